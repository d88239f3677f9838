"""The Session's static caches: layout, size and allocation.

The exported graphs fix every cache shape (`cache_slots` = max_batch + 1 scratch slot, `max_tokens`
positions, the V4 ring's W + k rows), so the runtime cannot grow or shrink them at load: it checks that
they fit in the memory left after the weights and graphs, and says what would fit when they do not.

Per model type (names as `dsv4c.export.flat_caches` writes them, "{layer}.{field}"):
  V4     ring (window rows), comp_kv / comp_score (the compressor's open-group state, fp32),
         entries (compressed entries), idx_kv / idx_score / idx_entries (the CSA indexer's compressor)
  V3     latent (c_KV rows), kpe (rotated key rows), index_keys (V3.2's indexer)
Paged artifacts (runtime/block_pool.py) hold the growing ones (entries, idx_entries, latent, kpe,
index_keys) as pools [N + 1 blocks, rows per block, ...] plus one "block_table" [slots, blocks per sequence].
Open-group scores start at -inf (an empty row has weight 0 in the pooling softmax); all else at 0.
"""
from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass

import torch

from dsv4c.config import ModelConfig

KIND_OF_FIELD = {"ring": "window ring", "comp_kv": "open-group state", "comp_score": "open-group state",
                 "entries": "compressed entries", "idx_kv": "indexer", "idx_score": "indexer",
                 "idx_entries": "indexer", "latent": "latent", "kpe": "latent (rope part)",
                 "index_keys": "indexer", "block_table": "block table"}


class CacheError(RuntimeError):
    """The caches do not fit; the message names the limits and what would fit."""


def fill_value(name: str) -> float:
    return float("-inf") if name.endswith("_score") else 0.0


@dataclass(frozen=True)
class CacheLayout:
    shapes: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]  # (flat name, shape [slots, ...], dtype)
    slots: int
    max_tokens: int

    @property
    def total_bytes(self) -> int:
        return sum(_numel(s) * d.itemsize for _, s, d in self.shapes)

    @property
    def bytes_per_slot(self) -> int:
        return self.total_bytes // self.slots

    def by_kind(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for name, s, d in self.shapes:
            out[KIND_OF_FIELD.get(name.split(".", 1)[-1], name)] += _numel(s) * d.itemsize
        return dict(out)

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in self.by_kind().items())
        return f"{self.slots} slots x {self.max_tokens} positions: {self.total_bytes / 2**20:.1f} MiB ({parts})"


def _numel(shape) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def cache_layout(config: ModelConfig, dtype: torch.dtype, slots: int, max_tokens: int, extra_ring_slots: int = 0,
                 mtp: bool = False, paged=None) -> CacheLayout:
    """The caches the graphs expect, computed on the meta device (nothing allocated). `paged`: a
    `dsv4c.model.common.PagedLayout` (the growing caches as pools of blocks, plus "block_table")."""
    from dsv4c.export import flat_caches
    from dsv4c.model import build_model

    model = build_model(config, device="meta", dtype=dtype)
    extra = {"extra_ring_slots": extra_ring_slots} if config.is_v4 else {}
    if paged is not None:
        extra["paged"] = paged
    new = model.new_mtp_cache if mtp else model.new_cache
    meta = flat_caches(new(slots, max_len=max_tokens, **extra).layers)
    return CacheLayout(tuple((k, tuple(t.shape), t.dtype) for k, t in meta.items()), slots, max_tokens)


def free_bytes(device: torch.device) -> int:
    """Memory available for new allocations on `device`."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def allocate(layout: CacheLayout, device: torch.device, headroom: float = 0.1,
             what: str = "KV caches") -> dict[str, torch.Tensor]:
    """Allocate `layout` on `device` if it fits in the free memory less `headroom` (a fraction kept
    for activations and graph pools); else CacheError naming the limits and how many slots would fit."""
    need = layout.total_bytes
    have = int(free_bytes(device) * (1 - headroom))
    if need > have:
        fit = max(have // max(layout.bytes_per_slot, 1) - 1, 0)
        raise CacheError(f"{what} need {need / 2**30:.2f} GiB ({layout.describe()}) but only {have / 2**30:.2f} GiB "
                         f"of {device} memory is free after the weights and graphs; recompile with a smaller "
                         f"--max-batch (about {fit} sequences of {layout.max_tokens} positions fit) or --max-tokens")
    return {k: torch.full(s, fill_value(k), dtype=d, device=device) for k, s, d in layout.shapes}
