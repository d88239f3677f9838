"""The fused compressor update (kernels/v4_compress.py) against the static op it replaces.

Both run on clones of the same caches; every slot but the scratch one (the last; the static op sends
its masked writes there, the kernel skips them) must agree after every call: the state rows exactly
(they are copies and one fp32 add), the entries within `TOL`. CPU runs the Triton interpreter with
small shapes (w = 24: not a power of two, r = 8, m = 4 for CSA, m = 8 standing in for HCA); the gpu
tests use V4-Flash shapes with bf16 entries and CUDA-graph replay.

Legend: B batch rows, T chunk tokens, m compress ratio, c overlap (2 for m = 4), w entry width,
r rope dims, R kept state rows, E entry capacity, n_slots cache slots (the last is scratch).
"""
from __future__ import annotations

import pytest
import torch
from dsv4c.kernels.tolerances import rel_err
from dsv4c.kernels.v4_compress import (
    one_launch,
    v4_compress_fused,
    v4_compress_fused_ref,
)
from dsv4c.passes.split_at_routers import OP_CAPTURE

# Entries vs the static op. fp32: rel_err (||x - ref|| / ||ref||, fp64); the two differ only in the
# order of the fp32 sums (softmax denominator, Σ p·kv, Σ x²): measured <= 3e-8 on CPU. bf16:
# max|x - ref| / max|ref|, i.e. within one bf16 rounding (2^-8) of the largest entry: an fp32 ulp of
# difference before a cast can flip one rounding (CPU measured 0: the kernel rounds to nearest-even
# under the interpreter too).
TOL: dict[torch.dtype, float] = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def entry_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """The metric of TOL for x's dtype."""
    if x.dtype == torch.float32:
        return rel_err(x, ref)
    return float((x.double() - ref.double()).abs().max() / ref.double().abs().max())


def _caches(n_slots, R, E, c, w, g, dtype=torch.float32):
    """Random state (slot 0 fresh: zero kv, -inf scores) and random entries."""
    st_kv = torch.randn(n_slots, R, c * w, generator=g)
    st_sc = 2 * torch.randn(n_slots, R, c * w, generator=g)
    st_kv[0], st_sc[0] = 0.0, float("-inf")  # as _compressor_rows makes them
    entries = torch.randn(n_slots, E, w, generator=g).to(dtype)
    return [st_kv, st_sc, entries]


def _params(m, c, w, half, g, dtype=torch.float32):
    ape = torch.randn(m, c * w, generator=g)
    norm_w = (1 + 0.3 * torch.randn(w, generator=g)).to(dtype)
    inv_freq = 10000.0 ** (-torch.arange(half, dtype=torch.float32) / half)
    return ape, norm_w, inv_freq


def _compare(fused, ref, step, dtype=torch.float32) -> float:
    for name, a, b in zip(("state_kv", "state_score"), fused[:2], ref[:2]):
        assert torch.equal(a[:-1], b[:-1]), f"step {step}: {name} differs"
    err = entry_err(fused[2][:-1], ref[2][:-1])
    assert err <= TOL[dtype], f"step {step}: entries error {err:.3g} > {TOL[dtype]}"
    return err


