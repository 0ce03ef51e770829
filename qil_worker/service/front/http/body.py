"""A call's JSON body: received within a time limit, parsed, and refused with a 400 naming
what is wrong (not valid JSON, nested too deep, a lone surrogate) before anything reads it."""

from __future__ import annotations

import asyncio
import json
import re

from aiohttp import web

from qil_worker.request_limits import MAX_JSON_DEPTH, json_fault
from qil_worker.service.errors import invalid

# a body not received within this long ends the call (a client trickling bytes holds a handler)
BODY_TIMEOUT_S = 60.0
# Where a body could hold a fault that ``json_fault`` finds: a lone surrogate only arrives as a
# \uD800-\uDFFF escape (raw UTF-8 cannot carry one), and nesting needs brackets. Most bodies
# have neither, and are not walked.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


async def read_body(request: web.Request) -> dict:
    try:
        raw = await asyncio.wait_for(request.read(), BODY_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise invalid("body", f"not received within {BODY_TIMEOUT_S:g}s") from None
    try:
        body = json.loads(raw)
    except RecursionError:
        raise invalid("body", f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid("body", f"not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise invalid("body", "must be a JSON object")
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH or _SURROGATE_ESCAPE.search(raw):
        fault = json_fault(body)
        if fault is not None:
            path, what = fault
            top = path.split(".", 1)[0].split("[", 1)[0] or "body"
            raise invalid(top, what if path == top else f"{path[len(top):].lstrip('.')}: {what}")
    return body
