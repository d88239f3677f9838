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
