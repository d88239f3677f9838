"""Fused V4 indexer selection (kernels/v4_indexer.py) vs the model's `dsv4c::v4_indexer_topk`.

The fused op returns the model op's SET of entries in ascending order, so selections are compared as
sets; an entry may differ only where its reference score is a near-tie (within NEAR_TIE relative) of
the K-th score. CPU runs the kernels under the Triton interpreter; GPU tests with -m gpu.
Dimensions: B rows, T tokens, HI heads, dI head dim, E entry capacity, K topk.
"""
from __future__ import annotations

import textwrap

import pytest
import torch
from dsv4c.kernels import v4_indexer as V
from dsv4c.kernels.tolerances import rel_err

from dsv4c.model.v4_ops import v4_indexer_topk
from sm90_compile import run_sm90_script

SCORE_REL_ERR = 1e-6   # fp32 scores vs fp64 (only the summation order differs); measured <= 8.5e-8 on CPU
NEAR_TIE = 1e-5        # relative distance to the K-th score within which set membership may differ
M = 4


def make_inputs(B, T, HI, dI, E, pos0, n_slots=5, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, HI, dI, generator=g).to(dtype)
    w = torch.randn(B, T, HI, generator=g) * HI ** -0.5
    keys = torch.randn(n_slots, E, dI, generator=g).to(dtype)
    slots = torch.randperm(n_slots, generator=g)[:B]
    pos0 = torch.tensor(pos0, dtype=torch.int64)
    return [t.to(device) for t in (q, w, keys, slots, pos0)]


