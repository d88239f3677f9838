"""The distributed machinery of the runtime: process groups under the names the sharded graphs use.

The shard pass (passes/shard.py) writes functional collectives on the group *names*
`parallel.TP_GROUP` (this rank's row of the [ep, tp] mesh) and `parallel.WORLD_GROUP` (every rank).
`init_groups` creates the row groups (every rank creates every row's group, in row order, as
`torch.distributed.new_group` requires) and registers this rank's under those names, so a graph
saved by compile resolves its collectives in any process of the run.
"""
from __future__ import annotations

import os

import torch.distributed as dist

from dsv4c.parallel import TP_GROUP, WORLD_GROUP, ParallelPlan, PlanError

# NVLink multicast stays off in every worker (design: the lent machines' NVLS/multicast path is not used).
WORKER_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def set_worker_env() -> None:
    os.environ.update(WORKER_ENV)


def init_groups(plan: ParallelPlan, rank: int) -> dict:
    """Create the plan's groups on an initialised default group and register them by name.
    Returns {name: group} for this rank."""
    from torch._C._distributed_c10d import _register_process_group

    if not dist.is_initialized():
        raise RuntimeError("init_groups: torch.distributed is not initialised (init_process_group first)")
    world = dist.get_world_size()
    if world != plan.world_size:
        raise PlanError("world_size", f"the run has {world} processes, the plan {plan} needs {plan.world_size}")
    mine = None
    for row in range(plan.ep):
        ranks = list(range(row * plan.tp, (row + 1) * plan.tp))
        g = dist.new_group(ranks) if plan.ep > 1 else dist.group.WORLD
        if rank in ranks:
            mine = g
    groups = {TP_GROUP: mine, WORLD_GROUP: dist.group.WORLD}
    for name, g in groups.items():
        _register_process_group(name, g)
    return groups


# ---- one scheduler, replaying followers ----------------------------------------------------------
# Rank 0's Session decides every step; before it runs a graph (or resets a cache slot) it broadcasts
# the command and the step's inputs, and every other rank does the same on its own shards and caches.
# Header (int64 [8]): cmd, graph index, B, T, cache set, hidden ndim, hidden dims 2 and 3.
# Paged caches: every rank has its own pool, and rank 0's BlockPool decides the blocks; before a run whose
# block table changed since the last one sent, rank 0 sends CMD_TABLE and the table [slots, blocks], so every
# rank reads and writes the same blocks of its pool. A reset leaves the pools alone (their blocks follow the
# table).
# Prefix caching: rank 0's prefix cache (runtime/prefix_cache.py, or the paged BlockPool) decides what is
# stored and restored; each copy it makes between a slot and its store is sent as CMD_PREFIX (header: cmd,
# op, three ints, the length of a row list that follows), and every rank makes the same copy on its own
# caches into its own store (`PrefixReplica`): each rank's boundary state is its own shards'.
CMD_RUN, CMD_RESET, CMD_STOP, CMD_TABLE, CMD_PREFIX = 1, 2, 3, 4, 5  # CMD_TABLE: rank 0's block table follows
CACHE_SETS = ("main", "mtp", "fused")  # Session.caches, the MTP caches, verify_mtp's union of both
_HEADER = 8
# CMD_PREFIX ops. Slot caches (PrefixCache): SETUP (block size, pool blocks: the followers build the same
# pool), STORE (slot; rows [2, n]: pool row and block number of each block whose growing rows are stored),
# BOUNDARY (pool row, slot, end), RESTORE (slot; rows [n]: the pool rows of the blocks restored in order).
# Paged (BlockPool): PAGED_STORE / PAGED_RESTORE (block, slot, end), PAGED_FORGET (block).
OP_SETUP, OP_STORE, OP_BOUNDARY, OP_RESTORE, OP_PAGED_STORE, OP_PAGED_RESTORE, OP_PAGED_FORGET = range(1, 8)


def rank_view(art, manifest: dict) -> tuple[dict, int | None]:
    """Check that this run's world matches the artifact's plan; -> (this rank's manifest, rank or None
    for a single-process artifact). Registers the plan's process groups. Errors name the mismatch."""
    from dsv4c.compile import ArtifactError, rank_manifest

    plan = ParallelPlan.from_dict(manifest["parallel"]) if "parallel" in manifest else ParallelPlan()
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != plan.world_size:
        how = ("start it with `dsv4c run|bench ART` (one worker per rank) or torchrun --nproc-per-node "
               f"{plan.world_size}") if world == 1 else "recompile with a plan for this world or change the launch"
        raise ArtifactError(f"{art}: compiled for {plan} ({plan.world_size} rank(s)), but this run has {world} "
                            f"process(es) (torch.distributed world_size); {how}")
    if plan.is_single:
        return manifest, None
    rank = dist.get_rank()
    init_groups(plan, rank)
    return rank_manifest(manifest, rank), rank


