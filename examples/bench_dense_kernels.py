"""Issue 28 item 1: the dense linears of a V4 decode step, bf16 against the FP8 block kernels, per shape.

    python examples/bench_dense_kernels.py --out $OUT/dense_kernels.json                      # H200, < 1 min
    python examples/bench_dense_kernels.py --sweep --budget-s 240 --out $OUT/dense_sweep.json # + GEMV tiles
    python examples/bench_dense_kernels.py --device cpu --quick --out q.json                  # interpreter smoke run

For each FP8-stored dense linear of the preset's decoder layers as the decode graph runs them (fused
by passes/fuse_projections.py: wq_a ‖ wkv, wq_b, wq_b ‖ the indexer's wq_b in CSA layers, wo_b, the
shared expert's w1 ‖ w3 and w2) and each token count M:
  * `bf16 linear`: F.linear on the weight widened to bf16 (cuBLAS; what the bf16 artifacts run);
  * `w8a16 gemv` / `w8a8 gemv+quant`: kernels/fp8_gemv.py (the dense ops' path up to 64 tokens; W8A8
    includes its activation-quantisation launch, kernels/act_quant.py);
  * `w8a16 tile` / `w8a8 tile+quant`: the tile GEMMs of kernels/fp8_gemm.py (the W8A16 op's path
    from 65 to DEQUANT_M - 1 tokens; W8A8's above 64);
  * `w8a16 dequant+linear`: the weight widened to bf16 (`fp8_dequant`) then F.linear, the W8A16 op's
    path from DEQUANT_M tokens;
  * `bi tile` / `bi decode tile`: the deterministic mode's batch-invariant matmul on the bf16 weight
    (kernels/batch_invariant.py) with the decode graphs' K split `bi_split`, on its 64 x 64 tile (what
    decode graphs ran until the decode tile) and on the decode tile (what they run now).
Timing: CUDA-graph replay of back-to-back calls that cycle over enough weight copies to exceed twice
the L2 cache (each call reads its weight from HBM), µs per call. GB/s counts the bytes the call
must read (weights as the kernel reads them: bf16, or e4m3 + one scale per 128x128 tile; the
activations) against the copy bandwidth measured in the same run. Error: ||y - ref|| / ||ref||
against the fp32 product of the same bf16 activations and the exact dequantised weight, and as
SNR dB. --sweep times more GEMV tiles per shape (kernels/fp8_gemv.Fp8GemvConfig) and reports the
best next to the default.

Legend: M tokens, N output features, K reduction.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_segments import _commit, copy_bandwidth  # noqa: E402

from dsv4c import ModelConfig  # noqa: E402
from dsv4c import quant as Q  # noqa: E402
from dsv4c.kernels.act_quant import act_quant_fp8  # noqa: E402
from dsv4c.kernels.batch_invariant import bi_matmul, bi_split  # noqa: E402
from dsv4c.kernels.fp8_gemm import fp8_dequant, fp8_gemm_w8a8, fp8_gemm_w8a16  # noqa: E402
from dsv4c.kernels.fp8_gemv import Fp8GemvConfig, default_config, fp8_gemv_w8a8, fp8_gemv_w8a16  # noqa: E402
from dsv4c.kernels.tolerances import rel_err  # noqa: E402

KERNELS = ("bf16 linear", "w8a16 gemv", "w8a8 gemv+quant", "w8a16 tile", "w8a8 tile+quant",
           "w8a16 dequant+linear", "bi tile", "bi decode tile")


def dense_shapes(cfg: ModelConfig) -> list[tuple[str, int, int]]:
    """(name, N, K) of the FP8-stored dense linears of one V4 decoder layer, as the decode graph runs them."""
    D, Qr, H, d = cfg.hidden_size, cfg.q_lora_rank, cfg.num_attention_heads, cfg.head_dim
    I = cfg.moe_intermediate_size * cfg.n_shared_experts
    return [("attn.wq_a‖wkv", Qr + d, D), ("attn.wq_b", H * d, Qr),
            ("attn.wq_b‖indexer.wq_b", H * d + cfg.index_n_heads * cfg.index_head_dim, Qr),  # CSA layers
            ("attn.wo_b", D, cfg.o_groups * cfg.o_lora_rank), ("shared.w1‖w3", 2 * I, D), ("shared.w2", D, I)]


def weight_bytes(kernel: str, n: int, k: int, m: int) -> int:
    """Bytes a call must read: the weight as the kernel reads it plus the bf16 activations."""
    w = 2 * n * k if kernel.startswith(("bf16", "bi ")) else n * k + math.ceil(n / 128) * math.ceil(k / 128)
    return w + 2 * m * k


def make_call(kernel: str, cfg: Fp8GemvConfig | None = None):
    """f(a, w_bf16, w_q, w_s) -> y for one kernel."""
    if kernel == "bf16 linear":
        return lambda a, wb, wq, ws: F.linear(a, wb)
    if kernel == "w8a16 gemv":
        return lambda a, wb, wq, ws: fp8_gemv_w8a16(a, wq, ws, config=cfg)
    if kernel == "w8a8 gemv+quant":
        return lambda a, wb, wq, ws: fp8_gemv_w8a8(*act_quant_fp8(a), wq, ws, config=cfg)
    if kernel == "w8a16 tile":
        return lambda a, wb, wq, ws: fp8_gemm_w8a16(a, wq, ws)
    if kernel == "w8a8 tile+quant":
        return lambda a, wb, wq, ws: fp8_gemm_w8a8(*act_quant_fp8(a), wq, ws)
    if kernel == "w8a16 dequant+linear":
        return lambda a, wb, wq, ws: F.linear(a, fp8_dequant(wq, ws, a.dtype))
    if kernel in ("bi tile", "bi decode tile"):
        decode = kernel == "bi decode tile"
        return lambda a, wb, wq, ws: bi_matmul(a, wb, split=bi_split(*wb.shape), decode=decode)
    raise ValueError(f"kernel: one of {KERNELS}, got {kernel!r}")


def time_us(call, a, copies: list[tuple], reps: int) -> float:
    """µs per call: a CUDA graph of `reps` calls cycling over the weight copies, replayed 5 times."""
    for c in copies[:2]:
        call(a, *c)  # compile / warm up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            call(a, *copies[i % len(copies)])
    g.replay()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(5):
        g.replay()
    t1.record()
    t1.synchronize()
    del g
    return t0.elapsed_time(t1) * 1e3 / (5 * reps)


def sweep_configs(m: int, n: int, k: int, sms: int) -> list[Fp8GemvConfig]:
    """The default GEMV tile and its neighbours (block_n, block_k, split, warps, stages; one token
    also on tensor cores)."""
    d = default_config(m, n, k, sms)
    out = [d]
    for bn in (d.block_n // 2, d.block_n * 2):
        if 16 <= bn <= 128 and (d.block_m == 1 or bn >= 16):
            out.append(replace(d, block_n=bn))
    for bk in (d.block_k // 2, d.block_k * 2):
        if 128 <= bk <= 1024:
            out.append(replace(d, block_k=bk))
    for split in (d.split // 2, d.split * 2, d.split * 4):
        if split >= 1 and split * 128 <= k:
            out.append(replace(d, split=split))
    out.append(replace(d, num_warps=4 if d.num_warps == 8 else 8))
    if d.block_m > 1:
        out += [replace(d, num_stages=s) for s in (2, 3, 6) if s != d.num_stages]
        # wide tiles: the activation rows, re-read by every N program, shrink against the weight tile
        out += [replace(d, block_n=bn, block_k=128, num_stages=st, num_warps=w, split=sp)
                for bn in (64, 128) for st in (3, 4) for w in (4, 8) for sp in {d.split, max(1, d.split // 2)}]
    else:  # one token on tensor cores (15 padding rows) instead of CUDA cores
        out.append(replace(default_config(2, n, k, sms), split=d.split))
    return list(dict.fromkeys(out))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="v4-flash-slice")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 64], help="token counts")
    ap.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    ap.add_argument("--sweep", action="store_true", help="also time the GEMV tiles around the default")
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop sweeping after this many seconds")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU interpreter smoke run, no timing)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--md", type=Path, help="also write the markdown table here")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    t_start = time.perf_counter()
    cfg = ModelConfig.preset(a.preset)
    shapes = dense_shapes(cfg)
    if a.quick:
        shapes, a.m = [(name, max(16, n // 256), max(128, k // 32)) for name, n, k in shapes[:2]], [1, 3]
    res: dict = {"preset": a.preset, "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
                 "torch": torch.__version__, "rows": [], "sweep": []}
    res["commit"] = _commit()
    if cuda:
        props = torch.cuda.get_device_properties(dev)
        res["copy_bandwidth_GBps"] = copy_bandwidth(dev) / 1e9
        res["l2_bytes"] = props.L2_cache_size
        res["sm_count"] = props.multi_processor_count
    sms = res.get("sm_count", 8)
    g = torch.Generator().manual_seed(0)
    for name, n, k in shapes:
        w = torch.randn(n, k, generator=g) * 0.02
        wq, ws = Q.quant_fp8_block(w)
        wb = Q.dequant_fp8_block(wq, ws)                                 # exact: ue8m0 scales
        ncopy = max(2, min(32, math.ceil(2 * res.get("l2_bytes", 0) / (n * k)))) if cuda else 1
        copies = [(wb.to(dev, torch.bfloat16), wq.to(dev), ws.to(dev)) for _ in range(ncopy)]
        for m in a.m:
            x = torch.randn(m, k, generator=g).bfloat16()
            ref = x.float() @ wb.T                                       # fp32 [M, N]
            xd = x.to(dev)
            reps = max(16, ncopy)
            for kern in a.kernels:
                call = make_call(kern)
                row = {"shape": name, "n": n, "k": k, "m": m, "kernel": kern}
                if "gemv" in kern:
                    row["config"] = asdict(default_config(m, n, k, sms))
                err = rel_err(call(xd, *copies[0]).float().cpu(), ref)
                row.update(rel_err=err, snr_db=-20 * math.log10(err) if err > 0 else None)
                if cuda:
                    us = time_us(call, xd, copies, reps)
                    gbps = weight_bytes(kern, n, k, m) / us / 1e3
                    row.update(us=us, GBps=gbps, frac_copy_bw=gbps / res["copy_bandwidth_GBps"])
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
            if a.sweep and cuda:
                for kern in ("w8a16 gemv",):  # W8A8 runs the same tiles
                    for c in sweep_configs(m, n, k, sms):
                        if time.perf_counter() - t_start > a.budget_s:
                            break
                        try:
                            us = time_us(make_call(kern, c), xd, copies, reps)
                        except Exception as e:  # noqa: BLE001 (a tile that does not compile is reported)
                            res["sweep"].append({"shape": name, "m": m, "kernel": kern, "config": asdict(c),
                                                 "failed": f"{type(e).__name__}: {str(e)[:300]}"})
                            continue
                        gbps = weight_bytes(kern, n, k, m) / us / 1e3
                        res["sweep"].append({"shape": name, "n": n, "k": k, "m": m, "kernel": kern, "config": asdict(c),
                                             "us": us, "GBps": gbps, "frac_copy_bw": gbps / res["copy_bandwidth_GBps"]})
            a.out.write_text(json.dumps(res, indent=1))
        del copies
        if cuda:
            torch.cuda.empty_cache()
    res["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    res["table"] = table(res)
    a.out.write_text(json.dumps(res, indent=1))
    print(res["table"])
    if a.md:
        a.md.write_text(res["table"] + "\n")
    return 0


def table(res: dict) -> str:
    """One row per shape and M: µs (% of copy bandwidth) per kernel, the error in SNR dB, and the
    best swept GEMV tile."""
    kernels = list(dict.fromkeys(r["kernel"] for r in res["rows"]))
    bw = res.get("copy_bandwidth_GBps")
    head = f"{res['preset']} dense linears on {res['device']}" + (f" (copy bandwidth {bw:.0f} GB/s)" if bw else "")
    cols = [f"{k} µs (% BW) / SNR dB" for k in kernels]
    lines = [head, "", "| linear [N, K] | M | " + " | ".join(cols) + " | best swept gemv µs (% BW) |",
             "|---|---:|" + "---:|" * (len(cols) + 1)]
    for key in dict.fromkeys((r["shape"], r["n"], r["k"], r["m"]) for r in res["rows"]):
        rows = {r["kernel"]: r for r in res["rows"] if (r["shape"], r["n"], r["k"], r["m"]) == key}
        cells = []
        for kern in kernels:
            r = rows.get(kern)
            snr = "–" if r is None or r.get("snr_db") is None else f"{r['snr_db']:.1f}"
            cells.append("–" if r is None else
                         (f"{r['us']:.1f} ({r['frac_copy_bw']:.0%}) / {snr}" if "us" in r else f"– / {snr}"))
        sw = [s for s in res["sweep"] if (s["shape"], s["m"]) == (key[0], key[3]) and "us" in s
              and s["kernel"] == "w8a16 gemv"]
        best = min(sw, key=lambda s: s["us"]) if sw else None
        bcell = "–" if best is None else (f"{best['us']:.1f} ({best['frac_copy_bw']:.0%}) "
                                          f"bm{best['config']['block_m']} bn{best['config']['block_n']} "
                                          f"bk{best['config']['block_k']} s{best['config']['split']} "
                                          f"w{best['config']['num_warps']} st{best['config']['num_stages']}")
        lines.append(f"| {key[0]} [{key[1]}, {key[2]}] | {key[3]} | " + " | ".join(cells) + f" | {bcell} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
