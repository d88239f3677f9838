"""V4's grouped output projection `z = einsum("btgi,gri->btgr", x, W_oa)` as one Triton launch.

Public API::

    grouped_linear(x, w) -> Tensor        # Triton (decode-sized M), one launch
    grouped_linear_ref(x, w) -> Tensor    # the model's einsum, x cast to w's dtype first
    fp8_grouped_linear(x, w_q, w_s, dtype) -> Tensor      # the same on the stored FP8 block weight (M <= 64)
    fp8_grouped_linear_ref(x, w_q, w_s, dtype) -> Tensor  # the einsum on the weight dequantised to dtype

Custom ops (targets of passes/lower_grouped_linear.py and quantize_dense.py; CPU = the reference)::

    dsv4c::grouped_linear(Tensor x, Tensor w) -> Tensor
    dsv4c::fp8_grouped_linear(Tensor x, Tensor w_q, Tensor w_s, ScalarType dtype) -> Tensor

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

FP8 (the release stores wo_a as e4m3 [G·R, I] with one scale per 128x128 tile, ue8m0 or fp32): w_q keeps
that 2-D layout and w_s its tiles; group g's weight is rows [g·R, (g+1)·R). Program (m-tile, g, r-block)
walks I in 128-column steps (one scale column per step), forms each step's product of x (cast to `dtype`)
and the widened e4m3 values (exact) from zero, scales it per weight row by that row's tile scale and adds
it in fp32: half the bytes of the bf16 weight. With FP8_GEMV_MAX_M = 1 (the default), one token row runs
kernels/fp8_gemv.py's one-token GEMV block-diagonally instead. Up to FP8_MAX_M token rows in 16-row tiles
(the tiles of one weight slice launch side by side); above, the weight is widened once per call
(kernels/fp8_gemm.py `fp8_dequant`, = quant.dequant_fp8_block) for the einsum. Legend as above, with
w_q [G·R, I].
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from dsv4c.kernels._tl import e8m0_value, pdl_launch, pdl_wait
from dsv4c.kernels.fp8_gemv import fp8_gemv_grouped_w8a16

from dsv4c import quant as Q

MAX_M = 16          # token rows up to which the Triton kernel runs (one 16-row dot tile)
BLOCK_R = 32
BLOCK_I = 256
FP8_MAX_M = 64      # token rows up to which fp8_grouped_linear's kernel runs (16-row tiles)
FP8_BLOCK_I = 128   # one scale column per K step
# Up to this many token rows (bf16/fp16 x of the output dtype), fp8_grouped_linear runs the dense FP8 decode
# GEMV block-diagonally (kernels/fp8_gemv.py `fp8_gemv_grouped_w8a16`: CUDA cores, 512-column K steps, a K
# split to fill the SMs) instead of the 16-row tile; 0: the tile always. Off until timed: the tile ran Flash's
# wo_a at about a third of copy bandwidth at batch 1 (run54's timeline: 33 µs for its 33.5 MB), the dense GEMV
# wo_b's equal bytes in about 17 µs. run56 (H100): alone, at one bf16 token, GEMV 16.3 µs vs the tile 16.5 µs; in
# the step it never ran, since the graph's x is fp32 (the attention's output, cast by the op). The GEMV now
# rounds one fp32 row itself: run57 (H100, 2-layer slice, batch 1) put the step on the GPU alone at 0.812 ms
# against 0.848 / 0.837 with the tile. Up to 16 rows the GEMV's tensor-core tile takes fp32 rows too (rounded
# before the MMA); untimed: batch 8's step with 16 here is run59's A/B.
FP8_GEMV_MAX_M = 1
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


@triton.jit
def _fp8_grouped_kernel(x_ptr, w_ptr, ws_ptr, z_ptr, M, G, R, I: tl.constexpr, swsn, BLOCK_M: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr, WS_E8M0: tl.constexpr, F32: tl.constexpr,
                        INTERPRET: tl.constexpr, PDL: tl.constexpr = False):
    """Program (m-tile, g, r-block): z[m, g, r] = sum over 128-column steps of (x[m, g, :] . w_q[g·R + r, :])
    times the step's scale of weight row g·R + r; fp32 accumulation, one rounding to z's dtype."""
    pdl_wait(PDL)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.program_id(1)
    r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    k = tl.arange(0, BLOCK_I)
    rm, mm = r < R, m < M
    ty = z_ptr.dtype.element_ty
    wrow = g.to(tl.int64) * R + r                                  # [BLOCK_R] rows of the stored [G·R, I]
    x_rows = x_ptr + (m[:, None].to(tl.int64) * G + g) * I        # [BLOCK_M, 1]
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for i0 in range(0, I, BLOCK_I):
        km = (i0 + k) < I
        x = tl.load(x_rows + i0 + k[None, :], mask=mm[:, None] & km[None, :], other=0.0).to(ty)
        w = tl.load(w_ptr + wrow[:, None] * I + i0 + k[None, :], mask=rm[:, None] & km[None, :], other=0.0).to(ty)
        sc = tl.load(ws_ptr + (wrow // 128) * swsn + i0 // 128, mask=rm, other=0)
        if WS_E8M0:
            sc = e8m0_value(sc.to(tl.int32))
        if INTERPRET:  # the interpreter's low-precision dot is not exact: multiply the same values in fp32
            p = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
        elif F32:
            p = tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            p = tl.dot(x, tl.trans(w))
        acc += p * sc.to(tl.float32)[None, :]
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


def _check_fp8(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor,
               dtype: torch.dtype) -> tuple[int, int, int, torch.Tensor]:
    """x, dtype and the FP8 weight (kernels/fp8_gemm.py's contract) -> (M, G, R, the scale as the kernel reads
    it: uint8 e8m0 bytes or fp32)."""
    from dsv4c.kernels.fp8_gemm import _check_weight, _scale

    if dtype not in _DTYPES or x.dtype not in _DTYPES:
        raise ValueError(f"fp8_grouped_linear: x and dtype must be float32/bfloat16/float16, got {x.dtype}, {dtype}")
    if x.dim() != 4:
        raise ValueError(f"fp8_grouped_linear: x must be [B, T, G, I], got {list(x.shape)}")
    G, I = x.shape[2], x.shape[3]
    ws = _check_weight(w_q, _scale(w_s), I)
    if G == 0 or w_q.shape[0] % G:
        raise ValueError(f"fp8_grouped_linear: w_q [G·R, I] = {list(w_q.shape)} does not split into x's G = {G} "
                         "groups")
    if x.device != w_q.device or w_s.device != w_q.device:
        raise ValueError(f"fp8_grouped_linear: x on {x.device}, w_q on {w_q.device}, w_s on {w_s.device}")
    return x.shape[0] * x.shape[1], G, w_q.shape[0] // G, ws


def fp8_grouped_linear(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, dtype: torch.dtype,
                       block_m: int = 16) -> torch.Tensor:
    """z [B, T, G, R] (dtype) = einsum('btgi,gri->btgr', x.to(dtype), dequant(w_q, w_s) viewed [G, R, I]) in one
    Triton launch, up to FP8_MAX_M token rows. w_q e4m3 [G·R, I], w_s [ceil(G·R/128), ceil(I/128)] (e8m0,
    its uint8 bytes, or fp32). `block_m` (16, 32 or 64): token rows per tile; each tile reads its weight
    slice (the op uses 16; 64, which reads it once at 64 rows, was no faster: 1.00x, BENCHMARKS.md). Up to
    FP8_GEMV_MAX_M rows with x in dtype (16-bit) or fp32 (rounded to dtype in the kernel, as the tile casts),
    the block-diagonal FP8 GEMV instead (the same products summed in another order: one row on CUDA cores, more
    on its tensor-core tile). CPU tensors run under the interpreter."""
    M, G, R, ws = _check_fp8(x, w_q, w_s, dtype)
    if M > FP8_MAX_M:
        raise ValueError(f"fp8_grouped_linear: {M} token rows exceed the kernel's FP8_MAX_M = {FP8_MAX_M} (use the "
                         f"op: it widens the weight above that)")
    if block_m not in (16, 32, 64):
        raise ValueError(f"fp8_grouped_linear: block_m must be 16, 32 or 64, got {block_m}")
    xc = x.contiguous()
    if (0 < M <= FP8_GEMV_MAX_M and dtype in (torch.bfloat16, torch.float16) and R % 16 == 0
            and x.dtype in (dtype, torch.float32)):
        return fp8_gemv_grouped_w8a16(xc.view(M, -1), w_q, ws, G, dtype).view(*x.shape[:2], G, R)
    z = torch.empty((*x.shape[:2], G, R), dtype=dtype, device=x.device)
    if M == 0:
        return z
    grid = (triton.cdiv(M, block_m), G, triton.cdiv(R, BLOCK_R))  # m-tiles of one weight slice side by side
    _fp8_grouped_kernel[grid](xc, w_q, ws, z, M, G, R, x.shape[3], ws.stride(0), BLOCK_M=block_m, BLOCK_R=BLOCK_R,
                              BLOCK_I=FP8_BLOCK_I, WS_E8M0=ws.dtype == torch.uint8, F32=dtype == torch.float32,
                              INTERPRET=xc.device.type == "cpu", num_warps=4, num_stages=4, **pdl_launch(xc))
    return z


def fp8_grouped_linear_ref(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The function computed: the model's einsum on the weight dequantised (fp32, rounded once to dtype)."""
    from dsv4c.kernels.fp8_gemm import _scale

    _, G, R, _ = _check_fp8(x, w_q, w_s, dtype)
    w = Q.dequant_fp8_block(w_q, _scale(w_s)).to(dtype).view(G, R, -1)
    return grouped_linear_ref(x, w)


@torch.library.custom_op("dsv4c::fp8_grouped_linear", mutates_args=())
def fp8_grouped_linear_op(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`fp8_grouped_linear` on CUDA tensors of up to FP8_MAX_M token rows; above, the weight widened once
    (`fp8_dequant`) and the einsum; CPU tensors run the reference."""
    from dsv4c.kernels.fp8_gemm import _scale, fp8_dequant

    M, G, R, _ = _check_fp8(x, w_q, w_s, dtype)
    if x.device.type == "cpu":
        return fp8_grouped_linear_ref(x, w_q, w_s, dtype)
    if M > FP8_MAX_M:
        return grouped_linear_ref(x, fp8_dequant(w_q, _scale(w_s), dtype).view(G, R, -1))
    return fp8_grouped_linear(x, w_q, w_s, dtype)


@fp8_grouped_linear_op.register_fake
def _fp8_grouped_linear_fake(x, w_q, w_s, dtype):
    return x.new_empty((*x.shape[:2], x.shape[2], w_q.shape[0] // x.shape[2]), dtype=dtype)
