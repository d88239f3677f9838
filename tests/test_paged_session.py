"""Paged caches through the Session (runtime/block_pool.py, issue 27 item 1): the growing caches in
blocks of a shared pool, read and written through the block table, give the logits of the slot caches
(fp32, 1e-6) for tiny V4 (SWA, CSA, HCA layers), V3 and V3.2, in prefill and decode; prompts sharing a
prefix share its blocks without copies and each gets its from-scratch result; a tiny pool evicts and
waits and keeps every answer exact; a pool too small for one request is refused naming the limit.

As tests/test_prefix_cache.py, the Sessions run the eager model's traceable `step` as their graphs (the
exported graphs: tests/test_paged_ops.py). Both sides prefill in chunks of one block."""
from __future__ import annotations

import pytest
import torch

from dsv4c import ModelConfig
from dsv4c.model import build_model, randomize_
from dsv4c.runtime import Session
from dsv4c.runtime.block_pool import PagedCacheError, PagedConfig
from session_probe import eager_session as probe_session
from session_probe import assert_same, follow_up_turn, serve


def eager_session(model, block: int, paged: PagedConfig | None, prefix: bool = True, **kw) -> Session:
    """tests/session_probe.eager_session with paged caches (`paged`; the prefix cache follows `prefix`) or
    slot caches without a prefix cache (None)."""
    return probe_session(model, block, prefix if paged is not None else False, paged=paged, **kw)


def prompts_sharing(V: int, seed: int = 0) -> tuple[list[int], list[list[int]]]:
    """A 40-token base and prompts sharing 13 of it (inside a compression group), 16 (a block end) and 40
    (past the window), then diverging."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(2, V, (40,), generator=g).tolist()
    tail = lambda n: torch.randint(2, V, (n,), generator=g).tolist()  # noqa: E731
    return base, [base[:13] + tail(6), base[:16] + tail(9), base + tail(7), base[:37], base[:24]]


NAMES = ("v4-tiny-a", "v3-tiny", "v32-tiny")


@pytest.fixture(scope="module")
def models():
    return {name: randomize_(build_model(ModelConfig.preset(name), dtype=torch.float32), seed=21 + i).eval()
            for i, name in enumerate(NAMES)}


@pytest.fixture(scope="module")
def refs(models):
    """The slot caches' answers to prompts_sharing (no prefix cache), per model."""
    out = {}
    for name, model in models.items():
        base, ps = prompts_sharing(model.config.vocab_size)
        out[name] = serve(eager_session(model, 8, None), ps, max_new=3)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_paged_logits_equal_the_slot_caches_and_shared_prefixes_are_exact(models, refs, name):
    """Prefill and decode logits of paged caches equal the slot caches'; with prefix sharing the base's
    blocks are put into the later tables (no copy) and every request still gets its from-scratch answer."""
    model = models[name]
    base, ps = prompts_sharing(model.config.vocab_size)
    ref = refs[name]
    assert_same(ref, serve(eager_session(model, 8, PagedConfig(block_size=8), prefix=False), ps, max_new=3))
    sess = eager_session(model, 8, PagedConfig(block_size=8))
    serve(sess, [base], max_new=1)  # registers its 5 blocks
    assert_same(ref, serve(sess, ps, max_new=3))
    st = sess.prefix.stats()
    # shared blocks, leaving >= 1 token to prefill: 19 tokens sharing 13 -> 8, 25 sharing 16 -> 16, ...
    assert st["hit_tokens"] == 8 + 16 + 40 + 32 + 16, st
    assert st["blocks_in_use"] == 0 and st["blocks_cached"] >= 5, st


@pytest.mark.parametrize("name", ["v4-tiny-a", "v3-tiny"])
def test_a_follow_up_turn_shares_the_blocks_its_answer_completed(models, name):
    """The next turn's prompt is the last prompt, its answer and a new message: the blocks the answer's
    decode steps completed were registered when it finished (with V4's boundary state at their ends), so
    the turn shares them without copies and equals the slot caches from scratch (session_probe.follow_up_turn)."""
    model, block = models[name], 8
    sess = eager_session(model, block, PagedConfig(block_size=block))
    follow_up_turn(sess, eager_session(model, block, None), block)
    st = sess.prefix.stats()
    assert st["blocks_in_use"] == 0 and set(sess.prefix.boundary) <= set(sess.prefix.key_of), st


