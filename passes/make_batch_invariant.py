"""Deterministic mode (`compile --deterministic`): give every row's reductions a fixed order.

Runs only when `ctx.deterministic`; otherwise it leaves the graph alone.

    before:  y = linear(x, w, b)             z = dsv4c.linear_f32(x, w)      y = matmul(h, t(w))
             o = dsv4c.grouped_linear(x, w)  e = dsv4c.moe_experts(x, idx, wt, W1, W3, W2, L)
             q = dsv4c.moe_experts_q(x, idx, wt, "mxfp4" | "nvfp4", w13, s13, g13, w2, s2, g2, None, None, L)
             q8 = dsv4c.moe_experts_q(x, idx, wt, "fp8_block", w13, s13, None, w2, s2, None, None, None, L)
             f = dsv4c.fp8_linear_w8a16(x, w_q, w_s)
             u, p, c = dsv4c.hc_pre(X, ...)  s = mean(x, [-1], keepdim)      s = sum(x, [-2])
             r = dsv4c.rms_norm(x, w, ...)   X' = dsv4c.hc_post(y, X, p, c)  c = dsv4c.sinkhorn(c0, ...)
    after:   y = dsv4c.linear_bi(x, w, b, False[, S, True])   z = dsv4c.linear_bi(x, w, None, True[, S, True])
             y = dsv4c.linear_bi(h, w, None, False[, S, True])
             o = dsv4c.grouped_linear_bi(x, w[, S, True])     e = dsv4c.moe_experts_bi(x, idx, wt, W1, W3, W2, L)
             q = dsv4c.moe_experts_fp4_bi(x, idx, wt, fmt, w13, s13, g13, w2, s2, g2, L)
             q8 = dsv4c.moe_experts_fp8_bi(x, idx, wt, w13, s13, w2, s2, L)
             f = dsv4c.fp8_linear_bi(x, w_q, w_s[, S, True])
             u, p, c = dsv4c.hc_pre_rows(X, ...)   s = dsv4c.sum_bi(x, -1, True, True) ...
             r = dsv4c.rms_norm_bi(x, w, ...)      X' = dsv4c.hc_post_bi(y, X, p, c)   c = dsv4c.sinkhorn_bi(c0, ...)

Why it is valid: each replacement computes the same function up to the order of its fp32 sums
(kernels/batch_invariant.py, mhc.py), and that order is now fixed by the shapes of one row, not by how
many rows share the call: fixed GEMM tiles and K walk, no split-K chosen from M (a decode-kind graph's
linears get the decode tile, weight rows on the MMA's rows and 16 token rows per tile, and a K split
S = `bi_split(N, K)` from the weight's shape alone, added in split order, so that a [1536, 4096] weight is
not 24 programs at one token; prefill keeps the 64 x 64 tile and S = 1; a token's row is always computed
by graphs of one kind, so each kind needs only its own fixed tile), one expert path for any
token count (bf16 experts: a gathered GEMV; FP4 weight-only experts, as quantize_experts left them: the
FP4 CUDA-core GEMV with one tile; FP8 block experts: the grouped tensor-core kernel with one tile, its
activations quantised per row), row-at-a-time hc mix, reductions as fixed-order sums, and the fusion
kernels' fast variant at any row count (kernels/norm.py and mhc.py pick a variant by the launch's rows).

It runs after quantize_experts and quantize_dense, so it sees the expert and dense ops the target chose.
What stays: after the rewrite the pass lists the nodes it cannot vouch for (`blockers`): GEMM or
reduction ATen ops it did not match, FP8 / W4A4 expert ops and W8A8 FP8 dense linears (their kernels pick
a path by token count; W8A16 ones become `fp8_linear_bi`, the same tiles on the stored FP8 bytes), and the
default `hc_pre`. On a CUDA target `compile --deterministic` refuses an
artifact with any blocker, naming them (dsv4c/compile.py). On the CPU target the ops run their torch
references, whose batch invariance is not proven; the manifest says so.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch.fx import GraphModule, Node

from dsv4c.passes import PassContext, PassResult, erase_unused
from dsv4c.passes.split_at_routers import op_name

aten = torch.ops.aten
_FLOAT = (torch.float32, torch.bfloat16, torch.float16)
# ATen ops whose CUDA kernels may reduce in an order that depends on the number of rows
_UNSAFE_ATEN = {"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.matmul", "aten.linear", "aten.einsum",
                "aten.sum", "aten.mean", "aten.var", "aten.var_mean", "aten.norm", "aten.linalg_vector_norm",
                "aten._softmax", "aten.softmax", "aten.log_softmax", "aten.logsumexp", "aten.cumsum",
                "aten.index_add", "aten.index_add_", "aten.scatter_add", "aten.scatter_add_"}
# dsv4c ops whose default kernels choose a reduction path from the token count
_UNSAFE_DSV4C = {"dsv4c.moe_experts": "per-expert cuBLAS GEMMs sized by the token count, index_add_ combine",
                 "dsv4c.moe_experts_gathered": "batched GEMMs sized by the token count",
                 "dsv4c.moe_experts_q": "kernels/moe_grouped.py / moe_fp8_prefill.py pick a path and tile by token "
                                        "count (FP4 weight-only and FP8 block experts have a fixed path: "
                                        "moe_experts_fp4_bi, moe_experts_fp8_bi)",
                 "dsv4c.fp8_linear_w8a8": "kernels/fp8_gemm.py runs the decode kernels up to 64 rows, the GEMM "
                                          "above",
                 "dsv4c.hc_pre": "kernels/mhc.py switches to the tiled mix kernel above HC_ROWS_MAX rows",
                 "dsv4c.hc_post": "kernels/mhc.py picks its variant by the token count (EXACT_ROWS_MIN)",
                 "dsv4c.hc_post_pre": "kernels/mhc.py chains the pair up to HC_CHAIN_MAX rows only (fuse_hc_chain "
                                      "leaves deterministic graphs alone)",
                 "dsv4c.rms_norm": "kernels/norm.py picks its variant by the row count (EXACT_ROWS_MIN)",
                 "dsv4c.sinkhorn": "kernels/mhc.py picks its variant and tile by the matrix count",
                 "dsv4c.grouped_linear": "kernels/grouped_linear.py runs the einsum above MAX_M rows",
                 "dsv4c.fp8_grouped_linear": "kernels/grouped_linear.py widens the weight for the einsum above "
                                             "FP8_MAX_M rows (quantize_dense keeps wo_a bf16 in deterministic graphs)",
                 "dsv4c.linear_f32": "cuBLAS"}


# the fusion ops (variant chosen by row count) -> the same kernels' fast variant at any row count
_FIXED_VARIANT = {"dsv4c.rms_norm": "rms_norm_bi", "dsv4c.hc_post": "hc_post_bi", "dsv4c.sinkhorn": "sinkhorn_bi"}


def _val(n) -> torch.Tensor | None:
    v = n.meta.get("val") if isinstance(n, Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _transposed_weight(n) -> Node | None:
    """w when n = t(w) (or permute(w, [1, 0])) of a 2-D value, else None."""
    if not (isinstance(n, Node) and n.op == "call_function"):
        return None
    if n.target is aten.t.default or (n.target is aten.permute.default and list(n.args[1]) == [1, 0]):
        w = n.args[0]
        return w if _val(w) is not None and _val(w).dim() == 2 else None
    return None


def _fp4_weight_only() -> tuple[str, ...]:
    from dsv4c.kernels.batch_invariant import FP4_WEIGHT_ONLY  # the kernels need triton: imported when used

    return FP4_WEIGHT_ONLY


def _tile_args(w: Node, decode: bool) -> tuple:
    """The trailing (split, decode) arguments of a linear_bi / grouped_linear_bi on weight w ([N, K] or
    [G, N, K]): in a decode-kind graph `bi_split(N, K)` and the decode tile, else none (the ops' defaults:
    no split, the 64 x 64 tile)."""
    from dsv4c.kernels.batch_invariant import bi_split

    v = _val(w)
    if not decode or v is None or v.dim() < 2:
        return ()
    return bi_split(v.shape[-2], v.shape[-1]), True


def _replacement(n: Node, decode: bool):
    """(op, args) computing n's value batch-invariantly, or None when n is not a pattern of the pass.
    `decode`: the graph is of a decode kind (its linears get the decode tile and a K split from their
    weight's shape)."""
    ops = torch.ops.dsv4c
    t = n.target
    if t is aten.linear.default:
        x, w = n.args[0], n.args[1]
        b = n.args[2] if len(n.args) > 2 else None
        vx, vw = _val(x), _val(w)
        if vx is not None and vw is not None and vx.dtype == vw.dtype and vx.dtype in _FLOAT and vw.dim() == 2:
            return ops.linear_bi.default, (x, w, b, False, *_tile_args(w, decode))
    elif t is aten.matmul.default:
        x, w = n.args[0], _transposed_weight(n.args[1])
        vx = _val(x)
        if w is not None and vx is not None and vx.dtype == _val(w).dtype and vx.dtype in _FLOAT:
            return ops.linear_bi.default, (x, w, None, False, *_tile_args(w, decode))
    elif t is ops.linear_f32.default:
        return ops.linear_bi.default, (n.args[0], n.args[1], None, True, *_tile_args(n.args[1], decode))
    elif op_name(t) == "dsv4c.fp8_linear_w8a16":
        return ops.fp8_linear_bi.default, (*n.args, *_tile_args(n.args[1], decode))
    elif t is ops.grouped_linear.default:
        return ops.grouped_linear_bi.default, (*n.args, *_tile_args(n.args[1], decode))
    elif t in (ops.moe_experts.default, ops.moe_experts_gathered.default):
        return ops.moe_experts_bi.default, tuple(n.args)
    elif op_name(t) == "dsv4c.moe_experts_q" and len(n.args) == 13 and n.args[3] in _fp4_weight_only():
        x, idx, wt, fmt, w13, s13, g13, w2, s2, g2, in13, in2, limit = n.args
        if in13 is None and in2 is None:  # weight-only: no activation scales
            return ops.moe_experts_fp4_bi.default, (x, idx, wt, fmt, w13, s13, g13, w2, s2, g2, limit)
    elif op_name(t) == "dsv4c.moe_experts_q" and len(n.args) == 13 and n.args[3] == "fp8_block":
        x, idx, wt, fmt, w13, s13, g13, w2, s2, g2, in13, in2, limit = n.args
        if g13 is None and g2 is None and in13 is None and in2 is None:
            return ops.moe_experts_fp8_bi.default, (x, idx, wt, w13, s13, w2, s2, limit)
    elif t is ops.hc_pre.default:
        return ops.hc_pre_rows.default, tuple(n.args)
    elif isinstance(t, torch._ops.OpOverload) and op_name(t) in _FIXED_VARIANT:
        return getattr(ops, _FIXED_VARIANT[op_name(t)]).default, tuple(n.args)
    elif t in (aten.mean.dim, aten.sum.dim_IntList) and not n.kwargs:
        dims = n.args[1]
        if isinstance(dims, (list, tuple)) and len(dims) == 1:
            keep = bool(n.args[2]) if len(n.args) > 2 else False
            return ops.sum_bi.default, (n.args[0], int(dims[0]), keep, t is aten.mean.dim)
    return None


def batch_invariance_blockers(gm: GraphModule) -> list[str]:
    """The nodes whose kernels may sum a row in an order that depends on the rows sharing the call."""
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        name = op_name(n.target)
        if name in _UNSAFE_DSV4C:
            out.append(f"{n.name} ({name}: {_UNSAFE_DSV4C[name]})")
        elif ".".join(name.split(".")[:2]) in _UNSAFE_ATEN:
            out.append(f"{n.name} ({name}: not matched by make_batch_invariant)")
    return out


def make_batch_invariant(gm: GraphModule, ctx: PassContext) -> PassResult:
    if not ctx.deterministic:
        return PassResult(gm, False, {"skipped": "not deterministic mode"})
    from dsv4c.model import register_ops

    register_ops()
    swapped: Counter = Counter()
    dead = []
    for n in list(gm.graph.nodes):
        if n.op != "call_function":
            continue
        r = _replacement(n, ctx.graph_kind != "prefill")
        if r is None:
            continue
        op, args = r
        with gm.graph.inserting_before(n):
            new = gm.graph.call_function(op, args)
        new.meta = dict(n.meta)  # same value (shape, dtype)
        n.replace_all_uses_with(new)
        dead += [a for a in n.args if isinstance(a, Node)]
        swapped[f"{op_name(n.target)} -> {op_name(op)}"] += 1
        gm.graph.erase_node(n)
    erase_unused(gm, dead)
    gm.graph.lint()
    gm.recompile()
    return PassResult(gm, bool(swapped), {"swapped": dict(swapped), "blockers": batch_invariance_blockers(gm)})
