"""The compile step's padding check at the segment boundaries (runtime.segments.verify_artifact_boundaries)."""
from __future__ import annotations

import pytest
import torch
from cut_presets import small

from dsv4c import write_random_checkpoint
from dsv4c.compile import compile_checkpoint
from dsv4c.runtime.segments import SegmentExecutor, boundary_sizes, verify_artifact_boundaries


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    d = tmp_path_factory.mktemp("boundary")
    write_random_checkpoint(small("v32-tiny"), d / "ckpt", seed=2, dtype=torch.float32)  # dense + MoE layer
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


def test_boundary_sizes_cover_every_bucket_gap_at_its_most_padding():
    default = (1, 2, 4, 8, 16, 24, 32, 48, 64)
    # one size per gap (just above the lower bucket: the most padded rows) and the largest non-bucket
    assert boundary_sizes(default, 64) == [3, 5, 9, 17, 25, 33, 49, 63]
    for max_batch in (1, 2, 3, 6, 7, 8, 20, 64):
        sizes = boundary_sizes(default, max_batch)
        assert all(1 <= b <= max_batch for b in sizes), (max_batch, sizes)
        non_buckets = [b for b in range(1, max_batch + 1) if b not in default]
        if non_buckets:  # only padded sizes, and every gap below max_batch is represented
            assert set(sizes) <= set(non_buckets) and max(non_buckets) in sizes
            for lo, hi in zip(default, default[1:]):
                if hi - lo > 1 and lo + 1 <= max_batch:
                    assert any(lo < b < hi for b in sizes), (max_batch, lo, hi, sizes)
        else:
            assert sizes == [max_batch]


def test_a_batch_above_every_bucket_is_checked_on_the_eager_path(tmp_path):
    """max_batch 3 with buckets 1, 2: batch 3 runs eagerly (no bucket fits); the check records it
    with bucket None instead of failing the compile."""
    write_random_checkpoint(small("v32-tiny"), tmp_path / "ckpt", seed=3, dtype=torch.float32)
    m = compile_checkpoint(tmp_path / "ckpt", tmp_path / "art", target="h200", max_tokens=32, max_batch=3,
                           dtype=torch.float32, buckets=(1, 2), kernels={"moe_experts": "gathered"})
    rep = m["boundary_check"]
    assert rep["ok"] is True and {(c["batch"], c["bucket"]) for c in rep["cases"]} == {(3, None)}
