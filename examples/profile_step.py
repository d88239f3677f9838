"""Where the time of one decode step goes: the v4-flash-slice decode graph lowered for h200, profiled
with torch.profiler at one batch size.

    python examples/profile_step.py --out $OUT/profile.json        # H200
    python examples/profile_step.py --layers 2 --expert-format mxfp4_w4a16 --out $OUT/p.json   # H100 (80 GB)
    python examples/profile_step.py --device cpu --quick           # CPU smoke run (tiny model)
    python examples/profile_step.py --layers 2 --dense-format bf16 --out $OUT/p.json   # dense widened to bf16
    python examples/profile_step.py --layers 2 --deterministic --expert-format mxfp4_w4a16 --out $OUT/d.json
    python examples/profile_step.py --layers 2 --deterministic --expert-format mxfp4_w4a16 --batch 64 --verify 3 \
        --out $OUT/v.json   # where a verify call of 1 + 3 tokens per row goes (MTP rounds, issue 23)

The experts run as the h200 lowering quantises them (fp8_block, or `--expert-format`; `--bf16-experts`
keeps them bf16). The dense linears the release stores in FP8 run on FP8 blocks as h200 lowers them
(fp8_block_w8a16: the bf16 weights quantised in memory, their bytes counted as stored; the grouped wo_a on
`fp8_grouped_linear`, except in deterministic graphs, which keep it bf16), or widened with `--dense-format bf16`. The
4-layer slice is built in bf16 and its experts converted beside it, which outgrows an 80 GB card with
FP8 experts: `--layers 2` cuts it. `--deterministic` lowers as `compile --deterministic`
(batch-invariant kernels, the fused attention's `fused_det`, bf16 dense unless `--dense-format` says
otherwise), with bf16 experts (`--bf16-experts`), FP4 weight-only ones (`--expert-format mxfp4_w4a16` /
`nvfp4_w4a16`) or FP8 block ones (`--expert-format fp8_block`: `moe_experts_fp8_bi`): where its step time goes.

Prints, for the eager step (segments run op by op): device time and kernel count per operator
(ATen and dsv4c ops, self time), and for the full-graph replay: device time per kernel name and the
kernel count (`--timeline`: the last replayed step kernel by kernel, with the gaps between them). The sum
of kernel times against the replayed step time separates "kernels are slow" from "too many kernels"
(each kernel inside a CUDA graph still costs a launch slot of ~1-2 us). The replayed step is timed twice:
as the host runs it (start event, launch work, replay, end event) and on the GPU alone (`LEAD_CYCLES`: a
sleep kernel ahead of the start event hides the launch work). Compare variants by the second: at batch 1
the first carries 0.1-0.2 ms of host time that differs between processes (run54).

On a GPU it also groups the replay's kernels by class (`kernel_class`: routed experts, attention and
caches, dense GEMMs and head, other) twice: by summed kernel durations, and by each kernel's share of the
last step's critical path (`critical_rows`: how far it moved the latest end; under programmatic dependent
launch a kernel's duration includes its wait for the one before, so the sums overstate). Each grouping sets
each class's time beside the bytes it must read (examples/bench_segments.py `step_bytes`: the experts in
the lowering's format, the unique experts of B tokens as expected under uniform routing, the dense weights
as run and the bf16 head, the caches read at the prompt's length) and the measured copy bandwidth: achieved
GB/s and the share of the bandwidth per class (`class_table`; issue 28's per-kernel-class profile).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_segments as bs  # noqa: E402  (build, prefill, graph, decode)

from dsv4c.export import flat_caches  # noqa: E402
from dsv4c.runtime.segments import SegmentExecutor  # noqa: E402


def _dev_time(evt) -> float:
    """Self device time in us of a profiler aggregate (attribute names differ across torch versions)."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        v = getattr(evt, name, None)
        if v is not None:
            return float(v)
    return 0.0


def op_table(prof, top: int) -> list[dict]:
    rows = []
    for e in prof.key_averages():
        t = _dev_time(e)
        if t > 0:
            rows.append({"name": e.key, "calls": e.count, "device_us": t})
    rows.sort(key=lambda r: -r["device_us"])
    return rows[:top]


def kernel_rows(prof) -> list[dict]:
    """Kernel events only (device side), grouped by name, longest total first: [{name, count, us}]."""
    agg: dict[str, list[float]] = {}
    for e in prof.events():
        on_device = getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
        if on_device and e.name and not e.name.startswith("Memcpy"):
            d = getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0)
            agg.setdefault(e.name, []).append(float(d))
    rows = [{"name": k[:120], "count": len(v), "us": sum(v)} for k, v in agg.items()]
    rows.sort(key=lambda r: -r["us"])
    return rows


