"""Split at routers (passes/split_at_routers.py) and the segment executor (runtime/segments.py).

The split module must compute the unsplit graph's function: same outputs, same in-place cache writes
on the caller's tensors. Padded rows (n_real = 0) must change nothing for the real rows.
"""
from __future__ import annotations

import copy

import networkx as nx
import pytest
import torch
from cut_presets import small
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4c import ModelConfig
from dsv4c.export import GraphSpec, export_graph, flat_caches, lift_weights
from dsv4c.model import build_model
from dsv4c.passes import PassContext, default_pipeline, run_pipeline, verify
from dsv4c.passes.split_at_routers import (OP_CAPTURE, SegmentPlan, apply_plan, host_sync_ops, op_name,
                                           plan_segments, reference_impl, split_at_routers)
from dsv4c.runtime.segments import SegmentExecutor

# cut_presets.small: one layer of each kind (v4: sliding, CSA, HCA, hash and learned routing; v3: one dense,
# one MoE); the plan, the split and the executor are per MoE layer, so the layer count changes nothing here
PRESETS = ["v4-tiny-a", "v3-tiny", "v32-tiny"]
KINDS = ["decode", "prefill"]
REL = 1e-5
N_SLOTS, MAX_LEN, K = 4, 64, 2
STATIC_REFERENCE_OPS = {op for op in OP_CAPTURE if not op.endswith(("_static", "_gathered"))} - {"dsv4c.moe_experts"}

_models: dict = {}
_graphs: dict = {}


def _model(preset):
    if preset not in _models:
        _models[preset] = build_model(small(preset))
    return _models[preset]


def _graph(preset, kind):
    """(model, ctx, unsplit gm, plan, split gm), exported once per module."""
    if (preset, kind) not in _graphs:
        m = _model(preset)
        gm = export_graph(m, GraphSpec(kind, k=K, n_slots=N_SLOTS, max_len=MAX_LEN)).module()
        ctx = PassContext(m.config, graph_kind=kind)
        plan = plan_segments(gm, ctx)
        _graphs[(preset, kind)] = (m, ctx, gm, plan, apply_plan(gm, plan))
    return _graphs[(preset, kind)]


def _moe_layers(cfg):
    return [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]


def _state(model, seed=0):
    """A cache after a ragged prompt in all four slots."""
    g = torch.Generator().manual_seed(seed)
    cache = model.new_cache(N_SLOTS, max_len=MAX_LEN)
    model(torch.randint(0, model.config.vocab_size, (N_SLOTS, 11), generator=g), cache,
          n_real=torch.tensor([11, 7, 9, 5]))
    return cache, g


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _close(a, b, rel=REL, msg=None):
    """Equal within rel * max|b| (at least rel); infinities (the -inf open-group scores) must match."""
    fin = b[torch.isfinite(b)]
    scale = max(fin.abs().max().item(), 1.0) if fin.numel() else 1.0
    torch.testing.assert_close(a, b, rtol=0, atol=rel * scale, msg=msg)


class _RecordOps(TorchDispatchMode):
    """Records the arguments of dsv4c custom-op calls (first call per op, tensors cloned)."""

    def __init__(self):
        super().__init__()
        self.calls: dict = {}
        self.moe_rows: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = op_name(func)
        if name.startswith("dsv4c."):
            if name not in self.calls:
                self.calls[name] = torch.utils._pytree.tree_map(
                    lambda a: a.clone() if isinstance(a, torch.Tensor) else a, (args, kwargs or {}))
            if name == "dsv4c.moe_experts":
                self.moe_rows.append((args[0].shape[0], args[1].clone()))
        return func(*args, **(kwargs or {}))


