"""Export of the step graphs and the pass pipeline: every pass preserves the eager function."""
from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from cut_presets import small

from dsv4c import ModelConfig
from dsv4c.cli import main as cli_main
from dsv4c.compare import compare_passes, error_metrics
from dsv4c.export import GraphSpec, export_graph, flat_caches, graph_ops
from dsv4c.model import build_model
from dsv4c.passes import PassContext, VerifyError, default_pipeline, run_pipeline, verify
from dsv4c.passes.absorb_mla import absorb_mla, crossover_tokens
from dsv4c.passes.fuse_projections import fuse_projections
from dsv4c.passes.lower_f32_linears import lower_f32_linears

PRESETS = ["v4-tiny-a", "v3-tiny", "v32-tiny"]
REL = 1e-5  # fp32 relative error bound (max |err| / max |logit|), absorption included


@pytest.fixture(scope="module")
def exports():
    """preset -> (model, {kind: ExportedGraph}), filled as tests ask: each graph is exported once per module.
    One layer of each kind (cut_presets.small): what these graph properties need, a fraction of the export.
    n_slots = 3: the capture-safe ops' scratch slot (h200) is the last one."""
    cache: dict[str, tuple] = {}

    def get(preset: str, kind: str):
        if preset not in cache:
            cache[preset] = (build_model(small(preset)), {})
        m, graphs = cache[preset]
        if kind not in graphs:
            graphs[kind] = export_graph(m, GraphSpec(kind, k=2, n_slots=3, max_len=64))
        return m, graphs[kind]

    return get


