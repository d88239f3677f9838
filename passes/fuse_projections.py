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

The shared expert's SwiGLU is written `x @ w.t()` (dsv4c/model/common.py `swiglu`), which exports as
`matmul(x, t(W))`: the same bias-free linear, so its gate (w1) and up (w3) projections on the same x
form a group too and become one `linear(x, cat([W1, W3]))` + split (the activation then reads the two
halves, passes/fuse_swiglu.py). Matmul-form linears group only with each other: in an fp32 model the
router's logits GEMM (`linear(to(u, fp32), to(W, fp32))`) reads the same u, and it stays its own GEMM
as in bf16 models (every group that formed before is unchanged).

The fused weight is a new graph attribute `<common prefix>.fused_<members>`; the member weights
are dropped from the graph. An fp32 group of bf16 weights keeps the fused weight in bf16 and the
upcast in the graph (`linear(x, to(W, fp32))`), so that `lower_f32_linears` turns it into
`linear_f32`: the weight is stored and read once in bf16, not as an fp32 copy of twice the bytes. `stats["groups"]` lists each fused weight with its members, which the
artifact's weight map records.

Second rewrite, the per-head q norm with RoPE (one kernel instead of ~25 elementwise ops):
Before:
    xf = to(q, fp32); n = xf * rsqrt(mean(xf², -1) + eps); q2 = to(n, act)
    q3 = cat([q2[..., :d-r], interleave(rot_even(q2[..., d-r:], cos, sin), rot_odd(...))], -1)
After:
    q3 = dsv4c.head_rms_rope(q, cos, sin, eps)
