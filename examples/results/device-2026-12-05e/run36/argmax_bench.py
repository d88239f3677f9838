"""Greedy argmax at the Flash vocabulary: torch.argmax vs kernels/argmax.py, device time per call in a
CUDA graph of 20 calls and host time per call enqueued eagerly; the indices compared."""
import json
import statistics
import sys
import time

import torch

from dsv4c.kernels.argmax import argmax_rows

V, res = 129280, []
for B in (1, 8, 64):
    x = torch.randn(B, V, device="cuda")
    same = bool(torch.equal(argmax_rows(x), x.argmax(-1)))
    for name, fn in (("torch.argmax", lambda: x.argmax(-1)), ("argmax_rows", lambda: argmax_rows(x))):
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(20):
                fn()
        g.replay()
        torch.cuda.synchronize()
        dev = []
        for _ in range(10):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            dev.append(a.elapsed_time(b) * 1e3 / 20)
        host = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                fn()
            host.append((time.perf_counter() - t0) * 1e6 / 200)
            torch.cuda.synchronize()
        row = {"B": B, "impl": name, "device_us": statistics.median(dev), "host_us": statistics.median(host),
               "equal_torch": same}
        res.append(row)
        print(row, flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
