"""Messages between the front (gRPC, asyncio) and the worker process (model, pages, scheduler).

Transport: a duplex ``multiprocessing.Pipe`` of a *spawn* context. Why this and not a socket,
shared memory or a multiprocessing.Queue:

* one pickled message per ``send``: framing and serialisation come for free, and both ends are
  our own code (so unpickling is safe) and ship together (so there is one shape per message);
* ``Connection.poll(timeout)`` lets the worker *block* when idle and drain without blocking when
  busy; ``recv`` in the front's reader thread blocks too — nobody spins;
* the end of the pipe is the liveness signal in both directions: the front sees ``EOFError`` the
  moment the worker dies (SIGKILL included), and the worker sees ``EOFError`` when the front dies,
  and exits on its own;
* a Queue would add a feeder thread per side and hide a dead peer; a raw socket would need our own
  framing for no gain at these message sizes.

Front → worker: ``Submit``, ``Cancel``, ``Stop``, and the tokenizer calls ``Tokenize`` /
``Detokenize``. Worker → front: ``Ready`` (or ``Fatal``) once, then one ``StepBatch`` per loop
iteration that ran a step or answered a submit — never one message per token — and one
``Tokenized`` / ``Detokenized`` per tokenizer call, under the call's id (the front drops an
answer whose caller is gone). Every batch carries the page pool's numbers after its step, and every change
of them comes from a submit or a step, so the front's latest batch is always current.

This module is imported by the front and must stay torch-free: the worker maps the engine's
events to these records (``qil_worker.engine`` imports torch on import, so the front could not
unpickle its classes), which also keeps what crosses the pipe to what the front reads (a final
record carries counts and metrics, never the prompt's token ids).
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, field, fields
from typing import Any

from qil_worker.engine.config import EngineConfig  # torch-free
from qil_worker.engine.outputs import FinishReason  # torch-free: one FinishReason, engine to front
from qil_worker.engine.spec import RequestSpec  # torch-free


def message(cls: type) -> type:
    """A frozen, slotted dataclass that pickles as ``cls(*fields)`` (unless it defines its own
    ``__reduce__``).

    The default pickling of a frozen slotted dataclass goes through ``dataclasses.fields()`` for
    every object, several times slower than this for the small records sent every step.
    """
    own_reduce = "__reduce__" in cls.__dict__
    cls = dataclass(frozen=True, slots=True)(cls)
    names = [f.name for f in fields(cls)]
    if own_reduce:
        return cls
    if not names:
        cls.__reduce__ = lambda self: (cls, ())
    elif len(names) == 1:
        get_one = operator.attrgetter(names[0])
        cls.__reduce__ = lambda self: (cls, (get_one(self),))
    else:
        get_all = operator.attrgetter(*names)
        cls.__reduce__ = lambda self: (cls, get_all(self))
    return cls


class RejectKind(str, enum.Enum):
    """Why the worker refused a submit (mapped to a status code in ``service.errors``)."""

    INVALID = "invalid"
    CAPACITY = "capacity"
    DUPLICATE = "duplicate"
    PRECONDITION = "precondition"  # e.g. text sent to a worker without a tokenizer
    INTERNAL = "internal"


@dataclass(frozen=True)
class WorkerConfig:
    """What the worker process is started with, built once from the command line.

    ``quantize``: None keeps the weights in ``dtype``, "int8" quantizes them at load. The KV
    pool is ``engine.num_pages``, unless sized from a byte budget (``kv_memory_bytes``) or a
    fraction of the free device memory (``kv_memory_fraction``). ``tokenizer``: None takes the
    model directory's when it has one; ``use_tokenizer`` False serves token ids only.
    ``structured_warmup``: build the grammar library's tokenizer tables before Ready.
    ``tensor_parallel_size``: the worker and N-1 rank processes it spawns, each with its shard
    (with ``nnodes`` > 1: the ranks of node 0; the other nodes start theirs, ``worker.node``).
    """

    model: str | None = None  # None: the embedded demo model
    device: str = "cpu"
    dtype: str | None = None
    threads: int | None = None
    quantize: str | None = None
    compile: bool = True  # compile the CPU kernels that measure faster compiled (``Qwen3.from_directory``)
    # what the server is for (``qil_worker.task``): auto, generate, embed or rerank
    task: str = "auto"
    engine: EngineConfig = field(default_factory=EngineConfig)
    kv_memory_bytes: int | None = None
    kv_memory_fraction: float | None = None
    tokenizer: str | None = None
    use_tokenizer: bool = True
    structured_warmup: bool = True
    tensor_parallel_size: int = 1  # ranks the model is split over (``qil_worker.parallel``)
    # several nodes: ``tensor_parallel_size / nnodes`` ranks on each, joined at ``dist_init_addr``
    # (host:port of node 0's rendezvous); node 0 runs this worker, the others ranks only
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    log_level: str = "INFO"
    log_format: str = "text"  # or "json"


# ---------------------------------------------------------------- front → worker


@message
class Submit:
    """Queue a request: ``Engine.submit(spec)``, the spec whole (its id given by the front)."""

    spec: RequestSpec

    @property
    def request_id(self) -> str:
        return self.spec.request_id  # type: ignore[return-value]  # (the front always sets it)


@message
class Cancel:
    request_id: str


@message
class Stop:
    """Cancel everything, close the engine, exit 0."""


# ---------------------------------------------------------------- worker → front


@message
class PoolStats:
    """The page pool and the queues, as the engine's ``stats()`` reports them."""

    pages_total: int
    pages_used: int
    pages_free: int
    num_running: int
    num_waiting: int
    pages_cached: int
    prefix_cache_hit_rate: float

    def all_free(self) -> "PoolStats":
        """The numbers of a worker that holds nothing (it died: its pages are gone with it)."""
        total = self.pages_total
        return PoolStats(total, 0, total, 0, 0, 0, self.prefix_cache_hit_rate)