def kernel_spans(prof) -> list[tuple[str, float, float]]:
    """Kernel events only (device side) as (name, start us, end us), in start order."""
    spans = []
    for e in prof.events():
        on_device = getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
        if on_device and e.name and not e.name.startswith("Memcpy"):
            spans.append((e.name, float(e.time_range.start), float(e.time_range.end)))
    return sorted(spans, key=lambda s: s[1])


def timeline(spans: list[tuple[str, float, float]], n: int) -> list[dict]:
    """The last n kernel spans (one step's) -> [{name, start, us, gap}]: start from the first of them, gap
    from the latest end among the earlier ones (negative: the kernel started before its predecessors
    ended, as programmatic dependent launch lets it; positive: the GPU ran none of them)."""
    last = spans[-n:] if n > 0 else []
    rows, t0, end = [], last[0][1] if last else 0.0, None
    for name, a, b in last:
        rows.append({"name": name[:60], "start": a - t0, "us": b - a, "gap": 0.0 if end is None else a - end})
        end = b if end is None else max(end, b)
    return rows


def critical_rows(rows: list[dict]) -> list[dict]:
    """`timeline` rows -> [{name, count, us}] by kernel name, us = how far each kernel moved the latest end
    (its time on the step's critical path): under programmatic dependent launch a kernel starts before its
    predecessor ends and its duration counts that wait, so summed durations overstate a class; idle gaps
    count for no kernel."""
    agg: dict[str, list[float]] = {}
    end = None
    for r in rows:
        a, b = r["start"], r["start"] + r["us"]
        gain = b - a if end is None else max(0.0, b - max(end, a))
        end = b if end is None else max(end, b)
        agg.setdefault(r["name"], []).append(gain)
    return [{"name": k, "count": len(v), "us": sum(v)} for k, v in agg.items()]


def kernel_table(prof, top: int) -> tuple[list[dict], int, float]:
    """`kernel_rows` -> (the top rows, kernel count, total us)."""
    rows = kernel_rows(prof)
    return rows[:top], sum(r["count"] for r in rows), sum(r["us"] for r in rows)


# kernel name -> class: dsv4c's Triton kernels by exact name (kernels/*.py), library kernels by a part of it.
# `_act_fp8_kernel` quantises the FP8 experts' activations (and the W8A8 dense linears' under
# --dense-format fp8_block, counted with the experts here).
CLASS_EXACT = {
    "routed experts": ("_moe_gemm_kernel", "_gemv13_kernel", "_gemv2_kernel", "_act_f16_kernel",
                       "_moe_combine_kernel", "_fp8_prefill_kernel", "_act_fp8_kernel", "_act_nvfp4_kernel",
                       "_bi_gemv_kernel"),
    "attention and caches": ("_attn_split_kernel", "_combine_kernel", "_v4_compress_kernel", "_scores_kernel",
                             "_select_kernel", "_select_slice_kernel"),
    "dense GEMMs and head": ("_gemv_kernel", "_fp8_gemm_kernel", "_grouped_linear_kernel", "_fp8_grouped_kernel",
                             "_bi_matmul_kernel", "_dequant_kernel", "_gemv_f32_kernel"),
}
# dsv4c's kernels counted as "other" on purpose (small per-token work that reads no weight of a class's bytes);
# tests/test_profile_step.py checks that every Triton kernel of kernels/ is named here or in CLASS_EXACT
CLASS_OTHER = ("_argmax_part_kernel", "_argmax_final_kernel", "_row_sum_kernel", "_sinkhorn_kernel",
               "_sinkhorn_exact_kernel", "_hc_mix_kernel", "_hc_mix_rows_kernel", "_hc_sumsq_kernel",
               "_hc_pre_finish_kernel", "_hc_pre_finish_exact_kernel", "_hc_post_kernel",
               "_hc_post_mix_kernel", "_hc_post_exact_kernel", "_rms_norm_kernel", "_rms_norm_exact_kernel",
               "_rope_kernel", "_head_rms_rope_kernel", "_rope_angles_kernel", "_route_topk_kernel",
               "_route_hashed_kernel", "_route_hashed_ids_kernel", "_route_prep_kernel", "_swiglu_act_kernel",
               "_prefetch_kernel")
CLASS_PARTS = {"dense GEMMs and head": ("nvjet", "gemm", "gemv", "splitKreduce", "cutlass")}
EXPERT_BYTE_FACTOR = bs.EXPERT_BYTE_FACTOR  # bytes of a routed-expert weight in a format against bf16's 2
CLASS_BYTES = {"routed experts": ("routed_experts",), "attention and caches": ("kv",),
               "dense GEMMs and head": ("non_expert_weights", "head")}


