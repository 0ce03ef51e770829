"""Plain results of the client (the streaming calls yield the generated ``Event`` messages)."""

from __future__ import annotations

from dataclasses import dataclass, field

from qil_client._proto.qil.v1 import inference_pb2 as pb

FINISH_REASONS = {
    pb.FINISH_REASON_UNSPECIFIED: None,
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_CANCELLED: "cancelled",
    pb.FINISH_REASON_ERROR: "error",
}


@dataclass(frozen=True)
class Metrics:
    """Measured in the worker, seconds since the request arrived there."""

    queue_time_s: float = 0.0
    ttft_s: float = 0.0
    mean_itl_s: float = 0.0
    max_itl_s: float = 0.0
    e2e_s: float = 0.0
    num_preemptions: int = 0

    @classmethod
    def from_proto(cls, m: pb.RequestMetrics) -> "Metrics":
        return cls(m.queue_time_s, m.ttft_s, m.mean_itl_s, m.max_itl_s, m.e2e_s, m.num_preemptions)


@dataclass(frozen=True)
class Result:
    request_id: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "cancelled", "error"
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    metrics: Metrics = field(default_factory=Metrics)


class ResultBuilder:
    """Accumulates the events of one request into a Result, checking they are gap-free."""

    def __init__(self, request_id: str = "") -> None:
        self.request_id = request_id
        self.token_ids: list[int] = []
        self.final: pb.Event | None = None

    def add(self, ev: pb.Event) -> None:
        if ev.seq != len(self.token_ids):
            raise RuntimeError(f"event gap for {ev.request_id}: seq {ev.seq}, expected {len(self.token_ids)}")
        self.request_id = ev.request_id
        self.token_ids.extend(ev.token_ids)
        if ev.finished:
            self.final = ev

    def result(self) -> Result:
        ev = self.final
        if ev is None:
            return Result(self.request_id, list(self.token_ids), None)
        return Result(
            request_id=self.request_id,
            token_ids=list(self.token_ids),
            finish_reason=FINISH_REASONS.get(ev.finish_reason),
            error=ev.error or None,
            num_prompt_tokens=ev.num_prompt_tokens,
            num_output_tokens=ev.num_output_tokens,
            metrics=Metrics.from_proto(ev.metrics),
        )


def submit_request(
    token_ids, max_new_tokens: int | None = None, stop_token_ids=(), request_id: str = ""
) -> pb.SubmitRequest:
    req = pb.SubmitRequest(
        request_id=request_id or "", token_ids=list(token_ids), stop_token_ids=list(stop_token_ids or ())
    )
    if max_new_tokens is not None:
        req.max_new_tokens = max_new_tokens
    return req
