"""Names of the weight quantizations a worker can apply at load (torch-free, so the front's CLI
offers them): ``none`` keeps the weights in the compute dtype; ``int8`` stores every projection
as per-output-channel int8 (``model.int8_linear``); ``int4`` and ``int4-g32`` as group-wise
asymmetric 4-bit codes, one scale and zero per 128 or 32 inputs (``model.int4_linear``)."""

from __future__ import annotations

from qil_worker.errors import ConfigError

QUANTIZE_CHOICES = ("none", "int8", "int4", "int4-g32")


def resolve_quantize(quantize: str | None) -> str | None:
    """None or "none" → None; a choice → itself; anything else a ``ConfigError`` naming the flag."""
    if quantize is None or quantize == "none":
        return None
    if quantize not in QUANTIZE_CHOICES:
        raise ConfigError(f"quantize: {quantize!r} is not supported (expected one of {', '.join(QUANTIZE_CHOICES)})")
    return quantize
