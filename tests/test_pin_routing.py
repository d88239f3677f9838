"""Pinned routing (dsv4c/routing.py, passes/pin_routing.py, compare's pinned columns) on a two-layer V4
(a hash layer, then a top-k layer) in fp32: a perturbed expert kernel shows exactly its own error when
routing is pinned; flips are counted exactly on a constructed near-tie; every fusion pass is bit-exact
or >= 38 dB pinned, on the prefill and the MTP graph."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from dsv4c.compare import _cases, _run, case_metrics, error_metrics
from dsv4c.export import export_graph
from dsv4c.passes import PassContext, get_param, run_pipeline, set_param
from dsv4c.passes.pin_routing import expert_nodes, insert_taps, tapped
from dsv4c.routing import (RoutingEntry, RoutingTable, RoutingTap, _v4_selection_scores, margin_summary,
                           record_routing, routing_flips, set_flips, topk_margins)

from fusion_cases import model as tiny_model


@pytest.fixture(scope="module")
def prefill():
    """(model, the prefill case with eager's routing recorded, the exported prefill graph)."""
    m = tiny_model("v4")
    (case,) = _cases(m, ["prefill"], 0, seed=3)
    return m, case, export_graph(m, case.spec).module()


def test_set_flips_ignore_order_and_count_set_changes():
    a = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    b = torch.tensor([[1, 0], [2, 4], [4, 5], [7, 6]])
    assert set_flips(a, b).tolist() == [False, True, False, False]
    with pytest.raises(ValueError, match="shapes differ"):
        set_flips(a, b[:, :1])


def test_tap_replays_a_recording_in_chunks_and_refuses_too_many_rows():
    idx = torch.arange(12).view(6, 2)
    table = RoutingTable([RoutingEntry("layers.0", idx, torch.rand(6, 2))])
    tap = RoutingTap(table, pin=True)
    own = torch.zeros(4, 2, dtype=torch.int32), torch.zeros(4, 2)
    a, _ = tap(*own, slot=0)
    assert a.dtype == torch.int32 and a.tolist() == idx[:4].tolist() and tap.unconsumed() == {"layers.0": 2}
    b, wb = tap(own[0][:2], own[1][:2], slot=0)
    assert b.tolist() == idx[4:].tolist() and torch.equal(wb, table.entries[0].weight[4:]) and not tap.unconsumed()
    with pytest.raises(ValueError, match="rows 6..7"):
        tap(own[0][:1], own[1][:1], slot=0)
    with pytest.raises(ValueError, match="router #1"):
        tap(*own, slot=1)
    # the two chunks the graph saw merge into one entry of 6 rows, all flipped but the identical ones
    flips = routing_flips(table, tap.seen)
    assert flips[0]["tokens"] == 6 and flips[0]["flipped"] == 6


def test_margins_are_the_gap_between_kth_and_next_score():
    s = torch.tensor([[5.0, 4.0, 3.9, 1.0], [1.0, 2.0, 3.0, 4.0]])
    assert torch.allclose(topk_margins(s, 2), torch.tensor([0.1, 1.0]))
    m = margin_summary(RoutingTable([RoutingEntry("a", torch.zeros(2, 2), torch.zeros(2, 2), False,
                                                  topk_margins(s, 2)),
                                     RoutingEntry("h", torch.zeros(2, 2), torch.zeros(2, 2), True)]))
    assert abs(m[0]["quantiles"]["p0"] - 0.1) < 1e-6 and m[0]["below"]["0.01"] == 0.0 and "quantiles" not in m[1]


def test_taps_leave_the_graph_as_it_was_and_observe_its_routing(prefill):
    m, case, gm0 = prefill
    gm = copy.deepcopy(gm0)
    code = gm.code
    tap = RoutingTap(case.routing)
    with tapped(gm, tap):
        assert "routing_tap" in gm.code
        out = _run(gm, case)
    assert gm.code == code and not hasattr(gm, "routing_tap")
    assert torch.equal(out, _run(gm, case))  # observing changes nothing
    assert [e.name for e in case.routing.entries] == ["layers.0", "layers.1"] and case.routing.entries[0].hashed
    assert all(f["flipped"] == 0 for f in routing_flips(case.routing, tap.seen))  # export = eager
    with pytest.raises(ValueError, match="recorded RoutingTable"):
        RoutingTap(None, pin=True)


def test_pinned_routing_shows_exactly_a_perturbed_expert_kernels_error(prefill):
    """A test double of the layer-0 experts adds a known error; free, the error cascades through layer 1's
    flipped routing; pinned, the graph equals the eager model with the same error and eager's routing."""
    m, case, gm0 = prefill
    D = m.config.hidden_size
    delta = torch.randn(D, generator=torch.Generator().manual_seed(7)) * 0.5

    def perturbed(x, idx, w, *rest):
        return torch.ops.dsv4c.moe_experts(x, idx, w, *rest) + delta

    def run(pin: bool):
        gm = copy.deepcopy(gm0)
        tap = RoutingTap(case.routing, pin=pin)
        insert_taps(gm, tap)
        expert_nodes(gm)[0].target = perturbed
        gm.recompile()
        return _run(gm, case), tap

    hook = m.layers[0].ffn.register_forward_hook(lambda mod, a, out: out + delta)
    try:
        with torch.no_grad(), record_routing(m, pin=case.routing) as rec:  # eager + the error, eager's routing
            expected = case.eager(m)
    finally:
        hook.remove()
    assert not torch.equal(rec.table.entries[1].idx, case.routing.entries[1].idx)  # the error flips routes
    pinned, ptap = run(pin=True)
    free, ftap = run(pin=False)
    known = error_metrics(expected, case.ref)
    assert known["snr_db"] < 40  # the known error is visible
    assert error_metrics(pinned, expected)["snr_db"] > 120  # the graph pinned = eager with the same error
    assert abs(error_metrics(pinned, case.ref)["snr_db"] - known["snr_db"]) < 1e-3
    assert not ptap.unconsumed()
    free_flips = routing_flips(case.routing, ftap.seen)
    assert free_flips[0]["flipped"] == 0 and free_flips[1]["flipped"] > 0  # hash layer never flips
    assert error_metrics(free, expected)["snr_db"] < 60  # unpinned, the flips add error of their own


def test_flips_are_counted_exactly_on_a_constructed_near_tie(prefill):
    """Layer 1's gate bias of one expert is raised, in the graph only, by just enough that exactly n tokens
    (those whose gap to the k-th score is smallest) take that expert in: n flips there, none in layer 0."""
    m, case, gm0 = prefill
    gate = m.layers[1].ffn.gate
    got = {}
    h = gate.register_forward_hook(lambda mod, a, out: got.__setitem__("u", a[0]))
    try:
        with torch.no_grad():
            case.eager(m)
    finally:
        h.remove()
    with torch.no_grad():
        s = _v4_selection_scores(gate, got["u"])  # [T, E]
    kth = s.topk(gate.k, -1).values[:, -1]
    chosen = case.routing.entries[1].idx
    e = int(torch.bincount(chosen.flatten(), minlength=s.shape[1]).argmin())  # a rarely chosen expert
    outside = ~(chosen == e).any(-1)
    gaps = torch.where(outside, kth - s[:, e], torch.inf).sort().values
    n = 3
    assert gaps[n].isfinite() and gaps[n] - gaps[n - 1] > 1e-5  # a clean cut between the 3rd and 4th
    bump = float(gaps[n - 1] + gaps[n]) / 2
    gm = copy.deepcopy(gm0)
    name = next(k for k, _ in gm.named_parameters() if k.endswith("layers.1.ffn.gate.bias"))
    b = get_param(gm, name).detach().clone()
    b[e] += bump
    set_param(gm, name, torch.nn.Parameter(b))
    for pin in (False, True):
        tap = RoutingTap(case.routing, pin=pin)
        with tapped(gm, tap):
            _run(gm, case)
        flips = routing_flips(case.routing, tap.seen)
        assert [f["flipped"] for f in flips] == [0, n], (pin, flips)
        assert math.isclose(flips[1]["share"], n / chosen.shape[0], rel_tol=1e-6)


def _pipeline_rows(gm, case, cfg, kind: str) -> list[tuple[str, dict]]:
    rows = []
    run_pipeline(copy.deepcopy(gm), PassContext(cfg, "h200", kind),
                 after_each=lambda name, g: rows.append((name, case_metrics(g, case, pin_routing=True))))
    return rows


def test_fusion_passes_pinned_are_bit_exact_or_38db_prefill_and_mtp(prefill):
    m, case, gm = prefill
    (mcase,) = _cases(m, ["mtp"], 1, seed=4)
    for kind, c, g in (("prefill", case, gm), ("mtp", mcase, export_graph(m, mcase.spec).module())):
        rows = _pipeline_rows(g, c, m.config, kind)
        lossy = ["quantize_experts", "quantize_dense", "make_batch_invariant", "select_kernels", "prefetch_weights"]
        assert [r[0] for r in rows][-5:] == lossy  # FP8 experts / dense: lossy on purpose, and the passes after them
        for name, r in rows:
            if name in lossy:
                assert 15 < r["pinned"]["snr_db"] < 80, (kind, name, r["pinned"])
                continue
            assert r["pinned"]["snr_db"] == math.inf or r["pinned"]["snr_db"] >= 38, (kind, name, r["pinned"])
            assert r["snr_db"] == math.inf or r["snr_db"] >= 38, (kind, name, r)
        q = dict(rows)["quantize_experts"]
        assert len(q["flips"]) == len(c.routing) and len(q["pinned_flips"]) == len(c.routing)


def test_plot_routing_from_accuracy_json(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import plot_routing

    flips = [{"layer": "layers.0", "hashed": True, "tokens": 4, "flipped": 0, "share": 0.0},
             {"layer": "layers.1", "hashed": False, "tokens": 4, "flipped": 1, "share": 0.25}]
    data = {"formats": [{"format": "fp8_block", "flips": flips, "pinned_flips": flips}],
            "margins": {"slice": [{"layer": "layers.0", "hashed": True, "tokens": 4},
                                  {"layer": "layers.1", "hashed": False, "tokens": 4,
                                   "quantiles": {"p0": 1e-4, "p1": 2e-4, "p10": 1e-3, "p50": 1e-2, "p90": 0.1},
                                   "below": {"0.001": 0.1, "0.01": 0.5}}]}}
    lines, margins = plot_routing.series(data)
    assert lines["fp8_block"] == (["layers.0", "layers.1"], [0.0, 0.25], [0.0, 0.25]) and "slice" in margins
    out = plot_routing.plot(data, tmp_path / "r.png")
    assert out.stat().st_size > 10_000


@pytest.mark.gpu
def test_gpu_pinned_compare_h200_bf16():
    """On the GPU, bf16, the h200 lowering with its Triton kernels: every fusion pass within bf16 rounding of
    eager with routing pinned (>= 38 dB, issue 22), and pinning never makes the quantised graph worse.
    Pinned means the routers' and the CSA indexers' decisions: with the indexers free, lower_f32_linears
    measured 29.3 dB here on the H200 (its other fp32 summation order moved near-tied top-k selections;
    tests/test_pin_indexer.py)."""
    from dsv4c import ModelConfig
    from dsv4c.compare import compare_passes
    from dsv4c.model import build_model

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    m = build_model(ModelConfig.preset("v4-tiny-a"), "cuda", torch.bfloat16, on_device=True)
    for kind in ("prefill", "decode"):
        rows = compare_passes(m, target="h200", kinds=(kind,), pin_routing=True, prompt_len=256)
        for r in rows:
            p = r["pinned"]["snr_db"]
            if r["name"] in ("quantize_experts", "quantize_dense", "make_batch_invariant", "select_kernels"):
                assert p >= r["snr_db"] - 0.5, (kind, r["name"], p, r["snr_db"])
            else:
                assert p == math.inf or p >= 38, (kind, r["name"], r["pinned"], r.get("index_flips"), r["flips"])


@pytest.mark.parametrize("kfmt", ["nvfp4", "fp8_block"])
def test_in_memory_quantisation_of_release_values_is_the_lossless_conversion(kfmt):
    """Experts holding exactly MXFP4 values (the release values) quantise in memory as compile converts the
    checkpoint: without loss. Float weights that are not MXFP4 still go through the lossy recipe."""
    from dsv4c import quant as Q
    from dsv4c.kernels.moe_grouped import experts_from_tensors
    from dsv4c.convert import expert_tensors

    g = torch.Generator().manual_seed(0)
    e, i, d = 2, 128, 256
    raw = [torch.randn(e, *s, generator=g) * 0.05 for s in ((i, d), (i, d), (d, i))]
    release = [Q.dequant_mxfp4(*Q.quant_mxfp4(w)) for w in raw]
    for ws, exact in ((release, True), (raw, False)):
        fields, _ = expert_tensors(kfmt, e, lambda j, ws=ws: ("float", *(w[j] for w in ws)), i, d)
        got = experts_from_tensors(kfmt, **fields).dequantize()
        same = all(torch.equal(a.float(), b) for a, b in zip(got, ws))
        assert same == exact, (kfmt, exact)


def test_compare_cli_pin_routing_json_on_the_mtp_graph(tmp_path, capsys):
    """`dsv4c compare CFG --graphs mtp --pin-routing --json`: every row has its pinned metrics and per-layer
    flips (the MTP block's router), strict JSON; the first row carries eager's margins."""
    import json

    from dsv4c.cli import main
    from fusion_cases import V4_TINY_2L

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(V4_TINY_2L))
    assert main(["compare", str(cfg), "--graphs", "mtp", "--pin-routing", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["name"] == "export" and [m["layer"] for m in rows[0]["margins"]] == ["mtp.0"]
    for r in rows:
        assert set(r["pinned"]) == {"snr_db", "max_abs_err", "cosine"}
        assert [f["layer"] for f in r["flips"]] == [f["layer"] for f in r["pinned_flips"]] == ["mtp.0"]
    assert rows[0]["pinned"]["snr_db"] == "inf"
