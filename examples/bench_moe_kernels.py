"""Benchmark of the grouped MoE kernels (dsv4c.kernels.moe_grouped) at Flash expert shapes.

Measures, in one run: HBM copy bandwidth (device-to-device copy of a large buffer) and the dense
FP8 peak (torch._scaled_mm, large square, per-tensor scales). Then per format:
  decode (tokens 1, 8, 64): achieved weight bytes/s = bytes of the experts actually routed to
    (weights + scales) / time, and its ratio to the copy bandwidth;
  prefill (tokens 4096, 16384): TFLOP/s = 6*T*K*I*D / time, and its ratio to the FP8 peak.
Peers: bf16 torch.matmul looped over experts, torch._scaled_mm (per-tensor FP8) looped over
experts (token lists built outside the timed region, which favours the peers), and the
reference op torch.ops.dsv4c.moe_experts (bf16).

    python examples/bench_moe_kernels.py --out bench_moe.json            # H200
    TRITON_INTERPRET=1 python examples/bench_moe_kernels.py --small      # CPU smoke run

Prints a markdown table; --out writes JSON.

--sweep: decode tile/variant sweep instead. For tokens 1, 8, 64 (and 4096 for fp8_block with
--prefill) and each format, a short list of MoeKernelConfig candidates is timed eagerly and as a
CUDA-graph replay (deployment runs under graphs), each call cycling over several routings so that
the experts' weights are not L2-resident across calls. Every candidate's output is checked against
the default config's (rel err < KERNEL_REL_ERR[fmt]); a candidate that fails to compile or run is
recorded as an error and skipped. Reports us, % of the copy bandwidth measured in the same run,
the best config per (format, tokens), and FP8/FP4 time ratios at 1 and 8 tokens; the JSON is
rewritten after every cell, so a timeout keeps what was measured.

    python examples/bench_moe_kernels.py --sweep --out sweep.json --plot sweep.png   # H200, ~3-4 min
    TRITON_INTERPRET=1 python examples/bench_moe_kernels.py --small --sweep
    python examples/bench_moe_kernels.py --plot-from sweep.json --plot sweep.png     # re-plot, no GPU
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time

import torch
from dsv4c.kernels import moe_grouped as M
from dsv4c.kernels.tolerances import KERNEL_REL_ERR, rel_err

import dsv4c.model.moe  # noqa: F401  (registers torch.ops.dsv4c.moe_experts)


def timeit(fn, iters: int, warmup: int = 2) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    times = []
    cuda = torch.cuda.is_available()
    for _ in range(iters):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth(dev) -> float | None:
    if dev.type != "cuda":
        return None
    n = 2 << 30
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    t = timeit(lambda: b.copy_(a), 10)
    return 2 * n / t


def fp8_peak(dev) -> float | None:
    if dev.type != "cuda":
        return None
    n = 8192
    a = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=dev)
    t = timeit(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), 10)
    return 2 * n ** 3 / t


def make_experts(fmt: str, e: int, i: int, d: int, dev) -> M.Experts:
    """Random experts directly in the format (quantising 6 G weights from float is needless)."""
    def u8(*shape, lo=0, hi=256):
        return torch.randint(lo, hi, shape, dtype=torch.uint8, device=dev)
    if fmt == "bf16":
        return M.Bf16Experts((torch.randn(e, 2 * i, d, device=dev, dtype=torch.bfloat16) * d ** -0.5),
                             torch.randn(e, d, i, device=dev, dtype=torch.bfloat16) * i ** -0.5)
    if fmt == "fp8_block":
        def fp8(*s):
            return torch.randn(*s, device=dev, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
        sc = 2.0 ** -8
        return M.Fp8BlockExperts(fp8(e, 2 * i, d), torch.full((e, 2 * i // 128, d // 128), sc, device=dev),
                                 fp8(e, d, i), torch.full((e, d // 128, i // 128), sc, device=dev))
    if fmt == "mxfp4":
        e8 = torch.float8_e8m0fnu
        return M.Mxfp4Experts(u8(e, 2 * i, d // 2), u8(e, 2 * i, d // 32, lo=118, hi=124).view(e8),
                              u8(e, d, i // 2), u8(e, d, i // 32, lo=118, hi=124).view(e8))
    e4 = torch.float8_e4m3fn
    return M.Nvfp4Experts(u8(e, 2 * i, d // 2), u8(e, 2 * i, d // 16, lo=0x30, hi=0x40).view(e4),
                          torch.full((e,), 1e-3, device=dev), u8(e, d, i // 2),
                          u8(e, d, i // 16, lo=0x30, hi=0x40).view(e4), torch.full((e,), 1e-3, device=dev))


def expert_bytes(ex: M.Experts) -> int:
    """Bytes of one expert's weights and scales."""
    total = 0
    for name in ("w13", "w13_scale", "w13_global", "w2", "w2_scale", "w2_global"):
        t = getattr(ex, name, None)
        if t is not None:
            total += t[0].numel() * t.element_size()
    return total


