"""runtime/kv_cache.py: the cache layout per model type, and a clear error when the caches cannot fit."""
import pytest
import torch

from dsv4c import ModelConfig
from dsv4c.runtime import kv_cache
from dsv4c.runtime.kv_cache import CacheError, allocate, cache_layout


def test_v4_layout_has_every_state_kind_and_counts_bytes():
    cfg = ModelConfig.preset("v4-tiny-a")
    lay = cache_layout(cfg, torch.bfloat16, slots=3, max_tokens=64, extra_ring_slots=2)
    kinds = lay.by_kind()
    assert set(kinds) == {"window ring", "open-group state", "compressed entries", "indexer"}
    assert sum(kinds.values()) == lay.total_bytes == 3 * lay.bytes_per_slot
    ring = next(s for n, s, _ in lay.shapes if n == "0.ring")
    assert ring == (3, cfg.sliding_window + 2, cfg.head_dim)
    assert all(d == torch.float32 for n, _, d in lay.shapes if "score" in n or n.endswith("_kv"))
    caches = allocate(lay, torch.device("cpu"))
    assert all(torch.isinf(t).all() == n.endswith("_score") for n, t in caches.items())


def test_v3_layouts():
    for preset, kinds in (("v3-tiny", {"latent", "latent (rope part)"}),
                          ("v32-tiny", {"latent", "latent (rope part)", "indexer"})):
        lay = cache_layout(ModelConfig.preset(preset), torch.bfloat16, slots=2, max_tokens=32)
        assert set(lay.by_kind()) == kinds


def test_caches_that_do_not_fit_name_the_limits(monkeypatch):
    lay = cache_layout(ModelConfig.preset("v4-tiny-a"), torch.float32, slots=9, max_tokens=4096)
    monkeypatch.setattr(kv_cache, "free_bytes", lambda device: lay.bytes_per_slot * 4)
    with pytest.raises(CacheError, match=r"KV caches need .*\(9 slots x 4096 positions.*--max-batch \(about 2 "):
        allocate(lay, torch.device("cpu"))
