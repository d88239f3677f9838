"""Tests of dsv4c.quant against quant_formats.md §1-4 and the §8 test vectors.

References here are written independently of the module (bit formulas, brute-force nearest
rounding, frexp, per-tile loops) so that a wrong implementation fails.
"""
from __future__ import annotations

import math

import pytest
import torch

from dsv4c import quant as Q

# Relative Frobenius-norm error bounds, one per format / comparison (measured values are about
# 0.027 for FP8, 0.12 for MXFP4 and FP4 on Gaussian data; ~1e-7 for same-math GEMM checks).
REL_ERR = {
    "fp8_block_ue8m0": 0.04,
    "fp8_block_fp32": 0.04,
    "act_fp8_ue8m0": 0.04,
    "act_fp8_fp32": 0.04,
    "mxfp4": 0.14,
    "sim_fp4": 0.14,
    "gemm_same_math": 1e-5,
    "gemm_fp8_vs_fp32": 0.05,
    "gemm_mxfp4_vs_fp32": 0.15,
}

E2M1_MAGS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm())


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def e4m3_byte_ref(b: int) -> float:
    """Spec §1 decode of one e4m3fn byte (NaN for S1111111)."""
    s, e, m = b >> 7, (b >> 3) & 0xF, b & 7
    if e == 15 and m == 7:
        return math.nan
    mag = m * 2.0**-9 if e == 0 else 2.0 ** (e - 7) * (1 + m / 8)
    return -mag if s else mag


def e2m1_code_ref(c: int) -> float:
    """Spec §1 decode of one e2m1 code from its bits S EE M, bias 1."""
    s, e, m = c >> 3, (c >> 1) & 3, c & 1
    mag = m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
    return -mag if s else mag


def e2m1_nearest_ref(x: torch.Tensor) -> torch.Tensor:
    """Brute force: clamp to ±6, nearest magnitude, ties to the even code; sign from signbit."""
    mags = torch.tensor(E2M1_MAGS, dtype=torch.float64)
    a = x.double().abs().clamp(max=6.0).flatten()
    dist = (a[:, None] - mags[None]).abs()                       # [n, 8]
    tied = dist == dist.min(dim=1, keepdim=True).values
    even_bonus = 2 - torch.arange(8) % 2                          # prefer the even code on a tie
    idx = (tied * even_bonus).argmax(dim=1).to(torch.uint8)
    return (idx | (torch.signbit(x.flatten()).to(torch.uint8) << 3)).view(x.shape)


def ceil_pow2_ref(x: float) -> float:
    m, e = math.frexp(x)                                          # x = m·2^e, 0.5 <= m < 1
    return 2.0 ** (e - 1) if m == 0.5 else 2.0**e


# ---------------------------------------------------------------------------------------------
# §8 test vectors


