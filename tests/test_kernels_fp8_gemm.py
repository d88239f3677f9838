"""Dense FP8 block GEMM kernels vs their references (CPU interpreter; GPU with -m gpu)."""
from __future__ import annotations

import pytest
import torch

from dsv4c.kernels.fp8_gemm import (
    fp8_gemm_w8a8,
    fp8_gemm_w8a8_ref,
    fp8_gemm_w8a16,
    fp8_gemm_w8a16_ref,
)
from dsv4c.kernels.tolerances import KERNEL_REL_ERR, rel_err

from dsv4c import quant as Q


def operands(m, n, k, scale_fmt, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g) * 0.05
    w_q, w_s = Q.quant_fp8_block(w, scale_fmt=scale_fmt)
    return a.to(device), w_q.to(device), w_s.to(device)


@pytest.mark.parametrize("m, n, k, fmt", [(1, 128, 128, "ue8m0"), (37, 200, 384, "ue8m0"), (70, 130, 256, "fp32")])
def test_w8a8_matches_ref(m, n, k, fmt):
    a, w_q, w_s = operands(m, n, k, fmt)
    a_q, a_s = Q.quant_act_fp8(a)
    y = fp8_gemm_w8a8(a_q, a_s, w_q, w_s)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert rel_err(y, fp8_gemm_w8a8_ref(a_q, a_s, w_q, w_s)) < KERNEL_REL_ERR["gemm_fp8"]


@pytest.mark.parametrize("m, n, k, fmt", [(3, 130, 200, "ue8m0"), (65, 64, 128, "fp32")])
def test_w8a16_matches_ref(m, n, k, fmt):
    a, w_q, w_s = operands(m, n, k, fmt, seed=1)
    y = fp8_gemm_w8a16(a, w_q, w_s)
    assert rel_err(y, fp8_gemm_w8a16_ref(a, w_q, w_s)) < KERNEL_REL_ERR["gemm_fp8_w_bf16_a"]


def test_fp8_gemm_rejects_bad_scales():
    a, w_q, w_s = operands(2, 128, 256, "ue8m0")
    with pytest.raises(ValueError, match="w_s: expected"):
        fp8_gemm_w8a16(a, w_q, w_s[:, :1])
    with pytest.raises(ValueError, match="a_q: expected"):
        fp8_gemm_w8a8(a, torch.ones(2, 2), w_q, w_s)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 300])
def test_fp8_gemms_gpu(m):
    a, w_q, w_s = operands(m, 1000, 1024, "ue8m0", device="cuda")
    a_q, a_s = Q.quant_act_fp8(a)
    assert rel_err(fp8_gemm_w8a8(a_q, a_s, w_q, w_s), fp8_gemm_w8a8_ref(a_q, a_s, w_q, w_s)) < KERNEL_REL_ERR["gemm_fp8"]
    assert rel_err(fp8_gemm_w8a16(a, w_q, w_s), fp8_gemm_w8a16_ref(a, w_q, w_s)) < KERNEL_REL_ERR["gemm_fp8_w_bf16_a"]
