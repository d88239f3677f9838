"""Interleaved RoPE (`dsv4c.model.common.rope_interleaved`) as one Triton kernel.

Public API::

    rope_interleaved(x, cos, sin, inverse=False) -> Tensor   # the Triton kernel, one launch
    rope_interleaved_ref(x, cos, sin, inverse=False)         # the model's function, unchanged (the spec)

Custom op (the target of passes/fuse_rope.py; CPU = the reference)::

    dsv4c::rope_interleaved(Tensor x, Tensor cos, Tensor sin, bool inverse) -> Tensor

Semantics: x [..., C]; cos/sin [..., r/2] broadcastable to x's leading dims (V4: [B, T, r/2] for the
kv row, [B, T, 1, r/2] for per-head q and o). The first C − r channels pass through; each pair
(a, b) = (x[C−r+2j], x[C−r+2j+1]) becomes (a·c − b·s, a·s + b·c) in fp32, cast back to x's dtype,
with c = cos[j], s = ±sin[j] (− for `inverse`). Eagerly that is ~17 ATen launches (slices, cast,
four muls, stack, flatten, cat); here one program per row of x, grid = rows, fixed by the shape, no
host sync: capture-safe. Same operations as the reference, so fp32 results agree to an ulp (FMA
contraction aside); low-precision outputs to within one rounding.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from dsv4c.kernels._tl import pdl_launch, pdl_wait

MAX_LEAD = 3  # leading dims of x ([B, T, H]); cos/sin index them through their (broadcast) strides
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, C, L1, L2, xs0, xs1, xs2, cs0, cs1, cs2, cs3, ss0, ss1, ss2, ss3,
                 INVERSE: tl.constexpr, KEEP: tl.constexpr, HALF: tl.constexpr, BLOCK_KEEP: tl.constexpr,
                 BLOCK_HALF: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    # x [L0, L1, L2, C]: element (i0, i1, i2, c) at Σ i·xs + c; out contiguous; cos/sin element (i0, i1, i2, j)
    # at Σ i·stride (0 where broadcast)
    row = tl.program_id(0).to(tl.int64)
    i2 = row % L2
    i1 = (row // L2) % L1
    i0 = row // (L2 * L1)
    base = row * C
    xb = i0 * xs0 + i1 * xs1 + i2 * xs2
    if KEEP > 0:
        k = tl.arange(0, BLOCK_KEEP)
        km = k < KEEP
        tl.store(out_ptr + base + k, tl.load(x_ptr + xb + k, mask=km), mask=km)
    j = tl.arange(0, BLOCK_HALF)
    jm = j < HALF
    c = tl.load(cos_ptr + i0 * cs0 + i1 * cs1 + i2 * cs2 + j * cs3, mask=jm, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + i0 * ss0 + i1 * ss1 + i2 * ss2 + j * ss3, mask=jm, other=0.0).to(tl.float32)
    if INVERSE:
        s = -s
    even = KEEP + 2 * j
    a = tl.load(x_ptr + xb + even, mask=jm, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + xb + even + 1, mask=jm, other=0.0).to(tl.float32)
    ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + base + even, (a * c - b * s).to(ty), mask=jm)
    tl.store(out_ptr + base + even + 1, (a * s + b * c).to(ty), mask=jm)


def _check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[int, int]:
    if x.dtype not in _DTYPES or cos.dtype not in _DTYPES or sin.dtype not in _DTYPES:
        raise ValueError(f"rope_interleaved: x, cos, sin must be float32/bfloat16/float16, got {x.dtype}, "
                         f"{cos.dtype}, {sin.dtype}")
    if x.dim() < 1 or x.dim() > MAX_LEAD + 1:
        raise ValueError(f"rope_interleaved: x must be [..., C] with at most {MAX_LEAD} leading dims, "
                         f"got shape {list(x.shape)}")
    half = cos.shape[-1] if cos.dim() else 0
    if cos.shape != sin.shape:
        raise ValueError(f"rope_interleaved: cos and sin shapes differ: {list(cos.shape)} vs {list(sin.shape)}")
    if half < 1 or 2 * half > x.shape[-1]:
        raise ValueError(f"rope_interleaved: cos.shape[-1] = {half} rotates {2 * half} channels; x has {x.shape[-1]}")
    try:
        torch.broadcast_shapes(cos.shape[:-1], x.shape[:-1])
    except RuntimeError:
        raise ValueError(f"rope_interleaved: cos/sin {list(cos.shape)} do not broadcast to x's leading dims "
                         f"{list(x.shape[:-1])}") from None
    if torch.broadcast_shapes(cos.shape[:-1], x.shape[:-1]) != x.shape[:-1]:
        raise ValueError(f"rope_interleaved: cos/sin {list(cos.shape)} would broadcast x {list(x.shape)}")
    return x.shape[-1], half


def _row_args(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: int) -> tuple:
    """The kernels' shape arguments after C: L1, L2 (x's leading dims padded to MAX_LEAD), x's three strides
    over them, then cos's and sin's four strides over [L0, L1, L2, r/2] (0 where they broadcast)."""
    lead = (1,) * (MAX_LEAD - (x.dim() - 1)) + tuple(x.shape[:-1])
    pad = (0,) * (MAX_LEAD - (x.dim() - 1))
    cs = cos.expand(*x.shape[:-1], half)
    ss = sin.expand(*x.shape[:-1], half)
    return (lead[1], lead[2], *(pad + tuple(x.stride()[:-1])), *(pad + tuple(cs.stride())),
            *(pad + tuple(ss.stride())))


def _unit_inner(x: torch.Tensor) -> torch.Tensor:
    """x itself where its last dim has unit stride (read through its strides), else a contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last 2·cos.shape[-1] channels of x in interleaved pairs (see the module doc); out contiguous.
    x is read through its strides where its last dim has unit stride (a column slice of a fused projection's
    output at several tokens), else copied once; cos/sin broadcastable to x's leading dims (read through
    their strides, no copy). CPU tensors run under the Triton interpreter."""
    C, half = _check(x, cos, sin)
    xc = _unit_inner(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if xc.numel() == 0:
        return out
    keep = C - 2 * half
    rows = xc.numel() // C
    _rope_kernel[(rows,)](xc, cos, sin, out, C, *_row_args(xc, cos, sin, half), INVERSE=bool(inverse), KEEP=keep,
                          HALF=half, BLOCK_KEEP=triton.next_power_of_2(max(keep, 1)),
                          BLOCK_HALF=triton.next_power_of_2(half), num_warps=1 if C <= 256 else 2, **pdl_launch(xc))
    return out


def rope_interleaved_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """The eager model's `rope_interleaved` (the specification), unchanged."""
    from dsv4c.model.common import rope_interleaved as model_rope

    return model_rope(x, cos, sin, inverse=inverse)


