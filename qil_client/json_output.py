"""Protobuf messages as JSON objects for the CLI (``generate --json``, ``info``).

protobuf's ``MessageToDict`` leaves out every field at proto3's zero (the first event's ``seq``,
``finished: false``) and writes 64-bit integers as strings (for JavaScript's doubles), so one
stream's lines would change shape from event to event. Here every field is written, integers as
numbers; a field with presence (``optional``, a oneof member, a message) only when it is set, as
its absence means something (no tokenizer: no ``text``).
"""

from __future__ import annotations

import base64
import math
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message


def message_to_dict(message: Message) -> dict[str, Any]:
    """``message`` as a dict ready for ``json.dumps``: proto field names, enums by name."""
    out: dict[str, Any] = {}
    for f in message.DESCRIPTOR.fields:
        value = getattr(message, f.name)
        if f.is_repeated:
            entry = f.message_type
            if entry is not None and entry.GetOptions().map_entry:
                value_field = entry.fields_by_name["value"]
                out[f.name] = {str(k): _value(value_field, v) for k, v in value.items()}
            else:
                out[f.name] = [_value(f, v) for v in value]
        elif not f.has_presence or message.HasField(f.name):
            out[f.name] = _value(f, value)
    return out


def _value(f: FieldDescriptor, value: Any) -> Any:
    if f.type == FieldDescriptor.TYPE_MESSAGE:
        return message_to_dict(value)
    if f.type == FieldDescriptor.TYPE_ENUM:
        known = f.enum_type.values_by_number.get(value)
        return known.name if known is not None else value
    if f.type == FieldDescriptor.TYPE_BYTES:
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, float) and not math.isfinite(value):
        # JSON has no infinities or NaN (json.dumps would write invalid JSON): protobuf's names
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return value
