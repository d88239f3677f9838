"""Cache slots: a step may run any subset of the cached sequences, in any order (V4 and V3)."""
from __future__ import annotations

import pytest
import torch

from dsv4c import ModelConfig
from dsv4c.model import build_model


@torch.no_grad()
@pytest.mark.parametrize("preset", ["v4-tiny-a", "v3-tiny", "v32-tiny"])
def test_subset_of_slots_equals_sequences_alone(preset):
    cfg = ModelConfig.preset(preset)
    model = build_model(cfg)
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(0, cfg.vocab_size, (3, 14), generator=g)
    alone = []
    for s in seqs:
        c = model.new_cache(1, max_len=32)
        alone.append(torch.cat([model(s[None, :10], c)] + [model(s[None, 10 + i : 11 + i], c) for i in range(4)], 1))
    cache = model.new_cache(3, max_len=32)
    first = model(seqs[:, :10], cache)
    steps = {0: [], 2: []}
    for i in range(4):  # only sequences 2 and 0 decode; sequence 1 stays put
        out = model(seqs[[2, 0], 10 + i : 11 + i], cache, slots=torch.tensor([2, 0]))
        steps[2].append(out[0:1])
        steps[0].append(out[1:2])
    assert cache.pos.tolist() == [14, 10, 14]
    for b in (0, 2):
        got = torch.cat([first[b : b + 1]] + steps[b], 1)
        torch.testing.assert_close(got, alone[b], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("preset", ["v4-tiny-a", "v3-tiny"])
def test_bad_slots_are_rejected_before_any_state_changes(preset):
    model = build_model(ModelConfig.preset(preset))
    cache = model.new_cache(3, max_len=16)
    ids = torch.zeros(2, 2, dtype=torch.int64)
    for slots in ([1, 1], [0, 3], [-1, 0]):
        with pytest.raises(ValueError, match="distinct cache rows"):
            model(ids, cache, slots=torch.tensor(slots))
    assert cache.pos.tolist() == [0, 0, 0]
