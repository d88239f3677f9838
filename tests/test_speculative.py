"""MTP speculative decoding (runtime/speculative.py, issue 8): greedy equals plain greedy, rejection
sampling keeps the target distribution, and rollback leaves the caches of a fresh prefill.

Most tests run the Session over the eager model's traceable `step`/`mtp_step` ("eager graphs": the
same call signature, flat caches, slots, positions and n_real as the compiled graphs), which keeps them
fast; the `compiled` tests run an artifact of the bundled model compiled with --mtp 3 (slow: export)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from dsv4c import ModelConfig, load_model
from dsv4c.export import unflat_caches
from dsv4c.model import build_model, randomize_
from dsv4c.runtime import Session
from dsv4c.runtime.sampling import SamplingParams, processed_probs
from dsv4c.runtime.speculative import SpecStats, Speculator, accept_drafts, choose_k, speculator

BUNDLE = Path(__file__).resolve().parents[1] / "examples" / "models" / "v4-tiny-pystdlib"
# mixed lengths; 70 > W = 64 (the MTP fill starts at n - W, the ring wraps)
PROMPT_LENS = [3, 11, 70, 6, 25]


def eager_session(model, max_batch: int = 4, max_tokens: int = 104, mtp_k: int = 3) -> Session:
    """A Session whose graphs are the eager model's step functions (graph_mode off)."""
    cache = model.new_cache(1, max_len=1)
    cls, n_layers = type(cache.layers[0]), len(cache.layers)

    def main(ids, slots, pos0, n_real, caches, weights):
        return model.step(ids, slots, pos0, n_real, unflat_caches(caches, cls, n_layers))

    def fixed(T: int, fn):  # like a compiled decode/verify/mtp graph: exactly T tokens per row
        def run(*args):
            ids = args[-6]
            assert ids.shape[1] == T, f"graph takes {T} tokens per row, got {ids.shape[1]}"
            return fn(*args)
        return run

    def mtp(hidden, ids, slots, pos0, n_real, caches, weights):
        (lc,) = unflat_caches(caches, cls, 1)
        return model.mtp_step(hidden, ids, slots, pos0, n_real, lc)

    kinds = {"prefill": None, "decode": 1, "verify": 1 + mtp_k, "mtp": 1 + mtp_k}
    manifest = {"model_config": model.config.to_dict(), "dtype": str(model.act_dtype).replace("torch.", ""),
                "limits": {"max_tokens": max_tokens, "max_batch": max_batch, "cache_slots": max_batch + 1},
                "mtp_k": mtp_k, "buckets": [], "target": {"name": "cpu"},
                "graphs": {k: {"weights": [], "tokens_per_seq": t, "kind": k} for k, t in kinds.items()}}
    graphs = {"prefill": main, "decode": fixed(1, main), "verify": fixed(1 + mtp_k, main),
              "mtp": fixed(1 + mtp_k, mtp)}
    return Session(Path("<eager>"), manifest, graphs, {}, torch.device("cpu"), None)


def prompts(V: int, lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, V, (n,), generator=g).tolist() for n in lens]


def corrupt_every_offset(k: int, V: int, truth: dict[int, list[int]] | None = None):
    """Draft filter: in round r of a request, drafts are the true continuation (`truth[request index]`,
    when given) except draft j = r mod (k+1), which is made wrong (none when j = k): rounds then end
    with a = 0, 1, .., k in turn, and rollback happens at every offset."""
    def f(r, rnd: int, drafts: list[int]) -> list[int]:
        if truth is not None:
            t = truth[r.index][len(r.out):]
            drafts = [t[i] if i < len(t) else d for i, d in enumerate(drafts)]
        j = (rnd + r.index) % (k + 1)
        if j < len(drafts):
            drafts[j] = (drafts[j] + 1 + rnd) % V
        return drafts
    return f


@pytest.fixture(scope="module")
def bundled():
    model = load_model(BUNDLE, dtype=torch.float32).eval()
    return model, eager_session(model)


