"""The compile step's padding check at the segment boundaries (runtime.segments.verify_artifact_boundaries)."""
from __future__ import annotations

import pytest
import torch

from dsv4c import ModelConfig, write_random_checkpoint
from dsv4c.compile import compile_checkpoint
from dsv4c.runtime.segments import SegmentExecutor, verify_artifact_boundaries


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    d = tmp_path_factory.mktemp("boundary")
    write_random_checkpoint(ModelConfig.preset("v32-tiny"), d / "ckpt", seed=2, dtype=torch.float32)
    m = compile_checkpoint(d / "ckpt", d / "art", target="h200", max_tokens=32, max_batch=4, dtype=torch.float32,
                           buckets=(1, 2, 4), kernels={"moe_experts": "gathered"})
    return d / "art", m


def test_compile_records_a_passing_boundary_check(art):
    _, m = art
    rep = m["boundary_check"]
    assert rep["ok"] is True
    assert {(c["batch"], c["bucket"], c["mode"]) for c in rep["cases"]} == {(3, 4, "emulate"), (3, 4, "full-emulate")}
    assert all(c["logits_rel_err"] <= 1e-4 and c["cache_rel_err"] <= 1e-4 for c in rep["cases"])


def test_the_check_catches_padding_that_writes_to_a_real_slot(art, monkeypatch):
    """Sabotage the executor: padded rows claim one real token and use the first row's slot."""
    original = SegmentExecutor._fill_inputs

    def leaky(self, st, flat, B):
        original(self, st, flat, B)
        for i in self._padded_idx:
            name = self._placeholders[i].name
            if name == "n_real":
                st.flat_views[i][B:].fill_(1)
            elif name == "slots":
                st.flat_views[i][B:].copy_(flat[i][:1].expand(st.size - B))

    monkeypatch.setattr(SegmentExecutor, "_fill_inputs", leaky)
    rep = verify_artifact_boundaries(art[0])
    assert rep["ok"] is False
    assert all(c["cache_rel_err"] > 1e-3 for c in rep["cases"]), rep
