"""Server-sent events: ``data: {json}\\n\\n`` per chunk and ``data: [DONE]\\n\\n`` at the end,
each write timed on the call's ``WriteClock`` (a write that stays pending means the client
stopped reading: the same backlog rule as a gRPC stream then applies)."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from qil_worker.service.streams import WriteClock

HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # a proxy in front (nginx) must not hold the events back
}


def encode(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class EventStream:
    def __init__(self, request: web.Request, writes: WriteClock) -> None:
        self.request = request
        self.writes = writes
        self.response = web.StreamResponse(status=200, headers=HEADERS)

    async def open(self) -> None:
        await self.response.prepare(self.request)

    async def send(self, obj: Any) -> None:
        await self._write(encode(obj))

    async def close(self) -> None:
        await self._write(b"data: [DONE]\n\n")
        await self.response.write_eof()

    async def _write(self, data: bytes) -> None:
        self.writes.started()
        await self.response.write(data)  # waits while the client's socket buffer is full
        self.writes.done()
