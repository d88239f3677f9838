"""run66: the one-token FP8 GEMV on Flash's wo_b (33.5 MB of e4m3) from a cold L2, against the same GEMV after
l2_prefetch of its weight and a wait of N GPU cycles (torch.cuda._sleep), for several N: does the prefetch help
once it has had time to finish? (run65, H100: with 60k cycles 68.1 vs 21.3 us, a loss; run64, H200: 18.8 vs 20.4.)"""
import torch

from dsv4c.kernels import l2_prefetch as L
from dsv4c.kernels.fp8_gemv import fp8_gemv_w8a16

w = torch.randn(4096, 8192, device="cuda").to(torch.float8_e4m3fn)
ws = torch.rand(32, 64, device="cuda") + 0.5
a = torch.randn(1, 8192, device="cuda", dtype=torch.bfloat16)
flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")


def timed(prefetch: bool, cycles: int) -> float:
    flush.zero_()
    if prefetch:
        L.l2_prefetch([w], [w.numel()])
    torch.cuda._sleep(cycles)
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    fp8_gemv_w8a16(a, w, ws)
    t1.record()
    t1.synchronize()
    return t0.elapsed_time(t1) * 1e3


for cycles in (60_000, 300_000, 1_500_000):
    for p in (False, True):
        timed(p, cycles)
    cold = sorted(timed(False, cycles) for _ in range(15))[7]
    pre = sorted(timed(True, cycles) for _ in range(15))[7]
    print(f"wait {cycles} cycles: cold {cold:.1f} us, after the prefetch {pre:.1f} us, ratio {pre / cold:.2f}")
