"""Targets, credentials and channel options shared by the sync and asyncio clients."""

from __future__ import annotations

import ipaddress
import json
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import grpc

from qil_client._proto.qil.v1 import inference_pb2 as pb

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# Balancing over several servers: round_robin, skipping a server whose grpc.health.v1 status for
# the Inference service is not SERVING (loading, restarting its worker or draining), so calls go
# to the replicas that can take them instead of failing with UNAVAILABLE on the one that cannot.
INFERENCE_SERVICE = pb.DESCRIPTOR.services_by_name["Inference"].full_name
ROUND_ROBIN = json.dumps({
    "loadBalancingConfig": [{"round_robin": {}}],
    "healthCheckConfig": {"serviceName": INFERENCE_SERVICE},
})


@dataclass(frozen=True)
class TLS:
    """TLS settings; each field is PEM bytes or a path to a PEM file."""

    root_certificates: bytes | str | None = None
    private_key: bytes | str | None = None  # client certificate (mutual TLS)
    certificate_chain: bytes | str | None = None
    server_name: str | None = None  # override the name checked against the certificate


def _pem(value: bytes | str | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    return Path(value).read_bytes()


def _host_port(entry: str) -> tuple[str, str]:
    """``HOST:PORT`` or ``[IPv6]:PORT`` → (host, port); a ValueError naming the entry otherwise."""
    host, sep, port = entry.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not (sep and host and "[" not in host and "]" not in host
            and port.isascii() and port.isdigit() and int(port) <= 65535):
        raise ValueError(f"bad target {entry!r}: expected HOST:PORT")
    return host, port


def resolve_target(target: str | Sequence[str]) -> tuple[str, bool]:
    """→ (grpc target, use round_robin). A list of HOST:PORT becomes one ipv4:/ipv6: target, its
    names resolved now: a ValueError names an entry that is not HOST:PORT or does not resolve."""
    if isinstance(target, str):
        if "," in target and "://" not in target and not target.startswith(("ipv4:", "ipv6:")):
            return resolve_target([t.strip() for t in target.split(",") if t.strip()])
        return target, target.startswith(("dns:", "ipv4:", "ipv6:"))
    targets = list(target)
    if not targets:
        raise ValueError("no target")
    if len(targets) == 1:
        return targets[0], False
    v4, v6 = [], []
    for t in targets:
        host, port = _host_port(t)
        try:
            addrs = [ipaddress.ip_address(host)]
        except ValueError:
            try:
                infos = socket.getaddrinfo(host, int(port), proto=socket.IPPROTO_TCP)
            except OSError as err:
                raise ValueError(f"cannot resolve target {t!r}: {err}") from None
            addrs = [ipaddress.ip_address(info[4][0]) for info in infos][:1]
        for a in addrs:
            (v4 if a.version == 4 else v6).append(f"{a}:{port}" if a.version == 4 else f"[{a}]:{port}")
    if v4 and v6:
        raise ValueError("mix of IPv4 and IPv6 targets: use a dns:/// name instead")
    return ("ipv4:" + ",".join(v4)) if v4 else ("ipv6:" + ",".join(v6)), True


def channel_options(round_robin: bool, tls: TLS | None) -> list[tuple[str, object]]:
    opts: list[tuple[str, object]] = [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.enable_retries", 1),
    ]
    if round_robin:
        opts.append(("grpc.service_config", ROUND_ROBIN))
    if tls is not None and tls.server_name:
        opts.append(("grpc.ssl_target_name_override", tls.server_name))
    return opts


def credentials(tls: bool | TLS | None) -> grpc.ChannelCredentials | None:
    if not tls:
        return None
    if tls is True:
        return grpc.ssl_channel_credentials()
    return grpc.ssl_channel_credentials(
        root_certificates=_pem(tls.root_certificates),
        private_key=_pem(tls.private_key),
        certificate_chain=_pem(tls.certificate_chain),
    )


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {token}"),) if token else None
