"""Tiny presets cut to one layer of each kind: export (most of a compile's time) grows with the layer count,
and tests whose property does not depend on it compile these instead."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from dsv4c import ModelConfig

BUNDLE = Path(__file__).resolve().parents[1] / "examples" / "models" / "v4-tiny-pystdlib"


def small(name: str) -> ModelConfig:
    """`name`'s preset with one layer of each kind and no more: v4-tiny-a keeps its sliding, CSA and HCA
    layers, hash and learned routing (and its MTP block); the V3 presets keep one dense and one MoE layer."""
    cfg = ModelConfig.preset(name)
    if name == "v4-tiny-a":
        return dataclasses.replace(cfg, num_hidden_layers=3, compress_ratios=cfg.compress_ratios[:3] + (0,))
    if not cfg.is_v4:
        return dataclasses.replace(cfg, num_hidden_layers=cfg.first_k_dense_replace + 1)
    raise KeyError(f"small: no cut defined for {name!r}")


def bundle_cut(dst: Path, layers: int) -> Path:
    """The bundled checkpoint's first `layers` layers (and its MTP block), tokenizer and chat template."""
    from dsv4c import load_model, save_checkpoint
    from dsv4c.model import build_model

    full = load_model(BUNDLE, dtype=torch.bfloat16)
    cfg = full.config
    ratios = cfg.compress_ratios[:layers] + cfg.compress_ratios[-1:]  # the last: the MTP block's
    cut = build_model(cfg.replace(num_hidden_layers=layers, compress_ratios=ratios), device="meta")
    names = set(cut.state_dict())
    cut.load_state_dict({k: v for k, v in full.state_dict().items() if k in names}, strict=True, assign=True)
    save_checkpoint(cut, dst, quant="release")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (dst / f).write_bytes((BUNDLE / f).read_bytes())
    return dst
