"""What fraction of the measured copy bandwidth a plain read stream reaches at the decode MoE's sizes,
in CUDA-graph replay: the ceiling that any FP4 weight-only decode kernel works under (issue 6).

    python examples/read_roofline.py --out $OUT/read_roofline.json        # needs a CUDA GPU

A Triton kernel reads int32 words and XOR-reduces them (one store per program, so nothing is
optimised away). Cases, each timed as the median of 5 x 50 replays:
  * one pass over 1 GiB (the stream's asymptote);
  * the routed-expert bytes of one Flash token (6 experts: W1/W3 with e8m0 scales, then W2) as two
    dependent launches, as the GEMVs read them, and as one launch; 8 disjoint regions per replay, as
    the MoE benchmark's 8 routings, so L2 holds nothing of the next region.
The copy bandwidth is examples/bench_moe_kernels.py's (2 x bytes / time of a 2 GiB device copy),
so a read-only stream can exceed 100%.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_moe_kernels import copy_bandwidth  # noqa: E402


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _read_kernel(p, out, n_words, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    base = pid.to(tl.int64) * BLOCK * STEPS
    for s in range(STEPS):
        o = base + s * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(p + o, mask=o < n_words, other=0)
    tl.store(out + pid, tl.reduce(acc, 0, _xor))


def reader(buf: torch.Tensor, steps: int, block: int = 1024):
    """(launch, out): a launch that reads every word of buf (int32, 1-D) and writes the XOR of each
    program's words to out."""
    n = buf.numel()
    grid = triton.cdiv(n, block * steps)
    out = torch.empty(grid, dtype=torch.int32, device=buf.device)
    return (lambda: _read_kernel[(grid,)](buf, out, n, BLOCK=block, STEPS=steps, num_warps=4)), out


def graph_us(fns, reps: int = 50) -> float:
    """Median microseconds of one replay of a graph holding the launches fns, in order."""
    for f in fns:
        f()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / reps * 1e3)
    return sorted(times)[2]


def flash_token_bytes(k: int = 6, d: int = 4096, i: int = 2048) -> tuple[int, int]:
    """(W1/W3 bytes with e8m0 scales, W2 bytes with scales) of the k experts of one token, MXFP4."""
    return k * (2 * i * d // 2 + 2 * i * d // 32), k * (d * i // 2 + d * i // 32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("read_roofline.py: needs a CUDA GPU")
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    res = {"device": torch.cuda.get_device_name(), "copy_bw_Bps": bw, "rows": []}

    def record(name: str, nbytes: int, us: float) -> None:
        res["rows"].append({"case": name, "bytes": nbytes, "us": us, "copy_bw_ratio": nbytes / (us * 1e-6) / bw})
        print(f"| {name} | {nbytes / 1e6:.1f} MB | {us:.1f} us | {100 * nbytes / (us * 1e-6) / bw:.0f}% |", flush=True)

    print(f"copy bandwidth {bw / 1e12:.3f} TB/s\n| case | bytes | time | % of copy bandwidth |\n|---|---|---|---|")
    pool = torch.randint(-2 ** 31, 2 ** 31 - 1, (2 ** 28,), dtype=torch.int32, device=dev)   # 1 GiB
    for steps in (4, 8):
        record(f"1 GiB, one launch, {steps} steps", pool.numel() * 4, graph_us([reader(pool, steps)[0]]))
    b13, b2 = flash_token_bytes()
    for steps in (2, 4, 8):
        two, one = [], []
        for r in range(8):
            off = r * (b13 + b2) // 4
            w13 = pool[off: off + b13 // 4]
            w2 = pool[off + b13 // 4: off + (b13 + b2) // 4]
            two += [reader(w13, steps)[0], reader(w2, steps)[0]]
            one.append(reader(pool[off: off + (b13 + b2) // 4], steps)[0])
        record(f"1 Flash token, W13 then W2, {steps} steps", b13 + b2, graph_us(two) / 8)
        record(f"1 Flash token, one launch, {steps} steps", b13 + b2, graph_us(one) / 8)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
