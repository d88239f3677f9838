"""Batch-invariant kernels of the deterministic mode (dsv4c.kernels.batch_invariant).

CPU: the Triton kernels under the interpreter (TRITON_INTERPRET=1, tests/conftest.py), small shapes:
each row is bit-identical whether it is computed alone or among 8 rows, and equals the torch reference
to fp32 rounding. (The interpreter runs the kernel's program structure and K order, not the GPU's MMA
units: the GPU tests below repeat the row check on the device at M = 1/8/64.)
"""
from __future__ import annotations

import pytest
import torch

from dsv4c.kernels.batch_invariant import (
    bi_gemv_gathered,
    bi_gemv_gathered_ref,
    bi_matmul,
    bi_matmul_ref,
    moe_experts_bi_impl,
)


def _rand(*shape, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bi_matmul_rows_do_not_depend_on_m(dtype):
    K, N = 200, 70  # K not a multiple of BLOCK_K, N not of BLOCK_N: the masked tails are exercised
    x, w, b = _rand(8, K, dtype=dtype), _rand(N, K, dtype=dtype, seed=1), _rand(N, dtype=dtype, seed=2)
    y8 = bi_matmul(x, w, b)
    for i in (0, 5, 7):
        assert torch.equal(bi_matmul(x[i:i + 1], w, b), y8[i:i + 1])
    ref = bi_matmul_ref(x, w, b)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (y8.float() - ref.float()).abs().max() <= tol * ref.float().abs().max()
    y32 = bi_matmul(x, w, None, torch.float32)  # the linear_f32 form: bf16 operands, fp32 out
    assert y32.dtype == torch.float32 and torch.equal(bi_matmul(x[3:4], w, None, torch.float32), y32[3:4])


def test_bi_gemv_and_experts_rows_do_not_depend_on_token_count():
    E, N, K, T, C = 5, 24, 150, 8, 3
    x, w = _rand(T, K, dtype=torch.bfloat16), _rand(E, N, K, dtype=torch.bfloat16, seed=1)
    rows = torch.arange(T).repeat_interleave(C)
    experts = torch.randint(0, E, (T * C,), generator=torch.Generator().manual_seed(3))
    y = bi_gemv_gathered(x, rows, experts, w)
    assert (y.float() - bi_gemv_gathered_ref(x, rows, experts, w).float()).abs().max() <= 2e-2 * y.float().abs().max()
    I, D = 16, K
    w1, w3, w2 = _rand(E, I, D, dtype=torch.bfloat16, seed=4), _rand(E, I, D, dtype=torch.bfloat16, seed=5), \
        _rand(E, D, I, dtype=torch.bfloat16, seed=6)
    idx = experts.view(T, C)
    wt = torch.rand(T, C, generator=torch.Generator().manual_seed(7))
    out8 = moe_experts_bi_impl(x, idx, wt, w1, w3, w2, 7.0)
    for i in (0, 6):
        assert torch.equal(moe_experts_bi_impl(x[i:i + 1], idx[i:i + 1], wt[i:i + 1], w1, w3, w2, 7.0), out8[i:i + 1])
    from dsv4c.model.moe import moe_experts_loop
    ref = moe_experts_loop(x.float(), idx, wt, w1.float(), w3.float(), w2.float(), 7.0)
    assert (out8.float() - ref).abs().max() <= 3e-2 * ref.abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bi_matmul_rows_on_gpu(dtype):
    K, N = 4096, 1536  # a Flash q_a-like projection
    x, w = _rand(64, K, dtype=dtype, device="cuda"), _rand(N, K, dtype=dtype, device="cuda", seed=1)
    y64 = bi_matmul(x, w)
    for m in (1, 8):
        assert torch.equal(bi_matmul(x[:m], w), y64[:m])
    ref = bi_matmul_ref(x, w)
    assert (y64.float() - ref.float()).abs().max() <= 1e-2 * ref.float().abs().max()
    rows = torch.arange(64, device="cuda")
    e = torch.zeros(64, dtype=torch.int64, device="cuda")
    g64 = bi_gemv_gathered(x, rows, e, w[None])
    assert torch.equal(bi_gemv_gathered(x[:1], rows[:1], e[:1], w[None]), g64[:1])
