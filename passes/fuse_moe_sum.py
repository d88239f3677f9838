"""Fold the MoE's sum of routed and shared experts into the mHC post-mix that reads it (DeepSeek-V4).

A V4 MoE ends in `y = routed + shared` (dsv4c/model/v4.py `MoE.forward`), reshaped to the streams' lead
dims, and the FFN site's post-mix is the only reader of y. At decode the sum is one ATen launch of a few
kilobytes, and, being no Triton kernel, it ends the step's programmatic-dependent-launch chain: the
post-mix behind it cannot start its weight reads early. The post-mix ops take the two addends instead
and add them in their kernel (kernels/mhc.py `_load_y`).

Before (a, b [M, D] of one dtype; the view optional; P one of hc_post, hc_post_pre, hc_post_bi):
    s = aten.add.Tensor(a, b);  y = aten.view/reshape(s, lead + [D]);  X' = dsv4c.P(y, X, post, comb, ...)
After:
    ya = aten.reshape(a, lead + [D]);  yb = aten.reshape(b, lead + [D]);  X' = dsv4c.P(ya, X, post, comb, ..., yb)

Why it is valid: the op with y2 is defined as the op on `y + y2` (its CPU form calls the model's
function on that eager sum: bit-exact); the kernels add the two in fp32 and round once to y's dtype,
which is what ATen's add of two tensors of one floating dtype stores, so the post-mix reads the same y.
The add has no alpha, no broadcasting (a and b have one shape and dtype), and no other reader (s and y
are used once), so nothing else saw s. Reshaping each addend to y's shape is what the view did to the sum.

`stats`: `folded`, the sums folded.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from dsv4c.passes import PassContext, PassResult, kernel_ops, tensor_value, unavailable

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten.reshape.default)
_FLOAT = (torch.float32, torch.bfloat16, torch.float16)
_Y2_AT = {"hc_post": 4, "hc_post_bi": 4, "hc_post_pre": 10}  # y2's position: after the op's other arguments
_CHECK = aten._assert_tensor_metadata.default  # export's dtype/device checks: read no values


def _read_once(n: Node) -> bool:
    """n has one user besides export's metadata checks."""
    return sum(u.target is not _CHECK for u in n.users) == 1


def _sum_of(y: Node) -> tuple[Node, Node | None] | None:
    """(the add, the view between it and the post-mix or None) when y is such a sum read once."""
    view = None
    if y.op == "call_function" and y.target in _VIEWS and _read_once(y):
        view, y = y, y.args[0]
    if not (isinstance(y, Node) and y.op == "call_function" and y.target is aten.add.Tensor
            and len(y.args) == 2 and not y.kwargs and _read_once(y)):
        return None
    a, b = (tensor_value(x) for x in y.args)
    if a is None or b is None or a.dtype not in _FLOAT or a.dtype != b.dtype or a.shape != b.shape:
        return None
    return y, view


def _fold(gm: GraphModule, post: Node, add: Node, view: Node | None, at: int) -> None:
    g = gm.graph
    y = post.args[0]
    addends = list(add.args)
    if view is not None:
        with g.inserting_before(view):  # where the view was: before its metadata checks
            addends = [g.call_function(aten.reshape.default, (x, list(view.args[1]))) for x in add.args]
        for r in addends:
            r.meta["val"] = y.meta["val"]
    post.args = (addends[0], *post.args[1:at], addends[1])
    for n, like in ((view, addends[0]), (add, add.args[0])):  # their metadata checks move to a value alike
        if n is not None:
            n.replace_all_uses_with(like)
            g.erase_node(n)


def fuse_moe_sum(gm: GraphModule, ctx: PassContext) -> PassResult:
    if not ctx.config.is_v4:
        return PassResult(gm, False, {"folded": 0, "skipped": "no mHC (not a V4 model)"})
    names = tuple(_Y2_AT)
    ops = kernel_ops(ctx, *names)
    if ops is None:
        return PassResult(gm, False, {"folded": 0, "skipped": unavailable(*names)})
    at = dict(zip(ops, _Y2_AT.values()))
    folded = 0
    for post in list(gm.graph.nodes):
        if post.op != "call_function" or post.target not in at or len(post.args) != at[post.target] or post.kwargs:
            continue  # not a post-mix, or one with its y2 already (or arguments by name)
        found = _sum_of(post.args[0]) if isinstance(post.args[0], Node) else None
        if found is not None:
            _fold(gm, post, *found, at[post.target])
            folded += 1
    if folded:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, folded > 0, {"folded": folded})