EMPTY_STATS = PoolStats(0, 0, 0, 0, 0, 0, 0.0)


@message
class WorkerInfo:
    """What the worker tells once it is loaded and warm (GetInfo and the start-up log)."""

    name: str
    demo: bool
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: list[int]
    dtype: str
    device: str
    num_hidden_layers: int
    hidden_size: int
    has_tokenizer: bool
    has_chat_template: bool
    tokenizer: str | None  # its directory, None when serving token ids only
    prefix_cache: bool
    schedule_policy: str
    cuda_graphs: bool
    attention: str
    kv_pool: str  # a human summary of the pool's size
    memory: str  # a human summary of the memory in use
    page_bytes: int
    page_size: int
    token_budget: int
    prefill_chunk: int
    max_active: int
    pid: int
    stats: PoolStats
    # constrained requests can run: the grammar library imports and there is a tokenizer
    structured_output: bool = False
    # a lower bound on a text's token count (``text.tokenizer.min_tokens``), so that the front
    # refuses a prompt that cannot fit before shipping it: the most bytes one token stands for
    # (0: no bound) and the tokenizer's normalizer (None or "NFC")
    max_token_bytes: int = 0
    normal_form: str | None = None
    # the formats the weights run in and the bytes they hold (``Qwen3.weight_summary``), all
    # tensor-parallel ranks together
    weight_format: str = ""
    weight_bytes: int = 0
    # the tensor-parallel ranks, the machines they span and the most weight bytes one rank holds
    tensor_parallel_size: int = 1
    nnodes: int = 1
    rank_weight_bytes: int = 0
    # the tokenizer's class, special tokens and chat template (``text.tokenizer.tokenizer_summary``;
    # empty without a tokenizer)
    tokenizer_summary: dict = field(default_factory=dict)
    # the architecture ("qwen3", "qwen3_moe"), its experts and its weights, total and per token
    architecture: str = "qwen3"
    num_experts: int = 0
    num_experts_per_tok: int = 0
    num_parameters: int = 0
    num_active_parameters: int = 0
    # the resolved task (``qil_worker.task``) and whether it was asked for rather than detected
    task: str = "generate"
    task_explicit: bool = False


@message
class Ready:
    info: WorkerInfo


@message
class Fatal:
    """The worker cannot start (bad model directory...) and exits."""

    message: str


@message
class Rejection:
    kind: RejectKind
    field: str | None
    message: str


@message
class Ack:
    """The answer to one ``Submit``: accepted (``rejection`` None) or refused."""

    request_id: str
    num_prompt_tokens: int  # after encoding text or rendering messages; 0 when refused
    rejection: Rejection | None = None


@message
class RequestTimings:
    """Timings of a finished request in seconds (None: the moment never came), as
    ``qil.v1.RequestMetrics`` names them."""

    queue_time_s: float | None
    ttft_s: float | None
    mean_itl_s: float | None
    max_itl_s: float | None
    e2e_s: float | None
    num_preemptions: int


@message
class FinalRecord:
    """How a request ended. ``metrics`` None: the worker has none (the front ended it)."""

    reason: FinishReason
    error: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    stop_reason: int | str | None  # on STOP: the token id or the stop string that ended it
    metrics: RequestTimings | None
    pooled: list[float] | float | None = None  # a pooled request's answer: an embedding or a score


@message
class ScoredPrompt:
    """A request's prompt log-probabilities (``Event.prompt_logprobs``), sent once, with its
    first token: ``logprobs[i]`` scores prompt token i + 1; ``top`` None unless N > 0."""

    logprobs: list[float]
    top: list[list[tuple[int, float]]] | None


@message
class StepTiming:
    seconds: float  # wall time around ``engine.step()``
    batch_size: int  # distinct requests with events in that step


