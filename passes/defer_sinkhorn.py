"""Move each mHC site's Sinkhorn from its pre-mix into the post-mix that reads comb (DeepSeek-V4), where the
post-mix runs it before its PDL wait: off the decode step's critical path.

After fuse_hc / fuse_hc_chain a site's pre-mix (`hc_pre`, or the `hc_post_pre` that chains the previous site's
post into it) ends with a finish kernel whose token programs write u, post and comb; comb is the 20-iteration
Sinkhorn of the logits c0, run by one program a token after u is formed, and every later kernel waits for it.
Nothing reads comb until the site's post-mix, after the attention or the MoE block: the Sinkhorn can run
there, in the post-mix's programs before their PDL wait, while the block's last kernel still runs.

Before (one site; y is computed from u by the block; y2, fuse_moe_sum's second addend, optional):
    t = dsv4c.hc_pre(X, fn, base, scale, eps, hc_eps, iters);     u, post, comb = t[0], t[1], t[2]
    ...  y = block(u)  ...
    X1 = dsv4c.hc_post(y, X, post, comb, y2)                      # or hc_post_pre(y, X, post, comb, ..)
After:
    t = dsv4c.hc_pre_c0(X, fn, base, scale, eps, hc_eps, iters);  u, post, c0 = t[0], t[1], t[2]
    ...  y = block(u)  ...
    X1 = dsv4c.hc_post_c0(y, X, post, c0, iters, hc_eps, True, y2)   # or hc_post_pre_c0(.., c0_in=True, ..)
A chained site (`hc_post_pre`) may be both: its comb input and its comb' output deferred (hc_post_pre_c0's
`c0_in` and `defer`).

Why it is valid: the ops are defined as the model's functions split at the Sinkhorn (kernels/mhc.py:
`hc_pre_c0` is `HyperConnection.pre_logits`, the post-mix ops apply the model's `sinkhorn` to c0 and then
`.post`), so on the CPU the graph computes the same bits; on CUDA the post-mix's programs run the finish's
own fast Sinkhorn (`_sinkhorn_tile`) on c0 (tests/test_defer_sinkhorn.py bounds the difference). A link is
deferred only when every reader of comb is a post-mix (hc_post / hc_post_pre, comb as its fourth argument;
export's metadata checks aside) and each reader's y (and y2) is computed from the producer's u: then at least
one kernel runs between the finish that writes c0 and the post-mix, so c0 is complete before the post-mix
launches and its early read (`early`, before the PDL wait; kernels/_tl.py `pdl_wait`) is ordered. Off unless the
target asks for it (`Target.defer_sinkhorn`); deterministic graphs keep their ops (`hc_pre_rows`, `hc_post_bi`).

`stats`: `links` (comb values deferred), `skipped` (why not, when the pass did nothing).
"""
from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from dsv4c.passes import PassContext, PassResult, kernel_ops, unavailable

_CHECK = torch.ops.aten._assert_tensor_metadata.default  # export's dtype/device checks: read no values
_VIEWS = {"view", "reshape", "_unsafe_view", "expand", "slice", "select", "squeeze", "unsqueeze", "permute",
          "transpose", "t", "alias", "detach", "as_strided", "unflatten", "flatten", "split", "split_with_sizes",
          "chunk", "narrow", "_assert_tensor_metadata"}
_NAMES = ("hc_pre", "hc_post", "hc_post_pre", "hc_pre_c0", "hc_post_c0", "hc_post_pre_c0")


def _out(node: Node, i: int) -> Node | None:
    """The getitem node reading output i of a multi-output op, if exactly one does."""
    got = [u for u in node.users if u.target is operator.getitem and u.args[1] == i]
    return got[0] if len(got) == 1 else None


def _free(n: Node) -> bool:
    """n launches no kernel: a getitem or an ATen view."""
    return n.target is operator.getitem or (isinstance(n.target, torch._ops.OpOverload)
                                            and n.target.overloadpacket.__name__ in _VIEWS)


def _reaches(src: Node, dst: Node) -> bool:
    """dst is computed from src through at least one node that launches a kernel (dst itself counts): that
    kernel runs after the one writing src and before any reader of dst."""
    seen, todo = {(src, False)}, [(src, False)]
    while todo:
        n, crossed = todo.pop()
        for u in n.users:
            c = crossed or not _free(u)
            if u is dst and c:
                return True
            if (u, c) not in seen:
                seen.add((u, c))
                todo.append((u, c))
    return False


