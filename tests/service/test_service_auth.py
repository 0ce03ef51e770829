"""Bearer-token auth (and reflection left open), --max-queued, TLS and mutual TLS, one client
target over two servers (round robin), and a ``dns:///`` target resolved by gRPC itself."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grpc
import pytest

from qil_client import TLS, Client, ResourceExhausted, Unauthenticated, Unavailable, pb
from qil_client._proto.qil.v1 import inference_pb2_grpc as pb_grpc
from qil_worker.service.front import limits
from service_fixtures import start_server, wait_until

TOKEN = "s3cret-token"
SMALL = dict(num_pages=1024, page_size=16, token_budget=128, prefill_chunk=64, max_active=2)


@pytest.fixture(scope="module")
def servers(model_dir):
    a = start_server(model_dir, engine=SMALL, auth_token=TOKEN, max_queued=1)
    b = start_server(model_dir, engine=SMALL, auth_token=TOKEN, max_queued=1, open_reflection=True)
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
    with grpc.insecure_channel(a.target) as ch:  # reflection is protected too, both versions
        for version in ("v1", "v1alpha"):
            with pytest.raises(grpc.RpcError) as exc:
                list_services(ch, version)
            assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED, version
    with Client(a.target, token=TOKEN, timeout=30) as c:
        assert c.generate([1, 2], max_new_tokens=3).finish_reason == "length"


def list_services(channel: grpc.Channel, version: str, metadata=None) -> set[str]:
    """A raw ServerReflectionInfo call of reflection ``version`` (v1 and v1alpha have the same
    messages on the wire): the services the server lists."""
    from grpc_reflection.v1alpha import reflection_pb2

    call = channel.stream_stream(
        f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    (resp,) = call(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), metadata=metadata, timeout=10)
    return {s.name for s in resp.list_services_response.service}


def get_info(target: str, metadata) -> None:
    """GetInfo with exactly this metadata (the client always sends its one header as 'Bearer')."""
    with grpc.insecure_channel(target) as ch:
        pb_grpc.InferenceStub(ch).GetInfo(pb.GetInfoRequest(), metadata=metadata, timeout=10)


def test_the_bearer_scheme_is_case_insensitive_and_the_token_exact(servers):
    a, _ = servers
    for value in (f"Bearer {TOKEN}", f"bearer {TOKEN}", f"BEARER {TOKEN}", f"bEaReR  {TOKEN}"):
        get_info(a.target, (("authorization", value),))
    for value in (f"Bearer {TOKEN.upper()}", f"Basic {TOKEN}", f"Bearer{TOKEN}", TOKEN,
                  "Bearer", f"Bearer {TOKEN[:-1]}"):
        with pytest.raises(grpc.RpcError) as exc:
            get_info(a.target, (("authorization", value),))
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED, value


@pytest.mark.parametrize("values", [(TOKEN, "wrong"), ("wrong", TOKEN), (TOKEN, TOKEN)])
def test_two_authorization_headers_are_refused(servers, values):
    """Not decided by whichever the server reads first."""
    a, _ = servers
    with pytest.raises(grpc.RpcError) as exc:
        get_info(a.target, tuple(("authorization", f"Bearer {v}") for v in values))
    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_open_reflection_answers_without_the_token_and_nothing_else_does(servers):
    _, b = servers  # started with open_reflection=True
    with grpc.insecure_channel(b.target) as ch:
        for version in ("v1", "v1alpha"):
            assert {"qil.v1.Inference", "grpc.health.v1.Health"} <= list_services(ch, version)
    with Client(b.target, timeout=10) as c:  # grpcurl's way to health: reflection, then Check
        assert c.health() == "SERVING"
        with pytest.raises(Unauthenticated):
            c.info()
    with Client(b.target, token=TOKEN, timeout=10) as c:
        assert c.info().limits.max_queued == 1


def test_serve_open_reflection_flag_reaches_the_config():
    import argparse

    from qil_worker.service.cli import add_serve_parser, config_from_args

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    assert config_from_args(parser.parse_args(["serve", "--open-reflection"])).open_reflection
    assert not config_from_args(parser.parse_args(["serve"])).open_reflection


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


def test_round_robin_skips_a_server_that_is_not_serving(servers):
    """A replica that reports NOT_SERVING (loading, restarting its worker, draining) gets no
    calls from a balancing client while another one serves."""
    a, b = servers
    with Client(b.target, token=TOKEN) as c:
        before_b = c.info().num_requests_total
    b.call(b.server.health.set_serving(False))
    try:
        with Client([a.target, b.target], token=TOKEN, timeout=30) as c:
            for i in range(8):
                assert c.generate([i + 1, 2], max_new_tokens=2).num_output_tokens == 2
    finally:
        b.call(b.server.health.set_serving(True))
    with Client(b.target, token=TOKEN) as c:
        assert c.info().num_requests_total == before_b


def test_server_connections_age_out_so_clients_find_new_replicas():
    options = dict(limits.SERVER_OPTIONS)
    assert 0 < options["grpc.max_connection_age_ms"] <= 30 * 60 * 1000
    assert options["grpc.max_connection_age_grace_ms"] >= 2**31 - 1  # streams in flight finish


def test_dns_target_is_resolved_by_grpc(servers):
    a, _ = servers
    # "localhost" may also resolve to ::1, where nothing listens: round robin uses the live address
    with Client(f"dns:///localhost:{a.port}", token=TOKEN, timeout=30) as c:
        assert c.health() == "SERVING"
        assert c.generate([4, 5], max_new_tokens=2).num_output_tokens == 2
    with Client("dns:///no-such-host.invalid:50051", token=TOKEN, timeout=5) as c:
        with pytest.raises(Unavailable):
            c.info()


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _authority(name: str, out: Path) -> tuple[Path, Path]:
    """A self-signed CA: (certificate, key)."""
    key, cert = out / f"{name}.key", out / f"{name}.pem"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-keyout", str(key), "-out", str(cert),
             "-subj", f"/CN={name}")
    return cert, key


def _issue(ca: tuple[Path, Path], name: str, out: Path, san: str | None = None) -> tuple[Path, Path]:
    """A key and a certificate for ``name`` signed by ``ca``: (key, certificate)."""
    key, csr, cert = out / f"{name}.key", out / f"{name}.csr", out / f"{name}.pem"
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")
    extra = []
    if san:
        (out / f"{name}.ext").write_text(f"subjectAltName={san}\n")
        extra = ["-extfile", str(out / f"{name}.ext")]
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
             "-days", "1", "-out", str(cert), *extra)
    return key, cert


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_mutual_tls_needs_a_client_certificate_from_the_trusted_ca(model_dir, tmp_path):
    ca, other_ca = _authority("qil-test-ca", tmp_path), _authority("other-ca", tmp_path)
    server_key, server_cert = _issue(ca, "localhost", tmp_path, san="DNS:localhost,IP:127.0.0.1")
    client_key, client_cert = _issue(ca, "client", tmp_path)
    stranger_key, stranger_cert = _issue(other_ca, "stranger", tmp_path)
    srv = start_server(model_dir, engine=SMALL, tls_cert=str(server_cert), tls_key=str(server_key),
                       tls_client_ca=str(ca[0]))
    try:
        trusted = TLS(root_certificates=str(ca[0]), private_key=str(client_key), certificate_chain=str(client_cert))
        with Client(srv.target, tls=trusted, timeout=30) as c:
            assert c.generate([1, 2], max_new_tokens=2).finish_reason == "length"
        for tls in (
            TLS(root_certificates=str(ca[0])),  # no client certificate
            TLS(root_certificates=str(ca[0]), private_key=str(stranger_key), certificate_chain=str(stranger_cert)),
        ):
            with Client(srv.target, tls=tls, timeout=10) as c:
                with pytest.raises(Unavailable):
                    c.info()
    finally:
        srv.stop()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls(model_dir, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True,
    )
    with start_server(model_dir, engine=SMALL, tls_cert=str(cert), tls_key=str(key)) as srv:
        with Client(srv.target, tls=TLS(root_certificates=str(cert)), timeout=30) as c:
            assert c.generate([1, 2], max_new_tokens=2).finish_reason == "length"
        with Client(srv.target, timeout=5) as plain:  # plaintext to a TLS port fails
            with pytest.raises(Unavailable):
                plain.info()


def test_a_token_that_only_starts_with_the_right_one_is_refused(model_dir):
    with start_server(model_dir, auth_token="s3cret") as srv:
        for bad in ("s3cret-and-more", "s3cre"):
            with Client(srv.target, token=bad, timeout=10) as c:
                with pytest.raises(Unauthenticated):
                    c.info()
        with Client(srv.target, token="s3cret", timeout=10) as c:
            c.info()
