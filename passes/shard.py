"""Shard an exported graph for one rank of a `ParallelPlan` (design.md: "a plan is data, sharding is a pass").

The rank r sits at (e, t) = plan.coords(r) on the [ep, tp] mesh. Weights are matched by name and
get a *slice recipe* `[(dim, start, stop), ...]`; the graph attribute becomes a `meta` tensor of the
local shape (the pass never reads or copies weight values: compile's weight streaming applies the
recipes, `slice_weight`), and the graph is rewritten so that it computes, on every rank, the same
function as the unsharded graph:

    before                                   after (rank r, tp ranks of one row share T, the world W)
    e = embedding(E [V, D], ids)             l = ids - t·V/tp; m = 0 <= l < V/tp
                                             e = all_reduce_T(where(m, embedding(E_t [V/tp, D], where(m, l, 0)), 0))
    q = wq_b(x).view(.., H, d)               q = wq_b_t(x).view(.., H/tp, d)        heads [t·H/tp, (t+1)·H/tp)
    o → view(.., G, H·d/G) → wo_a → wo_b     o_t → view(.., G/tp, H·d/G) → wo_a_t → all_reduce_T(wo_b_t(z_t))
    y = moe_experts(u, idx, w, W1, W3, W2)   i = idx - e·E/ep; m = 0 <= i < E/ep
                                             y = all_reduce_W(moe_experts(u, where(m, i, 0), where(m, w, 0),
                                                                          W1_et, W3_et, W2_et))
    s = W2s(silu(W1s u) ⊙ W3s u)             s = all_reduce_T(W2s_t(silu(W1s_t u) ⊙ W3s_t u))   (dense MLPs too)
    logits = linear(h, head [V, D])          logits = all_gather_T(linear(h, head_t [V/tp, D]))   (vocabulary order)

Why it is valid: every split is along a dim that the function sums over (heads and output groups
feed `wo_b`, expert intermediate columns feed `w2`, experts feed the weighted sum) or maps
independently (vocabulary rows), so each rank computes a partial sum of the same terms and the
all-reduce adds them; a token routed to another row's expert gets weight 0 on this row and its
contribution (0 · expert_0(u)) adds an exact zero. Shapes that the tracer wrote as literals (the head
count of a `view`) are rescaled, and every value's fake tensor is recomputed from the new shapes.
Replicated (not split): norms, mHC, the K=V latent `wkv`, compressors, `wq_a`, the router, hash
tables, `e_proj`/`h_proj` of the MTP block, and the V4 indexer (its top-k needs the score summed
over all its heads before the selection; splitting it needs the op split in two, not done yet).

Collectives are functional (`torch.ops._c10d_functional.*` + `wait_tensor`) on the group *names*
`parallel.TP_GROUP` and `parallel.WORLD_GROUP`; the runtime registers this process's groups under
those names (`runtime.distributed.init_groups`), so a saved graph does not depend on process-group
numbering and a CUDA graph captures the collectives like any other op.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch
from torch.fx import GraphModule, Node

from dsv4c.parallel import TP_GROUP, WORLD_GROUP, ParallelPlan, PlanError
from dsv4c.quant import FP8_BLOCK
from dsv4c.passes import PassContext, PassResult, get_param, set_param, tensor_value

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

Recipe = tuple[tuple[int, int, int], ...]  # ((dim, start, stop), ...) applied in order


# ---- which weight is split how --------------------------------------------------------------------
@dataclass(frozen=True)
class Rule:
    pattern: str  # regex on the graph weight name (searched)
    splits: tuple[tuple[int, str], ...]  # (dim, "tp" | "ep") per split dim
    role: str  # vocab_embed | vocab_head | heads | partial_tp | experts


# Order matters: the first matching rule wins (the indexer's wq_b is not the attention's).
RULES: tuple[Rule, ...] = (
    Rule(r"(^|\.)(embed|embed_tokens)\.weight$", ((0, "tp"),), "vocab_embed"),
    Rule(r"(^|\.)(head|lm_head)\.weight$", ((0, "tp"),), "vocab_head"),
    Rule(r"\.indexer\.", (), "replicated"),
    # V4 attention: heads of q, sinks, output groups
    Rule(r"\.attn\.wq_b\.weight$", ((0, "tp"),), "heads"),
    Rule(r"\.attn\.attn_sink$", ((0, "tp"),), "heads"),
    Rule(r"\.attn\.wo_a\.weight$", ((0, "tp"),), "heads"),
    Rule(r"\.attn\.wo_b\.weight$", ((1, "tp"),), "partial_tp"),
    # V3/V3.2 MLA: heads of q and of the kv up-projection, o_proj's input columns
    Rule(r"\.self_attn\.(q_b_proj|q_proj|kv_b_proj)\.weight$", ((0, "tp"),), "heads"),
    Rule(r"\.self_attn\.o_proj\.weight$", ((1, "tp"),), "partial_tp"),
    # shared experts (V4 w1/w3/w2, V3 gate/up/down) and dense MLPs: intermediate columns
    Rule(r"\.shared_experts\.(w1|w3)\.weight$", ((0, "tp"),), "heads"),
    Rule(r"\.shared_experts\.w2\.weight$", ((1, "tp"),), "partial_tp"),
    Rule(r"\.(mlp|shared_experts)\.(gate_proj|up_proj)\.weight$", ((0, "tp"),), "heads"),
    Rule(r"\.(mlp|shared_experts)\.down_proj\.weight$", ((1, "tp"),), "partial_tp"),
    # routed experts (stacked): experts over ep, intermediate columns over tp
    Rule(r"\.experts\.(w1|w3|gate_proj|up_proj)$", ((0, "ep"), (1, "tp")), "experts"),
    Rule(r"\.experts\.(w2|down_proj)$", ((0, "ep"), (2, "tp")), "experts"),
)


def rule_for(name: str) -> Rule | None:
    for r in RULES:
        if re.search(r.pattern, name):
            return None if r.role == "replicated" else r
    return None


def chunk(n: int, parts: int, index: int, what: str) -> tuple[int, int]:
    """[start, stop) of part `index` of `n` rows split `parts` ways; the split must be exact."""
    if n % parts:
        raise PlanError("tp" if what.endswith("tp") else "ep",
                        f"{what}: size {n} is not divisible by {parts}")
    size = n // parts
    return index * size, (index + 1) * size


def weight_recipe(name: str, shape: tuple[int, ...], plan: ParallelPlan, rank: int) -> Recipe:
    """The slice recipe of graph weight `name` (full shape `shape`) on `rank`; () = replicated."""
    r = rule_for(name)
    if r is None:
        return ()
    e, t = plan.coords(rank)
    out = []
    for dim, axis in r.splits:
        parts, index = (plan.tp, t) if axis == "tp" else (plan.ep, e)
        if parts > 1:
            out.append((dim, *chunk(shape[dim], parts, index, f"weight {name} dim {dim} over {axis}")))
    return tuple(out)


def slice_weight(w: torch.Tensor, recipe: Recipe | list) -> torch.Tensor:
    """Apply a slice recipe to a full weight (compile's weight streaming; tests)."""
    for dim, lo, hi in recipe:
        w = w.narrow(dim, lo, hi - lo)
    return w.contiguous() if recipe else w


def slice_fp8_block(w_q: torch.Tensor, w_s: torch.Tensor, recipe: Recipe | list, block: int = FP8_BLOCK,
                    name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """A slice recipe applied to an FP8 block weight as stored: w_q [N, K] e4m3 and w_s, one scale per
    block x block tile [ceil(N/block), ceil(K/block)]. The slice keeps w_q's rows / columns and the scale
    tiles covering them; the kernels map local index j to tile j // block, which is the stored tile when
    the slice starts on a tile boundary or lies inside one tile (then its one tile). Any other slice would
    pair values with another tile's scale: PlanError naming the weight and the limit."""
    for dim, lo, hi in recipe:
        if lo % block and lo // block != (hi - 1) // block:
            raise PlanError("tp", f"{name}: the shard [{lo}, {hi}) of dim {dim} starts inside a {block}-wide FP8 "
                                  f"scale block and crosses into the next; FP8 dense linears shard only on block "
                                  f"boundaries (a tp that cuts this dim into multiples of {block}, or "
                                  f"--dense-format bf16)")
        w_q = w_q.narrow(dim, lo, hi - lo)
        w_s = w_s.narrow(dim, lo // block, (hi - 1) // block - lo // block + 1)
    return (w_q.contiguous(), w_s.contiguous()) if recipe else (w_q, w_s)


def local_shape(shape: tuple[int, ...], recipe: Recipe) -> tuple[int, ...]:
    s = list(shape)
    for dim, lo, hi in recipe:
        s[dim] = hi - lo
    return tuple(s)


# ---- the pass ------------------------------------------------------------------------------------
def shard_pass(plan: ParallelPlan, rank: int) -> Callable[[GraphModule, PassContext], PassResult]:
    """The shard pass for one rank, as a pipeline step (`run_pipeline(..., passes=[("shard", ...), ...])`)."""
    plan.coords(rank)  # a rank outside the world fails here

    def run(gm: GraphModule, ctx: PassContext) -> PassResult:
        return shard(gm, ctx, plan, rank)

    return run


def shard(gm: GraphModule, ctx: PassContext, plan: ParallelPlan, rank: int) -> PassResult:
    if plan.is_single:
        return PassResult(gm, False, {"plan": plan.to_dict(), "rank": rank, "skipped": "one rank: nothing to shard"})
    g = gm.graph
    e, t = plan.coords(rank)
    old = {n: n.meta.get("val") for n in g.nodes}
    mode = _fake_mode(gm)
    recipes: dict[str, Recipe] = {}
    roles: dict[Node, str] = {}
    for n in g.nodes:
        if n.op != "get_attr":
            continue
        full = get_param(gm, n.target)
        first = n.target not in recipes  # several get_attr nodes may read one weight: slice it once
        rec = weight_recipe(n.target, tuple(old[n].shape), plan, rank) if first else recipes[n.target]
        if not rec:
            continue
        shape = local_shape(tuple(old[n].shape), rec)
        recipes[n.target] = rec
        roles[n] = rule_for(n.target).role
        if first:
            set_param(gm, n.target, torch.empty(shape, dtype=full.dtype, device="meta"))
        with mode:
            n.meta["val"] = torch.empty(shape, dtype=full.dtype, device=old[n].device)
    counts = {"all_reduce_tp": 0, "all_reduce_world": 0, "all_gather_tp": 0, "vocab_embed": 0, "expert_remap": 0}
    for n, role in roles.items():
        for user in _consumers(n):
            if role == "vocab_embed" and user.target is aten.embedding.default and plan.tp > 1:
                _vocab_embedding(gm, user, t, plan.tp)
                counts["vocab_embed"] += 1
            elif role == "vocab_head" and _is_linear(user) and plan.tp > 1:
                _all_gather_last(gm, user, plan.tp)
                counts["all_gather_tp"] += 1
            elif role == "partial_tp" and _is_linear(user) and plan.tp > 1:
                _all_reduce_after(gm, user, TP_GROUP)
                counts["all_reduce_tp"] += 1
    for n in [n for n in g.nodes if _is_experts(n)]:
        w1 = n.args[3]
        if not (isinstance(w1, Node) and w1.op == "get_attr" and w1.target in recipes):
            continue
        if plan.ep > 1:
            n_local = recipes[w1.target][0][2] - recipes[w1.target][0][1]
            _remap_experts(gm, n, e * n_local, n_local)
            counts["expert_remap"] += 1
        _all_reduce_after(gm, n, WORLD_GROUP)
        counts["all_reduce_world"] += 1
    rescaled = _repropagate(gm, old, mode)
    g.lint()
    stats = {"plan": plan.to_dict(), "rank": rank, "coords": [e, t],
             "slices": {k: [list(s) for s in v] for k, v in sorted(recipes.items())},
             "collectives": counts, "rescaled_shapes": rescaled}
    return PassResult(gm, True, stats)


def _fake_mode(gm: GraphModule):
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch._subclasses.FakeTensor):
            return v.fake_mode
    raise ValueError("shard: the graph carries no fake tensors (meta['val']); shard an exported graph")


_PASSTHROUGH = {aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.t.default, aten.permute.default,
                aten.contiguous.default}


def _consumers(n: Node) -> list[Node]:
    """The nodes that compute with weight `n`, looking through casts and transposes."""
    out = []
    for u in n.users:
        if u.target is aten._assert_tensor_metadata.default:
            continue
        if u.target in _PASSTHROUGH:
            out += _consumers(u)
        else:
            out.append(u)
    return out


def _is_linear(n: Node) -> bool:
    return n.target in (aten.linear.default, aten.matmul.default, aten.mm.default)


def _is_experts(n: Node) -> bool:
    name = getattr(n.target, "name", None)
    return n.op == "call_function" and callable(name) and name().split(".")[0] in (
        "dsv4c::moe_experts", "dsv4c::moe_experts_gathered")


def _call(gm: GraphModule, target, args: tuple) -> Node:
    return gm.graph.call_function(target, args)


def _all_reduce_after(gm: GraphModule, n: Node, group: str) -> Node:
    """n -> wait(all_reduce(n, sum, group)) for every user of n."""
    g = gm.graph
    users = list(n.users)
    with g.inserting_after(n):
        ar = _call(gm, c10d.all_reduce.default, (n, "sum", group))
    with g.inserting_after(ar):
        w = _call(gm, c10d.wait_tensor.default, (ar,))
    for u in users:
        u.replace_input_with(n, w)
    return w


def _all_gather_last(gm: GraphModule, n: Node, tp: int) -> None:
    """x [..., V/tp] -> [..., V]: the ranks' vocabulary slices in rank order (all_gather concatenates
    along dim 0, so the vocabulary dim goes first and back)."""
    g = gm.graph
    users = list(n.users)
    with g.inserting_after(n):
        first = _call(gm, aten.movedim.int, (n, -1, 0))
    with g.inserting_after(first):
        cont = _call(gm, aten.clone.default, (first,))
    with g.inserting_after(cont):
        ag = _call(gm, c10d.all_gather_into_tensor.default, (cont, tp, TP_GROUP))
    with g.inserting_after(ag):
        w = _call(gm, c10d.wait_tensor.default, (ag,))
    with g.inserting_after(w):
        back = _call(gm, aten.movedim.int, (w, 0, -1))
    with g.inserting_after(back):
        out = _call(gm, aten.clone.default, (back,))
    out.kwargs = {"memory_format": torch.contiguous_format}
    for u in users:
        u.replace_input_with(n, out)


def _vocab_embedding(gm: GraphModule, n: Node, t: int, tp: int) -> None:
    """embedding(E_t, ids) over this rank's vocabulary rows, zero elsewhere, summed over the row."""
    g = gm.graph
    w, ids = n.args[0], n.args[1]
    n_local = tensor_value(w).shape[0]
    lo = t * n_local
    with g.inserting_before(n):
        local = _call(gm, aten.sub.Tensor, (ids, lo))
        ge = _call(gm, aten.ge.Scalar, (local, 0))
        lt = _call(gm, aten.lt.Scalar, (local, n_local))
        mine = _call(gm, aten.bitwise_and.Tensor, (ge, lt))
        safe = _call(gm, aten.where.ScalarOther, (mine, local, 0))
    n.args = (w, safe, *n.args[2:])
    users = list(n.users)
    with g.inserting_after(n):
        m3 = _call(gm, aten.unsqueeze.default, (mine, -1))
    with g.inserting_after(m3):
        masked = _call(gm, aten.where.ScalarOther, (m3, n, 0.0))
    for u in users:
        u.replace_input_with(n, masked)
    _all_reduce_after(gm, masked, TP_GROUP)


def _remap_experts(gm: GraphModule, n: Node, lo: int, n_local: int) -> None:
    """Global expert ids -> this row's local ids; choices of other rows' experts get weight 0."""
    g = gm.graph
    x, idx, wt = n.args[:3]
    with g.inserting_before(n):
        local = _call(gm, aten.sub.Tensor, (idx, lo))
        ge = _call(gm, aten.ge.Scalar, (local, 0))
        lt = _call(gm, aten.lt.Scalar, (local, n_local))
        mine = _call(gm, aten.bitwise_and.Tensor, (ge, lt))
        safe = _call(gm, aten.where.ScalarOther, (mine, local, 0))
        w0 = _call(gm, aten.where.ScalarOther, (mine, wt, 0.0))
    n.args = (x, safe, w0, *n.args[3:])


# ---- shapes ---------------------------------------------------------------------------------------
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def _same(a, b) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return str(a) == str(b)


def _groups(src: tuple, dst: tuple) -> list[tuple[list[int], list[int]]]:
    """Align the dims of a view: consecutive groups of src dims and dst dims with equal products
    (symbolic dims must match one to one)."""
    out, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        if i < len(src) and j < len(dst) and _same(src[i], dst[j]):
            out.append(([i], [j]))
            i, j = i + 1, j + 1
            continue
        gi, gj, pi, pj = [], [], 1, 1
        while True:
            if pi <= pj and i < len(src) and isinstance(src[i], int):
                pi *= src[i]; gi.append(i); i += 1
            elif j < len(dst) and isinstance(dst[j], int):
                pj *= dst[j]; gj.append(j); j += 1
            elif i < len(src) and isinstance(src[i], int):
                pi *= src[i]; gi.append(i); i += 1
            else:
                raise ValueError(f"cannot align view dims {src} -> {dst}")
            if pi == pj and gi and gj:
                break
        out.append((gi, gj))
    return out


def _rescale_view(n: Node, old_in: tuple, new_in: tuple, old_out: tuple) -> bool:
    """Fix the literal sizes of a view/reshape whose input shrank along some dims."""
    sizes = list(n.args[1])
    changed = False
    for gi, gj in _groups(old_in, old_out):
        pi_old = _prod([old_in[i] for i in gi])
        pi_new = _prod([new_in[i] for i in gi])
        if _same(pi_old, pi_new):
            continue
        f = pi_old // pi_new
        k = gj[0]
        if sizes[k] == -1:
            continue  # -1 adapts
        if not isinstance(sizes[k], int) or sizes[k] % f:
            raise PlanError("tp", f"shard: view {n.name} {list(old_in)} -> {sizes}: cannot split dim {k} by {f}")
        sizes[k] //= f
        changed = True
    if changed:
        n.args = (n.args[0], sizes, *n.args[2:])
    return changed


def _rescale_unflatten(n: Node, old_in: tuple, new_in: tuple) -> bool:
    dim = n.args[1] % len(old_in)
    if _same(old_in[dim], new_in[dim]):
        return False
    f = old_in[dim] // new_in[dim]
    sizes = list(n.args[2])
    if sizes[0] == -1:
        return False
    if sizes[0] % f:
        raise PlanError("tp", f"shard: unflatten {n.name} of {sizes}: cannot split the outer size by {f}")
    sizes[0] //= f
    n.args = (n.args[0], n.args[1], sizes, *n.args[3:])
    return True


def _rescale_expand(n: Node, old_in: tuple, new_in: tuple) -> bool:
    sizes = list(n.args[1])
    off = len(sizes) - len(old_in)
    changed = False
    for i, (a, b) in enumerate(zip(old_in, new_in)):
        if not _same(a, b) and isinstance(sizes[off + i], int) and sizes[off + i] != -1:
            sizes[off + i] = b
            changed = True
    if changed:
        n.args = (n.args[0], sizes, *n.args[2:])
    return changed


def _prod(xs):
    p = 1
    for x in xs:
        p = p * x
    return p


def _shape(v) -> tuple | None:
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _repropagate(gm: GraphModule, old: dict, mode) -> list[str]:
    """Recompute meta['val'] of every node downstream of a changed shape (and of the new nodes),
    rescaling literal view sizes on the way. Returns the names of the rescaled nodes."""
    dirty: set[Node] = {n for n in gm.graph.nodes if n.op == "get_attr" and n.meta.get("val") is not old.get(n)}
    rescaled = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        new_node = n not in old
        if not new_node and not any(a in dirty for a in n.all_input_nodes):
            continue
        src = n.args[0] if n.args and isinstance(n.args[0], Node) else None
        if src is not None and src in dirty and not new_node:
            o_in, n_in = _shape(old.get(src)), _shape(src.meta.get("val"))
            if o_in is not None and n_in is not None and o_in != n_in:
                fixed = False
                if n.target in _VIEWS:
                    fixed = _rescale_view(n, o_in, n_in, _shape(old[n]))
                elif n.target is aten.unflatten.int:
                    fixed = _rescale_unflatten(n, o_in, n_in)
                elif n.target is aten.expand.default:
                    fixed = _rescale_expand(n, o_in, n_in)
                if fixed:
                    rescaled.append(n.name)
        if n.target is aten.cat.default and not new_node:
            rescaled += _match_cat_expands(n, dirty, mode)
        if n.target is aten._assert_tensor_metadata.default:
            _drop_size_check(n)
            continue
        args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta.get("val"))
        try:
            with mode:
                val = n.target(*args, **kwargs)
        except Exception as e:  # name the node: the shape rule that is missing
            raise PlanError("tp", f"shard: recomputing node {n.name} ({n.target}) after the split failed: {e}") from e
        n.meta["val"] = val
        # the inserted nodes keep the shapes of the values they replace, so only changed shapes spread
        if not new_node and _shapes_differ(old.get(n), val):
            dirty.add(n)
    return rescaled


def _match_cat_expands(n: Node, dirty: set, mode) -> list[str]:
    """cat([a, expand(b, [.., H, ..])]) where a's heads were split: the broadcast copy (V3's shared
    rope key, expanded to every head) gets the local head count too."""
    parts, dim = n.args[0], (n.args[1] if len(n.args) > 1 else 0)
    ref = next((p for p in parts if p in dirty), None)
    if ref is None:
        return []
    shape = _shape(ref.meta["val"])
    dim = dim % len(shape)
    out = []
    for p in parts:
        if p in dirty or p.target is not aten.expand.default:
            continue
        sizes = list(p.args[1])
        new = [s if (k == dim or not isinstance(s, int) or s == -1) else shape[k] for k, s in enumerate(sizes)]
        if new != sizes:
            p.args = (p.args[0], new, *p.args[2:])
            args = torch.fx.node.map_arg(p.args, lambda a: a.meta.get("val"))
            with mode:
                p.meta["val"] = p.target(*args)
            dirty.add(p)
            out.append(p.name)
    return out


def _shapes_differ(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) != len(b) or any(_shapes_differ(x, y) for x, y in zip(a, b))
    return False


def _drop_size_check(n: Node) -> None:
    if n.kwargs.get("size") is not None or n.kwargs.get("stride") is not None:
        n.kwargs = {k: v for k, v in n.kwargs.items() if k not in ("size", "stride")}
    if len(n.args) > 1:
        n.args = (n.args[0], None, None, *n.args[3:])

