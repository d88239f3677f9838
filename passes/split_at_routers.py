"""Split a graph at its MoE routers into static and dynamic segments (design.md: "split at routers").

The routed experts of every MoE layer are one op, `dsv4c::moe_experts`: how many tokens each expert
gets depends on the data, so that op is the *dynamic* segment of its layer. Everything between two
of them is a *static* segment: plain ATen plus the attention/cache custom ops, with shapes fixed by
the batch bucket. A static segment is what the runtime captures as a CUDA graph (one per bucket,
`dsv4c.runtime.segments.SegmentExecutor`); dynamic segments run eagerly in between.

    plan = plan_segments(gm, ctx)     # SegmentPlan: which nodes, values and caches each segment has
    print(plan)                       # a table;  plan.graph() -> networkx.DiGraph;  plan.to_dot()
    split = apply_plan(gm, plan)      # parent GraphModule calling submod_0, submod_1, ... in order

`split` takes the same `(ids, slots, pos0, n_real, caches)` as `gm`, returns the same outputs and
mutates the caller's cache tensors in place: the cache tensors are passed down into the submodules
unchanged and the mutating custom ops stay inside them.

Capturability is decided per op (`OP_CAPTURE`). The reference ops loop over sequences in Python
and read positions with `int()` (a host sync), so segments that hold them are recorded as not
capturable, with the op named in the reason. `dsv4c.passes.select_kernels` runs before this and
swaps in the implementations the target names (`Target.kernels`): the `*_static` cache ops and a
capture-safe expert op. The same plan code then marks those segments capturable.

Value roles (what a runtime has to do with each segment input/output when it pads a batch to a
bucket of B_pad rows; `SegmentValue.role`):
  padded  per-row or per-token activations (ids, hidden streams, router outputs): B_pad rows, the
          padded rows computed and dropped;
  real    inputs/outputs of a dynamic segment with one row per token: sized to the *real* tokens
          (B_real * T rows), so padded rows reach no expert and stay out of the tokens-per-expert
          counts (design.md's padding contract);
  meta    per-sequence metadata `slots`, `pos0`, `n_real` [B]: padded rows get n_real = 0 (they
          write nothing), pos0 = 0 and a slot of the runtime's choice;
  cache   static cache buffers [n_slots, ...], mutated in place; their addresses must not change;
  weight  parameters and buffers (static), get_attr or lifted `weights` inputs;
  size    Python/symbolic ints derived from the bucket shape (constant per bucket);
  static  tensors of fixed shape computed inside the graph (e.g. fp32 copies of weights).
"""
from __future__ import annotations

import copy
import re
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch.fx import GraphModule, Node
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4c.passes import PassContext, PassResult

MOE_OP = "dsv4c.moe_experts"
# every implementation of the routed experts: a router boundary whichever one the target chose
MOE_OPS = frozenset({MOE_OP, "dsv4c.moe_experts_gathered", "dsv4c.moe_experts_q", "dsv4c.moe_experts_bi",
                     "dsv4c.moe_experts_fp4_bi"})
META_INPUTS = ("slots", "pos0", "n_real")
CACHE_PREFIX = "caches_"

