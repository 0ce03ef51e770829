"""What the streaming calls (Generate, StreamEvents) share: the event that takes a reader from
its cursor to the end of a request's log, and the bound on how far a reader may fall behind."""

from __future__ import annotations

import logging

from qil_client._proto.qil.v1 import inference_pb2 as pb
from qil_worker.service.errors import ServiceError, invalid, resource_exhausted
from qil_worker.service.front import Front
from qil_worker.service.front_request import Req

log = logging.getLogger("qil.server")


def request_metrics(final: tuple | None) -> pb.RequestMetrics | None:
    if final is None:
        return None
    queue, ttft, mean_itl, max_itl, e2e, preempt = final[2:8]
    return pb.RequestMetrics(
        queue_time_s=max(queue, 0.0),
        ttft_s=max(ttft, 0.0),
        mean_itl_s=max(mean_itl, 0.0),
        max_itl_s=max(max_itl, 0.0),
        e2e_s=max(e2e, 0.0),
        num_preemptions=preempt,
    )


def build_event(req: Req, cursor: int) -> tuple[pb.Event | None, int, bool]:
    """The event that takes a follower from ``cursor`` to the end of ``req``'s log.

    Returns ``(event or None, new cursor, done)``. All tokens produced since the cursor go into
    one event: that is the coalescing for readers slower than the worker.
    """
    n = len(req.tokens)
    final = req.final
    if cursor >= n and final is None:
        return None, cursor, False
    ev = pb.Event(request_id=req.rid, seq=cursor, token_ids=req.tokens[cursor:])
    if req.texts is not None:
        ev.text = "".join(req.texts[cursor:]) + (req.final_text if final is not None else "")
    if req.logprobs is not None:
        ev.logprobs.extend(req.logprobs[cursor:])
    if req.top is not None:
        for top in req.top[cursor:]:
            ev.top_logprobs.add().candidates.extend(
                pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in top
            )
    if final is not None:
        code, error, record = final
        ev.finished = True
        ev.finish_reason = code
        if error:
            ev.error = error
        ev.num_prompt_tokens = req.prompt_len
        ev.num_output_tokens = n
        metrics = request_metrics(record)
        if metrics is not None:
            ev.metrics.CopyFrom(metrics)
        if record is not None and len(record) >= 10:
            ev.num_cached_tokens = record[8]
            stop = record[9]
            if isinstance(stop, str):
                ev.stop_string = stop
            elif stop is not None:
                ev.stop_token_id = stop
    return ev, n, final is not None


def past_the_end(req: Req, from_seq: int) -> ServiceError:
    return invalid("from_seq", f"{from_seq} is past the end ({len(req.tokens)})")


def backlog_bound(front: Front) -> int | None:
    bound = front.config.max_stream_backlog
    return bound if bound and bound > 0 else None


def backlog_error(bound: int) -> ServiceError:
    return resource_exhausted(
        f"the client fell more than {bound} tokens behind this stream; its request(s) were cancelled"
    )


def stream_fell_behind(front: Front, rids: list[str], bound: int, behind: str = "") -> None:
    if not rids:
        log.warning(
            "stream reader more than %d tokens behind: ending the stream", bound,
            extra={"request_id": behind},
        )
    for rid in rids:
        log.warning(
            "stream reader more than %d tokens behind: cancelling", bound, extra={"request_id": rid}
        )
        front.cancel_nowait(rid)
    if front.metrics is not None:
        front.metrics.on_backlog_exceeded()
