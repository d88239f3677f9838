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
"""
from __future__ import annotations

import argparse
import functools
import json
import time

import torch
from dsv4c.kernels import moe_grouped as M

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write JSON here")
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--formats", default="bf16,fp8_block,mxfp4,nvfp4")
    ap.add_argument("--no-peers", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
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
