"""Fuse the projections that read the same input into one GEMM (DeepSeek-V4).

V4's checkpoint is already latent (K = V, one 512-d row per token), so V3-style absorption does
not apply; what V4 offers instead is several small GEMMs on the same activation. In each
attention layer, the normed block input x feeds `wq_a`, `wkv`, the compressor's `wkv` and `wgate`,
the indexer compressor's `wkv` and `wgate`, and the indexer's `weights_proj`.

Before (per group of linears on the same x, same input dtype):
    a = linear(x, W_a);  b = linear(x, W_b);  c = linear(x, W_c)
After:
    y = linear(x, cat([W_a, W_b, W_c]));  a, b, c = split_with_sizes(y, [n_a, n_b, n_c], -1)

Why it is valid: a linear map's output rows are independent, so stacking the weights along the
output dim and splitting the result gives the same values (in fp32 the same accumulation order per
output element, so bit-for-bit on the CPU reference). The compressor's projections run in fp32
(an fp32 island), so in a bf16 model they form their own fp32 group beside the bf16 wq_a ‖ wkv.

The fused weight is a new graph attribute `<common prefix>.fused_<members>`; the member weights
are dropped from the graph. `stats["groups"]` lists each fused weight with its members, which the
artifact's weight map records.
"""
from __future__ import annotations

import operator
from collections import defaultdict

import torch
from torch.fx import GraphModule, Node

from dsv4c.passes import (PassContext, PassResult, delete_param, erase_unused, fake_value, get_param,
                          resolve, set_param)


def _linear_weight(n: Node) -> str | None:
    """The parameter name of a bias-free linear's weight, or None."""
    if n.op != "call_function" or n.target is not torch.ops.aten.linear.default:
        return None
    if len(n.args) > 2 and n.args[2] is not None:
        return None
    w = resolve(n.args[1])
    return w.target if w.op == "get_attr" else None


def _groups(gm: GraphModule) -> list[list[Node]]:
    by_input: dict[tuple, list[Node]] = defaultdict(list)
    for n in gm.graph.nodes:
        if _linear_weight(n) is not None:
            x = n.args[0]
            by_input[(resolve(x), x.meta["val"].dtype)].append(n)
    return [g for g in by_input.values() if len(g) > 1]


def _fused_name(weights: list[str]) -> str:
    parts = [w.split(".") for w in weights]
    common = []
    for seg in zip(*parts):
        if len(set(seg)) > 1:
            break
        common.append(seg[0])
    rel = ["_".join(p[len(common):-1]) for p in parts]  # drop the common prefix and ".weight"
    return ".".join(common + ["fused_" + "__".join(rel), "weight"])


def fuse_projections(gm: GraphModule, ctx: PassContext) -> PassResult:
    if not ctx.config.is_v4:
        return PassResult(gm, False, {"skipped": "V3/V3.2 use absorb_mla"})
    groups_out = []
    before = sum(_linear_weight(n) is not None for n in gm.graph.nodes)
    for group in _groups(gm):
        groups_out.append(_fuse(gm, group))
    after = sum(_linear_weight(n) is not None for n in gm.graph.nodes)
    return PassResult(gm, bool(groups_out), {"groups": groups_out, "linears_before": before, "linears_after": after})


def _fuse(gm: GraphModule, group: list[Node]) -> dict:
    x = group[0].args[0]
    dtype = x.meta["val"].dtype
    names = [_linear_weight(n) for n in group]
    weights = [get_param(gm, w).detach().to(dtype) for w in names]
    fused = torch.cat(weights, 0)
    fname = _fused_name(names)
    set_param(gm, fname, fused)
    sizes = [w.shape[0] for w in weights]
    with gm.graph.inserting_before(group[0]):
        w_node = gm.graph.get_attr(fname)
        w_node.meta["val"] = fake_value(x, lambda t: t, fused)
        y = gm.graph.call_function(torch.ops.aten.linear.default, (x, w_node))
        y.meta["val"] = fake_value(x, torch.ops.aten.linear.default, x.meta["val"], w_node.meta["val"])
        parts = gm.graph.call_function(torch.ops.aten.split_with_sizes.default, (y, sizes, -1))
        parts.meta["val"] = fake_value(x, torch.ops.aten.split_with_sizes.default, y.meta["val"], sizes, -1)
    for i, n in enumerate(group):
        with gm.graph.inserting_after(parts):
            item = gm.graph.call_function(operator.getitem, (parts, i))
        item.meta["val"] = parts.meta["val"][i]
        n.replace_all_uses_with(item)
    erase_unused(gm, group)
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for w in names:
        if w not in used:
            delete_param(gm, w)
    return {"fused": fname, "members": names, "out_features": sizes, "dtype": str(dtype).replace("torch.", "")}
