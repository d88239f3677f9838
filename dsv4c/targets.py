"""Compile targets, declared as data (design.md: "targets are data").

A target says which GPU capability it needs, the weight format per module class, the kernel per
custom op, and the default CUDA-graph token buckets. Passes and the Session read the target; they
never branch on GPU names.

`expert_format` is live: passes/quantize_experts.py rewrites the routed experts into it (Triton
grouped kernels, kernels/moe_grouped.py); `expert_format_reason` and `expert_format_tokens` record why
(the measured figures) and for which tokens-per-step range. `dense_format` is live too:
passes/quantize_dense.py runs the linears whose checkpoint weights are FP8 blocks (attention, indexer
wq_b, shared experts, MTP projections) on the stored FP8 weights: `fp8_block` = W8A8 (1x128 activation
scales), `fp8_block_w8a16` = FP8 weights x bf16 activations; `reference` / `bf16` rewrite nothing.
H100 and H200 run `fp8_block_w8a16`: the release's FP8 bytes, half the dense memory. On the H100
(BENCHMARKS.md, 2026-12-06) it made the 2-layer slice's decode step 1.12x faster at batch 1 and 1.00x at 64
(an earlier run: 1.06x / 1.02x / 0.98x at 1 / 8 / 64; the H200: 1.01x at 64). Prefill-sized calls (from
DEQUANT_M rows, kernels/fp8_gemm.py) widen each weight to bf16 for cuBLAS (0.92x of bf16 at 4096 tokens),
since every FP8 GEMM here ran them slower (W8A16 tile 0.33x, W8A8 0.84x). W8A8 (`fp8_block`) stays
opt-in: 5 dB of pinned SNR lost on the slice and slower decode. The B200 keeps `bf16` until measured;
`compile --dense-format bf16` restores the widened weights. The
deterministic mode defaults to them too (compile.deterministic_target); with `--dense-format
fp8_block_w8a16` its linears run the stored FP8 bytes on `fp8_linear_bi` (0.96x / 1.01x the bf16 step's
time at batch 1 / 64; BENCHMARKS.md), the grouped wo_a staying bf16.
"""
from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)


class TargetError(RuntimeError):
    """The artifact's target cannot run here; the message names the capability needed."""


@dataclass(frozen=True)
class Target:
    name: str
    device: str  # "cuda" or "cpu"
    capability: tuple[int, int] | None  # minimum CUDA compute capability
    expert_format: str  # planned routed-expert weight format
    dense_format: str  # format of the FP8-stored dense linears (passes/quantize_dense.py)
    kernels: dict = field(default_factory=dict)  # custom op -> implementation
    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    dtype: str = "bfloat16"  # activation dtype the artifact is compiled in unless --dtype says otherwise
    status: str = "routed experts in expert_format; FP8-stored dense linears in dense_format"
    expert_format_reason: str = ""  # why this expert format (measured figures), as data
    expert_format_tokens: tuple[int, int] | None = None  # tokens per MoE call the choice is best for
    # bytes of the next linears' weights a decode graph asks into L2 at the start of each run of small kernels
    # (passes/prefetch_weights.py); 0 (every target today, run64 measured a loss): none
    l2_prefetch_bytes: int = 0

    def to_dict(self) -> dict:
        return {"name": self.name, "device": self.device, "capability": self.capability,
                "expert_format": self.expert_format, "dense_format": self.dense_format,
                "kernels": dict(self.kernels), "buckets": list(self.buckets), "dtype": self.dtype,
                "status": self.status, "expert_format_reason": self.expert_format_reason,
                "expert_format_tokens": list(self.expert_format_tokens) if self.expert_format_tokens else None,
                "l2_prefetch_bytes": self.l2_prefetch_bytes}


_REFERENCE = {op: "reference" for op in ("moe_experts", "v4_attention", "v4_compress", "v4_indexer_topk",
                                          "head_rms_rope", "mla_cache_update", "dsa_cache_update", "dsa_topk")}
# CUDA targets: capture-safe cache ops so decode steps become CUDA graphs. V4's attention, compressor,
# indexer and per-head q norm + RoPE run as Triton kernels (`fused`, kernels/v4_*.py, rope.py); V3's
# cache writes as the static ATen forms (dsv4c/model/static_ops.py). The routed experts are rewritten
# by quantize_experts (expert_format) into capture-safe Triton kernels. The fp32 linears (routers' gates,
# compressor and indexer projections) take kernels/linear_f32.py's one-token GEMV (run59: 13 µs a 2-layer step).
_CUDA = {**_REFERENCE, "v4_attention": "fused", "v4_compress": "fused", "mla_cache_update": "static",
         "dsa_cache_update": "static", "head_rms_rope": "fused", "v4_indexer_topk": "fused",
         "linear_f32": "fused"}

