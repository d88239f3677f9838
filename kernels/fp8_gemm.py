"""Dense block-scaled FP8 GEMMs (quant_formats.md §2-3), Triton kernels + refs.

* `fp8_gemm_w8a8(a_q, a_s, w_q, w_s)`: e4m3 activations with 1x128 scales [M, K/128] times e4m3
  weights with 128x128 scales [ceil(N/128), K/128] (as in the released checkpoints); fp32
  accumulation per 128-wide K block, bf16 output. Ref: `fp8_gemm_w8a8_ref`.
* `fp8_gemm_w8a16(a, w_q, w_s)`: bf16 activations times the same FP8 weights; the weight
  scale is applied to each K block's fp32 partial product. Ref: `fp8_gemm_w8a16_ref`.
* `fp8_dequant(w_q, w_s)`: the weight widened to bf16 (w_q * its tile's scale, rounded once: exact for
  ue8m0 scales), one pass at copy bandwidth. Ref: `dsv4c.quant.dequant_fp8_block`.

These tile GEMMs give each program 128 output rows and all of K; the decode shapes (up to 64
tokens) run on kernels/fp8_gemv.py instead (the custom ops below choose by M), and W8A16 from
DEQUANT_M tokens widens the weight (`fp8_dequant`) for cuBLAS: at prefill sizes the tile GEMM ran at
a third of cuBLAS bf16 (BENCHMARKS.md, H100, 2026-12-06), while widening costs one read of the FP8
bytes and one write of bf16 ones, small beside a GEMM of hundreds of token rows.

Weight scales may be float8_e8m0fnu (V4, decoded in the kernel) or fp32 (V3 weight_scale_inv).
Shapes: M tokens, N output features, K reduction; Kb = K/128 blocks. K is a constexpr (one
compile per layer width; the Triton interpreter cannot loop to a runtime bound under numpy 2).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from dsv4c.kernels import _tl as U
from dsv4c.kernels.fp8_gemv import MAX_M, fp8_gemv_w8a8, fp8_gemv_w8a16

from dsv4c import quant as Q

__all__ = ["fp8_gemm_w8a8", "fp8_gemm_w8a8_ref", "fp8_gemm_w8a16", "fp8_gemm_w8a16_ref", "fp8_dequant",
           "DEQUANT_M"]

_B = Q.FP8_BLOCK
DEQUANT_M = 128  # fp8_linear_w8a16 from here: fp8_dequant + cuBLAS (below: the GEMV, then the tile GEMM)
_DQ_N = 32  # rows per dequant program (a divisor of 128: one scale tile per program)


@triton.jit
def _fp8_gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, y_ptr, M, N, K: tl.constexpr,
                     stride_am, stride_asm, stride_wn, stride_wsn, stride_ym,
                     A_FP8: tl.constexpr, WS_E8M0: tl.constexpr, INTERPRET: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    U.pdl_wait(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        kb = k0 // BLOCK_K
        ws = tl.load(ws_ptr + (cols // BLOCK_K) * stride_wsn + kb, mask=col_ok, other=0)
        if WS_E8M0:
            ws = U.e8m0_value(ws.to(tl.int32))
        if A_FP8:
            part = U.mma(a, w, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), INTERPRET)
            a_s = tl.load(as_ptr + rows * stride_asm + kb, mask=row_ok, other=0.0)
            acc += part * a_s[:, None] * ws[None, :]
        else:
            part = U.mma(a, w.to(a.dtype), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), INTERPRET)
            acc += part * ws[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def _check_weight(w_q: torch.Tensor, w_s: torch.Tensor, k: int) -> torch.Tensor:
    """Validate w_q e4m3 [N, K] and w_s [ceil(N/128), ceil(K/128)]; return the scale as passed
    to the kernel (uint8 bytes for e8m0, fp32 otherwise)."""
    if w_q.dtype != torch.float8_e4m3fn or w_q.dim() != 2 or w_q.shape[1] != k or w_q.stride(1) != 1:
        raise ValueError(f"w_q: expected float8_e4m3fn [N, {k}] with unit stride along K, got {w_q.dtype} "
                         f"shape {tuple(w_q.shape)} strides {w_q.stride()}")
    want = (triton.cdiv(w_q.shape[0], _B), triton.cdiv(k, _B))
    if tuple(w_s.shape) != want or w_s.dtype not in (torch.float8_e8m0fnu, torch.float32) or w_s.stride(1) != 1:
        raise ValueError(f"w_s: expected float8_e8m0fnu or fp32 {want} (128x128 tiles of w_q {tuple(w_q.shape)}), "
                         f"got {w_s.dtype} shape {tuple(w_s.shape)}")
    return w_s.view(torch.uint8) if w_s.dtype == torch.float8_e8m0fnu else w_s


def _launch(a, a_s, w_q, ws, a_fp8: bool, out_dtype: torch.dtype) -> torch.Tensor:
    m, k = a.shape
    n = w_q.shape[0]
    y = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return y
    block_m = 64 if m >= 64 else 16
    block_n = 128
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_gemm_kernel[grid](a, a_s, w_q, ws, y, m, n, k, a.stride(0), a_s.stride(0), w_q.stride(0), ws.stride(0),
                           y.stride(0), A_FP8=a_fp8, WS_E8M0=ws.dtype == torch.uint8,
                           INTERPRET=U.interpret_flag(a), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=_B,
                           num_warps=4, num_stages=3, **U.pdl_launch(a))
    return y


@triton.jit
def _dequant_kernel(w_ptr, ws_ptr, y_ptr, N, K, stride_wn, stride_wsn, stride_yn, WS_E8M0: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    U.pdl_wait(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (rows < N)[:, None] & (cols < K)[None, :]
    w = tl.load(w_ptr + rows[:, None] * stride_wn + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    s = tl.load(ws_ptr + (pid_n * BLOCK_N // BLOCK_K) * stride_wsn + pid_k)  # the tile's one scale
    if WS_E8M0:
        s = U.e8m0_value(s.to(tl.int32))
    tl.store(y_ptr + rows[:, None] * stride_yn + cols[None, :], (w * s).to(y_ptr.dtype.element_ty), mask=ok)


def fp8_dequant(w_q: torch.Tensor, w_s: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """W [N, K] out_dtype = w_q [N, K] e4m3 * w_s [ceil(N/128), ceil(K/128)] (e8m0 or fp32) per 128x128
    tile, computed in fp32 and rounded once (= dsv4c.quant.dequant_fp8_block(w_q, w_s, out_dtype))."""
    ws = _check_weight(w_q, w_s, w_q.shape[-1] if w_q.dim() else 0)
    n, k = w_q.shape
    y = torch.empty(n, k, dtype=out_dtype, device=w_q.device)
    if n and k:
        grid = (triton.cdiv(n, _DQ_N), triton.cdiv(k, _B))
        _dequant_kernel[grid](w_q, ws, y, n, k, w_q.stride(0), ws.stride(0), y.stride(0),
                              WS_E8M0=ws.dtype == torch.uint8, BLOCK_N=_DQ_N, BLOCK_K=_B, num_warps=4,
                              **U.pdl_launch(w_q))
    return y


def fp8_gemm_w8a8(a_q: torch.Tensor, a_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor,
                  out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """y [M, N] = block-scaled a_q [M, K] @ w_q [N, K]^T (§3); a_q float8_e4m3fn (K % 128 == 0),
    a_s fp32 [M, K/128]; w_q float8_e4m3fn [N, K], w_s e8m0/fp32 [ceil(N/128), K/128]."""
    if a_q.dtype != torch.float8_e4m3fn or a_q.dim() != 2 or a_q.shape[1] % _B or a_q.stride(1) != 1:
        raise ValueError(f"a_q: expected float8_e4m3fn [M, K] with K % 128 == 0 and unit stride, "
                         f"got {a_q.dtype} shape {tuple(a_q.shape)}")
    m, k = a_q.shape
    if a_s.dtype != torch.float32 or tuple(a_s.shape) != (m, k // _B):
        raise ValueError(f"a_s: expected fp32 {(m, k // _B)}, got {a_s.dtype} shape {tuple(a_s.shape)}")
    ws = _check_weight(w_q, w_s, k)
    return _launch(a_q, a_s, w_q, ws, True, out_dtype)


def fp8_gemm_w8a8_ref(a_q: torch.Tensor, a_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor) -> torch.Tensor:
    """fp32 reference of `fp8_gemm_w8a8` (`dsv4c.quant.fp8_block_gemm_ref`)."""
    return Q.fp8_block_gemm_ref(a_q, a_s, w_q, w_s)


def fp8_gemm_w8a16(a: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor,
                   out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """y [M, N] = a [M, K] (bf16/fp16, any K) @ dequant(w_q, w_s)^T, the weight scale applied per
    128x128 tile to fp32 partial products; w_q float8_e4m3fn [N, K], w_s e8m0/fp32 tiles."""
    if a.dtype not in (torch.bfloat16, torch.float16) or a.dim() != 2 or a.stride(1) != 1:
        raise ValueError(f"a: expected bf16/fp16 [M, K] with unit stride, got {a.dtype} shape {tuple(a.shape)}")
    ws = _check_weight(w_q, w_s, a.shape[1])
    return _launch(a, a, w_q, ws, False, out_dtype)


def fp8_gemm_w8a16_ref(a: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor) -> torch.Tensor:
    """fp32 reference of `fp8_gemm_w8a16`: a @ dequant_fp8_block(w_q, w_s)^T."""
    return a.float() @ Q.dequant_fp8_block(w_q, w_s).T


# ---------------------------------------------------------------------------------------------
# custom ops for passes/quantize_dense.py: a linear on FP8 block weights, any leading dims
# (x [..., K] -> y [..., N], y in x's dtype). CUDA: Triton launches with grids from shapes only and
# no host sync (capture safe): up to MAX_M = 64 token rows the decode kernels of kernels/fp8_gemv.py
# (split over N and K), above them the tile GEMMs here; W8A16 from DEQUANT_M rows the widened weight
# on cuBLAS; CPU (artifacts with emulate=True, tests): the `*_ref` math in fp32.


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [M, K] rows; a copy only when K is not unit-stride (the kernels take any row stride)."""
    r = x.reshape(-1, x.shape[-1])                                                   # [M, K]
    return r if r.stride(-1) == 1 else r.contiguous()


