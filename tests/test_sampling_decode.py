"""Plain decoding's sampling on the device (runtime/sampling.py `sample_rows` / `DecodeSampler`,
runtime/session.py `_Scheduler._decode_step`, issue 23): the batched draw equals the per-row rule with
the RNG contract's uniforms, keeps the processed distribution, and sampled steps are pipelined like
greedy ones: no host read of a step before the next one is queued, and mtp="auto" choosing k = 0 runs
exactly that path. Sessions run the eager model's step functions (tests/test_speculative.py)."""
from __future__ import annotations

import pytest
import torch

from dsv4c import load_model
from dsv4c.runtime.sampling import (DecodeSampler, RowParams, SamplingParams, counter_uniforms, draw_rows,
                                    processed_probs, sample_at, sample_rows)
from dsv4c.runtime.speculative import choose_k, speculator
from session_probe import serve
from test_mtp_pipeline import PARAMS
from test_speculative import BUNDLE, chi2_pvalue, eager_session, prompts


@pytest.fixture(scope="module")
def bundled():
    model = load_model(BUNDLE, dtype=torch.float32).eval()
    sess = eager_session(model)
    return sess, prompts(model.config.vocab_size)[:4]


def _reference(logits: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> list[int]:
    """Row by row: the argmax, or the inverse CDF at u of `processed_probs` (the host rule)."""
    return [int(row.argmax()) if p.temperature == 0 else int(draw_rows(processed_probs(row, p)[None], u[i:i + 1]))
            for i, (row, p) in enumerate(zip(logits, params))]


def test_sample_rows_equal_the_per_row_rule_with_the_contract_uniforms():
    B, V = 40, 13
    g = torch.Generator().manual_seed(0)
    params = [PARAMS[i % len(PARAMS)] for i in range(B)]
    seeds = list(range(100, 100 + B))
    sampler = DecodeSampler(params, seeds, "cpu")
    pos = [3 * i for i in range(B)]
    for step in range(70):  # past the table's 64 columns: it is rebuilt at the positions reached
        logits = torch.randn(B, V, generator=g) * 2
        u = counter_uniforms(torch.tensor(seeds), torch.tensor(pos), 1)[:, 0]
        got = sampler.tokens(logits, pos).tolist()
        assert got == _reference(logits, params, u) == sample_rows(logits, RowParams.of(params, "cpu"), u).tolist()
        if step % 9 == 0:
            assert [sample_at(logits[i], p, seeds[i], pos[i]) for i, p in enumerate(params)] == got
        pos = [p + 1 for p in pos]
    assert sampler.base == [3 * i + 64 for i in range(B)]
    greedy = DecodeSampler([SamplingParams(0.0)] * 3, [1, 2, 3], "cpu")
    logits = torch.randn(3, V, generator=g)
    assert greedy.tokens(logits, [0, 0, 0]).tolist() == logits.argmax(-1).tolist() and greedy.table is None


def test_min_p_keeps_the_tokens_within_its_ratio_of_the_most_likely():
    """min_p after top-k / top-p: a token stays when its probability is >= min_p x the largest (the same ratio
    before and after renormalising), then the rest is renormalised."""
    logits = torch.log(torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04]))
    got = processed_probs(logits, SamplingParams(1.0, min_p=0.3))
    want = torch.tensor([0.40, 0.25, 0.15, 0.0, 0.0, 0.0])  # >= 0.3 x 0.40 = 0.12
    torch.testing.assert_close(got, want / want.sum())
    got = processed_probs(logits, SamplingParams(1.0, top_k=2, min_p=0.7))
    torch.testing.assert_close(got, torch.tensor([1.0, 0, 0, 0, 0, 0]))  # 0.25 < 0.7 x 0.40
    assert torch.equal(processed_probs(logits, SamplingParams(1.0, min_p=0.0)), processed_probs(logits, SamplingParams(1.0)))


@pytest.mark.parametrize("params", [SamplingParams(0.8), SamplingParams(1.0, top_k=4), SamplingParams(1.2, top_p=0.7),
                                    SamplingParams(1.0, min_p=0.25)])
def test_sample_rows_follow_the_processed_distribution(params):
    """20000 rows of one logits vector, each its own seed: token frequencies follow `processed_probs`."""
    n, V = 20000, 8
    logits = torch.randn(V, generator=torch.Generator().manual_seed(3)) * 1.5
    u = counter_uniforms(torch.arange(n) + 7, torch.full((n,), 11), 1)[:, 0]
    tok = sample_rows(logits.expand(n, V), RowParams.of([params] * n, "cpu"), u)
    want = processed_probs(logits, params)
    counts = torch.bincount(tok, minlength=V)
    assert (counts[want == 0] == 0).all()  # never a token outside top-k / top-p
    keep = want > 0
    assert chi2_pvalue(counts[keep], want[keep] / want[keep].sum()) > 1e-3