# ---- capture safety, per op -------------------------------------------------------------------
# Capture safety of each dsv4c custom op. None means capture-safe (static shapes, no host sync); a
# string says why it is not. The entries were measured with `host_sync_ops` (tests/test_split.py
# checks the table against the implementations).
OP_CAPTURE: dict[str, str | None] = {
    "dsv4c.v4_attention": "reference op dsv4c.v4_attention syncs the host (int() of slots/pos0/n_real per row)",
    "dsv4c.v4_compress": "reference op dsv4c.v4_compress syncs the host (int() of slots/pos0/n_real per row)",
    "dsv4c.mla_cache_update": "reference op dsv4c.mla_cache_update syncs the host (boolean-mask indexing)",
    "dsv4c.dsa_cache_update": "reference op dsv4c.dsa_cache_update syncs the host (boolean-mask indexing)",
    "dsv4c.moe_experts": "reference op dsv4c.moe_experts syncs the host (per-expert token counts: "
                         "data-dependent tokens per expert)",
    # measured capture-safe: gathers, einsum, masked top-k of fixed size, no int()/nonzero
    "dsv4c.v4_indexer_topk": None,
    "dsv4c.dsa_topk": None,
    "dsv4c.head_rms_rope": None,
    # dsv4c/model/static_ops.py, selected by passes/select_kernels.py
    "dsv4c.v4_attention_static": None,
    "dsv4c.v4_compress_static": None,
    "dsv4c.mla_cache_update_static": None,
    "dsv4c.dsa_cache_update_static": None,
    "dsv4c.moe_experts_gathered": None,
    "dsv4c.linear_f32": None,  # passes/lower_f32_linears.py: one cuBLAS call
    "dsv4c.linear_f32_fused": None,  # kernels/linear_f32.py (`fused`): one Triton launch at one token, else cuBLAS
    # kernels/moe_grouped.py (passes/quantize_experts.py): on CUDA, device routing prep + Triton grids
    # fixed by shapes (worst-case M-blocks), no host sync. Its CPU fallback (reference math, with an
    # int() range check) is not what this entry claims; tests/test_quantize_experts.py checks the CUDA path.
    "dsv4c.moe_experts_q": None,
    # kernels/batch_invariant.py, mhc.py (passes/make_batch_invariant.py, deterministic mode): Triton grids
    # fixed by the shapes, no host sync
    "dsv4c.linear_bi": None,
    "dsv4c.fp8_linear_bi": None,  # bi_matmul's launch on FP8 block weights
    "dsv4c.grouped_linear_bi": None,
    "dsv4c.moe_experts_bi": None,
    "dsv4c.moe_experts_fp4_bi": None,  # kernels/moe_fp4_gemv.py on CUDA, as moe_experts_q's GEMV path
    "dsv4c.moe_experts_fp8_bi": None,  # kernels/moe_grouped.py on CUDA with one tile, as moe_experts_q
    "dsv4c.sum_bi": None,
    "dsv4c.hc_pre_rows": None,
    "dsv4c.hc_post_bi": None,
    "dsv4c.rms_norm_bi": None,
    "dsv4c.sinkhorn_bi": None,
    # kernels/mhc.py (passes/fuse_sinkhorn.py): one Triton launch, grid fixed by the shape
    "dsv4c.sinkhorn": None,
    # kernels/mhc.py, norm.py, rope.py (passes/fuse_hc.py, fuse_rmsnorm.py, fuse_rope.py): Triton launches,
    # grids fixed by the shapes
    "dsv4c.hc_pre": None,
    "dsv4c.hc_post": None,
    "dsv4c.hc_head": None,  # passes/fuse_hc.py: hc_pre's launches
    "dsv4c.hc_post_pre": None,  # passes/fuse_hc_chain.py: two or three of the same launches
    "dsv4c.rms_norm": None,
    "dsv4c.rope_interleaved": None,
    "dsv4c.rope_angles": None,  # kernels/rope_angles.py (passes/fuse_rope_angles.py): one Triton launch
    "dsv4c.route_topk": None,  # kernels/router.py (passes/fuse_router.py): one Triton launch, grid = T
    "dsv4c.route_hashed": None,
    "dsv4c.route_hashed_ids": None,  # the same launch, the hash table lookup inside it
    "dsv4c.swiglu_act": None,  # kernels/swiglu.py (passes/fuse_swiglu.py): one Triton launch, grid fixed by the shape
    "dsv4c.l2_prefetch": None,  # kernels/l2_prefetch.py (passes/prefetch_weights.py): one launch, grid from the sizes
    # kernels/rope.py, v4_attention.py, v4_compress.py, v4_indexer.py (the `fused` implementations,
    # passes/select_kernels.py): Triton launches, grids fixed by the shapes, no host sync
    "dsv4c.head_rms_rope_fused": None,
    "dsv4c.grouped_linear": None,  # kernels/grouped_linear.py (passes/lower_grouped_linear.py): one launch or the einsum
    "dsv4c.fp8_grouped_linear": None,  # the same on FP8 wo_a (passes/quantize_dense.py): one launch or widen+einsum
    # kernels/fp8_gemm.py (passes/quantize_dense.py): act_quant + GEMM launches, grids from shapes, no host sync
    "dsv4c.fp8_linear_w8a8": None,
    "dsv4c.fp8_linear_w8a16": None,
    "dsv4c.v4_attention_fused": None,
    "dsv4c.v4_attention_fused_det": None,  # the same launches with the batch-invariant split
    "dsv4c.v4_compress_fused": None,
    "dsv4c.v4_indexer_topk_fused": None,
    # paged caches (dsv4c.model.common.PagedLayout, runtime/block_pool.py): the same split
    "dsv4c.v4_attention_paged": "reference op dsv4c.v4_attention_paged syncs the host (int() per row)",
    "dsv4c.v4_compress_paged": "reference op dsv4c.v4_compress_paged syncs the host (int() per row)",
    "dsv4c.mla_cache_update_paged": "reference op dsv4c.mla_cache_update_paged syncs the host (boolean-mask indexing)",
    "dsv4c.dsa_cache_update_paged": "reference op dsv4c.dsa_cache_update_paged syncs the host (boolean-mask indexing)",
    "dsv4c.v4_indexer_topk_paged": None,  # a gather through the block table, then the indexer's fixed-size top-k
    "dsv4c.v4_attention_paged_static": None,
    "dsv4c.v4_compress_paged_static": None,
    "dsv4c.mla_cache_update_paged_static": None,
    "dsv4c.dsa_cache_update_paged_static": None,
    "dsv4c.v4_attention_paged_fused": None,
    "dsv4c.v4_compress_paged_fused": None,
    "dsv4c.v4_indexer_topk_paged_fused": None,
}