@pytest.mark.parametrize("mode,temperature,forced", [("off", 0.8, None), ("off", 0.0, 0.7), ("emulate", 0.0, 0.7)])
@torch.no_grad()
def test_mtp_rounds_register_the_blocks_they_complete(models, mode, temperature, forced):
    """As the slot caches' prefix cache (tests/test_prefix_cache.py): an answer decoded in pipelined MTP rounds
    registers the blocks its rounds completed, with V4's boundary state at their ends patched for the ring rows
    the next queued round overwrote, and the next turn shares them and equals the slot caches from scratch."""
    from dsv4c.runtime.speculative import speculator

    model, block = models["v4-tiny-a"], 8
    sess = eager_session(model, block, PagedConfig(block_size=block), mtp_k=2)
    speculator(sess).round_mode = mode
    follow_up_turn(sess, eager_session(model, block, None), block, mtp=2, temperature=temperature, forced=forced)
    st = sess.prefix.stats()
    assert st["blocks_in_use"] == 0 and st["stored_blocks"] >= 8
    assert set(sess.prefix.boundary) <= set(sess.prefix.key_of)


def test_shared_blocks_are_referenced_not_copied_and_never_written(models):
    """Two running requests share the base's first blocks: their table rows hold the same pool blocks,
    and those blocks' bytes do not change while both decode."""
    model = models["v4-tiny-a"]
    base, _ = prompts_sharing(model.config.vocab_size, seed=4)
    sess = eager_session(model, 8, PagedConfig(block_size=8))
    serve(sess, [base], max_new=2)
    pools = {k: t.clone() for k, t in sess.caches.items() if k.endswith("entries")}
    pool = sess.prefix
    shared = [pool.by_key[k] for k in pool.keys(base)[:3]]
    a, b = base[:24] + [3, 4, 5], base[:24] + [6, 7, 8, 9]
    rows = {}
    orig_admit = pool.admit

    def admit(ids, slot, pos, mtp=False, **kw):
        ok = orig_admit(ids, slot, pos, mtp, **kw)
        rows[slot] = pool.table[slot].clone()
        return ok

    pool.admit = admit
    ref = serve(eager_session(model, 8, None), [a, b], max_new=5)
    got = serve(sess, [a, b], max_new=5)
    assert_same(ref, got)
    r0, r1 = rows.values()
    assert r0[:3].tolist() == r1[:3].tolist() == shared  # the same pool blocks in both tables
    own = [{x for x in r[3:].tolist() if x != pool.n_blocks} for r in (r0, r1)]  # (scratch: unused entries)
    assert own[0] and own[1] and own[0].isdisjoint(own[1]) and not own[0] & set(shared)
    rb = {k: pools[k].shape[1] for k in pools}
    for k, t in pools.items():
        assert torch.equal(sess.caches[k][shared], t[shared]), k  # shared blocks never written
        assert rb[k] * pool.n_blocks < pools[k].numel()  # (pools, not per-slot caches)


def test_table_rows_reach_the_device_at_the_next_flush_in_one_copy(models):
    """Admitted and released rows are written on the host and sent by the next flush (Session._run flushes
    before queuing a graph): requests finishing together cost one copy, not one each; the answers are
    those of the slot caches (the admitted rows were on the device before their prefill)."""
    model = models["v4-tiny-a"]
    base, ps = prompts_sharing(model.config.vocab_size, seed=5)
    sess = eager_session(model, 8, PagedConfig(block_size=8))
    pool, table = sess.prefix, sess.caches["block_table"]
    assert pool.table_dev is table
    assert_same(serve(eager_session(model, 8, None), ps[:3], max_new=2), serve(sess, ps[:3], max_new=2))
    assert sorted(pool.dirty) == [0, 1, 2] and (pool.table[:3] == pool.n_blocks).all()  # released, not sent
    assert (table[:3] != pool.n_blocks).any()
    pool.flush()
    assert not pool.dirty and torch.equal(table, pool.table)


