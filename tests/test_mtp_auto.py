"""mtp="auto" while running (runtime/speculative.py `plan_auto`, `AutoRun`, issue 23 item 3): the k follows
the acceptance observed on the traffic, not only the calibration's; probes from k = 0 (and below K) are
paid from a budget of PROBE_SHARE of the decode time; predictions within noise do not flip-flop; and the
switches inside a generate call keep the output exact.

The policy tests run `plan_auto` / `AutoRun` against test doubles: a Speculator stand-in, calibrated
costs given as numbers, and traffic that accepts each draft position with a chosen probability. The
session tests run the eager bundled model (tests/test_speculative.py `eager_session`) with controlled
costs and acceptance estimates."""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from dsv4c import load_model
from dsv4c.runtime import speculative as sp
from dsv4c.runtime.sampling import SamplingParams
from dsv4c.runtime.speculative import (MIN_ROUND_SAMPLES, MIN_STEP_SAMPLES, PROBE_ROUNDS, PROBE_SHARE,
                                       RECHOOSE_ROUNDS, Acceptance, AutoRun, Speculator, pick_k, plan_auto,
                                       predicted_speedups, speculator)
from test_sampling_decode import _logged_generate
from test_speculative import BUNDLE, eager_session, prompts

COSTS = {"step": 1.0, "round": {1: 1.3, 2: 1.45, 3: 1.9}}  # seconds (any unit): plain step, k-draft rounds


# ------------------------------------------------------------------------------------------------
# test doubles
# ------------------------------------------------------------------------------------------------
class FakeSpec:
    """What the auto policy uses of a Speculator: K, k, the acceptance store, the budget, the last k, and
    the round timings (`clock`: None leaves rounds untimed, so the calibrated costs are the true ones)."""

    observe = Speculator.observe
    acceptance = Speculator.acceptance

    def __init__(self, K: int = 3, costs: dict = COSTS, B: int = 8, clock=None):
        self.K, self.k, self.auto = K, K, None
        self.observed, self.auto_last, self.probe_budget = {}, {}, {}
        self.calibration = {("costs", B, "greedy"): costs}
        self.calibration_tokens = 8
        self.round_seen, self.clock = ({} if clock else None), clock
        self.step_seen = None  # plain steps untimed (a test sets a dict)


@dataclass(frozen=True)
class FakeConfig:
    is_v4: bool = True
    sliding_window: int = 64


@dataclass
class FakeSess:
    max_batch: int = 8
    max_tokens: int = 512
    config: FakeConfig = FakeConfig()


@dataclass
class FakeReq:
    ids: list
    max_new: int
    params: SamplingParams = SamplingParams(0.0)


def prior(spec: FakeSpec, alpha: list[float], n: int = 64) -> None:
    """A calibration run's acceptance: n K-draft rounds with exactly these per-position rates."""
    acc = spec.acceptance(0.0)
    acc.prop = [float(n)] * spec.K
    acc.acc = [a * n for a in alpha]
    acc.checks = n


def traffic(rng: random.Random, alpha: list[float], k: int) -> int:
    """Accepted drafts of one row's k-draft round: position j accepted with probability alpha[j]."""
    a = 0
    while a < k and rng.random() < alpha[a]:
        a += 1
    return a


def run_rounds(spec: FakeSpec, run: AutoRun, alpha: list[float], n: int, B: int, rng: random.Random) -> list[int]:
    """Up to n rounds of B rows at the run's k (observed, then `after_round`) -> the k of each round."""
    ks = []
    for _ in range(n):
        k = run.k
        if k == 0:
            break
        for _ in range(B):
            spec.observe(0.0, traffic(rng, alpha, k), k)
        run.after_round(k)
        ks.append(k)
    return ks


def plan(spec: FakeSpec, B: int = 8, max_new: int = 96) -> AutoRun:
    run = plan_auto(FakeSess(), spec, [FakeReq([1] * 20, max_new) for _ in range(B)])
    spec.auto = run if run.k else None
    return run


def best_k(alpha: list[float], costs: dict = COSTS) -> int:
    pred = predicted_speedups(costs, alpha)
    return max(pred, key=pred.get)


