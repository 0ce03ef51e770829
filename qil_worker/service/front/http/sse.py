"""Server-sent events: ``data: {json}\\n\\n`` per chunk and ``data: [DONE]\\n\\n`` at the end,
each write timed on the call's ``WriteClock`` (a write that stays pending means the client
stopped reading: the same backlog rule as a gRPC stream then applies)."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from qil_worker.service.front.streams import WriteClock

HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # a proxy in front (nginx) must not hold the events back
}


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def encode(obj: Any) -> bytes:
    return b"data: " + dumps(obj).encode() + b"\n\n"


class ChunkFrame:
    """The event of one choice's chunk, ``{**head, "choices": [choice]}`` (and ``"usage":
    null`` when the call asked for usage), with the head encoded once per call: the same bytes
    as ``encode`` gives, at the cost of encoding the choice alone."""

    __slots__ = ("_before", "_after")

    def __init__(self, head: dict, usage_null: bool) -> None:
        self._before = b"data: " + dumps(head)[:-1].encode() + b',"choices":['
        self._after = b',"usage":null}\n\n' if usage_null else b"}\n\n"
        self._after = b"]" + self._after

    def encode(self, choice: dict) -> bytes:
        return self._before + dumps(choice).encode() + self._after


class EventStream:
    def __init__(self, request: web.Request, writes: WriteClock) -> None:
        self.request = request
        self.writes = writes
        self.response = web.StreamResponse(status=200, headers=HEADERS)

    async def open(self) -> None:
        await self.response.prepare(self.request)

    async def send(self, obj: Any) -> None:
        await self._write(encode(obj))

    async def send_raw(self, data: bytes) -> None:
        await self._write(data)

    async def close(self) -> None:
        await self._write(b"data: [DONE]\n\n")
        await self.response.write_eof()

    async def _write(self, data: bytes) -> None:
        self.writes.started()
        await self.response.write(data)  # waits while the client's socket buffer is full
        self.writes.done()
