"""Fuse V4's MoE router scoring (after the logits GEMM) into one `dsv4c::route_topk` / `route_hashed(_ids)` call.

Every V4 MoE (each layer's and the MTP block's) routes with `Gate.forward`: the logits GEMM
(`linear_f32` once lower_f32_linears ran on a low-precision graph, an fp32 `linear` otherwise),
then `route_topk` (non-hash layers) or `route_hashed` (hash layers) of dsv4c/model/v4.py, ~9 ATen
launches per layer in a decode step's CUDA graph.

Before (logits [T, E] fp32, bias [E] fp32 graph attribute; K, scale literals):
    s = sqrt(softplus(logits))
    top-K:  idx = topk(s + to(bias, fp32), K).indices          hash:  idx = tid2eid[ids]  (stays)
    g = gather(s, -1, idx);  w = g / (sum(g, -1, keepdim) + 1e-20) * scale
After:
    idx, w = dsv4c.route_topk(logits, bias, K, scale)          w = dsv4c.route_hashed(logits, idx, scale)
                                                               # kernels/router.py: one Triton launch
    hash, with the lookup:  idx, w = dsv4c.route_hashed_ids(logits, ids, tid2eid, scale)
The hash layers' lookup `idx = tid2eid[ids]` (an ATen gather, launched outside the kernels' PDL chain)
moves into the op with the scoring when ids is an int64 [T] (any stride) and tid2eid a contiguous int64
[V, K] (always, in the model's graphs) and HASH_LOOKUP is on; otherwise the lookup stays before
`route_hashed`. HASH_LOOKUP is off: its GPU tests pass, but on the 2-layer slice (one hash layer) the step
was no faster, 0.753 / 0.760 vs 0.756 / 0.752 ms at batch 1 and 1.468 vs 1.467 at batch 8 (H100,
examples/results/device-2026-12-07/run78). tests/test_fuse_router.py turns it on.

Why it is valid: the patterns are not written by hand. They are the model's own `route_topk` and
`route_hashed` (the latter with `Gate.forward`'s lookup before it, or alone) exported with torch.export
for this config's K (num_experts_per_tok) and scale (routed_scaling_factor), so they hold exactly the op
sequence and literals the model's graphs contain; passes/pattern.py finds each site and keeps it only
when no intermediate value (s, the keys, the gathered scores) is used outside it. The ops are defined as
those same functions: on the CPU they call them (bit-exact), on CUDA one Triton kernel computes the same
formula in fp32 (tests/test_fuse_router.py bounds the difference: equal expert ids, weights within 1e-6).
A site is left alone when its logits are not a contiguous fp32 [T, E] with E <= kernels.router.MAX_E, or
its bias not an fp32 [E]. V3/V3.2 routers (sigmoid, group-limited) hold no softplus: nothing matches
there.

`stats["sites"]` is the number of routers fused, `stats["variants"]` how many of each (topk, hashed_ids,
hashed).
"""
from __future__ import annotations

import functools
import operator

import torch
from torch import nn
from torch.fx import GraphModule, Node

from dsv4c.passes import PassContext, PassResult, kernel_ops, tensor_value, unavailable
from dsv4c.passes.pattern import export_pattern, fuse_sites


class _TopK(nn.Module):
    def __init__(self, k: int, scale: float):
        super().__init__()
        self.k, self.scale = k, scale

    def forward(self, logits, bias):
        from dsv4c.model.v4 import route_topk

        return route_topk(logits, bias, self.k, self.scale)


class _Hashed(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, logits, idx):
        from dsv4c.model.v4 import route_hashed

        return route_hashed(logits, idx, self.scale)


