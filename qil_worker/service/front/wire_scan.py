"""A reader of protobuf's wire format that finds a message's fields (tags and bounds) without
decoding their payloads, and splices fields out of a message: pure Python, protobuf-free.

It is for a message of megabytes whose bulk is one field: finding that field costs a few tags,
so the rest can be parsed without it. The reader gives up (``None``) wherever the parser's
verdict would need more than tags and lengths (groups, a field cut short, a tag or length that
is not a varint of at most 5 bytes, more fields than allowed): the caller then parses the
message whole and protobuf decides, as it would have. Whatever the reader accepts, protobuf's
parser (upb) accepts too, payloads apart (a string field's UTF-8 is not checked here).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

VARINT, FIXED64, LENGTH_DELIMITED, START_GROUP, END_GROUP, FIXED32 = range(6)
MAX_FIELD_NUMBER = (1 << 29) - 1
# ...of one message (a run below counts as one): walking many small fields in Python would cost
# what the reader saves; such a message is parsed whole.
MAX_FIELDS = 4096

_FIXED_SIZE = {FIXED64: 8, FIXED32: 4}
# each byte of a varint → 1 while it has the continuation bit, 0 for its last byte
_CONTINUES = bytes(int(b >= 0x80) for b in range(256))
_OVERLONG = b"\x01" * 10  # a varint has at most 10 bytes


@dataclass(frozen=True)
class Field:
    """One field of a message, or a run of consecutive varint fields with the same one-byte tag
    (an unpacked repeated field): ``data[start:end]`` is the field with its tag(s),
    ``data[value_start:end]`` its payload (for a run, from its first value on)."""

    number: int
    wire_type: int
    start: int
    value_start: int
    end: int
    count: int = 1  # the varints of a run

    @property
    def size(self) -> int:
        return self.end - self.value_start


def read_varint(data: bytes | memoryview, pos: int, end: int, max_bytes: int = 10) -> tuple[int, int] | None:
    """(value, position after it), or None when no varint of at most ``max_bytes`` bytes ends
    before ``end``."""
    value = shift = 0
    for i in range(pos, min(end, pos + max_bytes)):
        byte = data[i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i + 1
        shift += 7
    return None


def _run_pattern(tag: int) -> re.Pattern[bytes]:
    element = re.escape(bytes([tag])) + rb"[\x80-\xff]{0,9}[\x00-\x7f]"
    return re.compile(b"(?:" + element + b")++")  # possessive: linear, no backtracking


_RUN_PATTERNS: dict[int, re.Pattern[bytes]] = {}


def fields(
    data: bytes, start: int = 0, end: int | None = None, *,
    varint_runs: Iterable[int] = (), max_fields: int = MAX_FIELDS,
) -> list[Field] | None:
    """The fields of the message ``data[start:end]`` in order, or None (see the module).

    ``varint_runs``: numbers (1 to 15: one-byte tags) of repeated varint fields that may come
    unpacked, one field per element; consecutive elements are read as one ``Field`` at the
    speed of a regular expression.
    """
    end = len(data) if end is None else end
    runs = {}
    for number in varint_runs:
        assert 1 <= number < 16, number
        runs[number] = _RUN_PATTERNS.setdefault(number, _run_pattern(number << 3 | VARINT))
    found: list[Field] = []
    pos = start
    while pos < end:
        if len(found) >= max_fields:
            return None
        tag = read_varint(data, pos, end, 5)
        if tag is None:
            return None
        number, wire_type, value_start = tag[0] >> 3, tag[0] & 7, tag[1]
        if not 1 <= number <= MAX_FIELD_NUMBER:
            return None
        if wire_type == VARINT:
            run = runs.get(number) if value_start == pos + 1 else None
            match = run.match(data, pos, end) if run is not None else None
            if match is not None:
                count = count_varints(data, pos, match.end()) // 2  # a tag and a value each end one
                found.append(Field(number, wire_type, pos, value_start, match.end(), count))
                pos = match.end()
                continue
            value = read_varint(data, value_start, end)
            if value is None:
                return None
            field_end = value[1]
        elif wire_type == LENGTH_DELIMITED:
            length = read_varint(data, value_start, end, 5)
            if length is None or length[0] > end - length[1]:
                return None
            value_start, field_end = length[1], length[1] + length[0]
        elif wire_type in _FIXED_SIZE:
            field_end = value_start + _FIXED_SIZE[wire_type]
            if field_end > end:
                return None
        else:  # groups (deprecated; proto3 has none) and the unused wire types 6 and 7
            return None
        found.append(Field(number, wire_type, pos, value_start, field_end))
        pos = field_end
    return found


# Payloads are checked a slice at a time: a slice of megabytes would be a fresh mapping (the
# front maps large blocks on their own, ``freed_memory.map_large_blocks``), page-faulted in
# for one look; slices of this size come from the heap, the same memory each time.
SLICE = 64 << 10


def count_varints(data: bytes, start: int, end: int) -> int:
    """How many varints end in ``data[start:end]`` (its bytes below 0x80), counted in C."""
    count = 0
    for i in range(start, end, SLICE):
        count += data[i:min(i + SLICE, end)].translate(_CONTINUES).count(0)
    return count


def packed_varints(data: bytes, field: Field) -> int | None:
    """The number of values in a packed repeated varint field, or None when its payload is not
    a sequence of whole varints of at most 10 bytes (the parser refuses it)."""
    start, end = field.value_start, field.end
    if start == end:
        return 0
    if data[end - 1] >= 0x80:
        return None
    count = 0
    for i in range(start, end, SLICE):
        # (9 bytes more: an overlong varint across the slices' border)
        mask = data[i:min(i + SLICE + 9, end)].translate(_CONTINUES)
        if _OVERLONG in mask:
            return None
        count += mask.count(0, 0, SLICE)
    return count


def is_ascii(data: bytes, start: int, end: int) -> bool:
    """Whether ``data[start:end]`` is ASCII."""
    return all(data[i:min(i + SLICE, end)].isascii() for i in range(start, end, SLICE))


def without(data: bytes, dropped: Sequence[Field], start: int = 0, end: int | None = None) -> bytes:
    """The message ``data[start:end]`` less the given fields of it (in the order ``fields``
    found them): protobuf parses it as that message without them, each field being whole and
    self-delimiting."""
    view = memoryview(data)
    kept, pos = [], start
    for field in dropped:
        kept.append(view[pos:field.start])
        pos = field.end
    kept.append(view[pos:len(data) if end is None else end])
    return b"".join(kept)
