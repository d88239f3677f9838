"""Ask the next linears' weights into L2 while a run of small kernels leaves HBM idle (decode graphs, CUDA
targets with `Target.l2_prefetch_bytes`; none has it today: measured a loss, below).

At batch 1 a decode step alternates between linears that stream their weights from HBM and runs of small
kernels that read almost nothing from it (mHC, norms, RoPE, the attention on short caches, routing). This
pass puts one `dsv4c::l2_prefetch` (kernels/l2_prefetch.py) at the start of each such run, naming the weights
of the linears that follow it, up to the target's byte budget; those linears then read the bytes from L2.

Before (S: a weight-streaming linear, s: a small kernel, E: the routed experts):
    S(wq_b) s(head_rms_rope) s(rms_norm) s(rope) s(v4_attention) s(rope) S(wo_a) S(wo_b) s(hc_post_pre) ...
After:
    S(wq_b) s(head_rms_rope) P([wo_a.w_q, wo_b.w_q], [n_a, n_b]) s(rms_norm) ... S(wo_a) S(wo_b) ...

Placement: P goes after the first kernel of a run of at least MIN_RUN small kernels. With the step's
programmatic dependent launch each kernel starts while its predecessor drains, so P starts as that first
small kernel starts, when the linear before the run has finished: P's traffic does not compete with it.
P names the weights of the linears up to the next such run, in graph order, until the budget is spent (a
linear that follows a shorter run, like wq_b after the q norm or wo_b after wo_a, is served by the P before
it). The routed experts are a barrier: which experts they read is known only on the device, and at decode
they stream more bytes than L2 holds, so nothing is asked across them. A P asking for fewer than
MIN_CALL_BYTES is not placed (one launch for little).

Why it is valid: l2_prefetch computes nothing and writes nothing (a cache hint; its CPU form does nothing):
the graph's outputs and cache writes are those of the graph without it; only when bytes move from HBM to L2
changes. The op is side-effecting for dead-code elimination, so export and loading keep it.

Measured (run64, H200, the 2-layer slice on the GPU alone, interleaved): with 32 MiB per P the batch-1 step took
0.648 / 0.643 ms against 0.632 / 0.628 ms without (batch 8: 1.183 vs 1.165 ms). The dense linears' critical path
fell by 7-8 µs, the six launches and the small kernels beside the prefetch traffic cost 17-18 µs; evict_first
weight loads in the GEMV did no better (0.644 ms). Alone, Flash's wo_b on the one-token
GEMV took 20.4 µs from a cold L2, 18.8 after a prefetch and 17.2 from a warm L2: at this size the GEMV is held
by its own bytes in flight more than by HBM (kernels/fp8_gemv.py: more programs per SM, adopted instead). So
`Target.l2_prefetch_bytes` is 0 for every target; the pass is kept, tested, for a placement that pays.

`stats`: `calls` (P nodes placed), `bytes` (asked in all), `windows` (per P: the weights and MB).
"""
from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from dsv4c.passes import PassContext, PassResult, get_param, kernel_ops, unavailable
from dsv4c.passes.split_at_routers import MOE_OPS, op_name

MIN_RUN = 2  # small kernels a run needs before a P is placed at its start
MIN_TENSOR_BYTES = 1 << 20  # weights smaller than this are not asked for (scales, norms)
MIN_CALL_BYTES = 8 << 20  # a P asking for less is not placed
MAX_WEIGHTS = 4  # weights per P (kernels/l2_prefetch.MAX_RANGES)

# ops that read their whole weight whatever the input (dense linears and their lowered forms)
STREAMING = frozenset({"aten.linear", "aten.mm", "aten.addmm", "aten.matmul", "dsv4c.fp8_linear_w8a16",
                       "dsv4c.fp8_linear_w8a8", "dsv4c.fp8_grouped_linear", "dsv4c.grouped_linear",
                       "dsv4c.linear_f32", "dsv4c.linear_f32_fused", "dsv4c.linear_bi", "dsv4c.fp8_linear_bi",
                       "dsv4c.grouped_linear_bi"})
