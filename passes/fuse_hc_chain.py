"""Chain each mHC post-mix into the pre-mix of the site that reads its output (DeepSeek-V4).

After fuse_hc a V4 block is, per site, `hc_pre` (two launches) ... `hc_post` (one launch), and the
streams one site's post writes are what the next site's pre reads at once: the FFN site after the
attention site, the next block's attention site after the FFN site. At decode each of those launches
is a few microseconds of latency around a megabyte or two of reads; the pass makes the post and the
next pre's first launch one (kernels/mhc.py `_hc_post_mix_kernel`): 2 launches fewer per block.

Before (X1 used by the pre here and by the site's own post later):
    X1 = dsv4c.hc_post(y, X0, post0, comb0)
    t = dsv4c.hc_pre(X1, fn, base, scale, eps, hc_eps, iters);  u, post1, comb1 = t[0], t[1], t[2]
After:
    c = dsv4c.hc_post_pre(y, X0, post0, comb0, fn, base, scale, eps, hc_eps, iters)
    X1, u, post1, comb1 = c[0], c[1], c[2], c[3]

Why it is valid: the op is defined as the pair, `HyperConnection.post` then `.pre` on its output (on the
CPU it calls exactly those, bit-exact); X1 is still produced, so its other users are unchanged. On
CUDA up to HC_CHAIN_MAX tokens the chained kernel forms X1 in X's dtype and the pre's partial sums of z
from X1 as stored, split by d-block instead of by K chunk (fp32 sums in another order: a few ulp of z,
as between hc_pre's own row and tile kernels; tests/test_fuse_hc_chain.py bounds it); above HC_CHAIN_MAX
tokens it runs hc_post then hc_pre, unchanged. Deterministic graphs keep the pair: the op picks its path
by token count, which make_batch_invariant would have to undo.

`stats`: `chained`, the pairs fused.
"""
from __future__ import annotations

import operator

from torch.fx import GraphModule, Node

from dsv4c.passes import PassContext, PassResult, kernel_ops, unavailable


def _pairs(gm: GraphModule, pre_op, post_op) -> list[tuple[Node, Node]]:
    """(post, pre) where pre's streams are post's output (and no other pre's), pre's results are read only
    through getitem, and pre's other tensor inputs are weights (placeholders or attributes, which can move
    above post)."""
    out = []
    for pre in gm.graph.nodes:
        if pre.target is not pre_op or not isinstance(pre.args[0], Node) or pre.args[0].target is not post_op:
            continue
        post = pre.args[0]
        weights = [a for a in pre.args[1:] if isinstance(a, Node)]
        if (sum(u.target is pre_op for u in post.users) == 1 and all(u.target is operator.getitem for u in pre.users)
                and all(a.op in ("placeholder", "get_attr") for a in weights)):
            out.append((post, pre))
    return out


def _chain(gm: GraphModule, post: Node, pre: Node, op, order: dict[Node, float]) -> None:
    """`order`: the nodes' positions, computed once by the pass and kept current for the nodes moved here."""
    g = gm.graph
    for a in pre.args[1:]:  # an attribute read first by the pre moves above the post (it has no inputs)
        if isinstance(a, Node) and a.op == "get_attr" and order[a] > order[post]:
            post.prepend(a)
            order[a] = order[post] - 0.5
    with g.inserting_before(post):
        fused = g.call_function(op, (*post.args, *pre.args[1:]))
        x1 = g.call_function(operator.getitem, (fused, 0))
    fused.meta["val"] = (post.meta["val"], *pre.meta["val"])
    x1.meta["val"] = post.meta["val"]
    for u in list(pre.users):
        u.args = (fused, u.args[1] + 1)
    post.replace_all_uses_with(x1)
    g.erase_node(pre)
    g.erase_node(post)


def fuse_hc_chain(gm: GraphModule, ctx: PassContext) -> PassResult:
    if not ctx.config.is_v4:
        return PassResult(gm, False, {"chained": 0, "skipped": "no mHC (not a V4 model)"})
    if ctx.deterministic:
        return PassResult(gm, False, {"chained": 0, "skipped": "deterministic: the pair stays (one path at any M)"})
    ops = kernel_ops(ctx, "hc_pre", "hc_post", "hc_post_pre")
    if ops is None:
        return PassResult(gm, False, {"chained": 0, "skipped": unavailable("hc_pre", "hc_post", "hc_post_pre")})
    pre_op, post_op, chain_op = ops
    pairs = _pairs(gm, pre_op, post_op)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for post, pre in pairs:
        _chain(gm, post, pre, chain_op, order)
    if pairs:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, bool(pairs), {"chained": len(pairs)})
