"""Warm the L2 cache with weight bytes that a later kernel of the decode step reads
(passes/prefetch_weights.py places the calls).

Public API::

    l2_prefetch(weights, nbytes)          # request bytes [0, nbytes[i]) of weights[i] into L2; returns at once
    l2_prefetch_ref(weights, nbytes)      # the function computed: nothing (a cache hint changes no value)
    prefetch_plan(ranges) -> Tensor       # the (range, byte offset, bytes) requests one launch makes (dry run)

Custom op (side-effecting: dead-code elimination keeps it; CPU = nothing to do)::

    dsv4c::l2_prefetch(Tensor[] weights, int[] nbytes) -> ()

Why: at batch 1 a decode step alternates between linears that stream their weights from HBM and runs of
small kernels that read almost nothing (norms, RoPE, the attention on short caches, routing). run62 (H100, the
2-layer slice): a CSA layer's attention run is about 43 µs of such kernels, then wo_a and wo_b stream 67 MB at
about 64% of copy bandwidth. A call placed at the start of such a run asks for the next linears' weights; the
memory system fills L2 while the small kernels run, and the linears then find those bytes in L2.
Measured a loss (run64, H200: the launches cost more than the one-token GEMV gains from L2), so no target asks
for it today (passes/prefetch_weights.py has the figures).

The kernel: program p, lane l issues one request per range for bytes [(p·LANES + l)·CHUNK, +CHUNK) clipped to
the range; nothing waits for the data (sm_90's bulk `cp.async.bulk.prefetch.L2.global`, one instruction per
request). The requests go out before the kernel's PDL wait:
weights are fixed before the step's chain starts (kernels/_tl.py's rule), so they race nothing; the wait keeps
the chain's order for the successor. A range starts 16-byte aligned and its length is a multiple of 16 (the
bulk form's rule): the wrapper clips each range inward to that.

Ranges: at most MAX_RANGES (4) per call; R ranges, bytes per range n_r.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from dsv4c.kernels import _tl as U

__all__ = ["l2_prefetch", "l2_prefetch_ref", "prefetch_plan", "MAX_RANGES"]

MAX_RANGES = 4
CHUNK = 4096  # bytes per request
LANES = 32  # requests per program and range (one warp)
# one request of $2 bytes at address $1 when $2 > 0 ($0: a dummy result; is_pure=False keeps the asm)
_BULK = tl.constexpr("{ .reg .pred p; setp.gt.s32 p, $2, 0; "
                     "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }")


@triton.jit
def _issue(addr, n, r, rec_ptr, CHUNK: tl.constexpr, LANES: tl.constexpr, DRY_RUN: tl.constexpr):
    """One range's requests of this program: addr (int64, 16-byte aligned) and n bytes (a multiple of 16).
    DRY_RUN: record (r, offset, bytes) per lane in rec_ptr [grid, R, LANES, 3] instead of issuing."""
    pid = tl.program_id(0)
    lane = tl.arange(0, LANES)
    off = (pid * LANES + lane).to(tl.int64) * CHUNK                                    # [L] bytes into the range
    size = tl.minimum(n - off, CHUNK).to(tl.int32)                                     # [L] <= 0: past the range
    if DRY_RUN:
        rec = rec_ptr + ((pid * 4 + r) * LANES + lane) * 3  # 4: MAX_RANGES
        ok = size > 0
        tl.store(rec, tl.where(ok, r, -1).to(tl.int64))
        tl.store(rec + 1, tl.where(ok, off, 0))
        tl.store(rec + 2, tl.where(ok, size, 0).to(tl.int64))
    else:
        tl.inline_asm_elementwise(_BULK, "=r,l,r", [addr + off, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_kernel(a0, n0, a1, n1, a2, n2, a3, n3, rec_ptr, R: tl.constexpr, CHUNK: tl.constexpr,
                     LANES: tl.constexpr, DRY_RUN: tl.constexpr, PDL: tl.constexpr = False):
    """Program p: the requests of every range at p (ranges R.. are absent), then the PDL wait."""
    _issue(a0, n0, 0, rec_ptr, CHUNK, LANES, DRY_RUN)
    if R > 1:
        _issue(a1, n1, 1, rec_ptr, CHUNK, LANES, DRY_RUN)
    if R > 2:
        _issue(a2, n2, 2, rec_ptr, CHUNK, LANES, DRY_RUN)
    if R > 3:
        _issue(a3, n3, 3, rec_ptr, CHUNK, LANES, DRY_RUN)
    U.pdl_wait(PDL)


def _aligned(addr: int, n: int) -> tuple[int, int]:
    """(start, bytes) of [addr, addr + n) clipped inward to 16-byte boundaries."""
    start = -(-addr // 16) * 16
    return start, max(0, (addr + n - start) // 16 * 16)


def _ranges(weights: list[torch.Tensor], nbytes: list[int]) -> list[tuple[int, int]]:
    """Checked (aligned address, bytes) per range; ranges of no bytes dropped."""
    if len(weights) != len(nbytes):
        raise ValueError(f"l2_prefetch: {len(weights)} weights but {len(nbytes)} byte counts")
    if len(weights) > MAX_RANGES:
        raise ValueError(f"l2_prefetch: at most {MAX_RANGES} weights per call, got {len(weights)}")
    out = []
    for i, (w, n) in enumerate(zip(weights, nbytes)):
        size = w.numel() * w.element_size()
        if not w.is_contiguous():
            raise ValueError(f"l2_prefetch: weights[{i}] {list(w.shape)} is not contiguous")
        if not 0 <= n <= size:
            raise ValueError(f"l2_prefetch: nbytes[{i}] = {n} is outside the tensor's {size} bytes")
        if w.device != weights[0].device:
            raise ValueError(f"l2_prefetch: weights[{i}] on {w.device}, weights[0] on {weights[0].device}")
        start, count = _aligned(w.data_ptr(), n)
        if count:
            out.append((start, count))
    return out


def _launch(ranges: list[tuple[int, int]], anchor: torch.Tensor, rec: torch.Tensor | None) -> None:
    """One launch for `ranges`; `anchor`: a tensor on the launch's device (the record buffer in a dry run)."""
    grid = (max(triton.cdiv(n, CHUNK * LANES) for _, n in ranges),)
    flat = [v for a, n in ranges for v in (a, n)] + [0, 0] * (MAX_RANGES - len(ranges))
    dry = rec is not None
    _prefetch_kernel[grid](*flat, rec if dry else anchor, R=len(ranges), CHUNK=CHUNK, LANES=LANES, DRY_RUN=dry,
                           num_warps=1, **U.pdl_launch(anchor))  # a dry run's anchor: CPU, PDL off