Valid because `head_rms_rope` is defined as exactly that computation (its reference implementation
calls the same `rms` and `rope_interleaved` as the model); the matcher checks the structure and
leaves a site alone when anything differs.
"""
from __future__ import annotations

import operator
from collections import defaultdict

import torch
from torch.fx import GraphModule, Node

from dsv4c.passes import (PassContext, PassResult, delete_param, erase_unused, fake_linear, fake_value,
                          get_param, set_param)

aten = torch.ops.aten


def _source(n: Node) -> Node:
    """Look through every dtype cast (`aten.to.dtype`) to the value being cast."""
    while n.op == "call_function" and n.target is aten.to.dtype:
        n = n.args[0]
    return n


def _linear_weight(n: Node) -> str | None:
    """The parameter name of a bias-free linear's weight (through a cast such as the compressor's
    `w.float()`), or of `matmul(x, t(W))` with W a 2-D graph attribute (the SwiGLU's `x @ w.t()`);
    else None."""
    if n.op != "call_function":
        return None
    if n.target is aten.matmul.default:
        return _matmul_weight(n)
    if n.target is not aten.linear.default:
        return None
    if len(n.args) > 2 and n.args[2] is not None:
        return None
    w = _source(n.args[1])
    return w.target if w.op == "get_attr" else None


def _matmul_weight(n: Node) -> str | None:
    """W's name for `matmul(x, t(W))`, W a 2-D get_attr (no cast: x @ W^T is then linear(x, W))."""
    wt = n.args[1]
    if not isinstance(wt, Node) or wt.op != "call_function" or wt.target is not aten.t.default:
        return None
    w = wt.args[0]
    val = w.meta.get("val") if isinstance(w, Node) else None
    if not isinstance(w, Node) or w.op != "get_attr" or not isinstance(val, torch.Tensor) or val.dim() != 2:
        return None
    return w.target


def _groups(gm: GraphModule) -> list[list[Node]]:
    """Linears on the same value computed in the same dtype (casts of one value count as one input);
    matmul-form linears group among themselves (the module doc says why)."""
    by_input: dict[tuple, list[Node]] = defaultdict(list)
    for n in gm.graph.nodes:
        if _linear_weight(n) is not None:
            x = n.args[0]
            by_input[(_source(x), x.meta["val"].dtype, n.target)].append(n)
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
    ropes = _fuse_q_norm_rope(gm, ctx)
    stats = {"groups": groups_out, "linears_before": before, "linears_after": after, "q_norm_rope_fused": ropes}
    return PassResult(gm, bool(groups_out) or ropes > 0, stats)


def _stored_dtype(gm: GraphModule, names: list[str], dtype: torch.dtype) -> torch.dtype:
    """The dtype the fused weight is kept in: the members' own dtype when they all share one and the
    linears upcast it to `dtype` (the fp32 island of a bf16 model); else `dtype`."""
    own = {get_param(gm, w).dtype for w in names}
    return own.pop() if len(own) == 1 and dtype == torch.float32 else dtype


def _fuse(gm: GraphModule, group: list[Node]) -> dict:
    x = group[0].args[0]
    dtype = x.meta["val"].dtype
    names = [_linear_weight(n) for n in group]
    stored = _stored_dtype(gm, names, dtype)
    weights = [get_param(gm, w).detach().to(stored) for w in names]
    fused = torch.cat(weights, 0)
    fname = _fused_name(names)
    set_param(gm, fname, fused)
    sizes = [w.shape[0] for w in weights]
    with gm.graph.inserting_before(group[0]):
        w_node = gm.graph.get_attr(fname)
        w_node.meta["val"] = fake_value(x, lambda t: t, fused)
        w_node.meta["fused_members"] = (tuple(names), tuple(sizes))  # passes/quantize_dense.py reads it
        if stored != dtype:  # keep the upcast in the graph: lower_f32_linears then reads the weight once in bf16
            w_node = gm.graph.call_function(aten.to.dtype, (w_node, dtype))
            w_node.meta["val"] = fake_value(x, lambda t: t.to(dtype), fused)
        y = gm.graph.call_function(torch.ops.aten.linear.default, (x, w_node))
        y.meta["val"] = fake_value(x, fake_linear, x.meta["val"], w_node.meta["val"])
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
    return {"fused": fname, "members": names, "out_features": sizes, "dtype": str(dtype).replace("torch.", ""),
            "stored": str(stored).replace("torch.", "")}


# ---- per-head q norm + RoPE ------------------------------------------------------------------------
def _only_user(n: Node) -> Node | None:
    users = [u for u in n.users if u.target is not aten._assert_tensor_metadata.default]
    return users[0] if len(users) == 1 else None


def _match_q_norm_rope(rsqrt: Node, ctx: PassContext):
    """From an rsqrt of a 4-d input, check the rms -> cast -> rope chain; return (q, cos, sin, out)."""
    add = rsqrt.args[0]
    if add.target is not aten.add.Tensor or add.args[1] != ctx.config.rms_norm_eps:
        return None
    mean = add.args[0]
    if mean.target is not aten.mean.dim or mean.args[0].target is not aten.pow.Tensor_Scalar:
        return None
    xf = mean.args[0].args[0]
    mul = _only_user(rsqrt)
    if mul is None or mul.target is not aten.mul.Tensor or xf.meta["val"].dim() != 4:
        return None
    q = xf.args[0] if xf.target is aten.to.dtype else xf
    cast = _only_user(mul)
    if cast is None or cast.target is not aten.to.dtype:
        return None
    d, r = ctx.config.head_dim, ctx.config.qk_rope_head_dim
    slices = {u.args[2]: u for u in cast.users if u.target is aten.slice.Tensor and u.args[1] == 3}
    if set(slices) != {0, d - r} or len(cast.users) - _n_checks(cast) != 2:
        return None
    out = _only_user(slices[0])
    if out is None or out.target is not aten.cat.default:
        return None
    cos_sin = _rope_tables(slices[d - r])
    if cos_sin is None:
        return None
    return q, cos_sin[0], cos_sin[1], out


def _n_checks(n: Node) -> int:
    return sum(u.target is aten._assert_tensor_metadata.default for u in n.users)


def _rope_tables(rot: Node):
    """cos and sin [B, T, r/2] of the interleaved rotation applied to `rot` (via unsqueeze(., 2))."""
    tables = []
    for n in rot.graph.nodes:
        if n.target is aten.mul.Tensor and _feeds_from(n, rot) and n.args[1].target is aten.unsqueeze.default:
            tables.append(n.args[1].args[0])
    uniq = list(dict.fromkeys(tables))
    if len(uniq) != 2:
        return None
    sub = next((n for n in rot.graph.nodes if n.target is aten.sub.Tensor and _feeds_from(n, rot)), None)
    if sub is None:
        return None
    cos = sub.args[0].args[1].args[0]  # x_even·cos − x_odd·sin
    sin = uniq[1] if uniq[0] is cos else uniq[0]
    return cos, sin


def _feeds_from(n: Node, src: Node, depth: int = 4) -> bool:
    frontier = [n]
    for _ in range(depth):
        nxt = []
        for x in frontier:
            for a in x.all_input_nodes:
                if a is src:
                    return True
                nxt.append(a)
        frontier = nxt
    return False


def _fuse_q_norm_rope(gm: GraphModule, ctx: PassContext) -> int:
    from dsv4c.model import v4_ops  # noqa: F401  (registers the op)

    op = torch.ops.dsv4c.head_rms_rope.default
    count = 0
    for rsqrt in [n for n in gm.graph.nodes if n.target is aten.rsqrt.default]:
        m = _match_q_norm_rope(rsqrt, ctx)
        if m is None:
            continue
        q, cos, sin, out = m
        with gm.graph.inserting_before(out):
            fused = gm.graph.call_function(op, (q, cos, sin, ctx.config.rms_norm_eps))
        fused.meta["val"] = fake_value(q, op, q.meta["val"], cos.meta["val"], sin.meta["val"], ctx.config.rms_norm_eps)
        out.replace_all_uses_with(fused)
        erase_unused(gm, [out])
        count += 1
    return count
