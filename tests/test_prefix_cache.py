"""Prefix caching (runtime/prefix_cache.py, issue 27): a request served from cached blocks gives the
logits of a run from scratch, for V4 (SWA, CSA, HCA layers), V3 and V3.2; shared prefixes that then
diverge; eviction under a tiny pool; a pool too small for one request; MTP on top.

The Sessions run the eager model's traceable `step` as their graphs (as tests/test_speculative.py does),
which keeps the tests fast. Both sides prefill in chunks of one block, so the cached run and the run from
scratch do the same float operations: a wrong restore (a missing ring row, compressor row or entry) shows
as an error of order 1, the tolerance is 1e-6 of max |logit| (fp32)."""
from __future__ import annotations

import pytest
import torch

from dsv4c import ModelConfig
from dsv4c.model import build_model, randomize_
from dsv4c.runtime import Session
from dsv4c.runtime.prefix_cache import PrefixCacheConfig, PrefixCacheError, RingPatch
from session_probe import eager_session, follow_up_turn, serve


def assert_same(ref, got, decode_tol: float = 1e-6) -> None:
    """Equal logits: the first token's (prefill) within 1e-6, the decode steps' within `decode_tol`."""
    for i, (a, b) in enumerate(zip(ref[1], got[1])):
        assert a.shape == b.shape, i
        err = ((a - b).abs().amax(-1) / a.abs().amax(-1)).tolist()
        assert err[0] <= 1e-6 and max(err) <= decode_tol, f"request {i}: rel err {err}"
    assert ref[0] == got[0]


