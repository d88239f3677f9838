"""passes/overlap_early_ops.py: a compressed layer's compressor / indexer projection and a hash layer's expert
lookup forked onto the side stream where their inputs are ready and joined before their first reader;
outputs and cache writes bit-identical; routers' gates and the head stay; `stream_passes` in the Session."""
from __future__ import annotations

import pytest
import torch
from torch.fx import Graph, GraphModule

from dsv4c.passes import PassContext, run_pipeline, stream_passes
from dsv4c.passes import overlap_early_ops as early
from dsv4c.passes.overlap_shared_experts import SideStream, graph_copy, side_join
from dsv4c.passes.split_at_routers import apply_plan, op_name, plan_segments
from dsv4c.runtime.segments import SegmentExecutor
from fusion_cases import assert_same, exported, inputs, model, run

BF16 = torch.bfloat16


def _lowered(kind: str):
    """The two-layer V4's `kind` graph in bf16 through the h100 pipeline (its compressor and router projections
    are fp32 linears of bf16 weights, `linear_f32_fused`, as in the release checkpoint's model) and its context."""
    ctx = PassContext(model("v4", BF16).config, "h100", graph_kind="decode" if kind == "verify" else kind)
    gm, _ = run_pipeline(exported("v4", kind, BF16), ctx)
    return gm, ctx


def _first(nodes, pred):
    return next(i for i, n in enumerate(nodes) if pred(n))


def _op(n) -> str:
    return op_name(n.target) if n.op == "call_function" else ""


@pytest.mark.parametrize("kind", ["decode", "verify"])
def test_compressor_projection_and_hash_lookup_fork_where_their_inputs_are_ready(kind):
    gm, ctx = _lowered(kind)
    args = inputs("v4", kind, BF16)
    before = run(gm, args)
    res = early.overlap_early_ops(graph_copy(gm), ctx)
    out = res.graph
    # candidates: the hash lookup, the compressor projection, two routers' gates and the head
    assert res.stats["seen"] == 5 and res.stats["forked"] == 2, res.stats
    assert len(res.stats["skipped"]) == 3 and all("before its first reader" in w for w in res.stats["skipped"].values())
    nodes = list(out.graph.nodes)
    calls = {n: getattr(out, n.target) for n in nodes if n.op == "call_module" and n.target.startswith("early_")}
    moved = {n: [_op(b) for b in m.body.graph.nodes if b.op == "call_function"] for n, m in calls.items()}
    assert sorted(moved.values()) == [["aten.index"], ["dsv4c.linear_f32_fused"]]
    assert all(isinstance(m, SideStream) for m in calls.values())
    for call, ops in moved.items():
        (join,) = call.users
        assert join.target is side_join
        at, joined = nodes.index(call), nodes.index(join)
        if ops == ["aten.index"]:  # before the step's first kernel; joined before route_hashed reads it
            assert at < _first(nodes, lambda n: _op(n) == "aten.embedding")
            assert _op(nodes[joined + 1]) == "dsv4c.route_hashed"
        else:  # right after layer 1's attention norm, before its wq_a ‖ wkv GEMV and its q path
            norm = call.args[0]
            assert _op(norm) == "dsv4c.rms_norm" and nodes.index(norm) < at
            q_path = [i for i, n in enumerate(nodes) if at < i < joined and _op(n).startswith("dsv4c.")]
            assert {_op(nodes[i]) for i in q_path} >= {"dsv4c.fp8_linear_w8a16", "dsv4c.head_rms_rope_fused"}
            assert joined < _first(nodes, lambda n: _op(n) == "dsv4c.v4_compress_fused")
    assert_same(run(out, args), before)
    assert_same(run(gm, args), before)  # graph_copy left the original alone


def test_stream_passes_run_in_a_whole_step_executor():
    """Both stream passes in order (`stream_passes`), split at the routers and run as one whole step
    (full-emulate): the same segments, all capturable, and the same outputs and cache writes."""
    gm, ctx = _lowered("decode")
    args = inputs("v4", "decode", BF16)
    plan0 = plan_segments(gm, ctx)
    out, records = run_pipeline(graph_copy(gm), ctx, passes=stream_passes(), check=False)
    assert [(r.name, r.stats["forked"]) for r in records] == [("overlap_shared_experts", 2), ("overlap_early_ops", 2)]
    plan = plan_segments(out, ctx)
    assert len(plan.segments) == len(plan0.segments) and plan.n_capturable == len(plan.segments)
    ex0 = SegmentExecutor(apply_plan(gm, plan0), plan0, "cpu", buckets=(2,), mode="full-emulate")
    ex = SegmentExecutor(apply_plan(out, plan), plan, "cpu", buckets=(2,), mode="full-emulate")
    assert_same(run(ex, args), run(ex0, args))


def _toy(index_from_cache: bool) -> GraphModule:
    """ids, a cache and a table: y = table[ids] (or cache[ids]) read after two kernels on the main stream."""
    g = Graph()
    ids, cache, x = g.placeholder("ids"), g.placeholder("caches_0_ring"), g.placeholder("x")
    root = torch.nn.Module()
    root.table = torch.arange(12.0).view(6, 2)
    table = g.get_attr("table")
    h = g.call_function(torch.ops.aten.mm.default, (x, x))
    h = g.call_function(torch.ops.aten.mm.default, (h, x))
    y = g.call_function(torch.ops.aten.index.Tensor, (cache if index_from_cache else table, [ids]))
    g.output(g.call_function(torch.ops.aten.add.Tensor, (y, h)))
    gm = GraphModule(root, g)
    vals = {"ids": torch.tensor([1, 4]), "caches_0_ring": torch.randn(6, 2), "x": torch.randn(2, 2)}
    for n in gm.graph.nodes:  # the pass reads meta["val"] for the side call's
        if n.op == "placeholder":
            n.meta["val"] = vals[n.name]
    return gm, vals


def test_the_rules_what_stays_on_the_main_stream(monkeypatch):
    ctx = PassContext(model("v4", BF16).config, "cpu", graph_kind="decode")
    gm, vals = _toy(False)
    want = gm(**vals)
    res = early.overlap_early_ops(gm, ctx)
    assert res.stats["forked"] == 1
    assert torch.equal(res.graph(**vals), want)
    gm, vals = _toy(True)  # reads a cache: other ops write caches in place, so it stays where it was
    res = early.overlap_early_ops(gm, ctx)
    assert not res.changed and "reads a cache" in next(iter(res.stats["skipped"].values()))
    monkeypatch.setattr(early, "MIN_BETWEEN", 3)  # two mm launches between fork and reader: too few now
    gm, vals = _toy(False)
    res = early.overlap_early_ops(gm, ctx)
    assert not res.changed and "2 kernel(s) before its first reader" in next(iter(res.stats["skipped"].values()))
