"""Fuse each mHC Sinkhorn normalisation into one `dsv4c::sinkhorn` call (DeepSeek-V4).

Every V4 block has two mHC sites (`HyperConnection.pre`, attention and FFN; the MTP block too), and
each normalises its [N, N] mixing matrix with `dsv4c.model.v4.sinkhorn`. Exported, that is a chain
of 6·iters − 1 tiny ATen ops per site (N = hc_mult = 4, iters = hc_sinkhorn_iters = 20: 119 ops), each
one GPU kernel launch of ~2 us in a CUDA graph: about a quarter of the v4-flash-slice decode step.

Before (one site, c0 [B, T, N, N] fp32; eps = hc_eps as a literal):
    c = softmax(c0, -1) + eps
    c = c / (sum(c, [-2], keepdim) + eps)
    c = c / (sum(c, [-1], keepdim) + eps);  c = c / (sum(c, [-2], keepdim) + eps)   # × (iters - 1)
After:
    c = dsv4c.sinkhorn(c0, iters, eps)            # kernels/mhc.py: one Triton launch per site

Why it is valid: the pattern is not written by hand. It is the model's own `sinkhorn` exported with
torch.export for this config's iters and eps, so it is exactly the op sequence the model's graphs
contain, literals (eps) included; `torch.fx`'s SubgraphMatcher finds it, and a match is only kept
when no intermediate value is used outside the chain. `dsv4c::sinkhorn` is defined as that same
function: on CPU it calls `dsv4c.model.v4.sinkhorn` (bit-exact), on CUDA the kernel repeats the same
operations in the same order (tests/test_fuse_sinkhorn.py bounds the difference at ~1e-7 relative).
A site whose input is not fp32 [..., N, N] with N a power of two <= 16, or whose eps or iteration
count differ from the config's, does not match and stays as it is.

`stats["sites"]` is the number of sites fused.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.fx import Graph, GraphModule, Node
from torch.fx.passes.utils.matcher_utils import SubgraphMatcher

from dsv4c.passes import PassContext, PassResult, erase_unused, fake_value, kernel_ops, unavailable

aten = torch.ops.aten


class _SinkhornPattern(nn.Module):
    def __init__(self, iters: int, eps: float):
        super().__init__()
        self.iters, self.eps = iters, eps

    def forward(self, c0: torch.Tensor) -> torch.Tensor:
        from dsv4c.model.v4 import sinkhorn

        return sinkhorn(c0, self.iters, self.eps)


@functools.lru_cache(maxsize=8)
def sinkhorn_pattern(iters: int, eps: float, n: int) -> Graph:
    """The ATen graph torch.export makes of the model's `sinkhorn(c0 [2, n, n], iters, eps)`; exported
    once per (iters, eps, n) and only read by the matcher, so every graph of a compile shares it."""
    example = torch.zeros(2, n, n)
    ep = torch.export.export(_SinkhornPattern(iters, eps), (example,), strict=False)
    return ep.graph


def _fusable(c0: Node) -> bool:
    v = c0.meta.get("val")
    if not isinstance(v, torch.Tensor) or v.dtype != torch.float32 or v.dim() < 2:
        return False
    n = v.shape[-1]
    return isinstance(n, int) and v.shape[-2] == n and 1 <= n <= 16 and n & (n - 1) == 0


def fuse_sinkhorn(gm: GraphModule, ctx: PassContext) -> PassResult:
    cfg = ctx.config
    if not cfg.is_v4:
        return PassResult(gm, False, {"sites": 0, "skipped": "no mHC (not a V4 model)"})
    if not any(n.target in (aten.softmax.int, aten._softmax.default) for n in gm.graph.nodes):
        return PassResult(gm, False, {"sites": 0})
    ops = kernel_ops(ctx, "sinkhorn")
    if ops is None:
        return PassResult(gm, False, {"sites": 0, "skipped": unavailable("sinkhorn")})
    op, = ops
    iters, eps = cfg.hc_sinkhorn_iters, cfg.hc_eps
    matcher = SubgraphMatcher(sinkhorn_pattern(iters, eps, cfg.hc_mult), match_output=False,
                              match_placeholder=False, remove_overlapping_matches=True)
    sites = 0
    for m in matcher.match(gm.graph):
        (c0,), (out,) = m.placeholder_nodes, m.returning_nodes
        if not _fusable(c0):
            continue
        with gm.graph.inserting_before(out):
            fused = gm.graph.call_function(op, (c0, iters, eps))
        fused.meta["val"] = fake_value(c0, op, c0.meta["val"], iters, eps)
        out.replace_all_uses_with(fused)
        erase_unused(gm, [out])
        sites += 1
    return PassResult(gm, sites > 0, {"sites": sites, "iters": iters, "eps": eps})
