"""Flash's wo_b ([4096, 8192] e4m3, 33.5 MB) through the one-token FP8 GEMV, one call timed with CUDA events:
from a cold L2 (a 512 MB write before each call), right after a call that read the same weight (warm L2), and
after an L2 prefetch + 30 µs wait; per GEMV tile. Does the GEMV read faster from L2?"""
import json
import torch
from dsv4c.kernels.fp8_gemv import Fp8GemvConfig, default_config, fp8_gemv_w8a16
from dsv4c.kernels import l2_prefetch as L

w = torch.randn(4096, 8192, device="cuda").to(torch.float8_e4m3fn)
ws = torch.rand(32, 64, device="cuda") + 0.5
a = torch.randn(1, 8192, device="cuda", dtype=torch.bfloat16)
flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
sms = torch.cuda.get_device_properties(0).multi_processor_count


def one(cfg, mode):
    flush.zero_()
    if mode == "warm":
        fp8_gemv_w8a16(a, w, ws, config=cfg)
    if mode == "prefetch":
        L.l2_prefetch([w], [w.numel()])
    torch.cuda._sleep(60_000)
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    fp8_gemv_w8a16(a, w, ws, config=cfg)
    t1.record()
    t1.synchronize()
    return t0.elapsed_time(t1) * 1e3


d = default_config(1, 4096, 8192, sms)
cfgs = [d, Fp8GemvConfig(1, 32, 512, 16, 8, 4), Fp8GemvConfig(1, 64, 512, 4, 8, 4), Fp8GemvConfig(1, 16, 512, 4, 4, 4),
        Fp8GemvConfig(1, 32, 1024, 2, 8, 4), Fp8GemvConfig(1, 32, 256, 4, 4, 4)]
for cfg in cfgs:
    row = {"cfg": [cfg.block_n, cfg.block_k, cfg.split, cfg.num_warps]}
    for mode in ("cold", "warm", "prefetch"):
        one(cfg, mode)
        row[mode] = round(sorted(one(cfg, mode) for _ in range(11))[5], 1)
    print(json.dumps(row), flush=True)
