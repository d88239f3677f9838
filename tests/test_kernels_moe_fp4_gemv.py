"""FP4 weight-only decode GEMV kernels (dsv4c.kernels.moe_fp4_gemv) vs their reference.

CPU: Triton interpreter (the inline PTX is replaced by the same products in fp32). GPU tests
(-m gpu) run the PTX decoding (PRMT tables, fp16x2 FMAs) at Flash-like shapes.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4c.kernels import moe_grouped as M
from dsv4c.kernels.moe_fp4_gemv import Fp4GemvConfig, moe_fp4_gemv, moe_fp4_gemv_ref
from dsv4c.kernels.tolerances import KERNEL_REL_ERR, rel_err
from moe_cases import float_weights, routing

CONTAINERS = {"mxfp4": M.Mxfp4Experts, "nvfp4": M.Nvfp4Experts}
LIMIT = 0.6


def experts(fmt, e, i, d, seed=0, device="cpu", raw_bytes=False):
    """Quantised from Gaussians, or (raw_bytes) every byte random: all 16 codes in every nibble
    position, scales over a range of exponents."""
    g = torch.Generator().manual_seed(seed)
    if raw_bytes:
        def u8(*s, lo=0, hi=256):
            return torch.randint(lo, hi, s, generator=g, dtype=torch.uint8)
        if fmt == "mxfp4":
            e8 = torch.float8_e8m0fnu
            ex = M.Mxfp4Experts(u8(e, 2 * i, d // 2), u8(e, 2 * i, d // 32, lo=112, hi=128).view(e8),
                                u8(e, d, i // 2), u8(e, d, i // 32, lo=112, hi=128).view(e8))
        else:
            e4 = torch.float8_e4m3fn
            ex = M.Nvfp4Experts(u8(e, 2 * i, d // 2), u8(e, 2 * i, d // 16, lo=0x08, hi=0x50).view(e4),
                                torch.rand(e, generator=g) + 0.5, u8(e, d, i // 2),
                                u8(e, d, i // 16, lo=0x08, hi=0x50).view(e4), torch.rand(e, generator=g) + 0.5)
    else:
        ex = CONTAINERS[fmt].from_float(*float_weights(e, i, d, seed))
    return M.experts_from_tensors(fmt, **{f: (getattr(ex, f).to(device) if getattr(ex, f, None) is not None else None)
                                          for f in ("w13", "w13_scale", "w13_global", "w2", "w2_scale", "w2_global")})


def args_of(x, idx, weight, ex):
    return (x, idx, weight, ex.w13, ex.w13_scale, getattr(ex, "w13_global", None), ex.w2, ex.w2_scale,
            getattr(ex, "w2_global", None), ex.group)


# (T, K, E, D, I, config): D not a multiple of block_k, I not of block_n13 / block_n2
CASES = [(4, 2, 6, 96, 96, Fp4GemvConfig(64, 64, 64, 4)), (3, 3, 5, 96, 64, Fp4GemvConfig(32, 16, 32, 2))]


@pytest.mark.parametrize("case", ["random", "empty_experts", "one_expert_all", "repeated_ids"])
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_gemv_matches_ref(fmt, case):
    t, k, e, d, i, cfg = CASES[0]
    ex = experts(fmt, e, i, d)
    x = (torch.randn(t, d, generator=torch.Generator().manual_seed(3)) * 2).bfloat16()
    idx, weight = routing(case, t, k, e)
    a = args_of(x, idx, weight, ex)
    y = moe_fp4_gemv(*a, LIMIT, cfg)
    assert y.dtype == torch.bfloat16 and y.shape == (t, d)
    assert rel_err(y, moe_fp4_gemv_ref(*a, LIMIT)) < KERNEL_REL_ERR[fmt]
    # the same function as the grouped kernels' reference (h not rounded there)
    assert rel_err(y, M.moe_grouped_ref(x, idx, weight, ex, LIMIT)) < KERNEL_REL_ERR[fmt]


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_gemv_every_code_and_wide_activations(fmt):
    """Random bytes (every e2m1 code in every nibble position, many scale exponents), activations
    spanning 1e-4..1e4, no clamp, second tile config."""
    t, k, e, d, i, cfg = CASES[1]
    ex = experts(fmt, e, i, d, seed=4, raw_bytes=True)
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(t, d, generator=g) * 10.0 ** torch.randint(-4, 5, (t, d), generator=g)).bfloat16()
    idx, weight = routing("random", t, k, e)
    a = args_of(x, idx, weight, ex)
    y = moe_fp4_gemv(*a, 0.0, cfg)
    assert torch.isfinite(y.float()).all()
    assert rel_err(y, moe_fp4_gemv_ref(*a, 0.0)) < KERNEL_REL_ERR[fmt]


@pytest.mark.parametrize("sort", [False, True])
def test_gemv_nvfp4_half_chunks(sort):
    """NVFP4 with D and I multiples of 16 but not of 32: the last 32-column activation chunk of x
    and of h is half full, and GEMM 2's K steps end inside it."""
    t, k, e, d, i = 3, 2, 4, 80, 48
    ex = experts("nvfp4", e, i, d, seed=11)
    x = (torch.randn(t, d, generator=torch.Generator().manual_seed(12)) * 2).bfloat16()
    idx, weight = routing("random", t, k, e)
    a = args_of(x, idx, weight, ex)
    y = moe_fp4_gemv(*a, LIMIT, Fp4GemvConfig(32, 16, 32, 4, sort=sort))
    assert rel_err(y, moe_fp4_gemv_ref(*a, LIMIT)) < KERNEL_REL_ERR["nvfp4"]


