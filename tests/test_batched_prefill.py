"""Batched prefill across requests (runtime/session.py `_prefill_rows`, issues 27/28): the scheduler runs several
admitted requests' prompt chunks in one prefill call (rows padded to the longest chunk, n_real per row), and
every request gets the logits and tokens of the one-request-per-call path (`max_prefill_rows = 1`): tiny V4
(SWA, CSA, HCA layers), V3 and V3.2; slot and paged caches; with and without the prefix cache; MTP. Padding
positions write no cache entry (the caches after the prefill equal the one-at-a-time path's).

Tolerance (fp32): 1e-5 of max |logit|, the batched-rows tolerance of tests/test_paged_session.py. No row reads
another (a row mix or a padding write is an error of order 1, `test_padding_writes_no_cache_entry` plants one),
but the CPU BLAS picks its GEMM kernel by the number of rows M (M = 1, 2, >= 3 round differently: x[:1] @ W.T
differs from (x @ W.T)[:1] by ~1e-7 relative), and a batched call has other M in every linear and in every
routed expert (M = tokens routed to it): measured up to 2.2e-6 on these models (V3 with a 2-token row), 1.0e-6
on V4, against 0 to 6e-7 between two chunkings of the one-at-a-time path.

The Sessions run the eager model's `step` as their graphs (tests/session_probe.py), as the prefix-cache tests."""
from __future__ import annotations

from functools import partial

import pytest
import torch

from dsv4c import ModelConfig
from dsv4c.model import build_model, randomize_
from dsv4c.runtime.block_pool import PagedConfig
from dsv4c.runtime.prefix_cache import PrefixCacheConfig
from session_probe import assert_same as same_as_serve
from session_probe import eager_session, serve

BUDGET, BLOCK = 32, 8  # max_num_batched_tokens (tokens per prefill call, padding counted), prefix block size
NAMES = ("v4-tiny-a", "v3-tiny", "v32-tiny")


@pytest.fixture(scope="module")
def models():
    return {name: randomize_(build_model(ModelConfig.preset(name), dtype=torch.float32), seed=31 + i).eval()
            for i, name in enumerate(NAMES)}


def prompts(V: int, seed: int = 0) -> tuple[list[int], list[list[int]]]:
    """A 24-token base and six prompts of 3..45 tokens (one longer than a call: two chunks), four sharing
    13, 16 or 24 tokens of the base (inside a compression group, on a block end, past the window)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(2, V, (24,), generator=g).tolist()
    tail = lambda n: torch.randint(2, V, (n,), generator=g).tolist()  # noqa: E731
    return base, [tail(7), base[:13] + tail(6), tail(3), base[:16] + tail(9), base + tail(21), base + tail(2)]


def session(model, rows: int, prefix=False, paged=None, mtp_k: int = 0):
    """An eager Session of 6 slots whose prefill calls take at most `rows` requests; records each call's
    (B, T, n_real)."""
    sess = eager_session(model, BUDGET, prefix, max_batch=6, paged=paged, mtp_k=mtp_k)
    sess.max_prefill_rows = rows
    sess.calls = []
    run = sess._run

    def recording(kind, ids, slots, n_real, **kw):
        if kind == "prefill":
            sess.calls.append((*ids.shape, list(n_real)))
        return run(kind, ids, slots, n_real, **kw)

    sess._run = recording
    return sess


def both(model, ps, base=None, **kw):
    """serve(ps) on the one-request-per-call path and on the batched one (after serving `base` alone first,
    when given, so that the prompts find its blocks cached)."""
    out = []
    for rows in (1, 6):
        sess = session(model, rows, **kw)
        if base is not None:
            serve(sess, [base], max_new=1)
        sess.calls.clear()
        sess.prefill_stats = dict.fromkeys(sess.prefill_stats, 0)
        out.append((serve(sess, ps, max_new=3), sess))
    return out


assert_same = partial(same_as_serve, tol=1e-5)  # 1e-5: see the module docstring


def assert_batched(one, many) -> None:
    """The batched path made fewer calls, with several rows, within the token budget, and the same rows."""
    assert all(B == 1 for B, _, _ in one.calls)
    assert len(many.calls) < len(one.calls) and max(B for B, _, _ in many.calls) > 1, many.calls
    assert all(B * T <= BUDGET and max(n) == T and min(n) >= 1 for B, T, n in many.calls), many.calls
    assert any(min(n) < T for _, T, n in many.calls), many.calls  # some rows were padded
    assert sorted(x for *_, n in one.calls for x in n) == sorted(x for *_, n in many.calls for x in n)
    st = many.prefill_stats
    assert st["calls"] == len(many.calls) and st["tokens"] <= st["padded_tokens"] <= BUDGET * st["calls"], st


@pytest.mark.parametrize("name", NAMES)
def test_batched_prefill_gives_the_one_at_a_time_logits_slot_caches(models, name):
    model = models[name]
    _, ps = prompts(model.config.vocab_size)
    (ref, one), (got, many) = both(model, ps)
    assert_same(ref, got)
    assert_batched(one, many)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("paged", [False, True])
def test_batched_prefill_with_cached_prefixes(models, name, paged):
    """Prompts resume from the base's cached blocks (slot caches + prefix cache, or paged caches sharing
    blocks) at per-row positions; the hits and stored blocks equal the one-at-a-time path's."""
    model = models[name]
    base, ps = prompts(model.config.vocab_size, seed=1)
    kw = dict(paged=PagedConfig(block_size=BLOCK), prefix=True) if paged else dict(prefix=PrefixCacheConfig(BLOCK))
    (ref, one), (got, many) = both(model, ps, base, **kw)
    assert_same(ref, got)
    assert_batched(one, many)
    a, b = one.prefix.stats(), many.prefix.stats()
    assert a["hit_tokens"] > 0 and all(a[k] == b[k] for k in ("hit_tokens", "stored_blocks", "blocks_cached")), (a, b)


