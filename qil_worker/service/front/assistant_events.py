"""A chat sample's output split (``text.assistant_output``) onto its gRPC events: each event's
reasoning, content and tool-call deltas from the parts its tokens added (``FrontRequest.parts``),
and the whole split on the sample's final event."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from qil_client._proto.qil.v1 import inference_pb2 as pb
from qil_worker.service.front.request_log import FrontRequest, SampleEnd
from qil_worker.text.assistant_output import CallArguments, CallStart, Content, Part, Reasoning, joined


def call_id(rid: str, sample: int, index: int) -> str:
    """A call's id from its request, sample and place: every subscriber, and the deltas and the
    final event, give the same one."""
    digest = hashlib.blake2s(f"{rid}/{sample}/{index}".encode(), digest_size=12).hexdigest()
    return f"call_{digest}"


def add_deltas(ev: pb.Event, parts: Iterable[Part]) -> None:
    """The deltas of ``parts`` (the parts of ``ev``'s items, in order) onto ``ev``: one text per
    kind, one ``ToolCallDelta`` per call, its arguments' fragments joined."""
    reasoning: list[str] = []
    content: list[str] = []
    calls: dict[int, pb.ToolCallDelta] = {}
    for part in parts:
        if isinstance(part, Reasoning):
            reasoning.append(part.text)
        elif isinstance(part, Content):
            content.append(part.text)
        elif isinstance(part, CallStart):
            calls[part.index] = pb.ToolCallDelta(
                index=part.index, id=call_id(ev.request_id, ev.sample_index, part.index), name=part.name
            )
        elif isinstance(part, CallArguments):
            delta = calls.get(part.index)
            if delta is None:
                delta = calls[part.index] = pb.ToolCallDelta(index=part.index)
            delta.arguments += part.text
    if reasoning:
        ev.reasoning_delta = "".join(reasoning)
    if content:
        ev.content_delta = "".join(content)
    ev.tool_call_deltas.extend(calls.values())


def sample_parts(req: FrontRequest, end: SampleEnd) -> list[Part]:
    """Every part of ``end``'s sample, in order."""
    assert req.parts is not None
    samples = req.samples
    parts = [p for i, token_parts in enumerate(req.parts)
             if samples is None or samples[i] == end.sample for p in token_parts]
    return parts + list(end.parts)


def add_whole(ev: pb.Event, req: FrontRequest, end: SampleEnd) -> None:
    """The sample's whole split onto its final event ``ev``."""
    parsed = joined(sample_parts(req, end))
    ev.reasoning = parsed.reasoning
    ev.content = parsed.content
    for call in parsed.tool_calls:
        ev.tool_calls.add(id=call_id(req.rid, end.sample, call.index), name=call.name, arguments=call.arguments)
