"""MLA weight absorption for DeepSeek-V3/V3.2 (deepseek_v3_mla.md §5).

The naive form expands every cached latent row into per-head keys and values through kv_b_proj;
the absorbed form folds kv_b_proj's key half into the query and its value half into the output, so
attention runs over the cached 512 + 64 latent directly (MQA-like) and never expands the cache.

Before (one MLA layer; C = latent cache rows gathered for the batch, K_pe = rope keys):
    kv = linear(C, W_kvb).view(B, L, H, dn+dv);  k_nope, v = split(kv, [dn, dv])
    logits = einsum("bthd,bshd->bhts", cat(q_nope, q_pe), cat(k_nope, expand(K_pe)))
    ...mask, softmax -> p...
    o = einsum("bhts,bshd->bthd", p, v)
After (W_UK = W_kvb[h, :dn, :], W_UV = W_kvb[h, dn:, :], new graph weights):
    q_abs = einsum("bthd,hdc->bthc", q_nope, W_UK)
    logits = einsum("bthc,bsc->bhts", q_abs, C) + einsum("bthr,bsr->bhts", q_pe, K_pe)
    ...mask, softmax -> p... (unchanged)
    o = einsum("bthc,hdc->bthd", einsum("bhts,bsc->bthc", p, C), W_UV)

Why it is valid: both forms compute q_nope·(W_UK·c) = (q_nope·W_UK)·c and Σ_s p·(W_UV·c_s) =
W_UV·(Σ_s p·c_s); only the association order differs (fp32 difference ~1e-6 relative). W_kvb must be
dequantised before absorbing, since block scales do not commute with the product; this pass runs
before quantize_experts, on unquantised weights.

When: absorption trades the per-key expansion (L·c·H·(dn+dv) FLOPs per sequence) for wider per-query
work (T·L·H·(2c+dr) instead of T·L·H·(dn+dr+dv)). With L much larger than T the crossover is at
T* ≈ c·(dn+dv) / (2c+dr − dn−dr−dv) query tokens per sequence (≈ 170 for V3). Decode and MTP graphs
(T = 1 + k) are absorbed; the prefill graph, whose chunk length is dynamic up to the cache length,
stays naive. The decision and its reason are in the stats.
"""
from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from dsv4c.passes import (PassContext, PassResult, delete_param, erase_unused, fake_einsum, fake_value,
                          get_param, resolve, set_param)

aten = torch.ops.aten


def crossover_tokens(ctx: PassContext) -> float:
    """Query tokens per sequence below which the absorbed form needs fewer FLOPs (large L)."""
    c = ctx.config
    extra = 2 * c.kv_lora_rank + c.qk_rope_head_dim - (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)
    return c.kv_lora_rank * (c.qk_nope_head_dim + c.v_head_dim) / max(extra, 1)


def absorb_mla(gm: GraphModule, ctx: PassContext) -> PassResult:
    if ctx.config.is_v4:
        return PassResult(gm, False, {"decision": "not applicable",
                                      "reason": "V4 caches are already latent (K = V); see fuse_projections"})
    t_star = crossover_tokens(ctx)
    if ctx.graph_kind == "prefill":
        return PassResult(gm, False, {"decision": "naive", "crossover_tokens": round(t_star, 1),
                                      "reason": f"prefill chunks reach the cache length; absorbing pays only below "
                                                f"~{t_star:.0f} query tokens per sequence"})
    layers, skipped = [], []
    for lin in [n for n in gm.graph.nodes if _is_kvb_linear(n)]:
        site = _match(lin)
        if isinstance(site, str):
            skipped.append({"weight": resolve(lin.args[1]).target, "why": site})
            continue
        layers.append(_rewrite(gm, ctx, site))
    stats = {"decision": "absorbed" if layers else "naive", "crossover_tokens": round(t_star, 1),
             "reason": f"{ctx.graph_kind} graph: 1 + k query tokens per sequence, below ~{t_star:.0f}",
             "layers": layers, "skipped": skipped,
             "kv_b_linears_left": sum(_is_kvb_linear(n) for n in gm.graph.nodes)}
    return PassResult(gm, bool(layers), stats)


def _is_kvb_linear(n: Node) -> bool:
    if n.op != "call_function" or n.target is not aten.linear.default:
        return False
    w = resolve(n.args[1])
    return w.op == "get_attr" and w.target.endswith("kv_b_proj.weight")


