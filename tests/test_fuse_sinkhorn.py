"""The mHC Sinkhorn kernel (kernels/mhc.py), its custom op and the fuse_sinkhorn pass."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from fusion_cases import assert_same as _assert_same, exported, inputs, model as case_model, rel, run as _run

from dsv4c.kernels.mhc import sinkhorn, sinkhorn_ref
from dsv4c.model.v4 import sinkhorn as model_sinkhorn
from dsv4c.passes import PassContext, run_pipeline, verify
from dsv4c.passes.fuse_sinkhorn import fuse_sinkhorn
from dsv4c.passes.split_at_routers import OP_CAPTURE, host_sync_ops, plan_segments, reference_impl

# Kernel vs the eager reference in fp32 and in fp64, relative norm ||k - r|| / ||r||. Kernel and
# eager fp32 round differently only in exp and in the order of the N-term sums; measured <= 1.3e-7
# vs either (eager fp32 vs fp64: ~1e-7). One Sinkhorn iteration more or less moves c by ~3e-4.
KERNEL_REL = 1e-6
# A graph's outputs and cache writes, fused vs unfused: on CPU the op is the reference itself
# (bit-exact, asserted as 0); with the Triton kernel in its place (interpreter), max |err| / max |out|
# measured <= 3.5e-7 on the decode graph (4.5e-7 prefill).
GRAPH_REL = 2e-6
ITERS, EPS = 20, 1e-6

# This file's "decode" graph is the step graph of 1 + K tokens per row (fusion_cases' "verify").
_CASE_KIND = {"decode": "verify", "prefill": "prefill", "mtp": "mtp"}


# ---- the kernel (Triton interpreter on CPU) ---------------------------------------------------------
@pytest.mark.parametrize("shape,block_m", [
    ((0, 4, 4), None),         # zero rows: no launch
    ((1, 4, 4), None),
    ((2, 3, 4, 4), None),      # leading dims [B, T]
    ((37, 4, 4), 8),           # 37 matrices over blocks of 8: a partial last block
    ((5, 0, 4, 4), None),
    ((6, 2, 2), 4),
    ((9, 8, 8), 4),
    ((3, 16, 16), None),
    ((4, 1, 1), None),
])
def test_kernel_matches_reference(shape, block_m):
    g = torch.Generator().manual_seed(sum(shape))
    c0 = 3 * torch.randn(shape, generator=g)
    got = sinkhorn(c0, ITERS, EPS, block_m=block_m)
    want = sinkhorn_ref(c0, ITERS, EPS)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert rel(got, want) <= KERNEL_REL
    assert rel(got.double(), sinkhorn_ref(c0.double(), ITERS, EPS)) <= KERNEL_REL  # as close as eager fp32
    if want.numel():  # the reference did normalise: columns sum to ~1 (a kernel returning c0 fails here)
        assert torch.allclose(got.sum(-2), torch.ones(()), atol=1e-4)


@pytest.mark.parametrize("iters", [1, 2, 7])
def test_kernel_iteration_counts_and_strided_input(iters):
    g = torch.Generator().manual_seed(iters)
    c0 = 4 * torch.randn(4, 4, 5, 3, generator=g)
    strided = c0.permute(2, 3, 0, 1)  # [5, 3, 4, 4], not contiguous
    got = sinkhorn(strided, iters, 1e-3, block_m=4)
    want = sinkhorn_ref(strided, iters, 1e-3)
    assert rel(got, want) <= KERNEL_REL
    assert rel(sinkhorn_ref(strided, iters + 1, 1e-3), want) > 10 * KERNEL_REL  # iterations matter here


@pytest.mark.parametrize("bad,err", [
    (torch.zeros(2, 4, 4, dtype=torch.float64), "float32"),
    (torch.zeros(2, 4, 3), r"\[..., N, N\]"),
    (torch.zeros(4), r"\[..., N, N\]"),
    (torch.zeros(2, 3, 3), "power of two"),
    (torch.zeros(2, 32, 32), "power of two <= 16"),
])
def test_wrapper_rejects_bad_input(bad, err):
    with pytest.raises(ValueError, match=err):
        sinkhorn(bad, ITERS, EPS)


def test_wrapper_rejects_zero_iterations():
    with pytest.raises(ValueError, match="iters"):
        sinkhorn(torch.zeros(2, 4, 4), 0, EPS)


# ---- the custom op --------------------------------------------------------------------------------
def test_op_is_the_reference_on_cpu_fake_and_capture_safe():
    from dsv4c.model import register_ops

    register_ops()  # what makes the op available (as for the other dsv4c ops)
    c0 = 3 * torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(torch.ops.dsv4c.sinkhorn(c0, ITERS, EPS), model_sinkhorn(c0, ITERS, EPS))
    with torch._subclasses.FakeTensorMode() as mode:
        fake = torch.ops.dsv4c.sinkhorn(mode.from_tensor(c0), ITERS, EPS)
    assert fake.shape == c0.shape and fake.dtype == c0.dtype
    assert OP_CAPTURE["dsv4c.sinkhorn"] is None
    assert host_sync_ops(reference_impl("dsv4c.sinkhorn"), c0, ITERS, EPS) == []


# ---- the pass -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return case_model("v4")   # v4-tiny-a cut to 2 layers (SWA + CSA with its indexer)


def _exported(model, kind):
    """The unfused GraphModule of `kind` (a deep copy of the one export)."""
    return exported("v4", _CASE_KIND[kind])


def _inputs(model, kind):
    """Random inputs; main graphs run on a cache filled by a ragged prompt in slots 0 and 1."""
    return inputs("v4", _CASE_KIND[kind])


def _sites(model, kind) -> int:
    cfg = model.config
    return 2 if kind == "mtp" else 2 * cfg.num_hidden_layers


@pytest.mark.parametrize("kind", ["decode", "prefill", "mtp"])
def test_pass_fuses_every_site_and_preserves_outputs(model, kind):
    ctx = PassContext(model.config, "cpu", graph_kind=kind)
    ref_gm = _exported(model, kind)
    gm = _exported(model, kind)
    n_before = len(gm.graph.nodes)
    res = fuse_sinkhorn(gm, ctx)
    gm = res.graph
    gm.recompile()
    verify(gm, ctx, after="fuse_sinkhorn")
    assert res.changed and res.stats["sites"] == _sites(model, kind)
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.dsv4c.sinkhorn.default) == _sites(model, kind)
    assert torch.ops.aten.softmax.int not in ops  # the attention softmax lives inside v4_attention
    assert n_before - len(gm.graph.nodes) == _sites(model, kind) * (6 * ITERS - 2)  # 6·iters − 1 ops -> 1
    args = _inputs(model, kind)
    _assert_same(_run(gm, args), _run(ref_gm, args))  # CPU: the op is the reference: exact

    # a second run finds nothing left
    again = fuse_sinkhorn(gm, ctx)
    assert not again.changed and again.stats["sites"] == 0


def test_fused_graph_with_the_triton_kernel_matches(model):
    """The decode graph with each dsv4c.sinkhorn node running the Triton kernel (interpreter)."""
    ctx = PassContext(model.config, "cpu", graph_kind="decode")
    ref_gm = _exported(model, "decode")
    gm = fuse_sinkhorn(_exported(model, "decode"), ctx).graph
    for n in gm.graph.nodes:
        if n.target is torch.ops.dsv4c.sinkhorn.default:
            n.target = sinkhorn  # the host wrapper, called with (c0, iters, eps)
    gm.recompile()
    args = _inputs(model, "decode")
    got, want = _run(gm, args), _run(ref_gm, args)
    _assert_same(got, want, rel=GRAPH_REL)


def test_sites_that_differ_are_left_alone(model):
    """A config whose hc_eps differs from the graph's literal: the pattern does not match."""
    cfg = dataclasses.replace(model.config, hc_eps=1e-5)
    gm = _exported(model, "decode")
    before = gm.code
    res = fuse_sinkhorn(gm, PassContext(cfg, "cpu", graph_kind="decode"))
    assert not res.changed and res.stats["sites"] == 0 and res.graph.code == before
    cfg = dataclasses.replace(model.config, hc_sinkhorn_iters=ITERS + 1)  # a longer chain than the graph's
    res = fuse_sinkhorn(gm, PassContext(cfg, "cpu", graph_kind="decode"))
    assert not res.changed and res.graph.code == before