def test_eviction_and_waiting_under_a_tiny_pool_keep_every_answer_exact(models):
    model = models["v4-tiny-a"]
    base, ps = prompts_sharing(model.config.vocab_size, seed=2)
    ps = ps[:4] + [base[::-1], base[::-1][:30] + [3, 4]]
    ref = serve(eager_session(model, 8, None), ps, max_new=3)
    sess = eager_session(model, 8, PagedConfig(block_size=8, max_blocks=8))
    # waiting changes which requests decode together: batched rows round differently (as in test_batching)
    assert_same(ref, serve(sess, ps, max_new=3), tol=1e-5)
    st = sess.prefix.stats()
    assert st["evictions"] > 0 and st["waits"] > 0 and st["hit_tokens"] > 0 and st["blocks_in_use"] == 0, st
    assert sess.caches["0.ring"].shape[0] == 4 and sess.caches["1.entries"].shape[0] == 8 + 1  # pool: 8 + scratch


def test_a_pool_too_small_for_one_request_is_refused_naming_the_limit(models):
    model = models["v3-tiny"]
    sess = eager_session(model, 4, PagedConfig(block_size=4, max_blocks=4))
    with pytest.raises(PagedCacheError, match=r"pool too small: a 17-token prompt with max_new_tokens=2 needs 5 "
                                              r"blocks of 4 tokens, the pool holds 4 \(PagedConfig.max_blocks\)"):
        sess.generate([[5] * 3, [6] * 17], max_new_tokens=2)
    assert sess.prefix.stats()["requests"] == 0
    with pytest.raises(PagedCacheError, match="block_size=6: must be >= 1 and a multiple of every compression"):
        eager_session(models["v4-tiny-a"], 4, PagedConfig(block_size=6))


def first_stop(tokens: list[int], logits: torch.Tensor, stop: set[int]):
    """A generation cut where a stop token ends it: (tokens, logits rows)."""
    n = next((i + 1 for i, t in enumerate(tokens) if t in stop), len(tokens))
    return tokens[:n], logits[:n]


def test_blocks_grow_with_the_tokens_so_a_pool_smaller_than_the_reservations_serves_the_batch(models):
    """A request takes its prompt's blocks at admission and one more each time decode crosses a block end: a
    9-block pool (the slot caches: 36) serves three requests with max_new_tokens=40 at once (reserving
    prompt + max_new would need 3 x 7 blocks), since they stop early; logits equal the slot caches'."""
    model = models["v4-tiny-a"]
    for seed in range(11, 31):  # prompts whose 7th sampled tokens occur nowhere earlier: each request stops at its 7th
        g = torch.Generator().manual_seed(seed)
        ps = [torch.randint(2, model.config.vocab_size, (n,), generator=g).tolist() for n in (15, 14, 13)]
        ref = serve(eager_session(model, 8, None), ps, max_new=8)
        stop = {toks[6] for toks in ref[0]}
        cut = [first_stop(t, lg, stop) for t, lg in zip(*ref)]
        if all(len(t) == 7 for t, _ in cut):
            break
    assert all(len(t) == 7 for t, _ in cut), "no seed in 11..30 gives three requests that stop at their 7th token"
    ref = [t for t, _ in cut], [lg for _, lg in cut]
    sess = eager_session(model, 8, PagedConfig(block_size=8, max_blocks=9))
    assert 3 * sess.prefix.blocks_for(13 + 40) > sess.prefix.n_blocks
    grown = []
    orig_grow = sess.prefix.grow

    def grow(slot, end, **kw):
        before = len(sess.prefix.seqs[slot].blocks) if slot in sess.prefix.seqs else 0
        ok = orig_grow(slot, end, **kw)
        grown.append(len(sess.prefix.seqs[slot].blocks) - before)
        return ok

    sess.prefix.grow = grow
    got = serve(sess, ps, max_new=40, stop=sorted(stop))
    assert_same(ref, got)
    st = sess.prefix.stats()
    assert st["waits"] == 0 and st["preemptions"] == 0 and st["requests"] == 3 and st["blocks_in_use"] == 0, st
    assert st["peak_blocks_in_use"] == 9, st
    assert sum(grown) >= 3 and max(grown) == 1  # blocks taken one at a time, as decode crossed block ends


