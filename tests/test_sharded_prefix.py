"""Prefix caching on sharded runs (issue 27 item 4; runtime/distributed.py CMD_PREFIX): rank 0's prefix cache
decides what is stored and restored, each copy is mirrored to the other ranks, and every rank stores and
restores its own caches' state (the paged BlockPool's boundary rows; the slot caches' growing and boundary
rows in a pool each rank holds).

The default test runs a gloo world of 2 whose ranks hold the eager model's step functions as their graphs
(tests/session_probe.py): rank 0 schedules through `attach` + `Leader` exactly as a sharded artifact's
rank 0 does, rank 1 replays with `serve_follower`. Both ranks compute the same thing, so every graph call of
the follower must give rank 0's logits: a restore the follower missed (its slot left at reset values) or
did wrongly shows as an error of order 1 on the follower alone. Rank 0's answers equal the single-process
run from scratch (fp32; 1e-5 as tests/test_paged_session.py's tiny pool: waits change which rows decode
together), with prefix hits, evictions and waits. The `long` test does the same end to end on compiled
tp = 2 (paged) and ep = 2 (slot caches) artifacts against the single-process artifact."""
from __future__ import annotations

import os
import traceback
from pathlib import Path

import pytest
import torch

from dsv4c import ModelConfig
from dsv4c.model import build_model, randomize_
from dsv4c.runtime.block_pool import PagedConfig
from dsv4c.runtime.prefix_cache import PrefixCacheConfig
from session_probe import eager_session, serve
from shard_cases import _fork_ranks, free_port, run_artifact

BLOCK = 8


def prompts_sharing(V: int, seed: int = 0) -> tuple[list[int], list[list[int]]]:
    """A 40-token base and prompts sharing 13 of it (inside a compression group), 16 (a block end) and 40
    (past the window of 8), then diverging."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(2, V, (40,), generator=g).tolist()
    tail = lambda n: torch.randint(2, V, (n,), generator=g).tolist()  # noqa: E731
    return base, [base[:13] + tail(6), base[:16] + tail(9), base + tail(7), base[:37], base[:24]]


# (model, paged): tiny pools evict and make requests wait (paged: 8 blocks of 8 for up to 3 requests of <= 7
# blocks, also preempting; slot caches: a prefix pool of 6 blocks)
CASES = [("v4-tiny-a", True), ("v4-tiny-a", False), ("v32-tiny", True), ("v32-tiny", False)]


def _session(model, paged: bool, leader: bool):
    if paged:
        return eager_session(model, BLOCK, leader, paged=PagedConfig(block_size=BLOCK, max_blocks=8))
    return eager_session(model, BLOCK, PrefixCacheConfig(block_size=BLOCK, max_blocks=6) if leader else False)


def _recording(sess) -> list[torch.Tensor]:
    """Record the logits of every graph call of `sess` (rank 0's and the follower's alike)."""
    calls = []
    for kind, g in list(sess.graphs.items()):
        def rec(*a, _g=g):
            out = _g(*a)
            calls.append(out[0].detach().clone())
            return out
        sess.graphs[kind] = rec
    return calls


def _rank(rank: int, port: int, models: dict, out_dir: str) -> None:
    import torch.distributed as dist

    from dsv4c.runtime.distributed import attach, send_stop, serve_follower

    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=2)
        out = []
        for name, paged in CASES:
            model = models[name]
            sess = _session(model, paged, leader=rank == 0)  # as Session.load: followers build no prefix cache
            attach(sess, rank)
            calls = _recording(sess)
            res = {"calls": calls}
            if rank == 0:
                try:
                    base, ps = prompts_sharing(model.config.vocab_size)
                    serve(sess, [base], max_new=1)
                    res["served"] = serve(sess, ps, max_new=3)
                    res["stats"] = sess.prefix.stats()
                finally:
                    send_stop(sess.device)
            else:
                serve_follower(sess)
            out.append(res)
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
        dist.destroy_process_group()
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


@pytest.fixture(scope="module")
def models():
    return {name: randomize_(build_model(ModelConfig.preset(name), dtype=torch.float32), seed=31 + i).eval()
            for i, name in enumerate(("v4-tiny-a", "v32-tiny"))}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / a.abs().max()).item()


@torch.no_grad()
def test_every_rank_restores_its_own_prefix_state_and_rank_0_gives_the_single_process_answers(models, tmp_path):
    port = free_port()
    _fork_ranks("sharded prefix cache", [(_rank, (r, port, models, str(tmp_path))) for r in range(2)], tmp_path, 120.0)
    lead, follow = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    for (name, paged), r0, r1 in zip(CASES, lead, follow):
        case = f"{name} {'paged' if paged else 'slot caches'}"
        st = r0["stats"]
        assert st["hit_tokens"] >= 3 * BLOCK and st["evictions"] > 0, (case, st)  # restores and evictions happened
        assert len(r1["calls"]) == len(r0["calls"]), case
        for i, (a, b) in enumerate(zip(r0["calls"], r1["calls"])):  # the follower computed what rank 0 did
            assert a.shape == b.shape and rel(a, b) <= 1e-6, f"{case}: graph call {i}: follower rel err {rel(a, b)}"
        base, ps = prompts_sharing(models[name].config.vocab_size)
        ref = serve(eager_session(models[name], BLOCK, False), ps, max_new=3)  # one process, no prefix cache
        toks, rows = r0["served"]
        assert toks == ref[0], case
        for i, (a, b) in enumerate(zip(ref[1], rows)):  # 1e-5: see the module docstring
            assert rel(a, b) <= 1e-5, f"{case}: request {i}: rel err {rel(a, b)}"


# ---- end to end: compiled sharded artifacts ------------------------------------------------------------
def _prefix_scenario(sess) -> dict:
    """Rank 0's part of the end-to-end test: fill the cache with the shared prefix, then serve the prompts."""
    base, ps = prompts_sharing(sess.config.vocab_size)
    serve(sess, [base], max_new=1)
    return {"served": serve(sess, ps, max_new=3), "stats": sess.prefix.stats()}