BARRIERS = MOE_OPS | {"dsv4c.moe_experts_fp8_bi"}
# ops that launch no kernel (views, metadata, shape arithmetic): they do not count in a run
NO_KERNEL = frozenset({"aten.view", "aten.reshape", "aten._unsafe_view", "aten.unflatten", "aten.flatten",
                       "aten.split_with_sizes", "aten.split", "aten.expand", "aten.unsqueeze", "aten.squeeze",
                       "aten.select", "aten.slice", "aten.permute", "aten.t", "aten.transpose", "aten.sym_size",
                       "aten._assert_tensor_metadata", "aten.detach", "aten.alias", "aten.sym_numel"})


def _op(n: Node) -> str:
    """'ns.name' of a call_function node's op ('' for Python operators: shape arithmetic, no kernel)."""
    return op_name(n.target) if isinstance(n.target, torch._ops.OpOverload) else ""


def _weights(gm: GraphModule, n: Node) -> list[tuple[Node, int]]:
    """(get_attr node, bytes) of the weights n reads whole, MIN_TENSOR_BYTES and up, in argument order."""
    out = []
    for a in n.all_input_nodes:
        if a.op == "get_attr":
            t = get_param(gm, a.target)
            size = t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
            if size >= MIN_TENSOR_BYTES:
                out.append((a, size))
    return out


class _Window:
    """One P being planned: where it goes and what it asks for."""

    def __init__(self, anchor: Node, budget: int):
        self.anchor, self.left, self.asks = anchor, budget, []

    def add(self, weights: list[tuple[Node, int]]) -> None:
        for w, size in weights:
            take = min(size, self.left)
            if take < MIN_TENSOR_BYTES or len(self.asks) == MAX_WEIGHTS or any(w is a for a, _ in self.asks):
                continue
            self.asks.append((w, take))
            self.left -= take


def _plan(gm: GraphModule, budget: int) -> list[_Window]:
    """The windows of the graph, in order (see the module docstring)."""
    windows, run, current = [], [], None
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is operator.getitem:
            continue
        op = _op(n)
        if op in BARRIERS:
            current, run = None, []
            continue
        streamed = _weights(gm, n) if op in STREAMING else []
        if streamed:
            if len(run) >= MIN_RUN:
                current = _Window(run[0], budget)
                windows.append(current)
            if current is not None:
                current.add(streamed)
            run = []
        elif op and op not in NO_KERNEL:
            run.append(n)
    return [w for w in windows if sum(b for _, b in w.asks) >= MIN_CALL_BYTES]


def prefetch_weights(gm: GraphModule, ctx: PassContext) -> PassResult:
    from dsv4c.targets import get_target

    budget = get_target(ctx.target).l2_prefetch_bytes
    if budget <= 0:
        return PassResult(gm, False, {"calls": 0, "skipped": f"target {ctx.target}: l2_prefetch_bytes is 0"})
    if ctx.graph_kind == "prefill":
        return PassResult(gm, False, {"calls": 0, "skipped": "prefill graph (weights are read at compute speed)"})
    ops = kernel_ops(ctx, "l2_prefetch")
    if ops is None:
        return PassResult(gm, False, {"calls": 0, "skipped": unavailable("l2_prefetch")})
    windows = _plan(gm, budget)
    for w in windows:
        with gm.graph.inserting_after(w.anchor):
            p = gm.graph.call_function(ops[0], ([a for a, _ in w.asks], [b for _, b in w.asks]))
        for a, _ in w.asks:  # export puts a get_attr by its first reader; it reads nothing, so it may move up
            p.prepend(a)
    stats = {"calls": len(windows), "bytes": sum(b for w in windows for _, b in w.asks),
             "windows": [{"after": w.anchor.name, "weights": [a.target for a, _ in w.asks],
                          "MB": round(sum(b for _, b in w.asks) / 1e6, 1)} for w in windows]}
    return PassResult(gm, bool(windows), stats)