def _bcast(t, device):
    t = t.to(device).contiguous()
    dist.broadcast(t, src=0)
    return t


class Leader:
    """Rank 0's side: mirrors each graph call and cache reset to the followers."""

    def __init__(self, sess):
        import torch

        self.sess, self.torch = sess, torch
        self.kinds = sorted(sess.manifest["graphs"])
        self.comm_device = sess.device
        self.table_version = -1  # paged: the block table version the followers hold
        self.prefix_setup = False  # slot caches: the followers built rank 0's prefix cache pool (OP_SETUP)

    def _header(self, *vals: int) -> None:
        h = self.torch.zeros(_HEADER, dtype=self.torch.int64)
        h[: len(vals)] = self.torch.tensor(vals, dtype=self.torch.int64)
        _bcast(h, self.comm_device)

    def run(self, kind: str, ids, slots, pos0, n_real, hidden, caches: dict) -> None:
        from dsv4c.export import MTP_CACHE_PREFIX

        pool = self.sess.prefix if self.sess.paged else None
        if pool is not None and pool.version != self.table_version:  # blocks are decided here, once for all ranks
            self._header(CMD_TABLE)
            _bcast(pool.table, self.comm_device)
            self.table_version = pool.version
        cset = 0 if caches is self.sess.caches else (2 if any(k.startswith(MTP_CACHE_PREFIX) for k in caches) else 1)
        B, T = ids.shape
        hs = tuple(hidden.shape[2:]) if hidden is not None else ()
        self._header(CMD_RUN, self.kinds.index(kind), B, T, cset, 0 if hidden is None else 2 + len(hs), *hs)
        _bcast(ids, self.comm_device)
        _bcast(self.torch.stack([slots, pos0, n_real]), self.comm_device)
        if hidden is not None:
            _bcast(hidden, self.comm_device)

    def reset(self, cache_set: str, slot: int) -> None:
        self._header(CMD_RESET, CACHE_SETS.index(cache_set), slot)

    def prefix(self, op: int, *vals: int, rows: list[int] | None = None) -> None:
        """Mirror one copy of the prefix cache (OP_*: up to three ints, and a row list)."""
        if not self.sess.paged and not self.prefix_setup:
            self.prefix_setup = True  # before the first copy: the same pool on every rank
            self.prefix(OP_SETUP, self.sess.prefix.block_size, self.sess.prefix.n_blocks)
        n = len(rows) if rows else 0
        self._header(CMD_PREFIX, op, *vals, *(0,) * (3 - len(vals)), n)
        if n:
            _bcast(self.torch.tensor(rows, dtype=self.torch.int64), self.comm_device)

    def stop(self) -> None:
        self._header(CMD_STOP)


def attach(sess, rank: int) -> None:
    """Make a loaded Session rank `rank` of a sharded run: rank 0 schedules and mirrors its graph calls,
    cache resets and prefix-cache copies (`Leader`); a follower replays them (`serve_follower`) and its
    prefix store is built and filled by those commands (slot caches: from rank 0's OP_SETUP)."""
    sess.rank = rank
    if rank == 0:
        sess.mirror = Leader(sess)
        if sess.prefix is not None:
            sess.prefix.mirror = sess.mirror
    elif not sess.paged:
        sess.prefix = None  # not its own: rank 0's OP_SETUP builds the pool its copies address


