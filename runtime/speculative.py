"""MTP speculative decoding for `Session` (../shared/spec/speculative_decoding.md).

One round for the active sequences, each with committed tokens x_0..x_n (x_n sampled, not yet fed; the
main caches hold positions < n, the MTP cache positions < n and its draft for x_{n+1} is pending):

  1. draft   d_1 is the pending MTP output; d_2..d_k come from k-1 one-position calls of the `mtp` graph,
             each fed the previous MTP output streams (recursive drafting, spec §2).
  2. verify  one call of the `verify` graph (1 + K tokens per sequence, n_real = 1 + k) over
             [x_n, d_1..d_k] at positions n..n+k: target logits p_0..p_k and streams h_n..h_{n+k}.
  3. accept  greedy: while d_j == argmax p_{j-1}; sampling: exact rejection sampling on the processed
             distributions (`accept_drafts`). -> a accepted drafts and one extra token y.
  4. rollback positions go to n+a+1. The state the verify wrote for positions > n+a is harmless (below).
  5. refresh one `mtp` call over positions n..n+a with the true inputs (h_j, x_{j+1}); its output at n+a is
             the next round's d_1.

The fused round (artifacts with a `verify_mtp` graph, dsv4c/export.py `VerifyMTPStepModule`): steps 2 and
5 are one graph call. After the verify forward the graph runs the MTP block over rows 0..k with
(h_{n+j}, argmax p_j) and returns the MTP logits/output per row and the argmax ids it used. For a greedy
row these are the true inputs at every row <= a (accepted d_{j+1} = argmax p_j, and y = argmax p_a), so
the MTP output at row a is exactly what the refresh computes. A row keeps the fused result only if its
committed tokens d_1..d_a, y equal the graph's ids (`_take_fused`); otherwise (sampling rows whose
accepted or emitted token was not the argmax) it gets the separate refresh of step 5
(`SpecStats.fused_rounds` / `fallback_refreshes` count both). MTP rows written for positions > n+a are
stale like the verify's rows: the MTP caches also hold K extra rows, and the next round rewrites those
positions before any query reads them. Drafts d_2..d_k still come from `mtp` calls.

Why the rest needs no rollback (the ops' contracts, dsv4c/model/v4_ops.py, v3_ops.py):
  * window ring: the caches carry W + K rows (`extra_ring_slots`), so the verify's rows evict only
    positions <= n-W, which no later query reads; rows of rejected positions are rewritten before any
    query can read them (a chunk writes its rows before it attends, and reads only older positions).
  * compressed entries / indexer entries: entry i is visible only from its closing position on, and the
    chunk that reaches that position rewrites it first.
  * V3/V3.2 latent, k_pe and indexer keys: row p is read only by queries at positions >= p, after the
    chunk holding p wrote it again.
  * MTP ring (V4, sliding window only) and V3 MTP cache: same argument, and the refresh (or the fused
    graph) rewrites positions n..n+a with true inputs.
  * the compressors' kept rows (`comp_kv/comp_score`, `idx_kv/idx_score`): position p at row p mod
    (c·m + K). A group closing at a rejected position pools rejected rows into an entry that is not
    visible yet (above). The accepted positions' rows stay, since the K extra rows keep the verify's
    rows from reaching them, and the chunk that reaches the closing position again rewrites the rows
    first. (While these rows were not position-indexed, such a round restored a snapshot and replayed
    the accepted prefix through `verify`: one more forward in 15-35% of rounds.)

Blocks a round completes are kept for the prefix cache (its answer blocks, runtime/prefix_cache.py): when a
round is read, the block end it passed (at most one: K + 1 <= block size) gets `after_decode`. A pipelined
round is read after the next one was queued, whose writes may have overwritten ring rows that block's
boundary state needs; a round queued after one that may pass a block end first copies the ring rows it
overwrites aside (`stash_rings`, K + 1 rows per slot per ring field), and the stored rows are patched from
them (`RingPatch`). Sharded runs' rounds keep no blocks.

Every graph call goes through `Session._run`, so the segment executor applies to verify and mtp too.
Pipelined rounds (`_Pipeline`, below) run each round as one CUDA graph replay where the graphs run
whole-step (`RoundGraphs`, `Speculator.round_mode`), else op by op (`_round_ops`).

Legend: B batch (active sequences), K the artifact's verify width - 1, k the drafts of this round (<= K),
V vocab, N hc streams, D hidden.
"""
from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

import torch

from dsv4c.export import verify_mtp_caches
from dsv4c.runtime.kv_cache import fill_value
from dsv4c.runtime.prefix_cache import RingPatch
from dsv4c.runtime.sampling import (RowParams, SamplingParams, counter_uniforms, draw_rows, one_hot_rows,
                                    processed_probs, processed_probs_rows)
from dsv4c.targets import DEFAULT_BUCKETS

# draft override for tests: (request, round, drafts) -> drafts; a changed draft counts as drawn from a one-hot
DraftFilter = Callable[[object, int, list[int]], list[int]]
FUSED = "verify_mtp"  # the artifact's fused verify + MTP refresh graph (dsv4c/compile.py graph_kinds)


# ------------------------------------------------------------------------------------------------
# acceptance (spec §3)
# ------------------------------------------------------------------------------------------------
def accept_drafts(p: torch.Tensor, q: torch.Tensor, drafts: list[int], greedy: bool,
                  gen: torch.Generator | None) -> tuple[int, int]:
    """Exact acceptance of `drafts` (k tokens) against the target.

    p [k+1, V]: processed target distributions p̃_0..p̃_k (fp32); q [k, V]: the distributions the drafts
    were actually drawn from (one-hot for greedy drafts). -> (a accepted drafts, the extra token y).
    Greedy target: accept while d_j is the argmax, y = argmax. Otherwise: accept d_j with probability
    min(1, p̃(d_j)/q̃(d_j)); on rejection y ~ norm(max(0, p̃ - q̃)) (p̃ if that mass is 0); after k
    acceptances y ~ p̃_k. Uniforms are drawn only where the outcome is uncertain, in draft order."""
    for j, d in enumerate(drafts):
        if greedy:
            ok = int(p[j].argmax()) == d
        else:
            pj, qj = float(p[j, d]), float(q[j, d])
            ratio = math.inf if qj <= 0 else pj / qj
            ok = ratio >= 1 or (ratio > 0 and float(torch.rand((), generator=gen)) < ratio)
        if not ok:
            if greedy:
                return j, int(p[j].argmax())
            res = (p[j] - q[j]).clamp_min(0)
            return j, _draw(res if float(res.sum()) > 0 else p[j], gen)
    k = len(drafts)
    return k, int(p[k].argmax()) if greedy else _draw(p[k], gen)


def _draw(dist: torch.Tensor, gen: torch.Generator | None) -> int:
    return int(torch.multinomial(dist / dist.sum(), 1, generator=gen))


# ------------------------------------------------------------------------------------------------
# statistics
# ------------------------------------------------------------------------------------------------
@dataclass
class SpecStats:
    """Per-request speculation counters. α_j = accepted[j] / proposed[j] (draft j was checked only when
    drafts 1..j-1 were accepted); τ = tokens per round (accepted drafts + 1)."""

    k: int
    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    histogram: list[int] = field(default_factory=list)  # rounds by accepted drafts 0..k
    rounds: int = 0
    fused_rounds: int = 0  # rounds whose next first draft came from the verify_mtp graph
    fallback_refreshes: int = 0  # verify_mtp rounds that still needed a separate mtp refresh (non-argmax tokens)
    policy: dict | None = None

    def __post_init__(self):
        self.proposed = self.proposed or [0] * self.k
        self.accepted = self.accepted or [0] * self.k
        self.histogram = self.histogram or [0] * (self.k + 1)

    def record(self, a: int, k_round: int) -> None:
        if k_round > len(self.proposed):  # mtp="auto" moved to a larger k (or probed at K)
            grow = k_round - len(self.proposed)
            self.proposed += [0] * grow
            self.accepted += [0] * grow
            self.histogram += [0] * grow
        self.rounds += 1
        self.histogram[a] += 1
        for j in range(min(a + 1, k_round)):
            self.proposed[j] += 1
            self.accepted[j] += j < a

    def as_dict(self) -> dict:
        acc = [a / p if p else None for a, p in zip(self.accepted, self.proposed)]
        n_acc = sum(self.accepted)
        out = {"mtp_k": self.k, "mode": "exact", "rounds": self.rounds,
               "acceptance_per_position": acc, "accepted_per_position": list(self.accepted),
               "proposed_per_position": list(self.proposed), "accept_histogram": list(self.histogram),
               "mean_accepted_length": (n_acc + self.rounds) / self.rounds if self.rounds else None,
               "accepted_draft_tokens": n_acc,
               "fused_rounds": self.fused_rounds, "fallback_refreshes": self.fallback_refreshes}
        if self.policy is not None:
            out["mtp_policy"] = self.policy
        return out


def merge_spec_stats(stats: list[dict]) -> dict | None:
    """Speculation counters of several requests (`generate` result stats) added up: acceptance per
    draft position, mean accepted length, histogram, and the policy of the first. None without MTP."""
    spec = [s for s in stats if "accept_histogram" in s]
    if not spec:
        return None
    k = max(len(s["accept_histogram"]) for s in spec) - 1
    prop, acc, hist = [0] * k, [0] * k, [0] * (k + 1)
    fused = {key: sum(s.get(key, 0) for s in spec) for key in ("fused_rounds", "fallback_refreshes")}
    for s in spec:
        for j, (p, a) in enumerate(zip(s["proposed_per_position"], s["accepted_per_position"])):
            prop[j] += p
            acc[j] += a
        for j, h in enumerate(s["accept_histogram"]):
            hist[j] += h
    rounds = sum(hist)
    out = {"mtp_k": k, "rounds": rounds, "acceptance_per_position": [a / p if p else None for a, p in zip(acc, prop)],
           "proposed_per_position": prop, "accept_histogram": hist,
           "mean_accepted_length": (sum(acc) + rounds) / rounds if rounds else None,
           **fused}
    if "mtp_policy" in spec[0]:
        out["mtp_policy"] = spec[0]["mtp_policy"]
    return out


@dataclass
class _Seq:
    req: object  # session._Request
    stats: SpecStats
    draft_logits: torch.Tensor | None = None  # [V] MTP logits for d_1 of the next round
    draft_z: torch.Tensor | None = None  # MTP output streams at the last committed position


