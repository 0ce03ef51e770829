"""Helpers for the service tests: real servers (front in a thread, worker in a spawned process)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

from qil_worker.engine.config import EngineConfig
from qil_worker.service.front.front import FrontConfig
from qil_worker.service.protocol import WorkerConfig
from qil_worker.service.front.server import ServeConfig, ServerThread

ENGINE = dict(num_pages=512, page_size=16, token_budget=256, prefill_chunk=64, max_active=48)
# The tiny test model with room for long requests (cancellation tests need them to run a while).
MAX_POSITIONS = 16384
POOL_TOKENS = ENGINE["num_pages"] * ENGINE["page_size"]  # 8192
# Channel options for a reader slower than the worker: a small HTTP/2 window, so the server's
# writes to a call whose client does not read block early.
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 2048)]


def make_service_checkpoint(path: Path) -> Path:
    from checkpoints import make_checkpoint

    return make_checkpoint(path, seed=0, max_position_embeddings=MAX_POSITIONS)


def start_server(model_dir: Path | str | None, engine: dict | None = None, **kw: Any) -> ServerThread:
    """A real server in this process (its worker spawned) on 127.0.0.1, a free port; ``engine``:
    ``EngineConfig`` fields; ``kw``: fields of ``WorkerConfig``, ``FrontConfig`` or ``ServeConfig``."""
    worker_kw = {k: kw.pop(k) for k in list(kw) if k in WorkerConfig.__dataclass_fields__}
    front_kw = {k: kw.pop(k) for k in list(kw) if k in FrontConfig.__dataclass_fields__}
    worker = WorkerConfig(
        model=str(model_dir) if model_dir else None, engine=EngineConfig(**(engine or ENGINE)),
        **{"threads": 1, **worker_kw},
    )
    front = FrontConfig(worker=worker, **front_kw)
    return ServerThread(ServeConfig(**{"host": "127.0.0.1", "port": 0, **kw}, front=front)).start()


def wait_until(predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, float]:
    """``/metrics`` as {'name{labels}': value} (labels exactly as exposed)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        out[key] = float(value)
    return out


def spy_on(obj: Any, name: str) -> list[tuple]:
    """Record the positional arguments of every call of ``obj.<name>`` (this object only) in the
    list returned; the calls go on as before. Tests wait on it to know that a call has reached,
    say, the front of an in-thread server (``srv.server.front``)."""
    calls: list[tuple] = []
    method = getattr(obj, name)

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return method(*args, **kwargs)

    setattr(obj, name, spy)
    return calls


def reference_outputs(model_dir: Path, prompts: list[list[int]], max_new_tokens: int,
                      engine: dict | None = None) -> list[list[int]]:
    """What the in-process Engine gives for the same requests (all submitted together)."""
    from qil_worker.engine import Engine
    from qil_worker.model import Qwen3

    eng = Engine(Qwen3.from_directory(model_dir), **dict(engine or ENGINE))
    ids = [eng.submit(p, max_new_tokens=max_new_tokens) for p in prompts]
    while not eng.idle:
        eng.step()
    out = [eng.result(i).output_token_ids for i in ids]
    eng.close()
    return out


def serve_process(*args: str, env: dict | None = None) -> tuple[subprocess.Popen, str, list[str]]:
    """``python -m qil_worker serve --port 0 --threads 1 ARGS`` as its own process.

    Returns the process, its target and the list its stderr lines keep arriving in. For tests
    that need the real process tree (RSS, signals, the CLI); most tests use ``start_server``.
    Both pipes are drained by threads, so a chatty server never blocks on a full pipe.
    """
    if env is None:
        env = {k: v for k, v in os.environ.items() if k != "QIL_AUTH_TOKEN"}
    env = dict(env, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "qil_worker", "serve", "--port", "0", "--threads", "1", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    out: list[str] = []
    err: list[str] = []
    proc.output_readers = [  # type: ignore[attr-defined]  # for join_output
        threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True),
        threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True),
    ]
    for reader in proc.output_readers:
        reader.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for line in list(out):
            if line.startswith("qil serving on "):
                proc.announcement = line  # type: ignore[attr-defined]  # e.g. its "(HTTP on ...)"
                return proc, line.split()[3], err
        if proc.poll() is not None:
            join_output(proc)
            raise AssertionError(f"server exited ({proc.returncode}):\n" + "".join(err)[-3000:])
        time.sleep(0.05)  # poll interval
    proc.kill()
    raise AssertionError("server did not start:\n" + "".join(err)[-3000:])


def join_output(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """Wait until a ``serve_process`` that has exited has had both pipes read to their end, so
    its lists hold every line it wrote."""
    for reader in proc.output_readers:  # type: ignore[attr-defined]
        reader.join(timeout)
        assert not reader.is_alive(), "the process's output did not end"


def stop_server_process(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it does not exit in time."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def start_http_server(model_dir: Path | str | None, engine: dict | None = None, **kw: Any) -> ServerThread:
    """``start_server`` with the OpenAI-compatible HTTP API on a free port too
    (``srv.http_port``; ``http_base_url(srv)`` for an OpenAI client)."""
    return start_server(model_dir, engine, http_port=0, **kw)


def http_base_url(srv: ServerThread) -> str:
    return f"http://127.0.0.1:{srv.http_port}/v1"


def openai_client(srv: ServerThread, api_key: str = "unused", **kw: Any):
    """The official ``openai`` client on the server's HTTP front (no retries: a test sees the
    first answer); use it as a context manager."""
    import openai

    return openai.OpenAI(base_url=http_base_url(srv), api_key=api_key, max_retries=0, **kw)


def rss(pid: int) -> int:
    """The resident memory of process ``pid`` in bytes."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
