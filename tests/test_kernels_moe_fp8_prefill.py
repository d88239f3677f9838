"""FP8-block prefill MoE kernels (dsv4c.kernels.moe_fp8_prefill) vs moe_grouped_ref and moe_grouped.

CPU: Triton interpreter, small shapes, small BLOCK_M (several M-blocks, rows not a multiple of
it). GPU tests: -m gpu on the device machine.
"""
from __future__ import annotations

import pytest
import torch

from dsv4c.kernels import moe_fp8_prefill as P
from dsv4c.kernels import moe_grouped as M
from dsv4c.kernels.tolerances import KERNEL_REL_ERR, rel_err
from moe_cases import float_weights, inputs, routing

TOL = KERNEL_REL_ERR["fp8_block"]


def experts(e: int, i: int, d: int, seed: int = 0, device="cpu") -> M.Fp8BlockExperts:
    ex = M.Fp8BlockExperts.from_float(*float_weights(e, i, d, seed))
    if device == "cpu":
        return ex
    return M.Fp8BlockExperts(*(getattr(ex, f).to(device) for f in ("w13", "w13_scale", "w2", "w2_scale")))


# CPU configs: the default path (TMA descriptors, persistent grid of 3 programs, GEMM 2 two halves)
# and the pointer-load path (one program per tile, one half); BLOCK_M 16 so experts span M-blocks
CPU_CONFIGS = {
    "tma_persistent": P.Fp8PrefillConfig(block_m=16, num_sms=3, group_m=2),
    "pointers_grid": P.Fp8PrefillConfig(block_m=16, tma=False, persistent=False, gemm2_halves=1, group_m=3),
}


@pytest.mark.parametrize("case", ["random", "empty_experts", "one_expert_all", "repeated_ids"])
@pytest.mark.parametrize("cfg", list(CPU_CONFIGS))
def test_matches_ref_and_moe_grouped(case, cfg):
    t, k, e, d, i = 37, 3, 6, 256, 256       # 111 assignments: no expert's row count is a multiple of 16
    ex = experts(e, i, d)
    idx, w = routing(case, t, k, e)
    x = inputs(t, d)
    y = P.moe_fp8_prefill(x, idx, w, ex, 0.6, CPU_CONFIGS[cfg])
    assert y.dtype == torch.bfloat16 and y.shape == (t, d)
    ref = P.moe_fp8_prefill_ref(x, idx, w, ex, 0.6)
    assert float(ref.norm()) > 0
    assert rel_err(y, ref) < TOL
    assert rel_err(y, M.moe_grouped(x, idx, w, ex, 0.6)) < TOL


def test_no_clamp_odd_d_int32_idx():
    """L <= 0 disables the clamp; D = 3*128 forces one GEMM 2 half; int32 ids."""
    t, k, e, d, i = 21, 2, 4, 384, 128
    ex = experts(e, i, d, seed=3)
    idx, w = routing("random", t, k, e, seed=4)
    x = inputs(t, d, seed=5) * 4     # large enough that a clamp at 0.6 would change the result
    y = P.moe_fp8_prefill(x, idx.int(), w, ex, 0.0, P.Fp8PrefillConfig(block_m=16, num_sms=2))
    ref = P.moe_fp8_prefill_ref(x, idx, w, ex, 0.0)
    assert rel_err(y, ref) < TOL
    assert rel_err(P.moe_fp8_prefill_ref(x, idx, w, ex, 0.6), ref) > 10 * TOL   # the clamp matters here


def test_zero_tokens_and_bad_input():
    ex = experts(4, 128, 128)
    x = torch.zeros(0, 128, dtype=torch.bfloat16)
    assert P.moe_fp8_prefill(x, torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2), ex, 0.6).shape == (0, 128)
    x = inputs(3, 128)
    idx, w = routing("random", 3, 2, 4)
    with pytest.raises(ValueError, match="config.block_m"):
        P.moe_fp8_prefill(x, idx, w, ex, 0.6, P.Fp8PrefillConfig(block_m=48))
    with pytest.raises(ValueError, match="config.gemm2_halves"):
        P.moe_fp8_prefill(x, idx, w, ex, 0.6, P.Fp8PrefillConfig(gemm2_halves=3))
    bf = M.Bf16Experts.from_float(*(torch.randn(4, 128, 128),) * 3)
    with pytest.raises(ValueError, match="Fp8BlockExperts"):
        P.moe_fp8_prefill(x, idx, w, bf, 0.6)
    with pytest.raises(ValueError, match="x: expected bf16"):
        P.moe_fp8_prefill(x.float(), idx, w, ex, 0.6)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [300, 2000])
def test_gpu_matches_ref_and_graph(t):
    dev = torch.device("cuda")
    k, e, d, i = 6, 16, 512, 256
    ex = experts(e, i, d, device=dev)
    idx, w = routing("random", t, k, e)
    idx, w, x = idx.to(dev), w.to(dev), inputs(t, d).to(dev)
    y = P.moe_fp8_prefill(x, idx, w, ex, 0.6)
    ref = P.moe_fp8_prefill_ref(x, idx, w, ex, 0.6)
    assert rel_err(y, ref) < TOL
    assert rel_err(y, M.moe_grouped(x, idx, w, ex, 0.6)) < TOL
    for cfg in CPU_CONFIGS.values():   # the other code paths at the device's tile size
        assert rel_err(P.moe_fp8_prefill(x, idx, w, ex, 0.6, P.Fp8PrefillConfig(
            block_m=128, tma=cfg.tma, persistent=cfg.persistent, gemm2_halves=cfg.gemm2_halves)), ref) < TOL
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yg = P.moe_fp8_prefill(x, idx, w, ex, 0.6)
    x.mul_(-1.0)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(yg, P.moe_fp8_prefill_ref(x, idx, w, ex, 0.6)) < TOL
