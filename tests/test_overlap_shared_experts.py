"""passes/overlap_shared_experts.py: each MoE layer's shared expert moved into a side-stream call placed
after its router (or before it, FORK_BEFORE_ROUTER 1) and joined before the post-mix; outputs and cache
writes bit-identical; the Session applies it to whole-step graphs only."""
from __future__ import annotations

import json
import operator
import warnings

import pytest
import torch

from dsv4c.bench import side_streams
from dsv4c.passes import PassContext, run_pipeline
from dsv4c.passes.overlap_shared_experts import SideStream, _ancestors, graph_copy, overlap_shared_experts, side_join
from dsv4c.passes.split_at_routers import MOE_OPS, apply_plan, op_name, plan_segments
from dsv4c.runtime.segments import SegmentExecutor
from fusion_cases import assert_same, exported, inputs, model, run

SHARED_OPS = {"dsv4c.fp8_linear_w8a16", "dsv4c.swiglu_act", "aten.linear"}


def _lowered(kind: str):
    """The two-layer V4's `kind` graph through the h200 pipeline (quantised experts and dense linears) and
    its context."""
    ctx = PassContext(model("v4").config, "h200", graph_kind="decode" if kind == "verify" else kind)
    gm, _ = run_pipeline(exported("v4", kind), ctx)
    return gm, ctx


def _calls(gm, fn) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function" and fn(n)]


def _side_calls(gm) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_module" and isinstance(getattr(gm, n.target), SideStream)]


@pytest.mark.parametrize("kind", ["decode", "verify"])
def test_each_shared_expert_moves_before_its_router_and_outputs_are_bit_identical(kind, monkeypatch):
    """FORK_BEFORE_ROUTER 1: each side call sits right after x, before its layer's router."""
    import dsv4c.passes.overlap_shared_experts as ose

    monkeypatch.setattr(ose, "FORK_BEFORE_ROUTER", 1)
    gm, ctx = _lowered(kind)
    args = inputs("v4", kind)
    before = run(gm, args)
    n_shared = len(_calls(gm, lambda n: op_name(n.target) == "dsv4c.swiglu_act"))
    res = overlap_shared_experts(graph_copy(gm), ctx)
    out = res.graph
    assert res.changed and res.stats["forked"] == res.stats["layers"] == 2 == n_shared, res.stats
    assert not _calls(out, lambda n: op_name(n.target) == "dsv4c.swiglu_act")  # all moved into the bodies
    nodes = list(out.graph.nodes)
    for call in _side_calls(out):
        body = getattr(out, call.target)
        assert isinstance(body, SideStream)
        moved = {op_name(n.target) for n in body.body.graph.nodes if n.op == "call_function"}
        assert "dsv4c.swiglu_act" in moved and not moved & (MOE_OPS | {"dsv4c.route_topk", "dsv4c.route_hashed", "dsv4c.route_hashed_ids"})
        (join,) = list(call.users)
        assert join.target is side_join
        moe = next(n for n in nodes[nodes.index(call):] if op_name(getattr(n, "target", "")) in MOE_OPS)
        router = max((n for n in _ancestors(moe) if n.op == "call_function" and "route" in op_name(n.target)),
                     key=nodes.index)  # this layer's
        assert nodes.index(call) < nodes.index(router) < nodes.index(moe) < nodes.index(join)
    assert_same(run(out, args), before)
    assert_same(run(gm, args), before)  # graph_copy left the original alone


def test_the_fork_follows_the_router_by_default():
    """FORK_BEFORE_ROUTER 0 (the default): each side call sits after its layer's router and right before the
    routed experts' op (the router's kernels launch first); outputs and cache writes bit-identical, whole-step
    executor too."""
    import dsv4c.passes.overlap_shared_experts as ose

    assert ose.FORK_BEFORE_ROUTER == 0
    gm, ctx = _lowered("decode")
    args = inputs("v4", "decode")
    out = overlap_shared_experts(graph_copy(gm), ctx).graph
    nodes = list(out.graph.nodes)
    calls = _side_calls(out)
    assert len(calls) == 2
    for call in calls:
        moe = nodes[nodes.index(call) + 1]
        assert op_name(moe.target) in MOE_OPS
        router = max((n for n in _ancestors(moe) if n.op == "call_function" and "route" in op_name(n.target)),
                     key=nodes.index)
        assert nodes.index(router) < nodes.index(call)
    assert_same(run(out, args), run(gm, args))
    plan = plan_segments(out, ctx)
    assert plan.n_capturable == len(plan.segments)
    ex = SegmentExecutor(apply_plan(out, plan), plan, "cpu", buckets=(2,), mode="full-emulate")
    plan0 = plan_segments(gm, ctx)
    ex0 = SegmentExecutor(apply_plan(gm, plan0), plan0, "cpu", buckets=(2,), mode="full-emulate")
    assert_same(run(ex, args), run(ex0, args))


def test_the_split_step_runs_the_same_with_the_side_calls():
    """Whole-step execution (full-emulate): same segment count, the side call in the static segment before
    the experts, its join after them, and the same outputs and cache writes."""
    gm, ctx = _lowered("decode")
    args = inputs("v4", "decode")
    plan0 = plan_segments(gm, ctx)
    out = overlap_shared_experts(graph_copy(gm), ctx).graph
    plan = plan_segments(out, ctx)
    assert len(plan.segments) == len(plan0.segments) and plan.n_capturable == len(plan.segments)
    seg_of = {name: s for s in plan.segments for name in s.nodes}
    calls = _side_calls(out)
    assert calls and all(seg_of[c.name].kind == "static" for c in calls)
    assert all(seg_of[next(iter(c.users)).name].index > seg_of[c.name].index + 1 for c in calls)
    ex0 = SegmentExecutor(apply_plan(gm, plan0), plan0, "cpu", buckets=(2,), mode="full-emulate")
    ex = SegmentExecutor(apply_plan(out, plan), plan, "cpu", buckets=(2,), mode="full-emulate")
    assert_same(run(ex, args), run(ex0, args))


