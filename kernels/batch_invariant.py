"""Batch-invariant matmuls for the deterministic mode (`compile --deterministic`).

Public API::

    bi_matmul(x, w, bias=None, out_dtype=None, split=1, decode=False) -> Tensor  # Triton: y = x @ w^T (+ bias)
    bi_matmul_fp8(x, w_q, w_s, out_dtype=None, split=1, decode=False) -> Tensor  # the same on FP8 block weights
    bi_split(n, k) -> int                                  # the K split of a decode-kind graph's [n, k] linear
    decode_groups(m) -> int                                # 16-row token groups per decode-tile program at M rows
    bi_matmul_ref(x, w, bias=None, out_dtype=None) -> Tensor  # the same function through torch
    bi_gemv_gathered(x, rows, experts, w) -> Tensor        # Triton: y[p] = x[rows[p]] @ w[experts[p]]^T
    bi_gemv_gathered_ref(...)                              # the same through torch
    row_sum(x) -> Tensor                                   # Triton: fp32 x.sum(-1), one program per row

Custom ops (targets of passes/lower_invariant_linears.py and select_kernels' `moe_experts=invariant`;
CPU tensors run the reference)::

    dsv4c::linear_bi(Tensor x, Tensor w, Tensor? bias, bool out_f32, int split=1, bool decode=False) -> Tensor
    dsv4c::fp8_linear_bi(Tensor x, Tensor w_q, Tensor w_s, int split=1, bool decode=False) -> Tensor
    dsv4c::grouped_linear_bi(Tensor x, Tensor w, int split=1, bool decode=False) -> Tensor
    dsv4c::moe_experts_bi(x, idx, weight, w1, w3, w2, swiglu_limit) -> Tensor
    dsv4c::moe_experts_fp4_bi(x, idx, weight, fmt, w13, w13_scale, w13_global, w2, w2_scale, w2_global,
                              swiglu_limit) -> Tensor      # FP4 weight-only experts (mxfp4, nvfp4)
    dsv4c::moe_experts_fp8_bi(x, idx, weight, w13, w13_scale, w2, w2_scale, swiglu_limit) -> Tensor
                                                           # FP8 block experts (W8A8): `fp8_bi_config`

Legend: M token rows, N output features, K input features, P (token, expert choice) pairs,
E experts.

Why: cuBLAS (and the other GEMM paths: split-K, tile sizes chosen from M, MoE paths chosen by token
count) may sum one row's products in an order that depends on how many rows share the call, so a
row's bf16 output (and a greedy argmax at a near tie) depends on the batch. Here one program computes
one [BLOCK_M, BLOCK_N] tile and walks K in BLOCK_K steps from 0 upward, accumulating in fp32; the tile
sizes are constants, never chosen from M, and no split-K is chosen from M. An MMA's row i depends only
on row i of its A operand, so each row's result is the same bits whatever M is (tests:
test_kernels_batch_invariant.py, 1 vs 8 rows). A K split fixed by the weight's shape keeps that: with
`split` S, program s walks its own K range in the same fixed steps and the last program of a tile adds
the S fp32 partials in split order (then the bias), so a row's sums are the same for any M. (A serial form,
one program per tile walking the S ranges itself without storing partials, was timed slower at the batch-64
verify, run53: 8.201 vs 8.128 ms on an H100, and removed.)
make_batch_invariant gives decode-kind graphs (decode, verify, mtp) `bi_split(N, K)`: at decode a
[1536, 4096] weight in 64-row tiles is 24 programs, each walking all of K, a few percent of the copy
bandwidth; the prefill graph keeps S = 1, where the tiles over M fill the GPU. Decode-kind graphs also
get the decode tile (`decode=True`, DECODE_*): the 64 x 64 tile spends 63 of its 64 MMA rows on padding at
one token and walks K 64 columns at a time; the decode tile puts 64 weight rows on the MMA's rows and 16 token
rows on its columns, with 128-column K steps and 4 stages in flight (H200, the slice's dense shapes: 0.98x /
0.97x of cuBLAS bf16 at 1 / 8 tokens against the 64 x 64 tile's 0.92x, but 0.48x at 64 tokens, where each
weight tile is read once per 16 tokens; BENCHMARKS.md, 2026-12-06, run38). Column j of w_tile @ x_tile^T
depends on token row j only, so it is batch-invariant for the same reason. Past 16 rows a program owns 2 or
4 groups of 16 token rows (`decode_groups`, from M) and multiplies each loaded weight tile with each group
as its own 16-column MMA and accumulator: the MMA shape and K walk of a row are those of its group alone,
so the group count may follow M (a verify call of 1 + k tokens per row reads each weight tile once per 64
rows, not once per 16; the sm_90 build test checks that every MMA has the one-group shape). A row is
invariant within its graph kind, and every token's row is always computed by the same kind (a prompt token
by prefill, a generated one by decode or verify). The experts' GEMV computes one pair per program with a
fixed-order K walk (one weight row block at a time): no tile is shared between pairs, so the path is
the same at 1 token and at 64. FP4 weight-only experts keep their stored bytes: `moe_experts_fp4_bi`
runs the CUDA-core GEMV kernels of kernels/moe_fp4_gemv.py at every token count with one fixed tile
(`fp4_bi_config`), where `moe_experts_q` switches to the grouped tensor-core kernels above two
assignments per expert. Those GEMVs are per (token, choice) pair too: the activation's fp16 chunk
scales are per token row, each program walks K in a fixed order with no atomics, and the choices are
summed per token in choice order (kernels/moe_combine.py); ordering the programs by expert (a sort
past E/4 pairs) changes which program runs when, not what any program computes. FP8 block weights
(`bi_matmul_fp8`, the dense linears quantize_dense left on `fp8_linear_w8a16`) take the same tiles and K
walk: each K step's e4m3 tile is widened in registers (exact), its product formed from zero and scaled by
that step's 128x128 scale (K steps of 64 or 128 never straddle a scale block), then added in K order, so
a row's sums still depend on that row alone. FP8 block experts (`moe_experts_fp8_bi`, with `--expert-format
fp8_block`) run kernels/moe_grouped.py's tensor-core tile at every token count (`fp8_bi_config`): its rows are
assignments, each activation row quantised on its own (1x128 scales), and sorted M-blocks read an expert
once per 16 of its assignments, where the per-pair GEMVs read it once per assignment (a verify call of
1 + k tokens per row touches each expert many times at batch 32-64; run48: the slice's MTP grid at batch
64 reached 50-58% of its bound with it, 28-31% with the FP4 GEMV).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from dsv4c.kernels._tl import SPLIT_TICKS, e8m0_value, last_split, pdl_launch, pdl_wait, split_counters

BLOCK_M = 64      # fixed for every M (never chosen from M: that is the point)
BLOCK_N = 64
BLOCK_K = 64
# The decode tile (decode-kind graphs): weight rows are the MMA's row dim, 16 token rows its column dim, K in
# 128-column steps, 4 stages in flight; fixed for every M too.
DECODE_BLOCK_T = 16
DECODE_BLOCK_N = 64
DECODE_BLOCK_K = 128
DECODE_STAGES = 4
# From this many token groups (`decode_groups`) the decode tile's 16-bit weights feed the MMAs from registers
# (`A_REG`); 0: never. From shared memory every group's MMAs read the weight tile again; at 256 verify rows
# the batch-invariant linears ran at about 150 TFLOP/s (run49). run51 (H100, 256 verify rows): dense GEMMs and
# head 2.79 -> 2.06 ms with 4, the same bits (GPU test); batch 1 / 8 / 64 decode steps unchanged.
DECODE_A_REG_MIN_GROUPS = 4
# Token groups per decode-tile program above 64 rows (`decode_groups`): 4 (each weight tile read once per 64 rows)
# or 8 (once per 128). Only the deterministic verify has more than 64 rows (batch 32 / 64 x (1 + k) tokens:
# issue 23's weakest cells, where run51 put the batch-invariant linears and head at 2.06 ms of 256 verify rows,
# four reads of every weight). Any count gives every row the same bits. 8 is not timed yet: run80.
DECODE_MAX_GROUPS = 4
SPLIT_PROGRAMS = 264  # bi_split's grid target at one M tile: 2 per SM of a 132-SM H100 / H200 (a constant, not
SPLIT_MIN_STEPS = 4   # the device's count: the split fixes the bits); each split walks >= 4 DECODE_BLOCK_K steps
GEMV_BLOCK_N = 64
GEMV_BLOCK_K = 128
ROW_SUM_BLOCK = 1024  # row_sum: lanes per program (each adds every 1024th element), fixed for every M
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _tile_product(a, b, acc, F32: tl.constexpr, INTERPRET: tl.constexpr):
    """acc [R, C] += a [R, BK] @ b [C, BK]^T, fp32 accumulation."""
    if INTERPRET:  # fp32 products summed per row, no host BLAS: the interpreter's tl.dot is numpy's matmul,
        # whose fp32 rows depended on the tile's other rows on one CI host (M = 1 vs 8, last bit)
        return acc + tl.sum(a.to(tl.float32)[:, None, :] * b.to(tl.float32)[None, :, :], 2)
    elif F32:  # fp32 operands: IEEE products, not TF32
        return tl.dot(a, tl.trans(b), acc, input_precision="ieee")
    else:
        return tl.dot(a, tl.trans(b), acc)


@triton.jit
def _x_tile(x_ptr, m, M, sxm, k0, k, K: tl.constexpr):
    """x rows m [R], K columns k0 + k [BK] -> [R, BK] (zeros past M and K)."""
    return tl.load(x_ptr + m[:, None].to(tl.int64) * sxm + k0 + k[None, :],
                   mask=(m < M)[:, None] & ((k0 + k) < K)[None, :], other=0.0)


@triton.jit
def _swap_step(acc_t, b, sc, a, F32: tl.constexpr, INTERPRET: tl.constexpr, W_FP8: tl.constexpr):
    """The decode tile's K step for one group of token rows: acc_t [BN, T] += b [BN, BK] @ a [T, BK]^T (W_FP8:
    the step's product formed from zero and scaled per weight row by sc [BN])."""
    if W_FP8:
        return acc_t + _tile_product(b, a, tl.zeros(acc_t.shape, dtype=tl.float32), F32, INTERPRET) * sc[:, None]
    return _tile_product(b, a, acc_t, F32, INTERPRET)


