"""Quantise the routed experts into the target's expert format (issue 6, quant_formats.md).

Before (one node per MoE layer, MTP block included; `moe_experts_gathered` is the same function):
    y = dsv4c.moe_experts(x, idx, weight, W1 [E, I, D], W3 [E, I, D], W2 [E, D, I], L)
After (x in bf16, D and I zero-padded to the format's block when they are not multiples of it):
    xb = to(x, bf16);  xb = constant_pad_nd(xb, [0, Dp - D])               # only if needed
    yb = dsv4c.moe_experts_q(xb, idx, weight, fmt, w13, w13_scale, w13_global,
                             w2, w2_scale, w2_global, input_scale_13, input_scale_2, L)
    y  = to(slice(yb, 1, 0, D), x.dtype)
with w13 = [W1 ‖ W3] (+ scales) in `fmt` (kernels/moe_grouped.py containers). The three expert
weights leave the graph; the new ones are graph attributes `<experts>.<fmt>.<field>`. The input
scales are None except for nvfp4_w4a4 (dsv4c/convert.py).

Why it is valid: `moe_experts_q` computes the function of `moe_experts` (Σ_j w_j · W2 SwiGLU_L(W1 x,
W3 x) per token) on the weights the container holds, the routing weight multiplied before W2 as
Official does (equal in exact arithmetic). The only change is the format's rounding of weights (and,
for fp8_block and nvfp4_w4a4, of activations), which kernels/tolerances.py bounds per format.
Zero padding is exact: padded input columns meet zero x, padded expert rows give SwiGLU(0) = 0 and
meet zero W2 columns, padded output rows are sliced off; zeros change no block amax, so no scale.

Formats per target (`Target.expert_format`, dsv4c/targets.py): reference (no rewrite), bf16,
fp8_block, mxfp4_w4a16, nvfp4_w4a16, nvfp4_w4a4. A kernel override of `moe_experts` in the
context (`--kernel moe_experts=...`) asks for that implementation of the unquantised op, so the
pass then leaves the experts alone.

Weights: the pass does not make them. With real weights in the graph it has them converted now
(dsv4c/convert.py: `quantize_stack`; tests, `dsv4c compare`); on the meta device (`dsv4c compile`)
it creates meta tensors of the right shape and dtype and records a *recipe* per new weight, which
compile streams from the checkpoint (`dsv4c.convert.CheckpointExperts`). nvfp4_w4a4's static
activation global scales (x and h per layer; their sources: checkpoint, calibration or weight
bound) are dsv4c/convert.py's too; the pass adds them as two [1] fp32 inputs of the op.

Stats: `layers` (one entry per rewritten node) and `quant_map` (per module: format, scale kind,
layer, MTP or not, the new tensors), which compile merges into manifest["quant_map"].
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import torch
from torch.fx import GraphModule, Node

from dsv4c.convert import (  # the formats and the weight conversion
    ACT_FIELDS,
    ALIGN,
    KERNEL_FORMAT,
    SCALE_KIND,
    QuantizeError,
    check_format,
    field_specs,
    given_activation_record,
    norm_weight_name,
    padded,
    quantize_stack,
)
from dsv4c.passes import PassContext, PassResult, delete_param, erase_unused, fake_value, get_param, set_param

aten = torch.ops.aten
RECIPE = "experts_q"  # the recipe kind compile.py streams


# ---- the pass ---------------------------------------------------------------------------------
def _expert_nodes(gm: GraphModule) -> list[Node]:
    ops = (torch.ops.dsv4c.moe_experts.default, torch.ops.dsv4c.moe_experts_gathered.default)
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in ops]


def _layer_of(name: str, ctx: PassContext) -> tuple[int | None, bool]:
    """(layer index, is MTP) from an expert weight's name; V4's MTP block counts after the main layers."""
    m = re.search(r"(layers|mtp)\.(\d+)\.", name)
    if m is None:
        return None, False
    n_main = ctx.config.num_hidden_layers
    if m.group(1) == "mtp":
        return n_main + int(m.group(2)), True
    layer = int(m.group(2))
    return layer, layer >= n_main


def _call(gm: GraphModule, ref: Node, op, args: tuple, shape_fn: Callable | None = None) -> Node:
    """A new call node with its meta['val']; `shape_fn(*vals)` computes the fake value from shapes only,
    for ops whose fake kernel would specialise the symbolic batch size (constant_pad_nd calls size())."""
    node = gm.graph.call_function(op, args)
    vals = tuple(a.meta["val"] if isinstance(a, Node) else a for a in args)
    node.meta["val"] = fake_value(ref, shape_fn or op, *vals)
    return node


def _attr(gm: GraphModule, ref: Node, name: str, value: torch.Tensor) -> Node:
    set_param(gm, name, value)
    node = gm.graph.get_attr(name)
    node.meta["val"] = fake_value(ref, lambda t: t, value)
    return node


def _new_weights(kfmt: str, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, ip: int, dp: int) -> dict:
    if w1.is_meta:  # compile: the recipe says how to build them (dsv4c.convert.CheckpointExperts)
        return {f: torch.empty(s, dtype=dt, device="meta") for f, (s, dt) in field_specs(kfmt, w1.shape[0], ip, dp).items()}
    return quantize_stack(kfmt, w1, w3, w2, ip, dp)


def _activation_scales(gm: GraphModule, module: str, w1, w3, limit: float, ctx: PassContext,
                       act_amax: dict | None) -> tuple[dict, dict | None]:
    """W4A4's static global scales as graph weights ({field: tensor}) and their record (None on the meta
    device: compile sets them when the weights stream, `CheckpointExperts.activation`)."""
    if w1.is_meta:
        return {f: torch.empty((1,), dtype=torch.float32, device="meta") for f in ACT_FIELDS}, None
    norm_name = norm_weight_name(module)
    try:
        norm = get_param(gm, norm_name)
    except AttributeError:
        raise QuantizeError(f"{module}: nvfp4_w4a4 needs the norm weight {norm_name} for its activation "
                            f"scale bound, and the graph has none") from None
    rec = given_activation_record(ctx.config, module, norm, w1, w3, limit, act_amax)
    return {f: torch.tensor([rec[f]], dtype=torch.float32, device=w1.device) for f in ACT_FIELDS}, rec


def _rewrite(gm: GraphModule, node: Node, fmt: str, kfmt: str, ctx: PassContext, act_amax: dict | None) -> dict:
    x, idx, weight, n1, n3, n2, limit = node.args
    names = {"w1": n1.target, "w3": n3.target, "w2": n2.target}
    w1, w3, w2 = (get_param(gm, names[k]) for k in ("w1", "w3", "w2"))
    e, i, d = w1.shape
    a = ALIGN[kfmt]
    ip, dp = padded(i, a), padded(d, a)
    module = names["w1"].rsplit(".", 1)[0]
    values = _new_weights(kfmt, w1, w3, w2, ip, dp)
    act = None
    if kfmt == "nvfp4_w4a4":
        scales, act = _activation_scales(gm, module, w1, w3, float(limit), ctx, act_amax)
        values.update(scales)
    xdt = x.meta["val"].dtype
    with gm.graph.inserting_before(node):
        xb = x if xdt == torch.bfloat16 else _call(gm, x, aten.to.dtype, (x, torch.bfloat16))
        if dp != d:
            xb = _call(gm, x, aten.constant_pad_nd.default, (xb, [0, dp - d], 0.0),
                       shape_fn=lambda t, pad, value: t.new_empty((*t.shape[:-1], t.shape[-1] + pad[1])))
        attrs = {f: _attr(gm, x, f"{module}.{kfmt}.{f}", v) for f, v in values.items()}
        args = (xb, idx, weight, kfmt, attrs["w13"], attrs.get("w13_scale"), attrs.get("w13_global"), attrs["w2"],
                attrs.get("w2_scale"), attrs.get("w2_global"), attrs.get("input_scale_13"),
                attrs.get("input_scale_2"), float(limit))
        y = _call(gm, x, torch.ops.dsv4c.moe_experts_q.default, args)
        if dp != d:
            y = _call(gm, x, aten.slice.Tensor, (y, 1, 0, d))
        if xdt != torch.bfloat16:
            y = _call(gm, x, aten.to.dtype, (y, xdt))
    node.replace_all_uses_with(y)
    erase_unused(gm, [node])
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for n in names.values():
        if n not in used:
            delete_param(gm, n)
    layer, mtp = _layer_of(module, ctx)
    tensors = {f: f"{module}.{kfmt}.{f}" for f in values}
    return {"module": module, "node": node.name, "layer": layer, "mtp": mtp, "format": fmt, "kernel_format": kfmt,
            "scale": SCALE_KIND[kfmt], "experts": e, "dims": {"I": i, "D": d}, "padded": {"I": ip, "D": dp},
            "sources": names, "tensors": tensors, "limit": float(limit),
            **({"activation_scales": act} if act is not None else {})}


def quant_map_entry(rec: dict, graph_kind: str) -> dict:
    """The manifest's view of one rewritten module."""
    return {"format": rec["format"], "kernel_format": rec["kernel_format"], "scale": rec["scale"],
            "layer": rec["layer"], "mtp": rec["mtp"], "experts": rec["experts"], "dims": rec["dims"],
            "padded": rec["padded"], "tensors": sorted(rec["tensors"].values()), "graphs": [graph_kind],
            **({"activation_scales": rec["activation_scales"]} if "activation_scales" in rec else {})}


