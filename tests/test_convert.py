"""NVFP4 and the format conversions of quant_formats.md §5-6 (dsv4c.quant).

Exactness claims are checked bit for bit on dequantised values; the lossy ones against an
fp32 reference by relative norm, with thresholds from dsv4c.kernels.tolerances.
"""
from __future__ import annotations

import pytest
import torch
from dsv4c.kernels.tolerances import QUANT_REL_ERR, rel_err

from dsv4c import quant as Q


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def mx_with_exponents(exps: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 [O, 32*nb] whose block exponents are `exps` [O, nb]; every block holds
    code 1 (0.5, the smallest non-zero) and code 7 (6.0) so range losses show."""
    o, nb = exps.shape
    codes = torch.randint(0, 16, (o, nb * 32), generator=gen(seed), dtype=torch.uint8)
    codes[:, 0::32] = 1
    codes[:, 1::32] = 7
    return Q.pack_fp4(codes).view(torch.int8), (exps + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_nvfp4_decode_by_hand():
    # code 0x2B: low nibble -1.5, high nibble 1.0; e4m3 0x38 = 1; 0x08 = 2^-6; g = 0.5
    w = torch.tensor([[0x2B] * 8, [0x2B] * 8], dtype=torch.uint8)
    s = torch.tensor([[0x38], [0x08]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    out = Q.dequant_nvfp4(w, s, torch.tensor(0.5))
    assert out[0, :2].tolist() == [-0.75, 0.5]
    assert out[1, :2].tolist() == [-1.5 * 2 ** -7, 2 ** -7]


def test_nvfp4_recipe_matches_modelopt_formula():
    w = torch.randn(64, 128, generator=gen(1))
    q, s, g = Q.quant_nvfp4(w)
    assert g.shape == () and torch.allclose(g, w.abs().max() / (6 * 448))
    amax_b = w.abs().unflatten(-1, (-1, 16)).amax(-1)
    assert torch.equal(s.float(), (amax_b / (6 * g)).to(torch.float8_e4m3fn).float())
    assert rel_err(Q.dequant_nvfp4(q, s, g), w) < QUANT_REL_ERR["nvfp4"]


def test_nvfp4_per_expert_and_shared_global():
    w = torch.randn(3, 32, 64, generator=gen(2)) * torch.tensor([1.0, 10.0, 0.01])[:, None, None]
    q, s, g = Q.quant_nvfp4(w)
    assert g.shape == (3,)
    assert rel_err(Q.dequant_nvfp4(q, s, g), w) < QUANT_REL_ERR["nvfp4"]
    _, _, g2 = Q.quant_nvfp4(w, global_scale=torch.tensor(0.5))
    assert torch.equal(g2, torch.full((3,), 0.5))


def test_nvfp4_activation_roundtrip():
    x = torch.randn(7, 96, generator=gen(3))
    gs = x.abs().max() / (6 * 448)
    p, s = Q.quant_act_nvfp4(x, gs)
    assert p.shape == (7, 48) and s.shape == (7, 6)
    assert rel_err(Q.dequant_act_nvfp4(p, s, gs), x) < QUANT_REL_ERR["nvfp4"]


def test_mxfp4_to_nvfp4_spec_vector():
    w, s = mx_with_exponents(torch.tensor([[3, -5, -14]]))
    out, ws, g, lossy = Q.mxfp4_to_nvfp4(w, s)
    assert g.item() == 2.0 ** -5 and lossy == 0
    assert ws.float()[0].tolist() == [2.0 ** 8] * 2 + [1.0] * 2 + [2.0 ** -9] * 2
    assert torch.equal(out, w.view(torch.uint8))                   # code bytes copied
    assert bits_equal(Q.dequant_nvfp4(out, ws, g), Q.dequant_mxfp4(w, s))


def test_mxfp4_to_nvfp4_exact_on_random_checkpoint_like_tensors():
    wf = torch.randn(4, 64, 256, generator=gen(4)) * torch.logspace(-3, 1, 256)
    w, s = Q.quant_mxfp4(wf)
    out, ws, g, lossy = Q.mxfp4_to_nvfp4(w, s)
    assert lossy == 0 and g.shape == (4,)
    assert bits_equal(Q.dequant_nvfp4(out, ws, g), Q.dequant_mxfp4(w, s))


@pytest.mark.parametrize("spread, exact", [(17, True), (18, False)])
def test_mxfp4_to_nvfp4_exactness_limit(spread, exact):
    w, s = mx_with_exponents(torch.tensor([[0, -spread, -2]]))
    out, ws, g, lossy = Q.mxfp4_to_nvfp4(w, s)
    same = bits_equal(Q.dequant_nvfp4(out, ws, g), Q.dequant_mxfp4(w, s))
    assert same == exact and (lossy == 0) == exact
    if not exact:
        assert lossy == 2                                            # both 16-halves of block 1
        assert ws.float()[0, 2:4].tolist() == [2.0 ** -9] * 2


def test_mxfp4_to_nvfp4_zero_blocks_do_not_set_the_range():
    w, s = mx_with_exponents(torch.tensor([[100, 0, -10]]))
    codes = Q.unpack_fp4(w)
    codes[:, :32] = 0                                                # block with exponent 100 is zero
    w = Q.pack_fp4(codes).view(torch.int8)
    out, ws, g, lossy = Q.mxfp4_to_nvfp4(w, s)
    assert g.item() == 2.0 ** -8 and lossy == 0
    assert ws.float()[0, :2].tolist() == [2.0 ** -9] * 2
    assert bits_equal(Q.dequant_nvfp4(out, ws, g), Q.dequant_mxfp4(w, s))


def test_mxfp4_to_nvfp4_w13_shares_one_global_scale_exactly():
    w1f = torch.randn(3, 64, 128, generator=gen(5))
    w3f = torch.randn(3, 64, 128, generator=gen(6)) * 16                  # larger range than w1
    (w1, s1), (w3, s3) = Q.quant_mxfp4(w1f), Q.quant_mxfp4(w3f)
    a1, b1, a3, b3, g, lossy = Q.mxfp4_to_nvfp4_w13(w1, s1, w3, s3)
    assert lossy == 0 and g.shape == (3,)
    assert bits_equal(Q.dequant_nvfp4(a1, b1, g), Q.dequant_mxfp4(w1, s1))
    assert bits_equal(Q.dequant_nvfp4(a3, b3, g), Q.dequant_mxfp4(w3, s3))
    _, _, g3_alone, _ = Q.mxfp4_to_nvfp4(w3, s3)
    assert torch.equal(g, g3_alone)                                 # max of the two


def test_mxfp4_to_fp8_block_exact_on_released_like_weights():
    wf = torch.randn(2, 256, 384, generator=gen(7))
    w, s = Q.quant_mxfp4(wf)
    q, ts, lossy = Q.mxfp4_to_fp8_block(w, s)
    assert q.shape == (2, 256, 384) and ts.shape == (2, 2, 3) and ts.dtype == torch.float8_e8m0fnu
    assert lossy == 0
    assert bits_equal(Q.dequant_fp8_block(q, ts), Q.dequant_mxfp4(w, s))


@pytest.mark.parametrize("spread, exact", [(14, True), (15, False)])
def test_mxfp4_to_fp8_block_exactness_limit(spread, exact):
    exps = torch.zeros(128, 4, dtype=torch.int64)
    exps[5, 2] = -spread
    w, s = mx_with_exponents(exps)
    q, ts, lossy = Q.mxfp4_to_fp8_block(w, s)
    assert Q.e8m0_to_float(ts).item() == 2.0 ** -6
    assert bits_equal(Q.dequant_fp8_block(q, ts), Q.dequant_mxfp4(w, s)) == exact
    assert lossy == (0 if exact else 1)


def test_mxfp4_to_fp8_block_partial_tiles():
    wf = torch.randn(200, 160, generator=gen(8))
    w, s = Q.quant_mxfp4(wf)
    q, ts, lossy = Q.mxfp4_to_fp8_block(w, s)
    assert q.shape == (200, 160) and ts.shape == (2, 2) and lossy == 0
    assert bits_equal(Q.dequant_fp8_block(q, ts), Q.dequant_mxfp4(w, s))


def test_bf16_conversions():
    w = torch.randn(3, 130, 256, generator=gen(9)).bfloat16()
    q, s = Q.bf16_to_fp8_block(w)
    assert rel_err(Q.dequant_fp8_block(q, s), w.float()) < QUANT_REL_ERR["fp8_block"]
    a, b, g = Q.bf16_to_nvfp4(w)
    assert rel_err(Q.dequant_nvfp4(a, b, g), w.float()) < QUANT_REL_ERR["nvfp4"]


def test_conversion_errors_name_the_tensor():
    w, s = Q.quant_mxfp4(torch.randn(4, 64, generator=gen(10)))
    with pytest.raises(ValueError, match=r"layers\.3\.ffn\.experts\.7\.w1: scale"):
        Q.mxfp4_to_nvfp4(w, s[:, :1], name="layers.3.ffn.experts.7.w1")
    with pytest.raises(ValueError, match=r"experts\.w2: weight"):
        Q.mxfp4_to_fp8_block(w[:, :3], s, name="experts.w2")
    with pytest.raises(ValueError, match=r"head: w: in dim"):
        Q.bf16_to_nvfp4(torch.randn(4, 10), name="head")
    bad = s.view(torch.uint8).clone()
    bad[0, 0] = 255
    with pytest.raises(ValueError, match="w2: scale: holds the ue8m0 NaN"):
        Q.mxfp4_to_nvfp4(w, bad, name="w2")
