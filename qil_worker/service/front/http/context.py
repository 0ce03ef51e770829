"""What every handler of the HTTP site reads: the front, health, the served model's name, the
token strings, the auth token and the metrics (``HttpContext``)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from qil_worker.service.front.http.token_strings import TokenStrings

if TYPE_CHECKING:
    from qil_worker.service.front.front import Front
    from qil_worker.service.front.health import Health

DEMO_MODEL_NAME = "qil-demo"


def served_model_name(model_dir: str | None, configured: str | None) -> str:
    """``--served-model-name``, else the model directory's name (``qil-demo`` for the demo)."""
    if configured:
        return configured
    if not model_dir:
        return DEMO_MODEL_NAME
    return os.path.basename(os.path.normpath(model_dir)) or model_dir


@dataclass
class HttpContext:
    front: "Front"
    health: "Health"
    model_name: str
    token_strings: TokenStrings
    auth_token: bytes | None
    metrics: object | None  # a metrics.Metrics (its registry is served at /metrics)
    created: int = field(default_factory=lambda: int(time.time()))  # the model's "created"
