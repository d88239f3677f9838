"""MTP speculative decoding (runtime/speculative.py, issue 8): greedy equals plain greedy, rejection
sampling keeps the target distribution, and rollback leaves the caches of a fresh prefill.

Most tests run the Session over the eager model's traceable `step`/`mtp_step` ("eager graphs": the
same call signature, flat caches, slots, positions and n_real as the compiled graphs), which keeps them
fast; tests/test_speculative_compiled.py runs an artifact of the bundled model's first three layers compiled
with --mtp 3 (slow: export; a file of its own so that the two halves run on different xdist workers)."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
import cut_presets

from dsv4c import ModelConfig, load_model
from dsv4c.export import VerifyMTPStepModule, unflat_caches
from dsv4c.model import build_model, randomize_
from dsv4c.runtime import Session
from dsv4c.runtime.sampling import SamplingParams, processed_probs
from dsv4c.runtime.speculative import SpecStats, Speculator, accept_drafts, choose_k, speculator

BUNDLE = Path(__file__).resolve().parents[1] / "examples" / "models" / "v4-tiny-pystdlib"
# mixed lengths; 70 > W = 64 (the MTP fill starts at n - W, the ring wraps)
PROMPT_LENS = [3, 11, 70, 6, 25]


def eager_session(model, max_batch: int = 4, max_tokens: int = 104, mtp_k: int = 3, fused: bool = True) -> Session:
    """A Session whose graphs are the eager model's step functions (graph_mode off). `fused`: with the
    `verify_mtp` graph (the export wrapper `VerifyMTPStepModule`, run eagerly), else as an artifact
    compiled before it."""
    cache = model.new_cache(1, max_len=1)
    cls, n_layers = type(cache.layers[0]), len(cache.layers)
    verify_mtp = VerifyMTPStepModule(model, cls, n_layers)

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
    if fused:
        kinds["verify_mtp"] = 1 + mtp_k
    manifest = {"model_config": model.config.to_dict(), "dtype": str(model.act_dtype).replace("torch.", ""),
                "limits": {"max_tokens": max_tokens, "max_batch": max_batch, "cache_slots": max_batch + 1},
                "mtp_k": mtp_k, "buckets": [], "target": {"name": "cpu"},
                "graphs": {k: {"weights": [], "tokens_per_seq": t, "kind": k} for k, t in kinds.items()}}
    graphs = {"prefill": main, "decode": fixed(1, main), "verify": fixed(1 + mtp_k, main),
              "mtp": fixed(1 + mtp_k, mtp)}
    if fused:
        graphs["verify_mtp"] = fixed(1 + mtp_k, lambda *args: verify_mtp(*args[:-1]))
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
def unfused(bundled):
    """The same model as an artifact without the verify_mtp graph (compiled before it existed)."""
    return eager_session(bundled[0], fused=False)


def _session(bundled, unfused, fused: bool) -> Session:
    sess = bundled[1] if fused else unfused
    assert speculator(sess).fused is fused
    return sess


@pytest.fixture(scope="module")
def plain(bundled):
    model, sess = bundled
    ps = prompts(model.config.vocab_size)
    with torch.no_grad():
        return ps, [r.tokens for r in sess.generate(ps, max_new_tokens=20)]


def _check_stats(st: dict, k: int, n_tokens: int, fused: bool) -> None:
    # greedy: every round but the last (which ends the request) takes its next first draft from the fused graph
    assert st["fused_rounds"] == (max(st["rounds"] - 1, 0) if fused else 0) and st["fallback_refreshes"] == 0
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
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("k", [1, 2, 3])
@torch.no_grad()
def test_greedy_mtp_equals_plain_greedy(bundled, unfused, plain, k, fused):
    sess = _session(bundled, unfused, fused)
    ps, ref = plain
    out = sess.generate(ps, max_new_tokens=20, mtp=k)  # 5 prompts through 4 slots
    assert [r.tokens for r in out] == ref
    for r in out:
        _check_stats(r.stats, k, len(r.tokens), fused)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("k", [1, 3])
@torch.no_grad()
def test_greedy_with_forced_rejection_at_every_offset(bundled, unfused, plain, k, fused):
    model, _ = bundled
    sess = _session(bundled, unfused, fused)
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
    assert (sum(r.stats["fused_rounds"] for r in out) > 0) is fused
    assert sum(r.stats["fallback_refreshes"] for r in out) == 0  # greedy rows never fall back


@torch.no_grad()
def test_device_greedy_round_equals_host_round(bundled, plain, monkeypatch):
    """All rows greedy on the fused graph: the pipelined rounds (acceptance, next inputs and positions
    decided on the device, round r+1 queued before round r is read) give the same tokens, acceptance
    and fused rounds per request as the one-round host path (host distributions and
    `accept_drafts`), with 5 prompts through 4 slots."""
    from dsv4c.runtime import speculative as sp

    _, sess = bundled
    ps, ref = plain
    spec = speculator(sess)
    keys = ("accept_histogram", "accepted_per_position", "fused_rounds", "fallback_refreshes")
    calls = []
    launch = sp._Pipeline.launch
    monkeypatch.setattr(sp._Pipeline, "launch", lambda self, st, **kw: calls.append(1) or launch(self, st, **kw))
    runs, device_rounds = {}, {}
    try:
        for host in (False, True):
            spec.host_drafts = host
            calls.clear()
            out = sess.generate(ps, max_new_tokens=20, mtp=3)
            runs[host] = [(r.tokens, {n: r.stats[n] for n in keys}) for r in out]
            device_rounds[host] = len(calls)
    finally:
        spec.host_drafts = False
    assert device_rounds[False] > 0 and device_rounds[True] == 0
    assert runs[False] == runs[True]
    assert [t for t, _ in runs[False]] == ref
    assert sum(st["accept_histogram"][0] for _, st in runs[False]) > 0  # rejections happened


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
    g = 4 if kind.startswith("idx") else m  # comp_* / idx_*: position p at row p mod R
    c = 2 if g == 4 else 1
    lo = max(0, (n // g - (c - 1)) * g)  # the open group, and for CSA the previous one
    return t[[p % t.shape[0] for p in range(lo, n)]]


def _closing_rejections(n_start: int, trace: list, k: int, group_sizes=(4, 16)) -> int:
    """Rounds whose rejected positions include one where a compressor group closes: the verify
    pooled rejected rows into an entry and the kept rows must still serve the accepted ones.
    trace: (positions fed, acceptance histogram) after each round."""
    count, n_prev, hist_prev = 0, n_start, [0] * (k + 1)
    for n, hist in trace:
        a = n - n_prev - 1
        assert hist[a] == hist_prev[a] + 1
        rejected = range(n_prev + a + 1, n_prev + k + 1)
        count += any((p + 1) % m == 0 for m in group_sizes for p in rejected)
        n_prev, hist_prev = n, hist
    return count


def _rollback_check(model, sess, K: int, trace: list):
    def check(spec, r):
        _assert_rolled_back(model, sess, spec, r, K)
        trace.append((len(r.ids) + len(r.out) - 1, list(r.spec.histogram)))
    return check


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


def _run_rounds(model, sess, prompt: list[int], k: int, rounds: int, check, temperature: float = 0.0) -> SpecStats:
    """Drive one sequence round by round (as Session._serve does), rejecting at every offset in turn,
    and call check after every round. Greedy: the drafts are the true continuation but for the
    corrupted one; sampling: the MTP's drafts with one corrupted."""
    spec = speculator(sess)
    n_new = rounds * (k + 1) + 2
    truth = sess.generate([prompt], max_new_tokens=n_new)[0].tokens if temperature == 0 else None
    spec.k = k
    spec.draft_filter = corrupt_every_offset(k, model.config.vocab_size, truth and {0: truth})
    (r,) = sess._requests([prompt], n_new, temperature, 1.0, 0, 0, None)
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


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@torch.no_grad()
def test_rolled_back_caches_equal_fresh_prefill_v4(bundled, unfused, fused):
    model, _ = bundled
    sess = _session(bundled, unfused, fused)
    (prompt,) = prompts(model.config.vocab_size, [61], seed=1)  # the verify chunks cross W and groups of 4/16
    trace = []
    st = _run_rounds(model, sess, prompt, 3, 8, _rollback_check(model, sess, 3, trace))
    assert _closing_rejections(len(prompt), trace, 3) > 0 and min(st.histogram) > 0
    assert st.fused_rounds == (8 if fused else 0) and st.fallback_refreshes == 0


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("k", [1, 3])
@torch.no_grad()
def test_fused_refresh_equals_separate_refresh(bundled, unfused, k):
    """After every round (accepted and rejected ones in turn) the fused path's MTP caches, MTP position
    and next-round draft (logits, streams) equal what the separate `mtp` refresh gives: the caches
    bitwise here, the draft within 1e-6 (the MTP block runs over 1 + k rows instead of a + 1)."""
    model, _ = bundled
    cfg = model.config
    (prompt,) = prompts(cfg.vocab_size, [61], seed=1)

    def trace(sess):
        out = []

        def record(spec, r):
            n, q = len(r.ids) + len(r.out) - 1, spec.seqs[r.slot]
            mtp = {name: _valid(name, t[r.slot], n, cfg, True).clone() for name, t in spec.mtp_caches.items()}
            out.append((list(r.out), int(spec.mtp_pos[r.slot]), list(r.spec.histogram), mtp,
                        q.draft_logits.clone(), q.draft_z.clone()))
        st = _run_rounds(model, sess, prompt, k, 6, record)
        return out, st

    got, st_f = trace(bundled[1])
    want, st_u = trace(unfused)
    assert st_f.fused_rounds == 6 and st_u.fused_rounds == 0
    outcomes = set()
    for i, (g, w) in enumerate(zip(got, want)):
        assert g[:3] == w[:3], i  # tokens, MTP position, acceptance so far
        outcomes.add(g[2].index(max(g[2])) if i == 0 else
                     next(a for a, (x, y) in enumerate(zip(g[2], got[i - 1][2])) if x != y))
        for name in w[3]:
            assert torch.equal(g[3][name], w[3][name]), (i, name)
        assert _rel(g[4], w[4]) < 1e-6 and _rel(g[5], w[5]) < 1e-6, i
    assert outcomes == set(range(k + 1))  # rejected at every offset and fully accepted


