"""Accuracy thresholds of the quantised formats and kernels: ONE table per format.

Error metric: relative Frobenius norm ||y - y_ref|| / ||y_ref||, computed in float64, where
y_ref is an fp32/fp64 reference on random Gaussian inputs. Two kinds of reference:

* `QUANT_REL_ERR[fmt]`: quantise-dequantise of a Gaussian tensor vs the original (the loss of the
  format itself). Measured: FP8 block ~0.027, MXFP4 ~0.12, NVFP4 ~0.095.
* `KERNEL_REL_ERR[fmt]`: a Triton kernel vs its `*_ref`, which uses the SAME quantised weights
  and emulates the same activation quantisation in fp32; what remains is accumulation order,
  bf16 rounding of intermediate activations (the SwiGLU output h) and e4m3/e2m1 rounding flips
  of activations that sit on a rounding boundary. Thresholds are about 3x the largest value
  measured in tests/test_kernels_*.py (CPU interpreter and H200).
* `FORMAT_VS_FP32_REL_ERR[fmt]`: the whole MoE in a format vs the unquantised fp32 MoE
  (weights quantised from fp32 Gaussians): the end-to-end cost of choosing the format.
"""
from __future__ import annotations

import torch

__all__ = ["FORMAT_VS_FP32_REL_ERR", "KERNEL_REL_ERR", "QUANT_REL_ERR", "rel_err"]

QUANT_REL_ERR: dict[str, float] = {
    "fp8_block": 0.04,
    "mxfp4": 0.14,
    "nvfp4": 0.12,
}

KERNEL_REL_ERR: dict[str, float] = {
    "bf16": 1e-2,          # h rounded to bf16 before w2, output bf16 (CPU 0.0065: the interpreter truncates to bf16)
    "bf16_vs_model_op": 2e-2,  # vs torch.ops.dsv4c.moe_experts in bf16 (weight after w2, its own roundings)
    "fp8_block": 3e-2,     # + e4m3 flips of x and h (W8A8)
    "mxfp4": 1e-2,         # weight-only: weights exact in bf16
    "nvfp4": 1e-2,         # weight-only: fp4 * e4m3 exact in bf16, global scale in fp32
    "nvfp4_w4a4": 6e-2,    # + e2m1 flips of x and h
    "act_fp8": 1e-6,       # dequantised activations; kernels match bit for bit in practice
    "act_nvfp4": 1e-6,
    "gemm_fp8": 1e-2,      # bf16 output rounding
    "gemm_fp8_w_bf16_a": 1e-2,
    # passes/quantize_dense.py, whole decode graph vs the eager fp32 logits, weights FP8-block values
    # (tests/test_quantize_dense.py, tiny V4 model, hidden 128, 17 rewritten linears, routing pinned):
    "dense_w8a16": 1e-2,   # weights exact; CPU reference in fp32 (measured 0), CUDA: bf16 activations
    "dense_w8a8": 0.15,    # + e4m3 rounding of every linear's input (measured 0.044 on CPU)
}

# measured on the test's small Gaussian MoE (D=160..256, I=96..128, clamp 0.6): bf16 0.0065,
# fp8_block 0.10, mxfp4 0.30, nvfp4 0.24, nvfp4_w4a4 0.30 (two quantised GEMMs, and for W8A8/W4A4
# two quantised activations, compound)
FORMAT_VS_FP32_REL_ERR: dict[str, float] = {
    "bf16": 2e-2,
    "fp8_block": 0.15,
    "mxfp4": 0.4,
    "nvfp4": 0.35,
    "nvfp4_w4a4": 0.45,
}


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64 (0 when both are zero)."""
    ref64 = ref.double()
    den = float(ref64.norm())
    num = float((x.double() - ref64).norm())
    return num / den if den else num
