"""Run each MoE layer's shared expert on a second CUDA stream, beside its router and routed experts.

Applied at load, not in the compile pipeline: the runtime runs it on the fixed-shape graphs it captures as
one CUDA graph per bucket (`Session.load(side_stream=True)`, the default; runtime/session.py `_executors`),
before `split_at_routers`. The artifact's graphs are unchanged.

At batch 1 a V4 MoE layer launches the router (gate GEMV, top-k), the routed experts (activation quant,
w1 ‖ w3 GEMV, SwiGLU quant, w2 GEMV, combine) and then the shared expert (w1 ‖ w3 GEMV, SwiGLU, w2 GEMV) on
one stream, though the shared expert reads neither: each launch's ramp and tail is paid in turn. Forked
onto a second stream, the shared expert's kernels fill the gaps the routed path leaves (run67, H100, Flash
shapes, 4 layers alone: 94.3 → 87.2 µs a layer; run68, the 2-layer slice's whole step on the GPU alone: 1.016x
at batch 1, 1.014x at batch 8, forked before the router).

Before (one layer; x: the FFN norm's output, N rows; every op launches on the current stream):
    x = reshape(rms_norm(h))                                  # [N, D]
    r = moe_experts_q(pad(x), route(linear_f32_fused(x)))     # routed
    s = fp8_linear(swiglu_act(split(fp8_linear(x, w13))), w2) # shared        [N, D]
    h2 = hc_post_pre(slice(r), X, .., y2=s)
After (`FORK_BEFORE_ROUTER` 0, the default):
    x = reshape(rms_norm(h))
    idx, w = route(linear_f32_fused(x))                       # the router's launches go first
    s = side_0(x, w13, w2, ..)        # SideStream(body): waits for the current stream, launches body's
                                      # kernels (the shared expert, moved here) on the side stream
    r = moe_experts_q(pad(x), idx, w)                         # current stream, concurrently
    s' = side_join(s)                 # the current stream waits for the side stream
    h2 = hc_post_pre(slice(r), X, .., y2=s')
With `FORK_BEFORE_ROUTER` 1 the side call goes right after x instead, before the router's ops.

Why it is valid: the moved nodes are exactly the layer's nodes that read x (directly or through each other)
and are neither ancestors nor descendants of the routed-experts op: the shared expert. They read only x and
weights, write fresh tensors and no cache, and nothing outside reads them before the join; the two streams
are ordered by an event at the fork and one at the join. So every kernel reads the same inputs as before and
the outputs are bit-identical. Memory: the inputs are marked used by the side stream and the output by the
current one (`record_stream`), so the allocator does not reuse them while the other stream may read them.
The only device state kernels share is kernels/_tl.py's split-K tile counters; launches on the side stream
get their own buffer (`_tl.split_counters`). On tensors that are not CUDA tensors both helpers do nothing.

Skipped (left on one stream) where a layer's candidate nodes are not one clean branch: more than one value
leaving them, a collective or other op outside the aten / dsv4c namespaces (sharded graphs: the shared
expert ends in an all-reduce), a cache write, or an input other than x and the weights.

`stats`: `layers` (MoE nodes seen), `forked` (shared experts moved), `skipped` (layer -> why).
"""
from __future__ import annotations

import copy
import operator

import torch
from torch.fx import Graph, GraphModule, Node

from dsv4c.kernels._tl import side_stream
from dsv4c.passes import PassContext, PassResult, _mutated_args
from dsv4c.passes.split_at_routers import MOE_OPS, op_name

