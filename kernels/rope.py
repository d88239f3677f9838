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

MAX_LEAD = 3  # leading dims of x ([B, T, H]); cos/sin index them through their (broadcast) strides
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, C, L1, L2, cs0, cs1, cs2, cs3, ss0, ss1, ss2, ss3,
                 INVERSE: tl.constexpr, KEEP: tl.constexpr, HALF: tl.constexpr, BLOCK_KEEP: tl.constexpr,
                 BLOCK_HALF: tl.constexpr):
    # x, out [L0, L1, L2, C] contiguous; cos/sin element (i0, i1, i2, j) at Σ i·stride (0 where broadcast)
    row = tl.program_id(0).to(tl.int64)
    i2 = row % L2
    i1 = (row // L2) % L1
    i0 = row // (L2 * L1)
    base = row * C
    if KEEP > 0:
        k = tl.arange(0, BLOCK_KEEP)
        km = k < KEEP
        tl.store(out_ptr + base + k, tl.load(x_ptr + base + k, mask=km), mask=km)
    j = tl.arange(0, BLOCK_HALF)
    jm = j < HALF
    c = tl.load(cos_ptr + i0 * cs0 + i1 * cs1 + i2 * cs2 + j * cs3, mask=jm, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + i0 * ss0 + i1 * ss1 + i2 * ss2 + j * ss3, mask=jm, other=0.0).to(tl.float32)
    if INVERSE:
        s = -s
    even = base + KEEP + 2 * j
    a = tl.load(x_ptr + even, mask=jm, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + even + 1, mask=jm, other=0.0).to(tl.float32)
    ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + even, (a * c - b * s).to(ty), mask=jm)
    tl.store(out_ptr + even + 1, (a * s + b * c).to(ty), mask=jm)


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


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last 2·cos.shape[-1] channels of x in interleaved pairs (see the module doc). x any
    strides (a non-contiguous x is copied once); cos/sin broadcastable to x's leading dims (read through
    their strides, no copy). CPU tensors run under the Triton interpreter."""
    C, half = _check(x, cos, sin)
    xc = x.contiguous()
    out = torch.empty_like(xc)
    if xc.numel() == 0:
        return out
    lead = (1,) * (MAX_LEAD - (x.dim() - 1)) + tuple(x.shape[:-1])
    cs = cos.expand(*x.shape[:-1], half)
    ss = sin.expand(*x.shape[:-1], half)
    pad = (0,) * (MAX_LEAD - (x.dim() - 1))
    cstr, sstr = pad + tuple(cs.stride()), pad + tuple(ss.stride())
    keep = C - 2 * half
    rows = xc.numel() // C
    _rope_kernel[(rows,)](xc, cs, ss, out, C, lead[1], lead[2], *cstr, *sstr, INVERSE=bool(inverse), KEEP=keep,
                          HALF=half, BLOCK_KEEP=triton.next_power_of_2(max(keep, 1)),
                          BLOCK_HALF=triton.next_power_of_2(half), num_warps=1 if C <= 256 else 2)
    return out


def rope_interleaved_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """The eager model's `rope_interleaved` (the specification), unchanged."""
    from dsv4c.model.common import rope_interleaved as model_rope

    return model_rope(x, cos, sin, inverse=inverse)


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
