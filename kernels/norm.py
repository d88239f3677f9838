"""RMSNorm (`dsv4c.model.common.RMSNorm`) as one Triton kernel, in two variants chosen by row count.

Public API::

    rms_norm(x, w, eps, cast_first=False, exact=None) -> Tensor   # one launch (variant: below)
    rms_norm_ref(x, w, eps, cast_first=False)         # RMSNorm.forward, unchanged (the spec of both)
    reduce_layout(rows, C) -> ReduceLayout            # PyTorch's CUDA order for a row's mean
    torch_cuda_row_sum(v, rows=None) -> Tensor        # that order in torch ops (the exact kernel's spec)

Custom ops (the target of passes/fuse_rmsnorm.py; CPU = the reference)::

    dsv4c::rms_norm(Tensor x, Tensor w, float eps, bool cast_first) -> Tensor     # variant by rows
    dsv4c::rms_norm_bi(Tensor x, Tensor w, float eps, bool cast_first) -> Tensor  # the fast one always

Semantics, per row of x [..., C] (r = x·rsqrt(mean(x²) + eps) in fp32):
    V4 order (cast_first=False):  out = (w_f32 · r).to(x.dtype)
    V3 order (cast_first=True):   out = w · r.to(x.dtype)   (dtype: promote(w, x); the product of two
                                  values is formed in fp32 and rounded once, as PyTorch does)
Eagerly that is ~6 ATen launches per norm (casts, pow, mean, add, rsqrt, two muls); here one
program per row. Grid = rows, fixed by the shape, no host sync: capture-safe.

Variants. Launches of at least EXACT_ROWS_MIN rows (prefill chunks) run `_rms_norm_exact_kernel`,
which rounds like eager on CUDA (below); fewer rows (decode: batch x (1 + k) tokens) run
`_rms_norm_kernel`, one row in registers, a tree sum in Triton's order: fp32 a few ulp from eager,
low-precision outputs within one rounding. The exact kernel cost the slice's decode step 0.26 ms
on the H200 (BENCHMARKS.md, 2026-12-02), so decode keeps the fast kernel, unchanged. Both are
batch-invariant on their own (a row's order is fixed by C); the choice by row count is not, so the
deterministic mode uses `dsv4c::rms_norm_bi` (the fast kernel at any row count).

The exact kernel: rounding like eager (issue 22). Every fp32 operation of the eager graph is done once, in its order:
x² rounded (no FMA: the kernel is compiled with `enable_fp_fusion=False`), the sum of the squares in
the order PyTorch's CUDA reduction kernel (ATen/native/cuda/Reduce.cuh, `mean` = MeanOps) sums one
row, times fl(1/C), + eps, `rsqrt` (the hardware rsqrt.approx, as CUDA's rsqrtf), x·rsqrt, w·r,
one cast. A kernel that sums in its own order gives fp32 values a few ulp off eager's, which move
single bf16 roundings; on the random-weight slice's prefill graph such moves cost 3 dB of logits
SNR (BENCHMARKS.md, 2026-12-01), as much as a whole different evaluation order of the model.

PyTorch's order for a row of C contiguous fp32 values, R rows (`reduce_layout`): a block of BW lanes
(× YS warps when the row is split across warps) reads the row; vectorised (C >= 128) lane t reads
the float4 vectors t, t + BW·YS, t + 2·BW·YS, ... into four accumulators (one per vector element,
each summed in order), otherwise it reads elements t + BW·YS·(4m + i) into accumulator i. Each
thread adds its accumulators in order ((a0 + a1) + a2) + a3, then the lanes are summed as a tree
with halving offsets (v[l] += v[l + BW/2], then + BW/4, ..., Reduce.cuh's warp shuffles, offsets
decreasing since PyTorch 2.9), then the warps likewise. BW and YS depend on R below 16 rows (wide
blocks); the kernel always takes the layout of >= 16 rows (ORDER_ROWS): bit-exact with eager there
(every launch it gets) and one order for any row count. Exact for C < 128 or C % 4 == 0 (every model width);
other widths ignore the per-row alignment head PyTorch sums first (a valid fp32 sum, not eager's).
The CPU reduction sums in another order: on CPU tensors the kernel runs under the Triton interpreter
and matches `torch_cuda_row_sum`, not the CPU eager model bit for bit. (`row_sumsq`, its sum of
squares, is also kernels/mhc.py's for hc_pre's exact path.)
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import triton
import triton.language as tl
from dsv4c.kernels._tl import pdl_launch, pdl_wait

MAX_C = 16384  # one row per program
# Launches with at least this many rows take the exact-order kernels (this file and kernels/mhc.py);
# decode launches (batch x (1 + k) rows, <= 127) keep the fast ones.
EXACT_ROWS_MIN = 128
# The exact kernel sums every row in PyTorch's order for this many rows or more (where Reduce.cuh's
# block is 32 lanes wide whatever the count): the prefill graphs' case, and one order for any row count.
ORDER_ROWS = 16
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_THREADS = 512  # Reduce.cuh's MAX_NUM_THREADS for fp32
_WARP = 32


@dataclass(frozen=True)
class ReduceLayout:
    """How PyTorch's CUDA reduction sums one row of C values among R rows (module doc)."""

    lanes: int  # BW: threads along the row (block.x)
    warps: int  # YS: warps splitting the row (1: each warp has rows of its own)
    steps: int  # loads per thread and accumulator
    vectorized: bool  # float4 loads (C >= 128)