@pytest.mark.parametrize("name", ["v4-tiny-a", "v3-tiny"])
@pytest.mark.parametrize("paged", [False, True])
@torch.no_grad()
def test_padding_writes_no_cache_entry(models, name, paged):
    """After the prompts' prefill (max_new_tokens=1: no decode step), every cache tensor, the pools included,
    equals the one-at-a-time path's: the padded positions of the shorter rows wrote nothing. A prefill graph
    told that every position is real (the padding written) breaks the comparison."""
    model = models[name]
    _, ps = prompts(model.config.vocab_size, seed=2)

    def caches(rows: int, leak: bool = False) -> dict:
        sess = session(model, rows, paged=PagedConfig(block_size=BLOCK) if paged else None)
        if leak:
            graph = sess.graphs["prefill"]
            sess.graphs["prefill"] = lambda ids, s, p0, n, *a: graph(ids, s, p0, torch.full_like(n, ids.shape[1]), *a)
        sess.generate(ps, max_new_tokens=1)
        assert (max(B for B, _, _ in sess.calls) > 1) == (rows > 1)
        return sess.caches

    ref, got, leaky = caches(1), caches(6), caches(6, leak=True)
    for k, t in ref.items():
        torch.testing.assert_close(got[k], t, rtol=1e-5, atol=1e-5, msg=k)
    bad = [k for k, t in ref.items() if t.is_floating_point()
           and ((leaky[k] - t).nan_to_num(posinf=1.0, neginf=-1.0).abs().max() > 1e-2)]
    assert bad, "the planted padding writes were not seen"


def test_a_prompt_sharing_a_prefix_with_one_being_prefilled_waits_for_its_blocks(models):
    """Submitted together into an empty prefix cache, prompts that share a 24-token prefix: the first is
    prefilled alone, the others are admitted after it and resume at its last full block, prefilled together
    (one call, two rows): the hits of one request after another."""
    model = models["v4-tiny-a"]
    base, _ = prompts(model.config.vocab_size, seed=3)
    ps = [base + [3, 4, 5, 6, 7], base + [8, 9], base + [10, 11, 12]]
    (ref, one), (got, many) = both(model, ps, prefix=PrefixCacheConfig(BLOCK))
    assert_same(ref, got)
    assert one.prefix.stats()["hit_tokens"] == many.prefix.stats()["hit_tokens"] == 2 * 24
    # the first: chunks end at 16 (the last block end >= W before its end), 24 (its last full block) and 29
    assert many.calls == [(1, 16, [16]), (1, 8, [8]), (1, 5, [5]), (2, 3, [2, 3])], many.calls


@pytest.mark.parametrize("name,paged", [("v4-tiny-a", False), ("v4-tiny-a", True), ("v3-tiny", False)])
def test_mtp_after_batched_prefill_gives_the_plain_greedy_tokens(models, name, paged):
    """MTP (k = 2) drafts its first round from each row's own last streams: the greedy tokens equal plain
    decoding and the one-at-a-time path's, with cached prefixes."""
    model = models[name]
    base, ps = prompts(model.config.vocab_size, seed=4)
    kw = dict(paged=PagedConfig(block_size=BLOCK), prefix=True) if paged else dict(prefix=PrefixCacheConfig(BLOCK))
    plain = serve(session(model, 6, **kw), ps, max_new=5, temperature=0.0)[0]
    got = []
    for rows in (1, 6):
        sess = session(model, rows, mtp_k=2, **kw)
        serve(sess, [base], max_new=1, temperature=0.0, mtp=2)
        sess.calls.clear()
        got.append(serve(sess, ps, max_new=5, temperature=0.0, mtp=2)[0])
        assert sess.prefix.stats()["hit_tokens"] > 0 or name == "v3-tiny"  # (V3 + MTP restores nothing)
    assert got[0] == plain and got[1] == plain
    assert max(B for B, _, _ in sess.calls) > 1


