"""Triton activation quantisation vs its reference (CPU interpreter; GPU with -m gpu)."""
from __future__ import annotations

import pytest
import torch

from dsv4c.kernels.act_quant import (
    act_quant_fp8,
    act_quant_fp8_ref,
    act_quant_nvfp4,
    act_quant_nvfp4_ref,
)
from dsv4c.kernels.tolerances import KERNEL_REL_ERR, rel_err

from dsv4c import quant as Q


def make_x(m: int, k: int, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-6, 2, k)[torch.randperm(k, generator=g)]
    if m > 2:
        x[1] = 0                                   # amax floor row
        x[2, :16] = 1e-30                          # tiny block
    return x.to(torch.bfloat16).to(device)


@pytest.mark.parametrize("m, k, ue8m0", [(1, 128, True), (37, 384, True), (20, 256, False)])
def test_act_fp8_matches_ref(m, k, ue8m0):
    x = make_x(m, k)
    q, s = act_quant_fp8(x, ue8m0=ue8m0)
    q_ref, s_ref = act_quant_fp8_ref(x, ue8m0=ue8m0)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    deq = Q.dequant_act(q, s)
    assert rel_err(deq, Q.dequant_act(q_ref, s_ref)) <= KERNEL_REL_ERR["act_fp8"]


@pytest.mark.parametrize("m, k", [(1, 16), (19, 176), (5, 256)])
def test_act_nvfp4_matches_ref(m, k):
    x = make_x(m, k, seed=1)
    gs = (x.float().abs().max() / (6 * 448)).reshape(1)
    q, s = act_quant_nvfp4(x, gs)
    q_ref, s_ref = act_quant_nvfp4_ref(x, gs)
    assert torch.equal(s.view(torch.uint8), s_ref.view(torch.uint8))
    assert torch.equal(q, q_ref)
    deq = Q.dequant_act_nvfp4(q, s, gs)
    assert rel_err(deq, Q.dequant_act_nvfp4(q_ref, s_ref, gs)) <= KERNEL_REL_ERR["act_nvfp4"]


def test_act_quant_rejects_bad_input():
    with pytest.raises(ValueError, match="x: K = 100"):
        act_quant_fp8(torch.zeros(2, 100))
    with pytest.raises(ValueError, match="input_scale"):
        act_quant_nvfp4(torch.zeros(2, 32), torch.tensor([1.0, 2.0]))


@pytest.mark.gpu
def test_act_quant_gpu_matches_ref():
    x = make_x(300, 1024, device="cuda")
    q, s = act_quant_fp8(x)
    q_ref, s_ref = act_quant_fp8_ref(x)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    gs = (x.float().abs().max() / (6 * 448)).reshape(1)
    q4, s4 = act_quant_nvfp4(x, gs)
    q4_ref, s4_ref = act_quant_nvfp4_ref(x, gs)
    assert torch.equal(q4, q4_ref) and torch.equal(s4.view(torch.uint8), s4_ref.view(torch.uint8))
