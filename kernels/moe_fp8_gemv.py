"""Decode MoE with FP8 block experts (W8A8) on CUDA cores: GEMV kernels.

While few assignments share an expert (decode: 1 and 8 Flash tokens at top-6 of 256), every
assigned expert is read once per assignment anyway, and the tensor-core tile of
kernels/moe_grouped.py spends 15 of its 16 rows on padding. Here a program multiplies one
assignment's activation row with BLOCK_N weight rows of its expert on CUDA cores, the loop of the
dense decode GEMV (kernels/fp8_gemv.py `_fma_loop`: e4m3 widened exactly to fp32, the next K step
loaded before the current one is multiplied), with the first step's weights requested before the PDL
wait, as the FP4 GEMV does.

Public API::

    moe_fp8_gemv(x, idx, weight, w13, w13_scale, w2, w2_scale, swiglu_limit, config=None) -> Tensor  # bf16 [T, D]
    Fp8GemvMoeConfig(block_n13, block_n2, block_k, num_warps, early_weights)

The function is `moe_grouped` on `Fp8BlockExperts` (and `moe_grouped_ref`'s fp8_block branch):
x and h quantised to e4m3 per 128 columns with ue8m0 scales (W8A8), for each token t and slot j
y[t] += W2_e (silu(min(W1_e x_t, L)) * clamp(W3_e x_t, -L, L) * w[t, j]), e = idx[t, j]. Products
of the e4m3 values are exact in fp32; only the fp32 summation order differs from the tensor-core
tile's.

Kernels (no atomics, no host syncs, grids from shapes only: CUDA-graph safe; one PDL chain on sm_90+):
  1. act_quant_fp8(x) (kernels/act_quant.py): e4m3 [T, D] and fp32 scales [T, D/128];
  2. `_gemv13_kernel`, grid (N_A, I / BLOCK_N13): rows n of W1 and W3 of expert e times x[t] in one
     K loop (two accumulators); SwiGLU, clamp and routing weight; h fp32 [N_A, I];
  3. act_quant_fp8(h): e4m3 and scales per 128 columns of a row (the per-128 amax spans programs);
  4. `_gemv2_kernel`, grid (N_A, D / BLOCK_N2): y[a] = W2_e h[a] (bf16);
  5. out[t] = sum_j y[t, j] (kernels/moe_combine.py: fp32 accumulation, one rounding).

Shapes: T tokens, K experts per token, N_A = T*K assignments, D hidden, I expert width, E experts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from dsv4c.kernels import _tl as U
from dsv4c.kernels.act_quant import act_quant_fp8
from dsv4c.kernels.fp8_gemv import _a_step, _w_step
from dsv4c.kernels.moe_combine import combine_slots
from dsv4c.kernels.moe_fp4_gemv import check_gemv_inputs

__all__ = ["Fp8GemvMoeConfig", "moe_fp8_gemv"]


@dataclass(frozen=True)
class Fp8GemvMoeConfig:
    """block_n13: W1 (and as many W3) rows per program; block_n2: W2 rows per program (both powers of
    two dividing 128: one scale row per program); block_k: K columns per loop step (a power-of-two
    multiple of 128); num_warps: Triton's; early_weights: request the first K step's weights before the
    PDL wait. The defaults read 32 weight rows x 512 columns per step in both kernels, the dense one-token
    GEMV's tile. sm_90 builds (Triton 3.9, compiled offline with the strides' divisibility by 16 that launches
    specialise): 123 and 120 registers per thread (without those hints: 255 and 212, the figures Triton 3.6 gave
    earlier). Through Triton's pipeliner (cp.async, 3-4 stages) or quantising x and h as they load them, these
    GEMVs were 1.3-2.1x slower on an H100 (run65), and quantising with 3 stages faulted in the 2-layer step:
    both were removed."""

    block_n13: int = 16
    block_n2: int = 32
    block_k: int = 512
    num_warps: int = 8
    early_weights: bool = True

    def check(self) -> None:
        for name in ("block_n13", "block_n2"):
            v = getattr(self, name)
            if v not in (16, 32, 64, 128):
                raise ValueError(f"Fp8GemvMoeConfig.{name}: 16, 32, 64 or 128 (divides the 128-row scale tile), "
                                 f"got {v}")
        if self.block_k < 128 or self.block_k & (self.block_k - 1):
            raise ValueError(f"Fp8GemvMoeConfig.block_k: a power-of-two multiple of 128, got {self.block_k}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"Fp8GemvMoeConfig.num_warps: 1, 2, 4, 8 or 16, got {self.num_warps}")


def default_gemv_config(device: torch.device) -> Fp8GemvMoeConfig:
    """Smaller K steps and fewer warps under the CPU interpreter (the test shapes are small)."""
    return Fp8GemvMoeConfig(32, 32, 128, 4) if device.type == "cpu" else Fp8GemvMoeConfig()


@triton.jit
def _gemv13_kernel(xq_ptr, xs_ptr, idx_ptr, rw_ptr, w_ptr, s_ptr, h_ptr, I, limit,
                   stride_x, stride_xs, stride_we, stride_wn, stride_se, stride_sn, stride_h,
                   K: tl.constexpr, TOPK: tl.constexpr, HAS_LIMIT: tl.constexpr, PDL: tl.constexpr,
                   EARLY: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """h[a, n] = silu(min(W1_e[n] . x_t, L)) * clamp(W3_e[n] . x_t, -L, L) * w[a] for the BLOCK_N rows n
    of one tile, assignment a = program 0 (token t = a // TOPK, expert e = idx[a]). EARLY: the first K
    step's weights are requested before the PDL wait (idx and the weights are fixed before the
    predecessor's own wait returned, see `_tl.pdl_wait`); x, which the predecessor writes, after it."""
    a = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    e = tl.load(idx_ptr + a).to(tl.int64)
    t = a // TOPK
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                                 # [BN]
    row_ok = rows < I
    x_row, xs_row = xq_ptr + t * stride_x, xs_ptr + t * stride_xs
    w_e, s_e = w_ptr + e * stride_we, s_ptr + e * stride_se
    g_rows = w_e + rows.to(tl.int64)[:, None] * stride_wn                          # W1 rows [BN, 1]
    u_rows = w_e + (I + rows).to(tl.int64)[:, None] * stride_wn                    # W3 rows
    g_s = s_e + (pid_n * BLOCK_N // 128) * stride_sn
    u_s = s_e + ((I + pid_n * BLOCK_N) // 128) * stride_sn
    if not EARLY:
        U.pdl_wait(PDL)
    wg, sg = _w_step(g_rows, g_s, row_ok, 0, K, K, False, BLOCK_K)
    wu, su = _w_step(u_rows, u_s, row_ok, 0, K, K, False, BLOCK_K)
    if EARLY:
        U.pdl_wait(PDL)
    xa = _a_step(x_row, xs_row, 0, K, K, True, BLOCK_K)
    acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for i in range((K + BLOCK_K - 1) // BLOCK_K):  # the next step's tiles are loaded before this one's products
        k1 = (i + 1) * BLOCK_K
        wg1, sg1 = _w_step(g_rows, g_s, row_ok, k1, K, K, False, BLOCK_K)
        wu1, su1 = _w_step(u_rows, u_s, row_ok, k1, K, K, False, BLOCK_K)
        xa1 = _a_step(x_row, xs_row, k1, K, K, True, BLOCK_K)
        acc_g += tl.sum(wg.to(tl.float32) * (sg * xa)[None, :], axis=1)
        acc_u += tl.sum(wu.to(tl.float32) * (su * xa)[None, :], axis=1)
        wg, sg, wu, su, xa = wg1, sg1, wu1, su1, xa1
    h = U.swiglu(acc_g, acc_u, limit, HAS_LIMIT) * tl.load(rw_ptr + a)
    tl.store(h_ptr + a * stride_h + rows, h, mask=row_ok)


@triton.jit
def _gemv2_kernel(hq_ptr, hs_ptr, idx_ptr, w_ptr, s_ptr, y_ptr, D,
                  stride_h, stride_hs, stride_we, stride_wn, stride_se, stride_sn, stride_y,
                  K: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """y[a, n] = W2_e[n] . h[a] for the BLOCK_N rows n of one tile, assignment a = program 0; the first K
    step's weights requested before the PDL wait if EARLY, h after it (as in `_gemv13_kernel`)."""
    a = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    e = tl.load(idx_ptr + a).to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < D
    w_rows = w_ptr + e * stride_we + rows.to(tl.int64)[:, None] * stride_wn
    ws_row = s_ptr + e * stride_se + (pid_n * BLOCK_N // 128) * stride_sn
    h_row, hs_row = hq_ptr + a * stride_h, hs_ptr + a * stride_hs
    if not EARLY:
        U.pdl_wait(PDL)
    w, ws = _w_step(w_rows, ws_row, row_ok, 0, K, K, False, BLOCK_K)
    if EARLY:
        U.pdl_wait(PDL)
    ha = _a_step(h_row, hs_row, 0, K, K, True, BLOCK_K)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for i in range((K + BLOCK_K - 1) // BLOCK_K):
        k1 = (i + 1) * BLOCK_K
        w1, ws1 = _w_step(w_rows, ws_row, row_ok, k1, K, K, False, BLOCK_K)
        ha1 = _a_step(h_row, hs_row, k1, K, K, True, BLOCK_K)
        acc += tl.sum(w.to(tl.float32) * (ws * ha)[None, :], axis=1)
        w, ws, ha = w1, ws1, ha1
    tl.store(y_ptr + a * stride_y + rows, acc.to(tl.bfloat16), mask=row_ok)


def _check(x, idx, weight, w13, w13_scale, w2, w2_scale) -> tuple[int, int, int]:
    if w13.dtype != torch.float8_e4m3fn or w13.dim() != 3 or not w13.is_contiguous():
        raise ValueError(f"w13: expected contiguous float8_e4m3fn [E, 2I, D], got {w13.dtype} {tuple(w13.shape)}")
    e, i2, d = w13.shape
    i = i2 // 2
    if i2 % 2 or i % 128 or d % 128 or i == 0 or d == 0:
        raise ValueError(f"w13: expected [E, 2I, D] with I and D positive multiples of 128, got {tuple(w13.shape)}")
    want = {"w13_scale": (w13_scale, torch.float32, (e, i2 // 128, d // 128)),
            "w2": (w2, torch.float8_e4m3fn, (e, d, i)), "w2_scale": (w2_scale, torch.float32, (e, d // 128, i // 128))}
    check_gemv_inputs(x, idx, weight, w13, want, e, d)
    return e, i, d


def moe_fp8_gemv(x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, w13: torch.Tensor,
                 w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, swiglu_limit: float,
                 config: Fp8GemvMoeConfig | None = None) -> torch.Tensor:
    """Routed FP8 block experts (W8A8) as CUDA-core GEMVs (see the module doc).

    x bf16 [T, D] contiguous; idx int [T, K] in [0, E); weight fp32 [T, K]; w13 e4m3 [E, 2I, D] (w1 rows,
    then w3) with fp32 scales [E, 2I/128, D/128]; w2 e4m3 [E, D, I] with fp32 scales [E, D/128, I/128];
    swiglu_limit L (<= 0: no clamp) -> bf16 [T, D]. Reads every assigned expert once per assignment:
    meant for decode, where few assignments share an expert. CPU tensors run under the Triton
    interpreter."""
    _, i, d = _check(x, idx, weight, w13, w13_scale, w2, w2_scale)
    cfg = config or default_gemv_config(x.device)
    cfg.check()
    t, topk = idx.shape
    out = torch.empty_like(x)
    if t == 0:
        return out
    n_a, dev = t * topk, x.device
    idx_flat = idx.reshape(-1)
    xq, xs = act_quant_fp8(x)                                                      # [T, D] e4m3, [T, D/128]
    h = torch.empty(n_a, i, dtype=torch.float32, device=dev)
    _gemv13_kernel[(n_a, triton.cdiv(i, cfg.block_n13))](
        xq, xs, idx_flat, weight.reshape(-1).contiguous(), w13, w13_scale, h, i, float(swiglu_limit),
        xq.stride(0), xs.stride(0), w13.stride(0), w13.stride(1), w13_scale.stride(0), w13_scale.stride(1),
        h.stride(0), K=d, TOPK=topk, HAS_LIMIT=swiglu_limit > 0, EARLY=cfg.early_weights, BLOCK_N=cfg.block_n13,
        BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, **U.pdl_launch(x))
    hq, hs = act_quant_fp8(h)                                                      # [N_A, I] e4m3, [N_A, I/128]
    y = torch.empty(n_a, d, dtype=torch.bfloat16, device=dev)
    _gemv2_kernel[(n_a, triton.cdiv(d, cfg.block_n2))](
        hq, hs, idx_flat, w2, w2_scale, y, d, hq.stride(0), hs.stride(0), w2.stride(0), w2.stride(1),
        w2_scale.stride(0), w2_scale.stride(1), y.stride(0), K=i, EARLY=cfg.early_weights, BLOCK_N=cfg.block_n2,
        BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, **U.pdl_launch(x))
    return combine_slots(y, None, topk, out, pdl=U.pdl_supported(dev))          # fp32 sum, one rounding
