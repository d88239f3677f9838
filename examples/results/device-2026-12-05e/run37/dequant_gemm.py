"""run37 extra: FP8 dense at prefill sizes as dequant (FP8 blocks -> bf16, torch ops) + cuBLAS bf16 F.linear,
against F.linear on bf16 weights, the slice's six dense shapes, CUDA-event median of 50 calls."""
import sys
import torch
import torch.nn.functional as F
sys.path.insert(0, "examples")
from bench_dense_kernels import dense_shapes
from dsv4c.config import ModelConfig
from dsv4c import quant as Q

def t(fn, n=50):
    for _ in range(5):
        fn()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b) * 1e3)
    return sorted(ts)[n // 2]

cfg = ModelConfig.preset("v4-flash-slice")
for name, n, k in dense_shapes(cfg):
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    wq, ws = Q.quant_fp8_block(w)
    for m in (512, 4096):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        wd = Q.dequant_fp8_block(wq, ws).to(torch.bfloat16)
        base = t(lambda: F.linear(x, wd))
        deq = t(lambda: Q.dequant_fp8_block(wq, ws).to(torch.bfloat16))
        both = t(lambda: F.linear(x, Q.dequant_fp8_block(wq, ws).to(torch.bfloat16)))
        print(f"{name} [{n},{k}] M={m}: bf16 {base:.1f} us, dequant {deq:.1f}, dequant+linear {both:.1f} "
              f"({base / both:.2f}x bf16)")
