"""The README's planner table: V4-Flash and V4-Pro on 1, 2, 4 and 8 H200 / B200 (`dsv4c plan`, computed).

Runs the same function as `dsv4c plan` (dsv4c.planner.plan_report) for each cell and prints a markdown
table: the chosen plan, its per-GPU bytes and the decode-step roofline, or the shortfall of the best plan.
CPU only, nothing allocated (meta device); about 10 s.

    python examples/plan_table.py [--max-tokens 4096] [--max-batch 8]
"""
from __future__ import annotations

import argparse

from dsv4c.planner import plan_report

CELLS = [("v4-flash", "h200", "mxfp4_w4a16"), ("v4-flash", "h200", "fp8_block"),
         ("v4-flash", "b200", "nvfp4_w4a4"), ("v4-pro", "h200", "mxfp4_w4a16"), ("v4-pro", "h200", "fp8_block"),
         ("v4-pro", "b200", "nvfp4_w4a4")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--max-batch", type=int, default=8)
    a = p.parse_args()
    print(f"| model | GPUs | routed experts | plan | weights GB/GPU | total GB/GPU | headroom GB | "
          f"decode step at batch 1 (roofline) |")
    print("|---|---|---|---|---|---|---|---|")
    for model, target, fmt in CELLS:
        for n in (1, 2, 4, 8):
            r = plan_report(model, n, target, fmt, a.max_tokens, a.max_batch)
            ok = [c for c in r.candidates if not c.problems]
            if r.chosen is not None:
                c = next(c for c in ok if c.plan == r.chosen)
                cells = [f"tp={c.plan.tp} ep={c.plan.ep}", f"{sum(c.weights.values()) / 1e9:.1f}",
                         f"{c.total / 1e9:.1f}", f"{c.headroom / 1e9:.1f}", f"{c.step_s * 1e3:.2f} ms"]
            else:
                c = min(ok, key=lambda c: c.shortfall)
                cells = [f"none fits (best tp={c.plan.tp} ep={c.plan.ep})", f"{sum(c.weights.values()) / 1e9:.1f}",
                         f"{c.total / 1e9:.1f}", f"short by {c.shortfall / 1e9:.1f}", "-"]
            print(f"| {model} | {n} x {target.upper()} | {fmt} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
