"""Run the dense linears whose checkpoint weights are FP8 blocks on FP8 GEMMs (issue 28, quant_formats.md §2-3).

Before (a bias-free linear on a weight the release checkpoint stores as e4m3 + 128x128 scales:
attention wq_a, wq_b, wkv, wo_b, indexer wq_b, shared-expert w1/w2/w3, MTP e_proj/h_proj; fused
groups of those from passes/fuse_projections.py):
    y = linear(x, W [N, K])            or   y = matmul(x, t(W))   (the shared expert's w2)
After (`fp8_block`: W8A8, x quantised per token and 128-wide K block; `fp8_block_w8a16`: W8A16):
    y = dsv4c.fp8_linear_w8a8(x, W.w_q [N, K] e4m3, W.w_s [ceil(N/128), ceil(K/128)] scale)
    y = dsv4c.fp8_linear_w8a16(x, W.w_q, W.w_s)
V4's grouped wo_a (after passes/lower_grouped_linear.py; the release stores it as e4m3 [G·R, I]):
    z = dsv4c.grouped_linear(x, unflatten(W, 0, [G, R]))
 -> z = dsv4c.fp8_grouped_linear(x, W.w_q [G·R, I], W.w_s, z's dtype)   # W8A16 in both FP8 formats
(kernels/grouped_linear.py); deterministic graphs keep it (grouped_linear_bi has no FP8 form).
Both linear ops keep x's dtype and leading dims (kernels/fp8_gemm.py; on CUDA up to 64 token rows the
split-K decode kernels of kernels/fp8_gemv.py; W8A16 from DEQUANT_M rows cuBLAS on the weight widened
per call). W leaves the graph.

Why it is valid: the ops compute x @ dequant(w_q, w_s)^T. When W's values are FP8-block values (a
model loaded from the release checkpoint, whose stored bytes these are), dequant(w_q, w_s) == W
exactly, so W8A16 differs from the linear only by accumulation order and the kernel's bf16 input;
W8A8 adds the e4m3 rounding of x (1x128 ue8m0 scales). kernels/tolerances.py bounds both
(`dense_w8a16`, `dense_w8a8`); fp8_grouped_linear computes the einsum on dequant(w_q, w_s) viewed [G, R, I],
which is W for FP8-block values. That rounding is W8A8's whole accuracy cost, not a defect: one linear
on Gaussian activations is ~31.5 dB SNR (fp32 activation scales: 31.8; bf16 output rounding alone
~55), and a W8A8 linear adds an independent noise source in series with the routed experts' own
(fp8_block experts quantise their inputs too): 5 per layer (wq_a ‖ wkv, wq_b, wo_b, w1 ‖ w3, w2)
beside the experts' 2 predicts 10 log10(7/2) = 5.4 dB off the logits' SNR, as the slice lost on the
H200 (20.2 -> 15.2 dB). The tiny test model: W8A16 0 error, W8A8 27.1 dB (28.4 with fp32 scales). A fused weight is the row-concatenation of its members; its FP8 form
is the concatenation of the members' stored rows and scale rows only when every member but the last
has a multiple of 128 rows (the scale tiles then do not straddle members) and every member is FP8 in
the checkpoint; otherwise the fused linear stays as it is (recorded in `stats["kept"]`). W8A8 needs
K % 128 == 0 (the activation blocks); a linear with another K runs W8A16 and says so
(`quant_map[...]["kernel"]`, `["why"]`). The LM head, router, compressor/indexer-compressor
projections and the mHC mixers are not FP8 in the release and stay as stored.

Which format: `ctx.dense_format` (compile --dense-format), else the target's `dense_format`
(dsv4c/targets.py), except in deterministic graphs (`ctx.deterministic`), whose default is `bf16`
(`fp8_block_w8a16` there is opt-in: make_batch_invariant turns it into `fp8_linear_bi`, 0.96x / 1.01x
the bf16-dense deterministic step's time at batch 1 / 64 on a 2-layer slice, BENCHMARKS.md). `reference`
and `bf16` rewrite nothing.

Weights: the pass does not convert checkpoints. With real weights in the graph (tests, `dsv4c
compare`) it quantises them to FP8 blocks now (exact for FP8-block values); on the meta device
(`dsv4c compile`) it records a recipe per new weight (`RECIPE`, with the member weights) and
compile streams the checkpoint's stored FP8 bytes and scales (dsv4c.checkpoint.read_fp8_block).
Compile passes `ctx.fp8_stored`, the weights this checkpoint really stores in FP8 (its headers): a
bf16 checkpoint gets no rewrite, since there are no FP8 bytes to keep; without it (in-memory
weights) the release layout's FP8 weights are the candidates.

Stats: `linears` (one record per rewrite), `kept` (FP8-eligible linears left alone, with the
reason) and `quant_map` {weight: entry}, which compile merges into manifest["quant_map"]["dense"].
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch.fx import GraphModule, Node

from dsv4c import quant as Q
from dsv4c.passes import PassContext, PassResult, delete_param, erase_unused, fake_value, get_param, set_param

aten = torch.ops.aten
RECIPE = "dense_fp8"  # the recipe kind compile.py streams
B = Q.FP8_BLOCK
KERNEL = {"fp8_block": "w8a8", "fp8_block_w8a16": "w8a16"}  # dense_format -> GEMM; others: no rewrite
DENSE_FORMATS = ("reference", "bf16", *KERNEL)


class DenseFormatError(ValueError):
    """An unknown dense format; the message names the field."""


def check_dense_format(fmt: str, where: str = "dense_format") -> None:
    if fmt not in DENSE_FORMATS:
        raise DenseFormatError(f"{where}: expected one of {list(DENSE_FORMATS)}, got {fmt!r}")


def deterministic_dense_format(fmt: str) -> str:
    """The dense format a deterministic graph runs when none is asked for: `fmt` if it rewrites nothing,
    else bf16 (`fp8_linear_bi` is opt-in: no faster at batch 64, BENCHMARKS.md)."""
    return fmt if fmt in ("reference", "bf16") else "bf16"


def scale_dtype(cfg) -> torch.dtype:
    """The FP8 weight scales' graph dtype: ue8m0 as uint8 bytes (V4, ue8m0 V3 checkpoints; torch 2.11's
    export serialiser has no float8_e8m0fnu), else fp32 (V3 weight_scale_inv)."""
    qc = cfg.quantization_config
    return torch.uint8 if cfg.is_v4 or (qc is not None and qc.scale_fmt == "ue8m0") else torch.float32


def _canonical(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def _weight_attr(w: Node) -> Node | None:
    """The get_attr behind a linear's weight argument (through dtype casts)."""
    while isinstance(w, Node) and w.op == "call_function" and w.target is aten.to.dtype:
        w = w.args[0]
    return w if isinstance(w, Node) and w.op == "get_attr" else None


