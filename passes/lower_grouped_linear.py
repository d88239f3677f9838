"""Lower V4's grouped output projection to one kernel call (DeepSeek-V4 attention, `wo_a`).

`Attention._output` projects the attention output per group: o [B, T, H, d] (fp32, after the inverse
RoPE) is cast to the model dtype, viewed as [B, T, G, H·d/G], and multiplied by W_oa [G, R, H·d/G].

Before (exported):
    oc = to(o, bf16);  a = reshape(oc, [B, T, G, I]);  w = unflatten(W_oa, 0, [G, R])
    z = einsum("btgi,gri->btgr", a, w)
After:
    z = dsv4c.grouped_linear(reshape(o, [B, T, G, I]), w)      # kernels/grouped_linear.py

Why it is valid: `grouped_linear(x, w)` is defined as `einsum("btgi,gri->btgr", x.to(w.dtype), w)`
(its CPU implementation is exactly that), so moving the cast into the op computes the same values:
the reshape of o and of its cast select the same elements. On CUDA, up to 16 token rows, one Triton
launch replaces the cast, the einsum's two permuting copies and its batched GEMM (fp32 accumulation
of the same bf16 products, one rounding: only the summation order differs); above that the op runs
the einsum. The cast is folded only when the reshape is its one user and it casts to w's dtype;
otherwise the op gets the einsum's own operand.

`stats["sites"]` counts the rewritten einsums, `stats["casts_folded"]` the casts moved into the op.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from dsv4c.passes import PassContext, PassResult, erase_unused, fake_value, kernel_ops, unavailable

aten = torch.ops.aten
EQUATION = "btgi,gri->btgr"
_RESHAPES = (aten.reshape.default, aten.view.default)


def _users(n: Node) -> list[Node]:
    return [u for u in n.users if u.target is not aten._assert_tensor_metadata.default]


def _uncast(a: Node, w_dtype: torch.dtype) -> Node | None:
    """The fp source of `a = reshape(to(src, w_dtype))` when the cast feeds only that reshape, else None."""
    if a.op != "call_function" or a.target not in _RESHAPES:
        return None
    cast = a.args[0]
    if not (isinstance(cast, Node) and cast.target is aten.to.dtype and cast.args[1:2] == (w_dtype,)
            and not cast.kwargs and _users(cast) == [a]):
        return None
    src = cast.args[0]
    v = src.meta.get("val") if isinstance(src, Node) else None
    return src if isinstance(v, torch.Tensor) and v.is_floating_point() else None


def lower_grouped_linear(gm: GraphModule, ctx: PassContext) -> PassResult:
    if not ctx.config.is_v4:
        return PassResult(gm, False, {"sites": 0, "skipped": "V4 only (the grouped wo_a)"})
    ops = kernel_ops(ctx, "grouped_linear")
    if ops is None:
        return PassResult(gm, False, {"sites": 0, "skipped": unavailable("grouped_linear")})
    op, = ops
    sites = folded = 0
    g = gm.graph
    for n in list(g.nodes):
        if n.op != "call_function" or n.target is not aten.einsum.default or n.args[0] != EQUATION:
            continue
        a, w = n.args[1]
        wv = w.meta.get("val")
        src = _uncast(a, wv.dtype)
        x = a
        if src is not None:
            with g.inserting_before(n):
                x = g.call_function(a.target, (src, a.args[1]))
            x.meta["val"] = fake_value(src, lambda t: t.reshape(a.meta["val"].shape), src.meta["val"])
            folded += 1
        with g.inserting_before(n):
            z = g.call_function(op, (x, w))
        z.meta = dict(n.meta)
        n.replace_all_uses_with(z)
        g.erase_node(n)
        erase_unused(gm, [a])
        sites += 1
    if sites:
        g.lint()
        gm.recompile()
    return PassResult(gm, sites > 0, {"sites": sites, "casts_folded": folded})
