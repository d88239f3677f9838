"""Routing decisions as data: record the eager model's, tap a graph's, count flips, measure margins.

Two kinds of discrete decision are recorded and can be pinned: the MoE routers' (expert ids and weights,
`entries`) and the sparse-attention indexers' (the compressed entries each query attends to: V4's CSA
`Indexer`, V3.2's DSA `Indexer`; `index`). Both flip on near-ties when a lowering rounds differently.

A comparison tool (`dsv4c compare --pin-routing`, `compare.artifact_logits`): nothing here is part
of a compiled artifact or of the runtime's hot path.

    with record_routing(model) as rec:        # eager: every Gate's (expert ids, weights), call order
        ref = model(ids)
    tap = RoutingTap(rec.table, pin=True)     # graph side (passes/pin_routing.py inserts it before
                                              # each routed-experts op): feeds the recorded decisions
                                              # to the experts, and records the graph's own
    routing_flips(rec.table, tap.seen)        # per MoE layer: share of tokens whose top-k SET differs
    index_flips(rec.table, tap.seen)          # per indexer: share of queries whose selected SET differs

Entries are in call order: a model's forward calls its MoE layers in order (hash layers included), the
MTP block's gate after them; a graph's routed-experts ops sit in the same order. A recorded entry is
consumed row by row across calls (`RoutingTap` keeps a cursor per entry), so a prompt recorded in one
eager forward can be replayed through a graph run in chunks (Session's chunked prefill).

An indexer entry holds the selection [B·T, topk] of one call (query rows flattened batch-major, entry ids
as the op returns them, -1 = none); a graph's indexer ops (`INDEX_OPS`) sit in the same layer order.

Legend: T tokens (B·T rows of a step), K experts per token, E experts.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class RoutingEntry:
    """One router call: its module name, expert ids [T, K] int64 and weights [T, K] fp32 (on the CPU);
    `margins` [T] the gap between the K-th and (K+1)-th selection score (None for hash layers)."""

    name: str
    idx: torch.Tensor
    weight: torch.Tensor
    hashed: bool = False
    margins: torch.Tensor | None = None


@dataclass
class IndexEntry:
    """One indexer call: its attention's module name ("layers.1") and the selected entry ids [B·T, topk]
    int64 (on the CPU; -1 = none)."""

    name: str
    idx: torch.Tensor


@dataclass
class RoutingTable:
    entries: list[RoutingEntry] = field(default_factory=list)
    index: list[IndexEntry] = field(default_factory=list)  # the indexers' selections, call order

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    def merged(self) -> "RoutingTable":
        """Entries of the same module called several times (chunks) concatenated along the rows."""
        out: dict[str, RoutingEntry] = {}
        for e in self.entries:
            if e.name not in out:
                out[e.name] = RoutingEntry(e.name, e.idx, e.weight, e.hashed, e.margins)
                continue
            m = out[e.name]
            m.idx, m.weight = torch.cat([m.idx, e.idx]), torch.cat([m.weight, e.weight])
            if m.margins is not None and e.margins is not None:
                m.margins = torch.cat([m.margins, e.margins])
        idx: dict[str, IndexEntry] = {}
        for e in self.index:
            idx[e.name] = IndexEntry(e.name, torch.cat([idx[e.name].idx, e.idx]) if e.name in idx else e.idx)
        return RoutingTable(list(out.values()), list(idx.values()))


def _gate_classes() -> tuple[type, ...]:
    from dsv4c.model import v3, v4

    return (v4.Gate, v3.Gate)


def _indexer_classes() -> tuple[type, ...]:
    from dsv4c.model import v3, v4

    return (v4.Indexer, v3.Indexer)


def _layer_name(name: str) -> str:
    """"layers.1.attn.indexer" -> "layers.1" (V3.2: "model.layers.1.self_attn.indexer" -> "model.layers.1")."""
    return name.removesuffix(".indexer").removesuffix(".attn").removesuffix(".self_attn")


def topk_margins(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [T, E] -> [T]: k-th largest minus (k+1)-th largest (inf when E == k: nothing can flip)."""
    if scores.shape[-1] <= k:
        return torch.full(scores.shape[:-1], float("inf"))
    v = scores.float().topk(k + 1, dim=-1).values
    return v[..., k - 1] - v[..., k]


def _v4_selection_scores(gate, u: torch.Tensor) -> torch.Tensor:
    """The scores V4's top-K selects on: sqrt(softplus(u W^T)) + bias, fp32 [T, E]."""
    logits = F.linear(u.float(), gate.weight.float())
    return F.softplus(logits).sqrt() + gate.bias.float()