def _last_pow2(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def reduce_layout(rows: int, c: int) -> ReduceLayout:
    """Reduce.cuh's setReduceConfig for a mean over the last dim of a contiguous fp32 [rows, c]."""
    vec = c >= 128
    dim0 = c // 4 if vec else c
    d0 = _MAX_THREADS if dim0 >= _MAX_THREADS else _last_pow2(dim0)
    d1 = _MAX_THREADS if rows >= _MAX_THREADS else _last_pow2(rows)
    bw = min(d0, _WARP)
    bh = min(d1, _MAX_THREADS // bw)
    bw = min(d0, _MAX_THREADS // bh)
    ys = bh if -(-c // bw) >= min(bh * 16, 256) else 1  # values per thread: split the row across warps
    step = bw * ys
    # (a further split across blocks needs >= 256 values per thread after this: C >= 131072, > MAX_C)
    return ReduceLayout(bw, ys, -(-c // (4 * step)), vec)


def _tree(v: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (a power of two) with halving offsets: v[l] + v[l + n/2], ..."""
    while v.shape[-1] > 1:
        h = v.shape[-1] // 2
        v = v[..., :h] + v[..., h:]
    return v[..., 0]


def torch_cuda_row_sum(v: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """Σ over the last dim of fp32 v [R, C], added in the order of PyTorch's CUDA reduction of `rows`
    rows (default R; `reduce_layout`, module doc), in torch ops. The kernel's sum is this with
    rows = ORDER_ROWS; eager's on CUDA is this with rows = R."""
    c = v.shape[1]
    lay = reduce_layout(v.shape[0] if rows is None else rows, c)
    step = lay.lanes * lay.warps
    t = torch.arange(step, device=v.device).view(lay.warps, lay.lanes, 1)  # thread = warp·BW + lane
    i = torch.arange(4, device=v.device).view(1, 1, 4)
    acc = torch.zeros(v.shape[0], lay.warps, lay.lanes, 4, dtype=torch.float32, device=v.device)
    for m in range(lay.steps):
        e = 4 * (t + step * m) + i if lay.vectorized else t + step * (4 * m + i)
        x = torch.where(e < c, v[:, e.clamp_max(c - 1)], 0.0)
        acc = acc + x
    s = ((acc[..., 0] + acc[..., 1]) + acc[..., 2]) + acc[..., 3]  # [R, YS, BW]
    return _tree(_tree(s))  # lanes, then warps


@triton.jit
def _halve(v, H: tl.constexpr, W: tl.constexpr):
    # v [H, W] -> [H, W/2]: v[:, l] + v[:, l + W/2] (one level of Reduce.cuh's shuffle tree)
    lo, hi = tl.split(tl.permute(tl.reshape(v, (H, 2, W // 2)), (0, 2, 1)))
    return lo + hi


@triton.jit
def row_sumsq(row_ptr, C, BW: tl.constexpr, YS: tl.constexpr, STEPS: tl.constexpr, VEC: tl.constexpr,
               LOG_BW: tl.constexpr, LOG_YS: tl.constexpr):
    # Σ x² of one row in PyTorch's CUDA order (module doc); x² rounded (the launch disables FMA fusion)
    t = tl.arange(0, YS)[:, None] * BW + tl.arange(0, BW)[None, :]  # [YS, BW] thread index
    i = tl.arange(0, 4)
    acc = tl.zeros((YS, BW, 4), dtype=tl.float32)
    for m in tl.static_range(STEPS):
        if VEC:
            e = 4 * (t[:, :, None] + BW * YS * m) + i[None, None, :]
        else:
            e = t[:, :, None] + BW * YS * (4 * m + i[None, None, :])
        x = tl.load(row_ptr + e, mask=e < C, other=0.0).to(tl.float32)
        acc = acc + x * x
    even, odd = tl.split(tl.reshape(acc, (YS, BW, 2, 2)))  # element i = 2p + q: even holds i = 0, 2
    a0, a2 = tl.split(even)
    a1, a3 = tl.split(odd)
    v = ((a0 + a1) + a2) + a3  # [YS, BW]
    for k in tl.static_range(LOG_BW):
        v = _halve(v, YS, BW >> k)
    v = tl.reshape(v, (1, YS))
    for k in tl.static_range(LOG_YS):
        v = _halve(v, 1, YS >> k)
    return tl.sum(tl.reshape(v, (1,)), axis=0)  # one element: exact


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, C, SX, eps, inv_c, CAST_FIRST: tl.constexpr, BLOCK_C: tl.constexpr,
                     PDL: tl.constexpr = False):
    pdl_wait(PDL)
    # x [R, C] rows SX elements apart, unit stride along C; w [C]; out [R, C] contiguous
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    cm = c < C
    x = tl.load(x_ptr + row * SX + c, mask=cm, other=0.0).to(tl.float32)
    r = x * (1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) * inv_c + eps))
    w = tl.load(w_ptr + c, mask=cm, other=0.0).to(tl.float32)
    if CAST_FIRST:
        r = r.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * C + c, (w * r).to(out_ptr.dtype.element_ty), mask=cm)


@triton.jit
def _rms_norm_exact_kernel(x_ptr, w_ptr, out_ptr, C, SX, eps, inv_c, CAST_FIRST: tl.constexpr, BW: tl.constexpr,
                           YS: tl.constexpr, STEPS: tl.constexpr, VEC: tl.constexpr, LOG_BW: tl.constexpr,
                           LOG_YS: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    # x [R, C] rows SX elements apart, unit stride along C; w [C]; out [R, C] contiguous; one program per row
    row = tl.program_id(0).to(tl.int64)
    ss = row_sumsq(x_ptr + row * SX, C, BW, YS, STEPS, VEC, LOG_BW, LOG_YS)
    rs = tl.math.rsqrt(ss * inv_c + eps)  # eager: mean (sum · fl(1/C)), + eps, rsqrt: each rounded
    t = tl.arange(0, YS)[:, None] * BW + tl.arange(0, BW)[None, :]
    i = tl.arange(0, 4)
    for m in tl.static_range(STEPS):  # the same tiles again (cached): the elementwise part
        if VEC:
            e = 4 * (t[:, :, None] + BW * YS * m) + i[None, None, :]
        else:
            e = t[:, :, None] + BW * YS * (4 * m + i[None, None, :])
        em = e < C
        r = tl.load(x_ptr + row * SX + e, mask=em, other=0.0).to(tl.float32) * rs
        w = tl.load(w_ptr + e, mask=em, other=0.0).to(tl.float32)
        if CAST_FIRST:
            r = r.to(x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * C + e, (w * r).to(out_ptr.dtype.element_ty), mask=em)


def out_dtype(x: torch.Tensor, w: torch.Tensor, cast_first: bool) -> torch.dtype:
    return torch.promote_types(w.dtype, x.dtype) if cast_first else x.dtype


def _check(x: torch.Tensor, w: torch.Tensor, eps: float) -> int:
    if x.dtype not in _DTYPES or w.dtype not in _DTYPES:
        raise ValueError(f"rms_norm: x and w must be float32/bfloat16/float16, got {x.dtype} and {w.dtype}")
    if x.dim() < 1:
        raise ValueError("rms_norm: x must be [..., C], got a scalar")
    c = x.shape[-1]
    if w.dim() != 1 or w.shape[0] != c:
        raise ValueError(f"rms_norm: w must have shape [{c}] (x's last dim), got {list(w.shape)}")
    if not eps >= 0.0:
        raise ValueError(f"rms_norm: eps must be >= 0, got {eps}")
    return c


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, cast_first: bool = False,
             exact: bool | None = None) -> torch.Tensor:
    """RMSNorm of every row of x [..., C] with weight w [C], out contiguous. x is read in place where its rows
    are one stride apart with unit stride along C (a column slice of a wider row: the split of a fused
    projection at several tokens), else copied once. C <= MAX_C. `exact` picks the variant (module doc; default:
    rows >= EXACT_ROWS_MIN): True the exact-order kernel, False the fast one. CPU tensors run under the Triton
    interpreter."""
    c = _check(x, w, eps)
    if c > MAX_C:
        raise ValueError(f"rms_norm: C = {c} exceeds MAX_C = {MAX_C} (one row per program)")
    xr, wc = rows_view(x), w.contiguous()
    out = torch.empty(x.shape, dtype=out_dtype(x, w, cast_first), device=x.device)
    rows = xr.shape[0] if c else 0
    if rows == 0:
        return out
    if rows >= EXACT_ROWS_MIN if exact is None else exact:
        _launch_exact(xr, wc, out, rows, c, eps, cast_first)
    else:
        _launch_fast(xr, wc, out, rows, c, eps, cast_first)
    return out


def rows_view(x: torch.Tensor) -> torch.Tensor:
    """x [..., C] as [R, C] rows one stride apart with unit stride along C: a view where x's strides allow
    (no copy), else a contiguous copy."""
    c = x.shape[-1]
    if x.dim() and x.stride(-1) == 1:
        try:
            return x.view(-1, c)
        except RuntimeError:  # leading dims not collapsible to one stride
            pass
    return x.contiguous().view(-1, c)


def _launch_fast(xr, wc, out, rows: int, c: int, eps: float, cast_first: bool) -> None:
    # decode-sized launches: the kernel and launch of the tree's decode path before issue 22's re-land
    block = triton.next_power_of_2(c)
    _rms_norm_kernel[(rows,)](xr, wc, out, c, xr.stride(0), float(eps), 1.0 / c, CAST_FIRST=bool(cast_first),
                              BLOCK_C=block, num_warps=max(1, min(16, block // 512)), **pdl_launch(xr))


def _launch_exact(xr, wc, out, rows: int, c: int, eps: float, cast_first: bool) -> None:
    lay = reduce_layout(ORDER_ROWS, c)
    _rms_norm_exact_kernel[(rows,)](xr, wc, out, c, xr.stride(0), float(eps), 1.0 / c, CAST_FIRST=bool(cast_first),
                                    BW=lay.lanes, YS=lay.warps, STEPS=lay.steps, VEC=lay.vectorized,
                                    LOG_BW=lay.lanes.bit_length() - 1, LOG_YS=lay.warps.bit_length() - 1,
                                    num_warps=max(1, min(16, lay.lanes * lay.warps // 32)), enable_fp_fusion=False,
                                    **pdl_launch(xr))


def rms_norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float, cast_first: bool = False) -> torch.Tensor:
    """`RMSNorm.forward` of the eager model (the specification), unchanged, with this weight and eps."""
    from dsv4c.model.common import RMSNorm

    return RMSNorm.forward(SimpleNamespace(weight=w, eps=eps, cast_first=cast_first), x)


@torch.library.custom_op("dsv4c::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, w: torch.Tensor, eps: float, cast_first: bool) -> torch.Tensor:
    """`rms_norm` on CUDA tensors; on CPU the model's own function (bit-exact with the unfused graph)."""
    if x.device.type == "cpu":
        _check(x, w, eps)
        return rms_norm_ref(x, w, eps, cast_first)
    return rms_norm(x, w, eps, cast_first)


@rms_norm_op.register_fake
def _rms_norm_fake(x, w, eps, cast_first):
    return x.new_empty(x.shape, dtype=out_dtype(x, w, cast_first))


@torch.library.custom_op("dsv4c::rms_norm_bi", mutates_args=())
def rms_norm_bi_op(x: torch.Tensor, w: torch.Tensor, eps: float, cast_first: bool) -> torch.Tensor:
    """`rms_norm` with the fast kernel at every row count (the deterministic mode,
    passes/make_batch_invariant.py: `dsv4c::rms_norm` picks its variant by the launch's rows, so a row's
    bits would depend on the rows sharing the call). CPU: the model's function, as `dsv4c::rms_norm`."""
    if x.device.type == "cpu":
        _check(x, w, eps)
        return rms_norm_ref(x, w, eps, cast_first)
    return rms_norm(x, w, eps, cast_first, exact=False)


@rms_norm_bi_op.register_fake
def _rms_norm_bi_fake(x, w, eps, cast_first):
    return _rms_norm_fake(x, w, eps, cast_first)
