"""The V4 router kernel (kernels/router.py), its custom ops and the fuse_router pass."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dsv4c.kernels import router as R
from dsv4c.kernels.router import (route_hashed, route_hashed_ids, route_hashed_ids_ref, route_hashed_ref, route_topk,
                                  route_topk_ref)
from dsv4c.kernels.tolerances import rel_err
from dsv4c.model import register_ops
from dsv4c.passes import PassContext, verify
from dsv4c.passes.fuse_router import fuse_router
from dsv4c.passes.lower_f32_linears import lower_f32_linears
from dsv4c.passes.split_at_routers import OP_CAPTURE, host_sync_ops, reference_impl
from fusion_cases import assert_in_capturable_segments, pipeline_pair, swap_targets
from fusion_cases import (assert_same as _assert_same, exported as _exported, inputs as _inputs, model as _model,
                           run as _run)

register_ops()

# Kernel vs the model's function: expert ids equal; weights ||k - r|| / ||r|| (the softplus written
# out within a few ulp, a tree sum of K scores; measured <= 1.4e-7 under the interpreter).
W_REL = 1e-6
SP_ULP = 4  # sqrt(softplus) vs fp64, normal range (measured <= 1.9 ulp; torch's own: 1.4)
GRAPH_REL = 2e-6  # graphs with the Triton kernels (interpreter) in place of the ops, fp32 model
TOPK, HASHED = torch.ops.dsv4c.route_topk.default, torch.ops.dsv4c.route_hashed.default
HASHED_IDS = torch.ops.dsv4c.route_hashed_ids.default


def _case(T, E, K, seed):
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(T, E, generator=g)
    bias = 0.5 * torch.randn(E, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K, dtype=torch.long)
    return logits, bias, idx


def _table(V, E, K, T, seed):
    """A hash table tid2eid [V, K] (K distinct experts a row) and token ids [T] into it, repeats included."""
    g = torch.Generator().manual_seed(seed)
    table = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(V)])
    return table, torch.randint(0, V, (T,), generator=g)


# ---- the kernels (Triton interpreter on CPU) ------------------------------------------------------
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("E,K", [(40, 2), (40, 6), (256, 2), (256, 6)])
def test_kernels_match_the_model_functions(T, E, K):
    logits, bias, hidx = _case(T, E, K, seed=T * 1000 + E + K)
    idx, w = route_topk(logits, bias, K, 1.5)
    ridx, rw = route_topk_ref(logits, bias, K, 1.5)
    assert idx.dtype == torch.int64 and w.dtype == torch.float32 and idx.shape == w.shape == (T, K)
    assert torch.equal(idx, ridx)  # random scores: no ties
    assert rel_err(w, rw) <= W_REL
    assert torch.allclose(w.sum(-1), torch.full((T,), 1.5))
    # the bias takes part in the choice only (a kernel ignoring it picks other experts here)
    assert not torch.equal(route_topk(logits, torch.zeros(E), K, 1.5)[0], route_topk(logits, 4 * bias, K, 1.5)[0])
    hw = route_hashed(logits, hidx, 2.5)
    assert hw.shape == (T, K) and rel_err(hw, route_hashed_ref(logits, hidx, 2.5)) <= W_REL
    table, ids = _table(50, E, K, T, seed=T + E)
    tidx, tw = route_hashed_ids(logits, ids, table, 2.5)
    ridx, rw = route_hashed_ids_ref(logits, ids, table, 2.5)
    assert tidx.shape == (T, K) and torch.equal(tidx, ridx) and torch.equal(tidx, table[ids])
    assert rel_err(tw, rw) <= W_REL
    strided = torch.stack([ids, torch.zeros_like(ids)], 1)[:, 0]  # ids with stride 2 (a column of a step's ids)
    sidx, sw = route_hashed_ids(logits, strided, table, 2.5)
    assert torch.equal(sidx, tidx) and torch.equal(sw, tw)


@triton.jit
def _sqrt_softplus_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    tl.store(out_ptr + i, R._sqrt_softplus(tl.load(x_ptr + i, mask=m, other=0.0)), mask=m)


def _ulps(a: torch.Tensor, ref64: torch.Tensor) -> torch.Tensor:
    r = ref64.float().abs()
    return (a.double() - ref64).abs() / (torch.nextafter(r, torch.tensor(float("inf"))) - r).double()


def test_sqrt_softplus_below_and_above_the_threshold():
    """The kernel's sqrt(softplus) against fp64, from -87 (below, softplus stays a normal number) to 40:
    log1p(exp(x)) below 20, x itself above (torch's threshold), exact at and around 20."""
    x = torch.cat([torch.linspace(-87, 40, 20001), torch.linspace(-1, 1, 2001),
                   torch.tensor([20.0, 20.000002, 19.999998, 0.0, -0.0, 1e-30, -1e-30, 1e30])])
    out = torch.empty_like(x)
    _sqrt_softplus_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    xd = x.double()
    ref64 = torch.where(xd > 20, xd, torch.log1p(torch.exp(xd))).sqrt()
    assert _ulps(out, ref64).max() <= SP_ULP
    above = x > 20
    # x itself, its square root correctly rounded (torch's CPU fp32 sqrt is not, for ~1/8 of these x)
    assert torch.equal(out[above], x[above].double().sqrt().float())
    assert _ulps(F.softplus(x).sqrt(), ref64).max() <= SP_ULP  # the reference is within the same bound
    tail = torch.tensor([-100.0, -200.0, float("-inf")])  # e^x underflows: s ~ 0, no NaN
    t_out = torch.empty_like(tail)
    _sqrt_softplus_kernel[(1,)](tail, t_out, 3, BLOCK=4)
    assert torch.all(t_out < 1e-21) and torch.all(t_out >= 0)


def test_large_logits_take_the_threshold_branch_in_the_router():
    logits, bias, hidx = _case(3, 40, 6, seed=7)
    logits = logits * 4 + 12  # many above 20, some below
    assert (logits > 20).any() and (logits < 20).any()
    idx, w = route_topk(logits, bias, 6, 1.0)
    ridx, rw = route_topk_ref(logits, bias, 6, 1.0)
    assert torch.equal(idx, ridx) and rel_err(w, rw) <= W_REL
    assert rel_err(route_hashed(logits, hidx, 1.0), route_hashed_ref(logits, hidx, 1.0)) <= W_REL


def test_ties_go_to_the_lowest_index_in_descending_order():
    logits = torch.zeros(2, 12)
    logits[1, [3, 9]] = 1.0  # two equal maxima
    idx, w = route_topk(logits, torch.zeros(12), 4, 1.0)
    assert idx.tolist() == [[0, 1, 2, 3], [3, 9, 0, 1]]
    assert torch.allclose(w[0], torch.full((4,), 0.25))


def test_no_rows_launch_nothing():
    idx, w = route_topk(torch.zeros(0, 40), torch.zeros(40), 2, 1.0)
    assert idx.shape == w.shape == (0, 2)
    assert route_hashed(torch.zeros(0, 40), torch.zeros(0, 2, dtype=torch.long), 1.0).shape == (0, 2)
    idx, w = route_hashed_ids(torch.zeros(0, 40), torch.zeros(0, dtype=torch.long), torch.zeros(9, 2, dtype=torch.long), 1.0)
    assert idx.shape == w.shape == (0, 2)


def test_hashed_kernel_bad_ids_give_nan_not_a_wild_read():
    logits = torch.randn(2, 16)
    w = route_hashed(logits, torch.tensor([[1, 2], [3, 16]]), 1.0)
    assert torch.isfinite(w[0]).all() and torch.isnan(w[1]).all()
    table = torch.tensor([[1, 2], [3, 16], [4, 5]])  # token 1's row names expert 16 of 16
    idx, w = route_hashed_ids(logits.repeat(2, 1), torch.tensor([0, 1, 3, -1]), table, 1.0)
    assert idx[:2].tolist() == [[1, 2], [3, 16]] and idx[2:].tolist() == [[0, 0], [0, 0]]  # unknown tokens: expert 0
    assert torch.isfinite(w[0]).all() and torch.isnan(w[1:]).all()


@pytest.mark.parametrize("call,err", [
    (lambda: route_topk(torch.zeros(2, 8, dtype=torch.float64), torch.zeros(8), 2, 1.0), "logits must be float32"),
    (lambda: route_topk(torch.zeros(8), torch.zeros(8), 2, 1.0), r"logits must be \[T, E\]"),
    (lambda: route_topk(torch.zeros(8, 2).t(), torch.zeros(8), 2, 1.0), "logits must be contiguous"),
    (lambda: route_topk(torch.zeros(1, 600), torch.zeros(600), 2, 1.0), "MAX_E = 512"),
    (lambda: route_topk(torch.zeros(2, 8), torch.zeros(7), 2, 1.0), r"bias must be a contiguous float32 \[8\]"),
    (lambda: route_topk(torch.zeros(2, 8), torch.zeros(8, dtype=torch.bfloat16), 2, 1.0), "bias must be"),
    (lambda: route_topk(torch.zeros(2, 8), torch.zeros(8), 9, 1.0), r"k = 9; need 1 <= k <= min\(E = 8"),
    (lambda: route_topk(torch.zeros(2, 8), torch.zeros(8), 0, 1.0), "k = 0"),
    (lambda: route_hashed(torch.zeros(2, 8), torch.zeros(2, 2, dtype=torch.int32), 1.0), "idx must be a contiguous int64"),
    (lambda: route_hashed(torch.zeros(2, 8), torch.zeros(3, 2, dtype=torch.long), 1.0), r"int64 \[2, K\]"),
    (lambda: route_hashed(torch.zeros(2, 8), torch.zeros(2, 40, dtype=torch.long), 1.0), "K = 40 columns"),
    (lambda: route_hashed_ids(torch.zeros(2, 8), torch.zeros(2, 1, dtype=torch.long), torch.zeros(5, 2, dtype=torch.long),
                              1.0), r"ids must be an int64 \[2\]"),
    (lambda: route_hashed_ids(torch.zeros(2, 8), torch.zeros(2, dtype=torch.long), torch.zeros(5, 2, dtype=torch.int32),
                              1.0), "tid2eid must be a contiguous int64"),
    (lambda: route_hashed_ids(torch.zeros(2, 8), torch.zeros(2, dtype=torch.long), torch.zeros(5, 40, dtype=torch.long),
                              1.0), "tid2eid has K = 40 columns"),
    (lambda: torch.ops.dsv4c.route_topk(torch.zeros(2, 8), torch.zeros(7), 2, 1.0), "bias must be"),
    (lambda: torch.ops.dsv4c.route_hashed(torch.zeros(2, 8, dtype=torch.float16), torch.zeros(2, 2, dtype=torch.long),
                                          1.0), "logits must be float32"),
])
def test_bad_input_is_rejected_naming_the_tensor(call, err):
    with pytest.raises(ValueError, match=err):
        call()


# ---- the custom ops -------------------------------------------------------------------------------
def test_ops_are_the_model_functions_on_cpu_fake_and_capture_safe():
    logits, bias, hidx = _case(5, 40, 6, seed=3)
    idx, w = torch.ops.dsv4c.route_topk(logits, bias, 6, 1.5)
    ridx, rw = route_topk_ref(logits, bias, 6, 1.5)
    assert torch.equal(idx, ridx) and torch.equal(w, rw)
    assert torch.equal(torch.ops.dsv4c.route_hashed(logits, hidx, 1.5), route_hashed_ref(logits, hidx, 1.5))
    table, ids = _table(30, 40, 6, 5, seed=3)
    oi, ow = torch.ops.dsv4c.route_hashed_ids(logits, ids, table, 1.5)
    assert torch.equal(oi, table[ids]) and torch.equal(ow, route_hashed_ref(logits, table[ids], 1.5))
    assert str(TOPK._schema) == "dsv4c::route_topk(Tensor logits, Tensor bias, int k, float scale) -> (Tensor, Tensor)"
    with torch._subclasses.FakeTensorMode() as mode:
        fi, fw = torch.ops.dsv4c.route_topk(mode.from_tensor(logits), mode.from_tensor(bias), 6, 1.5)
        fh = torch.ops.dsv4c.route_hashed(mode.from_tensor(logits), mode.from_tensor(hidx), 1.5)
        ti, tw = torch.ops.dsv4c.route_hashed_ids(mode.from_tensor(logits), mode.from_tensor(ids),
                                                  mode.from_tensor(table), 1.5)
    assert (fi.shape, fi.dtype, fw.shape, fw.dtype) == ((5, 6), torch.int64, (5, 6), torch.float32)
    assert (fh.shape, fh.dtype) == ((5, 6), torch.float32)
    assert (ti.shape, ti.dtype, tw.shape, tw.dtype) == ((5, 6), torch.int64, (5, 6), torch.float32)
    assert all(OP_CAPTURE[f"dsv4c.{n}"] is None for n in ("route_topk", "route_hashed", "route_hashed_ids"))
    assert host_sync_ops(reference_impl("dsv4c.route_topk"), logits, bias, 6, 1.5) == []
    assert host_sync_ops(reference_impl("dsv4c.route_hashed"), logits, hidx, 1.5) == []
    assert host_sync_ops(reference_impl("dsv4c.route_hashed_ids"), logits, ids, table, 1.5) == []


# ---- the pass ------------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _hash_lookup_on(monkeypatch):
    """The pass tests here take the hash layers' table lookup into the op (fuse_router.HASH_LOOKUP, off by
    default: no faster on the device, run78); test_a_lookup_left_out_leaves_route_hashed[off] checks the default."""
    import dsv4c.passes.fuse_router as FR

    monkeypatch.setattr(FR, "HASH_LOOKUP", True)


def _expected(name, kind, lookup: bool = True) -> dict:
    """Router sites by variant, from the config: each layer's MoE (the first num_hash_layers hashed, their
    table lookup inside the op with `lookup`), or the MTP block's one top-K router."""
    cfg = _model(name).config
    if kind == "mtp":
        return {"topk": 1, "hashed_ids": 0, "hashed": 0}
    h = cfg.num_hash_layers
    return {"topk": cfg.num_hidden_layers - h, "hashed_ids": h if lookup else 0, "hashed": 0 if lookup else h}


def _count(gm, op) -> int:
    return sum(nd.target is op for nd in gm.graph.nodes)


@pytest.mark.parametrize("kind,dtype", [
    ("decode", torch.float32),
    ("verify", torch.float32),
    ("mtp", torch.float32),
    ("prefill", torch.bfloat16),
])
def test_pass_fuses_every_router_bit_exact(kind, dtype):
    model = _model("v4", dtype)
    ctx = PassContext(model.config, "cpu", graph_kind=kind)
    ref_gm = _exported("v4", kind, dtype)
    gm = _exported("v4", kind, dtype)
    if dtype != torch.float32:  # as in the pipeline: the logits are dsv4c.linear_f32 by now
        gm = lower_f32_linears(gm, ctx).graph
    res = fuse_router(gm, ctx)
    gm = res.graph
    verify(gm, ctx, after="fuse_router")
    want = _expected("v4", kind)
    assert res.changed and res.stats["variants"] == want and res.stats["sites"] == sum(want.values()) > 0
    assert _count(gm, TOPK) == want["topk"] and _count(gm, HASHED_IDS) == want["hashed_ids"]
    assert _count(gm, HASHED) == 0
    assert _count(gm, torch.ops.aten.softplus.default) == 0 and _count(gm, torch.ops.aten.topk.default) == 0
    assert _count(gm, torch.ops.aten.index.Tensor) == _count(ref_gm, torch.ops.aten.index.Tensor) - want["hashed_ids"]
    if dtype != torch.float32:
        assert all(nd.args[0].target is torch.ops.dsv4c.linear_f32.default
                   for nd in gm.graph.nodes if nd.target in (TOPK, HASHED_IDS))
    args = _inputs("v4", kind, dtype)
    _assert_same(_run(gm, args), _run(ref_gm, args))  # CPU: the ops are the model's functions: exact
    again = fuse_router(gm, ctx)
    assert not again.changed and again.stats["sites"] == 0


@pytest.mark.parametrize("kind", ["decode", "verify"])
def test_fused_graph_with_the_triton_kernels_matches(kind):
    ctx = PassContext(_model("v4").config, "cpu", graph_kind=kind)
    ref_gm = _exported("v4", kind)
    gm = fuse_router(_exported("v4", kind), ctx).graph
    assert swap_targets(gm, {TOPK: route_topk, HASHED_IDS: route_hashed_ids}) == sum(_expected("v4", kind).values())
    args = _inputs("v4", kind)
    _assert_same(_run(gm, args), _run(ref_gm, args), rel=GRAPH_REL)


@pytest.mark.parametrize("why", ["refused", "off"])
def test_a_lookup_left_out_leaves_route_hashed(monkeypatch, why):
    """Where the table lookup does not move into the op (a site refused, or HASH_LOOKUP off: the default),
    the hashed sites are the plain `route_hashed` after the ATen lookup, still bit-exact."""
    import dsv4c.passes.fuse_router as FR

    if why == "refused":
        monkeypatch.setattr(FR, "_hashed_ids_ok", lambda site, k: False)
    else:
        monkeypatch.undo()  # the module's own default
        assert FR.HASH_LOOKUP is False
    ctx = PassContext(_model("v4").config, "cpu", graph_kind="decode")
    ref_gm = _exported("v4", "decode")
    res = FR.fuse_router(_exported("v4", "decode"), ctx)
    want = _expected("v4", "decode", lookup=False)
    assert res.stats["variants"] == want
    assert _count(res.graph, HASHED) == want["hashed"] > 0 and _count(res.graph, HASHED_IDS) == 0
    args = _inputs("v4", "decode")
    _assert_same(_run(res.graph, args), _run(ref_gm, args))


def test_other_k_or_scale_and_v3_graphs_are_left_alone():
    import dataclasses

    cfg = _model("v4").config
    for other in (dataclasses.replace(cfg, routed_scaling_factor=2.0), dataclasses.replace(cfg, num_experts_per_tok=3)):
        gm = _exported("v4", "mtp")
        res = fuse_router(gm, PassContext(other, "cpu", graph_kind="mtp"))
        assert res.stats["sites"] == 0 and _count(res.graph, TOPK) == 0
    v3 = _exported("v3-tiny", "decode")
    before = v3.code
    res = fuse_router(v3, PassContext(_model("v3-tiny").config, "cpu", graph_kind="decode"))
    assert not res.changed and res.stats["sites"] == 0 and res.graph.code == before


def test_in_the_pipeline_routers_sit_in_capturable_segments():
    """fuse_router runs in default_pipeline right after lower_f32_linears: the outputs equal the pipeline
    without it, and on h200 the fused routers sit in capturable static segments."""
    ctx, gm, recs, _ = pipeline_pair("fuse_router")
    names = [r.name for r in recs]
    assert names.index("fuse_router") == names.index("lower_f32_linears") + 1
    want = _expected("v4", "decode")
    assert next(r for r in recs if r.name == "fuse_router").stats["variants"] == want
    assert_in_capturable_segments(gm, ctx, (TOPK, HASHED_IDS), sum(want.values()))


# ---- CUDA (the device) ------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 64])
def test_kernels_on_cuda(T):
    """V4-Flash's router: E = 256, K = 6, against the model's functions run on CUDA."""
    logits, bias, hidx = (t.cuda() for t in _case(T, 256, 6, seed=T))
    idx, w = torch.ops.dsv4c.route_topk(logits, bias, 6, 1.5)
    ridx, rw = route_topk_ref(logits, bias, 6, 1.5)
    assert torch.equal(idx, ridx) and rel_err(w, rw) <= W_REL
    hw = torch.ops.dsv4c.route_hashed(logits, hidx, 1.5)
    assert rel_err(hw, route_hashed_ref(logits, hidx, 1.5)) <= W_REL
    table, ids = (t.cuda() for t in _table(1000, 256, 6, T, seed=T))
    ti, tw = torch.ops.dsv4c.route_hashed_ids(logits, ids, table, 1.5)
    ri, rw = route_hashed_ids_ref(logits, ids, table, 1.5)
    assert torch.equal(ti, ri) and rel_err(tw, rw) <= W_REL


@pytest.mark.gpu
def test_ops_capture_in_a_cuda_graph():
    logits, bias, hidx = (t.cuda() for t in _case(8, 256, 6, seed=11))
    table, ids = (t.cuda() for t in _table(1000, 256, 6, 8, seed=11))
    torch.ops.dsv4c.route_topk(logits, bias, 6, 1.5)  # compile before capture
    torch.ops.dsv4c.route_hashed(logits, hidx, 1.5)
    torch.ops.dsv4c.route_hashed_ids(logits, ids, table, 1.5)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        idx, w = torch.ops.dsv4c.route_topk(logits, bias, 6, 1.5)
        hw = torch.ops.dsv4c.route_hashed(logits, hidx, 1.5)
        ti, tw = torch.ops.dsv4c.route_hashed_ids(logits, ids, table, 1.5)
    logits.copy_(3 * torch.randn_like(logits))
    ids.copy_(torch.randint_like(ids, 0, 1000))  # new tokens: the lookup happens at replay
    graph.replay()
    torch.cuda.synchronize()
    ridx, rw = route_topk_ref(logits, bias, 6, 1.5)
    assert torch.equal(idx, ridx) and rel_err(w, rw) <= W_REL
    assert rel_err(hw, route_hashed_ref(logits, hidx, 1.5)) <= W_REL
    ri, rw = route_hashed_ids_ref(logits, ids, table, 1.5)
    assert torch.equal(ti, ri) and rel_err(tw, rw) <= W_REL
