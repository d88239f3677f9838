"""RMSNorm (`dsv4c.model.common.RMSNorm`) as one Triton kernel.

Public API::

    rms_norm(x, w, eps, cast_first=False) -> Tensor   # the Triton kernel, one launch
    rms_norm_ref(x, w, eps, cast_first=False)         # RMSNorm.forward, unchanged (the spec)

Custom op (the target of passes/fuse_rmsnorm.py; CPU = the reference)::

    dsv4c::rms_norm(Tensor x, Tensor w, float eps, bool cast_first) -> Tensor

Semantics, per row of x [..., C] (r = x·rsqrt(mean(x²) + eps) in fp32):
    V4 order (cast_first=False):  out = (w_f32 · r).to(x.dtype)
    V3 order (cast_first=True):   out = w · r.to(x.dtype)   (dtype: promote(w, x); the product of two
                                  values is formed in fp32 and rounded once, as PyTorch does)
Eagerly that is ~6 ATen launches per norm (casts, pow, mean, add, rsqrt, two muls); here one program
holds one row in registers (C <= MAX_C). Grid = rows, fixed by the shape, no host sync: capture-safe.
The sum of squares is a tree reduction (the eager CPU/CUDA reductions use their own orders), so fp32
results agree with the reference to a few ulp; low-precision outputs to within one rounding.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import triton
import triton.language as tl

MAX_C = 16384  # one row in registers
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, C, eps, inv_c, CAST_FIRST: tl.constexpr, BLOCK_C: tl.constexpr):
    # x [R, C] contiguous rows; w [C]; out [R, C]
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    cm = c < C
    x = tl.load(x_ptr + row * C + c, mask=cm, other=0.0).to(tl.float32)
    r = x * (1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) * inv_c + eps))
    w = tl.load(w_ptr + c, mask=cm, other=0.0).to(tl.float32)
    if CAST_FIRST:
        r = r.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * C + c, (w * r).to(out_ptr.dtype.element_ty), mask=cm)


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


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, cast_first: bool = False) -> torch.Tensor:
    """RMSNorm of every row of x [..., C] with weight w [C] (any strides: a non-contiguous x is
    copied once). C <= MAX_C. CPU tensors run under the Triton interpreter."""
    c = _check(x, w, eps)
    if c > MAX_C:
        raise ValueError(f"rms_norm: C = {c} exceeds MAX_C = {MAX_C} (one row per program)")
    xc, wc = x.contiguous(), w.contiguous()
    out = torch.empty(x.shape, dtype=out_dtype(x, w, cast_first), device=x.device)
    rows = xc.numel() // c if c else 0
    if rows == 0:
        return out
    block = triton.next_power_of_2(c)
    _rms_norm_kernel[(rows,)](xc, wc, out, c, float(eps), 1.0 / c, CAST_FIRST=bool(cast_first), BLOCK_C=block,
                              num_warps=max(1, min(16, block // 512)))
    return out


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
