"""FP8 block expert decode GEMVs (dsv4c.kernels.moe_fp8_gemv) vs moe_grouped's fp8_block reference
(W8A8: x and h quantised per 128 columns) and vs the tensor-core tile.

CPU: Triton interpreter. GPU tests (-m gpu): Flash's expert shape (D 4096, I 2048) at 1 and 8 tokens,
CUDA-graph capture, and the default config's choice.
"""
from __future__ import annotations

import pytest
import torch

from dsv4c.kernels import moe_grouped as M
from dsv4c.kernels.moe_fp8_gemv import Fp8GemvMoeConfig, moe_fp8_gemv
from dsv4c.kernels.tolerances import KERNEL_REL_ERR, rel_err
from moe_cases import float_weights, inputs, routing

LIMIT = 0.6
TOL = KERNEL_REL_ERR["fp8_block"]


def experts(e, i, d, seed=0, device="cpu"):
    ex = M.Fp8BlockExperts.from_float(*float_weights(e, i, d, seed))
    return M.Fp8BlockExperts(*(getattr(ex, f).to(device) for f in ("w13", "w13_scale", "w2", "w2_scale")))


def gemv(x, idx, weight, ex, limit=LIMIT, cfg=None):
    return moe_fp8_gemv(x, idx, weight, ex.w13, ex.w13_scale, ex.w2, ex.w2_scale, limit, cfg)


def tile(x, idx, weight, ex, limit=LIMIT):
    return M.moe_grouped(x, idx, weight, ex, limit, M.MoeKernelConfig(16, 64, 128, 4, 4, direct=True))


CASES = ["random", "empty_experts", "one_expert_all", "repeated_ids"]


# every routing case on the first config; the second (other tiles, a 256-column K step, weights after the PDL
# wait) on a random routing and on repeated ids
@pytest.mark.parametrize("cfg,case", [(Fp8GemvMoeConfig(32, 32, 128, 4), c) for c in CASES]
                         + [(Fp8GemvMoeConfig(16, 64, 256, 2, False), c) for c in ("random", "repeated_ids")])
def test_gemv_matches_ref_and_tile(cfg, case):
    """Random weights, routing weights and activations, a SwiGLU clamp; K steps past K (256 / 384 with
    a 256-column step) masked. The tile computes the same W8A8 function: the two agree to fp32
    summation order (and an e4m3 flip of h that it may cause)."""
    t, k, e, d, i = 3, 2, 6, 384, 256
    ex = experts(e, i, d, seed=1)
    x = inputs(t, d, seed=3)
    idx, weight = routing(case, t, k, e)
    y = gemv(x, idx, weight, ex, cfg=cfg)
    assert y.dtype == torch.bfloat16 and y.shape == (t, d)
    ref = M.moe_grouped_ref(x, idx, weight, ex, LIMIT)
    assert rel_err(y, ref) < TOL
    assert rel_err(y, tile(x, idx, weight, ex)) < TOL
    assert rel_err(gemv(x, idx.int(), weight, ex, cfg=cfg), ref) < TOL   # int32 ids


def test_gemv_without_clamp_and_wide_activations():
    """No SwiGLU clamp; activations spanning 1e-3..1e3 (per-128 scales over many exponents)."""
    t, k, e, d, i = 2, 3, 5, 256, 128
    ex = experts(e, i, d, seed=4)
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(t, d, generator=g) * 10.0 ** torch.randint(-3, 4, (t, d), generator=g)).bfloat16()
    idx, weight = routing("random", t, k, e)
    y = gemv(x, idx, weight, ex, 0.0)
    assert torch.isfinite(y.float()).all()
    assert rel_err(y, M.moe_grouped_ref(x, idx, weight, ex, 0.0)) < TOL