@pytest.mark.long  # three compiles and two gloo worlds of 2: minutes of CPU
@torch.no_grad()
def test_sharded_artifacts_with_prefix_caching_give_the_single_process_logits(tmp_path):
    """Compiled tp = 2 --paged (copy-free sharing, boundary rows per rank) and ep = 2 slot-cache (prefix pool
    per rank) artifacts with prefix caching on: prompts sharing a prefix that ends inside a compression group,
    on a block end and past the window give the single-process artifact's logits (fp32, 1e-5 as the other
    sharded tests) and tokens, with hits on rank 0."""
    from cut_presets import small
    from dsv4c import write_random_checkpoint
    from dsv4c.compile import compile_checkpoint
    from dsv4c.parallel import ParallelPlan
    from dsv4c.runtime import Session

    write_random_checkpoint(small("v4-tiny-a"), tmp_path / "ckpt", seed=3, dtype=torch.float32)
    kw = dict(target="cpu", max_tokens=64, max_batch=2, dtype=torch.float32)
    paged = PagedConfig(block_size=BLOCK, max_blocks=12)
    compile_checkpoint(tmp_path / "ckpt", tmp_path / "single", verify_boundaries=False, paged=paged, **kw)
    compile_checkpoint(tmp_path / "ckpt", tmp_path / "tp2", plan=ParallelPlan(2, 1), paged=paged, **kw)
    compile_checkpoint(tmp_path / "ckpt", tmp_path / "ep2", plan=ParallelPlan(1, 2), **kw)
    single = Session.load(tmp_path / "single", prefix_cache=False)
    base, ps = prompts_sharing(single.config.vocab_size)
    ref = serve(single, ps, max_new=3)
    for name in ("tp2", "ep2"):
        out = tmp_path / f"{name}-out"
        out.mkdir()
        got = run_artifact(tmp_path / name, 2, out, scenario=_prefix_scenario)
        assert got["stats"]["hit_tokens"] > 0, (name, got["stats"])
        assert got["served"][0] == ref[0], name
        for i, (a, b) in enumerate(zip(ref[1], got["served"][1])):
            assert rel(a, b) <= 1e-5, f"{name}: request {i}: rel err {rel(a, b)}"