def prompts_sharing(V: int, seed: int = 0) -> tuple[list[int], list[list[int]]]:
    """A 40-token base and prompts that share 13 of it (inside a compression group), 16 (on a block and
    group boundary) and 40 (past the window), then diverge."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(2, V, (40,), generator=g).tolist()
    tail = lambda n: torch.randint(2, V, (n,), generator=g).tolist()  # noqa: E731
    return base, [base[:13] + tail(6), base[:16] + tail(9), base + tail(7), base[:37], base[:24]]


@pytest.fixture(scope="module")
def models():
    out = {}
    for i, name in enumerate(("v4-tiny-a", "v3-tiny", "v32-tiny")):
        out[name] = randomize_(build_model(ModelConfig.preset(name), dtype=torch.float32), seed=11 + i).eval()
    return out


@pytest.mark.parametrize("name", ["v4-tiny-a", "v3-tiny", "v32-tiny"])
def test_cached_prefixes_give_the_logits_of_a_run_from_scratch(models, name):
    model, block = models[name], 8
    base, ps = prompts_sharing(model.config.vocab_size)
    ref = serve(eager_session(model, block, False), ps, max_new=3)
    sess = eager_session(model, block, PrefixCacheConfig(block_size=block))
    serve(sess, [base], max_new=1)  # a miss: stores 5 blocks
    got = serve(sess, ps, max_new=3)
    assert_same(ref, got)
    st = sess.prefix.stats()
    # the matched full blocks, leaving >= 1 token to prefill: 19 tokens sharing 13 resume at 8, ...
    assert st["hit_tokens"] == 8 + 16 + 40 + 32 + 16 and st["blocks_in_use"] == 0, st
    # base's 5, one each for the 19- and 25-token prompts' own blocks, and one decoded: the 47-token prompt's first
    # decode step completes block [40, 48)
    assert st["blocks_cached"] == 5 + 1 + 1 + 1, st
    assert st["hit_rate"] == st["hit_tokens"] / sum(map(len, [base, *ps])), st


@pytest.mark.parametrize("name", ["v4-tiny-a", "v3-tiny"])
def test_a_follow_up_turn_resumes_from_the_blocks_its_answer_completed(models, name):
    """Chat traffic: the next turn's prompt is the last prompt, its answer and a new message. The blocks the
    answer's decode steps completed are stored when it finishes (growing rows and, for V4, the boundary
    rows at each block end, copied right after the step that completes the block), so the next turn
    resumes past the answer, and its logits equal a run from scratch (session_probe.follow_up_turn)."""
    model, block = models[name], 8
    follow_up_turn(eager_session(model, block, PrefixCacheConfig(block_size=block)), eager_session(model, block, False),
                   block)


@torch.no_grad()
def test_a_prompt_waits_while_a_running_answer_holds_the_pool(models):
    """A running request with a short prompt (no full block) fills a 6-block pool with its answer's blocks; a
    prompt that arrives then and needs 5 blocks waits for it to finish (its blocks then become evictable)
    instead of being refused, and both answers equal a cache-free run."""
    model = models["v4-tiny-a"]
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(9)
    short, long_ = torch.randint(2, V, (5,), generator=g).tolist(), torch.randint(2, V, (41,), generator=g).tolist()
    plain = eager_session(model, 8, False)
    ref = {5: plain.generate([short], max_new_tokens=60)[0].tokens, 41: plain.generate([long_], max_new_tokens=8)[0].tokens}
    sess = eager_session(model, 8, PrefixCacheConfig(block_size=8, max_blocks=6))
    ids = {sess.add_request(short, max_new_tokens=60): 5}
    toks = {5: [], 41: []}
    for step in range(200):
        if step == 54:  # the answer has completed 6 blocks (positions 8..56): the pool is full
            (hold,) = sess.prefix.holds.values()
            assert len(hold.decoded) == 6 and not sess.prefix.free_rows and len(toks[5]) < 60
            ids[sess.add_request(long_, max_new_tokens=8)] = 41
        for o in sess.step():
            toks[ids[o.request_id]] += o.tokens
        if step > 54 and not sess.has_unfinished():
            break
    assert toks == ref and sess.prefix.stats()["waits"] > 0


def test_v4_second_request_learns_the_divergence_point(models):
    """V4's boundary rows exist at chunk ends only: the base (one chunk of 48 > 40 tokens) stored them at
    32 and 40; a prompt diverging at 24 cannot resume (no block end <= 24 has them) and adds a chunk end at
    24, so the next prompt diverging there resumes at 24."""
    model = models["v4-tiny-a"]
    base, _ = prompts_sharing(model.config.vocab_size, seed=1)
    sess = eager_session(model, 48, PrefixCacheConfig(block_size=8))  # one chunk per prompt
    serve(sess, [base])
    before = sess.prefix.stats()["hit_tokens"]
    serve(sess, [base[:24] + [7, 8, 9]])
    assert sess.prefix.stats()["hit_tokens"] - before == 0  # only block 5 (end 40) had boundary rows
    p2 = base[:24] + [9, 9, 9, 9]
    ref = serve(eager_session(model, 48, False), [p2])
    got = serve(sess, [p2])
    assert sess.prefix.stats()["hit_tokens"] - before == 24
    serve(sess, [base], max_new=1)  # its first prefill also ended a chunk at 32, where it resumes now
    assert sess.prefix.stats()["hit_tokens"] - before == 24 + 32
    for a, b in zip(ref[1], got[1]):  # different chunking on the two sides: chunked-prefill rounding
        assert ((a - b).abs().max() / a.abs().max()).item() < 1e-5


def test_eviction_under_a_tiny_pool_keeps_every_answer_exact(models):
    model = models["v4-tiny-a"]
    base, ps = prompts_sharing(model.config.vocab_size, seed=2)
    ps = ps[:4] + [base[::-1], base[::-1][:30] + [3, 4]]  # up to 5 full blocks each
    ref = serve(eager_session(model, 8, False), ps, max_new=3)
    sess = eager_session(model, 8, PrefixCacheConfig(block_size=8, max_blocks=6))
    # waiting changes which requests decode together: batched rows round differently (as in test_batching)
    assert_same(ref, serve(sess, ps, max_new=3), decode_tol=1e-5)
    st = sess.prefix.stats()
    assert st["evictions"] > 0 and st["waits"] > 0 and st["hit_tokens"] > 0 and st["blocks_in_use"] == 0, st
    assert st["blocks_cached"] <= 6


def test_a_pool_too_small_for_one_request_is_refused_before_any_work(models):
    model = models["v3-tiny"]
    sess = eager_session(model, 4, PrefixCacheConfig(block_size=4, max_blocks=3))
    with pytest.raises(PrefixCacheError, match=r"pool too small: a 17-token prompt needs 4 blocks of 4 tokens, "
                                                r"the pool holds 3"):
        sess.generate([[5] * 3, [6] * 17])
    assert sess.prefix.stats()["requests"] == 0
    with pytest.raises(PrefixCacheError, match="block_size=6: must be >= 1 and a multiple of every compression"):
        eager_session(models["v4-tiny-a"], 4, PrefixCacheConfig(block_size=6))
    v4 = models["v4-tiny-a"]
    assert eager_session(v4, 4, True).prefix.block_size == 16  # the default: lcm(4, 8) rounded up to 16
    short = eager_session(v4, 4, True, max_tokens=12)  # the default where no block fits: off, and said so
    assert short.prefix is None and "below one block of 16 tokens" in short.cache_info["prefix"]
    with pytest.raises(PrefixCacheError, match="no block fits"):
        eager_session(v4, 4, PrefixCacheConfig(), max_tokens=12)


def test_mtp_on_cached_prefixes_equals_plain_greedy(models):
    """V4 with MTP resumes >= W tokens before the prompt's end (the first draft needs the last W streams);
    the verify graph's writes past the prompt go to the slot, never to stored blocks."""
    model = models["v4-tiny-a"]
    base, ps = prompts_sharing(model.config.vocab_size, seed=3)
    plain = serve(eager_session(model, 8, False), ps, max_new=4, temperature=0.0)[0]
    sess = eager_session(model, 8, PrefixCacheConfig(block_size=8), mtp_k=2)
    serve(sess, [base], max_new=4, temperature=0.0, mtp=2)
    assert serve(sess, ps, max_new=4, temperature=0.0, mtp=2)[0] == plain
    st = sess.prefix.stats()
    assert st["hit_tokens"] == 8 + 16 + 32 + 24 + 16, st  # each resume <= len - W = len - 8
    assert serve(sess, ps, max_new=4, temperature=0.0, mtp=2)[0] == plain  # blocks unchanged by verify rows