def test_gemv_through_moe_grouped_config(monkeypatch):
    """MoeKernelConfig(gemv=True) on fp8_block experts runs this GEMV; default_config picks it up to
    FP8_GEMV_MAX_ASSIGN assignments and E/4 on sm_89+ (capability faked; nothing launched there)."""
    t, k, e, d, i = 2, 2, 4, 256, 128
    ex = experts(e, i, d)
    x = inputs(t, d)
    idx, weight = routing("random", t, k, e)
    cfg = M.MoeKernelConfig(block_n=32, block_k=128, num_warps=4, gemv=True)
    assert torch.equal(M.moe_grouped(x, idx, weight, ex, LIMIT, cfg),
                       gemv(x, idx, weight, ex, cfg=Fp8GemvMoeConfig(16, 32, 128, 4)))
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert M.default_config("fp8_block", 6, 256, cuda).gemv          # the default (8): one token of Flash's top-6
    assert not M.default_config("fp8_block", 48, 256, cuda).gemv     # batch 8: the tile
    monkeypatch.setattr(M, "FP8_GEMV_MAX_ASSIGN", 64)
    assert M.default_config("fp8_block", 6, 256, cuda).gemv and M.default_config("fp8_block", 48, 256, cuda).gemv
    assert not M.default_config("fp8_block", 65, 256, cuda).gemv        # past FP8_GEMV_MAX_ASSIGN
    assert not M.default_config("fp8_block", 17, 32, cuda).gemv         # past max(E/4, 16)
    monkeypatch.setattr(M, "FP8_GEMV_MAX_ASSIGN", 0)
    assert not M.default_config("fp8_block", 6, 256, cuda).gemv
    monkeypatch.setattr(M, "FP8_GEMV_MAX_ASSIGN", 64)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert not M.default_config("fp8_block", 6, 256, cuda).gemv


def test_gemv_empty_batch():
    ex = experts(4, 128, 128)
    y = gemv(torch.zeros(0, 128, dtype=torch.bfloat16), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2), ex)
    assert y.shape == (0, 128)


def test_gemv_errors_name_the_input():
    t, k, e, d, i = 2, 2, 4, 256, 128
    ex = experts(e, i, d)
    x = inputs(t, d)
    idx, weight = routing("random", t, k, e)
    with pytest.raises(ValueError, match="w13_scale"):
        moe_fp8_gemv(x, idx, weight, ex.w13, ex.w13_scale[:, :1], ex.w2, ex.w2_scale, LIMIT)
    with pytest.raises(ValueError, match="w13: expected"):
        moe_fp8_gemv(x, idx, weight, ex.w13.float(), ex.w13_scale, ex.w2, ex.w2_scale, LIMIT)
    with pytest.raises(ValueError, match="w2: expected"):
        moe_fp8_gemv(x, idx, weight, ex.w13, ex.w13_scale, ex.w2[:, :128], ex.w2_scale, LIMIT)
    with pytest.raises(ValueError, match="x: expected"):
        gemv(x.float(), idx, weight, ex)
    with pytest.raises(ValueError, match=r"idx: expert ids must be in \[0, 4\)"):
        gemv(x, torch.full_like(idx, e), weight, ex)
    with pytest.raises(ValueError, match="weight: expected"):
        gemv(x, idx, weight[:, :1], ex)
    with pytest.raises(ValueError, match="block_k"):
        gemv(x, idx, weight, ex, cfg=Fp8GemvMoeConfig(32, 32, 192, 4))
    with pytest.raises(ValueError, match="block_n2"):
        gemv(x, idx, weight, ex, cfg=Fp8GemvMoeConfig(32, 256, 128, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8])
def test_gpu_gemv_matches_ref_and_tile(t):
    """Flash's expert shape (16 of them), top-6, on the device: against the reference and the tile."""
    k, e, d, i = 6, 16, 4096, 2048
    ex = experts(e, i, d, device="cuda")
    x = inputs(t, d, device="cuda")
    idx, weight = (v.cuda() for v in routing("random", t, k, e))
    ref = M.moe_grouped_ref(x, idx, weight, ex, LIMIT)
    for cfg in (None, Fp8GemvMoeConfig(64, 32, 256, 4), Fp8GemvMoeConfig(early_weights=False)):
        y = gemv(x, idx, weight, ex, cfg=cfg)
        assert rel_err(y, ref) < TOL, cfg
    assert rel_err(y, tile(x, idx, weight, ex)) < TOL


@pytest.mark.gpu
def test_gpu_gemv_cuda_graph_capture():
    """Captured once, replayed on new activations and routing: the eager call's bits."""
    t, k, e, d, i = 8, 6, 32, 1024, 512
    ex = experts(e, i, d, device="cuda")
    x = inputs(t, d, device="cuda")
    idx, weight = (v.cuda() for v in routing("random", t, k, e))
    gemv(x, idx, weight, ex)                                        # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv(x, idx, weight, ex)
    idx2, w2 = (v.cuda() for v in routing("one_expert_all", t, k, e, seed=9))
    x.copy_(inputs(t, d, seed=10, device="cuda"))
    idx.copy_(idx2)
    weight.copy_(w2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, gemv(x, idx, weight, ex))
