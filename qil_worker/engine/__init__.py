"""Scheduling, batching and sampling around the model: the in-process engine."""

from qil_worker.engine.engine import Engine, EngineStats
from qil_worker.engine.outputs import Event, FinishReason, RequestMetrics, Result
from qil_worker.engine.sampling_params import SamplingParams

__all__ = ["Engine", "EngineStats", "Event", "FinishReason", "RequestMetrics", "Result", "SamplingParams"]
