"""Element and weight quantisation formats of the DeepSeek checkpoints (quant_formats.md §1-4, §7).

Reference implementations in plain PyTorch, vectorised, for CPU and CUDA:

* element formats (§1): e4m3fn (`to_e4m3`), ue8m0 (`ceil_pow2`, `e8m0_to_float`,
  `float_to_e8m0`), e2m1 (`e2m1_encode`, `e2m1_decode`);
* FP8 128x128 block weights (§2): `quant_fp8_block`, `dequant_fp8_block`;
* dynamic activation quantisation and GEMM semantics (§3): `quant_act_fp8`, `dequant_act`,
  `fp8_block_gemm_ref`, `mxfp4_fp8_gemm_ref`, and the V4 `official_sim` helpers
  `sim_fp8_blocks`, `sim_fp4_blocks`;
* MXFP4 weights (§4): `pack_fp4`, `unpack_fp4`, `quant_mxfp4`, `dequant_mxfp4`;
* NVFP4 (§5): `quant_nvfp4`, `dequant_nvfp4` (weights, one global scale per leading index),
  `quant_act_nvfp4`, `dequant_act_nvfp4` (activations with a given global input scale);
* conversions (§6), each taking the tensor's `name` for its errors: `mxfp4_to_nvfp4`,
  `mxfp4_to_nvfp4_w13` (w1 and w3 sharing one global scale), `mxfp4_to_fp8_block`,
  `bf16_to_fp8_block`, `bf16_to_nvfp4`.

ue8m0 scales are computed from the fp32 bits, never with a dtype cast: torch's cast to
float8_e8m0fnu rounds (3.0 becomes 4, 2.1 becomes 2), the formats need the ceiling.
Encoders clamp to the format's maximum before rounding (§1 "Rule") and never rely on a
library's overflow behaviour. Public functions check their inputs and raise ValueError naming
the argument and the shapes involved.

Shape legend:
  O out features, I in features (a weight is [O, I]); M tokens, N output features and K the
  reduction dim of a GEMM (activation [M, K], weight [N, K]); B block size along a dim;
  Kb = K/B blocks; To = ceil(O/B), Ti = ceil(I/B) tiles; "..." any leading dims.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "E4M3_MAX", "E2M1_MAX", "FP8_BLOCK", "MXFP4_BLOCK", "ACT_AMAX_FLOOR",
    "ceil_pow2_exponent", "ceil_pow2", "e8m0_to_float", "float_to_e8m0", "to_e4m3",
    "e2m1_encode", "e2m1_decode", "pack_fp4", "unpack_fp4", "dequant_mxfp4", "quant_mxfp4",
    "dequant_fp8_block", "quant_fp8_block", "quant_act_fp8", "dequant_act",
    "fp8_block_gemm_ref", "mxfp4_fp8_gemm_ref", "sim_fp8_blocks", "sim_fp4_blocks",
    "NVFP4_BLOCK", "quant_nvfp4", "dequant_nvfp4", "quant_act_nvfp4", "dequant_act_nvfp4",
    "mxfp4_to_nvfp4", "mxfp4_to_nvfp4_w13", "mxfp4_to_fp8_block", "bf16_to_fp8_block", "bf16_to_nvfp4",
]

E4M3_MAX = 448.0          # largest finite e4m3fn, byte 0x7E
E2M1_MAX = 6.0            # largest e2m1 magnitude, code 7
FP8_BLOCK = 128           # FP8 weight tile side and activation block (§2, §3)
MXFP4_BLOCK = 32          # input columns per MXFP4 scale (§4)
NVFP4_BLOCK = 16          # input columns per NVFP4 block scale (§5)
ACT_AMAX_FLOOR = 1e-4     # activation amax floor (§3)
E8M0_BIAS = 127
E8M0_NAN = 255

_FP32_MANT_BITS = 23
_FP32_MANT_MASK = (1 << _FP32_MANT_BITS) - 1
_FP32_EXP_MASK = 0xFF
_FP32_TINY = torch.finfo(torch.float32).tiny      # 2^-126, smallest normal fp32
_SUBNORMAL_SHIFT = 64                             # 2^64 lifts every fp32 subnormal to a normal
_FP32_POW2_M127_BITS = 1 << 22                    # bits of 2^-127 (an fp32 subnormal)

# e2m1 magnitudes by code & 7; code c is negative if c & 8 (code 8 is -0).
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_VALUES = _E2M1_MAGNITUDES + tuple(-m for m in _E2M1_MAGNITUDES)
# Rounding steps on |x| (§1 threshold table): (threshold, a tie goes up). The magnitude index is
# the number of steps passed. Ties go to the even code: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, ...
_E2M1_STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True),
               (2.5, False), (3.5, True), (5.0, False))

_FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_FP8_SCALE_DTYPES = (torch.float8_e8m0fnu, torch.float32)
_E8M0_DTYPES = (torch.float8_e8m0fnu, torch.uint8)
_PACKED_DTYPES = (torch.int8, torch.uint8)
_SCALE_FORMATS = ("ue8m0", "fp32")


# ---------------------------------------------------------------------------------------------
# input checks


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _require_tensor(name: str, t: object) -> None:
    if not isinstance(t, Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")


def _require_dtype(name: str, t: Tensor, dtypes: Sequence[torch.dtype]) -> None:
    _require_tensor(name, t)
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name}: dtype must be one of ({allowed}), got {t.dtype} (shape {_shape(t)})")


def _require_ndim(name: str, t: Tensor, ndim: int, exact: bool = False) -> None:
    if (t.dim() != ndim) if exact else (t.dim() < ndim):
        want = f"exactly {ndim}" if exact else f"at least {ndim}"
        raise ValueError(f"{name}: expected {want} dims, got shape {_shape(t)}")


def _require_block(name: str, block: int) -> None:
    if not isinstance(block, int) or block <= 0:
        raise ValueError(f"{name}: block must be a positive int, got {block!r}")


def _require_multiple(name: str, t: Tensor, block: int, what: str = "last dim") -> None:
    if t.shape[-1] % block != 0:
        raise ValueError(f"{name}: {what} {t.shape[-1]} of shape {_shape(t)} must be a multiple of {block}")


def _require_shape(name: str, t: Tensor, expected: Sequence[int], context: str) -> None:
    if _shape(t) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)} ({context}), got {_shape(t)}")


def _require_finite(name: str, t: Tensor) -> None:
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name}: all values must be finite (shape {_shape(t)})")


def _require_codes(name: str, codes: Tensor) -> None:
    _require_dtype(name, codes, (torch.uint8,))
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"{name}: e2m1 codes must be in 0..15, got max {int(codes.max())} (shape {_shape(codes)})")


# ---------------------------------------------------------------------------------------------
# powers of two and ue8m0


def ceil_pow2_exponent(x: Tensor) -> Tensor:
    """int32 k with 2^k = ceil_pow2(x) = 2^ceil(log2 x), from the fp32 bits (§1 "ue8m0 scales").

    k = exponent - 127 + (mantissa != 0). Defined for finite x > 0 only: fp32 subnormals are
    first scaled by 2^64 (exactly) so they are handled too; for x <= 0, NaN or inf the result is
    meaningless, so callers floor x first (e.g. amax clamped, or 1 for all-zero blocks).
    Other float dtypes are converted to fp32 first (exact for bf16 and fp16). Same shape as x.
    """
    x = x.to(torch.float32)
    sub = x.abs() < _FP32_TINY
    bits = torch.where(sub, x * 2.0 ** _SUBNORMAL_SHIFT, x).view(torch.int32)
    exponent = (bits >> _FP32_MANT_BITS) & _FP32_EXP_MASK
    inexact = ((bits & _FP32_MANT_MASK) != 0).to(torch.int32)
    return exponent - E8M0_BIAS + inexact - _SUBNORMAL_SHIFT * sub.to(torch.int32)


def _exp2i(k: Tensor) -> Tensor:
    """Exact fp32 2^k for an integer tensor k, built from bits: subnormals down to 2^-149,
    k > 127 gives inf, k < -149 gives 0. Same shape as k."""
    k = k.to(torch.int32)
    normal = (k.clamp(-126, 128) + E8M0_BIAS) << _FP32_MANT_BITS   # k = 128 gives the bits of inf
    subnormal = torch.ones_like(k) << (k.clamp(-149, -127) + 149)
    bits = torch.where(k >= -126, normal, torch.where(k >= -149, subnormal, torch.zeros_like(k)))
    return bits.view(torch.float32)


def ceil_pow2(x: Tensor) -> Tensor:
    """fp32 2^ceil(log2 x), exact; x > 0 finite, as in `ceil_pow2_exponent`. Same shape as x."""
    return _exp2i(ceil_pow2_exponent(x))


def _e8m0_bytes(name: str, t: Tensor) -> Tensor:
    """The raw ue8m0 bytes (uint8, same shape) of a float8_e8m0fnu or uint8 tensor."""
    _require_dtype(name, t, _E8M0_DTYPES)
    return t.view(torch.uint8)


def e8m0_to_float(t: Tensor) -> Tensor:
    """Decode ue8m0 (float8_e8m0fnu, or its uint8 bytes) to fp32: 2^(b-127), NaN for b = 255.
    Byte 0 gives 2^-127, an fp32 subnormal. Same shape as t."""
    b = _e8m0_bytes("t", t).to(torch.int32)
    return torch.where(b == E8M0_NAN, torch.nan, _exp2i(b - E8M0_BIAS))


def float_to_e8m0(x: Tensor) -> Tensor:
    """Encode exact powers of two in [2^-127, 2^127] as float8_e8m0fnu (same shape).

    Reads the fp32 bits, so it never rounds; any other value (3.0, 0, negative, NaN, inf,
    out of range) raises ValueError. Use `ceil_pow2` first to produce a scale.
    """
    _require_dtype("x", x, _FLOAT_INPUTS)
    bits = x.to(torch.float32).view(torch.int32)
    exponent = (bits >> _FP32_MANT_BITS) & _FP32_EXP_MASK
    normal_pow2 = (bits > 0) & ((bits & _FP32_MANT_MASK) == 0) & (exponent != _FP32_EXP_MASK)
    min_pow2 = bits == _FP32_POW2_M127_BITS
    ok = normal_pow2 | min_pow2
    if not bool(ok.all()):
        bad = x[~ok].flatten()[:4].tolist()
        raise ValueError(f"x: values must be exact powers of two in [2^-127, 2^127], got {bad} (shape {_shape(x)})")
    byte = torch.where(min_pow2, torch.zeros_like(exponent), exponent)
    return byte.to(torch.uint8).view(torch.float8_e8m0fnu)


def _e8m0_from_exponent(k: Tensor) -> Tensor:
    """float8_e8m0fnu for int exponents k in [-127, 127] (same shape)."""
    return (k + E8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu)


def _scale_to_float(name: str, s: Tensor, dtypes: Sequence[torch.dtype] = _FP8_SCALE_DTYPES) -> Tensor:
    """fp32 values of a scale tensor stored as float8_e8m0fnu (or uint8 bytes) or fp32."""
    _require_dtype(name, s, dtypes)
    return s if s.dtype == torch.float32 else e8m0_to_float(s)


# ---------------------------------------------------------------------------------------------
# e4m3 and e2m1


def div_const(t: Tensor, c: float) -> Tensor:
    """t / c, correctly rounded on every device. CUDA kernels turn a division by a Python scalar
    into a multiplication by its reciprocal, which differs from the quotient in about one fp32
    result in four (c = 2688); a conversion on the GPU would then write other scales than on the
    CPU. Dividing by a tensor of c keeps IEEE division on both."""
    return t / torch.full_like(t, c)


def to_e4m3(x: Tensor) -> Tensor:
    """float8_e4m3fn of x (same shape): clamp to +-448, then round to nearest, ties to even.
    x is first converted to fp32 (a float64 input is thus rounded twice). NaN stays NaN."""
    _require_dtype("x", x, _FLOAT_INPUTS)
    return x.to(torch.float32).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e2m1_encode(x: Tensor) -> Tensor:
    """e2m1 codes (uint8 0..15, same shape) of x: clamp to +-6, then the §1 threshold table
    (round to nearest, ties to the even code). The sign bit follows x's sign bit, so -0.0 and
    small negatives give code 8 (-0). NaN gives +-0 (e2m1 has no NaN)."""
    _require_dtype("x", x, _FLOAT_INPUTS)
    x = x.to(torch.float32)
    mag = x.abs().clamp(max=E2M1_MAX)
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for threshold, tie_up in _E2M1_STEPS:   # 7 fixed steps; vectorised over the elements
        code += (mag >= threshold) if tie_up else (mag > threshold)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def _e2m1_values(codes: Tensor) -> Tensor:
    """fp32 values of uint8 codes 0..15 (unchecked). Same shape."""
    table = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def e2m1_decode(codes: Tensor) -> Tensor:
    """fp32 values (same shape) of e2m1 codes (uint8 0..15); code 8 decodes to -0.0."""
    _require_codes("codes", codes)
    return _e2m1_values(codes)


def _pack(codes: Tensor) -> Tensor:
    """uint8 [..., K] codes -> uint8 [..., K/2]: element 2j low nibble, 2j+1 high nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack(packed: Tensor) -> Tensor:
    """uint8/int8 [..., K/2] -> uint8 codes [..., K] (inverse of `_pack`)."""
    p = packed.view(torch.uint8)
    return torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)


