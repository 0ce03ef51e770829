"""``serve --tensor-parallel-size 2`` as a real server: the worker and the rank it spawns give
the single-device engine's tokens; SIGKILL of that rank mid-stream ends the stream with an
in-band error and the supervisor replaces the whole group (a new worker, a new rank). A headless
embedding checkpoint is served sharded: Embed answers as transformers' pooling; a causal LM with
a tokenizer answers Rerank and ``/v1/rerank`` with transformers' P(yes), in TP 1's order. Two
``serve`` processes stand in for two nodes (``--nnodes 2``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
import torch.nn.functional as F
from qil_client import Client, QilError

from checkpoints import load_reference, make_headless_checkpoint, make_judge_checkpoint
from service_fixtures import (
    free_port, http_base_url, make_service_checkpoint, reference_outputs, serve_process, start_http_server,
    start_server, wait_until,
)

ROOT = Path(__file__).resolve().parents[2]
ENGINE = dict(num_pages=256, page_size=16, token_budget=128, prefill_chunk=64, max_active=8)
PROMPTS = [[1, 2, 3], [7, 8, 9, 10, 11], [40, 41]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_service_checkpoint(tmp_path_factory.mktemp("tp-service"))


@pytest.fixture(scope="module")
def headless_dir(tmp_path_factory):
    return make_headless_checkpoint(tmp_path_factory.mktemp("tp-headless") / "m")


def _children(pid: int) -> list[int]:
    """The live child processes of ``pid``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid and fields[0] != "Z":
                    found.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return found


def test_tp2_server_gives_tp1_tokens_and_survives_a_killed_rank(model_dir):
    expected = reference_outputs(model_dir, PROMPTS, 12, engine=ENGINE)
    with start_server(model_dir, engine=ENGINE, tensor_parallel_size=2, restart_backoff_s=0.2) as srv:
        with Client(srv.target, timeout=120) as c:
            assert [list(c.generate(p, max_new_tokens=12).token_ids) for p in PROMPTS] == expected
            worker = c.info().worker.pid
            (rank1,) = [p for p in _children(worker) if _comm(p) != "resource_tracker"]
            stream = c.stream([1, 2, 3], max_new_tokens=4000)
            assert next(stream).token_ids
            os.kill(rank1, signal.SIGKILL)
            events = list(stream)  # the request ends in-band, as on a lost device
            assert events and "tensor-parallel group failed" in events[-1].error
            wait_until(lambda: _serving_again(c, worker), timeout=120, interval=0.2)
            info = c.info()
            assert info.worker.restarts == 1 and info.pages.used == 0
            assert [list(c.generate(p, max_new_tokens=12).token_ids) for p in PROMPTS] == expected
            assert len([p for p in _children(info.worker.pid) if _comm(p) != "resource_tracker"]) == 1


def test_tp2_server_sizes_its_pool_from_a_byte_budget_on_every_rank(model_dir):
    """``--kv-memory-bytes`` at TP 2: each rank sizes the pool for its own heads' pages and all
    take the fewest; rank 0's pages are its shard's, and generation runs on the agreed pool."""
    expected = reference_outputs(model_dir, PROMPTS, 12, engine=ENGINE)
    budget = 3 << 20
    engine = {k: v for k, v in ENGINE.items() if k != "num_pages"}
    with start_server(model_dir, engine=engine, tensor_parallel_size=2, kv_memory_bytes=budget) as srv:
        with Client(srv.target, timeout=120) as c:
            pages = c.info().pages
            single = start_server(model_dir, engine=engine, kv_memory_bytes=budget)
            with single, Client(single.target, timeout=120) as one:
                whole = one.info().pages
            assert pages.page_bytes * 2 == whole.page_bytes  # each rank holds half the KV heads
            assert pages.total == budget // pages.page_bytes == 2 * whole.total
            assert [list(c.generate(p, max_new_tokens=12).token_ids) for p in PROMPTS] == expected
            wait_until(lambda: _idle(c), timeout=30)


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return "resource_tracker" if "resource_tracker" in f.read() else "rank"
    except OSError:
        return "gone"