@message
class StepBatch:
    """Everything one loop iteration produced: the acks of the submits it drained, the events of
    its step and the pool's numbers after it.

    The events are columns, entry i of each for one event (each request has at most one per
    step): ``token_ids[i]`` is -1 for an end that produced no token, ``texts[i]`` None without a
    tokenizer, ``logprobs[i]`` / ``top_logprobs[i]`` None when not asked for. A request that
    ended in this step has its ``finals`` entry, a request whose first token this is and that
    asked for prompt logprobs its ``prompt_logprobs`` entry (sparse: empty in most steps).
    A request of several samples (``n``) has one event per sample: ``samples[i]`` is the sample
    of event i (the column is None when every event is of sample 0), and the final of sample
    s > 0 is keyed ``(request_id, s)``. Columns pickle as a handful of lists, where a record per
    event would cost one object per token on both sides of the pipe. ``cached``: the prompt
    tokens served from the prefix cache of each request whose first token is in this batch (so
    the front has them should the worker die before the request's final record).
    """

    acks: list[Ack]
    request_ids: list[str]
    token_ids: list[int]
    texts: list[str | None]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]
    finals: dict[str | tuple[str, int], FinalRecord]
    stats: PoolStats
    timing: StepTiming | None  # None: the iteration ran no step (only acks)
    cached: dict[str, int]
    prompt_logprobs: dict[str, ScoredPrompt]
    samples: list[int] | None = None

    def __reduce__(self) -> tuple:
        # Pickled as plain values under one reconstructor: each class a pickle names costs an
        # import lookup on both ends, several times what the values of a small batch cost.
        return (_step_batch, (
            [(a.request_id, a.num_prompt_tokens, None if a.rejection is None else (
                a.rejection.kind.value, a.rejection.field, a.rejection.message)) for a in self.acks],
            self.request_ids, self.token_ids, self.texts, self.logprobs, self.top_logprobs,
            {rid: (f.reason.number, f.error, f.num_prompt_tokens, f.num_output_tokens,
                   f.num_cached_tokens, f.stop_reason, None if f.metrics is None else _METRICS(f.metrics),
                   f.pooled)
             for rid, f in self.finals.items()},
            _STATS(self.stats),
            None if self.timing is None else (self.timing.seconds, self.timing.batch_size),
            self.cached,
            {rid: (p.logprobs, p.top) for rid, p in self.prompt_logprobs.items()},
            self.samples,
        ))


_METRICS = operator.attrgetter(*(f.name for f in fields(RequestTimings)))
_STATS = operator.attrgetter(*(f.name for f in fields(PoolStats)))


def _step_batch(acks: list, ids: list, tokens: list, texts: list, logprobs: list, tops: list,
                finals: dict, stats: tuple, timing: tuple | None, cached: dict,
                prompt_logprobs: dict, samples: list | None = None) -> StepBatch:
    """``StepBatch.__reduce__`` undone."""
    return StepBatch(
        [Ack(rid, n, None if r is None else Rejection(RejectKind(r[0]), r[1], r[2])) for rid, n, r in acks],
        ids, tokens, texts, logprobs, tops,
        {rid: FinalRecord(FinishReason.of_number(f[0]), *f[1:6], None if f[6] is None else RequestTimings(*f[6]), f[7])
         for rid, f in finals.items()},
        PoolStats(*stats),
        None if timing is None else StepTiming(*timing),
        cached,
        {rid: ScoredPrompt(*p) for rid, p in prompt_logprobs.items()},
        samples,
    )


# ---------------------------------------------------------------- tokenizer calls (Tokenize RPCs)


@message
class Tokenize:
    """Encode ``text`` or chat ``messages`` as a ``Submit``'s prompt would be; ``call_id`` keys
    the answer (``Tokenized``) in the front. Both None: the empty prompt, zero tokens.
    ``max_tokens``: refuse a longer prompt as soon as that is certain (the model's positions:
    no request could carry it); None: no limit."""

    call_id: int
    text: str | None
    messages: list[dict[str, str]] | None
    enable_thinking: bool | None
    max_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None  # as ``Prompt.tools``


@message
class Detokenize:
    call_id: int
    token_ids: list[int]
    skip_special_tokens: bool


@message
class Tokenized:
    """The answer to a ``Tokenize``: the ids, or why not."""

    call_id: int
    token_ids: list[int] | None
    rejection: Rejection | None = None


@message
class Detokenized:
    call_id: int
    text: str | None
    rejection: Rejection | None = None


TOKENIZER_CALLS = (Tokenize, Detokenize)
TOKENIZER_ANSWERS = (Tokenized, Detokenized)

ToWorker = Submit | Cancel | Stop | Tokenize | Detokenize
FromWorker = Ready | Fatal | StepBatch | Tokenized | Detokenized