@torch.no_grad()
def test_pipelined_sampling_equals_one_step_at_a_time_and_the_contract(bundled):
    """Mixed greedy and sampled rows: the pipelined steps give the tokens of the one-step-at-a-time path
    (logits on the host), each token is `sample_at` of the recorded logits row at its position, the same
    seed repeats them and another seed changes the sampled rows."""
    sess, ps = bundled

    def run(seed: int):
        reqs = sess._requests(ps, 6, 0.0, 1.0, 0, seed, None)
        for i in (1, 3):
            reqs[i].params = SamplingParams(0.9, top_p=0.95)
        reqs[2].params = SamplingParams(1.1, top_k=20)
        list(sess._serve(reqs, 0))
        return reqs

    a, b, c = run(0), run(0), run(1)
    assert [r.out for r in a] == [r.out for r in b]
    assert [a[i].out for i in (1, 2, 3)] != [c[i].out for i in (1, 2, 3)]
    assert [a[i].out for i in (0,)] == [c[i].out for i in (0,)]
    # one step at a time, recording each row (greedy and sampled requests in separate batches: the
    # recorded rows are those of serve()'s single SamplingParams)
    toks, rows = serve(sess, ps, max_new=6, temperature=0.9, top_p=0.95)
    piped = [r.tokens for r in sess.generate(ps, max_new_tokens=6, temperature=0.9, top_p=0.95, seed=5)]
    assert toks == piped
    p = SamplingParams(0.9, top_p=0.95)
    for i, (prompt, t, lg) in enumerate(zip(ps, toks, rows)):
        assert [sample_at(lg[j], p, 5 + i, len(prompt) + j - 1) for j in range(len(t))] == t


class _Tracked(torch.Tensor):
    """A decode graph's logits, and whatever is computed from them: reading one on the host (cpu, tolist,
    item, numpy, bool/int/float) is logged as "read" (a device->host sync on a GPU)."""

    log: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in {"cpu", "tolist", "item", "numpy", "__bool__", "__int__", "__float__",
                                             "__index__"}:
            cls.log.append("read")
        return super().__torch_function__(func, types, args, kwargs or {})


def _logged_generate(sess, ps, **kw) -> list[str]:
    decode = sess.graphs["decode"]

    def tracked(*args):
        args = [a.as_subclass(torch.Tensor) if isinstance(a, _Tracked) else a for a in args]
        _Tracked.log.append("launch")
        out = decode(*args)
        return (out[0].as_subclass(_Tracked),) + tuple(out[1:])

    _Tracked.log = []
    sess.graphs["decode"] = tracked
    try:
        sess.generate(ps, max_new_tokens=5, **kw)
    finally:
        sess.graphs["decode"] = decode
    return _Tracked.log


@torch.no_grad()
def test_sampled_steps_are_pipelined_like_greedy_and_auto_k0_is_the_same_path(bundled):
    """Each decode step's tokens are read on the host once, after the next step was queued (greedy,
    sampled, and mtp="auto" when it picks plain decoding); the one-step-at-a-time path reads before."""
    sess, ps = bundled
    pipelined = ["launch"] + ["launch", "read"] * 3 + ["read"]  # 4 steps after the prefill's token
    assert _logged_generate(sess, ps, temperature=0.0) == pipelined
    assert _logged_generate(sess, ps, temperature=0.8, seed=3) == pipelined
    assert _logged_generate(sess, ps[:3], temperature=0.8, top_k=5, top_p=0.9, seed=3) == pipelined
    spec = speculator(sess)
    saved, observed = dict(spec.calibration), dict(spec.observed)
    try:
        spec.calibration.clear()
        spec.observed.clear()
        spec.round_seen = spec.step_seen = None  # untimed: the costly calibration is the truth
        for T in (0.0, 0.8):
            costly = {"step": 1.0, "round": {1: 3.0, 2: 4.0, 3: 5.0}}  # rounds cost more than they emit
            spec.calibration[("costs", 4, "sample" if T else "greedy")] = costly
            for _ in range(40):
                spec.observe(T, 3, 3)
            assert choose_k(sess, spec, SamplingParams(T), 4, ps)[0] == 0
            assert _logged_generate(sess, ps, temperature=T, seed=3, mtp="auto") == pipelined
    finally:
        spec.calibration.clear()
        spec.calibration.update(saved)
        spec.observed.clear()
        spec.observed.update(observed)
    sess.host_steps = True
    try:
        log = _logged_generate(sess, ps, temperature=0.8, seed=3)
        steps = [c.split() for c in " ".join(log).split("launch")[1:]]
        assert len(steps) == 4 and all(steps)  # every step read before the next one is queued
    finally:
        sess.host_steps = False
