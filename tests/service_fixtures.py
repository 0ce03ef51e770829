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

from qil_worker.service.front import FrontConfig
from qil_worker.service.server import ServeConfig, ServerThread

ENGINE = dict(num_pages=512, page_size=16, token_budget=256, prefill_chunk=64, max_active=48)
# The tiny test model with room for long requests (cancellation tests need them to run a while).
MAX_POSITIONS = 16384
POOL_TOKENS = ENGINE["num_pages"] * ENGINE["page_size"]  # 8192


def make_service_checkpoint(path: Path) -> Path:
    from checkpoints import make_checkpoint

    return make_checkpoint(path, seed=0, max_position_embeddings=MAX_POSITIONS)


def start_server(model_dir: Path | str | None, engine: dict | None = None, **kw: Any) -> ServerThread:
    front_kw = {k: kw.pop(k) for k in list(kw) if k in FrontConfig.__dataclass_fields__}
    front = FrontConfig(
        model=str(model_dir) if model_dir else None,
        engine=dict(engine or ENGINE),
        threads=1,
        **front_kw,
    )
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
        cwd=Path(__file__).resolve().parents[1],
    )
    out: list[str] = []
    err: list[str] = []
    threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True).start()
    threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True).start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for line in list(out):
            if line.startswith("qil serving on "):
                return proc, line.split()[3], err
        if proc.poll() is not None:
            time.sleep(0.2)  # let the reader threads take the last lines
            raise AssertionError(f"server exited ({proc.returncode}):\n" + "".join(err)[-3000:])
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("server did not start:\n" + "".join(err)[-3000:])


def stop_server_process(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it does not exit in time."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