def n_selected(pos0: torch.Tensor, T: int, E: int, topk: int) -> torch.Tensor:
    """[B, T] expected number of selected entries: min(K, visible)."""
    vis = ((pos0[:, None] + torch.arange(T, device=pos0.device) + 1) // M).clamp(0, E)
    return vis.clamp(max=topk)


def assert_selection(out: torch.Tensor, args: list[torch.Tensor], topk: int) -> int:
    """out has the fused convention and the model op's set up to near-ties; returns the near-tie swaps."""
    q, w, keys, slots, pos0 = args
    B, T = q.shape[:2]
    ref = v4_indexer_topk(q, w, keys, slots, pos0, topk, M).cpu()
    score = V.v4_indexer_scores_ref(q, w, keys, slots, pos0, M).cpu()                  # [B, T, E]
    count = n_selected(pos0, T, keys.shape[1], topk).cpu()
    out = out.cpu()
    assert out.shape == (B, T, topk) and out.dtype == torch.int64
    swaps = 0
    for b in range(B):
        for t in range(T):
            n = int(count[b, t])
            row = out[b, t]
            assert torch.all(row[n:] == -1), f"row {b},{t}: -1 padding after {n} entries: {row.tolist()}"
            sel = row[:n]
            assert torch.all(sel[1:] > sel[:-1]) and torch.all(sel >= 0), f"row {b},{t} not ascending: {row.tolist()}"
            got, want = set(row[:n].tolist()), set(ref[b, t][ref[b, t] >= 0].tolist())
            assert len(want) == n
            if got != want:
                kth = float(score[b, t, list(want)].min())
                for e in got ^ want:
                    s = float(score[b, t, e])
                    assert abs(s - kth) <= NEAR_TIE * abs(kth), f"row {b},{t}: entry {e} score {s} vs K-th {kth}"
                swaps += len(got - want)
    return swaps


def lowest_index_topk(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """The fused convention from given scores [B, T, E] (-inf = invisible), ties to the lowest index."""
    B, T, E = scores.shape
    k = min(topk, E)
    top = scores.sort(dim=-1, descending=True, stable=True)
    idx = top.indices[..., :k].masked_fill(top.values[..., :k] == float("-inf"), -1)
    out = torch.full((B, T, topk), -1, dtype=torch.int64, device=scores.device)
    out[..., :k] = idx
    return V._ascending(out)


# (B, T, HI, dI, E, pos0): pos0 0 (nothing visible), partly and fully visible rows, E not a block multiple
SHAPES = [
    (1, 1, 4, 16, 7, [27]),
    (3, 3, 6, 32, 40, [0, 21, 200]),
    (3, 1, 5, 16, 130, [0, 300, 600]),
    (1, 3, 4, 32, 130, [517]),
]


@pytest.mark.parametrize("B, T, HI, dI, E, pos0", SHAPES)
def test_scores_match_fp64(B, T, HI, dI, E, pos0):
    args = make_inputs(B, T, HI, dI, E, pos0)
    s = V.v4_indexer_scores(*args, M)
    ref = V.v4_indexer_scores_ref(*args, M, dtype=torch.float64)
    assert torch.equal(torch.isinf(s), torch.isinf(ref))
    vis = ~torch.isinf(ref)
    assert rel_err(s[vis], ref[vis]) <= SCORE_REL_ERR


@pytest.mark.parametrize("B, T, HI, dI, E, pos0", SHAPES)
@pytest.mark.parametrize("topk", [2, 8, 64])
def test_selection_matches_model_op(B, T, HI, dI, E, pos0, topk):
    args = make_inputs(B, T, HI, dI, E, pos0, seed=topk)
    out = V.v4_indexer_topk_fused(*args, topk, M)
    assert_selection(out, args, topk)
    assert torch.equal(out, lowest_index_topk(V.v4_indexer_scores(*args, M), topk))  # launch 2 exactly
    assert torch.equal(torch.ops.dsv4c.v4_indexer_topk_fused(*args, topk, M),
                       V.v4_indexer_topk_fused_ref(*args, topk, M))


def test_nothing_visible_is_all_minus_one():
    args = make_inputs(2, 3, 4, 16, 40, [0, 0])   # positions 0..2: (p + 1) // 4 = 0
    out = V.v4_indexer_topk_fused(*args, 8, M)
    assert torch.equal(out, torch.full((2, 3, 8), -1))
    assert torch.equal(out, V.v4_indexer_topk_fused_ref(*args, 8, M))


def test_empty_cache_and_zero_topk():
    args = make_inputs(2, 1, 4, 16, 0, [9, 40])
    assert torch.equal(V.v4_indexer_topk_fused(*args, 5, M), torch.full((2, 1, 5), -1))
    args = make_inputs(2, 1, 4, 16, 12, [9, 40])
    assert V.v4_indexer_topk_fused(*args, 0, M).shape == (2, 1, 0)


@pytest.mark.parametrize("max_row", [None, 32])
@pytest.mark.parametrize("tie", ["zero", "equal"])
def test_ties_take_lowest_entries(monkeypatch, max_row, tie):
    """Many entries with one score (zero keys: exactly 0; equal keys: equal dots): the kernel takes the
    lowest indices among them, also across chunks when the row is re-read in MAX_ROW pieces."""
    if max_row:
        monkeypatch.setattr(V, "MAX_ROW", max_row)
    q, w, keys, slots, pos0 = make_inputs(2, 2, 4, 16, 130, [400, 300])
    keys[:, 50:] = 0 if tie == "zero" else keys[:, 50:51]   # entries 50.. tie; 0..49 are distinct
    args = [q, w.abs(), keys, slots, pos0]                  # positive weights: scores >= 0
    out = V.v4_indexer_topk_fused(*args, 64, M)
    assert_selection(out, args, 64)
    assert torch.equal(out, lowest_index_topk(V.v4_indexer_scores(*args, M), 64))
    assert (out >= 50).sum() >= 4 * 14                      # the ties were really needed


@pytest.mark.parametrize("topk", [8, 64])
def test_multi_chunk_rows(monkeypatch, topk):
    """Rows longer than MAX_ROW are re-read in chunks (non-multiple of the chunk)."""
    monkeypatch.setattr(V, "MAX_ROW", 32)
    args = make_inputs(3, 2, 4, 16, 130, [0, 90, 520], seed=7)
    assert_selection(V.v4_indexer_topk_fused(*args, topk, M), args, topk)


@pytest.mark.parametrize("topk", [4, 16])
@pytest.mark.parametrize("tie", [None, "equal"])
def test_sliced_selection_of_long_rows(monkeypatch, topk, tie):
    """Rows longer than MAX_ROW (32 here) go through `_select_sliced`: 300 entries and K = 4 take three stages
    (300 -> 10 slices x 4 -> 2 x 4 -> the output), K = 16 five. The result equals the one-program order
    exactly: the top K by (score desc, index asc), ascending, with rows of nothing, fewer than K and partly
    visible entries, and ties spread over many slices."""
    monkeypatch.setattr(V, "MAX_ROW", 32)
    stages = []
    real = V._select_slice_kernel

    class Count:  # counts the stage launches, runs the real kernel
        def __getitem__(self, grid):
            stages.append(grid)
            return real[grid]

    monkeypatch.setattr(V, "_select_slice_kernel", Count())
    q, w, keys, slots, pos0 = make_inputs(3, 2, 4, 16, 300, [0, 40, 1500], seed=11)  # n_vis 0 / 10-11 / 300
    if tie:
        keys[:, 100:] = 100 * keys[:, 100:101]            # entries 100.. tie, far above the rest
        w = w.abs()
    args = [q, w, keys, slots, pos0]
    out = V.v4_indexer_topk_fused(*args, topk, M)
    assert torch.equal(out, lowest_index_topk(V.v4_indexer_scores(*args, M), topk))
    assert_selection(out, args, topk)
    assert [g[1] for g in stages] == ([10, 2, 1] if topk == 4 else [10, 5, 3, 2, 1])
    if tie:
        assert (out[2] >= 100).all()                      # the long rows took the lowest of 200 tied entries


def test_negative_and_zero_scores():
    """Negative weights give negative scores, relu gives exact zeros: the fp32 -> ordered-bits map."""
    q, w, keys, slots, pos0 = make_inputs(2, 2, 4, 16, 60, [230, 239], seed=3)
    w[0] = -w[0].abs()
    q[1, 0] = -q[1, 0].abs()
    keys[slots[1]] = keys[slots[1]].abs()         # row (1, 0): every q·k <= 0, all scores 0
    args = [q, w, keys, slots, pos0]
    assert_selection(V.v4_indexer_topk_fused(*args, 16, M), args, 16)


def test_custom_op_registration():
    args = make_inputs(2, 2, 4, 16, 40, [30, 100])
    torch.library.opcheck(torch.ops.dsv4c.v4_indexer_topk_fused.default, (*args, 8, M))


def test_rejects_bad_input():
    q, w, keys, slots, pos0 = make_inputs(2, 1, 4, 16, 40, [30, 100])
    f = V.v4_indexer_topk_fused
    with pytest.raises(ValueError, match="q must be"):
        f(q[0], w, keys, slots, pos0, 8, M)
    with pytest.raises(ValueError, match="keys dtype"):
        f(q, w, keys.double(), slots, pos0, 8, M)
    with pytest.raises(ValueError, match=r"keys must be \[n_slots, E, dI=16\]"):
        f(q, w, keys[..., :8].contiguous(), slots, pos0, 8, M)
    with pytest.raises(ValueError, match="weights must be float32"):
        f(q, w.bfloat16(), keys, slots, pos0, 8, M)
    with pytest.raises(ValueError, match="weights must be"):
        f(q, w[:, :, :2], keys, slots, pos0, 8, M)
    with pytest.raises(ValueError, match="slots must be int64"):
        f(q, w, keys, slots.int(), pos0, 8, M)
    with pytest.raises(ValueError, match="pos0 must be int64"):
        f(q, w, keys, slots, pos0[:1], 8, M)
    with pytest.raises(ValueError, match="q must be contiguous"):
        f(q.transpose(2, 3).contiguous().transpose(2, 3), w, keys, slots, pos0, 8, M)
    with pytest.raises(ValueError, match="topk must be"):
        f(q, w, keys, slots, pos0, -1, M)
    with pytest.raises(ValueError, match="q must be"):
        torch.ops.dsv4c.v4_indexer_topk_fused(q.long(), w, keys, slots, pos0, 8, M)


# ------------------------------------------------------------------------------------------------
# GPU (bf16, DeepSeek-V4-Flash indexer: HI=64, dI=128, K=512)
# ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("B, T", [(1, 1), (8, 1), (64, 1), (8, 4)])
def test_gpu_flash_shapes(B, T):
    E = 2048                                       # 8192 tokens: real top-512 selections
    pos0 = [(8191 - T - 997 * i) % (8192 - T) for i in range(B)]   # long and short rows
    args = make_inputs(B, T, 64, 128, E, pos0, n_slots=max(B, 2), dtype=torch.bfloat16, device="cuda")
    s = V.v4_indexer_scores(*args, M)
    ref = V.v4_indexer_scores_ref(*args, M, dtype=torch.float64)
    vis = ~torch.isinf(ref)
    assert torch.equal(torch.isinf(s), ~vis)
    assert rel_err(s[vis], ref[vis]) <= SCORE_REL_ERR
    assert_selection(V.v4_indexer_topk_fused(*args, 512, M), args, 512)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 8])