def kernel_class(name: str) -> str:
    """The class of a kernel name (CLASS_EXACT, then CLASS_PARTS), else "other"."""
    for cls, names in CLASS_EXACT.items():
        if name in names:
            return cls
    for cls, parts in CLASS_PARTS.items():
        if any(p in name for p in parts):
            return cls
    return "other"


def class_table(rows: list[dict], steps: int, step_bytes: dict, bandwidth: float) -> list[dict]:
    """Per kernel class over `steps` profiled steps: kernels and us per step, the bytes the class must read
    per step (CLASS_BYTES of `step_bytes`; "other" reads little and gets none), GB/s and the share of the
    copy `bandwidth` (bytes/s) they reach."""
    out = []
    for cls in (*CLASS_EXACT, "other"):
        mine = [r for r in rows if kernel_class(r["name"]) == cls]
        us = sum(r["us"] for r in mine) / steps
        nbytes = sum(step_bytes[k] for k in CLASS_BYTES.get(cls, ()))
        gbs = nbytes / (us / 1e6) / 1e9 if us and nbytes else None
        out.append({"class": cls, "kernels": sum(r["count"] for r in mine) / steps, "us": us, "bytes": nbytes,
                    "gb_s": gbs, "of_bandwidth": gbs * 1e9 / bandwidth if gbs and bandwidth else None})
    return out


def print_classes(classes: list[dict], label: str = "") -> None:
    """`class_table` rows as a markdown table; `label` follows each class name (the critical-path grouping)."""
    print(f"| class{label} | kernels/step | us/step | MB/step | GB/s | of copy bandwidth |\n"
          "|---|---:|---:|---:|---:|---:|")
    for c in classes:
        gbs, share = c["gb_s"], c["of_bandwidth"]
        print(f"| {c['class']}{label} | {c['kernels']:.0f} | {c['us']:.0f} | {c['bytes'] / 1e6:.1f} | "
              f"{'-' if gbs is None else f'{gbs:.0f}'} | {'-' if share is None else f'{share:.0%}'} |")


expected_unique = bs.expected_unique


class JitCompiles:
    """Counts Triton's JIT compiles by kernel name while installed (triton.knobs' post-compile hook), so a
    benchmark can say which stage paid compiles inside its timings. `take()` returns the counts since the last
    take and starts again. Without triton.knobs (older Triton, or none) it counts nothing: `available` False."""

    def __init__(self):
        self.counts: dict[str, int] = {}
        try:
            import triton.knobs as knobs
        except ImportError:
            knobs = None
        self.available = knobs is not None and hasattr(knobs.runtime, "jit_post_compile_hook")
        if self.available:
            self._prev = knobs.runtime.jit_post_compile_hook
            knobs.runtime.jit_post_compile_hook = self._hook

    def _hook(self, *args, **kw) -> None:
        fn = kw.get("fn")
        name = getattr(fn, "name", None) or str(kw.get("repr", "?")).split("[")[0]
        self.counts[name] = self.counts.get(name, 0) + 1
        if self._prev:
            self._prev(*args, **kw)

    def take(self) -> dict:
        out, self.counts = {"total": sum(self.counts.values()), "by_kernel": dict(sorted(self.counts.items()))}, {}
        return out


# A sleep kernel of this many cycles (about 2 ms on an H100 or H200) before a step's start event: the host
# enqueues the step meanwhile, so the replay's time excludes its launch work (run54: at batch 1 on 2 layers the
# replayed kernels spanned 0.86 ms of a 0.98-1.07 ms step; the rest was the host's, and varied by process).
LEAD_CYCLES = 4_000_000