def op_capture_blocker(op: str) -> str | None:
    """Why the dsv4c op `op` ("dsv4c.v4_attention") cannot be captured in a CUDA graph, or None."""
    if op not in OP_CAPTURE:
        return f"{op} has no capture-safety entry (OP_CAPTURE)"
    return OP_CAPTURE[op]


# ATen ops that read device data on the host (or have data-dependent output shapes).
HOST_SYNC_ATEN = frozenset({
    "aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.masked_select", "aten.unique",
    "aten._unique", "aten._unique2", "aten.unique_dim", "aten.unique_consecutive", "aten.equal",
    "aten.is_nonzero", "aten.bincount", "aten.tolist",
})
_BOOL_INDEX_ATEN = frozenset({"aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"})


def op_name(target) -> str:
    """`torch.ops.ns.op.overload` -> "ns.op" (packet name, overload dropped)."""
    name = getattr(target, "name", None)
    if callable(name):  # OpOverload.name() -> "ns::op.overload"
        full = name()
        return full.split(".")[0].replace("::", ".")
    return getattr(target, "__name__", str(target))


def _syncing_aten(name: str, args) -> str | None:
    """Why an ATen call syncs the host, or None."""
    if name in HOST_SYNC_ATEN:
        return f"{name} syncs the host"
    if name == "aten.repeat_interleave" and len(args) == 1:
        return f"{name} without output_size syncs the host"
    if name in _BOOL_INDEX_ATEN:
        flat = torch.utils._pytree.tree_leaves(args[1:2])
        for a in flat:
            dt = getattr(a, "dtype", None)
            if dt is None and isinstance(a, Node):
                dt = getattr(a.meta.get("val"), "dtype", None)
            if dt in (torch.bool, torch.uint8):
                return f"{name} with a boolean mask syncs the host"
    return None


class _SyncRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        why = _syncing_aten(op_name(func), args)
        if why is not None:
            self.found.append(why)
        return func(*args, **(kwargs or {}))


def host_sync_ops(fn: Callable, *args, **kwargs) -> list[str]:
    """Run `fn` and list the ATen calls it makes that sync the host (int(), nonzero, boolean masks...).
    Call a custom op's Python implementation directly (e.g. `reference_impl("dsv4c.v4_attention")`):
    the mode does not look inside an op dispatched as a whole."""
    rec = _SyncRecorder()
    with rec:
        fn(*args, **kwargs)
    return rec.found


def reference_impl(name: str) -> Callable:
    """The Python implementation behind a dsv4c custom op ("dsv4c.v4_attention")."""
    from torch._library.custom_ops import OPDEFS

    from dsv4c.model import register_ops

    register_ops()
    return OPDEFS[name.replace(".", "::", 1)]._init_fn


