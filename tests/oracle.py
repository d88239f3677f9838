"""HF transformers as the test oracle: random weights for dsv4c models, copied into HF models by name.

HF's random init zeroes sinks, biases, `ape` and `tid2eid`; every dsv4c parameter is randomised here
and every HF parameter must receive a value, or the comparison proves nothing.
"""
from __future__ import annotations

import torch

from dsv4c.names import v4_official_to_hf


def randomize_(model: torch.nn.Module, seed: int = 0, std: float = 0.3, expert_gain: float = 4.0) -> None:
    """Fill every parameter and integer buffer with seeded random values."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    for name, p in model.named_parameters():
        with torch.no_grad():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight") or name.endswith("k_norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(("_scale", "hc_scale")):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif ".experts." in name or name.endswith(("experts.w1", "experts.w2", "experts.w3")):
                fan_in = p.shape[-1]
                p.copy_(expert_gain * torch.randn(p.shape, generator=g) / fan_in**0.5)
            elif p.dim() >= 2:
                p.copy_(std * torch.randn(p.shape, generator=g) * (64 / p.shape[-1]) ** 0.5)
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            V, K = b.shape
            rows = torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:K] for _ in range(V)])
            b.copy_(rows)


def hf_v4_model(model) -> torch.nn.Module:
    """An HF DeepseekV4ForCausalLM (eager, fp32) holding exactly `model`'s main-model weights."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    hc = DeepseekV4Config(**model.config.to_hf_dict())
    hc._attn_implementation = "eager"
    hf = DeepseekV4ForCausalLM(hc).float().eval()
    target = hf.state_dict()
    assigned = set()
    for name, t in model.state_dict().items():
        if name.startswith("mtp."):
            continue
        if name.endswith(("experts.w1", "experts.w3", "experts.w2")):
            layer = name.split(".")[1]
            pre = f"model.layers.{layer}.mlp.experts."
            I = t.shape[1]
            if name.endswith("w1"):
                target[pre + "gate_up_proj"][:, :I] = t
            elif name.endswith("w3"):
                target[pre + "gate_up_proj"][:, I:] = t
            else:
                target[pre + "down_proj"].copy_(t)
            assigned.add(pre + ("down_proj" if name.endswith("w2") else "gate_up_proj"))
            continue
        hf_name = v4_official_to_hf(name)
        assert target[hf_name].shape == t.shape, (name, hf_name)
        target[hf_name].copy_(t)
        assigned.add(hf_name)
    missing = set(target) - assigned
    assert not missing, f"HF parameters left at their init: {sorted(missing)}"
    hf.load_state_dict(target)
    return hf
