"""Decode MoE with FP4 weight-only experts (MXFP4, NVFP4) on CUDA cores: GEMV kernels.

At decode each expert sees one token or a few, so a tensor-core tile wastes 15 of its 16 rows
and pays the operand conversion for them. Here every weight byte is decoded once, by byte
permutes (PRMT), and multiplied by one activation row with packed fp16 FMAs. The integer pipe
is the limit: Hopper runs 64 integer lanes per SM per clock, so at 75% of 4.2 TB/s a kernel
can spend about 0.16 integer warp-instructions per weight byte; the decode here takes 13 per
packed 4-byte word per lane, 0.10 per byte. See BENCHMARKS.md.

Public API::

    moe_fp4_gemv(x, idx, weight, w13, w13_scale, w13_global, w2, w2_scale, w2_global, group,
                 swiglu_limit, config=None) -> Tensor       # bf16 [T, D]
    moe_fp4_gemv_ref(...same arguments...) -> Tensor         # fp32 [T, D]
    Fp4GemvConfig(block_n13, block_n2, block_k, num_warps)

Same function as `moe_grouped` on `Mxfp4Experts` (group 32, e8m0 scales, no global) or
`Nvfp4Experts` (group 16, e4m3 scales, fp32 global per expert): for each token t and slot j,
y[t] += W2_e (silu(min(W1_e x_t, L)) * clamp(W3_e x_t, -L, L) * w[t, j]), e = idx[t, j].

Kernels (no atomics, no host syncs, grids from shapes only: CUDA-graph safe; past E/4 assignments
one torch.sort launch orders the programs by expert, see Fp4GemvConfig.sort_experts):
  1. `_act_f16_kernel`, grid (T, D / 256): x -> fp16 x * 2^k with 2^-k per 32 columns, k putting
     each 32-column chunk's amax in [1024, 2048) (products and 4-term sums then stay below
     6 * 4 * 2048 < 65504, and small chunks keep their precision);
  2. `_gemv13_kernel`, grid (N_A, I / BLOCK_N13): assignment a = (t, j) multiplies rows n of W1
     and W3 of expert e with x[t]; SwiGLU + clamp + routing weight, then h is stored in the same
     fp16-with-chunk-scales form;
  3. `_gemv2_kernel`, grid (N_A, D / BLOCK_N2): y[a] = W2_e h[a] (bf16);
  4. out[t] = sum_j y[t, j] (kernels/moe_combine.py: one launch, fp32 accumulation).
On sm_90+ the four are chained by programmatic dependent launch (Fp4GemvConfig.pdl): each is
launched while its predecessor runs, the GEMVs request their first weight step before waiting
for it, and the launch gaps and pipeline fill between the kernels overlap (H200, Flash shapes:
34.4 -> 31.5 us at 1 token, BENCHMARKS.md ninth session).

Arithmetic per packed int32 word (8 weights, element j in nibble j, element 2b in byte b's low
nibble, as released): the decoded fp16 pairs (exact) times the activation's fp16 pairs, 4 FMAs
per lane in fp16 (in GEMM 1 the products are exact: 2 significant bits times bf16's 8; h carries
fp16's 11, so in GEMM 2 they round like the sums, to 2^-11 relative), the two lanes summed in
fp32; per scale group the fp32 sum is multiplied by the weight scale (e8m0 or e4m3) times the
activation chunk's 2^-k; NVFP4's global scale at the end. Under the CPU interpreter
(TRITON_INTERPRET=1) the inline PTX is replaced by the same products in fp32, so CPU tests check
the data flow, the scaling and the tiling; GPU tests check the PTX.

Shapes: T tokens, K experts per token, N_A = T*K assignments, D hidden, I expert width,
E experts, G scale group (32 or 16).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from dsv4c.kernels import _tl as U
from dsv4c.kernels.moe_combine import combine_slots

from dsv4c import quant as Q

__all__ = ["Fp4GemvConfig", "moe_fp4_gemv", "moe_fp4_gemv_ref"]


@dataclass(frozen=True)
class Fp4GemvConfig:
    """Tiles of the two GEMV kernels. block_n13: W1/W3 rows per program (each program reads
    2 * block_n13 rows); block_n2: W2 rows per program; block_k: K columns per loop step (a
    multiple of the scale group); sort: order the programs by expert (see sort_experts);
    pdl: launch the four kernels with programmatic dependent launch on sm_90+ (see `_tl.pdl_wait`);
    ignored under the interpreter and on older GPUs."""

    block_n13: int = 32
    block_n2: int = 32
    block_k: int = 512
    num_warps: int = 4
    sort: bool | None = None
    pdl: bool = True

    def sort_experts(self, n_assign: int, n_experts: int) -> bool:
        """Launch the programs in expert order? None: when assignments outnumber E/4, where experts
        repeat (meant for L2 reuse; the H200 sweep saw no measurable gain at 64 Flash tokens,
        BENCHMARKS.md sixth session)."""
        return self.sort if self.sort is not None else 4 * n_assign > n_experts

    def check(self, group: int) -> None:
        for name in ("block_n13", "block_n2", "block_k"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"Fp4GemvConfig.{name}: a power of two, got {v}")
        if self.block_n13 < 32:
            raise ValueError(f"Fp4GemvConfig.block_n13: at least 32 (h is scaled per 32 columns), got {self.block_n13}")
        if self.block_k < group:
            raise ValueError(f"Fp4GemvConfig.block_k: at least the scale group {group}, got {self.block_k}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"Fp4GemvConfig.num_warps: 1, 2, 4, 8 or 16, got {self.num_warps}")


def default_gemv_config(device: torch.device) -> Fp4GemvConfig:
    """Smaller K steps under the CPU interpreter (the test shapes are small)."""
    if device.type == "cpu":
        return Fp4GemvConfig(32, 32, 64, 4)
    return Fp4GemvConfig()


# ---------------------------------------------------------------------------------------------
# device helpers


@triton.jit
def _chunk_scale_f16(v, CHUNKS: tl.constexpr):
    """v fp32 [CHUNKS, 32] -> (fp16 v * 2^k, 2^-k [CHUNKS]) with 2^k per chunk putting the chunk's
    amax in [1024, 2048) (k in [-117, 100]; an all-zero chunk gets k = 100)."""
    amax = tl.max(tl.abs(v), axis=1)                                          # [CHUNKS]
    ex = (amax.to(tl.int32, bitcast=True) >> 23) & 255
    k = tl.minimum(137 - ex, 100)
    return (v * U.exp2i(k)[:, None]).to(tl.float16), U.exp2i(-k)


@triton.jit
def _act_f16_kernel(x_ptr, out_ptr, s_ptr, K, stride_x, stride_o, stride_s, CHUNKS: tl.constexpr,
                    PDL: tl.constexpr):
    """One row's CHUNKS*32 columns: fp16 x * 2^k and 2^-k per 32 columns (see _chunk_scale_f16)."""
    U.pdl_wait(PDL)
    r = tl.program_id(0).to(tl.int64)
    c0 = tl.program_id(1) * CHUNKS
    cols = (c0 + tl.arange(0, CHUNKS))[:, None] * 32 + tl.arange(0, 32)[None, :]   # [CHUNKS, 32]
    ok = cols < K
    v = tl.load(x_ptr + r * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    q, inv = _chunk_scale_f16(v, CHUNKS)
    tl.store(out_ptr + r * stride_o + cols, q, mask=ok)
    ch = c0 + tl.arange(0, CHUNKS)
    tl.store(s_ptr + r * stride_s + ch, inv, mask=ch * 32 < K)


@triton.jit
def _f16_lo(w):
    return (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f16_hi(w):
    return ((w >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


# The PTX of _dot8. $1 = q (8 packed e2m1 codes, element j in nibble j), $2..$5 = activation
# fp16 pairs (x[2m], x[2m+1]), m = 0..3. Decoding without arithmetic: every fp16 value of e2m1
# has a zero low byte, so one PRMT looks up the high bytes of four elements from the 3-bit
# magnitude codes (table 00 38 3C 3E 40 42 44 46: 0, 0.5, 1, 1.5, 2, 3, 4, 6); a sign-replicating
# PRMT turns the four sign bits into byte masks that one LOP3 merges into bit 7 of each byte; a
# PRMT with a zero register spreads two high bytes into an fp16 pair. 13 integer instructions per
# 8 weights, then 4 fp16x2 FMAs: the products are exact for bf16 activations (2 significant bits
# times 8; h's 11-bit fp16 values round), each lane adds 4 of them in fp16, and the two lanes are
# summed in fp32.
_DOT8_PTX = tl.constexpr("""{
.reg .b32 q4, q7, q7h, u0, u1, s0, s1, w0, w1, w2, w3, acc;
.reg .b16 lo, hi;
.reg .f32 flo, fhi;
shl.b32 q4, $1, 4;
and.b32 q7, $1, 0x77777777;
shr.u32 q7h, q7, 16;
prmt.b32 u0, 0x3E3C3800, 0x46444240, q7;
prmt.b32 u1, 0x3E3C3800, 0x46444240, q7h;
prmt.b32 s0, $1, q4, 0x9D8C;
prmt.b32 s1, $1, q4, 0xBFAE;
lop3.b32 u0, u0, s0, 0x80808080, 0xF8;
lop3.b32 u1, u1, s1, 0x80808080, 0xF8;
prmt.b32 w0, u0, 0, 0x1404;
prmt.b32 w1, u0, 0, 0x3424;
prmt.b32 w2, u1, 0, 0x1404;
prmt.b32 w3, u1, 0, 0x3424;
mul.rn.f16x2 acc, w0, $2;
fma.rn.f16x2 acc, w1, $3, acc;
fma.rn.f16x2 acc, w2, $4, acc;
fma.rn.f16x2 acc, w3, $5, acc;
mov.b32 {lo, hi}, acc;
cvt.f32.f16 flo, lo;
cvt.f32.f16 fhi, hi;
add.f32 $0, flo, fhi;
}""")


@triton.jit
def _dot8(q, x0, x1, x2, x3, INTERPRET: tl.constexpr):
    """fp32 sum over the 8 weights of each packed word q (int32) times the activation fp16
    pair words x0..x3 (broadcast against q)."""
    if INTERPRET:
        s = U.e2m1_value((q >> 0) & 15) * _f16_lo(x0) + U.e2m1_value((q >> 4) & 15) * _f16_hi(x0)
        s += U.e2m1_value((q >> 8) & 15) * _f16_lo(x1) + U.e2m1_value((q >> 12) & 15) * _f16_hi(x1)
        s += U.e2m1_value((q >> 16) & 15) * _f16_lo(x2) + U.e2m1_value((q >> 20) & 15) * _f16_hi(x2)
        s += U.e2m1_value((q >> 24) & 15) * _f16_lo(x3) + U.e2m1_value((q >> 28) & 15) * _f16_hi(x3)
        return s
    else:
        return tl.inline_asm_elementwise(_DOT8_PTX, "=r,r,r,r,r,r", [q, x0, x1, x2, x3],
                                         dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _scale_value(sb, GROUP: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 value of scale bytes sb (uint8): e8m0 (GROUP 32) or e4m3 (GROUP 16)."""
    b = sb.to(tl.int32)
    if GROUP == 32:
        return U.e8m0_value(b)
    elif INTERPRET:
        v = U.e4m3_value(b & 127)
        return tl.where(b >= 128, -v, v)      # the sign, as the GPU's e4m3 conversion reads it
    else:
        return sb.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _w_step(w_base, s_base, rows, row_ok, k0, K: tl.constexpr, stride_wn, stride_sn, GROUP: tl.constexpr,
            BLOCK_K: tl.constexpr):
    """The weight words [BN, BLOCK_K/8] and scale bytes [BN, NG] of K step k0 (zero past K).
    Words run along the fast axis, so a warp reads whole contiguous row spans."""
    NG: tl.constexpr = BLOCK_K // GROUP
    kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)                                                # [BKW]
    q = tl.load(w_base + rows[:, None] * stride_wn + kw[None, :], mask=row_ok[:, None] & (kw < K // 8)[None, :],
                other=0)
    ks = k0 // GROUP + tl.arange(0, NG)
    sb = tl.load(s_base + rows[:, None] * stride_sn + ks[None, :], mask=row_ok[:, None] & (ks < K // GROUP)[None, :],
                 other=0)
    return q, sb


@triton.jit
def _gemv_rows(w_base, s_base, rows, row_ok, off2, aw_row, as_row, K: tl.constexpr, stride_wn, stride_sn,
               TWO: tl.constexpr, GROUP: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 [BLOCK_N] (and, with TWO, a second [BLOCK_N] for rows + off2): rows of one expert's
    packed weights times one activation row (aw_row: int32 fp16 pairs; as_row: fp32 2^-k per 32
    columns). The next K step's weights are loaded before this step's arithmetic, so two steps
    of HBM reads are in flight; with TWO both row sets share the activation loads. The first
    step's weights are requested before the PDL wait (they do not depend on the predecessor)."""
    NG: tl.constexpr = BLOCK_K // GROUP
    GW: tl.constexpr = GROUP // 8
    BKW: tl.constexpr = BLOCK_K // 8
    g = tl.arange(0, NG)
    acc = tl.zeros((BLOCK_N, NG), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, NG), dtype=tl.float32)
    q_next, sb_next = _w_step(w_base, s_base, rows, row_ok, 0, K, stride_wn, stride_sn, GROUP, BLOCK_K)
    q2_next, sb2_next = q_next, sb_next
    if TWO:
        q2_next, sb2_next = _w_step(w_base, s_base, rows + off2, row_ok, 0, K, stride_wn, stride_sn, GROUP, BLOCK_K)
    U.pdl_wait(PDL)
    for k0 in range(0, K, BLOCK_K):
        q = q_next
        sb = sb_next
        q2 = q2_next
        sb2 = sb2_next
        q_next, sb_next = _w_step(w_base, s_base, rows, row_ok, k0 + BLOCK_K, K, stride_wn, stride_sn, GROUP,
                                  BLOCK_K)
        if TWO:
            q2_next, sb2_next = _w_step(w_base, s_base, rows + off2, row_ok, k0 + BLOCK_K, K, stride_wn, stride_sn,
                                        GROUP, BLOCK_K)
        kw = k0 // 8 + tl.arange(0, BKW)                                                     # [BKW]
        xv = tl.load(aw_row + kw[:, None] * 4 + tl.arange(0, 4)[None, :], mask=(kw < K // 8)[:, None], other=0)
        xa, xb = tl.split(tl.reshape(xv, (BKW, 2, 2)))       # words m = 0, 2 and m = 1, 3
        x0, x2 = tl.split(xa)
        x1, x3 = tl.split(xb)
        a_s = tl.load(as_row + (k0 + g * GROUP) // 32, mask=k0 + g * GROUP < K, other=0.0)     # [NG]
        p = _dot8(q, x0[None, :], x1[None, :], x2[None, :], x3[None, :], INTERPRET)           # [BN, BKW]
        part = tl.sum(tl.reshape(p, (BLOCK_N, NG, GW)), axis=2)                               # [BN, NG]
        acc += part * (_scale_value(sb, GROUP, INTERPRET) * a_s[None, :])
        if TWO:
            p2 = _dot8(q2, x0[None, :], x1[None, :], x2[None, :], x3[None, :], INTERPRET)
            part2 = tl.sum(tl.reshape(p2, (BLOCK_N, NG, GW)), axis=2)
            acc2 += part2 * (_scale_value(sb2, GROUP, INTERPRET) * a_s[None, :])
    return tl.sum(acc, axis=1), tl.sum(acc2, axis=1)


# ---------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _gemv13_kernel(xw_ptr, xs_ptr, idx_ptr, perm_ptr, rw_ptr, w_ptr, s_ptr, g_ptr, h_ptr, hs_ptr, I, limit,
                   stride_xw, stride_xs, stride_we, stride_wn, stride_se, stride_sn, stride_h, stride_hs,
                   K: tl.constexpr, TOPK: tl.constexpr, GROUP: tl.constexpr, HAS_GLOBAL: tl.constexpr,
                   HAS_LIMIT: tl.constexpr, HAS_PERM: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """h[a, n] for the BLOCK_N rows n of one tile, assignment a = program 0 (or perm[program 0]),
    token a // TOPK: SwiGLU of W1 and W3 rows against x, clamp, routing weight; stored as
    fp16 * 2^k with 2^-k per 32 columns (hs), the operand format of _gemv2_kernel."""
    a = tl.program_id(0)
    if HAS_PERM:
        a = tl.load(perm_ptr + a).to(tl.int32)
    pid_n = tl.program_id(1)
    e = tl.load(idx_ptr + a).to(tl.int64)
    t = (a // TOPK).to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < I
    w_base = w_ptr + e * stride_we
    s_base = s_ptr + e * stride_se
    g, u = _gemv_rows(w_base, s_base, rows, row_ok, I, xw_ptr + t * stride_xw, xs_ptr + t * stride_xs, K,
                      stride_wn, stride_sn, True, GROUP, INTERPRET, PDL, BLOCK_N, BLOCK_K)
    if HAS_GLOBAL:
        gs = tl.load(g_ptr + e)
        g = g * gs
        u = u * gs
    h = U.swiglu(g, u, limit, HAS_LIMIT) * tl.load(rw_ptr + a)
    h = tl.where(row_ok, h, 0.0)
    hq, inv = _chunk_scale_f16(tl.reshape(h, (BLOCK_N // 32, 32)), BLOCK_N // 32)
    a64 = a.to(tl.int64)
    tl.store(h_ptr + a64 * stride_h + tl.reshape(rows, (BLOCK_N // 32, 32)), hq,
             mask=tl.reshape(row_ok, (BLOCK_N // 32, 32)))
    ch = pid_n * (BLOCK_N // 32) + tl.arange(0, BLOCK_N // 32)
    tl.store(hs_ptr + a64 * stride_hs + ch, inv, mask=ch * 32 < I)


@triton.jit
def _gemv2_kernel(hw_ptr, hs_ptr, idx_ptr, perm_ptr, w_ptr, s_ptr, g_ptr, y_ptr, D,
                  stride_hw, stride_hs, stride_we, stride_wn, stride_se, stride_sn, stride_y,
                  K: tl.constexpr, GROUP: tl.constexpr, HAS_GLOBAL: tl.constexpr, HAS_PERM: tl.constexpr,
                  INTERPRET: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[a, n] = W2_e[n] . h[a] for the BLOCK_N rows n of one tile, assignment a = program 0
    (or perm[program 0])."""
    a = tl.program_id(0).to(tl.int64)
    if HAS_PERM:
        a = tl.load(perm_ptr + a)
    pid_n = tl.program_id(1)
    e = tl.load(idx_ptr + a).to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < D
    y, _ = _gemv_rows(w_ptr + e * stride_we, s_ptr + e * stride_se, rows, row_ok, 0, hw_ptr + a * stride_hw,
                      hs_ptr + a * stride_hs, K, stride_wn, stride_sn, False, GROUP, INTERPRET, PDL, BLOCK_N, BLOCK_K)
    if HAS_GLOBAL:
        y = y * tl.load(g_ptr + e)
    tl.store(y_ptr + a * stride_y + rows, y.to(tl.bfloat16), mask=row_ok)


# ---------------------------------------------------------------------------------------------
# host side


def check_gemv_inputs(x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, w13: torch.Tensor,
                      want: dict[str, tuple], e: int, d: int) -> None:
    """The decode GEMVs' common contract (here and kernels/moe_fp8_gemv.py): each `want` field name ->
    (tensor, dtype, shape) contiguous as given; x contiguous bf16 [T, d]; idx int32/int64 [T, K] in [0, e)
    (checked on CPU tensors: a device check would sync); weight fp32 [T, K]; all on one device."""
    for name, (tns, dt, shape) in want.items():
        if not isinstance(tns, torch.Tensor) or tns.dtype != dt or tuple(tns.shape) != shape or not tns.is_contiguous():
            got = f"{tns.dtype} {tuple(tns.shape)}" if isinstance(tns, torch.Tensor) else repr(tns)
            raise ValueError(f"{name}: expected contiguous {dt} {shape}, got {got}")
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != d or not x.is_contiguous():
        raise ValueError(f"x: expected contiguous bf16 [T, {d}], got {x.dtype} {tuple(x.shape)}")
    t = x.shape[0]
    if idx.dim() != 2 or idx.shape[0] != t or idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"idx: expected int32/int64 [{t}, K], got {idx.dtype} {tuple(idx.shape)}")
    if weight.dtype != torch.float32 or tuple(weight.shape) != tuple(idx.shape):
        raise ValueError(f"weight: expected fp32 {tuple(idx.shape)}, got {weight.dtype} {tuple(weight.shape)}")
    devs = {v.device for v in (x, idx, weight, w13, *(tns for tns, _, _ in want.values()))}
    if len(devs) != 1:
        raise ValueError(f"x/idx/weight/w13/w2 and their scales: all on one device, got {sorted(map(str, devs))}")
    if x.device.type == "cpu" and idx.numel():
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= e:
            raise ValueError(f"idx: expert ids must be in [0, {e}), got {lo}..{hi}")


def _check(x, idx, weight, w13, w13_scale, w13_global, w2, w2_scale, w2_global, group) -> tuple[int, int, int]:
    if group not in (16, 32):
        raise ValueError(f"group: 32 (MXFP4) or 16 (NVFP4), got {group}")
    if w13.dtype != torch.uint8 or w13.dim() != 3 or not w13.is_contiguous():
        raise ValueError(f"w13: expected contiguous uint8 [E, 2I, D/2], got {w13.dtype} {tuple(w13.shape)}")
    e, i2, d2 = w13.shape
    i, d = i2 // 2, d2 * 2
    if i2 % 2 or i == 0 or d == 0:
        raise ValueError(f"w13: expected [E, 2I, D/2] with I, D > 0 (w1 rows, then w3), got {tuple(w13.shape)}")
    if i % group or d % group:
        raise ValueError(f"w13: I = {i} and D = {d} must be multiples of the group {group}")
    sdt = torch.float8_e8m0fnu if group == 32 else torch.float8_e4m3fn
    want = {"w13_scale": (w13_scale, sdt, (e, i2, d // group)), "w2": (w2, torch.uint8, (e, d, i // 2)),
            "w2_scale": (w2_scale, sdt, (e, d, i // group))}
    if group == 16:
        want["w13_global"] = (w13_global, torch.float32, (e,))
        want["w2_global"] = (w2_global, torch.float32, (e,))
    check_gemv_inputs(x, idx, weight, w13, want, e, d)
    return e, i, d


def moe_fp4_gemv(x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, w13: torch.Tensor,
                 w13_scale: torch.Tensor, w13_global: torch.Tensor | None, w2: torch.Tensor,
                 w2_scale: torch.Tensor, w2_global: torch.Tensor | None, group: int, swiglu_limit: float,
                 config: Fp4GemvConfig | None = None) -> torch.Tensor:
    """Routed experts in MXFP4 (group 32, e8m0 scales, globals None) or NVFP4 (group 16, e4m3
    scales, fp32 globals [E]) weight-only, as two CUDA-core GEMV kernels.

    x bf16 [T, D] contiguous; idx int [T, K] in [0, E); weight fp32 [T, K]; w13 uint8 [E, 2I, D/2]
    (w1 rows, then w3); w2 uint8 [E, D, I/2]; swiglu_limit L (<= 0: no clamp) -> bf16 [T, D].
    Reads every assigned expert once per assignment (the programs are at most ordered by expert,
    see Fp4GemvConfig.sort): meant for decode, where few assignments share an expert. CPU
    tensors run under the Triton interpreter."""
    e, i, d = _check(x, idx, weight, w13, w13_scale, w13_global, w2, w2_scale, w2_global, group)
    cfg = config or default_gemv_config(x.device)
    cfg.check(group)
    t, topk = idx.shape
    out = torch.empty_like(x)
    if t == 0:
        return out
    dev = x.device
    interp = dev.type == "cpu"
    has_global = group == 16
    n_a = t * topk
    g13 = w13_global if has_global else weight
    g2 = w2_global if has_global else weight
    s13 = w13_scale.view(torch.uint8)
    s2 = w2_scale.view(torch.uint8)
    idx_flat = idx.reshape(-1)
    wflat = weight.reshape(-1).contiguous()
    w13w = w13.view(torch.int32)    # 8 packed weights per word
    w2w = w2.view(torch.int32)
    # Programs in expert order when experts repeat: consecutive programs then read the same expert
    # tile, and all but the first find it in L2 (one sort launch; none at 1 and 8 Flash tokens).
    perm = torch.sort(idx_flat, stable=True).indices if cfg.sort_experts(n_a, e) else None
    permp = idx_flat if perm is None else perm
    # activations as fp16 * 2^k with 2^-k per 32 columns; words are fp16 pairs
    xh = torch.empty(t, d, dtype=torch.float16, device=dev)
    xs = torch.empty(t, triton.cdiv(d, 32), dtype=torch.float32, device=dev)
    pdl = cfg.pdl and U.pdl_supported(dev)
    launch = {"launch_pdl": True} if pdl else {}
    _act_f16_kernel[(t, triton.cdiv(d, 32 * 8))](x, xh, xs, d, x.stride(0), xh.stride(0), xs.stride(0), CHUNKS=8,
                                                 PDL=pdl, **launch)
    h = torch.empty(n_a, i, dtype=torch.float16, device=dev)
    hs = torch.empty(n_a, triton.cdiv(i, 32), dtype=torch.float32, device=dev)
    xw, hw = xh.view(torch.int32), h.view(torch.int32)
    _gemv13_kernel[(n_a, triton.cdiv(i, cfg.block_n13))](
        xw, xs, idx_flat, permp, wflat, w13w, s13, g13, h, hs, i, float(swiglu_limit),
        xw.stride(0), xs.stride(0), w13w.stride(0), w13w.stride(1), s13.stride(0), s13.stride(1), h.stride(0),
        hs.stride(0), K=d, TOPK=topk, GROUP=group, HAS_GLOBAL=has_global, HAS_LIMIT=swiglu_limit > 0,
        HAS_PERM=perm is not None, INTERPRET=interp, PDL=pdl, BLOCK_N=cfg.block_n13, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, **launch)
    y = torch.empty(n_a, d, dtype=torch.bfloat16, device=dev)
    _gemv2_kernel[(n_a, triton.cdiv(d, cfg.block_n2))](
        hw, hs, idx_flat, permp, w2w, s2, g2, y, d,
        hw.stride(0), hs.stride(0), w2w.stride(0), w2w.stride(1), s2.stride(0), s2.stride(1), y.stride(0),
        K=i, GROUP=group, HAS_GLOBAL=has_global, HAS_PERM=perm is not None, INTERPRET=interp, PDL=pdl,
        BLOCK_N=cfg.block_n2, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, **launch)
    return combine_slots(y, None, topk, out, pdl=pdl)      # fp32 accumulation, one rounding to bf16


def moe_fp4_gemv_ref(x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, w13: torch.Tensor,
                     w13_scale: torch.Tensor, w13_global: torch.Tensor | None, w2: torch.Tensor,
                     w2_scale: torch.Tensor, w2_global: torch.Tensor | None, group: int,
                     swiglu_limit: float) -> torch.Tensor:
    """fp32 reference of `moe_fp4_gemv` [T, D]: dequantised weights, fp32 math throughout,
    routing weight before w2."""
    _, i, _ = _check(x, idx, weight, w13, w13_scale, w13_global, w2, w2_scale, w2_global, group)
    if group == 32:
        w13f, w2f = Q.dequant_mxfp4(w13, w13_scale), Q.dequant_mxfp4(w2, w2_scale)
    else:
        w13f, w2f = Q.dequant_nvfp4(w13, w13_scale, w13_global), Q.dequant_nvfp4(w2, w2_scale, w2_global)
    t, topk = idx.shape
    flat = idx.reshape(-1).long()
    xa = x.float().repeat_interleave(topk, 0)                                         # [N_A, D]
    gu = torch.einsum("nd,nid->ni", xa, w13f[flat])                                   # [N_A, 2I]
    g, u = gu[:, :i], gu[:, i:]
    if swiglu_limit > 0:
        g = g.clamp(max=swiglu_limit)
        u = u.clamp(-swiglu_limit, swiglu_limit)
    h = torch.nn.functional.silu(g) * u * weight.reshape(-1, 1)
    y = torch.einsum("ni,ndi->nd", h, w2f[flat])                                      # [N_A, D]
    return y.view(t, topk, -1).sum(1)
