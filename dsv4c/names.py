"""Tensor-name forms of the checkpoints and the maps between them.

dsv4c's canonical form is the one its eager models use in `state_dict()`:
  * V4: official hub names (`layers.L.attn.wq_a.weight`, `mtp.0.*`), with the routed experts stacked
    into `layers.L.ffn.experts.w1 [E, I, D]` (likewise w3, w2);
  * V3/V3.2: HF hub names (`model.layers.L.self_attn.q_a_proj.weight`), routed experts stacked into
    `model.layers.L.mlp.experts.gate_proj [E, I, D]` (likewise up_proj, down_proj).

On disk, experts are per expert (`...experts.{e}.w1.weight`), and quantised weights carry a scale
(`.scale` for V4 official, `.weight_scale_inv` for HF names). V4 also arrives in HF's in-memory
names and in HF's `save_pretrained` names (deepseek_v4.md §2.1); `to_official_v4` normalises both.
"""
from __future__ import annotations

import re

import torch

# ---- V4: official leaf -> HF module leaf (deepseek_v4.md §2.2) ------------------------------------
_V4_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
_V4_LAYER = [  # (official suffix after `layers.L.`, HF suffix after `model.layers.L.`)
    ("attn_norm.", "input_layernorm."),
    ("ffn_norm.", "post_attention_layernorm."),
    ("hc_attn_fn", "attn_hc.fn"), ("hc_attn_base", "attn_hc.base"), ("hc_attn_scale", "attn_hc.scale"),
    ("hc_ffn_fn", "ffn_hc.fn"), ("hc_ffn_base", "ffn_hc.base"), ("hc_ffn_scale", "ffn_hc.scale"),
    ("attn.attn_sink", "self_attn.sinks"),
    ("attn.indexer.compressor.ape", "self_attn.compressor.indexer.position_bias"),
    ("attn.indexer.compressor.wkv.", "self_attn.compressor.indexer.kv_proj."),
    ("attn.indexer.compressor.wgate.", "self_attn.compressor.indexer.gate_proj."),
    ("attn.indexer.compressor.norm.", "self_attn.compressor.indexer.kv_norm."),
    ("attn.indexer.wq_b.", "self_attn.compressor.indexer.q_b_proj."),
    ("attn.indexer.weights_proj.", "self_attn.compressor.indexer.scorer.weights_proj."),
    ("attn.compressor.ape", "self_attn.compressor.position_bias"),
    ("attn.compressor.wkv.", "self_attn.compressor.kv_proj."),
    ("attn.compressor.wgate.", "self_attn.compressor.gate_proj."),
    ("attn.compressor.norm.", "self_attn.compressor.kv_norm."),
    ("attn.wq_a.", "self_attn.q_a_proj."),
    ("attn.q_norm.", "self_attn.q_a_norm."),
    ("attn.wq_b.", "self_attn.q_b_proj."),
    ("attn.wkv.", "self_attn.kv_proj."),
    ("attn.kv_norm.", "self_attn.kv_norm."),
    ("attn.wo_a.", "self_attn.o_a_proj."),
    ("attn.wo_b.", "self_attn.o_b_proj."),
    ("ffn.gate.bias", "mlp.gate.e_score_correction_bias"),
    ("ffn.gate.", "mlp.gate."),
    ("ffn.shared_experts.w1.", "mlp.shared_experts.gate_proj."),
    ("ffn.shared_experts.w3.", "mlp.shared_experts.up_proj."),
    ("ffn.shared_experts.w2.", "mlp.shared_experts.down_proj."),
]
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.*)$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


def _scale_to_hf(name: str) -> str:
    return name[: -len(".scale")] + ".weight_scale_inv" if name.endswith(".scale") else name


def _scale_to_official(name: str) -> str:
    return name[: -len(".weight_scale_inv")] + ".scale" if name.endswith(".weight_scale_inv") else name


