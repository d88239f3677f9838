"""Tiny presets cut to one layer of each kind: export (most of a compile's time) grows with the layer count,
and tests whose property does not depend on it compile these instead."""
from __future__ import annotations

import dataclasses

from dsv4c import ModelConfig


def small(name: str) -> ModelConfig:
    """`name`'s preset with one layer of each kind and no more: v4-tiny-a keeps its sliding, CSA and HCA
    layers, hash and learned routing (and its MTP block); the V3 presets keep one dense and one MoE layer."""
    cfg = ModelConfig.preset(name)
    if name == "v4-tiny-a":
        return dataclasses.replace(cfg, num_hidden_layers=3, compress_ratios=cfg.compress_ratios[:3] + (0,))
    if not cfg.is_v4:
        return dataclasses.replace(cfg, num_hidden_layers=cfg.first_k_dense_replace + 1)
    raise KeyError(f"small: no cut defined for {name!r}")