@triton.jit
def _put_tile(acc, m, n, M, N, y_ptr, sym, b_ptr, part_ptr, pid_s, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):
    """Store an output tile acc [R, BN] (rows m, columns n): y (+ bias) when SPLIT = 1, else the split's fp32
    partial ([SPLIT, M, N] at part_ptr)."""
    ok = (m < M)[:, None] & (n < N)[None, :]
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + m[:, None].to(tl.int64) * sym + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(part_ptr + m[:, None].to(tl.int64) * N + n[None, :] + pid_s * M * N, acc, mask=ok)


@triton.jit
def _sum_parts(m, n, M, N, y_ptr, sym, b_ptr, part_ptr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
               R: tl.constexpr, BN: tl.constexpr):
    """The last program of a tile: y rows m = the SPLIT fp32 partials added in split order (+ bias)."""
    ok = (m < M)[:, None] & (n < N)[None, :]
    p = part_ptr + m[:, None].to(tl.int64) * N + n[None, :]
    tot = tl.zeros((R, BN), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        tot += tl.load(p + s * M * N, mask=ok, other=0.0, cache_modifier=".cg")
    if HAS_BIAS:
        tot += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None].to(tl.int64) * sym + n[None, :], tot.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _bi_matmul_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K: tl.constexpr, sxm, swn, sym,
                      HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, F32: tl.constexpr, INTERPRET: tl.constexpr,
                      K_SPLIT: tl.constexpr, SPLIT: tl.constexpr, SWAP: tl.constexpr = False,
                      PDL: tl.constexpr = False, ws_ptr=None, swsn=0, W_FP8: tl.constexpr = False,
                      WS_E8M0: tl.constexpr = False, GROUPS: tl.constexpr = 1, A_REG: tl.constexpr = False):
    """Program (pid_m, pid_n, pid_s): the [BLOCK_M, BLOCK_N] output tile over K range pid_s (all of K when
    SPLIT = 1). SWAP (the decode tile) computes it as w_tile @ x_tile^T ([BLOCK_N, BLOCK_M]: weight rows fill
    the MMA's rows, the few token rows its columns) and transposes it: column j depends on token row j
    alone, as row i of x_tile @ w_tile^T depends on row i alone. SWAP with GROUPS G (1, 2, 4 or 8): the program
    owns G consecutive groups of BLOCK_M token rows and multiplies each K step's weight tile, loaded once,
    with each group as its own [BLOCK_N, BLOCK_M] product and accumulator: the same MMA and K walk as one
    group alone, so G changes how often a weight tile is read, not any row's sums. W_FP8: w is e4m3 with one
    scale per 128x128 tile at ws_ptr ([ceil(N/128), ceil(K/128)], row stride swsn; e8m0 bytes with WS_E8M0,
    else fp32): each K step's product is formed from zero, scaled, then accumulated. A_REG (SWAP, 16-bit
    weights, compiled for a GPU only): each K step's weight tile passes through an inline-asm register copy,
    so every group's MMA reads its A operand from registers instead of shared memory (as the FP8 path's
    converted tile does); the MMA shape, operands and K walk are unchanged."""
    pdl_wait(PDL)
    pid_s = tl.program_id(2)
    m = tl.program_id(0) * (BLOCK_M * GROUPS) + tl.arange(0, BLOCK_M)   # group 0's rows; group g: + g * BLOCK_M
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    nm = n < N
    w_rows = w_ptr + n[:, None].to(tl.int64) * swn     # [BLOCK_N, 1]
    acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # SWAP: one accumulator per group
    acc_t1 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_t2 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_t3 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_t4 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_t5 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_t6 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_t7 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = 0
    if SPLIT > 1:
        k_lo = pid_s * K_SPLIT
    for k0 in range(k_lo, k_lo + K_SPLIT, BLOCK_K):  # fixed order: k_lo, k_lo + BLOCK_K, ... whatever M is
        b = tl.load(w_rows + k0 + k[None, :], mask=nm[:, None] & ((k0 + k) < K)[None, :], other=0.0)
        sc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        if W_FP8:  # e4m3 -> x's dtype is exact; one scale per weight row for this K step
            b = b.to(x_ptr.dtype.element_ty)
            sc = tl.load(ws_ptr + (n // 128) * swsn + k0 // 128, mask=nm, other=0)
            if WS_E8M0:
                sc = e8m0_value(sc.to(tl.int32))
            sc = sc.to(tl.float32)
        if A_REG:  # an opaque register copy of the 16-bit weight tile: the MMAs take A from registers
            b = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [b], dtype=b.dtype, is_pure=True, pack=2)
        if SWAP:
            acc_t = _swap_step(acc_t, b, sc, _x_tile(x_ptr, m, M, sxm, k0, k, K), F32, INTERPRET, W_FP8)
            if GROUPS > 1:
                acc_t1 = _swap_step(acc_t1, b, sc, _x_tile(x_ptr, m + BLOCK_M, M, sxm, k0, k, K), F32,
                                    INTERPRET, W_FP8)
            if GROUPS > 2:
                acc_t2 = _swap_step(acc_t2, b, sc, _x_tile(x_ptr, m + 2 * BLOCK_M, M, sxm, k0, k, K), F32,
                                    INTERPRET, W_FP8)
                acc_t3 = _swap_step(acc_t3, b, sc, _x_tile(x_ptr, m + 3 * BLOCK_M, M, sxm, k0, k, K), F32,
                                    INTERPRET, W_FP8)
            if GROUPS > 4:
                acc_t4 = _swap_step(acc_t4, b, sc, _x_tile(x_ptr, m + 4 * BLOCK_M, M, sxm, k0, k, K), F32,
                                    INTERPRET, W_FP8)
                acc_t5 = _swap_step(acc_t5, b, sc, _x_tile(x_ptr, m + 5 * BLOCK_M, M, sxm, k0, k, K), F32,
                                    INTERPRET, W_FP8)
                acc_t6 = _swap_step(acc_t6, b, sc, _x_tile(x_ptr, m + 6 * BLOCK_M, M, sxm, k0, k, K), F32,
                                    INTERPRET, W_FP8)
                acc_t7 = _swap_step(acc_t7, b, sc, _x_tile(x_ptr, m + 7 * BLOCK_M, M, sxm, k0, k, K), F32,
                                    INTERPRET, W_FP8)
        else:
            a = _x_tile(x_ptr, m, M, sxm, k0, k, K)
            if W_FP8:
                acc += _tile_product(a, b, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), F32,
                                     INTERPRET) * sc[None, :]
            else:
                acc = _tile_product(a, b, acc, F32, INTERPRET)
    if SWAP:
        acc = tl.trans(acc_t)
    _put_tile(acc, m, n, M, N, y_ptr, sym, b_ptr, part_ptr, pid_s, HAS_BIAS, SPLIT)
    if GROUPS > 1:
        _put_tile(tl.trans(acc_t1), m + BLOCK_M, n, M, N, y_ptr, sym, b_ptr, part_ptr, pid_s, HAS_BIAS, SPLIT)
    if GROUPS > 2:
        _put_tile(tl.trans(acc_t2), m + 2 * BLOCK_M, n, M, N, y_ptr, sym, b_ptr, part_ptr, pid_s, HAS_BIAS, SPLIT)
        _put_tile(tl.trans(acc_t3), m + 3 * BLOCK_M, n, M, N, y_ptr, sym, b_ptr, part_ptr, pid_s, HAS_BIAS, SPLIT)
    if GROUPS > 4:
        _put_tile(tl.trans(acc_t4), m + 4 * BLOCK_M, n, M, N, y_ptr, sym, b_ptr, part_ptr, pid_s, HAS_BIAS, SPLIT)
        _put_tile(tl.trans(acc_t5), m + 5 * BLOCK_M, n, M, N, y_ptr, sym, b_ptr, part_ptr, pid_s, HAS_BIAS, SPLIT)
        _put_tile(tl.trans(acc_t6), m + 6 * BLOCK_M, n, M, N, y_ptr, sym, b_ptr, part_ptr, pid_s, HAS_BIAS, SPLIT)
        _put_tile(tl.trans(acc_t7), m + 7 * BLOCK_M, n, M, N, y_ptr, sym, b_ptr, part_ptr, pid_s, HAS_BIAS, SPLIT)
    if SPLIT > 1:  # the last program of the tile adds the partials in split order, then the bias
        tl.debug_barrier()
        if last_split(cnt_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), SPLIT):
            for g in tl.static_range(GROUPS):
                _sum_parts(m + g * BLOCK_M, n, M, N, y_ptr, sym, b_ptr, part_ptr, HAS_BIAS, SPLIT, BLOCK_M, BLOCK_N)


