"""passes/prefetch_weights.py: where the L2 prefetches go, what they ask for, and that the graph computes the same
values with them; they survive export, save and load in a compiled artifact."""
from __future__ import annotations

import dataclasses

import torch
from cut_presets import small
from fusion_cases import assert_same, exported, inputs, model, run

from dsv4c import targets, write_random_checkpoint
from dsv4c.compile import compile_checkpoint
from dsv4c.model import register_ops
from dsv4c.passes import PassContext, get_param, run_pipeline
from dsv4c.passes import prefetch_weights as PW
from dsv4c.runtime import Session

register_ops()
P = torch.ops.dsv4c.l2_prefetch.default


def _budget(monkeypatch, budget: int) -> None:
    """The h200 target with `l2_prefetch_bytes` = budget (every target has 0: run64 measured a loss)."""
    t = targets.TARGETS["h200"]
    monkeypatch.setitem(targets.TARGETS, "h200", dataclasses.replace(t, l2_prefetch_bytes=budget))


def _small_thresholds(monkeypatch, budget: int = 32 << 20):
    """The tiny models' weights are kilobytes: scale the pass's byte thresholds down to them; a budget on h200."""
    monkeypatch.setattr(PW, "MIN_TENSOR_BYTES", 1 << 10)
    monkeypatch.setattr(PW, "MIN_CALL_BYTES", 4 << 10)
    _budget(monkeypatch, budget)


def _lowered(kind: str = "decode", target: str = "h200", skip=()):
    """The two-layer V4 in bf16 (as the CUDA targets compile it: the head a bf16 linear) through the pipeline."""
    m = model("v4", torch.bfloat16)
    ctx = PassContext(m.config, target, graph_kind="decode" if kind == "verify" else kind)
    gm, recs = run_pipeline(exported("v4", kind, torch.bfloat16), ctx, skip=skip)
    return gm, next(r for r in recs if r.name == "prefetch_weights")


def _order(gm) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def test_prefetches_open_each_run_of_small_kernels_and_ask_for_the_linears_after_it(monkeypatch):
    """Two-layer V4 (SWA + CSA): a prefetch after the first kernel of each run of small kernels, asking for the
    weights of the linears up to the next run; none asks across the routed experts; each one's weights are read
    later in the graph by a linear, before any routed-experts op."""
    _small_thresholds(monkeypatch)
    gm, rec = _lowered()
    calls = [n for n in gm.graph.nodes if n.target is P]
    assert rec.stats["calls"] == len(calls) >= 5, rec.stats
    order = _order(gm)
    for p in calls:
        at = order.index(p)
        before = order[at - 1]
        assert PW._op(before) not in PW.STREAMING, before  # after a small kernel, not after a linear
        ws, nbytes = p.args
        assert len(ws) == len(nbytes) <= PW.MAX_WEIGHTS
        for w, n in zip(ws, nbytes):
            t = get_param(gm, w.target)
            assert 0 < n <= t.numel() * t.element_size()
            readers = [order.index(u) for u in w.users if u is not p and PW._op(u) not in PW.NO_KERNEL]
            first = min(r for r in readers if r > at)
            assert PW._op(order[first]) in PW.STREAMING
            assert not any(PW._op(n) in PW.BARRIERS for n in order[at:first]), (p, w)
    names = [w.target for p in calls for w in p.args[0]]
    for layer in (0, 1):
        assert f"model.layers.{layer}.attn.wo_a.w_q" in names or f"model.layers.{layer}.attn.wo_a.weight" in names
    assert "model.head.weight" in names


def test_the_budget_caps_each_prefetch(monkeypatch):
    """Each prefetch asks for at most the budget, and a budget below the windows' wants cuts some of them short."""
    _small_thresholds(monkeypatch)
    full, _ = _lowered()
    _small_thresholds(monkeypatch, budget=6 << 10)
    capped, rec = _lowered()
    asked = [sum(p.args[1]) for p in capped.graph.nodes if p.target is P]
    wanted = [sum(p.args[1]) for p in full.graph.nodes if p.target is P]
    assert rec.stats["calls"] == len(asked) > 0 and rec.stats["bytes"] == sum(asked)
    assert all(a <= 6 << 10 for a in asked), asked
    assert max(wanted) > 6 << 10 and sum(asked) < sum(wanted), (asked, wanted)


