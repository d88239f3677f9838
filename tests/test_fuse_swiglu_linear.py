"""passes/fuse_swiglu_linear.py: a shared expert's SwiGLU folded into w2's FP8 linear. The rewrite keeps every
value (the op is defined as the two it replaces; tests/test_kernels_fp8_gemm.py checks the CUDA GEMV's bits
against them under the interpreter), leaves the deterministic mode's linears and shared activations alone, and
the fused op runs inside a capturable segment."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from fusion_cases import assert_in_capturable_segments, assert_same, exported, inputs, model, run

from dsv4c import targets
from dsv4c.model import register_ops
from dsv4c.passes import PassContext, run_pipeline
from dsv4c.passes.fuse_swiglu_linear import fuse_swiglu_linear

register_ops()
F = torch.ops.dsv4c.fp8_linear_swiglu_w8a16.default
A = torch.ops.dsv4c.swiglu_act.default
L = torch.ops.dsv4c.fp8_linear_w8a16.default


@pytest.fixture
def on(monkeypatch):
    """The h200 target with swiglu_in_gemv set (no target sets it yet)."""
    monkeypatch.setitem(targets.TARGETS, "h200", dataclasses.replace(targets.TARGETS["h200"], swiglu_in_gemv=True))


def _lowered(kind: str = "decode", skip=(), deterministic: bool = False):
    """The two-layer V4 in bf16 through the pipeline on h200 (FP8 dense linears; routed experts unquantised)."""
    m = model("v4", torch.bfloat16)
    ctx = PassContext(m.config, "h200", graph_kind="decode" if kind == "verify" else kind,
                      deterministic=deterministic)
    gm, recs = run_pipeline(exported("v4", kind, torch.bfloat16), ctx, skip=("quantize_experts",) + tuple(skip))
    return ctx, gm, next(r for r in recs if r.name == "fuse_swiglu_linear")


def test_each_shared_expert_activation_folds_into_its_w2_and_the_values_stay(on):
    """Decode and prefill graphs: one fused op per layer's shared expert, no activation left feeding an FP8
    linear, and the same logits, streams and cache writes as without the pass."""
    for kind in ("decode", "prefill"):
        ctx, gm, rec = _lowered(kind)
        _, without, _ = _lowered(kind, skip=("fuse_swiglu_linear",))
        n_layers = ctx.config.num_hidden_layers
        assert rec.stats == {"sites": n_layers} and sum(n.target is F for n in gm.graph.nodes) == n_layers, kind
        assert not any(n.target is L and n.args[0].target is A for n in gm.graph.nodes)
        assert sum(n.target is A for n in without.graph.nodes) == n_layers
        args = inputs("v4", kind, torch.bfloat16)
        assert_same(run(gm, args), run(without, args))  # bit-exact on the CPU: the op runs the two ops
        if kind == "decode":
            assert_in_capturable_segments(gm, ctx, {F}, n_layers)


def test_deterministic_mode_and_shared_activations_are_left_alone(on):
    """--deterministic: make_batch_invariant turned the linears into batch-invariant ops first, so nothing
    matches; an activation with a second user keeps its own launch."""
    _, gm, rec = _lowered(deterministic=True)
    assert rec.stats == {"sites": 0} and not rec.changed and not any(n.target is F for n in gm.graph.nodes)
    ctx, gm, _ = _lowered(skip=("fuse_swiglu_linear",))
    act = next(n for n in gm.graph.nodes if n.target is A)
    with gm.graph.inserting_after(act):
        extra = gm.graph.call_function(torch.ops.aten.neg.default, (act,))
    out = next(n for n in gm.graph.nodes if n.op == "output")
    out.args = ((*out.args[0], extra),)
    gm.recompile()
    res = fuse_swiglu_linear(gm, ctx)
    assert res.stats["sites"] == ctx.config.num_hidden_layers - 1 and act in gm.graph.nodes


def test_off_on_every_target_until_timed():
    """No target sets swiglu_in_gemv (not yet timed on a GPU): the pass leaves the graph as it was."""
    assert not any(t.swiglu_in_gemv for t in targets.TARGETS.values())
    _, gm, rec = _lowered()
    assert rec.stats == {"sites": 0, "skipped": "target h200: swiglu_in_gemv is off"} and not rec.changed
    assert not any(n.target is F for n in gm.graph.nodes) and any(n.target is A for n in gm.graph.nodes)