@pytest.fixture(scope="module")
def plain(bundled):
    model, sess = bundled
    ps = prompts(model.config.vocab_size)
    with torch.no_grad():
        return ps, [r.tokens for r in sess.generate(ps, max_new_tokens=20)]


def _check_stats(st: dict, k: int, n_tokens: int) -> None:
    assert st["mtp_k"] == k and sum(st["accept_histogram"]) == st["rounds"] and len(st["accept_histogram"]) == k + 1
    assert st["accepted_draft_tokens"] == sum(a * c for a, c in enumerate(st["accept_histogram"]))
    assert st["accepted_draft_tokens"] + st["rounds"] == n_tokens - 1  # the first token comes from prefill
    assert st["mean_accepted_length"] == pytest.approx((n_tokens - 1) / st["rounds"])
    assert st["proposed_per_position"][0] <= st["rounds"]  # a round near max_new_tokens may draft nothing
    for a, p, alpha in zip(st["accepted_per_position"], st["proposed_per_position"], st["acceptance_per_position"]):
        assert a <= p and (alpha is None if p == 0 else alpha == a / p)


# ------------------------------------------------------------------------------------------------
# greedy equality (eager graphs, the trained bundled model)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 3])
@torch.no_grad()
def test_greedy_mtp_equals_plain_greedy(bundled, plain, k):
    _, sess = bundled
    ps, ref = plain
    out = sess.generate(ps, max_new_tokens=20, mtp=k)  # 5 prompts through 4 slots
    assert [r.tokens for r in out] == ref
    for r in out:
        _check_stats(r.stats, k, len(r.tokens))


@pytest.mark.parametrize("k", [1, 3])
@torch.no_grad()
def test_greedy_with_forced_rejection_at_every_offset(bundled, plain, k):
    model, sess = bundled
    ps, ref = plain
    spec = speculator(sess)
    spec.draft_filter = corrupt_every_offset(k, model.config.vocab_size, dict(enumerate(ref)))
    try:
        out = sess.generate(ps, max_new_tokens=20, mtp=k)
    finally:
        spec.draft_filter = None
    assert [r.tokens for r in out] == ref
    hist = [sum(r.stats["accept_histogram"][a] for r in out) for a in range(k + 1)]
    assert all(h > 0 for h in hist), hist  # a rejection at every offset happened, and full acceptance
    assert sum(r.stats["rollback_replays"] for r in out) > 0  # and some needed the replay