def pack_fp4(codes: Tensor) -> Tensor:
    """Pack e2m1 codes uint8 [..., K] (K even) into uint8 [..., K/2] along the last dim (§4):
    element 2j goes to the low nibble of byte j, element 2j+1 to its high nibble."""
    _require_codes("codes", codes)
    _require_ndim("codes", codes, 1)
    _require_multiple("codes", codes, 2)
    return _pack(codes)


def unpack_fp4(packed: Tensor) -> Tensor:
    """Unpack uint8 or int8 bytes [..., K/2] into e2m1 codes uint8 [..., K] (low nibble first)."""
    _require_dtype("packed", packed, _PACKED_DTYPES)
    _require_ndim("packed", packed, 1)
    return _unpack(packed)


# ---------------------------------------------------------------------------------------------
# MXFP4 weights (§4)


def dequant_mxfp4(weight: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """W[n,k] = fp4(code[n,k]) * 2^(scale[n, k/32] - 127).

    weight int8/uint8 [..., O, I/2]; scale float8_e8m0fnu (or uint8 bytes) [..., O, I/32]
    -> dtype [..., O, I]. The fp32 result is exact, and so is its bf16 rounding (§4).
    """
    _require_dtype("weight", weight, _PACKED_DTYPES)
    _require_ndim("weight", weight, 2)
    _require_multiple("weight", weight, MXFP4_BLOCK // 2, "packed in dim (I/2)")
    expected = (*weight.shape[:-1], weight.shape[-1] * 2 // MXFP4_BLOCK)
    _require_shape("scale", scale, expected, f"one scale per {MXFP4_BLOCK} inputs of weight {_shape(weight)}")
    s = _scale_to_float("scale", scale, _E8M0_DTYPES)                        # [..., O, I/32]
    vals = _e2m1_values(_unpack(weight)).unflatten(-1, (-1, MXFP4_BLOCK))  # [..., O, I/32, 32]
    return (vals * s.unsqueeze(-1)).flatten(-2).to(dtype)


def quant_mxfp4(w: Tensor) -> tuple[Tensor, Tensor]:
    """Quantise w [..., O, I] (I % 32 == 0) to MXFP4.

    Per 32-block: scale = ceil_pow2(amax/6) (an all-zero block gets scale 1, byte 127), codes =
    e2m1(w/scale). Returns (weight int8 [..., O, I/2], the packed bytes as the released
    checkpoints store them, and scale float8_e8m0fnu [..., O, I/32]).
    """
    _require_dtype("w", w, _FLOAT_INPUTS)
    _require_ndim("w", w, 2)
    _require_multiple("w", w, MXFP4_BLOCK, "in dim")
    _require_finite("w", w)
    wb = w.to(torch.float32).unflatten(-1, (-1, MXFP4_BLOCK))              # [..., O, I/32, 32]
    amax = wb.abs().amax(dim=-1)                                           # [..., O, I/32]
    k = ceil_pow2_exponent(div_const(torch.where(amax == 0, E2M1_MAX, amax), E2M1_MAX)).clamp(-E8M0_BIAS, E8M0_BIAS)
    codes = e2m1_encode(wb / _exp2i(k).unsqueeze(-1)).flatten(-2)          # [..., O, I]
    return _pack(codes).view(torch.int8), _e8m0_from_exponent(k)


# ---------------------------------------------------------------------------------------------
# FP8 128x128 block weights (§2)


def _tile_counts(rows: int, cols: int, block: int) -> tuple[int, int]:
    return math.ceil(rows / block), math.ceil(cols / block)


def _expand_tiles(s: Tensor, rows: int, cols: int, block: int) -> Tensor:
    """Per-tile values [..., To, Ti] -> per-element [..., rows, cols] (partial tiles cropped)."""
    s = s.repeat_interleave(block, dim=-2)[..., :rows, :]
    return s.repeat_interleave(block, dim=-1)[..., :cols]


def _tile_amax(w: Tensor, block: int) -> Tensor:
    """amax |w| per tile: fp32 [..., O, I] -> [..., To, Ti]. Partial tiles are zero-padded,
    which changes no amax (§2), so their amax comes from the real elements only."""
    rows, cols = w.shape[-2:]
    t_rows, t_cols = _tile_counts(rows, cols, block)
    padded = F.pad(w.abs(), (0, t_cols * block - cols, 0, t_rows * block - rows))
    tiles = padded.unflatten(-1, (t_cols, block)).unflatten(-3, (t_rows, block))  # [..., To, B, Ti, B]
    return tiles.amax(dim=(-3, -1))


def _fp8_weight_scale(amax: Tensor, scale_fmt: str) -> Tensor:
    """fp32 tile scale from tile amax (same shape): amax/448, or ceil_pow2(amax/448) for ue8m0;
    1 for an all-zero tile. Tiny amax (< 448*2^-126) is floored to keep the scale normal."""
    sigma = torch.where(amax == 0, 1.0, div_const(amax, E4M3_MAX))
    if scale_fmt == "ue8m0":
        return _exp2i(ceil_pow2_exponent(sigma).clamp(-E8M0_BIAS, E8M0_BIAS))
    return sigma.clamp_min(_FP32_TINY)


def dequant_fp8_block(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32,
                      block: int = FP8_BLOCK) -> Tensor:
    """W[i,j] = q[i,j] * scale[i/block, j/block] (§2), any O and I.

    q float8_e4m3fn [..., O, I]; scale float8_e8m0fnu or fp32 [..., To, Ti] -> dtype [..., O, I].
    Computed in fp32 and rounded once to dtype: exact in bf16 for e8m0 (power-of-two) scales,
    rounded for general fp32 scales.
    """
    _require_dtype("q", q, (torch.float8_e4m3fn,))
    _require_ndim("q", q, 2)
    _require_block("block", block)
    rows, cols = q.shape[-2:]
    expected = (*q.shape[:-2], *_tile_counts(rows, cols, block))
    _require_shape("scale", scale, expected, f"ceil of q {_shape(q)} / {block}")
    s = _expand_tiles(_scale_to_float("scale", scale), rows, cols, block)   # [..., O, I]
    return (q.to(torch.float32) * s).to(dtype)


def quant_fp8_block(w: Tensor, scale_fmt: str = "ue8m0", block: int = FP8_BLOCK) -> tuple[Tensor, Tensor]:
    """Quantise w [..., O, I] (any O, I) to FP8 block form (§2 "Producing FP8 weights").

    Per tile: sigma = amax/448 ('fp32') or ceil_pow2(amax/448) ('ue8m0'), sigma = 1 for an
    all-zero tile; q = e4m3(clamp(w/sigma, +-448)). Partial tiles use their real elements only.
    Returns (q float8_e4m3fn [..., O, I], scale [..., To, Ti]: float8_e8m0fnu for 'ue8m0',
    fp32 for 'fp32').
    """
    _require_dtype("w", w, _FLOAT_INPUTS)
    _require_ndim("w", w, 2)
    _require_block("block", block)
    if scale_fmt not in _SCALE_FORMATS:
        raise ValueError(f"scale_fmt: expected one of {_SCALE_FORMATS}, got {scale_fmt!r}")
    _require_finite("w", w)
    w32 = w.to(torch.float32)
    sigma = _fp8_weight_scale(_tile_amax(w32, block), scale_fmt)             # [..., To, Ti]
    q = to_e4m3(w32 / _expand_tiles(sigma, *w.shape[-2:], block))            # [..., O, I]
    return q, (float_to_e8m0(sigma) if scale_fmt == "ue8m0" else sigma)


# ---------------------------------------------------------------------------------------------
# dynamic activation quantisation (§3)


def _act_scale(amax: Tensor, ue8m0: bool) -> Tensor:
    """s = max(amax, 1e-4)/448, ceil_pow2'd for ue8m0. fp32, same shape as amax."""
    s = div_const(amax.clamp_min(ACT_AMAX_FLOOR), E4M3_MAX)
    return ceil_pow2(s) if ue8m0 else s


def quant_act_fp8(x: Tensor, block: int = FP8_BLOCK, ue8m0: bool = True) -> tuple[Tensor, Tensor]:
    """Per-token, per-block dynamic quantisation of x [..., K] (K % block == 0, §3, §7).

    s = max(amax_block, 1e-4)/448 (then ceil_pow2 if ue8m0); q = e4m3(clamp(x/s, +-448)).
    Returns (q float8_e4m3fn [..., K], s fp32 [..., K/block]).
    """
    _require_dtype("x", x, _FLOAT_INPUTS)
    _require_ndim("x", x, 1)
    _require_block("block", block)
    if x.shape[-1] % block != 0:
        raise ValueError(f"x: K = {x.shape[-1]} (shape {_shape(x)}) must be a multiple of block = {block}; "
                         f"zero-pad K in both the activation and the weight (quant_formats.md §7)")
    xb = x.to(torch.float32).unflatten(-1, (-1, block))                   # [..., Kb, B]
    s = _act_scale(xb.abs().amax(dim=-1), ue8m0)                           # [..., Kb]
    q = to_e4m3(xb / s.unsqueeze(-1)).flatten(-2)                          # [..., K]
    return q, s


def dequant_act(q: Tensor, s: Tensor, block: int = FP8_BLOCK, dtype: torch.dtype = torch.float32) -> Tensor:
    """x = q * s per block. q float8_e4m3fn [..., K]; s fp32 or float8_e8m0fnu [..., K/block]
    -> dtype [..., K] (computed in fp32)."""
    _require_dtype("q", q, (torch.float8_e4m3fn,))
    _require_ndim("q", q, 1)
    _require_block("block", block)
    _require_multiple("q", q, block, "K")
    _require_shape("s", s, (*q.shape[:-1], q.shape[-1] // block), f"one scale per {block} of q {_shape(q)}")
    qb = q.to(torch.float32).unflatten(-1, (-1, block))                    # [..., Kb, B]
    return (qb * _scale_to_float("s", s).unsqueeze(-1)).flatten(-2).to(dtype)


# ---------------------------------------------------------------------------------------------
# GEMM references (§3)


def _block_scaled_gemm(a: Tensor, a_scale: Tensor, w: Tensor, w_scale: Tensor, block: int) -> Tensor:
    """y[m,n] = sum_b a_scale[m,b] * w_scale[n,b] * sum_{k in b} a[m,k] * w[n,k], all fp32.
    a [M, K]; a_scale [M, Kb]; w [N, K]; w_scale [N, Kb] -> [M, N]."""
    ab = a.unflatten(-1, (-1, block))                                      # [M, Kb, B]
    wb = w.unflatten(-1, (-1, block))                                      # [N, Kb, B]
    partial = torch.einsum("mbk,nbk->mbn", ab, wb)                         # [M, Kb, N]
    scaled = partial * a_scale.unsqueeze(-1) * w_scale.T.unsqueeze(0)      # [M, Kb, N]
    return scaled.sum(dim=1)


def _check_act_operand(a_q: Tensor, a_s: Tensor) -> tuple[int, int]:
    """Validate a_q e4m3 [M, K] (K % 128 == 0) and a_s [M, K/128]; return (M, K)."""
    _require_dtype("a_q", a_q, (torch.float8_e4m3fn,))
    _require_ndim("a_q", a_q, 2, exact=True)
    _require_multiple("a_q", a_q, FP8_BLOCK, "K")
    m, k = a_q.shape
    _require_shape("a_s", a_s, (m, k // FP8_BLOCK), f"one scale per {FP8_BLOCK} of a_q {_shape(a_q)}")
    return m, k


def fp8_block_gemm_ref(a_q: Tensor, a_s: Tensor, w_q: Tensor, w_s: Tensor) -> Tensor:
    """FP8 x FP8 block GEMM reference (§3), fp32 output (kernels write it as bf16):
    y[m,n] = sum_b a_s[m,b] * w_s[n/128, b] * sum_{k in b} a_q[m,k] * w_q[n,k].

    a_q float8_e4m3fn [M, K] (K % 128 == 0); a_s fp32 or e8m0 [M, K/128];
    w_q float8_e4m3fn [N, K]; w_s fp32 or e8m0 [ceil(N/128), K/128] -> fp32 [M, N].
    """
    _, k = _check_act_operand(a_q, a_s)
    _require_dtype("w_q", w_q, (torch.float8_e4m3fn,))
    _require_ndim("w_q", w_q, 2, exact=True)
    if w_q.shape[1] != k:
        raise ValueError(f"w_q: expected K = {k} columns to match a_q {_shape(a_q)}, got shape {_shape(w_q)}")
    n = w_q.shape[0]
    _require_shape("w_s", w_s, _tile_counts(n, k, FP8_BLOCK), f"ceil of w_q {_shape(w_q)} / {FP8_BLOCK}")
    a_scale = _scale_to_float("a_s", a_s)                                          # [M, Kb]
    w_scale = _scale_to_float("w_s", w_s).repeat_interleave(FP8_BLOCK, dim=0)[:n]  # [N, Kb]
    return _block_scaled_gemm(a_q.to(torch.float32), a_scale, w_q.to(torch.float32), w_scale, FP8_BLOCK)


def mxfp4_fp8_gemm_ref(a_q: Tensor, a_s: Tensor, w_packed: Tensor, w_scale: Tensor) -> Tensor:
    """FP8-activation x MXFP4-weight GEMM reference (§3, V4 experts), fp32 output:
    y[m,n] = sum_{b32} a_s[m, b32/4] * w_scale[n, b32] * sum_{k in b32} a_q[m,k] * fp4(w[n,k]).

    a_q float8_e4m3fn [M, K] (K % 128 == 0); a_s fp32 or e8m0 [M, K/128];
    w_packed int8/uint8 [N, K/2]; w_scale float8_e8m0fnu (or uint8 bytes) [N, K/32] -> fp32 [M, N].
    """
    _, k = _check_act_operand(a_q, a_s)
    _require_dtype("w_packed", w_packed, _PACKED_DTYPES)
    _require_ndim("w_packed", w_packed, 2, exact=True)
    if w_packed.shape[1] * 2 != k:
        raise ValueError(f"w_packed: expected K/2 = {k // 2} columns to match a_q {_shape(a_q)}, "
                         f"got shape {_shape(w_packed)}")
    n = w_packed.shape[0]
    _require_shape("w_scale", w_scale, (n, k // MXFP4_BLOCK), f"one scale per {MXFP4_BLOCK} of K = {k}")
    groups = FP8_BLOCK // MXFP4_BLOCK                                               # 4 weight groups per act block
    a_scale = _scale_to_float("a_s", a_s).repeat_interleave(groups, dim=1)          # [M, K/32]
    w_vals = _e2m1_values(_unpack(w_packed))                                        # [N, K]
    w_sc = _scale_to_float("w_scale", w_scale, _E8M0_DTYPES)                        # [N, K/32]
    return _block_scaled_gemm(a_q.to(torch.float32), a_scale, w_vals, w_sc, MXFP4_BLOCK)


# ---------------------------------------------------------------------------------------------
# official_sim helpers (§3 "Simulation variants")


def sim_fp8_blocks(x: Tensor, block: int = 64) -> Tensor:
    """Quantise x [..., K] to e4m3 per `block` along K with ue8m0 scales (as `quant_act_fp8`),
    dequantise, and return x.dtype [..., K] (V4 KV NoPE: block 64; V3.2 indexer: block 128)."""
    q, s = quant_act_fp8(x, block=block, ue8m0=True)
    return dequant_act(q, s, block=block, dtype=x.dtype)


def sim_fp4_blocks(x: Tensor, block: int = 32) -> Tensor:
    """FP4 activation simulation of x [..., K] (K % block == 0), returns x.dtype [..., K]:
    s = ceil_pow2(max(amax, 6*2^-126)/6), x' = e2m1(clamp(x/s, +-6)) * s per block."""
    _require_dtype("x", x, _FLOAT_INPUTS)
    _require_ndim("x", x, 1)
    _require_block("block", block)
    _require_multiple("x", x, block, "K")
    xb = x.to(torch.float32).unflatten(-1, (-1, block))                              # [..., Kb, B]
    s = ceil_pow2(div_const(xb.abs().amax(dim=-1, keepdim=True).clamp_min(E2M1_MAX * _FP32_TINY), E2M1_MAX))  # [..., Kb, 1]
    return (_e2m1_values(e2m1_encode(xb / s)) * s).flatten(-2).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# NVFP4 (§5)

_NVFP4_GLOBAL_DIV = E2M1_MAX * E4M3_MAX          # g = amax / (6 * 448)
_E4M3_POW2_MIN, _E4M3_POW2_MAX = -9, 8           # exactly representable powers of two in e4m3


def _nvfp4_blocks(xb: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """ModelOpt per-block step: fp32 blocks xb [..., Kb, 16] and global g broadcastable to
    [..., 1, 1] -> (codes uint8 [..., Kb*16], scale e4m3 [..., Kb]). s_b = e4m3(amax_b/(6g)),
    codes = e2m1(x/(s_b*g)); a block whose scale rounds to 0 gets zero codes (sign kept)."""
    s = to_e4m3(xb.abs().amax(dim=-1) / (E2M1_MAX * g.squeeze(-1)))            # [..., Kb]
    denom = s.to(torch.float32) * g.squeeze(-1)
    denom = torch.where(denom == 0, torch.inf, denom)
    return e2m1_encode(xb / denom.unsqueeze(-1)).flatten(-2), s


def _global_scale(name: str, w32: Tensor, global_scale: Tensor | None, dims: int) -> Tensor:
    """fp32 global scale [...] (leading dims of w32 [..., <dims trailing>]): amax/(6*448) over the
    trailing dims (1 for an all-zero slice), or the given one broadcast to that shape."""
    lead = w32.shape[: w32.dim() - dims]
    if global_scale is None:
        amax = w32.abs().flatten(-dims).amax(dim=-1) if dims else w32.abs()
        return torch.where(amax == 0, 1.0, div_const(amax, _NVFP4_GLOBAL_DIV))
    _require_dtype(name, global_scale, (torch.float32,))
    g = global_scale.expand(lead) if global_scale.dim() <= len(lead) else global_scale
    _require_shape(name, g, lead, "one global scale per leading index")
    if not bool((g > 0).all()) or not bool(torch.isfinite(g).all()):
        raise ValueError(f"{name}: global scale must be finite and > 0 (shape {_shape(g)})")
    return g.to(torch.float32)


def quant_nvfp4(w: Tensor, global_scale: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Quantise weights w [..., O, I] (I % 16 == 0) to NVFP4 with the ModelOpt recipe (§5).

    g = amax(w[...])/(6*448) per leading index (over O and I; 1 for an all-zero matrix) unless
    `global_scale` (fp32, broadcastable to [...]) is given, e.g. a shared w1/w3 scale.
    Returns (weight uint8 [..., O, I/2] packed like MXFP4, weight_scale float8_e4m3fn
    [..., O, I/16], weight_scale_2 fp32 [...]).
    """
    _require_dtype("w", w, _FLOAT_INPUTS)
    _require_ndim("w", w, 2)
    _require_multiple("w", w, NVFP4_BLOCK, "in dim")
    _require_finite("w", w)
    w32 = w.to(torch.float32)
    g = _global_scale("global_scale", w32, global_scale, 2)                  # [...]
    codes, s = _nvfp4_blocks(w32.unflatten(-1, (-1, NVFP4_BLOCK)), g[..., None, None, None])
    return _pack(codes), s, g


def dequant_nvfp4(weight: Tensor, weight_scale: Tensor, weight_scale_2: Tensor,
                  dtype: torch.dtype = torch.float32) -> Tensor:
    """W[n,k] = fp4(code) * e4m3(weight_scale[n, k/16]) * weight_scale_2 (§5).

    weight uint8/int8 [..., O, I/2]; weight_scale float8_e4m3fn (or its uint8 bytes) [..., O, I/16];
    weight_scale_2 fp32 broadcastable to [...] -> dtype [..., O, I], computed in fp32.
    """
    _require_dtype("weight", weight, _PACKED_DTYPES)
    _require_ndim("weight", weight, 2)
    _require_multiple("weight", weight, NVFP4_BLOCK // 2, "packed in dim (I/2)")
    expected = (*weight.shape[:-1], weight.shape[-1] * 2 // NVFP4_BLOCK)
    _require_shape("weight_scale", weight_scale, expected, f"one scale per {NVFP4_BLOCK} inputs of weight {_shape(weight)}")
    _require_dtype("weight_scale", weight_scale, (torch.float8_e4m3fn, torch.uint8))
    _require_dtype("weight_scale_2", weight_scale_2, (torch.float32,))
    s = weight_scale.view(torch.float8_e4m3fn).to(torch.float32)                # [..., O, I/16]
    g = weight_scale_2.reshape(*weight_scale_2.shape, 1, 1) if weight_scale_2.dim() else weight_scale_2
    vals = _e2m1_values(_unpack(weight)).unflatten(-1, (-1, NVFP4_BLOCK))       # [..., O, I/16, 16]
    return ((vals * s.unsqueeze(-1)).flatten(-2) * g).to(dtype)


def quant_act_nvfp4(x: Tensor, input_scale: Tensor) -> tuple[Tensor, Tensor]:
    """NVFP4 activation quantisation (§5) of x [..., K] (K % 16 == 0) with the global
    `input_scale` g (fp32 scalar tensor): per 16 channels s_b = e4m3(amax_b/(6g)),
    codes = e2m1(x/(s_b*g)). Returns (packed uint8 [..., K/2], scale float8_e4m3fn [..., K/16])."""
    _require_dtype("x", x, _FLOAT_INPUTS)
    _require_ndim("x", x, 1)
    if x.shape[-1] % NVFP4_BLOCK != 0:
        raise ValueError(f"x: K = {x.shape[-1]} (shape {_shape(x)}) must be a multiple of {NVFP4_BLOCK}; "
                         f"zero-pad K in both the activation and the weight (quant_formats.md §7)")
    _require_dtype("input_scale", input_scale, (torch.float32,))
    if input_scale.numel() != 1:
        raise ValueError(f"input_scale: expected one value, got shape {_shape(input_scale)}")
    codes, s = _nvfp4_blocks(x.to(torch.float32).unflatten(-1, (-1, NVFP4_BLOCK)), input_scale.reshape(1, 1))
    return _pack(codes), s


def dequant_act_nvfp4(packed: Tensor, scale: Tensor, input_scale: Tensor,
                      dtype: torch.dtype = torch.float32) -> Tensor:
    """x = fp4(code) * e4m3(scale) * input_scale. packed uint8 [..., K/2]; scale e4m3 (or uint8
    bytes) [..., K/16]; input_scale fp32 scalar -> dtype [..., K]."""
    _require_dtype("input_scale", input_scale, (torch.float32,))
    return dequant_nvfp4(packed.unsqueeze(-2), scale.unsqueeze(-2), input_scale.reshape(()), dtype).squeeze(-2)


# ---------------------------------------------------------------------------------------------
# conversions (§6); every function takes the tensor's name and puts it in its errors


class _Named:
    """Context manager: re-raise a ValueError as '<name>: <message>'."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, err, tb) -> bool:
        if kind is ValueError:
            raise ValueError(f"{self.name}: {err}") from err
        return False


def _mx_operands(weight: Tensor, scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Checked MXFP4 operands -> (codes uint8 [..., O, I], exponents int32 [..., O, I/32],
    zero-block mask bool [..., O, I/32] of blocks whose 32 codes are all +-0)."""
    _require_dtype("weight", weight, _PACKED_DTYPES)
    _require_ndim("weight", weight, 2)
    _require_multiple("weight", weight, MXFP4_BLOCK // 2, "packed in dim (I/2)")
    expected = (*weight.shape[:-1], weight.shape[-1] * 2 // MXFP4_BLOCK)
    _require_shape("scale", scale, expected, f"one scale per {MXFP4_BLOCK} inputs of weight {_shape(weight)}")
    b = _e8m0_bytes("scale", scale)
    if bool((b == E8M0_NAN).any()):
        raise ValueError(f"scale: holds the ue8m0 NaN byte 255 (shape {_shape(scale)})")
    codes = _unpack(weight)
    zero = ((codes & 7) == 0).unflatten(-1, (-1, MXFP4_BLOCK)).all(dim=-1)
    return codes, b.to(torch.int32) - E8M0_BIAS, zero


def _changed_blocks(new: Tensor, old: Tensor, block: int) -> int:
    """Number of `block`-wide blocks along the last dim where new and old differ (bit-wise,
    so -0 vs 0 counts)."""
    diff = new.view(torch.int32) != old.view(torch.int32)
    return int(diff.unflatten(-1, (-1, block)).any(dim=-1).sum())


def mxfp4_to_nvfp4(weight: Tensor, scale: Tensor, name: str = "weight") -> tuple[Tensor, Tensor, Tensor, int]:
    """Lossless MXFP4 -> NVFP4 (§6.1), one global scale per leading index (over O and I).

    weight int8/uint8 [..., O, I/2]; scale e8m0 [..., O, I/32]. E = max block exponent over the
    non-zero blocks, g = 2^(E-8), each 32-block becomes two 16-blocks with scale e4m3(2^(e-E+8));
    code bytes are copied. Exact iff E - e <= 17 for every non-zero block; other blocks are
    re-quantised with the smallest scale 2^-9 (lossy). All-zero blocks get 2^-9.
    Returns (weight uint8 [..., O, I/2], weight_scale float8_e4m3fn [..., O, I/16],
    weight_scale_2 fp32 [...], lossy: the number of 16-blocks whose dequantised values changed).
    To share g between tensors (w1, w3), concatenate them along O first (`mxfp4_to_nvfp4_w13`).
    """
    with _Named(name):
        codes, e, zero = _mx_operands(weight, scale)
        masked = torch.where(zero, torch.iinfo(torch.int32).min, e)
        top = masked.flatten(-2).amax(dim=-1)                                    # [...]
        top = torch.where(top == torch.iinfo(torch.int32).min, 0, top)           # all-zero tensor
        d = top[..., None, None] - e                                             # [..., O, I/32]
        exact = zero | (d <= _E4M3_POW2_MAX - _E4M3_POW2_MIN)
        k = torch.where(exact & ~zero, _E4M3_POW2_MAX - d, _E4M3_POW2_MIN)      # scale exponents
        g = _exp2i(top - _E4M3_POW2_MAX)
        # out-of-range blocks: value / (2^-9 g) = fp4 * 2^(e - top + 17), re-encoded
        blocks = _e2m1_values(codes).unflatten(-1, (-1, MXFP4_BLOCK))             # [..., O, I/32, 32]
        shifted = blocks * _exp2i(torch.where(exact, 0, _E4M3_POW2_MAX - _E4M3_POW2_MIN - d)).unsqueeze(-1)
        requant = e2m1_encode(shifted).flatten(-2)
        new_codes = torch.where(exact.repeat_interleave(MXFP4_BLOCK, dim=-1), codes, requant)
        w_scale = to_e4m3(_exp2i(k).repeat_interleave(MXFP4_BLOCK // NVFP4_BLOCK, dim=-1))
        out = _pack(new_codes)
        lossy = 0
        if not bool(exact.all()):
            lossy = _changed_blocks(dequant_nvfp4(out, w_scale, g), dequant_mxfp4(weight, scale), NVFP4_BLOCK)
        return out, w_scale, g, lossy


def mxfp4_to_nvfp4_w13(w1: Tensor, s1: Tensor, w3: Tensor, s3: Tensor,
                       names: tuple[str, str] = ("w1", "w3")) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, int]:
    """`mxfp4_to_nvfp4` of w1 and w3 ([..., I, D/2] + [..., I, D/32] each) with ONE global scale
    per leading index (per expert), as fused gate/up kernels need (§5 "Fused gate/up").
    Returns (w1 uint8, w1 scale e4m3, w3 uint8, w3 scale e4m3, g fp32 [...], lossy blocks)."""
    if w1.shape != w3.shape or s1.shape != s3.shape:
        raise ValueError(f"{names[0]}/{names[1]}: shapes differ: {_shape(w1)}/{_shape(s1)} vs {_shape(w3)}/{_shape(s3)}")
    rows = w1.shape[-2]
    w, s, g, lossy = mxfp4_to_nvfp4(torch.cat((w1.view(torch.uint8), w3.view(torch.uint8)), dim=-2),
                                    torch.cat((_e8m0_bytes(f"{names[0]} scale", s1), _e8m0_bytes(f"{names[1]} scale", s3)), dim=-2),
                                    name=f"{names[0]}+{names[1]}")
    return w[..., :rows, :], s[..., :rows, :], w[..., rows:, :], s[..., rows:, :], g, lossy


def mxfp4_to_fp8_block(weight: Tensor, scale: Tensor, name: str = "weight") -> tuple[Tensor, Tensor, int]:
    """MXFP4 -> FP8 128x128 block (§6.2): per tile, E_t = max group exponent over the tile's
    non-zero 32-groups (an all-zero tile gets scale 1), tile scale 2^(E_t-6) (ue8m0), elements
    e4m3(fp4 * 2^(e_g - E_t + 6)). Exact iff E_t - e_g <= 14 for every non-zero group. Any O and
    I % 32 == 0: partial tiles are padded with zero codes and cropped afterwards (§7).
    Zero groups are left out of the maximum (Official's convert.py takes all groups); this only
    widens the exact cases.
    Returns (q float8_e4m3fn [..., O, I], scale float8_e8m0fnu [..., ceil(O/128), ceil(I/128)],
    lossy: the number of 32-groups whose dequantised values changed).
    """
    with _Named(name):
        codes, e, zero = _mx_operands(weight, scale)
        rows, cols = codes.shape[-2:]
        t_rows, t_cols = _tile_counts(rows, cols, FP8_BLOCK)
        pad_r, pad_c = t_rows * FP8_BLOCK - rows, t_cols * FP8_BLOCK - cols
        gpt = FP8_BLOCK // MXFP4_BLOCK                                           # 4 groups per tile row
        masked = F.pad(torch.where(zero, -(1 << 20), e), (0, pad_c // MXFP4_BLOCK, 0, pad_r), value=-(1 << 20))
        tiles = masked.unflatten(-1, (t_cols, gpt)).unflatten(-3, (t_rows, FP8_BLOCK))  # [..., To, B, Ti, 4]
        top = tiles.amax(dim=(-3, -1))                                           # [..., To, Ti]
        t_exp = torch.where(top == -(1 << 20), 0, top - 6).clamp(-E8M0_BIAS, E8M0_BIAS)
        t_elem = _expand_tiles(t_exp, rows, cols, FP8_BLOCK)                     # [..., O, I]
        e_elem = e.repeat_interleave(MXFP4_BLOCK, dim=-1)                        # [..., O, I]
        q = to_e4m3(_e2m1_values(codes) * _exp2i(e_elem - t_elem))
        t_scale = _e8m0_from_exponent(t_exp)
        lossy = _changed_blocks(dequant_fp8_block(q, t_scale), dequant_mxfp4(weight, scale), MXFP4_BLOCK)
        return q, t_scale, lossy


def bf16_to_fp8_block(w: Tensor, name: str = "weight", scale_fmt: str = "ue8m0") -> tuple[Tensor, Tensor]:
    """bf16 (or any float) weight [..., O, I] -> FP8 block (§2), as `quant_fp8_block`, with the
    tensor's name in errors. Returns (q float8_e4m3fn [..., O, I], scale [..., To, Ti])."""
    with _Named(name):
        return quant_fp8_block(w, scale_fmt=scale_fmt)


def bf16_to_nvfp4(w: Tensor, name: str = "weight", global_scale: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """bf16 (or any float) weight [..., O, I] -> NVFP4 (§5 ModelOpt recipe, lossy), as
    `quant_nvfp4`, with the tensor's name in errors."""
    with _Named(name):
        return quant_nvfp4(w, global_scale=global_scale)