# ------------------------------------------------------------------------------------------------
# the policy
# ------------------------------------------------------------------------------------------------
def test_auto_converges_to_the_best_k_of_the_traffic_not_of_the_calibration():
    """The calibration saw little acceptance past the first draft (k = 1 predicted best); the traffic
    accepts deeper drafts (k = 2 is best). Running at k = 1 observes only position 1, so the budgeted
    probes at K find position 2's acceptance and auto moves to k = 2 and stays; the probes' share of the
    rounds is what the budget allows."""
    true = [0.8, 0.7, 0.3]
    spec, rng = FakeSpec(), random.Random(0)
    prior(spec, [0.75, 0.2, 0.2])
    assert best_k(true) == 2 and best_k([0.75, 0.2, 0.2]) == 1
    run = plan(spec)
    assert run.k == 1 and not run.info["probe"]
    ks = run_rounds(spec, run, true, 1500, 8, rng)
    assert len(ks) == 1500 and ks[-300:].count(2) >= 300 - 2 * PROBE_ROUNDS  # settled, only probes leave it
    first = next(i for i, k in enumerate(ks) if k == 2)
    probes = [h for h in run.history if h["reason"] == "probe"]
    assert probes and all(h["round"] >= RECHOOSE_ROUNDS for h in probes)
    # the budget: probes at K cost PROBE_ROUNDS * (t_3 - t_k) at most PROBE_SHARE of the time run
    t_run = sum(COSTS["round"][k] for k in ks)
    probe_cost = sum(PROBE_ROUNDS * (COSTS["round"][3] - COSTS["round"][ks[h["round"] - 1]]) for h in probes)
    assert probe_cost <= PROBE_SHARE * t_run + 1e-9
    assert first < 800, first  # the first probe comes once ~1% of the time paid for it


def test_auto_leaves_speculation_when_the_traffic_accepts_nothing_and_probes_back():
    """A high-acceptance calibration (k = 3), then traffic that accepts nothing: auto drops to k = 0 within a
    few re-choices. Then plain calls earn probe budget; once it holds a probe's worst-case cost a call
    starts with PROBE_ROUNDS rounds at K, which see the traffic accept again, and auto speculates."""
    spec, rng = FakeSpec(), random.Random(1)
    prior(spec, [0.9, 0.9, 0.9])
    run = plan(spec)
    assert run.k == best_k([0.9] * 3) > 0
    ks = run_rounds(spec, run, [0.0] * 3, 200, 8, rng)
    assert run.k == 0 and len(ks) <= 6 * RECHOOSE_ROUNDS, len(ks)
    assert run.history[-1]["k"] == 0 and spec.auto_last[(8, "greedy", 0.0)] == 0
    calls, budget_start = 0, spec.probe_budget.get((8, "greedy", 0.0), 0.0)
    while True:  # the traffic accepts again; plain calls until one probes
        run = plan(spec)
        calls += 1
        if run.info["probe"]:
            break
        assert run.k == 0 and calls < 200
    earned = budget_start + calls * PROBE_SHARE * 96 * COSTS["step"]
    assert run.info["probe_cost_ms"] / 1e3 <= earned + 1e-9 and calls > 1  # paid from what plain calls earned
    assert run.k == 3 and run.k_run == 0
    ks = run_rounds(spec, run, [0.9, 0.8, 0.7], PROBE_ROUNDS, 8, rng)
    assert ks == [3] * PROBE_ROUNDS and run.k == best_k([0.9, 0.8, 0.7]) > 0
    assert plan(spec).k == run.k  # the next call starts speculating


def test_auto_does_not_flip_flop_between_k_that_predict_within_noise():
    """Costs that make k = 2 and k = 3 predict the same on the traffic: each re-choice sees them within
    noise of each other (α_3's estimate moves with every window), and the run keeps one k (hysteresis,
    `pick_k`); a clear gain (> SWITCH_MARGIN) still moves it."""
    true = [0.8, 0.7, 0.5]
    costs = {"step": 1.0, "round": {1: 1.3, 2: 1.45, 3: 1.45 * 2.64 / 2.36}}
    pred = predicted_speedups(costs, true)
    assert abs(pred[3] / pred[2] - 1) < 1e-9
    spec, rng = FakeSpec(costs=costs), random.Random(2)
    prior(spec, [0.8, 0.7, 0.6])
    run = plan(spec)
    assert run.k == 3
    ks = run_rounds(spec, run, true, 600, 8, rng)
    switches = [h for h in run.history if h["reason"] == "observed"]
    assert len(switches) <= 2, switches
    assert pick_k({0: 1.0, 1: 1.30, 2: 1.31}, 1) == 1 and pick_k({0: 1.0, 1: 1.30, 2: 1.35}, 1) == 2
    assert pick_k({0: 1.0, 1: 0.99}, 1) == 1 and pick_k({0: 1.0, 1: 0.95}, 1) == 0
    assert pick_k({0: 1.0, 1: 1.04}, 0) == 0 and pick_k({0: 1.0, 1: 1.06}, 0) == 1