def make_routing(t: int, k: int, e: int, dev, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.rand(t, e, generator=g).argsort(dim=1)[:, :k]
    weight = torch.rand(t, k, generator=g)
    return idx.to(dev), weight.to(dev)


def expert_rows(idx: torch.Tensor, e: int) -> list[tuple[int, torch.Tensor]]:
    """Host-built token lists per used expert (outside the timed region)."""
    flat = idx.reshape(-1).cpu()
    rows = torch.arange(idx.shape[0]).repeat_interleave(idx.shape[1])
    return [(j, rows[flat == j].to(idx.device)) for j in range(e) if bool((flat == j).any())]


def peer_bf16_loop(x, lists, w13, w2, i, limit):
    def run():
        out = torch.zeros_like(x)
        for j, r in lists:
            gu = x[r] @ w13[j].t()
            g, u = gu[:, :i].clamp(max=limit), gu[:, i:].clamp(-limit, limit)
            out.index_add_(0, r, (torch.nn.functional.silu(g) * u) @ w2[j].t())
        return out
    return run


def peer_scaled_mm_loop(x, lists, q13, q2, i, limit):
    one = torch.ones((), device=x.device)

    def run():
        out = torch.zeros_like(x)
        for j, r in lists:
            xs = x[r]
            pad = (-xs.shape[0]) % 16
            xq = torch.nn.functional.pad(xs, (0, 0, 0, pad)).to(torch.float8_e4m3fn)
            gu = torch._scaled_mm(xq, q13[j].t(), one, one, out_dtype=torch.bfloat16)
            g, u = gu[:, :i].clamp(max=limit), gu[:, i:].clamp(-limit, limit)
            h = (torch.nn.functional.silu(g) * u).to(torch.float8_e4m3fn)
            y = torch._scaled_mm(h, q2[j].t(), one, one, out_dtype=torch.bfloat16)
            out.index_add_(0, r, y[: xs.shape[0]])
        return out
    return run


# ---------------------------------------------------------------------------------------------
# --sweep


def log(*a) -> None:
    print(*a, flush=True)


def sweep_candidates(fmt: str, prefill: bool, small: bool) -> list[tuple[str, M.MoeKernelConfig | None]]:
    """(name, config) to try, most promising first; None = default_config."""
    C = M.MoeKernelConfig
    if small:   # CPU interpreter: a few, to exercise every path
        if fmt in ("mxfp4", "nvfp4"):
            return [("default", None), ("split bn32 bk64", C(16, 32, 64, 4, 3, True)),
                    ("split bn64 bk128 sk2", C(16, 64, 128, 4, 3, True, 2)),
                    ("scaled bn32 bk64 direct", C(16, 32, 64, 4, 3, fp4_scaled=fmt == "mxfp4", direct=True)),
                    ("gemv bn32 bk64 w4", C(block_n=32, block_k=64, num_warps=4, gemv=True))]
        return [("default", None), ("bn64 sk2", C(16, 64, 128, 4, 3, False, 2)),
                ("bn64 direct", C(16, 64, 128, 4, 3, direct=True))]
    if prefill:
        # fp8_prefill: kernels/moe_fp8_prefill.py, which default_config picks from 64 assignments per expert
        extra = [("fp8_prefill", C(fp8_prefill=True))] if fmt == "fp8_block" else []
        return [("default", None)] + extra + [
                ("m128 n128 w4 s3", C(128, 128, 128, 4, 3)), ("m64 n128 w4 s4", C(64, 128, 128, 4, 4)),
                ("m128 n256 w8 s3", C(128, 256, 128, 8, 3)), ("m128 n128 w8 s4", C(128, 128, 128, 8, 4)),
                ("m128 n64 w4 s4", C(128, 64, 128, 4, 4)), ("m64 n256 w8 s3", C(64, 256, 128, 8, 3))]
    def tag(name, direct):
        return name + (" direct" if direct else "")
    if fmt in ("mxfp4", "nvfp4"):
        def gv(bn, bk, w, pdl=True):   # CUDA-core GEMV kernels (kernels/moe_fp4_gemv.py)
            name = f"gemv bn{bn} bk{bk} w{w}" + ("" if pdl else " nopdl")
            return name, C(block_n=bn, block_k=bk, num_warps=w, gemv=True, pdl=pdl)
        gemv = [gv(32, 512, 4, False), gv(32, 256, 4), gv(32, 512, 4), gv(32, 1024, 4), gv(64, 256, 4), gv(64, 512, 8),
                gv(32, 256, 2), gv(32, 256, 2, False), gv(32, 512, 8)]

        def sp(bn, bk, w, st, direct=False):
            return tag(f"split bn{bn} bk{bk} w{w} s{st}", direct), C(16, bn, bk, w, st, True, direct=direct)

        def sc(bn, bk, w, st, direct=False):   # tl.dot_scaled (MXFP4 only)
            return tag(f"scaled bn{bn} bk{bk} w{w} s{st}", direct), C(16, bn, bk, w, st, fp4_scaled=True, direct=direct)
        if fmt == "nvfp4":
            return [("default", None)] + gemv + [sp(64, 256, 4, 4)]
        return [("default", None)] + gemv + [sc(64, 128, 4, 4, True), sc(64, 256, 4, 4)]
    if fmt == "fp8_block":   # GEMM 1 always runs BLOCK_N 128 (h quantised per 128 in its epilogue)
        def f8(bn, w, st, direct=False):
            return tag(f"bn{bn} w{w} s{st}", direct), C(16, bn, 128, w, st, direct=direct)

        def g8(bn, bk, w):   # CUDA-core GEMV kernels (kernels/moe_fp8_gemv.py): bn W2 rows, bn / 2 of W1 and W3
            return f"gemv bn{bn} bk{bk} w{w}", C(block_n=bn, block_k=bk, num_warps=w, gemv=True)
        gemv = [g8(32, 512, 8), g8(32, 256, 4), g8(32, 512, 4), g8(32, 256, 8), g8(32, 1024, 8), g8(64, 256, 4),
                g8(64, 512, 8), g8(64, 256, 8)]
        return [("default", None)] + gemv + [f8(64, 4, 4, True), f8(32, 4, 4, True), f8(128, 4, 4, True),
                                             f8(64, 4, 3, True)]
    return [("default", None), ("bn32 bk128 w4 s4 direct", C(16, 32, 128, 4, 4, direct=True)),
            ("bn64 bk64 w4 s4 direct", C(16, 64, 64, 4, 4, direct=True))]


def time_eager(fn, iters: int) -> float:
    return timeit(fn, iters, warmup=1)


def time_graph(fn, replays: int) -> float:
    """Median seconds of one replay of a graph holding one call of fn (CUDA only)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    try:
        return timeit(graph.replay, replays, warmup=2)
    finally:
        del graph


def run_sweep(args, dev) -> dict:
    t_start = time.time()
    if args.small:
        e, d, i, k, tokens, n_rot, iters = 4, 128, 128, 2, [1, 5], 1, 1
    else:
        e, d, i, k, tokens, n_rot, iters = 256, 4096, 2048, 6, [1, 8, 64], 8, 5
    if args.tokens:   # token counts above 64 get the prefill candidates
        tokens = [int(t) for t in args.tokens.split(",")]
    limit = 10.0
    cuda = dev.type == "cuda"
    bw = copy_bandwidth(dev)
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           "shape": {"E": e, "D": d, "I": i, "K": k}, "copy_bw_Bps": bw, "routings_per_call": n_rot,
           "timing": "per-call us = median over repeats of (time of n_rot calls, each on a different routing) / n_rot",
           "rows": [], "best": {}, "budget_s": args.budget_s}
    log(f"copy bandwidth {bw / 1e12:.3f} TB/s" if bw else "copy bandwidth: n/a (cpu)")

    def dump() -> None:
        res["elapsed_s"] = round(time.time() - t_start, 1)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)

    cells = [(f, t) for f in args.formats.split(",") for t in tokens]
    if args.prefill and "fp8_block" in args.formats.split(",") and not args.small:
        cells.append(("fp8_block", 4096))
    by_fmt: dict[str, list[int]] = {}
    for f, t in cells:
        by_fmt.setdefault(f, []).append(t)
    log("\n| format | tokens | candidate | eager us | graph us | % copy BW (graph) | rel err vs default | status |")
    log("|---|---|---|---|---|---|---|---|")
    for fmt, fmt_tokens in by_fmt.items():
        ex = make_experts(fmt, e, i, d, dev)
        per_expert = expert_bytes(ex)
        cell_inputs = {}
        for t in fmt_tokens:    # routings, inputs and the default config's output (the correctness baseline)
            x = (torch.randn(t, d, device=dev) * 0.5).bfloat16()
            rts = [make_routing(t, k, e, dev, seed=s) for s in range(n_rot if t <= 64 else 1)]
            used = statistics.mean(int(torch.unique(r[0]).numel()) for r in rts)
            try:
                base = M.moe_grouped(x, rts[0][0], rts[0][1], ex, limit)
            except Exception as exc:   # noqa: BLE001
                log(f"| {fmt} | {t} | default | - | - | - | - | error: {type(exc).__name__}: {str(exc)[:200]} |")
                base = None
            cell_inputs[t] = (x, rts, used, base)
        cands = {}
        for t in fmt_tokens:
            for name, cfg in sweep_candidates(fmt, t > 64, args.small):
                if args.candidates and not any(c in name for c in args.candidates.split(",")):
                    continue
                cands.setdefault((t > 64, name), (name, cfg, []))[2].append(t)
        for name, cfg, cand_tokens in cands.values():
            for t in cand_tokens:
                x, rts, used, base = cell_inputs[t]
                c = cfg or M.default_config(fmt, t * k, e, dev)
                row = {"format": fmt, "tokens": t, "candidate": name, "config": dataclasses.asdict(c),
                       "experts_used": used, "weight_bytes": used * per_expert}
                res["rows"].append(row)
                if time.time() - t_start > args.budget_s:
                    row["status"] = "skipped (budget)"
                    log(f"| {fmt} | {t} | {name} | - | - | - | - | {row['status']} |")
                    continue
                try:
                    y = M.moe_grouped(x, rts[0][0], rts[0][1], ex, limit, c)
                    if base is not None:
                        row["rel_err"] = rel_err(y, base)
                        ok = row["rel_err"] < KERNEL_REL_ERR[fmt]
                    else:
                        ok = bool(torch.isfinite(y.float()).all())

                    def call(c=c, x=x, rts=rts):
                        for idx, w in rts:
                            M.moe_grouped(x, idx, w, ex, limit, c)
                    row["eager_us"] = time_eager(call, iters) / len(rts) * 1e6
                    if cuda:
                        row["graph_us"] = time_graph(call, iters + 3) / len(rts) * 1e6
                    row["status"] = "ok" if ok else "WRONG"
                except Exception as exc:   # noqa: BLE001  (compile or launch failure: record, go on)
                    row["status"] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                    if cuda:
                        torch.cuda.synchronize()
                us = row.get("graph_us") or row.get("eager_us")
                if us and bw:
                    row["bw_ratio"] = row["weight_bytes"] / (us / 1e6) / bw
                bwp = f"{100 * row['bw_ratio']:.0f}%" if row.get("bw_ratio") else "-"
                log(f"| {fmt} | {t} | {name} | {row.get('eager_us', float('nan')):.1f} | "
                    f"{row.get('graph_us', float('nan')):.1f} | {bwp} | {row.get('rel_err', float('nan')):.2e} | "
                    f"{row['status']} |")
            dump()
        del ex, cell_inputs
        if cuda:
            torch.cuda.empty_cache()
    summarize(res, bw)
    dump()
    return res


def summarize(res: dict, bw: float | None) -> None:
    """Best config per (format, tokens) by graph time (eager on CPU), FP8/FP4 ratios."""
    best = {}
    for r in res["rows"]:
        us = r.get("graph_us") or r.get("eager_us")
        if r.get("status") != "ok" or not us:
            continue
        key = f"{r['format']}@{r['tokens']}"
        if key not in best or us < best[key]["us"]:
            best[key] = {"us": us, "candidate": r["candidate"], "config": r["config"], "bw_ratio": r.get("bw_ratio"),
                         "eager_us": r.get("eager_us")}
    res["best"] = best
    log("\n| format@tokens | best candidate | us (graph) | eager us | % copy BW | config |")
    log("|---|---|---|---|---|---|")
    for key, b in best.items():
        bwp = f"{100 * b['bw_ratio']:.0f}%" if b["bw_ratio"] else "-"
        log(f"| {key} | {b['candidate']} | {b['us']:.1f} | {b['eager_us']:.1f} | {bwp} | {b['config']} |")
    ratios = {}
    for f in ("mxfp4", "nvfp4"):
        for t in (1, 8):
            a, b = best.get(f"fp8_block@{t}"), best.get(f"{f}@{t}")
            if a and b:
                ratios[f"{f}@{t}"] = a["us"] / b["us"]
    res["fp4_speedup_vs_fp8_best"] = ratios
    log("\nFP4 weight-only speedup over fp8_block (best configs, time ratio; target >= 1.6):",
        {k2: round(v, 2) for k2, v in ratios.items()})


def plot_sweep(res: dict, path: str) -> None:
    """One panel per format: graph-replay us per call of the sweep's "default" candidate and of the
    best candidate, at each token count, with the best's share of the copy bandwidth."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fmts = list(dict.fromkeys(r["format"] for r in res["rows"]))
    fig, axes = plt.subplots(1, len(fmts), figsize=(4 * len(fmts), 3.6), squeeze=False)
    for ax, fmt in zip(axes[0], fmts):
        rows = [r for r in res["rows"] if r["format"] == fmt and r.get("status") == "ok"]
        tokens = sorted({r["tokens"] for r in rows})
        us = lambda r: r.get("graph_us") or r.get("eager_us")   # noqa: E731
        default = [next((us(r) for r in rows if r["tokens"] == t and r["candidate"] == "default"), float("nan"))
                   for t in tokens]
        best = [min((r for r in rows if r["tokens"] == t), key=us) for t in tokens]
        xs = range(len(tokens))
        ax.bar([x - 0.2 for x in xs], default, 0.4, label="default config")
        ax.bar([x + 0.2 for x in xs], [us(b) for b in best], 0.4, label="best candidate")
        for x, b in zip(xs, best):
            if b.get("bw_ratio"):
                ax.annotate(f"{100 * b['bw_ratio']:.0f}%", (x + 0.2, us(b)), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs), [str(t) for t in tokens])
        ax.set_xlabel("tokens")
        ax.set_title(fmt)
        ax.set_yscale("log")
    axes[0][0].set_ylabel("us per call (CUDA-graph replay)" if res.get("copy_bw_Bps") else "us per call (eager)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"grouped MoE decode sweep, {res.get('device', '?')} (labels: best's % of copy bandwidth)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write JSON here")
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--formats", default="bf16,fp8_block,mxfp4,nvfp4")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="decode tile/variant sweep (see the module docstring)")
    ap.add_argument("--prefill", action="store_true", help="--sweep: add fp8_block at 4096 tokens")
    ap.add_argument("--budget-s", type=float, default=200.0, help="--sweep: stop starting candidates after this")
    ap.add_argument("--tokens", default=None, help="--sweep: comma list of token counts instead of 1,8,64")
    ap.add_argument("--candidates", default=None,
                    help="--sweep: comma list of substrings; keep only candidates whose name has one")
    ap.add_argument("--plot", default=None, help="--sweep: also plot default vs best per format to this PNG")
    ap.add_argument("--plot-from", default=None, help="plot a saved --sweep JSON to --plot and exit")
    args = ap.parse_args()
    if args.plot_from:
        if not args.plot:
            ap.error("--plot-from needs --plot PNG")
        with open(args.plot_from) as f:
            plot_sweep(json.load(f), args.plot)
        return
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.sweep:
        if args.formats == ap.get_default("formats"):
            args.formats = "mxfp4,nvfp4,fp8_block,bf16"    # the targets first: a timeout cuts the control
        res = run_sweep(args, dev)
        if args.plot:
            plot_sweep(res, args.plot)
        return
    if args.small:
        e, d, i, k, decode, prefill = 8, 256, 128, 2, [1, 8], [64]
    else:
        e, d, i, k, decode, prefill = 256, 4096, 2048, 6, [1, 8, 64], [4096, 16384]
    limit = 10.0
    bw, peak = copy_bandwidth(dev), fp8_peak(dev)
    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "shape": {"E": e, "D": d, "I": i, "K": k},
           "copy_bw_Bps": bw, "fp8_peak_flops": peak, "rows": []}
    if bw and peak:
        print(f"copy bandwidth {bw / 1e12:.3f} TB/s, FP8 dense peak {peak / 1e12:.0f} TFLOP/s")
    fmts = args.formats.split(",")
    peers_done = set()
    for fmt in fmts:
        ex = make_experts(fmt, e, i, d, dev)
        per_expert = expert_bytes(ex)
        for t in decode + prefill:
            x = (torch.randn(t, d, device=dev) * 0.5).bfloat16()
            idx, weight = make_routing(t, k, e, dev)
            used = int(torch.unique(idx).numel())
            sec = timeit(functools.partial(M.moe_grouped, x, idx, weight, ex, limit), args.iters)
            row = {"format": fmt, "impl": "triton moe_grouped", "tokens": t, "us": sec * 1e6, "experts_used": used,
                       "weight_bytes": used * per_expert, "flops": 6 * t * k * i * d}
            rows = [row]
            if not args.no_peers and t not in peers_done and fmt == fmts[-1]:
                peers_done.add(t)
                lists = expert_rows(idx, e)
                wb = make_experts("bf16", e, i, d, dev)
                rows.append(dict(row, format="bf16", impl="torch.matmul loop",
                                 us=timeit(peer_bf16_loop(x, lists, wb.w13, wb.w2, i, limit), 3) * 1e6,
                                 weight_bytes=used * expert_bytes(wb)))
                w1, w3 = wb.w13[:, :i], wb.w13[:, i:]
                rows.append(dict(row, format="bf16", impl="ref op dsv4c::moe_experts",
                                 us=timeit(functools.partial(torch.ops.dsv4c.moe_experts, x, idx, weight, w1, w3, wb.w2, limit), 3) * 1e6,
                                 weight_bytes=used * expert_bytes(wb)))
                del wb, w1, w3
                if dev.type == "cuda":
                    f8 = make_experts("fp8_block", e, i, d, dev)
                    rows.append(dict(row, format="fp8 per-tensor", impl="torch._scaled_mm loop",
                                     us=timeit(peer_scaled_mm_loop(x, lists, f8.w13, f8.w2, i, limit), 3) * 1e6,
                                     weight_bytes=used * (f8.w13[0].numel() + f8.w2[0].numel())))
                    del f8
            for r in rows:
                s = r["us"] / 1e6
                r["bytes_per_s"] = r["weight_bytes"] / s
                r["flops_per_s"] = r["flops"] / s
                r["bw_ratio"] = r["bytes_per_s"] / bw if bw else None
                r["peak_ratio"] = r["flops_per_s"] / peak if peak else None
                res["rows"].append(r)
        del ex
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    by = {(r["format"], r["tokens"]): r["us"] for r in res["rows"] if r["impl"] == "triton moe_grouped"}
    res["fp4_speedup_vs_fp8"] = {f"{f}@{t}": by[("fp8_block", t)] / by[(f, t)]
                                 for f in ("mxfp4", "nvfp4") for t in decode
                                 if (f, t) in by and ("fp8_block", t) in by}
    print("\n| format | impl | tokens | experts used | us | weight GB/s | % copy BW | TFLOP/s | % FP8 peak |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        bwp = f"{100 * r['bw_ratio']:.0f}%" if r["bw_ratio"] else "-"
        pkp = f"{100 * r['peak_ratio']:.0f}%" if r["peak_ratio"] else "-"
        print(f"| {r['format']} | {r['impl']} | {r['tokens']} | {r['experts_used']} | {r['us']:.0f} | "
              f"{r['bytes_per_s'] / 1e9:.0f} | {bwp} | {r['flops_per_s'] / 1e12:.1f} | {pkp} |")
    print("\nFP4 weight-only speedup over fp8_block:", {k2: round(v, 2) for k2, v in res["fp4_speedup_vs_fp8"].items()})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
