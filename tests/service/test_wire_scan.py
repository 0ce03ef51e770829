"""The wire reader (``service.wire_scan``) and the outsized-submit deserializer built on it
(``service.outsized_submit``), exactly, against protobuf's own parse of the same bytes."""

from __future__ import annotations

import random

import pytest
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet

from qil_client._proto.qil.v1 import inference_pb2 as pb
from qil_worker.freed_memory import OUTSIZED_CHARS
from qil_worker.service.front import wire_scan as W
from qil_worker.service.front.decoding import Undecodable, lenient
from qil_worker.service.front.outsized_submit import OutsizedSubmit, TextSize, stream_events_request, submit_request
from qil_worker.text.tokenizer import min_tokens, min_tokens_of_sizes
from raw_grpc import varint

BIG = OUTSIZED_CHARS + 7




def tag(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def delimited(number: int, payload: bytes) -> bytes:
    return tag(number, W.LENGTH_DELIMITED) + varint(len(payload)) + payload


def parses(data: bytes) -> bool:
    try:
        pb.SubmitRequest.FromString(data)
        return True
    except DecodeError:
        return False


# unknown fields of every wire type the reader follows (proto3 parsers keep them)
UNKNOWN = (
    tag(1000, W.VARINT) + varint(2**64 - 1)
    + tag(1001, W.FIXED64) + bytes(range(8))
    + delimited(1002, b"\xff\x00 any bytes")
    + tag(1003, W.FIXED32) + bytes(range(4))
)


def every_kind() -> tuple[pb.SubmitRequest, bytes]:
    """A request with fields of every wire type, known and unknown, and its bytes."""
    msg = pb.SubmitRequest(
        request_id="r-1", token_ids=[0, 127, 128, 2**32 - 1], max_new_tokens=300, seed=2**63,
        temperature=0.5, top_k=-1, stop_strings=["a", "é"], logit_bias={5: -1.0},
        messages=[pb.ChatMessage(role="user", content="hi")], json_schema="{}",
    )
    data = msg.SerializeToString() + UNKNOWN
    return pb.SubmitRequest.FromString(data), data


def unknown_of(msg) -> list[tuple[int, int, object]]:
    return [(f.field_number, f.wire_type, f.data) for f in UnknownFieldSet(msg)]


def known_of(msg) -> pb.SubmitRequest:
    copy = pb.SubmitRequest()
    copy.CopyFrom(msg)
    copy.DiscardUnknownFields()
    return copy


def test_fields_are_the_messages_fields_in_order_and_tile_it():
    msg, data = every_kind()
    found = W.fields(data)
    assert found is not None
    assert b"".join(data[f.start:f.end] for f in found) == data
    assert [f.start for f in found[1:]] == [f.end for f in found[:-1]]
    numbers = [(f.number, f.wire_type) for f in found]
    assert numbers[-4:] == [(1000, W.VARINT), (1001, W.FIXED64), (1002, W.LENGTH_DELIMITED), (1003, W.FIXED32)]
    # each field alone parses as the message holding just that field's value
    for f in found:
        alone = pb.SubmitRequest.FromString(data[f.start:f.end])
        if f.number >= 1000:
            assert unknown_of(alone) == [u for u in unknown_of(msg) if u[0] == f.number]
        else:
            name = pb.SubmitRequest.DESCRIPTOR.fields_by_number[f.number].name
            assert alone.ListFields()[0][0].name == name
    by_number = {f.number: f for f in found}
    assert W.read_varint(data, by_number[3].value_start, by_number[3].end) == (300, by_number[3].end)
    assert data[by_number[1].value_start:by_number[1].end] == b"r-1"
    assert W.packed_varints(data, by_number[2]) == len(msg.token_ids)


@pytest.mark.parametrize("drop", [{1}, {2}, {6}, {2, 6}, {1000, 1002}, {7, 1003}, {11}])
def test_without_parses_as_the_message_without_those_fields(drop):
    msg, data = every_kind()
    found = W.fields(data)
    rest = pb.SubmitRequest.FromString(W.without(data, [f for f in found if f.number in drop]))
    expected = pb.SubmitRequest()
    expected.CopyFrom(msg)
    for number in drop - {1000, 1001, 1002, 1003}:
        expected.ClearField(pb.SubmitRequest.DESCRIPTOR.fields_by_number[number].name)
    assert known_of(rest) == known_of(expected)
    assert unknown_of(rest) == [u for u in unknown_of(msg) if u[0] not in drop]


def test_without_inside_an_enclosing_message():
    msg, inner = every_kind()
    data = delimited(1, inner)
    frame = W.fields(data)
    assert [(f.number, f.wire_type, f.value_start, f.end) for f in frame] == [(1, 2, len(data) - len(inner), len(data))]
    found = W.fields(data, frame[0].value_start, frame[0].end)
    rest = pb.SubmitRequest.FromString(W.without(data, [f for f in found if f.number == 2], frame[0].value_start))
    assert list(rest.token_ids) == [] and rest.request_id == msg.request_id and unknown_of(rest) == unknown_of(msg)


def test_unpacked_varints_are_read_as_runs_and_counted_like_the_parser():
    rng = random.Random(0)
    values = [rng.choice([0, 1, 127, 128, 2**14, 2**32 - 1, 2**64 - 1]) for _ in range(300)]
    elements = [tag(2, W.VARINT) + varint(v) for v in values]
    elements[7] = tag(2, W.VARINT) + b"\x80\x80\x00"  # not minimal: still one value
    elements[8] = tag(2, W.VARINT) + b"\xff" * 9 + b"\x7f"  # ten bytes: the most
    data = (b"".join(elements[:100]) + delimited(1, b"id") + b"".join(elements[100:])
            + delimited(2, b"".join(varint(v) for v in (1, 2, 3))) + tag(3, W.VARINT) + b"\x05")
    found = W.fields(data, varint_runs=(2,))
    assert [(f.number, f.wire_type, f.count) for f in found] == [
        (2, W.VARINT, 100), (1, W.LENGTH_DELIMITED, 1), (2, W.VARINT, 200), (2, W.LENGTH_DELIMITED, 1),
        (3, W.VARINT, 1),
    ]
    parsed = pb.SubmitRequest.FromString(data)
    counted = sum(f.count if f.wire_type == W.VARINT else W.packed_varints(data, f) for f in found if f.number == 2)
    assert counted == len(parsed.token_ids) == 303
    # without runs each element is a field of its own
    assert len(W.fields(data)) == 303
    rest = pb.SubmitRequest.FromString(W.without(data, [f for f in found if f.number == 2]))
    assert rest.request_id == "id" and rest.max_new_tokens == 5 and not rest.token_ids


def test_an_overlong_varint_ends_a_run_and_the_reader_gives_up_as_the_parser_does():
    data = tag(2, W.VARINT) + b"\x01" + tag(2, W.VARINT) + b"\xff" * 10 + b"\x01"
    assert W.fields(data, varint_runs=(2,)) is None and not parses(data)


@pytest.mark.parametrize("payload, count", [
    (b"", 0), (b"\x00", 1), (b"\x7f\x80\x01", 2), (b"\xff" * 9 + b"\x01", 1),
    (b"\x80\x00" * 5, 5), (b"\x01\xff", None), (b"\xff" * 10 + b"\x01", None),
])
def test_packed_varints_count_as_the_parser_or_refuse_with_it(payload, count):
    data = delimited(2, payload)
    (f,) = W.fields(data)
    assert W.packed_varints(data, f) == count
    if count is None:
        assert not parses(data)
    else:
        assert len(pb.SubmitRequest.FromString(data).token_ids) == count


def test_every_truncation_is_refused_by_the_reader_exactly_when_by_the_parser():
    _, data = every_kind()
    for cut in range(len(data)):
        assert (W.fields(data[:cut]) is not None) == parses(data[:cut]), cut


@pytest.mark.parametrize("data", [
    tag(3, W.VARINT)[:1] + b"\x80\x80\x80\x80\x80\x00\x05",  # a tag of 6 bytes
    b"\x00\x01",  # field number 0
    b"\x1e\x01", b"\x1f\x01",  # wire types 6 and 7
    tag(7, W.END_GROUP),  # an end without a start
    delimited(1, b"abc")[:-1],  # a length past the end
    tag(1, W.LENGTH_DELIMITED) + b"\x80\x80\x80\x80\x80\x00",  # a length of 6 bytes
    tag(7, W.FIXED64) + b"\x00" * 7,
    tag(3, W.VARINT) + b"\xff" * 10 + b"\x01",  # a varint of 11 bytes
])
def test_malformed_messages_are_given_up_and_the_parser_refuses_them(data):
    assert W.fields(data) is None
    assert not parses(data)
    assert isinstance(lenient(pb.SubmitRequest, submit_request)(data + b"\x00" * 0), Undecodable)


def test_groups_and_too_many_fields_are_left_to_the_parser():
    group = tag(7, W.START_GROUP) + tag(1, W.VARINT) + b"\x01" + tag(7, W.END_GROUP)
    assert parses(group) and W.fields(group) is None
    many = (tag(3, W.VARINT) + b"\x01") * 11
    assert W.fields(many, max_fields=10) is None and len(W.fields(many, max_fields=11)) == 11
    run = (tag(2, W.VARINT) + b"\x01") * 50  # one field as a run
    assert [f.count for f in W.fields(run, varint_runs=(2,), max_fields=1)] == [50]


def test_tags_and_lengths_of_up_to_five_bytes_are_read_as_the_parser_reads_them():
    data = b"\x98\x80\x80\x80\x00\x05" + b"\x0a\x83\x80\x80\x80\x00abc"  # max_new_tokens, request_id
    found = W.fields(data)
    assert [(f.number, f.wire_type) for f in found] == [(3, W.VARINT), (1, W.LENGTH_DELIMITED)]
    msg = pb.SubmitRequest.FromString(data)
    assert (msg.max_new_tokens, msg.request_id) == (5, "abc") == (W.read_varint(data, found[0].value_start, found[0].end)[0],
                                                                 data[found[1].value_start:found[1].end].decode())


# ---------------------------------------------------------------------------- outsized submits


def test_an_outsized_text_is_sized_and_spliced_out():
    msg = pb.SubmitRequest(request_id="big", text="word " * (BIG // 5 + 1), max_new_tokens=2, temperature=0.5,
                           stop_strings=["x"], json_object=True)
    data = msg.SerializeToString() + UNKNOWN
    got = submit_request(data)
    assert isinstance(got, OutsizedSubmit) and got.request_id == "big"
    assert got.prompt.given == ["text"]
    assert got.prompt.text == TextSize(len(msg.text), True)
    expected = pb.SubmitRequest.FromString(data)
    expected.ClearField("text")
    assert known_of(got.rest) == known_of(expected) and unknown_of(got.rest) == unknown_of(expected)
    assert got.whole() == pb.SubmitRequest.FromString(data) and got.data is None
    assert got.prompt.min_tokens(4, None) == min_tokens([msg.text], 4) == -(-len(msg.text) // 4)


def test_the_last_text_field_is_the_prompt_as_for_the_parser():
    big, small = delimited(5, b"x" * BIG), delimited(5, "é!".encode())
    got = submit_request(big + small)
    assert got.prompt.text == TextSize(3, False) and got.prompt.given == ["text"]
    assert pb.SubmitRequest.FromString(big + small).text == "é!"
    emptied = submit_request(big + delimited(5, b""))
    assert emptied.prompt.given == [] and pb.SubmitRequest.FromString(big + delimited(5, b"")).text == ""


def test_a_text_that_is_not_ascii_is_flagged_and_its_utf8_left_to_the_whole_parse():
    text = "é" * (BIG // 2)
    got = submit_request(pb.SubmitRequest(text=text).SerializeToString())
    assert got.prompt.text == TextSize(len(text.encode()), False)
    bad = submit_request(delimited(5, b"\xff" * BIG))  # not UTF-8: only the whole parse says so
    assert bad.prompt.text == TextSize(BIG, False)
    assert isinstance(bad.whole(), Undecodable)


@pytest.mark.parametrize("packed", [True, False])
def test_outsized_token_ids_are_counted_without_a_list(packed):
    rng = random.Random(1)
    ids = [rng.randrange(200_000) for _ in range(BIG // 2)]
    if packed:
        data = pb.SubmitRequest(token_ids=ids, max_new_tokens=4).SerializeToString()
    else:
        data = b"".join(tag(2, W.VARINT) + varint(i) for i in ids) + tag(3, W.VARINT) + b"\x04"
    got = submit_request(data)
    assert got.prompt.num_token_ids == len(pb.SubmitRequest.FromString(data).token_ids) == len(ids)
    assert got.prompt.given == ["token_ids"] and not got.rest.token_ids and got.rest.max_new_tokens == 4
    assert list(got.whole().token_ids) == ids


def test_outsized_messages_are_sized_per_content_with_their_roles():
    msgs = [pb.ChatMessage(role="system", content="s"), pb.ChatMessage(role="user", content="w" * BIG),
            pb.ChatMessage(content="é")]
    data = pb.SubmitRequest(messages=msgs, enable_thinking=False).SerializeToString()
    got = submit_request(data)
    assert got.prompt.given == ["messages"]
    assert got.prompt.contents == (TextSize(1, True), TextSize(BIG, True), TextSize(2, False))
    assert not got.prompt.roles_known and got.prompt.min_tokens(4, None) == 0  # the worker names messages[2]
    msgs[2].role = "assistant"
    known = submit_request(pb.SubmitRequest(messages=msgs).SerializeToString())
    assert known.prompt.roles_known and known.prompt.min_tokens(4, None) == -(-(BIG + 3) // 4)
    assert known.prompt.min_tokens(4, "NFC") == -(-(-(-(BIG + 3) // 3)) // 4)  # not ASCII: it may shrink


def test_two_prompt_forms_are_both_given():
    data = pb.SubmitRequest(token_ids=[1], text="x" * BIG).SerializeToString()
    assert submit_request(data).prompt.given == ["token_ids", "text"]


@pytest.mark.parametrize("data", [
    pb.SubmitRequest(text="x" * (OUTSIZED_CHARS - 100)).SerializeToString(),  # not outsized
    pb.SubmitRequest(text="x", stop_strings=["s" * BIG]).SerializeToString(),  # not the prompt
    delimited(5, b"x" * BIG) + tag(5, W.VARINT) + b"\x01",  # a prompt field of another wire type
    delimited(5, b"x" * BIG) + delimited(1, b"\xff"),  # the rest is not valid
    delimited(6, delimited(1, b"user") + tag(2, W.VARINT) + b"\x01") + delimited(5, b"x" * BIG),
    delimited(2, b"\x01" * BIG + b"\x80"),  # packed, cut in a varint
    delimited(5, b"x" * BIG)[:-1],  # truncated
])
def test_what_needs_the_parsers_verdict_is_parsed_whole(data):
    assert submit_request(data) is None
    whole = lenient(pb.SubmitRequest, submit_request)(data)
    assert isinstance(whole, (pb.SubmitRequest, Undecodable))
    assert isinstance(whole, Undecodable) == (not parses(data))


def test_a_stream_frame_of_one_outsized_submit():
    msg = pb.SubmitRequest(request_id="f", text="x" * BIG, max_new_tokens=3)
    data = pb.StreamEventsRequest(submit=msg).SerializeToString()
    got = stream_events_request(data)
    assert got.frame and got.prompt.text == TextSize(BIG, True) and got.rest.max_new_tokens == 3
    assert got.whole() == msg
    two = data + pb.StreamEventsRequest(cancel=pb.CancelRequest(request_ids=["a"])).SerializeToString()
    assert stream_events_request(two) is None  # (the oneof's last member wins: the parser's to say)
    assert stream_events_request(pb.StreamEventsRequest(submit=pb.SubmitRequest(text="x")).SerializeToString()) is None


@pytest.mark.parametrize("texts", [["a" * 100], ["é" * 50, "b"], ["\u1100\u1161" * 30], ["가" * 30]])
@pytest.mark.parametrize("normal_form", [None, "NFC"])
def test_min_tokens_of_sizes_bounds_min_tokens(texts, normal_form):
    sizes = [(len(t.encode()), t.isascii()) for t in texts]
    of_sizes = min_tokens_of_sizes(sizes, 3, normal_form)
    assert of_sizes <= min_tokens(texts, 3, normal_form)
    if normal_form is None or all(t.isascii() for t in texts):
        assert of_sizes == min_tokens(texts, 3, normal_form)
    assert min_tokens_of_sizes(sizes, 0, normal_form) == 0


def test_slices_count_and_check_across_their_borders():
    n = 3 * W.SLICE + 5
    ids = bytes([0x81, 0x01]) * (n // 2)  # 2-byte varints straddling every border
    data = delimited(2, ids)
    (f,) = W.fields(data)
    assert W.packed_varints(data, f) == len(pb.SubmitRequest.FromString(data).token_ids) == n // 2
    assert W.count_varints(data, f.value_start, f.end) == n // 2
    for at in (W.SLICE - 4, W.SLICE - 1, 2 * W.SLICE + 3):  # an overlong varint across a border
        bad = bytearray(b"\x01" * n)
        bad[at:at + 10] = b"\xff" * 10
        data = delimited(2, bytes(bad))
        assert W.packed_varints(data, W.fields(data)[0]) is None and not parses(data)
    text = bytearray(b"a" * n)
    assert W.is_ascii(bytes(text), 0, n)
    for at in (0, W.SLICE - 1, W.SLICE, n - 1):
        text[at] = 0xC3
        assert not W.is_ascii(bytes(text), 0, n) and W.is_ascii(bytes(text), at + 1, n)
        text[at] = 0x61
