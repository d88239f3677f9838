"""Launch ops whose inputs are ready long before their first reader on the side stream, as soon as they can run.

Applied at load after `overlap_shared_experts`, on the same graphs (those captured whole as one CUDA graph per
bucket; runtime/session.py `_executors`). The artifact's graphs are unchanged.

Two ops of a V4 decode step wait on the main stream although everything they read was ready much earlier:
- a compressed layer's compressor / indexer projection (`linear_f32_fused` of the stacked bf16 weights, about
  21 MB at Flash's ratio-4 layers, 11 µs at batch 1 on an H100) reads the attention norm's output, yet runs
  after the q and kv paths (wq_a ‖ wkv, q norm, wq_b, head norm and rope, kv norm and rope), just before the
  compress kernels that read it;
- a hash layer's expert lookup `tid2eid[ids]` (an ATen gather, outside the step's PDL chain) reads only the
  token ids and a table, yet runs between the router's GEMV and `route_hashed`.
Forked onto the side stream at the point its inputs are ready, each runs beside the main stream's kernels up
to its first reader, where the main stream joins it.

Before (one compressed layer; x: the attention norm's output):
    x = rms_norm(u, w_norm)
    q = head_rms_rope(fp8_linear(rms_norm(split(fp8_linear(x, w_qkv))[0]), w_qb))   # q path ...
    kv = rope(rms_norm(split(..)[1]))                                               # ... kv path
    c = linear_f32_fused(x, w_comp)          # waits for the q and kv paths' kernels
    v4_compress(split(c)[0], split(c)[1], ..)
After:
    x = rms_norm(u, w_norm)
    c = side_i(x, w_comp)                    # SideStream: waits for the main stream so far, then launches
    q = ...;  kv = ...                       # the main stream, concurrently
    c' = side_join(c)                        # the main stream waits for the side stream
    v4_compress(split(c')[0], split(c')[1], ..)

Why it is valid: the moved op is one node that reads only tensors made before the fork (its inputs, weights
and views of graph inputs other than the caches), writes a fresh tensor and no input, and nothing reads
its result before the join; the streams are ordered by an event at the fork and one at the join. So it
reads the same values as before and every output is bit-identical. The views and weights it reads that the
graph defines later (a get_attr, a reshape of the token ids) move up to the fork: they read only graph
inputs and attributes, so they compute the same there. Memory and split-K counters as in
`overlap_shared_experts` (`SideStream`, `side_join`, kernels/_tl.py's side-stream counters).

Only these ops move (`EARLY_OPS`), and only where the main stream launches at least `MIN_BETWEEN` kernels
between the fork and the first reader: a router's gate GEMV, read at once by its top-k, and the head stay.

`stats`: `seen` (candidate ops), `forked`, `skipped` (node -> why).
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from dsv4c.passes import PassContext, PassResult
from dsv4c.passes.overlap_shared_experts import SideStream, _allowed, _body, side_join
from dsv4c.passes.split_at_routers import op_name

EARLY_OPS = {"dsv4c.linear_f32_fused", "dsv4c.linear_f32", "aten.index"}
MIN_BETWEEN = 2  # main-stream kernels between the fork and the first reader for a fork to pay


def _is_early(n: Node, memo: dict[Node, bool]) -> bool:
    """True when `n` is a graph input other than a cache, an attribute, or an ATen op (not a kernel of
    ours, not writing its input) of early nodes only: it can be computed at the graph's start."""
    if n not in memo:
        if n.op == "get_attr":
            memo[n] = True
        elif n.op == "placeholder":
            memo[n] = not n.name.startswith("caches_")
        else:
            memo[n] = (n.op == "call_function" and op_name(n.target).startswith("aten.") and _allowed(n) is None
                       and all(_is_early(a, memo) for a in n.all_input_nodes))
    return memo[n]


def _launches(n: Node) -> bool:
    """A node that launches a kernel on the main stream (our ops and ATen's linear / mm / index / embedding)."""
    if n.op != "call_function":
        return False
    name = op_name(n.target)
    return name.startswith("dsv4c.") or name in ("aten.linear", "aten.mm", "aten.index", "aten.embedding")


def _fork_point(n: Node, nodes: list[Node], memo: dict) -> tuple[Node, list[Node]]:
    """(the node the side call follows, the early nodes to move up before it): the latest input of `n` that
    is not early, else the node before the graph's first kernel; the early inputs' own early ancestors
    defined after that point move too (graph order kept)."""
    order = {m: k for k, m in enumerate(nodes)}
    late = [a for a in n.all_input_nodes if not _is_early(a, memo)]
    at = max(late, key=order.__getitem__) if late else next(m for m in nodes if _launches(m)).prev
    move, todo = set(), [a for a in n.all_input_nodes if _is_early(a, memo)]
    while todo:
        a = todo.pop()
        if a not in move and order[a] > order[at]:
            move.add(a)
            todo.extend(a.all_input_nodes)
    return at, sorted(move, key=order.__getitem__)


def _why_not(n: Node, at: Node, nodes: list[Node]) -> str | None:
    """Why `n` stays on the main stream (None: it moves)."""
    why = _allowed(n)
    if why:
        return why
    if any(a.op == "placeholder" and a.name.startswith("caches_") for a in n.all_input_nodes):
        return f"{n.name} reads a cache"
    if not n.users:
        return f"{n.name} has no reader"
    order = {m: k for k, m in enumerate(nodes)}
    first = min(n.users, key=order.__getitem__)
    between = sum(_launches(m) for m in nodes[order[at] + 1:order[first]] if m is not n)
    if between < MIN_BETWEEN:
        return f"{n.name}: {between} kernel(s) before its first reader {first.name}"
    return None


def overlap_early_ops(gm: GraphModule, ctx: PassContext) -> PassResult:
    """The pass (in place on `gm`'s graph; each moved op goes into an `early_{i}` submodule)."""
    stats: dict = {"seen": 0, "forked": 0, "skipped": {}}
    memo: dict[Node, bool] = {}
    cands = [n for n in gm.graph.nodes if n.op == "call_function" and op_name(n.target) in EARLY_OPS]
    for i, n in enumerate(cands):
        stats["seen"] += 1
        nodes = list(gm.graph.nodes)
        at, move = _fork_point(n, nodes, memo)
        why = _why_not(n, at, nodes)
        if why:
            stats["skipped"][n.name] = why
            continue
        body, ins = _body([n], n)
        name = f"early_{i}"
        gm.add_submodule(name, SideStream(body))
        with gm.graph.inserting_after(at):
            call = gm.graph.call_module(name, tuple(ins))
        for a in move:  # in graph order, each right before the call
            call.prepend(a)
        call.meta = {"val": n.meta.get("val")}
        order = {m: k for k, m in enumerate(gm.graph.nodes)}
        with gm.graph.inserting_before(min(n.users, key=order.__getitem__)):
            join = gm.graph.call_function(side_join, (call,))
        join.meta = {"val": n.meta.get("val")}
        n.replace_all_uses_with(join)
        gm.graph.erase_node(n)
        stats["forked"] += 1
    if stats["forked"]:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, bool(stats["forked"]), stats)
