"""Prefill calls replayed at fixed (rows, tokens) shapes (runtime/prefill_graphs.py): the padded data flow
("emulate": the same padding, gather and static outputs as the CUDA graphs, op by op) gives the logits and
tokens of the unpadded op-by-op path, writes no cache entry at the padded rows and positions, and keeps the
hidden rows MTP's admission reads. Tiny V4 (SWA, CSA, HCA layers), V3 and V3.2; slot and paged caches, with
cached prefixes. The CUDA graphs themselves run in the `gpu` test at the end.

Tolerance (fp32): 1e-5 of max |logit|, as tests/test_batched_prefill.py (the CPU BLAS rounds by the number of
rows M, and the padded call has other M); a padding leak is an error of order 1 (planted below)."""
from __future__ import annotations

import pytest
import torch

from dsv4c import ModelConfig
from dsv4c.model import build_model, randomize_
from dsv4c.runtime.block_pool import PagedConfig
from dsv4c.runtime.prefill_graphs import PrefillGraphs, default_shapes
from dsv4c.runtime.prefix_cache import PrefixCacheConfig
from session_probe import assert_same, eager_session, serve

BUDGET, BLOCK = 64, 8  # max_num_batched_tokens (shapes: 1, 2, 4 x 16; 1, 2 x 32; 1 x 64), prefix block size
NAMES = ("v4-tiny-a", "v3-tiny", "v32-tiny")


@pytest.fixture(scope="module")
def models():
    return {name: randomize_(build_model(ModelConfig.preset(name), dtype=torch.float32), seed=41 + i).eval()
            for i, name in enumerate(NAMES)}


def prompts(V: int, seed: int = 0) -> tuple[list[int], list[list[int]]]:
    """A 24-token base and six prompts of 3..89 tokens (one longer than a call: two chunks), three sharing 13,
    16 or 24 tokens of it; the first three share a call (3 rows, padded to 4)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(2, V, (24,), generator=g).tolist()
    tail = lambda n: torch.randint(2, V, (n,), generator=g).tolist()  # noqa: E731
    return base, [tail(7), tail(3), tail(5), base[:13] + tail(6), base[:16] + tail(9), base + tail(65)]


def session(model, graphs: bool, prefix=False, paged=None, mtp_k: int = 0):
    """An eager Session of 6 slots (tests/session_probe.py) with emulated prefill graphs or none; records
    each prefill call's (B, T, replayed)."""
    sess = eager_session(model, BUDGET, prefix, max_batch=6, paged=paged, mtp_k=mtp_k)
    sess.prefill_graphs = sess._make_prefill_graphs("emulate" if graphs else "off", "off", sharded=False)
    sess.calls = []
    run = sess._run

    def recording(kind, ids, slots, n_real, **kw):
        if kind == "prefill":
            sess.calls.append((*ids.shape, kw.get("replay", False)))
        return run(kind, ids, slots, n_real, **kw)

    sess._run = recording
    return sess


def test_default_shapes_cover_the_budget_in_powers_of_two():
    assert default_shapes(64, 4) == ((1, 16), (2, 16), (4, 16), (1, 32), (2, 32), (1, 64))
    assert default_shapes(2048, 64)[-1] == (1, 2048) and len(default_shapes(2048, 64)) == 35
    assert all(r * t <= 2048 and r <= 64 for r, t in default_shapes(2048, 64))
    assert default_shapes(8, 4) == ()  # below the smallest chunk: every call runs op by op