def capture_blockers(node: Node, capture_safe: frozenset[str] | None = None) -> list[str]:
    """Why `node` cannot run inside a CUDA graph (empty: it can)."""
    if node.op != "call_function":
        return []
    name = op_name(node.target)
    out = []
    if name.startswith("dsv4c."):
        why = None if capture_safe is not None and name in capture_safe else op_capture_blocker(name)
        if why is not None:
            out.append(why)
    elif isinstance(node.target, torch._ops.HigherOrderOperator):
        out.append(f"{name}: data-dependent control flow")
    elif name.startswith("aten."):
        why = _syncing_aten(name, node.args)
        if why:
            out.append(why)
    val = node.meta.get("val")
    if val is not None:
        from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

        try:
            unbacked = free_unbacked_symbols(val)
        except Exception:  # values that are not tensors/symints
            unbacked = set()
        if unbacked:
            out.append(f"{node.name}: data-dependent shape ({', '.join(sorted(map(str, unbacked)))})")
    return out


# ---- the plan --------------------------------------------------------------------------------
@dataclass(frozen=True)
class SegmentValue:
    """A value that enters or leaves a segment (named by its node in the unsplit graph)."""

    name: str
    role: str  # padded | real | meta | cache | weight | size | static
    shape: str  # symbolic shape ("[3*s72, 64]"), or the int's expression for sizes
    dtype: str
    rows: str | None  # "batch" (dim 0 is B), "tokens" (dim 0 is B*T), or None
    producer: int | None  # segment index; None for graph inputs and weights


@dataclass(frozen=True)
class Segment:
    index: int
    kind: str  # static | dynamic
    nodes: tuple[str, ...]  # compute nodes, graph order
    op_counts: tuple[tuple[str, int], ...]  # (op, count), most frequent first
    inputs: tuple[SegmentValue, ...]  # in the order of the submodule's placeholders
    outputs: tuple[SegmentValue, ...]  # in the order of the submodule's outputs
    capturable: bool
    reason: str
    mutates: tuple[str, ...] = ()  # cache inputs written in place
    caches: tuple[str, ...] = ()  # cache inputs its ops read or write (not counting shape-only guards)
    layer: int | None = None  # the MoE layer of a dynamic segment

    @property
    def submod_name(self) -> str:
        return f"submod_{self.index}"

    @property
    def n_ops(self) -> int:
        return sum(c for _, c in self.op_counts)

    def inputs_by_role(self, role: str) -> tuple[SegmentValue, ...]:
        return tuple(v for v in self.inputs if v.role == role)