def test_the_graph_computes_the_same_values_and_cache_writes(monkeypatch):
    """Decode and verify graphs with and without the prefetches: identical logits, streams and caches (the op
    does nothing on the CPU; the rewrite only adds it)."""
    _small_thresholds(monkeypatch)
    for kind in ("decode", "verify"):
        with_p, rec = _lowered(kind)
        without, _ = _lowered(kind, skip=("prefetch_weights",))
        assert rec.stats["calls"] > 0 and not any(n.target is P for n in without.graph.nodes)
        args = inputs("v4", kind, torch.bfloat16)
        assert_same(run(with_p, args), run(without, args))  # bit-exact


def test_cpu_target_prefill_and_zero_budget_are_left_alone(monkeypatch):
    _small_thresholds(monkeypatch)
    _, rec = _lowered(target="cpu")
    assert rec.stats == {"calls": 0, "skipped": "target cpu: l2_prefetch_bytes is 0"}
    _, rec = _lowered("prefill")
    assert rec.stats["calls"] == 0 and "prefill" in rec.stats["skipped"]
    _budget(monkeypatch, 0)
    _, rec = _lowered()
    assert rec.stats["calls"] == 0 and "l2_prefetch_bytes is 0" in rec.stats["skipped"]


def test_default_thresholds_place_nothing_on_a_tiny_model(monkeypatch):
    """At the real thresholds (MB weights) a tiny model's kilobyte weights are not worth a launch."""
    _budget(monkeypatch, 32 << 20)
    _, rec = _lowered()
    assert rec.stats["calls"] == 0 and not rec.changed


def test_every_target_has_it_off():
    """run64 measured a loss: no target asks for prefetches, so the default pipeline leaves graphs as they were."""
    assert all(t.l2_prefetch_bytes == 0 for t in targets.TARGETS.values())
    _, rec = _lowered()
    assert rec.stats == {"calls": 0, "skipped": "target h200: l2_prefetch_bytes is 0"}


def test_prefetches_survive_compile_save_and_load(tmp_path, monkeypatch):
    """An h200 artifact compiled with the prefetches: its loaded decode graph still holds them (dead-code
    elimination keeps a side-effecting op), and the emulated Session's greedy tokens are the eager model's."""
    _small_thresholds(monkeypatch)
    write_random_checkpoint(small("v4-tiny-a"), tmp_path / "ckpt", seed=5, dtype=torch.float32)
    m = compile_checkpoint(tmp_path / "ckpt", tmp_path / "art", target="h200", max_tokens=32, max_batch=2,
                           buckets=(1, 2), dtype=torch.float32, kernels={"moe_experts": "reference"},
                           verify_boundaries=False)
    rec = next(p for p in m["graphs"]["decode"]["passes"] if p["name"] == "prefetch_weights")
    assert rec["changed"] and rec["stats"]["calls"] > 0
    sess = Session.load(tmp_path / "art", emulate=True, graphs="emulate", prefix_cache=False)
    assert sum(n.target is P for n in sess.graphs["decode"].graph.nodes) == rec["stats"]["calls"]
    split = sess.executors["decode"].gm  # the router split's parent module and its segments, which run them
    nodes = [n for mod in split.modules() if isinstance(mod, torch.fx.GraphModule) for n in mod.graph.nodes]
    assert sum(n.target is P for n in nodes) == rec["stats"]["calls"]
    from dsv4c import load_model
    from dsv4c.model.generate import greedy

    ref = load_model(tmp_path / "ckpt")
    prompt = [5, 9, 17, 3, 11]
    got = sess.generate([prompt], max_new_tokens=4)[0].tokens
    assert got == greedy(ref, torch.tensor([prompt]), 4)[0].tolist()
