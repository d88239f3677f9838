"""Flash's grouped wo_a (G = 8, R = 1024, I = 4096, e4m3 with ue8m0 128x128 scales) at one bf16 token:
`fp8_grouped_linear` on the block-diagonal FP8 GEMV (grouped_linear.FP8_GEMV_MAX_M = 1) against the 16-row tile
(0), interleaved twice; µs per call in a CUDA graph cycling over 6 weight copies (201 MB, past the L2), the
share of copy bandwidth, and each output's error against the fp64 einsum."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import bench_dense_kernels as bd  # noqa: E402
import bench_segments as bs  # noqa: E402

import dsv4c.kernels.grouped_linear as GL  # noqa: E402
from dsv4c import quant as Q  # noqa: E402
from dsv4c.kernels.tolerances import rel_err  # noqa: E402

G, R, I = 8, 1024, 4096
dev = torch.device("cuda")
g = torch.Generator().manual_seed(0)
x = torch.randn(1, 1, G, I, generator=g).to(dev, torch.bfloat16)
copies = []
for _ in range(6):
    q, s = Q.quant_fp8_block(torch.randn(G * R, I, generator=g) * 0.05)
    copies.append((q.to(dev), s.to(dev).view(torch.uint8)))
w = Q.dequant_fp8_block(copies[0][0].cpu(), copies[0][1].cpu().view(torch.float8_e8m0fnu)).double().view(G, R, I)
want = torch.einsum("btgi,gri->btgr", x.cpu().double(), w)
bw = bs.copy_bandwidth(dev)
nbytes = G * R * I + copies[0][1].numel()
print(torch.cuda.get_device_name(), f"copy bandwidth {bw / 1e9:.0f} GB/s")
for v in (1, 0, 1, 0):
    GL.FP8_GEMV_MAX_M = v
    err = rel_err(GL.fp8_grouped_linear(x, *copies[0], torch.bfloat16).cpu(), want)
    us = bd.time_us(lambda a, q, s: GL.fp8_grouped_linear(a, q, s, torch.bfloat16), x, copies, 60)
    name = "GEMV" if v else "tile"
    print(f"{name}: {us:.2f} us/call, {nbytes / us / 1e3:.0f} GB/s ({nbytes / us * 1e6 / bw:.0%} of copy), "
          f"rel err vs fp64 {err:.2e}", flush=True)
