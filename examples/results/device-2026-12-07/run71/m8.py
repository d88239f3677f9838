"""run71: why the FP8 W8A16 dense GEMV at 2-16 tokens runs below the one-token one (the 2-layer slice's batch-8
step: dense GEMMs and head 585 µs on the critical path against 492 at batch 1, run70), and what a few tokens
could run at instead. At the slice's six dense shapes, M = 1 / 4 / 8, µs per call (CUDA graph of calls
cycling over weight copies past twice the L2, examples/bench_dense_kernels.py `time_us`):

  prod       kernels/fp8_gemv.py as the ops run it (default_config), and with its K split x2 / x4 / x8;
  tc_bf16    an experimental tensor-core GEMV like prod's M > 1 loop (e4m3 widened to bf16), split for P programs
             per SM, 3 or 5 stages;
  tc_f16     the same with e4m3 and the activations widened to fp16 (is the e4m3 -> bf16 widening the cost?);
  cc         CUDA cores for M tokens (prod's one-token loop, the next K step held in registers, every token of
             the step multiplied with the loaded weights in turn), split for P programs per SM;
  bf16       F.linear on the bf16 weight (cuBLAS).

Every kernel's output is checked against the fp32 product (rel. error printed). Timing only: no kernel here is
wired into dsv4c. `python m8.py OUT.json [budget_s]`."""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # examples/
from bench_dense_kernels import dense_shapes, time_us  # noqa: E402
from bench_segments import copy_bandwidth  # noqa: E402

from dsv4c import ModelConfig  # noqa: E402
from dsv4c import quant as Q  # noqa: E402
from dsv4c.kernels import _tl as U  # noqa: E402
from dsv4c.kernels.fp8_gemv import default_config, fp8_gemv_w8a16  # noqa: E402
from dataclasses import replace  # noqa: E402