def v4_official_to_hf(name: str) -> str | None:
    """Official V4 name -> HF module name (per-expert names and `mtp.*` -> None: HF has no such tensor)."""
    if name in _V4_TOP:
        return _V4_TOP[name]
    m = _LAYER_RE.match(name)
    if not m or ".experts." in name and "shared_experts" not in name:
        return None
    layer, rest = m.groups()
    rest = _scale_to_hf(rest)
    for off, hf in _V4_LAYER:
        if rest.startswith(off):
            return f"model.layers.{layer}.{hf}{rest[len(off):]}"
    raise KeyError(f"no HF name known for V4 tensor {name!r}")


_V4_HF_TO_OFF = {hf: off for off, hf in _V4_LAYER}


def v4_hf_module_to_official(name: str) -> str:
    """HF in-memory V4 name -> official name (fused experts are handled by the caller)."""
    name = _scale_to_official(name)
    for off, hf in _V4_TOP.items():
        if name == hf:
            return off
    m = _HF_LAYER_RE.match(name)
    if not m:
        raise KeyError(f"unknown HF V4 tensor name {name!r}")
    layer, rest = m.groups()
    # longest HF suffix first, so `compressor.indexer.kv_proj.` wins over `compressor.kv_proj.`
    for hf in sorted(_V4_HF_TO_OFF, key=len, reverse=True):
        if rest.startswith(hf):
            return f"layers.{layer}.{_V4_HF_TO_OFF[hf]}{rest[len(hf):]}"
    raise KeyError(f"unknown HF V4 tensor name {name!r}")


def v4_hf_saved_to_official(name: str) -> str:
    """HF `save_pretrained` V4 name (form 3) -> official name."""
    if name.startswith("model."):
        name = name[len("model."):]
    name = _scale_to_official(name)
    if name == "embed_tokens.weight":
        return "embed.weight"
    if name.startswith("hc_head.hc_"):
        return "hc_head_" + name[len("hc_head.hc_"):]
    m = re.match(r"^layers\.(\d+)\.attn\.norm\.weight$", name)
    if m:
        return f"layers.{m.group(1)}.attn.kv_norm.weight"
    return name


def v4_name_form(names) -> str:
    """'official', 'hf_module' or 'hf_saved' (deepseek_v4.md §2.1)."""
    names = list(names)
    if any(n.startswith("model.layers.") and ".self_attn." in n for n in names):
        return "hf_module"
    if any(n.startswith("model.") for n in names):
        return "hf_saved"
    return "official"


_STACKED_RE = re.compile(r"\.experts\.(w1|w2|w3|gate_proj|up_proj|down_proj)$")


def is_stacked(name: str) -> bool:
    """True for a stacked routed-expert parameter of the eager models (`...experts.w1 [E, I, D]`)."""
    return bool(_STACKED_RE.search(name))


def expert_disk_name(stacked: str, e: int) -> str:
    """`P.experts.w1` -> `P.experts.{e}.w1.weight`."""
    prefix, leaf = stacked.rsplit(".", 1)
    return f"{prefix}.{e}.{leaf}.weight"


_V4_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(w1|w2|w3)$")


def v4_to_hf_state_dict(sd: dict, drop_prefixes: tuple[str, ...] = ("mtp.",)) -> tuple[dict, list[str]]:
    """dsv4c V4 tensors (official names, stacked experts) -> (HF in-memory tensors, dropped names).
    Experts: gate_up_proj [E, 2I, D] = w1 rows then w3 rows; down_proj [E, D, I] = w2. Names under
    `drop_prefixes` (the MTP block: HF has none) are dropped; any other name HF lacks raises KeyError."""
    out: dict = {}
    dropped = []
    for name, t in sd.items():
        if name.startswith(drop_prefixes):
            dropped.append(name)
            continue
        m = _V4_EXPERT.match(name)
        if m:
            pre = f"model.layers.{m.group(1)}.mlp.experts."
            if m.group(2) == "w1":
                out[pre + "gate_up_proj"] = torch.cat((t, sd[name[:-2] + "w3"]), dim=1)
            elif m.group(2) == "w2":
                out[pre + "down_proj"] = t
            continue  # w3 is folded into gate_up_proj
        hf = v4_official_to_hf(name)
        if hf is None:
            raise KeyError(f"checkpoint tensor {name!r} has no HF name (dsv4c.names.v4_official_to_hf)")
        out[hf] = t
    return out, dropped
