"""Decode-shaped dense FP8 block GEMMs (M <= 64 tokens): split over N and K to fill the GPU.

At decode a dense linear reads its whole weight for a handful of tokens, so its time is the
weight bytes over the bandwidth the launch can draw. The tile GEMM of kernels/fp8_gemm.py gives
each program 128 output rows and all of K: the slice's wq_a ‖ wkv ([1536, 4096]) is 12 programs,
wo_b and the shared expert ([4096, K]) 32, on a GPU of 132 SMs. Here a program owns BLOCK_N rows
(16..128) and a K range; when the N tiles alone are too few to fill the SMs, SPLIT programs share
a tile's K, each writes its fp32 partial, and the program that finishes last (an atomic counter
per tile) sums the SPLIT partials in split order and writes the output: one launch, and the
result does not depend on which program finished last.

* `fp8_gemv_w8a16(a, w_q, w_s)`: bf16/fp16 activations x e4m3 weights with 128x128 scales
  (ue8m0 bytes or fp32); per 128-wide K block the fp32 partial product of the exact e4m3 values
  (cast to a's dtype, exact) with a is multiplied by the block's weight scale (one scalar per
  program and block: BLOCK_N divides 128). Ref: `fp8_gemv_w8a16_ref`.
* `fp8_gemv_grouped_w8a16(a, w_q, w_s, groups)`: the same block-diagonally (V4's grouped wo_a at one
  token): the weight rows of group g take the activations' columns of group g.
* `fp8_gemv_w8a8(a_q, a_s, w_q, w_s)`: the same with e4m3 activations and fp32 1x128 scales
  (kernels/act_quant.py), e4m3 x e4m3 tensor-core products, both scales on the fp32 partial.
  Ref: `fp8_gemv_w8a8_ref`.

One token (BLOCK_M = 1) runs on CUDA cores (fp32 products and sums, no padded tensor-core rows);
more tokens on tensor cores with BLOCK_M = 16, 32 or 64 rows (padding rows are masked, no bytes).
No host syncs; grids from shapes only (CUDA-graph safe); the split counters are a persistent
buffer that every launch leaves as it found it (`_tl.split_counters`: no memset per call). CPU
tensors run under the Triton interpreter.

Shapes: M tokens, N output features, K reduction; Kb = ceil(K/128) scale blocks.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from dsv4c.kernels import _tl as U

from dsv4c import quant as Q

__all__ = ["Fp8GemvConfig", "default_config", "fp8_gemv_w8a16", "fp8_gemv_w8a16_ref", "fp8_gemv_grouped_w8a16",
           "fp8_gemv_grouped_w8a16_ref", "fp8_gemv_w8a8", "fp8_gemv_w8a8_ref", "MAX_M"]

_B = Q.FP8_BLOCK
MAX_M = 64  # the ops in kernels/fp8_gemm.py take this kernel up to here, the tile GEMM above
# one token: the K split doubles while the grid stays under this many programs per SM (and each keeps a K step).
# run64 (H200, the 2-layer slice's batch-1 step on the GPU alone, interleaved): 16: 0.606 / 0.605 ms, 8: 0.610 /
# 0.612, 2 (the earlier rule): 0.629 / 0.629; 32 0.607. The dense linears' critical path 358-360 vs 379-382 µs.
GEMV_PROGRAMS_PER_SM = 16


@dataclass(frozen=True)
class Fp8GemvConfig:
    """block_m: token rows per program (1: CUDA cores; 16/32/64: tensor cores); block_n: weight rows
    per program (a power of two dividing 128, so one scale row per program); block_k: K columns per
    loop step (a multiple of 128); split: programs per output tile along K (a power of two);
    num_warps / num_stages: Triton's. One token's K loop holds the next step in registers (run65, H100: Triton's
    pipeliner through shared memory timed equal in the 2-layer step, and was removed)."""

    block_m: int
    block_n: int
    block_k: int = 256
    split: int = 1
    num_warps: int = 4
    num_stages: int = 4

    def check(self) -> None:
        if self.block_m not in (1, 16, 32, 64):
            raise ValueError(f"Fp8GemvConfig.block_m: 1, 16, 32 or 64, got {self.block_m}")
        if self.block_n not in (16, 32, 64, 128):
            raise ValueError(f"Fp8GemvConfig.block_n: 16, 32, 64 or 128 (divides the 128-row scale tile), "
                             f"got {self.block_n}")
        if self.block_k < _B or self.block_k % _B or self.block_k & (self.block_k - 1):
            raise ValueError(f"Fp8GemvConfig.block_k: a power of two multiple of {_B}, got {self.block_k}")
        if self.split < 1 or self.split & (self.split - 1):
            raise ValueError(f"Fp8GemvConfig.split: a power of two, got {self.split}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"Fp8GemvConfig.num_warps: 1, 2, 4, 8 or 16, got {self.num_warps}")


def default_config(m: int, n: int, k: int, sm_count: int) -> Fp8GemvConfig:
    """Tiles for an [m, k] x [n, k]^T product on `sm_count` SMs, as the sweeps of
    examples/bench_dense_kernels.py chose them at the slice's six dense shapes (H200 for one token,
    H100 run36 for 8 and 64: examples/results/device-2026-12-05e/).

    One token: 32 rows x 512 columns per step on 8 warps (120 registers, 16 KB of the next step in
    flight per program); the K split doubles while the programs stay under GEMV_PROGRAMS_PER_SM (16)
    per SM: more programs, more bytes in flight (run64, Flash's wo_b alone: 20.4 µs from a cold L2 at
    split 4, 18.0 at split 16, and 17.2 from a warm L2 at split 4: the GEMV is not bandwidth-bound at
    this size). More tokens:
    tensor cores, 16 (up to 16 tokens) or 32 / 64 token rows x 64 weight rows x 128 columns per step,
    3 stages, 4 warps; the K split doubles only while the doubled grid stays within two programs per SM
    (at 8 tokens the wider split of the one-token rule was 1.1-1.6x slower on every split shape). Both
    keep a K step per split and the fp32 partials (split * m * n * 4 bytes, written and read once)
    under a quarter of the weight bytes."""
    if m == 1:
        bm, bn, bk, warps, stages = 1, 32, 512 if k >= 1024 else _B, 8, 4
    else:
        bm, bn, bk, warps, stages = min(MAX_M, max(16, triton.next_power_of_2(m))), 64, _B, 4, 3
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    steps = triton.cdiv(k, bk)
    grid_cap = GEMV_PROGRAMS_PER_SM * sm_count if m == 1 else sm_count  # programs (one token) / before a doubling
    split = 1
    while (tiles * split < grid_cap and steps >= 2 * split and 2 * split <= U.SPLIT_TICKS
           and 2 * split * min(m, MAX_M) * n * 4 <= n * k // 4):
        split *= 2
    return Fp8GemvConfig(bm, bn, bk, split, num_warps=warps, num_stages=stages)


@triton.jit
def _tc_loop(a_rows, as_rows, w_rows, ws_row, n_ok, m_ok, k_lo, K: tl.constexpr, A_FP8: tl.constexpr,
             WS_E8M0: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, K_SPLIT: tl.constexpr, A_ROUND: tl.constexpr = None,
             RNE_BF16: tl.constexpr = False):
    """Tensor cores: acc [BN, BM] = sum over 128-wide K blocks of (w_blk @ a_blk^T) * scales.
    Loads feed the dot, so Triton's pipeliner keeps num_stages steps in flight. A_ROUND (a 16-bit dtype, or
    None): fp32 activations rounded to it before the products (RNE_BF16: by the bits, under the interpreter)."""
    KB: tl.constexpr = (K + 127) // 128
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for i in range(K_SPLIT // BLOCK_K):
        for j in tl.static_range(BLOCK_K // 128):
            k0 = k_lo + i * BLOCK_K + j * 128
            ks = k0 + tl.arange(0, 128)
            k_ok = ks < K
            w = tl.load(w_rows + ks[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)   # [BN, 128] e4m3
            a = tl.load(a_rows + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)   # [BM, 128]
            kb = tl.minimum(k0 // 128, KB - 1)  # a step past K (the last split's padding) reads zeros of w
            ws = tl.load(ws_row + kb)
            if WS_E8M0:
                ws = U.e8m0_value(ws.to(tl.int32))
            if A_FP8:
                part = U.mma(w, a, tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), INTERPRET)
                a_s = tl.load(as_rows + kb, mask=m_ok, other=0.0)                                # [BM]
                acc += part * (a_s * ws)[None, :]
            else:
                if A_ROUND is not None:
                    a = U.round_to(a.to(tl.float32), A_ROUND, RNE_BF16).to(A_ROUND)
                part = U.mma(w.to(a.dtype), a, tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), INTERPRET)
                acc += part * ws
    return acc


@triton.jit
def _w_step(w_rows, ws_row, n_ok, k0, k_hi, K: tl.constexpr, WS_E8M0: tl.constexpr, BLOCK_K: tl.constexpr):
    """One K step's weights (columns k0.. below min(k_hi, K), zeros past them): (e4m3 [BN, BK], their fp32
    scales [BK], one per column)."""
    ks = k0 + tl.arange(0, BLOCK_K)
    kb = tl.minimum(ks // 128, (K + 127) // 128 - 1)                                   # [BK]
    w = tl.load(w_rows + ks[None, :], mask=n_ok[:, None] & ((ks < K) & (ks < k_hi))[None, :], other=0.0)
    ws = tl.load(ws_row + kb)
    if WS_E8M0:
        ws = U.e8m0_value(ws.to(tl.int32))
    return w, ws


@triton.jit
def _a_step(a_row, as_row, k0, k_hi, K: tl.constexpr, A_FP8: tl.constexpr, BLOCK_K: tl.constexpr,
            A_ROUND: tl.constexpr = None, RNE_BF16: tl.constexpr = False):
    """One K step of one token's activations, fp32 [BK] (zeros past min(k_hi, K)); FP8 ones times their
    1x128 scales; A_ROUND (a dtype, or None): rounded to it first (fp32 activations the model casts)."""
    ks = k0 + tl.arange(0, BLOCK_K)
    ok = (ks < K) & (ks < k_hi)
    a = tl.load(a_row + ks, mask=ok, other=0.0).to(tl.float32)
    if A_ROUND is not None:
        a = U.round_to(a, A_ROUND, RNE_BF16)
    if A_FP8:
        a = a * tl.load(as_row + tl.minimum(ks // 128, (K + 127) // 128 - 1))
    return a


@triton.jit
def _fma_loop(a_row, as_row, w_rows, ws_row, n_ok, k_lo, w, ws, K: tl.constexpr, A_FP8: tl.constexpr,
              WS_E8M0: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_SPLIT: tl.constexpr,
              A_ROUND: tl.constexpr = None, RNE_BF16: tl.constexpr = False):
    """CUDA cores, one token: acc [BN, 1], given the first K step's weights (w, ws: `_w_step` at k_lo). The
    next K step is loaded before the current one is multiplied (the pipeliner only serves loads that feed a
    dot); products and sums in fp32."""
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    k_hi = k_lo + K_SPLIT
    a = _a_step(a_row, as_row, k_lo, k_hi, K, A_FP8, BLOCK_K, A_ROUND, RNE_BF16)
    for i in range(K_SPLIT // BLOCK_K):
        k1 = k_lo + (i + 1) * BLOCK_K
        w1, ws1 = _w_step(w_rows, ws_row, n_ok, k1, k_hi, K, WS_E8M0, BLOCK_K)
        a1 = _a_step(a_row, as_row, k1, k_hi, K, A_FP8, BLOCK_K, A_ROUND, RNE_BF16)
        acc += tl.sum(w.to(tl.float32) * (ws * a)[None, :], axis=1)
        w, ws, a = w1, ws1, a1
    return acc[:, None]


@triton.jit
def _gemv_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K: tl.constexpr,
                 stride_am, stride_asm, stride_wn, stride_wsn, stride_ym,
                 A_FP8: tl.constexpr, WS_E8M0: tl.constexpr, INTERPRET: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 K_SPLIT: tl.constexpr, SPLIT: tl.constexpr, GROUP_ROWS: tl.constexpr = 0,
                 ROUND_A: tl.constexpr = False, RNE_BF16: tl.constexpr = False, PDL: tl.constexpr = False):
    """Program (pid_n, pid_s, pid_m): acc [BLOCK_N, BLOCK_M] = w rows x a rows over K range pid_s.
    GROUP_ROWS > 0: weight rows [g·GROUP_ROWS, (g+1)·GROUP_ROWS) take columns [g·K, (g+1)·K) of a's rows.
    ROUND_A: a's (fp32) values are rounded to y's dtype before the products."""
    U.pdl_wait(PDL)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    if GROUP_ROWS > 0:  # a tile's rows lie in one group (BLOCK_N divides GROUP_ROWS)
        a_ptr += (pid_n * BLOCK_N // GROUP_ROWS).to(tl.int64) * K
    n_idx = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                                  # [BN]
    m_idx = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                                  # [BM]
    n_ok = n_idx < N
    m_ok = m_idx < M
    w_rows = w_ptr + n_idx.to(tl.int64)[:, None] * stride_wn                         # [BN, 1]
    ws_row = ws_ptr + (pid_n * BLOCK_N // 128) * stride_wsn
    k_lo = pid_s * K_SPLIT
    if BLOCK_M == 1:
        row = pid_m.to(tl.int64)
        w0, ws0 = _w_step(w_rows, ws_row, n_ok, k_lo, k_lo + K_SPLIT, K, WS_E8M0, BLOCK_K)
        acc = _fma_loop(a_ptr + row * stride_am, as_ptr + row * stride_asm, w_rows, ws_row, n_ok, k_lo, w0, ws0,
                        K, A_FP8, WS_E8M0, BLOCK_N, BLOCK_K, K_SPLIT,
                        y_ptr.dtype.element_ty if ROUND_A else None, RNE_BF16)
    else:
        acc = _tc_loop(a_ptr + m_idx.to(tl.int64)[:, None] * stride_am, as_ptr + m_idx * stride_asm, w_rows, ws_row,
                       n_ok, m_ok, k_lo, K, A_FP8, WS_E8M0, INTERPRET, BLOCK_M, BLOCK_N, BLOCK_K, K_SPLIT,
                       y_ptr.dtype.element_ty if ROUND_A else None, RNE_BF16)
    y_ptrs = y_ptr + m_idx[None, :] * stride_ym + n_idx[:, None]                     # [BN, BM]
    ok = n_ok[:, None] & m_ok[None, :]
    # partials [SPLIT, M, N] fp32
    U.store_split(acc, y_ptrs, part_ptr + m_idx[None, :] * N + n_idx[:, None], M * N, ok,
                  cnt_ptr + pid_m * tl.num_programs(0) + pid_n, pid_s, SPLIT)


def _check_weight(w_q: torch.Tensor, w_s: torch.Tensor, k: int) -> torch.Tensor:
    """w_q e4m3 [N, K] unit stride along K, w_s e8m0 (or its uint8 bytes) / fp32 [ceil(N/128), ceil(K/128)];
    returns the scale as the kernel reads it (uint8 bytes or fp32)."""
    if w_q.dtype != torch.float8_e4m3fn or w_q.dim() != 2 or w_q.shape[1] != k or w_q.stride(1) != 1:
        raise ValueError(f"w_q: expected float8_e4m3fn [N, {k}] with unit stride along K, got {w_q.dtype} "
                         f"shape {tuple(w_q.shape)} strides {w_q.stride()}")
    want = (triton.cdiv(w_q.shape[0], _B), triton.cdiv(k, _B))
    if (tuple(w_s.shape) != want or w_s.dtype not in (torch.float8_e8m0fnu, torch.uint8, torch.float32)
            or w_s.stride(1) != 1):
        raise ValueError(f"w_s: expected float8_e8m0fnu (or uint8 bytes) or fp32 {want} (128x128 tiles of w_q "
                         f"{tuple(w_q.shape)}) with unit stride, got {w_s.dtype} shape {tuple(w_s.shape)}")
    if w_s.device != w_q.device:
        raise ValueError(f"w_s: on {w_s.device}, w_q on {w_q.device}")
    return w_s.view(torch.uint8) if w_s.dtype == torch.float8_e8m0fnu else w_s


def _launch(a, a_s, w_q, ws, a_fp8: bool, out_dtype: torch.dtype, config: Fp8GemvConfig | None,
            groups: int = 1) -> torch.Tensor:
    m, k = a.shape[0], a.shape[1] // groups
    n = w_q.shape[0]
    if w_q.device != a.device:
        raise ValueError(f"w_q: on {w_q.device}, activations on {a.device}")
    y = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return y
    cfg = config or default_config(m, n, k, U.sm_count(a.device))
    while config is None and groups > 1 and (n // groups) % cfg.block_n and cfg.block_n > 16:
        cfg = replace(cfg, block_n=cfg.block_n // 2)  # the default's tile within one group
    cfg.check()
    if cfg.block_m == 1 and m != 1:
        raise ValueError(f"Fp8GemvConfig.block_m = 1 takes one token, got M = {m}")
    if groups > 1 and (n // groups) % cfg.block_n:
        raise ValueError(f"Fp8GemvConfig.block_n = {cfg.block_n} does not divide the {n // groups} weight rows of a "
                         f"group (a tile must read one group's activations)")
    k_split = triton.cdiv(triton.cdiv(k, cfg.split), cfg.block_k) * cfg.block_k
    grid = (triton.cdiv(n, cfg.block_n), cfg.split, triton.cdiv(m, cfg.block_m))
    if cfg.split > 1:
        part = torch.empty(cfg.split, m, n, dtype=torch.float32, device=a.device)
        cnt = U.split_counters(a.device, grid[0] * grid[2], cfg.split)
    else:
        part, cnt = y, y
    _gemv_kernel[grid](a, a_s, w_q, ws, y, part, cnt, m, n, k, a.stride(0), a_s.stride(0), w_q.stride(0),
                       ws.stride(0), y.stride(0), A_FP8=a_fp8, WS_E8M0=ws.dtype == torch.uint8,
                       INTERPRET=U.interpret_flag(a), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                       K_SPLIT=k_split, SPLIT=cfg.split, GROUP_ROWS=n // groups if groups > 1 else 0,
                       ROUND_A=a.dtype == torch.float32 and not a_fp8,
                       RNE_BF16=U.rne_bf16(a, out_dtype), num_warps=cfg.num_warps,
                       num_stages=cfg.num_stages, **U.pdl_launch(a))
    return y


def fp8_gemv_w8a16(a: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                   config: Fp8GemvConfig | None = None) -> torch.Tensor:
    """y [M, N] = a [M, K] @ dequant(w_q, w_s)^T; a bf16/fp16 with unit stride along K (any K),
    w_q float8_e4m3fn [N, K], w_s ue8m0 (or uint8 bytes) / fp32 [ceil(N/128), ceil(K/128)].
    Meant for M <= 64 (any M works)."""
    if a.dtype not in (torch.bfloat16, torch.float16) or a.dim() != 2 or a.stride(1) != 1:
        raise ValueError(f"a: expected bf16/fp16 [M, K] with unit stride, got {a.dtype} shape {tuple(a.shape)} "
                         f"strides {a.stride() if a.dim() else ()}")
    ws = _check_weight(w_q, w_s, a.shape[1])
    return _launch(a, a, w_q, ws, False, out_dtype, config)


def fp8_gemv_w8a16_ref(a: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor) -> torch.Tensor:
    """fp32 reference of `fp8_gemv_w8a16`: a @ dequant_fp8_block(w_q, w_s)^T."""
    s = w_s.view(torch.float8_e8m0fnu) if w_s.dtype == torch.uint8 else w_s
    return a.float() @ Q.dequant_fp8_block(w_q, s).T


def fp8_gemv_grouped_w8a16(a: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, groups: int,
                           out_dtype: torch.dtype = torch.bfloat16,
                           config: Fp8GemvConfig | None = None) -> torch.Tensor:
    """A block-diagonal `fp8_gemv_w8a16` (V4's grouped wo_a): a [M, G·I] bf16/fp16 with unit stride, w_q
    e4m3 [G·R, I] with its 128x128 scales; y [M, G·R] where y[:, g·R + r] = a[:, g·I:(g+1)·I] .
    dequant(w_q)[g·R + r]: the kernel of `fp8_gemv_w8a16` with each tile's activations taken from its
    group's columns. a may also be fp32: it is rounded to out_dtype (bf16/fp16) first, as the model casts the
    attention output before the einsum. The config's block_n must divide R (the default's is
    halved down to 16 rows until it does)."""
    f32 = a.dtype == torch.float32 and out_dtype in (torch.bfloat16, torch.float16)
    if (a.dtype not in (torch.bfloat16, torch.float16) and not f32) or a.dim() != 2 or a.stride(1) != 1:
        raise ValueError(f"a: expected bf16/fp16 [M, G·I] (or fp32 with a bf16/fp16 out_dtype) with unit stride, "
                         f"got {a.dtype} shape {tuple(a.shape)} and out_dtype {out_dtype}")
    if groups < 1 or a.shape[1] % groups or w_q.dim() != 2 or w_q.shape[0] % groups:
        raise ValueError(f"groups: {groups} must divide a's {a.shape[1]} columns and w_q's rows "
                         f"({tuple(w_q.shape)})")
    ws = _check_weight(w_q, w_s, a.shape[1] // groups)
    return _launch(a, a, w_q, ws, False, out_dtype, config, groups)


def fp8_gemv_grouped_w8a16_ref(a: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, groups: int,
                               out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """fp32 reference of `fp8_gemv_grouped_w8a16`: per group, a's columns of g @ its weight rows^T (fp32 a
    rounded to out_dtype first)."""
    if a.dtype == torch.float32:
        a = a.to(out_dtype)
    s = w_s.view(torch.float8_e8m0fnu) if w_s.dtype == torch.uint8 else w_s
    w = Q.dequant_fp8_block(w_q, s).view(groups, w_q.shape[0] // groups, -1)       # [G, R, I]
    return torch.einsum("mgi,gri->mgr", a.float().view(a.shape[0], groups, -1), w).reshape(a.shape[0], -1)


def fp8_gemv_w8a8(a_q: torch.Tensor, a_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor,
                  out_dtype: torch.dtype = torch.bfloat16, config: Fp8GemvConfig | None = None) -> torch.Tensor:
    """y [M, N] = block-scaled a_q [M, K] @ w_q [N, K]^T (quant_formats.md §3); a_q float8_e4m3fn
    (K % 128 == 0, unit stride), a_s fp32 [M, K/128]; w_q, w_s as in `fp8_gemv_w8a16`."""
    if a_q.dtype != torch.float8_e4m3fn or a_q.dim() != 2 or a_q.shape[1] % _B or a_q.stride(1) != 1:
        raise ValueError(f"a_q: expected float8_e4m3fn [M, K] with K % 128 == 0 and unit stride, "
                         f"got {a_q.dtype} shape {tuple(a_q.shape)}")
    m, k = a_q.shape
    if a_s.dtype != torch.float32 or tuple(a_s.shape) != (m, k // _B) or (m and a_s.stride(1) != 1):
        raise ValueError(f"a_s: expected fp32 {(m, k // _B)} with unit stride, got {a_s.dtype} "
                         f"shape {tuple(a_s.shape)}")
    ws = _check_weight(w_q, w_s, k)
    return _launch(a_q, a_s, w_q, ws, True, out_dtype, config)


def fp8_gemv_w8a8_ref(a_q: torch.Tensor, a_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor) -> torch.Tensor:
    """fp32 reference of `fp8_gemv_w8a8` (`dsv4c.quant.fp8_block_gemm_ref`)."""
    s = w_s.view(torch.float8_e8m0fnu) if w_s.dtype == torch.uint8 else w_s
    return Q.fp8_block_gemm_ref(a_q, a_s, w_q, s)