def quantize_experts_as(fmt: str, act_amax: dict[str, tuple[float, float]] | None = None
                        ) -> Callable[[GraphModule, PassContext], PassResult]:
    """The pass for an explicit expert format (tests, comparisons); `quantize_experts` reads the target's.
    `act_amax` {experts module: (amax x, amax h)}, e.g. from `calibrate_activations`, sets W4A4's static
    activation scales of in-memory weights (x ACT_MARGIN, capped at the bound) instead of the bound alone."""
    if fmt not in KERNEL_FORMAT:
        raise ValueError(f"expert format: expected one of {sorted(KERNEL_FORMAT)}, got {fmt!r}")

    def run(gm: GraphModule, ctx: PassContext) -> PassResult:
        return _quantize(gm, ctx, fmt, act_amax)

    return run


def quantize_experts(gm: GraphModule, ctx: PassContext) -> PassResult:
    from dsv4c.targets import get_target

    target = get_target(ctx.target)
    if ctx.expert_format is not None:  # compile --expert-format: the same capability check
        target = dataclasses.replace(target, expert_format=ctx.expert_format)
    check_format(target)
    override = dict(ctx.kernels).get("moe_experts")
    if override is not None:
        return PassResult(gm, False, {"skipped": f"--kernel moe_experts={override}: unquantised experts requested",
                                      "format": "reference", "layers": [], "quant_map": {}})
    return _quantize(gm, ctx, target.expert_format)


