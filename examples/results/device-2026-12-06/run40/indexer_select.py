"""The V4 indexer's selection (launch 2) at the Flash indexer's K = 512: one program per row re-reading a long
row in MAX_ROW chunks (`_select_kernel`, before `_select_sliced`) against the staged slices, rows of E visible
entries (E = context / 4), batch 1 and 8; each replayed in a CUDA graph of 20 calls; outputs compared.
    python indexer_select.py OUT.json"""
import json
import statistics
import sys

import torch
import triton

from dsv4c.kernels import v4_indexer as V


def graph_us(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(times)


rows, K, m = [], 512, 4
for E in (2048, 4096, 16384, 65536):
    for B in (1, 8):
        scores = torch.randn(B, 1, E, device="cuda")
        pos0 = torch.full((B,), 4 * E - 1, dtype=torch.int64, device="cuda")  # every entry visible
        one = torch.empty(B, 1, K, dtype=torch.int64, device="cuda")
        staged = torch.empty_like(one)
        chunk = min(V.MAX_ROW, triton.next_power_of_2(E))

        def one_program():
            V._select_kernel[(B,)](scores, pos0, one, 1, E, m, K=K, CHUNK=chunk, N_CHUNKS=triton.cdiv(E, chunk),
                                   BLOCK_K=K, DIGIT=V.DIGIT_BITS, num_warps=8, **V.pdl_launch(scores))

        def sliced():
            V._select_sliced(scores.view(B, E), pos0, staged.view(B, K), 1, m, K)

        r = {"E": E, "context": 4 * E, "B": B, "one_program_us": graph_us(one_program)}
        if E > V.MAX_ROW:
            r["sliced_us"] = graph_us(sliced)
            r["equal"] = bool(torch.equal(one, staged))
            r["speedup"] = r["one_program_us"] / r["sliced_us"]
        rows.append(r)
        print(r, flush=True)
json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(sys.argv[1], "w"), indent=1)
