"""Per-pass numerical report: run the pipeline one pass at a time and compare each graph's logits
with the eager model on the same inputs (`dsv4c compare`).

For every graph kind, the first row ("export") is the traced graph before any pass; every later
row is the graph after that pass. Each row carries the pass's stats and time and, unless the model
lives on the meta device, the SNR (dB), max abs error and cosine similarity of the logits against
the eager model. Later passes (split, quantize) are judged the same way; `snr_prev_db` is the SNR of
each step's logits against the previous step's (a lossy pass such as quantize_experts shows its own
cost there, whatever came before).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

from dsv4c.export import GraphSpec, export_graph, flat_caches
from dsv4c.passes import PassContext, run_pipeline


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


def _cases(model, kinds, k: int, seed: int) -> list[_Case]:
    cfg = model.config
    dev = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    V, B = cfg.vocab_size, 2
    prompt_len = (cfg.sliding_window + 9) if cfg.is_v4 else 13
    spec_len = prompt_len + 16
    cases = []
    for kind in kinds:
        spec = GraphSpec(kind, k=k, n_slots=B, max_len=spec_len + 8)
        T = prompt_len if kind == "prefill" else 1 + k
        ids = torch.randint(0, V, (B, T), generator=g).to(dev)
        meta = (torch.arange(B, device=dev), None, torch.full((B,), T, device=dev))
        if kind == "mtp":
            cache = model.new_mtp_cache(B, max_len=spec.max_len)
            hidden = _sample_hidden(model, B, T, g)
            pos0 = cache.pos.clone()
            ref = model.mtp_forward(hidden, ids, copy.deepcopy(cache))[0]
            cases.append(_Case(spec, (hidden, ids, meta[0], pos0, meta[2]), cache, ref))
            continue
        cache = model.new_cache(B, max_len=spec.max_len)
        if kind == "decode":  # decode after a prompt, so the step sees a real cache
            model(torch.randint(0, V, (B, prompt_len), generator=g).to(dev), cache)
        pos0 = cache.pos.clone()
        ref = model(ids, copy.deepcopy(cache))
        cases.append(_Case(spec, (ids, meta[0], pos0, meta[2]), cache, ref))
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


@torch.no_grad()
def compare_passes(model, target: str = "cpu", kinds=("prefill", "decode"), k: int = 0, skip=(),
                   seed: int = 0, passes=None, on_step=None) -> list[dict]:
    """One row per (graph kind, step): export first, then each pass of the pipeline. `on_step(kind,
    name, metrics)` is called as each step finishes (progress; metrics are empty on `meta`)."""
    cfg = model.config
    meta = next(model.parameters()).is_meta
    rows = []
    for kind in kinds:
        case = None if meta else next(c for c in _cases(model, [kind], k, seed))
        spec = case.spec if case else GraphSpec(kind, k=k)
        eg = export_graph(model, spec)
        gm = eg.module()

        prev = [None]  # logits of the previous step

        def metrics(graph, case=case, prev=prev) -> dict:
            if case is None:
                return {}
            out = _run(graph, case)
            m = {**error_metrics(out, case.ref), "snr_prev_db": error_metrics(out, prev[0])["snr_db"]
                 if prev[0] is not None else None}
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
                     "snr_prev_db": None, **step_done("export", gm)})
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
    """A plain-text table, one row per graph and step."""
    head = (f"{'graph':8} {'step':18} {'changed':7} {'SNR dB':>8} {'vs prev':>8} {'max abs':>10} {'cosine':>10} "
            f"{'sec':>6}  stats")
    lines = [head, "-" * len(head)]
    for r in rows:
        snr, prev = (_db(r["snr_db"]), _db(r.get("snr_prev_db")))
        mae = "-" if r["max_abs_err"] is None else f"{r['max_abs_err']:.2e}"
        cos = "-" if r["cosine"] is None else f"{r['cosine']:.6f}"
        step = r["name"] + (" (skipped)" if r.get("skipped") else "")
        lines.append(f"{r['graph']:8} {step:18} {str(r['changed']):7} {snr:>8} {prev:>8} {mae:>10} {cos:>10} "
                     f"{r['seconds']:6.2f}  {_short_stats(r['stats'])}")
    return "\n".join(lines)


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
