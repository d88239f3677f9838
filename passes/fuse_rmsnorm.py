"""Fuse each RMSNorm into one `dsv4c::rms_norm` call (V4 and V3).

Every norm of both models is `dsv4c.model.common.RMSNorm`: V4's attn_norm, ffn_norm, q_norm, kv_norm,
the final norm and the MTP block's enorm, hnorm and norm (V4 order: multiply in fp32, cast once);
V3's layernorms, the MLA q_a/kv_a norms and the MTP block's (V3 order, `cast_first`: cast rms(x)
to the input dtype, then multiply). Exported, one norm is ~6 ATen ops (pow, mean, add, rsqrt and
two muls, plus dtype casts), each a launch in a CUDA graph. (The compressors' norms live inside
the compressor ops, V4's per-head q norm in `dsv4c.head_rms_rope`.)

Before (x [..., C], w [C]; eps a literal):
    xf = to(x, fp32);  r = xf * rsqrt(mean(xf², -1) + eps)
    V4:  out = to(to(w, fp32) * r, x.dtype)          V3:  out = w * to(r, x.dtype)
After:
    out = dsv4c.rms_norm(x, w, eps, cast_first)       # kernels/norm.py: one Triton launch

Why it is valid: the pattern is not written by hand. It is the model's own `RMSNorm.forward`
exported with torch.export for this config's eps, each order and each activation dtype the graph
holds, so it is exactly the op sequence the model's graphs contain; `torch.fx`'s SubgraphMatcher
finds it, and a site is only kept when no intermediate value is used outside it (passes/pattern.py).
`dsv4c::rms_norm` is defined as that same function: on the CPU it calls `RMSNorm.forward`
(bit-exact), on CUDA one Triton kernel computes the same formula in fp32 (tests/test_fuse_rmsnorm.py
bounds the difference). A norm whose eps differs from the config's, or whose weight is not a 1-D
tensor of x's last dim, stays as it is.

`stats["sites"]` is the number of norms fused, `stats["orders"]` how many of each order.
"""
from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
from torch import nn
from torch.fx import GraphModule

from dsv4c.passes import PassContext, PassResult, kernel_ops, tensor_value, unavailable
from dsv4c.passes.pattern import export_pattern, fuse_sites

_ACT = (torch.float32, torch.bfloat16, torch.float16)


class _Norm(nn.Module):
    def __init__(self, eps: float, cast_first: bool):
        super().__init__()
        self.eps, self.cast_first = eps, cast_first

    def forward(self, x, w):
        from dsv4c.model.common import RMSNorm

        return RMSNorm.forward(SimpleNamespace(weight=w, eps=self.eps, cast_first=self.cast_first), x)


@functools.lru_cache(maxsize=16)
def norm_pattern(eps: float, cast_first: bool, dtype: torch.dtype):
    """`RMSNorm.forward` exported on x [2, 8] of `dtype` (the weight's dtype appears in no op of it)."""
    return export_pattern(_Norm(eps, cast_first), (torch.zeros(2, 8, dtype=dtype), torch.ones(8, dtype=dtype))).graph


def _ok(site) -> bool:
    x, w = (tensor_value(a) for a in site.inputs)
    return (x is not None and w is not None and x.dim() >= 1 and w.dim() == 1 and x.dtype in _ACT
            and w.dtype in _ACT and isinstance(x.shape[-1], int) and w.shape[0] == x.shape[-1])


def fuse_rmsnorm(gm: GraphModule, ctx: PassContext) -> PassResult:
    ops = kernel_ops(ctx, "rms_norm")
    if ops is None:
        return PassResult(gm, False, {"sites": 0, "skipped": unavailable("rms_norm")})
    op, = ops
    if not any(n.target is torch.ops.aten.rsqrt.default for n in gm.graph.nodes):
        return PassResult(gm, False, {"sites": 0})
    eps = ctx.config.rms_norm_eps
    found = {v.dtype for n in gm.graph.nodes if (v := tensor_value(n)) is not None}
    dtypes = [dt for dt in _ACT if dt in found]
    orders = {"v4": 0, "v3": 0}
    for cast_first in (False, True):
        for dt in dtypes:
            orders["v3" if cast_first else "v4"] += fuse_sites(
                gm, norm_pattern(eps, cast_first, dt),
                lambda s, cf=cast_first: (op, (*s.inputs, eps, cf)) if _ok(s) else None)
    sites = sum(orders.values())
    if sites:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, sites > 0, {"sites": sites, "orders": orders, "eps": eps})
