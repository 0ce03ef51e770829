"""Logging of the front and the worker: one format for both, ``text`` or ``json``.

Every line about a request carries its id: pass ``extra={"request_id": rid}`` (or use
``request_logger(log, rid)``); text lines then read ``... [req RID] message`` and JSON lines get
a ``request_id`` key. JSON lines are one object per line with ``ts``, ``level``, ``logger``,
``message``, ``process`` and, when present, ``request_id`` and ``exc``.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import sys
from typing import Any

FORMATS = ("text", "json")

TEXT_FORMAT = "%(asctime)s %(levelname)s [%(name)s %(process)d]%(request_tag)s %(message)s"


class _RequestTag(logging.Filter):
    """Gives every record a ``request_tag`` (``" [req RID]"`` or ``""``) for the text format."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = getattr(record, "request_id", None)
        record.request_tag = f" [req {rid}]" if rid else ""
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, Any] = {
            "ts": _dt.datetime.fromtimestamp(record.created, _dt.timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "process": record.process,
        }
        rid = getattr(record, "request_id", None)
        if rid:
            obj["request_id"] = rid
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            for k, v in fields.items():
                obj.setdefault(k, v)
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj, default=str)


def setup(level: str = "INFO", fmt: str = "text", stream: Any = None) -> None:
    """Configure the root logger of this process (replaces earlier handlers)."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {FORMATS}, got {fmt!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(_RequestTag())
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)


def request_logger(logger: logging.Logger, request_id: str) -> logging.LoggerAdapter:
    """A logger whose lines carry ``request_id``."""
    return logging.LoggerAdapter(logger, {"request_id": request_id})
