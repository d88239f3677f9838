"""run67 (any GPU, about 1 min): what a second captured stream for V4's shared expert could save at batch 1.

In the decode step the shared expert (w1 ‖ w3 GEMV, SwiGLU, w2 GEMV: three launches) runs after the routed
experts (act_quant, gemv13, act_quant, gemv2, combine) on one stream, though neither reads the other (run62's
timeline, H100: about 24 µs a layer after the routed experts' 65). This times L layers of Flash-shaped
weights (256 FP8 block experts, top-6; a 2048-wide shared expert; D 4096; distinct weights per layer, so no
layer reads another's from L2) in one CUDA graph, the two branches serial on one stream against the shared
expert forked onto a second stream and joined before the layer's add. Both read the same bytes; the
difference is how much of each branch's ramp, tail and small launches the other hides.

Prints, per variant, µs per layer (median of REPEATS graph replays) and the fraction of copy bandwidth that
the layer's bytes give at that time. Values are random (timing only).
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

from dsv4c.kernels.fp8_gemv import fp8_gemv_w8a16
from dsv4c.kernels.moe_fp8_gemv import moe_fp8_gemv
from dsv4c.kernels.swiglu import swiglu_act

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # examples/
from bench_segments import copy_bandwidth  # noqa: E402

E, TOPK, D, I, I_SH = 256, 6, 4096, 2048, 2048
LIMIT = 10.0
LAYERS = int(sys.argv[1]) if len(sys.argv) > 1 else 4
REPEATS = 30
dev = torch.device("cuda")


def fp8(*shape) -> torch.Tensor:
    """Random finite e4m3 bytes (0x00..0x6f: no NaN codes), positive."""
    return torch.randint(0, 0x70, shape, dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)


def scales(*shape) -> torch.Tensor:
    return torch.full(shape, 2.0 ** -12, device=dev)


def layer_weights() -> dict:
    return {"w13": fp8(E, 2 * I, D), "s13": scales(E, 2 * I // 128, D // 128), "w2": fp8(E, D, I),
            "s2": scales(E, D // 128, I // 128), "sh13": fp8(2 * I_SH, D), "shs13": scales(2 * I_SH // 128, D // 128),
            "sh2": fp8(D, I_SH), "shs2": scales(D // 128, I_SH // 128),
            "idx": torch.randperm(E, device=dev)[:TOPK].view(1, TOPK),
            "wt": torch.rand(1, TOPK, device=dev)}


def routed(x, w):
    return moe_fp8_gemv(x, w["idx"], w["wt"], w["w13"], w["s13"], w["w2"], w["s2"], LIMIT)


def shared(x, w):
    gu = fp8_gemv_w8a16(x, w["sh13"], w["shs13"])                                    # [1, 2 I_SH]
    return fp8_gemv_w8a16(swiglu_act(gu[:, :I_SH], gu[:, I_SH:], LIMIT), w["sh2"], w["shs2"])


def step(x, ws, side: torch.cuda.Stream | None):
    for w in ws:
        if side is None:
            y1 = routed(x, w)
            y2 = shared(x, w)
        else:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                y2 = shared(x, w)
            y1 = routed(x, w)
            torch.cuda.current_stream().wait_stream(side)
            y2.record_stream(torch.cuda.current_stream())  # made on `side`, read here
        x = (x.float() * 0.5 + y1.float() + y2.float()).to(torch.bfloat16)
    return x


def timed(graph: torch.cuda.CUDAGraph) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(REPEATS):
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3)
    return statistics.median(out)


def main() -> None:
    bw = copy_bandwidth(dev)
    ws = [layer_weights() for _ in range(LAYERS)]
    x = torch.randn(1, D, device=dev, dtype=torch.bfloat16) * 0.1
    per_layer_bytes = TOPK * (2 * I * D + D * I) + (2 * I_SH * D + D * I_SH)        # e4m3: 1 byte each
    side = torch.cuda.Stream()
    graphs = {}
    for name, s in (("serial", None), ("two streams", side)):
        for _ in range(2):  # JIT compiles, allocator
            step(x, ws, s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = step(x, ws, s)
        graphs[name] = (g, out)
    ref = graphs["serial"][1].float()
    for name in ("serial", "two streams", "serial", "two streams"):  # interleaved
        g, out = graphs[name]
        us = timed(g) / LAYERS
        err = ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
        print(f"{name}: {us:.1f} us a layer ({per_layer_bytes / 1e6:.1f} MB: "
              f"{per_layer_bytes / (us * 1e-6) / bw:.0%} of copy bandwidth {bw / 1e9:.0f} GB/s); "
              f"max rel diff vs serial {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
