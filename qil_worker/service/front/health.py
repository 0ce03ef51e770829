"""grpc.health.v1: NOT_SERVING until the model is loaded and warm, and again while the worker
restarts or the server shuts down."""

from __future__ import annotations

from grpc_health.v1 import health, health_pb2, health_pb2_grpc

SERVICE_NAME = "qil.v1.Inference"


class Health:
    def __init__(self) -> None:
        self.servicer = health.aio.HealthServicer()
        self.serving = False

    def add_to_server(self, server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    async def set_serving(self, serving: bool) -> None:
        self.serving = serving
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", SERVICE_NAME):
            await self.servicer.set(name, status)

    async def shutdown(self) -> None:
        self.serving = False
        await self.servicer.enter_graceful_shutdown()
