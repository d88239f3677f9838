"""Deterministic mode on the v4-flash-slice: its cost per decode step, and that rows do not depend on the batch.

    python examples/bench_deterministic.py --out $OUT/det.json              # H200, ~2-3 min
    python examples/bench_deterministic.py --device cpu --quick             # CPU smoke run (tiny model)

For each lowering (h200 pipeline, decode graph, one full CUDA graph per bucket):
  default        the target's kernels, fp8_block experts (what `compile --target h200` ships)
  default-bf16   the target's kernels, bf16 experts (`moe_experts_gathered`): the same expert bytes as
                 the deterministic mode, so the difference is the kernels' alone
  deterministic  `PassContext(deterministic=True)`: passes/make_batch_invariant.py + v4_attention=fused_det
it prefills max(batch) slots with a `--prompt`-token prompt (eager model), then from the same cache state
and the same first tokens runs `--steps` greedy decode steps at each batch size, and records
  * the median step time (CUDA events, after 3 warm-up steps) per batch: the mode's cost;
  * `rows_identical`: the first step's logits of rows 0..B-1 are bit-identical at every batch size;
  * `tokens_identical`: every greedy token of rows 0..B-1 is the same at every batch size.
Only the deterministic mode claims the two; the others are recorded for contrast.
`--layers N` cuts the slice to N layers (the gpu test uses 2: a random 2-layer Flash-dimension model).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from dsv4c import ModelConfig
from dsv4c.export import GraphSpec, export_graph, flat_caches
from dsv4c.model import build_model
from dsv4c.passes import PassContext, run_pipeline
from dsv4c.passes.split_at_routers import apply_plan, plan_segments
from dsv4c.runtime.segments import SegmentExecutor
from dsv4c.targets import DEFAULT_BUCKETS

MODES = {  # name -> (kernel overrides, skip quantize_experts, deterministic)
    "default": ({}, False, False),
    "default-bf16": ({"moe_experts": "gathered"}, True, False),
    "deterministic": ({"v4_attention": "fused_det"}, True, True),
}


def config(preset: str, layers: int | None) -> ModelConfig:
    cfg = ModelConfig.preset(preset)
    if layers:
        r = list(cfg.compress_ratios)
        cfg = cfg.replace(num_hidden_layers=layers, compress_ratios=tuple(r[:layers]) + (r[-1],),
                          num_hash_layers=min(cfg.num_hash_layers, layers))
    return cfg


def lower(model, n_slots: int, max_len: int, mode: str):
    kernels, no_quant, det = MODES[mode]
    ctx = PassContext(model.config, "h200", "decode", tuple(sorted(kernels.items())), None, deterministic=det)
    gm = export_graph(model, GraphSpec("decode", k=0, n_slots=n_slots, max_len=max_len)).module()
    gm, records = run_pipeline(gm, ctx, skip=("quantize_experts",) if no_quant else ())
    blockers = [b for r in records if r.name == "make_batch_invariant" for b in r.stats.get("blockers", [])]
    plan = plan_segments(gm, ctx)
    return plan, apply_plan(gm, plan), blockers


@torch.no_grad()
def greedy(ex, flat, snap, pos0, ids0, B: int, steps: int):
    """`steps` greedy steps of rows 0..B-1 from the snapshot -> (first logits [B, V], tokens [steps, B], ms)."""
    for name, t in flat.items():
        t.copy_(snap[name])
    dev = ids0.device
    ids, slots, pos = ids0[:B].clone(), torch.arange(B, device=dev), pos0[:B].clone()
    one = torch.ones(B, dtype=torch.int64, device=dev)
    first, toks, ms = None, [], []
    for _ in range(steps):
        a = b = None
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        logits = ex.run(ids, slots, pos, one, flat)[0][:, -1]  # [B, V]
        if dev.type == "cuda":
            b.record()
            b.synchronize()
            ms.append(a.elapsed_time(b))
        first = logits.float().clone() if first is None else first
        ids = logits.argmax(-1, keepdim=True)
        toks.append(ids[:, 0].cpu())
        pos += 1
    return first, torch.stack(toks), ms


def run(layers: int | None = None, batches=(1, 8, 64), prompt: int = 1024, steps: int = 12,
        modes=tuple(MODES), device: str = "cuda", preset: str = "v4-flash-slice") -> dict:
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    batches = sorted(batches)
    model = build_model(config(preset, layers), dev, dtype, on_device=True)
    cfg = model.config
    n_slots, max_len = batches[-1] + 1, prompt + steps + 8
    cache = model.new_cache(n_slots, max_len=max_len)
    g = torch.Generator().manual_seed(0)
    for s in range(0, n_slots - 1, 8):
        rows = torch.arange(s, min(s + 8, n_slots - 1), device=dev)
        model(torch.randint(0, cfg.vocab_size, (len(rows), prompt), generator=g).to(dev), cache, slots=rows)
    flat = flat_caches(cache.layers)
    snap = {k: t.clone() for k, t in flat.items()}
    pos0 = cache.pos.clone()
    ids0 = torch.randint(0, cfg.vocab_size, (batches[-1], 1), generator=g).to(dev)
    buckets = tuple(sorted({b for b in DEFAULT_BUCKETS if b < n_slots} | {n_slots - 1}))
    res: dict = {"preset": preset, "layers": cfg.num_hidden_layers, "prompt": prompt, "steps": steps,
                 "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__}
    for mode in modes:
        plan, split, blockers = lower(model, n_slots, max_len, mode)
        ex = SegmentExecutor(split, plan, dev, buckets=buckets, mode="full" if dev.type == "cuda" else "eager",
                             pad_slot=n_slots - 1)
        out = {b: greedy(ex, flat, snap, pos0, ids0, b, steps) for b in batches}
        big_first, big_toks, _ = out[batches[-1]]
        r = {"step_ms": {b: statistics.median(o[2][3:]) if len(o[2]) > 3 else None for b, o in out.items()},
             "rows_identical": all(torch.equal(o[0], big_first[:b]) for b, o in out.items()),
             "tokens_identical": all(torch.equal(o[1], big_toks[:, :b]) for b, o in out.items()),
             "blockers": blockers,  # deterministic mode: ops make_batch_invariant could not vouch for
             "max_logit_diff_vs_largest_batch": {b: float((o[0] - big_first[:b]).abs().max()) for b, o in out.items()}}
        res[mode] = r
        print(f"{mode:14} " + "  ".join(f"B={b}: {ms:.3f} ms" for b, ms in r["step_ms"].items() if ms is not None)
              + f"  rows identical: {r['rows_identical']}  tokens identical: {r['tokens_identical']}", flush=True)
        del ex, split
    if "deterministic" in res and "default" in res:
        res["cost_vs_default"] = {b: res["deterministic"]["step_ms"][b] / res["default"]["step_ms"][b]
                                  for b in batches if res["default"]["step_ms"][b]}
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--layers", type=int, default=None, help="cut the slice to this many layers")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--quick", action="store_true", help="tiny model, short prompt (a smoke run)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    preset = "v4-flash-slice"
    if a.quick:
        preset, a.batches, a.prompt, a.steps = "v4-tiny-a", [1, 3], 12, 3
    res = run(a.layers, a.batches, a.prompt, a.steps, tuple(a.modes), a.device, preset)
    if "cost_vs_default" in res:
        print("deterministic / default step time: " + ", ".join(f"B={b}: {x:.2f}x" for b, x in res["cost_vs_default"].items()))
    if a.out:
        a.out.write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