def test_fit_takes_the_smallest_shape_that_holds_the_call():
    pg = PrefillGraphs(lambda *a: None, torch.device("cpu"), default_shapes(2048, 64), 0, keep_hidden=False,
                       mode="emulate")
    assert pg.fit(16, 128) == (16, 128) and pg.fit(1, 2048) == (1, 2048)
    assert pg.fit(3, 20) == (4, 32) and pg.fit(9, 100) == (16, 128) and pg.fit(1, 1100) == (1, 2048)
    assert pg.fit(2, 16) == (2, 16) and pg.fit(1, 1) == (1, 16)
    assert pg.fit(65, 16) is None and pg.fit(1, 2049) is None  # no shape holds it


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("cache", ["slot", "prefix", "paged"])
def test_replayed_prefill_gives_the_op_by_op_logits(models, name, cache):
    """Every call that fits a shape is replayed (padded rows and positions among them) and every request gets
    the op-by-op path's logits and tokens, also resuming from cached prefixes."""
    model = models[name]
    base, ps = prompts(model.config.vocab_size, seed=1)
    kw = {"slot": {}, "prefix": dict(prefix=PrefixCacheConfig(BLOCK)),
          "paged": dict(paged=PagedConfig(block_size=BLOCK), prefix=True)}[cache]
    out = []
    for graphs in (False, True):
        sess = session(model, graphs, **kw)
        if cache != "slot":
            serve(sess, [base], max_new=1)
        out.append(serve(sess, ps, max_new=3))
    assert_same(*out, tol=1e-5)
    pg = sess.prefill_graphs
    assert pg.stats["replays"] == sess.prefill_stats["replays"] > 0
    replayed = [(B, T) for B, T, r in sess.calls if r]
    assert cache != "slot" or any(pg.fit(B, T)[0] > B for B, T in replayed), sess.calls  # padded rows
    assert any(pg.fit(B, T)[1] > T for B, T in replayed), sess.calls  # padded positions
    if cache != "slot":
        assert sess.prefix.stats()["hit_tokens"] > 0


@pytest.mark.parametrize("name,paged", [("v4-tiny-a", False), ("v4-tiny-a", True), ("v3-tiny", False)])
@torch.no_grad()
def test_replayed_prefill_writes_no_cache_entry_at_the_padding(models, name, paged):
    """After the prompts' prefill (max_new_tokens=1), every cache tensor equals the op-by-op path's, but the
    scratch slot (padded rows point at it). A graph told that every padded position is real breaks it."""
    model = models[name]
    _, ps = prompts(model.config.vocab_size, seed=2)

    def caches(graphs: bool, leak: bool = False) -> dict:
        sess = session(model, graphs, paged=PagedConfig(block_size=BLOCK) if paged else None)
        if leak:
            gm = sess.prefill_graphs.gm
            sess.prefill_graphs.gm = lambda ids, s, p0, n, *a: gm(ids, s, p0, torch.where(
                n > 0, torch.full_like(n, ids.shape[1]), n), *a)
        sess.generate(ps, max_new_tokens=1)
        assert any(r for *_, r in sess.calls) == graphs
        pools = sess._pools
        return {k: t if k in pools else t[:-1] for k, t in sess.caches.items()}  # [:-1]: not the scratch slot

    ref, got, leaky = caches(False), caches(True), caches(True, leak=True)
    for k, t in ref.items():
        torch.testing.assert_close(got[k], t, rtol=1e-5, atol=1e-5, msg=k)
    bad = [k for k, t in ref.items() if t.is_floating_point()
           and ((leaky[k] - t).nan_to_num(posinf=1.0, neginf=-1.0).abs().max() > 1e-2)]
    assert bad, "the planted padding writes were not seen"


@pytest.mark.parametrize("name,paged", [("v4-tiny-a", False), ("v4-tiny-a", True), ("v3-tiny", False)])
def test_mtp_admission_reads_the_replayed_hidden_rows(models, name, paged):
    """MTP (k = 2) drafts its first round from the prompt's hidden rows, which the replayed graph keeps
    (`keep_hidden`): greedy tokens equal plain decoding's."""
    model = models[name]
    base, ps = prompts(model.config.vocab_size, seed=4)
    kw = dict(paged=PagedConfig(block_size=BLOCK), prefix=True) if paged else dict(prefix=PrefixCacheConfig(BLOCK))
    plain = serve(session(model, False, **kw), ps, max_new=5, temperature=0.0)[0]
    sess = session(model, True, mtp_k=2, **kw)
    assert sess.prefill_graphs.keep_hidden
    serve(sess, [base], max_new=1, temperature=0.0, mtp=2)
    assert serve(sess, ps, max_new=5, temperature=0.0, mtp=2)[0] == plain
    assert sess.prefill_stats["replays"] > 0