@pytest.fixture(scope="module", params=PRESETS)
def preset(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model(exports, preset):
    return exports(preset, "decode")[0]


@pytest.fixture(scope="module")
def decode_graph(exports, preset):
    return exports(preset, "decode")[1]


def _fresh(eg) -> torch.fx.GraphModule:
    """A copy of an exported graph's module for a pass to rewrite (the export is shared by the module)."""
    return copy.deepcopy(eg.module())


def _inputs(model, T: int, prompt: int = 11, seed: int = 0, n_slots: int = 3):
    """A cache after a ragged prompt in slots 0 and 1, and a [2, T] step at different positions.
    (n_slots = 3 leaves the last slot as the capture-safe ops' scratch slot.)"""
    g = torch.Generator().manual_seed(seed)
    V = model.config.vocab_size
    cache = model.new_cache(n_slots, max_len=64)
    model(torch.randint(0, V, (2, prompt), generator=g), cache, n_real=torch.tensor([prompt, prompt - 4]),
          slots=torch.arange(2))
    ids = torch.randint(0, V, (2, T), generator=g)
    return ids, cache


def _run_graph(gm, ids, cache):
    c = copy.deepcopy(cache)
    out = gm(ids, torch.arange(2), c.pos[:2].clone(), torch.full((2,), ids.shape[1]), flat_caches(c.layers))[0]
    return out, c


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@torch.no_grad()
def test_export_round_trips_through_save_and_load(model, decode_graph, tmp_path):
    path = tmp_path / "decode.pt2"
    torch.export.save(decode_graph.program, str(path))
    loaded = torch.export.load(str(path))
    ids, cache = _inputs(model, 3)
    a, ca = _run_graph(decode_graph.module(), ids, cache)
    b, cb = _run_graph(loaded.module(), ids, cache)
    assert torch.equal(a, b)
    for x, y in zip(ca.layers, cb.layers):
        for k, t in x.tensors().items():
            assert torch.equal(t, getattr(y, k)), k


@torch.no_grad()
def test_graphs_have_no_data_dependent_guards_and_find_the_routers(model, decode_graph):
    ops = graph_ops(decode_graph.module())
    n_moe = sum(model.config.is_moe_layer(i) for i in range(model.config.num_hidden_layers))
    assert ops.get("moe_experts.default", 0) == n_moe
    # one graph serves every batch size up to n_slots: run B = 1 through the B-dynamic graph
    ids, cache = _inputs(model, 3)
    c = copy.deepcopy(cache)
    out = decode_graph.module()(ids[1:], torch.tensor([1]), c.pos[1:2].clone(), torch.tensor([3]), flat_caches(c.layers))[0]
    ref = model(ids[1:], copy.deepcopy(cache), slots=torch.tensor([1]))
    assert _rel(out, ref) <= REL


@torch.no_grad()
def test_decode_graph_with_k2_equals_three_single_steps(model, decode_graph):
    ids, cache = _inputs(model, 3)
    got, _ = _run_graph(decode_graph.module(), ids, cache)
    c = copy.deepcopy(cache)
    steps = torch.cat([model(ids[:, t : t + 1], c, slots=torch.arange(2)) for t in range(3)], 1)
    assert _rel(got, steps) <= REL


@torch.no_grad()
@pytest.mark.parametrize("kind,target", [("prefill", "cpu"), ("decode", "cpu"), ("decode", "h200"), ("prefill", "h200")])
def test_each_pass_preserves_outputs(exports, preset, kind, target):
    """h200: select_kernels swaps in the capture-safe cache ops (dsv4c/model/static_ops.py) and the fused
    kernels' ops (their CPU forms), prefill included (its 9-token chunk is longer than a window ring)."""
    T = 9 if kind == "prefill" else 3
    model, eg = exports(preset, kind)
    ids, cache = _inputs(model, T)
    ref = model(ids, copy.deepcopy(cache), slots=torch.arange(2))
    errors = {}
    _, recs = run_pipeline(_fresh(eg), PassContext(model.config, target, graph_kind=kind),
                           skip=("quantize_experts", "quantize_dense"),  # lossy: tests/test_quantize_{experts,dense}.py bound them
                           after_each=lambda name, gm: errors.__setitem__(name, _rel(_run_graph(gm, ids, cache)[0], ref)))
    assert set(errors) == {n for n, _ in default_pipeline()} - {"quantize_experts", "quantize_dense"}
    assert max(errors.values()) <= REL, errors
    swapped = next(r for r in recs if r.name == "select_kernels")
    assert swapped.changed == (target == "h200"), swapped.stats


@torch.no_grad()
def test_select_kernels_keeps_prefill_experts(exports, preset):
    """`moe_experts=gathered` (decode-sized batches) lowers the decode graph's experts, not prefill's; the
    prefill graph's cache ops get the same implementations as decode's."""
    from dsv4c.passes.select_kernels import select_kernels

    got = {}
    for kind in ("prefill", "decode"):
        model, eg = exports(preset, kind)
        gm = _fresh(eg)
        ctx = PassContext(model.config, "h200", graph_kind=kind, kernels=(("moe_experts", "gathered"),))
        got[kind] = select_kernels(gm, ctx).stats["swapped"]
    assert "moe_experts -> gathered" in got["decode"] and "moe_experts -> gathered" not in got["prefill"]
    kept = {"moe_experts -> gathered"}  # select_kernels.DECODE_ONLY
    assert set(got["prefill"]) == set(got["decode"]) - kept != set()  # the other cache ops too


@torch.no_grad()
def test_head_rms_rope_op_equals_model_math():
    from dsv4c.model import v4_ops  # noqa: F401  (registers the op)
    from dsv4c.model.common import rms, rope_interleaved

    g = torch.Generator().manual_seed(3)
    q, cos, sin = torch.randn(2, 3, 4, 64, generator=g), torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 8, generator=g)
    want = rope_interleaved(rms(q, 1e-6), cos[:, :, None], sin[:, :, None])
    assert torch.equal(torch.ops.dsv4c.head_rms_rope(q, cos, sin, 1e-6), want)
    assert not torch.allclose(want[..., :48], q[..., :48])  # the norm did something


