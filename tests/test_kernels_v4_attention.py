"""Fused V4 decode attention (dsv4c.kernels.v4_attention) vs the static op it replaces.

CPU: the Triton wrapper itself under the interpreter (TRITON_INTERPRET=1, tests/conftest.py), small
shapes, compared with `dsv4c::v4_attention_static` on a clone of the caches: the output by relative
norm (REL_ERR, per dtype) and the ring on every non-scratch slot exactly. GPU tests (-m gpu) run
V4-Flash shapes in bf16 and a CUDA-graph capture.

Legend: B batch, T chunk tokens, H heads, d head dim, S ring rows, W window, m compress ratio,
E entry capacity, k selected entries per token.
"""
from __future__ import annotations

import textwrap

import pytest
import torch
from dsv4c.kernels.tolerances import rel_err
from dsv4c.kernels.v4_attention import (
    REL_ERR,
    V4AttnConfig,
    v4_attention_fused,
    v4_attention_fused_op,
    v4_attention_fused_ref,
)

W = 8
SMALL = V4AttnConfig(block_h=16, block_n=16)  # H = 4..6: one partial head block; BN 16 < the key counts


def make_case(B, T, H, d, S, m, E, k, pos0, n_real, dtype=torch.float32, device="cpu", seed=0, n_minus=3,
              window=W):
    """Random inputs; slots are distinct non-scratch slots in shuffled order. CSA (m = 4): k distinct
    indices per token below the visible count (the indexer's rule), the last n_minus of them -1."""
    g = torch.Generator().manual_seed(seed)
    n_slots = B + 2

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    slots = torch.randperm(n_slots - 1, generator=g)[:B]
    pos0 = torch.tensor(pos0, dtype=torch.int64)
    a = {"q": rnd(B, T, H, d), "kv": rnd(B, T, d), "slots": slots.to(device), "pos0": pos0.to(device),
         "n_real": torch.tensor(n_real, dtype=torch.int64, device=device), "ring": rnd(n_slots, S, d),
         "sinks": torch.randn(H, generator=g).to(device), "entries": rnd(n_slots, E, d) if m else None,
         "selected": None, "window": window, "m": m}
    if m == 4:
        sel = torch.full((B, T, k), -1, dtype=torch.int64)
        for b in range(B):
            for t in range(T):
                vis = min(E, (int(pos0[b]) + t + 1) // m)
                n = max(0, min(k - n_minus, vis))
                sel[b, t, :n] = torch.randperm(vis, generator=g)[:n]
        a["selected"] = sel.to(device)
    return a


def run_both(a, config=None):
    """(fused output, fused ring, static output, static ring), each on its own clone of the ring."""
    r1, r2 = a["ring"].clone(), a["ring"].clone()
    got = v4_attention_fused(**{**a, "ring": r1}, config=config)
    want = v4_attention_fused_ref(**{**a, "ring": r2})
    return got, r1, want, r2


def assert_same(a, config=None):
    got, r1, want, r2 = run_both(a, config)
    assert got.dtype == torch.float32 and got.shape == a["q"].shape
    err = rel_err(got, want)
    assert err <= REL_ERR[a["q"].dtype], f"rel err {err:.3g}"
    assert torch.equal(r1[:-1], r2[:-1]), "ring differs on a non-scratch slot"
    return err


# B = 3 rows at different positions: pos0 = 0, pos0 < W, and a wrapped ring (pos0 > S); n_real < T pads
CASES = {
    1: {"B": 1, "T": 1, "pos0": [5], "n_real": [1]},
    3: {"B": 3, "T": 3, "pos0": [0, 5, 23], "n_real": [3, 1, 2]},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,E,k", [(0, 0, 0), (4, 13, 7), (8, 7, 0)])
@pytest.mark.parametrize("case", [1, 3])
def test_matches_static_op(case, m, E, k, dtype):
    c = CASES[case]
    a = make_case(c["B"], c["T"], 6 if case == 3 else 4, 32, 10, m, E, k, c["pos0"], c["n_real"], dtype,
                  seed=case + m)
    assert_same(a, SMALL)


@pytest.mark.parametrize("m,E,k,dtype", [(0, 0, 0, torch.bfloat16), (4, 13, 7, torch.float32),
                                         (8, 7, 0, torch.bfloat16)])  # each branch set once, both dtypes
def test_prefill_chunk_longer_than_the_ring(m, E, k, dtype):
    """A prefill chunk of T = 37 > S = 10 rows (window 8): the chunk's keys come from kv, a row at
    pos0 = 0 and one resuming past a wrapped ring, one padded (n_real < T) so its last real rows are not
    the chunk's; the ring keeps each row's newest S real positions, exactly as the static op."""
    a = make_case(2, 37, 4, 32, 10, m, E, k, [0, 23], [37, 30], dtype, seed=21 + m)
    assert_same(a, SMALL)
    assert_same(a, V4AttnConfig(block_n=16, split=3))  # the chunk blocks' start moves with t: any split


@pytest.mark.parametrize("split", [1, 2, 5])
def test_split_counts_and_many_entries(split):
    """Explicit SPLIT (1: the first kernel finishes o itself), entries spanning several blocks, S = W:
    the ring holds exactly the window, rows wrap at pos0 = 37."""
    a = make_case(2, 3, 5, 32, W, 4, 40, 21, [37, 2], [2, 3], torch.bfloat16, seed=7)
    assert_same(a, V4AttnConfig(block_n=16, split=split))
    a = make_case(2, 3, 5, 32, W, 8, 9, 0, [37, 70], [3, 0], torch.float32, seed=8)
    assert_same(a, V4AttnConfig(block_n=16, split=split))


def test_combine_head_block_changes_no_bit():
    """`combine_programs`: fewer heads per combine program at small B·T (down to 1), the same outputs and ring
    bit for bit (each head's merge is the same arithmetic in any block); batch-invariant configs keep block_h."""
    from dsv4c.kernels.v4_attention import _combine_heads

    assert _combine_heads(1, 64, V4AttnConfig(combine_programs=264)) == 1
    assert _combine_heads(8, 64, V4AttnConfig(combine_programs=264)) == 1
    assert _combine_heads(4, 64, V4AttnConfig(combine_programs=64)) == 4
    assert _combine_heads(256, 64, V4AttnConfig(combine_programs=264)) == 16
    assert _combine_heads(1, 64, V4AttnConfig()) == 1  # the default: 264
    assert _combine_heads(1, 64, V4AttnConfig(combine_programs=0)) == 16
    assert _combine_heads(1, 64, V4AttnConfig(combine_programs=264, batch_invariant=True)) == 16
    with pytest.raises(ValueError, match="combine_programs"):
        V4AttnConfig(combine_programs=-1)
    for dtype, m, E, k in ((torch.bfloat16, 4, 40, 21), (torch.float32, 8, 9, 0)):
        a = make_case(2, 3, 6, 32, W, m, E, k, [37, 2], [2, 3], dtype, seed=11)
        base = V4AttnConfig(block_n=16, split=4, combine_programs=0)
        o0, r0, want, _ = run_both(a, base)
        o1, r1, _, _ = run_both(a, V4AttnConfig(block_n=16, split=4, combine_programs=64))  # 6 heads: CH 1
        assert torch.equal(o0, o1) and torch.equal(r0, r1)
        assert rel_err(o1, want) <= REL_ERR[dtype]


_SM90_COMBINE = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from dsv4c.kernels.v4_attention import _combine_kernel as fn

    names = list(fn.arg_names)
    types = {"kv_ptr": "*bf16", "ring_ptr": "*bf16", "slots_ptr": "*i64", "pos0_ptr": "*i64", "nreal_ptr": "*i64",
             "sinks_ptr": "*fp32", "o_ptr": "*fp32", "pacc_ptr": "*fp32", "pm_ptr": "*fp32", "pl_ptr": "*fp32"}
    for ch, warps in ((16, 8), (1, 4)):
        consts = dict(D=512, BLOCK_D=512, BLOCK_H=ch, SPLIT=21, PDL=True)
        sig = {nm: "constexpr" if nm in consts else types.get(nm, "i32") for nm in names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, nm in enumerate(names) if nm.endswith("_ptr")}
        src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                        attrs=attrs)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ptx"]
        print("kernel", ch, int("griddepcontrol.wait" in ptx), int("ex2.approx" in ptx))
''')


def test_combine_compiles_for_sm90_with_one_head_per_program(tmp_path):
    """The combine at the split kernel's 16 heads and at one head per program (`combine_programs` at batch 1)
    compiles for sm_90 (not run): the PDL wait, the exp2 of the merge."""
    from sm90_compile import run_sm90_script

    assert run_sm90_script(tmp_path, _SM90_COMBINE) == [["16", "1", "1"], ["1", "1", "1"]]


def test_default_config_and_sequence_of_calls():
    """Default tiles; three decode steps in a row, each reading what the previous one wrote, on the
    same two caches; non-power-of-two d."""
    a = make_case(2, 1, 4, 48, 9, 8, 6, 0, [6, 15], [1, 1], seed=9)
    r1, r2 = a["ring"].clone(), a["ring"].clone()
    for step in range(3):
        pos0 = a["pos0"] + step
        kv = torch.randn_like(a["kv"])
        got = v4_attention_fused(**{**a, "kv": kv, "pos0": pos0, "ring": r1})
        want = v4_attention_fused_ref(**{**a, "kv": kv, "pos0": pos0, "ring": r2})
        assert rel_err(got, want) <= REL_ERR[torch.float32]
        assert torch.equal(r1[:-1], r2[:-1])


def test_padding_rows_write_nothing_and_every_key_counts():
    """n_real = 0 rows leave the ring alone; changing one key the query sees (a window row, an entry)
    changes the output, one it does not see (an unselected entry) does not."""
    a = make_case(2, 2, 4, 32, 10, 4, 12, 6, [20, 9], [0, 2], seed=11, n_minus=1)
    got, r1, _want, _ = run_both(a, SMALL)
    slot0 = int(a["slots"][0])
    assert torch.equal(r1[slot0], a["ring"][slot0])
    base = got[0, 0]
    for what, mutate, moves in [
            ("window row", lambda x: x["ring"][slot0, 19 % 10].add_(1.0), True),
            ("selected entry", lambda x: x["entries"][slot0, int(x["selected"][0, 0, 0])].add_(1.0), True),
            ("unselected entry", lambda x: x["entries"][slot0, unselected(x)].add_(1.0), False)]:
        b = {key: (v.clone() if isinstance(v, torch.Tensor) else v) for key, v in a.items()}
        mutate(b)
        out = v4_attention_fused(**b, config=SMALL)[0, 0]
        assert (not torch.equal(out, base)) == moves, what


def unselected(a) -> int:
    chosen = set(a["selected"][0, 0].tolist())
    return next(i for i in range(a["entries"].shape[1]) if i not in chosen)


def test_custom_op_on_cpu_is_the_static_op():
    a = make_case(2, 2, 4, 32, 10, 8, 5, 0, [12, 3], [2, 1], seed=12)
    r1, r2 = a["ring"].clone(), a["ring"].clone()
    got = torch.ops.dsv4c.v4_attention_fused(**{**a, "ring": r1})
    want = v4_attention_fused_ref(**{**a, "ring": r2})
    assert torch.equal(got, want) and torch.equal(r1, r2)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fake = {key: (mode.from_tensor(v) if isinstance(v, torch.Tensor) else v) for key, v in a.items()}
        out = v4_attention_fused_op(**fake)
    assert out.shape == a["q"].shape and out.dtype == torch.float32


@pytest.mark.parametrize("field,value,msg", [
    ("q", lambda a: a["q"][..., :-1], "kv must be"),
    ("kv", lambda a: a["kv"].bfloat16(), "kv dtype"),
    ("ring", lambda a: a["ring"].transpose(0, 1).contiguous().transpose(0, 1), "ring must be contiguous"),
    ("pos0", lambda a: a["pos0"].int(), "pos0 must be"),
    ("sinks", lambda a: a["sinks"][:-1], "sinks must be"),
    ("selected", lambda a: a["selected"].int(), "selected must be"),
    ("entries", lambda a: a["entries"][:-1], "entries must be"),
    ("window", lambda a: 0, "window must be"),
    ("ring", lambda a: a["ring"][:, :0], "ring must have at least one row"),
])
def test_bad_inputs(field, value, msg):
    a = make_case(2, 2, 4, 32, 10, 4, 12, 6, [20, 9], [2, 2], seed=13)
    a[field] = value(a)
    with pytest.raises(ValueError, match=msg):
        v4_attention_fused(**a)


def test_bad_input_hca_needs_ratio():
    a = make_case(1, 1, 4, 32, 10, 8, 5, 0, [3], [1], seed=14)
    with pytest.raises(ValueError, match="m must be >= 1"):
        v4_attention_fused(**{**a, "m": 0})


# ------------------------------------------------------------------------------------------------
# GPU: V4-Flash shapes (H 64, d 512, W 128, S 128 + 3, k 512), bf16
# ------------------------------------------------------------------------------------------------
FLASH = {"H": 64, "d": 512, "S": 131}


@pytest.mark.gpu
@pytest.mark.parametrize("B,T", [(1, 1), (8, 1), (64, 1), (8, 4), (2, 300)])
@pytest.mark.parametrize("m,E,k", [(0, 0, 0), (4, 1024, 512), (128, 32, 0)])
def test_flash_shapes_on_cuda(B, T, m, E, k):
    """Rows at random positions (row 0 at 0, so no window and no entries), the last row padded; T = 300 is
    a prefill chunk longer than the ring (S = 131)."""
    g = torch.Generator().manual_seed(B * 10 + T)
    pos0 = torch.randint(0, m * E + 200 if m else 3000, (B,), generator=g).tolist()
    pos0[0] = 0
    n_real = [T] * B
    n_real[-1] = max(0, T - 2)
    a = make_case(B, T, FLASH["H"], FLASH["d"], FLASH["S"], m, E, k, pos0, n_real, torch.bfloat16, "cuda",
                  seed=B + T + m, n_minus=5, window=128)
    err = assert_same(a)
    print(f"B={B} T={T} m={m}: rel err {err:.3g}")


@pytest.mark.gpu
@pytest.mark.parametrize("B,m,E,k", [(1, 4, 1024, 512), (8, 128, 32, 0), (1, 0, 0, 0)])
def test_combine_head_block_same_bits_on_cuda(B, m, E, k):
    """Flash shapes: the combine with one head per program (`combine_programs` 264, the default, at batch 1 and 8)
    gives the outputs and ring of the split kernel's 16-head block (0) bit for bit."""
    a = make_case(B, 1, FLASH["H"], FLASH["d"], FLASH["S"], m, E, k, [700 + 13 * i for i in range(B)], [1] * B,
                  torch.bfloat16, "cuda", seed=B + m, n_minus=5, window=128)
    o0, r0, want, _ = run_both(a, V4AttnConfig(combine_programs=0))
    o1, r1, _, _ = run_both(a)
    assert torch.equal(o0, o1) and torch.equal(r0, r1)
    assert rel_err(o1, want) <= REL_ERR[torch.bfloat16]


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    """Capture once, change q, kv and positions in place, replay: equals an eager call on the new inputs."""
    a = make_case(8, 2, 64, 512, 131, 4, 512, 512, list(range(300, 2700, 300)), [2] * 8, torch.bfloat16,
                  "cuda", seed=21, window=128)
    ring_g, ring_e = a["ring"].clone(), a["ring"].clone()
    args = {**a, "ring": ring_g}
    torch.ops.dsv4c.v4_attention_fused(**{**args, "ring": ring_g.clone()})  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.dsv4c.v4_attention_fused(**args)
    a["q"].copy_(torch.randn_like(a["q"]))
    a["kv"].copy_(torch.randn_like(a["kv"]))
    a["pos0"].add_(7)
    graph.replay()
    torch.cuda.synchronize()
    want = torch.ops.dsv4c.v4_attention_fused(**{**a, "ring": ring_e})
    assert torch.equal(out, want)
    assert torch.equal(ring_g[:-1], ring_e[:-1])


def test_batch_invariant_split_gives_bit_identical_rows():
    """Batch 1 vs batch 8 (row 0 the same inputs): the default split comes from B·T, so row 0's keys
    are reduced in other groups and its output differs in the last bits; the batch-invariant split
    (`BATCH_INVARIANT`, the `fused_det` implementation) gives bit-identical rows."""
    from dsv4c.kernels.v4_attention import BATCH_INVARIANT, _grid_split

    big = make_case(8, 1, 4, 32, 40, 8, 9, 0, [37, 5, 30, 12, 39, 2, 25, 33], [1] * 8, seed=21, window=40)
    one = {**big, "q": big["q"][:1], "kv": big["kv"][:1], "slots": big["slots"][:1], "pos0": big["pos0"][:1],
           "n_real": big["n_real"][:1]}
    assert BATCH_INVARIANT.batch_invariant
    cfg = V4AttnConfig(block_n=16, target_programs=16)  # the GPU's regime at these small sizes
    inv = V4AttnConfig(block_n=16, target_programs=16, batch_invariant=True, invariant_split=3)
    n_blocks = 3 + 1 + 1  # window 39 keys in blocks of 16, the chunk, the entries
    assert _grid_split(1, 1, 4, n_blocks, cfg) != _grid_split(8, 1, 4, n_blocks, cfg)
    assert _grid_split(1, 1, 4, n_blocks, inv) == _grid_split(8, 1, 4, n_blocks, inv)
    outs = {}
    for name, c in (("default", cfg), ("invariant", inv)):
        o8 = v4_attention_fused(**{**big, "ring": big["ring"].clone()}, config=c)
        o1 = v4_attention_fused(**{**one, "ring": big["ring"].clone()}, config=c)
        outs[name] = torch.equal(o1[0], o8[0])
        assert rel_err(o1[0], o8[0]) <= REL_ERR[torch.float32]
    assert outs == {"default": False, "invariant": True}
    from dsv4c.passes.select_kernels import implementation_op  # compile --kernel v4_attention=fused_det

    assert implementation_op("v4_attention", "fused_det") is torch.ops.dsv4c.v4_attention_fused_det.default