def test_vector_mxfp4_byte_0x2b_scale_0x80():
    codes = Q.unpack_fp4(torch.tensor([0x2B], dtype=torch.uint8))
    assert codes.tolist() == [0xB, 0x2]
    assert Q.e2m1_decode(codes).tolist() == [-1.5, 1.0]
    weight = torch.zeros(1, 16, dtype=torch.uint8)
    weight[0, 0] = 0x2B
    scale = torch.tensor([[0x80]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    w = Q.dequant_mxfp4(weight.view(torch.int8), scale)
    assert w.shape == (1, 32)
    assert w[0, :2].tolist() == [-3.0, 2.0]
    assert not w[0, 2:].any()


@pytest.mark.parametrize("byte,value", [(0x7E, 448.0), (0x08, 2.0**-6), (0x01, 2.0**-9), (0x38, 1.0),
                                        (0x30, 0.5), (0xBC, -1.5)])
def test_vector_e4m3(byte, value):
    assert torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).float().item() == value
    assert Q.to_e4m3(torch.tensor([value])).view(torch.uint8).item() == byte


def test_vector_ue8m0():
    assert Q.ceil_pow2(torch.tensor([3.0 / 448])).item() == 2.0**-7
    assert Q.ceil_pow2_exponent(torch.tensor([3.0 / 448])).item() == -7
    one = Q.ceil_pow2(torch.tensor([448.0 / 448]))
    assert one.item() == 1.0
    assert Q.float_to_e8m0(one).view(torch.uint8).item() == 127


def test_vector_activation_amax_zero():
    x = torch.zeros(3, 256)
    q, s = Q.quant_act_fp8(x, ue8m0=True)
    assert s.dtype == torch.float32 and s.shape == (3, 2)
    assert (s == 2.0**-22).all()
    assert not q.float().any()
    _, s_fp32 = Q.quant_act_fp8(x, ue8m0=False)
    assert (s_fp32 == torch.tensor(1e-4) / 448).all()


# ---------------------------------------------------------------------------------------------
# element formats


def test_e4m3_all_bytes_decode_and_reencode():
    b = torch.arange(256, dtype=torch.uint8)
    vals = b.view(torch.float8_e4m3fn).float()
    ref = torch.tensor([e4m3_byte_ref(i) for i in range(256)])
    nan = torch.isnan(ref)
    assert nan.sum() == 2 and torch.isnan(vals[nan]).all()
    assert torch.equal(vals[~nan], ref[~nan])
    assert torch.equal(Q.to_e4m3(vals[~nan]).view(torch.uint8), b[~nan])


def test_e4m3_round_to_nearest_even_and_clamp():
    pos = torch.tensor([e4m3_byte_ref(i) for i in range(0x7F)], dtype=torch.float64)  # 0 .. 448
    lo, hi = pos[:-1], pos[1:]
    mid = (lo + hi) / 2
    even_up = torch.arange(1, 0x7F) % 2 == 0                      # the upper neighbour's byte is even
    exp_mid = torch.where(even_up, hi, lo)
    assert torch.equal(Q.to_e4m3(mid.float()).double(), exp_mid)
    eps = (hi - lo) / 8
    assert torch.equal(Q.to_e4m3((mid + eps).float()).double(), hi)
    assert torch.equal(Q.to_e4m3((mid - eps).float()).double(), lo)
    big = torch.tensor([448.5, 464.0, 480.0, 1e9, 3e38, float("inf"), -464.0, -1e30])
    assert Q.to_e4m3(big).float().tolist() == [448.0] * 6 + [-448.0] * 2


def test_e8m0_decode_all_bytes_and_reencode():
    b = torch.arange(256, dtype=torch.uint8)
    ref = torch.tensor([2.0 ** (i - 127) for i in range(255)], dtype=torch.float64)
    for t in (b, b.view(torch.float8_e8m0fnu)):
        v = Q.e8m0_to_float(t)
        assert v.dtype == torch.float32
        assert torch.equal(v[:255].double(), ref)
        assert torch.isnan(v[255])
    assert torch.equal(Q.float_to_e8m0(ref.float()).view(torch.uint8), b[:255])


@pytest.mark.parametrize("bad", [3.0, 0.0, -2.0, 2.0**-128, float("inf"), float("nan"), 1.0 + 2.0**-23])
def test_float_to_e8m0_rejects_non_powers(bad):
    with pytest.raises(ValueError, match="powers of two"):
        Q.float_to_e8m0(torch.tensor([1.0, bad]))


def test_ceil_pow2_is_the_ceiling_not_a_cast():
    xs = [2.1, 2.5, 2.9, 3.0, 3.5, 4.0, 4.0000005, 0.75, 1.0, 1.0000001, 0.999999, 2.0**-130,
          3 * 2.0**-140, 2.0**-149, 1.5 * 2.0**-126, 2.0**127, 1e30, 3.0 / 448]
    x = torch.tensor(xs)
    ref = torch.tensor([ceil_pow2_ref(v) for v in x.tolist()])
    got = Q.ceil_pow2(x)
    assert torch.equal(got, ref)
    assert got[:4].tolist() == [4.0, 4.0, 4.0, 4.0]               # torch's e8m0 cast gives 2, 2, 2, 4
    k = Q.ceil_pow2_exponent(x)
    assert k.dtype == torch.int32
    assert torch.equal(k, torch.tensor([round(math.log2(v)) for v in ref.tolist()], dtype=torch.int32))


def test_ceil_pow2_random_against_frexp():
    x = torch.exp(torch.empty(4096).uniform_(-80, 80, generator=gen(1)))
    x = torch.cat([x, Q.ceil_pow2(x)])                            # exact powers must map to themselves
    m, e = torch.frexp(x.double())
    ref = torch.where(m == 0.5, e - 1, e).to(torch.int32)
    assert torch.equal(Q.ceil_pow2_exponent(x), ref)


def test_scales_are_exact_ceilings_in_quantisers():
    """An amax of 3.0 needs scale 2^-7 (fp8) and 2^-1 (fp4); a cast would pick 2^-8 / 2^-1."""
    x = torch.zeros(1, 128)
    x[0, 5] = 3.0
    _, s = Q.quant_act_fp8(x)
    assert s.item() == 2.0**-7
    _, ws = Q.quant_fp8_block(x, "ue8m0")
    assert ws.view(torch.uint8).item() == 127 - 7
    x[0, 5] = 2.1 * 6                                             # amax/6 = 2.1 -> 4, a cast gives 2
    _, ms = Q.quant_mxfp4(x)
    assert ms.view(torch.uint8)[0, 0].item() == 127 + 2


E2M1_TABLE = [  # (x, expected magnitude), §1 thresholds incl. ties and clamping
    (0.0, 0.0), (0.1, 0.0), (0.25, 0.0), (0.2500001, 0.5), (0.5, 0.5), (0.7499999, 0.5), (0.75, 1.0),
    (1.0, 1.0), (1.25, 1.0), (1.2500001, 1.5), (1.5, 1.5), (1.7499999, 1.5), (1.75, 2.0),
    (2.0, 2.0), (2.5, 2.0), (2.5000002, 3.0), (3.0, 3.0), (3.4999998, 3.0), (3.5, 4.0),
    (4.0, 4.0), (5.0, 4.0), (5.0000005, 6.0), (6.0, 6.0), (6.5, 6.0), (1e9, 6.0), (float("inf"), 6.0),
]


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_e2m1_threshold_table(sign):
    x = torch.tensor([sign * v for v, _ in E2M1_TABLE])
    codes = Q.e2m1_encode(x)
    assert codes.dtype == torch.uint8
    mags = torch.tensor(E2M1_MAGS)[(codes & 7).long()]
    assert mags.tolist() == [m for _, m in E2M1_TABLE]
    assert ((codes >> 3) == (1 if sign < 0 else 0)).all()
    assert torch.equal(codes, e2m1_nearest_ref(x))


def test_e2m1_ties_go_to_even_code():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert Q.e2m1_encode(ties).tolist() == [0, 2, 2, 4, 4, 6, 6]
    assert Q.e2m1_encode(-ties).tolist() == [8, 10, 10, 12, 12, 14, 14]


def test_e2m1_dense_grid_against_brute_force():
    x = torch.cat([torch.arange(-8 * 64, 8 * 64 + 1) / 64.0,
                   torch.randn(2000, generator=gen(2)) * 3])
    assert torch.equal(Q.e2m1_encode(x), e2m1_nearest_ref(x))


def test_e2m1_all_codes_round_trip():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = Q.e2m1_decode(codes)
    assert vals.dtype == torch.float32
    assert vals.tolist() == [e2m1_code_ref(c) for c in range(16)]
    assert torch.signbit(vals[8]) and vals[8] == 0                 # code 8 is -0
    assert torch.equal(Q.e2m1_encode(vals), codes)


def test_e2m1_decode_rejects_bad_codes():
    with pytest.raises(ValueError, match="0..15"):
        Q.e2m1_decode(torch.tensor([3, 16], dtype=torch.uint8))
    with pytest.raises(ValueError, match="codes: dtype"):
        Q.e2m1_decode(torch.tensor([3], dtype=torch.int64))


def test_pack_unpack_round_trip_and_nibble_order():
    assert Q.pack_fp4(torch.tensor([0xB, 0x2, 0x0, 0xF], dtype=torch.uint8)).tolist() == [0x2B, 0xF0]
    codes = torch.randint(0, 16, (3, 5, 64), generator=gen(3), dtype=torch.uint8)
    packed = Q.pack_fp4(codes)
    assert packed.shape == (3, 5, 32) and packed.dtype == torch.uint8
    assert torch.equal(Q.unpack_fp4(packed), codes)
    assert torch.equal(Q.unpack_fp4(packed.view(torch.int8)), codes)
    with pytest.raises(ValueError, match=r"\(3, 7\)"):
        Q.pack_fp4(torch.zeros(3, 7, dtype=torch.uint8))


# ---------------------------------------------------------------------------------------------
# MXFP4


def mxfp4_weight(seed: int, out: int = 48, inp: int = 256) -> torch.Tensor:
    """Gaussian weight whose 32-blocks span magnitudes 2^-12 .. 2^12."""
    g = gen(seed)
    w = torch.randn(out, inp, generator=g)
    block_mag = 2.0 ** torch.randint(-12, 13, (out, inp // 32), generator=g).float()
    return w * block_mag.repeat_interleave(32, dim=1)


def test_quant_mxfp4_matches_independent_reference():
    w = mxfp4_weight(4)
    w[3, 64:96] = 0                                               # an all-zero block
    packed, scale = Q.quant_mxfp4(w)
    assert packed.dtype == torch.int8 and packed.shape == (48, 128)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (48, 8)
    amax = w.abs().unflatten(1, (8, 32)).amax(-1)
    ref_s = torch.tensor([[ceil_pow2_ref(a / 6) if a > 0 else 1.0 for a in row] for row in amax.double().tolist()])
    assert torch.equal(Q.e8m0_to_float(scale).double(), ref_s)
    assert scale.view(torch.uint8)[3, 2].item() == 127
    ref_codes = e2m1_nearest_ref(w / ref_s.float().repeat_interleave(32, dim=1))
    assert torch.equal(Q.unpack_fp4(packed), ref_codes)


def test_mxfp4_round_trip_error_and_bf16_exact():
    w = mxfp4_weight(5)
    packed, scale = Q.quant_mxfp4(w)
    deq = Q.dequant_mxfp4(packed, scale)
    assert deq.dtype == torch.float32 and deq.shape == w.shape
    assert rel_err(deq, w) < REL_ERR["mxfp4"]
    s = Q.e8m0_to_float(scale).repeat_interleave(32, dim=1)
    assert ((deq - w).abs() <= s).all()                           # at most half the widest gap (4 -> 6)
    bf = Q.dequant_mxfp4(packed, scale, dtype=torch.bfloat16)
    assert bf.dtype == torch.bfloat16
    assert torch.equal(bf.float(), deq)


def test_mxfp4_validation():
    with pytest.raises(ValueError, match=r"w: in dim 48 of shape \(4, 48\)"):
        Q.quant_mxfp4(torch.zeros(4, 48))
    packed = torch.zeros(4, 32, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"scale: expected shape \(4, 2\).*got \(4, 4\)"):
        Q.dequant_mxfp4(packed, torch.zeros(4, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="weight: dtype"):
        Q.dequant_mxfp4(packed.float(), torch.zeros(4, 2, dtype=torch.uint8))


# ---------------------------------------------------------------------------------------------
# FP8 128x128 blocks


def tiles(rows: int, cols: int, b: int = 128):
    for i in range(0, rows, b):
        for j in range(0, cols, b):
            yield i // b, j // b, slice(i, i + b), slice(j, j + b)


@pytest.mark.parametrize("fmt", ["ue8m0", "fp32"])
@pytest.mark.parametrize("shape", [(256, 384), (200, 130)])
def test_fp8_block_round_trip(fmt, shape):
    w = torch.randn(*shape, generator=gen(6))
    w[128:, 128:] *= 1000.0                                       # tiles with different scales
    q, s = Q.quant_fp8_block(w, fmt)
    to, ti = math.ceil(shape[0] / 128), math.ceil(shape[1] / 128)
    assert q.dtype == torch.float8_e4m3fn and q.shape == shape
    assert s.shape == (to, ti)
    assert s.dtype == (torch.float8_e8m0fnu if fmt == "ue8m0" else torch.float32)
    deq = Q.dequant_fp8_block(q, s)
    assert rel_err(deq, w) < REL_ERR[f"fp8_block_{fmt}"]
    sf = s.float() if fmt == "fp32" else Q.e8m0_to_float(s)
    for ti_, tj, rs, cs in tiles(*shape):
        amax = w[rs, cs].abs().max().item()
        want = ceil_pow2_ref(amax / 448) if fmt == "ue8m0" else torch.tensor(amax / 448, dtype=torch.float32).item()
        assert sf[ti_, tj].item() == pytest.approx(want, rel=1e-7 if fmt == "fp32" else 0)
        qmax = q[rs, cs].float().abs().max().item()
        assert qmax == 448.0 if fmt == "fp32" else 224.0 <= qmax <= 448.0


def test_fp8_partial_tile_scale_uses_real_elements_only():
    w = torch.full((200, 130), 0.5)
    w[128:, 128:] = 0.0
    w[150, 129] = -3.0                                            # the only non-zero of tile (1, 1)
    q, s = Q.quant_fp8_block(w, "ue8m0")
    assert Q.e8m0_to_float(s).tolist() == [[2.0**-9, 2.0**-9], [2.0**-9, 2.0**-7]]
    assert q[150, 129].float().item() == -384.0
    _, s32 = Q.quant_fp8_block(w, "fp32")
    assert s32[1, 1].item() == torch.tensor(3.0 / 448, dtype=torch.float32).item()


@pytest.mark.parametrize("fmt", ["ue8m0", "fp32"])
def test_fp8_all_zero_tile_has_scale_one(fmt):
    w = torch.randn(256, 200, generator=gen(7))
    w[:128, 128:] = 0.0
    q, s = Q.quant_fp8_block(w, fmt)
    sf = s.float() if fmt == "fp32" else Q.e8m0_to_float(s)
    assert sf[0, 1].item() == 1.0
    assert sf[0, 0].item() != 1.0 and sf[1, 1].item() != 1.0
    if fmt == "ue8m0":
        assert s.view(torch.uint8)[0, 1].item() == 127
    assert not q[:128, 128:].float().any()


def test_fp8_dequant_bf16_exact_for_e8m0():
    w = torch.randn(200, 130, generator=gen(8)) * 37
    q, s = Q.quant_fp8_block(w, "ue8m0")
    assert torch.equal(Q.dequant_fp8_block(q, s, dtype=torch.bfloat16).float(), Q.dequant_fp8_block(q, s))


def test_fp8_block_validation():
    q = torch.zeros(200, 130).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"scale: expected shape \(2, 2\).*got \(2, 1\)"):
        Q.dequant_fp8_block(q, torch.ones(2, 1))
    with pytest.raises(ValueError, match="scale: dtype"):
        Q.dequant_fp8_block(q, torch.ones(2, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="scale_fmt"):
        Q.quant_fp8_block(torch.zeros(4, 4), "e4m3")
    with pytest.raises(ValueError, match="finite"):
        Q.quant_fp8_block(torch.tensor([[1.0, float("nan")]]), "fp32")


# ---------------------------------------------------------------------------------------------
# activations and simulation helpers


@pytest.mark.parametrize("ue8m0", [True, False])
def test_act_quant_round_trip(ue8m0):
    x = torch.randn(4, 3, 256, generator=gen(9))
    x[..., 128:] *= 50.0
    q, s = Q.quant_act_fp8(x, ue8m0=ue8m0)
    assert q.shape == x.shape and q.dtype == torch.float8_e4m3fn
    assert s.shape == (4, 3, 2) and s.dtype == torch.float32
    amax = x.abs().unflatten(-1, (2, 128)).amax(-1)
    if ue8m0:
        ref = torch.tensor([ceil_pow2_ref(a / 448) for a in amax.flatten().tolist()]).view_as(s)
        assert torch.equal(s, ref)
    else:
        assert torch.equal(s, amax / 448)
    key = "act_fp8_ue8m0" if ue8m0 else "act_fp8_fp32"
    assert rel_err(Q.dequant_act(q, s), x) < REL_ERR[key]
    if ue8m0:                                                     # e8m0-stored scales decode the same
        assert torch.equal(Q.dequant_act(q, Q.float_to_e8m0(s)), Q.dequant_act(q, s))


def test_act_quant_requires_multiple_of_block():
    with pytest.raises(ValueError, match=r"K = 100 .*\(2, 100\).*multiple of block = 128"):
        Q.quant_act_fp8(torch.zeros(2, 100))
    with pytest.raises(ValueError, match=r"s: expected shape \(2, 2\)"):
        Q.dequant_act(torch.zeros(2, 256).to(torch.float8_e4m3fn), torch.ones(2, 1))


def test_sim_fp8_blocks_uses_ue8m0_block64():
    x = torch.zeros(2, 128)
    x[:, 0], x[:, 1] = 3.0, 1e-3                                  # block 0: s = 2^-7
    x[:, 64] = 1.0                                                # block 1: s = 2^-8
    x[:, 65] = 0.3
    y = Q.sim_fp8_blocks(x)
    assert y.dtype == torch.float32
    # 1e-3/2^-7 = 0.128 -> e4m3 0.125 -> 2^-10 (an fp32 scale 3/448 would give ~9.4e-4)
    assert y[0, :2].tolist() == [3.0, 2.0**-10]
    # 0.3/2^-8 = 76.8 -> e4m3 80 (step 8 in [64, 128)) -> 80·2^-8
    assert y[0, 64:66].tolist() == [1.0, 80 * 2.0**-8]
    xb = torch.randn(8, 192, generator=gen(10)).bfloat16()
    yb = Q.sim_fp8_blocks(xb)
    assert yb.dtype == torch.bfloat16
    assert rel_err(yb, xb) < REL_ERR["act_fp8_ue8m0"]
    with pytest.raises(ValueError, match="multiple of block = 64"):
        Q.sim_fp8_blocks(torch.zeros(2, 96))


def test_sim_fp4_blocks():
    x = torch.zeros(1, 96)
    x[0, :4] = torch.tensor([5.0, 2.5, 0.75, -0.25])              # amax 5 -> s = 1
    x[0, 32:35] = torch.tensor([7.0, -1.1, 0.6])                  # amax 7 -> s = 2
    x[0, 64] = 1e-39                                              # floored amax -> s = 2^-126
    y = Q.sim_fp4_blocks(x)
    assert y[0, :4].tolist() == [4.0, 2.0, 1.0, -0.0]
    assert y[0, 32:35].tolist() == [8.0, -1.0, 1.0]
    assert not y[0, 64:].any() and torch.isfinite(y).all()
    xb = torch.randn(16, 256, generator=gen(11)).bfloat16()
    yb = Q.sim_fp4_blocks(xb)
    assert yb.dtype == torch.bfloat16
    assert rel_err(yb, xb) < REL_ERR["sim_fp4"]


# ---------------------------------------------------------------------------------------------
# GEMM references


@pytest.mark.parametrize("fmt", ["ue8m0", "fp32"])
def test_fp8_block_gemm_ref(fmt):
    a = torch.randn(8, 384, generator=gen(12))
    a[:, 128:256] *= 0.01                                         # per-K-block activation scales differ
    w = torch.randn(200, 384, generator=gen(13))
    w[128:, :] *= 100.0                                           # per-N-block weight scales differ
    w[:, 256:] *= 0.1
    a_q, a_s = Q.quant_act_fp8(a, ue8m0=fmt == "ue8m0")
    w_q, w_s = Q.quant_fp8_block(w, fmt)
    y = Q.fp8_block_gemm_ref(a_q, a_s, w_q, w_s)
    assert y.dtype == torch.float32 and y.shape == (8, 200)
    ref = Q.dequant_act(a_q, a_s).double() @ Q.dequant_fp8_block(w_q, w_s).double().T
    assert rel_err(y, ref) < REL_ERR["gemm_same_math"]
    assert rel_err(y, a.double() @ w.double().T) < REL_ERR["gemm_fp8_vs_fp32"]


def test_fp8_block_gemm_ref_validation():
    a_q, a_s = Q.quant_act_fp8(torch.randn(4, 256))
    w_q, w_s = Q.quant_fp8_block(torch.randn(130, 256))
    with pytest.raises(ValueError, match=r"w_s: expected shape \(2, 2\).*got \(1, 2\)"):
        Q.fp8_block_gemm_ref(a_q, a_s, w_q, w_s[:1])
    with pytest.raises(ValueError, match=r"w_q: expected K = 256"):
        Q.fp8_block_gemm_ref(a_q, a_s, w_q[:, :128], w_s[:, :1])


def test_mxfp4_fp8_gemm_ref():
    a = torch.randn(6, 256, generator=gen(14))
    a[:, 128:] *= 30.0
    w = mxfp4_weight(15, out=40, inp=256)
    a_q, a_s = Q.quant_act_fp8(a)
    w_p, w_sc = Q.quant_mxfp4(w)
    y = Q.mxfp4_fp8_gemm_ref(a_q, a_s, w_p, w_sc)
    assert y.dtype == torch.float32 and y.shape == (6, 40)
    ref = Q.dequant_act(a_q, a_s).double() @ Q.dequant_mxfp4(w_p, w_sc).double().T
    assert rel_err(y, ref) < REL_ERR["gemm_same_math"]
    assert rel_err(y, a.double() @ w.double().T) < REL_ERR["gemm_mxfp4_vs_fp32"]
    with pytest.raises(ValueError, match=r"w_scale: expected shape \(40, 8\)"):
        Q.mxfp4_fp8_gemm_ref(a_q, a_s, w_p, w_sc[:, :4])


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """Comparable view of a tensor: uint8 bytes for 1-byte dtypes (fp8 has no equality on CPU)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    w = mxfp4_weight(16, out=64, inp=256)
    a = torch.randn(8, 256, generator=gen(17))
    cpu = [*Q.quant_mxfp4(w), *Q.quant_fp8_block(w[:, :200], "ue8m0"), *Q.quant_act_fp8(a)]
    dev = [*Q.quant_mxfp4(w.cuda()), *Q.quant_fp8_block(w[:, :200].cuda(), "ue8m0"),
           *Q.quant_act_fp8(a.cuda())]
    # scales divided by constants (amax/448, amax/(6*448) per expert): the GPU must not round them
    # differently (a division by a Python float is a reciprocal multiply there; see Q.div_const)
    ws = torch.randn(32, 64, 256, generator=gen(19)) * torch.logspace(-3, 2, 32)[:, None, None]
    cpu += [*Q.quant_nvfp4(ws), *Q.quant_fp8_block(ws[0] * 1.37, "fp32"), *Q.quant_act_fp8(a * 3.1, ue8m0=False)]
    dev += [*Q.quant_nvfp4(ws.cuda()), *Q.quant_fp8_block(ws[0].cuda() * 1.37, "fp32"),
            *Q.quant_act_fp8(a.cuda() * 3.1, ue8m0=False)]
    for c, d in zip(cpu, dev):
        assert c.dtype == d.dtype and torch.equal(as_bits(c), as_bits(d.cpu()))
    y_cpu = Q.mxfp4_fp8_gemm_ref(cpu[4], cpu[5], cpu[0], cpu[1])
    y_dev = Q.mxfp4_fp8_gemm_ref(dev[4], dev[5], dev[0], dev[1])
    assert rel_err(y_dev.cpu(), y_cpu) < REL_ERR["gemm_same_math"]
    x = torch.randn(4, 128, generator=gen(18)).bfloat16()
    assert torch.equal(Q.sim_fp4_blocks(x.cuda()).cpu(), Q.sim_fp4_blocks(x))
    assert torch.equal(Q.sim_fp8_blocks(x.cuda()).cpu(), Q.sim_fp8_blocks(x))
