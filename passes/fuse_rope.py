"""Fuse each interleaved RoPE into one `dsv4c::rope_interleaved` call (V4 and V3).

`dsv4c.model.common.rope_interleaved` rotates the last r channels of a row in interleaved pairs. V4
calls it for the kv row, the indexer's q (CSA layers) and, inverted, for the attention output; V3 for
q_pe and k_pe. (V4's main q RoPE is inside `dsv4c.head_rms_rope`, the compressors' inside their
ops.) Exported, one call is ~17 ATen ops, each a launch in a CUDA graph.

Before (x [..., C] with up to 3 leading dims, cos/sin [..., r/2]; C − r and the dims as literals):
    keep = x[..., :C-r];  rot = to(x[..., C-r:], fp32);  a, b = rot[..., 0::2], rot[..., 1::2]
    s = -sin (inverse) or sin
    out = cat([keep, to(flatten(stack([a·cos − b·s, a·s + b·cos], -1), -2), x.dtype)], -1)
After:
    out = dsv4c.rope_interleaved(x, cos, sin, inverse)     # kernels/rope.py: one Triton launch

Why it is valid: the pattern is not written by hand. It is the model's own `rope_interleaved`
exported with torch.export for each (rank, C, r, dtype, inverse) the graph can hold, so it is
exactly the op sequence the model's graphs contain, literals included. The candidate keys come from
the graph's `cat([slice(x, -1, 0, C − r), ...], -1)` nodes; `torch.fx`'s SubgraphMatcher then finds
the sites, and a site is only kept when no intermediate value is used outside it (passes/pattern.py).
`dsv4c::rope_interleaved` is defined as that same function: on the CPU it calls it (bit-exact), on
CUDA one Triton kernel performs the same operations in fp32 (tests/test_fuse_rope.py bounds the
difference). A site whose cos/sin would broadcast x itself stays as it is.

`stats["sites"]`: calls fused; `stats["inverse"]`: of them, inverse rotations.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.fx import GraphModule, Node

from dsv4c.passes import PassContext, PassResult, kernel_ops, tensor_value, unavailable
from dsv4c.passes.pattern import export_pattern, fuse_sites

aten = torch.ops.aten
_ACT = (torch.float32, torch.bfloat16, torch.float16)
_MAX_RANK = 4  # x [B, T, H, C] (kernels/rope.py MAX_LEAD + 1)


class _Rope(nn.Module):
    def __init__(self, inverse: bool):
        super().__init__()
        self.inverse = inverse

    def forward(self, x, cos, sin):
        from dsv4c.model.common import rope_interleaved

        return rope_interleaved(x, cos, sin, inverse=self.inverse)


@functools.lru_cache(maxsize=64)
def rope_pattern(rank: int, C: int, r: int, dtype: torch.dtype, inverse: bool):
    """`rope_interleaved` exported on x [2, ..., C] of `rank` dims and `dtype`, cos/sin [2, ..., r/2]."""
    lead = (2,) * (rank - 1)
    cs = torch.zeros(*lead, r // 2)
    return export_pattern(_Rope(inverse), (torch.zeros(*lead, C, dtype=dtype), cs, cs.clone())).graph


def _keys(gm: GraphModule) -> set[tuple]:
    """(rank, C, r, dtype) of every `cat([slice(x, last, 0, C - r), _], -1)` whose x could be a RoPE input."""
    keys = set()
    for n in gm.graph.nodes:
        if n.target is not aten.cat.default or len(n.args) < 2 or n.args[1] != -1 or len(n.args[0]) != 2:
            continue
        keep = n.args[0][0]
        if not (isinstance(keep, Node) and keep.target is aten.slice.Tensor and len(keep.args) == 4):
            continue
        x, dim, start, end = keep.args
        v = tensor_value(x)
        if v is None or v.dtype not in _ACT or not 1 <= v.dim() <= _MAX_RANK or dim != v.dim() - 1 or start != 0:
            continue
        C = v.shape[-1]
        if isinstance(C, int) and isinstance(end, int) and 0 <= end < C and (C - end) % 2 == 0:
            keys.add((v.dim(), C, C - end, v.dtype))
    return keys


def _ok(site) -> bool:
    """Tensors of the op's dtypes, and cos/sin broadcast to x's leading dims, never x to theirs: the
    site's output has x's shape (symbolic sizes compared by expression; the batch sizes of x and of
    cos/sin are different symbols of one runtime value)."""
    x, cos, sin = (tensor_value(a) for a in site.inputs)
    out = tensor_value(site.outputs[0])
    if x is None or cos is None or sin is None or out is None:
        return False
    if cos.dtype not in _ACT or sin.dtype not in _ACT or cos.dim() > x.dim() or sin.dim() != cos.dim():
        return False
    return len(out.shape) == len(x.shape) and all(str(a) == str(b) for a, b in zip(out.shape, x.shape))


def fuse_rope(gm: GraphModule, ctx: PassContext) -> PassResult:
    ops = kernel_ops(ctx, "rope_interleaved")
    if ops is None:
        return PassResult(gm, False, {"sites": 0, "skipped": unavailable("rope_interleaved")})
    op, = ops
    counts = {False: 0, True: 0}
    for key in sorted(_keys(gm), key=str):
        for inverse in (True, False):  # inverse first: the forward pattern also matches it, with -sin as sin
            counts[inverse] += fuse_sites(gm, rope_pattern(*key, inverse),
                                          lambda s, inv=inverse: (op, (*s.inputs, inv)) if _ok(s) else None)
    sites = counts[False] + counts[True]
    if sites:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, sites > 0, {"sites": sites, "inverse": counts[True]})