def test_when_no_block_can_be_had_requests_wait_or_are_preempted_and_get_exact_tokens(models):
    """A 6-block pool: the third request waits for blocks (its prompt needs 3 while two run); when both
    running requests cross a block end with no block left, the younger is preempted, waits until the older
    finishes and resumes from prompt + its tokens (sharing its cached prompt block). Greedy tokens (the
    pipelined decode) equal the slot caches'."""
    model = models["v4-tiny-a"]
    g = torch.Generator().manual_seed(12)
    ps = [torch.randint(2, model.config.vocab_size, (n,), generator=g).tolist() for n in (9, 9, 20)]
    ref = serve(eager_session(model, 8, None), ps, max_new=20, temperature=0.0)[0]
    sess = eager_session(model, 8, PagedConfig(block_size=8, max_blocks=6))
    assert [r.tokens for r in sess.generate(ps, max_new_tokens=20, temperature=0.0)] == ref
    st = sess.prefix.stats()
    assert st["waits"] > 0 and st["preemptions"] > 0 and st["blocks_in_use"] == 0, st
    # the incremental API (the server's): a preempted request can be aborted while it waits; the others finish
    sess = eager_session(model, 8, PagedConfig(block_size=8, max_blocks=6))
    ids = [sess.add_request(p, max_new_tokens=20) for p in ps]
    got: dict[int, list[int]] = {i: [] for i in ids}
    while sess.has_unfinished():
        for o in sess.step():
            got[o.request_id] += o.tokens
        victim = next((r for r in sess._live.waiting if r.preempted), None)
        if victim is not None and victim.index == ids[1]:
            assert sess.abort(victim.index) and not sess.abort(victim.index)
    assert got[ids[0]] == ref[0] and got[ids[2]] == ref[2] and got[ids[1]] == ref[1][: len(got[ids[1]])]
    assert len(got[ids[1]]) < 20 and sess.prefix.stats()["blocks_in_use"] == 0
    assert st["hit_tokens"] >= 8  # the preempted request's prompt block was shared on resuming


def greedy(sess: Session, prompts, max_new: int, mtp: int = 0, forced: dict | None = None):
    """generate()'s greedy tokens and the drafts MTP rounds accepted; `forced`: teacher-forced drafts of the
    true continuation, kept with probability 0.7 (acceptance on a random model, runtime/speculative.py)."""
    from dsv4c.runtime.speculative import ForcedDrafts, speculator

    if mtp:
        speculator(sess).forced = ForcedDrafts(forced, alpha=0.7) if forced else None
    with torch.no_grad():
        res = sess.generate(prompts, max_new_tokens=max_new, temperature=0.0, mtp=mtp)
    return [r.tokens for r in res], sum(r.stats["accepted_draft_tokens"] for r in res)


def test_paged_mtp_gives_the_tokens_of_plain_decoding_with_shared_prefixes_and_a_small_pool(models):
    """Paged + MTP (k = 1, 2; pipelined verify_mtp rounds write 1 + k positions and roll back by moving the
    position; drafts teacher-forced so that some are accepted): greedy tokens equal paged k = 0 and slot + MTP,
    with the base's blocks shared (resuming >= W tokens before each prompt's end) and never written, and
    under a 9-block pool (waits, blocks grown ahead of queued rounds, preemption)."""
    model = models["v4-tiny-a"]
    base, ps = prompts_sharing(model.config.vocab_size, seed=3)
    ps, n = [ps[0], ps[1], ps[2]], 18  # 19, 25 and 47 tokens sharing 13, 16 and 40 of the base
    plain, _ = greedy(eager_session(model, 8, PagedConfig(block_size=8)), ps, n)
    truth = {i: p + t for i, (p, t) in enumerate(zip(ps, plain))}
    slot, acc = greedy(eager_session(model, 8, None, mtp_k=2), ps, n, mtp=2, forced=truth)
    assert slot == plain and acc > 0
    sess = eager_session(model, 8, PagedConfig(block_size=8), mtp_k=2)
    greedy(sess, [base], 2)
    pool = sess.prefix
    shared = [pool.by_key[k] for k in pool.keys(base)]
    before = {k: t[shared].clone() for k, t in sess.caches.items() if k.endswith("entries")}
    for k in (1, 2):
        got, acc = greedy(sess, ps, n, mtp=k, forced=truth)
        assert got == plain and acc > 0, k
    st = pool.stats()
    assert st["hit_tokens"] == 2 * (8 + 16 + 32), st  # each resume <= len - W (W = 8)
    assert all(torch.equal(sess.caches[k][shared], t) for k, t in before.items())
    small = eager_session(model, 8, PagedConfig(block_size=8, max_blocks=9), mtp_k=2)
    got, acc = greedy(small, ps, n, mtp=2, forced=truth)
    st = small.prefix.stats()
    assert got == plain and acc > 0 and st["waits"] > 0 and st["preemptions"] > 0 and st["blocks_in_use"] == 0, st


