"""Helpers of the sharding tests: run exported graphs on several gloo ranks (forked, so the children
inherit the parent's exported graphs and full weights) and compare with one process.

A scenario runs the same steps on a dict of graphs: a ragged prefill of two sequences, greedy decode
steps, and (when there is one) the MTP graph on the prefill's output; it returns every logits tensor.
"""
from __future__ import annotations

import json
import os
import socket
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

from dsv4c.export import flat_caches
from dsv4c.parallel import ParallelPlan
from dsv4c.passes import PassContext, set_param
from dsv4c.passes.shard import shard, slice_weight

PROMPT = (7, 5)  # real tokens of the two prompts
DECODE_STEPS = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def full_weights(gm: torch.fx.GraphModule) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in [*gm.named_parameters(), *gm.named_buffers()]}


@torch.no_grad()
def scenario(model, graphs: dict, n_slots: int = 3, max_len: int = 32, seed: int = 0) -> dict[str, torch.Tensor]:
    """prefill -> DECODE_STEPS greedy decode steps (-> the MTP graph on the prefill streams)."""
    g = torch.Generator().manual_seed(seed)
    V = model.config.vocab_size
    caches = flat_caches(model.new_cache(n_slots, max_len=max_len).layers)
    ids = torch.randint(0, V, (2, max(PROMPT)), generator=g)
    slots, n_real = torch.arange(2), torch.tensor(PROMPT)
    out = {}
    logits, hidden = graphs["prefill"](ids, slots, torch.zeros(2, dtype=torch.int64), n_real, caches)[:2]
    out["prefill"] = logits
    pos = n_real.clone()
    nxt = logits[torch.arange(2), n_real - 1].argmax(-1)[:, None]  # [2, 1]
    for s in range(DECODE_STEPS):
        step = graphs["decode"](nxt, slots, pos.clone(), torch.ones(2, dtype=torch.int64), caches)[0]
        out[f"decode{s}"] = step
        nxt = step[:, -1].argmax(-1)[:, None]
        pos += 1
    if "mtp" in graphs:
        mcaches = flat_caches(model.new_mtp_cache(n_slots, max_len=max_len).layers)
        T = 1  # the mtp graph takes 1 + k tokens per row (k = 0 here)
        nxt_ids = torch.randint(0, V, (2, T), generator=g)
        out["mtp"] = graphs["mtp"](hidden[:, :T], nxt_ids, slots, torch.zeros(2, dtype=torch.int64),
                                   torch.full((2,), T), mcaches)[0]
    return out


def _worker(rank: int, plan: ParallelPlan, port: int, model, graphs: dict, fulls: dict, out_dir: str,
            after_shard=None) -> None:
    import torch.distributed as dist

    from dsv4c.runtime.distributed import init_groups

    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=plan.world_size)
        init_groups(plan, rank)
        cfg = model.config
        stats = {}
        for name, gm in graphs.items():  # the forked copy: sharding it leaves the parent's graph alone
            res = shard(gm, PassContext(cfg, "cpu", name), plan, rank)
            stats[name] = res.stats
            for w, rec in res.stats.get("slices", {}).items():
                set_param(gm, w, slice_weight(fulls[name][w], rec))
            gm.recompile()
            if after_shard is not None:  # e.g. quantise the routed experts as compile does after the shard pass
                graphs[name] = after_shard(name, gm, res.stats)
        torch.save(scenario(model, graphs), Path(out_dir) / f"rank{rank}.pt")
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(stats))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def _fork_ranks(what, targets: list, out_dir: Path, timeout: float) -> None:
    """Fork one process per (fn, args) in `targets` (rank order), wait up to `timeout`, and raise naming
    `what` and the rank that hung (killed) or failed (with its rank{r}.err)."""
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=fn, args=args) for fn, args in targets]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            p.join()
            raise TimeoutError(f"{what}: rank {r} did not finish in {timeout}s")
        if p.exitcode != 0:
            err = out_dir / f"rank{r}.err"
            raise RuntimeError(f"{what}: rank {r} exited with {p.exitcode}:\n{err.read_text() if err.exists() else ''}")


def run_sharded(model, graphs: dict, plan: ParallelPlan, out_dir: Path, timeout: float = 120.0,
                after_shard=None) -> tuple[list[dict], list[dict]]:
    """Every rank's scenario outputs and shard-pass stats per graph, ranks forked from this process.
    `after_shard(name, gm, stats) -> gm` runs in each rank on its sharded graph with its weights."""
    fulls = {name: full_weights(gm) for name, gm in graphs.items()}
    port = free_port()
    _fork_ranks(plan, [(_worker, (r, plan, port, model, graphs, fulls, str(out_dir), after_shard))
                       for r in range(plan.world_size)], out_dir, timeout)
    return ([torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in range(plan.world_size)],
            [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(plan.world_size)])


# ---- artifacts: one Session per rank ---------------------------------------------------------------
@torch.no_grad()
def session_scenario(sess, seed: int = 0) -> dict[str, torch.Tensor]:
    """The artifact's graphs through a Session: each prompt prefilled into its slot, then
    DECODE_STEPS greedy decode steps of both together (on a sharded artifact rank 0 mirrors every
    call to the other ranks). Returns the logits, and the greedy tokens as `tokens`."""
    g = torch.Generator().manual_seed(seed)
    V = sess.config.vocab_size
    out, nxt = {}, []
    for slot, n in enumerate(PROMPT):
        sess._reset_slot(slot)
        logits = sess._run("prefill", torch.randint(0, V, (1, n), generator=g), [slot], [n]).float().cpu()
        out[f"prefill{slot}"] = logits
        nxt.append(int(logits[0, -1].argmax()))
    ids, tokens = torch.tensor(nxt)[:, None], [nxt]
    for s in range(DECODE_STEPS):
        step = sess._run("decode", ids, [0, 1], [1, 1]).float().cpu()
        out[f"decode{s}"] = step
        ids = step[:, -1].argmax(-1)[:, None]
        tokens.append(ids[:, 0].tolist())
    out["tokens"] = torch.tensor(tokens)
    return out


def _session_worker(rank: int, world: int, port: int, art: str, out_dir: str, scenario=None) -> None:
    import torch.distributed as dist

    from dsv4c.runtime import Session
    from dsv4c.runtime.distributed import send_stop, serve_follower

    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        sess = Session.load(art)  # checks the plan against this world, registers the groups
        if rank == 0:
            try:
                torch.save((scenario or session_scenario)(sess), Path(out_dir) / "rank0.pt")
            finally:
                send_stop(sess.device)
        else:
            serve_follower(sess)
        dist.destroy_process_group()
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def run_artifact(art: Path, world: int, out_dir: Path, timeout: float = 300.0, scenario=None) -> dict:
    """`scenario(sess)` (default `session_scenario`) on a sharded artifact: one forked gloo process per rank
    (rank 0 schedules and runs it, the others replay, as `dsv4c run` does); what rank 0's scenario returned."""
    port = free_port()
    _fork_ranks(art, [(_session_worker, (r, world, port, str(art), str(out_dir), scenario)) for r in range(world)],
                out_dir, timeout)
    return torch.load(out_dir / "rank0.pt", weights_only=True)
