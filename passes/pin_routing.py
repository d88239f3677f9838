"""A comparison pass: route a graph's experts through a `RoutingTap` (dsv4c/routing.py).

Not in the default pipeline and never in a compiled artifact: `dsv4c compare --pin-routing` and
`dsv4c.compare.artifact_logits` apply it to a graph in memory, run it, and take it out again.

Before (any lowering: `moe_experts`, `moe_experts_gathered` or `moe_experts_q`, prefill/decode/MTP):
    idx, w = <router>(...)                       # top-K or hash routing, fused or not
    y = dsv4c.<experts op>(x, idx, w, *weights)
After (i = the op's position among the graph's routed-experts ops, i.e. its MoE layer in call order):
    t = routing_tap(idx, w, slot=i)              # call_module of the tap submodule
    y = dsv4c.<experts op>(x, getitem(t, 0), getitem(t, 1), *weights)

Why it is valid for a comparison: the tap in "observe" mode returns its inputs (the graph computes
what it computed before, and the tap records its routing); in "pin" mode it returns the eager model's
recorded decisions for the same rows, so the experts of every layer get exactly the tokens and
weights eager gave them, and the only differences left in the logits are the kernels' and formats'.
The router itself still runs (its outputs feed the tap), so the graph's own routing is recorded too.
"""
from __future__ import annotations

import contextlib
import operator

import torch
from torch.fx import GraphModule, Node

from dsv4c.passes import PassContext, PassResult

TAP = "routing_tap"  # the submodule name


def _is_experts(n: Node) -> bool:
    from dsv4c.passes.split_at_routers import MOE_OPS, op_name

    return n.op == "call_function" and op_name(n.target) in MOE_OPS


def expert_nodes(gm: GraphModule) -> list[Node]:
    """The routed-experts nodes in graph (= layer) order."""
    return [n for n in gm.graph.nodes if _is_experts(n)]


def insert_taps(gm: GraphModule, tap: torch.nn.Module) -> int:
    """Rewrite every routed-experts op to read its (idx, w) through `tap`; returns how many."""
    if hasattr(gm, TAP):
        raise ValueError(f"graph already has a {TAP} (remove_taps first)")
    nodes = expert_nodes(gm)
    gm.add_submodule(TAP, tap)
    g = gm.graph
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
        idx, w = t.args
        for u in list(t.users):
            u.replace_all_uses_with(idx if u.args[1] == 0 else w)
            g.erase_node(u)
        g.erase_node(t)
    if hasattr(gm, TAP):
        delattr(gm, TAP)
    g.lint()
    gm.recompile()
    return len(taps)


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
    pin_routing_as(tap))])`); stats["routers"] is the number of experts ops now reading the tap."""

    def run(gm: GraphModule, ctx: PassContext) -> PassResult:
        n = insert_taps(gm, tap)
        return PassResult(gm, n > 0, {"routers": n, "pin": bool(getattr(tap, "pin", False))})

    return run