class record_routing(contextlib.AbstractContextManager):
    """Record every Gate and Indexer call of `model` (forward hooks; the model is unchanged): `.table`
    after the block. With `pin=table`, the gates' (and indexers') outputs are replaced by that table's,
    row by row (the eager side of a pinned comparison: e.g. an eager model with a perturbed layer,
    routed as the unperturbed one)."""

    def __init__(self, model: nn.Module, pin: RoutingTable | None = None):
        self.model, self.table, self._handles = model, RoutingTable(), []
        self._pin = RoutingTap(pin, pin=True) if pin is not None else None
        self._order: dict[str, int] = {}

    def __enter__(self) -> "record_routing":
        from dsv4c.model import v4

        classes = _gate_classes()
        gates = [(n, m) for n, m in self.model.named_modules() if isinstance(m, classes)]
        if not gates:
            raise ValueError(f"{type(self.model).__name__}: no router (Gate) modules to record")
        for name, gate in gates:
            short = name.removesuffix(".ffn.gate").removesuffix(".mlp.gate")

            def hook(mod, args, out, short=short):
                idx, w = out
                margins = None
                hashed = bool(getattr(mod, "hashed", False))
                if isinstance(mod, v4.Gate) and not hashed:
                    margins = topk_margins(_v4_selection_scores(mod, args[0]), mod.k).cpu()
                self.table.entries.append(RoutingEntry(short, idx.detach().cpu(), w.detach().float().cpu(),
                                                       hashed, margins))
                if self._pin is not None:
                    return self._pin(idx, w, slot=len(self.table) - 1)
                return None

            self._handles.append(gate.register_forward_hook(hook))
        for name, indexer in [(n, m) for n, m in self.model.named_modules() if isinstance(m, _indexer_classes())]:
            def index_hook(mod, args, out, short=_layer_name(name)):
                self.table.index.append(IndexEntry(short, out.detach().reshape(-1, out.shape[-1]).cpu()))
                if self._pin is not None:
                    return self._pin(out, slot=len(self.table.index) - 1, index=True)
                return None

            self._handles.append(indexer.register_forward_hook(index_hook))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _same_sets(own: torch.Tensor, pinned: torch.Tensor) -> torch.Tensor:
    """[rows]: whether each row of `own` selects the same set as the row of `pinned` ([rows, k] each)."""
    return (own.sort(dim=-1).values == pinned.sort(dim=-1).values).all(dim=-1)


class RoutingTap(nn.Module):
    """Inserted before the routed experts of a graph (passes/pin_routing.py): `tap(idx, w, slot=i)` is
    the i-th router of the graph. Always records the graph's own (idx, w) in `seen`; with `pin=True`
    returns the recorded decisions of entry i instead (the next rows of it: a cursor per entry), cast
    to the graph's dtypes and device, for the rows whose selected set differs from eager's: a row that
    selects eager's set keeps its own order and weights (they differ from eager's by the router kernel's
    rounding, an error pinning is meant to leave), so pinning changes nothing where no decision flipped.
    After each indexer op: `tap(sel, slot=j, index=True)` (sel
    [B, T, topk]), the j-th indexer, recorded in `seen.index` and pinned the same way. `reset()`
    rewinds the cursors and clears `seen`."""

    def __init__(self, table: RoutingTable | None = None, pin: bool = False):
        super().__init__()
        if pin and table is None:
            raise ValueError("RoutingTap(pin=True) needs a recorded RoutingTable")
        self.table, self.pin = table, pin
        self.reset()

    def reset(self) -> None:
        self.cursor: dict[int, int] = {}
        self.index_cursor: dict[int, int] = {}
        self.seen = RoutingTable()
        self._dev_cache: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, idx: torch.Tensor, weight: torch.Tensor | None = None, slot: int = 0, index: bool = False):
        if index:
            return self._index(idx, slot)
        name = self.table.entries[slot].name if self.table is not None and slot < len(self.table) else f"router{slot}"
        if not self.pin:
            self._see(name, idx, weight)
            return idx, weight
        if slot >= len(self.table):
            raise ValueError(f"pinned routing: the graph has a router #{slot}, the recorded table only "
                             f"{len(self.table)} ({self.table.names})")
        e = self.table.entries[slot]
        rows = idx.shape[0]
        start = self.cursor.get(slot, 0)
        if start + rows > e.idx.shape[0] or idx.shape[1] != e.idx.shape[1]:
            raise ValueError(f"pinned routing, router #{slot} ({e.name}): the graph asks for rows "
                             f"{start}..{start + rows} of K={idx.shape[1]}, the recording has "
                             f"{e.idx.shape[0]} rows of K={e.idx.shape[1]}")
        self.cursor[slot] = start + rows
        self._see(name, idx, weight)
        key = (slot, str(idx.device))
        if key not in self._dev_cache:
            self._dev_cache[key] = (e.idx.to(idx.device), e.weight.to(idx.device))
        i, w = self._dev_cache[key]
        i, w = i[start:start + rows].to(idx.dtype), w[start:start + rows].to(weight.dtype)
        same = _same_sets(idx, i)[:, None]  # a decision that agrees with eager's is not replaced
        return torch.where(same, idx, i), torch.where(same, weight, w)

    def _index(self, sel: torch.Tensor, slot: int) -> torch.Tensor:
        """The j-th indexer's selection sel [B, T, topk]: recorded; pinned, the recording's next B·T rows."""
        rows = sel.reshape(-1, sel.shape[-1])
        recorded = self.table.index if self.table is not None else []
        name = recorded[slot].name if slot < len(recorded) else f"indexer{slot}"
        if not self.pin:
            self.seen.index.append(IndexEntry(name, rows.detach().clone()))
            return sel
        if slot >= len(recorded):
            raise ValueError(f"pinned routing: the graph has an indexer #{slot}, the recorded table only "
                             f"{len(recorded)} ({[e.name for e in recorded]})")
        e = recorded[slot]
        start = self.index_cursor.get(slot, 0)
        if start + rows.shape[0] > e.idx.shape[0] or rows.shape[1] != e.idx.shape[1]:
            raise ValueError(f"pinned routing, indexer #{slot} ({e.name}): the graph asks for rows "
                             f"{start}..{start + rows.shape[0]} of topk={rows.shape[1]}, the recording has "
                             f"{e.idx.shape[0]} rows of topk={e.idx.shape[1]}")
        self.index_cursor[slot] = start + rows.shape[0]
        self.seen.index.append(IndexEntry(name, rows.detach().clone()))
        key = (-1 - slot, str(sel.device))  # the router cache's keys are >= 0
        if key not in self._dev_cache:
            self._dev_cache[key] = (e.idx.to(sel.device), e.idx)
        pinned = self._dev_cache[key][0][start:start + rows.shape[0]].to(sel.dtype)
        return torch.where(_same_sets(rows, pinned)[:, None], rows, pinned).view(sel.shape)

    def _see(self, name: str, idx: torch.Tensor, weight: torch.Tensor) -> None:
        self.seen.entries.append(RoutingEntry(name, idx.detach().clone(), weight.detach().float().clone()))

    def unconsumed(self) -> dict[str, int]:
        """Recorded rows no graph call asked for, per entry (empty: the replay covered the recording);
        indexer entries as "indexer <name>"."""
        if not self.pin:
            return {}
        left = {e.name: e.idx.shape[0] - self.cursor.get(i, 0) for i, e in enumerate(self.table.entries)
                if self.cursor.get(i, 0) != e.idx.shape[0]}
        left.update({f"indexer {e.name}": e.idx.shape[0] - self.index_cursor.get(i, 0)
                     for i, e in enumerate(self.table.index) if self.index_cursor.get(i, 0) != e.idx.shape[0]})
        return left