def _site(n: Node) -> tuple[Node, Node] | None:
    """(x, weight get_attr) of a bias-free `linear(x, W)` or `matmul(x, t(W))`, else None."""
    if n.op != "call_function":
        return None
    if n.target is aten.linear.default and (len(n.args) == 2 or n.args[2] is None) and not n.kwargs:
        w = _weight_attr(n.args[1])
    elif (n.target is aten.matmul.default and isinstance(n.args[1], Node)
          and n.args[1].op == "call_function" and n.args[1].target is aten.t.default):
        w = _weight_attr(n.args[1].args[0])
    else:
        return None
    return (n.args[0], w) if w is not None else None


def _members(w: Node) -> tuple[list[str], list[int]]:
    """The checkpoint weights behind a graph weight and their row counts (fuse_projections' groups)."""
    if "fused_members" in w.meta:
        names, sizes = w.meta["fused_members"]
        return list(names), list(sizes)
    return [w.target], [None]


def _why_not(cfg, members: list[str], sizes: list, users: int, fp8_stored: frozenset[str] | None = None) -> str | None:
    from dsv4c.checkpoint import release_format

    def is_fp8(name: str) -> bool:
        c = _canonical(name)
        return c in fp8_stored if fp8_stored is not None else release_format(cfg, c) == "fp8"

    not_fp8 = [m for m in members if not is_fp8(m)]
    if len(not_fp8) == len(members):
        return ""  # not an FP8 weight at all: not a candidate
    if not_fp8:
        return f"fused with members the checkpoint does not store in FP8: {[_canonical(m) for m in not_fp8]}"
    ragged = [(m, s) for m, s in zip(members[:-1], sizes[:-1]) if s % B]
    if ragged:
        return f"fused members' row blocks do not align to {B}: {[(_canonical(m), s) for m, s in ragged]}"
    if users != 1:
        return f"the weight has {users} users"
    return None