# ------------------------------------------------------------------------------------------------
# rollback: caches equal a fresh prefill of the committed tokens
# ------------------------------------------------------------------------------------------------
def _valid(name: str, t: torch.Tensor, n: int, cfg: ModelConfig, mtp: bool) -> torch.Tensor:
    """The part of one slot's cache tensor that holds state for positions < n."""
    layer, kind = name.split(".", 1)
    if not cfg.is_v4:  # latent / kpe / index_keys: position p at row p
        return t[:n]
    m = cfg.compress_ratios[cfg.num_hidden_layers if mtp else int(layer)]
    if kind == "ring":
        W, S = cfg.sliding_window, t.shape[0]
        return t[[p % S for p in range(max(0, n - W), n)]]
    if kind in ("entries", "idx_entries"):
        return t[: n // (4 if kind == "idx_entries" else m)]
    g = 4 if kind.startswith("idx") else m
    c = t.shape[0] // g
    rows = list(range((c - 1) * g, (c - 1) * g + n % g))
    if c == 2 and n >= g:
        rows = list(range(g)) + rows  # the previous (closed) group of CSA
    return t[rows]


def _fresh_state(model, committed: list[int], nxt: int, K: int):
    """Eager prefill of `committed` and the MTP over it with true inputs -> (main caches, mtp caches,
    draft logits at the last position)."""
    from dsv4c.export import flat_caches

    n = len(committed)
    extra = {"extra_ring_slots": K} if model.config.is_v4 else {}
    cache, mcache = model.new_cache(1, max_len=n + 8, **extra), model.new_mtp_cache(1, max_len=n + 8, **extra)
    fwd = model.forward_with_streams if model.config.is_v4 else model.forward_with_hidden
    _, h = fwd(torch.tensor([committed]), cache)
    mlogits, _ = model.mtp_forward(h, torch.tensor([committed[1:] + [nxt]]), mcache)
    return flat_caches(cache.layers), flat_caches(mcache.layers), mlogits[0, -1]


def _assert_rolled_back(model, sess, spec: Speculator, r, K: int) -> None:
    committed = r.ids + r.out[:-1]  # the last token is sampled, not yet fed
    n = len(committed)
    assert int(sess.pos[r.slot]) == n and int(spec.mtp_pos[r.slot]) == n
    main, mtp, draft = _fresh_state(model, committed, r.out[-1], K)
    cfg = model.config
    assert set(main) == set(sess.caches) and set(mtp) == set(spec.mtp_caches)
    for caches, fresh, is_mtp in ((sess.caches, main, False), (spec.mtp_caches, mtp, True)):
        for name, t in caches.items():
            got, want = _valid(name, t[r.slot], n, cfg, is_mtp), _valid(name, fresh[name][0], n, cfg, is_mtp)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} at n={n}: {m}")
    got = spec.seqs[r.slot].draft_logits.float()
    assert ((got - draft).abs().max() / draft.abs().max()).item() < 1e-4  # the pending draft of the next round


def _run_rounds(model, sess, prompt: list[int], k: int, rounds: int, check) -> SpecStats:
    """Drive one sequence round by round (as Session._serve does), rejecting at every offset in turn,
    and call check after every round."""
    spec = speculator(sess)
    n_new = rounds * (k + 1) + 2
    truth = sess.generate([prompt], max_new_tokens=n_new)[0].tokens
    spec.k = k
    spec.draft_filter = corrupt_every_offset(k, model.config.vocab_size, {0: truth})
    (r,) = sess._requests([prompt], n_new, 0.0, 1.0, 0, 0, None)
    r.slot = 1
    sess._reset_slot(r.slot)
    try:
        list(sess._emit(r, spec.prefill(r)))
        r.spec = SpecStats(k)
        spec.admit(r, r.spec)
        for _ in range(rounds):
            list(spec.round({r.slot: r}))
            check(spec, r)
    finally:
        spec.draft_filter = None
        spec.release(r.slot)
    return r.spec


@torch.no_grad()
def test_rolled_back_caches_equal_fresh_prefill_v4(bundled):
    model, sess = bundled
    (prompt,) = prompts(model.config.vocab_size, [61], seed=1)  # the verify chunks cross W and groups of 4/16
    st = _run_rounds(model, sess, prompt, 3, 8, lambda spec, r: _assert_rolled_back(model, sess, spec, r, 3))
    assert st.replays > 0 and min(st.histogram) > 0


# ------------------------------------------------------------------------------------------------
# V3 MTP (random tiny model): greedy equality with forced rejections, rollback state
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def v3():
    model = randomize_(build_model(ModelConfig.preset("v3-tiny"), dtype=torch.float32), seed=5).eval()
    return model, eager_session(model, max_batch=3, max_tokens=64, mtp_k=2)


@torch.no_grad()
def test_v3_greedy_mtp_with_forced_rejection_equals_plain(v3):
    model, sess = v3
    ps = prompts(model.config.vocab_size, [4, 9, 2, 15], seed=2)
    ref = [r.tokens for r in sess.generate(ps, max_new_tokens=12)]
    spec = speculator(sess)
    for k, filt in ((2, None), (2, corrupt_every_offset(2, model.config.vocab_size, dict(enumerate(ref)))),
                    (1, None)):
        spec.draft_filter = filt
        try:
            assert [r.tokens for r in sess.generate(ps, max_new_tokens=12, mtp=k)] == ref
        finally:
            spec.draft_filter = None


