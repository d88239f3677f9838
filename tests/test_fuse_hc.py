"""The mHC pre/post kernels (kernels/mhc.py), their custom ops and the fuse_hc pass."""
from __future__ import annotations

import copy
import dataclasses
import io

import numpy as np
import pytest
import torch

from dsv4c import ModelConfig
from dsv4c.export import GraphSpec, export_graph
import dsv4c.kernels.mhc as mhc_mod
from dsv4c.kernels.mhc import (HC_ROWS_MAX, _eager_z, hc_head, hc_head_ref, hc_post, hc_post_ref, hc_pre, hc_pre_ref,
                               sinkhorn, sinkhorn_cuda_order, sinkhorn_ref)
from dsv4c.kernels.norm import EXACT_ROWS_MIN, torch_cuda_row_sum
from dsv4c.model import build_model, register_ops
from dsv4c.model.v4 import HyperConnection
from dsv4c.passes import PassContext, run_pipeline, verify
from dsv4c.passes.fuse_hc import fuse_hc
from dsv4c.passes.fuse_sinkhorn import fuse_sinkhorn
from dsv4c.passes.split_at_routers import OP_CAPTURE, host_sync_ops, plan_segments, reference_impl
from fusion_cases import (V4_TINY_2L, assert_same as _assert_same, exported as _exported, inputs as _inputs,
                           model as _model, rel as _rel, run as _run)

register_ops()

# Kernel vs an fp64 reference, relative norm ||k - r|| / ||r|| per output, by the output's dtype.
# fp32 outputs (post, comb; u of fp32 streams): kernel and eager fp32 differ only in summation order,
# exp/sigmoid/rsqrt rounding: measured <= 2.1e-7 (eager fp32 vs fp64 ~1.6e-7).
# Low-precision u / X': one rounding of the fp32 value; the Triton interpreter truncates instead of
# rounding to nearest (< 1 ulp: 2^-7 bf16, 2^-10 fp16; measured 4.2e-3 bf16); on CUDA (round to
# nearest) half of that.
KERNEL_REL = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 1.5e-3}
# A decode graph with the Triton kernels in place of the ops (interpreter) vs the unfused graph:
# max |err| / max |out| over logits, streams and cache writes (bf16 u rounds differently: the
# model is fp32 here, so this measures the fp32 kernels end to end).
GRAPH_REL = 2e-6
ITERS, EPS, HC_EPS = 20, 1e-6, 1e-6