def test_auto_corrects_the_calibrated_round_times_with_the_rounds_it_times():
    """The calibration's rounds were faster than the traffic's (run29, batch 8: k = 1 calibrated 1.92 ms,
    2.40 ms paid): the rounds actually take 1.6x the calibrated time at every k. Auto starts at the k the
    calibration predicts, times its rounds, and within a few re-choices drops to plain decoding, where the
    paid times predict a loss; the next call plans with them and starts plain. Measured α alone (right
    here) would have kept speculating."""
    true = [0.75, 0.6, 0.3]
    slow = {k: 1.6 * t for k, t in COSTS["round"].items()}
    assert best_k(true) > 0 and best_k(true, {**COSTS, "round": slow}) == 0
    now = [0.0]
    spec, rng = FakeSpec(clock=lambda: now[0]), random.Random(3)
    prior(spec, true)
    run = plan(spec)
    assert run.k == best_k(true)
    rounds = 0
    while run.k and rounds < 200:
        k = run.k
        for _ in range(8):
            spec.observe(0.0, traffic(rng, true, k), k)
        now[0] += slow[k]
        run.after_round(k)
        rounds += 1
    assert run.k == 0 and rounds <= MIN_ROUND_SAMPLES + 2 * RECHOOSE_ROUNDS, rounds
    used = sp.observed_costs(spec, 8, "greedy", COSTS)
    assert all(abs(used["round"][k] / slow[k] - 1) < 1e-9 for k in slow)  # observed at one k, scaled at the others
    nxt = plan(spec)
    assert nxt.k == 0 and "round_ms_observed" in nxt.info and not nxt.info["probe"]


def test_round_timing_skips_an_admission_and_a_change_of_k():
    """Intervals are per k, and an admission (the scheduler calls `restart_timing`) starts a new one: its
    prefill is no round's cost."""
    now = [0.0]
    spec = FakeSpec(clock=lambda: now[0])
    prior(spec, [0.9, 0.8, 0.7])
    run = plan(spec)
    k = run.k
    assert k >= 2
    for gap in (1.0, 1.0, 50.0, 1.0):  # rounds read at 1, 2, 52, 53 s; the 50 s follow an admission
        if gap == 50.0:
            run.restart_timing()
        now[0] += gap
        run.after_round(k)
    assert list(spec.round_seen[(8, "greedy", k)]) == [1.0, 1.0]
    now[0] += 7.0
    run.after_round(k - 1)  # another k: no interval
    assert (8, "greedy", k - 1) not in spec.round_seen and len(spec.round_seen[(8, "greedy", k)]) == 2


def test_auto_plans_with_the_plain_step_time_the_traffic_paid():
    """run24: the calibration put the plain step 20% above what plain decoding then ran at, so auto
    speculated where k = 0 was faster. Plain steps timed on the traffic (`Session.step_seen`, MIN_STEP_SAMPLES
    of them at the call's rows and mode) replace the calibrated step: here a step 0.6x the calibrated one
    turns k = 1's predicted 1.35x into a loss, and auto plans plain decoding."""
    from collections import deque

    true = [0.75, 0.6, 0.3]
    spec = FakeSpec()
    prior(spec, true)
    spec.step_seen = {(8, "greedy"): deque([0.6] * (MIN_STEP_SAMPLES - 1))}
    assert plan(spec).k == best_k(true) > 0  # too few plain steps timed: the calibration holds
    spec.auto_last.clear()
    spec.step_seen[(8, "greedy")].append(0.6)
    spec.step_seen[(4, "greedy")] = deque([0.01] * 64)  # another batch size: not this cell's
    run = plan(spec)
    assert run.k == 0 and run.info["step_ms_observed"] == 600.0 and run.info["predicted_speedup"][1] < 1


