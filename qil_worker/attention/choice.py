"""Which attention backend an engine runs: the requested name, checked once at start-up.

``auto`` on a CUDA device times every backend that works here — the varlen kernels (paged,
packed) and gather + SDPA — on one synthetic decode step and takes the fastest
(``measure``); if the timing itself fails, the paged kernel where it works, else gather + SDPA.
Off CUDA ``auto`` is the CPU's own SDPA paths. An explicit varlen choice that does not work
here is an error. Whether a varlen kernel works is found by ``probe_varlen``: it runs the
backend on small inputs and compares the result with plain SDPA, so a kernel that runs but
aligns the causal mask differently is refused too.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from qil_worker.attention import measure
from qil_worker.attention.backend import AttentionBackend
from qil_worker.attention.cpu import CpuAttention
from qil_worker.attention.names import ATTENTION_CHOICES, PACKED, PAGED, SDPA, SEGMENTS
from qil_worker.attention.sdpa import GatherSdpa
from qil_worker.attention.segments import VarlenSegments, segment_metadata, torch_segment_attn
from qil_worker.attention.varlen import VarlenPacked, VarlenPaged, takes_block_table, torch_varlen_attn

log = logging.getLogger(__name__)


def cpu_kernels(device: torch.device) -> bool:
    """Whether ``sdpa`` on ``device`` means the CPU's own paths (``cpu.CpuAttention``) rather
    than the portable wiring CUDA runs (``sdpa.GatherSdpa``) — one switch, so that a test can
    run the CUDA wiring on a CPU."""
    return device.type == "cpu"


def choose_backend(
    requested: str, device: torch.device, dtype: torch.dtype, page_size: int, heads: int, kv_heads: int, dim: int
) -> tuple[AttentionBackend, str | None]:
    """(backend, why the paged varlen kernel is not used, or None) for ``requested`` in
    ``ATTENTION_CHOICES``."""
    if requested not in ATTENTION_CHOICES:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION_CHOICES)}, got {requested!r}")
    portable = CpuAttention() if cpu_kernels(device) else GatherSdpa()
    if requested == SDPA:
        return portable, None
    if requested != "auto":
        why_not = probe_varlen(device, dtype, page_size, heads, kv_heads, dim, requested)
        if why_not is not None:
            raise ValueError(f"attention {requested!r} is unavailable: {why_not}")
        return varlen_backend(requested), None
    name, why_not = auto_choice(device, dtype, page_size, heads, kv_heads, dim)
    if name == SDPA:
        return portable, why_not
    return varlen_backend(name), why_not


def varlen_backend(name: str) -> AttentionBackend:
    """A varlen backend by name, on this build's kernels."""
    return {PAGED: VarlenPaged, PACKED: VarlenPacked, SEGMENTS: VarlenSegments}[name]()


def auto_choice(
    device: torch.device, dtype: torch.dtype, page_size: int, heads: int, kv_heads: int, dim: int
) -> tuple[str, str | None]:
    """``auto``'s backend name, and why not the paged kernel (None if it is)."""
    why_not = probe_varlen(device, dtype, page_size, heads, kv_heads, dim, PAGED)
    working = [PAGED] if why_not is None else []
    if device.type == "cuda":
        working += [mode for mode in (PACKED, SEGMENTS)
                    if probe_varlen(device, dtype, page_size, heads, kv_heads, dim, mode) is None]
    if not working:
        return SDPA, why_not
    if device.type != "cuda":  # a test's stand-in kernel: nothing to time it against
        return working[0], why_not
    best, timings = fastest_on(device, dtype, page_size, heads, kv_heads, dim, tuple(working))
    if best == PAGED:
        return PAGED, None
    return best, why_not or f"measured slower here ({timings})"


@functools.lru_cache(maxsize=None)
def fastest_on(
    device: torch.device, dtype: torch.dtype, page_size: int, heads: int, kv_heads: int, dim: int,
    working: tuple[str, ...],
) -> tuple[str, str]:
    """(the fastest of the ``working`` varlen backends and gather + SDPA on a CUDA device, the
    timings as text), measured once per process and shape: every engine of the process then
    runs the same backend. If the timing fails, the first of ``working``."""
    backends = [varlen_backend(name) for name in working] + [GatherSdpa()]
    try:
        work = measure.decode_workload(device, dtype, page_size, heads, kv_heads, dim)
        best, seconds = measure.fastest_backend(backends, work, measure.device_timer(device))
        del work
    except Exception as exc:  # noqa: BLE001 - timing is an optimisation: keep the preference order
        log.warning("attention: timing the backends failed (%s: %s); not measured", type(exc).__name__, exc)
        return working[0], "not measured"
    timings = ", ".join(f"{name} {1e3 * s:.2f} ms" for name, s in seconds.items())
    log.info("attention: %s, the fastest of a %d-row decode step's attention here (%s)",
             best.name, measure.ROWS, timings)
    return best.name, timings