def _serving_again(c: Client, old_pid: int) -> bool:
    try:
        return c.health() == "SERVING" and c.info().worker.pid not in (0, old_pid)
    except QilError:
        return False


def test_tp2_server_embeds_with_a_headless_checkpoint_and_tells_its_ranks(headless_dir):
    """Every rank loads the checkpoint without a head (the resolved task reaches them); GetInfo
    and ``qil_client info`` tell the ranks, the node and the weights per rank."""
    from transformers import Qwen3Model

    from qil_worker import Qwen3

    reference = Qwen3Model.from_pretrained(headless_dir).eval()
    whole = Qwen3.from_directory(headless_dir, embedding=True).weight_summary()[1]
    prompts = [[5, 6, 7, 8], [9], list(range(1, 40))]
    with start_server(headless_dir, engine=ENGINE, tensor_parallel_size=2, use_tokenizer=False) as srv:
        with Client(srv.target, timeout=120) as c:
            model = c.info().model
            assert model.task == "embed"
            assert (model.tensor_parallel_size, model.nnodes) == (2, 1)
            # each rank a shard (norms and vocabulary padding aside); both together at least the whole
            assert model.rank_weight_bytes < whole * 0.75 and whole <= model.weight_bytes <= 2 * model.rank_weight_bytes
            shown = json.loads(subprocess.run([sys.executable, "-m", "qil_client", "--target", srv.target, "info"],
                                              capture_output=True, text=True, check=True, timeout=60, cwd=ROOT).stdout)
            assert {k: shown["model"][k] for k in ("tensor_parallel_size", "nnodes", "rank_weight_bytes")} == {
                "tensor_parallel_size": 2, "nnodes": 1, "rank_weight_bytes": model.rank_weight_bytes}
            for vector, ids in zip(c.embed(prompts).vectors, prompts):
                with torch.no_grad():
                    want = F.normalize(reference(torch.tensor([ids])).last_hidden_state[0, -1], dim=-1)
                assert F.cosine_similarity(torch.tensor(vector), want, dim=0).item() >= 0.99999
            wait_until(lambda: _idle(c), timeout=30)


def test_tp2_server_reranks_with_transformers_yes_probability_in_tp1s_order(tmp_path):
    """The yes/no tokens are the last of the vocabulary, so rank 1's block of the LM head holds
    them: each score reads logits gathered across the ranks. The rerank prompts are longer than
    a prefill chunk, so their first chunks run in steps with no logit row."""
    from transformers import AutoTokenizer

    from qil_worker import Engine, Qwen3
    from qil_worker.text.rerank_prompt import rerank_prompt

    judge = make_judge_checkpoint(tmp_path / "judge")
    ref, tok = load_reference(judge), AutoTokenizer.from_pretrained(judge)
    yes, no = tok.convert_tokens_to_ids(["yes", "no"])
    assert rank_of(yes, len(tok)) == rank_of(no, len(tok)) == 1
    query, docs = "where do cats sleep", ["on the mat", "in the box", "the dog barks", "cats sleep all day"]
    prompts = [tok(rerank_prompt(query, d), add_special_tokens=False)["input_ids"] for d in docs]
    assert min(map(len, prompts)) > ENGINE["prefill_chunk"]
    expected = []
    for ids in prompts:
        with torch.no_grad():
            logits = ref(torch.tensor([ids])).logits[0, -1]
        expected.append(torch.softmax(logits[[no, yes]], dim=-1)[1].item())
    tp1 = Engine(Qwen3.from_directory(judge, dtype="float32"), **ENGINE)
    tp1_scores = tp1.score(prompts, yes, no)
    tp1_order = sorted(range(len(docs)), key=lambda i: -tp1_scores[i])
    tp1.close()
    assert tp1_order == sorted(range(len(docs)), key=lambda i: -expected[i])
    with start_http_server(judge, engine=ENGINE, tensor_parallel_size=2) as srv:
        with Client(srv.target, timeout=120) as c:
            assert c.info().model.tensor_parallel_size == 2
            ranked = c.rerank(query, docs)
            assert [r.index for r in ranked] == tp1_order
            for r in ranked:
                assert r.relevance_score == pytest.approx(expected[r.index], abs=1e-5)
            reply = httpx.post(f"{http_base_url(srv)}/rerank", timeout=120, json={"query": query, "documents": docs})
            assert reply.status_code == 200, reply.text
            results = reply.json()["results"]
            assert [r["index"] for r in results] == tp1_order
            assert [r["relevance_score"] for r in results] == [pytest.approx(expected[i], abs=1e-5) for i in tp1_order]
            wait_until(lambda: _idle(c), timeout=30)


