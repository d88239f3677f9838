"""Eager reference models (the spec in code) and what every model shares: building one for a
config, the dtype policy (which tensors stay fp32), and seeded random weights."""
from __future__ import annotations

import importlib
import zlib

import torch
from torch import nn

from dsv4c.config import ModelConfig
from dsv4c.names import expert_disk_name, is_stacked

# Tensors kept in fp32 whatever the model dtype, as in the released checkpoints.
_FP32_SUFFIXES = ("_fn", "_base", "_scale", "attn_sink", ".ape", "gate.bias", "e_score_correction_bias")


def keeps_fp32(name: str) -> bool:
    """True for the mHC/hc_head parameters, sinks, compressor `ape` and router biases."""
    return name.endswith(_FP32_SUFFIXES)


# The Triton kernel modules (dsv4c.kernels.<name>) that register dsv4c custom ops the fusion passes
# and the quantised experts lower to; they need triton.
KERNEL_MODULES = ("batch_invariant", "fp8_gemm", "grouped_linear", "l2_prefetch", "linear_f32", "mhc", "moe_grouped",
                  "norm", "rope", "rope_angles", "router", "swiglu", "v4_attention", "v4_compress", "v4_indexer")


def register_ops() -> dict[str, str]:
    """Import every module that defines dsv4c custom ops (needed before torch.export.load).

    Returns {kernel module: import error} for the kernel modules that failed to import (empty when all
    did). The caller decides what a failure means: the fusion passes raise on a CUDA target and print
    a notice on the CPU target (`dsv4c.passes.kernel_ops`)."""
    from dsv4c.model import moe, static_ops, v3_ops, v4_ops  # noqa: F401

    failed = {}
    for mod in KERNEL_MODULES:
        try:
            importlib.import_module(f"dsv4c.kernels.{mod}")
        except ImportError as e:
            failed[mod] = f"{type(e).__name__}: {e}"
    return failed


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    if cfg.is_v4:
        from dsv4c.model.v4 import DeepseekV4Model

        return DeepseekV4Model
    from dsv4c.model.v3 import DeepseekV3Model

    return DeepseekV3Model


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                init: bool = True, on_device: bool = False) -> nn.Module:
    """Build the eager model for `cfg`. `device="meta"` allocates nothing (full-size configs).
    With `init=False` the parameters are left uninitialised (they are about to be loaded);
    `on_device=True` draws the random values on `device` (see `randomize_`). The dtype is set on
    meta, so no fp32 copy is ever allocated; the values are the same as casting after the fill."""
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    set_dtype_(model, dtype)
    if str(device) != "meta":
        model = model.to_empty(device=device)
        if init:
            randomize_(model, seed=0, on_device=on_device)
    return model.eval()


def set_dtype_(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast floating parameters to `dtype`, except the fp32 islands (`keeps_fp32`)."""
    for name, p in model.named_parameters():
        want = torch.float32 if keeps_fp32(name) else dtype
        if p.dtype != want:
            p.data = p.data.to(want)


def tensor_seed(seed: int, name: str) -> int:
    """A per-tensor seed: the same tensor gets the same values however the checkpoint is sharded."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**62)


def random_tensor(name: str, shape: tuple[int, ...], cfg: ModelConfig, seed: int,
                  dtype: torch.dtype = torch.float32, expert_gain: float = 4.0,
                  device: str | torch.device = "cpu") -> torch.Tensor:
    """Seeded random values with every parameter non-trivial (HF's init zeroes sinks, biases, ape and
    tid2eid, which hides bugs). Matrices get std gain/sqrt(fan_in); routed experts a larger gain so
    that the SwiGLU clamp fires; `tid2eid` rows hold K distinct experts. The values depend on the
    device's generator: CPU values are the reference (checkpoints); a GPU fills full-size models fast."""
    g = torch.Generator(device=device).manual_seed(tensor_seed(seed, name))
    kw = {"generator": g, "device": device}
    if name.endswith("tid2eid"):
        V, K = shape
        return torch.rand(V, cfg.n_routed_experts, **kw).topk(K, dim=-1).indices.to(torch.int64)
    if name.endswith(("norm.weight", "layernorm.weight")):
        t = 1 + 0.2 * torch.randn(shape, **kw)
    elif name.endswith("_scale"):  # mHC / hc_head scales
        t = 0.5 + torch.rand(shape, **kw)
    elif len(shape) >= 2:
        gain = expert_gain if _is_routed_expert(name) else 2.4
        t = gain * torch.randn(shape, **kw) / shape[-1] ** 0.5
    else:  # sinks, biases, ape rows, hc bases, LayerNorm bias
        t = 0.3 * torch.randn(shape, **kw)
    return t.to(torch.float32 if keeps_fp32(name) else dtype)


def _is_routed_expert(name: str) -> bool:
    return ".experts." in name and "shared_experts" not in name


@torch.no_grad()
def randomize_(model: nn.Module, seed: int = 0, on_device: bool = False) -> nn.Module:
    """Fill every parameter and persistent buffer of `model` with `random_tensor` values (drawn on the
    CPU, or with `on_device=True` by the parameters' own device: other values, much faster on a GPU)."""
    cfg = model.config
    persistent = set(model.state_dict())
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name not in persistent:
            continue
        dev = t.device if on_device else "cpu"
        if is_stacked(name):  # per expert, under its checkpoint name, as `dsv4c init` writes it
            for e in range(t.shape[0]):
                t[e].copy_(random_tensor(expert_disk_name(name, e), tuple(t.shape[1:]), cfg, seed, t.dtype,
                                         device=dev))
        else:
            t.copy_(random_tensor(name, tuple(t.shape), cfg, seed, t.dtype, device=dev))
    return model


def count_parameters(model: nn.Module) -> dict[str, int]:
    """Parameter counts (works on the meta device): `total` and per-token `active` for the main model,
    and the MTP block's own count under `mtp`. The published totals (V4-Flash 284B / 13B active) exclude
    the MTP block. Active counts K of E routed experts per MoE layer; embedding and head are included."""
    cfg = model.config
    total = active = mtp = 0
    for name, p in model.named_parameters():
        n = p.numel()
        if name.startswith("mtp.") or name.startswith(f"model.layers.{cfg.num_hidden_layers}."):
            mtp += n
            continue
        total += n
        active += n * cfg.num_experts_per_tok // cfg.n_routed_experts if _is_routed_expert(name) else n
    return {"total": total, "active": active, "mtp": mtp}