MTP_TURNS = [("v4-tiny-a", "off", 0.8, None), ("v4-tiny-a", "emulate", 0.8, None), ("v4-tiny-a", "off", 0.0, 0.7),
             ("v4-tiny-a", "emulate", 0.0, 0.7), ("v3-tiny", "off", 0.8, None)]


@pytest.mark.parametrize("name,mode,temperature,forced", MTP_TURNS)
@torch.no_grad()
def test_mtp_rounds_keep_the_blocks_they_complete(models, name, mode, temperature, forced):
    """An answer decoded in MTP rounds (pipelined: op by op, and as round graphs' static-buffer flow; sampled,
    and greedy with teacher-forced drafts that are accepted) keeps the blocks its rounds completed, so the
    next turn resumes past it and equals a run from scratch. A pipelined round is read after the next one was
    queued, whose verify overwrote ring rows of the block's window when this round accepted drafts: without
    the copy of those rows (`stash_rings`, patched back by `RingPatch`) the V4 turn with accepted drafts
    differs (the sampled rounds here accept few, and a round that accepts none overwrites only the stored row
    P - W, which no query at P or later reads)."""
    from dsv4c.runtime.speculative import speculator

    model, block = models[name], 8

    def turn():
        sess = eager_session(model, block, PrefixCacheConfig(block_size=block), mtp_k=2)
        speculator(sess).round_mode = mode
        follow_up_turn(sess, eager_session(model, block, False), block, mtp=2, temperature=temperature,
                       forced=forced)
        return sess

    sess = turn()
    assert sess.prefix.stats()["stored_blocks"] >= 8
    if model.config.is_v4:
        assert speculator(sess).stash_buffers() and speculator(sess).keeps_blocks
    if model.config.is_v4 and forced:
        orig = RingPatch.apply
        RingPatch.apply = lambda *a: None
        try:
            with pytest.raises(AssertionError, match="rel err"):
                turn()
        finally:
            RingPatch.apply = orig


