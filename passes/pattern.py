"""Match a model function's exported graph inside a step graph, and replace each site by one op.

The fusion passes (fuse_hc, fuse_rmsnorm, fuse_rope) do not write their patterns by hand: each
pattern is the model's own function (`HyperConnection.pre`, `RMSNorm.forward`, ...) exported with
torch.export on small example tensors, with the config's constants, so it holds exactly the op
sequence and the literals (eps, slice bounds, dims) that the model's graphs hold.

    pattern = export_pattern(module, example_inputs)       # fx.Graph, the function's ATen ops
    fuse_sites(gm, pattern, lambda site: (op, args))       # each self-contained site -> one op call

Two export artifacts are allowed inside a site:
- Export puts an `aten._assert_tensor_metadata` check beside every `.to(dtype)`. Those checks are
  not part of the computation: a check on a value computed inside a site goes with the site (the
  matcher does not count it as a use from outside), and checks on the site's inputs stay.
- `x.float()` of an fp32 x returns x itself, so export records a no-op cast `to(x, fp32)` and
  routes every later use of x through it. Such a cast of a site input may be used outside the site;
  the replacement points those uses at the input itself (the same tensor).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.passes.utils.matcher_utils import SubgraphMatcher

from dsv4c.passes import erase_unused, fake_value, is_noop_cast

_ASSERT = torch.ops.aten._assert_tensor_metadata.default


def export_pattern(module: torch.nn.Module, example_inputs: tuple) -> GraphModule:
    """The ATen graph (as a GraphModule, for passes that rewrite it further) of `module(*example_inputs)`;
    the pattern's placeholders are the module's inputs, its outputs the values the site returns.
    Export's dtype checks are dropped from it (no value uses them: older SubgraphMatchers call them
    dead code)."""
    gm = torch.export.export(module, example_inputs, strict=False).graph_module
    for n in list(gm.graph.nodes):
        if n.target is _ASSERT:
            gm.graph.erase_node(n)
    return gm


class _Matcher(SubgraphMatcher):
    """SubgraphMatcher that ignores export's dtype checks on values inside a site."""

    def _is_contained(self, nodes_map: dict[Node, Node]) -> bool:
        inside = {gn for pn, gn in nodes_map.items() if pn.op != "placeholder"}
        inputs = {gn for pn, gn in nodes_map.items() if pn.op == "placeholder"}
        for pn, gn in nodes_map.items():
            if pn.op == "placeholder" or pn in self.pattern_returning_nodes or _input_alias(gn, inputs):
                continue
            if any(u not in inside and u.target is not _ASSERT for u in gn.users):
                return False
        return True


def _input_alias(n: Node, inputs: set) -> bool:
    """n is a chain of no-op casts of one of `inputs` (the same tensor)."""
    if not is_noop_cast(n):
        return False
    while is_noop_cast(n):
        n = n.args[0]
        if n in inputs:
            return True
    return False


@dataclass
class Site:
    inputs: list  # graph nodes (or literals) bound to the pattern's placeholders, in order
    outputs: list[Node]  # graph nodes holding the pattern's outputs, in order
    nodes: list[Node]  # every matched compute node, graph order


def match_sites(gm: GraphModule, pattern: Graph) -> list[Site]:
    """Every non-overlapping occurrence of `pattern` in `gm` whose intermediate values are used only
    inside the occurrence (export's dtype checks aside)."""
    matcher = _Matcher(pattern, match_output=False, match_placeholder=False, remove_overlapping_matches=True)
    # SubgraphMatcher drops anchors that have no candidate (and then fails on them): none -> no site
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    if any(a.target not in targets for a in matcher.pattern_anchors):
        return []
    out_node = pattern.find_nodes(op="output")[0]
    outs = out_node.args[0]
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    sites = []
    for m in matcher.match(gm.graph):
        nodes = sorted((gn for pn, gn in m.nodes_map.items() if pn.op not in ("placeholder", "output")),
                       key=order.__getitem__)
        sites.append(Site(list(m.placeholder_nodes), [m.nodes_map[o] for o in outs], nodes))
    return sites


def _insertion_point(g: Graph, args, outputs: list[Node]) -> Node | None:
    """The first of the site's outputs in graph order, if every argument of the op comes before it
    (an input may be computed between the site's first node and its outputs, e.g. `-sin`); else None."""
    order = {n: i for i, n in enumerate(g.nodes)}
    first = min(outputs, key=order.__getitem__)
    return None if any(isinstance(a, Node) and order[a] > order[first] for a in args) else first


def fuse_sites(gm: GraphModule, pattern: Graph, rewrite: Callable[[Site], tuple | None]) -> int:
    """Replace every site of `pattern` for which `rewrite(site)` gives `(op, args)` (None: leave it);
    returns how many. A site's inputs may be an earlier site's outputs (mHC sites chain): they are
    mapped to the replacing nodes first; a site that an earlier replacement erased part of is matched
    again in another round. A site whose op would need a value computed after the site's first
    output is left alone."""
    count, stale = 0, True
    while stale:  # a site that an earlier replacement touched otherwise is matched again
        renamed: dict[Node, Node] = {}
        stale = False
        for site in match_sites(gm, pattern):
            site.inputs = [renamed.get(a, a) if isinstance(a, Node) else a for a in site.inputs]
            if any(getattr(n, "_erased", False) for n in site.nodes + [a for a in site.inputs if isinstance(a, Node)]):
                stale = True
                continue
            call = rewrite(site)
            if call is None or _insertion_point(gm.graph, call[1], site.outputs) is None:
                continue
            new = replace_site(gm, site, *call)
            renamed.update(zip(site.outputs, new))
            count += 1
    return count


def replace_site(gm: GraphModule, site: Site, op, args: tuple, val_args: tuple | None = None) -> list[Node]:
    """Insert `op(*args)` before the site's first output, route the site's outputs to it (through
    getitems when the op returns a tuple) and erase the site. `meta["val"]` comes from the op's fake
    implementation on `val_args` (default: the args' own values); the stack trace of the site's
    first output is kept (profiles and censuses group by it)."""
    g = gm.graph
    ref = next(a for a in args if isinstance(a, Node))
    if val_args is None:
        val_args = tuple(a.meta["val"] if isinstance(a, Node) else a for a in args)
    where = _insertion_point(g, args, site.outputs)
    if where is None:
        raise ValueError(f"an argument of {op} is computed after the site's first output")
    with g.inserting_before(where):
        fused = g.call_function(op, args)
    fused.meta["val"] = fake_value(ref, op, *val_args)
    trace = site.outputs[0].meta.get("stack_trace")
    if trace is not None:
        fused.meta["stack_trace"] = trace
    if len(site.outputs) == 1 and not isinstance(fused.meta["val"], (tuple, list)):
        site.outputs[0].replace_all_uses_with(fused)
        new = [fused]
    else:
        new = []
        last = fused
        for i, out in enumerate(site.outputs):
            with g.inserting_after(last):
                item = last = g.call_function(operator.getitem, (fused, i))
            item.meta["val"] = fused.meta["val"][i]
            if trace is not None:
                item.meta["stack_trace"] = trace
            out.replace_all_uses_with(item)
            new.append(item)
    inputs = {a for a in site.inputs if isinstance(a, Node)}
    inside = set(site.nodes)
    for n in site.nodes:
        if _input_alias(n, inputs):
            src = n.args[0]
            while src not in inputs:
                src = src.args[0]
            n.replace_all_uses_with(src, delete_user_cb=lambda u: u not in inside)
    erase_unused(gm, site.outputs)
    return new
