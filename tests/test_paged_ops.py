"""Paged cache ops and graphs (issue 27 item 1): the growing caches in blocks of a pool, addressed through
a block table, against the slot caches holding the same rows.

* the capture-safe paged ops equal the static slot ops (compressor writes, attention, V3 cache writes);
* the Triton kernels' block-table paths (kernels/v4_attention.py, kernels/v4_indexer.py, under
  TRITON_INTERPRET=1 from tests/conftest.py) equal their slot paths and their *_ref;
* exported graphs of tiny V4 and V3.2 models with paged caches (prefill with the reference ops, decode
  lowered by select_kernels to the CUDA targets' implementations, which run their CPU forms here) give
  the slot graphs' logits and leave the pool holding the slot caches' rows.

Legend: B batch, T chunk tokens, n_slots cache slots (last scratch), N pool blocks (+1 scratch),
RB rows per block, NB blocks per sequence, E = NB·RB rows per sequence, d width.
"""
from __future__ import annotations

import pytest
import torch

from dsv4c import ModelConfig
from dsv4c.export import GraphSpec, export_graph, flat_caches
from dsv4c.model import build_model, randomize_, register_ops
from dsv4c.model.common import PagedLayout
from dsv4c.passes import PassContext
from dsv4c.passes.select_kernels import select_kernels

register_ops()
ops = torch.ops.dsv4c


def paged_copy(slot_cache: torch.Tensor, N: int, RB: int, seed: int = 0):
    """A pool [N+1, RB, d] and a block table [n_slots, NB] holding the rows of `slot_cache [n_slots, E, d]`
    in shuffled blocks (every slot's blocks, the scratch slot's too: its table row points at scratch)."""
    n_slots, E, d = slot_cache.shape
    NB = E // RB
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(N, generator=g)[: (n_slots - 1) * NB]
    table = torch.full((n_slots, NB), N, dtype=torch.int64)
    table[:-1] = perm.view(n_slots - 1, NB)
    pool = torch.randn(N + 1, RB, d, generator=g).to(slot_cache.dtype)  # unused blocks hold garbage
    pool[table[:-1]] = slot_cache[:-1].view(n_slots - 1, NB, RB, d)
    return pool, table