def _quantized(cfg, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_q, w_s) of an in-memory weight; meta tensors of the right shape on the meta device."""
    n, k = w.shape
    sdt = scale_dtype(cfg)
    if w.is_meta:
        return (torch.empty((n, k), dtype=torch.float8_e4m3fn, device="meta"),
                torch.empty((-(-n // B), -(-k // B)), dtype=sdt, device="meta"))
    q, s = Q.quant_fp8_block(w.detach().float(), scale_fmt="ue8m0" if sdt == torch.uint8 else "fp32")
    return q, s.view(torch.uint8) if sdt == torch.uint8 else s


def _attr(gm: GraphModule, ref: Node, name: str, value: torch.Tensor) -> Node:
    set_param(gm, name, value)
    node = gm.graph.get_attr(name)
    node.meta["val"] = fake_value(ref, lambda t: t, value)
    return node


def _swap_in_fp8(gm: GraphModule, n: Node, x: Node, w: Node, op, extra: tuple, dead: list[Node], kernel: str,
                 members: list[str], ctx: PassContext, **rec) -> dict:
    """Replace node n by op(x, W.w_q, W.w_s, *extra) on W's FP8 form (get_attrs `<base>.w_q`, `.w_s`), erase
    n and the `dead` nodes it leaves unused, drop W once nothing reads it; -> the pass's record of it."""
    W = get_param(gm, w.target)
    base = w.target[: -len(".weight")] if w.target.endswith(".weight") else w.target
    w_q, w_s = _quantized(ctx.config, W)
    with gm.graph.inserting_before(n):
        q_node = _attr(gm, x, f"{base}.w_q", w_q)
        s_node = _attr(gm, x, f"{base}.w_s", w_s)
        y = gm.graph.call_function(op, (x, q_node, s_node, *extra))
        y.meta["val"] = n.meta["val"]
    n.replace_all_uses_with(y)
    erase_unused(gm, [n, *dead])
    if not any(u.op == "get_attr" and u.target == w.target for u in gm.graph.nodes):
        delete_param(gm, w.target)
    return {"weight": w.target, "node": n.name, "kernel": kernel, "members": members, "shape": list(W.shape),
            "tensors": {"w_q": f"{base}.w_q", "w_s": f"{base}.w_s"}, "scale": str(w_s.dtype).replace("torch.", ""),
            **rec}


def _rewrite(gm: GraphModule, n: Node, x: Node, w: Node, kernel: str, ctx: PassContext,
             members: list[str]) -> dict:
    k = get_param(gm, w.target).shape[1]
    why = {}
    if kernel == "w8a8" and k % B:
        kernel, why = "w8a16", {"why": f"K = {k} is not a multiple of {B} (W8A8's activation blocks)"}
    op = torch.ops.dsv4c.fp8_linear_w8a8.default if kernel == "w8a8" else torch.ops.dsv4c.fp8_linear_w8a16.default
    return _swap_in_fp8(gm, n, x, w, op, (), [], kernel, members, ctx, **why)


def _grouped_site(n: Node) -> tuple[Node, Node, Node] | None:
    """(x, unflatten, weight get_attr) of `dsv4c.grouped_linear(x, unflatten(W, 0, [G, R]))` (V4's wo_a after
    passes/lower_grouped_linear.py), else None."""
    if n.op != "call_function" or n.target is not torch.ops.dsv4c.grouped_linear.default:
        return None
    u = n.args[1]
    if not (isinstance(u, Node) and u.op == "call_function" and u.target is aten.unflatten.int and u.args[1] == 0
            and len(u.users) == 1):
        return None
    w = _weight_attr(u.args[0])
    return (n.args[0], u, w) if w is not None else None


def _rewrite_grouped(gm: GraphModule, n: Node, x: Node, u: Node, w: Node, fmt: str, ctx: PassContext) -> dict:
    """grouped_linear(x, unflatten(W)) -> fp8_grouped_linear(x, W.w_q, W.w_s, dtype): the stored [G·R, I] bytes."""
    why = {"why": "the grouped wo_a has no W8A8 kernel: W8A16"} if fmt == "fp8_block" else {}
    return _swap_in_fp8(gm, n, x, w, torch.ops.dsv4c.fp8_grouped_linear.default, (n.meta["val"].dtype,), [u],
                        "w8a16", [w.target], ctx, grouped=True, **why)


def quant_map_entry(rec: dict, fmt: str, graph_kind: str) -> dict:
    """The manifest's view of one rewritten weight."""
    return {"dense_format": fmt, "kernel": rec["kernel"], "scale": rec["scale"], "shape": rec["shape"],
            "members": [_canonical(m) for m in rec["members"]], "tensors": sorted(rec["tensors"].values()),
            "graphs": [graph_kind], **({"why": rec["why"]} if "why" in rec else {})}


