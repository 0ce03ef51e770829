"""Bearer-token auth, --max-queued, TLS, and one client target over two servers (round robin)."""

from __future__ import annotations

import shutil
import subprocess

import grpc
import pytest

from qil_client import TLS, Client, ResourceExhausted, Unauthenticated, Unavailable
from service_fixtures import make_service_checkpoint, start_server, wait_until

TOKEN = "s3cret-token"
SMALL = dict(num_pages=1024, page_size=16, token_budget=128, prefill_chunk=64, max_active=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_service_checkpoint(tmp_path_factory.mktemp("svc-auth-model"))


@pytest.fixture(scope="module")
def servers(model_dir):
    a = start_server(model_dir, engine=SMALL, auth_token=TOKEN, max_queued=1)
    b = start_server(model_dir, engine=SMALL, auth_token=TOKEN, max_queued=1)
    yield a, b
    a.stop()
    b.stop()


def test_every_rpc_but_health_needs_the_token(servers):
    a, _ = servers
    for token in (None, "wrong"):
        with Client(a.target, token=token, timeout=10) as c:
            assert c.health() == "SERVING"  # health needs no token
            for call in (
                lambda: c.submit([1, 2]),
                lambda: c.cancel("x"),
                c.info,
                lambda: c.generate([1, 2], max_new_tokens=2),
                lambda: list(c.events("x")),
            ):
                with pytest.raises(Unauthenticated):
                    call()
    with grpc.insecure_channel(a.target) as ch:  # reflection is protected too
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        with pytest.raises(grpc.RpcError) as exc:
            list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with Client(a.target, token=TOKEN, timeout=30) as c:
        assert c.generate([1, 2], max_new_tokens=3).finish_reason == "length"


def test_max_queued_gives_resource_exhausted(servers):
    a, _ = servers
    with Client(a.target, token=TOKEN, timeout=30) as c:
        limit = c.info().limits
        admitted = [c.submit([1, 2, i], max_new_tokens=6000) for i in range(limit.max_active + limit.max_queued)]
        with pytest.raises(ResourceExhausted):
            c.submit([1, 2, 3], max_new_tokens=2)
        assert all(c.cancel(*admitted).values())
        wait_until(lambda: c.info().num_unfinished == 0)
        assert c.generate([1], max_new_tokens=2).finish_reason == "length"


def test_one_target_over_two_servers_round_robin(servers):
    a, b = servers
    before = {}
    for s in servers:
        with Client(s.target, token=TOKEN) as c:
            before[s.port] = c.info().num_requests_total
    with Client([a.target, b.target], token=TOKEN, timeout=30) as c:
        for i in range(12):
            assert c.generate([i + 1, 2], max_new_tokens=2).num_output_tokens == 2
    for s in servers:
        with Client(s.target, token=TOKEN) as c:
            assert c.info().num_requests_total - before[s.port] >= 3  # both got traffic


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls(model_dir, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True,
    )
    srv = start_server(model_dir, engine=SMALL, tls_cert=str(cert), tls_key=str(key))
    try:
        with Client(srv.target, tls=TLS(root_certificates=str(cert)), timeout=30) as c:
            assert c.generate([1, 2], max_new_tokens=2).finish_reason == "length"
        with Client(srv.target, timeout=5) as plain:  # plaintext to a TLS port fails
            with pytest.raises(Unavailable):
                plain.info()
    finally:
        srv.stop()
