"""qil: a from-scratch inference engine for Qwen3 dense models, served over gRPC."""

from qil_worker.config import Qwen3Config
from qil_worker.engine import Engine, EngineStats, Event, FinishReason, Result
from qil_worker.errors import (
    CapacityError,
    ConfigError,
    DuplicateRequestError,
    InvalidRequestError,
    QilError,
    UnknownRequestError,
    WeightError,
)
from qil_worker.model import Qwen3

__version__ = "0.1.0"

__all__ = [
    "CapacityError",
    "ConfigError",
    "DuplicateRequestError",
    "Engine",
    "EngineStats",
    "Event",
    "FinishReason",
    "InvalidRequestError",
    "QilError",
    "Qwen3",
    "Qwen3Config",
    "Result",
    "UnknownRequestError",
    "WeightError",
    "__version__",
]