@pytest.mark.parametrize("kind,target,skip", [
    ("prefill", "cpu", ()),
    ("decode", "h200", ("quantize_experts", "quantize_dense")),  # lossy (tests/test_quantize_experts.py); static ops swapped in
])
def test_in_the_pipeline(model, kind, target, skip):
    """fuse_sinkhorn runs in default_pipeline: every site fused, the pipeline's outputs equal the same
    pipeline without it, and a second application finds nothing."""
    ctx = PassContext(model.config, target, graph_kind=kind)
    args = _inputs(model, kind)
    unfused, _ = run_pipeline(_exported(model, kind), ctx, skip=skip + ("fuse_sinkhorn",))
    want = _run(unfused, args)
    gm, recs = run_pipeline(_exported(model, kind), ctx, skip=skip)
    rec = next(r for r in recs if r.name == "fuse_sinkhorn")
    assert rec.changed and rec.stats["sites"] == _sites(model, kind)
    _assert_same(_run(gm, args), want)
    again = fuse_sinkhorn(gm, ctx)
    assert not again.changed and again.stats["sites"] == 0
    if target == "h200":  # the fused sites sit in capturable static segments (fuse_hc, next, takes them into hc_pre,
        plan = plan_segments(gm, ctx)  # and fuse_hc_chain most of those into hc_post_pre)
        ops = (torch.ops.dsv4c.sinkhorn.default, torch.ops.dsv4c.hc_pre.default, torch.ops.dsv4c.hc_post_pre.default)
        names = {n.name for n in gm.graph.nodes if n.target in ops}
        assert len(names) == _sites(model, kind)
        holding = [s for s in plan.segments if names & set(s.nodes)]
        assert sum(len(names & set(s.nodes)) for s in holding) == len(names)
        assert all(s.kind == "static" and s.capturable for s in holding), [(s.index, s.reason) for s in holding]


@pytest.mark.gpu
def test_kernel_on_cuda_matches_reference_and_captures():
    """The compiled kernel (not the interpreter) against the fp32 reference, and inside a CUDA graph."""
    g = torch.Generator().manual_seed(0)
    for shape in [(1, 1, 4, 4), (64, 1, 4, 4), (3, 5, 4, 4), (1000, 4, 4), (7, 8, 8)]:
        c0 = (torch.randn(*shape, generator=g) * 3).cuda()
        ref = sinkhorn_ref(c0, 20, 1e-6)
        out = torch.ops.dsv4c.sinkhorn(c0, 20, 1e-6)
        rel = ((out - ref).norm() / ref.norm()).item()
        assert rel < 1e-6, (shape, rel)
    c0 = torch.randn(8, 1, 4, 4, device="cuda")
    torch.ops.dsv4c.sinkhorn(c0, 20, 1e-6)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.dsv4c.sinkhorn(c0, 20, 1e-6)
    c0.copy_(torch.randn(8, 1, 4, 4, device="cuda"))
    graph.replay()
    torch.testing.assert_close(out, sinkhorn_ref(c0, 20, 1e-6), rtol=1e-5, atol=1e-7)