# ---- summaries --------------------------------------------------------------------------------
def set_flips(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a, b [T, K] expert ids -> [T] bool: the top-K expert SET differs (order within a row ignored)."""
    if a.shape != b.shape:
        raise ValueError(f"routing shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    return (a.cpu().sort(-1).values != b.cpu().sort(-1).values).any(-1)


def routing_flips(ref: RoutingTable, got: RoutingTable) -> list[dict]:
    """Per router (merged over chunks): {"layer", "hashed", "tokens", "flipped", "share"}."""
    r, g = ref.merged(), got.merged()
    if len(r) != len(g):
        raise ValueError(f"routing tables differ in length: {len(r)} routers recorded, {len(g)} seen")
    out = []
    for a, b in zip(r.entries, g.entries):
        f = set_flips(a.idx, b.idx)
        out.append({"layer": a.name, "hashed": a.hashed, "tokens": int(f.numel()), "flipped": int(f.sum()),
                    "share": float(f.float().mean()) if f.numel() else 0.0})
    return out


def index_flips(ref: RoutingTable, got: RoutingTable) -> list[dict]:
    """Per indexer (merged over chunks): {"layer", "tokens", "flipped", "share"}: the query tokens whose set
    of selected compressed entries differs from the reference's (order within a row ignored)."""
    r, g = ref.merged().index, got.merged().index
    if len(r) != len(g):
        raise ValueError(f"indexer tables differ in length: {len(r)} indexers recorded, {len(g)} seen")
    out = []
    for a, b in zip(r, g):
        f = set_flips(a.idx, b.idx)
        out.append({"layer": a.name, "tokens": int(f.numel()), "flipped": int(f.sum()),
                    "share": float(f.float().mean()) if f.numel() else 0.0})
    return out


MARGIN_QUANTILES = (0.0, 0.01, 0.1, 0.5, 0.9)


def margin_summary(table: RoutingTable, thresholds: tuple[float, ...] = (1e-3, 1e-2)) -> list[dict]:
    """Per router: quantiles of the top-K margin (score units: V4 selects on sqrt(softplus(logit)) + bias)
    and the share of tokens whose margin is below each threshold. Hash layers have no margin (their
    experts come from the token id), V3 gates are not measured: their entries carry only the counts."""
    out = []
    for e in table.merged().entries:
        if e.margins is None:
            out.append({"layer": e.name, "hashed": e.hashed, "tokens": int(e.idx.shape[0])})
            continue
        m = e.margins.double()
        q = torch.quantile(m, torch.tensor(MARGIN_QUANTILES, dtype=torch.float64)).tolist()
        out.append({"layer": e.name, "hashed": False, "tokens": int(m.numel()),
                    "quantiles": {f"p{int(p * 100)}": v for p, v in zip(MARGIN_QUANTILES, q)},
                    "below": {str(t): float((m < t).double().mean()) for t in thresholds}})
    return out
