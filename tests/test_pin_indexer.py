"""Pinned indexer selections (issue 22): the sparse attention's top-k over compressed entries (V4 CSA) is a
discrete decision like a router's, recorded by `record_routing` and fed to the graph by the routing tap
(passes/pin_routing.py). On a two-layer V4 in fp32 (layer 1 is a CSA layer): a constructed near-tie in
the indexer's scores flips one query's selection when free, and pinned the attention reads eager's."""
from __future__ import annotations

import copy

import pytest
import torch

from dsv4c.compare import _cases, _run, case_metrics
from dsv4c.export import export_graph
from dsv4c.model.common import topk_visible
from dsv4c.model.v4_ops import visible_count
from dsv4c.passes.pin_routing import index_nodes, insert_taps, remove_taps, tapped
from dsv4c.routing import IndexEntry, RoutingTable, RoutingTap, index_flips, record_routing

from fusion_cases import model as tiny_model


@pytest.fixture(scope="module")
def prefill():
    """(model, the prefill case with eager's decisions recorded, the exported prefill graph)."""
    m = tiny_model("v4")
    (case,) = _cases(m, ["prefill"], 0, seed=3, prompt_len=48)  # up to 12 compressed entries per query
    return m, case, export_graph(m, case.spec).module()


def _scores(q, weights, keys, slots, pos0, m):
    """The indexer's scores [B, T, E] and visibility (dsv4c/model/v4_ops.py's formula, fp32)."""
    rows = keys[slots]
    dots = torch.einsum("bthi,bsi->bths", q.float(), rows.float()).relu()
    score = torch.einsum("bth,bths->bts", weights.float() * q.shape[-1] ** -0.5, dots)
    pos = pos0[:, None] + torch.arange(q.shape[1])
    return score, torch.arange(rows.shape[1]) < visible_count(pos, m)[..., None]


def test_eager_records_the_indexer_and_the_graph_sees_the_same(prefill):
    m, case, gm0 = prefill
    assert [e.name for e in case.routing.index] == ["layers.1"]
    B, T = case.args[0].shape
    assert case.routing.index[0].idx.shape == (B * T, m.config.index_topk)
    gm = copy.deepcopy(gm0)
    code = gm.code
    tap = RoutingTap(case.routing)
    with tapped(gm, tap):
        assert len(index_nodes(gm)) == 1 and "index = True" in gm.code
        out = _run(gm, case)
    assert gm.code == code  # the taps are gone again
    assert torch.equal(out, _run(gm, case))
    assert [f["flipped"] for f in index_flips(case.routing, tap.seen)] == [0]  # export = eager


def test_a_near_tie_flips_one_query_free_and_none_reaches_the_attention_pinned(prefill):
    """The graph's indexer op is replaced by a test double that adds to one score just over the smallest
    gap between a query's k-th and (k+1)-th visible entry: free, exactly that query's selection flips and
    the logits move; pinned, the attention reads eager's selection and the logits are eager's bit for bit
    (the graph's own selection, still recorded, shows the one local flip)."""
    m, case, gm0 = prefill
    k = m.config.index_topk
    node = index_nodes(gm0)[0]
    real = node.target
    seen_args = {}

    def record(*a):
        seen_args["a"] = a
        return real(*a)

    gm = copy.deepcopy(gm0)
    index_nodes(gm)[0].target = record
    gm.recompile()
    with torch.no_grad():
        _run(gm, case)
    q, weights, keys, slots, pos0, topk, ratio = seen_args["a"]
    score, visible = _scores(q, weights, keys, slots, pos0, ratio)
    s = score.masked_fill(~visible, float("-inf")).sort(-1, descending=True)
    gap = s.values[..., k - 1] - s.values[..., k]  # [B, T]
    gap = torch.where(gap.isfinite() & (gap > 0), gap, torch.inf)
    b, t = divmod(int(gap.argmin()), gap.shape[1])
    e = int(s.indices[b, t, k])  # the best entry left out
    bump = 2 * gap[b, t].item()
    spread = float(s.values[b, t, 0] - s.values[b, t, k])
    assert bump < 0.1 * spread  # a near-tie: small against the query's scores

    def bumped(q, weights, keys, slots, pos0, topk, ratio):
        sc, vis = _scores(q, weights, keys, slots, pos0, ratio)
        sc[b, t, e] += bump
        return topk_visible(sc, vis, topk)

    with torch.no_grad():
        ref = _run(gm0, case)
    for pin in (False, True):
        tap = RoutingTap(case.routing, pin=pin)
        gm = copy.deepcopy(gm0)
        insert_taps(gm, tap)
        index_nodes(gm)[0].target = bumped  # the tap reads the double's selection
        gm.recompile()
        with torch.no_grad():
            out = _run(gm, case)
        flips = index_flips(case.routing, tap.seen)
        assert [f["flipped"] for f in flips] == [1], (pin, flips)  # the graph's own selection: one query
        assert abs(flips[0]["share"] - 1 / (q.shape[0] * q.shape[1])) < 1e-9
        if pin:
            assert torch.equal(out, ref) and not tap.unconsumed()
        else:
            assert not torch.equal(out, ref)


def test_tap_replays_indexer_rows_in_chunks_and_refuses_too_many():
    sel = torch.arange(12).view(6, 2)
    tap = RoutingTap(RoutingTable([], [IndexEntry("layers.1", sel)]), pin=True)
    own = torch.zeros(1, 4, 2, dtype=torch.int64)
    a = tap(own, slot=0, index=True)
    assert a.shape == (1, 4, 2) and a.flatten(0, 1).tolist() == sel[:4].tolist()
    assert tap.unconsumed() == {"indexer layers.1": 2}
    b = tap(own[:, :2], slot=0, index=True)
    assert b.flatten(0, 1).tolist() == sel[4:].tolist() and not tap.unconsumed()
    with pytest.raises(ValueError, match=r"indexer #0 \(layers.1\).*rows 6..7"):
        tap(own[:, :1], slot=0, index=True)
    with pytest.raises(ValueError, match="indexer #1"):
        tap(own, slot=1, index=True)
    assert [f["flipped"] for f in index_flips(tap.table, tap.seen)] == [6]  # the graph's zeros, merged


def test_compare_reports_indexer_flips_and_eager_pins_them_too(prefill):
    """case_metrics carries per-indexer flips (free and pinned); `record_routing(pin=...)` replays the
    indexers' selections on the eager side as it does the gates'."""
    m, case, gm0 = prefill
    r = case_metrics(copy.deepcopy(gm0), case, pin_routing=True)
    assert [f["layer"] for f in r["index_flips"]] == [f["layer"] for f in r["pinned_index_flips"]] == ["layers.1"]
    assert r["pinned"]["snr_db"] == float("inf")
    other = RoutingTable(case.routing.entries, [IndexEntry(e.name, e.idx.flip(0)) for e in case.routing.index])
    with torch.no_grad(), record_routing(m, pin=other) as rec:
        out = case.eager(m)
    assert torch.equal(rec.table.index[0].idx, case.routing.index[0].idx)  # recorded: the model's own
    assert not torch.equal(out, case.ref)  # but the attention read the pinned one
    gm = copy.deepcopy(gm0)
    assert insert_taps(gm, RoutingTap(case.routing)) == 2 and remove_taps(gm) == 2  # routers counted
