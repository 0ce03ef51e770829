"""Shared fixtures: small random Qwen3 checkpoints made once per test session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# The shared helpers (checkpoints, engine and service fixtures) import by their plain names.
sys.path.insert(0, str(Path(__file__).parent / "helpers"))

from checkpoints import make_checkpoint  # noqa: E402

# Tiny models gain nothing from threads, and OpenMP barriers crawl when the cores are shared
# with worker subprocesses: a tiny model's step is mostly synchronisation between threads, and
# under load that costs far more than its compute.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def device() -> str:
    """Where qil's model runs in the engine tests: ``QIL_TEST_DEVICE`` (default cpu).

    The transformers reference always runs on the CPU in float32.
    """
    return os.environ.get("QIL_TEST_DEVICE", "cpu")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """Tied head, GQA group of 2, single safetensors file."""
    return make_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="session")
def tiny_untied_sharded_dir(tmp_path_factory) -> Path:
    """Untied head, several shards with an index."""
    return make_checkpoint(
        tmp_path_factory.mktemp("sharded"), seed=1, tie_word_embeddings=False, max_shard_size="30KB"
    )


@pytest.fixture(scope="session")
def model(tiny_dir, device):
    """qil's float32 model of ``tiny_dir`` on the test device (modules may define their own)."""
    from qil_worker import Qwen3

    return Qwen3.from_directory(tiny_dir, device=device, dtype="float32")


@pytest.fixture(scope="session")
def ref(tiny_dir):
    """transformers' float32 model of ``tiny_dir`` on the CPU: the correctness oracle."""
    from checkpoints import load_reference

    return load_reference(tiny_dir)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """The service tests' checkpoint (``service_fixtures.make_service_checkpoint``), built once;
    tests that change a model directory copy it first."""
    from service_fixtures import make_service_checkpoint

    return make_service_checkpoint(tmp_path_factory.mktemp("service-model"))


@pytest.fixture(scope="module")
def server(model_dir):
    """A real server (front and worker process) on ``model_dir``, one per module; modules that
    need other flags define their own."""
    from service_fixtures import start_server

    srv = start_server(model_dir)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    """A client of the requesting module's ``server`` fixture (a real server, service tests)."""
    from qil_client import Client

    with Client(server.target, timeout=60) as c:
        yield c
