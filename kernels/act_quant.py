"""Dynamic activation quantisation (quant_formats.md §3, §5), Triton kernels + refs.

* `act_quant_fp8(x, ue8m0=True)`: per token, per 128 channels -> e4m3 + fp32 scale
  (s = max(amax, 1e-4)/448, ceil_pow2'd for ue8m0). Ref: `act_quant_fp8_ref`.
* `act_quant_nvfp4(x, input_scale)`: per 16 channels -> packed e2m1 + e4m3 block scale with a
  global fp32 `input_scale` g (s_b = e4m3(amax_b/(6g))). Ref: `act_quant_nvfp4_ref`.

Shapes: M rows (tokens), K channels; Kb = K/128 (FP8) or K/16 (NVFP4) blocks.
One program quantises a [BLOCK_M, 128] (or [BLOCK_M, 16*G]) tile; no host sync. Divisions use
tl.math.div_rn: Triton's `/` on fp32 is an approximate division on CUDA, which flipped NVFP4
roundings against the reference on the H200.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from dsv4c.kernels import _tl as U

from dsv4c import quant as Q

__all__ = ["act_quant_fp8", "act_quant_fp8_ref", "act_quant_nvfp4", "act_quant_nvfp4_ref"]

_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _act_fp8_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm,
                    UE8M0: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    U.pdl_wait(PDL)
    pid_m = tl.program_id(0)
    kb = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = kb * BLOCK + tl.arange(0, BLOCK)
    ok = rows[:, None] < M
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4) / 448.0                  # [BLOCK_M]
    if UE8M0:
        s = U.ceil_pow2(s)
    q = U.e4m3_bits(tl.math.div_rn(x, s[:, None]))
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q.to(tl.uint8), mask=ok)
    tl.store(s_ptr + rows * stride_sm + kb, s, mask=rows < M)


@triton.jit
def _act_nvfp4_kernel(x_ptr, g_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm,
                      BLOCK_M: tl.constexpr, GROUPS: tl.constexpr, PDL: tl.constexpr = False):
    U.pdl_wait(PDL)
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    BK: tl.constexpr = GROUPS * 16
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BK + tl.arange(0, BK)
    ok = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr)
    xb = tl.reshape(x, (BLOCK_M, GROUPS, 16))
    sb = U.e4m3_bits(tl.math.div_rn(tl.max(tl.abs(xb), axis=2), 6.0 * g))                 # [BLOCK_M, GROUPS]
    denom = U.e4m3_value(sb) * g
    denom = tl.where(denom == 0.0, float("inf"), denom)
    codes = tl.reshape(U.e2m1_code(tl.math.div_rn(xb, denom[:, :, None])), (BLOCK_M, BK // 2, 2))
    lo, hi = tl.split(codes)
    packed = lo | (hi << 4)
    pcols = pid_k * (BK // 2) + tl.arange(0, BK // 2)
    tl.store(q_ptr + rows[:, None] * stride_qm + pcols[None, :], packed.to(tl.uint8),
             mask=(rows[:, None] < M) & (pcols[None, :] < K // 2))
    scols = pid_k * GROUPS + tl.arange(0, GROUPS)
    tl.store(s_ptr + rows[:, None] * stride_sm + scols[None, :], sb.to(tl.uint8),
             mask=(rows[:, None] < M) & (scols[None, :] < K // 16))


def _check_act(name: str, x: torch.Tensor, block: int) -> None:
    if x.dtype not in _ACT_DTYPES:
        raise ValueError(f"{name}: dtype must be bf16/fp16/fp32, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{name}: expected [M, K], got shape {tuple(x.shape)}")
    if x.shape[1] % block:
        raise ValueError(f"{name}: K = {x.shape[1]} must be a multiple of {block} (zero-pad K, quant_formats.md §7)")
    if x.stride(1) != 1:
        raise ValueError(f"{name}: last dim must be contiguous, got strides {x.stride()}")


def act_quant_fp8(x: torch.Tensor, ue8m0: bool = True, block_m: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K % 128 == 0, unit stride along K) -> (q float8_e4m3fn [M, K], s fp32 [M, K/128]).
    Matches `act_quant_fp8_ref` bit for bit."""
    _check_act("x", x, Q.FP8_BLOCK)
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.uint8, device=x.device)
    s = torch.empty(m, k // Q.FP8_BLOCK, dtype=torch.float32, device=x.device)
    if m:
        grid = (triton.cdiv(m, block_m), k // Q.FP8_BLOCK)
        _act_fp8_kernel[grid](x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0),
                              UE8M0=ue8m0, BLOCK_M=block_m, BLOCK=Q.FP8_BLOCK, **U.pdl_launch(x))
    return q.view(torch.float8_e4m3fn), s


def act_quant_fp8_ref(x: torch.Tensor, ue8m0: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of `act_quant_fp8`: `dsv4c.quant.quant_act_fp8` with block 128."""
    return Q.quant_act_fp8(x, block=Q.FP8_BLOCK, ue8m0=ue8m0)


def act_quant_nvfp4(x: torch.Tensor, input_scale: torch.Tensor, block_m: int = 16,
                    groups: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K % 16 == 0), input_scale fp32 [] or [1] on x's device (the global g; a device
    tensor, so no host sync) -> (packed uint8 [M, K/2], scale float8_e4m3fn [M, K/16]).
    Matches `act_quant_nvfp4_ref` bit for bit."""
    _check_act("x", x, Q.NVFP4_BLOCK)
    if input_scale.dtype != torch.float32 or input_scale.numel() != 1 or input_scale.device != x.device:
        raise ValueError(f"input_scale: expected one fp32 value on {x.device}, got {input_scale.dtype} "
                         f"shape {tuple(input_scale.shape)} on {input_scale.device}")
    m, k = x.shape
    q = torch.empty(m, k // 2, dtype=torch.uint8, device=x.device)
    s = torch.empty(m, k // Q.NVFP4_BLOCK, dtype=torch.uint8, device=x.device)
    if m:
        grid = (triton.cdiv(m, block_m), triton.cdiv(k, groups * Q.NVFP4_BLOCK))
        _act_nvfp4_kernel[grid](x, input_scale, q, s, m, k, x.stride(0), q.stride(0), s.stride(0),
                                BLOCK_M=block_m, GROUPS=groups, **U.pdl_launch(x))
    return q, s.view(torch.float8_e4m3fn)


def act_quant_nvfp4_ref(x: torch.Tensor, input_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of `act_quant_nvfp4`: `dsv4c.quant.quant_act_nvfp4`."""
    return Q.quant_act_nvfp4(x, input_scale)