def l2_prefetch(weights: list[torch.Tensor], nbytes: list[int]) -> None:
    """Ask for bytes [0, nbytes[i]) of each CUDA tensor weights[i] (contiguous) to be brought into L2, clipped
    inward to 16-byte boundaries; one launch; nothing is waited for. CPU tensors: nothing to do."""
    ranges = _ranges(weights, nbytes)
    if not ranges or weights[0].device.type != "cuda":
        return
    if not U.pdl_supported(weights[0].device):
        raise RuntimeError(f"l2_prefetch: needs a GPU of sm_90+ (the bulk prefetch), got {weights[0].device}")
    _launch(ranges, weights[0], None)


def l2_prefetch_ref(weights: list[torch.Tensor], nbytes: list[int]) -> None:
    """The function computed: nothing. A cache hint changes no value the graph computes."""
    _ranges(weights, nbytes)


def prefetch_plan(ranges: list[tuple[int, int]]) -> torch.Tensor:
    """The requests one launch makes for `ranges` ((aligned address, bytes) as `_ranges` gives them), from the
    kernel's own index arithmetic under the Triton interpreter: int64 [k, 3] rows (range, byte offset, bytes)."""
    grid = max(triton.cdiv(n, CHUNK * LANES) for _, n in ranges)
    rec = torch.full((grid, MAX_RANGES, LANES, 3), -1, dtype=torch.int64)
    _launch(ranges, rec, rec)
    rows = rec.reshape(-1, 3)
    return rows[rows[:, 0] >= 0]


@torch.library.custom_op("dsv4c::l2_prefetch", mutates_args=())
def l2_prefetch_op(weights: list[torch.Tensor], nbytes: list[int]) -> None:
    """The op passes/prefetch_weights.py inserts: `l2_prefetch` on CUDA tensors, nothing elsewhere."""
    l2_prefetch(list(weights), list(nbytes))


@l2_prefetch_op.register_fake
def _l2_prefetch_fake(weights, nbytes) -> None:
    return None


torch.fx.node.has_side_effect(torch.ops.dsv4c.l2_prefetch.default)