def test_session_logits_on_paged_caches(models):
    """Session.logits (no admission) takes blocks as it goes and gives them back."""
    model = models["v32-tiny"]
    ids = prompts_sharing(model.config.vocab_size, seed=6)[0]
    ref = eager_session(model, 8, None).logits(ids)
    sess = eager_session(model, 8, PagedConfig(block_size=8, max_blocks=6))
    got = sess.logits(ids)
    assert ((ref - got).abs().max() / ref.abs().max()).item() <= 1e-6
    assert sess.prefix.stats()["blocks_in_use"] == 0


def _h200_paged_gives_the_slot_tokens(tmp_path, device: str) -> None:
    """The h200 lowering of v4-tiny-a (fp32, reference experts), slot and paged artifacts (block tables in
    every cache op): the paged one gives the slot one's logits and tokens, with and without prefix sharing."""
    from dsv4c import write_random_checkpoint
    from dsv4c.compile import compile_checkpoint

    write_random_checkpoint(ModelConfig.preset("v4-tiny-a"), tmp_path / "ckpt", seed=3, dtype=torch.float32)
    common = dict(target="h200", max_tokens=96, max_batch=3, dtype=torch.float32, kernels={"moe_experts": "reference"},
                  verify_boundaries=device == "cuda")
    compile_checkpoint(tmp_path / "ckpt", tmp_path / "slot", **common)
    compile_checkpoint(tmp_path / "ckpt", tmp_path / "paged", paged=PagedConfig(block_size=8, max_blocks=24), **common)
    emulate = device == "cpu"
    slot = Session.load(tmp_path / "slot", device=device, emulate=emulate, max_num_batched_tokens=8, prefix_cache=False)
    paged = Session.load(tmp_path / "paged", device=device, emulate=emulate, max_num_batched_tokens=8, paged=True)
    if device == "cuda":
        assert paged.executors["decode"].mode in ("full", "graphs")
    assert paged.caches["1.entries"].shape[0] == 24 + 1
    base, ps = prompts_sharing(slot.config.vocab_size)
    ref = serve(slot, ps, max_new=6)
    paged.prefix.share = False
    got = serve(paged, ps, max_new=6)
    for i, (a, b) in enumerate(zip(ref[1], got[1])):  # the same kernels reading the same rows
        assert ((a - b).abs().max() / a.abs().max()).item() < 1e-5, i
    assert ref[0] == got[0]
    paged.prefix.share = True
    serve(paged, [base], max_new=1)
    shared = serve(paged, ps, max_new=6)
    assert paged.prefix.stats()["hit_tokens"] == 8 + 16 + 40 + 32 + 16
    for i, (a, b) in enumerate(zip(ref[1], shared[1])):
        assert ((a - b).abs().max() / a.abs().max()).item() < 1e-5, i
    assert ref[0] == shared[0]


