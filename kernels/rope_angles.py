"""The RoPE angle table of a chunk (`dsv4c.model.common.rope_angles`) as one Triton kernel.

Public API::

    rope_angles(pos0, inv_freq, T) -> (cos, sin)        # the Triton kernel, one launch
    rope_angles_ref(pos0, inv_freq, T) -> (cos, sin)    # the model's function, unchanged (the spec)

Custom op (the target of passes/fuse_rope_angles.py; CPU = the reference)::

    dsv4c::rope_angles(Tensor pos0, Tensor inv_freq, SymInt T) -> (Tensor, Tensor)

Semantics (B sequences, T chunk tokens, r/2 = inv_freq.shape[0]): pos0 [B] int64, inv_freq [r/2]
fp32 -> cos, sin [B, T, r/2] fp32 (contiguous) with

    ang[b, t, j] = fp32(pos0[b] + t) * inv_freq[j]      (one fp32 rounding of the product)
    cos = cos(ang), sin = sin(ang)

the model's order of operations (int64 add, cast to fp32, fp32 multiply). Exported, the model's
table is ~6 launches (arange, add, cast, mul, cos, sin); here one program per block of rows of the
[B·T, r/2] table, grid fixed by the shape, no host sync: capture-safe.

Accuracy. Angles reach ~1e6 rad (positions up to 1M times frequencies up to 1), so the argument
reduction matters: the hardware `cos.approx.f32`/`sin.approx.f32` lose accuracy as |angle| grows.
This kernel calls libdevice's `__nv_cosf`/`__nv_sinf` explicitly (`triton.language.extra.libdevice`:
full-range reduction, <= 2 ulp like torch's CUDA cos/sin), so the precision does not depend on how
a Triton version lowers `tl.cos`/`tl.sin` (triton 3.6 on sm_90 happens to lower them to libdevice
too). The compiled sm_90 PTX holds no `.approx` sine or cosine (tests/test_fuse_rope_angles.py).
The product is libdevice's `mul_rn` (`mul.rn.f32`: rounded once, never contracted into an FMA).
The Triton interpreter cannot run libdevice calls (the stubs return None: an InterpreterError), so
on CPU tensors the kernel takes `*` and `tl.cos`/`tl.sin` (INTERPRET), which the interpreter
evaluates with numpy's float32 multiply and cos/sin (accurate: measured <= 6.9e-8 absolute against
fp64 of the same fp32 angle, for angles up to 1e6 with numpy 2.4; torch's CPU cos/sin 3.6e-8).

sm_90 (triton 3.6, compiled on the CPU machine, not run): no `sin.approx`/`cos.approx` in the PTX;
libdevice's reduction is Cody-Waite for |angle| < 105615 and Payne-Hanek (a 28-byte local array)
above; no shared memory. Triton links libdevice in flush-to-zero mode, which changes nothing here:
the angles are 0 or normal (position >= 1 times a normal frequency).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from dsv4c.kernels._tl import interpret_flag, pdl_launch, pdl_wait

_ELEMS = 1024  # table elements per program (rows x BLOCK_HALF)


@triton.jit
def _rope_angles_kernel(pos0_ptr, inv_freq_ptr, cos_ptr, sin_ptr, rows, T, HALF: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, INTERPRET: tl.constexpr,
                        PDL: tl.constexpr = False):
    pdl_wait(PDL)
    # rows = B·T; row i is (b, t) = (i // T, i % T); cos/sin [B, T, HALF] contiguous
    i = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    j = tl.arange(0, BLOCK_HALF)
    im = i < rows
    jm = j < HALF
    pos = tl.load(pos0_ptr + i // T, mask=im, other=0) + i % T  # int64, as the model's add
    f = tl.load(inv_freq_ptr + j, mask=jm, other=0.0)
    p = pos.to(tl.float32)[:, None]
    if INTERPRET:  # libdevice does not run under the interpreter; numpy's cos/sin are accurate there
        ang = p * f[None, :]
        c = tl.cos(ang)
        s = tl.sin(ang)
    else:  # mul.rn: one rounding, never contracted into an FMA; precise range reduction
        ang = libdevice.mul_rn(p, f[None, :])
        c = libdevice.cos(ang)
        s = libdevice.sin(ang)
    off = i[:, None] * HALF + j[None, :]
    m = im[:, None] & jm[None, :]
    tl.store(cos_ptr + off, c, mask=m)
    tl.store(sin_ptr + off, s, mask=m)


def _check(pos0: torch.Tensor, inv_freq: torch.Tensor, T: int) -> None:
    if pos0.dtype != torch.int64 or pos0.dim() != 1:
        raise ValueError(f"rope_angles: pos0 must be a 1-D int64 tensor [B], got {pos0.dtype} {list(pos0.shape)}")
    if inv_freq.dtype != torch.float32 or inv_freq.dim() != 1 or inv_freq.shape[0] < 1:
        raise ValueError(f"rope_angles: inv_freq must be a non-empty 1-D float32 tensor [r/2], got "
                         f"{inv_freq.dtype} {list(inv_freq.shape)}")
    if pos0.device != inv_freq.device:
        raise ValueError(f"rope_angles: pos0 and inv_freq must be on one device, got {pos0.device} and "
                         f"{inv_freq.device}")
    if T < 0:
        raise ValueError(f"rope_angles: T must be >= 0, got {T}")


def rope_angles(pos0: torch.Tensor, inv_freq: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, T, r/2] fp32 of the angles fp32(pos0[b] + t) · inv_freq[j] in one launch (see the
    module doc). pos0 [B] int64 and inv_freq [r/2] fp32, any strides (copied once if not contiguous).
    CPU tensors run under the Triton interpreter."""
    _check(pos0, inv_freq, T)
    B, half = pos0.shape[0], inv_freq.shape[0]
    cos = torch.empty(B, T, half, dtype=torch.float32, device=pos0.device)
    sin = torch.empty_like(cos)
    rows = B * T
    if rows == 0:
        return cos, sin
    block_half = triton.next_power_of_2(half)
    block_r = min(triton.next_power_of_2(rows), max(1, _ELEMS // block_half))
    _rope_angles_kernel[(triton.cdiv(rows, block_r),)](
        pos0.contiguous(), inv_freq.contiguous(), cos, sin, rows, T, HALF=half, BLOCK_R=block_r,
        BLOCK_HALF=block_half, INTERPRET=interpret_flag(pos0), num_warps=1 if block_r * block_half <= 256 else 4,
        **pdl_launch(cos))
    return cos, sin


def rope_angles_ref(pos0: torch.Tensor, inv_freq: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager model's `rope_angles` (the specification), unchanged."""
    from dsv4c.model.common import rope_angles as model_rope_angles

    return model_rope_angles(pos0, T, inv_freq)


@torch.library.custom_op("dsv4c::rope_angles", mutates_args=())
def rope_angles_op(pos0: torch.Tensor, inv_freq: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_angles` on CUDA tensors; on CPU the model's own function (bit-exact with the unfused graph)."""
    if pos0.device.type == "cpu":
        _check(pos0, inv_freq, T)
        return rope_angles_ref(pos0, inv_freq, T)
    return rope_angles(pos0, inv_freq, T)


@rope_angles_op.register_fake
def _rope_angles_fake(pos0, inv_freq, T):
    cos = pos0.new_empty((pos0.shape[0], T, inv_freq.shape[0]), dtype=torch.float32)
    return cos, torch.empty_like(cos)