def _quantize(gm: GraphModule, ctx: PassContext, fmt: str, act_amax: dict | None = None) -> PassResult:
    from dsv4c.kernels import moe_grouped  # noqa: F401  (registers dsv4c::moe_experts_q)

    from dsv4c.model import register_ops

    register_ops()
    kfmt = KERNEL_FORMAT[fmt]
    if kfmt is None:
        return PassResult(gm, False, {"format": fmt, "layers": [], "quant_map": {}})
    layers = [_rewrite(gm, n, fmt, kfmt, ctx, act_amax) for n in _expert_nodes(gm)]
    if layers:
        gm.recompile()
    qmap = {r["module"]: quant_map_entry(r, ctx.graph_kind) for r in layers}
    return PassResult(gm, bool(layers), {"format": fmt, "kernel_format": kfmt, "layers": layers, "quant_map": qmap})


# ---- the artifact's quant map (dsv4c/compile.py) ----------------------------------------------
def merge_quant_map(qmap: dict, records, graph: str) -> dict:
    """Add one graph's quantize_experts record to the artifact quant map:
    {"expert_format", "modules": {module: entry}, "layers": [...], "mtp_layers": [...]}."""
    for r in records:
        if r.name != "quantize_experts" or not r.stats.get("quant_map"):
            continue
        qmap.setdefault("expert_format", r.stats["format"])
        mods = qmap.setdefault("modules", {})
        for module, entry in r.stats["quant_map"].items():
            if module in mods:
                mods[module]["graphs"] = sorted(set(mods[module]["graphs"]) | {graph})
            else:
                mods[module] = {**entry, "graphs": [graph]}
        qmap["layers"] = sorted({m["layer"] for m in mods.values() if not m["mtp"]})
        qmap["mtp_layers"] = sorted({m["layer"] for m in mods.values() if m["mtp"]})
    return qmap


def describe_quant_map(qmap: dict) -> str:
    """One line for `dsv4c inspect`."""
    if not qmap or not qmap.get("modules"):
        return "none (routed experts unquantised: reference op)"
    mods = qmap["modules"].values()
    kinds = sorted({(m["kernel_format"], m["scale"]) for m in mods})
    padded = sum(m["padded"] != m["dims"] for m in mods)
    return (f"routed experts {qmap['expert_format']} in {len(qmap['modules'])} modules: layers {qmap['layers']}, "
            f"MTP layers {qmap['mtp_layers']}" + (f", {padded} zero-padded" if padded else "")
            + "; " + "; ".join(f"{k}: {s}" for k, s in kinds))