@torch.no_grad()
def test_v3_rolled_back_caches_equal_fresh_prefill(v3):
    model, sess = v3
    (prompt,) = prompts(model.config.vocab_size, [7], seed=4)
    st = _run_rounds(model, sess, prompt, 2, 5, lambda spec, r: _assert_rolled_back(model, sess, spec, r, 2))
    assert min(st.histogram) > 0


# ------------------------------------------------------------------------------------------------
# exact rejection sampling: the emitted distribution equals the target's
# ------------------------------------------------------------------------------------------------
def chi2_pvalue(observed: torch.Tensor, expected_p: torch.Tensor) -> float:
    """Pearson χ² goodness of fit; cells with expected count < 5 are pooled into one."""
    obs, exp = observed.double().flatten(), expected_p.double().flatten() * observed.sum()
    assert obs[exp == 0].sum() == 0, "a token with target probability 0 was emitted"
    small = exp < 5
    obs = torch.cat([obs[~small], obs[small].sum()[None]])
    exp = torch.cat([exp[~small], exp[small].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


def _markov(V: int, params: SamplingParams, seed: int):
    """A target chain P[c] and a draft chain Q[c] (different logits), both processed by `params`."""
    g = torch.Generator().manual_seed(seed)
    lp, lq = torch.randn(V, V, generator=g) * 1.5, torch.randn(V, V, generator=g) * 1.5
    return processed_probs(lp, params), processed_probs(lq, params)


def _sample_two(P, Q, k: int, greedy_drafts: bool, n: int, gen, rule=accept_drafts, start: int = 0):
    """n rounds of speculative sampling from context `start`: counts of the first two emitted tokens."""
    V = P.shape[0]
    counts = torch.zeros(V, V, dtype=torch.int64)
    for _ in range(n):
        out, ctx = [], start
        while len(out) < 2:
            drafts, qs, c = [], [], ctx
            for _ in range(k):
                d = int(Q[c].argmax()) if greedy_drafts else int(torch.multinomial(Q[c], 1, generator=gen))
                qs.append(torch.nn.functional.one_hot(torch.tensor(d), V).float() if greedy_drafts else Q[c])
                drafts.append(d)
                c = d
            p = P[[ctx] + drafts]  # p̃_0..p̃_k
            a, y = rule(p, torch.stack(qs), drafts, False, gen)
            out += drafts[:a] + [y]
            ctx = out[-1]
        counts[out[0], out[1]] += 1
    return counts


@pytest.mark.parametrize("temperature,top_p,greedy_drafts", [(0.7, 0.9, False), (1.0, 1.0, False),
                                                             (1.0, 1.0, True), (0.7, 0.9, True)])
def test_rejection_sampling_matches_target_distribution(temperature, top_p, greedy_drafts):
    V, k, n = 8, 2, 6000
    P, Q = _markov(V, SamplingParams(temperature, top_p), seed=11)
    gen = torch.Generator().manual_seed(7)
    counts = _sample_two(P, Q, k, greedy_drafts, n, gen)
    target = P[0][:, None] * P  # P(x1) P(x2 | x1)
    assert chi2_pvalue(counts, target) > 1e-3


def test_the_distribution_test_detects_a_wrong_rule():
    """Sampling y from p̃ instead of the residual after a rejection biases the output: the same test fails."""
    def wrong(p, q, drafts, greedy, gen):
        a, _ = accept_drafts(p, q, drafts, greedy, gen)
        return a, int(torch.multinomial(p[a], 1, generator=gen))

    V = 8
    P, Q = _markov(V, SamplingParams(1.0), seed=11)
    counts = _sample_two(P, Q, 2, False, 6000, torch.Generator().manual_seed(7), rule=wrong)
    assert chi2_pvalue(counts, P[0][:, None] * P) < 1e-6


def test_accept_rule_edge_cases():
    V = 5
    onehot = lambda t: torch.nn.functional.one_hot(torch.tensor(t), V).float()  # noqa: E731
    p = torch.stack([onehot(2), onehot(4), onehot(1)])
    assert accept_drafts(p, torch.stack([onehot(2), onehot(4)]), [2, 4], True, None) == (2, 1)
    assert accept_drafts(p, torch.stack([onehot(2), onehot(3)]), [2, 3], True, None) == (1, 4)
    # sampling target, draft with zero target mass: always rejected, residual excludes it
    g = torch.Generator().manual_seed(0)
    pt = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0], [0.2] * 5])
    for _ in range(50):
        a, y = accept_drafts(pt, onehot(0)[None], [0], False, g)
        assert a == 0 and y in (1, 2)
    # p == q: always accepted, the bonus token comes from p̃_k
    a, y = accept_drafts(pt, pt[:1], [1], False, g)
    assert a == 1 and 0 <= y < V