def decode_groups(m: int) -> int:
    """Token-row groups per program of the decode tile at M rows: 1 up to DECODE_BLOCK_T rows, 2 up to twice
    that, 4 up to four times (each weight tile read once per up to 64 rows instead of once per 16), then
    DECODE_MAX_GROUPS (4 or 8). Any count gives every row the same bits (`_bi_matmul_kernel`), so it may
    follow M."""
    if DECODE_MAX_GROUPS not in (4, 8):
        raise ValueError(f"batch_invariant.DECODE_MAX_GROUPS: expected 4 or 8, got {DECODE_MAX_GROUPS}")
    t = DECODE_BLOCK_T
    return 1 if m <= t else 2 if m <= 2 * t else 4 if m <= 4 * t else DECODE_MAX_GROUPS


def bi_split(n: int, k: int) -> int:
    """The K split of an [n, k] weight in a decode-kind graph (the decode tile): doubles while one M tile's
    grid stays under SPLIT_PROGRAMS, each split keeps SPLIT_MIN_STEPS K steps and the split stays within
    SPLIT_TICKS (the tile counters' period, kernels/_tl.py). From the weight's shape
    only (never M), so every row count gets the same split and the same bits."""
    tiles, steps, split = triton.cdiv(n, DECODE_BLOCK_N), triton.cdiv(k, DECODE_BLOCK_K), 1
    while tiles * split < SPLIT_PROGRAMS and steps >= 2 * split * SPLIT_MIN_STEPS and 2 * split <= SPLIT_TICKS:
        split *= 2
    return split


