"""`dsv4c::linear_f32` (bf16 x and weight, fp32 output: the routers' gate, the compressor and indexer
projections) at decode token counts as one Triton launch.

Public API::

    linear_f32_gemv(x, w) -> Tensor       # the Triton GEMV: x [1, K], w [N, K] one 16-bit dtype -> fp32 [1, N]
    linear_f32_tc(x, w) -> Tensor         # a few token rows: x [M, K] -> fp32 [M, N] on batch_invariant's decode tile
    linear_f32_gemv_ref(x, w) -> Tensor   # linear(x.float(), w.float()), the function computed

Custom op (select_kernels' `fused` implementation of `linear_f32`; CPU = the reference)::

    dsv4c::linear_f32_fused(Tensor x, Tensor w) -> Tensor

Why: on CUDA `linear_f32` is one cuBLAS call (`torch.mm(..., out_dtype=fp32)`). At one token and a small
weight (the Flash router's [256, 4096], 2 MB) cuBLAS splits K and adds the partials in a second kernel, and
neither kernel takes part in the step's programmatic-dependent-launch chain (kernels/_tl.py): its successor
starts only when the reduction has ended. Here program (n-tile, split) multiplies BLOCK_N weight rows by its
K range on CUDA cores (products of two 16-bit values, exact in fp32; fp32 sums); with SPLIT > 1 each stores
its fp32 partial and the tile's last program (`_tl.last_split`) adds them in split order: one launch, the
same result whichever program finishes last, chained by PDL. Only the summation order differs from cuBLAS's
(lower_f32_linears.py: within fp32 rounding of the sum). The op runs it up to GEMV_MAX_ELEMENTS weight
values (the head, 129280 x 4096, stays with cuBLAS at about 94% of copy bandwidth); 0 keeps cuBLAS always.
run59 (H100, the 2-layer slice's batch-1 step on the GPU alone, interleaved): 0.807 / 0.807 ms with the GEMV
against 0.820 / 0.820 ms with cuBLAS (76 vs 79 kernels), so 16M weight values (the routers' gates, the
compressor and indexer projections) and the CUDA targets' `linear_f32: fused` are the defaults.

From two token rows cuBLAS runs again: run72's batch-8 timeline (H100, the 2-layer slice) shows each of these
linears as cuBLAS's split-K GEMM and its reduce, two launches outside the PDL chain (router 4.6 + 1.7 µs,
compressor 10.3 + 2.0 µs). `linear_f32_tc` is one PDL-chained launch instead: kernels/batch_invariant.py's
`bi_matmul` on its decode tile (weight rows on the MMA's rows, 16 token rows on its columns, fp32 accumulation
of exact bf16 products, an ordered K split `bi_split`) with an fp32 output. The op takes it from 2 up to TC_MAX_M
rows, 0 by default: at 16 (examples/results/device-2026-12-07/run75, H100) the 2-layer slice's batch-8 step
was 1.467 / 1.464 ms against 1.461 on cuBLAS, three launches fewer and no faster.

Shapes: K reduction (x's last dim), N output features; legend as kernels/fp8_gemv.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from dsv4c.kernels import _tl as U
from dsv4c.kernels.batch_invariant import bi_matmul, bi_split

BLOCK_N = 32
BLOCK_K = 256
NUM_WARPS = 4
GEMV_MAX_ELEMENTS = 16 << 20  # weight values up to which the op runs the GEMV at one token; 0: cuBLAS always
TC_MAX_M = 0       # token rows (2 or more) up to which the op runs linear_f32_tc (at most GEMV_MAX_ELEMENTS weight
                   # values); 0: cuBLAS from two rows (run75: 16 is no faster)
_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _step(x_ptr, w_rows, n_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """One K step: (w [BN, BK] fp32, x [BK] fp32), zeros past K."""
    ks = k0 + tl.arange(0, BLOCK_K)
    k_ok = ks < K
    w = tl.load(w_rows + ks[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
    return w, tl.load(x_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)


@triton.jit
def _gemv_f32_kernel(x_ptr, w_ptr, y_ptr, part_ptr, cnt_ptr, N, K: tl.constexpr, stride_wn,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_SPLIT: tl.constexpr, SPLIT: tl.constexpr,
                     PDL: tl.constexpr = False):
    """Program (pid_n, pid_s): y[n] (SPLIT 1) or its partial over K range pid_s, for BLOCK_N rows n. The next
    step is loaded before the current one is multiplied (the pipeliner only serves loads that feed a dot)."""
    U.pdl_wait(PDL)
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                                       # [BN]
    n_ok = n < N
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn                              # [BN, 1]
    k_lo = pid_s * K_SPLIT
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    w, x = _step(x_ptr, w_rows, n_ok, k_lo, K, BLOCK_K)
    for i in range(K_SPLIT // BLOCK_K):
        w1, x1 = _step(x_ptr, w_rows, n_ok, k_lo + (i + 1) * BLOCK_K, K, BLOCK_K)
        acc += tl.sum(w * x[None, :], axis=1)
        w, x = w1, x1
    U.store_split(acc, y_ptr + n, part_ptr + n, N, n_ok, cnt_ptr + pid_n, pid_s, SPLIT)  # partials [SPLIT, N]


# the K split doubles while the grid stays within this many programs per SM
GEMV_PROGRAMS_PER_SM = 2


def split_for(n: int, k: int, sm_count: int) -> int:
    """Programs per output tile along K: doubled while the grid stays within GEMV_PROGRAMS_PER_SM programs per
    SM, each keeps at least one K step, and the partials (split · N · 4 bytes) stay under a quarter of the
    weight's bytes."""
    tiles, steps, split = triton.cdiv(n, BLOCK_N), triton.cdiv(k, BLOCK_K), 1
    while (tiles * split * 2 <= GEMV_PROGRAMS_PER_SM * sm_count and steps >= 2 * split and 2 * split <= U.SPLIT_TICKS
           and 2 * split * n * 4 <= n * k * 2 // 4):
        split *= 2
    return split


def _check(x: torch.Tensor, w: torch.Tensor) -> None:
    if x.dtype not in _DTYPES or w.dtype != x.dtype:
        raise ValueError(f"linear_f32_gemv: x and w must share a 16-bit dtype, got {x.dtype}, {w.dtype}")
    if x.dim() != 2 or x.shape[0] != 1 or w.dim() != 2 or w.shape[1] != x.shape[1]:
        raise ValueError(f"linear_f32_gemv: x must be [1, K] and w [N, K], got {list(x.shape)}, {list(w.shape)}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"linear_f32_gemv: x and w need unit stride along K, got {x.stride()}, {w.stride()}")
    if x.device != w.device:
        raise ValueError(f"linear_f32_gemv: x on {x.device}, w on {w.device}")


def linear_f32_gemv(x: torch.Tensor, w: torch.Tensor, split: int | None = None) -> torch.Tensor:
    """y [1, N] fp32 = x [1, K] @ w [N, K]^T, x and w in one 16-bit dtype, fp32 products and sums; `split`
    (a power of two) overrides the K split. CPU tensors run under the Triton interpreter."""
    _check(x, w)
    n, k = w.shape
    y = torch.empty(1, n, dtype=torch.float32, device=x.device)
    if n == 0:
        return y
    split = split or split_for(n, k, U.sm_count(x.device))
    if split < 1 or split > U.SPLIT_TICKS or split & (split - 1):
        raise ValueError(f"linear_f32_gemv: split must be a power of two up to {U.SPLIT_TICKS}, got {split}")
    k_split = triton.cdiv(triton.cdiv(k, split), BLOCK_K) * BLOCK_K
    grid = (triton.cdiv(n, BLOCK_N), split)
    if split > 1:
        part = torch.empty(split, n, dtype=torch.float32, device=x.device)
        cnt = U.split_counters(x.device, grid[0], split)
    else:
        part, cnt = y, y
    _gemv_f32_kernel[grid](x, w, y, part, cnt, n, k, w.stride(0), BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, K_SPLIT=k_split,
                           SPLIT=split, num_warps=NUM_WARPS, **U.pdl_launch(x))
    return y


def linear_f32_tc(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y [M, N] fp32 = x [M, K] @ w [N, K]^T, x and w in one 16-bit dtype: `bi_matmul`'s decode tile with the K
    split `bi_split` fixes from w's shape (one PDL-chained launch; its checks name bad input)."""
    return bi_matmul(x, w, out_dtype=torch.float32, split=bi_split(*w.shape), decode=True)


def linear_f32_gemv_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The function computed: linear(x.float(), w.float())."""
    return torch.nn.functional.linear(x.float(), w.float())


@torch.library.custom_op("dsv4c::linear_f32_fused", mutates_args=())
def linear_f32_fused(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`dsv4c::linear_f32`: on CUDA with at most GEMV_MAX_ELEMENTS weight values (unit stride along K) the GEMV
    above at one token row, `linear_f32_tc` from 2 to TC_MAX_M rows; otherwise the op itself (cuBLAS; the
    reference on the CPU)."""
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    if (x.device.type == "cuda" and 0 < w.numel() <= GEMV_MAX_ELEMENTS and x.dtype in _DTYPES
            and w.dtype == x.dtype and x2.stride(1) == 1 and w.stride(1) == 1):
        if m == 1:
            return linear_f32_gemv(x2, w).view(*x.shape[:-1], w.shape[0])
        if 2 <= m <= TC_MAX_M:
            return linear_f32_tc(x2, w).view(*x.shape[:-1], w.shape[0])
    return torch.ops.dsv4c.linear_f32(x, w)


@linear_f32_fused.register_fake
def _linear_f32_fused_fake(x, w):
    return x.new_empty((*x.shape[:-1], w.shape[0]), dtype=torch.float32)
