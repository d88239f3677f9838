"""The routed experts' combine step (kernels/moe_combine.py): Triton under the interpreter vs torch."""
from __future__ import annotations

import pytest
import torch

from dsv4c.kernels.moe_combine import combine_slots, combine_slots_ref
from dsv4c.kernels.tolerances import rel_err


@pytest.mark.parametrize("t,topk,d,dtype,sorted_rows", [
    (1, 6, 96, torch.bfloat16, False),
    (5, 2, 40, torch.float32, False),
    (3, 4, 1100, torch.bfloat16, True),    # D over one block, not a multiple of it; gathered rows
    (4, 3, 64, torch.float32, True),
    (0, 2, 32, torch.bfloat16, False),     # no tokens: no launch
])
def test_matches_the_torch_sum(t, topk, d, dtype, sorted_rows):
    g = torch.Generator().manual_seed(t * 100 + d)
    n = t * topk + (7 if sorted_rows else 0)  # the sorted layout has padding rows
    y = torch.randn(n, d, generator=g).to(dtype)
    inv = torch.randperm(n, generator=g)[: t * topk] if sorted_rows else None
    got = combine_slots(y, inv, topk, torch.empty(t, d, dtype=dtype))
    want = combine_slots_ref(y, inv, topk, torch.empty(t, d, dtype=dtype))
    exact = (y[inv] if sorted_rows else y[: t * topk]).double().view(t, topk, d).sum(1)
    assert got.shape == (t, d)
    if t:
        limit = 1e-6 if dtype == torch.float32 else 1e-2  # one bf16 rounding (the interpreter truncates)
        assert rel_err(got, exact) <= limit and rel_err(want, exact) <= limit
        if t > 1:
            assert rel_err(got, exact.roll(1, 0)) > 0.1  # rows land on their own token


def test_fp32_partials_into_bf16():
    y = torch.randn(12, 64, dtype=torch.float32)
    got = combine_slots(y, None, 3, torch.empty(4, 64, dtype=torch.bfloat16))
    assert rel_err(got, y.view(4, 3, 64).double().sum(1)) <= 1e-2


@pytest.mark.parametrize("kw,err", [
    ({"y": torch.zeros(6, 8), "out": torch.zeros(2, 9)}, "share D"),
    ({"y": torch.zeros(5, 8), "out": torch.zeros(2, 8)}, "direct layout needs"),
    ({"y": torch.zeros(6, 8, dtype=torch.float64), "out": torch.zeros(2, 8)}, "bf16/fp16/fp32"),
    ({"y": torch.zeros(6, 8), "out": torch.zeros(2, 8), "inv": torch.zeros(5, dtype=torch.int64)}, "inv must be"),
    ({"y": torch.zeros(8, 6).t(), "out": torch.zeros(2, 8)}, "unit stride"),
])
def test_bad_input(kw, err):
    with pytest.raises(ValueError, match=err):
        combine_slots(kw["y"], kw.get("inv"), 3, kw["out"])


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 64])
def test_on_cuda_at_flash_shapes(t):
    y = torch.randn(t * 6, 4096, device="cuda").bfloat16()
    got = combine_slots(y, None, 6, torch.empty(t, 4096, dtype=torch.bfloat16, device="cuda"))
    assert rel_err(got, y.double().view(t, 6, 4096).sum(1)) <= 5e-3


def test_combine_pdl_needs_a_hopper_gpu():
    y = torch.randn(4, 8)
    with pytest.raises(ValueError, match="pdl needs a CUDA GPU"):
        combine_slots(y, None, 2, torch.empty(2, 8), pdl=True)
