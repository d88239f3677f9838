"""Fuse each mHC site's pre-mix and post-mix, and the collapse before the head, into one custom op each
(DeepSeek-V4).

Every V4 block has two mHC sites (attention and FFN; the MTP block too). Exported, one site's
`HyperConnection.pre` is ~36 ATen ops around the (already fused) Sinkhorn, and `.post` ~8, each a GPU
launch of a few microseconds in a CUDA graph. The pass makes them 2 + 1 launches (kernels/mhc.py).

Before (one site; X [B, T, N, D] in the activation dtype, fn/base/scale fp32 weights):
    x = to(flatten(X, -2), fp32);  z = linear(x, to(fn, fp32)) * rsqrt(mean(x², -1) + eps)
    pre  = sigmoid(s[0]·z[..., :N] + b[:N]) + hc_eps;  post = 2·sigmoid(s[1]·z[..., N:2N] + b[N:2N])
    comb = sinkhorn(unflatten(s[2]·z[..., 2N:] + b[2N:], (N, N)), iters, hc_eps)   # dsv4c.sinkhorn or its chain
    u    = to(sum(pre[..., None] · to(X, fp32), -2), X.dtype)
    ... y = block(norm(u)) ...
    X'   = to(post[..., None] · to(y, fp32)[..., None, :] + einsum("btjk,btjd->btkd", comb, to(X, fp32)), X.dtype)
After:
    u, post, comb = dsv4c.hc_pre(X, fn, base, scale, eps, hc_eps, iters)
    X' = dsv4c.hc_post(y, X, post, comb)

And the head's collapse of the streams (`hc_head_collapse`, once per graph before the final norm and the LM
head, and in the MTP block; ~12 ATen ops: the same z, then w = sigmoid(scale·z + base) + hc_eps, u = Σ_k w_k·X[k]):
    u = dsv4c.hc_head(X, fn, base, scale, eps, hc_eps)        # hc_pre's launches with N mix rows, u alone
Deterministic graphs keep the head unfused (its ATen mean and linear become make_batch_invariant's ops).

Why it is valid: the patterns are not written by hand. Each is the model's own function
(`HyperConnection.pre`, `HyperConnection.post`, `hc_head_collapse`) exported with torch.export for this config's N, eps,
hc_eps and iters and the graph's activation dtype, so it is exactly the op sequence the model's graphs
hold, literals included; `pre` is matched both with the Sinkhorn chain and with `dsv4c.sinkhorn` in
its place (the pattern run through fuse_sinkhorn), so the pass works whether or not fuse_sinkhorn ran.
`torch.fx`'s SubgraphMatcher finds the sites, and a site is only kept when no intermediate value is
used outside it (export's dtype checks aside, passes/pattern.py). The ops are defined as those same
functions: on the CPU they call `HyperConnection.pre`/`.post`/`hc_head_collapse` (bit-exact), on CUDA the Triton kernels
compute the same formulas in fp32 (tests/test_fuse_hc.py bounds the difference). A site whose
tensors do not have the model's dtypes and shapes (N a power of two <= 16, fp32 weights) stays.

`stats`: `pre`, `post` and `head`, the sites fused.
"""
from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
from torch import nn
from torch.fx import GraphModule

from dsv4c.passes import PassContext, PassResult, kernel_ops, tensor_value, unavailable
from dsv4c.passes.pattern import export_pattern, fuse_sites, match_sites, replace_site

_ACT = (torch.float32, torch.bfloat16, torch.float16)


class _Pre(nn.Module):
    def __init__(self, n: int, eps: float, hc_eps: float, iters: int):
        super().__init__()
        self.hc = SimpleNamespace(n=n, eps=eps, hc_eps=hc_eps, iters=iters)  # what `pre` reads of its module

    def forward(self, X, fn, base, scale):
        from dsv4c.model.v4 import HyperConnection

        return HyperConnection.pre(self.hc, X, fn, base, scale)


class _Head(nn.Module):
    def __init__(self, eps: float, hc_eps: float):
        super().__init__()
        self.eps, self.hc_eps = eps, hc_eps

    def forward(self, X, fn, base, scale):
        from dsv4c.model.v4 import hc_head_collapse

        return hc_head_collapse(X, fn, base, scale, self.eps, self.hc_eps)


class _Post(nn.Module):
    def forward(self, y, X, post, comb):
        from dsv4c.model.v4 import HyperConnection

        return HyperConnection.post(y, X, post, comb)