def _check(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dtype not in _DTYPES or w.dtype != x.dtype:
        raise ValueError(f"bi_matmul: x and w must share one float dtype of {_DTYPES}, got {x.dtype}, {w.dtype}")
    if w.dim() != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"bi_matmul: x [..., K] and w [N, K] expected, got {list(x.shape)}, {list(w.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != w.shape[0]):
        raise ValueError(f"bi_matmul: bias [N = {w.shape[0]}] expected, got {list(bias.shape)}")


def bi_matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
              out_dtype: torch.dtype | None = None, split: int = 1, decode: bool = False) -> torch.Tensor:
    """y [..., N] = x [..., K] @ w [N, K]^T (+ bias) with fixed tiles and K order (batch-invariant),
    fp32 accumulation, one rounding to `out_dtype` (default x's). `split` (a power of two, from the
    weight's shape: `bi_split`) programs share a tile's K and add their partials in split order.
    `decode`: the decode tile (DECODE_*: weight rows on the MMA's rows, 16 token rows per tile), for
    decode-kind graphs, where M is a few rows; else the 64 x 64 tile. Each is fixed for every M.
    CPU tensors run under the interpreter."""
    _check(x, w, bias)
    return _launch_bi(x, w, bias, out_dtype, split, decode, None)


