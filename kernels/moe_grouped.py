"""Grouped routed-expert MoE (the function of torch.ops.dsv4c.moe_experts) in bf16, FP8 block,
MXFP4 / NVFP4 weight-only and NVFP4 W4A4, as Triton kernels.

Public API::

    moe_grouped(x, idx, weight, experts, swiglu_limit, config=None) -> Tensor   # [T, D], x.dtype
    moe_grouped_ref(x, idx, weight, experts, swiglu_limit) -> Tensor            # [T, D], fp32
    Bf16Experts(w13, w2)
    Fp8BlockExperts(w13, w13_scale, w2, w2_scale)
    Mxfp4Experts(w13, w13_scale, w2, w2_scale)
    Nvfp4Experts(w13, w13_scale, w13_global, w2, w2_scale, w2_global)
    Nvfp4W4A4Experts(w13, w13_scale, w13_global, w2, w2_scale, w2_global,
                     input_scale_13=None, input_scale_2=None)

Custom op (for the FX pass that rewrites ``dsv4c::moe_experts`` nodes; fake impl = empty_like(x))::

    dsv4c::moe_experts_q(Tensor x, Tensor idx, Tensor weight, str fmt, Tensor w13,
                         Tensor? w13_scale, Tensor? w13_global, Tensor w2, Tensor? w2_scale,
                         Tensor? w2_global, Tensor? input_scale_13, Tensor? input_scale_2,
                         float swiglu_limit) -> Tensor

  fmt is a container's `format` ("bf16", "fp8_block", "mxfp4", "nvfp4", "nvfp4_w4a4"); the tensors
  are that container's fields (None where the format has none); `experts_from_tensors` rebuilds it.

Semantics (deepseek_v4.md §4.2 "Experts", §7 Official): for each token t and slot j,
y += w[t,j] * W2_e (silu(min(W1_e x, L)) * clamp(W3_e x, -L, L)), e = idx[t,j]; the routing weight
multiplies silu(g)*v in fp32 BEFORE W2; a repeated id adds. L <= 0 disables the clamp.
FP8 block runs W8A8 like Official: x and h are quantised per token per 128 channels (e4m3,
ue8m0 scales); h is quantised in the first GEMM's epilogue. Weight-only formats run bf16
tensor-core math on weights dequantised in registers (exact in bf16; NVFP4's fp32 global scale
is applied to the accumulator); MXFP4 on sm_90+ goes through tl.dot_scaled (bf16 x e2m1 with
e8m0 scales), whose Hopper lowering is that same exact upcast, done by Triton. W4A4 quantises
x and h to NVFP4 (per 16, e4m3 scales, a global input scale: the container's, or amax/(6*448)
computed on device) and multiplies with
tl.dot_scaled (sm_100+); elsewhere the wrapper refuses, naming capability 10.0, except under the
CPU interpreter where an emulation (both operands dequantised to bf16) runs the same kernel.

Pipeline, all on device, no host sync, fixed grids from shapes only (CUDA-graph capture safe):
  1. routing prep (torch ops): assignments sorted by expert (stable), each expert's rows padded to
     BLOCK_M; `ids` [R] = assignment id per padded row (N_A marks padding); `block_expert`
     [NB] = expert of each M-block (-1: unused block, the program exits);
     NB = ceil(N_A/BLOCK_M) + min(E, N_A) is the worst case, R = NB*BLOCK_M.
     At decode (config.direct) there is no sort: M-block a is assignment a alone (one valid
     row), so NB = R = N_A and the routing costs no launch; experts shared by several
     assignments are then read once per assignment;
  2. GEMM 1 over w13 (w1 rows then w3 rows) on rows gathered from x, SwiGLU (+clamp) and the
     routing weight in the epilogue -> h [R, I];
  3. GEMM 2 over w2 on h's contiguous rows -> y [R, D] bf16;
  4. combine: out[t] = sum_j y[row of (t, j)] (kernels/moe_combine.py: one launch, fp32 accumulation).

Shapes: T tokens, D hidden, E experts, K experts per token (top-k), I expert width,
N_A = T*K assignments, R padded rows, NB M-blocks.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import triton
import triton.language as tl
from dsv4c.kernels import _tl as U
from dsv4c.kernels.act_quant import act_quant_fp8, act_quant_nvfp4
from dsv4c.kernels.moe_combine import combine_slots
from dsv4c.kernels.moe_fp4_gemv import Fp4GemvConfig, moe_fp4_gemv
from dsv4c.kernels.moe_fp8_gemv import Fp8GemvMoeConfig, moe_fp8_gemv

from dsv4c import quant as Q

__all__ = [
    "Bf16Experts", "Fp8BlockExperts", "MoeKernelConfig", "Mxfp4Experts", "Nvfp4Experts", "Nvfp4W4A4Experts",
    "experts_from_tensors", "moe_grouped", "moe_grouped_ref", "route_direct", "route_prep", "route_prep_fused",
    "route_prep_ref",
]

_FMT_ID = {"bf16": 0, "fp8_block": 1, "mxfp4": 2, "nvfp4": 3, "nvfp4_w4a4": 4}
_NVFP4_GLOBAL_DIV = Q.E2M1_MAX * Q.E4M3_MAX


# ---------------------------------------------------------------------------------------------
# weight containers


def _req(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_field(fmt: str, name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    _req(isinstance(t, torch.Tensor), f"{fmt}.{name}: expected a tensor, got {type(t).__name__}")
    _req(t.dtype == dtype and tuple(t.shape) == shape and t.is_contiguous(),
         f"{fmt}.{name}: expected contiguous {dtype} {shape}, got {t.dtype} {tuple(t.shape)}"
         f"{'' if t.is_contiguous() else ' (not contiguous)'}")


@dataclass(frozen=True)
class Bf16Experts:
    """bf16 experts. w13 [E, 2I, D] (w1 rows 0..I-1, then w3), w2 [E, D, I]."""

    w13: torch.Tensor
    w2: torch.Tensor
    format: ClassVar[str] = "bf16"

    def __post_init__(self) -> None:
        e, i2, d = self.w13.shape
        _req(i2 % 2 == 0, f"{self.format}.w13: 2I = {i2} must be even")
        _check_field(self.format, "w13", self.w13, torch.bfloat16, (e, i2, d))
        _check_field(self.format, "w2", self.w2, torch.bfloat16, (e, d, i2 // 2))

    @property
    def dims(self) -> tuple[int, int, int]:
        """(E, I, D)."""
        e, i2, d = self.w13.shape
        return e, i2 // 2, d

    @classmethod
    def from_float(cls, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> Bf16Experts:
        return cls(torch.cat((w1, w3), 1).to(torch.bfloat16).contiguous(), w2.to(torch.bfloat16).contiguous())

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """fp32 (w1 [E, I, D], w3 [E, I, D], w2 [E, D, I])."""
        i = self.dims[1]
        return self.w13[:, :i].float(), self.w13[:, i:].float(), self.w2.float()


@dataclass(frozen=True)
class Fp8BlockExperts:
    """FP8 128x128 block experts (W8A8). w13 e4m3 [E, 2I, D], w13_scale fp32 [E, 2I/128, D/128],
    w2 e4m3 [E, D, I], w2_scale fp32 [E, D/128, I/128]; D and I multiples of 128 (so no tile
    straddles w1 and w3). e8m0 checkpoint scales convert to fp32 exactly."""

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    format: ClassVar[str] = "fp8_block"

    def __post_init__(self) -> None:
        e, i2, d = self.w13.shape
        i = i2 // 2
        _req(i % 128 == 0 and d % 128 == 0, f"{self.format}.w13: I = {i} and D = {d} must be multiples of 128 "
             "(zero-pad, quant_formats.md §7)")
        _check_field(self.format, "w13", self.w13, torch.float8_e4m3fn, (e, i2, d))
        _check_field(self.format, "w13_scale", self.w13_scale, torch.float32, (e, i2 // 128, d // 128))
        _check_field(self.format, "w2", self.w2, torch.float8_e4m3fn, (e, d, i))
        _check_field(self.format, "w2_scale", self.w2_scale, torch.float32, (e, d // 128, i // 128))

    dims = Bf16Experts.dims

    @classmethod
    def from_float(cls, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> Fp8BlockExperts:
        q13, s13 = Q.bf16_to_fp8_block(torch.cat((w1, w3), 1), name="w13")
        q2, s2 = Q.bf16_to_fp8_block(w2, name="w2")
        return cls(q13, Q.e8m0_to_float(s13), q2, Q.e8m0_to_float(s2))

    @classmethod
    def from_mxfp4(cls, mx: Mxfp4Experts) -> Fp8BlockExperts:
        """Convert MXFP4 experts (quant_formats.md §6.2); raises if a value would change."""
        q13, s13, l13 = Q.mxfp4_to_fp8_block(mx.w13, mx.w13_scale, name="w13")
        q2, s2, l2 = Q.mxfp4_to_fp8_block(mx.w2, mx.w2_scale, name="w2")
        _req(l13 == 0 and l2 == 0, f"mxfp4 -> fp8_block is lossy here: {l13} w13 and {l2} w2 groups change")
        return cls(q13, Q.e8m0_to_float(s13), q2, Q.e8m0_to_float(s2))

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        i = self.dims[1]
        w13 = Q.dequant_fp8_block(self.w13, self.w13_scale)
        return w13[:, :i], w13[:, i:], Q.dequant_fp8_block(self.w2, self.w2_scale)


@dataclass(frozen=True)
class Mxfp4Experts:
    """MXFP4 weight-only experts (V4 release). w13 uint8 [E, 2I, D/2] (e2m1 pairs, element 2j
    in the low nibble), w13_scale float8_e8m0fnu [E, 2I, D/32], w2 uint8 [E, D, I/2],
    w2_scale float8_e8m0fnu [E, D, I/32]; D and I multiples of 32."""

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    format: ClassVar[str] = "mxfp4"
    group: ClassVar[int] = Q.MXFP4_BLOCK
    scale_dtype: ClassVar[torch.dtype] = torch.float8_e8m0fnu

    def __post_init__(self) -> None:
        e, i2, d2 = self.w13.shape
        i, d, g = i2 // 2, d2 * 2, self.group
        _req(i % g == 0 and d % g == 0, f"{self.format}.w13: I = {i} and D = {d} must be multiples of {g}")
        _check_field(self.format, "w13", self.w13, torch.uint8, (e, i2, d // 2))
        _check_field(self.format, "w13_scale", self.w13_scale, self.scale_dtype, (e, i2, d // g))
        _check_field(self.format, "w2", self.w2, torch.uint8, (e, d, i // 2))
        _check_field(self.format, "w2_scale", self.w2_scale, self.scale_dtype, (e, d, i // g))

    @property
    def dims(self) -> tuple[int, int, int]:
        e, i2, d2 = self.w13.shape
        return e, i2 // 2, d2 * 2

    @classmethod
    def from_float(cls, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> Mxfp4Experts:
        q13, s13 = Q.quant_mxfp4(torch.cat((w1, w3), 1))
        q2, s2 = Q.quant_mxfp4(w2)
        return cls(q13.view(torch.uint8), s13, q2.view(torch.uint8), s2)

    @classmethod
    def from_checkpoint(cls, w1, s1, w3, s3, w2, s2) -> Mxfp4Experts:
        """From stacked checkpoint tensors: wX int8/uint8 [E, out, in/2], sX e8m0 [E, out, in/32]."""
        cat = torch.cat((w1.view(torch.uint8), w3.view(torch.uint8)), 1).contiguous()
        return cls(cat, torch.cat((s1, s3), 1).contiguous(), w2.view(torch.uint8).contiguous(), s2.contiguous())

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        i = self.dims[1]
        w13 = Q.dequant_mxfp4(self.w13, self.w13_scale)
        return w13[:, :i], w13[:, i:], Q.dequant_mxfp4(self.w2, self.w2_scale)


@dataclass(frozen=True)
class Nvfp4Experts:
    """NVFP4 weight-only experts (W4A16). w13 uint8 [E, 2I, D/2], w13_scale float8_e4m3fn
    [E, 2I, D/16], w13_global fp32 [E] (ONE global scale per expert for w1 and w3 together),
    w2 uint8 [E, D, I/2], w2_scale float8_e4m3fn [E, D, I/16], w2_global fp32 [E]."""

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w13_global: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    w2_global: torch.Tensor
    format: ClassVar[str] = "nvfp4"
    group: ClassVar[int] = Q.NVFP4_BLOCK
    scale_dtype: ClassVar[torch.dtype] = torch.float8_e4m3fn

    def __post_init__(self) -> None:
        Mxfp4Experts.__post_init__(self)
        e = self.w13.shape[0]
        _check_field(self.format, "w13_global", self.w13_global, torch.float32, (e,))
        _check_field(self.format, "w2_global", self.w2_global, torch.float32, (e,))

    dims = Mxfp4Experts.dims

    @classmethod
    def from_float(cls, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, **kw) -> Nvfp4Experts:
        """ModelOpt recipe (lossy); w1 and w3 share amax(w1, w3)/(6*448) per expert."""
        q13, s13, g13 = Q.bf16_to_nvfp4(torch.cat((w1, w3), 1), name="w13")
        q2, s2, g2 = Q.bf16_to_nvfp4(w2, name="w2")
        return cls(q13, s13, g13, q2, s2, g2, **kw)

    @classmethod
    def from_mxfp4(cls, mx: Mxfp4Experts, **kw) -> Nvfp4Experts:
        """Lossless conversion (quant_formats.md §6.1), w1/w3 sharing one global scale per expert;
        raises if any block would change."""
        q13, s13, g13, l13 = Q.mxfp4_to_nvfp4(mx.w13, mx.w13_scale, name="w13")
        q2, s2, g2, l2 = Q.mxfp4_to_nvfp4(mx.w2, mx.w2_scale, name="w2")
        _req(l13 == 0 and l2 == 0, f"mxfp4 -> nvfp4 is lossy here: {l13} w13 and {l2} w2 blocks change")
        return cls(q13, s13, g13, q2, s2, g2, **kw)

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        i = self.dims[1]
        w13 = Q.dequant_nvfp4(self.w13, self.w13_scale, self.w13_global)
        return w13[:, :i], w13[:, i:], Q.dequant_nvfp4(self.w2, self.w2_scale, self.w2_global)


@dataclass(frozen=True)
class Nvfp4W4A4Experts(Nvfp4Experts):
    """NVFP4 W4A4 (Blackwell): the NVFP4 weights plus optional calibrated activation global
    scales (fp32 [1]) for x (input_scale_13) and h (input_scale_2); None = amax/(6*448) of the
    current batch, computed on device."""

    input_scale_13: torch.Tensor | None = None
    input_scale_2: torch.Tensor | None = None
    format: ClassVar[str] = "nvfp4_w4a4"

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("input_scale_13", "input_scale_2"):
            t = getattr(self, name)
            if t is not None:
                _check_field(self.format, name, t, torch.float32, (1,))


Experts = Bf16Experts | Fp8BlockExperts | Mxfp4Experts | Nvfp4Experts | Nvfp4W4A4Experts
_CONTAINERS = {c.format: c for c in (Bf16Experts, Fp8BlockExperts, Mxfp4Experts, Nvfp4Experts, Nvfp4W4A4Experts)}


def experts_from_tensors(fmt: str, **fields: torch.Tensor | None) -> Experts:
    """Build the container of format `fmt` from its fields (extra None fields are ignored)."""
    _req(fmt in _CONTAINERS, f"fmt: expected one of {sorted(_CONTAINERS)}, got {fmt!r}")
    cls = _CONTAINERS[fmt]
    if fmt == "mxfp4":  # graphs carry ue8m0 scales as uint8 bytes (dsv4c/convert.py: field_specs)
        fields = {k: v.view(torch.float8_e8m0fnu) if k.endswith("_scale") and v is not None and v.dtype == torch.uint8
                  else v for k, v in fields.items()}
    names = {f.name for f in dataclasses.fields(cls)}
    extra = [k for k, v in fields.items() if k not in names and v is not None]
    _req(not extra, f"{fmt}: unexpected fields {extra}")
    return cls(**{k: v for k, v in fields.items() if k in names})


# ---------------------------------------------------------------------------------------------
# Triton kernel


@triton.jit
def _load_a(FMT: tl.constexpr, a_ptr, as_ptr, arow, valid, k0, K: tl.constexpr, stride_am, stride_asm,
            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """The A tile of K block k0 and its scales (unused for bf16 activations)."""
    if FMT == 4:
        kp = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        a = tl.load(a_ptr + arow[:, None] * stride_am + kp[None, :], mask=valid[:, None] & (kp[None, :] < K // 2), other=0)
        ks = k0 // 16 + tl.arange(0, BLOCK_K // 16)
        a_s = tl.load(as_ptr + arow[:, None] * stride_asm + ks[None, :], mask=valid[:, None] & (ks[None, :] < K // 16), other=0)
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + arow[:, None] * stride_am + kk[None, :], mask=valid[:, None] & (kk[None, :] < K), other=0.0)
        if FMT == 1:
            a_s = tl.load(as_ptr + arow * stride_asm + k0 // 128, mask=valid, other=0.0)
        else:
            a_s = tl.zeros((BLOCK_M,), dtype=tl.float32)
    return a, a_s


@triton.jit
def _fp4_tile(w_base, ws_base, cols, col_ok, k0, K: tl.constexpr, stride_wn, stride_wsn, GROUP: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Packed e2m1 tile -> fp32 [BLOCK_N, BLOCK_K] = fp4 * block scale (ue8m0 per 32 or e4m3 per 16)."""
    kp = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    p = tl.load(w_base + cols[:, None] * stride_wn + kp[None, :], mask=col_ok[:, None] & (kp[None, :] < K // 2), other=0)
    vals = U.e2m1_value(U.unpack_fp4(p.to(tl.int32), BLOCK_N, BLOCK_K))
    ks = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
    sb = tl.load(ws_base + cols[:, None] * stride_wsn + ks[None, :], mask=col_ok[:, None] & (ks[None, :] < K // GROUP), other=0)
    sb = sb.to(tl.int32)
    s = U.e8m0_value(sb) if GROUP == 32 else U.e4m3_value(sb)
    return U.scale_blocks(vals, s, BLOCK_N, BLOCK_K, GROUP)


@triton.jit
def _fp4_tile_split(w_base, ws_base, cols, col_ok, k0, K: tl.constexpr, stride_wn, stride_wsn, GROUP: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Packed e2m1 tile -> (even, odd) bf16 [BLOCK_N, BLOCK_K/2]: the weights of K columns
    k0 + 2j and k0 + 2j + 1 (low and high nibble of packed column j), block scale applied.
    Loaded as [BLOCK_N, groups, GROUP/2] so the per-group scale broadcasts without a join;
    the nibbles decode to fp16 by bit placement (fp4 * 2^-14), the scale carries the 2^14.
    Exact for block scales below 2^114 (every e4m3; e8m0 bytes <= 240)."""
    NG: tl.constexpr = BLOCK_K // GROUP
    HG: tl.constexpr = GROUP // 2
    g = tl.arange(0, NG)
    kp = k0 // 2 + g[:, None] * HG + tl.arange(0, HG)[None, :]                          # [NG, HG]
    p = tl.load(w_base + cols[:, None, None] * stride_wn + kp[None, :, :],
                mask=col_ok[:, None, None] & (kp[None, :, :] < K // 2), other=0).to(tl.int32)
    ks = k0 // GROUP + g
    sb = tl.load(ws_base + cols[:, None] * stride_wsn + ks[None, :], mask=col_ok[:, None] & (ks[None, :] < K // GROUP),
                 other=0).to(tl.int32)
    s = (U.e8m0_value(sb) if GROUP == 32 else U.e4m3_value(sb)) * 16384.0                # [BLOCK_N, NG]
    lo = (U.e2m1_lo_f16(p).to(tl.float32) * s[:, :, None]).to(tl.bfloat16)
    hi = (U.e2m1_hi_f16(p).to(tl.float32) * s[:, :, None]).to(tl.bfloat16)
    return tl.reshape(lo, (BLOCK_N, BLOCK_K // 2)), tl.reshape(hi, (BLOCK_N, BLOCK_K // 2))


@triton.jit
def _step_split(FMT: tl.constexpr, a_even, a_odd, w_base, ws_base, cols, col_ok, k0, K: tl.constexpr, stride_wn,
                stride_wsn, acc, INTERPRET: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + A_tile @ W_tile^T for FP4 weight-only (FMT 2, 3) as two half-K dots (even, odd K)."""
    lo, hi = _fp4_tile_split(w_base, ws_base, cols, col_ok, k0, K, stride_wn, stride_wsn, 32 if FMT == 2 else 16,
                             BLOCK_N, BLOCK_K)
    acc = U.mma(a_even, lo, acc, INTERPRET)
    return U.mma(a_odd, hi, acc, INTERPRET)


@triton.jit
def _step(FMT: tl.constexpr, a, a_s, w_base, ws_base, cols, col_ok, k0, K: tl.constexpr, stride_wn, stride_wsn, acc,
          USE_DOT_SCALED: tl.constexpr, SCALED_FP4: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + A_tile @ W_tile^T for K block k0, W rows `cols` of one expert, in format FMT."""
    if FMT == 0 or FMT == 1:
        kk = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_base + cols[:, None] * stride_wn + kk[None, :], mask=col_ok[:, None] & (kk[None, :] < K), other=0.0)
        if FMT == 0:
            acc = U.mma(a, w, acc, INTERPRET)
        else:
            ws = tl.load(ws_base + (cols // 128) * stride_wsn + k0 // 128, mask=col_ok, other=0.0)
            part = U.mma(a, w, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), INTERPRET)
            acc += part * a_s[:, None] * ws[None, :]
    elif FMT == 2 and SCALED_FP4 and not INTERPRET:
        # bf16 x MXFP4 through tl.dot_scaled: on Hopper Triton upcasts e2m1 and applies the e8m0
        # scale in registers (exact in bf16), then runs a bf16 dot; on sm_100 it is native.
        kp = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        p = tl.load(w_base + cols[:, None] * stride_wn + kp[None, :],
                    mask=col_ok[:, None] & (kp[None, :] < K // 2), other=0)
        ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        sb = tl.load(ws_base + cols[:, None] * stride_wsn + ks[None, :],
                     mask=col_ok[:, None] & (ks[None, :] < K // 32), other=0)
        acc = tl.dot_scaled(a, None, "bf16", tl.trans(p), sb, "e2m1", acc, fast_math=True)
    elif FMT == 2:   # (also SCALED_FP4 under the interpreter, which has no dot_scaled)
        w = _fp4_tile(w_base, ws_base, cols, col_ok, k0, K, stride_wn, stride_wsn, 32, BLOCK_N, BLOCK_K)
        acc = U.mma(a, w.to(tl.bfloat16), acc, INTERPRET)
    elif FMT == 3:
        w = _fp4_tile(w_base, ws_base, cols, col_ok, k0, K, stride_wn, stride_wsn, 16, BLOCK_N, BLOCK_K)
        acc = U.mma(a, w.to(tl.bfloat16), acc, INTERPRET)
    else:
        if USE_DOT_SCALED:
            kp = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            p = tl.load(w_base + cols[:, None] * stride_wn + kp[None, :], mask=col_ok[:, None] & (kp[None, :] < K // 2), other=0)
            ks = k0 // 16 + tl.arange(0, BLOCK_K // 16)
            sb = tl.load(ws_base + cols[:, None] * stride_wsn + ks[None, :], mask=col_ok[:, None] & (ks[None, :] < K // 16), other=0)
            acc = tl.dot_scaled(a, a_s.to(tl.float8e4nv, bitcast=True), "e2m1",
                                tl.trans(p), sb.to(tl.float8e4nv, bitcast=True), "e2m1", acc)
        else:   # emulation: both operands dequantised (exact in bf16), bf16 MMA
            av = U.scale_blocks(U.e2m1_value(U.unpack_fp4(a.to(tl.int32), BLOCK_M, BLOCK_K)),
                                U.e4m3_value(a_s.to(tl.int32)), BLOCK_M, BLOCK_K, 16)
            w = _fp4_tile(w_base, ws_base, cols, col_ok, k0, K, stride_wn, stride_wsn, 16, BLOCK_N, BLOCK_K)
            acc = U.mma(av.to(tl.bfloat16), w.to(tl.bfloat16), acc, INTERPRET)
    return acc


@triton.jit(do_not_specialize=["TOPK", "N_ASSIGN"])
def _moe_gemm_kernel(
        a_ptr, as_ptr, w_ptr, ws_ptr, wg_ptr, ag_ptr, ids_ptr, bexp_ptr, rw_ptr, out_ptr, outs_ptr,
        N, K: tl.constexpr, TOPK, N_ASSIGN, limit,
        stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om, stride_osm,
        FMT: tl.constexpr, GATHER: tl.constexpr, SWIGLU: tl.constexpr, QUANT_OUT: tl.constexpr,
        HAS_LIMIT: tl.constexpr, USE_DOT_SCALED: tl.constexpr, INTERPRET: tl.constexpr,
        SPLIT_FP4: tl.constexpr, SCALED_FP4: tl.constexpr, DIRECT: tl.constexpr, K_CHUNK: tl.constexpr,
        ATOMIC_OUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        PDL: tl.constexpr = False):
    """One [BLOCK_M, BLOCK_N] output tile of one expert's M-block over K columns
    [pid_k*K_CHUNK, (pid_k+1)*K_CHUNK). GATHER: A rows are x[ids // TOPK] (GEMM 1), else the
    block's own rows (GEMM 2). SWIGLU: two accumulators over W rows n and N + n, SwiGLU, clamp
    and routing weight in the epilogue (QUANT_OUT: e4m3 + ue8m0 per 128, BLOCK_N == 128).
    SPLIT_FP4 (FMT 2, 3): even/odd-K half dots on nibble-decoded weights (_fp4_tile_split).
    ATOMIC_OUT (split-K): fp32 atomic add of the partial tile into a zeroed fp32 out.
    SCALED_FP4 (FMT 2): tl.dot_scaled on the packed weights and their e8m0 scales.
    DIRECT: no sorted routing; M-block pid_m is assignment pid_m alone (row 0 of the tile, the
    other rows masked), bexp_ptr is the flat idx [N_A], and out / h have one row per assignment."""
    U.pdl_wait(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    e = tl.load(bexp_ptr + pid_m).to(tl.int32)
    if e >= 0:
        if DIRECT:
            r = tl.arange(0, BLOCK_M)
            valid = r == 0
            ids = tl.where(valid, pid_m, N_ASSIGN)
            rows = tl.where(valid, pid_m, 0)
        else:
            rows, ids, valid = U.block_rows(pid_m, ids_ptr, N_ASSIGN, BLOCK_M)
        arow = U.a_rows(ids, rows, valid, TOPK, GATHER)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        w_base = w_ptr + e.to(tl.int64) * stride_we
        ws_base = ws_ptr + e.to(tl.int64) * stride_wse
        acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_lo = pid_k * K_CHUNK
        for kc in range(0, K_CHUNK, BLOCK_K):
            k0 = k_lo + kc
            if SPLIT_FP4:
                kk = k0 + 2 * tl.arange(0, BLOCK_K // 2)
                a_ptrs = a_ptr + arow[:, None] * stride_am + kk[None, :]
                a_mask = valid[:, None] & (kk[None, :] < K)
                a_even = tl.load(a_ptrs, mask=a_mask, other=0.0)
                a_odd = tl.load(a_ptrs + 1, mask=a_mask, other=0.0)
                acc1 = _step_split(FMT, a_even, a_odd, w_base, ws_base, cols, col_ok, k0, K, stride_wn, stride_wsn,
                                   acc1, INTERPRET, BLOCK_N, BLOCK_K)
                if SWIGLU:
                    acc2 = _step_split(FMT, a_even, a_odd, w_base, ws_base, cols + N, col_ok, k0, K, stride_wn,
                                       stride_wsn, acc2, INTERPRET, BLOCK_N, BLOCK_K)
            else:
                a, a_s = _load_a(FMT, a_ptr, as_ptr, arow, valid, k0, K, stride_am, stride_asm, BLOCK_M, BLOCK_K)
                acc1 = _step(FMT, a, a_s, w_base, ws_base, cols, col_ok, k0, K, stride_wn, stride_wsn, acc1,
                             USE_DOT_SCALED, SCALED_FP4, INTERPRET, BLOCK_M, BLOCK_N, BLOCK_K)
                if SWIGLU:
                    acc2 = _step(FMT, a, a_s, w_base, ws_base, cols + N, col_ok, k0, K, stride_wn, stride_wsn, acc2,
                                 USE_DOT_SCALED, SCALED_FP4, INTERPRET, BLOCK_M, BLOCK_N, BLOCK_K)
        if FMT == 3 or FMT == 4:
            g = tl.load(wg_ptr + e)
            if FMT == 4:
                g = g * tl.load(ag_ptr)
            acc1 = acc1 * g
            acc2 = acc2 * g
        orow = rows.to(tl.int64)
        store_ok = valid[:, None] & col_ok[None, :]   # padding rows are never read back
        if SWIGLU:
            rw = tl.load(rw_ptr + ids, mask=valid, other=0.0)
            h = U.swiglu(acc1, acc2, limit, HAS_LIMIT) * rw[:, None]
            if QUANT_OUT:
                q, s = U.quant_rows_e4m3(h)
                tl.store(out_ptr + orow[:, None] * stride_om + cols[None, :], q.to(tl.uint8), mask=store_ok)
                tl.store(outs_ptr + orow * stride_osm + pid_n, s, mask=valid)
            else:
                tl.store(out_ptr + orow[:, None] * stride_om + cols[None, :], h.to(out_ptr.dtype.element_ty),
                         mask=store_ok)
        elif ATOMIC_OUT:
            tl.atomic_add(out_ptr + orow[:, None] * stride_om + cols[None, :], acc1,
                          mask=valid[:, None] & col_ok[None, :], sem="relaxed")
        else:
            tl.store(out_ptr + orow[:, None] * stride_om + cols[None, :], acc1.to(out_ptr.dtype.element_ty),
                     mask=store_ok)


# ---------------------------------------------------------------------------------------------
# host side


# fp8_block experts run the CUDA-core GEMVs (kernels/moe_fp8_gemv.py) up to this many assignments, and while
# they are at most E/4 (few share an expert; `direct` routing's regime); 0: never (the tile). run54 (H100, the
# 2-layer step's replayed kernels): 856 vs 868 µs at batch 1 (2-4 µs a layer saved), a loss at batch 8 (1643 vs
# 1593 µs, 48 assignments): 8 takes it at one token (6 assignments at Flash's top-6) and never at batch 8.
FP8_GEMV_MAX_ASSIGN = 8
# and with these tiles: W2 rows per program (half as many of W1 and of W3), K columns per step, warps
FP8_GEMV_BLOCK_N, FP8_GEMV_BLOCK_K, FP8_GEMV_WARPS = 32, 512, 8


@dataclass(frozen=True)
class MoeKernelConfig:
    """Tile sizes and launch parameters (BLOCK_M also sets the routing alignment).

    fp4_split: MXFP4/NVFP4 weight-only decode the nibbles by bit placement and run two half-K
    dots (even / odd K) instead of interleaving the nibbles (join + reshape); ignored elsewhere.
    split_k: the w2 GEMM splits K into this many chunks, each added into an fp32 buffer with
    atomics (more programs at decode; the summation order then varies run to run); 1 = off.
    fp4_scaled: MXFP4 weight-only multiplies through tl.dot_scaled (bf16 x e2m1 with e8m0 scales;
    Triton's own in-register upcast on Hopper); ignored for other formats.
    direct: skip the sort; every assignment is its own M-block of one row (no routing prep, two
    GEMM launches and a sum). For decode, where few assignments share an expert.
    gemv: MXFP4/NVFP4 weight-only: the CUDA-core GEMV kernels of kernels/moe_fp4_gemv.py
    (no sort, no tensor cores; block_n rows of W1/W3 or W2 per program, block_k, num_warps; the
    other fields are ignored); fp8_block: those of kernels/moe_fp8_gemv.py (W8A8 as the tile, its
    activation quantisation included; block_n weight rows per program: block_n / 2 of W1 and of W3, or
    block_n of W2).
    fp8_prefill: fp8_block only: the prefill kernels of kernels/moe_fp8_prefill.py with their own
    default tiles (BLOCK_M 128, TMA weights, persistent grid; the other fields are ignored).
    pdl: gemv only: programmatic dependent launch between its kernels on sm_90+ (Fp4GemvConfig.pdl)."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    fp4_split: bool = False
    split_k: int = 1
    fp4_scaled: bool = False
    direct: bool = False
    gemv: bool = False
    fp8_prefill: bool = False
    pdl: bool = True


def default_config(fmt: str, n_assign: int, n_experts: int, device: torch.device) -> MoeKernelConfig:
    """Heuristic tiles from static shapes: small BLOCK_M at decode, large at prefill; large
    blocks under the CPU interpreter (fewer programs).

    Decode choices come from the H200 sweep at Flash shapes, replayed in CUDA graphs
    (BENCHMARKS.md, fourth session): `direct` routing (no sort) while few assignments share an
    expert (n_assign <= E/4: 1 and 8 tokens at top-6 of 256) halves the 1-token call (the
    sort's ~15 launches were most of it), and below 16 assignments at any E (a small model's
    verify: the sort's launches cost more than reading a few expert tiles twice); MXFP4
    weight-only multiplies through tl.dot_scaled (Triton's in-register upcast) on sm_90+, about
    1.5x faster than the best fp4_split tile.
    split_k stays off: its atomics make the summation order vary.
    Sixth-session H200 sweeps (BENCHMARKS.md): MXFP4/NVFP4 weight-only decode runs
    the CUDA-core GEMV kernels (gemv) up to 2 assignments per expert: at 1 / 8 / 64 tokens of
    Flash, 40 / 199 / 1465 us against 81 / 417 / 1753 for tl.dot_scaled; fp8_block from 64
    assignments per expert runs the prefill kernels (fp8_prefill), 1.5-1.6x faster at 4096 and
    16384 tokens."""
    if device.type == "cpu":
        return MoeKernelConfig(block_m=16, block_n=128, block_k=128)
    per_expert = n_assign / max(n_experts, 1)
    fp4 = fmt in ("mxfp4", "nvfp4", "nvfp4_w4a4")
    cap = torch.cuda.get_device_capability(device)
    # the GEMV's NVFP4 scales decode through fp8e4nv (sm_89+); the prefill kernel loads by TMA (sm_90+)
    if fmt in ("mxfp4", "nvfp4") and n_assign <= max(2 * n_experts, 16) and cap >= (8, 9):
        return MoeKernelConfig(block_n=32, block_k=512, num_warps=4, gemv=True)
    if fmt == "fp8_block" and per_expert >= 64 and cap >= (9, 0):
        return MoeKernelConfig(fp8_prefill=True)
    if fmt == "fp8_block" and n_assign <= min(max(n_experts // 4, 16), FP8_GEMV_MAX_ASSIGN) and cap >= (8, 9):
        return MoeKernelConfig(block_n=FP8_GEMV_BLOCK_N, block_k=FP8_GEMV_BLOCK_K, num_warps=FP8_GEMV_WARPS, gemv=True)
    if per_expert <= 16:
        direct = n_assign <= max(n_experts // 4, 16)
        if fmt == "mxfp4" and torch.cuda.get_device_capability(device) >= (9, 0):
            return MoeKernelConfig(16, 64, 128, 4, 4, fp4_scaled=True, direct=direct)
        if fmt in ("mxfp4", "nvfp4"):
            return MoeKernelConfig(16, 64, 128, 4, 4, fp4_split=True, direct=direct)
        if fmt == "bf16":
            return MoeKernelConfig(16, 32, 128, 4, 4, direct=direct)
        return MoeKernelConfig(16, 64, 256 if fp4 else 128, 4, 4, direct=direct)
    if fmt == "fp8_block":
        # H200 prefill sweep (fourth session, graph replay): at 4096 / 16384 tokens this tile took
        # 3.62 / 11.31 ms against 7.76 / 24.85 ms for BLOCK_M 128 (24% / 31% of the FP8 peak)
        return MoeKernelConfig(64, 256, 128, 8, 3)
    if per_expert <= 64:   # bf16 at BLOCK_K 128 x 4 stages needed 320 KB of shared memory
        return MoeKernelConfig(64, 128, 64 if fmt == "bf16" else 128, 4, 3)
    return MoeKernelConfig(128, 128, 128 if fmt != "bf16" else 64, 8, 3)


@dataclass(frozen=True)
class Routing:
    """Device routing prep. ids int32 [R]; block_expert int32 [NB]; inv int64 [N_A] (padded row
    of each assignment, row-major over [T, K]); n_assign, block_m static ints. direct
    (route_direct): block_expert is the flat idx [N_A], ids unused, inv None."""

    ids: torch.Tensor
    block_expert: torch.Tensor
    inv: torch.Tensor | None
    n_assign: int
    block_m: int
    direct: bool = False

    @property
    def rows(self) -> int:
        """Rows of h and y: one per assignment (direct), else the padded row count."""
        return self.n_assign if self.direct else self.ids.numel()


def route_direct(idx: torch.Tensor, block_m: int) -> Routing:
    """Routing without a sort: M-block a is assignment a (row-major over [T, K]). No device op."""
    flat = idx.reshape(-1)
    return Routing(flat, flat, None, flat.numel(), block_m, direct=True)


# `route_prep` in one launch up to this many assignments (0: never). The ATen path is about 24 launches (scatter_add,
# two cumsums, a stable radix sort, scatters, searchsorted, fills and copies), outside the step's PDL chain: 76-77
# µs a MoE layer between the router and the first expert GEMM at 64 tokens (run79's timeline, H100, the 2-layer
# slice, 384 assignments). The kernel is one program; its work grows with assignments² / ROUTE_PREP_CHUNK, so
# prefill-sized routings keep the ATen path. run80 (H200, the 2-layer slice, FP8 block experts, GPU alone): the kernel
# took batch 32 2.346 vs 2.441 / 2.445 ms and batch 64 3.202 vs 3.275 ms, 60 fewer launches a step. 2048 covers
# the deterministic verify of 1 + 3 tokens at batch 64 (1536 assignments; not yet timed there).
ROUTE_PREP_KERNEL_MAX_ASSIGN = 2048
ROUTE_PREP_CHUNK = 64   # assignments per step of the kernel's loops
ROUTE_PREP_WARPS = 8


def route_prep(idx: torch.Tensor, n_experts: int, block_m: int) -> Routing:
    """Sort assignments by expert (stable) and pad each expert's rows to block_m, on the device with no
    host sync (every size comes from idx.shape): `route_prep_fused`'s one launch up to
    ROUTE_PREP_KERNEL_MAX_ASSIGN assignments (CPU tensors: under the interpreter, as the GEMMs), else
    `route_prep_ref`'s torch ops. Both give the same tensors. idx [T, K] ints in [0, E) (not checked on
    device)."""
    if 0 < idx.numel() <= ROUTE_PREP_KERNEL_MAX_ASSIGN:
        return route_prep_fused(idx.contiguous(), n_experts, block_m)
    return route_prep_ref(idx, n_experts, block_m)


def _n_blocks(n: int, n_experts: int, block_m: int) -> int:
    """M-blocks of a sorted routing of n assignments: every expert's rows padded up to block_m add at most
    one partial block per expert that has rows."""
    return math.ceil(n / block_m) + min(n_experts, n)


def route_prep_ref(idx: torch.Tensor, n_experts: int, block_m: int) -> Routing:
    """`route_prep` in torch device ops (the reference of `route_prep_fused`)."""
    n = idx.numel()
    dev = idx.device
    flat = idx.reshape(-1).to(torch.int64)                                          # [N_A]
    counts = torch.zeros(n_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m                            # [E]
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    start = torch.cumsum(counts, 0) - counts
    sorted_e, order = torch.sort(flat, stable=True)                                 # [N_A]
    dest = pad_start[sorted_e] + torch.arange(n, device=dev) - start[sorted_e]      # padded row
    n_blocks = _n_blocks(n, n_experts, block_m)
    ids = torch.full((n_blocks * block_m,), n, dtype=torch.int32, device=dev).scatter_(0, dest, order.to(torch.int32))
    inv = torch.empty(n, dtype=torch.int64, device=dev).scatter_(0, order, dest)
    block_rows = torch.arange(n_blocks, device=dev) * block_m
    bexp = torch.searchsorted(pad_end, block_rows, right=True)
    bexp = torch.where(bexp < n_experts, bexp, -1).to(torch.int32)
    return Routing(ids, bexp, inv, n, block_m)


# Legend: N assignments (flat idx, row-major over [T, K]), E experts (E_P the next power of two), BM block_m,
# NB M-blocks (`_n_blocks`), C assignments per loop step (FILL padded rows per fill step). One program:
#   1. counts[e] = #{a : idx[a] = e}                         (one-hot [C, E_P] sums over the chunks)
#   2. padded = ⌈counts / BM⌉·BM;  pad_end = cumsum(padded);  pad_start = pad_end - padded
#   3. bexp[b] = #{e < E : pad_end[e] <= b·BM}, -1 where that is E (searchsorted, right=True)
#   4. ids[r] = N for every padded row r; then, a barrier later, for each assignment a in order:
#      dest[a] = pad_start[idx[a]] + #{a' < a : idx[a'] = idx[a]}  (the stable sort's place among its expert's)
#      ids[dest[a]] = a;  inv[a] = dest[a]
# The earlier chunks' share of the rank is a running per-expert count (`seen`), the chunk's own a [C, C]
# comparison. No host sync, a grid of one: capture-safe.
@triton.jit
def _route_prep_kernel(idx_ptr, ids_ptr, bexp_ptr, inv_ptr, N, E, NB,
                       BM: tl.constexpr, C: tl.constexpr, E_P: tl.constexpr, FILL: tl.constexpr,
                       PDL: tl.constexpr = False):
    U.pdl_wait(PDL)
    ex = tl.arange(0, E_P)
    c = tl.arange(0, C)
    counts = tl.zeros((E_P,), dtype=tl.int32)
    for a0 in range(0, N, C):
        a = a0 + c
        ea = tl.load(idx_ptr + a, mask=a < N, other=-1).to(tl.int32)
        counts += tl.sum((ea[:, None] == ex[None, :]).to(tl.int32), axis=0)
    padded = (counts + BM - 1) // BM * BM
    pad_end = tl.cumsum(padded, 0)
    pad_start = pad_end - padded
    for b0 in range(0, NB, C):
        b = b0 + c
        below = (pad_end[None, :] <= (b * BM)[:, None]) & (ex[None, :] < E)          # [C, E_P]
        owner = tl.sum(below.to(tl.int32), axis=1)
        tl.store(bexp_ptr + b, tl.where(owner < E, owner, -1), mask=b < NB)
    f = tl.arange(0, FILL)
    for r0 in range(0, NB * BM, FILL):
        r = r0 + f
        tl.store(ids_ptr + r, tl.full((FILL,), 0, tl.int32) + N, mask=r < NB * BM)
    tl.debug_barrier()  # the padding fills land before the scatter below overwrites the real rows
    seen = tl.zeros((E_P,), dtype=tl.int32)
    before = c[None, :] < c[:, None]                                                  # [C(a), C(a')]: a' first
    for a0 in range(0, N, C):
        a = a0 + c
        ok = a < N
        ea = tl.load(idx_ptr + a, mask=ok, other=-1).to(tl.int32)
        hot = ea[:, None] == ex[None, :]                                              # [C, E_P]
        base = tl.sum(tl.where(hot, (pad_start + seen)[None, :], 0), axis=1)
        rank = tl.sum(((ea[:, None] == ea[None, :]) & before).to(tl.int32), axis=1)
        dest = base + rank
        tl.store(inv_ptr + a, dest.to(tl.int64), mask=ok)
        tl.store(ids_ptr + dest, a.to(tl.int32), mask=ok)
        seen += tl.sum(hot.to(tl.int32), axis=0)


def route_prep_fused(idx: torch.Tensor, n_experts: int, block_m: int) -> Routing:
    """`route_prep_ref`'s tensors from one launch of `_route_prep_kernel` (CPU tensors: the interpreter).
    idx [T, K] integer, contiguous; block_m a power of two."""
    _req(not idx.is_floating_point() and not idx.is_complex(), f"idx: expected an integer tensor, got {idx.dtype}")
    _req(idx.is_contiguous(), "idx: expected a contiguous tensor (the kernel reads it flat)")
    _req(n_experts >= 1, f"n_experts: expected >= 1, got {n_experts}")
    _req(block_m >= 1 and block_m & (block_m - 1) == 0, f"block_m: expected a power of two, got {block_m}")
    n = idx.numel()
    dev = idx.device
    nb = _n_blocks(n, n_experts, block_m)
    ids = torch.empty(nb * block_m, dtype=torch.int32, device=dev)
    bexp = torch.empty(nb, dtype=torch.int32, device=dev)
    inv = torch.empty(n, dtype=torch.int64, device=dev)
    if n:
        _route_prep_kernel[(1,)](idx, ids, bexp, inv, n, n_experts, nb, BM=block_m, C=ROUTE_PREP_CHUNK,
                                 E_P=triton.next_power_of_2(n_experts), FILL=1024, num_warps=ROUTE_PREP_WARPS,
                                 **U.pdl_launch(idx))
    return Routing(ids, bexp, inv, n, block_m)


def _check_inputs(x, idx, weight, experts, swiglu_limit) -> None:
    _req(isinstance(experts, tuple(_CONTAINERS.values())), f"experts: expected one of {sorted(_CONTAINERS)} "
         f"containers, got {type(experts).__name__}")
    e, _, d = experts.dims
    _req(x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[1] == d and x.stride(1) == 1,
         f"x: expected bf16 [T, {d}] with unit stride along D, got {x.dtype} {tuple(x.shape)}")
    t = x.shape[0]
    _req(idx.dim() == 2 and idx.shape[0] == t and idx.dtype in (torch.int32, torch.int64),
         f"idx: expected int32/int64 [{t}, K], got {idx.dtype} {tuple(idx.shape)}")
    _req(weight.dtype == torch.float32 and tuple(weight.shape) == tuple(idx.shape),
         f"weight: expected fp32 {tuple(idx.shape)}, got {weight.dtype} {tuple(weight.shape)}")
    _req(x.device == idx.device == weight.device == experts.w13.device,
         f"x/idx/weight/experts: all on one device, got {x.device}, {idx.device}, {weight.device}, {experts.w13.device}")
    _req(isinstance(swiglu_limit, (int, float)) and math.isfinite(swiglu_limit),
         f"swiglu_limit: expected a finite float, got {swiglu_limit!r}")
    if x.device.type == "cpu" and idx.numel():
        lo, hi = int(idx.min()), int(idx.max())
        _req(lo >= 0 and hi < e, f"idx: expert ids must be in [0, {e}), got {lo}..{hi}")


def _w_args(experts: Experts, which: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight, scale, global) of w13 or w2 as kernel operands (scale bytes as uint8)."""
    w = getattr(experts, which)
    s = getattr(experts, f"{which}_scale", None)
    g = getattr(experts, f"{which}_global", None)
    if s is not None and s.dtype != torch.float32:
        s = s.view(torch.uint8)
    return w, (w if s is None else s), (w if g is None else g)


def _gemm(fmt: str, a, a_s, a_g, experts, which: str, routing: Routing, weight_flat, out, out_s, n: int, k: int,
          topk: int, limit: float, gather: bool, swiglu: bool, quant_out: bool, cfg: MoeKernelConfig,
          use_dot_scaled: bool) -> None:
    w, ws, wg = _w_args(experts, which)
    n_blocks = routing.block_expert.numel()
    split_k = 1 if swiglu else cfg.split_k
    k_chunk = triton.cdiv(triton.cdiv(k, split_k), cfg.block_k) * cfg.block_k
    grid = (n_blocks, triton.cdiv(n, cfg.block_n), triton.cdiv(k, k_chunk))
    _moe_gemm_kernel[grid](
        a, a_s, w, ws, wg, a_g, routing.ids, routing.block_expert, weight_flat, out, out_s,
        n, k, topk, routing.n_assign, float(limit),
        a.stride(0), a_s.stride(0), w.stride(0), w.stride(1), ws.stride(0), ws.stride(1) if ws.dim() > 1 else 0,
        out.stride(0), out_s.stride(0),
        FMT=_FMT_ID[fmt], GATHER=gather, SWIGLU=swiglu, QUANT_OUT=quant_out, HAS_LIMIT=limit > 0,
        USE_DOT_SCALED=use_dot_scaled, INTERPRET=U.interpret_flag(a),
        SPLIT_FP4=cfg.fp4_split and fmt in ("mxfp4", "nvfp4"), SCALED_FP4=cfg.fp4_scaled and fmt == "mxfp4",
        DIRECT=routing.direct, K_CHUNK=k_chunk, ATOMIC_OUT=out.dtype == torch.float32,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **U.pdl_launch(a))


def _dynamic_scale(t: torch.Tensor, given: torch.Tensor | None) -> torch.Tensor:
    """NVFP4 activation global scale fp32 [1]: the given one, or amax(t)/(6*448) on device."""
    if given is not None:
        return given
    return Q.div_const(t.abs().amax().float(), _NVFP4_GLOBAL_DIV).clamp_min(torch.finfo(torch.float32).tiny).reshape(1)


def _check_cfg(fmt: str, cfg: MoeKernelConfig, d: int, i: int) -> None:
    _req(cfg.block_m >= 16 and cfg.block_m & (cfg.block_m - 1) == 0, f"config.block_m: power of two >= 16, got {cfg.block_m}")
    _req(cfg.block_n >= 16 and cfg.block_n & (cfg.block_n - 1) == 0, f"config.block_n: power of two >= 16, got {cfg.block_n}")
    _req(cfg.block_k >= 32 and cfg.block_k & (cfg.block_k - 1) == 0, f"config.block_k: power of two >= 32, got {cfg.block_k}")
    _req(cfg.num_warps in (1, 2, 4, 8, 16), f"config.num_warps: 1, 2, 4, 8 or 16, got {cfg.num_warps}")
    _req(cfg.num_stages >= 1, f"config.num_stages: >= 1, got {cfg.num_stages}")
    _req(cfg.split_k >= 1, f"config.split_k: >= 1, got {cfg.split_k}")
    if fmt == "fp8_block":
        _req(cfg.block_k == 128, f"config.block_k: fp8_block needs 128 (one activation scale per K step), got {cfg.block_k}")
    _req(not (cfg.fp4_split and cfg.fp4_scaled), "config: fp4_split and fp4_scaled are alternatives; set one")
    if cfg.fp4_split and fmt in ("mxfp4", "nvfp4"):
        g = 32 if fmt == "mxfp4" else 16
        _req(cfg.block_k >= 2 * max(g, 16), f"config.block_k: fp4_split with {fmt} needs >= {2 * max(g, 16)} "
             f"(half-K dots of >= 16 and whole scale groups), got {cfg.block_k}")


def _moe_grouped_impl(x, idx, weight, experts, swiglu_limit, cfg: MoeKernelConfig, use_dot_scaled: bool):
    fmt = experts.format
    e, i, d = experts.dims
    t, topk = idx.shape
    out = torch.empty_like(x)
    if t == 0:
        return out
    routing = route_direct(idx, cfg.block_m) if cfg.direct else route_prep(idx, e, cfg.block_m)
    rows = routing.rows
    dev = x.device
    wflat = weight.reshape(-1).contiguous()
    dummy = wflat   # any fp32 tensor: the pointer of an operand the format does not read
    cfg2 = cfg
    if fmt == "fp8_block":
        xq, xs = act_quant_fp8(x)
        h = torch.empty(rows, i, dtype=torch.uint8, device=dev)
        hs = torch.empty(rows, i // 128, dtype=torch.float32, device=dev)
        cfg1 = dataclasses.replace(cfg, block_n=128)
        _gemm(fmt, xq, xs, dummy, experts, "w13", routing, wflat, h, hs, i, d, topk, swiglu_limit, True, True, True,
              cfg1, use_dot_scaled)
        a2, a2_s, a2_g = h.view(torch.float8_e4m3fn), hs, dummy
    elif fmt == "nvfp4_w4a4":
        x_g = _dynamic_scale(x, experts.input_scale_13)
        xq, xs = act_quant_nvfp4(x, x_g)
        h = torch.zeros(rows, i, dtype=torch.bfloat16, device=dev)
        _gemm(fmt, xq, xs.view(torch.uint8), x_g, experts, "w13", routing, wflat, h, h, i, d, topk, swiglu_limit,
              True, True, False, cfg, use_dot_scaled)
        a2_g = _dynamic_scale(h, experts.input_scale_2)
        a2, a2_s = act_quant_nvfp4(h, a2_g)
        a2_s = a2_s.view(torch.uint8)
    else:
        h = torch.empty(rows, i, dtype=torch.bfloat16, device=dev)
        _gemm(fmt, x, x, dummy, experts, "w13", routing, wflat, h, h, i, d, topk, swiglu_limit, True, True, False,
              cfg, use_dot_scaled)
        a2, a2_s, a2_g = h, h, dummy
    if cfg2.split_k > 1:    # partial sums of the K chunks meet in fp32
        y = torch.zeros(rows, d, dtype=torch.float32, device=dev)
    else:
        y = torch.empty(rows, d, dtype=torch.bfloat16, device=dev)
    _gemm(fmt, a2, a2_s, a2_g, experts, "w2", routing, wflat, y, y, d, i, topk, 0.0, False, False, False, cfg2,
          use_dot_scaled)
    return combine_slots(y, None if routing.direct else routing.inv, topk, out)   # fp32 sum, one rounding


def moe_grouped(x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, experts: Experts,
                swiglu_limit: float, config: MoeKernelConfig | None = None) -> torch.Tensor:
    """Routed experts on Triton kernels: same function as torch.ops.dsv4c.moe_experts, with the
    routing weight applied before w2 (Official) and the weights in `experts`' format.

    x bf16 [T, D]; idx int32/int64 [T, K] in [0, E); weight fp32 [T, K]; experts one of the
    containers; swiglu_limit L (<= 0: no clamp) -> bf16 [T, D].

    CUDA-graph capture safe: routing prep is torch device ops (sort, scatter, cumsum,
    searchsorted) with no host sync, the grids depend on shapes only (a worst-case number of
    M-blocks; unused blocks exit), and the activation global scales of W4A4 are device tensors.
    Kernels must be compiled once (one eager call) before capture. On CPU tensors the kernels
    run under the Triton interpreter (set TRITON_INTERPRET=1 before they first launch).
    nvfp4_w4a4 needs tl.dot_scaled on CUDA capability >= 10.0 (sm_100, Blackwell); the wrapper
    refuses on older GPUs.
    """
    _check_inputs(x, idx, weight, experts, swiglu_limit)
    fmt = experts.format
    e, i, d = experts.dims
    cfg = config or default_config(fmt, idx.numel(), e, x.device)
    if cfg.fp8_prefill:
        _req(fmt == "fp8_block", f"config.fp8_prefill: only for fp8_block experts, got {fmt}")
        from dsv4c.kernels.moe_fp8_prefill import moe_fp8_prefill   # it imports this module
        return moe_fp8_prefill(x, idx, weight, experts, swiglu_limit)
    if cfg.gemv and fmt == "fp8_block":
        return moe_fp8_gemv(x.contiguous(), idx, weight, experts.w13, experts.w13_scale, experts.w2,
                            experts.w2_scale, swiglu_limit,
                            Fp8GemvMoeConfig(cfg.block_n // 2, cfg.block_n, cfg.block_k, cfg.num_warps))
    if cfg.gemv:
        _req(fmt in ("mxfp4", "nvfp4"), f"config.gemv: only for mxfp4 / nvfp4 / fp8_block experts, got {fmt}")
        _req(cfg.block_n >= 32, f"config.block_n: gemv needs >= 32 (h is scaled per 32 columns), got {cfg.block_n}")
        return moe_fp4_gemv(x.contiguous(), idx, weight, experts.w13, experts.w13_scale, getattr(experts, "w13_global", None),
                            experts.w2, experts.w2_scale, getattr(experts, "w2_global", None), experts.group,
                            swiglu_limit, Fp4GemvConfig(cfg.block_n, cfg.block_n, cfg.block_k, cfg.num_warps,
                                                        pdl=cfg.pdl))
    _check_cfg(fmt, cfg, d, i)
    use_dot_scaled = False
    if fmt == "nvfp4_w4a4" and x.device.type == "cuda":
        cap = torch.cuda.get_device_capability(x.device)
        _req(cap >= (10, 0), f"nvfp4_w4a4: tl.dot_scaled with NVFP4 needs CUDA capability >= 10.0 (sm_100), "
             f"this GPU is {cap[0]}.{cap[1]}; use nvfp4 (weight-only) or fp8_block")
        use_dot_scaled = True
    return _moe_grouped_impl(x, idx, weight, experts, swiglu_limit, cfg, use_dot_scaled)


# ---------------------------------------------------------------------------------------------
# reference


def _sim_act_fp8(v: torch.Tensor) -> torch.Tensor:
    return Q.dequant_act(*Q.quant_act_fp8(v))


def _sim_act_nvfp4(v: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return Q.dequant_act_nvfp4(*Q.quant_act_nvfp4(v, g.reshape(())), g.reshape(()))


def moe_grouped_ref(x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, experts: Experts,
                    swiglu_limit: float) -> torch.Tensor:
    """fp32 reference of `moe_grouped` [T, D]: dequantised weights, fp32 math, routing weight
    before w2, and the format's activation quantisation emulated (FP8: x and h per 128 with
    ue8m0 scales; W4A4: x and h to NVFP4 with the container's or the batch amax global scale)."""
    _check_inputs(x, idx, weight, experts, swiglu_limit)
    fmt = experts.format
    w1, w3, w2 = experts.dequantize()
    t, topk = idx.shape
    xa = x.float()
    if fmt == "fp8_block":
        xa = _sim_act_fp8(xa)
    elif fmt == "nvfp4_w4a4":
        xa = _sim_act_nvfp4(xa, _dynamic_scale(x, experts.input_scale_13))
    rows = torch.arange(t, device=x.device).repeat_interleave(topk)                  # [N_A]
    flat = idx.reshape(-1).long()
    g = torch.einsum("nd,nid->ni", xa[rows], w1[flat])                               # [N_A, I]
    u = torch.einsum("nd,nid->ni", xa[rows], w3[flat])
    if swiglu_limit > 0:
        g = g.clamp(max=swiglu_limit)
        u = u.clamp(-swiglu_limit, swiglu_limit)
    h = torch.nn.functional.silu(g) * u * weight.reshape(-1, 1)
    if fmt == "fp8_block":
        h = _sim_act_fp8(h)
    elif fmt == "nvfp4_w4a4":
        h = _sim_act_nvfp4(h, _dynamic_scale(h, experts.input_scale_2))
    y = torch.einsum("ni,ndi->nd", h, w2[flat])                                      # [N_A, D]
    return y.view(t, topk, -1).sum(1)


# ---------------------------------------------------------------------------------------------
# custom op for the FX rewrite of dsv4c::moe_experts


@torch.library.custom_op("dsv4c::moe_experts_q", mutates_args=())
def moe_experts_q(x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, fmt: str, w13: torch.Tensor,
                  w13_scale: torch.Tensor | None, w13_global: torch.Tensor | None, w2: torch.Tensor,
                  w2_scale: torch.Tensor | None, w2_global: torch.Tensor | None,
                  input_scale_13: torch.Tensor | None, input_scale_2: torch.Tensor | None,
                  swiglu_limit: float) -> torch.Tensor:
    """`moe_grouped` with the container passed as its fields (see the module docstring). On CPU
    tensors it computes `moe_grouped_ref` (cast to x.dtype): artifacts run there with emulate=True,
    and the kernels' interpreter tests call `moe_grouped` directly."""
    experts = experts_from_tensors(fmt, w13=w13, w13_scale=w13_scale, w13_global=w13_global, w2=w2,
                                   w2_scale=w2_scale, w2_global=w2_global, input_scale_13=input_scale_13,
                                   input_scale_2=input_scale_2)
    if x.device.type == "cpu":
        # CPU without the Triton interpreter (artifacts run with emulate=True): the reference math.
        # Capture safety (split_at_routers.OP_CAPTURE) is a claim about the CUDA path only.
        return moe_grouped_ref(x, idx, weight, experts, swiglu_limit).to(x.dtype)
    return moe_grouped(x, idx, weight, experts, swiglu_limit)


@moe_experts_q.register_fake
def _moe_experts_q_fake(x, idx, weight, fmt, w13, w13_scale, w13_global, w2, w2_scale, w2_global,
                        input_scale_13, input_scale_2, swiglu_limit):
    return torch.empty_like(x)
