"""Helpers for the service tests: real servers (front in a thread, worker in a spawned process)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
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
    return ServerThread(ServeConfig(host="127.0.0.1", port=0, front=front, **kw)).start()


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


def start_server_process(model_dir: Path, log_path: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    """``python -m qil_worker serve`` as its own process on a free port → (process, target).

    For tests that need the real process tree (RSS, signals); most tests use ``start_server``.
    """
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("QIL_AUTH_TOKEN", None)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "qil_worker", "serve", "--model", str(model_dir), "--host",
             "127.0.0.1", "--port", "0", "--threads", "1", "--log-level", "WARNING", *extra],
            stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=Path(__file__).resolve().parents[1],
        )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        for line in list(lines):
            if line.startswith("qil serving on "):
                return proc, line.split()[3]
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("server did not start:\n" + Path(log_path).read_text()[-3000:])


def stop_server_process(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
