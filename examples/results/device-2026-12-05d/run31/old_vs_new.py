"""run31: the FP4 GEMV before this change (moe_fp4_gemv_before.py, a copy of kernels/moe_fp4_gemv.py at
d2dc150) against the new one at rows 1 and rows 4, Flash expert shapes (E 256, D 4096, I 2048, top-6),
MXFP4 and NVFP4, tokens 1 / 8 / 32 / 64 / 128 / 256, each call one CUDA-graph replay cycling over 8
routings (so weights are not L2-resident across calls); medians of 15 replays, the variants interleaved.
Also: the new rows 1 and rows 4 outputs equal the old kernel's bits."""
import importlib.util
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../../.."))
from bench_moe_kernels import copy_bandwidth, expert_bytes, make_experts, make_routing  # noqa: E402

from dsv4c.kernels.moe_fp4_gemv import Fp4GemvConfig, moe_fp4_gemv  # noqa: E402

spec = importlib.util.spec_from_file_location("before", os.path.join(os.path.dirname(__file__),
                                                                     "moe_fp4_gemv_before.py"))
before = importlib.util.module_from_spec(spec)
sys.modules["before"] = before   # dataclasses look their module up there
spec.loader.exec_module(before)
dev = torch.device("cuda")
E, D, I, K = 256, 4096, 2048, 6
bw = copy_bandwidth(dev)
out = {"device": torch.cuda.get_device_name(), "copy_bw_Bps": bw, "rows": []}
print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
print("| fmt | tokens | experts used | before us | rows1 us | rows4 us | rows4 % copy BW | rows1 == before | rows4 == before |")
print("|---|---|---|---|---|---|---|---|---|")
for fmt in ("mxfp4", "nvfp4"):
    ex = make_experts(fmt, E, I, D, dev)
    per = expert_bytes(ex)
    g13 = getattr(ex, "w13_global", None)
    g2 = getattr(ex, "w2_global", None)
    for t in (1, 8, 32, 64, 128, 256):
        x = (torch.randn(t, D, device=dev) * 0.5).bfloat16()
        rts = [make_routing(t, K, E, dev, seed=s) for s in range(8)]
        used = statistics.mean(int(torch.unique(r[0]).numel()) for r in rts)
        variants = {
            "before": lambda idx, w: before.moe_fp4_gemv(x, idx, w, ex.w13, ex.w13_scale, g13, ex.w2, ex.w2_scale, g2,
                                                         ex.group, 10.0, before.Fp4GemvConfig()),
            "rows1": lambda idx, w: moe_fp4_gemv(x, idx, w, ex.w13, ex.w13_scale, g13, ex.w2, ex.w2_scale, g2,
                                                 ex.group, 10.0, Fp4GemvConfig()),
            "rows4": lambda idx, w: moe_fp4_gemv(x, idx, w, ex.w13, ex.w13_scale, g13, ex.w2, ex.w2_scale, g2,
                                                 ex.group, 10.0, Fp4GemvConfig(rows=4)),
        }
        ys = {n: f(*rts[0]) for n, f in variants.items()}
        graphs = {}
        for n, f in variants.items():
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for r in rts:
                    f(*r)
            torch.cuda.current_stream().wait_stream(s)
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr):
                for r in rts:
                    f(*r)
            graphs[n] = gr
        times = {n: [] for n in variants}
        for _ in range(15):
            for n, gr in graphs.items():
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                gr.replay()
                b.record()
                b.synchronize()
                times[n].append(a.elapsed_time(b) * 1e3 / len(rts))
        us = {n: statistics.median(v) for n, v in times.items()}
        row = {"fmt": fmt, "tokens": t, "experts_used": used, "us": us,
               "rows4_bw_ratio": used * per / (us["rows4"] / 1e6) / bw,
               "rows1_bw_ratio": used * per / (us["rows1"] / 1e6) / bw,
               "rows1_equal_before": bool(torch.equal(ys["rows1"], ys["before"])),
               "rows4_equal_before": bool(torch.equal(ys["rows4"], ys["before"]))}
        out["rows"].append(row)
        print(f"| {fmt} | {t} | {used:.0f} | {us['before']:.1f} | {us['rows1']:.1f} | {us['rows4']:.1f} | "
              f"{100 * row['rows4_bw_ratio']:.0f}% | {row['rows1_equal_before']} | {row['rows4_equal_before']} |",
              flush=True)
        del graphs
    del ex
    torch.cuda.empty_cache()
with open(os.path.join(os.environ.get("OUT", "."), "old_vs_new.json"), "w") as f:
    json.dump(out, f, indent=1)
