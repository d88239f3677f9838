"""How a model is spread over GPUs, as data: `ParallelPlan(tp, ep)`.

The ranks form a mesh `[ep, tp]`; rank r sits at `(ep_rank, tp_rank) = divmod(r, tp)`.

- Attention, dense MLPs, the shared expert, embedding and LM head: tensor parallel over the `tp`
  ranks of one row of the mesh (heads, intermediate columns, vocabulary rows), replicated across
  rows. What cannot be split (the shared K=V latent, compressors, norms, mHC) is replicated.
- Routed experts: expert parallel over the `ep` rows (row e holds experts
  `[e·E/ep, (e+1)·E/ep)`), and inside a row tensor parallel over each expert's intermediate dim.
- Every rank sees the same tokens; partial results are summed with all-reduce (attention and dense
  within a row, routed experts over the whole world).

Nothing here knows about graphs or weights: the shard pass and the runtime read the plan.
"""
from __future__ import annotations

from dataclasses import dataclass

# Process-group names the shard pass writes into graphs (functional collectives resolve groups by
# name); the runtime registers this process's groups under them (runtime/distributed.py).
TP_GROUP = "dsv4c_tp"  # the tp ranks of this rank's row of the mesh
WORLD_GROUP = "dsv4c_world"  # every rank (routed-expert partial sums)


class PlanError(ValueError):
    """A plan that does not fit the model or the world; `.field` names what is wrong."""

    def __init__(self, field_name: str, msg: str):
        super().__init__(f"{field_name}: {msg}")
        self.field = field_name


@dataclass(frozen=True)
class ParallelPlan:
    tp: int = 1  # tensor-parallel degree (attention heads, dense columns, vocabulary)
    ep: int = 1  # expert-parallel degree (routed experts)

    def __post_init__(self) -> None:
        for name in ("tp", "ep"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise PlanError(name, f"must be an integer >= 1, got {v!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.ep

    @property
    def is_single(self) -> bool:
        return self.world_size == 1

    def coords(self, rank: int) -> tuple[int, int]:
        """(ep_rank, tp_rank) of a global rank."""
        if not 0 <= rank < self.world_size:
            raise PlanError("rank", f"{rank} is outside the world of {self.world_size} ranks ({self})")
        return divmod(rank, self.tp)

    def tp_group(self, rank: int) -> tuple[int, ...]:
        """The ranks that share attention/dense shards with `rank` (one row of the mesh)."""
        e, _ = self.coords(rank)
        return tuple(e * self.tp + t for t in range(self.tp))

    def ep_group(self, rank: int) -> tuple[int, ...]:
        """The ranks that hold the same tp shard of different experts (one column of the mesh)."""
        _, t = self.coords(rank)
        return tuple(e * self.tp + t for e in range(self.ep))

    def to_dict(self) -> dict:
        return {"tp": self.tp, "ep": self.ep, "world_size": self.world_size}

    @classmethod
    def from_dict(cls, d: dict) -> "ParallelPlan":
        for key in ("tp", "ep"):
            if key not in d:
                raise PlanError(key, f"missing from the plan {d!r}")
        plan = cls(tp=d["tp"], ep=d["ep"])
        if "world_size" in d and d["world_size"] != plan.world_size:
            raise PlanError("world_size", f"{d['world_size']} != tp*ep = {plan.world_size}")
        return plan

    def __str__(self) -> str:
        return f"ParallelPlan(tp={self.tp}, ep={self.ep}, world={self.world_size})"