@torch.no_grad()
def test_end_to_end_sampling_distribution_tiny_vocab():
    """A V4 model with an 8-token vocabulary: the (first, second) generated tokens of mtp=2 sampling
    follow p(x1)·p(x2 | x1) computed from the model's own logits."""
    cfg = dataclasses.replace(ModelConfig.preset("v4-tiny-a"), vocab_size=8, eos_token_id=None, bos_token_id=None)
    model = randomize_(build_model(cfg, dtype=torch.float32), seed=2).eval()  # a random MTP: mostly rejected
    sess = eager_session(model, max_batch=8, max_tokens=16, mtp_k=2)
    prompt, params, n = [3, 5, 2, 7], SamplingParams(1.0, 0.9), 480
    p1 = processed_probs(sess.logits(prompt)[-1], params)
    target = torch.stack([p1[a] * processed_probs(sess.logits(prompt + [a])[-1], params) for a in range(8)])
    counts = torch.zeros(8, 8, dtype=torch.int64)
    rounds = [0, 0]
    for seed in range(0, n, 96):  # 4 tokens: the first round drafts 2
        for r in sess.generate([prompt] * 96, max_new_tokens=4, temperature=1.0, top_p=0.9, seed=seed, mtp=2):
            counts[r.tokens[0], r.tokens[1]] += 1
            rounds[0] += r.stats["proposed_per_position"][0]
            rounds[1] += r.stats["accepted_per_position"][0]
    assert 0 < rounds[1] < rounds[0]  # first drafts both accepted and rejected
    assert chi2_pvalue(counts, target) > 1e-3


# ------------------------------------------------------------------------------------------------
# policy, arguments, statistics
# ------------------------------------------------------------------------------------------------
def test_choose_k_follows_the_measurements(bundled):
    _, sess = bundled
    spec = speculator(sess)
    saved = dict(spec.calibration)
    try:
        spec.calibration.clear()
        times = {"decode": 1.0, "verify": 1.2, "mtp": 0.1}
        spec.calibration.update({("times", 1): times, ("alpha", 0.0): ([0.9, 0.8, 0.7], 0.0),
                                 ("times", 64): {"decode": 1.0, "verify": 3.5, "mtp": 0.5},
                                 ("alpha", 1.0): ([0.3, 0.2, 0.1], 0.5)})
        k, info = choose_k(sess, spec, SamplingParams(0.0), 1, [5])
        assert k >= 2 and info["predicted_speedup"][k] > 1.5 and "k=" in info["reason"]
        k, info = choose_k(sess, spec, SamplingParams(1.0), 4, [5])  # B clipped to max_batch = 4: measure
        assert ("times", 4) in spec.calibration
        spec.calibration[("times", 4)] = {"decode": 1.0, "verify": 3.5, "mtp": 0.5}
        k, info = choose_k(sess, spec, SamplingParams(1.0), 4, [5])
        assert k == 0 and "no k" in info["reason"]
    finally:
        spec.calibration.clear()
        spec.calibration.update(saved)


