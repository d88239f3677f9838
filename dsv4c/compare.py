"""Per-pass numerical report: run the pipeline one pass at a time and compare each graph's logits
with the eager model on the same inputs (`dsv4c compare`).

For every graph kind, the first row ("export") is the traced graph before any pass; every later
row is the graph after that pass. Each row carries the pass's stats and time and, unless the model
lives on the meta device, the SNR (dB), max abs error and cosine similarity of the logits against
the eager model. Later passes (split, quantize) are judged the same way; `snr_prev_db` is the SNR of
each step's logits against the previous step's (a lossy pass such as quantize_experts shows its own
cost there, whatever came before).

Routing (dsv4c/routing.py, passes/pin_routing.py): the eager reference's routing decisions are
recorded per MoE layer (hash layers and the MTP block's included). Every row's graph runs with a
routing tap that records its own decisions: `flips` is, per MoE layer, the share of tokens whose
top-k expert set differs from eager's (routing free). With `pin_routing=True` each graph also runs
with eager's decisions fed to its experts in place of its own router outputs: `pinned` holds that
run's SNR / max abs / cosine (only the kernels' and formats' error is left), `pinned_flips` the
graph's own router against eager's with eager-routed inputs (local flips, no cascade). The sparse
attention's indexers (V4 CSA, V3.2 DSA) are recorded and pinned the same way: `index_flips` and
`pinned_index_flips`, per indexer, the share of query tokens whose selected compressed entries differ
(present when the graph has indexers). The first row of each graph carries `margins`: per layer, the
distribution of eager's top-k margins.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

from dsv4c.export import GraphSpec, export_graph, flat_caches
from dsv4c.passes import PassContext, run_pipeline
from dsv4c.passes.pin_routing import tapped
from dsv4c.routing import RoutingTable, RoutingTap, index_flips, margin_summary, record_routing, routing_flips


def error_metrics(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """SNR in dB (inf when identical), max abs error, and cosine similarity, in float64."""
    o, r = out.double().flatten(), ref.double().flatten()
    noise = (o - r).pow(2).sum().item()
    signal = r.pow(2).sum().item()
    snr = math.inf if noise == 0 else 10 * math.log10(signal / noise)
    cos = torch.nn.functional.cosine_similarity(o, r, dim=0).item()
    return {"snr_db": snr, "max_abs_err": (o - r).abs().max().item(), "cosine": cos}


@dataclass
class _Case:
    """One graph's sample inputs: the batch metadata and a cache state to copy per run."""

    spec: GraphSpec
    args: tuple  # (ids, slots, pos0, n_real) or (hidden, ids, slots, pos0, n_real)
    cache: object  # the model's cache object before the step
    ref: torch.Tensor  # eager logits
    routing: RoutingTable | None = None  # eager's routing decisions of the step

    def eager(self, model) -> torch.Tensor:
        """`model`'s logits on a prefill or decode case's inputs, from a copy of its cache."""
        ids, slots = self.args[0], self.args[1]
        return model(ids, copy.deepcopy(self.cache), slots=slots)


def _cases(model, kinds, k: int, seed: int, prompt_len: int | None = None) -> list[_Case]:
    """One case per graph kind: B = 2 real rows in cache slots 0..B-1 and one more slot, the scratch slot
    the static and fused cache ops send their masked writes to (dsv4c/model/static_ops.py), as the
    Session reserves it. A real row in the last slot would have its entries overwritten by them."""
    cfg = model.config
    dev = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    V, B = cfg.vocab_size, 2
    if prompt_len is None:
        prompt_len = (cfg.sliding_window + 9) if cfg.is_v4 else 13
    spec_len = prompt_len + 16
    slots = torch.arange(B, device=dev)
    cases = []
    for kind in kinds:
        spec = GraphSpec(kind, k=k, n_slots=B + 1, max_len=spec_len + 8)
        T = prompt_len if kind == "prefill" else 1 + k
        ids = torch.randint(0, V, (B, T), generator=g).to(dev)
        n_real = torch.full((B,), T, device=dev)
        if kind == "mtp":
            cache = model.new_mtp_cache(B + 1, max_len=spec.max_len)
            hidden = _sample_hidden(model, B, T, g)
            pos0 = cache.pos[:B].clone()
            with record_routing(model) as rec:
                ref = model.mtp_forward(hidden, ids, copy.deepcopy(cache), slots=slots)[0]
            cases.append(_Case(spec, (hidden, ids, slots, pos0, n_real), cache, ref, rec.table))
            continue
        cache = model.new_cache(B + 1, max_len=spec.max_len)
        if kind == "decode":  # decode after a prompt, so the step sees a real cache
            model(torch.randint(0, V, (B, prompt_len), generator=g).to(dev), cache, slots=slots)
        pos0 = cache.pos[:B].clone()
        with record_routing(model) as rec:
            ref = model(ids, copy.deepcopy(cache), slots=slots)
        cases.append(_Case(spec, (ids, slots, pos0, n_real), cache, ref, rec.table))
    return cases