def _links(gm: GraphModule, ops: dict) -> list[tuple[Node, list[Node]]]:
    """(producer, its post-mix readers) for every comb value the pass may defer."""
    out = []
    for p in gm.graph.nodes:
        if p.target not in (ops["hc_pre"], ops["hc_post_pre"]):
            continue
        first = 0 if p.target is ops["hc_pre"] else 1  # u's output index; comb is the one two after it
        u, comb = _out(p, first), _out(p, first + 2)
        if u is None or comb is None:
            continue
        readers = [r for r in comb.users if r.target is not _CHECK]
        ok = bool(readers) and all(
            r.target in (ops["hc_post"], ops["hc_post_pre"]) and len(r.args) > 3 and r.args[3] is comb
            and comb not in (*r.args[:3], *r.args[4:], *r.kwargs.values())
            and (r.target is ops["hc_post"] or tuple(r.args[8:10]) == _consts(p))  # the same Sinkhorn
            and all(_reaches(u, a) for a in (r.args[0], _y2(r, ops)) if isinstance(a, Node))
            for r in readers)
        if ok:
            out.append((p, readers))
    return out


def _y2(r: Node, ops: dict):
    at = 4 if r.target is ops["hc_post"] else 10
    return r.args[at] if len(r.args) > at else r.kwargs.get("y2")


def _rewrite(gm: GraphModule, ops: dict, producers: set[Node], readers: set[Node]) -> None:
    g = gm.graph
    for n in list(g.nodes):
        if n not in producers and n not in readers:
            continue
        y2 = _y2(n, ops) if n.target is not ops["hc_pre"] else None
        if n.target is ops["hc_pre"]:
            new_target, args = ops["hc_pre_c0"], n.args
        elif n.target is ops["hc_post"]:  # a reader only
            eps_of = _producer_consts(n)
            new_target, args = ops["hc_post_c0"], (*n.args[:4], *eps_of, True, y2)
        else:  # hc_post_pre: a reader, a producer or both
            new_target = ops["hc_post_pre_c0"]
            args = (*n.args[:10], n in readers, n in producers, True, y2)
        with g.inserting_before(n):
            m = g.call_function(new_target, tuple(args))
        m.meta.update(n.meta)
        n.replace_all_uses_with(m)
        g.erase_node(n)


def _consts(p: Node) -> tuple[float, int]:
    """(hc_eps, iters) of a pre-mix node (hc_pre's arguments 5-6, hc_post_pre's 8-9, and their _c0 forms')."""
    return tuple(p.args[5:7]) if len(p.args) == 7 else tuple(p.args[8:10])


def _producer_consts(reader: Node) -> tuple[int, float]:
    """(iters, hc_eps) of the site whose comb the reader reads (the producer's arguments)."""
    hc_eps, iters = _consts(reader.args[3].args[0])
    return iters, hc_eps


def defer_sinkhorn(gm: GraphModule, ctx: PassContext) -> PassResult:
    from dsv4c.targets import get_target

    if not ctx.config.is_v4:
        return PassResult(gm, False, {"links": 0, "skipped": "no mHC (not a V4 model)"})
    if not get_target(ctx.target).defer_sinkhorn:
        return PassResult(gm, False, {"links": 0, "skipped": f"target {ctx.target}: defer_sinkhorn is off"})
    if ctx.deterministic:
        return PassResult(gm, False, {"links": 0, "skipped": "deterministic: its mHC ops stay"})
    found = kernel_ops(ctx, *_NAMES)
    if found is None:
        return PassResult(gm, False, {"links": 0, "skipped": unavailable(*_NAMES)})
    ops = dict(zip(_NAMES, found))
    links = _links(gm, ops)
    if not links:
        return PassResult(gm, False, {"links": 0, "skipped": "no comb read only by post-mixes computed from u"})
    _rewrite(gm, ops, {p for p, _ in links}, {r for _, rs in links for r in rs})
    gm.graph.lint()
    gm.recompile()
    return PassResult(gm, True, {"links": len(links)})