# ------------------------------------------------------------------------------------------------
# the speculator
# ------------------------------------------------------------------------------------------------
class Speculator:
    """MTP drafting, verification and rollback for one `Session` (its caches, graphs and `_run`).

    The MTP cache and its positions are allocated once per session (graph executors bind cache
    addresses). `k` (1..K) may change between `serve` calls."""

    def __init__(self, sess):
        m = sess.manifest
        self.K = int(m.get("mtp_k", 0))
        if self.K < 1 or "verify" not in sess.graphs or "mtp" not in sess.graphs:
            raise ValueError(f"{sess.art}: speculative decoding needs an artifact compiled with --mtp K "
                             f"(this one has mtp_k={self.K})")
        self.sess, self.cfg = sess, sess.config
        self.is_v4 = self.cfg.is_v4
        self.mtp_caches = sess._allocate_caches(mtp=True)
        self.mtp_pos = torch.zeros_like(sess.pos)
        self.seqs: dict[int, _Seq] = {}  # by slot
        self.k = self.K
        self.draft_filter: DraftFilter | None = None
        self.host_drafts = False  # True: rounds take the one-round host path (tests compare the two)
        self.forced: ForcedDrafts | None = None  # teacher-forced drafts (benchmark; pipelined rounds only)
        self._prompt_hidden: dict[int, torch.Tensor] = {}
        self.calibration: dict = {}  # mtp="auto": step and round times per (batch, sampling mode)
        self.calibration_tokens = 64  # tokens per request of each timed calibration generation
        self.calibration_repeats = CALIBRATION_REPEATS  # interleaved timings of each k (median)
        # acceptance observed while running, per temperature bucket (forgetting: `Acceptance`)
        self.observed: dict[float, Acceptance] = {}
        self.auto: AutoRun | None = None  # mtp="auto": the running call's policy (None: a fixed k)
        self.auto_last: dict[tuple, int] = {}  # the k auto last ran per cell (hysteresis across calls)
        self.probe_budget: dict[tuple, float] = {}  # seconds of probing earned per cell (PROBE_SHARE)
        # mtp="auto": seconds between consecutive rounds read at one k, per (batch, sampling mode, k): the
        # round times the traffic pays, which correct the calibration's (`observed_costs`)
        self.round_seen: dict[tuple, deque] | None = {}
        self.step_seen: dict[tuple, deque] | None = sess.step_seen  # plain steps, per (rows, mode): the Session's
        self.clock: Callable[[], float] = time.perf_counter
        # the fused verify + refresh graph: absent from artifacts compiled before it (they use verify + mtp)
        self.fused = FUSED in sess.graphs
        self.fused_caches = verify_mtp_caches(sess.caches, self.mtp_caches) if self.fused else None
        # how pipelined rounds run (`RoundGraphs`): "graphs" one CUDA graph replay per round (the default where
        # `round_graph_blocker` finds nothing against it), "emulate" the same static-buffer data flow without
        # CUDA graphs (CPU tests), "off" the round's ops one by one
        self.round_mode = "off" if round_graph_blocker(sess, "graphs") else "graphs"
        self._round_graphs: dict[str, RoundGraphs] = {}
        # rounds keep the blocks they complete (module docstring): the stash of each ring field the prefix cache
        # stores boundary rows of ([cache_slots, K + 1, ...]), written by rounds queued after a block end
        self._stash: dict[str, torch.Tensor] | None = None

    def round_graphs(self) -> "RoundGraphs | None":
        """The `RoundGraphs` of `round_mode` (made on first use), or None for "off"."""
        mode = self.round_mode
        if mode == "off":
            return None
        if mode not in ROUND_MODES:
            raise ValueError(f"round_mode: expected one of {ROUND_MODES}, got {mode!r}")
        rg = self._round_graphs.get(mode)
        if rg is None:
            why = round_graph_blocker(self.sess, mode)
            if why:
                raise ValueError(f"{self.sess.art}: round_mode={mode!r}: {why}")
            rg = self._round_graphs[mode] = RoundGraphs(self, mode)
        return rg

    # ---- admission ------------------------------------------------------------------------------
    def prefill(self, r) -> torch.Tensor:
        """Prefill r's prompt into its slot (as Session._prefill), keeping the streams the MTP needs;
        returns the last position's logits [V]."""
        rest = r.context()[int(self.sess.pos[r.slot]):]  # past the prefix the prefix cache restored
        taken = self.sess._prefill_chunks(rest, r.slot, take=self.take)
        r.chunks += len(taken)
        return self.prefilled(r, taken)

    def take(self, o: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """What admission keeps of one prefill chunk's outputs (one row's, [1, n, ...]; the scheduler prefills
        several requests per call, Session._prefill_rows): the chunk's last logits row [V] and its hidden rows
        [n', (N,) D] that the MTP fill reads (V4: the last W, its MTP block is SWA; V3: all)."""
        h = o[1][0]
        if self.is_v4:
            h = h[-self.cfg.sliding_window:]
        return o[0][0, -1].clone(), h.clone()

    def prefilled(self, r, taken: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """r's prompt is prefilled (`taken`: `take` of each chunk, in order): keep the hidden rows the MTP fill
        needs for `admit`; returns the last position's logits [V]."""
        hidden = torch.cat([h for _, h in taken])  # [T_kept, (N,) D]
        keep = self.cfg.sliding_window if self.is_v4 else hidden.shape[0]  # V4's MTP block is SWA
        self._prompt_hidden[r.slot] = hidden[-keep:]
        return taken[-1][0]

    def admit(self, r, stats: SpecStats) -> None:
        """Fill the MTP cache of r's slot over the prompt with true inputs (h_j, x_{j+1}) and keep the
        MTP output at the last prompt position: the draft of the first round. Call after the first
        token was sampled (it is x_{j+1} of the last prompt position)."""
        s, ctx = r.slot, r.context()  # the prompt (and, resumed after a preemption, the tokens but the last)
        n = len(ctx)
        for name, t in self.mtp_caches.items():
            t[s].fill_(fill_value(name))
        if self.sess.mirror is not None:  # a sharded run: the followers reset theirs too
            self.sess.mirror.reset("mtp", s)
        hidden = self._prompt_hidden.pop(s)
        start = n - hidden.shape[0]
        nxt = torch.tensor(ctx[start + 1:] + [r.out[-1]])
        self.mtp_pos[s] = start
        T = 1 + self.K
        for i in range(0, hidden.shape[0], T):  # the mtp graph takes T = 1 + K rows: pad the last chunk
            real = min(T, hidden.shape[0] - i)
            h = torch.zeros((1, T) + tuple(hidden.shape[1:]), dtype=hidden.dtype, device=hidden.device)
            ids = torch.zeros(1, T, dtype=torch.int64)
            h[0, :real], ids[0, :real] = hidden[i:i + real], nxt[i:i + real]
            logits, z = self._mtp(h, ids, [s], [real])
            last = real - 1
        self.seqs[s] = _Seq(r, stats, logits[0, last], z[0, last])

    def observe(self, temperature: float, a: int, k_round: int) -> None:
        """Count one row's round for `mtp="auto"` (its acceptance estimate at this temperature bucket)."""
        self.acceptance(temperature).add(a, k_round)

    def acceptance(self, temperature: float) -> "Acceptance":
        return self.observed.setdefault(_temperature_bucket(temperature), Acceptance.empty(self.K))

    @property
    def keeps_blocks(self) -> bool:
        """Rounds hand the blocks they complete to the session's prefix cache (it may be swapped between calls)."""
        pc = self.sess.prefix
        return (pc is not None and self.sess.mirror is None and getattr(pc, "share", True)
                and self.K + 1 <= pc.block_size)

    def stash_buffers(self) -> dict[str, torch.Tensor]:
        """The ring fields' stash (`stash_rings`), made at first use (`_Pipeline.launch`: before any round graph
        can capture it)."""
        if self._stash is None:
            sess = self.sess
            self._stash = {f.name: sess.caches[f.name].new_zeros((sess.cache_slots, self.K + 1)
                                                                 + tuple(sess.caches[f.name].shape[2:]))
                           for f in sess.prefix.boundary_fields}
        return self._stash

    def keep_block(self, slot: int, n: int, end: int, after: "_Launched | None" = None) -> None:
        """A round that started at position n is read and slot's caches hold its positions < end: hand the block
        end it passed (if any) to the prefix cache, with the ring rows `after` (the round queued after it, which
        started at `end`) overwrote patched back from `after`'s stash."""
        if not self.keeps_blocks:
            return
        b = self.sess.prefix.block_size
        e = end // b * b
        if e <= n:
            return
        patch = None
        if after is not None:
            if not after.stash:
                raise RuntimeError(f"slot {slot}: a round passed block end {e} but the round queued after it "
                                   f"copied no ring rows aside")
            patch = RingPatch(end, {name: buf[slot] for name, buf in self.stash_buffers().items()})
        self.sess.prefix.after_decode(slot, e, patch)

    def release(self, slot: int) -> None:
        self.seqs.pop(slot, None)
        self._prompt_hidden.pop(slot, None)

    # ---- rounds ---------------------------------------------------------------------------------
    def rounds(self, active: dict) -> Iterator[tuple[int, int]]:
        """Rounds for `active` (slot -> request) until one of them finishes, yielding emitted (request
        index, token) pairs. With the fused graph, rounds are pipelined like plain decode steps
        (`_Scheduler._decode_step`): round r+1 is queued on round r's device outputs before the host
        reads round r. Acceptance
        (greedy: argmax compare + cumulative-product length; sampling: `_accept_rows` with each
        request's `counter_uniforms`), the emitted token, the next positions and the next first draft
        are all computed on the device; the host gets [B, T+2] int64 per round, copied asynchronously.
        Round r+1 is queued only when it cannot write past max_tokens whatever round r accepts; a
        request that finishes in round r has round r+1's tokens dropped (its slot is reset on reuse).
        Without the fused graph, with `draft_filter` or `host_drafts`: one `round` per call."""
        pipelined = self.fused and not self.host_drafts and self.draft_filter is None and self.k >= 1
        if self.forced is not None and not pipelined:
            raise ValueError(f"{self.sess.art}: teacher-forced drafts run in pipelined rounds only (the fused "
                             f"verify_mtp graph, k >= 1, no draft_filter / host_drafts)")
        pipe = _Pipeline(self, active) if pipelined else None
        if pipe is None or not pipe.fits(0):
            if self.forced is not None:
                raise ValueError(f"teacher-forced drafts: a round of k={self.k} at positions {pipe.n} would write "
                                 f"past max_tokens={self.sess.max_tokens}")
            yield from self.round(active)
            return
        yield from pipe.run()

    def _run_dev(self, kind: str, ids: torch.Tensor, ctx: "_Ctx", pos: torch.Tensor, n_real: torch.Tensor, *,
                 hidden: torch.Tensor | None = None, caches: dict):
        """Run a graph on device inputs (positions and n_real decided on the device; the host `pos`
        is set when the round is read)."""
        sess = self.sess
        run = sess.executors[kind].run if kind in sess.executors else sess.graphs[kind]
        if sess.paged:
            sess.prefix.flush()  # table rows changed since the last run
        lead = () if hidden is None else (hidden,)
        if sess.mirror is not None:  # a sharded artifact: the other ranks replay the same call
            sess.mirror.run(kind, ids, ctx.slots, pos, n_real, hidden, caches)
        return run(*lead, ids, ctx.slots, pos, n_real, caches, sess._graph_weights(kind))

    # ---- one round --------------------------------------------------------------------------------
    def round(self, active: dict) -> Iterator[tuple[int, int]]:
        """One draft-verify-accept round for every active sequence (slot -> request); yields emitted
        (request index, token) pairs through `Session._push`."""
        sess = self.sess
        slots = sorted(active)
        seqs = [self.seqs[s] for s in slots]
        n0 = sess.pos[slots].tolist()  # x_n is fed at position n
        ks = [max(0, min(self.k, q.req.max_new - len(q.req.out) - 1, sess.max_tokens - 1 - n))
              for q, n in zip(seqs, n0)]
        greedy = (self.fused and not self.host_drafts and self.draft_filter is None
                  and all(q.req.params.temperature == 0 for q in seqs))
        verify = self._verify_greedy if greedy else self._verify_general
        drafts, accepted, hidden, fused = verify(slots, seqs, n0, ks)
        for i, q in enumerate(seqs):
            a, y = accepted[i]
            q.stats.record(a, ks[i])
            self.observe(q.req.params.temperature, a, ks[i])
            sess.pos[slots[i]] = n0[i] + a + 1  # rollback: the rows past n+a are rewritten before any read
            self.keep_block(slots[i], n0[i], n0[i] + a + 1)
            for tok in drafts[i][:a] + [y]:
                if q.req.finish is None:
                    yield from sess._push(q.req, tok)
        live = [i for i, q in enumerate(seqs) if q.req.finish is None]
        if fused is not None:
            live = self._take_fused(slots, seqs, drafts, accepted, n0, live, *fused)
        self._refresh(slots, seqs, hidden, drafts, accepted, n0, live)
        if self.auto is not None:
            self.auto.after_round(self.k)

    def _verify_general(self, slots, seqs, n0, ks):
        """Steps 1-3 for any mix of sampling and greedy rows: drafts and the target distributions on
        the host, exact acceptance. -> (drafts, (a, y) per row, streams, fused outputs or None)."""
        sess, K, B = self.sess, self.K, len(slots)
        drafts, qs = self._draft(slots, seqs, ks)
        ids = torch.zeros(B, 1 + K, dtype=torch.int64)
        for i, q in enumerate(seqs):
            ids[i, : 1 + ks[i]] = torch.tensor([q.req.out[-1]] + drafts[i])
        fused = None
        if self.fused:  # verify and the MTP over the same rows with in-graph argmax inputs
            logits, hidden, *fused = sess._run(FUSED, ids, slots, [1 + k for k in ks], caches=self.fused_caches,
                                               outputs=True)
        else:
            logits, hidden = sess._run("verify", ids, slots, [1 + k for k in ks], outputs=True)
        logits = logits.float().cpu()
        accepted = []
        for i, q in enumerate(seqs):
            r = q.req
            p = processed_probs(logits[i, : 1 + ks[i]], r.params)
            accepted.append(accept_drafts(p, qs[i], drafts[i], r.params.temperature == 0, r.gen))
        return drafts, accepted, hidden, fused

    def _verify_greedy(self, slots, seqs, n0, ks):
        """Steps 1-3 when every row is greedy and the artifact has the fused graph: the same tokens as
        `_verify_general` (a greedy draft is the argmax of the MTP logits, and a draft is accepted
        while it equals the verify's argmax, which the fused graph returns as its MTP input ids), but
        the drafts stay on the device, so the round waits for the GPU once, for [B, 2T] token ids,
        instead of after every draft and for [B, T, V] logits. Draft columns past a row's k hold
        tokens the row does not use; n_real keeps them out of every cache."""
        sess, K, B = self.sess, self.K, len(slots)
        T, kmax = 1 + K, max(ks, default=0)
        dev = sess.device
        z = torch.stack([q.draft_z for q in seqs])  # [B, (N,) D]
        cols = [torch.stack([q.draft_logits for q in seqs]).argmax(-1)]  # d_1 [B]
        for j in range(1, kmax):  # d_{j+1} from the MTP fed (its own output, d_j)
            h = z.new_zeros((B, T) + tuple(z.shape[1:]))
            h[:, 0] = z
            step = torch.zeros(B, T, dtype=torch.int64, device=dev)
            step[:, 0] = cols[-1]
            lg, zz = self._mtp(h, step, slots, [int(ks[i] > j) for i in range(B)])
            cols.append(lg[:, 0].argmax(-1))
            z = zz[:, 0]
        last = torch.tensor([q.req.out[-1] for q in seqs], dtype=torch.int64)
        ids = torch.zeros(B, T, dtype=torch.int64, device=dev)
        ids[:, 0] = last.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else last
        if kmax:
            ids[:, 1:1 + kmax] = torch.stack(cols[:kmax], 1)
        logits, hidden, mlogits, mz, mids = sess._run(FUSED, ids, slots, [1 + k for k in ks],
                                                      caches=self.fused_caches, outputs=True)
        host = torch.cat([ids, mids.to(torch.int64)], 1).cpu().tolist()  # [B, 2T]: the round's one wait
        drafts, accepted = [], []
        for i, row in enumerate(host):
            d, p = row[1:1 + ks[i]], row[T:]  # drafts; argmax of the target at rows 0..K
            a = 0
            while a < ks[i] and d[a] == p[a]:
                a += 1
            drafts.append(d)
            accepted.append((a, p[a]))
        return drafts, accepted, hidden, (mlogits, mz, torch.tensor([r[T:] for r in host]))

    def _draft(self, slots: list[int], seqs: list[_Seq], ks: list[int]):
        """k drafts per sequence and the distributions they were drawn from ([k, V] each)."""
        B, K = len(slots), self.K
        drafts: list[list[int]] = [[] for _ in slots]
        qs: list[list[torch.Tensor]] = [[] for _ in slots]
        logits = torch.stack([q.draft_logits for q in seqs]).float().cpu()  # [B, V]
        z = torch.stack([q.draft_z for q in seqs])  # [B, (N,) D]
        for j in range(max(ks, default=0)):
            if j:
                h = torch.zeros((B, 1 + K) + tuple(z.shape[1:]), dtype=z.dtype, device=z.device)
                h[:, 0] = z
                ids = torch.zeros(B, 1 + K, dtype=torch.int64)
                ids[:, 0] = torch.tensor([d[-1] if d else 0 for d in drafts])
                lg, zz = self._mtp(h, ids, slots, [int(ks[i] > j) for i in range(B)])
                logits, z = lg[:, 0].float().cpu(), zz[:, 0]
            for i, q in enumerate(seqs):
                if ks[i] > j:
                    dist = processed_probs(logits[i], q.req.params)
                    greedy = q.req.params.temperature == 0
                    d = int(dist.argmax()) if greedy else int(torch.multinomial(dist, 1, generator=q.req.gen))
                    drafts[i].append(d)
                    qs[i].append(dist)
        for i, q in enumerate(seqs):
            if self.draft_filter is not None and drafts[i]:
                new = list(self.draft_filter(q.req, q.stats.rounds, list(drafts[i])))
                qs[i] = [dist if nd == d else torch.nn.functional.one_hot(torch.tensor(nd), dist.shape[0]).float()
                         for dist, d, nd in zip(qs[i], drafts[i], new)]
                drafts[i] = new
        V = self.cfg.vocab_size
        return drafts, [torch.stack(q) if q else torch.zeros(0, V) for q in qs]

    def _take_fused(self, slots, seqs, drafts, accepted, n0, live: list[int], mlogits, mz, mids) -> list[int]:
        """Keep the verify_mtp graph's MTP output at row a as the next d_1 for the rows of `live` whose
        committed tokens d_1..d_a, y are the graph's MTP input ids (always for greedy rows): there the
        MTP saw the true inputs (h_j, x_{j+1}) at every row <= a. -> the rows that need `_refresh`."""
        if not live:
            return []
        mids = mids.cpu()  # [B, T]
        fallback = []
        for i in live:
            a, y = accepted[i]
            q = seqs[i]
            if mids[i, : a + 1].tolist() == drafts[i][:a] + [y]:  # fused path
                q.draft_logits, q.draft_z = mlogits[i, a], mz[i, a]
                self.mtp_pos[slots[i]] = n0[i] + a + 1
                q.stats.fused_rounds += 1
            else:  # a committed token was not the argmax (sampling): the MTP input at that row was wrong
                fallback.append(i)
                q.stats.fallback_refreshes += 1
        return fallback

    def _refresh(self, slots, seqs, hidden, drafts, accepted, n0, live: list[int]) -> None:
        """MTP over positions n..n+a with true inputs (h_j, x_{j+1}) for the rows `live`; its last output
        drafts d_1."""
        if not live:
            return
        K = self.K
        ids = torch.zeros(len(live), 1 + K, dtype=torch.int64)
        n_real = []
        for row, i in enumerate(live):
            a, y = accepted[i]
            ids[row, : a + 1] = torch.tensor(drafts[i][:a] + [y])
            n_real.append(a + 1)
            self.mtp_pos[slots[i]] = n0[i]
        lg, z = self._mtp(hidden[live], ids, [slots[i] for i in live], n_real)
        for row, i in enumerate(live):
            last = n_real[row] - 1
            seqs[i].draft_logits, seqs[i].draft_z = lg[row, last], z[row, last]

    # ---- graphs ---------------------------------------------------------------------------------------
    def _mtp(self, hidden, ids, slots, n_real):
        return self.sess._run("mtp", ids, slots, n_real, hidden=hidden, pos=self.mtp_pos, caches=self.mtp_caches,
                              outputs=True)


# ------------------------------------------------------------------------------------------------
# pipelined rounds: acceptance, rollback and the next round's inputs decided on the device
# ------------------------------------------------------------------------------------------------
@dataclass
class ForcedDrafts:
    """Teacher-forced drafts: acceptance controlled on any model (examples/bench_mtp_forced.py).

    `truth[request index]` is the request's whole token sequence (prompt + a continuation generated
    with k = 0). The draft d_j of a round at position n (x_n fed there) is the true token x_{n+j},
    kept with probability `alpha` and otherwise replaced by a different token; with a greedy target
    that equals the truth, d_j is accepted exactly when it was kept, so α_j = alpha at every position
    and τ = (1 - alpha^(k+1)) / (1 - alpha). The keep/replace draws are `counter_uniforms` of
    (seed + request index, n): the same rounds corrupt the same drafts in every run. The MTP draft
    calls still run (their cost is part of what a round costs); their drafts are overridden."""

    truth: dict[int, list[int]]
    alpha: float  # inside a round graph a 0-d fp64 tensor holding it (`RoundGraphs.bind`)
    seed: int = 0

    def table(self, reqs: list, width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (true tokens [B, width] by position (0 past the known sequence), seeds [B])."""
        t = torch.zeros(len(reqs), width, dtype=torch.int64)
        for i, r in enumerate(reqs):
            seq = self.truth[r.index][:width]
            t[i, : len(seq)] = torch.tensor(seq, dtype=torch.int64)
        seeds = torch.tensor([self.seed + r.index for r in reqs], dtype=torch.int64)
        return t.to(device), seeds.to(device)

    def drafts(self, table: torch.Tensor, seeds: torch.Tensor, pos: torch.Tensor, k: int, V: int) -> torch.Tensor:
        """[B, k]: x_{n+1..n+k} from `table`, each replaced by another token with probability 1 - alpha."""
        idx = (pos[:, None] + 1 + torch.arange(k, device=pos.device)).clamp_max(table.shape[1] - 1)
        true = table.gather(1, idx)
        u = counter_uniforms(seeds, pos, 2 * k)
        keep = u[:, :k] < self.alpha
        wrong = (true + 1 + (u[:, k:] * (V - 1)).long().clamp_max(V - 2)) % V  # never the true token
        return torch.where(keep, true, wrong)

    def keep_flags(self, index: int, n: int, k: int) -> list[bool]:
        """Host replay of which drafts of request `index`'s round at position n are kept (tests)."""
        u = counter_uniforms(torch.tensor([self.seed + index]), torch.tensor([n]), 2 * k)
        return (u[0, :k] < self.alpha).tolist()


@dataclass
class _DevState:
    """A round's inputs, per row of the active batch, on the device."""

    last: torch.Tensor  # [B] int64: x_n, committed, not fed yet
    pos: torch.Tensor  # [B] int64: n (the MTP's position equals the main one at a round's start)
    dlogits: torch.Tensor  # [B, V]: MTP logits of d_1
    dz: torch.Tensor  # [B, (N,) D]: MTP output streams at n - 1


@dataclass
class _Ctx:
    """What stays fixed over one `Speculator.rounds` call (the active batch)."""

    slots: torch.Tensor  # [B] int64 device
    ones: torch.Tensor  # [B]: n_real of the draft calls
    n_verify: torch.Tensor  # [B]: 1 + k
    rp: RowParams
    seeds: torch.Tensor  # [B] int64: each request's seed (its RNG stream, `counter_uniforms`)
    forced: tuple | None  # (ForcedDrafts, table, seeds) or None


class _Launched:
    """A queued round: the next round's state (device) and an asynchronous copy of its results
    [B, T + 2] int64 (committed tokens d_1..d_a, y then junk; a; 1 where the row took the refresh)."""

    def __init__(self, state: _DevState, packed: torch.Tensor, k: int, stash: bool = False):
        self.state, self.k, self.stash = state, k, stash  # stash: the round copied its ring rows aside first
        if packed.device.type == "cuda":
            self.host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self.host.copy_(packed, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record(torch.cuda.current_stream(packed.device))
        else:  # a copy: a round graph's packed buffer is rewritten by the next round
            self.host, self.done = packed.clone(), None

    def read(self) -> list[list[int]]:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


def _accept_rows(P: torch.Tensor, Q: torch.Tensor, D: torch.Tensor, U: torch.Tensor, K: int):
    """`accept_drafts` for a batch, on the device. P [B, k+1, V] target, Q [B, k, V] draft distributions
    (processed; one-hot for greedy rows), D [B, k] drafts, U [B, 2K+1] the round's uniforms (draft j
    accepted iff U[:, K + j] < p̃(d_j) / q̃(d_j); y drawn with U[:, 2K]). -> (a [B], y [B]).
    A greedy row (one-hot P and Q) gets exactly the greedy rule: ratio 1 or 0, and y = argmax."""
    B, k = D.shape
    pd = P[:, :k].gather(-1, D[..., None])[..., 0]
    qd = Q.gather(-1, D[..., None])[..., 0]
    ratio = torch.where(qd > 0, pd / qd.clamp_min(1e-38), torch.inf).double()
    ok = U[:, K:K + k] < ratio
    a = ok.long().cumprod(1).sum(1)
    ar = torch.arange(B, device=P.device)
    Pa = P[ar, a]
    Qa = torch.cat([Q, torch.zeros_like(P[:, :1])], 1)[ar, a]
    res = (Pa - Qa).clamp_min(0)
    res = torch.where(res.sum(-1, keepdim=True) > 0, res, Pa)
    return a, draw_rows(res, U[:, 2 * K])


class _Pipeline:
    """`Speculator.rounds`: rounds queued back to back on the device (see there)."""

    def __init__(self, spec: "Speculator", active: dict):
        self.spec, self.sess = spec, spec.sess
        sess, dev = self.sess, spec.sess.device
        self.slots = sorted(active)
        self.seqs = [spec.seqs[s] for s in self.slots]
        reqs = [q.req for q in self.seqs]
        B = len(reqs)
        forced = None
        if spec.forced is not None:
            table, fseeds = spec.forced.table(reqs, sess.max_tokens + 2 * spec.K + 2, dev)
            forced = (spec.forced, table, fseeds)
        seeds = torch.tensor([r.gen.initial_seed() & ((1 << 63) - 1) for r in reqs], dtype=torch.int64)
        self.ctx = _Ctx(torch.tensor(self.slots, dtype=torch.int64).to(dev),
                        torch.ones(B, dtype=torch.int64, device=dev),
                        torch.full((B,), 1 + spec.k, dtype=torch.int64, device=dev),
                        RowParams.of([r.params for r in reqs], dev), seeds.to(dev), forced)
        self.n_verify = {spec.k: self.ctx.n_verify}  # [B] 1 + k per k this call runs (auto changes k)
        self.kmax = spec.k  # the largest k of a round launched (fits / grow bound the unread ones by it)
        self.n = sess.pos[self.slots].tolist()  # positions of the round last read (host)
        last = torch.tensor([r.out[-1] for r in reqs], dtype=torch.int64)
        self.state = _DevState(last.to(dev), sess.pos[self.slots].to(dev),
                               torch.stack([q.draft_logits for q in self.seqs]),
                               torch.stack([q.draft_z for q in self.seqs]))
        self.graphs = spec.round_graphs()  # one graph replay per round, or None: the ops one by one
        # the bucket's static buffers (None: off, or B above every bucket: those rounds run op by op)
        self.bufs = self.graphs.bind(self.ctx, self.state) if self.graphs is not None else None

    def fits(self, ahead: int, k: int | None = None) -> bool:
        """A round of k drafts queued `ahead` unread rounds (of at most `kmax` drafts) after the last read
        one writes positions < max_tokens."""
        k = self.spec.k if k is None else k
        kk = max(self.kmax, k)
        return all(n + ahead * (kk + 1) + k < self.sess.max_tokens for n in self.n)

    def grow(self, ahead: int, k: int | None = None) -> bool:
        """Paged caches: blocks for a round queued `ahead` unread rounds after the last read one (it writes
        positions < n + ahead (kmax + 1) + k + 1), without preempting (the scheduler grew them for ahead = 0)."""
        sess = self.sess
        k = self.spec.k if k is None else k
        kk = max(self.kmax, k)
        if not sess.paged:
            return True
        rows = [(s, n + ahead * (kk + 1) + k + 1) for s, n, q in zip(self.slots, self.n, self.seqs)
                if q.req.finish is None]
        return sess.prefix.grow_all([s for s, _ in rows], [e for _, e in rows])

    def next_k(self) -> int:
        """Drafts of the next round: the fixed k, or auto's current choice (0: stop, plain decoding next)."""
        return self.spec.k if self.spec.auto is None else self.spec.auto.k

    def may_pass_block_end(self, k: int) -> bool:
        """The round being read next (k drafts, from the positions `n`) may complete a block the prefix cache
        keeps: the round queued after it must copy its ring rows aside (`stash_rings`)."""
        if not self.spec.keeps_blocks:
            return False
        b = self.sess.prefix.block_size
        return any((n + k + 1) // b > n // b for n, q in zip(self.n, self.seqs) if q.req.finish is None)

    def run(self) -> Iterator[tuple[int, int]]:
        reqs = [q.req for q in self.seqs]
        cur = self.launch(self.state)
        while True:
            k = self.next_k()
            more = (k > 0 and self.fits(1, k) and any(len(r.out) + 1 < r.max_new for r in reqs)
                    and self.grow(1, k))
            # launches next_k() = k; read before `cur`, so `n` are still cur's positions
            nxt = self.launch(cur.state, stash=self.may_pass_block_end(cur.k)) if more else None
            done = yield from self.take(cur, nxt)
            if nxt is None or done:
                if nxt is not None:  # in flight: keep the tokens of the requests still running
                    yield from self.take(nxt, None)
                    cur = nxt
                break
            cur = nxt
        for i, q in enumerate(self.seqs):  # the next round's first draft, for the requests still running
            if q.req.finish is None:  # (copies: a round graph's state buffers are rewritten by later rounds)
                q.draft_logits, q.draft_z = cur.state.dlogits[i].clone(), cur.state.dz[i].clone()

    def take(self, out: _Launched, after: _Launched | None):
        """Read a round (`after`: the round queued after it, or None): commit each running request's tokens,
        positions and counters, and hand the prefix cache the block the round completed. -> any finished."""
        spec, sess, k, T = self.spec, self.sess, out.k, 1 + self.spec.K
        done = False
        for i, (q, row) in enumerate(zip(self.seqs, out.read())):
            r = q.req
            if r.finish is not None:
                continue
            toks, a, refreshed = row[:T], row[T], row[T + 1]
            n = self.n[i]
            # the drafts the one-round path would have checked (it drafts fewer near max_new_tokens)
            kr = max(0, min(k, r.max_new - len(r.out) - 1, sess.max_tokens - 1 - n))
            q.stats.record(min(a, kr), kr)
            if spec.forced is None:  # forced drafts say nothing about the model's acceptance
                spec.observe(r.params.temperature, min(a, kr), kr)
            self.n[i] = n + a + 1
            sess.pos[self.slots[i]] = spec.mtp_pos[self.slots[i]] = n + a + 1
            spec.keep_block(self.slots[i], n, n + a + 1, after)
            for tok in toks[: min(a, kr) + 1]:
                if r.finish is None:
                    yield from sess._push(r, tok)
            if r.finish is None:
                q.stats.fused_rounds += not refreshed
                q.stats.fallback_refreshes += refreshed
            done |= r.finish is not None
        if spec.auto is not None:
            spec.auto.after_round(k)
        return done

    def launch(self, st: _DevState, k: int | None = None, stash: bool = False) -> _Launched:
        """Queue one round of k drafts (default: `next_k()`) on `st`; nothing here waits for the device.
        With round graphs (`RoundGraphs`), one graph replay on the bucket's static buffers (`st` is copied
        in unless it is the buffers' state already, i.e. the previous round's output); else the ops one
        by one. `stash`: copy the ring rows it overwrites aside first (`stash_rings`)."""
        spec, ctx = self.spec, self.ctx
        k = self.next_k() if k is None else k
        B, dev = st.pos.shape[0], st.pos.device
        self.kmax = max(self.kmax, k)
        if stash:
            spec.stash_buffers()  # allocated outside any capture
        if self.bufs is not None:
            state, packed = self.graphs.launch(self.bufs, st, k, stash)
            return _Launched(state, packed, k, stash)
        if k not in self.n_verify:
            self.n_verify[k] = torch.full((B,), 1 + k, dtype=torch.int64, device=dev)
        nxt, packed = _round_ops(spec, ctx, st, k, spec._run_dev, self.n_verify[k], stash=stash)
        return _Launched(nxt, packed, k, stash)


def stash_rings(spec: "Speculator", slots: torch.Tensor, pos: torch.Tensor) -> None:
    """Copy aside the ring rows a round starting at `pos` [B] overwrites: it writes positions pos + j (j = 0..K)
    at row (pos + j) mod R of each ring field the prefix cache stores boundary rows of. `RingPatch` puts them
    back into a block's stored boundary rows."""
    j = torch.arange(spec.K + 1, device=pos.device)
    for name, buf in spec.stash_buffers().items():
        t = spec.sess.caches[name]  # [slots, R, ...]
        rows = (pos[:, None] + j).remainder(t.shape[1])  # [B, K + 1]
        buf[slots] = t[slots[:, None], rows]


def _round_ops(spec: "Speculator", ctx: _Ctx, st: _DevState, k: int, run: Callable, n_verify: torch.Tensor,
               real: torch.Tensor | None = None, stash: bool = False) -> tuple[_DevState, torch.Tensor]:
    """One round of k drafts on the device (`_Pipeline.launch`; also what `RoundGraphs` captures): draft,
    verify + MTP (the fused graph), accept, and the next round's state. `run(kind, ids, ctx, pos, n_real,
    hidden=, caches=)` calls a graph. `real` [B] bool: False on a round graph's padding rows (they must
    not take the refresh's cache writes); None: every row is real. `stash`: `stash_rings` before the verify
    writes the main caches. -> (the next state, packed [B, T + 2])."""
    K, T, V = spec.K, 1 + spec.K, spec.cfg.vocab_size
    B, dev = st.pos.shape[0], st.pos.device
    greedy = ctx.rp.all_greedy
    U = None if greedy else counter_uniforms(ctx.seeds, st.pos, 2 * K + 1)  # [B, 2K+1]
    lg, z = st.dlogits, st.dz
    drafts, qs = [], []
    for j in range(k):  # 1. draft: d_{j+1} from the MTP fed (its own output streams, d_j)
        if j:
            h = z.new_zeros((B, T) + tuple(z.shape[1:]))
            h[:, 0] = z
            ids = torch.zeros(B, T, dtype=torch.int64, device=dev)
            ids[:, 0] = drafts[-1]
            out = run("mtp", ids, ctx, st.pos + (j - 1), ctx.ones, hidden=h, caches=spec.mtp_caches)
            lg, z = out[0][:, 0], out[1][:, 0]
        if greedy:
            drafts.append(lg.argmax(-1))
        else:
            qs.append(processed_probs_rows(lg, ctx.rp))
            drafts.append(draw_rows(qs[-1], U[:, j]))
    D = torch.stack(drafts, 1) if k else torch.zeros(B, 0, dtype=torch.int64, device=dev)
    if ctx.forced is not None:
        f, table, fseeds = ctx.forced
        forced = f.drafts(table, fseeds, st.pos, k, V)
        if not greedy:  # a replaced draft counts as drawn from a one-hot
            qs = [torch.where((forced[:, j] == D[:, j])[:, None], q,
                              one_hot_rows(forced[:, j], V)) for j, q in enumerate(qs)]
        D = forced
    if stash:
        stash_rings(spec, ctx.slots, st.pos)
    ids = torch.zeros(B, T, dtype=torch.int64, device=dev)  # 2. verify + the MTP over the same rows
    ids[:, 0] = st.last
    ids[:, 1:1 + k] = D
    logits, hidden, mlogits, mz, mids = run(FUSED, ids, ctx, st.pos, n_verify, caches=spec.fused_caches)
    mids = mids.to(torch.int64)
    ar = torch.arange(B, device=dev)
    if greedy:  # 3. accept: while d_j is the verify's argmax
        a = (D == mids[:, :k]).long().cumprod(1).sum(1)
        y = mids.gather(1, a[:, None])[:, 0]
    else:
        P = processed_probs_rows(logits[:, :k + 1], ctx.rp)
        Q = torch.stack(qs, 1) if k else P[:, :0]
        a, y = _accept_rows(P, Q, D, U, K)
    toks = torch.zeros(B, T, dtype=torch.int64, device=dev)
    toks[:, :k] = D
    toks.scatter_(1, a[:, None], y[:, None])
    nxt_logits, nxt_z = mlogits[ar, a], mz[ar, a]  # 5. the fused graph's MTP output at row a
    if greedy:
        refreshed = torch.zeros(B, dtype=torch.int64, device=dev)
    else:  # rows whose committed tokens were not the argmax: the MTP over n..n+a with them
        cols = torch.arange(T, device=dev)[None]
        need = ((toks != mids) & (cols <= a[:, None])).any(1)
        if real is not None:
            need &= real
        rl, rz = run("mtp", toks, ctx, st.pos, torch.where(need, a + 1, 0), hidden=hidden, caches=spec.mtp_caches)
        nxt_logits = torch.where(need[:, None], rl[ar, a], nxt_logits)
        nxt_z = torch.where(need.view((B,) + (1,) * (nxt_z.dim() - 1)), rz[ar, a], nxt_z)
        refreshed = need.long()
    packed = torch.cat([toks, a[:, None], refreshed[:, None]], 1)
    return _DevState(y, st.pos + a + 1, nxt_logits, nxt_z), packed


# ------------------------------------------------------------------------------------------------
# one CUDA graph per round
# ------------------------------------------------------------------------------------------------
ROUND_MODES = ("off", "graphs", "emulate")  # Speculator.round_mode


def round_graph_blocker(sess, mode: str) -> str | None:
    """Why rounds cannot run through `RoundGraphs` in `mode` on this session (None: they can)."""
    if FUSED not in sess.graphs:
        return f"the artifact has no {FUSED} graph (compiled before it); its rounds run verify and mtp separately"
    if sess.mirror is not None:
        return "a sharded session mirrors every graph call to the other ranks from the host (runtime/distributed.py)"
    if mode != "graphs":
        return None
    if sess.device.type != "cuda":
        return f"CUDA graphs need a CUDA device, the session runs on {sess.device}"
    for kind in ("mtp", FUSED):
        ex = sess.executors.get(kind)
        if ex is None or not (ex.full and ex.cuda_graphs):
            return (f"graph {kind} does not run as one whole-step CUDA graph (executor mode "
                    f"{ex.mode if ex is not None else 'off'!r}; Session.load(graphs='full' or 'auto') with "
                    f"capture-safe experts): a round graph needs every kernel of the round capture-safe")
    return None


@dataclass
class _RoundBuffers:
    """One batch bucket's static round inputs and outputs (`RoundGraphs`). Rows B..b-1 are padding:
    slot = the scratch slot, n_real 0 in every graph call, greedy, state kept at 0."""

    b: int
    ctx: _Ctx  # static slots, ones (n_real of the draft calls: 1 real, 0 padding), sampling tensors, seeds
    real: torch.Tensor  # [b] bool
    state: _DevState  # [b, ...]: this round's inputs; the round graph writes the next round's here
    packed: torch.Tensor  # [b, T + 2] int64: the round's results (`_Launched`)
    B: int = 0  # real rows of the pipeline bound last
    view: _DevState | None = None  # `state` sliced to the B real rows (what `_Launched` carries)
    forced: tuple[torch.Tensor, ...] | None = None  # forced drafts' truth [b, W], seeds [b] and α (0-d fp64)


class RoundGraphs:
    """One CUDA graph replay per pipelined MTP round (issue 23).

    A round (`_round_ops`: k-1 mtp draft calls, the fused verify_mtp call, acceptance, the sampling rows'
    refresh mtp call, packing) is some 20-60 kernel launches of host work where the GPU work of a small
    model's round is barely more than a decode step's. Here it is captured whole, per (batch bucket b,
    k, sampling stages, forced drafts or not), on the bucket's static buffers (`_RoundBuffers`):

      * inputs: the active batch's slots / sampling parameters / seeds (copied once per
        `Speculator.rounds` call, `bind`) and the round state (last token, position, d_1's MTP logits
        and streams). The graph writes the next round's state into the same state buffers, so pipelined
        rounds chain without host copies (`launch` copies a state in only when it is not the buffers').
      * outputs: `packed` [b, T + 2], read as `_Launched` did; the next replay overwrites it after the
        asynchronous host copy queued behind this one.
      * inside, the graph calls run their executors' kernels directly (`SegmentExecutor.run_direct`, the
        `full` mode's whole step), not their own CUDA graphs: a replay nested in a capture is not relied on.
      * padding rows (B < b): the scratch slot, n_real 0 in every call (draft, verify and refresh), so
        nothing of theirs reaches a sequence's cache; their state is held at 0 (the executors' padding).
      * capture: lazily on a key's first round, after WARMUP runs of the round on a scratch copy of the
        buffers with every row padding (so the warm-up writes no sequence's cache and leaves the state
        alone; it triggers Triton compilation / autotuning before the capture); one memory pool for all.
        Every tensor live across rounds is a static buffer allocated outside the pool.

    "emulate" is the same data flow without CUDA graphs (CPU tests): "capture" runs one warm-up on the
    scratch copy, a "replay" runs the round's ops on the static buffers."""

    WARMUP = 2

    def __init__(self, spec: "Speculator", mode: str):
        sess = spec.sess
        self.spec, self.mode, self.cuda = spec, mode, mode == "graphs"
        buckets = sess.manifest["buckets"] or DEFAULT_BUCKETS
        self.buckets = tuple(sorted({min(int(b), sess.max_batch) for b in buckets}))
        self.pad_slot = sess.cache_slots - 1  # the capture-safe ops' scratch slot
        self.bufs: dict[int, _RoundBuffers] = {}
        self.graphs: dict[tuple, object] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.cuda else None
        self.stats = {"mode": mode, "captures": 0, "replays": 0, "capture_s": 0.0}

    # ---- binding a batch -------------------------------------------------------------------------
    def bind(self, ctx: _Ctx, st: _DevState) -> _RoundBuffers | None:
        """Copy one `Speculator.rounds` call's batch (`ctx`, B rows; `st` its first state, for the shapes)
        into its bucket's static buffers. None when B exceeds every bucket (its rounds run op by op)."""
        B = ctx.slots.shape[0]
        b = next((x for x in self.buckets if x >= B), None)
        if b is None:
            return None
        bf = self.bufs.get(b)
        if bf is None:
            bf = self.bufs[b] = self._allocate(b, st)
        c, rp = bf.ctx, bf.ctx.rp
        _pad_copy(c.slots, ctx.slots, self.pad_slot)
        _pad_copy(c.ones, ctx.ones, 0)
        bf.real.copy_(c.ones > 0)
        _pad_copy(c.seeds, ctx.seeds, 0)
        _pad_copy(rp.temperature, ctx.rp.temperature, 0.0)  # padding rows are greedy
        _pad_copy(rp.top_k, ctx.rp.top_k, 0)
        _pad_copy(rp.top_p, ctx.rp.top_p, 1.0)
        _pad_copy(rp.divisor, ctx.rp.divisor, 1.0)
        _pad_copy(rp.min_p, ctx.rp.min_p, 0.0)
        forced = None
        if ctx.forced is not None:  # α too is a buffer (fp64, as the Python float it replaces): one graph for all α
            f, table, fseeds = ctx.forced
            if bf.forced is None or bf.forced[0].shape[1] != table.shape[1]:
                bf.forced = (table.new_zeros((b, table.shape[1])), fseeds.new_zeros(b),
                             torch.zeros((), dtype=torch.float64, device=table.device))
            _pad_copy(bf.forced[0], table, 0)
            _pad_copy(bf.forced[1], fseeds, 0)
            bf.forced[2].fill_(float(f.alpha))
            forced = (replace(f, alpha=bf.forced[2]), bf.forced[0], bf.forced[1])
        flags = {k: getattr(ctx.rp, k) for k in ("any_top_k", "any_top_p", "all_greedy", "any_greedy", "any_min_p")}
        bf.ctx = _Ctx(c.slots, c.ones, None, RowParams(rp.temperature, rp.top_k, rp.top_p, divisor=rp.divisor,
                                                       min_p=rp.min_p, **flags),
                      c.seeds, forced)
        for t in (bf.state.last, bf.state.pos, bf.state.dlogits, bf.state.dz):
            t[B:].zero_()
        bf.B = B
        bf.view = _DevState(*(t[:B] for t in (bf.state.last, bf.state.pos, bf.state.dlogits, bf.state.dz)))
        return bf

    def _allocate(self, b: int, st: _DevState) -> _RoundBuffers:
        spec, dev = self.spec, self.spec.sess.device
        i64 = dict(dtype=torch.int64, device=dev)
        rp = RowParams(torch.zeros(b, device=dev), torch.zeros(b, **i64), torch.ones(b, device=dev), False, False,
                       True, True, torch.ones(b, device=dev), torch.zeros(b, device=dev))
        ctx = _Ctx(torch.zeros(b, **i64), torch.zeros(b, **i64), None, rp, torch.zeros(b, **i64), None)
        state = _DevState(torch.zeros(b, **i64), torch.zeros(b, **i64),
                          st.dlogits.new_zeros((b,) + tuple(st.dlogits.shape[1:])),
                          st.dz.new_zeros((b,) + tuple(st.dz.shape[1:])))
        return _RoundBuffers(b, ctx, torch.zeros(b, dtype=torch.bool, device=dev), state,
                             torch.zeros(b, spec.K + 3, **i64))

    # ---- rounds ----------------------------------------------------------------------------------
    def launch(self, bf: _RoundBuffers, st: _DevState, k: int, stash: bool = False) -> tuple[_DevState, torch.Tensor]:
        """Queue one round of k drafts on `st` -> (the next state, packed [B, T + 2]): views of the
        static buffers, valid until the next round of this bucket is queued."""
        if st is not bf.view:
            for dst, src in zip((bf.view.last, bf.view.pos, bf.view.dlogits, bf.view.dz),
                                (st.last, st.pos, st.dlogits, st.dz)):
                dst.copy_(src)
        rp, f = bf.ctx.rp, bf.ctx.forced
        key = (bf.b, k, rp.all_greedy, rp.any_top_k, rp.any_top_p, rp.any_min_p, f is not None, stash)
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = self._capture(bf, k, stash)
        if self.cuda:
            g.replay()
        else:
            self._body(bf, k, stash)
        self.stats["replays"] += 1
        return bf.view, bf.packed[: bf.B]

    def _body(self, bf: _RoundBuffers, k: int, stash: bool) -> None:
        """The round on the static buffers: `_round_ops`, then the next state and the results written
        into them (padding rows' state held at 0)."""
        ctx, st, real = bf.ctx, bf.state, bf.real
        nxt, packed = _round_ops(self.spec, ctx, st, k, self._run, ctx.ones * (1 + k), real, stash)
        for dst, src in zip((st.last, st.pos, st.dlogits, st.dz), (nxt.last, nxt.pos, nxt.dlogits, nxt.dz)):
            torch.where(real.view((-1,) + (1,) * (dst.dim() - 1)), src, src.new_zeros(()), out=dst)
        bf.packed.copy_(packed)

    def _run(self, kind: str, ids, ctx: _Ctx, pos, n_real, *, hidden=None, caches: dict):
        """A graph call inside the round: the executor's whole-step kernels (`run_direct`), or the graph
        itself where no executor runs it (CPU sessions); emulating over a piecewise executor, its `run`."""
        sess = self.spec.sess
        lead = () if hidden is None else (hidden,)
        args = (*lead, ids, ctx.slots, pos, n_real, caches, sess._graph_weights(kind))
        ex = sess.executors.get(kind)
        if ex is None:
            return sess.graphs[kind](*args)
        return ex.run_direct(*args) if ex.full else ex.run(*args)

    def _capture(self, bf: _RoundBuffers, k: int, stash: bool):
        t0 = time.perf_counter()
        scratch = self._scratch(bf)
        if not self.cuda:
            self._body(scratch, k, stash)
            graph = True
        else:
            dev = self.spec.sess.device
            s = torch.cuda.Stream(device=dev)
            s.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(s):
                for _ in range(self.WARMUP):
                    self._body(scratch, k, stash)
            torch.cuda.current_stream(dev).wait_stream(s)
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self._body(bf, k, stash)
        self.stats["captures"] += 1
        self.stats["capture_s"] += time.perf_counter() - t0
        return graph

    def _scratch(self, bf: _RoundBuffers) -> _RoundBuffers:
        """`bf` with every row padding (scratch slot, n_real 0) and its own state and results: a warm-up
        round on it writes no sequence's cache and leaves `bf` alone."""
        c = bf.ctx
        ctx = _Ctx(torch.full_like(c.slots, self.pad_slot), torch.zeros_like(c.ones), None, c.rp, c.seeds, c.forced)
        st = _DevState(*(t.clone() for t in (bf.state.last, bf.state.pos, bf.state.dlogits, bf.state.dz)))
        return _RoundBuffers(bf.b, ctx, torch.zeros_like(bf.real), st, bf.packed.clone(), bf.B)


def _pad_copy(dst: torch.Tensor, src: torch.Tensor, pad) -> None:
    """dst[:n] = src, dst[n:] = pad (n = len(src))."""
    n = src.shape[0]
    dst[:n].copy_(src)
    dst[n:].fill_(pad)


def plan_speculation(sess, mtp: int | str, reqs: list, plain_steps: int | None = None,
                     measure: bool = True) -> tuple[Speculator | None, Callable[[], SpecStats]]:
    """Resolve `mtp` (k = 1..K, or "auto") for one generate/stream call -> (the Speculator, or None for
    plain decoding, and a factory of per-request stats that carry the decision). `plain_steps`, `measure`:
    the auto plan's (`plan_auto`)."""
    K = int(sess.manifest.get("mtp_k", 0))
    if mtp == "auto":
        if K < 1:
            return None, lambda: SpecStats(0, policy={"k": 0, "reason": "the artifact has no MTP graphs"})
        spec = speculator(sess)
        run = plan_auto(sess, spec, reqs, plain_steps, measure)
        spec.auto = run if run.k else None
        if run.k:
            spec.k = run.k
        return (spec if run.k else None), (lambda: SpecStats(run.k_first, policy=run.info))
    if isinstance(mtp, bool) or not isinstance(mtp, int) or not 0 <= mtp <= K:
        raise ValueError(f"mtp: expected 0..{K} (the artifact's --mtp K) or 'auto', got {mtp!r}")
    spec = speculator(sess)
    spec.k, spec.auto = mtp, None
    return spec, lambda: SpecStats(mtp)


# ------------------------------------------------------------------------------------------------
# the auto policy (spec §6)
# ------------------------------------------------------------------------------------------------
MIN_ALPHA_CHECKS = 32  # first drafts checked at a temperature bucket before its acceptance is used as it is
AUTO_MARGIN = 1.05  # a k is chosen over plain decoding only when it predicts at least this speedup
SWITCH_MARGIN = 1.02  # hysteresis: a running k >= 1 gives way only to a k predicting this much more
RECHOOSE_ROUNDS = 8  # rounds read between two re-choices while speculating
ACCEPT_WINDOW = 256  # the acceptance counts halve every this many first-draft checks (or plain decode rows)
PROBE_ROUNDS = 8  # rounds at K of one probe (every draft position's acceptance)
PROBE_SHARE = 0.01  # probes spend at most this share of the decode time that earned them
CALIBRATION_REPEATS = 3  # interleaved timings of each k; the median is the cost
ROUND_SAMPLES = 32  # round intervals kept per (batch, mode, k) (`Speculator.round_seen`)
MIN_ROUND_SAMPLES = RECHOOSE_ROUNDS  # intervals at a k before they replace the calibrated round time
STEP_SAMPLES = 64  # plain step intervals kept per (rows, mode) (`Session.step_seen`)
MIN_STEP_SAMPLES = 16  # intervals before they replace the calibrated plain step time


@dataclass
class Acceptance:
    """Acceptance per draft position observed at one temperature bucket: accepted / proposed counts
    (draft j is proposed only when drafts 1..j-1 were accepted). They forget: every ACCEPT_WINDOW
    first-draft checks, and every ACCEPT_WINDOW rows decoded without drafts, all counts halve. A uniform
    scale keeps each α_j; it only lets the next observations weigh more, so the estimate follows the
    traffic (the last few hundred rounds) and a probe after a long plain stretch decides alone."""

    acc: list[float]
    prop: list[float]
    checks: int = 0  # first-draft checks ever (forgetting does not lower it)
    since: int = 0  # first-draft checks since the last halving

    @classmethod
    def empty(cls, K: int) -> "Acceptance":
        return cls([0.0] * K, [0.0] * K)

    def add(self, a: int, k_round: int) -> None:
        for j in range(min(a + 1, k_round)):
            self.prop[j] += 1
            self.acc[j] += j < a
        if k_round:
            self.checks += 1
            self.since += 1
            if self.since >= ACCEPT_WINDOW:
                self.forget(self.since)

    def forget(self, rows: float) -> None:
        f = 0.5 ** (rows / ACCEPT_WINDOW)
        self.acc = [x * f for x in self.acc]
        self.prop = [x * f for x in self.prop]
        self.since = 0

    def alpha(self) -> list[float]:
        """α_j (0 where position j was never checked: every draft before it was rejected)."""
        return [a / p if p > 0 else 0.0 for a, p in zip(self.acc, self.prop)]


def predicted_speedups(costs: dict, alpha: list[float]) -> dict[int, float]:
    """S(k) = τ(k) · t_step / t_round(k), τ(k) = 1 + Σ_{j≤k} Π_{i≤j} α_i; S(0) = 1."""
    pred = {0: 1.0}
    for k, t in sorted(costs["round"].items()):
        tau = 1 + sum(math.prod(alpha[: j + 1]) for j in range(k))
        pred[k] = tau * costs["step"] / t
    return pred


def pick_k(pred: dict[int, float], current: int = 0) -> int:
    """The k to run next from `current`: the best predicted one when it beats the current one by the
    margin (AUTO_MARGIN to leave plain decoding, SWITCH_MARGIN between k's and back to k = 0), else the
    current one: predictions within noise of each other do not flip-flop."""
    best = max(pred, key=lambda k: (pred[k], -k))  # the smallest k of equal prediction
    margin = AUTO_MARGIN if current == 0 else SWITCH_MARGIN
    return best if pred[best] > pred.get(current, 0.0) * margin else current


def observed_costs(spec, B: int, mode: str, costs: dict) -> dict:
    """The calibrated `costs` of (batch B, sampling mode) with the times the traffic paid. A k with
    MIN_ROUND_SAMPLES round intervals observed (`AutoRun.after_round`) takes their median; the other k's
    are scaled by the median ratio observed / calibrated of the observed ones (what the calibration's short
    generations missed, e.g. host work per emitted token, tends to miss at every k alike). The plain step
    takes the median of MIN_STEP_SAMPLES plain step intervals at B rows (`Session.step_seen`), when there
    are as many. Returns `costs` itself when nothing was observed (`round_seen` / `step_seen` None: untimed)."""
    seen = {}
    for (b, m, k), d in (spec.round_seen or {}).items():
        if (b, m) == (B, mode) and k in costs["round"] and len(d) >= MIN_ROUND_SAMPLES:
            seen[k] = statistics.median(d)
    steps = (spec.step_seen or {}).get((B, mode), ())
    step = statistics.median(steps) if len(steps) >= MIN_STEP_SAMPLES else None
    if not seen and step is None:
        return costs
    out = dict(costs)
    if seen:
        ratio = statistics.median(t / costs["round"][k] for k, t in seen.items())
        out["round"] = {k: seen.get(k, t * ratio) for k, t in costs["round"].items()}
        out["observed"] = seen
    if step is not None:
        out["step"], out["observed_step"] = step, step
    return out


def could_pay(costs: dict) -> bool:
    """Whether some k reaches AUTO_MARGIN even if every draft were accepted (else probing is pointless)."""
    return max((k + 1) * costs["step"] / t for k, t in costs["round"].items()) > AUTO_MARGIN


class AutoRun:
    """mtp="auto" while one call runs (a generate/stream call, or the incremental API's scheduler): the k
    of the next rounds (`k`; 0: plain decoding from here on). Every RECHOOSE_ROUNDS rounds read it
    predicts S(k) again from the calibrated costs and the acceptance observed so far (`Speculator.observe`
    counts every row of every round) and moves with hysteresis (`pick_k`). A probe runs PROBE_ROUNDS
    rounds at K, which check every draft position: at plain decoding's k = 0 nothing is observed, so
    `plan_auto` may start a call with one; below K the deeper positions go unobserved, so a run at
    1 <= k < K probes now and then. Probes are paid from a budget (`Speculator.probe_budget`) that
    earns PROBE_SHARE of the decode time of the cell, and a probe starts only when its worst-case cost
    (nothing accepted) is in the budget: together they cost at most PROBE_SHARE of the decode time."""

    def __init__(self, spec: Speculator, cell: tuple, temperature: float, costs: dict, k: int, probe: bool,
                 info: dict):
        self.spec, self.cell, self.temperature, self.costs, self.info = spec, cell, temperature, costs, info
        self.k_first = k
        self.k_run = k  # the chosen k
        self.probe_left = PROBE_ROUNDS if probe else 0
        self.rounds = 0
        self._last: tuple[int, float] | None = None  # (k, clock) of the last round read
        self.history: list[dict] = info.setdefault("history", [])
        self._sync_spec()

    @property
    def k(self) -> int:
        return self.spec.K if self.probe_left else self.k_run

    def after_round(self, k: int) -> None:
        """A round of k drafts was read (its rows observed): time it, account the budget, end a probe,
        re-choose."""
        spec = self.spec
        self._time_round(k)
        self.rounds += 1
        if self.probe_left:
            self.probe_left -= 1
            if not self.probe_left:
                self.rechoose("after a probe at k=%d" % spec.K)
            return
        spec.probe_budget[self.cell] = spec.probe_budget.get(self.cell, 0.0) + PROBE_SHARE * self.costs["round"][k]
        if self.rounds % RECHOOSE_ROUNDS:
            return
        self.rechoose("observed")
        k = self.k_run
        if 1 <= k < spec.K:  # deeper positions are not checked at k: probe them when the budget allows
            cost = PROBE_ROUNDS * max(self.costs["round"][spec.K] - self.costs["round"][k], 0.0)
            if spec.probe_budget[self.cell] >= cost:
                spec.probe_budget[self.cell] -= cost
                self.probe_left = PROBE_ROUNDS
                self.history.append({"round": self.rounds, "k": spec.K, "reason": "probe"})
        self._sync_spec()

    def restart_timing(self) -> None:
        """The next round read starts a new interval (the scheduler admitted requests: their prefill and MTP
        fill fall between two rounds and are no round's cost)."""
        self._last = None

    def _time_round(self, k: int) -> None:
        """The interval since the last round read, when both ran at k (`Speculator.round_seen`)."""
        seen = self.spec.round_seen
        if seen is None:  # rounds untimed: the calibrated costs are taken as true (tests that set them)
            return
        now = self.spec.clock()
        if self._last is not None and self._last[0] == k:
            seen.setdefault((*self.cell[:2], k), deque(maxlen=ROUND_SAMPLES)).append(now - self._last[1])
        self._last = (k, now)

    def rechoose(self, why: str) -> None:
        alpha = self.spec.acceptance(self.temperature).alpha()
        pred = predicted_speedups(observed_costs(self.spec, *self.cell[:2], self.costs), alpha)
        k = pick_k(pred, self.k_run)
        if k != self.k_run or why.startswith("after"):
            self.history.append({"round": self.rounds, "k": k, "reason": why,
                                 "alpha": [round(a, 3) for a in alpha],
                                 "predicted_speedup": {j: round(v, 3) for j, v in pred.items()}})
        self.k_run = k
        self.spec.auto_last[self.cell] = k
        self.info["k_last"] = k
        self._sync_spec()

    def _sync_spec(self) -> None:
        if self.k:
            self.spec.k = self.k


def plan_auto(sess, spec: Speculator, reqs: list, plain_steps: int | None = None, measure: bool = True) -> AutoRun:
    """`mtp="auto"` for a call's requests: the k to start with (`choose_k`, with hysteresis against the
    k the last call of this cell ran), and whether the call starts with a probe (k = 0 chosen, the
    cell could pay at some acceptance, and the budget holds the probe's worst-case cost: PROBE_ROUNDS
    rounds at K accepting nothing, plus the MTP fill of the admitted prompts, about one mtp call per
    1 + K prompt rows of the window). With k = 0, `plain_steps` plain decode steps earn probe budget
    (default: the call's longest request, which it will decode plain); the incremental API passes the
    steps it decoded plain since its last plan. `measure=False`: no timed generation (`choose_k`)."""
    params = reqs[0].params
    B = max(1, min(len(reqs), sess.max_batch))
    cell = (B, cost_mode(params), _temperature_bucket(params.temperature))
    k, info = choose_k(sess, spec, params, len(reqs), [r.ids for r in reqs], current=spec.auto_last.get(cell, 0),
                       measure=measure)
    costs = spec.calibration[("costs", B, cell[1])]
    probe = False
    if k == 0:  # plain decoding: it earns probe budget and the acceptance counts age by its rows
        steps = max(r.max_new for r in reqs) if plain_steps is None else plain_steps
        spec.probe_budget[cell] = spec.probe_budget.get(cell, 0.0) + PROBE_SHARE * steps * costs["step"]
        spec.acceptance(params.temperature).forget(steps * B)
        if could_pay(costs):
            K, T = spec.K, 1 + spec.K
            window = sess.config.sliding_window if sess.config.is_v4 else sess.max_tokens
            mtp_call = max(costs["round"].get(2, costs["round"][1]) - costs["round"][1], 0.0)
            fill = sum(-(-min(len(r.ids), window) // T) for r in reqs) * mtp_call
            cost = PROBE_ROUNDS * max(costs["round"][K] - costs["step"], 0.0) + fill
            info["probe_cost_ms"] = round(cost * 1e3, 3)
            if spec.probe_budget[cell] >= cost:
                spec.probe_budget[cell] -= cost
                probe = True
                info["reason"] += f"; probing k={K} for {PROBE_ROUNDS} rounds"
    spec.auto_last[cell] = k
    info["k_last"] = k
    info["probe"] = probe
    return AutoRun(spec, cell, params.temperature, costs, k, probe, info)


def choose_k(sess, spec: Speculator, params: SamplingParams, batch: int,
             prompts: list[list[int]], current: int = 0, measure: bool = True) -> tuple[int, dict]:
    """k for `mtp="auto"`: maximise the predicted decode speedup
        S(k) = τ(k) · t_step / t_round(k),   τ(k) = 1 + Σ_{j≤k} Π_{i≤j} α_i,
    with t_step the seconds per plain decode step and t_round(k) the seconds per k-draft round, both
    measured at batch B in the request's sampling mode (greedy, or sampling with or without top-k /
    top-p: a sampled step or round runs other device work than a greedy one) by short timed
    generations of B of `prompts` (`_measure_costs`: CALIBRATION_REPEATS interleaved timings of each
    k, the median; cached per B and mode). They time what a steady decode achieves: pipelined steps
    and rounds, host work included where the GPU waits for it, admission (prefill, the MTP fill) and
    CUDA-graph capture excluded. α: the acceptance per draft position observed at this temperature
    bucket (`Speculator.observe`: the calibration generations and every round run since, forgetting
    old ones: `Acceptance`); before MIN_ALPHA_CHECKS first drafts were ever checked there, a K-draft
    generation at this temperature observes more first. A round's device work does not depend on what
    it accepts (its graph calls are fixed), but its host work grows with the tokens it emits, which the
    calibration's acceptance may not match: once rounds of this cell have run, the round times they paid
    replace the calibrated ones (`observed_costs`; `AutoRun` re-chooses with them while running). The
    choice from `current` (the k running) is `pick_k`: k = 0 (plain decoding, the same path as mtp=0)
    unless some k predicts at least AUTO_MARGIN, and no switch within SWITCH_MARGIN. `measure=False`
    (a re-plan between the incremental API's steps, where no generation can run): the cell must be
    calibrated already, and α is what was observed, however little."""
    B = max(1, min(batch, sess.max_batch))
    mode = cost_mode(params)
    ckey = ("costs", B, mode)
    if ckey not in spec.calibration:
        if not measure:
            raise RuntimeError(f"mtp='auto': batch {B} in mode {mode} is not calibrated, and measure=False")
        spec.calibration[ckey] = _measure_costs(sess, spec, params, prompts, B)
    if measure and spec.acceptance(params.temperature).checks < MIN_ALPHA_CHECKS:
        _time_decode(sess, params, prompts, B, spec.K, spec.calibration_tokens)  # observes α
    calibrated = spec.calibration[ckey]
    costs = observed_costs(spec, B, mode, calibrated)
    alpha, source = _observed_alpha(spec, params.temperature)
    pred = predicted_speedups(costs, alpha)
    best = pick_k(pred, current)
    top = max(pred.values())
    reason = (f"predicted speedup {pred[best]:.2f}x at k={best}" if best else
              f"no k predicts >= {AUTO_MARGIN:.2f}x (best {top:.2f}x)")
    if best == current and pred[best] < top:
        reason += f" (kept: k={max(pred, key=pred.get)} predicts {top:.2f}x, within the switching margin)"
    info = {"k": best, "reason": reason, "batch": B, "temperature": params.temperature, "mode": mode,
            "alpha": [round(a, 3) for a in alpha], "alpha_source": source,
            "step_ms": {0: round(calibrated["step"] * 1e3, 3),
                        **{k: round(t * 1e3, 3) for k, t in calibrated["round"].items()}},
            "round_ms_used": {k: round(t * 1e3, 3) for k, t in costs["round"].items()},
            "predicted_speedup": {k: round(v, 3) for k, v in pred.items()},
            "guidance": "public: MTP pays at low temperature and small batch, loses at T > 0.7 or batch > 64"}
    if "spread" in calibrated:
        info["step_ms_spread"] = calibrated["spread"]
    if "observed" in costs:
        info["round_ms_observed"] = {k: round(t * 1e3, 3) for k, t in costs["observed"].items()}
    if "observed_step" in costs:
        info["step_ms_observed"] = round(costs["observed_step"] * 1e3, 3)
    return best, info


def cost_mode(params: SamplingParams) -> str:
    """Which device work a step or round runs: greedy, or sampling with the stages that sort."""
    if params.temperature == 0:
        return "greedy"
    return "sample" + ("+top_k" if params.top_k else "") + ("+top_p" if params.top_p < 1 else "")


def _observed_alpha(spec: Speculator, temperature: float) -> tuple[list[float], str]:
    """Per-position acceptance observed at this temperature bucket (`Acceptance.alpha`)."""
    acc = spec.acceptance(temperature)
    return acc.alpha(), f"observed over {acc.checks} rounds (weight {acc.prop[0]:.0f})"


def _temperature_bucket(temp: float) -> float:
    return 0.0 if temp == 0 else min(round(temp * 4) / 4, 2.0)


def _measure_costs(sess, spec: Speculator, params: SamplingParams, prompts: list[list[int]], B: int) -> dict:
    """{"step": seconds per plain decode step, "round": {k: seconds per k-draft round}} at batch B in
    params' mode: `calibration_repeats` passes over k = 0..K (interleaved, so a slow stretch of the
    machine hits every k alike), each a timed generation (`_time_decode`, the pipelined path the calls
    run, after one untimed generation per k that captures its CUDA graphs); the median per k.
    "spread": (max - min) / median per k, in percent."""
    n, ks = spec.calibration_tokens, range(spec.K + 1)
    if sess.executors:
        for k in ks:
            _time_decode(sess, params, prompts, B, k, min(8, n), warm=False)
    times: dict[int, list[float]] = {k: [] for k in ks}
    for _ in range(max(1, spec.calibration_repeats)):
        for k in ks:
            times[k].append(_time_decode(sess, params, prompts, B, k, n, warm=False))
    med = {k: statistics.median(v) for k, v in times.items()}
    spread = {k: round(100 * (max(v) - min(v)) / med[k], 1) if med[k] > 0 else 0.0 for k, v in times.items()}
    return {"step": med.pop(0), "round": med, "spread": spread}


def _time_decode(sess, params: SamplingParams, prompts: list[list[int]], B: int, k: int, n_new: int,
                 warm: bool = True) -> float:
    """Seconds per decode step (k = 0) or per k-draft round of a generation of B of `prompts` (cycled)
    with params, n_new tokens each and no stop tokens: from the end of admission (device synchronised)
    to the end, over the steps or rounds run. `warm`: a short untimed generation first captures the
    CUDA graphs of this bucket."""
    n_new = max(2, min(n_new, sess.max_tokens // 2))
    batch = [prompts[i % len(prompts)][-max(1, sess.max_tokens - n_new - 1):] for i in range(B)]

    def run(n: int) -> float:
        reqs = sess._requests(batch, n, params.temperature, params.top_p, params.top_k, 12345, None)
        for r in reqs:
            r.stop_ids, r.stop_strs = set(), []  # steady decoding to the end
        start: list[float] = []

        def admitted() -> None:
            _sync(sess.device)
            start.append(time.perf_counter())

        with torch.no_grad():
            for _ in sess._serve(reqs, k, on_decode=admitted):
                pass
        _sync(sess.device)
        steps = max((r.spec.rounds if k else len(r.out) - 1) for r in reqs)
        return (time.perf_counter() - start[0]) / max(steps, 1)

    if warm and sess.executors:
        run(min(8, n_new))
    return run(n_new)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def speculator(sess) -> Speculator:
    """The session's Speculator, made on first use (its MTP cache lives as long as the session)."""
    spec = sess.__dict__.get("_speculator")
    if spec is None:
        spec = sess.__dict__["_speculator"] = Speculator(sess)
    return spec
