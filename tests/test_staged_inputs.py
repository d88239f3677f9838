"""A Session's pipelined decode steps stage slots / pos0 / n_real straight into the decode executor's static
block (`SegmentExecutor.meta_staging`) and read the logits as views of its static outputs: the same tokens as
the copied path and as the eager model, with the executor copying nothing for those inputs.
(tests/test_split.py checks the executor alone, bit for bit at padded and full buckets.)"""
from __future__ import annotations

import warnings

import pytest
import torch

from dsv4c import load_model, write_random_checkpoint
from dsv4c.compile import compile_checkpoint
from dsv4c.config import ModelConfig
from dsv4c.model.generate import greedy
from dsv4c.runtime import Session
from dsv4c.runtime.segments import SegmentExecutor

PROMPTS = [[5, 9, 17, 3], [44, 2, 7], [19, 23, 1, 8, 4], [6, 6]]


@pytest.fixture(scope="module")
def h200_art(tmp_path_factory):
    """v4-tiny-a for h200 in fp32 with the reference experts, which the session runs as emulated piecewise graphs
    per bucket (the experts between them)."""
    d = tmp_path_factory.mktemp("staged")
    write_random_checkpoint(ModelConfig.preset("v4-tiny-a"), d / "ckpt", seed=5, dtype=torch.float32)
    compile_checkpoint(d / "ckpt", d / "art", target="h200", max_tokens=64, max_batch=4, dtype=torch.float32,
                       kernels={"moe_experts": "reference"}, verify_boundaries=False)
    return d


def _session(art):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Session.load(art, device="cpu", emulate=True, graphs="emulate", prefix_cache=False)


@torch.no_grad()
def test_pipelined_decode_stages_its_inputs_and_keeps_the_tokens(h200_art, monkeypatch):
    staged, real = [], SegmentExecutor._staged
    monkeypatch.setattr(SegmentExecutor, "_staged",
                        lambda self, view, x, B: staged.append(real(self, view, x, B)) or staged[-1])
    got = [r.tokens for r in _session(h200_art / "art").generate(PROMPTS, max_new_tokens=6)]
    n_staged = sum(staged)
    assert n_staged >= 3 * 4  # three inputs a step, in most of the decode steps
    monkeypatch.setattr(SegmentExecutor, "meta_staging", lambda self, *a: None)  # the copied path
    staged.clear()
    copied = [r.tokens for r in _session(h200_art / "art").generate(PROMPTS, max_new_tokens=6)]
    assert sum(staged) == 0 and got == copied
    model = load_model(h200_art / "ckpt")
    assert got == [greedy(model, torch.tensor([p]), 6)[0].tolist() for p in PROMPTS]
