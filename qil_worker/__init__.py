"""qil: a from-scratch inference engine for Qwen3 dense models, served over gRPC."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from qil_worker.config import Qwen3Config
from qil_worker.errors import (
    CapacityError,
    ConfigError,
    DeviceFailedError,
    DuplicateRequestError,
    InvalidRequestError,
    QilError,
    UnknownRequestError,
    WeightError,
)

if TYPE_CHECKING:  # pragma: no cover
    from qil_worker.engine import Engine, EngineStats, Event, FinishReason, Result, SamplingParams
    from qil_worker.model import Qwen3

__version__ = "0.1.0"

# Imported on first use (PEP 562): the gRPC front imports qil_worker.service.* and must not pay
# for (or depend on) torch; only the worker process touches the engine and the model.
_LAZY = {
    "Engine": "qil_worker.engine",
    "EngineStats": "qil_worker.engine",
    "Event": "qil_worker.engine",
    "FinishReason": "qil_worker.engine",
    "Result": "qil_worker.engine",
    "SamplingParams": "qil_worker.engine",
    "Qwen3": "qil_worker.model",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'qil_worker' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "CapacityError", "ConfigError", "DeviceFailedError", "DuplicateRequestError", "Engine", "EngineStats", "Event",
    "FinishReason", "InvalidRequestError", "QilError", "Qwen3", "Qwen3Config", "Result",
    "SamplingParams", "UnknownRequestError", "WeightError", "__version__",
]
