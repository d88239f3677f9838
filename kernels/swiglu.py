"""The SwiGLU activation (`dsv4c.model.common.swiglu_act`) as one Triton kernel.

Public API::

    swiglu_act(g, u, limit) -> Tensor        # the Triton kernel, one launch
    swiglu_act_ref(g, u, limit)              # the model's function, unchanged (the spec)

Custom op (the target of passes/fuse_swiglu.py; CPU = the reference)::

    dsv4c::swiglu_act(Tensor g, Tensor u, float limit) -> Tensor

Semantics, elementwise over g, u [..., I] of one dtype (fp32 or bf16); out contiguous, same dtype:
    limit > 0:  g = min(g, L),  u = max(min(u, L), −L)      (NaN passes through, as torch.clamp)
    h = silu(g) · u,  silu(g) = g / (1 + e^−g)
PyTorch's rounding steps are kept: in bf16, silu is computed in fp32 and rounded to bf16, then the
product of the two bf16 values is computed in fp32 and rounded to bf16; in fp32 everything is fp32.
Clamping a bf16 value at the fp32 limit and rounding gives min(g, bf16(L)) (rounding is monotonic
and g is representable), which is what torch returns, so the clamp needs no rounding step.
Eagerly that is 4 launches (clamp, clamp, silu, mul; 2 with limit 0); here one.

g and u may be strided views: their last dim must have unit stride and the leading dims must
collapse into one row stride (the two halves of the fused `w1 ‖ w3` GEMM's split output: row stride
2I). Grid = (rows, cdiv(I, BLOCK)), fixed by the shape, no host sync: capture-safe.

Accuracy: `tl.exp` is the approximate `ex2.approx` on CUDA (and libdevice's exp does not run under
the Triton interpreter), so e^−g is written out below: Cody-Waite reduction by ln 2 and a degree-7
Taylor polynomial (truncation < 6e-9 relative), a few fp32 ulp; the division is IEEE (`tl.div_rn`).
Measured under the interpreter (tests/test_fuse_swiglu.py): exp <= 1.1 ulp vs fp64 (torch's own:
0.55); fp32 h rel_err <= 1.4e-8 vs torch, 97-98% of elements bit-equal; bf16 h bit-equal to torch
on every element tested (2^17 random values and the specials; it can differ by one bf16 ulp only
where the fp32 silu lies within ~1 ulp of a bf16 rounding boundary). The interpreter's bf16 casts
truncate, so under it (RNE_BF16) values are rounded to nearest-even on the bits first; on CUDA the
cast (cvt.rn) does it.

sm_90 (triton 3.6 compile for GPUTarget("cuda", 90, 32), BLOCK 1024, 4 warps, ptxas -v): 32
registers (bf16) / 39 (fp32), no spills, no shared memory, no ex2.approx, 8 div.rn.f32 per thread;
128-bit loads and stores when I and the row strides are multiples of 16 (Triton specialises them
at launch: the Flash split halves, I = 2048, row stride 4096), scalar accesses otherwise.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from dsv4c.kernels import _tl as U

_DTYPES = (torch.float32, torch.bfloat16)
MAX_BLOCK = 1024


@triton.jit
def _swiglu_act_kernel(g_ptr, u_ptr, out_ptr, I, g_rs, u_rs, limit,
                       CLAMP: tl.constexpr, RNE_BF16: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    U.pdl_wait(PDL)
    # g, u: rows of I elements at row strides g_rs, u_rs (unit stride within a row); out [rows, I] contiguous
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < I
    ty = out_ptr.dtype.element_ty
    g = tl.load(g_ptr + row * g_rs + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_rs + c, mask=m, other=0.0).to(tl.float32)
    h = swiglu_values(g, u, limit, CLAMP, ty, RNE_BF16)
    tl.store(out_ptr + row * I + c, h.to(ty), mask=m)


@triton.jit
def swiglu_values(g, u, limit, CLAMP: tl.constexpr, ty: tl.constexpr, RNE_BF16: tl.constexpr):
    """h = silu(g) · u of fp32 g, u (values of `ty`) with PyTorch's rounding steps in `ty`, as fp32 (exact in
    ty)."""
    if CLAMP:  # compares, not min/max: a NaN passes through as in torch.clamp
        g = tl.where(g > limit, limit, g)
        u = tl.where(u > limit, limit, tl.where(u < -limit, -limit, u))
        if ty != tl.float32:  # the clamped value is min(g, L) rounded: min(g, round(L)), as torch's
            g = U.round_to(g, ty, RNE_BF16)
            u = U.round_to(u, ty, RNE_BF16)
    s = tl.div_rn(g, 1.0 + U.exp_f32(-g))
    if ty != tl.float32:
        s = U.round_to(s, ty, RNE_BF16)
        h = U.round_to(s * u, ty, RNE_BF16)
    else:
        h = s * u
    return h


def _row_stride(t: torch.Tensor, name: str) -> int:
    """The one row stride of t [..., I] seen as rows of I unit-stride elements, or a ValueError."""
    I = t.shape[-1]
    if t.numel() == 0:
        return I
    if t.stride(-1) != 1 and I > 1:
        raise ValueError(f"swiglu_act: {name} must have unit stride in its last dim, got strides {list(t.stride())}")
    try:
        rows = t.view(-1, I)
    except RuntimeError:
        raise ValueError(f"swiglu_act: {name}'s leading dims do not collapse into one row stride "
                         f"(shape {list(t.shape)}, strides {list(t.stride())})") from None
    return rows.stride(0)


def _check(g: torch.Tensor, u: torch.Tensor, limit: float) -> tuple[int, int]:
    """Contracts of both the kernel and the op; returns the row strides of g and u."""
    for name, t in (("g", g), ("u", u)):
        if t.dtype not in _DTYPES:
            raise ValueError(f"swiglu_act: {name} must be float32 or bfloat16, got {t.dtype}")
        if t.dim() < 1:
            raise ValueError(f"swiglu_act: {name} must be [..., I], got a scalar")
    if g.dtype != u.dtype:
        raise ValueError(f"swiglu_act: g and u must have one dtype, got g {g.dtype} and u {u.dtype}")
    if g.shape != u.shape:
        raise ValueError(f"swiglu_act: g and u must have one shape, got g {list(g.shape)} and u {list(u.shape)}")
    if g.device != u.device:
        raise ValueError(f"swiglu_act: g and u must be on one device, got g on {g.device} and u on {u.device}")
    if math.isnan(limit):
        raise ValueError("swiglu_act: limit is NaN")
    return _row_stride(g, "g"), _row_stride(u, "u")


def swiglu_act(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(clamp(g)) · clamp(u) in one launch (see the module doc); limit <= 0: no clamp. CPU tensors
    run under the Triton interpreter."""
    g_rs, u_rs = _check(g, u, limit)
    out = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    I = g.shape[-1]
    if out.numel() == 0:
        return out
    block = min(MAX_BLOCK, triton.next_power_of_2(I))
    grid = (out.numel() // I, triton.cdiv(I, block))
    _swiglu_act_kernel[grid](g, u, out, I, g_rs, u_rs, float(limit), CLAMP=limit > 0,
                             RNE_BF16=U.rne_bf16(g, g.dtype), BLOCK=block,
                             num_warps=max(1, min(4, block // 256)), **U.pdl_launch(g))
    return out


def swiglu_act_ref(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    """The eager model's `swiglu_act` (the specification), unchanged."""
    from dsv4c.model.common import swiglu_act as model_act

    return model_act(g, u, limit)


@torch.library.custom_op("dsv4c::swiglu_act", mutates_args=())
def swiglu_act_op(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    """`swiglu_act` on CUDA tensors; on CPU the model's own function (bit-exact with the unfused graph)."""
    if g.device.type == "cpu":
        _check(g, u, limit)
        return swiglu_act_ref(g, u, limit)
    return swiglu_act(g, u, limit)


@swiglu_act_op.register_fake
def _swiglu_act_fake(g, u, limit):
    return g.new_empty(g.shape)