def test_full_prompt_logits_run_op_by_op(models):
    """`Session.logits` needs every position's logits, which a replay does not return: it runs op by op."""
    model = models["v4-tiny-a"]
    ids = prompts(model.config.vocab_size)[1][4]
    got = session(model, True).logits(ids)
    ref = session(model, False).logits(ids)
    assert got.shape == (len(ids), model.config.vocab_size)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_capture_blocker_names_the_op_that_syncs_the_host(v3_tiny_mtp_art):
    """A graph with the reference cache ops or experts cannot be captured ("auto" then runs prefill op by op);
    one of capture-safe ops can."""
    from torch import fx

    from dsv4c.artifact_safety import load_program
    from dsv4c.model import register_ops
    from dsv4c.runtime.prefill_graphs import capture_blocker

    register_ops()
    data = (v3_tiny_mtp_art / "art" / "graphs" / "prefill.pt2").read_bytes()
    assert "syncs the host" in capture_blocker(load_program(data).module())

    def graph(*ops) -> fx.GraphModule:
        g = fx.Graph()
        x = g.placeholder("x")
        for op in ops:
            x = g.call_function(op, (x,))
        g.output(x)
        return fx.GraphModule(torch.nn.Module(), g)

    safe = (torch.ops.dsv4c.head_rms_rope_fused.default, torch.ops.dsv4c.v4_attention_static.default,
            torch.ops.aten.mul.Tensor)
    assert capture_blocker(graph(*safe)) is None
    assert "dsv4c.moe_experts syncs the host" in capture_blocker(graph(*safe, torch.ops.dsv4c.moe_experts.default))
    assert "aten.nonzero syncs the host" in capture_blocker(graph(torch.ops.aten.nonzero.default))


def test_bad_prefill_graph_settings_are_named(models):
    sess = eager_session(models["v3-tiny"], BUDGET, False, max_batch=6)
    with pytest.raises(ValueError, match="prefill_graphs: 'auto', 'off', 'emulate'"):
        sess._make_prefill_graphs("on", "off", sharded=False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        sess._make_prefill_graphs([(1, 16)], "off", sharded=False)
    assert sess._make_prefill_graphs("auto", "off", sharded=False) is None  # a CPU session: op by op
    with pytest.raises(ValueError, match="mode 'cuda' needs a CUDA device"):
        PrefillGraphs(lambda *a: None, torch.device("cpu"), [(1, 16)], 0, keep_hidden=False)
    with pytest.raises(ValueError, match=r"\(rows, tokens\) pairs"):
        PrefillGraphs(lambda *a: None, torch.device("cpu"), [(0, 16)], 0, keep_hidden=False, mode="emulate")
    pg = PrefillGraphs(lambda *a: None, torch.device("cpu"), [(1, 16)], 0, keep_hidden=False, mode="emulate")
    with pytest.raises(ValueError, match="no prefill graph shape holds 2 rows x 16 tokens"):
        pg.run(torch.zeros(2, 16, dtype=torch.int64), *[torch.zeros(2, dtype=torch.int64)] * 3, {}, {})


@pytest.mark.gpu
@torch.no_grad()
def test_gpu_prefill_graphs_give_the_op_by_op_tokens(tmp_path):
    """The h200 lowering of v4-tiny-a (fp32) on the GPU: prefill calls replayed as CUDA graphs (the default)
    give the op-by-op path's first-token logits (1e-4: GEMMs pick kernels by shape) and greedy tokens, with
    cached prefixes, slot and paged caches."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from dsv4c import write_random_checkpoint
    from dsv4c.compile import compile_checkpoint
    from dsv4c.runtime import Session

    write_random_checkpoint(ModelConfig.preset("v4-tiny-a"), tmp_path / "ckpt", seed=3, dtype=torch.float32)
    base, ps = prompts(256, seed=5)
    for paged in (False, True):
        art = tmp_path / f"art{int(paged)}"
        compile_checkpoint(tmp_path / "ckpt", art, target="h200", max_tokens=96, max_batch=6,
                           dtype=torch.float32, paged=PagedConfig(block_size=BLOCK) if paged else None)
        out = []
        for pg in ("off", "auto"):
            sess = Session.load(art, device="cuda", max_num_batched_tokens=BUDGET, prefix_cache=PrefixCacheConfig(BLOCK)
                                if not paged else True, prefill_graphs=pg)
            serve(sess, [base], max_new=1)
            out.append(serve(sess, ps, max_new=4))
            assert (sess.prefill_stats["replays"] > 0) == (pg == "auto"), sess.prefill_stats
        assert_same(*out, tol=1e-4)
