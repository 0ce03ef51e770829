"""Hostile inputs against a real server, over both fronts, as one table: what each is answered,
naming which field, how fast, what it leaves in the front's memory, and whether every request
ended and every KV page is free after it.

    python scripts/hostile_inputs.py [--model DIR]

Starts ``python -m qil_worker serve --http-port 0 --auth-token ...`` (the embedded demo model
unless ``--model``: a tokenizer and a chat template, 2048 positions) as its own process, then
sends each case once, one after another: gRPC calls through the client's stubs, HTTP bodies as
raw bytes (so that a lone surrogate or a deep nesting arrives as an attacker would send it), a
client trickling its headers and a flood of idle connections on raw sockets. A row's "idle" is
the server's own count after the case (no unfinished request, no KV page in use), waited for
up to 10 s. Prints the table (markdown) and exits 1 when a case was not refused as expected.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))

import grpc  # noqa: E402
import httpx  # noqa: E402

from qil_client import Client, pb  # noqa: E402
from qil_client._proto.qil.v1 import inference_pb2_grpc as pb_grpc  # noqa: E402
from service_fixtures import serve_process, stop_server_process  # noqa: E402

TOKEN = "hostile-run"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
HEADERS = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
MAX_CONNECTIONS = 16  # the run's --http-max-connections, so that a flood of twice that is quick
HEADER_TIMEOUT_S = 3.0  # the run's --http-header-timeout


@dataclass
class Row:
    front: str
    case: str
    expected: str  # the status and field the case must get
    got: str = ""
    field: str = ""
    ms: float = 0.0
    rss_mib: float = 0.0
    idle: str = ""

    @property
    def ok(self) -> bool:
        return self.got == self.expected.split(" ")[0] and (
            " " not in self.expected or self.field == self.expected.split(" ", 1)[1])


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def grpc_case(stub, call: str, request) -> tuple[str, str]:
    """(status name, field) of one gRPC call."""
    try:
        answer = getattr(stub, call)(request, metadata=AUTH, timeout=60)
        if call == "Generate":
            for _ in answer:
                pass
        return "OK", ""
    except grpc.RpcError as err:
        field = dict(err.trailing_metadata() or ()).get("qil-field", "")
        return err.code().name, field


def http_case(base: str, path: str, body: str | bytes, headers: dict | None = None) -> tuple[str, str]:
    content = body if isinstance(body, bytes) else body.encode()
    resp = httpx.post(f"{base}{path}", content=content, headers=headers or HEADERS, timeout=60)
    if resp.status_code == 200:
        return "200", ""
    try:
        error = resp.json()["error"]
    except (ValueError, KeyError):
        return str(resp.status_code), ""
    field = error.get("param") or ""
    if field and not error["message"].startswith(f"{field}: "):
        field += " (not in the message)"
    if resp.status_code == 401 and not resp.headers.get("WWW-Authenticate", "").startswith("Bearer"):
        field = "(no WWW-Authenticate)"
    return str(resp.status_code), field


def raw(value: object) -> str:
    return json.dumps(value, ensure_ascii=True)  # a lone surrogate goes out as its \\ud800 escape


def slow_headers(host: str, port: int) -> tuple[str, str]:
    """A client sending its request head a byte a second: how long until the server closes it."""
    t0 = time.monotonic()
    with socket.create_connection((host, port), timeout=HEADER_TIMEOUT_S + 10) as s:
        try:
            for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 60:
                s.sendall(bytes([byte]))
                s.settimeout(1.0)
                try:
                    if s.recv(1) == b"":
                        break
                except socket.timeout:
                    continue
        except (ConnectionResetError, BrokenPipeError):
            pass
    took = time.monotonic() - t0
    return ("closed", f"after {took:.1f}s") if took < HEADER_TIMEOUT_S + 3 else ("held", f"{took:.1f}s")


def idle_flood(host: str, port: int, base: str) -> tuple[str, str]:
    """Twice the cap of connections that send nothing: how many got the 503, and whether
    /health answered once their header timeout passed."""
    socks = [socket.create_connection((host, port), timeout=10) for _ in range(2 * MAX_CONNECTIONS)]
    refused = 0
    for s in socks:
        s.settimeout(0.5)
        try:
            refused += s.recv(64).startswith(b"HTTP/1.1 503")
        except socket.timeout:
            pass
    deadline = time.monotonic() + HEADER_TIMEOUT_S + 10
    served = False
    while time.monotonic() < deadline and not served:
        try:
            served = httpx.get(f"{base}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            pass
        time.sleep(0.2)  # (polling the server's answer)
    for s in socks:
        s.close()
    return ("503" if refused == MAX_CONNECTIONS else f"{refused} refused"), (
        f"{refused} of {2 * MAX_CONNECTIONS} refused; health {'served' if served else 'NOT served'} after")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a model directory (default: the demo model)")
    args = ap.parse_args()
    env = dict(os.environ, QIL_AUTH_TOKEN=TOKEN)
    flags = ["--http-port", "0", "--http-max-connections", str(MAX_CONNECTIONS),
             "--http-header-timeout", str(HEADER_TIMEOUT_S)] + (["--model", args.model] if args.model else [])
    proc, target, _ = serve_process(*flags, env=env)
    http = proc.announcement.split("(HTTP on ", 1)[1].split(")")[0]
    host, port = http.rsplit(":", 1)
    base = f"http://{http}"
    channel = grpc.insecure_channel(target)
    stub = pb_grpc.InferenceStub(channel)
    client = Client(target, token=TOKEN)
    positions = client.info().model.max_position_embeddings
    big_text = "word " * (15 * 2**20 // 5)
    schema: dict = {"type": "string"}
    for _ in range(300):
        schema = {"type": "object", "properties": {"a": schema}}
    chat = [{"role": "user", "content": "hello"}]
    S = pb.SubmitRequest
    cases: list[tuple[str, str, str, Callable[[], tuple[str, str]]]] = [
        ("gRPC", "Generate n=4294967295", "INVALID_ARGUMENT n",
         lambda: grpc_case(stub, "Generate", S(token_ids=[5], max_new_tokens=2, n=4294967295))),
        ("gRPC", "Submit n=4294967295", "INVALID_ARGUMENT n",
         lambda: grpc_case(stub, "Submit", S(token_ids=[5], max_new_tokens=2, n=4294967295))),
        ("gRPC", "n=1000000", "INVALID_ARGUMENT n",
         lambda: grpc_case(stub, "Generate", S(token_ids=[5], max_new_tokens=2, n=1_000_000))),
        ("gRPC", "top_logprobs=4294967295", "INVALID_ARGUMENT top_logprobs",
         lambda: grpc_case(stub, "Generate", S(token_ids=[5], logprobs=True, top_logprobs=4294967295))),
        ("gRPC", "prompt_logprobs=4294967295", "INVALID_ARGUMENT prompt_logprobs",
         lambda: grpc_case(stub, "Generate", S(token_ids=[5], prompt_logprobs=4294967295))),
        ("gRPC", "logit_bias of 301 ids", "INVALID_ARGUMENT logit_bias",
         lambda: grpc_case(stub, "Generate", S(token_ids=[5], logit_bias={i: 1.0 for i in range(301)}))),
        ("gRPC", "17 stop strings", "INVALID_ARGUMENT stop_strings",
         lambda: grpc_case(stub, "Generate", S(token_ids=[5], stop_strings=["x"] * 17))),
        ("gRPC", "1025 choices", "INVALID_ARGUMENT choice",
         lambda: grpc_case(stub, "Generate", S(token_ids=[5], choice=pb.Choices(choices=[str(i) for i in range(1025)])))),
        ("gRPC", "token id past the vocabulary", "INVALID_ARGUMENT token_ids",
         lambda: grpc_case(stub, "Generate", S(token_ids=[10**9]))),
        ("gRPC", "temperature NaN", "INVALID_ARGUMENT temperature",
         lambda: grpc_case(stub, "Generate", S(token_ids=[5], temperature=float("nan")))),
        ("gRPC", f"prompt of {positions + 1} ids", "INVALID_ARGUMENT token_ids",
         lambda: grpc_case(stub, "Generate", S(token_ids=[5] * (positions + 1), max_new_tokens=4))),
        ("gRPC", "15 MiB text prompt", "INVALID_ARGUMENT text",
         lambda: grpc_case(stub, "Generate", S(text=big_text, max_new_tokens=2))),
        ("gRPC", "Tokenize 15 MiB text", "INVALID_ARGUMENT text",
         lambda: grpc_case(stub, "Tokenize", pb.TokenizeRequest(text=big_text))),
        ("gRPC", "json_schema 600 levels deep", "INVALID_ARGUMENT json_schema",
         lambda: grpc_case(stub, "Generate", S(text="hi", max_new_tokens=2, json_schema=json.dumps(schema)))),
        ("gRPC", "self-recursive $ref", "INVALID_ARGUMENT json_schema",
         lambda: grpc_case(stub, "Generate", S(text="hi", max_new_tokens=2, json_schema='{"$ref": "#"}'))),
        ("HTTP", "body nested 300 levels", "400 x",
         lambda: http_case(base, "/v1/completions", '{"prompt": "hi", "x": ' + "[" * 300 + "]" * 300 + "}")),
        ("HTTP", "body nested 980 levels", "400 body",
         lambda: http_case(base, "/v1/completions", '{"prompt": "hi", "x": ' + "[" * 980 + "]" * 980 + "}")),
        ("HTTP", "response_format 600 levels deep", "400 response_format",
         lambda: http_case(base, "/v1/chat/completions", raw({"messages": chat, "max_tokens": 2, "response_format": {
             "type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}))),
        ("HTTP", "lone surrogate in prompt", "400 prompt",
         lambda: http_case(base, "/v1/completions", raw({"prompt": "ab\ud800cd", "max_tokens": 2}))),
        ("HTTP", "lone surrogate in a message", "400 messages",
         lambda: http_case(base, "/v1/chat/completions", raw({"messages": [{"role": "user", "content": "a\udfff"}]}))),
        ("HTTP", "n=1000000000", "400 n",
         lambda: http_case(base, "/v1/completions", raw({"prompt": "hi", "n": 10**9}))),
        ("HTTP", "temperature -1", "400 temperature",
         lambda: http_case(base, "/v1/completions", raw({"prompt": "hi", "temperature": -1}))),
        ("HTTP", "legacy functions", "400 functions",
         lambda: http_case(base, "/v1/chat/completions", raw({"messages": chat, "functions": [{"name": "f"}]}))),
        ("HTTP", "10k tools", "400 tools",
         lambda: http_case(base, "/v1/chat/completions", raw({"messages": chat, "tools": [
             {"type": "function", "function": {"name": f"f{i}"}} for i in range(10_000)]}))),
        ("HTTP", "a tool schema 600 levels deep", "400 tools",
         lambda: http_case(base, "/v1/chat/completions", raw({"messages": chat, "tools": [
             {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "x": schema}}}]}))),
        ("HTTP", f"prompt of {positions + 1} ids, max_tokens 4", "400 prompt",
         lambda: http_case(base, "/v1/completions", raw({"prompt": [5] * (positions + 1), "max_tokens": 4}))),
        ("HTTP", "10k chat messages, max_tokens 4", "400 messages",
         lambda: http_case(base, "/v1/chat/completions", raw({"messages": chat * 10_000, "max_tokens": 4}))),
        ("HTTP", "max_tokens past the context", "400 max_tokens",
         lambda: http_case(base, "/v1/chat/completions", raw({"messages": chat, "max_tokens": positions}))),
        ("HTTP", "self-recursive $ref", "400 response_format",
         lambda: http_case(base, "/v1/chat/completions", raw({"messages": chat, "max_tokens": 2, "response_format": {
             "type": "json_schema", "json_schema": {"name": "s", "schema": {"$ref": "#"}}}}))),
        ("HTTP", "17 MiB body", "413",
         lambda: http_case(base, "/v1/completions", b'{"prompt": "' + b"x" * (17 * 2**20) + b'"}')),
        ("HTTP", "/tokenize 15 MiB text", "400 prompt",
         lambda: http_case(base, "/tokenize", raw({"prompt": big_text}))),
        ("HTTP", "no bearer token", "401",
         lambda: http_case(base, "/v1/completions", raw({"prompt": "hi"}), {"Content-Type": "application/json"})),
        ("HTTP", "empty prompt", "200",
         lambda: http_case(base, "/v1/completions", raw({"prompt": "", "max_tokens": 2}))),
        ("HTTP", "developer role", "200",
         lambda: http_case(base, "/v1/chat/completions", raw({"messages": [{"role": "developer", "content": "x"}] + chat,
                                                                "max_tokens": 2}))),
        ("HTTP", "headers a byte a second", "closed", lambda: slow_headers(host, int(port))),
        ("HTTP", f"{2 * MAX_CONNECTIONS} idle connections, cap {MAX_CONNECTIONS}", "503",
         lambda: idle_flood(host, int(port), base)),
    ]
    rows = []
    try:
        for front, case, expected, run in cases:
            before = rss_mib(proc.pid)
            t0 = time.perf_counter()
            got, field = run()
            row = Row(front, case, expected, got, field, (time.perf_counter() - t0) * 1e3, rss_mib(proc.pid) - before)
            deadline = time.monotonic() + 10
            while True:
                info = client.info()
                if (info.num_unfinished, info.pages.used) == (0, 0) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)  # (polling the server's count)
            row.idle = "yes" if (info.num_unfinished, info.pages.used) == (0, 0) else \
                f"NO: {info.num_unfinished} unfinished, {info.pages.used} pages"
            rows.append(row)
    finally:
        channel.close()
        client.close()
        stop_server_process(proc)
    print(f"hostile inputs against {'the demo model' if not args.model else args.model} "
          f"({positions} positions); load {os.getloadavg()[0]:.2f}")
    print("| front | case | answer | field | ms | front RSS Δ MiB | idle after | as expected |")
    print("|---|---|---|---|---:|---:|---|---|")
    for r in rows:
        print(f"| {r.front} | {r.case} | {r.got} | {r.field} | {r.ms:.0f} | {r.rss_mib:+.1f} | {r.idle} | "
              f"{'yes' if r.ok and r.idle == 'yes' else 'NO'} |")
    sys.exit(0 if all(r.ok and r.idle == "yes" for r in rows) else 1)


if __name__ == "__main__":
    main()