@dataclass(frozen=True)
class SegmentPlan:
    """The segments of one graph, in graph order (submodule `submod_{i}` is segment i)."""

    graph_kind: str
    target: str
    segments: tuple[Segment, ...]
    graph_inputs: tuple[SegmentValue, ...]  # the flat placeholders, in order
    graph_outputs: tuple[SegmentValue, ...]  # the flat outputs, in order
    tokens_per_row: int | None  # T of decode/mtp graphs; None when T is dynamic (prefill)
    n_slots: int | None  # cache rows (from the cache inputs' leading dim)
    vocab_size: int

    # -- queries
    @property
    def boundaries(self) -> tuple[str, ...]:
        """The moe_experts nodes the graph is split at."""
        return tuple(s.nodes[0] for s in self.segments if s.kind == "dynamic")

    @property
    def n_capturable(self) -> int:
        return sum(s.capturable for s in self.segments)

    def segment_of(self, node_name: str) -> int:
        for s in self.segments:
            if node_name in s.nodes:
                return s.index
        raise KeyError(node_name)

    def graph(self):
        """Segment dependency graph (networkx.DiGraph): one node per segment with its attributes; an
        edge i -> j when j reads a value i produces (`values`) or touches a cache after i writes it,
        or writes a cache i touched before (`caches`)."""
        import networkx as nx

        g = nx.DiGraph(graph_kind=self.graph_kind, target=self.target)
        for s in self.segments:
            g.add_node(s.index, kind=s.kind, capturable=s.capturable, reason=s.reason, n_ops=s.n_ops,
                       layer=s.layer, submod=s.submod_name)
        for s in self.segments:
            for v in s.inputs:
                if v.producer is not None:
                    _edge(g, v.producer, s.index, "values", v.name)
        touched: dict[str, list[tuple[int, bool]]] = {}
        for s in self.segments:
            for name in s.caches:
                touched.setdefault(name, []).append((s.index, name in s.mutates))
        for cache, uses in touched.items():
            for (a, wa), (b, wb) in zip(uses, uses[1:]):
                if wa or wb:
                    _edge(g, a, b, "caches", cache)
        return g

    def to_dot(self) -> str:
        """The dependency graph as Graphviz DOT text (no pydot needed)."""
        g = self.graph()
        lines = [f'digraph "{self.graph_kind}_segments" {{', "  rankdir=TB;",
                 '  node [shape=box, fontname="monospace"];']
        for i, a in g.nodes(data=True):
            layer = "" if a["layer"] is None else f" L{a['layer']}"
            cap = "capturable" if a["capturable"] else "eager"
            color = "palegreen" if a["capturable"] else ("lightsalmon" if a["kind"] == "dynamic" else "lightgrey")
            lines.append(f'  s{i} [label="{a["submod"]}\\n{a["kind"]}{layer}\\n{a["n_ops"]} ops\\n{cap}", '
                         f'style=filled, fillcolor={color}];')
        for u, v, a in g.edges(data=True):
            label = []
            if a.get("values"):
                label.append(f"{len(a['values'])} values")
            if a.get("caches"):
                label.append(f"{len(a['caches'])} caches")
            style = "" if a.get("values") else ", style=dashed"
            lines.append(f'  s{u} -> s{v} [label="{", ".join(label)}"{style}];')
        lines.append("}")
        return "\n".join(lines) + "\n"

    def __str__(self) -> str:
        T = "dynamic" if self.tokens_per_row is None else str(self.tokens_per_row)
        n_dyn = sum(s.kind == "dynamic" for s in self.segments)
        head = (f"SegmentPlan: {self.graph_kind} graph, target {self.target}, {len(self.segments)} segments "
                f"({n_dyn} dynamic at routers, {self.n_capturable} capturable), tokens/row {T}, "
                f"n_slots {self.n_slots}")
        cols = f"{'seg':>3}  {'kind':7} {'layer':>5} {'ops':>5}  {'act':>3} {'meta':>4} {'cache':>5} {'wt':>3} " \
               f"{'size':>4}  {'out':>3}  {'capt':4}  {'nodes':34}  reason"
        lines = [head, cols, "-" * (len(cols) + 40)]
        for s in self.segments:
            r = Counter(v.role for v in s.inputs)
            act = r["padded"] + r["real"] + r["static"]
            layer = "-" if s.layer is None else str(s.layer)
            span = s.nodes[0] if len(s.nodes) == 1 else f"{s.nodes[0]} .. {s.nodes[-1]}"
            reason = s.reason if len(s.reason) <= 90 else s.reason[:87] + "..."
            lines.append(f"{s.index:>3}  {s.kind:7} {layer:>5} {s.n_ops:>5}  {act:>3} {r['meta']:>4} {r['cache']:>5} "
                         f"{r['weight']:>3} {r['size']:>4}  {len(s.outputs):>3}  {'yes' if s.capturable else 'no':4}  "
                         f"{span[:34]:34}  {reason}")
        lines.append("act: activation inputs (padded to the bucket; 'real' rows for dynamic segments); "
                     "meta: slots/pos0/n_real; wt: weights; size: ints from the bucket shape")
        return "\n".join(lines)


def _edge(g, a: int, b: int, key: str, name: str) -> None:
    if not g.has_edge(a, b):
        g.add_edge(a, b, values=[], caches=[])
    g.edges[a, b][key].append(name)


def _is_moe(n: Node) -> bool:
    return n.op == "call_function" and op_name(n.target) in MOE_OPS


def _expr(x):
    import sympy

    if isinstance(x, torch.SymInt):
        return x.node.expr
    return sympy.Integer(int(x))


def _mutated(n: Node) -> list[Node]:
    from dsv4c.passes import _mutated_args

    return _mutated_args(n) if n.op == "call_function" else []


