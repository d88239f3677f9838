"""A comparison pass: route a graph's experts and sparse-attention selections through a `RoutingTap`
(dsv4c/routing.py).

Not in the default pipeline and never in a compiled artifact: `dsv4c compare --pin-routing` and
`dsv4c.compare.artifact_logits` apply it to a graph in memory, run it, and take it out again.

Before (any lowering: `moe_experts`, `moe_experts_gathered` or `moe_experts_q`, prefill/decode/MTP):
    idx, w = <router>(...)                       # top-K or hash routing, fused or not
    y = dsv4c.<experts op>(x, idx, w, *weights)
After (i = the op's position among the graph's routed-experts ops, i.e. its MoE layer in call order):
    t = routing_tap(idx, w, slot=i)              # call_module of the tap submodule
    y = dsv4c.<experts op>(x, getitem(t, 0), getitem(t, 1), *weights)
and for the indexers (V4 CSA, V3.2 DSA; any lowering, `INDEX_OPS`; j = the op's position among them):
Before:
    sel = dsv4c.<indexer op>(q, weights, keys, ...)             # [B, T, topk] entry ids
    o = dsv4c.<attention op>(..., sel, ...)
After:
    sel = dsv4c.<indexer op>(q, weights, keys, ...)
    s = routing_tap(sel, slot=j, index=True)
    o = dsv4c.<attention op>(..., s, ...)

Why it is valid for a comparison: the tap in "observe" mode returns its inputs (the graph computes
what it computed before, and the tap records its routing); in "pin" mode it returns the eager model's
recorded decisions for the same rows, so the experts of every layer get exactly the tokens and
weights eager gave them, and each sparse attention reads exactly the compressed entries eager's indexer
picked; the only differences left in the logits are the kernels' and formats'. The router and the
indexer themselves still run (their outputs feed the tap), so the graph's own decisions are recorded too.
An indexer's top-k flips on near-ties as a router's does (issue 22: v4-tiny-a's 256-token prefill on the
H200 fell to 29.3 dB with only the routers pinned after lower_f32_linears; ARCHITECTURE.md section 6).
"""
from __future__ import annotations

import contextlib
import operator

import torch
from torch.fx import GraphModule, Node

from dsv4c.passes import PassContext, PassResult

TAP = "routing_tap"  # the submodule name
# the sparse-attention selection ops (every lowering): their output [B, T, topk] feeds the attention
INDEX_OPS = frozenset({"dsv4c.v4_indexer_topk", "dsv4c.v4_indexer_topk_fused", "dsv4c.v4_indexer_topk_paged",
                       "dsv4c.v4_indexer_topk_paged_fused", "dsv4c.dsa_topk"})


def _is_experts(n: Node) -> bool:
    from dsv4c.passes.split_at_routers import MOE_OPS, op_name

    return n.op == "call_function" and op_name(n.target) in MOE_OPS


def expert_nodes(gm: GraphModule) -> list[Node]:
    """The routed-experts nodes in graph (= layer) order."""
    return [n for n in gm.graph.nodes if _is_experts(n)]


def index_nodes(gm: GraphModule) -> list[Node]:
    """The indexer (sparse-attention selection) nodes in graph (= layer) order."""
    from dsv4c.passes.split_at_routers import op_name

    return [n for n in gm.graph.nodes if n.op == "call_function" and op_name(n.target) in INDEX_OPS]


def insert_taps(gm: GraphModule, tap: torch.nn.Module) -> int:
    """Rewrite every routed-experts op to read its (idx, w) through `tap`, and every indexer's users to
    read its selection through `tap`; returns how many routers."""
    if hasattr(gm, TAP):
        raise ValueError(f"graph already has a {TAP} (remove_taps first)")
    nodes = expert_nodes(gm)
    gm.add_submodule(TAP, tap)
    g = gm.graph
    for j, n in enumerate(index_nodes(gm)):
        with g.inserting_after(n):
            t = g.call_module(TAP, (n,), {"slot": j, "index": True})
        t.meta["val"] = n.meta.get("val")
        n.replace_all_uses_with(t, delete_user_cb=lambda u, t=t: u is not t)
    for i, n in enumerate(nodes):
        idx, w = n.args[1], n.args[2]
        with g.inserting_before(n):
            t = g.call_module(TAP, (idx, w), {"slot": i})
            gi = g.call_function(operator.getitem, (t, 0))
            gw = g.call_function(operator.getitem, (t, 1))
        vals = (idx.meta.get("val"), w.meta.get("val"))
        t.meta["val"], gi.meta["val"], gw.meta["val"] = vals, vals[0], vals[1]
        n.args = (n.args[0], gi, gw, *n.args[3:])
    g.lint()
    gm.recompile()
    return len(nodes)


def remove_taps(gm: GraphModule) -> int:
    """Undo `insert_taps`: the experts read the router's outputs again; returns how many taps."""
    g = gm.graph
    taps = [n for n in g.nodes if n.op == "call_module" and n.target == TAP]
    for t in taps:
        if t.kwargs.get("index"):
            t.replace_all_uses_with(t.args[0])
            g.erase_node(t)
            continue
        idx, w = t.args
        for u in list(t.users):
            u.replace_all_uses_with(idx if u.args[1] == 0 else w)
            g.erase_node(u)
        g.erase_node(t)
    if hasattr(gm, TAP):
        delattr(gm, TAP)
    g.lint()
    gm.recompile()
    return sum(not t.kwargs.get("index") for t in taps)


@contextlib.contextmanager
def tapped(gm: GraphModule, tap: torch.nn.Module):
    """`with tapped(gm, tap): gm(...)`: the taps exist only inside the block."""
    insert_taps(gm, tap)
    try:
        yield gm
    finally:
        remove_taps(gm)


def pin_routing_as(tap: torch.nn.Module):
    """The pass form, for a pipeline run by hand (`run_pipeline(gm, ctx, passes=[..., ("pin_routing",
    pin_routing_as(tap))])`); stats["routers"] is the number of experts ops now reading the tap,
    stats["indexers"] the number of indexer selections."""

    def run(gm: GraphModule, ctx: PassContext) -> PassResult:
        n = insert_taps(gm, tap)
        k = len(index_nodes(gm))
        return PassResult(gm, n + k > 0, {"routers": n, "indexers": k, "pin": bool(getattr(tap, "pin", False))})

    return run
