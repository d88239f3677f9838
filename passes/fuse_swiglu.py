"""Fuse each SwiGLU activation into one `dsv4c::swiglu_act` call (V4 and V3).

The model's `swiglu` (dsv4c/model/common.py) is `swiglu_act(x @ w1.t(), x @ w3.t(), limit) @ w2.t()`:
V4's shared experts (each layer's and the MTP block's, limit = swiglu_limit), V3's dense MLPs and
shared experts (limit 0). (The routed experts' SwiGLU lives inside the expert ops.) After
fuse_projections the two V4 GEMMs are one, and g, u are the halves of its split output. The
activation between the GEMMs is 4 elementwise launches in V4 (2 in V3), each ~2 µs in a decode step.

Before (g, u [..., I], one dtype; L = swiglu_limit a literal):
    V4:  g2 = clamp(g, None, L);  u2 = clamp(u, -L, L);  h = mul(silu(g2), u2)
    V3:  h = mul(silu(g), u)
After:
    h = dsv4c.swiglu_act(g, u, L)            # kernels/swiglu.py: one Triton launch (L = 0: no clamp)

Why it is valid: the pattern is not written by hand. It is the model's own `swiglu_act` exported
with torch.export for this config's limit, once per activation dtype the graph holds, so it is
exactly the op sequence and literals the model's graphs contain; passes/pattern.py finds each site
and keeps it only when no intermediate value (the clamped g and u, silu(g)) is used outside it.
`dsv4c::swiglu_act` is defined as that function: on the CPU it calls it (bit-exact), on CUDA one
Triton kernel computes it with PyTorch's rounding steps (tests/test_fuse_swiglu.py bounds the
difference). A site is left alone when g and u are not fp32/bf16 of one dtype and shape, or are
views the kernel cannot address with one row stride (the split halves can).

`stats["sites"]` is the number of activations fused, `stats["limit"]` the limit of the pattern.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.fx import GraphModule

from dsv4c.passes import PassContext, PassResult, kernel_ops, tensor_value, unavailable
from dsv4c.passes.pattern import export_pattern, fuse_sites

_ACT = (torch.float32, torch.bfloat16)


class _Act(nn.Module):
    def __init__(self, limit: float):
        super().__init__()
        self.limit = limit

    def forward(self, g, u):
        from dsv4c.model.common import swiglu_act

        return swiglu_act(g, u, self.limit)


@functools.lru_cache(maxsize=16)
def swiglu_pattern(limit: float, dtype: torch.dtype):
    """The model's `swiglu_act` exported on g, u [2, 8] of `dtype` with this limit."""
    ex = torch.zeros(2, 8, dtype=dtype)
    return export_pattern(_Act(limit), (ex, ex.clone())).graph


def _addressable(t: torch.Tensor) -> bool:
    """Rows of unit stride with one row stride (the kernel's contract, checked on the fake value)."""
    if t.dim() < 1 or not isinstance(t.shape[-1], int):
        return False
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        return False
    stride = None
    for k in range(t.dim() - 2, -1, -1):  # the leading dims collapse: stride[k] = stride[k+1]·size[k+1]
        want = t.stride(k + 1) * t.shape[k + 1] if stride is not None else None
        if want is not None and t.shape[k] != 1 and t.stride(k) != want:
            return False
        stride = t.stride(k)
    return True


def _ok(site) -> bool:
    g, u = (tensor_value(a) for a in site.inputs)
    return (g is not None and u is not None and g.dtype in _ACT and u.dtype == g.dtype and g.shape == u.shape
            and _addressable(g) and _addressable(u))


def fuse_swiglu(gm: GraphModule, ctx: PassContext) -> PassResult:
    ops = kernel_ops(ctx, "swiglu_act")
    if ops is None:
        return PassResult(gm, False, {"sites": 0, "skipped": unavailable("swiglu_act")})
    op, = ops
    if not any(n.target is torch.ops.aten.silu.default for n in gm.graph.nodes):
        return PassResult(gm, False, {"sites": 0})
    limit = float(ctx.config.swiglu_limit)
    found = {v.dtype for n in gm.graph.nodes if (v := tensor_value(n)) is not None}
    sites = 0
    for dt in (dt for dt in _ACT if dt in found):
        sites += fuse_sites(gm, swiglu_pattern(limit, dt), lambda s: (op, (*s.inputs, limit)) if _ok(s) else None)
    if sites:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, sites > 0, {"sites": sites, "limit": limit})
