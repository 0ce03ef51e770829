"""Scheduling, batching and sampling around the model: the in-process engine.

The names below are imported on first use (PEP 562), as in ``qil_worker``: the torch-free front
imports the engine's torch-free modules (``schedule_policy``, ``sampling_params``) without
loading torch and the model code with ``Engine``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from qil_worker.engine.engine import Engine, EngineStats
    from qil_worker.engine.outputs import Event, FinishReason, RequestMetrics, Result
    from qil_worker.engine.sampling_params import SamplingParams

_LAZY = {
    "Engine": "qil_worker.engine.engine",
    "EngineStats": "qil_worker.engine.engine",
    "Event": "qil_worker.engine.outputs",
    "FinishReason": "qil_worker.engine.outputs",
    "RequestMetrics": "qil_worker.engine.outputs",
    "Result": "qil_worker.engine.outputs",
    "SamplingParams": "qil_worker.engine.sampling_params",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'qil_worker.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = ["Engine", "EngineStats", "Event", "FinishReason", "RequestMetrics", "Result", "SamplingParams"]