def _sample_hidden(model, B: int, T: int, g: torch.Generator) -> torch.Tensor:
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g).to(next(model.parameters()).device)
    if cfg.is_v4:
        return model.forward_with_streams(ids)[1]
    return model.forward_with_hidden(ids)[1]


def _run(gm, case: _Case) -> torch.Tensor:
    cache = copy.deepcopy(case.cache)
    return gm(*case.args, flat_caches(cache.layers))[0]


def _run_tapped(gm, case: _Case, pin: bool) -> tuple[torch.Tensor, RoutingTap]:
    """Run `gm` with a routing tap (pinned to the case's eager routing, or observing); gm is unchanged after."""
    tap = RoutingTap(case.routing, pin=pin)
    with tapped(gm, tap):
        out = _run(gm, case)
    left = tap.unconsumed()
    if left:
        raise AssertionError(f"pinned routing: recorded rows never asked for: {left}")
    return out, tap


def case_metrics(gm, case: _Case, pin_routing: bool) -> dict:
    """The logits error of `gm` on `case` with routing free (and pinned), and the routing flips."""
    out, tap = _run_tapped(gm, case, pin=False)
    m = {**error_metrics(out, case.ref), "flips": routing_flips(case.routing, tap.seen), "_out": out}
    if case.routing.index:
        m["index_flips"] = index_flips(case.routing, tap.seen)
    if pin_routing:
        pout, ptap = _run_tapped(gm, case, pin=True)
        m["pinned"] = error_metrics(pout, case.ref)
        m["pinned_flips"] = routing_flips(case.routing, ptap.seen)
        if case.routing.index:
            m["pinned_index_flips"] = index_flips(case.routing, ptap.seen)
    return m


@torch.no_grad()
def compare_passes(model, target: str = "cpu", kinds=("prefill", "decode"), k: int = 0, skip=(),
                   seed: int = 0, passes=None, pin_routing: bool = False,
                   prompt_len: int | None = None, on_step=None) -> list[dict]:
    """One row per (graph kind, step): export first, then each pass of the pipeline. `pin_routing`:
    also run each graph with eager's routing decisions (module docstring). `prompt_len`: tokens per
    prefill row (and of the prompt before a decode step); default the window + 9 (V4), 13 (V3).
    `on_step(kind, name, metrics)` is called as each step finishes (progress; metrics are empty on `meta`)."""
    cfg = model.config
    meta = next(model.parameters()).is_meta
    rows = []
    for kind in kinds:
        case = None if meta else next(c for c in _cases(model, [kind], k, seed, prompt_len))
        spec = case.spec if case else GraphSpec(kind, k=k)
        eg = export_graph(model, spec)
        gm = eg.module()

        prev = [None]  # logits of the previous step

        def metrics(graph, case=case, prev=prev) -> dict:
            if case is None:
                return {}
            m = case_metrics(graph, case, pin_routing)
            out = m.pop("_out")
            m["snr_prev_db"] = error_metrics(out, prev[0])["snr_db"] if prev[0] is not None else None
            prev[0] = out
            return m

        def step_done(name, graph, kind=kind, snapshots=None):
            m = metrics(graph)
            if snapshots is not None:
                snapshots[name] = m
            if on_step is not None:
                on_step(kind, name, m)
            return m

        rows.append({"graph": kind, "name": "export", "changed": False, "stats": {"nodes": len(gm.graph.nodes)},
                     "seconds": eg.seconds, "snr_db": None, "max_abs_err": None, "cosine": None,
                     "snr_prev_db": None, **step_done("export", gm),
                     **({"margins": margin_summary(case.routing)} if case is not None else {})})
        ctx = PassContext(cfg, target=target, graph_kind=kind)
        snapshots = {}
        gm, records = run_pipeline(gm, ctx, passes=passes, skip=skip,
                                   after_each=lambda name, g, snaps=snapshots: step_done(name, g, snapshots=snaps))
        for r in records:
            row = {"graph": kind, "name": r.name, "changed": r.changed, "stats": r.stats, "seconds": r.seconds,
                   "skipped": r.skipped, "snr_db": None, "max_abs_err": None, "cosine": None, "snr_prev_db": None}
            row.update(snapshots.get(r.name, {}))
            rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    """A plain-text table, one row per graph and step (pinned-routing columns when measured), then
    the per-layer routing flips of each graph's last step and eager's top-k margins."""
    pinned = any("pinned" in r for r in rows)
    pcols = f" {'pinned':>8} {'p.max abs':>10} {'p.cosine':>10}" if pinned else ""
    head = (f"{'graph':8} {'step':18} {'changed':7} {'SNR dB':>8} {'vs prev':>8} {'max abs':>10} {'cosine':>10}"
            f"{pcols} {'flips':>6} {'sec':>6}  stats")
    lines = [head, "-" * len(head)]
    for r in rows:
        snr, prev = (_db(r["snr_db"]), _db(r.get("snr_prev_db")))
        mae = "-" if r["max_abs_err"] is None else f"{r['max_abs_err']:.2e}"
        cos = "-" if r["cosine"] is None else f"{r['cosine']:.6f}"
        step = r["name"] + (" (skipped)" if r.get("skipped") else "")
        p = ""
        if pinned:
            pm = r.get("pinned") or {}
            p = (f" {_db(pm.get('snr_db')):>8} {_e(pm.get('max_abs_err')):>10} "
                 f"{('-' if pm.get('cosine') is None else format(pm['cosine'], '.6f')):>10}")
        fl = r.get("flips")
        flips = "-" if not fl else f"{max(f['share'] for f in fl):.0%}"
        lines.append(f"{r['graph']:8} {step:18} {str(r['changed']):7} {snr:>8} {prev:>8} {mae:>10} {cos:>10}{p} "
                     f"{flips:>6} {r['seconds']:6.2f}  {_short_stats(r['stats'])}")
    lines.append("flips: the largest per-layer share of tokens whose top-k expert set differs from eager's "
                 "(routing free)")
    lines += routing_tables(rows)
    return "\n".join(lines)