def rank_of(token: int, vocab: int, world_size: int = 2) -> int:
    """The rank whose block of the vocabulary holds ``token``."""
    from qil_worker.parallel.shards import vocab_block

    return token // vocab_block(vocab, world_size)


def _idle(c: Client) -> bool:
    info = c.info()
    return info.num_unfinished == 0 and info.pages.used == 0


def test_two_serve_processes_as_two_nodes_give_tp1_tokens_and_rejoin_after_a_lost_rank(model_dir):
    """Node 1 runs rank 1 only; node 0 serves, with rank 0 in its worker. Killing node 1's rank
    mid-stream fails the group: node 0's supervisor replaces its worker, node 1 starts its rank
    again, and the new group gives the same tokens. SIGTERM stops each node cleanly."""
    expected = reference_outputs(model_dir, PROMPTS, 12, engine=ENGINE)
    nodes = ["--model", str(model_dir), "--tensor-parallel-size", "2", "--nnodes", "2",
             "--dist-init-addr", f"127.0.0.1:{free_port()}", "--num-pages", "256", "--page-size", "16",
             "--token-budget", "128", "--prefill-chunk", "64", "--max-active", "8"]
    node1 = subprocess.Popen(
        [sys.executable, "-m", "qil_worker", "serve", *nodes, "--node-rank", "1", "--threads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    node0 = None
    try:
        assert node1.stdout.readline().startswith("qil node 1 of 2: ranks 1..1 of 2, meeting at tcp://127.0.0.1:")
        node0, target, _ = serve_process(*nodes, "--node-rank", "0")
        with Client(target, timeout=120) as c:
            info = c.info()
            assert (info.model.tensor_parallel_size, info.model.nnodes) == (2, 2)
            assert [list(c.generate(p, max_new_tokens=12).token_ids) for p in PROMPTS] == expected
            (rank1,) = _children(node1.pid)
            # node 0 starts no rank of its own beside its worker's rank 0
            assert [p for p in _children(info.worker.pid) if _comm(p) != "resource_tracker"] == []
            stream = c.stream([1, 2, 3], max_new_tokens=4000)
            assert next(stream).token_ids
            os.kill(rank1, signal.SIGKILL)
            events = list(stream)
            assert events and "tensor-parallel group failed" in events[-1].error
            wait_until(lambda: _serving_again(c, info.worker.pid), timeout=180, interval=0.2)
            assert c.info().worker.restarts == 1
            assert [list(c.generate(p, max_new_tokens=12).token_ids) for p in PROMPTS] == expected
            assert len(_children(node1.pid)) == 1 and _children(node1.pid) != [rank1]
            wait_until(lambda: _idle(c), timeout=30)
        node0.send_signal(signal.SIGTERM)
        assert node0.wait(60) == 0
        rank = _children(node1.pid)
        node1.send_signal(signal.SIGTERM)
        assert node1.wait(60) == 0
        assert node1.stdout.read().strip().endswith("qil node 1 stopped")
        wait_until(lambda: all(_comm(p) == "gone" for p in rank), timeout=30)
    finally:
        for proc in (node0, node1):
            if proc is not None and proc.poll() is None:
                proc.kill()