# ---- fp64 references (independent of the model code) --------------------------------------------
def _sinkhorn64(c, iters, eps):
    c = c.softmax(-1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


def _pre64(X, fn, base, scale, eps, hc_eps, iters):
    N = X.shape[-2]
    x = X.flatten(-2).double()
    z = (x @ fn.double().t()) * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    b, s = base.double(), scale.double()
    pre = torch.sigmoid(s[0] * z[..., :N] + b[:N]) + hc_eps
    post = 2 * torch.sigmoid(s[1] * z[..., N:2 * N] + b[N:2 * N])
    comb = _sinkhorn64((s[2] * z[..., 2 * N:] + b[2 * N:]).unflatten(-1, (N, N)), iters, hc_eps)
    return (pre[..., None] * X.double()).sum(-2), post, comb


def _post64(y, X, post, comb):
    return post.double()[..., None] * y.double()[..., None, :] + torch.einsum("...jk,...jd->...kd", comb.double(),
                                                                              X.double())


def _site(lead, N, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    mix = (2 + N) * N
    X = torch.randn(*lead, N, D, generator=g).to(dtype)
    fn = torch.randn(mix, N * D, generator=g) / (N * D) ** 0.5
    base, scale = 0.3 * torch.randn(mix, generator=g), 0.5 + torch.rand(3, generator=g)
    return X, fn, base, scale


# ---- the kernels (Triton interpreter on CPU) --------------------------------------------------------
_PRE_CASES = [
    ((1, 1), 4, 64, torch.float32, 512),    # decode, batch 1
    ((3, 1), 4, 48, torch.float32, 64),     # 3 split-K chunks, non-power-of-two D
    ((2, 3), 4, 33, torch.float32, 64),     # verify-shaped [B, 1 + k]; K = 132: a partial last chunk
    ((17,), 4, 24, torch.float32, 64),      # 17 tokens: a partial M block; 3-D input
    ((2, 1), 2, 40, torch.float32, 64),
    ((1, 2), 1, 16, torch.float32, 64),     # N = 1
    ((2, 2), 8, 16, torch.float32, 64),     # N = 8: MIX = 80
    ((3, 1), 4, 64, torch.bfloat16, 128),
    ((2, 2), 4, 40, torch.float16, 64),
    ((0, 1), 4, 32, torch.float32, 64),     # no tokens: no launch
]


# the fast variant with both first launches on every case; the exact one (its 4 x 4 Sinkhorn unrolled is slow
# under the interpreter) on the cases that differ for it: N = 4 / 2 / 1 / 8, each dtype, a partial K chunk
@pytest.mark.parametrize("lead,N,D,dtype,chunk,rows,exact", [
    *[(*c, rows, False) for c in _PRE_CASES for rows in (False, True)],
    *[(*c, False, True) for c in _PRE_CASES if c[0] not in ((17,), (3, 1)) or c[3] != torch.float32]])
def test_hc_pre_kernel_matches_fp64(lead, N, D, dtype, chunk, rows, exact):
    """Both variants (fast: decode sizes, both first launches of the split-K path: tl.dot tiles / one row per
    program; exact: prefill sizes, z from eager's ops; the exact finish after the split-K launches:
    test_hc_pre_u_differs_from_the_model_only_by_the_dot_products_order and the 8 x 1 GPU case)."""
    X, fn, base, scale = _site(lead, N, D, dtype, seed=N * D + len(lead))
    got = hc_pre(X, fn, base, scale, EPS, HC_EPS, ITERS, chunk=chunk, block_d=16, rows=rows, exact=exact)
    want = _pre64(X, fn, base, scale, EPS, HC_EPS, ITERS)
    for name, a, b in zip(("u", "post", "comb"), got, want):
        assert a.shape == b.shape, name
        assert _rel(a, b) <= KERNEL_REL[a.dtype], (name, _rel(a, b))
    assert got[0].dtype == dtype and got[1].dtype == got[2].dtype == torch.float32
    if got[2].numel():  # Sinkhorn did normalise: columns sum to ~1 (a kernel skipping it fails here)
        assert torch.allclose(got[2].sum(-2), torch.ones(()), atol=1e-4)
        assert _rel(got[1], want[1]) <= KERNEL_REL[torch.float32] < _rel(got[1] / 2, want[1])


def _head64(X, fn, base, scale, eps, hc_eps):
    x = X.flatten(-2).double()
    z = (x @ fn.double().t()) * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    w = torch.sigmoid(scale.double() * z + base.double()) + hc_eps
    return (w[..., None] * X.double()).sum(-2)


@pytest.mark.parametrize("lead,N,D,dtype", [((2, 3), 4, 40, torch.float32), ((5,), 2, 33, torch.float32),
                                            ((3, 1), 4, 64, torch.bfloat16), ((0, 1), 4, 16, torch.float32)])
@pytest.mark.parametrize("rows,exact", [(True, False), (False, False), (False, True), (True, True)])
def test_hc_head_kernel_matches_fp64_and_the_model(lead, N, D, dtype, rows, exact):
    """hc_head (the collapse before the LM head: hc_pre's launches with N mix rows, u alone) in every variant:
    the one-row and tiled first launches, the fast and exact finishes (exact without rows: z from eager's ops)."""
    g = torch.Generator().manual_seed(N * D)
    X = torch.randn(*lead, N, D, generator=g).to(dtype)
    fn, base = torch.randn(N, N * D, generator=g) / (N * D) ** 0.5, 0.3 * torch.randn(N, generator=g)
    scale = 0.5 + torch.rand(1, generator=g)
    got = hc_head(X, fn, base, scale, EPS, HC_EPS, rows=rows, exact=exact)
    assert got.shape == (*lead, D) and got.dtype == dtype
    assert _rel(got, _head64(X, fn, base, scale, EPS, HC_EPS)) <= KERNEL_REL[dtype]
    assert _rel(got, hc_head_ref(X, fn, base, scale, EPS, HC_EPS)) <= 2 * KERNEL_REL[dtype]
    assert torch.equal(torch.ops.dsv4c.hc_head(X, fn, base, scale, EPS, HC_EPS),
                       hc_head_ref(X, fn, base, scale, EPS, HC_EPS))  # the CPU op is the model's function
    with pytest.raises(ValueError, match="hc_head: scale"):
        hc_head(X, fn, base, scale.repeat(3), EPS, HC_EPS)


@pytest.mark.parametrize("exact", [False, True])
def test_hc_pre_kernel_equals_the_model_function_in_fp32(exact):
    X, fn, base, scale = _site((2, 3), 4, 40, torch.float32, seed=7)
    for a, b in zip(hc_pre(X, fn, base, scale, EPS, HC_EPS, ITERS, chunk=64, exact=exact),
                    hc_pre_ref(X, fn, base, scale, EPS, HC_EPS, ITERS)):
        assert _rel(a, b) <= KERNEL_REL[torch.float32]


@pytest.mark.parametrize("lead,N,D,dtype", [
    ((1, 1), 4, 64, torch.float32),
    ((3, 2), 4, 40, torch.float32),
    ((5,), 2, 33, torch.float32),
    ((2, 1), 8, 16, torch.float32),
    ((3, 1), 4, 64, torch.bfloat16),
    ((2, 2), 4, 24, torch.float16),
    ((0, 1), 4, 16, torch.float32),
])
@pytest.mark.parametrize("exact", [False, True])
def test_hc_post_kernel_matches_fp64(lead, N, D, dtype, exact):
    g = torch.Generator().manual_seed(N + D)
    X = torch.randn(*lead, N, D, generator=g).to(dtype)
    y = torch.randn(*lead, D, generator=g).to(dtype)
    post = 2 * torch.rand(*lead, N, generator=g)
    comb = torch.rand(*lead, N, N, generator=g)
    got = hc_post(y, X, post, comb, block_d=16, exact=exact)
    want = _post64(y, X, post, comb)
    assert got.dtype == dtype and got.shape == X.shape
    assert _rel(got, want) <= KERNEL_REL[dtype]
    if got.numel():  # both terms matter
        assert _rel(_post64(y, X, post, torch.zeros_like(comb)), want) > 0.1
    if len(lead) == 2 and dtype == torch.float32:  # the model's own function (fp32)
        assert _rel(got, hc_post_ref(y, X, post, comb)) <= KERNEL_REL[dtype]


def _rne(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 -> dtype rounded to nearest even, by torch (the interpreter's own cast truncates; CUDA's rounds)."""
    return t.to(dtype)


@pytest.mark.parametrize("lead,N,D,dtype", [((2, 5), 4, 64, torch.bfloat16), ((3, 1), 4, 40, torch.float32),
                                            ((2, 3), 8, 16, torch.float16)])
def test_hc_post_kernel_rounds_exactly_like_the_model(lead, N, D, dtype):
    """Issue 22: the exact kernel's X' is bit-exact with HyperConnection.post: the einsum's FMA chain over j in order (as
    the CPU's GEMM and cuBLAS's run it), then post·y rounded and added (no FMA contraction). The kernel
    runs on fp32 copies of y and X (same values) and its fp32 X' is rounded by torch, since the
    interpreter's own cast truncates."""
    g = torch.Generator().manual_seed(D)
    X = torch.randn(*lead, N, D, generator=g).to(dtype)
    y = torch.randn(*lead, D, generator=g).to(dtype)
    post, comb = 2 * torch.rand(*lead, N, generator=g), torch.rand(*lead, N, N, generator=g)
    got = hc_post(y.float(), X.float(), post, comb, block_d=16, exact=True)
    assert torch.equal(got, hc_post_ref(y.float(), X.float(), post, comb))
    assert torch.equal(_rne(got, dtype), hc_post_ref(y, X, post, comb))


def test_sinkhorn_of_4x4_matrices_sums_in_pytorchs_cuda_order():
    """Issue 22: the exact Sinkhorn kernel (and hc_pre's exact finish, the same code) adds every sum in the order PyTorch's CUDA
    softmax and reductions add it (`sinkhorn_cuda_order`, with the interpreter's exp): bit-exact. The
    CPU's eager Sinkhorn sums in other orders (the GPU test compares with eager on CUDA)."""
    c0 = 2 * torch.randn(37, 4, 4, generator=torch.Generator().manual_seed(4))
    got = sinkhorn(c0, ITERS, HC_EPS, exact=True)
    want = sinkhorn_cuda_order(c0, ITERS, HC_EPS, exp=lambda t: torch.from_numpy(np.exp(t.numpy())))
    assert torch.equal(got, want)
    assert torch.equal(sinkhorn(c0.repeat(4, 1, 1), ITERS, HC_EPS)[:37], got)  # 148 matrices: exact by default
    assert not torch.equal(want, sinkhorn_ref(c0, ITERS, HC_EPS))  # the orders matter on these matrices


def test_prefill_sized_hc_pre_takes_z_from_eagers_own_ops():
    """Issue 22: from EXACT_ROWS_MIN tokens z = fn·vec(X) is eager's own linear on the fp32 copy of X (on CUDA
    the same cuBLAS call, so the same bits) and the sum of squares is added in PyTorch's CUDA order for that
    many rows: the finish then sees eager's fp32 values."""
    X, fn, base, scale = _site((20,), 4, 256, torch.bfloat16, seed=6)
    x = X.flatten(-2)
    zp, ssp, mixp, splits = _eager_z(x.contiguous(), fn, 20, 1024, 24)
    assert (mixp, splits) == (24, 1) and torch.equal(zp[0], torch.nn.functional.linear(x.float(), fn))
    assert torch.equal(ssp[0], torch_cuda_row_sum(x.float().pow(2)))
    assert EXACT_ROWS_MIN > 64  # decode batches keep the split-K kernel


class _Launches:
    """Stands in for kernels/mhc.py's kernels and records (kernel, FMA contraction) per launch."""

    def __init__(self, monkeypatch):
        self.names = []
        for name in [k for k in vars(mhc_mod) if k.startswith("_") and k.endswith("_kernel")]:
            monkeypatch.setattr(mhc_mod, name, self._kernel(name))

    def _kernel(self, name):
        class K:
            def __getitem__(_, grid):
                return lambda *a, **kw: self.names.append((name, kw.get("enable_fp_fusion", True)))
        return K()

    def take(self):
        out, self.names = self.names, []
        return out


def test_the_token_count_picks_the_variant(monkeypatch):
    """Decode-sized launches (< EXACT_ROWS_MIN tokens: batch x (1 + k)) run the fast kernels, as before issue
    22's exact kernels (FMA contraction on, split-K z); prefill-sized ones the exact kernels (no contraction,
    z from eager's linear + the sum of squares in PyTorch's order). `exact` overrides the count; the
    deterministic ops (hc_pre_rows, hc_post_bi, sinkhorn_bi) take the fast kernels at any count and on the
    CPU are the model's functions."""
    rec = _Launches(monkeypatch)
    N, D = 4, 64
    fast_pre = {1: "_hc_mix_rows_kernel", HC_ROWS_MAX: "_hc_mix_rows_kernel", HC_ROWS_MAX + 1: "_hc_mix_kernel",
                EXACT_ROWS_MIN - 1: "_hc_mix_kernel"}
    for m, first in fast_pre.items():
        X, fn, base, scale = _site((m,), N, D, torch.bfloat16, seed=m)
        hc_pre(X, fn, base, scale, EPS, HC_EPS, ITERS)
        assert rec.take() == [(first, True), ("_hc_pre_finish_kernel", True)], m
        c = torch.zeros(m, N, N)
        hc_post(X[:, 0], X, c[..., 0], c)
        sinkhorn(c, ITERS, HC_EPS)
        assert rec.take() == [("_hc_post_kernel", True), ("_sinkhorn_kernel", True)], m
    for m in (EXACT_ROWS_MIN, 4 * EXACT_ROWS_MIN):
        X, fn, base, scale = _site((m,), N, D, torch.bfloat16, seed=m)
        hc_pre(X, fn, base, scale, EPS, HC_EPS, ITERS)
        assert rec.take() == [("_hc_sumsq_kernel", False), ("_hc_pre_finish_exact_kernel", False)], m
        c = torch.zeros(m, N, N)
        hc_post(X[:, 0], X, c[..., 0], c)
        sinkhorn(c, ITERS, HC_EPS)
        assert rec.take() == [("_hc_post_exact_kernel", False), ("_sinkhorn_exact_kernel", True)], m
        hc_pre(X, fn, base, scale, EPS, HC_EPS, ITERS, rows=True, exact=False)  # dsv4c::hc_pre_rows' CUDA path
        assert rec.take() == [("_hc_mix_rows_kernel", True), ("_hc_pre_finish_kernel", True)]
    X, fn, base, scale = _site((2,), N, D, torch.bfloat16, seed=0)
    hc_pre(X, fn, base, scale, EPS, HC_EPS, ITERS, exact=True)
    assert rec.take() == [("_hc_mix_rows_kernel", True), ("_hc_pre_finish_exact_kernel", False)]
    with pytest.raises(ValueError, match="eager_z needs the exact finish"):
        hc_pre(X, fn, base, scale, EPS, HC_EPS, ITERS, exact=False, eager_z=True)
    monkeypatch.undo()
    X = X[:, None]  # [B, T, N, D]: the model's post
    y, post, comb = torch.randn(2, 1, D).to(torch.bfloat16), torch.rand(2, 1, N), torch.rand(2, 1, N, N)
    assert torch.equal(torch.ops.dsv4c.hc_post_bi(y, X, post, comb), hc_post_ref(y, X, post, comb))
    assert torch.equal(torch.ops.dsv4c.sinkhorn_bi(comb, ITERS, HC_EPS), sinkhorn_ref(comb, ITERS, HC_EPS))
    assert OP_CAPTURE["dsv4c.hc_post_bi"] is None and OP_CAPTURE["dsv4c.sinkhorn_bi"] is None


def _term_scale_error(X, pre, a, b) -> tuple[float, float]:
    """(max over elements of |a - b| beyond one rounding of b, in units of 2^-24·Σ_k|pre_k·X[k]|; the share
    of elements that differ). An element of u = Σ_k pre_k·X[k] carries fp32 error proportional to the terms,
    not to u: where the streams cancel, a few fp32 ulps of the terms are many ulps of u."""
    b32 = b.float()
    ulp = torch.exp2(torch.floor(torch.log2(b32.abs().clamp_min(2.0 ** -126))) - (7 if b.dtype == torch.bfloat16
                                                                                   else 10))
    terms = (pre[..., None] * X.float()).abs().sum(-2)
    excess = ((a.float() - b32).abs() - ulp).clamp_min(0) / (terms * 2.0 ** -24).clamp_min(2.0 ** -149)
    return excess.max().item(), (a != b).float().mean().item()


@pytest.mark.parametrize("exact", [False, True])
def test_hc_pre_u_differs_from_the_model_only_by_the_dot_products_order(exact):
    """u rounds once like eager; its fp32 value differs by the order of the N·D-term dot product z (here
    the CPU's GEMM against the split-K kernel), a few fp32 ulps of the terms pre_k·X[k]. An extra or a
    missing bf16 rounding of an intermediate would be 2^16 times that."""
    X, fn, base, scale = _site((2, 6), 4, 256, torch.bfloat16, seed=5)
    got = hc_pre(X.float(), fn, base, scale, EPS, HC_EPS, ITERS, exact=exact, eager_z=False)  # fp32 u, rounded by torch
    want = hc_pre_ref(X, fn, base, scale, EPS, HC_EPS, ITERS)
    pre = torch.sigmoid(scale[0] * _z(X, fn)[..., :4] + base[:4]) + HC_EPS
    excess, share = _term_scale_error(X, pre, _rne(got[0], torch.bfloat16), want[0])
    assert excess <= 64 and share <= 0.01, (excess, share)


def _z(X, fn):
    x = X.flatten(-2).float()
    return torch.nn.functional.linear(x, fn) * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def test_strided_inputs_are_accepted():
    X, fn, base, scale = _site((3, 2), 4, 24, torch.float32, seed=3)
    Xs = X.transpose(0, 1).contiguous().transpose(0, 1)  # same values, not contiguous
    assert not Xs.is_contiguous()
    for a, b in zip(hc_pre(Xs, fn, base, scale, EPS, HC_EPS, ITERS, chunk=64), _pre64(X, fn, base, scale, EPS,
                                                                                       HC_EPS, ITERS)):
        assert _rel(a, b) <= KERNEL_REL[a.dtype]


@pytest.mark.parametrize("change,err", [
    (lambda a: {**a, "X": a["X"].double()}, "X must be float32"),
    (lambda a: {**a, "X": a["X"][0, 0]}, r"X must be \[..., N, D\]"),
    (lambda a: {**a, "X": torch.zeros(2, 1, 3, 8)}, "power of two"),
    (lambda a: {**a, "fn": a["fn"].double()}, "fn must be float32"),
    (lambda a: {**a, "fn": a["fn"][:, :-1]}, r"fn must have shape \[24, 32\]"),
    (lambda a: {**a, "base": a["base"][:-1]}, "base must have shape"),
    (lambda a: {**a, "scale": a["scale"].half()}, "scale must be float32"),
    (lambda a: {**a, "iters": 0}, "iters"),
    (lambda a: {**a, "chunk": 96}, "chunk"),
])
def test_hc_pre_wrapper_rejects_bad_input(change, err):
    X, fn, base, scale = _site((2, 1), 4, 8, torch.float32, seed=0)
    a = change({"X": X, "fn": fn, "base": base, "scale": scale, "iters": ITERS, "chunk": 64})
    with pytest.raises(ValueError, match=err):
        hc_pre(a["X"], a["fn"], a["base"], a["scale"], EPS, HC_EPS, a["iters"], chunk=a["chunk"])


@pytest.mark.parametrize("change,err", [
    (lambda a: {**a, "y": a["y"][..., :-1]}, "y must be"),
    (lambda a: {**a, "post": a["post"].half()}, "post must be float32"),
    (lambda a: {**a, "comb": a["comb"][..., :2]}, "comb must have shape"),
    (lambda a: {**a, "X": a["X"].int()}, "X must be float32"),
])
def test_hc_post_wrapper_rejects_bad_input(change, err):
    a = change({"y": torch.zeros(2, 1, 8), "X": torch.zeros(2, 1, 4, 8), "post": torch.zeros(2, 1, 4),
                "comb": torch.zeros(2, 1, 4, 4)})
    with pytest.raises(ValueError, match=err):
        hc_post(a["y"], a["X"], a["post"], a["comb"])


# ---- the custom ops ---------------------------------------------------------------------------------
def test_ops_are_the_model_functions_on_cpu_fake_and_capture_safe():
    X, fn, base, scale = _site((2, 3), 4, 16, torch.bfloat16, seed=1)
    hc = HyperConnection.__new__(HyperConnection)
    hc.n, hc.eps, hc.hc_eps, hc.iters = 4, EPS, HC_EPS, ITERS
    want = HyperConnection.pre(hc, X, fn, base, scale)
    got = torch.ops.dsv4c.hc_pre(X, fn, base, scale, EPS, HC_EPS, ITERS)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    y = torch.randn(2, 3, 16).to(torch.bfloat16)
    assert torch.equal(torch.ops.dsv4c.hc_post(y, X, want[1], want[2]), HyperConnection.post(y, X, want[1], want[2]))
    with torch._subclasses.FakeTensorMode() as mode:
        f = [mode.from_tensor(t) for t in (X, fn, base, scale, y)]
        u, post, comb = torch.ops.dsv4c.hc_pre(*f[:4], EPS, HC_EPS, ITERS)
        out = torch.ops.dsv4c.hc_post(f[4], f[0], post, comb)
    assert [tuple(t.shape) for t in (u, post, comb, out)] == [(2, 3, 16), (2, 3, 4), (2, 3, 4, 4), (2, 3, 4, 16)]
    assert (u.dtype, post.dtype, comb.dtype, out.dtype) == (torch.bfloat16, torch.float32, torch.float32, torch.bfloat16)
    assert OP_CAPTURE["dsv4c.hc_pre"] is None and OP_CAPTURE["dsv4c.hc_post"] is None
    assert host_sync_ops(reference_impl("dsv4c.hc_pre"), X, fn, base, scale, EPS, HC_EPS, ITERS) == []
    assert host_sync_ops(reference_impl("dsv4c.hc_post"), y, X, want[1], want[2]) == []


# ---- the pass -----------------------------------------------------------------------------------
def _sites(kind) -> int:
    return 2 if kind == "mtp" else 2 * V4_TINY_2L["num_hidden_layers"]


def _count(gm, op) -> int:
    return sum(n.target is op for n in gm.graph.nodes)


@pytest.mark.parametrize("kind,dtype,sinkhorn_first", [
    ("decode", torch.float32, True),
    ("verify", torch.float32, True),
    ("mtp", torch.float32, True),
    ("prefill", torch.float32, False),   # the pattern with the Sinkhorn chain (fuse_sinkhorn skipped)
    ("decode", torch.bfloat16, True),    # bf16 streams: the bf16 pattern, no aliasing casts
    ("prefill", torch.bfloat16, True),   # issue 22: the bf16 prefill graph (compressors, many tokens)
    ("mtp", torch.bfloat16, False),
])
def test_pass_fuses_every_site_bit_exact(kind, dtype, sinkhorn_first):
    model = _model("v4", dtype)
    ctx = PassContext(model.config, "cpu", graph_kind=kind)
    ref_gm = _exported("v4", kind, dtype)
    gm = _exported("v4", kind, dtype)
    if sinkhorn_first:
        gm = fuse_sinkhorn(gm, ctx).graph
    res = fuse_hc(gm, ctx)
    gm = res.graph
    verify(gm, ctx, after="fuse_hc")
    assert res.changed and res.stats == {"pre": _sites(kind), "post": _sites(kind), "head": 1}  # one head a graph
    assert _count(gm, torch.ops.dsv4c.hc_pre.default) == _count(gm, torch.ops.dsv4c.hc_post.default) == _sites(kind)
    assert _count(gm, torch.ops.dsv4c.hc_head.default) == 1
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.dsv4c.sinkhorn.default not in ops
    assert not [n for n in gm.graph.nodes if n.target is torch.ops.aten.einsum.default and n.args[0] == "btjk,btjd->btkd"]
    assert torch.ops.aten.sigmoid.default not in ops  # every mHC site's and the head's are inside the fused ops
    args = _inputs("v4", kind, dtype)
    _assert_same(_run(gm, args), _run(ref_gm, args))  # CPU: the ops are the model's functions: exact
    again = fuse_hc(gm, ctx)
    assert not again.changed and again.stats == {"pre": 0, "post": 0, "head": 0}


def test_deterministic_graphs_keep_the_head_unfused():
    """With --deterministic the head's collapse stays ATen ops (make_batch_invariant makes them invariant);
    the sites are fused as always."""
    model = _model("v4")
    ctx = PassContext(model.config, "cpu", graph_kind="decode", deterministic=True)
    res = fuse_hc(fuse_sinkhorn(_exported("v4", "decode"), ctx).graph, ctx)
    assert res.stats == {"pre": _sites("decode"), "post": _sites("decode"), "head": 0}
    assert _count(res.graph, torch.ops.dsv4c.hc_head.default) == 0


def test_fused_graph_with_the_triton_kernels_matches():
    """The decode graph with each hc_pre/hc_post node running the Triton kernels (interpreter)."""
    ctx = PassContext(_model().config, "cpu", graph_kind="decode")
    ref_gm = _exported("v4", "decode")
    gm = fuse_hc(_exported("v4", "decode"), ctx).graph
    heads = 0
    for n in gm.graph.nodes:
        if n.target is torch.ops.dsv4c.hc_pre.default:
            n.target = hc_pre
        elif n.target is torch.ops.dsv4c.hc_post.default:
            n.target = hc_post
        elif n.target is torch.ops.dsv4c.hc_head.default:
            n.target, heads = hc_head, heads + 1
    assert heads == 1
    gm.recompile()
    args = _inputs("v4", "decode")
    _assert_same(_run(gm, args), _run(ref_gm, args), rel=GRAPH_REL)


def test_sites_that_differ_are_left_alone():
    """Constants of pre that differ from the graph's literals: pre does not match (post has none); the head
    reads eps and hc_eps, not the Sinkhorn's iterations."""
    gm = fuse_sinkhorn(_exported("v4", "decode"), PassContext(_model().config, "cpu", "decode")).graph
    for change in ({"hc_eps": 1e-5}, {"rms_norm_eps": 1e-5}, {"hc_sinkhorn_iters": ITERS + 1}):
        cfg = dataclasses.replace(_model().config, **change)
        res = fuse_hc(copy.deepcopy(gm), PassContext(cfg, "cpu", graph_kind="decode"))
        head = int("hc_sinkhorn_iters" in change)
        assert res.stats == {"pre": 0, "post": _sites("decode"), "head": head}, change


def test_not_a_v4_graph():
    m = build_model(ModelConfig.preset("v3-tiny"))
    gm = export_graph(m, GraphSpec("decode", n_slots=2, max_len=16)).module()
    res = fuse_hc(gm, PassContext(m.config, "cpu", "decode"))
    assert not res.changed and res.stats["pre"] == 0


def test_fused_graph_exports_and_round_trips():
    """A graph holding hc_pre (three outputs) and hc_post re-exports, saves and loads (torch.export)."""
    ctx = PassContext(_model().config, "cpu", graph_kind="decode")
    gm = fuse_hc(_exported("v4", "decode"), ctx).graph
    args = _inputs("v4", "decode")
    ep = torch.export.export(gm, tuple(copy.deepcopy(args)), strict=False)
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    loaded = torch.export.load(buf).module()
    names = {str(n.target) for n in loaded.graph.nodes}
    assert {"dsv4c.hc_pre.default", "dsv4c.hc_post.default"} <= names
    _assert_same(_run(loaded, args), _run(gm, args))


def test_in_the_pipeline_sites_sit_in_capturable_segments():
    """fuse_hc runs in default_pipeline after fuse_sinkhorn: every site fused, the pipeline's outputs
    equal the same pipeline without it, and on h200 the fused ops sit in capturable static segments."""
    ctx = PassContext(_model().config, "h200", graph_kind="verify")
    args = _inputs("v4", "verify")
    # lossy (tests/test_quantize_experts.py, test_quantize_dense.py); fuse_hc_chain: tests/test_fuse_hc_chain.py
    skip = ("quantize_experts", "quantize_dense", "fuse_hc_chain")
    unfused, _ = run_pipeline(_exported("v4", "verify"), ctx, skip=skip + ("fuse_hc",))
    gm, recs = run_pipeline(_exported("v4", "verify"), ctx, skip=skip)
    rec = next(r for r in recs if r.name == "fuse_hc")
    assert rec.stats == {"pre": _sites("verify"), "post": _sites("verify"), "head": 1}
    _assert_same(_run(gm, args), _run(unfused, args))
    plan = plan_segments(gm, ctx)
    names = {n.name for n in gm.graph.nodes if n.target in (torch.ops.dsv4c.hc_pre.default,
                                                             torch.ops.dsv4c.hc_post.default,
                                                             torch.ops.dsv4c.hc_head.default)}
    assert len(names) == 2 * _sites("verify") + 1
    holding = [s for s in plan.segments if names & set(s.nodes)]
    assert sum(len(names & set(s.nodes)) for s in holding) == len(names)
    assert all(s.kind == "static" and s.capturable for s in holding), [(s.index, s.reason) for s in holding]


# ---- CUDA (the device) ------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernels_on_cuda_at_flash_dims(batch, dtype):
    """The compiled kernels against the model's functions run on CUDA, at V4-Flash dims (hidden 4096,
    hc_mult 4, 20 Sinkhorn iterations), and against fp64."""
    X, fn, base, scale = (t.cuda() for t in _site((batch, 1), 4, 4096, dtype, seed=batch))
    got = torch.ops.dsv4c.hc_pre(X, fn, base, scale, EPS, HC_EPS, ITERS)
    torch_cuda = hc_pre_ref(X, fn, base, scale, EPS, HC_EPS, ITERS)
    want = _pre64(X, fn, base, scale, EPS, HC_EPS, ITERS)
    # fp32 outputs: K = N·D = 16384-term dot products; eager fp32 (CPU) vs fp64 measured 1.6e-6 (comb,
    # batch 1). bf16 u: one round to nearest on the device (eager: 1.7e-3).
    cuda_rel = {torch.float32: 1e-5, torch.bfloat16: 5e-3}
    for name, a, b, c in zip(("u", "post", "comb"), got, want, torch_cuda):
        assert _rel(a, b) <= cuda_rel[a.dtype], (name, _rel(a, b))
        assert _rel(a, c) <= 2 * cuda_rel[a.dtype], (name, _rel(a, c))
    y = torch.randn(batch, 1, 4096, device="cuda").to(dtype)
    out = torch.ops.dsv4c.hc_post(y, X, got[1], got[2])
    assert _rel(out, _post64(y, X, got[1], got[2])) <= cuda_rel[dtype]
    assert _rel(out, hc_post_ref(y, X, got[1], got[2])) <= 2 * cuda_rel[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("lead", [(1, 1), (8, 1), (1, 256)])
def test_hc_head_on_cuda_at_flash_dims(lead):
    """dsv4c::hc_head on CUDA at V4-Flash dims against fp64 and the model's function run on CUDA; from
    EXACT_ROWS_MIN rows (1 x 256: a prefill chunk) bit-exact with eager, as hc_pre."""
    g = torch.Generator().manual_seed(lead[0])
    X = torch.randn(*lead, 4, 4096, generator=g).to(torch.bfloat16).cuda()
    fn = (torch.randn(4, 4 * 4096, generator=g) / 128).cuda()
    base, scale = (0.3 * torch.randn(4, generator=g)).cuda(), (0.5 + torch.rand(1, generator=g)).cuda()
    got = torch.ops.dsv4c.hc_head(X, fn, base, scale, EPS, HC_EPS)
    eager = hc_head_ref(X, fn, base, scale, EPS, HC_EPS)
    assert _rel(got, _head64(X, fn, base, scale, EPS, HC_EPS)) <= 5e-3 and _rel(got, eager) <= 1e-2
    if lead[1] >= EXACT_ROWS_MIN:
        assert torch.equal(got, eager)


@pytest.mark.gpu
def test_ops_capture_in_a_cuda_graph():
    X, fn, base, scale = (t.cuda() for t in _site((8, 1), 4, 4096, torch.bfloat16, seed=0))
    y = torch.randn(8, 1, 4096, device="cuda", dtype=torch.bfloat16)
    torch.ops.dsv4c.hc_post(y, X, *torch.ops.dsv4c.hc_pre(X, fn, base, scale, EPS, HC_EPS, ITERS)[1:])  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        u, post, comb = torch.ops.dsv4c.hc_pre(X, fn, base, scale, EPS, HC_EPS, ITERS)
        out = torch.ops.dsv4c.hc_post(y, X, post, comb)
    X.copy_(torch.randn_like(X))
    graph.replay()
    want = hc_pre_ref(X, fn, base, scale, EPS, HC_EPS, ITERS)
    assert _rel(u, want[0]) <= 1e-2 and _rel(comb, want[2]) <= 2e-5
    assert _rel(out, hc_post_ref(y, X, want[1], want[2])) <= 1e-2


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of b's bf16 ulp (2^(exponent - 7))."""
    b32 = b.float()
    ulp = torch.exp2(torch.floor(torch.log2(b32.abs().clamp_min(2.0 ** -126))) - 7)
    return (a.float() - b32).abs() / ulp


@pytest.mark.gpu
@pytest.mark.parametrize("lead", [(2, 256), (2, 32), (8, 1)])
def test_kernels_round_once_like_eager_at_prefill_size(lead):
    """Issue 22: the exact kernels at Flash dims against eager on CUDA, element by element, at a prefill's
    2 x 256 tokens (the ops pick them there), 2 x 32 (z from eager's GEMM) and 8 x 1 (the row launch), where
    the ops pick the fast kernels (`test_kernels_on_cuda_at_flash_dims`). X' (the same post and comb
    in): bit-exact, an in-order FMA chain over j then post·y rounded and added, as eager's batched GEMM
    and add. u: the 16384-term dot z is summed in another order than cuBLAS's, so u may round differently
    where the fp32 values straddle a boundary: beyond one rounding at most 64·2^-24·Σ_k|pre_k·X[k]|, in
    <= 1% of the elements (an extra bf16 rounding step is ~30000 there, in a quarter of them). In ulps of
    u itself the same differences reached 14 on the H200 (elements where the streams cancel)."""
    X, fn, base, scale = (t.cuda() for t in _site(lead, 4, 4096, torch.bfloat16, seed=3))
    got = hc_pre(X, fn, base, scale, EPS, HC_EPS, ITERS, exact=True)
    want = hc_pre_ref(X, fn, base, scale, EPS, HC_EPS, ITERS)
    pre = torch.sigmoid(scale[0] * _z(X, fn)[..., :4] + base[:4]) + HC_EPS
    excess, share = _term_scale_error(X, pre, got[0], want[0])
    assert excess <= 64 and share <= 0.01, (excess, share, _ulps(got[0], want[0]).max().item())
    y = torch.randn(*lead, 4096, device="cuda").to(torch.bfloat16)
    out, ref = hc_post(y, X, want[1], want[2], exact=True), hc_post_ref(y, X, want[1], want[2])
    assert torch.equal(out, ref), ((out != ref).float().mean().item(), _ulps(out, ref).max().item())
    if X[..., 0, 0].numel() >= EXACT_ROWS_MIN:  # prefill-sized: the ops run these kernels
        assert torch.equal(torch.ops.dsv4c.hc_post(y, X, want[1], want[2]), out)
        assert all(torch.equal(a, b) for a, b in zip(torch.ops.dsv4c.hc_pre(X, fn, base, scale, EPS, HC_EPS, ITERS),
                                                     got))
    for a, b in zip(got[1:], want[1:]):  # fp32 post, comb
        assert _rel(a, b) <= 1e-5


@pytest.mark.gpu
def test_sinkhorn_is_bit_exact_with_eager_on_cuda():
    """Issue 22: the Sinkhorn in PyTorch's CUDA summation orders equals eager's on CUDA (the first assert
    checks the orders themselves, `sinkhorn_cuda_order` in torch ops), and so do the kernels."""
    c0 = (2 * torch.randn(2, 256, 4, 4, generator=torch.Generator().manual_seed(5))).cuda()
    want = sinkhorn_ref(c0, ITERS, HC_EPS)
    assert torch.equal(sinkhorn_cuda_order(c0, ITERS, HC_EPS), want)
    got = torch.ops.dsv4c.sinkhorn(c0, ITERS, HC_EPS)
    assert torch.equal(got, want), (got != want).float().mean().item()


@pytest.mark.gpu
def test_hc_pre_is_bit_exact_with_eager_at_prefill_size():
    """Issue 22: at a prefill's 2 x 256 tokens (>= EXACT_ROWS_MIN) hc_pre takes z from eager's own GEMM and the
    sum of squares in PyTorch's order; with torch's sigmoid and rsqrt and the Sinkhorn in PyTorch's summation
    orders, u, post and comb equal eager's on CUDA bit for bit (fuse_hc is then exact on prefill graphs)."""
    X, fn, base, scale = (t.cuda() for t in _site((2, 256), 4, 4096, torch.bfloat16, seed=3))
    got, want = torch.ops.dsv4c.hc_pre(X, fn, base, scale, EPS, HC_EPS, ITERS), hc_pre_ref(X, fn, base, scale, EPS,
                                                                                            HC_EPS, ITERS)
    for name, a, b in zip(("u", "post", "comb"), got, want):
        assert torch.equal(a, b), (name, (a != b).float().mean().item())


def test_row_block_first_launch_rows_do_not_depend_on_the_token_count():
    """`row_block` (HC_BI_ROW_BLOCK, 16 by default): the tiled first launch with a fixed 16-row tile at any token count. A
    token's u, post and comb are the same bits alone and among 20 (two tiles; rows past M masked, never mixed
    in), within fp32 noise of the one-row kernel's, and a bad row_block names itself."""
    X, fn, base, scale = _site((20, 1), 4, 96, torch.bfloat16, seed=13)
    blk = hc_pre(X, fn, base, scale, EPS, HC_EPS, ITERS, chunk=64, rows=True, exact=False, row_block=16)
    one = hc_pre(X, fn, base, scale, EPS, HC_EPS, ITERS, chunk=64, rows=True, exact=False)
    for m in (1, 5, 17):
        alone = hc_pre(X[:m], fn, base, scale, EPS, HC_EPS, ITERS, chunk=64, rows=True, exact=False, row_block=16)
        assert all(torch.equal(a, b[:m]) for a, b in zip(alone, blk)), m
    assert _rel(blk[0], one[0]) <= 1e-2 and all(_rel(a, b) <= 1e-5 for a, b in zip(blk[1:], one[1:]))
    assert _rel(blk[1], blk[1].roll(1, 0)) > 1e-3  # the rows differ: no row took another's partials
    with pytest.raises(ValueError, match="row_block must be 1, 16, 32 or 64"):
        hc_pre(X, fn, base, scale, EPS, HC_EPS, ITERS, rows=True, row_block=4)


@pytest.mark.gpu
def test_row_block_rows_do_not_depend_on_the_token_count_on_cuda(monkeypatch):
    """hc_pre_rows with HC_BI_ROW_BLOCK 16 (the default) at Flash dims: a token's bits alone equal its bits among
    256 (run49's batch-64 verify of 1 + 3 tokens), and are within fp32 noise of the one-row kernel's (1)."""
    X, fn, base, scale = (t.cuda() for t in _site((256, 1), 4, 4096, torch.bfloat16, seed=10))
    ops = torch.ops.dsv4c
    assert mhc_mod.HC_BI_ROW_BLOCK == 16
    pre = ops.hc_pre_rows(X, fn, base, scale, EPS, HC_EPS, ITERS)
    monkeypatch.setattr(mhc_mod, "HC_BI_ROW_BLOCK", 1)
    one = ops.hc_pre_rows(X, fn, base, scale, EPS, HC_EPS, ITERS)
    monkeypatch.setattr(mhc_mod, "HC_BI_ROW_BLOCK", 16)
    for m in (1, 3, 17, 64):
        assert all(torch.equal(a, b[:m]) for a, b in zip(ops.hc_pre_rows(X[:m], fn, base, scale, EPS, HC_EPS, ITERS),
                                                          pre)), m
    assert _rel(pre[0], one[0]) <= 1e-2 and all(_rel(a, b) <= 1e-5 for a, b in zip(pre[1:], one[1:]))


@pytest.mark.gpu
def test_deterministic_ops_rows_do_not_depend_on_the_token_count_on_cuda():
    """hc_pre_rows, hc_post_bi and sinkhorn_bi (the deterministic mode's ops): a token's bits are the same alone,
    among decode-sized and among prefill-sized launches (the default ops change kernels at EXACT_ROWS_MIN)."""
    M = 2 * EXACT_ROWS_MIN
    X, fn, base, scale = (t.cuda() for t in _site((M, 1), 4, 4096, torch.bfloat16, seed=9))
    y = torch.randn(M, 1, 4096, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16).cuda()
    ops = torch.ops.dsv4c
    pre = ops.hc_pre_rows(X, fn, base, scale, EPS, HC_EPS, ITERS)
    post = ops.hc_post_bi(y, X, pre[1], pre[2])
    c0 = (2 * torch.randn(M, 1, 4, 4, generator=torch.Generator().manual_seed(7))).cuda()
    sk = ops.sinkhorn_bi(c0, ITERS, HC_EPS)
    for m in (1, 8, EXACT_ROWS_MIN - 1, EXACT_ROWS_MIN):
        assert all(torch.equal(a, b[:m]) for a, b in zip(ops.hc_pre_rows(X[:m], fn, base, scale, EPS, HC_EPS, ITERS),
                                                          pre)), m
        assert torch.equal(ops.hc_post_bi(y[:m], X[:m], pre[1][:m], pre[2][:m]), post[:m]), m
        assert torch.equal(ops.sinkhorn_bi(c0[:m], ITERS, HC_EPS), sk[:m]), m