# ---- the plan --------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("preset", PRESETS)
def test_plan_has_one_dynamic_segment_per_moe_layer(preset, kind):
    m, ctx, gm, plan, _ = _graph(preset, kind)
    cfg = m.config
    layers = _moe_layers(cfg)
    assert isinstance(plan, SegmentPlan)
    kinds = [s.kind for s in plan.segments]
    assert kinds == ["static", "dynamic"] * len(layers) + ["static"]  # static segments between the routers
    dyn = [s for s in plan.segments if s.kind == "dynamic"]
    assert [s.layer for s in dyn] == layers
    assert [s.index for s in plan.segments] == list(range(len(plan.segments)))
    for s in dyn:
        assert s.op_counts == (("dsv4c.moe_experts", 1),) and not s.capturable and "moe_experts" in s.reason
        assert [v.role for v in s.inputs] == ["real"] * 3 + ["weight"] * 3  # x, idx, weight: real tokens
        assert [v.role for v in s.outputs] == ["real"] and s.outputs[0].rows == "tokens"
    # every compute node in exactly one segment, in graph order
    compute = [n.name for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    assert [n for s in plan.segments for n in s.nodes] == compute
    assert plan.boundaries == tuple(n.name for n in gm.graph.nodes
                                    if n.target is torch.ops.dsv4c.moe_experts.default)
    roles = {v.name: v.role for v in plan.graph_inputs}
    assert roles["input_ids"] == "padded" and all(roles[k] == "meta" for k in ("slots", "pos0", "n_real"))
    assert all(r == "cache" for k, r in roles.items() if k.startswith("caches_"))
    assert plan.tokens_per_row == (None if kind == "prefill" else 1 + K) and plan.n_slots == N_SLOTS
    # the reference attention ops sync the host: those segments are not capturable; the head is
    attn_op = "dsv4c.v4_attention" if cfg.is_v4 else "dsv4c.mla_cache_update"
    for s in plan.segments:
        if any(op == attn_op for op, _ in s.op_counts):
            assert not s.capturable and f"reference op {attn_op} syncs the host" in s.reason
            assert s.mutates and set(s.mutates) <= set(s.caches)
            assert {v.role for v in s.inputs} >= {"meta", "cache", "weight", "padded"}
    assert plan.segments[-1].capturable and plan.n_capturable == 1
    assert {v.rows for v in plan.graph_outputs} == {"batch"}
    # printable, networkx DAG, DOT
    text = str(plan)
    assert text.splitlines()[0].startswith(f"SegmentPlan: {kind} graph")
    assert all(f" {s.kind} " in line for s, line in zip(plan.segments, text.splitlines()[3:]))
    g = plan.graph()
    assert isinstance(g, nx.DiGraph) and nx.is_directed_acyclic_graph(g)
    assert g.number_of_nodes() == len(plan.segments) == 2 * len(layers) + 1
    assert all(u < v for u, v in g.edges) and nx.is_weakly_connected(g)
    assert all(g.has_edge(i, i + 1) for i in range(len(plan.segments) - 1))  # the hidden state chain
    dot = plan.to_dot()
    assert dot.startswith("digraph") and all(f"s{i} [" in dot for i in g.nodes)


def test_capture_table_matches_the_reference_implementations():
    """OP_CAPTURE says which ops sync the host: check it by running them (reference and capture-safe)."""
    calls = {}
    for preset in ("v4-tiny-a", "v32-tiny"):
        m = _model(preset)
        rec = _RecordOps()
        cache = m.new_cache(2, max_len=32)
        with torch.no_grad():
            m(torch.randint(0, m.config.vocab_size, (2, 9)), cache)
            with rec:  # a decode-shaped chunk (the static ops need T <= the window ring)
                m(torch.randint(0, m.config.vocab_size, (2, 3)), cache)
        calls.update(rec.calls)
    assert set(calls) >= {"dsv4c.v4_attention", "dsv4c.v4_compress", "dsv4c.v4_indexer_topk", "dsv4c.moe_experts",
                          "dsv4c.mla_cache_update", "dsv4c.dsa_cache_update", "dsv4c.dsa_topk"}
    for name, (args, kwargs) in calls.items():
        syncs = host_sync_ops(reference_impl(name), *args, **kwargs)
        assert bool(syncs) == (OP_CAPTURE[name] is not None), (name, syncs[:3])
        for alt in (name + "_static", name + "_gathered", name + "_fused"):  # capture-safe implementations, same arguments
            if alt in OP_CAPTURE:
                syncs = host_sync_ops(reference_impl(alt), *args, **kwargs)
                assert bool(syncs) == (OP_CAPTURE[alt] is not None), (alt, syncs[:3])


def test_a_target_with_capture_safe_kernels_flips_the_segments():
    m, ctx, gm, plan, _ = _graph("v4-tiny-a", "decode")
    flipped = plan_segments(gm, ctx, capture_safe=STATIC_REFERENCE_OPS)
    assert [s.capturable for s in flipped.segments] == [s.kind == "static" for s in flipped.segments]


# ---- the split module ------------------------------------------------------------------------
@torch.no_grad()
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("preset", PRESETS)
def test_split_module_equals_unsplit_graph_and_eager_model(preset, kind):
    m, ctx, gm, plan, split = _graph(preset, kind)
    verify(split, ctx, after="split_at_routers")
    assert [n.target for n in split.graph.nodes if n.op == "call_module"] == [s.submod_name for s in plan.segments]
    cache, g = _state(m)
    T = 9 if kind == "prefill" else 1 + K
    slots = torch.tensor([2, 0, 3])
    ids = torch.randint(0, m.config.vocab_size, (3, T), generator=g)
    args = (ids, slots, cache.pos[slots].clone(), torch.full((3,), T))
    c_gm, c_split, c_before = copy.deepcopy(cache), copy.deepcopy(cache), copy.deepcopy(cache)
    f_gm, f_split = flat_caches(c_gm.layers), flat_caches(c_split.layers)
    ptrs = {k: t.data_ptr() for k, t in f_split.items()}
    out_gm = gm(*args, f_gm)
    out_split = split(*args, f_split)
    ref = m(ids, cache, slots=slots)  # eager, advances `cache`
    assert len(out_split) == len(out_gm) == 2
    for a, b in zip(out_split, out_gm):
        assert torch.equal(a, b)
    assert _rel(out_split[0], ref) <= REL
    # the caller's cache tensors were written in place, exactly as by the unsplit graph and the model
    f_ref, f_before = flat_caches(cache.layers), flat_caches(c_before.layers)
    written = {k for s in plan.segments for k in s.mutates}
    changed = set()
    for k, t in f_split.items():
        assert t.data_ptr() == ptrs[k]
        assert torch.equal(t, f_gm[k]), k
        _close(t, f_ref[k], msg=k)
        if not torch.equal(t, f_before[k]):
            changed.add("caches_" + k.replace(".", "_"))
    assert changed and changed <= written
    assert any(k.endswith(("_ring", "_latent")) for k in changed)


@torch.no_grad()
@pytest.mark.parametrize("preset", PRESETS)
def test_padded_rows_with_n_real_0_change_nothing(preset):
    """B = 2 real rows + 2 padded rows (n_real = 0, an unused slot, ids that route to experts)."""
    m, ctx, gm, plan, split = _graph(preset, "decode")
    cache, g = _state(m, seed=1)
    T = 1 + K
    ids = torch.randint(0, m.config.vocab_size, (2, T), generator=g)
    slots = torch.tensor([1, 0])
    args = (ids, slots, cache.pos[slots].clone(), torch.full((2,), T))
    c_real, c_pad = copy.deepcopy(cache), copy.deepcopy(cache)
    f_real, f_pad = flat_caches(c_real.layers), flat_caches(c_pad.layers)
    out_real = split(*args, f_real)
    pad_ids = torch.cat([ids, ids.flip(0)])  # the padded rows carry real tokens: they are routed to experts
    pad_args = (pad_ids, torch.tensor([1, 0, 3, 3]), torch.cat([args[2], torch.tensor([5, 0])]),
                torch.tensor([T, T, 0, 0]))
    rec = _RecordOps()
    with rec:
        out_pad = split(*pad_args, f_pad)
    n_moe = len(_moe_layers(m.config))
    assert len(rec.moe_rows) == n_moe
    E = m.config.n_routed_experts
    for rows, idx in rec.moe_rows:  # the padded tokens did reach the expert op, with real expert ids
        assert rows == 4 * T and idx.shape[0] == 4 * T and bool(((idx[2 * T:] >= 0) & (idx[2 * T:] < E)).all())
    for a, b in zip(out_pad, out_real):
        assert a.shape[0] == 4
        _close(a[:2], b)
    for k, t in f_pad.items():  # every cache identical, the padded slot 3 included
        _close(t, f_real[k], msg=k)
        assert torch.equal(t[3], flat_caches(cache.layers)[k][3]), k


@torch.no_grad()
@pytest.mark.parametrize("preset", ["v4-tiny-a", "v3-tiny"])
def test_split_pass_in_the_pipeline(preset):
    """After fuse_projections/absorb_mla, as the last pipeline step: verify passes, numerics hold."""
    m, ctx, gm, _, _ = _graph(preset, "decode")
    cache, g = _state(m, seed=2)
    ids = torch.randint(0, m.config.vocab_size, (N_SLOTS, 1 + K), generator=g)
    args = (ids, torch.arange(N_SLOTS), cache.pos.clone(), torch.full((N_SLOTS,), 1 + K))
    ref = m(ids, copy.deepcopy(cache))
    passes = default_pipeline() + [("split_at_routers", split_at_routers)]
    seen = {}
    out_gm, records = run_pipeline(copy.deepcopy(gm), ctx, passes=passes, after_each=seen.__setitem__)
    stats = records[-1].stats
    n_moe = len(_moe_layers(m.config))
    assert stats["segments"] == 2 * n_moe + 1 and stats["boundaries"] == n_moe and stats["capturable"] == 1
    assert stats["dynamic"] == n_moe and all("syncs the host" in r for r in stats["not_capturable"])
    assert isinstance(out_gm.meta["segment_plan"], SegmentPlan)
    out = out_gm(*args, flat_caches(copy.deepcopy(cache).layers))[0]
    assert _rel(out, ref) <= REL


# ---- the executor ----------------------------------------------------------------------------
def _step_args(cache_pos, slots, ids):
    B, T = ids.shape
    return ids, slots, cache_pos[slots].clone(), torch.full((B,), T, device=ids.device)


@torch.no_grad()
def test_executor_cpu_run_equals_split_module():
    m, ctx, gm, plan, split = _graph("v4-tiny-a", "decode")
    cache, g = _state(m, seed=3)
    ex = SegmentExecutor(split, plan, "cpu")
    assert ex.mode == "eager"
    c_ex, c_ref = copy.deepcopy(cache), copy.deepcopy(cache)
    f_ex, f_ref = flat_caches(c_ex.layers), flat_caches(c_ref.layers)
    args = _step_args(cache.pos, torch.tensor([3, 1, 0]), torch.randint(0, 256, (3, 1 + K), generator=g))
    for a, b in zip(ex.run(*args, f_ex), split(*args, f_ref)):
        assert torch.equal(a, b)
    assert all(torch.equal(f_ex[k], f_ref[k]) for k in f_ex)


@torch.no_grad()
@pytest.mark.parametrize("preset", ["v4-tiny-a", "v32-tiny"])
@pytest.mark.parametrize("safe", ["target", "all_static"])
def test_executor_bucketed_path_emulated_on_cpu(preset, safe):
    """The CUDA data flow without CUDA graphs: padding to buckets, static buffers, experts on the real
    tokens only, slicing back. 'all_static' pretends every static segment is capturable."""
    m, ctx, gm, plan, split = _graph(preset, "decode")
    if safe == "all_static":
        plan = plan_segments(gm, ctx, capture_safe=STATIC_REFERENCE_OPS)
        split = apply_plan(gm, plan)
    ex = SegmentExecutor(split, plan, "cpu", mode="emulate", debug=True)
    assert ex.buckets == (1, 2, 4)  # nothing above n_slots (= 4)
    cache, g = _state(m, seed=4)
    c_ex, c_ref = copy.deepcopy(cache), copy.deepcopy(cache)
    f_ex, f_ref = flat_caches(c_ex.layers), flat_caches(c_ref.layers)
    before = {k: t.clone() for k, t in f_ex.items()}
    T = 1 + K
    ex.capture(*_step_args(cache.pos, torch.tensor([0]), torch.zeros(1, T, dtype=torch.long)), f_ex)
    assert all(torch.equal(before[k], f_ex[k]) for k in f_ex), "capture wrote to the caches"
    n_cap = plan.n_capturable
    assert all(v["captured_segments"] == n_cap for v in ex.stats["buckets"].values())
    pos = cache.pos.clone()
    for step in range(2):
        for slots in ([2, 0, 1], [3]):  # 3 rows -> bucket 4, 1 row -> bucket 1
            slots = torch.tensor(slots)
            args = _step_args(pos, slots, torch.randint(0, m.config.vocab_size, (len(slots), T), generator=g))
            got = ex.run(*args, f_ex)
            want = split(*args, f_ref)
            pos[slots] += T
            for a, b in zip(got, want):
                assert a.shape == b.shape
                _close(a, b)
            for k in f_ex:
                _close(f_ex[k], f_ref[k], msg=k)
    assert ex.stats["replays"] == 4 * n_cap and ex.stats["eager_fallbacks"] == 0
    # caches must keep their addresses
    moved = {k: t.clone() for k, t in f_ex.items()}
    with pytest.raises(RuntimeError, match="data_ptr changed"):
        ex.run(*_step_args(pos, torch.tensor([0]), torch.zeros(1, T, dtype=torch.long)), moved)


@torch.no_grad()
def test_executor_falls_back_to_eager_above_the_largest_bucket():
    m, ctx, gm, plan, split = _graph("v3-tiny", "decode")
    ex = SegmentExecutor(split, plan, "cpu", buckets=(1, 2), mode="emulate")
    cache, g = _state(m, seed=5)
    c_ex, c_ref = copy.deepcopy(cache), copy.deepcopy(cache)
    args = _step_args(cache.pos, torch.tensor([0, 1, 2]), torch.randint(0, 256, (3, 1 + K), generator=g))
    for a, b in zip(ex.run(*args, flat_caches(c_ex.layers)), split(*args, flat_caches(c_ref.layers))):
        assert torch.equal(a, b)
    assert ex.stats["eager_fallbacks"] == 1
    with pytest.raises(ValueError, match="fixed number of tokens"):
        SegmentExecutor(_graph("v3-tiny", "prefill")[4], _graph("v3-tiny", "prefill")[3], "cpu", mode="emulate")


@torch.no_grad()
def test_split_and_executor_on_a_graph_with_lifted_weights():
    """Artifact graphs take their weights as a trailing dict input (`export.lift_weights`)."""
    m, ctx, gm, plan0, split0 = _graph("v4-tiny-a", "decode")
    lifted = copy.deepcopy(gm)
    weights = lift_weights(lifted)
    plan = plan_segments(lifted, ctx)
    assert [(s.kind, s.capturable, s.layer) for s in plan.segments] == \
        [(s.kind, s.capturable, s.layer) for s in plan0.segments]
    roles = {v.name: v.role for v in plan.graph_inputs}
    assert sum(r == "weight" for r in roles.values()) == len(weights) and roles["input_ids"] == "padded"
    for s in plan.segments:
        if s.kind == "dynamic":
            assert [v.role for v in s.inputs] == ["real"] * 3 + ["weight"] * 3
    split = apply_plan(lifted, plan)
    cache, g = _state(m, seed=6)
    args = _step_args(cache.pos, torch.tensor([1, 3, 2]), torch.randint(0, 256, (3, 1 + K), generator=g))
    c0, c1, c2 = (copy.deepcopy(cache) for _ in range(3))
    want = split0(*args, flat_caches(c0.layers))
    for a, b in zip(split(*args, flat_caches(c1.layers), weights), want):
        assert torch.equal(a, b)
    ex = SegmentExecutor(split, plan, "cpu", mode="emulate", debug=True)
    for a, b in zip(ex.run(*args, flat_caches(c2.layers), weights), want):
        _close(a, b)
    with pytest.raises(RuntimeError, match="data_ptr changed"):
        ex.run(*args, flat_caches(c2.layers), {k: w.clone() for k, w in weights.items()})


# ---- CUDA (run with -m gpu on a GPU machine) -------------------------------------------------
@pytest.mark.gpu
@torch.no_grad()
def test_cuda_graphs_replay_equals_eager_for_non_bucket_batch_sizes():
    assert torch.cuda.is_available()
    dev = torch.device("cuda")
    cfg = ModelConfig.preset("v4-tiny-a")
    m = build_model(cfg, device=dev)
    n_slots, T = 8, 1 + K
    gm = export_graph(m, GraphSpec("decode", k=K, n_slots=n_slots, max_len=MAX_LEN)).module()
    ctx = PassContext(cfg, target="h200", graph_kind="decode")
    plan = plan_segments(gm, ctx)
    split = apply_plan(gm, plan)
    g = torch.Generator().manual_seed(0)
    cache = m.new_cache(n_slots, max_len=MAX_LEN)  # on the model's device
    m(torch.randint(0, cfg.vocab_size, (n_slots, 11), generator=g).to(dev), cache,
      n_real=torch.tensor([11, 7, 9, 5, 11, 3, 8, 10], device=dev))
    c_ex, c_ref = copy.deepcopy(cache), copy.deepcopy(cache)
    f_ex, f_ref = flat_caches(c_ex.layers), flat_caches(c_ref.layers)
    before = {k: t.clone() for k, t in f_ex.items()}
    ex = SegmentExecutor(split, plan, dev, debug=True)
    assert ex.mode == "graphs" and ex.buckets == (1, 2, 4, 8)
    ex.capture(*_step_args(cache.pos, torch.tensor([0], device=dev), torch.zeros(1, T, dtype=torch.long, device=dev)),
               f_ex)
    torch.cuda.synchronize()
    assert all(torch.equal(before[k], f_ex[k]) for k in f_ex), "capture wrote to the caches"
    st = ex.stats
    assert st["capture_s"] > 0 and set(st["buckets"]) == {1, 2, 4, 8}
    assert all(b["captured_segments"] == plan.n_capturable >= 1 for b in st["buckets"].values())
    assert st["graph_reserved_bytes"] >= 0 and st["graph_bytes"] >= 0
    pos = cache.pos.clone()
    for step in range(3):
        for slots in ([4, 1, 6], [0, 2, 3, 5, 7]):  # B = 3 -> bucket 4, B = 5 -> bucket 8
            slots = torch.tensor(slots, device=dev)
            ids = torch.randint(0, cfg.vocab_size, (len(slots), T), generator=g).to(dev)
            args = _step_args(pos, slots, ids)
            got = ex.run(*args, f_ex)
            want = split(*args, f_ref)
            pos[slots] += T
            for a, b in zip(got, want):
                assert a.shape == b.shape
                _close(a, b, rel=1e-4)
            for k in f_ex:
                _close(f_ex[k], f_ref[k], rel=1e-4, msg=k)
    assert st["replays"] == 6 * plan.n_capturable and st["eager_fallbacks"] == 0


def _static_graph(preset, n_slots, device, kernels=(("moe_experts", "gathered"),)):
    """A decode graph lowered for h200: capture-safe cache ops (+ gathered experts), split."""
    m = build_model(small(preset), device=device)
    ctx = PassContext(m.config, "h200", "decode", kernels)
    gm = export_graph(m, GraphSpec("decode", k=K, n_slots=n_slots, max_len=MAX_LEN)).module()
    gm, _ = run_pipeline(gm, ctx)
    plan = plan_segments(gm, ctx)
    return m, plan, apply_plan(gm, plan)


def _prefilled(m, n_slots, g, device):
    """Ragged prompts in every slot but the last (the scratch slot)."""
    cache = m.new_cache(n_slots, max_len=MAX_LEN)
    n = n_slots - 1
    lens = torch.tensor([11, 7, 9, 5, 11, 3, 8, 10][:n], device=device)
    m(torch.randint(0, m.config.vocab_size, (n, 11), generator=g).to(device), cache, n_real=lens,
      slots=torch.arange(n, device=device))
    return cache


def _modes_agree(m, plan, split, modes, device, n_slots, seed):
    """Run the same ragged steps in every mode; each must equal the eager split module."""
    g = torch.Generator().manual_seed(seed)
    cache = _prefilled(m, n_slots, g, device)
    T = 1 + K
    runs = {}
    for mode in ("eager", *modes):
        c = copy.deepcopy(cache)
        f = flat_caches(c.layers)
        ex = SegmentExecutor(split, plan, device, mode=mode, pad_slot=n_slots - 1, debug=mode != "eager")
        pos, outs = cache.pos.clone(), []
        gg = torch.Generator().manual_seed(seed + 1)
        for slots in ([2, 0, 1], [3], [0, 1, 2, 3, 4][: n_slots - 1], [4, 2][: n_slots - 2]):
            slots = torch.tensor(slots, device=device)
            ids = torch.randint(0, m.config.vocab_size, (len(slots), T), generator=gg).to(device)
            outs.append(ex.run(*_step_args(pos, slots, ids), f)[0])
            pos[slots] += T
        runs[mode] = (outs, f, ex)
    ref, f_ref, _ = runs.pop("eager")
    for mode, (outs, f, ex) in runs.items():
        for a, b in zip(outs, ref):
            _close(a, b, rel=1e-4, msg=mode)
        for k in f_ref:  # every real slot; the scratch slot is free to differ
            _close(f[k][:-1], f_ref[k][:-1], rel=1e-4, msg=f"{mode} {k}")
        assert ex.stats["replays"] > 0 and ex.stats["eager_fallbacks"] == 0, (mode, ex.stats)
    return runs


@torch.no_grad()
@pytest.mark.parametrize("preset", ["v4-tiny-a", "v32-tiny"])
def test_piecewise_and_full_modes_equal_eager_with_capture_safe_ops(preset):
    """CPU: the h200 lowering (static cache ops, gathered experts) in the emulated piecewise and full
    modes, on batches that are not bucket sizes (padding rows), equals the eager split module."""
    m, plan, split = _static_graph(preset, 5, "cpu")
    assert plan.n_capturable == len(plan.segments)  # every segment, experts included
    runs = _modes_agree(m, plan, split, ("emulate", "full-emulate"), torch.device("cpu"), 5, seed=7)
    assert runs["full-emulate"][2].stats["eager_segment_runs"] == 0
    assert runs["emulate"][2].stats["eager_segment_runs"] > 0  # piecewise: experts run eagerly between graphs


@torch.no_grad()
def test_run_direct_equals_the_full_step():
    """`SegmentExecutor.run_direct` (the whole step's kernels on the arguments as given, for a caller's own
    CUDA graph: runtime/speculative.py RoundGraphs) gives the full mode's outputs and cache writes on a
    bucket-sized batch; a piecewise executor refuses it."""
    m, plan, split = _static_graph("v4-tiny-a", 5, "cpu")
    g = torch.Generator().manual_seed(3)
    cache = _prefilled(m, 5, g, "cpu")
    slots = torch.tensor([3, 0, 2, 1])
    ids = torch.randint(0, m.config.vocab_size, (4, 1 + K), generator=g)
    got = {}
    for how in ("run", "run_direct"):
        f = flat_caches(copy.deepcopy(cache).layers)
        ex = SegmentExecutor(split, plan, "cpu", mode="full-emulate", pad_slot=4)
        got[how] = (getattr(ex, how)(*_step_args(cache.pos.clone(), slots, ids), f), f)
    (out_run, f_run), (out_direct, f_direct) = got["run"], got["run_direct"]
    assert all(torch.equal(a, b) for a, b in zip(out_run, out_direct))
    assert all(torch.equal(f_run[k][:-1], f_direct[k][:-1]) for k in f_run)  # the scratch slot may differ
    assert any(not torch.equal(f_direct[k][:-1], v[:-1]) for k, v in flat_caches(cache.layers).items())  # it wrote
    with pytest.raises(ValueError, match="run_direct needs mode 'full'"):
        SegmentExecutor(split, plan, "cpu", mode="emulate").run_direct(*_step_args(cache.pos, slots, ids), f_run)


def test_full_mode_needs_every_segment_capturable():
    m, ctx, gm, plan, split = _graph("v4-tiny-a", "decode")
    with pytest.raises(ValueError, match="captures the whole step, but segment 0 .* not capturable: reference op"):
        SegmentExecutor(split, plan, "cpu", mode="full-emulate")


@pytest.mark.gpu
@torch.no_grad()
@pytest.mark.parametrize("preset", ["v4-tiny-a", "v32-tiny"])
def test_cuda_piecewise_and_full_graphs_equal_eager(preset):
    dev = torch.device("cuda")
    m, plan, split = _static_graph(preset, 6, dev)
    runs = _modes_agree(m, plan, split, ("graphs", "full"), dev, 6, seed=8)
    assert runs["full"][2].stats["graph_reserved_bytes"] >= 0


def test_every_registered_dsv4c_op_has_a_capture_entry():
    """A dsv4c op missing from OP_CAPTURE makes its segment uncapturable, and a "full" step then replays piecewise
    (run64's first call timed such steps): every op the model and kernel modules register has an entry."""
    from dsv4c.model import register_ops
    from dsv4c.passes.split_at_routers import OP_CAPTURE

    assert register_ops() == {}
    ops = {f"dsv4c.{n.split('::')[1].split('.')[0]}" for n in torch._C._dispatch_get_all_op_names()
           if n.startswith("dsv4c::")}
    assert len(ops) >= 40 and "dsv4c.l2_prefetch" in ops
    assert sorted(ops - set(OP_CAPTURE)) == []


@torch.no_grad()
def test_staged_meta_inputs_and_output_views_equal_the_copied_path():
    """A caller that writes slots / pos0 / n_real into the executor's static block itself (`meta_staging`:
    real rows, then the padding `_fill_inputs` would set) gets the copied path's outputs and cache writes bit
    for bit, at a padded bucket and a full one, and `run` copies nothing for those inputs. With
    `copy_outputs=False` the outputs are the static buffers themselves (the next run reuses them)."""
    m, plan, split = _static_graph("v4-tiny-a", 5, "cpu")
    g = torch.Generator().manual_seed(11)
    cache = _prefilled(m, 5, g, torch.device("cpu"))
    T = 1 + K
    runs = {}
    for staged in (False, True):
        c = copy.deepcopy(cache)
        f = flat_caches(c.layers)
        ex = SegmentExecutor(split, plan, "cpu", mode="full-emulate", pad_slot=4)
        assert ex.meta_staging([0], [0], [1]) is None  # nothing captured yet
        pos, outs, hits = cache.pos.clone(), [], []
        gg = torch.Generator().manual_seed(12)
        for slots in ([2, 0, 1], [3], [1, 3], [3, 0, 2, 1]):  # buckets 4 (a padding row), 1, 2, 4
            ids = torch.randint(0, m.config.vocab_size, (len(slots), T), generator=gg)
            args = list(_step_args(pos, torch.tensor(slots), ids))
            st = ex.meta_staging(slots, pos[slots].tolist(), [T] * len(slots)) if staged else None
            if st is not None:
                block, values = st
                B, W = len(slots), block.shape[1]  # W: the largest bucket
                assert block.shape == (3, W) and len(values) == 3 * W
                assert values[:B] == slots and values[B:W] == [4] * (W - B)  # pad_slot past the real rows
                assert values[W + B:2 * W] == values[2 * W + B:] == [0] * (W - B)
                block.view(-1).copy_(torch.tensor(values))
                args[1:4] = block[0, :B], block[1, :B], block[2, :B]
            real = SegmentExecutor._staged
            seen = []
            ex._staged = lambda view, x, B, _r=real, _ex=ex: seen.append(_r(_ex, view, x, B)) or seen[-1]
            outs.append(ex.run(*args, f)[0])
            hits.append(sum(seen))
            pos[torch.tensor(slots)] += T
        runs[staged] = (outs, f, hits)
    (o0, f0, h0), (o1, f1, h1) = runs[False], runs[True]
    assert h0 == [0, 0, 0, 0] and h1 == [0, 3, 3, 3]  # the first run captures; then the three inputs are staged
    for a, b in zip(o0, o1):
        assert torch.equal(a, b)
    assert all(torch.equal(f0[k], f1[k]) for k in f0)
    ids, slots, pos0, _ = _step_args(cache.pos, torch.tensor([0]), torch.zeros(1, T, dtype=torch.long))
    args = ids, slots, pos0, torch.zeros(1, dtype=torch.long)  # n_real 0: the runs write nothing, all alike
    c = copy.deepcopy(cache)
    f = flat_caches(c.layers)
    ex = SegmentExecutor(split, plan, "cpu", mode="full-emulate", pad_slot=4)
    views = [ex.run(*args, f, copy_outputs=False)[0] for _ in range(2)]
    fresh = [ex.run(*args, f)[0] for _ in range(2)]
    assert views[0].data_ptr() == views[1].data_ptr() and fresh[0].data_ptr() != fresh[1].data_ptr()
    assert torch.equal(views[1], fresh[0])
