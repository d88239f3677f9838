"""Sampling: the processed distribution (temperature, top-k, top-p, renormalised) and seeded draws."""
from __future__ import annotations

import pytest
import torch

from dsv4c.runtime.sampling import SamplingParams, processed_probs, sample


def test_greedy_is_one_hot_argmax():
    logits = torch.tensor([0.1, 2.0, -1.0, 1.9])
    assert processed_probs(logits, SamplingParams()).tolist() == [0, 1, 0, 0]
    assert sample(logits, SamplingParams(), torch.Generator()) == 1


def test_temperature_top_k_top_p_by_hand():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    p = processed_probs(logits, SamplingParams(temperature=1.0))
    torch.testing.assert_close(p, torch.tensor([0.5, 0.25, 0.15, 0.1]))
    p = processed_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(p, torch.tensor([2 / 3, 1 / 3, 0, 0]))
    # top-p 0.7: the smallest prefix whose mass reaches 0.7 is {0.5, 0.25}
    p = processed_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    torch.testing.assert_close(p, torch.tensor([2 / 3, 1 / 3, 0, 0]))
    p = processed_probs(logits, SamplingParams(temperature=0.5))
    want = torch.tensor([0.5, 0.25, 0.15, 0.1]) ** 2
    torch.testing.assert_close(p, want / want.sum())


def test_draws_follow_the_processed_distribution():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    params = SamplingParams(temperature=1.0)
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([sample(logits, params, g) for _ in range(4000)]), minlength=3)
    freq = counts.float() / counts.sum()
    assert (freq - torch.tensor([0.5, 0.3, 0.2])).abs().max() < 0.03


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2)])
def test_invalid_parameters_name_the_field(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)
