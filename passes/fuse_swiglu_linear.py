"""Fold each SwiGLU activation into the FP8 linear that reads it: one `dsv4c::fp8_linear_swiglu_w8a16` call.

After fuse_swiglu and quantize_dense, a shared expert's second half (V4's each layer and the MTP block's; V3's
dense MLPs and shared experts where their w2 is FP8) is two launches: the activation, then w2's linear on it.
At one token the activation is 2 I values, which every program of w2's GEMV can compute from g and u itself
as it loads them; the separate launch (~2-3 µs of a decode step's critical path per layer) goes.

Before (g, u [..., I] the halves of the fused w1 ‖ w3 output; L a literal; W = w_q, w_s graph attributes):
    h = dsv4c.swiglu_act(g, u, L)
    y = dsv4c.fp8_linear_w8a16(h, W.w_q, W.w_s)
After:
    y = dsv4c.fp8_linear_swiglu_w8a16(g, u, W.w_q, W.w_s, L)   # kernels/fp8_gemm.py

Why it is valid: the new op is defined as the two it replaces: on CUDA one token's row is one GEMV whose
activation loads run kernels/swiglu.py's own `swiglu_values` (the same rounding steps, so the same bits), and
every other case runs the two ops (tests/test_kernels_fp8_gemm.py, tests/test_fuse_swiglu_linear.py). A site
is rewritten only when h has no other user; the deterministic mode's batch-invariant linears (made before
this pass) are not `fp8_linear_w8a16` and are left alone.

Off unless the target's `swiglu_in_gemv` is set (none is: run65, H100, timed it equal). `stats["sites"]` is the
number of activations folded.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule

from dsv4c.passes import PassContext, PassResult, kernel_ops, unavailable


def fuse_swiglu_linear(gm: GraphModule, ctx: PassContext) -> PassResult:
    from dsv4c.targets import get_target

    if not get_target(ctx.target).swiglu_in_gemv:
        return PassResult(gm, False, {"sites": 0, "skipped": f"target {ctx.target}: swiglu_in_gemv is off"})
    ops = kernel_ops(ctx, "swiglu_act", "fp8_linear_w8a16", "fp8_linear_swiglu_w8a16")
    if ops is None:
        return PassResult(gm, False, {"sites": 0, "skipped": unavailable("fp8_linear_swiglu_w8a16")})
    act, linear, fused = ops
    sites = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not linear or not isinstance(node.args[0], torch.fx.Node):
            continue
        h = node.args[0]
        if h.target is not act or len(h.users) != 1 or node.kwargs or h.kwargs:
            continue
        g, u, limit = h.args
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(fused, (g, u, node.args[1], node.args[2], float(limit)))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        gm.graph.erase_node(h)
        sites += 1
    if sites:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, sites > 0, {"sites": sites})