def _launch_bi(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None,
               split: int, decode: bool, ws: torch.Tensor | None) -> torch.Tensor:
    """bi_matmul's launch; `ws` (the scale tiles, uint8 e8m0 bytes or fp32) when w holds e4m3 values."""
    if split < 1 or split & (split - 1):
        raise ValueError(f"bi_matmul: split must be a power of two >= 1, got {split}")
    N, K = w.shape
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    wc = w if w.stride(-1) == 1 else w.contiguous()
    M = x2.shape[0]
    y = torch.empty((M, N), dtype=out_dtype or x.dtype, device=x.device)
    if M:
        bm, bn, bk = (DECODE_BLOCK_T, DECODE_BLOCK_N, DECODE_BLOCK_K) if decode else (BLOCK_M, BLOCK_N, BLOCK_K)
        stages = {"num_stages": DECODE_STAGES if x.dtype != torch.float32 else 2} if decode else {}
        groups = decode_groups(M) if decode else 1
        k_split = triton.cdiv(triton.cdiv(K, split), bk) * bk
        a_reg = (decode and ws is None and x.dtype != torch.float32 and x.device.type == "cuda"
                 and 0 < DECODE_A_REG_MIN_GROUPS <= groups)
        grid = (triton.cdiv(M, bm * groups), triton.cdiv(N, bn), split)  # M tiles side by side
        if split > 1:
            part = torch.empty((split, M, N), dtype=torch.float32, device=x.device)
            cnt = split_counters(x.device, grid[0] * grid[1], split)
        else:
            part, cnt = y, y
        fp8 = {} if ws is None else {"ws_ptr": ws, "swsn": ws.stride(0), "W_FP8": True,
                                     "WS_E8M0": ws.dtype == torch.uint8}
        _bi_matmul_kernel[grid](x2, wc, bias if bias is not None else wc, y, part, cnt, M, N, K, x2.stride(0),
                                wc.stride(0), y.stride(0), HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn,
                                BLOCK_K=bk, F32=x.dtype == torch.float32, INTERPRET=x.device.type == "cpu",
                                K_SPLIT=k_split, SPLIT=split, SWAP=decode, GROUPS=groups, A_REG=a_reg,
                                num_warps=4,
                                **stages, **pdl_launch(x2), **fp8)
    return y.view(*x.shape[:-1], N)


def bi_matmul_fp8(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, out_dtype: torch.dtype | None = None,
                  split: int = 1, decode: bool = False) -> torch.Tensor:
    """`bi_matmul` of x [..., K] (bf16 / fp16) and FP8 block weights: w_q e4m3 [N, K], w_s [ceil(N/128),
    ceil(K/128)] (e8m0, its uint8 bytes, or fp32), y = x @ dequant(w_q, w_s)^T with the same fixed tiles,
    K walk and split; each K step's partial product scaled by its tile's scale. CPU tensors run under the
    interpreter."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"bi_matmul_fp8: x bf16/fp16 [..., K] expected, got {x.dtype} {list(x.shape)}")
    from dsv4c.kernels.fp8_gemm import _check_weight, _scale  # the dense FP8 kernels' weight contract

    ws = _check_weight(w_q, _scale(w_s), x.shape[-1])  # uint8 e8m0 bytes or fp32, as the kernel reads them
    return _launch_bi(x, w_q, None, out_dtype, split, decode, ws)


def bi_matmul_fp8_ref(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor,
                      out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The function `bi_matmul_fp8` computes: an fp32 product with the dequantised weight, rounded once."""
    from dsv4c import quant as Q
    from dsv4c.kernels.fp8_gemm import _scale

    w = Q.dequant_fp8_block(w_q, _scale(w_s))
    return bi_matmul_ref(x.float(), w).to(out_dtype or x.dtype)