def _stream(m, T, steps, R, B=3, w=24, half=4, seed=0, dtype=torch.float32, block_rows=None, starts=None,
            E=64):
    """Calls of T tokens per row, state carried, rows at their own positions, some padded; returns
    (max entry error, number of entries written, fraction of entry values equal bit for bit)."""
    g = torch.Generator().manual_seed(seed)
    c = 2 if m == 4 else 1
    n_slots = 5
    ape, norm_w, inv_freq = _params(m, c, w, half, g, dtype)
    init = _caches(n_slots, R, E, c, w, g, dtype)
    ref, fused = [t.clone() for t in init], [t.clone() for t in init]
    slots = torch.tensor([2, 0, 3])[:B]
    pos = torch.tensor(starts or [m - 1, 0, 3 * m])[:B]  # just before a boundary, fresh, at a boundary
    worst = 0.0
    for step in range(steps):
        kv = torch.randn(B, T, c * w, generator=g)
        sc = 2 * torch.randn(B, T, c * w, generator=g)
        n_real = torch.tensor([T, T - 1 if step % 3 == 1 else T, 0 if step % 4 == 2 else T])[:B]
        v4_compress_fused_ref(kv, sc, slots, pos, n_real, ape, norm_w, inv_freq, *ref, m, 1e-6)
        v4_compress_fused(kv, sc, slots, pos, n_real, ape, norm_w, inv_freq, *fused, m, 1e-6, block_rows=block_rows)
        worst = max(worst, _compare(fused, ref, step, dtype))
        pos += n_real
    changed = (ref[2][:-1] != init[2][:-1]).any(-1)
    same = float((fused[2][:-1][changed] == ref[2][:-1][changed]).float().mean()) if changed.any() else 0.0
    return worst, int(changed.sum()), same