@torch.no_grad()
def test_auto_records_its_decision_and_stays_exact(bundled, plain):
    _, sess = bundled
    ps, ref = plain
    out = sess.generate(ps[:2], max_new_tokens=20, mtp="auto")
    assert [r.tokens for r in out] == ref[:2]
    pol = out[0].stats["mtp_policy"]
    assert pol["k"] in range(4) and pol["reason"] and len(pol["alpha"]) == 3
    assert set(pol["step_ms"]) == {"decode", "verify", "mtp"}


def test_bad_mtp_arguments_are_named(bundled):
    _, sess = bundled
    with pytest.raises(ValueError, match="mtp"):
        sess.generate([[5, 6]], max_new_tokens=2, mtp=4)
    with pytest.raises(ValueError, match="mtp"):
        sess.generate([[5, 6]], max_new_tokens=2, mtp="fast")


# ------------------------------------------------------------------------------------------------
# the compiled artifact (bundled model, --mtp 3, target cpu)
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    from dsv4c.compile import compile_checkpoint

    out = tmp_path_factory.mktemp("mtp") / "art"
    compile_checkpoint(BUNDLE, out, target="cpu", max_tokens=104, max_batch=4, mtp_k=3, dtype=torch.float32)
    return Session.load(out)


@pytest.mark.slow
@torch.no_grad()
def test_compiled_artifact_greedy_mtp_equals_plain_and_rolls_back(compiled, bundled, plain):
    model, _ = bundled
    ps, ref = plain
    sess = compiled
    assert sess.caches["0.ring"].shape[1] == model.config.sliding_window + 3  # extra_ring_slots = K
    assert [r.tokens for r in sess.generate(ps, max_new_tokens=20)] == ref
    spec = speculator(sess)
    for k in (1, 2, 3):
        spec.draft_filter = corrupt_every_offset(k, model.config.vocab_size, dict(enumerate(ref))) if k == 2 else None
        try:
            out = sess.generate(ps, max_new_tokens=20, mtp=k)
        finally:
            spec.draft_filter = None
        assert [r.tokens for r in out] == ref, k
    (prompt,) = prompts(model.config.vocab_size, [61], seed=1)
    st = _run_rounds(model, sess, prompt, 3, 4, lambda spec, r: _assert_rolled_back(model, sess, spec, r, 3))
    assert st.replays > 0


@pytest.mark.slow
@torch.no_grad()
def test_bench_reports_speculation_statistics(compiled):
    """`dsv4c bench --mtp k`: acceptance per draft position, mean accepted length and the histogram,
    merged over the batch's requests, consistent with each other."""
    from dsv4c.bench import bench_artifact, format_table

    res = bench_artifact(compiled.art, [2], prompt_len=8, output_len=12, mtp=2, warmup=False)
    (row,) = res["rows"]
    st = row["speculation"]
    hist = st["accept_histogram"]
    assert st["mtp_k"] == 2 and len(hist) == 3 and st["rounds"] == sum(hist) > 0
    accepted = sum(a * h for a, h in enumerate(hist))
    assert row["accepted_draft_tokens"] == accepted
    assert st["mean_accepted_length"] == pytest.approx((accepted + st["rounds"]) / st["rounds"])
    # the first draft is checked in every round that drafted (rounds near max_new_tokens may draft fewer)
    assert 0 < st["proposed_per_position"][0] <= st["rounds"]
    assert st["proposed_per_position"][1] <= st["proposed_per_position"][0]
    assert all(a is None or 0 <= a <= 1 for a in st["acceptance_per_position"])
    assert "acceptance per draft position" in format_table(res)
    plain = bench_artifact(compiled.art, [2], prompt_len=8, output_len=4, mtp=0, warmup=False)
    assert "speculation" not in plain["rows"][0]