@torch.no_grad()
def test_fuse_projections_op_counts(exports):
    m, eg = exports("v4-tiny-a", "decode")  # SWA, CSA, HCA layers
    cfg = m.config
    gm = _fresh(eg)
    before = graph_ops(gm)["linear.default"]
    res = fuse_projections(gm, PassContext(cfg))
    gm.recompile()
    verify(gm, PassContext(cfg), after="fuse_projections")
    groups = res.stats["groups"]
    # per layer: x feeds wq_a ‖ wkv (+ compressor wkv/wgate for m > 0, + indexer for CSA); qr feeds wq_b ‖ indexer wq_b
    # + per layer the shared expert's w1 ‖ w3 (exported as matmul(x, t(w)), not linear): another {2}
    members = {len(g["members"]) for g in groups}
    assert members == {2, 4, 7}
    shared = [g for g in groups if g["fused"].endswith("ffn.shared_experts.fused_w1__w3.weight")]
    assert len(shared) == cfg.num_hidden_layers and all(len(g["members"]) == 2 for g in shared)
    attn = [g for g in groups if g not in shared]
    assert {len(g["members"]) for g in attn} == {2, 4, 7}
    # each attention group of n linears leaves one; each shared group turns two matmuls into one linear
    assert graph_ops(gm)["linear.default"] == before - sum(len(g["members"]) - 1 for g in attn) + len(shared)
    assert graph_ops(gm)["matmul.default"] == cfg.num_hidden_layers  # only the w2 GEMMs stay matmuls
    names = {n.target for n in gm.graph.nodes if n.op == "get_attr" and n.users}
    assert not any(n.endswith(("attn.wq_a.weight", "attn.wkv.weight", "compressor.wgate.weight")) for n in names)
    # the per-head q norm + RoPE of every layer became one op
    assert res.stats["q_norm_rope_fused"] == graph_ops(gm)["head_rms_rope.default"] == cfg.num_hidden_layers
    csa = next(g for g in groups if len(g["members"]) == 7)
    assert csa["out_features"] == [cfg.q_lora_rank, cfg.head_dim, 2 * cfg.head_dim, 2 * cfg.head_dim,
                                   2 * cfg.index_head_dim, 2 * cfg.index_head_dim, cfg.index_n_heads]


@torch.no_grad()
def test_fuse_projections_in_bf16_keeps_the_fp32_compressor_group():
    """bf16 models compute the compressor/indexer projections in fp32 (an fp32 island): they fuse
    into their own fp32 GEMM beside the bf16 wq_a ‖ wkv, bit-exactly."""
    cfg = small("v4-tiny-a")  # SWA, CSA, HCA layers
    m = build_model(cfg, dtype=torch.bfloat16)
    gm = export_graph(m, GraphSpec("decode", n_slots=2, max_len=64)).module()
    res = fuse_projections(gm, PassContext(cfg))
    gm.recompile()
    groups = {(len(g["members"]), g["dtype"]) for g in res.stats["groups"]}
    assert groups == {(2, "bfloat16"), (2, "float32"), (5, "float32")}  # SWA/HCA/CSA layers
    assert {g["stored"] for g in res.stats["groups"]} == {"bfloat16"}  # the fp32 groups keep bf16 weights
    # 9 attention projections fold away (SWA: wq_a ‖ wkv 1; CSA: wq_a ‖ wkv 1, wq_b ‖ indexer wq_b 1, the
    # fp32 five 4; HCA: wq_a ‖ wkv 1, compressor wkv ‖ wgate 1), plus one of the shared expert's w1 ‖ w3 per layer
    assert res.stats["linears_after"] == res.stats["linears_before"] - 9 - cfg.num_hidden_layers
    ids, cache = _inputs(m, 1, n_slots=2)
    assert torch.equal(_run_graph(gm, ids, cache)[0], m(ids, copy.deepcopy(cache)))
    # lower_f32_linears then reads each fused fp32-island weight in bf16 (no fp32 copy): one linear_f32 each
    fp32_groups = [g for g in res.stats["groups"] if g["dtype"] == "float32"]
    low = lower_f32_linears(gm, PassContext(cfg))
    assert set(low.stats["weights"]) >= {g["fused"] for g in fp32_groups}
    assert torch.equal(_run_graph(gm, ids, cache)[0], m(ids, copy.deepcopy(cache)))


@torch.no_grad()
@pytest.mark.parametrize("preset", ["v3-tiny", "v32-tiny"])
def test_absorbed_decode_graph_never_expands_the_cache(exports, preset):
    m, dec = exports(preset, "decode")  # one dense and one MoE layer
    cfg = m.config
    kv_b = lambda gm: sum(1 for n in gm.graph.nodes if n.op == "get_attr" and n.users  # noqa: E731
                          and n.target.endswith("kv_b_proj.weight"))
    dec = _fresh(dec)
    n = cfg.num_hidden_layers
    assert kv_b(dec) == n
    einsums = graph_ops(dec)["einsum.default"]
    res = absorb_mla(dec, PassContext(cfg, graph_kind="decode"))
    dec.recompile()
    verify(dec, PassContext(cfg), after="absorb_mla")
    assert res.stats["decision"] == "absorbed" and res.stats["kv_b_linears_left"] == 0 and kv_b(dec) == 0
    assert graph_ops(dec)["einsum.default"] == einsums + 3 * n  # 2 einsums become 5 per layer
    pre = _fresh(exports(preset, "prefill")[1])
    res = absorb_mla(pre, PassContext(cfg, graph_kind="prefill"))
    assert not res.changed and res.stats["decision"] == "naive" and kv_b(pre) == n