@triton.jit
def _tc_kernel(a_ptr, w_ptr, ws_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K: tl.constexpr, KB: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, K_SPLIT: tl.constexpr, SPLIT: tl.constexpr, F16: tl.constexpr):
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    n = pid_n * BN + tl.arange(0, BN)
    m = tl.arange(0, BM)
    n_ok, m_ok = n < N, m < M
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for i in range(K_SPLIT // 128):
        k0 = pid_s * K_SPLIT + i * 128
        ks = k0 + tl.arange(0, 128)
        w = tl.load(w_ptr + n.to(tl.int64)[:, None] * K + ks[None, :], mask=n_ok[:, None] & (ks < K)[None, :], other=0.0)
        a = tl.load(a_ptr + m[:, None] * K + ks[None, :], mask=m_ok[:, None] & (ks < K)[None, :], other=0.0)
        ws = tl.load(ws_ptr + (pid_n * BN // 128) * KB + tl.minimum(k0 // 128, KB - 1))
        if F16:
            part = tl.dot(w.to(tl.float16), tl.trans(a.to(tl.float16)))
        else:
            part = tl.dot(w.to(tl.bfloat16), tl.trans(a))
        acc += part * ws
    ok = n_ok[:, None] & m_ok[None, :]
    U.store_split(acc, y_ptr + m[None, :] * N + n[:, None], part_ptr + m[None, :] * N + n[:, None], M * N, ok,
                  cnt_ptr + pid_n, pid_s, SPLIT)


@triton.jit
def _cc_kernel(a_ptr, w_ptr, ws_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K: tl.constexpr, KB: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, K_SPLIT: tl.constexpr, SPLIT: tl.constexpr):
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    n = pid_n * BN + tl.arange(0, BN)
    m = tl.arange(0, BM)
    n_ok = n < N
    w_rows = w_ptr + n.to(tl.int64)[:, None] * K
    ws_row = ws_ptr + (pid_n * BN // 128) * KB
    k_lo = pid_s * K_SPLIT
    k_hi = k_lo + K_SPLIT
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    ks = k_lo + tl.arange(0, BK)
    w = tl.load(w_rows + ks[None, :], mask=n_ok[:, None] & ((ks < K) & (ks < k_hi))[None, :], other=0.0)
    for i in range(K_SPLIT // BK):
        ks = k_lo + i * BK + tl.arange(0, BK)
        ks1 = ks + BK
        w1 = tl.load(w_rows + ks1[None, :], mask=n_ok[:, None] & ((ks1 < K) & (ks1 < k_hi))[None, :], other=0.0)
        ws = tl.load(ws_row + tl.minimum(ks // 128, KB - 1))
        wf = w.to(tl.float32)
        k_ok = (ks < K) & (ks < k_hi)
        for t in tl.static_range(BM):
            a_t = tl.load(a_ptr + t * K + ks, mask=k_ok & (tl.full((BK,), t, tl.int32) < M), other=0.0).to(tl.float32) * ws
            col = tl.sum(wf * a_t[None, :], axis=1)
            acc += tl.where(m[None, :] == t, col[:, None], 0.0)
        w = w1
    ok = n_ok[:, None] & (m < M)[None, :]
    U.store_split(acc, y_ptr + m[None, :] * N + n[:, None], part_ptr + m[None, :] * N + n[:, None], M * N, ok,
                  cnt_ptr + pid_n, pid_s, SPLIT)


def _split(tiles: int, k: int, bk: int, per_sm: int, sms: int) -> int:
    s = 1
    while tiles * s * 2 <= per_sm * sms and k // (2 * s) >= bk and 2 * s <= 64:
        s *= 2
    return s


def exp_call(kind: str, m: int, n: int, k: int, per_sm: int, sms: int, stages: int = 3, bn: int = 64, bk: int = 512,
             warps: int = 4):
    bm = max(16, triton.next_power_of_2(m)) if kind.startswith("tc") else triton.next_power_of_2(m)
    step = 128 if kind.startswith("tc") else bk
    tiles = triton.cdiv(n, bn)
    split = _split(tiles, k, step, per_sm, sms)
    k_split = triton.cdiv(triton.cdiv(k, split), step) * step
    kb = triton.cdiv(k, 128)

    def call(a, wb, wq, ws):
        y = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
        part = torch.empty(split, m, n, dtype=torch.float32, device=a.device) if split > 1 else y
        cnt = U.split_counters(a.device, tiles, split) if split > 1 else y
        if kind.startswith("tc"):
            _tc_kernel[(tiles, split)](a, wq, ws, y, part, cnt, m, n, k, kb, BM=bm, BN=bn, K_SPLIT=k_split, SPLIT=split,
                                       F16=kind == "tc_f16", num_warps=warps, num_stages=stages)
        else:
            _cc_kernel[(tiles, split)](a, wq, ws, y, part, cnt, m, n, k, kb, BM=bm, BN=bn, BK=bk, K_SPLIT=k_split,
                                       SPLIT=split, num_warps=warps)
        return y
    return call, split


def main() -> int:
    out, budget = Path(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 200.0
    t0 = time.perf_counter()
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    sms, l2 = props.multi_processor_count, props.L2_cache_size
    res = {"device": torch.cuda.get_device_name(dev), "copy_GBps": copy_bandwidth(dev) / 1e9, "rows": []}
    print(f"{res['device']}: copy {res['copy_GBps']:.0f} GB/s", flush=True)
    g = torch.Generator().manual_seed(0)
    shapes = dense_shapes(ModelConfig.preset("v4-flash-slice"))
    for name, n, k in shapes:
        w = torch.randn(n, k, generator=g) * 0.02
        wq, ws = Q.quant_fp8_block(w)
        wb = Q.dequant_fp8_block(wq, ws)
        ws32 = ws.float().contiguous()  # fp32 scale per 128x128 tile (exact: e8m0 powers of two)
        ncopy = max(2, min(32, math.ceil(2 * l2 / (n * k))))
        copies = [(wb.to(dev, torch.bfloat16), wq.to(dev), ws.to(dev)) for _ in range(ncopy)]
        copies32 = [(c[0], c[1], ws32.to(dev)) for c in copies]
        for m in (1, 4, 8):
            if time.perf_counter() - t0 > budget:
                break
            x = torch.randn(m, k, generator=g).bfloat16()
            ref = x.float() @ wb.T
            xd = x.to(dev)
            reps = max(16, ncopy)
            cands = [("prod", lambda a, b, q, s: fp8_gemv_w8a16(a, q, s), copies, None)]
            d = default_config(m, n, k, sms)
            for f in (2, 4, 8):
                if d.split * f <= 64 and k // (d.split * f) >= d.block_k:
                    c = replace(d, split=d.split * f)
                    cands.append((f"prod split{c.split}", lambda a, b, q, s, c=c: fp8_gemv_w8a16(a, q, s, config=c),
                                  copies, None))
            cands.append(("bf16", lambda a, b, q, s: F.linear(a, b), copies, None))
            if m > 1:
                for kind in ("tc_bf16", "tc_f16"):
                    for per_sm in (1, 4):
                        for st in (3, 5):
                            call, sp = exp_call(kind, m, n, k, per_sm, sms, stages=st)
                            cands.append((f"{kind} P{per_sm} st{st} s{sp}", call, copies32, None))
            for per_sm in (4, 16):
                for bn, bk, warps in ((32, 512, 8), (16, 512, 4)):
                    call, sp = exp_call("cc", m, n, k, per_sm, sms, bn=bn, bk=bk, warps=warps)
                    cands.append((f"cc P{per_sm} bn{bn} bk{bk} w{warps} s{sp}", call, copies32, None))
            for label, call, cps, _ in cands:
                time_row(res, label, call, xd, cps, ref, reps, name, n, k, m)
            out.write_text(json.dumps(res, indent=1))
        del copies, copies32
        torch.cuda.empty_cache()
    summary(res)
    out.write_text(json.dumps(res, indent=1))
    return 0


def time_row(res: dict, label: str, call, xd, cps, ref, reps: int, name: str, n: int, k: int, m: int) -> None:
    """One candidate on one shape: its relative error against `ref` and µs per call (or why it failed), appended
    to res["rows"] and printed."""
    try:
        y = call(xd, *cps[0]).float().cpu()
        err = ((y - ref).norm() / ref.norm()).item()
        us = time_us(call, xd, cps, reps)
    except Exception as e:  # noqa: BLE001 (a tile that does not compile or fit is reported)
        row = {"shape": name, "m": m, "kernel": label, "failed": f"{type(e).__name__}: {str(e)[:200]}"}
    else:
        gbps = (n * k + 2 * m * k) / us / 1e3
        row = {"shape": name, "n": n, "k": k, "m": m, "kernel": label, "us": round(us, 2),
               "bw": round(gbps / res["copy_GBps"], 3), "rel_err": err}
    res["rows"].append(row)
    print(json.dumps(row), flush=True)


def summary(res: dict, variant=lambda label: label, beside: tuple[str, ...] = ("prod",)) -> None:
    """Per M and kernel variant (`variant` of the row's label), the sum over the shapes measured at every M (µs),
    best first, with the `beside` variants' sums."""
    rows = [r for r in res["rows"] if "us" in r]
    shapes = {r["shape"] for r in rows}
    for m in sorted({r["m"] for r in rows}):
        tot: dict[str, list] = {}
        for r in rows:
            if r["m"] == m:
                tot.setdefault(variant(r["kernel"]), []).append(r["us"])
        full = {k: sum(v) for k, v in tot.items() if len(v) == len(shapes)}
        best = sorted(full.items(), key=lambda kv: kv[1])[:8]
        res.setdefault("summary", {})[str(m)] = best
        print(f"M={m}: " + "; ".join(f"{k} {v:.1f}" for k, v in best)
              + "".join(f" | {b} {full.get(b, float('nan')):.1f}" for b in beside), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
