"""gRPC server reflection under both of its names: ``grpc.reflection.v1`` (what current grpcurl
and Postman ask first) and ``grpc.reflection.v1alpha``.

grpcio-reflection implements v1alpha only. The v1 protocol is the same messages in another
package, identical on the wire, so v1 is served by the same servicer under the v1 service name,
and the v1 descriptors (v1alpha's, renamed) join the pool so that v1 can describe itself.
"""

from __future__ import annotations

from typing import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2
from grpc_reflection.v1alpha import reflection_pb2_grpc as v1alpha_grpc
from grpc_reflection.v1alpha.reflection import aio as reflection_aio

V1ALPHA_PACKAGE = "grpc.reflection.v1alpha"
V1_PACKAGE = "grpc.reflection.v1"
V1ALPHA_SERVICE = f"{V1ALPHA_PACKAGE}.ServerReflection"
V1_SERVICE = f"{V1_PACKAGE}.ServerReflection"
SERVICE_NAMES = (V1_SERVICE, V1ALPHA_SERVICE)
V1_FILE = "grpc/reflection/v1/reflection.proto"


def _add_v1_descriptors(pool: descriptor_pool.DescriptorPool) -> None:
    """v1alpha's file with its package renamed, unless the pool already has a v1 file (a newer
    grpcio-reflection, or a second server in this process)."""
    try:
        pool.FindFileContainingSymbol(V1_SERVICE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    v1alpha_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name = V1_FILE
    proto.package = V1_PACKAGE
    old, new = f".{V1ALPHA_PACKAGE}.", f".{V1_PACKAGE}."
    for message in proto.message_type:  # type names are fully qualified, with a leading dot
        for f in message.field:
            if f.type_name.startswith(old):
                f.type_name = new + f.type_name[len(old):]
    for service in proto.service:
        for method in service.method:
            method.input_type = new + method.input_type[len(old):]
            method.output_type = new + method.output_type[len(old):]
    proto.ClearField("options")  # v1alpha's java package and the like
    pool.AddSerializedFile(proto.SerializeToString())


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Reflection of ``service_names`` and of itself, under both protocol versions."""
    pool = descriptor_pool.Default()  # where the generated modules put qil's and health's files
    _add_v1_descriptors(pool)
    servicer = reflection_aio.ReflectionServicer((*service_names, *SERVICE_NAMES), pool=pool)
    v1alpha_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.method_handlers_generic_handler(V1_SERVICE, {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=v1alpha_pb2.ServerReflectionRequest.FromString,
            response_serializer=v1alpha_pb2.ServerReflectionResponse.SerializeToString,
        ),
    })
    server.add_generic_rpc_handlers((v1,))