def test_plain_decode_steps_are_timed_per_rows_and_mode(bundled):
    """The scheduler times consecutive pipelined plain steps of the same slots (`_time_step`), keyed by the
    rows and their sampling mode: 12 tokens, the first from prefill, give at most 10 intervals."""
    sess, ps, ref = bundled
    sess.step_seen.clear()
    with torch.no_grad():
        out = sess.generate(ps, max_new_tokens=12)
    assert [r.tokens for r in out] == [t[:12] for t in ref]
    (cell, seen), = sess.step_seen.items()
    assert cell == (4, "greedy") and 5 <= len(seen) <= 10 and all(t > 0 for t in seen), (cell, list(seen))


def test_acceptance_forgets_by_halving_and_keeps_the_ratios():
    acc = Acceptance.empty(2)
    for a in [2] * 30 + [1] * 10 + [0] * 10:
        acc.add(a, 2)
    assert acc.alpha() == [40 / 50, 30 / 40] and acc.checks == 50
    acc.forget(sp.ACCEPT_WINDOW)
    assert acc.alpha() == pytest.approx([0.8, 0.75]) and acc.prop[0] == pytest.approx(25)
    for _ in range(sp.ACCEPT_WINDOW * 4):
        acc.add(0, 2)
    assert acc.alpha()[0] < 0.01 and acc.checks == 50 + 4 * sp.ACCEPT_WINDOW


# ------------------------------------------------------------------------------------------------
# the session: switches inside a generate call stay exact; auto's k = 0 path is plain decoding
# ------------------------------------------------------------------------------------------------
class Flip(Acceptance):
    """An acceptance estimate that reads `first` for its first `n` reads of alpha(), then `then`."""

    def __init__(self, K: int, first: list[float], then: list[float], n: int = 1):
        super().__init__([0.0] * K, [1e3] * K, checks=10 ** 6)
        self.first, self.then, self.n = first, then, n

    def alpha(self) -> list[float]:
        self.n -= 1
        return list(self.first if self.n >= 0 else self.then)


@pytest.fixture(scope="module")
def bundled():
    model = load_model(BUNDLE, dtype=torch.float32).eval()
    sess = eager_session(model)
    ps = prompts(model.config.vocab_size, [3, 11, 30, 6])
    with torch.no_grad():
        ref = [r.tokens for r in sess.generate(ps, max_new_tokens=40)]
    return sess, ps, ref


def _setup(spec, flip: Flip, costs: dict = COSTS) -> None:
    spec.calibration.clear()
    spec.calibration[("costs", 4, "greedy")] = costs
    spec.observed.clear()
    spec.observed[0.0] = flip
    spec.auto_last.clear()
    spec.probe_budget.clear()
    spec.round_seen = spec.step_seen = None  # untimed: the controlled costs are the true ones


@torch.no_grad()
def test_auto_drops_to_plain_decoding_inside_a_generate_and_stays_exact(bundled):
    """Pipelined rounds at k = 3, then the estimate says nothing is accepted: at the next re-choice the
    pipeline stops launching, the scheduler goes on with plain decode steps, and every token equals
    plain greedy decoding."""
    sess, ps, ref = bundled
    spec = speculator(sess)
    _setup(spec, Flip(3, [0.9] * 3, [0.0] * 3))
    out = sess.generate(ps, max_new_tokens=40, mtp="auto")
    assert [r.tokens for r in out] == ref
    pol = out[0].stats["mtp_policy"]
    assert pol["k"] >= 1 and pol["k_last"] == 0 and pol["history"][-1]["round"] == RECHOOSE_ROUNDS
    assert 0 < out[0].stats["rounds"] <= RECHOOSE_ROUNDS + 1  # the round in flight at the switch is kept
    assert spec.auto is None  # the next call starts from its own plan