class _HashedIds(nn.Module):
    """A hash layer's `Gate.forward` after the logits: the table lookup, then `route_hashed`."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, logits, ids, tid2eid):
        from dsv4c.model.v4 import route_hashed

        idx = tid2eid[ids]
        return idx, route_hashed(logits, idx, self.scale)


HASH_LOOKUP = False  # hash layers: the table lookup inside the router's launch (route_hashed_ids)
_E = 8  # the patterns' example width (E appears in no op of them)


@functools.lru_cache(maxsize=8)
def topk_pattern(k: int, scale: float):
    """`route_topk` exported on logits [2, 8] fp32 for this K and scale, without the unused
    `getitem(topk, 0)` (the values; the matcher refuses dead code)."""
    g = export_pattern(_TopK(k, scale), (torch.zeros(2, _E), torch.zeros(_E))).graph
    _drop_unused_topk_values(g)
    return g


def _drop_unused_topk_values(g) -> int:
    """Erase `getitem(topk(...), i)` nodes nothing uses (export keeps the unused values); returns how many."""
    dead = [n for n in g.nodes if n.target is operator.getitem and not n.users and isinstance(n.args[0], Node)
            and n.args[0].target is torch.ops.aten.topk.default]
    for n in dead:
        g.erase_node(n)
    return len(dead)


@functools.lru_cache(maxsize=8)
def hashed_pattern(k: int, scale: float):
    """`route_hashed` exported on logits [2, 8] fp32 with ids [2, K]."""
    return export_pattern(_Hashed(scale), (torch.zeros(2, _E), torch.zeros(2, k, dtype=torch.int64))).graph


@functools.lru_cache(maxsize=8)
def hashed_ids_pattern(k: int, scale: float):
    """`tid2eid[ids]` then `route_hashed`, exported on logits [2, 8] fp32, ids [2], tid2eid [16, K]."""
    args = (torch.zeros(2, _E), torch.zeros(2, dtype=torch.int64), torch.zeros(16, k, dtype=torch.int64))
    return export_pattern(_HashedIds(scale), args).graph


def _logits_ok(logits) -> bool:
    from dsv4c.kernels.router import MAX_E

    return (logits is not None and logits.dtype == torch.float32 and logits.dim() == 2
            and isinstance(logits.shape[1], int) and 1 <= logits.shape[1] <= MAX_E and logits.is_contiguous())


def _topk_ok(site) -> bool:
    logits, bias = (tensor_value(a) for a in site.inputs)
    return (_logits_ok(logits) and bias is not None and bias.dtype == torch.float32
            and tuple(bias.shape) == (logits.shape[1],))


def _hashed_ok(site, k: int) -> bool:
    logits, idx = (tensor_value(a) for a in site.inputs)
    return (_logits_ok(logits) and idx is not None and idx.dtype == torch.int64 and idx.dim() == 2
            and idx.shape[1] == k)


def _hashed_ids_ok(site, k: int) -> bool:
    logits, ids, table = (tensor_value(a) for a in site.inputs)
    return (_logits_ok(logits) and ids is not None and ids.dtype == torch.int64 and ids.dim() == 1
            and table is not None and table.dtype == torch.int64 and table.dim() == 2
            and table.shape[1] == k and table.is_contiguous())


def fuse_router(gm: GraphModule, ctx: PassContext) -> PassResult:
    names = ("route_topk", "route_hashed", "route_hashed_ids")
    ops = kernel_ops(ctx, *names)
    if ops is None:
        return PassResult(gm, False, {"sites": 0, "skipped": unavailable(*names)})
    topk_op, hashed_op, hashed_ids_op = ops
    if not ctx.config.is_v4 or not any(n.target is torch.ops.aten.softplus.default for n in gm.graph.nodes):
        return PassResult(gm, False, {"sites": 0})
    k, scale = ctx.config.num_experts_per_tok, ctx.config.routed_scaling_factor
    # the graph's unused top-k values would count as a use from outside the site
    dropped = _drop_unused_topk_values(gm.graph)
    variants = {
        "topk": fuse_sites(gm, topk_pattern(k, scale),
                           lambda s: (topk_op, (*s.inputs, k, scale)) if _topk_ok(s) else None),
        "hashed_ids": 0,
    }
    if HASH_LOOKUP:  # before the plain hashed pattern, which is a part of this one
        variants["hashed_ids"] = fuse_sites(
            gm, hashed_ids_pattern(k, scale),
            lambda s: (hashed_ids_op, (*s.inputs, scale)) if _hashed_ids_ok(s, k) else None)
    variants["hashed"] = fuse_sites(gm, hashed_pattern(k, scale),
                                    lambda s: (hashed_op, (*s.inputs, scale)) if _hashed_ok(s, k) else None)
    sites = sum(variants.values())
    if sites or dropped:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, sites > 0 or dropped > 0, {"sites": sites, "variants": variants, "k": k, "scale": scale})