# ------------------------------------------------------------------------------------------------
# per-head RMS norm + RoPE of V4's query (dsv4c::head_rms_rope) in one launch
# ------------------------------------------------------------------------------------------------
@triton.jit
def _head_rms_rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, C, L1, L2, xs0, xs1, xs2, cs0, cs1, cs2, cs3, ss0, ss1,
                          ss2, ss3, eps, HALF: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_HALF: tl.constexpr,
                          PDL: tl.constexpr = False):
    pdl_wait(PDL)
    # one row of C channels: y = (x · rsqrt(mean(x²) + eps)) cast to x's dtype, then the last 2·HALF
    # channels rotated in fp32 from the cast values (the reference's order: norm, cast, rope); x's row
    # (i0, i1, i2) at Σ i·xs, out contiguous
    row = tl.program_id(0).to(tl.int64)
    i2 = row % L2
    i1 = (row // L2) % L1
    i0 = row // (L2 * L1)
    base = row * C
    xb = i0 * xs0 + i1 * xs1 + i2 * xs2
    ty = out_ptr.dtype.element_ty
    k = tl.arange(0, BLOCK_C)
    x = tl.load(x_ptr + xb + k, mask=k < C, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, 0) / C + eps)
    keep = C - 2 * HALF
    tl.store(out_ptr + base + k, (x * inv).to(ty), mask=k < keep)
    j = tl.arange(0, BLOCK_HALF)
    jm = j < HALF
    c = tl.load(cos_ptr + i0 * cs0 + i1 * cs1 + i2 * cs2 + j * cs3, mask=jm, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + i0 * ss0 + i1 * ss1 + i2 * ss2 + j * ss3, mask=jm, other=0.0).to(tl.float32)
    even = keep + 2 * j
    a = (tl.load(x_ptr + xb + even, mask=jm, other=0.0).to(tl.float32) * inv).to(ty).to(tl.float32)
    b = (tl.load(x_ptr + xb + even + 1, mask=jm, other=0.0).to(tl.float32) * inv).to(ty).to(tl.float32)
    tl.store(out_ptr + base + even, (a * c - b * s).to(ty), mask=jm)
    tl.store(out_ptr + base + even + 1, (a * s + b * c).to(ty), mask=jm)


