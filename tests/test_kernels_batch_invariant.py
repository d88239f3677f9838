"""Batch-invariant kernels of the deterministic mode (dsv4c.kernels.batch_invariant).

CPU: the Triton kernels under the interpreter (TRITON_INTERPRET=1, tests/conftest.py), small shapes:
each row is bit-identical whether it is computed alone or among 8 rows, and equals the torch reference
to fp32 rounding. (The interpreter runs the kernel's program structure and K order, not the GPU's MMA
units: the GPU tests below repeat the row check on the device at M = 1/8/64.)
"""
from __future__ import annotations

import functools
import textwrap

import pytest
import torch

from dsv4c.kernels.batch_invariant import (
    bi_gemv_gathered,
    bi_gemv_gathered_ref,
    bi_matmul,
    bi_matmul_fp8,
    bi_matmul_fp8_ref,
    bi_matmul_ref,
    bi_split,
    moe_experts_bi_impl,
    row_sum,
)
from sm90_compile import run_sm90_script


def _rand(*shape, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("split", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bi_matmul_rows_do_not_depend_on_m(dtype, split, decode):
    """Rows alone equal rows among 20, with and without a K split (split 4 over K = 200: ranges of 64 or 128
    columns, the last one partly masked), on the 64 x 64 tile and the decode tile (20 rows: two 16-row
    tiles); the split moves the sums' grouping, so its bits may differ from split 1's."""
    K, N = 200, 70  # K not a multiple of BLOCK_K, N not of BLOCK_N: the masked tails are exercised
    x, w, b = _rand(20, K, dtype=dtype), _rand(N, K, dtype=dtype, seed=1), _rand(N, dtype=dtype, seed=2)
    y20 = bi_matmul(x, w, b, split=split, decode=decode)
    for i in (0, 5, 17):
        assert torch.equal(bi_matmul(x[i:i + 1], w, b, split=split, decode=decode), y20[i:i + 1])
    assert torch.equal(bi_matmul(x[:8], w, b, split=split, decode=decode), y20[:8])
    if decode:  # 70 rows: two programs of four 16-row groups (decode_groups), the last group partly masked
        x70 = torch.cat([x, _rand(50, K, dtype=dtype, seed=3)])
        y70 = bi_matmul(x70, w, b, split=split, decode=True)
        assert torch.equal(y70[:20], y20)
        assert torch.equal(bi_matmul(x70[66:67], w, b, split=split, decode=True), y70[66:67])
        assert torch.equal(bi_matmul(x70[40:50], w, b, split=split, decode=True), y70[40:50])
    ref = bi_matmul_ref(x, w, b)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (y20.float() - ref.float()).abs().max() <= tol * ref.float().abs().max()
    y32 = bi_matmul(x, w, None, torch.float32, split, decode)  # the linear_f32 form: bf16 operands, fp32 out
    assert y32.dtype == torch.float32
    assert torch.equal(bi_matmul(x[3:4], w, None, torch.float32, split, decode), y32[3:4])
    assert (y32 - bi_matmul_ref(x, w, None, torch.float32)).abs().max() <= 1e-5 * y32.abs().max()


@pytest.mark.parametrize("fp8", [False, True])
def test_decode_tile_with_8_groups_gives_the_4_group_bits(fp8, monkeypatch):
    """DECODE_MAX_GROUPS 8 (the verify's 65+ rows: each weight tile read once per 128 rows): 150 rows run as one
    8-group program and a partly masked one; every row equals the 4-group launch's and its own launch alone."""
    from dsv4c import quant as Q
    from dsv4c.kernels import batch_invariant as bi

    K, N = (256 if fp8 else 200), 70   # FP8: whole 128-column scale tiles
    x = _rand(150, K, dtype=torch.bfloat16)
    if fp8:
        w_q, w_s = Q.quant_fp8_block(_rand(N, K, dtype=torch.float32, seed=1) * 0.05, scale_fmt="ue8m0")
        mm = lambda a: bi_matmul_fp8(a, w_q, w_s, split=2, decode=True)  # noqa: E731
    else:
        w, b = _rand(N, K, dtype=torch.bfloat16, seed=1), _rand(N, dtype=torch.bfloat16, seed=2)
        mm = lambda a: bi_matmul(a, w, b, split=2, decode=True)  # noqa: E731
    assert bi.decode_groups(150) == 4
    y4 = mm(x)
    monkeypatch.setattr(bi, "DECODE_MAX_GROUPS", 8)
    assert [bi.decode_groups(m) for m in (16, 32, 64, 65, 150)] == [1, 2, 4, 8, 8]
    y8 = mm(x)
    assert torch.equal(y8, y4)
    for lo, hi in ((0, 1), (127, 129), (140, 150)):
        assert torch.equal(mm(x[lo:hi]), y8[lo:hi])
    monkeypatch.setattr(bi, "DECODE_MAX_GROUPS", 6)
    with pytest.raises(ValueError, match="DECODE_MAX_GROUPS: expected 4 or 8, got 6"):
        mm(x)


@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("split, fmt", [(1, "ue8m0"), (2, "fp32")])
def test_bi_matmul_fp8_rows_do_not_depend_on_m(split, fmt, decode):
    """FP8 block weights (e4m3 + one scale per 128x128 tile, e8m0 or fp32): rows alone equal rows among 20
    on both tiles, with a K split; close to the fp32 product with the dequantised weight (whose bf16 form
    `bi_matmul` would run: the two differ by the order of the scale's multiplication only)."""
    from dsv4c import quant as Q

    K, N = 384, 200  # three scale columns, two scale rows (the second partial): tails masked
    x = _rand(20, K, dtype=torch.bfloat16)
    w_q, w_s = Q.quant_fp8_block(_rand(N, K, dtype=torch.float32, seed=1) * 0.05, scale_fmt=fmt)
    y20 = bi_matmul_fp8(x, w_q, w_s, split=split, decode=decode)
    assert y20.dtype == torch.bfloat16 and y20.shape == (20, N)
    for i in (0, 7, 19):
        assert torch.equal(bi_matmul_fp8(x[i:i + 1], w_q, w_s, split=split, decode=decode), y20[i:i + 1])
    assert torch.equal(bi_matmul_fp8(x[:8], w_q, w_s, split=split, decode=decode), y20[:8])
    if decode:  # 40 rows: four 16-row groups in one program, the last one partly masked
        x40 = torch.cat([x, _rand(20, K, dtype=torch.bfloat16, seed=3)])
        y40 = bi_matmul_fp8(x40, w_q, w_s, split=split, decode=True)
        assert torch.equal(y40[:20], y20)
        assert torch.equal(bi_matmul_fp8(x40[37:38], w_q, w_s, split=split, decode=True), y40[37:38])
    ref = bi_matmul_fp8_ref(x, w_q, w_s, torch.float32)
    assert (y20.float() - ref).abs().max() <= 1e-2 * ref.abs().max()
    if fmt == "ue8m0":  # the bytes as the op takes them from a graph (uint8) give the same bits
        assert torch.equal(bi_matmul_fp8(x, w_q, w_s.view(torch.uint8), split=split, decode=decode), y20)
    with pytest.raises(ValueError, match="w_s"):
        bi_matmul_fp8(x, w_q, w_s[:1, :1])
    with pytest.raises(ValueError, match="x bf16"):
        bi_matmul_fp8(x.float(), w_q, w_s)


def test_bi_split_comes_from_the_weight_shape_only():
    """The slice's decode shapes get a split that fills the GPU; the head and the wide projections none;
    bad splits are refused."""
    # wq_a || wkv, wo_a's group, wo_b, shared w2: 24 / 16 / 64 / 64 tiles of 64 rows
    assert [bi_split(n, k) for n, k in ((1536, 4096), (1024, 4096), (4096, 8192), (4096, 2048))] == [8, 8, 8, 4]
    assert bi_split(129280, 4096) == bi_split(40960, 1024) == 1
    assert bi_split(1536, 512) == 1  # K of 4 decode steps: one split keeps them all
    with pytest.raises(ValueError, match="power of two"):
        bi_matmul(_rand(1, 64, dtype=torch.float32), _rand(8, 64, dtype=torch.float32), split=3)


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


def test_hc_pre_rows_and_sum_rows_do_not_depend_on_m():
    """hc_pre with one row per program (`dsv4c::hc_pre_rows`'s CUDA path) under the interpreter, and
    sum_bi's CPU path (slices added in index order)."""
    from dsv4c.kernels.batch_invariant import sum_bi
    from dsv4c.kernels.mhc import hc_pre

    N, D, mix = 4, 40, 24
    X = _rand(8, N, D, dtype=torch.float32)
    fn = _rand(mix, N * D, dtype=torch.float32, seed=1) / (N * D) ** 0.5
    base, scale = 0.3 * _rand(mix, dtype=torch.float32, seed=2), 0.5 + torch.rand(3)
    full = hc_pre(X, fn, base, scale, 1e-6, 1e-6, 20, chunk=64, rows=True)
    for i in (0, 7):
        one = hc_pre(X[i:i + 1], fn, base, scale, 1e-6, 1e-6, 20, chunk=64, rows=True)
        assert all(torch.equal(a, b[i:i + 1]) for a, b in zip(one, full))
    s8 = sum_bi(X, -2, False, False)
    assert torch.equal(sum_bi(X[2:3], -2, False, False), s8[2:3])
    assert torch.allclose(s8, X.sum(-2), rtol=1e-6, atol=1e-6)
    assert torch.allclose(sum_bi(X, -1, True, True), X.mean(-1, keepdim=True), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_sum_rows_do_not_depend_on_m(dtype):
    """row_sum (sum_bi over the last dim on a GPU) under the interpreter: K = 2500 spans three 1024-lane steps,
    the last one masked; a row alone equals the row among 9, and the sums equal torch's to fp32 rounding."""
    x = _rand(9, 1, 2500, dtype=dtype)
    s9 = row_sum(x)
    assert s9.shape == (9, 1) and s9.dtype == torch.float32
    for i in (0, 4, 8):
        assert torch.equal(row_sum(x[i:i + 1]), s9[i:i + 1])
    assert torch.allclose(s9, x.float().sum(-1), rtol=1e-5, atol=1e-4)
    assert row_sum(x[:0]).shape == (0, 1)
    with pytest.raises(ValueError, match="row_sum"):
        row_sum(x.to(torch.int32))


@pytest.mark.gpu
def test_invariant_ops_rows_on_gpu():
    """The custom ops' CUDA paths: rows at M = 1 and 8 equal rows of M = 64, bit for bit."""
    ops = torch.ops.dsv4c
    x = _rand(64, 1, 512, dtype=torch.bfloat16, device="cuda")
    s = ops.sum_bi(x.float(), -1, True, True)
    assert torch.equal(ops.sum_bi(x[:1].float(), -1, True, True), s[:1])
    h = _rand(64, 1, 16384, dtype=torch.float32, device="cuda")  # the head's mean over hc x D at Flash dims
    m = ops.sum_bi(h, -1, True, True)
    assert torch.equal(ops.sum_bi(h[:1], -1, True, True), m[:1])
    assert torch.equal(ops.sum_bi(h[:8], -1, True, True), m[:8])
    assert torch.allclose(m, h.mean(-1, keepdim=True), rtol=1e-5, atol=1e-6)
    xg, wg = _rand(64, 1, 4, 256, dtype=torch.bfloat16, device="cuda"), _rand(4, 64, 256, dtype=torch.bfloat16,
                                                                              device="cuda", seed=1)
    for split, decode in ((1, False), (2, False), (1, True), (2, True)):
        z = ops.grouped_linear_bi(xg, wg, split, decode)
        assert torch.equal(ops.grouped_linear_bi(xg[:8], wg, split, decode), z[:8])
        assert torch.equal(ops.grouped_linear_bi(xg[:1], wg, split, decode), z[:1])
    E, I, D, C = 16, 128, 512, 6
    w1, w3 = _rand(E, I, D, dtype=torch.bfloat16, device="cuda", seed=2), _rand(E, I, D, dtype=torch.bfloat16,
                                                                                device="cuda", seed=3)
    w2 = _rand(E, D, I, dtype=torch.bfloat16, device="cuda", seed=4)
    xe = x[:, 0]
    idx = torch.stack([torch.randperm(E)[:C] for _ in range(64)]).cuda()
    wt = torch.rand(64, C, device="cuda")
    y = ops.moe_experts_bi(xe, idx, wt, w1, w3, w2, 7.0)
    for m in (1, 8):
        assert torch.equal(ops.moe_experts_bi(xe[:m], idx[:m], wt[:m], w1, w3, w2, 7.0), y[:m])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bi_matmul_rows_on_gpu(dtype):
    K, N = 4096, 1536  # a Flash q_a-like projection
    x, w = _rand(100, K, dtype=dtype, device="cuda"), _rand(N, K, dtype=dtype, device="cuda", seed=1)
    ref = bi_matmul_ref(x, w)
    for split, decode in ((1, False), (1, True), (bi_split(N, K), True)):  # 8: the decode graphs' split
        y100 = bi_matmul(x, w, split=split, decode=decode)
        for m in (1, 8, 17, 40, 64):  # the decode tile's groups per program: 1, 1, 2, 4, 4 (100 rows: 4)
            assert torch.equal(bi_matmul(x[:m], w, split=split, decode=decode), y100[:m]), (split, decode, m)
        assert torch.equal(bi_matmul(x[70:71], w, split=split, decode=decode), y100[70:71])
        assert (y100.float() - ref.float()).abs().max() <= 1e-2 * ref.float().abs().max()
    b = _rand(N, dtype=dtype, device="cuda", seed=2)
    yb = bi_matmul(x, w, b, split=8, decode=True)
    assert torch.equal(bi_matmul(x[:1], w, b, split=8, decode=True), yb[:1])
    assert (yb.float() - bi_matmul_ref(x, w, b).float()).abs().max() <= 1e-2 * ref.float().abs().max()
    rows = torch.arange(64, device="cuda")
    e = torch.zeros(64, dtype=torch.int64, device="cuda")
    g64 = bi_gemv_gathered(x, rows, e, w[None])
    assert torch.equal(bi_gemv_gathered(x[:1], rows[:1], e[:1], w[None]), g64[:1])


@pytest.mark.gpu
def test_bi_matmul_weights_from_registers_on_gpu(monkeypatch):
    """DECODE_A_REG_MIN_GROUPS = 4 (the default): the 4-group programs feed the MMAs the weight tile from
    registers; 0 turns it off. The MMA's products and K order are the same, so every row equals the
    shared-memory path's bits, and a row in a 4-group program (A from registers) equals the same row alone
    (1 group, A from shared memory)."""
    import dsv4c.kernels.batch_invariant as bi

    K, N = 4096, 1536
    x, w = _rand(100, K, dtype=torch.bfloat16, device="cuda"), _rand(N, K, dtype=torch.bfloat16, device="cuda", seed=1)
    split = bi_split(N, K)
    monkeypatch.setattr(bi, "DECODE_A_REG_MIN_GROUPS", 0)
    before = bi_matmul(x, w, split=split, decode=True)
    monkeypatch.setattr(bi, "DECODE_A_REG_MIN_GROUPS", 4)
    y100 = bi_matmul(x, w, split=split, decode=True)
    assert torch.equal(y100, before)
    for m in (1, 17, 40, 64):
        assert torch.equal(bi_matmul(x[:m], w, split=split, decode=True), y100[:m]), m


@pytest.mark.gpu
def test_bi_matmul_fp8_rows_on_gpu():
    """`fp8_linear_bi` on the device: a Flash wo_b-like FP8 weight, rows at M = 1 / 8 / 17 equal rows of
    M = 100 (decode tile: 1, 1, 2 and 4 groups of 16 rows per program) with the decode graphs' split and
    on the 64 x 64 tile; close to the fp32
    product with the dequantised weight."""
    from dsv4c import quant as Q

    K, N = 8192, 4096
    x = _rand(100, K, dtype=torch.bfloat16, device="cuda")
    w_q, w_s = Q.quant_fp8_block(_rand(N, K, dtype=torch.float32, device="cuda", seed=1) * 0.02)
    ref = bi_matmul_fp8_ref(x, w_q, w_s, torch.float32)
    for split, decode in ((1, False), (bi_split(N, K), True)):
        y100 = torch.ops.dsv4c.fp8_linear_bi(x, w_q, w_s.view(torch.uint8), split, decode)
        for m in (1, 8, 17, 40, 64):
            y = torch.ops.dsv4c.fp8_linear_bi(x[:m], w_q, w_s.view(torch.uint8), split, decode)
            assert torch.equal(y, y100[:m]), (split, decode, m)
        assert (y100.float() - ref).abs().max() <= 1e-2 * ref.abs().max()


@pytest.mark.parametrize("dtype,m,E,k", [(torch.float32, 4, 13, 7), (torch.bfloat16, 0, 0, 0),
                                         (torch.bfloat16, 16, 5, 0), (torch.bfloat16, 4, 13, 7)])
def test_attention_verify_rows_equal_decode_rows(dtype, m, E, k):
    """`v4_attention_fused` with the deterministic config (interpreter): a verify call of T = 4 tokens
    per row gives, for each token t, the same bits as the decode call (T = 1) at position pos0 + t made
    after the t earlier decode calls wrote their keys into the ring; and it still computes the static
    op's function (REL_ERR). Rows at pos0 = 0, inside the first window, and on a wrapped ring whose
    window straddles a key block (BN 16). Split 3 here (8 in BATCH_INVARIANT) to keep the interpreter quick."""
    import dataclasses
    from dsv4c.kernels.tolerances import rel_err
    from dsv4c.kernels.v4_attention import BATCH_INVARIANT, REL_ERR, v4_attention_fused, v4_attention_fused_ref
    from test_kernels_v4_attention import make_case

    cfg = dataclasses.replace(BATCH_INVARIANT, block_n=16, invariant_split=3)
    T, S, W = 4, 11, 8  # S = W + k: the ring of an artifact compiled for speculation
    a = make_case(B=3, T=T, H=5, d=32, S=S, m=m, E=E, k=k, pos0=[0, 5, 29], n_real=[T] * 3, dtype=dtype, window=W)
    ring_v = a["ring"].clone()
    verify = v4_attention_fused(**{**a, "ring": ring_v}, config=cfg)
    assert rel_err(verify, v4_attention_fused_ref(**{**a, "ring": a["ring"].clone()})) <= REL_ERR[dtype]
    ring_d = a["ring"].clone()
    one = torch.ones(3, dtype=torch.int64)
    for t in range(T):
        step = {**a, "q": a["q"][:, t:t + 1], "kv": a["kv"][:, t:t + 1], "pos0": a["pos0"] + t, "n_real": one,
                "ring": ring_d, "selected": None if a["selected"] is None else a["selected"][:, t:t + 1].contiguous()}
        decode = v4_attention_fused(**step, config=cfg)
        assert torch.equal(decode[:, 0], verify[:, t]), f"token {t}"
    assert torch.equal(ring_d[:-1], ring_v[:-1])


def _fp4_experts(fmt: str, E: int, I: int, D: int, device: str = "cpu"):
    from dsv4c.kernels import moe_grouped as M
    from moe_cases import float_weights

    cls = {"mxfp4": M.Mxfp4Experts, "nvfp4": M.Nvfp4Experts}[fmt]
    ex = cls.from_float(*float_weights(E, I, D, 11))
    return M.experts_from_tensors(fmt, **{f: getattr(ex, f).to(device) for f in
                                          ("w13", "w13_scale", "w13_global", "w2", "w2_scale", "w2_global")
                                          if getattr(ex, f, None) is not None})


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_fp4_experts_rows_do_not_depend_on_token_count(fmt):
    """`moe_experts_fp4_bi`'s GEMV path (interpreted): a token's row is the same bits alone (3 pairs: the
    programs in pair order) as among 8 tokens (24 pairs > E/4: the programs sorted by expert), and the
    function is the reference's within the FP4 GEMV's error table entry."""
    from dsv4c.kernels.batch_invariant import moe_experts_fp4_bi_gemv, moe_experts_fp4_bi_ref
    from dsv4c.kernels.tolerances import KERNEL_REL_ERR, rel_err

    E, I, D, T, C = 16, 64, 96, 8, 3
    ex = _fp4_experts(fmt, E, I, D)
    x = (_rand(T, D, dtype=torch.float32, seed=2) * 2).bfloat16()
    g = torch.Generator().manual_seed(3)
    idx = torch.stack([torch.randperm(E, generator=g)[:C] for _ in range(T)])
    wt = torch.rand(T, C, generator=g)
    y8 = moe_experts_fp4_bi_gemv(x, idx, wt, ex, 7.0)
    for i in (0, 5):
        assert torch.equal(moe_experts_fp4_bi_gemv(x[i:i + 1], idx[i:i + 1], wt[i:i + 1], ex, 7.0), y8[i:i + 1])
    assert rel_err(y8, moe_experts_fp4_bi_ref(x, idx, wt, ex, 7.0)) < KERNEL_REL_ERR[fmt]
    op = torch.ops.dsv4c.moe_experts_fp4_bi(x, idx, wt, fmt, ex.w13, ex.w13_scale, getattr(ex, "w13_global", None),
                                            ex.w2, ex.w2_scale, getattr(ex, "w2_global", None), 7.0)
    assert torch.equal(op, moe_experts_fp4_bi_ref(x, idx, wt, ex, 7.0))  # CPU tensors: the reference
    with pytest.raises(ValueError, match="fmt must be one of"):
        torch.ops.dsv4c.moe_experts_fp4_bi(x, idx, wt, "fp8_block", ex.w13, ex.w13_scale, None, ex.w2, ex.w2_scale,
                                           None, 7.0)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_fp4_experts_rows_on_gpu(fmt):
    """The CUDA path (PTX decode, PDL chain): rows at M = 1 and 8 equal rows of M = 64, bit for bit."""
    E, I, D, C = 32, 256, 512, 6
    ex = _fp4_experts(fmt, E, I, D, "cuda")
    x = _rand(64, D, dtype=torch.bfloat16, device="cuda", seed=2)
    idx = torch.stack([torch.randperm(E)[:C] for _ in range(64)]).cuda()
    wt = torch.rand(64, C, device="cuda")
    args = (fmt, ex.w13, ex.w13_scale, getattr(ex, "w13_global", None), ex.w2, ex.w2_scale,
            getattr(ex, "w2_global", None), 7.0)
    y = torch.ops.dsv4c.moe_experts_fp4_bi(x, idx, wt, *args)
    for m in (1, 8):
        assert torch.equal(torch.ops.dsv4c.moe_experts_fp4_bi(x[:m], idx[:m], wt[:m], *args), y[:m])


def _fp8_experts(E: int, I: int, D: int, device: str = "cpu"):
    from dsv4c.kernels import moe_grouped as M
    from moe_cases import float_weights

    ex = M.Fp8BlockExperts.from_float(*float_weights(E, I, D, 11))
    return M.experts_from_tensors("fp8_block", **{f: getattr(ex, f).to(device)
                                                  for f in ("w13", "w13_scale", "w2", "w2_scale")})


def test_fp8_experts_rows_do_not_depend_on_token_count():
    """`moe_experts_fp8_bi`'s grouped path (interpreted): a token's row is the same bits alone (3 assignments:
    `direct` routing, each its own M-block) as among 12 tokens (36 assignments > 16: sorted M-blocks shared
    by an expert's assignments), and the function is the reference's within the fp8_block error table
    entry; the op on CPU tensors is the reference."""
    from dsv4c.kernels.batch_invariant import fp8_bi_config, moe_experts_fp8_bi_impl
    from dsv4c.kernels.moe_grouped import moe_grouped_ref
    from dsv4c.kernels.tolerances import KERNEL_REL_ERR, rel_err

    E, I, D, T, C = 8, 128, 256, 12, 3
    ex = _fp8_experts(E, I, D)
    x = (_rand(T, D, dtype=torch.float32, seed=2) * 2).bfloat16()
    g = torch.Generator().manual_seed(3)
    idx = torch.stack([torch.randperm(E, generator=g)[:C] for _ in range(T)])
    wt = torch.rand(T, C, generator=g)
    assert fp8_bi_config(C, E).direct and not fp8_bi_config(T * C, E).direct
    y = moe_experts_fp8_bi_impl(x, idx, wt, ex, 7.0)
    for i in (0, 7, 11):
        assert torch.equal(moe_experts_fp8_bi_impl(x[i:i + 1], idx[i:i + 1], wt[i:i + 1], ex, 7.0), y[i:i + 1])
    ref = moe_grouped_ref(x, idx, wt, ex, 7.0)
    assert rel_err(y, ref) < KERNEL_REL_ERR["fp8_block"]
    op = torch.ops.dsv4c.moe_experts_fp8_bi(x, idx, wt, ex.w13, ex.w13_scale, ex.w2, ex.w2_scale, 7.0)
    assert torch.equal(op, ref.to(x.dtype))


@pytest.mark.gpu
def test_fp8_experts_rows_on_gpu():
    """The CUDA path: rows at 1 token (direct M-blocks) and at 8 (sorted, mostly one assignment per expert)
    equal rows of 64 tokens (sorted M-blocks shared by up to 16 assignments), bit for bit."""
    E, I, D, C = 32, 256, 512, 6
    ex = _fp8_experts(E, I, D, "cuda")
    x = _rand(64, D, dtype=torch.bfloat16, device="cuda", seed=2)
    idx = torch.stack([torch.randperm(E)[:C] for _ in range(64)]).cuda()
    wt = torch.rand(64, C, device="cuda")
    args = (ex.w13, ex.w13_scale, ex.w2, ex.w2_scale, 7.0)
    y = torch.ops.dsv4c.moe_experts_fp8_bi(x, idx, wt, *args)
    for m in (1, 8):
        assert torch.equal(torch.ops.dsv4c.moe_experts_fp8_bi(x[:m], idx[:m], wt[:m], *args), y[:m]), m


_SM90_SCRIPT = textwrap.dedent(r'''
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from dsv4c.kernels.batch_invariant import _bi_matmul_kernel as fn

    names = list(fn.arg_names)
    ints = ("N", "sxm", "swn", "sym")  # launch-time multiples of 16
    for dt, split, bias, swap, fp8, groups in (
            ("bf16", 1, False, False, False, 1), ("bf16", 8, True, False, False, 1),
            ("fp32", 4, False, False, False, 1), ("bf16", 8, True, True, False, 1),
            ("fp32", 4, False, True, False, 1), ("bf16", 8, False, True, True, 1),
            ("bf16", 1, False, False, True, 1), ("bf16", 8, True, True, False, 4),
            ("bf16", 8, False, True, True, 4), ("bf16", 8, True, True, False, 8)):
        types = {"x_ptr": f"*{dt}", "w_ptr": "*fp8e4nv" if fp8 else f"*{dt}", "b_ptr": f"*{dt}", "y_ptr": f"*{dt}",
                 "part_ptr": "*fp32", "cnt_ptr": "*i32", "ws_ptr": "*u8"}
        bm, bk, stages = (16, 128, 4 if dt == "bf16" else 2) if swap else (64, 64, 3)  # as bi_matmul launches
        consts = dict(K=4096, HAS_BIAS=bias, BLOCK_M=bm, BLOCK_N=64, BLOCK_K=bk, F32=dt == "fp32", INTERPRET=False,
                      K_SPLIT=4096 // split, SPLIT=split, SWAP=swap, PDL=True,  # PDL: as sm_90 launches it
                      W_FP8=fp8, WS_E8M0=fp8, GROUPS=groups, A_REG=False)
        sig = {nm: "constexpr" if nm in consts else types.get(nm, "i32") for nm in names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, nm in enumerate(names) if nm.endswith("_ptr") or nm in ints}
        src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": stages})
        ptx = k.asm["ptx"]
        print("kernel", dt + "+fp8" * fp8, split, int(swap), int("atom.global" in ptx),
              int("wgmma" in ptx or "mma.sync" in ptx), int("cp.async" in ptx or "cp.async.bulk" in ptx),
              ptx.count("wgmma.mma_async") + ptx.count("mma.sync.aligned"),
              ",".join(sorted(set(re.findall(r"wgmma\.mma_async\.\S+|mma\.sync\.aligned\.\S+", ptx))) or "-"))
''')


_SM90_A_REG_SCRIPT = textwrap.dedent(r'''
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from dsv4c.kernels.batch_invariant import _bi_matmul_kernel as fn

    names = list(fn.arg_names)
    types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "part_ptr": "*fp32",
             "cnt_ptr": "*i32", "ws_ptr": "*u8"}
    for a_reg in (False, True):
        consts = dict(K=4096, HAS_BIAS=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, F32=False, INTERPRET=False,
                      K_SPLIT=512, SPLIT=8, SWAP=True, PDL=True, W_FP8=False, WS_E8M0=False, GROUPS=4, A_REG=a_reg)
        sig = {nm: "constexpr" if nm in consts else types.get(nm, "i32") for nm in names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, nm in enumerate(names)
                 if nm.endswith("_ptr") or nm in ("N", "sxm", "swn", "sym")}
        src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                        attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 4})
        ptx = k.asm["ptx"]
        mma = [ln for ln in ptx.splitlines() if "wgmma.mma_async" in ln]
        a_in_regs = sum(bool(re.search(r"\}, \{%r", ln)) for ln in mma)  # A as a register list, not a descriptor
        print("kernel", int(a_reg), len(mma), a_in_regs, ",".join(sorted({ln.split()[0] for ln in mma})))
''')


def test_decode_tile_weights_from_registers_compile_for_sm90(tmp_path):
    """A_REG (DECODE_A_REG_MIN_GROUPS): the 4-group decode tile compiled for sm_90 keeps its 32 m64n16k16
    MMAs per K step, and each takes A (the weight tile) as registers; without it every MMA reads A through a
    shared-memory descriptor. The register copy is inline asm: the compiler cannot fold it away."""
    rows = run_sm90_script(tmp_path, _SM90_A_REG_SCRIPT)
    op = "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16"
    assert rows == [["0", "32", "0", op], ["1", "32", "32", op]], rows


def test_bi_matmul_compiles_for_sm90(tmp_path):
    """Compile (not run) the kernel for sm_90 with the real Triton compiler in a subprocess (tests import
    kernels under TRITON_INTERPRET=1), with and without a K split, the 64 x 64 tile and the decode tile:
    tensor-core MMAs for bf16 (fp32's IEEE products run on FMAs), a global atomic (the split's tile
    counter) only where the K is split, and the loads software-pipelined (cp.async); the FP8-weight variant
    (`bi_matmul_fp8`) on both tiles too; the decode tile with 4 (8) groups of token rows per program runs 4x
    (8x) the MMAs of one group, all of one group's shape (m64n16k16: a row's products and K order as alone)."""
    rows = run_sm90_script(tmp_path, _SM90_SCRIPT)
    n64, n16 = (f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16" for n in (64, 16))
    assert rows == [["bf16", "1", "0", "0", "1", "1", "4", n64], ["bf16", "8", "0", "1", "1", "1", "4", n64],
                    ["fp32", "4", "0", "1", "0", "1", "0", "-"], ["bf16", "8", "1", "1", "1", "1", "8", n16],
                    ["fp32", "4", "1", "1", "0", "1", "0", "-"], ["bf16+fp8", "8", "1", "1", "1", "1", "8", n16],
                    ["bf16+fp8", "1", "0", "0", "1", "1", "4", n64],
                    # the decode tile with 4 groups of token rows: 4x the MMAs, each of one group's shape
                    ["bf16", "8", "1", "1", "1", "1", "32", n16],
                    ["bf16+fp8", "8", "1", "1", "1", "1", "32", n16],
                    # 8 groups (DECODE_MAX_GROUPS 8): 8x the MMAs, the same shape
                    ["bf16", "8", "1", "1", "1", "1", "64", n16]], rows