@torch.no_grad()
def test_auto_probes_from_plain_decoding_and_then_speculates_exactly(bundled):
    """k = 0 chosen (the estimate accepts nothing) with a probe in the budget: the call starts with
    PROBE_ROUNDS rounds at K, the estimate now accepts, and it keeps speculating; the tokens are plain
    greedy's. Without budget the same call runs plain decoding with no extra host reads."""
    sess, ps, ref = bundled
    spec = speculator(sess)
    _setup(spec, Flip(3, [0.0] * 3, [0.9] * 3, n=3))
    pipelined = ["launch"] + ["launch", "read"] * 3 + ["read"]
    for _ in range(2):  # budget below a probe's cost: plain decoding, read once per step after the next launch
        assert _logged_generate(sess, ps, mtp="auto") == pipelined
    cell = (4, "greedy", 0.0)
    assert 0 < spec.probe_budget[cell] < PROBE_ROUNDS * (COSTS["round"][3] - COSTS["step"])
    spec.probe_budget[cell] = 1e9  # as if plain decoding had run long enough
    spec.observed[0.0].n = 1  # the plan reads "nothing accepted" once more
    out = sess.generate(ps, max_new_tokens=40, mtp="auto")
    assert [r.tokens for r in out] == ref
    pol = out[0].stats["mtp_policy"]
    assert pol["k"] == 0 and pol["probe"] and pol["k_last"] == best_k([0.9] * 3) > 0
    assert pol["history"][0]["round"] == PROBE_ROUNDS and pol["history"][0]["reason"].startswith("after a probe")
    assert out[0].stats["rounds"] > PROBE_ROUNDS and len(out[0].stats["acceptance_per_position"]) == 3


def _incremental(sess, ps, max_new: int = 40) -> list:
    """Each prompt through add_request / step until all finish -> the StepOutputs of their finishes, in order."""
    ids = [sess.add_request(p, max_new_tokens=max_new) for p in ps]
    toks, done = {i: [] for i in ids}, {}
    for _ in range(500):
        for o in sess.step():
            toks[o.request_id] += o.tokens
            if o.finish_reason is not None:
                done[o.request_id] = o
        if not sess.has_unfinished():
            break
    assert sorted(done) == ids
    return [toks[i] for i in ids], [done[i].stats for i in ids]


@torch.no_grad()
def test_incremental_auto_plans_again_from_plain_decoding_and_probes_back(bundled):
    """set_mtp("auto") chooses plain decoding (the estimate accepts nothing). Requests that arrive at an idle
    scheduler make it plan again, as a generate call would: without budget it stays plain; once the plain
    steps earned a probe, the next wave starts with PROBE_ROUNDS rounds at K, the estimate now accepts, and
    it speculates. Every request's tokens are plain greedy decoding's."""
    sess, ps, ref = bundled
    spec = speculator(sess)
    _setup(spec, Flip(3, [0.0] * 3, [0.0] * 3, n=10 ** 6))
    try:
        assert sess.set_mtp("auto")["k"] == 0
        cell = (4, "greedy", 0.0)
        budget0 = spec.probe_budget[cell]
        for _ in range(2):  # below a probe's cost: plain, and each wave's plain steps earn budget
            toks, stats = _incremental(sess, ps)
            assert toks == ref and all("rounds" not in s for s in stats)
        assert sess._live.spec is None and sess._live.plain_steps == 39  # since the second wave's plan
        earned = spec.probe_budget[cell] - budget0  # the first wave's 39 steps, paid at the second's plan
        assert earned == pytest.approx(PROBE_SHARE * 39 * COSTS["step"])
        spec.probe_budget[cell] = 1e9  # as if plain decoding had run long enough
        spec.observed[0.0] = Flip(3, [0.0] * 3, [0.9] * 3, n=1)  # the plan reads "nothing accepted" once more
        toks, stats = _incremental(sess, ps)
        assert toks == ref
        pol = stats[0]["mtp_policy"]
        assert pol["k"] == 0 and pol["probe"] and pol["k_last"] == best_k([0.9] * 3) > 0
        assert pol["history"][0]["reason"].startswith("after a probe")
        assert stats[0]["rounds"] > PROBE_ROUNDS and sess._live.spec is not None  # still speculating
        toks, _ = _incremental(sess, [p[:5] for p in ps], max_new=8)  # speculating: no re-plan, still exact
        assert toks == [r.tokens for r in sess.generate([p[:5] for p in ps], max_new_tokens=8)]
    finally:
        sess.set_mtp(0)