def routing_tables(rows: list[dict]) -> list[str]:
    """Per graph: per MoE layer, flips of the last measured step (free / pinned-local) and eager's margins."""
    lines = []
    for graph in dict.fromkeys(r["graph"] for r in rows):
        rs = [r for r in rows if r["graph"] == graph]
        last = next((r for r in reversed(rs) if r.get("flips")), None)
        margins = {m["layer"]: m for m in (rs[0].get("margins") or [])}
        if last is None:
            continue
        lines += ["", f"{graph}: routing per MoE layer after {last['name']} (flips: share of tokens whose expert "
                      f"set differs from eager's; margins: eager's k-th minus (k+1)-th selection score)",
                  f"  {'layer':10} {'hash':4} {'tokens':>6} {'flips free':>10} {'flips pinned':>12} "
                  f"{'margin min':>10} {'p10':>9} {'p50':>9}"]
        pinned = {f["layer"]: f for f in last.get("pinned_flips") or []}
        for f in last["flips"]:
            m = margins.get(f["layer"], {}).get("quantiles") or {}
            pf = pinned.get(f["layer"])
            lines.append(f"  {f['layer']:10} {'yes' if f['hashed'] else '':4} {f['tokens']:>6} {f['share']:>10.1%} "
                         f"{('-' if pf is None else format(pf['share'], '.1%')):>12} {_e(m.get('p0')):>10} "
                         f"{_e(m.get('p10')):>9} {_e(m.get('p50')):>9}")
        if last.get("index_flips"):
            pinned = {f["layer"]: f for f in last.get("pinned_index_flips") or []}
            lines += [f"{graph}: sparse-attention indexers after {last['name']} (flips: share of query tokens whose "
                      f"selected compressed entries differ from eager's)",
                      f"  {'layer':10} {'tokens':>6} {'flips free':>10} {'flips pinned':>12}"]
            for f in last["index_flips"]:
                pf = pinned.get(f["layer"])
                lines.append(f"  {f['layer']:10} {f['tokens']:>6} {f['share']:>10.1%} "
                             f"{('-' if pf is None else format(pf['share'], '.1%')):>12}")
    return lines


def _e(v: float | None) -> str:
    return "-" if v is None else f"{v:.2e}"


def json_rows(rows: list[dict]) -> list[dict]:
    """Rows as strict JSON values: an infinite SNR (identical logits) becomes "inf"."""
    def clean(v):
        if isinstance(v, float) and math.isinf(v):
            return "inf" if v > 0 else "-inf"
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v
    return [clean(r) for r in rows]


def _db(v: float | None) -> str:
    return "-" if v is None else ("inf" if v == math.inf else f"{v:.1f}")


def _short_stats(stats: dict) -> str:
    parts = []
    for key, v in stats.items():
        if isinstance(v, list):
            parts.append(f"{key}={len(v)}")
        elif isinstance(v, dict):
            parts.append(f"{key}={{...}}")
        else:
            parts.append(f"{key}={v}")
    return ", ".join(parts)[:80]


# ---- a whole compiled artifact ------------------------------------------------------------------
@torch.no_grad()
def eager_routing(model, ids) -> tuple[torch.Tensor, RoutingTable]:
    """Eager prefill logits [T, V] fp32 of one token sequence and its routing decisions."""
    dev = next(model.parameters()).device
    with record_routing(model) as rec:
        logits = model(torch.as_tensor(list(ids), device=dev)[None])[0].float()
    return logits, rec.table


@torch.no_grad()
def artifact_logits(session, ids, routing: RoutingTable | None = None) -> tuple[torch.Tensor, RoutingTap]:
    """`session.logits(ids)` (prefill logits [T, V] through the artifact's own prefill graph, in its
    chunks) with a routing tap in that graph: pinned to `routing` (from `eager_routing` on the same ids)
    when given, observing otherwise. The session's graph is unchanged afterwards; the tap's `seen` is the
    artifact's own routing (for flips)."""
    tap = RoutingTap(routing, pin=routing is not None)
    with tapped(session.graphs["prefill"], tap):
        out = session.logits(ids)
    left = tap.unconsumed()
    if left:
        raise AssertionError(f"pinned routing: recorded rows never asked for: {left}")
    return out, tap
