"""Overlapped scheduling: a step whose sampled tokens are still on the device.

An overlapped engine launches step N (forward + sampling, no host sync), then, in the next
``step()``, schedules and launches step N+1 before it reads step N's tokens. Every request
sampled in step N then has one token the host does not know yet: it counts in the request's
``num_tokens`` (``Request.in_flight_row``), so the scheduler gives the request its decode row as
usual, and that row's input id is taken on the device from step N's token tensor
(``decode_inputs`` / ``fill_inputs``). The host time of scheduling and staging N+1 thus runs
while the device computes N.

When step N is read, a request that finished in it (a stop id, a stop string, its length, an
error) or was cancelled meanwhile gets no token from step N+1: its row there is dropped when
N+1 is read. The scheduler never gives a row to a request whose in-flight token is its last
(``max_new_tokens`` is known on the host).

Which steps overlap their successor (``stays_in_flight``): a step is read before the next one
is scheduled — the engine steps synchronously for it — when one of its sampled requests needs
its token on the host before its next step can be built: a grammar (the next mask follows the
token), penalties or ``min_new_tokens`` (computed from the output on the host) or prompt
log-probabilities; or when it forks the samples of an ``n > 1`` request (they start from the
forking row's token; once forked, samples are requests of their own and overlap like any
other). And beside a step in flight the scheduler gives up where it would preempt
(``Scheduler.schedule(preempt=False)``); the step in flight is then read and scheduling
retried, so requests that ended in it free their pages first, as a synchronous engine's would,
and may spare the preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qil_worker.engine.request import Request
from qil_worker.engine.runner.pooling import PooledAnswers
from qil_worker.engine.sampler import DeviceSample
from qil_worker.engine.scheduler import ScheduledChunk
from qil_worker.engine.transfer import to_device


@dataclass
class InFlightStep:
    """A launched step: its KV writes are committed, its sampled tokens not read yet."""

    chunks: list[ScheduledChunk]  # every chunk the step computes
    requests: list[Request]  # the request of each sampled row, in row order (forked samples last)
    sample: DeviceSample
    # whether the next step may be scheduled before this one is read (module docstring)
    stays_in_flight: bool
    marked: bool = False  # kept in flight past its ``step()`` call (``mark``)
    pooled: PooledAnswers | None = None  # the answers of pooled prompts that end in the step

    def mark(self) -> None:
        """Give every still-running sampled request its row here: its token is in flight."""
        self.marked = True
        for row, request in enumerate(self.requests):
            if not request.finished:
                request.in_flight_row = row


def needs_host_token(request: Request) -> bool:
    """Whether building the request's next step needs the token it samples now on the host."""
    return (
        request.grammar is not None
        or request.sampling_row.reads_output
        or request.prompt_logprobs is not None
    )


def stays_in_flight(requests: list[Request], forks: list) -> bool:
    """Whether a step sampling ``requests`` (and forking ``forks``) may be read after the next
    step is launched: the one place that decides which steps overlap (besides a schedule
    that would preempt, module docstring)."""
    return not forks and not any(needs_host_token(r) for r in requests)


def decode_inputs(chunks: list[ScheduledChunk]) -> tuple[list[int], list[int], list[int]]:
    """For one-token chunks: each one's input id on the host (0 where the token is still in
    flight), and the rows whose id is in flight with the in-flight step's row of each."""
    ids: list[int] = []
    rows: list[int] = []
    sources: list[int] = []
    for row, chunk in enumerate(chunks):
        request = chunk.request
        if request.in_flight_row >= 0:
            ids.append(0)
            rows.append(row)
            sources.append(request.in_flight_row)
        else:
            ids.append(request.token_at(chunk.start))
    return ids, rows, sources


def fill_inputs(
    input_ids: torch.Tensor, rows: list[int], sources: list[int], in_flight_tokens: torch.Tensor | None
) -> None:
    """On the device: ``input_ids[rows[i]] = in_flight_tokens[sources[i]]`` (no host sync)."""
    if not rows:
        return
    if in_flight_tokens is None:
        raise RuntimeError("a request has a token in flight but no step is in flight")
    device = input_ids.device
    values = in_flight_tokens.index_select(0, to_device(sources, device, torch.long))
    input_ids.index_copy_(0, to_device(rows, device, torch.long), values.to(input_ids.dtype))