@functools.lru_cache(maxsize=16)
def pre_pattern(n: int, eps: float, hc_eps: float, iters: int, dtype: torch.dtype, fused_sinkhorn: bool):
    """`HyperConnection.pre` exported on X [2, 3, n, 8] of `dtype`; with `fused_sinkhorn` the Sinkhorn
    chain in it is replaced by dsv4c.sinkhorn, as fuse_sinkhorn does in the model's graphs."""
    d, mix = 8, (2 + n) * n
    ex = (torch.zeros(2, 3, n, d, dtype=dtype), torch.zeros(mix, n * d), torch.zeros(mix), torch.zeros(3))
    gm = export_pattern(_Pre(n, eps, hc_eps, iters), ex)
    if fused_sinkhorn:  # what fuse_sinkhorn does to the model's graphs
        from dsv4c.passes.fuse_sinkhorn import sinkhorn_pattern

        sites = match_sites(gm, sinkhorn_pattern(iters, hc_eps, n))
        if len(sites) != 1:
            return None
        replace_site(gm, sites[0], torch.ops.dsv4c.sinkhorn.default, (*sites[0].inputs, iters, hc_eps))
    return gm.graph


@functools.lru_cache(maxsize=8)
def post_pattern(n: int, dtype: torch.dtype):
    """`HyperConnection.post` exported on y [2, 3, 8], X [2, 3, n, 8] of `dtype`."""
    ex = (torch.zeros(2, 3, 8, dtype=dtype), torch.zeros(2, 3, n, 8, dtype=dtype), torch.zeros(2, 3, n),
          torch.zeros(2, 3, n, n))
    return export_pattern(_Post(), ex).graph


@functools.lru_cache(maxsize=8)
def head_pattern(n: int, eps: float, hc_eps: float, dtype: torch.dtype):
    """`hc_head_collapse` exported on X [2, 3, n, 8] of `dtype`."""
    ex = (torch.zeros(2, 3, n, 8, dtype=dtype), torch.zeros(n, n * 8), torch.zeros(n), torch.zeros(1))
    return export_pattern(_Head(eps, hc_eps), ex).graph


def _streams_ok(X, n: int):
    v = tensor_value(X)
    return v is not None and v.dim() == 4 and v.dtype in _ACT and v.shape[-2] == n


def _fp32(a, shape) -> bool:
    v = tensor_value(a)
    return v is not None and v.dtype == torch.float32 and tuple(v.shape) == tuple(shape)


def _pre_ok(site, n: int) -> bool:
    X, fn, base, scale = site.inputs
    if not _streams_ok(X, n):
        return False
    mix, d = (2 + n) * n, tensor_value(X).shape[-1]
    return isinstance(d, int) and _fp32(fn, (mix, n * d)) and _fp32(base, (mix,)) and _fp32(scale, (3,))


def _head_ok(site, n: int) -> bool:
    X, fn, base, scale = site.inputs
    if not _streams_ok(X, n):
        return False
    d = tensor_value(X).shape[-1]
    return isinstance(d, int) and _fp32(fn, (n, n * d)) and _fp32(base, (n,)) and _fp32(scale, (1,))


def _post_ok(site, n: int) -> bool:
    y, X, post, comb = site.inputs
    if not _streams_ok(X, n) or tensor_value(y) is None or tensor_value(y).dtype != tensor_value(X).dtype:
        return False
    return all(tensor_value(a) is not None and tensor_value(a).dtype == torch.float32 for a in (post, comb))


def _act_dtypes(gm: GraphModule) -> list[torch.dtype]:
    """Float dtypes of the graph's 4-D values (the candidates for the streams' dtype)."""
    found = {v.dtype for n in gm.graph.nodes if (v := tensor_value(n)) is not None and v.dim() == 4}
    return [dt for dt in _ACT if dt in found]


def fuse_hc(gm: GraphModule, ctx: PassContext) -> PassResult:
    cfg = ctx.config
    if not cfg.is_v4:
        return PassResult(gm, False, {"pre": 0, "post": 0, "head": 0, "skipped": "no mHC (not a V4 model)"})
    ops = kernel_ops(ctx, "hc_pre", "hc_post", "hc_head")
    if ops is None:
        return PassResult(gm, False, {"pre": 0, "post": 0, "head": 0,
                                      "skipped": unavailable("hc_pre", "hc_post", "hc_head")})
    pre_op, post_op, head_op = ops
    n, eps, hc_eps, iters = cfg.hc_mult, cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters
    pre = post = head = 0
    for dt in _act_dtypes(gm):
        for fused in (True, False):
            pattern = pre_pattern(n, eps, hc_eps, iters, dt, fused)
            if pattern is not None:
                pre += fuse_sites(gm, pattern, lambda s: (pre_op, (*s.inputs, eps, hc_eps, iters)) if _pre_ok(s, n)
                                  else None)
        post += fuse_sites(gm, post_pattern(n, dt), lambda s: (post_op, tuple(s.inputs)) if _post_ok(s, n) else None)
        if not ctx.deterministic:
            head += fuse_sites(gm, head_pattern(n, eps, hc_eps, dt),
                               lambda s: (head_op, (*s.inputs, eps, hc_eps)) if _head_ok(s, n) else None)
    if pre or post or head:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, bool(pre or post or head), {"pre": pre, "post": post, "head": head})