def test_absorption_crossover_for_v3_geometry():
    assert 165 < crossover_tokens(PassContext(ModelConfig.preset("v3"))) < 175


def test_verify_rejects_broken_graphs(exports):
    m, eg = exports("v3-tiny", "decode")
    cfg = m.config
    gm = _fresh(eg)
    ctx = PassContext(cfg)
    verify(gm, ctx)
    lin = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default)
    with gm.graph.inserting_after(lin):
        bad = gm.graph.call_function(torch.relu, (lin,))  # not an aten/dsv4c op, and no meta["val"]
    lin.replace_all_uses_with(bad)
    bad.args = (lin,)
    with pytest.raises(VerifyError, match="not an aten or dsv4c op"):
        verify(gm, ctx, after="bad_pass")


def test_run_pipeline_skips_dumps_and_rejects_unknown_names(exports, tmp_path):
    m, eg = exports("v4-tiny-a", "decode")
    cfg = m.config
    gm = _fresh(eg)
    ctx = PassContext(cfg)
    _, recs = run_pipeline(gm, ctx, skip=["fuse_projections"], dump_dir=tmp_path)
    names = [n for n, _ in default_pipeline()]
    assert names[0] == "fuse_projections" and names[-2:] == ["select_kernels", "prefetch_weights"]
    assert [(r.name, r.skipped) for r in recs] == [(n, n == "fuse_projections") for n in names]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{i:02d}_{n}.{w}.py" for i, n in enumerate(names[1:], 1)
                                                                for w in ("after", "before"))
    with pytest.raises(ValueError, match="unknown pass"):
        run_pipeline(gm, ctx, skip=["no_such_pass"])


def test_error_metrics():
    ref = torch.tensor([1.0, -2.0, 3.0])
    m = error_metrics(ref.clone(), ref)
    assert m["snr_db"] == float("inf") and m["max_abs_err"] == 0
    m = error_metrics(ref + torch.tensor([0.1, 0.0, 0.0]), ref)
    assert abs(m["snr_db"] - 10 * math.log10(14 / 0.01)) < 1e-4 and abs(m["max_abs_err"] - 0.1) < 1e-6


def test_compare_cli_json_on_a_checkpoint(tmp_path, capsys):
    ck, cfg = tmp_path / "ck", tmp_path / "config.json"
    cfg.write_text(json.dumps(small("v32-tiny").to_dict()))  # one dense and one MoE layer
    assert cli_main(["init", str(cfg), "-o", str(ck), "--dtype", "fp32"]) == 0
    capsys.readouterr()
    assert cli_main(["compare", str(ck), "--graphs", "decode", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == ["export"] + [n for n, _ in default_pipeline()]
    for r in rows:
        assert set(r) >= {"name", "changed", "stats", "seconds", "snr_db", "max_abs_err", "cosine"}
    absorbed = rows[2]
    assert absorbed["changed"] and 80 < absorbed["snr_db"] < 1000 and absorbed["cosine"] > 0.999999


def test_compare_on_meta_full_size_dims_reports_stats_only(capsys):
    """The benchmark slice has V4-Flash's per-layer dims; on meta there are no numerics. Its CSA layer
    alone (a hash layer here; the MTP block kept): the fused group checked is that layer's."""
    cfg = ModelConfig.preset("v4-flash-slice").replace(num_hidden_layers=1, compress_ratios=(4, 0))
    rows = compare_passes(build_model(cfg, device="meta"), kinds=("decode",))
    fused = rows[1]
    assert fused["changed"] and fused["snr_db"] is None
    csa = next(g for g in fused["stats"]["groups"] if len(g["members"]) == 7)
    assert csa["out_features"] == [1024, 512, 1024, 1024, 256, 256, 64]