def probe_varlen(
    device: torch.device, dtype: torch.dtype, page_size: int, heads: int, kv_heads: int, dim: int, mode: str = PAGED
) -> str | None:
    """None if ``mode`` (``PAGED``, ``PACKED`` or ``SEGMENTS``) works here and agrees with SDPA,
    else why not. ``SEGMENTS`` runs its prefill steps packed, so it needs both kernels."""
    if device.type != "cuda":
        return "not a CUDA device"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"flash attention needs float16/bfloat16, not {dtype}"
    fn = torch_varlen_attn()
    if fn is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    if mode == PAGED and not takes_block_table(fn):
        return f"torch {torch.__version__} has no varlen_attn with a block table"
    if mode == SEGMENTS:
        kernel = torch_segment_attn()
        if kernel is None:
            return f"torch {torch.__version__} has no flash kernel taking seqused_k"
        try:
            why = _check_segments_against_sdpa(device, dtype, page_size, heads, kv_heads, dim, kernel)
        except Exception as exc:  # noqa: BLE001 - any failure means: use another path
            return f"the flash kernel failed on page-by-page decoding: {type(exc).__name__}: {exc}"
        return why or probe_varlen(device, dtype, page_size, heads, kv_heads, dim, PACKED)
    try:
        for q_lens, causal in (((2, 1), True), ((1, 1), False)):  # chunks; decode rows as graphs run them
            why = _check_against_sdpa(device, dtype, page_size, heads, kv_heads, dim, mode, q_lens, causal)
            if why is not None:
                return why
        return None
    except Exception as exc:  # noqa: BLE001 - any failure means: use the portable path
        return f"varlen_attn failed on this build/page size: {type(exc).__name__}: {exc}"


class _Pool:
    """What ``varlen.VarlenMetadata.attend`` reads of a ``KVCache`` (one layer), for the probe."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k[None], v[None]

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer].index_select(0, slots), self.v[layer].index_select(0, slots)


def _check_against_sdpa(
    device: torch.device, dtype: torch.dtype, page_size: int, heads: int, kv_heads: int, dim: int, mode: str,
    q_lens: tuple[int, int] = (2, 1), causal: bool = True,
) -> str | None:
    """Two requests with 5 and 2 keys and ``q_lens`` queries (their last positions); request 1's
    pages come first in the pool."""
    backend = VarlenPacked() if mode == PACKED else VarlenPaged()
    lengths = (5, 2)
    pages = [-(-n // page_size) for n in lengths]
    first_page = (pages[1], 0)
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(sum(q_lens), heads, dim, device=device, dtype=dtype, generator=gen)
    k = torch.randn(sum(pages) * page_size, kv_heads, dim, device=device, dtype=dtype, generator=gen)
    v = torch.randn(sum(pages) * page_size, kv_heads, dim, device=device, dtype=dtype, generator=gen)
    i32 = dict(device=device, dtype=torch.int32)
    slots = [list(range(first * page_size, first * page_size + n)) for first, n in zip(first_page, lengths)]
    table = [[first + j for j in range(max(pages))] for first in first_page]  # past the end: unread
    meta = backend.metadata(
        slot_mapping=torch.zeros(0, dtype=torch.long, device=device),
        cu_seq_q=torch.tensor([0, q_lens[0], sum(q_lens)], **i32),
        cu_seq_k=torch.tensor([0, lengths[0], sum(lengths)], **i32),
        seq_used_k=torch.tensor(lengths, **i32),
        tables=torch.tensor(table, device=device).clamp_(max=sum(pages) - 1),
        max_q=max(q_lens),
        max_k=max(lengths),
        causal=causal,
        page_size=page_size,
        key_slots=None if mode == PAGED else torch.tensor(slots[0] + slots[1], device=device),
    )
    got = meta.attend(q, _Pool(k, v), 0).view(q.shape).float()
    want = []
    for (start, end), request_slots in zip(((0, q_lens[0]), (q_lens[0], sum(q_lens))), slots):
        index = torch.tensor(request_slots, device=device)
        keys = k.index_select(0, index).float().repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        values = v.index_select(0, index).float().repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        n_q, n_k = end - start, len(request_slots)
        mask = torch.arange(n_k, device=device)[None, :] <= torch.arange(n_k - n_q, n_k, device=device)[:, None]
        out = F.scaled_dot_product_attention(q[start:end].float().transpose(0, 1), keys, values, attn_mask=mask)
        want.append(out.transpose(0, 1))
    error = (got - torch.cat(want)).abs().max().item()
    kind = "causal" if causal else "decode"
    return None if error < 2e-2 else f"{mode} attention ({kind}) differs from SDPA by {error:.3g}"


def _check_segments_against_sdpa(
    device: torch.device, dtype: torch.dtype, page_size: int, heads: int, kv_heads: int, dim: int,
    kernel,
) -> str | None:
    """Decode rows of ``2 * page_size + 1`` and 2 keys, page by page: the first row's pages out
    of order, both tables padded with a page past their keys (the scratch page of a graph)."""
    lengths = (2 * page_size + 1, 2)
    tables_list = [[3, 0, 2, 4], [1, 4, 4, 4]]
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(len(lengths), heads, dim, device=device, dtype=dtype, generator=gen)
    k = torch.randn(5 * page_size, kv_heads, dim, device=device, dtype=dtype, generator=gen)
    v = torch.randn(5 * page_size, kv_heads, dim, device=device, dtype=dtype, generator=gen)
    tables = torch.tensor(tables_list, device=device)
    positions = torch.tensor([n - 1 for n in lengths], device=device)
    meta = segment_metadata(torch.zeros(0, dtype=torch.long, device=device), tables, positions + 1, page_size, kernel)
    got = meta.attend(q, _Pool(k, v), 0).view(q.shape).float()
    want = []
    for r, n in enumerate(lengths):
        slots = torch.tensor([tables_list[r][j // page_size] * page_size + j % page_size for j in range(n)],
                             device=device)
        keys = k.index_select(0, slots).float().repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        values = v.index_select(0, slots).float().repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        out = F.scaled_dot_product_attention(q[r : r + 1].float().transpose(0, 1), keys, values)
        want.append(out.transpose(0, 1))
    error = (got - torch.cat(want)).abs().max().item()
    return None if error < 2e-2 else f"{SEGMENTS} attention (decode) differs from SDPA by {error:.3g}"