def test_deterministic_artifacts_prefill_one_request_per_call(models):
    """A deterministic artifact promises logits independent of the other requests: one row per call."""
    from pathlib import Path

    from dsv4c.runtime import Session

    base = eager_session(models["v3-tiny"], BUDGET, False)
    manifest = {**base.manifest, "deterministic": True}
    sess = Session(Path("<eager>"), manifest, base.graphs, {}, torch.device("cpu"), None)
    assert sess.max_prefill_rows == 1 and base.max_prefill_rows == base.max_batch


def _h200_batched_and_cached(tmp_path, device: str) -> list:
    """The h200 lowering of v4-tiny-a (fp32, reference experts) served with cached prefixes, one request per
    prefill call and six: [serve results per rows], each after serving the base prompt alone. Its prefill
    graph has the target's cache kernels (fused attention, compressor, indexer) over B x T rows."""
    from dsv4c import write_random_checkpoint
    from dsv4c.compile import compile_checkpoint
    from dsv4c.runtime import Session

    write_random_checkpoint(ModelConfig.preset("v4-tiny-a"), tmp_path / "ckpt", seed=3, dtype=torch.float32)
    compile_checkpoint(tmp_path / "ckpt", tmp_path / "art", target="h200", max_tokens=96, max_batch=6,
                       dtype=torch.float32, kernels={"moe_experts": "reference"}, verify_boundaries=device == "cuda")
    base, ps = prompts(256, seed=5)
    out = []
    for rows in (1, 6):
        sess = Session.load(tmp_path / "art", device=device, emulate=device == "cpu", max_num_batched_tokens=BUDGET,
                            prefix_cache=PrefixCacheConfig(BLOCK))
        sess.max_prefill_rows = rows
        serve(sess, [base], max_new=1)
        st = dict(sess.prefill_stats)
        out.append(serve(sess, ps, max_new=4))
        calls, nrows = sess.prefill_stats["calls"] - st["calls"], sess.prefill_stats["rows"] - st["rows"]
        assert (calls < nrows) == (rows > 1), (calls, nrows)
        assert sess.prefix.stats()["hit_tokens"] > 0
    return out, (tmp_path / "ckpt", base, ps)


@pytest.mark.gpu
@torch.no_grad()
def test_h200_batched_prefill_gives_the_one_at_a_time_logits(tmp_path):
    """On the GPU: the h200 lowering's prefill graph (its fusion kernels over B x T rows) run with several
    requests per call gives each request the logits (fp32) and tokens of one request per call, with cached
    prefixes."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    out, _ = _h200_batched_and_cached(tmp_path, "cuda")
    assert_same(*out, tol=1e-4)  # GPU GEMMs pick their kernels by shape too


@torch.no_grad()
def test_h200_lowering_on_the_cpu_serves_cached_and_batched_prompts_as_the_reference_ops(tmp_path):
    """The same h200 artifact on the CPU (emulate), through a real Session and its scratch slot: the graphs'
    fused cache ops run their CPU forms, the static ops (dsv4c/model/static_ops.py) that each Triton kernel is
    tested equal to, which is where compare's scratch-slot bug showed (164bdc2). Six requests per prefill
    call give one request per call's logits, and both give what the cpu target's artifact (reference cache
    ops, no fusion) gives from scratch without a prefix cache. The prompts' chunks resume inside compression
    groups, on block ends and past the window."""
    from dsv4c.compile import compile_checkpoint
    from dsv4c.runtime import Session

    out, (ckpt, base, ps) = _h200_batched_and_cached(tmp_path, "cpu")
    assert_same(*out)
    compile_checkpoint(ckpt, tmp_path / "ref", target="cpu", max_tokens=96, max_batch=6, dtype=torch.float32)
    ref = Session.load(tmp_path / "ref", max_num_batched_tokens=BUDGET, prefix_cache=False)
    ref.max_prefill_rows = 1
    assert_same(serve(ref, ps, max_new=4), out[0], tol=1e-4)  # other kernels (fusions), other fp32 rounding
