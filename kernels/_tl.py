"""Shared Triton device helpers: element-format encode/decode by bit arithmetic and a matmul
step that is correct under the Triton interpreter.

Encoders are written with integer ops (not `.to(tl.float8e4nv)`) so that the CPU interpreter and
the GPU round identically: round to nearest, ties to even, after an explicit clamp
(quant_formats.md §1). The interpreter's own fp8 cast rounds ties away and wraps on overflow,
and its `tl.dot` multiplies bf16 operands as raw uint16 bits, hence `mma` with INTERPRET.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


def interpret_flag(t: torch.Tensor) -> bool:
    """True when kernels on `t` run under the Triton interpreter (CPU tensors)."""
    return t.device.type == "cpu"


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch (Triton's `launch_pdl`, `gdc_wait`) needs a GPU of sm_90+."""
    return device.type == "cuda" and _sm90(torch.cuda.current_device() if device.index is None else device.index)


@functools.lru_cache(maxsize=None)
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


_PDL_ON = {"PDL": True, "launch_pdl": True}
_PDL_OFF = {"PDL": False}


def pdl_launch(t: torch.Tensor) -> dict:
    """Launch keywords for a kernel whose first statement is `pdl_wait(PDL)`, run on t's device: on a
    GPU of sm_90+ it is launched with programmatic dependent launch (PDL=True, launch_pdl=True), so it
    starts while its predecessor drains and waits there; elsewhere PDL=False. Every dsv4c kernel of a
    decode step takes it, so the step is one PDL chain wherever two of them follow each other (after a
    cuBLAS or ATen kernel, which never signals early, one starts as that kernel ends)."""
    return _PDL_ON if pdl_supported(t.device) else _PDL_OFF


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Programmatic dependent launch (sm_90+). With PDL each kernel of a chain is launched while
    its predecessor still runs, and may read what is fixed before the chain started (the expert
    weights, idx and perm: written before the predecessor's own wait returned) but nothing the
    predecessor writes until this wait returns (the predecessor has then finished and its
    writes are visible). Only after its own wait does a kernel let its successor launch, so the
    successor's early reads never race a kernel further back. Kernels that call this first, before
    any load or store (all but the FP4 GEMV's, which request weights before it), need nothing else:
    they are ordered exactly as without PDL and only their launch overlaps. Without a programmatic
    dependency (PDL False, or launched without `launch_pdl`) the wait returns at once."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


# Split-K tile counters (`split_counters`, `last_split`): every split launch adds SPLIT_TICKS to each of its
# tiles' counters (SPLIT_TICKS / SPLIT per program), so a counter is a multiple of SPLIT_TICKS between launches
# and is never zeroed again: no memset per call, which would also break a step's PDL chain (an ATen kernel).
SPLIT_TICKS = 64
_COUNTERS: dict[tuple[torch.device, bool], torch.Tensor] = {}  # (device, on its side stream) -> counters
_RETIRED: list[torch.Tensor] = []
_MIN_COUNTERS = 1 << 16


def split_counters(device: torch.device, n: int, split: int) -> torch.Tensor:
    """int32 [n] tile counters of a split launch of `split` programs per tile on `device` (see `last_split`),
    from one zeroed buffer per device (and one more for the device's `side_stream`) that lives as long as the
    process. Launches that share a buffer run one after another (one stream, or streams the caller orders:
    any stream but the side stream counts on the first): a launch's counters are back to a multiple of
    SPLIT_TICKS when it ends. The buffer is made before a CUDA graph captures a launch (the kernels' eager
    warm-up call does it), never during capture."""
    if split < 1 or split > SPLIT_TICKS or split & (split - 1):
        raise ValueError(f"split_counters: split must be a power of two in [1, {SPLIT_TICKS}], got {split}")
    key = (device, _on_side_stream(device))
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"split_counters: {n} counters on {device} first asked for during CUDA graph "
                               "capture; run the launch once eagerly before capturing it")
        if buf is not None:  # graphs captured with the old buffer still count on it: never freed
            _RETIRED.append(buf)
        buf = torch.zeros(max(n, _MIN_COUNTERS), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf[:n]


@functools.lru_cache(maxsize=None)
def _side_stream(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(torch.device("cuda", index))


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The device's one side stream, on which passes/overlap_shared_experts.py runs the shared experts beside
    the routed ones. Split launches on it count on their own counters (`split_counters`), so they may run
    concurrently with split launches on any other stream."""
    return _side_stream(torch.cuda.current_device() if device.index is None else device.index)


def _on_side_stream(device: torch.device) -> bool:
    if device.type != "cuda" or _side_stream.cache_info().currsize == 0:
        return False
    return torch.cuda.current_stream(device) == side_stream(device)


@triton.jit
def last_split(cnt_ptr, SPLIT: tl.constexpr):
    """Count this program's arrival at its tile's counter (`split_counters`): True for the tile's last of
    SPLIT programs. acq_rel: the partials the others stored before arriving are visible to the last."""
    TICKS: tl.constexpr = 64  # SPLIT_TICKS
    old = tl.atomic_add(cnt_ptr, TICKS // SPLIT, sem="acq_rel", scope="gpu")
    return (old & (TICKS - 1)) == TICKS - TICKS // SPLIT


@triton.jit
def store_split(acc, y_ptrs, part_ptrs, part_stride, ok, cnt_ptr, pid_s, SPLIT: tl.constexpr):
    """A split-K tile's end: with SPLIT 1 store acc at y_ptrs; otherwise store it as partial pid_s (part_ptrs +
    pid_s·part_stride), and the tile's last program (`last_split` on cnt_ptr) sums the SPLIT partials in split
    order and stores that: the result does not depend on which program finished last. ok masks every access."""
    if SPLIT == 1:
        tl.store(y_ptrs, acc.to(y_ptrs.dtype.element_ty), mask=ok)
    else:
        tl.store(part_ptrs + pid_s * part_stride, acc, mask=ok)
        tl.debug_barrier()
        if last_split(cnt_ptr, SPLIT):
            tot = tl.zeros_like(acc)
            for s in tl.static_range(SPLIT):
                tot += tl.load(part_ptrs + s * part_stride, mask=ok, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, tot.to(y_ptrs.dtype.element_ty), mask=ok)


def sm_count(device: torch.device) -> int:
    """The device's SM count (8 for CPU tensors: the interpreter's stand-in for grid sizing)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


@triton.jit
def mma(a, b_nk, acc, INTERPRET: tl.constexpr):
    """acc + a [M, K] @ b_nk[N, K]^T in fp32 (tensor cores on GPU)."""
    if INTERPRET:
        return acc + tl.dot(a.to(tl.float32), tl.trans(b_nk.to(tl.float32)))
    else:
        return tl.dot(a, tl.trans(b_nk), acc)


def rne_bf16(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """`round_to`'s RNE_BF16 for kernels on `t` rounding to `dtype`: bf16 under the interpreter."""
    return interpret_flag(t) and dtype == torch.bfloat16


@triton.jit
def round_to(x, ty: tl.constexpr, RNE_BF16: tl.constexpr):
    """fp32 x rounded to `ty`, returned as fp32 (exact in ty). Under the interpreter (RNE_BF16) bf16 is
    rounded to nearest-even on the bits (its own cast truncates); NaN stays NaN. On CUDA the cast rounds."""
    if RNE_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        r = (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).to(tl.float32, bitcast=True)
        return tl.where((bits & 0x7FFFFFFF) > 0x7F800000, x, r)  # NaN
    else:
        return x.to(ty).to(tl.float32)


@triton.jit
def exp2i(k):
    """fp32 2^k for int32 k in [-126, 127], from the bits."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def ceil_pow2(s):
    """2^ceil(log2 s) for normal fp32 s > 0 (ue8m0 scale rule, §1)."""
    bits = s.to(tl.int32, bitcast=True)
    k = ((bits >> 23) & 255) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return exp2i(k)


@triton.jit
def e4m3_bits(x):
    """e4m3fn byte (int32 0..255) of fp32 x: clamp to +-448, round to nearest even."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.abs(x)
    # subnormal range (|x| < 2^-6): step 2^-9, rounded with the 2^23 magic number
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    ab = a.to(tl.int32, bitcast=True)
    nrm = ((ab + 0x7FFFF + ((ab >> 20) & 1)) >> 20) - (120 << 3)
    return tl.where(a < 0.015625, sub, nrm) | sign


@triton.jit
def e4m3_value(b):
    """fp32 value of a non-negative e4m3 byte b (int32), as for NVFP4 block scales."""
    e = (b >> 3) & 15
    m = b & 7
    normal = ((e + 120) << 23 | (m << 20)).to(tl.float32, bitcast=True)
    return tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)


@triton.jit
def e8m0_value(b):
    """fp32 2^(b-127) of a ue8m0 byte b (int32; 0 gives 2^-127)."""
    return tl.where(b == 0, 0x400000, b << 23).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_value(c):
    """fp32 value of e2m1 codes c (int32 0..15)."""
    e = (c >> 1) & 3
    m = c & 1
    mag = tl.where(e == 0, m * (126 << 23), ((e + 126) << 23) | (m << 22))
    return (mag | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_code(x):
    """e2m1 code (int32 0..15) of fp32 x: clamp to +-6, §1 threshold table (ties to even)."""
    a = tl.minimum(tl.abs(x), 6.0)
    c = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
         + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
         + (a > 5.0).to(tl.int32))
    return c | ((x.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def unpack_fp4(p, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Packed bytes p [ROWS, COLS/2] (int32) -> codes [ROWS, COLS]; element 2j is the low nibble."""
    return tl.reshape(tl.join(p & 15, (p >> 4) & 15), (ROWS, COLS))


@triton.jit
def scale_blocks(v, s, ROWS: tl.constexpr, COLS: tl.constexpr, GROUP: tl.constexpr):
    """v [ROWS, COLS] * s [ROWS, COLS/GROUP] broadcast over groups of GROUP columns."""
    v3 = tl.reshape(v, (ROWS, COLS // GROUP, GROUP))
    return tl.reshape(v3 * s[:, :, None], (ROWS, COLS))


@triton.jit
def e2m1_lo_f16(p):
    """Low-nibble e2m1 codes of packed bytes p (int32) as fp16 equal to fp4 * 2^-14: the code's
    EEM bits become fp16's lowest exponent bits and top mantissa bit, so code 1 (0.5) lands on
    the fp16 subnormal 2^-15 exactly; the sign goes to bit 15. No select, no fp arithmetic."""
    return (((p & 7) << 9) | ((p & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def e2m1_hi_f16(p):
    """High-nibble codes of p as fp16 fp4 * 2^-14 (see e2m1_lo_f16)."""
    return (((p & 0x70) << 5) | ((p & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def swiglu(g, u, limit, HAS_LIMIT: tl.constexpr):
    """silu(min(g, L)) * clamp(u, -L, L) in fp32 (no clamp without HAS_LIMIT): the experts'
    activation (deepseek_v4.md §4.2), before the routing weight."""
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    return g * tl.sigmoid(g) * u


@triton.jit
def quant_rows_e4m3(h):
    """Per-row e4m3 quantisation of fp32 h [M, N] with a ue8m0 scale per row (N = 128: FP8
    block activations): (e4m3 bytes int32 [M, N], scale fp32 [M])."""
    s = ceil_pow2(tl.maximum(tl.max(tl.abs(h), axis=1), 1e-4) / 448.0)
    return e4m3_bits(h / s[:, None]), s


@triton.jit
def block_rows(pid_m, ids_ptr, N_ASSIGN, BLOCK_M: tl.constexpr):
    """Padded rows of M-block pid_m of a sorted routing (route_prep): (rows, assignment ids,
    valid = not padding)."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(ids_ptr + rows)
    return rows, ids, ids < N_ASSIGN


@triton.jit
def a_rows(ids, rows, valid, TOPK, GATHER: tl.constexpr):
    """int64 activation rows: the token of each assignment (GATHER: x[ids // TOPK]), else the row."""
    if GATHER:
        return tl.where(valid, ids // TOPK, 0).to(tl.int64)
    else:
        return rows.to(tl.int64)


@triton.jit
def exp_f32(y):
    """e^y in fp32 to a few ulp (Cody-Waite reduction, Taylor to r^7; tl.exp is the approximate ex2 on
    CUDA and does not match the interpreter); +inf above ~88.72, 0 below ~-103.9 (the fp32 range)."""
    y = tl.minimum(tl.maximum(y, -110.0), 89.0)
    n = tl.floor(y * 1.4426950408889634 + 0.5)  # round(y / ln2), in [-159, 128]
    # ln2 = 0.693145751953125 (16 significant bits: n times it is exact) + 1.4286067653e-06
    r = (y - n * 0.693145751953125) - n * 1.4286067653e-06  # |r| <= ln2/2
    p = 1.0 / 5040.0
    p = p * r + 1.0 / 720.0
    p = p * r + 1.0 / 120.0
    p = p * r + 1.0 / 24.0
    p = p * r + 1.0 / 6.0
    p = p * r + 0.5
    p = p * r + 1.0
    p = p * r + 1.0
    ni = n.to(tl.int32)
    n1 = ni >> 1  # 2^n as two normal factors: subnormal results round once, 2^128 overflows to inf
    n2 = ni - n1
    s1 = ((n1 + 127) << 23).to(tl.float32, bitcast=True)
    s2 = ((n2 + 127) << 23).to(tl.float32, bitcast=True)
    return p * s1 * s2
