"""Greedy argmax over the vocabulary (kernels/argmax.py): Triton under the interpreter vs torch.argmax."""
from __future__ import annotations

import pytest
import torch

from dsv4c.kernels import argmax as A


def _rows(b: int, v: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, v, generator=g) * 4).to(dtype)


@pytest.mark.parametrize("b,v,dtype", [
    (1, 5000, torch.float32),          # three chunks, the last partial
    (3, A.BLOCK, torch.bfloat16),      # exactly one chunk
    (2, 2 * A.BLOCK + 1, torch.float16),
    (4, 17, torch.float32),            # one short chunk
])
def test_matches_torch_argmax(b, v, dtype):
    x = _rows(b, v, dtype, b * 1000 + v)
    got = A.argmax_rows(x)
    assert got.dtype == torch.int64 and got.shape == (b,)
    assert torch.equal(got, A.argmax_rows_ref(x))


def test_ties_take_the_first_index_across_chunks():
    x = _rows(3, 3 * A.BLOCK, torch.float32, 7)
    x[0, [A.BLOCK + 5, 2 * A.BLOCK + 1]] = 100.0     # the maximum in chunks 1 and 2
    x[1, [9, 4, A.BLOCK + 3]] = 50.0                   # twice in chunk 0 (out of order), once in chunk 1
    x[2, :] = 1.5                                      # all equal
    assert A.argmax_rows(x).tolist() == [A.BLOCK + 5, 4, 0] == x.argmax(-1).tolist()


def test_nan_beats_every_number_and_signed_zeros_tie():
    x = torch.full((4, A.BLOCK + 10), float("-inf"))
    x[0, A.BLOCK + 2] = float("nan")                   # a NaN after a +inf: the NaN
    x[0, 3] = float("inf")
    x[1, [A.BLOCK + 1, 7]] = float("nan")              # two NaNs: the first
    x[2, 5], x[2, 2] = 0.0, -0.0                       # +0 and -0 are equal: the first, -0
    # row 3: all -inf, index 0
    got = A.argmax_rows(x)
    assert got.tolist() == [A.BLOCK + 2, 7, 2, 0] == x.argmax(-1).tolist()


def test_rows_are_independent():
    x = _rows(5, 3000, torch.float32, 3)
    whole = A.argmax_rows(x)
    assert all(int(A.argmax_rows(x[i:i + 1])[0]) == int(whole[i]) for i in range(5))
    assert len(set(whole.tolist())) > 1   # random rows do not all pick one column


def test_strided_rows_and_empty_batch():
    x = _rows(3, 2 * A.BLOCK + 300, torch.float32, 11)[:, :A.BLOCK + 100]   # row stride != V
    assert torch.equal(A.argmax_rows(x), x.argmax(-1))
    assert A.argmax_rows(torch.empty(0, 10)).shape == (0,)


@pytest.mark.parametrize("x,err", [
    (torch.zeros(4), "fp32/bf16/fp16 \\[B, V\\]"),
    (torch.zeros(2, 8, dtype=torch.int32), "fp32/bf16/fp16"),
    (torch.zeros(8, 2).T, "unit stride"),
    (torch.zeros(2, 0), "V = 0"),
])
def test_bad_inputs_name_the_problem(x, err):
    with pytest.raises(ValueError, match=err):
        A.argmax_rows(x)


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 8, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_at_the_flash_vocabulary_and_in_a_graph(b, dtype):
    x = _rows(b, 129280, dtype, b).cuda()
    x[0, [70000, 90000]] = 1e4                          # a tie across chunks: the first
    assert torch.equal(A.argmax_rows(x), x.argmax(-1))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):                           # PDL launches inside a captured graph
        out = A.argmax_rows(x)
    x.copy_(_rows(b, 129280, dtype, b + 1).cuda())
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x.argmax(-1))


@pytest.mark.gpu
@pytest.mark.parametrize("v", [4096, A.SPLIT_MIN_COLUMNS, 129280])
def test_the_sessions_greedy_pick_on_cuda(v):
    from dsv4c.runtime.sampling import greedy_rows

    x = _rows(8, v, torch.float32, v).cuda()
    assert torch.equal(greedy_rows(x), x.argmax(-1))
    assert torch.equal(greedy_rows(x.bfloat16()), x.bfloat16().argmax(-1))
