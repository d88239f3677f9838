"""Fuse each RoPE angle table into one `dsv4c::rope_angles` call (V4, and V3/V3.2 where it applies).

Every V4 attention layer (and the MTP block's) builds the cos/sin table of its chunk with
`dsv4c.model.common.rope_angles(pos0, T, inv_freq)`: positions pos0[b] + t, times the layer's
frequencies (theta 10000 for SWA layers, the compressed layers' YaRN table otherwise). V3/V3.2
build their one table per step from the same two pieces (`pos0[:, None] + arange(T)` and
`RotaryTable.forward`), so their step graphs hold the same op sequence. Exported, one table is
~6 launches (arange, add, cast, mul, cos, sin) in a CUDA graph.

Before (pos0 [B] int64, inv_freq [r/2] fp32 buffer; T a literal, or prefill's symbolic chunk size):
    pos = unsqueeze(pos0, 1) + arange(T, device)              # [B, T] int64
    ang = unsqueeze(to(pos, fp32), 2) * to(inv_freq, device)  # [B, T, r/2], one fp32 rounding
    cos, sin = cos(ang), sin(ang)
After:
    cos, sin = dsv4c.rope_angles(pos0, to(inv_freq, device), T)   # kernels/rope_angles.py: one launch

Why it is valid: the pattern is not written by hand. It is the model's own `rope_angles` exported
with torch.export, with two literals opened up as pattern inputs, so one pattern matches every
graph kind: the arange's length T (decode 1, verify/MTP 1 + k, prefill the symbolic chunk size) and
its device. The no-op `inv_freq.to(device)` is left out of the pattern (the site's inv_freq input is
that node), because the CSA/HCA layers' compressors read the same node (`self.rope.inv_freq`
passed on). `torch.fx`'s SubgraphMatcher finds the sites, and a site is only kept when no
intermediate value is used outside it (passes/pattern.py): a table whose positions are also used
elsewhere (V3's MTP step zeroes the embedding at position 0) stays as it is. `dsv4c::rope_angles`
is defined as that same function: on the CPU it calls `rope_angles` (bit-exact), on CUDA one Triton
kernel computes the same fp32 product and libdevice's precise cos/sin (tests/test_fuse_rope_angles.py
bounds the difference). V3's `× rope_factor` after the table stays in the graph.

`stats["sites"]`: tables fused; `stats["T"]`: the chunk sizes of the graph's `rope_angles` calls (a
string when symbolic).
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.fx import Graph, GraphModule, Node

from dsv4c.passes import PassContext, PassResult, kernel_ops, tensor_value, unavailable
from dsv4c.passes.pattern import export_pattern, fuse_sites

aten = torch.ops.aten
_T_EXAMPLE = 3  # the pattern's example chunk size (replaced by a pattern input)


class _Angles(nn.Module):
    def forward(self, pos0, inv_freq):
        from dsv4c.model.common import rope_angles

        return rope_angles(pos0, _T_EXAMPLE, inv_freq)


@functools.lru_cache(maxsize=1)
def angles_pattern() -> Graph:
    """`rope_angles` exported on pos0 [2] int64 and inv_freq [4] fp32, then: the arange's length and
    device become the pattern inputs `T` and `device` (placeholders match literals and nodes alike),
    and inv_freq feeds the multiply directly (its no-op `.to(device)` dropped). Inputs, in order:
    pos0, inv_freq, T, device."""
    g = export_pattern(_Angles(), (torch.zeros(2, dtype=torch.int64), torch.ones(4))).graph
    _pos0, inv_freq = g.find_nodes(op="placeholder")
    arange, = (n for n in g.nodes if n.target is aten.arange.default)
    if arange.args != (_T_EXAMPLE,) or "device" not in arange.kwargs:
        raise AssertionError(f"rope_angles exported an unexpected arange: {arange.format_node()}")
    with g.inserting_after(inv_freq):
        t = g.placeholder("T")
    with g.inserting_after(t):
        device = g.placeholder("device")
    arange.args = (t,)
    arange.kwargs = {**arange.kwargs, "device": device}
    to_dev, = inv_freq.users
    if to_dev.target not in (aten.to.dtype_layout, aten.to.device, aten._to_copy.default):
        raise AssertionError(f"rope_angles exported an unexpected use of inv_freq: {to_dev.format_node()}")
    to_dev.replace_all_uses_with(inv_freq)
    g.erase_node(to_dev)
    g.lint()
    return g


def _t_value(t):
    """The chunk size bound to the pattern's T: an int literal, or a node holding a (sym)int."""
    if isinstance(t, Node):
        t = t.meta.get("val")
    return t if isinstance(t, (int, torch.SymInt)) and not isinstance(t, bool) else None


def _same_size(a, b) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return str(a) == str(b)  # symbolic sizes compared by expression (no guard)


def _ok(site) -> bool:
    """pos0 a 1-D int64, inv_freq a 1-D fp32, T a (sym)int, and the site's cos [B, T, r/2] fp32."""
    pos0, inv_freq = tensor_value(site.inputs[0]), tensor_value(site.inputs[1])
    T = _t_value(site.inputs[2])
    cos = tensor_value(site.outputs[0])
    if pos0 is None or inv_freq is None or T is None or cos is None:
        return False
    if pos0.dtype != torch.int64 or pos0.dim() != 1 or inv_freq.dtype != torch.float32 or inv_freq.dim() != 1:
        return False
    return (cos.dtype == torch.float32 and cos.dim() == 3 and _same_size(cos.shape[0], pos0.shape[0])
            and _same_size(cos.shape[1], T) and _same_size(cos.shape[2], inv_freq.shape[0]))


def fuse_rope_angles(gm: GraphModule, ctx: PassContext) -> PassResult:
    ops = kernel_ops(ctx, "rope_angles")
    if ops is None:
        return PassResult(gm, False, {"sites": 0, "skipped": unavailable("rope_angles")})
    op, = ops
    targets = {n.target for n in gm.graph.nodes}
    if not {aten.arange.default, aten.cos.default, aten.sin.default} <= targets:
        return PassResult(gm, False, {"sites": 0, "T": []})

    def rewrite(site):
        pos0, inv_freq, T, _device = site.inputs
        return (op, (pos0, inv_freq, T)) if _ok(site) else None

    sites = fuse_sites(gm, angles_pattern(), rewrite)
    if sites:
        gm.graph.lint()
        gm.recompile()
    chunk = {a if isinstance(a := n.args[2], int) else str(_t_value(a)) for n in gm.graph.nodes if n.target is op}
    return PassResult(gm, sites > 0, {"sites": sites, "T": sorted(chunk, key=str)})