def head_rms_rope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """`dsv4c::head_rms_rope` in one launch: per row of q [B, T, H, d], the unweighted RMS norm in
    fp32, cast to q's dtype, then interleaved RoPE of the last 2·cos.shape[-1] channels; cos/sin
    [B, T, r/2], shared by the heads (the model op's signature). q is read through its strides where its
    last dim has unit stride (else copied once); out contiguous. CPU tensors run under the Triton
    interpreter."""
    if q.dim() != 4 or cos.dim() != 3:
        raise ValueError(f"head_rms_rope: q must be [B, T, H, d] and cos/sin [B, T, r/2], got q {list(q.shape)}, "
                         f"cos {list(cos.shape)}")
    cos, sin = cos[:, :, None], sin[:, :, None]
    C, half = _check(q, cos, sin)
    qc = _unit_inner(q)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if qc.numel() == 0:
        return out
    _head_rms_rope_kernel[(qc.numel() // C,)](
        qc, cos, sin, out, C, *_row_args(qc, cos, sin, half), float(eps),
        HALF=half, BLOCK_C=triton.next_power_of_2(C), BLOCK_HALF=triton.next_power_of_2(half),
        num_warps=1 if C <= 256 else 4, **pdl_launch(qc))
    return out


def head_rms_rope_ref(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's op (dsv4c/model/v4_ops.py `head_rms_rope`), unchanged: the specification."""
    from dsv4c.model.v4_ops import head_rms_rope as model_op

    return model_op(q, cos, sin, eps)


@torch.library.custom_op("dsv4c::head_rms_rope_fused", mutates_args=())
def head_rms_rope_fused(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """`dsv4c::head_rms_rope` as one Triton launch on CUDA tensors; on CPU the model's op."""
    if q.device.type == "cpu":
        _check(q, cos[:, :, None], sin[:, :, None])
        return head_rms_rope_ref(q, cos, sin, eps)
    return head_rms_rope(q, cos, sin, eps)


@head_rms_rope_fused.register_fake
def _head_rms_rope_fake(q, cos, sin, eps):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.custom_op("dsv4c::rope_interleaved", mutates_args=())
def rope_interleaved_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """`rope_interleaved` on CUDA tensors; on CPU the model's own function (bit-exact with the unfused graph)."""
    if x.device.type == "cpu":
        _check(x, cos, sin)
        return rope_interleaved_ref(x, cos, sin, inverse)
    return rope_interleaved(x, cos, sin, inverse)


@rope_interleaved_op.register_fake
def _rope_fake(x, cos, sin, inverse):
    return torch.empty_like(x, memory_format=torch.contiguous_format)