def _replay_prefix(sess, op: int, a: int, b: int, c: int, rows: list[int]) -> None:
    """A follower's side of one prefix-cache copy (Leader.prefix), on its own caches and store."""
    from dsv4c.runtime.prefix_cache import PrefixCache, PrefixCacheConfig

    if op == OP_SETUP:
        sess.prefix = PrefixCache(sess.config, sess.caches, sess.max_tokens, sess.max_batch, sess.device,
                                  PrefixCacheConfig(block_size=a, max_blocks=b))
    elif sess.prefix is None:
        raise RuntimeError(f"rank {dist.get_rank()}: prefix-cache op {op} from rank 0 before its pool (OP_SETUP)")
    elif op == OP_STORE:
        sess.prefix.store_rows(rows[: len(rows) // 2], rows[len(rows) // 2:], a)
    elif op == OP_BOUNDARY:
        sess.prefix.store_boundary_row(a, b, c)
    elif op == OP_RESTORE:
        sess.prefix.restore_rows(rows, a)
    elif op == OP_PAGED_STORE:
        sess.prefix.store_boundary(a, b, c)
    elif op == OP_PAGED_RESTORE:
        sess.prefix.restore_boundary(a, b, c)
    elif op == OP_PAGED_FORGET:
        sess.prefix.forget_boundary(a)
    else:
        raise RuntimeError(f"rank {dist.get_rank()}: unknown prefix-cache op {op} from rank 0")


def send_stop(device) -> None:
    """End the followers' replay loops (rank 0, after its work)."""
    import torch

    h = torch.zeros(_HEADER, dtype=torch.int64)
    h[0] = CMD_STOP
    _bcast(h, device)


def serve_follower(sess) -> int:
    """A follower rank's replay loop over its own Session; returns the number of graph calls replayed."""
    import torch

    from dsv4c.export import verify_mtp_caches
    from dsv4c.runtime.block_pool import paged_names
    from dsv4c.runtime.kv_cache import fill_value

    kinds = sorted(sess.manifest["graphs"])
    dev = sess.device
    act = getattr(torch, sess.manifest["dtype"])
    sets: dict[int, dict] = {0: sess.caches}

    def cache_set(i: int) -> dict:
        if 1 not in sets:
            sets[1] = sess._allocate_caches(mtp=True)
            sets[2] = verify_mtp_caches(sess.caches, sets[1])
        return sets[i]

    pools = paged_names(sess.caches) if sess.paged else set()
    calls = 0
    while True:
        h = _bcast(torch.zeros(_HEADER, dtype=torch.int64), dev).tolist()
        if h[0] == CMD_STOP:
            return calls
        if h[0] == CMD_RESET:
            for name, t in cache_set(h[1]).items():
                if h[1] == 1 or name not in pools:  # a slot's rows; the pools' blocks follow the table
                    t[h[2]].fill_(fill_value(name))
            continue
        if h[0] == CMD_PREFIX:
            rows = _bcast(torch.empty(h[5], dtype=torch.int64), dev).tolist() if h[5] else []
            _replay_prefix(sess, h[1], h[2], h[3], h[4], rows)
            continue
        if h[0] == CMD_TABLE:
            table = sess.caches["block_table"]
            table.copy_(_bcast(torch.empty(table.shape, dtype=torch.int64), dev))
            continue
        if h[0] != CMD_RUN:
            raise RuntimeError(f"rank {dist.get_rank()}: unknown command {h[0]} from rank 0")
        kind, B, T, cset, hnd = kinds[h[1]], h[2], h[3], h[4], h[5]
        ids = _bcast(torch.empty(B, T, dtype=torch.int64), dev)
        meta = _bcast(torch.empty(3, B, dtype=torch.int64), dev)
        lead = ()
        if hnd:
            lead = (_bcast(torch.empty((B, T, *h[6:6 + hnd - 2]), dtype=act), dev),)
        run = sess.executors[kind].run if kind in sess.executors else sess.graphs[kind]
        run(*lead, ids, meta[0], meta[1], meta[2], cache_set(cset), sess._graph_weights(kind))
        calls += 1


# ---- launching ---------------------------------------------------------------------------------
class WorkerError(RuntimeError):
    """A worker died or hung; the message names its rank."""


def torchrun_env() -> bool:
    """Started by torchrun (or `launch_workers`): RANK and WORLD_SIZE are in the environment."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_from_env(device_type: str = "cpu", timeout_s: float = 300.0) -> int:
    """init_process_group from torchrun's environment (NCCL on GPUs, gloo on CPUs); -> rank."""
    import datetime

    import torch

    set_worker_env()
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank()


def launch_workers(argv: list[str], world: int, timeout_s: float = 3600.0, poll_s: float = 0.1,
                   started=None) -> int:
    """Run `python -m dsv4c ARGV` as `world` worker processes with torchrun's environment (RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT, NVLink multicast off). Rank 0's output is the run's.
    A worker that exits with an error or is killed ends the others and raises WorkerError naming its
    rank; so does a run past `timeout_s` (naming the ranks still running). `started(procs)` sees the
    processes (tests)."""
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(world):
        env = {**os.environ, **WORKER_ENV, "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-m", "dsv4c", *argv], env=env,
                                      stdout=None if r == 0 else subprocess.DEVNULL))
    if started is not None:
        started(procs)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = sorted(((c > 0, r, c) for r, c in enumerate(codes) if c not in (None, 0)))
            if bad:  # a killed worker first: the others then fail on its closed connections
                _, r, c = bad[0]
                why = f"was killed by signal {-c}" if c < 0 else f"exited with code {c}"
                raise WorkerError(f"worker rank {r} {why}; the run is stopped (all {world} workers ended)")
            if all(c == 0 for c in codes):
                return 0
            if time.monotonic() > deadline:
                alive = [r for r, c in enumerate(codes) if c is None]
                raise WorkerError(f"worker rank(s) {alive} still running after {timeout_s:.0f}s (hung?); "
                                  f"the run is stopped")
            time.sleep(poll_s)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
