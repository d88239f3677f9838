"""Swap each dsv4c op for the implementation the target names (`Target.kernels`).

    before:  v4_attention(q, kv, slots, pos0, n_real, ring, ...)            # reference: loops, int() syncs
    after:   v4_attention_static(q, kv, slots, pos0, n_real, ring, ...)     # fixed shapes, no host sync

The two ops take the same arguments and compute the same function (tests/test_static_ops.py checks
each pair on random state), so swapping the call target is the whole rewrite. The swap applies to every
graph: decode, verify and MTP (a fixed number of tokens per row) and prefill, whose chunks may be longer
than the window ring (the static and fused attention keep each row's newest S real positions in the
ring, as the reference does). Prefill keeps its routed experts as they are (`moe_experts`' `gathered`
form is for decode-sized batches; quantize_experts already chose the prefill kernels: `DECODE_ONLY`). The static
cache ops write what they must not write to the cache's last slot (dsv4c/model/static_ops.py: the
scratch slot), which the runtime reserves.

Implementations per op (the names a target may use):
    reference   the op as exported (dsv4c/model/*_ops.py, moe.py)
    static      `<op>_static`: the capture-safe cache ops
    gathered    `moe_experts_gathered`: capture-safe experts for decode-sized batches
    fused       `<op>_fused`: one or two Triton launches computing the capture-safe op's function
                (kernels/rope.py, v4_attention.py, v4_compress.py, v4_indexer.py, linear_f32.py); CPU
                tensors run the reference
"""
from __future__ import annotations

from collections import Counter

import torch
from torch.fx import GraphModule

from dsv4c.passes import PassContext, PassResult
from dsv4c.passes.split_at_routers import op_name

# (op, implementation) -> the dsv4c op that implements it
IMPLEMENTATIONS: dict[tuple[str, str], str] = {
    ("v4_attention", "static"): "v4_attention_static",
    ("v4_compress", "static"): "v4_compress_static",
    ("mla_cache_update", "static"): "mla_cache_update_static",
    ("dsa_cache_update", "static"): "dsa_cache_update_static",
    ("moe_experts", "gathered"): "moe_experts_gathered",
    ("head_rms_rope", "fused"): "head_rms_rope_fused",
    ("v4_indexer_topk", "fused"): "v4_indexer_topk_fused",
    ("v4_attention", "fused"): "v4_attention_fused",
    ("v4_attention", "fused_det"): "v4_attention_fused_det",  # batch-invariant split (deterministic mode)
    ("v4_compress", "fused"): "v4_compress_fused",
    ("linear_f32", "fused"): "linear_f32_fused",  # kernels/linear_f32.py: the one-token GEMV (GEMV_MAX_ELEMENTS)
    # paged caches (dsv4c.model.common.PagedLayout): the op's implementation follows its slot form's
    ("v4_attention_paged", "static"): "v4_attention_paged_static",
    ("v4_attention_paged", "fused"): "v4_attention_paged_fused",
    ("v4_compress_paged", "static"): "v4_compress_paged_static",
    ("v4_compress_paged", "fused"): "v4_compress_paged_fused",
    ("v4_indexer_topk_paged", "fused"): "v4_indexer_topk_paged_fused",
    ("mla_cache_update_paged", "static"): "mla_cache_update_paged_static",
    ("dsa_cache_update_paged", "static"): "dsa_cache_update_paged_static",
}
# not lowered in prefill graphs: moe_experts' `gathered` form moves T·K expert matrices (decode-sized batches only)
DECODE_ONLY = ("moe_experts",)
PAGED_SUFFIX = "_paged"  # `<op>_paged` takes the implementation the target names for `<op>`


def implementation_op(op: str, impl: str):
    """The OpOverload implementing `op` ("v4_attention") as `impl` ("static"); ValueError if unknown."""
    if impl == "reference":
        return getattr(torch.ops.dsv4c, op).default
    name = IMPLEMENTATIONS.get((op, impl))
    if name is None:
        known = sorted(i for o, i in IMPLEMENTATIONS if o == op)
        raise ValueError(f"target kernel for {op}: unknown implementation {impl!r} (known: reference, {known})")
    return getattr(torch.ops.dsv4c, name).default


def select_kernels(gm: GraphModule, ctx: PassContext) -> PassResult:
    from dsv4c.model import register_ops
    from dsv4c.targets import get_target

    register_ops()
    kernels = {**get_target(ctx.target).kernels, **dict(ctx.kernels)}
    if ctx.graph_kind == "prefill":
        for op in DECODE_ONLY:
            kernels.pop(op, None)
    swapped: Counter = Counter()
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        name = op_name(n.target)
        if not name.startswith("dsv4c."):
            continue
        op = name.split(".", 1)[1]
        impl = kernels.get(op.removesuffix(PAGED_SUFFIX) if op.endswith(PAGED_SUFFIX) else op, "reference")
        if impl == "reference":
            continue
        n.target = implementation_op(op, impl)
        swapped[f"{op} -> {impl}"] += 1
    if swapped:
        gm.recompile()
    return PassResult(gm, bool(swapped), {"swapped": dict(swapped)})
