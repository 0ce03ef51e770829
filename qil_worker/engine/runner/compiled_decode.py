"""CPU decode steps of one row through the model's compiled graph (``model.compiled_decode``).

The runner asks ``handles`` first: a step of exactly one decode token, sampled, whose request's
keys lie back to back in the pool (the page pool's pages for a request growing alone), and not
its first token (a lone key would be a shape of its own). Every other step runs eagerly. A
compiled call that fails (a recompile that cannot compile, for one) leaves the compiled path
off for good, with one warning; that step then runs eagerly, rewriting the same slots.
"""

from __future__ import annotations

import logging

import torch

from qil_worker.engine.in_flight import decode_inputs, fill_inputs
from qil_worker.engine.scheduler import ScheduledChunk
from qil_worker.engine.transfer import to_device
from qil_worker.kv.cache import KVCache
from qil_worker.kv.page_table import consecutive_start
from qil_worker.model.compiled_decode import DecodeStep, frozen_weights

log = logging.getLogger(__name__)


class CompiledDecode:
    """One engine's use of a compiled decode step: its KV tensors viewed flat, as the graph
    addresses them."""

    def __init__(self, step: DecodeStep, kv: KVCache) -> None:
        self.step = step
        self.page_size = kv.page_size
        self.k = kv.k.view(-1, *kv.k.shape[2:])
        self.v = kv.v.view(-1, *kv.v.shape[2:])
        self.steps = 0  # steps run compiled (observable by tests and benchmarks)

    def handles(self, chunks: list[ScheduledChunk]) -> bool:
        if self.step is None or len(chunks) != 1:
            return False
        chunk = chunks[0]
        request = chunk.request
        if chunk.num_tokens != 1 or chunk.start == 0 or not chunk.samples or request.prompt_logprobs is not None:
            return False
        return consecutive_start(chunk.pages, chunk.start // self.page_size + 1) is not None

    def run(self, chunks: list[ScheduledChunk], in_flight_tokens: torch.Tensor | None) -> torch.Tensor | None:
        """The step's logits [1, vocab]; None where the compiled call failed (the caller runs the
        step eagerly; this path is off from then on)."""
        chunk = chunks[0]
        ids, rows, sources = decode_inputs(chunks)
        input_ids = to_device(ids, self.k.device, torch.long)
        fill_inputs(input_ids, rows, sources, in_flight_tokens)
        position = chunk.start
        first = chunk.pages[0] * self.page_size
        args = (input_ids, torch.tensor([position]), self.k, self.v, torch.tensor([first + position]))
        try:
            with frozen_weights():
                logits = self.step(*args, first, position + 1)
        except Exception as exc:  # noqa: BLE001 — whatever inductor raises, the eager step works
            log.warning("compiled decode step failed (%s: %s); decode steps run eagerly from now on",
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            self.step = None
            return None
        self.steps += 1
        return logits