def quantize_dense_as(fmt: str) -> Callable[[GraphModule, PassContext], PassResult]:
    """The pass for an explicit dense format (tests, comparisons); `quantize_dense` reads the target's."""
    check_dense_format(fmt, "dense format")

    def run(gm: GraphModule, ctx: PassContext) -> PassResult:
        return _quantize(gm, ctx, fmt)

    return run


def quantize_dense(gm: GraphModule, ctx: PassContext) -> PassResult:
    from dsv4c.targets import get_target

    if ctx.dense_format is not None:
        fmt, where = ctx.dense_format, "--dense-format"
    elif ctx.deterministic:
        fmt, where = deterministic_dense_format(get_target(ctx.target).dense_format), "deterministic mode"
    else:
        fmt, where = get_target(ctx.target).dense_format, f"target {ctx.target}: dense_format"
    check_dense_format(fmt, where)
    return _quantize(gm, ctx, fmt)


def _quantize(gm: GraphModule, ctx: PassContext, fmt: str) -> PassResult:
    from dsv4c.kernels import fp8_gemm  # noqa: F401  (registers dsv4c::fp8_linear_*)

    kernel = KERNEL.get(fmt)
    if kernel is None:
        return PassResult(gm, False, {"format": fmt, "linears": [], "kept": [], "quant_map": {}})
    from dsv4c.kernels import grouped_linear  # noqa: F401  (registers dsv4c::fp8_grouped_linear)

    done, kept = [], []
    for n in list(gm.graph.nodes):
        grouped = _grouped_site(n)
        if grouped is not None:
            x, u, w = grouped
            why = _why_not(ctx.config, [w.target], [None], len(w.users), ctx.fp8_stored)
            if why is None and ctx.deterministic:
                why = "deterministic mode: no batch-invariant FP8 grouped kernel (grouped_linear_bi runs bf16)"
            if why is None:
                done.append(_rewrite_grouped(gm, n, x, u, w, fmt, ctx))
            elif why:  # "": not an FP8-stored weight, not a candidate
                kept.append({"weight": w.target, "why": why})
            continue
        site = _site(n)
        if site is None:
            continue
        x, w = site
        members, sizes = _members(w)
        why = _why_not(ctx.config, members, sizes, len(w.users), ctx.fp8_stored)
        if why == "":
            continue
        if why is not None:
            kept.append({"weight": w.target, "why": why})
            continue
        done.append(_rewrite(gm, n, x, w, kernel, ctx, members))
    if done:
        gm.recompile()
    qmap = {r["weight"]: quant_map_entry(r, fmt, ctx.graph_kind) for r in done}
    return PassResult(gm, bool(done), {"format": fmt, "linears": done, "kept": kept, "quant_map": qmap})


# ---- the artifact's quant map (dsv4c/compile.py) ----------------------------------------------
def merge_dense_quant_map(qmap: dict, records, graph: str) -> dict:
    """Add one graph's quantize_dense record to the artifact quant map's `dense` section:
    {"dense_format", "modules": {weight: entry}} (not "format": that key names expert formats)."""
    for r in records:
        if r.name != "quantize_dense" or not r.stats.get("quant_map"):
            continue
        dense = qmap.setdefault("dense", {"dense_format": r.stats["format"], "modules": {}})
        for name, entry in r.stats["quant_map"].items():
            mods = dense["modules"]
            if name in mods:
                mods[name]["graphs"] = sorted(set(mods[name]["graphs"]) | {graph})
            else:
                mods[name] = {**entry, "graphs": [graph]}
    return qmap


def describe_dense(qmap: dict) -> str:
    """One line for `dsv4c inspect`."""
    dense = (qmap or {}).get("dense")
    if not dense or not dense.get("modules"):
        return "dense linears as stored in bf16 (no FP8 rewrite)"
    mods = dense["modules"].values()
    kernels = sorted({m["kernel"] for m in mods})
    params = sum(m["shape"][0] * m["shape"][1] for m in mods)
    src = sorted({m.get("source", "in-memory weights") for m in mods})
    return (f"dense linears {dense['dense_format']} in {len(dense['modules'])} weights ({params / 1e6:.1f} M params, "
            f"kernels {', '.join(kernels)}, scales {sorted({m['scale'] for m in mods})}); source: {'; '.join(src)}")


def with_dense_format(target, fmt: str | None):
    """The target with `dense_format` overridden by hand (compile --dense-format)."""
    if fmt is None or fmt == target.dense_format:
        return target
    check_dense_format(fmt, "--dense-format")
    return dataclasses.replace(target, dense_format=fmt)