def _scale(w_s: torch.Tensor) -> torch.Tensor:
    """ue8m0 scales travel through graphs as uint8 bytes (torch 2.11's export serialiser has no e8m0)."""
    return w_s.view(torch.float8_e8m0fnu) if w_s.dtype == torch.uint8 else w_s


@torch.library.custom_op("dsv4c::fp8_linear_w8a8", mutates_args=())
def fp8_linear_w8a8(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor) -> torch.Tensor:
    """y = linear(x, dequant(w_q, w_s)) with x quantised per token and 128-wide K block (1x128,
    ue8m0 scales, kernels/act_quant.py) first; K % 128 == 0. w_s: e8m0 (or its uint8 bytes) / fp32."""
    a, w_s = _rows(x), _scale(w_s)
    if x.device.type == "cpu":
        from dsv4c.kernels.act_quant import act_quant_fp8_ref

        y = fp8_gemm_w8a8_ref(*act_quant_fp8_ref(a), w_q, w_s)
    else:
        from dsv4c.kernels.act_quant import act_quant_fp8

        gemm = fp8_gemv_w8a8 if a.shape[0] <= MAX_M else fp8_gemm_w8a8
        y = gemm(*act_quant_fp8(a), w_q, w_s)
    return y.to(x.dtype).view(*x.shape[:-1], w_q.shape[0])


