"""The model runner: a step's scheduled chunks in, its sampled tokens (still on the device) out.

It owns what the forward needs — the model, the KV tensors, the attention backend, the CUDA
graph runners with their static buffers — and the sampler's device pipeline; the engine keeps
the requests, the scheduler, the page pool's bookkeeping and the events. Each step takes one of
four paths, chosen here: a decode-only step replays a decode graph (``DecodeGraphs``), another
step with a graph bucket replays a mixed-step graph (``StepGraphs``), on CPU a lone decode row
may run the model's compiled forward (``CompiledDecode``), the rest run eagerly over
``build_step_inputs``. The runner is what a tensor-parallel rank will run: the step's inputs
(``StepInputs``) are plain tensors and typed records.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from qil_worker.attention.backend import AttentionBackend
from qil_worker.attention.choice import choose_backend
from qil_worker.engine import prompt_logprobs, samples
from qil_worker.engine.config import EngineConfig
from qil_worker.engine.request import Request
from qil_worker.engine.runner.batch import StepInputs, build_step_inputs
from qil_worker.engine.runner.compiled_decode import CompiledDecode
from qil_worker.engine.runner.decode_graphs import DecodeGraphs
from qil_worker.engine.runner.graph_capture import GraphCapture
from qil_worker.engine.runner.pooling import PooledAnswers, pooled_answers
from qil_worker.engine.runner.step_graphs import StepGraphs
from qil_worker.engine.sampler import DeviceSample, Sampler
from qil_worker.engine.scheduler import ScheduledChunk
from qil_worker.kv import KVCache
from qil_worker.model import Qwen3
from qil_worker.parallel.state import RankFailedError
from qil_worker.parallel.step_broadcast import StepSender

log = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 512  # decode steps with more requests than this run eagerly


def scratch_pages(model: Qwen3, cuda_graphs: bool | None = None, debug: bool = False) -> int:
    """KV pages a runner allocates beside the pool's ``num_pages``: the scratch page that padded
    decode rows write to, when decode steps run through ``DecodeGraphs`` (by default on CUDA,
    unless ``debug``). A KV memory budget must cover it too."""
    if cuda_graphs is None:
        # (a model whose forward loops on the host, a MoE without a grouped kernel, cannot be captured)
        cuda_graphs = model.device.type == "cuda" and not debug and model.graph_capturable
    return 1 if cuda_graphs else 0


@dataclass
class LaunchedStep:
    """What a step's launch queued on the device: its sampled tokens (``sample``, read later),
    the chunks whose KV it writes (``computed``: every chunk, in the path's order), the request
    of each sampled row (forked samples' rows last), the n-requests whose samples fork now and
    the answers of the pooled requests whose prompt ends in the step."""

    sample: DeviceSample
    computed: list[ScheduledChunk]
    requests: list[Request]
    forks: list
    pooled: PooledAnswers | None = None


def kv_cache(model: Qwen3, config: EngineConfig, scratch: int = 0) -> KVCache:
    """The KV tensors of ``config``'s pool for ``model``'s (this rank's) KV heads."""
    heads = model.heads
    return KVCache(
        model.config.num_hidden_layers, config.num_pages, config.page_size, heads.kv_heads, heads.head_dim,
        model.dtype, model.device, debug=config.debug, scratch_pages=scratch,
    )


class ModelRunner:
    """Runs the forward of every step of one engine, and samples its tokens on the device."""

    def __init__(self, model: Qwen3, config: EngineConfig, attention: AttentionBackend | None = None) -> None:
        """``attention``: a backend object instead of ``config.attention``'s name (tests)."""
        c, heads = model.config, model.heads  # (this rank's heads under tensor parallelism)
        self.model = model
        self.page_size = config.page_size
        if config.cuda_graphs and config.debug and model.device.type == "cuda":
            raise ValueError("debug checks read the device inside the forward; they cannot be captured")
        if config.cuda_graphs and model.device.type == "cuda" and not model.graph_capturable:
            raise ValueError("cuda_graphs: this model's forward cannot be captured (its experts run in a host "
                             "loop: no grouped kernel for its dtype or quantization)")
        # chosen before the KV pool is allocated: ``auto`` times the backends on CUDA
        if attention is not None:
            self.attention, why_not = attention, None
        else:
            self.attention, why_not = choose_backend(
                config.attention, model.device, model.dtype, config.page_size, heads.q_heads,
                heads.kv_heads, heads.head_dim,
            )
        if why_not and model.device.type == "cuda":
            log.info("attention: %s (not the paged varlen kernel: %s)", self.attention.name, why_not)
        scratch = scratch_pages(model, config.cuda_graphs, config.debug)
        self.kv = kv_cache(model, config, scratch)
        # rank 0 of a tensor-parallel group sends each step to the other ranks (None: one device)
        self.sender = StepSender.of(model.parallel, model.device)
        self.sampler = Sampler()
        # grammar masks filled beside the forward where the host is idle meanwhile
        self.sampler.grammar_masks.overlap = model.device.type == "cuda"
        self.graph_capture = GraphCapture(model.device) if scratch > 0 else None
        self.decode_graphs, self.step_graphs = self._graph_runners(config)
        self.compiled_decode = self._compiled_decode(config)

    def _compiled_decode(self, config: EngineConfig) -> CompiledDecode | None:
        """Lone decode rows through the model's compiled forward, where asked for and it
        compiles (CPU, one rank; never with debug checks, which read inside the forward)."""
        if not config.compile_decode or config.debug or self.sender is not None:
            return None
        step = self.model.compiled_decode()
        return CompiledDecode(step, self.kv) if step is not None else None

    def _graph_runners(self, config: EngineConfig) -> tuple[DecodeGraphs | None, StepGraphs | None]:
        """The decode graphs and the mixed-step graphs, where ``graph_capture`` exists (CUDA
        graphs on); mixed steps need a backend that builds their metadata in a graph."""
        capture, model = self.graph_capture, self.model
        static = capture is not None and self.attention.static_steps
        if config.step_graphs and not static:
            raise ValueError(
                f"step_graphs needs cuda_graphs and an attention backend that builds a step's metadata "
                f"in a graph (varlen), not {self.attention.name!r}"
            )
        if capture is None:
            return None, None
        max_context = min(model.config.max_position_embeddings, config.num_pages * self.page_size)
        max_requests = min(config.max_active, MAX_GRAPH_BATCH)
        decode = DecodeGraphs(
            model, self.kv, self.page_size, max_batch=max_requests, max_context=max_context,
            attention=self.attention, capture=capture,
        )
        mixed = None
        if static and config.step_graphs:
            mixed = StepGraphs(
                model, self.kv, self.page_size, max_tokens=config.token_budget,
                max_chunk=min(config.prefill_chunk, config.token_budget), max_requests=max_requests,
                max_context=max_context, attention=self.attention, capture=capture,
            )
        if model.device.type == "cuda":
            log.info("CUDA graphs: decode steps%s", " and mixed steps" if mixed else
                     f" (mixed steps run eagerly: attention {self.attention.name!r} builds no metadata in a graph)")
        return decode, mixed

    def launch(self, chunks: list[ScheduledChunk], in_flight_tokens: torch.Tensor | None) -> LaunchedStep:
        """Queue a step's forward and sampling on the device; nothing waits for it. The input
        of a request whose token is still in flight comes from ``in_flight_tokens`` (the
        previous step's sampled tokens, on the device). Prompt log-probabilities asked for are
        scored here (their rows follow the sampled ones)."""
        vocab = self.model.config.vocab_size
        pooled = None
        if self.decode_graphs is not None and self.decode_graphs.handles(chunks):
            computed = chunks
            requests = [c.request for c in chunks]
            self.sampler.prepare(requests, vocab)
            logits = self.decode_graphs.run(chunks, in_flight_tokens)
        elif self.step_graphs is not None and (bucket := self.step_graphs.bucket(chunks)) is not None:
            computed = chunks
            requests = [c.request for c in chunks if c.samples]  # the logits' rows
            self.sampler.prepare(requests, vocab)
            logits = self.step_graphs.run(chunks, bucket, in_flight_tokens)
        # (the compiled call runs in the condition: one that fails falls through to the eager step)
        elif (self.compiled_decode is not None and self.compiled_decode.handles(chunks)
              and (logits := self.compiled_decode.run(chunks, in_flight_tokens)) is not None):
            computed = chunks
            requests = [chunks[0].request]
            self.sampler.prepare(requests, vocab)
        else:
            inputs = build_step_inputs(
                chunks, self.attention, self.page_size, self.model.heads.query_groups, self.model.device,
                in_flight_tokens,
            )
            self.kv.check_reads(inputs.attention.slot_mapping, inputs.attention.reads())
            computed = inputs.chunks
            requests = [c.request for c in inputs.sampled]
            self.sampler.prepare(requests, vocab)
            if inputs.pool_indices is None:
                logits = self._forward(inputs)
            else:  # pooled prompts end here: their answers come from the hidden states
                hidden, logits = self._forward(inputs, keep_hidden=True)
                scored = len(logits) - inputs.num_score_rows  # a score's logit rows come last
                pooled = pooled_answers(
                    self.model, hidden.index_select(0, inputs.pool_indices), [c.request for c in inputs.pooled],
                    logits[scored:],
                )
                logits = logits[:scored]
            if inputs.prompt_rows:  # the rows after the sampled ones score prompt tokens
                prompt_logprobs.score(logits[len(requests):], inputs.prompt_rows)
                logits = logits[: len(requests)]
        forks = samples.forking(requests)  # n-requests whose prompt is computed now
        logits, requests = samples.with_fork_rows(logits, requests, forks)
        return LaunchedStep(self.sampler.sample_on_device(logits, requests), computed, requests, forks, pooled)

    def _forward(self, inputs: StepInputs, keep_hidden: bool = False):
        """The step's forward → its logit rows; with ``keep_hidden``, (the decoder stack's
        output, the logit rows), which make the same collectives as the plain forward. With
        tensor-parallel followers the step is sent to them first; a forward that fails here left
        them inside it, out of step with this rank: the group is lost (``RankFailedError``)."""
        model = self.model
        if self.sender is not None:
            self.sender.step(inputs.input_ids, inputs.positions, inputs.logit_indices, inputs.layout)
        try:
            if not keep_hidden:
                return model(inputs.input_ids, inputs.positions, inputs.attention, self.kv, inputs.logit_indices)
            hidden = model.hidden_states(inputs.input_ids, inputs.positions, inputs.attention, self.kv)
            return hidden, model.logits(hidden.index_select(0, inputs.logit_indices))
        except RankFailedError:
            raise
        except Exception as exc:
            if self.sender is None:
                raise
            raise RankFailedError(f"rank 0's forward failed, its followers are out of step: {exc}") from exc

    def copy_pages(self, sources: list[int], targets: list[int]) -> None:
        """``KVCache.copy_pages`` on every rank (forked samples, ``engine.samples``)."""
        if self.sender is not None and sources:
            self.sender.copy_pages(sources, targets)
        self.kv.copy_pages(sources, targets)

    def close(self) -> None:
        """Drop the graphs (they hold the KV tensors' addresses), the compiled decode's KV views
        and the KV tensors; release the tensor-parallel followers."""
        sender, self.sender = self.sender, None
        if sender is not None:
            try:
                sender.stop()
            except RankFailedError:  # the group is gone already: no follower is left to stop
                log.warning("tensor-parallel followers not stopped: the group has failed")
        self.decode_graphs = self.step_graphs = None
        self.compiled_decode = None  # (it holds views of the KV tensors)
        self.kv.k = self.kv.v = torch.empty(0)
