"""The varlen backends made selectable by name on any device, computed by the package's
plain-torch reference kernel (torch's varlen flash kernel is CUDA only)."""

from qil_worker.attention import PACKED, choice, varlen
from qil_worker.attention.reference import reference_varlen_attn


def use_reference_varlen(monkeypatch, modes=(PACKED,)) -> None:
    """Make ``attention=`` each of ``modes`` selectable here, computed by
    ``reference_varlen_attn`` (the others stay unavailable, so ``auto`` still means SDPA off CUDA
    unless ``modes`` holds the paged kernel)."""

    def probe(device, dtype, page_size, heads, kv_heads, dim, mode=varlen.PAGED):
        return None if mode in modes else "only the reference kernel here"

    monkeypatch.setattr(varlen, "torch_varlen_attn", lambda: reference_varlen_attn)
    monkeypatch.setattr(choice, "probe_varlen", probe)


def use_reference_packed_kernel(monkeypatch) -> None:
    """``attention="varlen-packed"`` selectable here, by the reference kernel."""
    use_reference_varlen(monkeypatch, (PACKED,))