def bi_matmul_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The function `bi_matmul` computes: an fp32 product of the stored values, rounded once."""
    y = torch.nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float())
    return y.to(out_dtype or x.dtype)


@triton.jit
def _bi_gemv_kernel(x_ptr, rows_ptr, e_ptr, w_ptr, y_ptr, N, K: tl.constexpr, sxm, swe, swn,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    p = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    nm = n < N
    row = tl.load(rows_ptr + p).to(tl.int64)
    e = tl.load(e_ptr + p).to(tl.int64)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # fixed order
        km = (k0 + k) < K
        a = tl.load(x_ptr + row * sxm + k0 + k, mask=km, other=0.0).to(tl.float32)
        b = tl.load(w_ptr + e * swe + n[:, None].to(tl.int64) * swn + k0 + k[None, :],
                    mask=nm[:, None] & km[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(b * a[None, :], axis=1)
    tl.store(y_ptr + p.to(tl.int64) * N + n, acc.to(y_ptr.dtype.element_ty), mask=nm)


def bi_gemv_gathered(x: torch.Tensor, rows: torch.Tensor, experts: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y [P, N] = x[rows[p]] [K] @ w[experts[p]] [N, K]^T, one (pair, N-block) per program, fp32
    accumulation in a fixed K order, rounded to x's dtype. x [M, K], rows/experts [P] int, w [E, N, K]."""
    if w.dim() != 3 or x.dim() != 2 or x.shape[1] != w.shape[2] or x.dtype != w.dtype:
        raise ValueError(f"bi_gemv_gathered: x [M, K] and w [E, N, K] of one dtype expected, got "
                         f"{list(x.shape)} {x.dtype}, {list(w.shape)} {w.dtype}")
    E, N, K = w.shape
    xc, wc = x.contiguous(), w.contiguous()
    P = rows.shape[0]
    y = torch.empty((P, N), dtype=x.dtype, device=x.device)
    if P:
        _bi_gemv_kernel[(P, triton.cdiv(N, GEMV_BLOCK_N))](xc, rows.contiguous(), experts.contiguous(), wc, y, N, K,
                                                           xc.stride(0), wc.stride(0), wc.stride(1),
                                                           BLOCK_N=GEMV_BLOCK_N, BLOCK_K=GEMV_BLOCK_K, num_warps=4,
                                                           **pdl_launch(xc))
    return y