MOE_NODES = MOE_OPS | {"dsv4c.moe_experts_fp8_bi"}
# Where the side call goes: 1 right after x, before the router (run68's A/B: 1.016x / 1.014x at batch 1 / 8); 0 right
# before the routed experts' op, after the router's launches. run72's timelines (H100, the 2-layer slice) show the
# router's first kernel starting 5 µs (batch 1) and 9-10 µs (batch 8) after the FFN norm ends, behind the shared
# expert's w1 ‖ w3 GEMV launched first on the side stream; with 0 the router's latency-bound kernels go first and
# the shared expert overlaps the experts' GEMMs instead. 0 in run78 (H100, one repetition): batch 8 1.458 vs 1.467 ms,
# batch 1 0.755 vs 0.756. run79 (another H100, the 2-layer step on the GPU alone, two interleaved repetitions): batch
# 8 1.510 / 1.515 vs 1.512 / 1.517 ms, batch 64 4.333 / 4.331 vs 4.369 / 4.364 ms (1.008x); the full slice
# back to back on that machine (run61, fortieth session): 1.161 / 2.667 / 7.797 vs 1.159 / 2.679 / 7.863 ms at batch
# 1 / 8 / 64. The default since then.
FORK_BEFORE_ROUTER = 0


class SideStream(torch.nn.Module):
    """Runs `body` (a GraphModule) on the device's side stream after the current stream's work so far."""

    def __init__(self, body: GraphModule):
        super().__init__()
        self.body = body

    def forward(self, *args):
        x = args[0]
        if not (isinstance(x, torch.Tensor) and x.is_cuda):
            return self.body(*args)
        main, side = torch.cuda.current_stream(x.device), side_stream(x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            out = self.body(*args)
        for a in args:  # freed on the current stream later: not reused while the side stream reads them
            if isinstance(a, torch.Tensor) and a.is_cuda:
                a.record_stream(side)
        return out


def side_join(y: torch.Tensor) -> torch.Tensor:
    """The current stream waits for the side stream's work so far; `y` (made there) is then read here."""
    if isinstance(y, torch.Tensor) and y.is_cuda:
        main = torch.cuda.current_stream(y.device)
        main.wait_stream(side_stream(y.device))
        y.record_stream(main)
    return y


def _reach(n: Node, step) -> set[Node]:
    """Every node reachable from `n` (not `n` itself) by repeated `step(node)` (its inputs or its users)."""
    seen, todo = set(), list(step(n))
    while todo:
        a = todo.pop()
        if a not in seen:
            seen.add(a)
            todo.extend(step(a))
    return seen


def _ancestors(n: Node) -> set[Node]:
    return _reach(n, lambda m: m.all_input_nodes)


def _descendants(n: Node) -> set[Node]:
    return _reach(n, lambda m: m.users)


def _branch_point(moe: Node) -> Node:
    """The routed experts' activations as the layer's other readers see them: walk back from the MoE op's
    first argument through single-reader nodes (the pad, views) to the first node read elsewhere too."""
    x = moe.args[0]
    while isinstance(x, Node) and len(x.users) == 1 and x.op == "call_function" and x.args \
            and isinstance(x.args[0], Node):
        x = x.args[0]
    return x


def _is_tensor(n: Node) -> bool:
    return isinstance(n.meta.get("val"), torch.Tensor)


def _allowed(n: Node) -> str | None:
    """Why `n` cannot move to the side stream (None: it can)."""
    if n.op != "call_function":
        return f"{n.name}: {n.op}"
    if n.target is operator.getitem:
        return None
    name = op_name(n.target)
    if not (name.startswith("aten.") or name.startswith("dsv4c.")):
        return f"{n.name}: {name} (only aten and dsv4c ops move)"
    if _mutated_args(n):
        return f"{n.name}: {name} writes its input"
    return None


def _branch(x: Node, moe: Node, order: dict[Node, int]) -> tuple[list[Node], Node] | str:
    """The shared expert's nodes (graph order) and the one value leaving them, or why there is none."""
    around = _ancestors(moe) | _descendants(moe) | {moe}
    cand = {n for n in _descendants(x) if n not in around and n.op == "call_function"}
    outs = [n for n in cand if any(u not in cand for u in n.users)]
    if not outs:
        return "no branch beside the routed experts"
    if len(outs) > 1:
        return f"{len(outs)} values leave the branch ({sorted(o.name for o in outs)[:4]})"
    out = outs[0]
    nodes = sorted(({out} | _ancestors(out)) & cand, key=order.__getitem__)
    for n in nodes:
        why = _allowed(n)
        if why:
            return why
        for a in n.all_input_nodes:
            if a not in cand and a is not x and a.op not in ("placeholder", "get_attr") and _is_tensor(a):
                return f"{n.name} reads {a.name} (only x, weights and sizes may enter)"
            if a.op == "placeholder" and a.name in ("slots", "pos0", "n_real") or a.name.startswith("caches_"):
                return f"{n.name} reads {a.name}"
    if not any(op_name(n.target).startswith("dsv4c.") or op_name(n.target) == "aten.linear" for n in nodes):
        return "no kernel in the branch"
    return nodes, out


def _hoist(ins: list[Node], x: Node, order: dict[Node, int]) -> Node:
    """Move the inputs defined after x whose own inputs come before it (weights read where first used,
    sizes) to right after x; -> the node the side call follows: the last of those, or the latest input
    that could not move."""
    at, stuck = x, []
    for a in sorted(ins, key=order.__getitem__):
        if order[a] <= order[x]:
            continue
        if all(order[i] < order[x] for i in a.all_input_nodes):
            at.append(a)
            at = a
        else:
            stuck.append(a)
    return max(stuck, key=order.__getitem__) if stuck else at


def _body(nodes: list[Node], out: Node) -> tuple[GraphModule, list[Node]]:
    """`nodes` as a GraphModule of their outside inputs (in first-use order), and those inputs."""
    g, env, ins = Graph(), {}, []
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in env and a not in nodes:
                env[a] = g.placeholder(a.name)
                env[a].meta = copy.copy(a.meta)
                ins.append(a)
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(env[out])
    return GraphModule(torch.nn.Module(), g), ins


def graph_copy(gm: GraphModule) -> GraphModule:
    """A GraphModule over a copy of `gm`'s graph (same calling convention), sharing `gm`'s submodules and
    tensors: the pass can rewrite it and leave `gm` as it was."""
    g = Graph()
    g._codegen = copy.deepcopy(gm.graph._codegen)
    g.output(g.graph_copy(gm.graph, {}))
    return GraphModule(gm, g)


def overlap_shared_experts(gm: GraphModule, ctx: PassContext) -> PassResult:
    """The pass (in place on `gm`'s graph; the moved nodes go into `side_{i}` submodules)."""
    stats: dict = {"layers": 0, "forked": 0, "skipped": {}}
    moes = [n for n in gm.graph.nodes if n.op == "call_function" and op_name(n.target) in MOE_NODES]
    for i, moe in enumerate(moes):
        stats["layers"] += 1
        order = {n: k for k, n in enumerate(gm.graph.nodes)}
        x = _branch_point(moe)
        found = _branch(x, moe, order)
        if isinstance(found, str):
            stats["skipped"][moe.name] = found
            continue
        nodes, out = found
        body, ins = _body(nodes, out)
        name = f"side_{i}"
        gm.add_submodule(name, SideStream(body))
        at = _hoist(ins, x, order)  # moves the weights (read where first used, after moe) up: both placements need it
        with gm.graph.inserting_after(at) if FORK_BEFORE_ROUTER else gm.graph.inserting_before(moe):
            call = gm.graph.call_module(name, tuple(ins))
        call.meta = {"val": out.meta.get("val")}
        readers = sorted((u for u in out.users if u not in nodes), key=order.__getitem__)
        with gm.graph.inserting_before(readers[0]):
            join = gm.graph.call_function(side_join, (call,))
        join.meta = {"val": out.meta.get("val")}
        out.replace_all_uses_with(join, delete_user_cb=lambda u: u not in nodes)
        for n in reversed(nodes):
            gm.graph.erase_node(n)
        stats["forked"] += 1
    if stats["forked"]:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, bool(stats["forked"]), stats)