def _single_user(n: Node, target) -> Node | None:
    users = list(n.users)
    return users[0] if len(users) == 1 and users[0].target is target else None


def _match(lin: Node):
    """Collect the nodes of one naive MLA site, or return why it does not match."""
    view = _single_user(lin, aten.view.default)
    split = view and _single_user(view, aten.split_with_sizes.default)
    if split is None:
        return "kv_b_proj output is not view -> split"
    items = {u.args[1]: u for u in split.users if u.target is operator.getitem}
    if set(items) != {0, 1} or len(items[0].users) != 1 or len(items[1].users) != 1:
        return "split outputs are not (k_nope, v) with one user each"
    k_cat = next(iter(items[0].users))
    e2 = next(iter(items[1].users))
    if k_cat.target is not aten.cat.default or e2.target is not aten.einsum.default:
        return "k_nope does not feed cat, or v does not feed einsum"
    e1 = _single_user(k_cat, aten.einsum.default)
    if e1 is None or e1.args[0] != "bthd,bshd->bhts" or e2.args[0] != "bhts,bshd->bthd":
        return "unexpected attention einsums"
    q_cat = e1.args[1][0]
    expand = k_cat.args[0][1]
    if q_cat.target is not aten.cat.default or expand.target is not aten.expand.default:
        return "q is not cat(q_nope, q_pe) or k_pe is not broadcast"
    unsq = expand.args[0]
    if unsq.target is not aten.unsqueeze.default:
        return "k_pe broadcast is not unsqueeze -> expand"
    return {"lin": lin, "view": view, "split": split, "k_cat": k_cat, "e1": e1, "e2": e2, "q_cat": q_cat,
            "q_nope": q_cat.args[0][0], "q_pe": q_cat.args[0][1], "latent": lin.args[0], "kpe": unsq.args[0],
            "weight": resolve(lin.args[1]).target}


def _rewrite(gm: GraphModule, ctx: PassContext, s: dict) -> dict:
    cfg = ctx.config
    dn, dv, c = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    W = get_param(gm, s["weight"]).detach()
    H = W.shape[0] // (dn + dv)  # this graph's heads: the shard pass may have kept a rank's share
    Wv = W.view(H, dn + dv, c)
    prefix = s["weight"][: -len(".weight")]
    uk_name, uv_name = prefix + ".w_uk", prefix + ".w_uv"
    set_param(gm, uk_name, Wv[:, :dn].contiguous())  # [H, dn, c]
    set_param(gm, uv_name, Wv[:, dn:].contiguous())  # [H, dv, c]
    g = gm.graph
    ref = s["e1"]

    def call(target, args, before):
        with g.inserting_before(before):
            n = g.call_function(target, args)
        vals = [a.meta["val"] if isinstance(a, Node) else
                ([x.meta["val"] for x in a] if isinstance(a, list) else a) for a in args]
        shape_fn = fake_einsum if target is aten.einsum.default else target  # see fake_linear
        n.meta["val"] = fake_value(ref, shape_fn, *vals)
        return n

    def attr(name, before):
        with g.inserting_before(before):
            n = g.get_attr(name)
        n.meta["val"] = fake_value(ref, lambda t: t, get_param(gm, name))
        return n

    e1, e2 = s["e1"], s["e2"]
    w_uk, w_uv = attr(uk_name, e1), attr(uv_name, e2)
    q_abs = call(aten.einsum.default, ("bthd,hdc->bthc", [s["q_nope"], w_uk]), e1)
    s1 = call(aten.einsum.default, ("bthc,bsc->bhts", [q_abs, s["latent"]]), e1)
    s2 = call(aten.einsum.default, ("bthr,bsr->bhts", [s["q_pe"], s["kpe"]]), e1)
    logits = call(aten.add.Tensor, (s1, s2), e1)
    e1.replace_all_uses_with(logits)
    p = e2.args[1][0]
    o_lat = call(aten.einsum.default, ("bhts,bsc->bthc", [p, s["latent"]]), e2)
    o = call(aten.einsum.default, ("bthc,hdc->bthd", [o_lat, w_uv]), e2)
    e2.replace_all_uses_with(o)
    erase_unused(gm, [e1, e2, s["k_cat"], s["q_cat"]])
    if not any(n.op == "get_attr" and n.target == s["weight"] for n in g.nodes):
        delete_param(gm, s["weight"])
    return {"weight": s["weight"], "w_uk": uk_name, "w_uv": uv_name}