def test_gpu_sliced_selection_at_65536_tokens(B):
    """E = 16384 (a 65536-token context): the staged selection (`_select_sliced`, 8 -> 2 -> 1 slices) gives
    exactly the top 512 by (score desc, index asc) of the kernel's own scores, and the model op's set."""
    E = 16384
    pos0 = [65535 - 7919 * i for i in range(B)]
    args = make_inputs(B, 1, 64, 128, E, pos0, n_slots=max(B, 2), dtype=torch.bfloat16, device="cuda")
    out = V.v4_indexer_topk_fused(*args, 512, M)
    assert torch.equal(out, lowest_index_topk(V.v4_indexer_scores(*args, M), 512))
    assert_selection(out, args, 512)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_equals_eager():
    B, T, E = 8, 2, 2048
    args = make_inputs(B, T, 64, 128, E, [100 * i + 7 for i in range(B)], n_slots=B, dtype=torch.bfloat16,
                       device="cuda")
    V.v4_indexer_topk_fused(*args, 512, M)         # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = V.v4_indexer_topk_fused(*args, 512, M)
    for pos in ([100 * i + 7 for i in range(B)], [8000 - 900 * i for i in range(B)]):
        args[4].copy_(torch.tensor(pos))
        args[0].normal_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, V.v4_indexer_topk_fused(*args, 512, M))