@fp8_linear_w8a8.register_fake
def _fp8_linear_w8a8_fake(x, w_q, w_s):
    return x.new_empty((*x.shape[:-1], w_q.shape[0]))


@torch.library.custom_op("dsv4c::fp8_linear_w8a16", mutates_args=())
def fp8_linear_w8a16(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor) -> torch.Tensor:
    """y = linear(x, dequant(w_q, w_s)), weights FP8 and activations unquantised (bf16 into the
    CUDA kernel; the CPU reference computes in fp32)."""
    a, w_s = _rows(x), _scale(w_s)
    if x.device.type == "cpu":
        y = fp8_gemm_w8a16_ref(a, w_q, w_s)
    else:
        a = a if a.dtype in (torch.bfloat16, torch.float16) else a.to(torch.bfloat16)
        if a.shape[0] >= DEQUANT_M:
            y = torch.nn.functional.linear(a, fp8_dequant(w_q, w_s, a.dtype))
        else:
            gemm = fp8_gemv_w8a16 if a.shape[0] <= MAX_M else fp8_gemm_w8a16
            y = gemm(a, w_q, w_s)
    return y.to(x.dtype).view(*x.shape[:-1], w_q.shape[0])


@fp8_linear_w8a16.register_fake
def _fp8_linear_w8a16_fake(x, w_q, w_s):
    return x.new_empty((*x.shape[:-1], w_q.shape[0]))
