"""V4's grouped output projection `z = einsum("btgi,gri->btgr", x, W_oa)` as one Triton launch.

Public API::

    grouped_linear(x, w) -> Tensor        # Triton (decode-sized M), one launch
    grouped_linear_ref(x, w) -> Tensor    # the model's einsum, x cast to w's dtype first

Custom op (the target of passes/lower_grouped_linear.py; CPU = the reference)::

    dsv4c::grouped_linear(Tensor x, Tensor w) -> Tensor

Legend: M = B·T token rows, G output groups, R rank per group (o_lora_rank), I = H·d/G inputs per
group. x [B, T, G, I] (any float dtype; cast to w's dtype, as the model casts the attention output
before the projection), w [G, R, I] -> z [B, T, G, R] in w's dtype: z[m, g, r] = Σ_i x[m, g, i]·w[g, r, i]
with fp32 accumulation, one rounding.

Why a kernel: eagerly the einsum is a cuBLAS batched GEMM over G with a permuting copy of x before
it and of z after it, and the model's cast of x is one more launch: four launches per layer, three
of them copies. Here program (g, r-block) reads its [BLOCK_R, I] weight slice once and all M rows
of group g (cast in registers), `tl.dot` with fp32 accumulation, and stores z in place: one launch,
the weight read once. For M above `MAX_M` tokens the tensor-core GEMM is the better tool and the op
runs the reference einsum. The grid is fixed by the shapes: capture-safe.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from dsv4c.kernels._tl import pdl_launch, pdl_wait

MAX_M = 16          # token rows up to which the Triton kernel runs (one 16-row dot tile)
BLOCK_R = 32
BLOCK_I = 256
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _grouped_linear_kernel(x_ptr, w_ptr, z_ptr, M, G, R, I: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_I: tl.constexpr, F32: tl.constexpr, INTERPRET: tl.constexpr,
                           PDL: tl.constexpr = False):
    pdl_wait(PDL)
    g = tl.program_id(0)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    m = tl.arange(0, BLOCK_M)
    k = tl.arange(0, BLOCK_I)
    rm, mm = r < R, m < M
    ty = w_ptr.dtype.element_ty
    x_rows = x_ptr + (m[:, None].to(tl.int64) * G + g) * I        # [BLOCK_M, 1]
    w_rows = w_ptr + (g.to(tl.int64) * R + r[:, None]) * I        # [BLOCK_R, 1]
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for i0 in range(0, I, BLOCK_I):  # I constexpr: one variant per layer width (the interpreter needs a static bound)
        km = (i0 + k) < I
        x = tl.load(x_rows + i0 + k[None, :], mask=mm[:, None] & km[None, :], other=0.0).to(ty)
        w = tl.load(w_rows + i0 + k[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        if INTERPRET:  # the interpreter's low-precision dot is not exact: multiply the same values in fp32
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
        elif F32:  # fp32 operands: IEEE products (the default would round them to TF32's 10-bit mantissa)
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    z = z_ptr + (m[:, None].to(tl.int64) * G + g) * R + r[None, :]
    tl.store(z, acc.to(ty), mask=mm[:, None] & rm[None, :])


def _check(x: torch.Tensor, w: torch.Tensor) -> tuple[int, int, int, int]:
    if x.dtype not in _DTYPES or w.dtype not in _DTYPES:
        raise ValueError(f"grouped_linear: x and w must be float32/bfloat16/float16, got {x.dtype}, {w.dtype}")
    if x.dim() != 4 or w.dim() != 3:
        raise ValueError(f"grouped_linear: x must be [B, T, G, I] and w [G, R, I], got {list(x.shape)}, "
                         f"{list(w.shape)}")
    G, R, I = w.shape
    if x.shape[2] != G or x.shape[3] != I:
        raise ValueError(f"grouped_linear: x {list(x.shape)} does not match w {list(w.shape)} (G = {G}, I = {I})")
    if x.device != w.device:
        raise ValueError(f"grouped_linear: x on {x.device}, w on {w.device}")
    return x.shape[0] * x.shape[1], G, R, I


def grouped_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """z [B, T, G, R] = einsum('btgi,gri->btgr', x.to(w.dtype), w) in one Triton launch (M <= MAX_M token
    rows). x and w any strides (copied once if not contiguous). CPU tensors run under the interpreter."""
    M, G, R, I = _check(x, w)
    if M > MAX_M:
        raise ValueError(f"grouped_linear: {M} token rows exceed the kernel's MAX_M = {MAX_M} (use the op: it "
                         f"runs the einsum above that)")
    xc, wc = x.contiguous(), w.contiguous()
    z = torch.empty((*x.shape[:2], G, R), dtype=w.dtype, device=w.device)
    if M == 0:
        return z
    _grouped_linear_kernel[(G, triton.cdiv(R, BLOCK_R))](
        xc, wc, z, M, G, R, I, BLOCK_M=16, BLOCK_R=BLOCK_R, BLOCK_I=BLOCK_I, F32=w.dtype == torch.float32,
        INTERPRET=xc.device.type == "cpu",
        num_warps=4, **pdl_launch(xc))
    return z


def grouped_linear_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The model's computation (`Attention._output` in dsv4c/model/v4.py): cast, then the einsum."""
    return torch.einsum("btgi,gri->btgr", x.to(w.dtype), w)


@torch.library.custom_op("dsv4c::grouped_linear", mutates_args=())
def grouped_linear_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`grouped_linear` on CUDA tensors of up to MAX_M token rows; else (CPU, or more rows) the reference."""
    M = _check(x, w)[0]
    if x.device.type == "cpu" or M > MAX_M:
        return grouped_linear_ref(x, w)
    return grouped_linear(x, w)


@grouped_linear_op.register_fake
def _grouped_linear_fake(x, w):
    return w.new_empty((*x.shape[:2], w.shape[0], w.shape[1]))
