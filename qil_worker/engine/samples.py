"""Several samples of one prompt in one request (``n``): the prompt is computed once, then forks.

A request with ``n > 1`` is ``n`` ``Request`` objects of one id, one per sample, in a
``SampleGroup``. Only sample 0 is queued: it computes the prompt like any request. The later
samples wait outside the scheduler (``RequestStatus.UNFORKED``, no pages) while it does; the
scheduler admits sample 0 only when ``max_active`` has room for all of them, so they never wait
for a slot. In the step where the prompt's last token is computed, its logits row is sampled
once per sample (each with its own seed), and the later samples fork off (``fork``): each one's
page table takes the prompt's full pages as shared holders (reference counts in the page pool:
pages of the prefix cache are shared the same way, and full prompt pages are never written
again) and a copy of the last, partly filled page (one device copy for all of them and all
layers, ``KVCache.copy_pages``), since every sample writes its own tokens after the prompt
there. From then on each sample is a request of its own: it decodes, is preempted (and then
recomputes prompt + its own output like any request; its sharing ends there) and finishes
alone. The request as a whole ends with its last sample.

Why fork after the prompt rather than admit the other samples later to hit the prefix cache:
the cache shares only full pages, so each sample would recompute the partial last page and its
last prompt token, and without ``prefix_cache`` the whole prompt; the fork computes every prompt
token once, with or without the cache.

Seeds: sample 0 draws with the request's seed, so it equals the same request with ``n = 1``;
sample ``i > 0`` with ``sample_seed(seed, i)``. Draws stay indexed by output position
(``sampler.uniform_for``), so a seeded sample is the same alone, batched, and after preemption.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

import torch

from qil_worker.engine.outputs import RequestMetrics
from qil_worker.engine.transfer import to_device
from qil_worker.errors import CapacityError
from qil_worker.engine.request import Request, RequestStatus, SampleGroup, unforked
from qil_worker.kv.page_table import PageTable, pages_for

if TYPE_CHECKING:
    from qil_worker.engine.outputs import Event
    from qil_worker.engine.scheduler import Scheduler
    from qil_worker.kv.page_pool import PagePool


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request seeded ``seed`` (sample 0 keeps the seed)."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:sample:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # 63 bits, as the engine's own random seeds


def make_samples(first: "Request", n: int, fresh: "Callable[[Request], None]") -> None:
    """Give ``first`` (sample 0, as submitted) ``n - 1`` sibling samples, waiting to fork.

    Each sibling gets its own copy of the per-sample state; ``fresh(sample)`` gives it the state
    that follows the sample's own output and that this module does not know how to make: a
    text decoder (with the request's stop strings) and a grammar matcher at the grammar's start.
    State shared on purpose: the prompt, its hashes and its scored log-probabilities (delivered
    once, with the request's first token).
    """

    group = SampleGroup([first])
    first.group = group
    for i in range(1, n):
        sample = copy.copy(first)  # prompt, limits, stop ids, sampling and hashes are shared
        sample.sample_index = i
        sample.seed = sample_seed(first.seed, i)
        sample.output_token_ids = []
        sample.page_table = PageTable(first.page_table.page_size)
        sample.metrics = RequestMetrics(arrival_time=first.metrics.arrival_time)
        fresh(sample)
        sample.status = RequestStatus.UNFORKED
        group.members.append(sample)
        group.unforked.append(sample)


def forking(requests: list["Request"]) -> list[tuple[int, list["Request"]]]:
    """(row, samples) for each sampled request whose samples fork now: sample 0 is about to draw
    its first token, so its row's logits are those of every sample's first token."""
    return [(row, unforked(r)) for row, r in enumerate(requests) if r.group is not None and unforked(r)]


class PageCopier(Protocol):
    """What copies KV pages: ``KVCache``, or the model runner that has every rank copy."""

    def copy_pages(self, sources: list[int], targets: list[int]) -> None: ...


def fork(
    first: "Request", samples: list["Request"], scheduler: "Scheduler", pool: "PagePool", kv: "PageCopier"
) -> None:
    """Start ``samples`` from ``first``'s computed prompt (see the module docstring); ``kv``
    copies the partial pages (the model runner: on every tensor-parallel rank). A sample
    that gets no page for its copy of the partial page (the pool is short) is queued instead,
    to compute the prompt itself when it is admitted, as after a preemption."""
    first.group.unforked = []
    prompt_len = len(first.prompt_token_ids)
    page_size = first.page_table.page_size
    shared = first.page_table.pages[: prompt_len // page_size]
    partial = first.page_table.pages[len(shared) :]  # the last, partly filled page, if any
    sources: list[int] = []
    copies: list[int] = []
    for sample in samples:
        sample.metrics.first_scheduled_time = first.metrics.first_scheduled_time
        sample.num_cached_tokens = first.num_cached_tokens
        own = pool.allocate(len(partial)) if partial else []
        if own is None:
            scheduler.adopt(sample, running=False)
            continue
        for page in shared:
            pool.retain(page)
        sample.page_table.pages = shared + own
        sample.num_computed_tokens = prompt_len
        sources += partial
        copies += own
        scheduler.adopt(sample, running=True)
    kv.copy_pages(sources, copies)


def tagged(event: "Event", request: "Request") -> "Event":
    """``event`` with the sample it belongs to and how many other samples still run."""
    if request.group is None:
        return event
    return replace(
        event, sample_index=request.sample_index, samples_running=request.group.running_after(request)
    )


def check_fits(n: int, prompt_len: int, max_new_tokens: int, scheduler: "Scheduler", page_size: int) -> None:
    """Refuse (``CapacityError`` naming ``n``) a request whose samples cannot all run at once:
    they take ``n`` of ``max_active``'s slots, and since a preempted sample recomputes its own
    prompt, all ``n`` may come to hold a whole request's pages each."""
    if n <= 1:
        return
    if n > scheduler.max_active:
        raise CapacityError("n", f"{n} samples run at once, but the engine runs at most {scheduler.max_active}")
    per_sample = pages_for(prompt_len + max_new_tokens - 1, page_size)
    if n * per_sample > scheduler.pool.total:
        raise CapacityError(
            "n",
            f"{n} samples of prompt ({prompt_len}) + max_new_tokens ({max_new_tokens}) need up to "
            f"{n} x {per_sample} KV pages but the whole pool has {scheduler.pool.total} (page size {page_size})",
        )


def with_fork_rows(
    logits: torch.Tensor, requests: list["Request"], forks: list[tuple[int, list["Request"]]]
) -> tuple[torch.Tensor, list["Request"]]:
    """The sampler's rows and requests with the forking samples appended, each a copy of its
    sample 0's logits row (a step without forks passes through untouched)."""
    if not forks:
        return logits, requests
    rows = list(range(len(requests))) + [row for row, group in forks for _ in group]
    return logits.index_select(0, to_device(rows, logits.device, torch.long)), requests + [
        s for _, group in forks for s in group
    ]
