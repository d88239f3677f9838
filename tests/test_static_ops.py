"""The capture-safe ops (dsv4c/model/static_ops.py) against the reference ops, on random state.

Every case runs both implementations on clones of the same random caches and compares the outputs
and every cache row except the scratch slot (the last one), which only the static ops write."""
import pytest
import torch

from dsv4c.model import moe, static_ops, v3_ops, v4_ops  # noqa: F401  (registers the ops)
from dsv4c.model.v4 import _compressor_rows

ops = torch.ops.dsv4c


def _real(t: torch.Tensor) -> torch.Tensor:
    return t[:-1]  # all slots but scratch


def _meta(B, T, n_slots, S, g, partial=True):
    slots = torch.randperm(n_slots - 1, generator=g)[:B]
    pos0 = torch.tensor([0, 3, 2 * S + 5, S - 1, 7][:B])
    n_real = torch.tensor([T, max(T - 1, 0) if partial else T, 0, T, 1][:B]).clamp(max=T)
    return slots, pos0, n_real


@pytest.mark.parametrize("T", [1, 2, 5])
@pytest.mark.parametrize("kind", ["swa", "hca", "csa"])
def test_v4_attention_static_matches_reference(T, kind):
    g = torch.Generator().manual_seed(T)
    B, H, d, W, n_slots, E, m = 4, 3, 8, 6, 6, 12, 4
    S = W + 2
    slots, pos0, n_real = _meta(B, T, n_slots, S, g)
    q, kv = torch.randn(B, T, H, d, generator=g), torch.randn(B, T, d, generator=g)
    ring = torch.randn(n_slots, S, d, generator=g)
    sinks = torch.randn(H, generator=g)
    entries = torch.randn(n_slots, E, d, generator=g) if kind != "swa" else None
    selected = None
    if kind == "csa":
        selected = torch.randint(-1, E, (B, T, 3), generator=g)
    r1, r2 = ring.clone(), ring.clone()
    a = ops.v4_attention(q, kv, slots, pos0, n_real, r1, sinks, entries, selected, W, m)
    b = ops.v4_attention_static(q, kv, slots, pos0, n_real, r2, sinks, entries, selected, W, m)
    assert (a - b).norm() / a.norm() < 1e-6
    assert torch.equal(_real(r1), _real(r2))
    assert not torch.equal(r1, ring)  # something was written