def test_a_branch_with_a_foreign_op_stays_on_one_stream():
    """An op outside aten / dsv4c in the branch (as a sharded graph's all-reduce would be): the layer is
    skipped, with the reason, and its nodes stay where they were."""
    gm, ctx = _lowered("decode")
    swig = _calls(gm, lambda n: op_name(n.target) == "dsv4c.swiglu_act")[0]
    with gm.graph.inserting_after(swig):
        neg = gm.graph.call_function(operator.neg, (swig,))
    swig.replace_all_uses_with(neg, delete_user_cb=lambda u: u is not neg)
    neg.meta = dict(swig.meta)
    gm.recompile()
    res = overlap_shared_experts(gm, ctx)
    assert res.stats["forked"] == 1 and len(res.stats["skipped"]) == 1, res.stats
    assert "neg" in next(iter(res.stats["skipped"].values()))
    assert swig in gm.graph.nodes  # not moved


def test_graphs_without_routed_experts_are_unchanged():
    ctx = PassContext(model("v4").config, "h200", graph_kind="decode")
    gm, _ = run_pipeline(exported("v4", "decode"), ctx, skip=("quantize_experts",))
    moe = _calls(gm, lambda n: op_name(n.target) in MOE_OPS)
    res = overlap_shared_experts(graph_copy(gm), ctx)
    assert res.stats["forked"] == len(moe)  # the reference MoE op is a MoE node too
    empty = graph_copy(gm)
    for n in _calls(empty, lambda n: op_name(n.target) in MOE_OPS):
        n.target = torch.ops.aten.clone.default  # no MoE node left
        n.args, n.kwargs = (n.args[0],), {}
    empty.recompile()
    res = overlap_shared_experts(empty, ctx)
    assert not res.changed and res.stats == {"layers": 0, "forked": 0, "skipped": {}}


@pytest.fixture(scope="module")
def h100_art(tmp_path_factory):
    """The bundled model's first two layers compiled for the h100 target (FP8 experts and dense linears)."""
    from cut_presets import bundle_cut

    from dsv4c.compile import compile_checkpoint

    d = tmp_path_factory.mktemp("overlap")
    compile_checkpoint(bundle_cut(d / "ckpt", 2), d / "art", target="h100", max_tokens=32, max_batch=2,
                       verify_boundaries=False)
    return d / "art"


def _session(art, device: str, side: bool):
    from dsv4c.runtime import Session

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        emulated = device == "cpu"
        return Session.load(art, device=device, emulate=emulated, graphs="full-emulate" if emulated else "full",
                            side_stream=side, prefix_cache=False)


def _sides(sess) -> int:
    return sum(side_streams(sess).values())


def test_session_forks_whole_step_graphs_only(h100_art):
    on, off = _session(h100_art, "cpu", True), _session(h100_art, "cpu", False)
    assert _sides(on) == 2 and _sides(off) == 0  # two MoE layers in the decode graph
    prompts = ["def parse(argv):", "class Stack:"]
    assert [r.tokens for r in on.generate(prompts, max_new_tokens=6)] == \
        [r.tokens for r in off.generate(prompts, max_new_tokens=6)]
    from dsv4c.runtime import Session

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        piecewise = Session.load(h100_art, device="cpu", emulate=True, graphs="emulate", prefix_cache=False)
    assert _sides(piecewise) == 0  # segments captured one by one: no stream crosses them


def test_bench_reports_the_side_stream_and_one_stream_turns_it_off(h100_art, capsys):
    from dsv4c.cli import main

    res = {}
    for flag in ((), ("--one-stream",)):
        out = h100_art.parent / f"bench{len(flag)}.json"
        assert main(["bench", str(h100_art), "--device", "cpu", "--emulate", "--graphs", "full-emulate", "--batch", "1",
                     "--prompt-len", "4", "--output-len", "3", "--json", str(out), *flag]) == 0
        res[flag] = json.loads(out.read_text())
    assert res[()]["side_stream"] == {"decode": 2} and res[("--one-stream",)]["side_stream"] == {"decode": 0}
    assert "side stream: 0 layer(s)" in capsys.readouterr().out


@pytest.mark.gpu
def test_side_stream_on_the_gpu_is_bit_identical(h100_art):
    """On the GPU, whole-step CUDA graphs: greedy tokens and every step's logits of the two-stream step equal
    the one-stream step's, at batch 1 and 2; the side stream's split launches count on their own buffer."""
    from dsv4c.kernels import _tl as U

    on, off = _session(h100_art, "cuda", True), _session(h100_art, "cuda", False)
    assert _sides(on) == 2
    for prompts in (["def parse(argv):"], ["def parse(argv):", "class Stack:"]):
        a = on.generate(prompts, max_new_tokens=24)
        b = off.generate(prompts, max_new_tokens=24)
        assert [r.tokens for r in a] == [r.tokens for r in b]
    dev = torch.device("cuda", torch.cuda.current_device())
    main = U.split_counters(dev, 8, 2)
    with torch.cuda.stream(U.side_stream(dev)):
        side = U.split_counters(dev, 8, 2)
    assert main.data_ptr() != side.data_ptr()
