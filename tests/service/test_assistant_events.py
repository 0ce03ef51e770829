"""A chat sample's reasoning, content and tool-call deltas on its gRPC events
(``front.assistant_events`` over ``FrontRequest.parts``): from any cursor, coalesced or token by
token, the deltas join to the final event's split, a tag split across tokens never reaches
content, and every reader gets the same call ids."""

from __future__ import annotations

import json

from qil_client import StreamedCalls
from qil_worker.service.front.request_log import FrontRequest
from qil_worker.service.front.streams import ends_before, next_event
from qil_worker.service.protocol import FinalRecord, FinishReason

# an output cut into token texts at awkward places: inside the tags and the call's JSON
PIECES = ["<th", "ink>\nhm", "m\n</th", "ink>\n\nSure", ". <tool", "_call>\n{\"na", "me\": \"add\", ",
          "\"arguments\": {\"a\": 2,", " \"b\": 3}}\n</tool_", "call>\n<tool_call>\n{\"name\": \"ping\", ",
          "\"arguments\": {}}\n</tool_call>"]


def _record(reason: FinishReason, output: int) -> FinalRecord:
    return FinalRecord(reason, None, 3, output, 0, None, None)


def _request(pieces: list[str], samples: list[int] | None = None, n: int = 1) -> FrontRequest:
    req = FrontRequest("r", prompt_len=3, n=n)
    req.assistant = True
    samples = samples or [0] * len(pieces)
    for k, (text, sample) in enumerate(zip(pieces, samples)):
        last = k == max(i for i, s in enumerate(samples) if s == sample)
        req.append(k, text, None, None, _record(FinishReason.STOP, samples.count(sample)) if last else None, sample)
    return req


def _events(req: FrontRequest, cursor: int = 0):
    """The events a reader from ``cursor`` gets of the whole log (coalesced)."""
    events, seen = [], ends_before(req, cursor)
    while True:
        ev, cursor, seen, done = next_event(req, cursor, seen)
        if ev is None:
            return events
        events.append(ev)
        if done:
            return events


def _token_by_token(pieces: list[str]):
    """One event per token: a reader that keeps up (the log grows a token at a time)."""
    req = FrontRequest("r", prompt_len=3)
    req.assistant = True
    events, cursor, seen = [], 0, 0
    for k, text in enumerate(pieces):
        req.append(k, text, None, None, _record(FinishReason.STOP, len(pieces)) if k == len(pieces) - 1 else None)
        while True:
            ev, cursor, seen, done = next_event(req, cursor, seen)
            if ev is None:
                break
            events.append(ev)
            if done:
                break
    return events


def _joined(events, sample: int = 0):
    mine = [e for e in events if e.sample_index == sample]
    calls = StreamedCalls()
    for ev in mine:
        calls.add(ev)
    reasoning = "".join(e.reasoning_delta for e in mine)
    content = "".join(e.content_delta for e in mine)
    return reasoning, content, [(c.id, c.name, c.arguments) for c in calls.calls(sample)]


def test_token_by_token_deltas_join_to_the_final_split_and_hold_back_tags():
    events = _token_by_token(PIECES)
    final = events[-1]
    assert final.finished
    reasoning, content, calls = _joined(events)
    assert (reasoning, content) == (final.reasoning, final.content) == ("\nhmm\n", "Sure. \n")
    assert calls == [(c.id, c.name, c.arguments) for c in final.tool_calls]
    assert [(name, json.loads(args)) for _, name, args in calls] == [("add", {"a": 2, "b": 3}), ("ping", {})]
    for ev in events:
        assert "<" not in ev.content_delta and "<" not in ev.reasoning_delta
    # a call's first delta carries its id and name; the later ones only argument fragments
    deltas = [d for e in events for d in e.tool_call_deltas if d.index == 0]
    assert (deltas[0].id, deltas[0].name) == (final.tool_calls[0].id, "add")
    assert len(deltas) > 1 and all(not d.id and not d.name for d in deltas[1:])


def test_a_coalesced_or_late_reader_gets_the_same_split_and_ids():
    req = _request(PIECES)
    whole = _token_by_token(PIECES)
    for cursor in (0, 4, 6):
        events = _events(req, cursor)
        final = events[-1]
        assert [(c.id, c.name, c.arguments) for c in final.tool_calls] == \
            [(c.id, c.name, c.arguments) for c in whole[-1].tool_calls]
    assert _joined(_events(req)) == _joined(whole)


def test_samples_split_apart():
    other = ["plain ", "answer"]
    # sample 1's two tokens interleave with sample 0's first two; the rest are sample 0's
    pieces = [PIECES[0], other[0], PIECES[1], other[1], *PIECES[2:]]
    samples = [0, 1, 0, 1] + [0] * (len(PIECES) - 2)
    req = _request(pieces, samples, n=2)
    events = _events(req)
    assert _joined(events, 1) == ("", "plain answer", [])
    reasoning, content, calls = _joined(events, 0)
    assert (reasoning, content) == ("\nhmm\n", "Sure. \n") and [c[1] for c in calls] == ["add", "ping"]
    ids = {c[0] for c in calls}
    assert len(ids) == 2


def test_a_block_cut_off_streams_its_start_but_is_no_call():
    req = _request(PIECES[:8])  # ends inside the first call's arguments
    events = _events(req)
    assert not events[-1].tool_calls
    (streamed,) = _joined(events)[2]
    assert streamed[1] == "add" and streamed[2].startswith('{"a": 2')