def plan_segments(gm: GraphModule, ctx: PassContext, *, capture_safe: Iterable[str] | None = None) -> SegmentPlan:
    """Segments of `gm` in graph order: a static segment between routers, one dynamic segment per
    routed-experts node (`MOE_OPS`). `capture_safe` names dsv4c ops to treat as capture-safe whatever
    `OP_CAPTURE` says (tests, and planning for kernels not written yet)."""
    safe = None if capture_safe is None else frozenset(capture_safe)
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    # contiguous groups in graph order: any topological order cut into runs gives forward-only deps
    groups: list[tuple[str, list[Node]]] = []
    cur: list[Node] = []
    for n in nodes:
        if n.op in ("placeholder", "get_attr", "output"):
            continue
        if _is_moe(n):
            if cur:
                groups.append(("static", cur))
                cur = []
            groups.append(("dynamic", [n]))
        else:
            cur.append(n)
    if cur:
        groups.append(("static", cur))
    seg_of = {n: i for i, (_, ns) in enumerate(groups) for n in ns}

    # symbolic row counts: B from the ids' dim 0, tokens = B * T
    ids = next((p for p in placeholders if p.name == "input_ids"), placeholders[0] if placeholders else None)
    ids_val = ids.meta.get("val") if ids is not None else None
    batch_exprs, tok_expr, T = set(), None, None
    if isinstance(ids_val, torch.Tensor) and ids_val.dim() >= 2:
        batch_exprs.add(_expr(ids_val.shape[0]))
        tok_expr = _expr(ids_val.shape[0]) * _expr(ids_val.shape[1])
        T = ids_val.shape[1] if isinstance(ids_val.shape[1], int) else None
    for p in placeholders:
        v = p.meta.get("val")
        if p.name in META_INPUTS and isinstance(v, torch.Tensor) and v.dim() == 1:
            batch_exprs.add(_expr(v.shape[0]))

    def info(n: Node, dynamic: bool) -> SegmentValue:
        val = n.meta.get("val")
        rows = None
        shape, dtype = "", ""
        if isinstance(val, torch.Tensor):
            shape, dtype = "[" + ", ".join(str(d) for d in val.shape) + "]", str(val.dtype).replace("torch.", "")
            if val.dim():
                e = _expr(val.shape[0])
                rows = "tokens" if tok_expr is not None and e == tok_expr else ("batch" if e in batch_exprs else None)
        elif isinstance(val, (torch.SymInt, int)):
            shape, dtype = str(val), "int"
        if n.op == "placeholder":  # ids/hidden have the dynamic batch dim; lifted weights (artifact graphs) do not
            if n.name in META_INPUTS:
                role = "meta"
            elif n.name.startswith(CACHE_PREFIX):
                role = "cache"
            else:
                from torch.fx.experimental.symbolic_shapes import free_symbols

                role = "padded" if isinstance(val, torch.Tensor) and free_symbols(val) else "weight"
        elif n.op == "get_attr":
            role = "weight"
        elif isinstance(val, torch.Tensor):
            from torch.fx.experimental.symbolic_shapes import free_symbols

            if free_symbols(val):
                role = "real" if dynamic and rows == "tokens" else "padded"
            else:
                role = "static"
        elif isinstance(val, (torch.SymInt, int, float, bool)):
            role = "size"
        else:
            role = "static"
        return SegmentValue(n.name, role, shape, dtype, rows, seg_of.get(n))

    out_node = gm.graph.find_nodes(op="output")[0]
    graph_out = [a for a in torch.utils._pytree.tree_leaves(out_node.args[0]) if isinstance(a, Node)]
    segments = []
    for i, (kind, ns) in enumerate(groups):
        members = set(ns)
        ins: dict[Node, None] = {}
        for n in ns:
            def visit(a, _ins=ins, _m=members):
                if a not in _m:
                    _ins.setdefault(a)
                return a
            torch.fx.graph.map_arg(n.args, visit)
            torch.fx.graph.map_arg(n.kwargs, visit)
        outs = [n for n in ns if any(u not in members for u in n.users)]
        dynamic = kind == "dynamic"
        blockers: list[str] = []
        for n in ns:
            for why in capture_blockers(n, safe):
                if why not in blockers:
                    blockers.append(why)
        mutates = tuple(dict.fromkeys(a.name for n in ns for a in _mutated(n)))
        caches = tuple(dict.fromkeys(a.name for n in ns if n.op == "call_function" for a in n.all_input_nodes
                                     if a.op == "placeholder" and a.name.startswith(CACHE_PREFIX)))
        layer = None
        if dynamic:  # from the expert weights' name; V4's MTP block counts after the main layers
            w = next((a for a in ns[0].args[3:] if isinstance(a, Node)), None)  # the first expert weight
            m = re.search(r"(layers|mtp)[._](\d+)[._]", str(getattr(w, "target", "")))
            if m:
                layer = int(m.group(2)) + (ctx.config.num_hidden_layers if m.group(1) == "mtp" else 0)
        ops = Counter(op_name(n.target) if n.op == "call_function" else n.op for n in ns)
        reason = "; ".join(blockers) if blockers else "static shapes, no host sync, no data-dependent control flow"
        segments.append(Segment(
            index=i, kind=kind, nodes=tuple(n.name for n in ns), op_counts=tuple(ops.most_common()),
            inputs=tuple(info(a, dynamic) for a in ins), outputs=tuple(info(o, dynamic) for o in outs),
            capturable=not blockers, reason=reason, mutates=mutates, caches=caches, layer=layer))

    cache_vals = [p.meta.get("val") for p in placeholders if p.name.startswith(CACHE_PREFIX)]
    n_slots = int(cache_vals[0].shape[0]) if cache_vals and isinstance(cache_vals[0], torch.Tensor) else None
    return SegmentPlan(
        graph_kind=ctx.graph_kind, target=ctx.target, segments=tuple(segments),
        graph_inputs=tuple(info(p, False) for p in placeholders),
        graph_outputs=tuple(info(o, False) for o in graph_out),
        tokens_per_row=T, n_slots=n_slots, vocab_size=ctx.config.vocab_size)


