"""CUDA-only checks (skipped without a GPU): the varlen flash-attention paths (paged, packed)."""

import random

import pytest
import torch

from qil_worker import Engine, Qwen3
from qil_worker.engine.probe import ForwardProbe
from qil_worker.attention import PACKED, PAGED
from qil_worker.attention.choice import probe_varlen

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def model(tiny_dir):
    return Qwen3.from_directory(tiny_dir, device="cuda", dtype="bfloat16")


@pytest.mark.parametrize("mode", [PAGED, PACKED])
@pytest.mark.parametrize("page_size", [16, 256])
def test_varlen_path_agrees_with_gather_sdpa(model, page_size, mode):
    c = model.config
    why = probe_varlen(model.device, model.dtype, page_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, mode)
    print(f"page_size={page_size}: {mode} {'available' if why is None else 'unavailable: ' + why}")
    if why is not None:
        pytest.skip(why)
    rng = random.Random(page_size)
    prompts = [[rng.randrange(97) for _ in range(n)] for n in (1, 7, 40, 300)]
    outs = {}
    for attention in ("sdpa", mode):
        probe = ForwardProbe(model, num_pages=64 * 256 // page_size, page_size=page_size, attention=attention)
        seqs = [probe.sequence(p) for p in prompts]
        first = probe.forward([(s, min(len(p), 5)) for s, p in zip(seqs, prompts)])
        rest = probe.forward([(s, len(p) - 5) for s, p in zip(seqs, prompts) if len(p) > 5])
        outs[attention] = torch.cat(first + rest)
    scale = outs["sdpa"].abs().max()
    assert (outs[mode] - outs["sdpa"]).abs().max() < 0.03 * scale

    engines = [Engine(model, num_pages=64 * 256 // page_size, page_size=page_size, attention=a) for a in (mode, "sdpa")]
    assert [e.attention_backend for e in engines] == [mode, "sdpa"]
    res = [e.generate(prompts, max_new_tokens=16) for e in engines]
    agree = sum(a == b for x, y in zip(*res) for a, b in zip(x.output_token_ids, y.output_token_ids))
    assert agree >= 0.9 * 16 * len(prompts)
    assert engines[0].runner.decode_graphs.steps > 0  # the graphed decode steps ran this kernel too


def test_memory_fraction_leaves_room_for_the_largest_step(model):
    """The pool takes the fraction of free memory less the warm-up step's activation peak,
    and a step of that size then runs beside the pool."""
    from qil_worker.engine.memory import bytes_per_page, size_pool

    torch.cuda.empty_cache()  # as size_pool does after its warm-up: earlier tests' cache is freed
    free_before, _ = torch.cuda.mem_get_info(model.device)
    size = size_pool(model, 16, memory_fraction=0.002, warmup_tokens=256)
    assert "activation peak of a 256-token step" in size.reason
    with_graphs = size_pool(model, 16, memory_fraction=0.002, warmup_tokens=256, graphs=True)
    assert "(twice: eager and in CUDA graphs)" in with_graphs.reason
    assert size.total_bytes <= 0.002 * free_before + bytes_per_page(model, 16)
    engine = Engine(model, num_pages=size.num_pages, page_size=16, token_budget=256, prefill_chunk=256)
    (result,) = engine.generate([[1] * 255], max_new_tokens=2)
    assert result.error is None and len(result.output_token_ids) == 2
    engine.close()


@pytest.mark.parametrize("mode", [PAGED, PACKED])
def test_mixed_steps_replay_captured_graphs_with_the_tokens_of_eager_steps(model, mode):
    """Prefill chunks beside decodes through ``step_graphs``: real graphs of torch's varlen
    kernel give the tokens of the same engine without step graphs (both bf16 on this device)."""
    c = model.config
    why = probe_varlen(model.device, model.dtype, 16, c.num_attention_heads, c.num_key_value_heads, c.head_dim, mode)
    if why is not None:
        pytest.skip(why)
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 97) for _ in range(n)] for n in (3, 30, 11, 45, 7, 19, 120, 2)]
    outputs = {}
    for graphs in (True, False):
        engine = Engine(model, num_pages=256, page_size=16, token_budget=48, prefill_chunk=24, attention=mode,
                        step_graphs=graphs)
        ids = []
        for prompt in prompts:  # arrivals beside decodes: most steps carry a prefill chunk
            ids.append(engine.submit(prompt, max_new_tokens=12))
            engine.step()
        while not engine.idle:
            engine.step()
        outputs[graphs] = [engine.result(i).output_token_ids for i in ids]
        if graphs:
            print(f"{mode}: {engine.runner.step_graphs.steps} mixed steps, {engine.runner.graph_capture.count} graphs, "
                  f"{engine.runner.graph_capture.seconds:.2f} s capture")
            assert engine.runner.graph_capture.enabled, "capture failed: the steps ran eagerly"
            assert engine.runner.step_graphs.steps >= 8 and engine.runner.step_graphs.num_graphs >= 2
        engine.close()
    agree = sum(a == b for x, y in zip(outputs[True], outputs[False]) for a, b in zip(x, y))
    assert agree >= 0.9 * 12 * len(prompts)  # bf16 kernels on differently padded shapes may tie-break apart