@torch.no_grad()
def test_sampling_rows_fall_back_to_the_separate_refresh(bundled):
    """Temperature > 0: a row keeps the fused result only when its committed tokens were the argmax;
    the others refresh separately. Either way the caches and the pending draft equal a fresh prefill."""
    model, sess = bundled
    (prompt,) = prompts(model.config.vocab_size, [40], seed=3)
    st = _run_rounds(model, sess, prompt, 2, 8, lambda spec, r: _assert_rolled_back(model, sess, spec, r, 3),
                     temperature=0.7)
    assert st.fused_rounds > 0 and st.fallback_refreshes > 0 and st.fused_rounds + st.fallback_refreshes == 8


@torch.no_grad()
def test_mixed_greedy_and_sampling_rows_in_one_round(bundled, plain):
    """One batch, rows at temperature 0 and 0.8: the greedy rows take the fused path and equal plain
    greedy; sampling rows whose tokens were not the argmax fall back, row by row."""
    _, sess = bundled
    ps, ref = plain
    reqs = sess._requests(ps, 20, 0.0, 1.0, 0, 0, None)
    for i in (1, 3):
        reqs[i].params = SamplingParams(0.8)
    list(sess._serve(reqs, 2))
    st = [sess._result(r).stats for r in reqs]
    for i in (0, 2, 4):
        assert reqs[i].out == ref[i]
        _check_stats(st[i], 2, len(reqs[i].out), True)
    assert sum(st[i]["fallback_refreshes"] for i in (1, 3)) > 0
    assert all(st[i]["fused_rounds"] + st[i]["fallback_refreshes"] == st[i]["rounds"] - 1 for i in (1, 3))


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
    follow p(x1)·p(x2 | x1) computed from the model's own logits. The rounds run the fused graph: rows whose
    tokens were the argmax keep its MTP output, the others refresh separately (both happen here)."""
    # cut_presets.small(): one layer of each kind (sliding, CSA, HCA) and the MTP block; the property needs no more
    cfg = dataclasses.replace(cut_presets.small("v4-tiny-a"), vocab_size=8, eos_token_id=None, bos_token_id=None)
    model = randomize_(build_model(cfg, dtype=torch.float32), seed=2).eval()  # a random MTP: mostly rejected
    sess = eager_session(model, max_batch=96, max_tokens=16, mtp_k=2)  # each generate() below in one batch
    prompt, params, n = [3, 5, 2, 7], SamplingParams(1.0, 0.9), 480
    p1 = processed_probs(sess.logits(prompt)[-1], params)
    target = torch.stack([p1[a] * processed_probs(sess.logits(prompt + [a])[-1], params) for a in range(8)])
    counts = torch.zeros(8, 8, dtype=torch.int64)
    rounds = [0, 0, 0, 0]
    for seed in range(0, n, 96):  # 4 tokens: the first round drafts 2
        for r in sess.generate([prompt] * 96, max_new_tokens=4, temperature=1.0, top_p=0.9, seed=seed, mtp=2):
            counts[r.tokens[0], r.tokens[1]] += 1
            rounds[0] += r.stats["proposed_per_position"][0]
            rounds[1] += r.stats["accepted_per_position"][0]
            rounds[2] += r.stats["fused_rounds"]
            rounds[3] += r.stats["fallback_refreshes"]
    assert 0 < rounds[1] < rounds[0]  # first drafts both accepted and rejected
    assert rounds[2] > 0 and rounds[3] > 0  # fused and fallback refreshes
    assert chi2_pvalue(counts, target) > 1e-3


# ------------------------------------------------------------------------------------------------
# policy, arguments, statistics
# ------------------------------------------------------------------------------------------------
def test_choose_k_follows_the_measurements(bundled):
    """The policy from measured step / round times and observed acceptance: S(k) = τ(k) t_step / t_round(k);
    a measured cost per batch and sampling mode; a loss or a gain below 5% keeps plain decoding."""
    _, sess = bundled
    spec = speculator(sess)
    saved, observed, n_cal = dict(spec.calibration), dict(spec.observed), spec.calibration_tokens
    try:
        spec.calibration.clear()
        spec.observed.clear()  # earlier tests' rounds
        spec.round_seen = spec.step_seen = None  # untimed: the given costs are the true ones
        for a in [3] * 60 + [2] * 20 + [1] * 10 + [0] * 10:  # α = 0.9, 0.889, 0.75 (a of k = 3 drafts)
            spec.observe(0.0, a, 3)
        alpha = [90 / 100, 80 / 90, 60 / 80]
        tau = [1 + sum(math.prod(alpha[: j + 1]) for j in range(k)) for k in range(4)]
        spec.calibration[("costs", 1, "greedy")] = {"step": 1.0, "round": {1: 1.2, 2: 1.3, 3: 2.5}}
        k, info = choose_k(sess, spec, SamplingParams(0.0), 1, [[5]])
        assert k == 2 and info["predicted_speedup"][2] == pytest.approx(tau[2] / 1.3, abs=1e-3)
        assert info["predicted_speedup"][1] == pytest.approx(tau[1] / 1.2, abs=1e-3)
        assert info["alpha"] == [round(a, 3) for a in alpha] and info["alpha_source"].startswith("observed over 100 rounds")
        assert info["step_ms"] == {0: 1e3, 1: 1.2e3, 2: 1.3e3, 3: 2.5e3} and info["mode"] == "greedy"
        # rounds that cost more than they emit: plain decoding
        spec.calibration[("costs", 1, "greedy")] = {"step": 1.0, "round": {1: 2.0, 2: 2.8, 3: 3.5}}
        k0, lost = choose_k(sess, spec, SamplingParams(0.0), 1, [[5]])
        assert k0 == 0 and "no k predicts" in lost["reason"]
        # a gain below the margin is not taken either
        spec.calibration[("costs", 1, "greedy")] = {"step": 1.0, "round": {1: tau[1] / 1.04, 2: tau[2] / 1.03,
                                                                          3: tau[3] / 1.02}}
        assert choose_k(sess, spec, SamplingParams(0.0), 1, [[5]])[0] == 0
        # sampling is another mode (its own costs, measured at B clipped to max_batch = 4) and another
        # temperature bucket (its own acceptance, observed by a calibration run when there is none)
        spec.calibration_tokens = 4
        k, info = choose_k(sess, spec, SamplingParams(1.0), 9, [[5, 6, 7]])
        costs = spec.calibration[("costs", 4, "sample")]
        assert set(costs["round"]) == {1, 2, 3} and costs["step"] > 0 and info["batch"] == 4
        assert spec.observed[1.0].prop[0] > 0 and info["alpha_source"].startswith("observed")
        assert all(costs["spread"][k] >= 0 for k in range(4))  # interleaved repeats: their spread is reported
        spec.calibration[("costs", 4, "sample")] = {"step": 1.0, "round": {1: 3.5, 2: 4.0, 3: 4.5}}
        assert choose_k(sess, spec, SamplingParams(1.0), 4, [[5]])[0] == 0
        # acceptance observed later moves the decision: every first draft rejected; the counts forget, so
        # 900 rejections weigh more than against the 100 rounds before (90 / 1000 without forgetting)
        spec.calibration[("costs", 1, "greedy")] = {"step": 1.0, "round": {1: 1.2, 2: 1.3, 3: 2.5}}
        for _ in range(900):
            spec.observe(0.0, 0, 3)
        k, info = choose_k(sess, spec, SamplingParams(0.0), 1, [[5]])
        assert k == 0 and info["alpha"][0] < 0.09 / 2
    finally:
        spec.calibration.clear()
        spec.calibration.update(saved)
        spec.observed.clear()
        spec.observed.update(observed)
        spec.calibration_tokens = n_cal


@torch.no_grad()
def test_auto_records_its_decision_and_stays_exact(bundled, plain):
    _, sess = bundled
    ps, ref = plain
    spec = speculator(sess)
    n_cal, spec.calibration_tokens = spec.calibration_tokens, 4
    try:
        out = sess.generate(ps[:2], max_new_tokens=20, mtp="auto")
    finally:
        spec.calibration_tokens = n_cal
    assert [r.tokens for r in out] == ref[:2]
    pol = out[0].stats["mtp_policy"]
    assert pol["k"] in range(4) and pol["reason"] and len(pol["alpha"]) == 3
    assert (pol["k"] > 0) == (max(pol["predicted_speedup"].values()) >= 1.05)
    assert set(pol["step_ms"]) == {0, 1, 2, 3} and all(v > 0 for v in pol["step_ms"].values())


def test_bad_mtp_arguments_are_named(bundled):
    _, sess = bundled
    with pytest.raises(ValueError, match="mtp"):
        sess.generate([[5, 6]], max_new_tokens=2, mtp=4)
    with pytest.raises(ValueError, match="mtp"):
        sess.generate([[5, 6]], max_new_tokens=2, mtp="fast")