# ---- applying it -----------------------------------------------------------------------------
def apply_plan(gm: GraphModule, plan: SegmentPlan) -> GraphModule:
    """Split `gm` into a parent GraphModule whose submodules `submod_{i}` are the plan's segments,
    called in the original order. The parent keeps `gm`'s calling convention (pytree in/out specs)
    and its weights (shared, not copied); `parent.meta["segment_plan"]` is the plan."""
    from torch.fx.passes.split_module import split_module

    where = {name: s.index for s in plan.segments for name in s.nodes}
    missing = [n.name for n in gm.graph.nodes
               if n.op not in ("placeholder", "get_attr", "output") and n.name not in where]
    if missing:
        raise ValueError(f"plan does not match the graph: {len(missing)} nodes have no segment, e.g. {missing[:3]}")
    split = split_module(gm, gm, lambda n: where[n.name], keep_original_order=True, keep_original_node_name=True)
    split.graph._codegen = copy.copy(gm.graph._codegen)  # gm's calling convention (pytree in/out specs)
    calls = [n for n in split.graph.nodes if n.op == "call_module"]
    if [n.target for n in calls] != [s.submod_name for s in plan.segments]:
        raise AssertionError(f"split order {[n.target for n in calls]} != plan order")
    for s, call in zip(plan.segments, calls):
        sub = getattr(split, s.submod_name)
        names = [p.name for p in sub.graph.nodes if p.op == "placeholder"]
        if names != [v.name for v in s.inputs]:
            raise AssertionError(f"{s.submod_name}: inputs {names} != plan {[v.name for v in s.inputs]}")
        if s.mutates:
            sub._is_impure = True  # a dead-code pass on the parent must keep cache writers
        sub.meta["segment"] = s
        # meta["val"] on the parent's call and getitem nodes (verify needs it; so do later passes)
        ret = sub.graph.find_nodes(op="output")[0].args[0]
        rets = ret if isinstance(ret, (tuple, list)) else (ret,)
        vals = [r.meta.get("val") if isinstance(r, Node) else r for r in rets]
        call.meta["val"] = tuple(vals) if isinstance(ret, (tuple, list)) else vals[0]
        call.meta["segment"] = s.index
        for u in call.users:
            if u.op == "call_function" and u.args[0] is call:
                u.meta["val"] = vals[u.args[1]]
    split.meta["segment_plan"] = plan
    split.recompile()
    return split


def split_at_routers(gm: GraphModule, ctx: PassContext) -> PassResult:
    """The pass: plan the segments and split. The returned graph is the split parent module."""
    plan = plan_segments(gm, ctx)
    split = apply_plan(gm, plan)
    stats = {"segments": len(plan.segments), "boundaries": len(plan.boundaries),
             "static": sum(s.kind == "static" for s in plan.segments),
             "dynamic": sum(s.kind == "dynamic" for s in plan.segments),
             "capturable": plan.n_capturable,
             "not_capturable": sorted({s.reason for s in plan.segments if not s.capturable})}
    return PassResult(split, True, stats)