@pytest.mark.gpu
@torch.no_grad()
def test_h200_artifact_on_restored_slots_gives_the_tokens_of_a_run_from_scratch(tmp_path):
    """On the GPU: the h200 lowering's fused cache kernels (CUDA graphs) decode from slots restored from
    cached blocks, with the logits and tokens of the same Session without the prefix cache."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from dsv4c import write_random_checkpoint
    from dsv4c.compile import compile_checkpoint

    write_random_checkpoint(ModelConfig.preset("v4-tiny-a"), tmp_path / "ckpt", seed=3, dtype=torch.float32)
    compile_checkpoint(tmp_path / "ckpt", tmp_path / "art", target="h200", max_tokens=96, max_batch=3,
                       dtype=torch.float32, kernels={"moe_experts": "reference"})
    sess = Session.load(tmp_path / "art", device="cuda", max_num_batched_tokens=8,
                        prefix_cache=PrefixCacheConfig(block_size=8))
    pc = sess.prefix
    base, ps = prompts_sharing(sess.config.vocab_size)
    sess.prefix = None
    ref = serve(sess, ps, max_new=6)
    sess.prefix = pc
    serve(sess, [base], max_new=1)
    got = serve(sess, ps, max_new=6)
    assert pc.stats()["hit_tokens"] == 8 + 16 + 40 + 32 + 16
    for i, (a, b) in enumerate(zip(ref[1], got[1])):  # the same chunks and batches: equal up to GPU rounding
        assert ((a - b).abs().max() / a.abs().max()).item() < 1e-5, i
    assert ref[0] == got[0]


def test_warm_up_covers_row_counts_divisible_by_16(models, monkeypatch):
    """Where a prefill call takes 16 rows, warm_up sends calls of 16 rows (of 16 and of 17 tokens): Triton
    specialises the row count on divisibility by 16, and 16 prompts resuming from a cached prefix met that
    class first, inside their time to first token (H100, examples/results/h200-2026-12-05)."""
    sess = eager_session(models["v4-tiny-a"], 40, False, max_batch=16)
    shapes = []
    run = sess._run

    def record(kind, ids, *a, **kw):
        if kind == "prefill":
            shapes.append(tuple(ids.shape))
        return run(kind, ids, *a, **kw)

    monkeypatch.setattr(sess, "_run", record)
    assert set(sess.warm_up()) == {"1x32", "1x17", "2x16", "2x17"}  # 16 x 17 tokens exceed the 40-token budget
    assert max(b for b, _ in shapes) == 2
    shapes.clear()
    sess.max_num_batched_tokens = 16 * 17
    took = sess.warm_up()
    assert set(took) == {"1x80", "1x17", "2x16", "2x17", "16x16", "16x17"}, took
    assert (16, 16) in shapes and (16, 17) in shapes and (1, 80) in shapes, shapes


@pytest.mark.parametrize("paged", [False, True])
def test_warm_up_leaves_no_trace(models, paged):
    """Session.warm_up (run by Session.load on a GPU) serves throwaway requests of each shape class: the
    prefix cache keeps none of them, and requests after it get exactly what a fresh session gives."""
    from dsv4c.runtime.block_pool import PagedConfig

    model = models["v4-tiny-a"]
    base, ps = prompts_sharing(model.config.vocab_size, seed=2)
    lay = PagedConfig(block_size=8) if paged else None
    fresh = eager_session(model, 40, PrefixCacheConfig(block_size=8), paged=lay)
    sess = eager_session(model, 40, PrefixCacheConfig(block_size=8), paged=lay)
    took = sess.warm_up()
    assert set(took) == {"1x32", "1x17", "2x16", "2x17"}, took  # chunks of 40 tokens: 32 is its multiple of 16
    assert sess.prefix.stats()["blocks_cached"] == 0 and getattr(sess.prefix, "share", True)
    want = serve(fresh, [base] + ps, max_new=3)
    got = serve(sess, [base] + ps, max_new=3)
    assert want[0] == got[0]
    for a, b in zip(want[1], got[1]):
        assert torch.equal(a, b)
    assert sess.prefix.stats()["hit_tokens"] == fresh.prefix.stats()["hit_tokens"] > 0


@pytest.mark.parametrize("paged", [False, True])
def test_a_wave_resuming_from_one_prefix_restores_and_stores_its_slots_together(models, paged):
    """Six prompts sharing the base, admitted in one wave: the slots are reset together, each distinct
    restore source (pool rows, or a paged block's boundary rows) is copied once into all the slots that take
    it (`batched_restores`), and the six new blocks the prefill call completes are stored in one set of
    copies (`batched_stores`); their first tokens' logits rows reach the host in one copy (`to_host`). Every
    request gets its from-scratch logits, and again when the same prompts come back and resume from those six
    blocks."""
    from dsv4c.runtime.block_pool import PagedConfig
    from session_probe import assert_same as probe_same

    model, block = models["v4-tiny-a"], 8
    base, _ = prompts_sharing(model.config.vocab_size, seed=5)
    g = torch.Generator().manual_seed(6)
    ps = [base + torch.randint(2, model.config.vocab_size, (9 + i,), generator=g).tolist() for i in range(6)]
    ref = serve(eager_session(model, block, False, max_batch=6), ps, max_new=3)
    kw = dict(paged=PagedConfig(block_size=block)) if paged else {}
    sess = eager_session(model, block, True if paged else PrefixCacheConfig(block_size=block), max_batch=6, **kw)
    sess.max_num_batched_tokens = 6 * block  # the six rows' [40, 48) chunks in one prefill call
    serve(sess, [base], max_new=1)
    calls: dict[str, list] = {}
    names = ("_restore_boundary", "_store_boundaries") if paged else ("_restore", "_store_block", "_store_boundary_rows")
    for name in names:
        inner = getattr(sess.prefix, name)
        setattr(sess.prefix, name, lambda a, slots, *r, _n=name, _f=inner: calls.setdefault(_n, []).append(
            sorted(slots)) or _f(a, slots, *r))
    copies, to_host = [], sess._last_rows_to_host
    sess._last_rows_to_host = lambda *a: (lambda got: copies.append(len(got)) or got)(to_host(*a))
    got = serve(sess, ps, max_new=3)
    probe_same(ref, got, tol=1e-5)  # six rows per prefill call: the CPU BLAS rounds by M (test_batched_prefill.py)
    assert sess.prefix.stats()["hit_tokens"] >= 6 * 32
    assert [c for c in copies if c] == [6], copies  # the six first-token rows reach the host in one copy
    for name in names:  # one call for the six slots: the restore from the base, the store of each [40, 48) block
        assert [len(c) for c in calls[name]][:1] == [6], (name, calls[name])
    calls.clear()
    again = serve(sess, ps, max_new=3)  # each resumes from its own stored block [40, 48)
    probe_same(ref, again, tol=1e-5)
    restore = names[0]
    assert len(calls[restore]) == 6 and all(len(c) == 1 for c in calls[restore]), calls[restore]  # six sources
