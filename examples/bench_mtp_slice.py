"""MTP cost on the v4-flash-slice (random weights: speed only, issue 8).

Random weights accept no drafts, so an end-to-end speedup on this model would only measure
rejection. What the slice can measure is the cost side of speculation at Flash dimensions: one
decode step (1 token per row), one verify step of the main model (1 + k tokens per row) and one MTP
draft step (1 token per row), each as a full CUDA graph of the h200 lowering, at batch 1 / 8 / 64.
From those, a round of k drafts costs `k * t_mtp + t_verify(k)` and yields `1 + E[accepted]` tokens,
so the speedup over plain decoding at per-position acceptance alpha_1..alpha_k is

    speedup(k) = (1 + sum_j prod_{i<=j} alpha_i) * t_decode / (k * t_mtp + t_verify(k))

and speculation breaks even where the numerator equals the denominator. The script prints the
measured step times, the break-even mean accepted length per k, and the speedup implied by the
acceptance given with --alpha (default: the bundled trained model's, measured on the H200 by
examples/bench_mtp.py; BENCHMARKS.md).

    python examples/bench_mtp_slice.py --out $OUT/mtp_slice.json      # H200
    python examples/bench_mtp_slice.py --device cpu --quick             # CPU smoke run
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_segments as bs  # noqa: E402  (build, graph)

from dsv4c.export import flat_caches  # noqa: E402
from dsv4c.runtime.segments import SegmentExecutor  # noqa: E402
from dsv4c.targets import DEFAULT_BUCKETS  # noqa: E402


def time_steps(ex, args_fn, steps: int, dev) -> float:
    """Median ms of `steps` calls after 3 warm-up calls (CUDA events; wall clock on CPU)."""
    times = []
    for i in range(steps + 3):
        args = args_fn()
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            ex.run(*args)
            b.record()
            b.synchronize()
            ms = a.elapsed_time(b)
        else:
            t0 = time.perf_counter()
            ex.run(*args)
            ms = (time.perf_counter() - t0) * 1e3
        if i >= 3:
            times.append(ms)
    return statistics.median(times)


def implied(alpha: list[float], k: int, t_dec: float, t_mtp: float, t_ver: float) -> dict:
    acc, p = 0.0, 1.0
    for a in alpha[:k]:
        p *= a
        acc += p
    cost = k * t_mtp + t_ver
    return {"mean_accepted_length": 1 + acc, "speedup": (1 + acc) * t_dec / cost,
            "break_even_length": cost / t_dec}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--kmax", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--alpha", default="0.65,0.60,0.55", help="per-position acceptance for the implied speedup")
    ap.add_argument("--kernels", default="moe_experts=gathered")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    preset = "v4-tiny-a" if a.quick else "v4-flash-slice"
    if a.quick:
        a.batches, a.prompt, a.steps = [1, 3], 24, 3
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = bs.build(preset, dev, dtype)
    cfg = model.config
    n_slots = max(a.batches) + 1
    max_len = a.prompt + 64
    kernels = dict(kv.split("=") for kv in a.kernels.split(",") if kv)
    alpha = [float(x) for x in a.alpha.split(",")]
    buckets = tuple(b for b in DEFAULT_BUCKETS if b < n_slots) + (n_slots - 1,)
    # caches: prefilled main cache (ring W + kmax) and an MTP cache; contents are random-ish, the
    # timings only depend on positions (all sequences at `prompt`).
    cache = model.new_cache(n_slots, max_len=max_len, extra_ring_slots=a.kmax)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for s in range(0, n_slots - 1, 8):
            rows = torch.arange(s, min(s + 8, n_slots - 1), device=dev)
            ids = torch.randint(0, cfg.vocab_size, (len(rows), a.prompt), generator=g).to(dev)
            model(ids, cache, slots=rows)
    mcache = model.new_mtp_cache(n_slots, max_len=max_len, extra_ring_slots=a.kmax)
    flat, mflat = flat_caches(cache.layers), flat_caches(mcache.layers)
    snap = {k: t.clone() for k, t in flat.items()}
    pos = cache.pos.clone()
    res: dict = {"preset": preset, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                 "torch": torch.__version__, "kernels": kernels, "alpha": alpha, "prompt": a.prompt, "rows": []}
    mode = "full" if dev.type == "cuda" else "full-emulate"
    graphs = {(kind, k): bs.graph(model, n_slots, max_len, kernels, kind=kind, k=k, extra_ring_slots=a.kmax)[:2]
              for kind, k in [("decode", k) for k in range(a.kmax + 1)] + [("mtp", 0)]}
    times: dict = {}
    for (kind, k), (plan, split) in graphs.items():
        ex = SegmentExecutor(split, plan, dev, buckets=buckets, mode=mode, pad_slot=n_slots - 1)
        for B in a.batches:
            T = 1 + k
            slots = torch.arange(B, device=dev)
            n_real = torch.full((B,), T, dtype=torch.int64, device=dev)

            def args_fn():
                for name, t in flat.items():
                    t.copy_(snap[name])
                ids = torch.randint(0, cfg.vocab_size, (B, T), device=dev)
                if kind == "mtp":
                    streams = torch.randn(B, T, cfg.hc_mult, cfg.hidden_size, device=dev, dtype=dtype)
                    return (streams, ids, slots, pos[:B].clone(), n_real, mflat)
                return (ids, slots, pos[:B].clone(), n_real, flat)

            ms = time_steps(ex, args_fn, a.steps, dev)
            times[(kind, k, B)] = ms
            print(f"{kind:6} k={k} B={B:3}: {ms:8.3f} ms", flush=True)
        del ex
    for B in a.batches:
        t_dec, t_mtp = times[("decode", 0, B)], times[("mtp", 0, B)]
        for k in range(1, a.kmax + 1):
            t_ver = times[("decode", k, B)]
            row = {"batch": B, "k": k, "decode_ms": t_dec, "verify_ms": t_ver, "mtp_ms": t_mtp,
                   "verify_over_decode": t_ver / t_dec, **implied(alpha, k, t_dec, t_mtp, t_ver)}
            res["rows"].append(row)
    print(table(res))
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))
    return 0


def table(res: dict) -> str:
    out = [f"MTP cost on {res['preset']} ({res['device']}), implied speedup at alpha = {res['alpha']}", "",
           "| batch | k | decode ms | verify(1+k) ms | MTP draft ms | verify/decode | break-even tokens/round | "
           "implied tokens/round | implied speedup |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        out.append(f"| {r['batch']} | {r['k']} | {r['decode_ms']:.2f} | {r['verify_ms']:.2f} | {r['mtp_ms']:.2f} | "
                   f"{r['verify_over_decode']:.2f} | {r['break_even_length']:.2f} | {r['mean_accepted_length']:.2f} | "
                   f"{r['speedup']:.2f}x |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