_SM90_SLICE_SCRIPT = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from dsv4c.kernels.v4_indexer import _select_slice_kernel as fn

    names = list(fn.arg_names)
    types = {"s_ptr": "*fp32", "id_ptr": "*i64", "pos0_ptr": "*i64", "cs_ptr": "*fp32", "cid_ptr": "*i64"}
    for first, last in ((True, False), (False, False), (False, True)):
        consts = dict(K=512, SLICE=2048 if not last else 1024, BLOCK_K=512, FIRST=first, LAST=last, DIGIT=4, PDL=True)
        sig = {nm: "constexpr" if nm in consts else types.get(nm, "i32") for nm in names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, nm in enumerate(names) if nm.endswith("_ptr")}
        src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
        print("kernel", int(first), int(last), int("griddepcontrol.wait" in k.asm["ptx"]))
''')


def test_sliced_selection_compiles_for_sm90(tmp_path):
    """`_select_slice_kernel` at the Flash indexer's K = 512 and MAX_ROW = 2048, each stage kind, compiled (not
    run) for sm_90 with the real compiler, with the PDL wait as sm_90 launches it."""
    rows = run_sm90_script(tmp_path, _SM90_SLICE_SCRIPT)
    assert rows == [["1", "0", "1"], ["0", "0", "1"], ["0", "1", "1"]], rows