def bi_gemv_gathered_ref(x: torch.Tensor, rows: torch.Tensor, experts: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.einsum("pk,pnk->pn", x[rows].float(), w[experts].float()).to(x.dtype)


def moe_experts_bi_impl(x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, w1: torch.Tensor,
                        w3: torch.Tensor, w2: torch.Tensor, swiglu_limit: float, gemv=bi_gemv_gathered) -> torch.Tensor:
    """The routed experts with one path for any token count: each (token, choice) pair's gate/up/down
    GEMVs (`gemv`), then the choices combined per token in choice order in fp32, rounded once.
    x [T, D], idx/weight [T, C] -> [T, D]. (The reference sums choices in bf16 in expert order via
    index_add_; the sum here differs by rounding only.)"""
    from dsv4c.model.common import swiglu_act

    T, C = idx.shape
    rows = torch.arange(T * C, device=x.device) // C                           # [P] token of each pair
    experts = idx.reshape(-1)                                                  # [P]
    g = gemv(x, rows, experts, w1)                                             # [P, I]
    u = gemv(x, rows, experts, w3)
    h = swiglu_act(g, u, swiglu_limit).to(x.dtype)                             # [P, I]
    pairs = torch.arange(T * C, device=x.device)
    y = gemv(h, pairs, experts, w2).float().view(T, C, -1)                     # [T, C, D]
    wt = weight.float()
    out = y[:, 0] * wt[:, 0, None]
    for c in range(1, C):  # fixed order, elementwise: no reduction kernel that could reorder
        out = out + y[:, c] * wt[:, c, None]
    return out.to(x.dtype)


@torch.library.custom_op("dsv4c::linear_bi", mutates_args=())
def linear_bi(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out_f32: bool,
              split: int = 1, decode: bool = False) -> torch.Tensor:
    """`bi_matmul` on CUDA tensors (output fp32 with `out_f32`, else x's dtype; K split `split`; the
    decode tile with `decode`); CPU tensors run the reference (torch's CPU GEMM: not proven
    batch-invariant, see ARCHITECTURE.md, deterministic mode)."""
    out = torch.float32 if out_f32 else x.dtype
    if x.device.type == "cpu":
        return bi_matmul_ref(x, w, bias, out)
    return bi_matmul(x, w, bias, out, split, decode)


@linear_bi.register_fake
def _linear_bi_fake(x, w, bias, out_f32, split=1, decode=False):
    return x.new_empty((*x.shape[:-1], w.shape[0]), dtype=torch.float32 if out_f32 else x.dtype)


@torch.library.custom_op("dsv4c::fp8_linear_bi", mutates_args=())
def fp8_linear_bi(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, split: int = 1,
                  decode: bool = False) -> torch.Tensor:
    """`dsv4c::fp8_linear_w8a16` batch-invariantly: `bi_matmul_fp8` on CUDA tensors (K split `split`, the
    decode tile with `decode`), y in x's dtype; CPU tensors run the reference."""
    if x.device.type == "cpu":
        return bi_matmul_fp8_ref(x, w_q, w_s)
    xb = x if x.dtype in (torch.bfloat16, torch.float16) else x.to(torch.bfloat16)
    return bi_matmul_fp8(xb, w_q, w_s, x.dtype, split, decode)


@fp8_linear_bi.register_fake
def _fp8_linear_bi_fake(x, w_q, w_s, split=1, decode=False):
    return x.new_empty((*x.shape[:-1], w_q.shape[0]))


@torch.library.custom_op("dsv4c::moe_experts_bi", mutates_args=())
def moe_experts_bi(x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                   w2: torch.Tensor, swiglu_limit: float) -> torch.Tensor:
    """`moe_experts` with one fixed path (`moe_experts_bi_impl`); CPU tensors use the torch GEMV."""
    gemv = bi_gemv_gathered_ref if x.device.type == "cpu" else bi_gemv_gathered
    return moe_experts_bi_impl(x, idx, weight, w1, w3, w2, swiglu_limit, gemv)


@moe_experts_bi.register_fake
def _moe_experts_bi_fake(x, idx, weight, w1, w3, w2, swiglu_limit):
    return torch.empty_like(x)


FP4_WEIGHT_ONLY = ("mxfp4", "nvfp4")  # expert container formats `moe_experts_fp4_bi` runs


def fp4_bi_config(device: torch.device):
    """The one GEMV tile of `moe_experts_fp4_bi` on `device`, never chosen from the token count (small K
    steps under the CPU interpreter, as kernels/moe_fp4_gemv.py's default)."""
    from dsv4c.kernels.moe_fp4_gemv import default_gemv_config

    return default_gemv_config(device)


def moe_experts_fp4_bi_gemv(x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, experts,
                            swiglu_limit: float) -> torch.Tensor:
    """FP4 weight-only experts (an Mxfp4Experts / Nvfp4Experts container) through `moe_fp4_gemv` with
    `fp4_bi_config`: one path at any token count (module docstring). x bf16 [T, D] -> bf16 [T, D]; CPU
    tensors run under the Triton interpreter."""
    from dsv4c.kernels.moe_fp4_gemv import moe_fp4_gemv

    if x.device.type == "cuda" and experts.format == "nvfp4" and torch.cuda.get_device_capability(x.device) < (8, 9):
        raise ValueError("moe_experts_fp4_bi: nvfp4's e4m3 scales decode through fp8e4nv, which needs CUDA "
                         f"capability >= 8.9; this GPU is {torch.cuda.get_device_capability(x.device)}")
    return moe_fp4_gemv(x.contiguous(), idx, weight, experts.w13, experts.w13_scale,
                        getattr(experts, "w13_global", None), experts.w2, experts.w2_scale,
                        getattr(experts, "w2_global", None), experts.group, swiglu_limit, fp4_bi_config(x.device))


def moe_experts_fp4_bi_ref(x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, experts,
                           swiglu_limit: float) -> torch.Tensor:
    """The function `moe_experts_fp4_bi_gemv` computes: `moe_grouped_ref` (fp32) cast to x's dtype."""
    from dsv4c.kernels.moe_grouped import moe_grouped_ref

    return moe_grouped_ref(x, idx, weight, experts, swiglu_limit).to(x.dtype)


@torch.library.custom_op("dsv4c::moe_experts_fp4_bi", mutates_args=())
def moe_experts_fp4_bi(x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, fmt: str, w13: torch.Tensor,
                       w13_scale: torch.Tensor, w13_global: torch.Tensor | None, w2: torch.Tensor,
                       w2_scale: torch.Tensor, w2_global: torch.Tensor | None, swiglu_limit: float) -> torch.Tensor:
    """`moe_experts_q` of FP4 weight-only experts (fmt mxfp4 or nvfp4, the container's fields as
    kernels/moe_grouped.py passes them) with one path at any token count (`moe_experts_fp4_bi_gemv`).
    x bf16 [T, D], idx [T, C], weight fp32 [T, C] -> bf16 [T, D]. CPU tensors compute the reference
    (`moe_experts_fp4_bi_ref`), as `moe_experts_q` does."""
    from dsv4c.kernels.moe_grouped import experts_from_tensors

    if fmt not in FP4_WEIGHT_ONLY:
        raise ValueError(f"moe_experts_fp4_bi: fmt must be one of {FP4_WEIGHT_ONLY}, got {fmt!r}")
    ex = experts_from_tensors(fmt, w13=w13, w13_scale=w13_scale, w13_global=w13_global, w2=w2, w2_scale=w2_scale,
                              w2_global=w2_global)
    run = moe_experts_fp4_bi_ref if x.device.type == "cpu" else moe_experts_fp4_bi_gemv
    return run(x, idx, weight, ex, swiglu_limit)


@moe_experts_fp4_bi.register_fake
def _moe_experts_fp4_bi_fake(x, idx, weight, fmt, w13, w13_scale, w13_global, w2, w2_scale, w2_global, swiglu_limit):
    return torch.empty_like(x)


def fp8_bi_config(n_assign: int, n_experts: int):
    """The tiles of `moe_experts_fp8_bi`: kernels/moe_grouped.py's decode tile for fp8_block (16 assignment
    rows x 64 output columns x 128 K, 4 warps, 4 stages; GEMM 1's outputs in 128-column blocks for their
    1x128 e4m3 scales) at every token count, never the prefill kernels or a split K. Only the routing follows
    the count: `direct` (each assignment its own M-block, the other 15 rows masked) while few assignments
    share an expert, sorted M-blocks of one expert's assignments above (each expert's weight tile read once
    per 16 of them). A row's products, K order and scales are the same in both: an MMA's row depends on its
    own A row only, the activations are quantised per token row, and the choices are summed per token in
    choice order (kernels/moe_combine.py)."""
    from dsv4c.kernels.moe_grouped import MoeKernelConfig

    return MoeKernelConfig(16, 64, 128, 4, 4, direct=n_assign <= max(n_experts // 4, 16))


def moe_experts_fp8_bi_impl(x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, experts,
                            swiglu_limit: float) -> torch.Tensor:
    """FP8 block experts (an Fp8BlockExperts container, W8A8 with 1x128 activation scales) through
    `moe_grouped` with `fp8_bi_config`. x bf16 [T, D] -> bf16 [T, D]; CPU tensors run under the interpreter."""
    from dsv4c.kernels.moe_grouped import moe_grouped

    return moe_grouped(x.contiguous(), idx, weight, experts, swiglu_limit,
                       config=fp8_bi_config(idx.numel(), experts.dims[0]))


@torch.library.custom_op("dsv4c::moe_experts_fp8_bi", mutates_args=())
def moe_experts_fp8_bi(x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, w13: torch.Tensor,
                       w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                       swiglu_limit: float) -> torch.Tensor:
    """`moe_experts_q` of FP8 block experts with one tile at any token count (`moe_experts_fp8_bi_impl`):
    each expert read once per 16 of its assignments (the FP4 GEMV of `moe_experts_fp4_bi` reads it once per
    assignment). x bf16 [T, D], idx [T, C], weight fp32 [T, C] -> bf16 [T, D]. CPU tensors compute the
    reference (`moe_grouped_ref` cast to x's dtype), as `moe_experts_q` does."""
    from dsv4c.kernels.moe_grouped import experts_from_tensors, moe_grouped_ref

    ex = experts_from_tensors("fp8_block", w13=w13, w13_scale=w13_scale, w2=w2, w2_scale=w2_scale)
    if x.device.type == "cpu":
        return moe_grouped_ref(x, idx, weight, ex, swiglu_limit).to(x.dtype)
    return moe_experts_fp8_bi_impl(x, idx, weight, ex, swiglu_limit)


@moe_experts_fp8_bi.register_fake
def _moe_experts_fp8_bi_fake(x, idx, weight, w13, w13_scale, w2, w2_scale, swiglu_limit):
    return torch.empty_like(x)


@torch.library.custom_op("dsv4c::grouped_linear_bi", mutates_args=())
def grouped_linear_bi(x: torch.Tensor, w: torch.Tensor, split: int = 1, decode: bool = False) -> torch.Tensor:
    """`dsv4c::grouped_linear` (z [B, T, G, R] = einsum('btgi,gri->btgr', x.to(w.dtype), w)) as one
    `bi_matmul` per group (K split `split`, the decode tile with `decode`): the same path for any token
    count (the default op switches to the einsum above 16 rows). CPU tensors run the reference."""
    xw = x.to(w.dtype)
    mm = bi_matmul_ref if x.device.type == "cpu" else functools.partial(bi_matmul, split=split, decode=decode)
    return torch.stack([mm(xw[:, :, g], w[g]) for g in range(w.shape[0])], dim=2)


@grouped_linear_bi.register_fake
def _grouped_linear_bi_fake(x, w, split=1, decode=False):
    return w.new_empty((*x.shape[:2], w.shape[0], w.shape[1]))


@triton.jit
def _row_sum_kernel(x_ptr, y_ptr, K: tl.constexpr, sxm, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program m: y[m] = sum_k x[m, k] in fp32. Lane i adds x[m, i], x[m, i + BLOCK], ... from k = 0 upward,
    then one tl.sum over the lanes: the order depends on K and BLOCK, never on how many rows share the call."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        acc += tl.load(x_ptr + row * sxm + k0 + k, mask=(k0 + k) < K, other=0.0).to(tl.float32)
    tl.store(y_ptr + row, tl.sum(acc, axis=0))


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """fp32 [...] = x [..., K].sum(-1), one program per row in a fixed order (`_row_sum_kernel`): a row's bits
    do not depend on the other rows. CPU tensors run under the interpreter."""
    if x.dtype not in _DTYPES:
        raise ValueError(f"row_sum: x must be one of {_DTYPES}, got {x.dtype}")
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    if x2.shape[0]:
        _row_sum_kernel[(x2.shape[0],)](x2, y, K, x2.stride(0), BLOCK=ROW_SUM_BLOCK, num_warps=4, **pdl_launch(x2))
    return y.view(x.shape[:-1])


@torch.library.custom_op("dsv4c::sum_bi", mutates_args=())
def sum_bi(x: torch.Tensor, dim: int, keepdim: bool, mean: bool) -> torch.Tensor:
    """x.sum(dim) (or .mean) in a fixed order: over the last dim one program per row (`row_sum`; fp32
    accumulation, fixed lane and K order), over another dim by adding its slices in index order (elementwise
    adds). A torch reduction may split one row over several blocks when few rows share the call. (The last
    dim once ran as a `bi_matmul` with a ones row: one program per 64 rows walking all of K, 1.4 ms of a 2.4 ms
    deterministic decode step on the slice for the head's mean over hc x D = 16384 values, run38.)"""
    d = dim % x.dim()
    n = x.shape[d]
    if d == x.dim() - 1 and x.device.type != "cpu":
        s = row_sum(x)
    else:
        s = x.select(d, 0).float() if n else x.sum(d).float()
        for i in range(1, n):
            s = s + x.select(d, i).float()
    if mean:
        s = s / n
    s = s.to(x.dtype)
    return s.unsqueeze(d) if keepdim else s


@sum_bi.register_fake
def _sum_bi_fake(x, dim, keepdim, mean):
    d = dim % x.dim()
    shape = list(x.shape)
    if keepdim:
        shape[d] = 1
    else:
        shape.pop(d)
    return x.new_empty(shape)