def run_steps(ex, flat, pos0, B: int, T: int, steps: int, V: int, dev, lead_cycles: int = 0) -> list[float]:
    """`steps` calls of the graph from the prefilled state -> ms each: greedy decode steps (T = 1,
    bench_segments.decode) or verify calls of T tokens per row (random drafts, positions advanced by T).
    lead_cycles: as in bench_segments.decode (the GPU's time alone, without the host's)."""
    if T == 1:
        return bs.decode(ex, flat, pos0, B, steps, V, dev, lead_cycles=lead_cycles)[2]
    g = torch.Generator().manual_seed(1)
    slots, pos = torch.arange(B, device=dev), pos0[:B].clone()
    n = torch.full((B,), T, dtype=torch.int64, device=dev)
    times = []
    for _ in range(steps):
        ids = torch.randint(0, V, (B, T), generator=g).to(dev)
        if dev.type == "cuda":  # CUDA events, as bench_segments.decode times a step
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if lead_cycles:
                torch.cuda._sleep(lead_cycles)
            a.record()
            ex.run(ids, slots, pos, n, flat)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            ex.run(ids, slots, pos, n, flat)
            times.append((time.perf_counter() - t0) * 1e3)
        pos += T
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--kernels", default="", help="OP=IMPL overrides, comma separated (e.g. moe_experts=gathered)")
    ap.add_argument("--quantize", action="store_true",
                    help="the default since 2026-12-05 (kept so that the commands logged before still run)")
    ap.add_argument("--bf16-experts", action="store_true",
                    help="skip quantize_experts (bf16 experts; the default keeps the target's expert format)")
    ap.add_argument("--expert-format", default=None, choices=sorted(EXPERT_BYTE_FACTOR),
                    help="routed experts in this format (as compile --expert-format; default: h200's fp8_block)")
    ap.add_argument("--dense-format", default=None, choices=["bf16", "fp8_block", "fp8_block_w8a16"],
                    help="the FP8-stored dense linears' format (as compile --dense-format; default: h200's, "
                         "fp8_block_w8a16; bf16 in --deterministic)")
    ap.add_argument("--deterministic", action="store_true",
                    help="the deterministic lowering; needs --bf16-experts or an --expert-format with a "
                         "batch-invariant kernel (FP4 weight-only, fp8_block)")
    ap.add_argument("--verify", type=int, default=0, metavar="K",
                    help="profile the verify graph of `--mtp K` (1 + K tokens per row, drafts at random) instead")
    ap.add_argument("--layers", type=int, default=None,
                    help="cut the slice to its first N layers (the 4-layer bf16 build and its FP8 copy outgrow 80 GB)")
    ap.add_argument("--skip-passes", nargs="+", default=(), metavar="PASS",
                    help="lower without these passes (e.g. fuse_hc_chain: its effect, against a run with it)")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--timeline", action="store_true",
                    help="print the replay's last step kernel by kernel: start, duration, gap to the ones before")
    ap.add_argument("--one-stream", action="store_true",
                    help="keep the shared experts on the step's stream (default: a second stream, as Session.load)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    preset = "v4-tiny-a" if a.quick else "v4-flash-slice"
    prompt = 40 if a.quick else a.prompt
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = bs.build(preset, dev, dtype, a.layers)
    T = 1 + a.verify  # tokens per row and call
    n_slots, max_len = a.batch + 1, prompt + 16 * T
    cache = bs.prefill(model, n_slots, prompt, max_len, chunk_rows=8, seed=0)
    flat = flat_caches(cache.layers)
    snap = {k: t.clone() for k, t in flat.items()}
    pos0 = cache.pos.clone()
    kernels = dict(kv.split("=") for kv in a.kernels.split(",") if kv)
    quantize = not a.bf16_experts
    if a.deterministic:
        from dsv4c.compile import DETERMINISTIC_EXPERTS

        if quantize and a.expert_format not in DETERMINISTIC_EXPERTS:
            ap.error(f"--deterministic: the experts must be bf16 (--bf16-experts) or one of {DETERMINISTIC_EXPERTS} "
                     "(--expert-format); the other formats' kernels are not batch-invariant")
        kernels.setdefault("v4_attention", "fused_det")
    fmt = (a.expert_format or "fp8_block") if quantize else "bf16"  # h200's expert format unless told
    plan, split, stats = bs.graph(model, n_slots, max_len, kernels, quantize=quantize, skip=tuple(a.skip_passes),
                                  expert_format=a.expert_format, dense_format=a.dense_format,
                                  deterministic=a.deterministic, k=a.verify, side_stream=not a.one_stream)
    blockers = stats.get("make_batch_invariant", {}).get("blockers", [])
    if a.deterministic and blockers and dev.type == "cuda":
        raise SystemExit(f"--deterministic: the graph keeps ops that are not batch-invariant: {blockers[:6]}")
    fp8_dense = len(stats.get("quantize_dense", {}).get("linears", []))
    res: dict = {"preset": preset, "layers": model.config.num_hidden_layers, "batch": a.batch, "kernels": kernels,
                 "quantize": quantize, "expert_format": fmt, "dense_format": a.dense_format or "target default",
                 "fp8_dense_linears": fp8_dense, "deterministic": a.deterministic, "blockers": blockers,
                 "skipped_passes": list(a.skip_passes), "tokens_per_row": T,
                 "segments": len(plan.segments), "capturable": plan.n_capturable,
                 "side_stream": stats.get("overlap_shared_experts", {}).get("forked", 0)}
    print(f"== side stream: {res['side_stream']} shared experts forked", flush=True)
    cfg = model.config
    unique = [expected_unique(cfg.n_routed_experts, cfg.num_experts_per_tok, a.batch * T)] * cfg.num_hidden_layers
    sb = bs.step_bytes(model, a.batch, prompt, unique)
    if quantize:  # the experts' bytes as stored in their format (bf16 counted by step_bytes)
        sb["routed_experts"] = sb["routed_experts"] * EXPERT_BYTE_FACTOR[fmt]
    if fp8_dense:  # the rewritten FP8-stored weights as stored (1 byte + a scale byte per 128x128 tile); the
        saved = bs.stored_bytes_saved(model)  # grouped wo_a too where quantize_dense rewrote it (not deterministic)
        wo_a_fp8 = any(r.get("grouped") for r in stats["quantize_dense"]["linears"])
        for key in ("non_expert_weights", "total"):
            sb[key] -= saved["saved"] - (0 if wo_a_fp8 else saved["wo_a_saved"])
    bw = bs.copy_bandwidth(dev) if dev.type == "cuda" else 0.0
    res["step_bytes"], res["copy_bandwidth_gb_s"] = sb, bw / 1e9
    V = model.config.vocab_size
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])

    def restore():
        for k, t in flat.items():
            t.copy_(snap[k])

    modes = ["eager"]
    if dev.type == "cuda":
        modes.append("full" if plan.n_capturable == len(plan.segments) else "graphs")
    blockers = sorted({s.reason for s in plan.segments if not s.capturable and s.reason})
    if blockers:  # run64's first call timed piecewise steps as if whole: say so where the figures are read
        res["not_one_graph"] = blockers
        print(f"== note: {len(plan.segments) - plan.n_capturable} of {len(plan.segments)} segments are not "
              f"capturable, so the step replays piecewise ('graphs'), not as one graph: {'; '.join(blockers)}")
    for mode in modes:
        ex = SegmentExecutor(split, plan, dev, mode=mode, pad_slot=n_slots - 1)
        restore()
        ms = run_steps(ex, flat, pos0, a.batch, T, 8, V, dev)  # warm-up + capture
        step_ms = statistics.median(ms[3:])
        gpu_ms = None
        if mode != "eager":  # the same replay with the host's launch work hidden behind a sleep kernel
            restore()
            gpu_ms = statistics.median(run_steps(ex, flat, pos0, a.batch, T, 8, V, dev, LEAD_CYCLES)[3:])
        restore()
        with profile(activities=acts) as prof:
            run_steps(ex, flat, pos0, a.batch, T, 3, V, dev)
        ops = op_table(prof, a.top)
        kern, n_kern, kern_us = kernel_table(prof, a.top)
        res[mode] = {"step_ms": step_ms, "gpu_step_ms": gpu_ms, "kernels_per_step": n_kern / 3,
                     "kernel_us_per_step": kern_us / 3,
                     "ops": ops, "kernels": kern}
        if mode != "eager":
            res[mode]["classes"] = classes = class_table(kernel_rows(prof), 3, sb, bw)
            print_classes(classes)
        gpu = "" if gpu_ms is None else f" ({gpu_ms:.3f} ms on the GPU alone)"
        print(f"\n== {mode}: {step_ms:.3f} ms/step{gpu}; {n_kern / 3:.0f} kernels/step, sum of kernel time "
              f"{kern_us / 3 / 1e3:.3f} ms/step", flush=True)
        print("| op (self) | calls/3 steps | device us/step |\n|---|---:|---:|")
        for r in ops:
            print(f"| {r['name'][:70]} | {r['calls']} | {r['device_us'] / 3:.0f} |")
        print("| kernel | count/step | us/step |\n|---|---:|---:|")
        for r in kern:
            print(f"| {r['name'][:90]} | {r['count'] / 3:.0f} | {r['us'] / 3:.0f} |")
        if mode != "eager":
            rows = timeline(kernel_spans(prof), round(n_kern / 3))
            res[mode]["critical_classes"] = crit = class_table(critical_rows(rows), 1, sb, bw)
            print_classes(crit, " (critical path)")
            if a.timeline:
                res[mode]["timeline"] = rows
                print("| kernel | start us | us | gap us |\n|---|---:|---:|---:|")
                for r in rows:
                    print(f"| {r['name']} | {r['start']:.1f} | {r['us']:.1f} | {r['gap']:.1f} |")
        del ex
        if a.out:
            a.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
