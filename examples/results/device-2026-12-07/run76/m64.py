"""run76: the FP8 W8A16 dense GEMV at 16 / 32 / 64 tokens (batch 64's decode step: run37 measured it at 17-47% of
copy bandwidth, slower than bf16 cuBLAS on four of the six shapes) against run71's experimental tensor-core loop
(run71/m8.py `exp_call`) with bigger tiles: bf16 or fp16 operands, 64 or 128 weight rows, 4 or 8 warps, 3 or 4
stages, 1 or 2 programs per SM; and the W8A8 GEMV with its activation quantisation (e4m3 activations: the
accuracy the issue allows where it is faster). µs per call, the slice's six dense shapes, CUDA graph of calls
cycling over weight copies past twice the L2. Timing only: nothing here is wired into dsv4c.
`python m64.py OUT.json [budget_s]`."""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "run71"))
import m8  # noqa: E402  (its sys.path setup brings examples/ in)
from bench_dense_kernels import dense_shapes  # noqa: E402
from bench_segments import copy_bandwidth  # noqa: E402

from dsv4c import ModelConfig  # noqa: E402
from dsv4c import quant as Q  # noqa: E402
from dsv4c.kernels.act_quant import act_quant_fp8  # noqa: E402
from dsv4c.kernels.fp8_gemv import fp8_gemv_w8a8, fp8_gemv_w8a16  # noqa: E402

TILES = [(64, 4, 3), (128, 4, 3), (128, 8, 3), (64, 8, 4), (128, 8, 4)]  # (weight rows, warps, stages)


def main() -> int:
    out, budget = Path(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 200.0
    t0 = time.perf_counter()
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    sms, l2 = props.multi_processor_count, props.L2_cache_size
    res = {"device": torch.cuda.get_device_name(dev), "copy_GBps": copy_bandwidth(dev) / 1e9, "rows": []}
    print(f"{res['device']}: copy {res['copy_GBps']:.0f} GB/s", flush=True)
    g = torch.Generator().manual_seed(0)
    for name, n, k in dense_shapes(ModelConfig.preset("v4-flash-slice")):
        w = torch.randn(n, k, generator=g) * 0.02
        wq, ws = Q.quant_fp8_block(w)
        wb = Q.dequant_fp8_block(wq, ws)
        ncopy = max(2, min(32, math.ceil(2 * l2 / (n * k))))
        copies = [(wb.to(dev, torch.bfloat16), wq.to(dev), ws.to(dev)) for _ in range(ncopy)]
        copies32 = [(c[0], c[1], ws.float().contiguous().to(dev)) for c in copies]
        for m in (16, 32, 64):
            if time.perf_counter() - t0 > budget:
                break
            x = torch.randn(m, k, generator=g).bfloat16()
            ref = x.float() @ wb.T
            xd = x.to(dev)
            reps = max(16, ncopy)
            cands = [("prod", lambda a, b, q, s: fp8_gemv_w8a16(a, q, s), copies),
                     ("w8a8+quant", lambda a, b, q, s: fp8_gemv_w8a8(*act_quant_fp8(a), q, s), copies),
                     ("bf16", lambda a, b, q, s: F.linear(a, b), copies)]
            for kind in ("tc_bf16", "tc_f16"):
                for bn, warps, stages in TILES:
                    for per_sm in (1, 2):
                        call, sp = m8.exp_call(kind, m, n, k, per_sm, sms, stages=stages, bn=bn, warps=warps)
                        cands.append((f"{kind} bn{bn} w{warps} st{stages} P{per_sm} s{sp}", call, copies32))
            for label, call, cps in cands:
                m8.time_row(res, label, call, xd, cps, ref, reps, name, n, k, m)
            out.write_text(json.dumps(res, indent=1))
        del copies, copies32
        torch.cuda.empty_cache()
    m8.summary(res, variant=lambda label: label.rsplit(" s", 1)[0] if label.startswith("tc") else label,
               beside=("prod", "bf16"))
    out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
