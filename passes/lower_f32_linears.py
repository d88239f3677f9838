"""Run the fp32 linears of low-precision operands without an fp32 copy of the weight.

The reference computes some projections in fp32 from bf16 weights: the V4 output head
(deepseek_v4.md: "Official computing this in fp32"), the MoE routers' gate, and the compressor and
indexer projections (after fuse_projections, one stacked bf16 weight per layer). Exported, such a
linear is

    before:  xf = to(x, fp32);  wf = to(w, fp32);  y = linear(xf, wf)     # x, w bf16; y fp32
    after:   y = dsv4c.linear_f32(x, w)

`wf` is a fresh fp32 copy of the weight at every step: for the Flash head, 129280 x 4096 values,
written and then read again, which is most of the head's cost in a decode step.

Why it is valid: x and w hold bf16 (or fp16) values, the product of two such values is exact in
fp32, and `linear_f32` accumulates in fp32 (dsv4c/model/static_ops.py). Only the order of the fp32
summation may differ from the reference's fp32 GEMM, which is within fp32 rounding of the sum.
The match requires both casts to go *up* to fp32 from the same low-precision dtype, no bias, and
the weight to be a graph attribute or input; anything else is left alone.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch.fx import GraphModule, Node

from dsv4c.passes import PassContext, PassResult, erase_unused

aten = torch.ops.aten
_LOW = (torch.bfloat16, torch.float16)


def _dtype(n) -> torch.dtype | None:
    v = n.meta.get("val") if isinstance(n, Node) else None
    return v.dtype if isinstance(v, torch.Tensor) else None


def _upcast_source(n) -> Node | None:
    """x when n = to(x, fp32) with x in bf16/fp16, else None."""
    if not (isinstance(n, Node) and n.op == "call_function" and n.target is aten.to.dtype):
        return None
    if n.args[1:2] != (torch.float32,) or n.kwargs:
        return None
    src = n.args[0]
    return src if _dtype(src) in _LOW else None


def _match(n: Node) -> tuple[Node, Node] | None:
    if n.op != "call_function" or n.target is not aten.linear.default:
        return None
    if len(n.args) > 2 and n.args[2] is not None:
        return None
    x, w = _upcast_source(n.args[0]), _upcast_source(n.args[1])
    if x is None or w is None or _dtype(x) != _dtype(w) or w.op not in ("get_attr", "placeholder"):
        return None
    return x, w


def lower_f32_linears(gm: GraphModule, ctx: PassContext) -> PassResult:
    from dsv4c.model import register_ops

    register_ops()
    op = torch.ops.dsv4c.linear_f32.default
    sites: Counter = Counter()
    casts = []
    for n in list(gm.graph.nodes):
        m = _match(n)
        if m is None:
            continue
        x, w = m
        with gm.graph.inserting_before(n):
            new = gm.graph.call_function(op, (x, w))
        new.meta = dict(n.meta)  # same value: fp32 [..., N]
        n.replace_all_uses_with(new)
        casts += [n.args[0], n.args[1]]
        gm.graph.erase_node(n)
        sites[str(w.target)] += 1
    if not sites:
        return PassResult(gm, False, {"sites": 0})
    erase_unused(gm, casts)
    gm.graph.lint()
    gm.recompile()
    return PassResult(gm, True, {"sites": sum(sites.values()), "weights": sorted(sites)})