def test_default_config_thresholds(monkeypatch):
    """moe_grouped's default: FP4 weight-only GEMV up to max(2E, 16) assignments on sm_89+, the FP8
    prefill kernel from 64 assignments per expert on sm_90+ (the capability is faked; nothing is
    launched)."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    for fmt in ("mxfp4", "nvfp4"):
        assert M.default_config(fmt, 512, 256, cuda).gemv and M.default_config(fmt, 16, 4, cuda).gemv
    assert not M.default_config("nvfp4", 513, 256, cuda).gemv
    assert not M.default_config("bf16", 6, 256, cuda).gemv
    assert not M.default_config("fp8_block", 48, 256, cuda).gemv  # fp8_block's GEMV: one token only (moe_fp8_gemv)
    assert M.default_config("fp8_block", 64 * 256, 256, cuda).fp8_prefill
    assert not M.default_config("fp8_block", 64 * 256 - 1, 256, cuda).fp8_prefill
    assert not M.default_config("mxfp4", 6, 256, torch.device("cpu")).gemv
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))   # A100
    assert not M.default_config("nvfp4", 6, 256, cuda).gemv
    assert not M.default_config("fp8_block", 64 * 256, 256, cuda).fp8_prefill
    with pytest.raises(ValueError, match="config.block_n"):
        ex = experts("mxfp4", 4, 64, 64)
        M.moe_grouped(torch.randn(1, 64).bfloat16(), torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2), ex,
                      LIMIT, M.MoeKernelConfig(block_n=16, gemv=True))


def test_gemv_expert_order_changes_nothing():
    """Programs launched in expert order (sort) compute exactly what the assignment order does."""
    fmt = "nvfp4"
    t, k, e, d, i, _ = CASES[1]
    cfg = Fp4GemvConfig(32, 32, 64, 4)
    ex = experts(fmt, e, i, d, seed=8)
    x = torch.randn(t, d).bfloat16()
    idx, weight = routing("random", t, k, e)
    a = args_of(x, idx, weight, ex)
    assert cfg.sort_experts(t * k, e) and not cfg.sort_experts(1, e)
    y_sorted = moe_fp4_gemv(*a, LIMIT, dataclasses.replace(cfg, sort=True))
    y_plain = moe_fp4_gemv(*a, LIMIT, dataclasses.replace(cfg, sort=False))
    assert torch.equal(y_sorted, y_plain)
    assert rel_err(y_sorted, moe_fp4_gemv_ref(*a, LIMIT)) < KERNEL_REL_ERR[fmt]


def test_gemv_through_moe_grouped_config():
    t, k, e, d, i, _ = CASES[0]
    ex = experts("mxfp4", e, i, d)
    x = torch.randn(t, d).bfloat16()
    idx, weight = routing("random", t, k, e)
    cfg = M.MoeKernelConfig(block_n=32, block_k=64, num_warps=4, gemv=True)
    y = M.moe_grouped(x, idx, weight, ex, LIMIT, cfg)
    direct = moe_fp4_gemv(*args_of(x, idx, weight, ex), LIMIT, Fp4GemvConfig(32, 32, 64, 4))
    assert torch.equal(y, direct)
    bf16 = M.Bf16Experts(torch.randn(e, 256, 128).bfloat16(), torch.randn(e, 128, 128).bfloat16())
    with pytest.raises(ValueError, match="config.gemv"):   # fp8_block has its own GEMV (test_kernels_moe_fp8_gemv)
        M.moe_grouped(torch.randn(t, 128).bfloat16(), idx, weight, bf16, LIMIT, cfg)


def test_gemv_empty_batch():
    ex = experts("nvfp4", 4, 64, 64)
    x = torch.zeros(0, 64, dtype=torch.bfloat16)
    y = moe_fp4_gemv(*args_of(x, torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2), ex), LIMIT)
    assert y.shape == (0, 64)


def test_gemv_errors_name_the_input():
    t, k, e, d, i, _ = CASES[0]
    ex = experts("mxfp4", e, i, d)
    x = torch.randn(t, d).bfloat16()
    idx, weight = routing("random", t, k, e)
    a = list(args_of(x, idx, weight, ex))
    with pytest.raises(ValueError, match="group"):
        moe_fp4_gemv(*a[:-1], 64, LIMIT)
    bad = list(a)
    bad[4] = ex.w13_scale.view(torch.uint8)
    with pytest.raises(ValueError, match="w13_scale"):
        moe_fp4_gemv(*bad, LIMIT)
    bad = list(a)
    bad[0] = x.float()
    with pytest.raises(ValueError, match="x: expected"):
        moe_fp4_gemv(*bad, LIMIT)
    bad = list(a)
    bad[1] = torch.full_like(idx, e)
    with pytest.raises(ValueError, match=r"idx: expert ids must be in \[0, 6\)"):
        moe_fp4_gemv(*bad, LIMIT)
    with pytest.raises(ValueError, match="block_k"):
        moe_fp4_gemv(*a, LIMIT, Fp4GemvConfig(32, 32, 16, 4))
    with pytest.raises(ValueError, match="block_n13"):
        moe_fp4_gemv(*a, LIMIT, Fp4GemvConfig(16, 32, 64, 4))
    bad = list(a)
    s13 = ex.w13_scale.view(torch.uint8)
    bad[3] = torch.cat((ex.w13, ex.w13[:, :1]), 1)           # 2I + 1 rows, scales to match
    bad[4] = torch.cat((s13, s13[:, :1]), 1).view(ex.w13_scale.dtype)
    with pytest.raises(ValueError, match="w13: expected"):
        moe_fp4_gemv(*bad, LIMIT)
    bad = list(a)
    bad[7] = ex.w2_scale.to("meta")
    with pytest.raises(ValueError, match="w2_scale|one device"):
        moe_fp4_gemv(*bad, LIMIT)


@pytest.mark.gpu
@pytest.mark.parametrize("raw", [False, True])
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("t", [1, 8, 64])
def test_gpu_gemv_matches_ref(fmt, t, raw):
    k, e, d, i = 6, 64, 1024, 512
    ex = experts(fmt, e, i, d, device="cuda", raw_bytes=raw)
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(t, d, generator=g) * 2).bfloat16().cuda()
    idx, weight = (v.cuda() for v in routing("random", t, k, e))
    a = args_of(x, idx, weight, ex)
    for cfg in (Fp4GemvConfig(), Fp4GemvConfig(64, 16, 512, 4, sort=True), Fp4GemvConfig(32, 64, 128, 8),
                Fp4GemvConfig(pdl=False)):
        y = moe_fp4_gemv(*a, LIMIT, cfg)
        assert rel_err(y, moe_fp4_gemv_ref(*a, LIMIT)) < KERNEL_REL_ERR[fmt], cfg


@pytest.mark.gpu
def test_gpu_gemv_cuda_graph_capture():
    t, k, e, d, i = 8, 6, 32, 512, 256
    ex = experts("mxfp4", e, i, d, device="cuda")
    x = torch.randn(t, d).bfloat16().cuda()
    idx, weight = (v.cuda() for v in routing("random", t, k, e))
    a = args_of(x, idx, weight, ex)
    moe_fp4_gemv(*a, LIMIT)                                        # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_fp4_gemv(*a, LIMIT)
    idx2, w2 = (v.cuda() for v in routing("one_expert_all", t, k, e, seed=9))
    x.copy_(torch.randn(t, d).bfloat16())
    idx.copy_(idx2)
    weight.copy_(w2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, moe_fp4_gemv(*a, LIMIT))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_gpu_gemv_pdl_chain_in_a_graph(fmt):
    """Programmatic dependent launch: each call reads the previous call's output (directly, and
    through a torch op launched without PDL), replayed in a CUDA graph, bit-equal to the same
    chain run eagerly without PDL. A kernel that read its predecessor's output before its wait
    would differ."""
    t, k, e, d, i = 8, 6, 64, 1024, 512
    ex = experts(fmt, e, i, d, device="cuda")
    x = torch.randn(t, d).bfloat16().cuda()
    idx, weight = (v.cuda() for v in routing("random", t, k, e))

    def chain(cfg):
        y = moe_fp4_gemv(*args_of(x, idx, weight, ex), LIMIT, cfg)
        y = moe_fp4_gemv(*args_of(y, idx, weight, ex), LIMIT, cfg)
        y = moe_fp4_gemv(*args_of(y * 0.5 + x, idx, weight, ex), LIMIT, cfg)
        return moe_fp4_gemv(*args_of(y, idx, weight, ex), LIMIT, cfg)

    want = chain(Fp4GemvConfig(pdl=False))
    assert torch.equal(chain(Fp4GemvConfig(pdl=True)), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = chain(Fp4GemvConfig(pdl=True))
    for _ in range(3):
        got.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want)