@pytest.mark.parametrize("extra", [0, 3])
@pytest.mark.parametrize("m", [4, 8])
def test_v4_compress_static_matches_reference_over_a_sequence(m, extra):
    """Chunks of varying T from position 0, the last ones partially real; groups close inside chunks,
    and one chunk is longer than the kept rows (c·m + extra)."""
    g = torch.Generator().manual_seed(m + extra)
    B, w, n_slots, E = 3, 4, 5, 16
    c = 2 if m == 4 else 1
    st_kv, st_sc = _compressor_rows(n_slots, m, w, "cpu", extra)
    st_kv.normal_(generator=g)  # slots start from arbitrary (already used) state
    ents = torch.randn(n_slots, E, w, generator=g)
    ape = torch.randn(m, c * w, generator=g)
    norm_w = torch.randn(w, generator=g)
    inv_freq = torch.rand(w // 2, generator=g)
    ref = [st_kv.clone(), st_sc.clone(), ents.clone()]
    new = [st_kv.clone(), st_sc.clone(), ents.clone()]
    slots = torch.tensor([3, 0, 2])
    pos = torch.zeros(B, dtype=torch.int64)
    for step, T in enumerate([3, 5, 1, 2, 5, 4, 13, 5]):
        kv = torch.randn(B, T, c * w, generator=g)
        sc = torch.randn(B, T, c * w, generator=g)
        n_real = torch.tensor([T, max(T - step % 3, 0), T if step % 2 else 0])
        ops.v4_compress(kv, sc, slots, pos, n_real, ape, norm_w, inv_freq, *ref, m, 1e-6)
        ops.v4_compress_static(kv, sc, slots, pos, n_real, ape, norm_w, inv_freq, *new, m, 1e-6)
        for a, b, name in zip(ref, new, ("state_kv", "state_score", "entries")):
            torch.testing.assert_close(_real(b), _real(a), atol=1e-5, rtol=1e-5,
                                       msg=lambda e, s=step, n=name: f"step {s} {n}: {e}")
        pos += n_real
    assert not torch.equal(ref[2], ents)  # entries were written


def test_v3_cache_updates_static_match_reference():
    g = torch.Generator().manual_seed(0)
    B, T, n_slots, L = 3, 4, 5, 20
    slots, pos0, n_real = torch.tensor([1, 3, 0]), torch.tensor([0, 9, 16]), torch.tensor([4, 2, 0])
    c_kv, k_pe = torch.randn(B, T, 6, generator=g), torch.randn(B, T, 2, generator=g)
    lat, kpe = torch.randn(n_slots, L, 6, generator=g), torch.randn(n_slots, L, 2, generator=g)
    a, b = [lat.clone(), kpe.clone()], [lat.clone(), kpe.clone()]
    ops.mla_cache_update(c_kv, k_pe, slots, pos0, n_real, *a)
    ops.mla_cache_update_static(c_kv, k_pe, slots, pos0, n_real, *b)
    for x, y in zip(a, b):
        assert torch.equal(_real(x), _real(y))
    keys = torch.randn(n_slots, L, 5, generator=g)
    ka, kb = keys.clone(), keys.clone()
    k_idx = torch.randn(B, T, 5, generator=g)
    ops.dsa_cache_update(k_idx, slots, pos0, n_real, ka)
    ops.dsa_cache_update_static(k_idx, slots, pos0, n_real, kb)
    assert torch.equal(_real(ka), _real(kb)) and not torch.equal(ka, keys)


@pytest.mark.parametrize("T", [1, 3, 7])
def test_moe_gathered_matches_reference(T):
    g = torch.Generator().manual_seed(T)
    E, D, I, K = 5, 8, 6, 3
    x = torch.randn(T, D, generator=g, dtype=torch.float64)
    idx = torch.randint(0, E, (T, K), generator=g)
    idx[0] = 2  # a repeated expert id adds its contributions
    w = torch.rand(T, K, generator=g)
    w1, w3 = torch.randn(E, I, D, generator=g, dtype=torch.float64), torch.randn(E, I, D, generator=g, dtype=torch.float64)
    w2 = torch.randn(E, D, I, generator=g, dtype=torch.float64)
    for limit in (0.0, 1.5):
        ref = moe.moe_experts_loop(x, idx, w, w1, w3, w2, limit)
        assert torch.allclose(ops.moe_experts(x, idx, w, w1, w3, w2, limit), ref, atol=1e-10)
        assert torch.allclose(ops.moe_experts_gathered(x, idx, w, w1, w3, w2, limit), ref, atol=1e-10)


@pytest.mark.parametrize("kind", ["swa", "hca", "csa"])
def test_static_attention_prefill_chunk_longer_than_the_ring(kind):
    """A prefill chunk of T = 3 S + 2 tokens: the static op equals the reference's per-row loop, and the
    ring keeps the newest S real positions of each row (a padded row's last real rows, not the chunk's)."""
    g = torch.Generator().manual_seed(11)
    B, H, d, W, n_slots, E, m = 3, 2, 8, 6, 5, 12, 4
    S = W + 1
    T = 3 * S + 2
    slots, pos0, n_real = torch.tensor([2, 0, 3]), torch.tensor([0, 2 * S + 3, 5]), torch.tensor([T, T - 4, 2])
    q, kv = torch.randn(B, T, H, d, generator=g), torch.randn(B, T, d, generator=g)
    ring = torch.randn(n_slots, S, d, generator=g)
    sinks = torch.randn(H, generator=g)
    entries = torch.randn(n_slots, E, d, generator=g) if kind != "swa" else None
    selected = torch.randint(-1, E, (B, T, 3), generator=g) if kind == "csa" else None
    r1, r2 = ring.clone(), ring.clone()
    a = ops.v4_attention(q, kv, slots, pos0, n_real, r1, sinks, entries, selected, W, m)
    b = ops.v4_attention_static(q, kv, slots, pos0, n_real, r2, sinks, entries, selected, W, m)
    real = torch.arange(T)[None, :] < n_real[:, None]  # padded rows' outputs are unspecified
    assert (a - b)[real].norm() / a[real].norm() < 1e-6
    assert torch.equal(_real(r1), _real(r2))
    assert torch.equal(r2[2, torch.arange(T - S, T) % S], kv[0, T - S:])  # row 0 (slot 2, pos0 0): the last S rows
