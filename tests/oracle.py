"""HF transformers as the test oracle: random weights for dsv4c models, copied into HF models by name.

HF's random init zeroes sinks, biases, `ape` and `tid2eid`; every dsv4c parameter is randomised here
and every HF parameter must receive a value, or the comparison proves nothing.
"""
from __future__ import annotations

import torch

from dsv4c.names import v4_to_hf_state_dict


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Every parameter and integer buffer random (dsv4c's seeded init, also used by `dsv4c init`)."""
    from dsv4c.model import randomize_ as _randomize

    _randomize(model, seed)


def hf_v4_model(model) -> torch.nn.Module:
    """An HF DeepseekV4ForCausalLM (eager, fp32) holding exactly `model`'s main-model weights."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    hc = DeepseekV4Config(**model.config.to_hf_dict())
    hc._attn_implementation = "eager"
    hf = DeepseekV4ForCausalLM(hc).float().eval()
    target = hf.state_dict()
    mapped, _ = v4_to_hf_state_dict(model.state_dict())
    for hf_name, t in mapped.items():
        assert target[hf_name].shape == t.shape, hf_name
        target[hf_name].copy_(t)
    assigned = set(mapped)
    missing = set(target) - assigned
    assert not missing, f"HF parameters left at their init: {sorted(missing)}"
    hf.load_state_dict(target)
    return hf


# ---- V3 / V3.2 -----------------------------------------------------------------------------------
def randomize_v3_(model: torch.nn.Module, seed: int = 0, std: float = 0.3) -> None:
    """Weights ~ N(0, std²); norm weights ~ 1 + N(0, 0.2²); LayerNorm bias and the router's
    e_score_correction_bias ~ N(0, 0.1²) (HF initialises the latter to 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if not t.is_floating_point():
                continue
            if name.endswith("e_score_correction_bias") or name.endswith("k_norm.bias"):
                val = 0.1 * torch.randn(t.shape, generator=g)
            elif "norm" in name.rsplit(".", 2)[-2] and name.endswith(".weight"):
                val = 1 + 0.2 * torch.randn(t.shape, generator=g)
            else:
                assert t.dim() >= 2, f"unexpected 1-D tensor {name}"
                val = std * torch.randn(t.shape, generator=g)
            t.data.copy_(val.to(t.dtype))


def to_hf_state_dict(sd: dict[str, torch.Tensor], skip_prefix: str | None = None) -> dict[str, torch.Tensor]:
    """dsv4c tensors -> HF in-memory names. Experts: gate_up_proj [E, 2I, D] = gate rows then up rows;
    down_proj [E, D, I] unchanged. Names starting with `skip_prefix` (the MTP layer, which HF lacks) are
    dropped."""
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if skip_prefix is not None and name.startswith(skip_prefix):
            continue
        if name.endswith("mlp.experts.gate_proj"):
            up = sd[name[: -len("gate_proj")] + "up_proj"]
            out[name[: -len("gate_proj")] + "gate_up_proj"] = torch.cat((t, up), dim=1)
        elif name.endswith("mlp.experts.up_proj"):
            continue  # folded into gate_up_proj
        else:
            out[name] = t
    return out


def hf_config(cfg):
    """HF config object for a dsv4c ModelConfig (eager attention, eager experts)."""
    from transformers import DeepseekV3Config, DeepseekV32Config

    cls = DeepseekV32Config if cfg.model_type == "deepseek_v32" else DeepseekV3Config
    hc = cls(**cfg.to_hf_dict())
    hc._attn_implementation = "eager"
    hc._experts_implementation = "eager"
    return hc


def hf_v3_model(model) -> torch.nn.Module:
    """An HF causal LM (eager, fp32) holding exactly `model`'s main-model weights."""
    from transformers import DeepseekV3ForCausalLM, DeepseekV32ForCausalLM

    cfg = model.config
    cls = DeepseekV32ForCausalLM if cfg.model_type == "deepseek_v32" else DeepseekV3ForCausalLM
    hf = cls(hf_config(cfg)).float().eval()
    assert hf.lm_head.weight.data_ptr() != hf.model.embed_tokens.weight.data_ptr(), "HF tied lm_head"
    mapped = to_hf_state_dict(model.state_dict(), skip_prefix=f"model.layers.{cfg.num_hidden_layers}.")
    target = hf.state_dict()
    missing, unexpected = set(target) - set(mapped), set(mapped) - set(target)
    assert not missing and not unexpected, f"unassigned HF tensors {sorted(missing)}; unused {sorted(unexpected)}"
    for name, t in mapped.items():
        assert target[name].shape == t.shape, f"{name}: HF {tuple(target[name].shape)} vs {tuple(t.shape)}"
    hf.load_state_dict(mapped, strict=True)
    for name, t in hf.state_dict().items():  # every HF tensor now holds the dsv4c value
        assert torch.equal(t, mapped[name].to(t.dtype)), name
    return hf