def slot_view(pool: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The pool's rows per real slot: [n_slots - 1, E, d]."""
    return pool[table[:-1]].flatten(1, 2)


def test_paged_static_compress_and_attention_equal_the_slot_ops():
    g = torch.Generator().manual_seed(1)
    B, T, d, m, n_slots, E, RB = 3, 3, 8, 4, 5, 16, 4
    slots, pos0, n_real = torch.tensor([2, 0, 3]), torch.tensor([0, 7, 22]), torch.tensor([3, 2, 3])
    kv, score = torch.randn(B, T, 2 * d, generator=g), torch.randn(B, T, 2 * d, generator=g)
    ape, nw, invf = torch.randn(m, 2 * d, generator=g), torch.randn(d, generator=g), torch.rand(d // 4, generator=g)
    st = torch.randn(n_slots, 2 * m + 1, 2 * d, generator=g)
    entries = torch.randn(n_slots, E, d, generator=g)
    pool, table = paged_copy(entries, 20, RB)
    st1, sc1, st2, sc2 = st.clone(), st.clone(), st.clone(), st.clone()
    ops.v4_compress_static(kv, score, slots, pos0, n_real, ape, nw, invf, st1, sc1, entries, m, 1e-6)
    ops.v4_compress_paged_static(kv, score, slots, pos0, n_real, ape, nw, invf, st2, sc2, pool, table, m, 1e-6)
    assert torch.equal(slot_view(pool, table), entries[:-1]) and torch.equal(st1[:-1], st2[:-1])
    ref_pool = pool.clone()
    ops.v4_compress_paged(kv, score, slots, pos0, n_real, ape, nw, invf, st.clone(), st.clone(), ref_pool, table, m,
                          1e-6)  # the reference paged op (loops, writes only closing groups)
    assert torch.equal(slot_view(ref_pool, table), entries[:-1])

    q, kvq = torch.randn(B, T, 4, d, generator=g), torch.randn(B, T, d, generator=g)
    ring, sinks = torch.randn(n_slots, 8, d, generator=g), torch.randn(4, generator=g)
    sel = torch.randint(-1, 4, (B, T, 5), generator=g)
    for selected in (None, sel):
        r1, r2, r3 = ring.clone(), ring.clone(), ring.clone()
        want = ops.v4_attention_static(q, kvq, slots, pos0, n_real, r1, sinks, entries, selected, 8, m)
        got = ops.v4_attention_paged_static(q, kvq, slots, pos0, n_real, r2, sinks, pool, table, selected, 8, m)
        ref = ops.v4_attention_paged(q, kvq, slots, pos0, n_real, r3, sinks, pool, table, selected, 8, m)
        assert torch.equal(want, got) and torch.equal(r1[:-1], r2[:-1])
        assert (ref - want).abs().max() <= 1e-6 * want.abs().max() and torch.equal(r1[:-1], r3[:-1])


def test_paged_v3_cache_writes_equal_the_slot_writes():
    g = torch.Generator().manual_seed(2)
    B, T, n_slots, L, RB = 3, 4, 4, 16, 4
    rows, kpe_rows = torch.randn(B, T, 6, generator=g), torch.randn(B, T, 2, generator=g)
    slots, pos0, n_real = torch.tensor([1, 2, 0]), torch.tensor([0, 5, 12]), torch.tensor([4, 2, 3])
    lat, kpe = torch.randn(n_slots, L, 6, generator=g), torch.randn(n_slots, L, 2, generator=g)
    (plat, table), (pkpe, _) = paged_copy(lat, 14, RB), paged_copy(kpe, 14, RB)
    for op, args in ((ops.mla_cache_update_paged, ()), (ops.mla_cache_update_paged_static, ())):
        pl, pk = plat.clone(), pkpe.clone()
        op(rows, kpe_rows, slots, pos0, n_real, pl, pk, table, *args)
        l2, k2 = lat.clone(), kpe.clone()
        ops.mla_cache_update_static(rows, kpe_rows, slots, pos0, n_real, l2, k2)
        assert torch.equal(slot_view(pl, table), l2[:-1]) and torch.equal(slot_view(pk, table), k2[:-1])


@pytest.mark.parametrize("dtype,m,k", [(torch.float32, 4, 7), (torch.bfloat16, 8, 0)])
def test_triton_attention_block_table_path_equals_its_slot_path(dtype, m, k):
    from dsv4c.kernels.v4_attention import (V4AttnConfig, v4_attention_fused, v4_attention_paged_fused_op,
                                            v4_attention_paged_fused_ref)

    g = torch.Generator().manual_seed(3)
    B, T, H, d, S, n_slots, E, RB = 3, 3, 4, 16, 8, 5, 16, 4
    slots, pos0, n_real = torch.tensor([3, 0, 1]), torch.tensor([0, 5, 23]), torch.tensor([3, 1, 2])
    q, kv = torch.randn(B, T, H, d, generator=g).to(dtype), torch.randn(B, T, d, generator=g).to(dtype)
    ring, sinks = torch.randn(n_slots, S, d, generator=g).to(dtype), torch.randn(H, generator=g)
    entries = torch.randn(n_slots, E, d, generator=g).to(dtype)
    pool, table = paged_copy(entries, 24, RB)
    sel = None
    if m == 4:  # distinct visible entries per token, -1 after (the indexer's rule)
        sel = torch.full((B, T, k), -1, dtype=torch.int64)
        for b in range(B):
            for t in range(T):
                vis = min(E, (int(pos0[b]) + t + 1) // m)
                n = min(k - 2, vis)
                sel[b, t, :n] = torch.randperm(vis, generator=g)[:n]
    cfg = V4AttnConfig(block_h=16, block_n=16)
    r1, r2, r3 = ring.clone(), ring.clone(), ring.clone()
    want = v4_attention_fused(q, kv, slots, pos0, n_real, r1, sinks, entries, sel, 8, m, config=cfg)
    got = v4_attention_fused(q, kv, slots, pos0, n_real, r2, sinks, pool, sel, 8, m, config=cfg, block_table=table)
    assert torch.equal(want, got) and torch.equal(r1[:-1], r2[:-1])  # same keys, same order: bit for bit
    ref = v4_attention_paged_fused_ref(q, kv, slots, pos0, n_real, r3, sinks, pool, table, sel, 8, m)
    assert (got - ref).norm() <= (2e-6 if dtype == torch.float32 else 1e-5) * ref.norm()
    assert torch.equal(v4_attention_paged_fused_op(q, kv, slots, pos0, n_real, ring.clone(), sinks, pool, table, sel,
                                                   8, m), ref)  # the CPU op is the reference


@pytest.mark.parametrize("m", [4, 8])
def test_triton_compressor_block_table_path_equals_its_slot_path(m):
    from dsv4c.kernels.v4_compress import v4_compress_fused, v4_compress_paged_fused_ref

    g = torch.Generator().manual_seed(7)
    B, T, w, n_slots, E, RB = 3, 5, 16, 5, 16, 4
    c = 2 if m == 4 else 1
    slots, pos0, n_real = torch.tensor([3, 0, 1]), torch.tensor([0, 6, 21]), torch.tensor([5, 3, 4])
    kv, score = torch.randn(B, T, c * w, generator=g), torch.randn(B, T, c * w, generator=g)
    ape, nw, invf = torch.randn(m, c * w, generator=g), torch.randn(w, generator=g), torch.rand(w // 4, generator=g)
    st = torch.randn(n_slots, c * m + 1, c * w, generator=g)
    entries = torch.randn(n_slots, E, w, generator=g)
    pool, table = paged_copy(entries, 20, RB)
    ref_pool, st3, sc3 = pool.clone(), st.clone(), st.clone()
    st1, sc1, st2, sc2 = st.clone(), st.clone(), st.clone(), st.clone()
    v4_compress_fused(kv, score, slots, pos0, n_real, ape, nw, invf, st1, sc1, entries, m, 1e-6)
    v4_compress_fused(kv, score, slots, pos0, n_real, ape, nw, invf, st2, sc2, pool, m, 1e-6, block_table=table)
    assert torch.equal(slot_view(pool, table), entries[:-1]) and torch.equal(st1, st2) and torch.equal(sc1, sc2)
    v4_compress_paged_fused_ref(kv, score, slots, pos0, n_real, ape, nw, invf, st3, sc3, ref_pool, table, m, 1e-6)
    assert (slot_view(ref_pool, table) - entries[:-1]).abs().max() <= 1e-5 * entries.abs().max()


def test_triton_indexer_block_table_path_equals_its_slot_path():
    from dsv4c.kernels.v4_indexer import (v4_indexer_topk_fused, v4_indexer_topk_paged_fused_op,
                                          v4_indexer_topk_paged_fused_ref)

    g = torch.Generator().manual_seed(4)
    B, T, HI, dI, n_slots, E, RB = 3, 2, 4, 16, 5, 24, 8
    q, w = torch.randn(B, T, HI, dI, generator=g), torch.randn(B, T, HI, generator=g)
    keys = torch.randn(n_slots, E, dI, generator=g)
    slots, pos0 = torch.tensor([2, 0, 3]), torch.tensor([3, 40, 95])
    pool, table = paged_copy(keys, 16, RB)
    for topk in (4, 32):
        want = v4_indexer_topk_fused(q, w, keys, slots, pos0, topk, 4)
        got = v4_indexer_topk_fused(q, w, pool, slots, pos0, topk, 4, block_table=table)
        assert torch.equal(want, got)
        ref = v4_indexer_topk_paged_fused_ref(q, w, pool, table, slots, pos0, topk, 4)
        assert torch.equal(got, ref) and torch.equal(v4_indexer_topk_paged_fused_op(q, w, pool, table, slots, pos0,
                                                                                     topk, 4), ref)



@pytest.mark.parametrize("m,RB", [(2, 16), (4, 6)])
def test_triton_attention_table_lookups_per_tile_and_odd_block_rows(m, RB):
    """The kernel's two table lookups: HCA entries in tiles inside one block (RB a multiple of the key tile:
    one table entry per tile; 45 visible entries over three blocks), and per-key lookups with RB not a power
    of two (CSA selection, RB = 6: the constexpr division is a multiply). Bit for bit the slot path."""
    from dsv4c.kernels.v4_attention import V4AttnConfig, v4_attention_fused

    g = torch.Generator().manual_seed(8)
    B, H, d, S, n_slots, E = 3, 4, 16, 8, 5, 48
    slots, pos0, n_real = torch.tensor([3, 0, 1]), torch.tensor([90, 37, 5]), torch.tensor([1, 1, 1])
    q, kv = torch.randn(B, 1, H, d, generator=g), torch.randn(B, 1, d, generator=g)
    ring, sinks = torch.randn(n_slots, S, d, generator=g), torch.randn(H, generator=g)
    entries = torch.randn(n_slots, E, d, generator=g)
    pool, table = paged_copy(entries, 40, RB)
    sel = None
    if m == 4:
        sel = torch.full((B, 1, 12), -1, dtype=torch.int64)
        for b in range(B):
            vis = min(E, (int(pos0[b]) + 1) // m)
            sel[b, 0, : min(10, vis)] = torch.randperm(vis, generator=g)[:10]
    cfg = V4AttnConfig(block_h=16, block_n=16)
    r1, r2 = ring.clone(), ring.clone()
    want = v4_attention_fused(q, kv, slots, pos0, n_real, r1, sinks, entries, sel, 8, m, config=cfg)
    got = v4_attention_fused(q, kv, slots, pos0, n_real, r2, sinks, pool, sel, 8, m, config=cfg, block_table=table)
    assert torch.equal(want, got) and torch.equal(r1[:-1], r2[:-1])


@pytest.mark.parametrize("RB", [64, 12])
def test_triton_indexer_table_lookups_per_tile_and_odd_block_rows(RB):
    """The scores kernel's table lookups: tiles of 64 entries inside one block (RB = 64: one table entry per
    tile) and RB = 12 (not a power of two, tiles across blocks). Bit for bit the slot path."""
    from dsv4c.kernels.v4_indexer import v4_indexer_topk_fused

    g = torch.Generator().manual_seed(9)
    B, HI, dI, n_slots, E = 3, 4, 16, 4, 192
    q, w = torch.randn(B, 1, HI, dI, generator=g), torch.randn(B, 1, HI, generator=g)
    keys = torch.randn(n_slots, E, dI, generator=g)
    slots, pos0 = torch.tensor([2, 0, 1]), torch.tensor([700, 300, 40])
    pool, table = paged_copy(keys, 3 * E // RB + 2, RB)
    for topk in (8, 100):
        want = v4_indexer_topk_fused(q, w, keys, slots, pos0, topk, 4)
        assert torch.equal(want, v4_indexer_topk_fused(q, w, pool, slots, pos0, topk, 4, block_table=table))


def test_triton_indexer_sliced_selection_through_the_block_table(monkeypatch):
    """Rows longer than MAX_ROW (32 here, E = 192 entries in blocks of 12) take the staged selection on the
    paged layout too: bit for bit the slot path, and the paged reference's set."""
    from dsv4c.kernels import v4_indexer as V

    monkeypatch.setattr(V, "MAX_ROW", 32)
    g = torch.Generator().manual_seed(10)
    B, HI, dI, n_slots, E, RB = 3, 4, 16, 4, 192, 12
    q, w = torch.randn(B, 1, HI, dI, generator=g), torch.randn(B, 1, HI, generator=g)
    keys = torch.randn(n_slots, E, dI, generator=g)
    slots, pos0 = torch.tensor([2, 0, 1]), torch.tensor([700, 300, 40])
    pool, table = paged_copy(keys, 3 * E // RB + 2, RB)
    want = V.v4_indexer_topk_fused(q, w, keys, slots, pos0, 8, 4)
    got = V.v4_indexer_topk_fused(q, w, pool, slots, pos0, 8, 4, block_table=table)
    assert torch.equal(want, got)
    assert torch.equal(got, V.v4_indexer_topk_paged_fused_ref(q, w, pool, table, slots, pos0, 8, 4))


def test_bench_paged_kernels_quick_run(tmp_path):
    """examples/bench_paged_kernels.py on the interpreter: every kernel and its paged twin, both block
    layouts, give bit-identical results (no timing on the CPU)."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import bench_paged_kernels as bench

    out = tmp_path / "q.json"
    assert bench.main(["--device", "cpu", "--quick", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [(r["kernel"], r["layout"]) for r in res["rows"]] == [(k, lay) for lay in bench.LAYOUTS
                                                                 for k in bench.KERNELS]
    assert all(r["same"] for r in res["rows"]) and "| attention csa | shared |" in res["table"]


_SM90_ATTENTION = """
import os, re, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dsv4c.kernels.v4_attention import V4AttnConfig, _attn_split_kernel as fn

names = list(fn.arg_names)
ptrs = dict(q_ptr="*bf16", kv_ptr="*bf16", ring_ptr="*bf16", ent_ptr="*bf16", sel_ptr="*i64", slots_ptr="*i64",
            pos0_ptr="*i64", sinks_ptr="*fp32", o_ptr="*fp32", pacc_ptr="*fp32", pm_ptr="*fp32", pl_ptr="*fp32",
            bt_ptr="*i64")
cfg = V4AttnConfig()
# the slice's CSA decode call (B 64, T 1, H 64, d 512, window 128, 512 selected, blocks of 128 positions), with
# the launcher's specialisation: ints equal to 1 are constants, multiples of 16 (and pointers) 16-divisible
ints = dict(sq_b=32768, sq_t=32768, sq_h=512, skv_b=512, skv_t=512, T=1, H=64, S=128, NSEL=512, W=128, NW=127,
            M_RATIO=4)
for paged in (False, True):
    consts = dict(D=512, BLOCK_D=512, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, SPLIT=2, ENT_MODE=1, LOWP=True,
                  INTERPRET=False, POS_BLOCKS=False, PAGED=paged, RB=32 if paged else 1, PDL=True)  # as sm_90 launches
    vals = {**ints, "E": 1088 if paged else 1066, "NB": 34 if paged else 1}
    consts.update({n: 1 for n, v in vals.items() if v == 1})
    if not paged:
        consts["bt_ptr"] = None
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "fp32" if n == "qk_scale" else "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n] != "constexpr" and (n in ptrs or vals.get(n, 1) % 16 == 0)}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    opts = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if paged and cfg.paged_max_registers is not None:
        opts["maxnreg"] = cfg.paged_max_registers
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    path = os.path.join(sys.argv[1], f"k{int(paged)}.cubin")
    open(path, "wb").write(k.asm["cubin"])
    exe = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    use = subprocess.run([exe, "--dump-resource-usage", path], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\\d+)", use).group(1)
    print("kernel", int(paged), regs, len(re.findall(r"\\b(?:div|rem)\\.[su]64", k.asm["ptx"])))
"""


def test_paged_attention_compiles_for_sm90_like_the_slot_kernel(tmp_path):
    """Compile (not run) the CSA split kernel for sm_90, slot and block-table paths, as the decode launches
    them: the paged one within the slot kernel's two programs per SM (<= 128 registers, its launch cap) and
    with no 64-bit division beyond the slot kernel's (the table lookup is shifts)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "sm90.py"
    script.write_text(_SM90_ATTENTION)
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    res = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {int(r[1]): (int(r[2]), int(r[3])) for r in (ln.split() for ln in res.stdout.splitlines())
            if r and r[0] == "kernel"}
    assert rows[1][0] <= 128 and rows[0][0] <= 128, rows
    assert rows[1][1] == rows[0][1], rows  # the window loop's divisions only, in both


def _graph(model, kind: str, paged, n_slots: int, max_len: int):
    gm = export_graph(model, GraphSpec(kind, n_slots=n_slots, max_len=max_len, paged=paged)).module()
    return select_kernels(gm, PassContext(model.config, "h200", kind)).graph


def _paged_graph_case(name: str, kinds: tuple[str, ...]):
    """Prefill two rows at different positions, then 3 decode steps: the slot caches through the eager
    model, the paged caches through the exported graphs of `kinds` (the eager model for the others).
    Paged logits equal slot logits, and the pools end up holding the slot caches' rows."""
    model = randomize_(build_model(ModelConfig.preset(name), dtype=torch.float32), seed=5).eval()
    n_slots, L = 3, 48
    lay = PagedLayout(8, 16)
    graphs = {k: _graph(model, k, lay, n_slots, L) for k in kinds}
    if "decode" in graphs:
        used = {str(n.target) for n in graphs["decode"].graph.nodes if n.op == "call_function"}
        assert any("paged" in o and ("static" in o or "fused" in o) for o in used), used
    sc = model.new_cache(n_slots, max_len=L)
    pc = model.new_cache(n_slots, max_len=L, paged=lay)
    paged_c = flat_caches(pc.layers)
    table = paged_c["block_table"]
    table[0], table[1] = torch.tensor([9, 3, 14, 0, 7, 11]), torch.tensor([2, 15, 5, 8, 1, 12])

    def paged_step(kind, ids, n_real):
        if kind in graphs:
            return graphs[kind](ids, slots, pc.pos[slots], n_real, paged_c)[0]
        return model(ids, pc, n_real=n_real, slots=slots)

    g = torch.Generator().manual_seed(6)
    V = model.config.vocab_size
    slots = torch.tensor([1, 0])
    steps = [("prefill", torch.randint(0, V, (2, 19), generator=g), torch.tensor([19, 13]))]
    steps += [("decode", torch.randint(0, V, (2, 1), generator=g), torch.ones(2, dtype=torch.int64))
              for _ in range(3)]
    with torch.no_grad():
        for kind, ids, n_real in steps:
            want = model(ids, sc, n_real=n_real, slots=slots)
            got = paged_step(kind, ids, n_real)
            if kind in graphs:
                pc.pos[slots] += n_real
            assert (want - got).abs().max() <= 1e-6 * want.abs().max(), kind
    slot_c = flat_caches(sc.layers)
    grow = [k for k in slot_c if k.split(".")[1] in ("entries", "idx_entries", "latent", "kpe", "index_keys")]
    assert grow
    for k in grow:
        rows = paged_c[k][table[:2]].flatten(1, 2)[:, : slot_c[k].shape[1]]  # slots 0, 1
        # (the eager side ran the reference compressor, the graph its static form: float rounding apart)
        assert (rows - slot_c[k][:2]).abs().max() <= 1e-6 * slot_c[k].abs().max(), k


@pytest.mark.slow  # two exports: about a minute
def test_paged_decode_graph_has_the_slot_graphs_ops():
    """The exported V4 decode graph (SWA, CSA, HCA layers) lowered for h200 with paged caches has the slot
    graph's ops, op for op, each cache op replaced by its `_paged` twin: no gathers, copies or block-table
    arithmetic of its own (the kernels read the table)."""
    from collections import Counter

    model = randomize_(build_model(ModelConfig.preset("v4-tiny-a"), dtype=torch.float32), seed=5).eval()

    def ops_of(gm):
        return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")

    slot = ops_of(_graph(model, "decode", None, 3, 48))
    paged = ops_of(_graph(model, "decode", PagedLayout(8, 16), 3, 48))
    twins = {k: v for k, v in paged.items() if "_paged" in k}
    assert twins and all("fused" in k for k in twins), twins  # the Triton forms, as in the slot graph
    assert Counter(k.replace("_paged", "") for k in paged.elements()) == slot


def test_exported_paged_decode_graph_equals_the_slot_caches():
    """V4 (SWA, CSA, HCA layers): the exported decode graph, lowered for the h200 target (paged static /
    fused ops; their CPU forms here), reads and writes the pools through the block table."""
    _paged_graph_case("v4-tiny-a", ("decode",))


@pytest.mark.long
@pytest.mark.parametrize("name", ["v4-tiny-a", "v32-tiny"])
def test_exported_paged_prefill_and_decode_graphs_equal_the_slot_caches(name):
    _paged_graph_case(name, ("prefill", "decode"))


def test_capture_safety_table_of_the_paged_ops():
    """split_at_routers' OP_CAPTURE for the paged ops, checked by running them on the tiny V4 and V3.2 models'
    paged caches: the reference ops sync the host, their static / fused forms do not."""
    from dsv4c.passes.split_at_routers import OP_CAPTURE, host_sync_ops, reference_impl

    calls: dict = {}
    orig = {}

    def recorder(name):
        def run(*args):
            calls.setdefault(f"dsv4c.{name}", args)
            return orig[name](*args)
        return run

    names = ("v4_attention_paged", "v4_compress_paged", "v4_indexer_topk_paged", "mla_cache_update_paged",
             "dsa_cache_update_paged")
    for preset in ("v4-tiny-a", "v32-tiny"):
        m = randomize_(build_model(ModelConfig.preset(preset), dtype=torch.float32), seed=1).eval()
        cache = m.new_cache(3, max_len=32, paged=PagedLayout(8, 10))
        flat_caches(cache.layers)["block_table"][:2] = torch.arange(8).view(2, 4)
        ids = torch.randint(0, m.config.vocab_size, (2, 3))
        with torch.no_grad():
            m(ids, cache, slots=torch.arange(2))
            for n in names:
                orig[n] = getattr(ops, n)
            try:
                for n in names:
                    setattr(ops, n, recorder(n))
                m(ids, cache, slots=torch.arange(2))
            finally:
                for n in names:
                    delattr(ops, n)
    assert set(calls) == {f"dsv4c.{n}" for n in names}
    for name, args in calls.items():
        for impl in (name, name + "_static", name + "_fused"):
            if impl in OP_CAPTURE:
                syncs = host_sync_ops(reference_impl(impl), *[a.clone() if isinstance(a, torch.Tensor) else a
                                                              for a in args])
                assert bool(syncs) == (OP_CAPTURE[impl] is not None), (impl, syncs[:3])


@pytest.mark.long  # ~21 s of CPU, most of it the export
def test_exported_paged_verify_mtp_graph_equals_the_slot_caches():
    """Paged + MTP (issue 27 item 2): the exported verify_mtp graph (k = 2, lowered for the h200 target; CPU
    forms) on paged main caches (the MTP block's ring stays per slot) gives the eager fused step's five
    outputs on slot caches, over rounds that roll back (the next round starts 1 or 3 positions later and
    rewrites the rejected rows)."""
    from cut_presets import small
    from dsv4c.export import VerifyMTPStepModule, verify_mtp_caches

    model = randomize_(build_model(small("v4-tiny-a"), dtype=torch.float32), seed=7).eval()
    n_slots, L, K = 3, 48, 2
    lay = PagedLayout(8, 16)
    gm = export_graph(model, GraphSpec("verify_mtp", k=K, n_slots=n_slots, max_len=L, extra_ring_slots=K,
                                       paged=lay)).module()
    gm = select_kernels(gm, PassContext(model.config, "h200", "verify_mtp")).graph
    sc, pc = (model.new_cache(n_slots, max_len=L, extra_ring_slots=K, paged=p) for p in (None, lay))
    smc, pmc = (model.new_mtp_cache(n_slots, max_len=L, extra_ring_slots=K) for _ in range(2))
    slot_c = verify_mtp_caches(flat_caches(sc.layers), flat_caches(smc.layers))
    paged_c = verify_mtp_caches(flat_caches(pc.layers), flat_caches(pmc.layers))
    paged_c["block_table"][0], paged_c["block_table"][1] = torch.tensor([9, 3, 14, 0, 7, 11]), torch.tensor([2, 15, 5,
                                                                                                              8, 1, 12])
    eager = VerifyMTPStepModule(model, type(sc.layers[0]), len(sc.layers))
    g = torch.Generator().manual_seed(8)
    V = model.config.vocab_size
    slots = torch.tensor([1, 0])
    with torch.no_grad():
        prompt = torch.randint(0, V, (2, 13), generator=g)
        n_real = torch.tensor([13, 11])
        for c in (sc, pc):
            model(prompt, c, n_real=n_real, slots=slots)
        pos = n_real.clone()
        for adv in (1, 3, 1, 3, 3):  # accepted drafts + 1 of each round (rollback: the position moves)
            ids = torch.randint(0, V, (2, 1 + K), generator=g)
            nr = torch.full((2,), 1 + K)
            want = eager(ids, slots, pos, nr, slot_c)
            got = gm(ids, slots, pos, nr, paged_c)
            for i, (w, x) in enumerate(zip(want, got)):
                if w.is_floating_point():
                    assert (w - x).abs().max() <= 1e-6 * w.abs().max(), (adv, i)
                else:
                    assert torch.equal(w, x), (adv, i)
            pos += adv