# BENCHMARKS.md, grouped-MoE sweeps on the H200 (2026-11-30, ninth session): Flash expert shapes,
# microseconds per call replayed in a CUDA graph (how decode runs), default kernels, at 1 / 8 / 64 tokens,
# and prefill; the v4-flash-slice decode step with each expert format is the sixth session's.
_HOPPER_REASON = ("H200 grouped-MoE sweep (Flash shapes, CUDA-graph replay, us at 1/8/64 tokens, default kernels): "
                  "fp8_block 57/288/1296, mxfp4_w4a16 (CUDA-core GEMV, PDL-chained) 31.5/188/1431, nvfp4_w4a16 "
                  "32.5/201/1546; prefill at 4096/16384 tokens (graph replay): fp8_block 2.48/6.92 ms, "
                  "mxfp4_w4a16 8.60/28.5 ms. v4-flash-slice decode step, full graph, ms at batch 1/8/64 (sixth "
                  "session): fp8_block 2.90/4.07/8.41, mxfp4_w4a16 2.82/3.79/9.88. MXFP4 is 1.5-1.8x faster per "
                  "MoE call up to 8 tokens, FP8 from 64 tokens and 3.5-4.1x at prefill. Accuracy: FP8 is the closer "
                  "for weights quantised from bf16; for the released MXFP4 experts, mxfp4_w4a16 keeps the "
                  "checkpoint's exact values. One format per artifact (graphs share weights), so fp8_block; "
                  "--expert-format mxfp4_w4a16 for latency-bound decode at batch <= 8 (and half the expert memory).")
_HOPPER = {"expert_format": "fp8_block", "dense_format": "fp8_block_w8a16", "kernels": _CUDA,
           "expert_format_reason": _HOPPER_REASON, "expert_format_tokens": (1, 16384)}
# l2_prefetch_bytes stays 0 (passes/prefetch_weights.py off): with 32 MiB the 2-layer slice's batch-1 step was
# 0.648 / 0.643 ms against 0.632 / 0.628 without, batch 8 1.183 vs 1.165 ms (run64, H200, GPU alone)

TARGETS: dict[str, Target] = {
    "b200": Target("b200", "cuda", (10, 0), expert_format="nvfp4_w4a4", dense_format="bf16", kernels=_CUDA,
                   expert_format_reason="NVFP4 W4A4 via tl.dot_scaled (sm_100): 4-bit weights and activations; "
                                        "not measured yet (no B200 on the team's device)"),
    "h200": Target("h200", "cuda", (9, 0), **_HOPPER),
    "h100": Target("h100", "cuda", (9, 0), **_HOPPER),  # same kernels as H200; figures are H200's
    "cpu": Target("cpu", "cpu", None, expert_format="reference", dense_format="reference", kernels=_REFERENCE,
                  buckets=(), dtype="float32",  # bf16 matmuls are slow on CPUs
                  status="reference kernels, unquantised weights",
                  expert_format_reason="the eager reference: exact, no quantisation"),
}


def get_target(name: str) -> Target:
    if name not in TARGETS:
        raise ValueError(f"--target: unknown target {name!r}; expected one of {sorted(TARGETS)}")
    return TARGETS[name]


def check_runnable(target: Target, device: str, emulate: bool = False) -> None:
    """Raise TargetError if an artifact for `target` cannot run on `device` (unless emulating)."""
    import torch

    if emulate or target.device == "cpu":
        return
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        raise TargetError(f"artifact target {target.name!r} needs a CUDA GPU of compute capability "
                          f"{target.capability[0]}.{target.capability[1]}+; this device is {device!r} "
                          f"(pass emulate=True / --emulate to run the same formats through emulation kernels)")
    have = torch.cuda.get_device_capability(torch.device(device))
    if have < target.capability:
        raise TargetError(f"artifact target {target.name!r} needs compute capability "
                          f"{target.capability[0]}.{target.capability[1]}+, this GPU has {have[0]}.{have[1]} "
                          f"(pass --emulate to run it through emulation kernels)")