@pytest.mark.parametrize("T", [1, 3, 5])
@pytest.mark.parametrize("m", [4, 8])
def test_stream_of_calls_matches_static_op(m, T):
    """R = c·m + T - 1 (the model's caches for verify chunks of T): one launch. The stream crosses
    at least three group boundaries in every row."""
    c = 2 if m == 4 else 1
    assert one_launch(c * m + T - 1, T, c, m)
    steps = -(-3 * m // T) + 2
    err, written, _ = _stream(m, T, steps, R=c * m + T - 1, seed=10 * m + T)
    assert written >= 6, "too few groups closed for the test to mean anything"
    print(f"m={m} T={T}: {written} entries, max rel_err {err:.2e}")


@pytest.mark.parametrize("m,T,block_rows", [(4, 3, 4), (8, 5, 2), (8, 1, 4)])
def test_short_state_two_launches_and_row_blocks(m, T, block_rows):
    """R = c·m (< T + c·m - 1 for T > 1): entries and state rows in two launches; rows pooled in
    blocks smaller than the group (the online softmax of the HCA path, also over CSA's -inf rows)."""
    c = 2 if m == 4 else 1
    R = c * m
    assert one_launch(R, T, c, m) == (T == 1)
    _err, written, _ = _stream(m, T, -(-2 * m // T) + 2, R=R, block_rows=block_rows, seed=m + T)
    assert written >= 4


def test_one_launch_bound():
    for m, c in ((4, 2), (128, 1)):
        for T in (1, 2, 4):
            R = c * m + T - 1  # _compressor_rows with extra = T - 1
            assert one_launch(R, T, c, m) and not one_launch(R - 1, T, c, m)


def test_single_row_far_position_and_bf16_entries():
    """B = 1 at a large position (RoPE angles of ~4e4 rad), bf16 entries and norm weight. Beyond TOL,
    almost every value must be the static op's bit for bit (both round to nearest-even at the same
    two places), which TOL alone would not see (e.g. a missing cast before RoPE)."""
    m, T = 4, 1
    err, written, same = _stream(m, T, 9, R=8, B=1, starts=[40003], dtype=torch.bfloat16, seed=3, E=10016)
    assert written >= 2 and same >= 0.97
    print(f"bf16 entries: max-abs-relative {err:.2e}, {same:.1%} bit-equal")


def test_padding_rows_on_scratch_and_strided_inputs():
    """A padding row (scratch slot, n_real = 0) writes nothing; kv/score as views of one fused
    projection [B, T, 2·c·w] give the same result as contiguous copies."""
    g = torch.Generator().manual_seed(7)
    m, T, c, w, half = 4, 3, 2, 24, 4
    B, n_slots, E, R = 4, 5, 16, 10
    ape, norm_w, inv_freq = _params(m, c, w, half, g)
    init = _caches(n_slots, R, E, c, w, g)
    fused_proj = torch.randn(B, T, 2 * c * w, generator=g)
    kv, sc = fused_proj[..., : c * w], fused_proj[..., c * w :]
    slots = torch.tensor([1, 4, 2, 3])  # row 1 pads on the scratch slot
    pos0 = torch.tensor([1, 5, 8, 0])
    n_real = torch.tensor([3, 0, 2, 3])
    ref, a, b = ([t.clone() for t in init] for _ in range(3))
    v4_compress_fused_ref(kv, sc, slots, pos0, n_real, ape, norm_w, inv_freq, *ref, m, 1e-6)
    v4_compress_fused(kv, sc, slots, pos0, n_real, ape, norm_w, inv_freq, *a, m, 1e-6)
    v4_compress_fused(kv.contiguous(), sc.contiguous(), slots, pos0, n_real, ape, norm_w, inv_freq, *b, m, 1e-6)
    _compare(a, ref, 0)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(torch.equal(x[-1], y[-1]) for x, y in zip(a, init))  # the kernel leaves scratch alone
    assert not torch.equal(a[2], init[2]) and not torch.equal(a[0], init[0])


def test_custom_op_on_cpu_is_the_static_op():
    import dsv4c.kernels.v4_compress  # noqa: F401  (registers dsv4c::v4_compress_fused)

    from dsv4c.model import static_ops  # noqa: F401

    g = torch.Generator().manual_seed(5)
    m, T, c, w, B = 8, 2, 1, 16, 2
    ape, norm_w, inv_freq = _params(m, c, w, 2, g)
    init = _caches(4, 9, 8, c, w, g)
    args = (torch.randn(B, T, c * w, generator=g), torch.randn(B, T, c * w, generator=g), torch.tensor([0, 2]),
            torch.tensor([7, 14]), torch.tensor([2, 2]), ape, norm_w, inv_freq)
    a, b = [t.clone() for t in init], [t.clone() for t in init]
    torch.ops.dsv4c.v4_compress_fused(*args, *a, m, 1e-6)
    torch.ops.dsv4c.v4_compress_static(*args, *b, m, 1e-6)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and not torch.equal(a[2], init[2])
    assert OP_CAPTURE["dsv4c.v4_compress_fused"] is None
    torch.library.opcheck(torch.ops.dsv4c.v4_compress_fused.default, (*args, *init, m, 1e-6))


def _good(B=2, T=1, m=4, w=8):
    c = 2 if m == 4 else 1
    z = torch.zeros
    return {"kv": z(B, T, c * w), "score": z(B, T, c * w), "slots": torch.tensor([0, 1]),
            "pos0": z(B, dtype=torch.int64), "n_real": torch.ones(B, dtype=torch.int64), "ape": z(m, c * w),
            "norm_weight": torch.ones(w), "inv_freq": torch.ones(2), "state_kv": z(3, c * m, c * w),
            "state_score": z(3, c * m, c * w), "entries": z(3, 4, w), "m": m, "eps": 1e-6}


@pytest.mark.parametrize("change,match", [
    ({"kv": torch.zeros(2, 1, 16, dtype=torch.bfloat16)}, "kv must be float32"),
    ({"slots": torch.tensor([0, 1], dtype=torch.int32)}, "slots must be int64"),
    ({"score": torch.zeros(2, 2, 16)}, "kv and score must both be"),
    ({"kv": torch.zeros(2, 1, 24), "score": torch.zeros(2, 1, 24)}, "kv width 24 must be w or 2·w"),
    ({"entries": torch.zeros(3, 4, 7)}, "w = 7 must be even"),
    ({"state_score": torch.zeros(3, 7, 16)}, "state_kv and state_score must both be"),
    ({"state_kv": torch.zeros(2, 8, 16)}, r"n_slots=3"),
    ({"pos0": torch.zeros(3, dtype=torch.int64)}, r"pos0 must be \[B=2\]"),
    ({"ape": torch.zeros(8, 16)}, r"ape must be \[m=4, 16\]"),
    ({"norm_weight": torch.ones(16)}, r"norm_weight must be \[w=8\]"),
    ({"inv_freq": torch.ones(5)}, r"inv_freq must be \[r/2\]"),
    ({"state_kv": torch.zeros(3, 16, 8).transpose(1, 2)}, "state_kv must be contiguous"),
    ({"kv": torch.zeros(2, 1, 32)[..., ::2]}, "contiguous channels"),
    ({"entries": torch.zeros(4, 3, 8).transpose(0, 1)}, "entries must be contiguous"),
    ({"m": 0}, "m must be a positive int"),
    ({"eps": -1.0}, "eps must be >= 0"),
])
def test_rejects_bad_input(change, match):
    kw = {**_good(), **change}
    with pytest.raises(ValueError, match=match):
        v4_compress_fused(**kw)
    with pytest.raises(ValueError, match=match):
        torch.ops.dsv4c.v4_compress_fused(**kw)


# ---- GPU (V4-Flash shapes, bf16 entries) -------------------------------------------------------
def _flash_case(m, w, B, T, seed, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    c = 2 if m == 4 else 1
    R, n_slots, E = c * m + 3, B + 1, 64  # the model's caches for verify chunks of up to 4 tokens
    ape, norm_w, inv_freq = _params(m, c, w, 32, g, torch.bfloat16)
    caches = _caches(n_slots, R, E, c, w, g, torch.bfloat16)
    slots = torch.randperm(B, generator=g)
    pos = (torch.randint(0, 40, (B,), generator=g) * m - torch.randint(0, 3, (B,), generator=g)).clamp(min=0)
    kv = torch.randn(B, T, c * w, generator=g)
    sc = 2 * torch.randn(B, T, c * w, generator=g)
    n_real = torch.full((B,), T)
    n_real[::3] = torch.randint(0, T + 1, n_real[::3].shape, generator=g)
    mv = lambda t: t.to(device)
    return ([mv(t) for t in (kv, sc, slots, pos, n_real, ape, norm_w, inv_freq)], [mv(t) for t in caches])


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("B", [1, 8, 64])
@pytest.mark.parametrize("m,w", [(4, 512), (128, 512), (4, 128)])
def test_gpu_flash_shapes_match_static_op(m, w, B, T):
    args, caches = _flash_case(m, w, B, T, seed=m + w + B + T)
    ref, fused = [t.clone() for t in caches], [t.clone() for t in caches]
    kv, sc, slots, pos, n_real, ape, norm_w, inv_freq = args
    pos[0], n_real[0] = 5 * m - 1, T  # row 0 closes a group at the first step (so entries must change)
    for step in range(m // T + 2 if m == 4 else 2):  # m = 4: crosses boundaries; m = 128: rows close near 0 mod 128
        v4_compress_fused_ref(kv, sc, slots, pos, n_real, ape, norm_w, inv_freq, *ref, m, 1e-6)
        torch.ops.dsv4c.v4_compress_fused(kv, sc, slots, pos, n_real, ape, norm_w, inv_freq, *fused, m, 1e-6)
        _compare(fused, ref, step, torch.bfloat16)
        pos = pos + n_real
        kv, sc = torch.randn_like(kv), 2 * torch.randn_like(sc)
    assert not torch.equal(fused[2], caches[2])


@pytest.mark.gpu
@pytest.mark.parametrize("m,w", [(4, 512), (128, 512)])
def test_gpu_cuda_graph_replay_equals_eager(m, w):
    B, T = 8, 1
    args, caches = _flash_case(m, w, B, T, seed=1)
    args[3].copy_(torch.arange(B, device="cuda") * m + m - 1)  # every row closes a group
    eager = [t.clone() for t in caches]
    torch.ops.dsv4c.v4_compress_fused(*args, *eager, m, 1e-6)
    static_caches = [t.clone() for t in caches]
    torch.ops.dsv4c.v4_compress_fused(*args, *static_caches, m, 1e-6)  # warm-up (compiles)
    for s, t in zip(static_caches, caches):
        s.copy_(t)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.dsv4c.v4_compress_fused(*args, *static_caches, m, 1e-6)
    for s, t in zip(static_caches, caches):
        s.copy_(t)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a[:-1], b[:-1]) for a, b in zip(static_caches, eager))
    assert not torch.equal(static_caches[2], caches[2])