@pytest.mark.gpu
@torch.no_grad()
def test_h200_paged_artifact_captures_cuda_graphs_and_gives_the_slot_tokens(tmp_path):
    """On the GPU: the h200 lowering of paged caches (the Triton attention, indexer and compressor with block
    tables) captured as CUDA graphs gives the logits and tokens of the slot artifact, with and without
    prefix sharing, and the paged decode graph is captured whole."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _h200_paged_gives_the_slot_tokens(tmp_path, "cuda")


@torch.no_grad()
def test_h200_paged_artifact_on_the_cpu_gives_the_slot_tokens(tmp_path):
    """The same on the CPU (emulate): the paged graphs' cache ops in their CPU forms (the `_paged` static ops
    each Triton kernel is tested equal to) in a real Session, prefill and decode, blocks shared or not."""
    _h200_paged_gives_the_slot_tokens(tmp_path, "cpu")


@pytest.mark.gpu
@torch.no_grad()
def test_h200_paged_mtp_artifact_in_cuda_graphs_gives_the_plain_greedy_tokens(tmp_path):
    """On the GPU: a paged artifact with --mtp 2 (verify, mtp and verify_mtp graphs on the block pool, captured
    as CUDA graphs; a 12-block pool, so blocks grow and requests wait) gives, with k = 1 and 2 (drafts
    teacher-forced so that some are accepted) and shared prefix blocks, the greedy tokens of k = 0."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from dsv4c import write_random_checkpoint
    from dsv4c.compile import compile_checkpoint

    write_random_checkpoint(ModelConfig.preset("v4-tiny-a"), tmp_path / "ckpt", seed=3, dtype=torch.float32)
    compile_checkpoint(tmp_path / "ckpt", tmp_path / "paged", target="h200", max_tokens=96, max_batch=3, mtp_k=2,
                       dtype=torch.float32, kernels={"moe_experts": "reference"},
                       paged=PagedConfig(block_size=8, max_blocks=12))
    sess = Session.load(tmp_path / "paged", device="cuda", max_num_batched_tokens=8, paged=True)
    assert sess.executors["verify_mtp"].mode in ("full", "graphs")
    base, ps = prompts_sharing(sess.config.vocab_size, seed=3)
    ps, n = [ps[0], ps[1], ps[2]], 18
    sess.prefix.share = False
    plain, _ = greedy(sess, ps, n)
    truth = {i: p + t for i, (p, t) in enumerate(zip(ps, plain))}
    sess.prefix.share = True
    greedy(sess, [base], 2)
    for k in (1, 2):
        got, acc = greedy(sess, ps, n, mtp=k, forced=truth)
        assert got == plain and acc > 0, k
    st = sess.prefix.stats()
    assert st["hit_tokens"] > 0 and st["waits"] > 0 and st["blocks_in_use"] == 0, st


def test_boundary_check_drive_compares_paged_caches_by_slot(models):
    """runtime/segments.py's boundary check drives the same prompts twice and compares the caches; with
    paged caches the second run gets other blocks, so it compares each slot's rows in order."""
    from dsv4c.runtime.segments import _drive

    model = models["v4-tiny-a"]
    sess = eager_session(model, 8, PagedConfig(block_size=8), prefix=False)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (7, 12)]
    ids = [torch.randint(0, 250, (2, 1), generator=g) for _ in range(3)]
    with torch.no_grad():
        a = _drive(sess, prompts, [0, 2], ids)
        rows_a = sess.prefix.table[[0, 2]].clone()
        sess._reset_slot(2)
        sess.prefix.ensure(1, 30)  # slot 2's blocks go to slot 1: the next run's slot 2 gets other pool blocks
        b = _drive(sess, prompts, [0, 2], ids)
    assert not torch.equal(rows_a, sess.prefix.table[[0, 2]]) and "block_table" not in b[1]
    for k in a[1]:
        assert torch.equal(a[1][k][:-1], b[1][k][:-1]), k
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0]))


@pytest.mark.long  # two compiles and a gloo world of 2: ~2 min of CPU
def test_sharded_paged_artifact_on_gloo_gives_the_single_process_paged_logits(tmp_path):
    """Paged + tp (issue 27 item 3): compile --tp 2 --paged; each rank has its own pool, the block table is
    decided by rank 0 and sent to the other rank when it changes (runtime/distributed.py CMD_TABLE). Prefill
    and greedy decode on a gloo world of 2 give the single-process paged artifact's logits and tokens."""
    from cut_presets import small
    from dsv4c import write_random_checkpoint
    from dsv4c.compile import compile_checkpoint
    from dsv4c.parallel import ParallelPlan
    from shard_cases import run_artifact, session_scenario

    write_random_checkpoint(small("v4-tiny-a"), tmp_path / "ckpt", seed=2, dtype=torch.float32)
    kw = dict(target="cpu", max_tokens=32, max_batch=2, dtype=torch.float32, paged=PagedConfig(block_size=8,
                                                                                                 max_blocks=5))
    compile_checkpoint(tmp_path / "ckpt", tmp_path / "single", verify_boundaries=False, **kw)
    compile_checkpoint(tmp_path / "ckpt", tmp_path / "tp2", plan=ParallelPlan(2, 1), **kw)
    ref = session_scenario(Session.load(tmp_path / "single"))
    got = run_artifact(tmp_path / "tp2", 2, tmp_path)
    for k in ref:
        if k != "tokens":
            err = ((got[k] - ref[k]).abs().max() / ref[k].abs().max()).item()
            assert err <= 1e-5, f"{k}: rel err {err:.2e}"
    assert torch.equal(got["tokens"], ref["tokens"])
