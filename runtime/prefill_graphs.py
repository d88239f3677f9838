"""`PrefillGraphs`: the prefill graph replayed as CUDA graphs at fixed (rows, tokens) shapes.

The prefill graph (dynamic B and T) runs op by op, and a short call is bound by the host: on the slice,
16 rows of 128 tokens resuming from a cached system prompt took 94 ms for 32 ms of kernels
(examples/results/h200-2026-12-02d, run17). Here the graph is captured per shape of a fixed list and a
call is padded up to the smallest shape that holds it:

    before:  logits, hidden = prefill(ids [B, T], slots, pos0, n_real, caches, weights)      # ~1400 launches
    after:   copy the inputs into the shape's static buffers [R, Tb] (R >= B, Tb >= T), replay
             -> last [R, V] (each row's logits at its last real position), hidden [R, Tb, ...] (MTP only)

Why the padded call computes the same rows (the padding contract of the cache ops, tests/test_static_ops.py
and tests/test_batched_prefill.py): positions t >= n_real[b] of a row write no cache entry and, attention
being causal, change none of the row's real positions; padded rows run with n_real = 0 on the scratch
slot (`pad_slot`, the Session's last cache slot), as the decode executor's padded rows do. Only the last
real position's logits leave the graph (a [R, Tb, V] fp32 output per shape would hold 1 GB at 2048
tokens), so a caller that needs every position's logits (`Session.logits`) runs the graph op by op.

All shapes' graphs share one memory pool, so what one capture frees (the full logits, the MoE workspace)
the next reuses, and write their outputs into one set of buffers sized for the largest shape (the hidden
rows of a 2048-token call are 64 MB on V4-Flash, once rather than per shape). So a replay overwrites every
shape's outputs: a caller copies what it keeps before the next call (the Session's `take` functions clone).
Capture runs the shape once op by op on inputs that write nothing (n_real = 0: Triton's JIT compiles there,
not inside the capture), then captures; it happens at the shape's first use, or for every shape in
`capture_all` (`Session.warm_up`).

Measured on the slice (H200, examples/results/h200-2026-12-05b, run21), replayed vs op by op in one session:
one request resuming from a cached prompt (1 x 128 tokens) 26.3 -> 12.0 ms, a 2048-token chunk 39.6 -> 32.0
ms; 16 such requests in one call 79.6 -> 75.5 ms for 32 ms of kernels: the rest is per-request host work
outside the graph (admission, restore, first-token sampling).

`mode="emulate"` runs the same padded data flow op by op without CUDA graphs, so CPU tests check the
padding and the gather of the last positions.

Legend: B rows of the call, T its chunk length, R >= B and Tb >= T the shape it is padded to, V vocab.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

PAD_TOKEN = 0  # token id of padded positions and rows (any valid id: n_real keeps them from mattering)


def capture_blocker(gm) -> str | None:
    """Why the prefill graph `gm` cannot be captured (the first node `split_at_routers.capture_blockers` names:
    an op that syncs the host, data-dependent control flow or shapes), or None. A plain callable (tests' eager
    sessions) is not checked."""
    from dsv4c.passes.split_at_routers import capture_blockers

    graph = getattr(gm, "graph", None)
    for n in graph.nodes if graph is not None else ():
        why = capture_blockers(n)
        if why:
            return why[0]
    return None


def default_shapes(max_tokens: int, max_rows: int, min_tokens: int = 16) -> tuple[tuple[int, int], ...]:
    """(rows, tokens) shapes: powers of two of tokens from `min_tokens` and of rows from 1, rows x tokens
    within `max_tokens` (the call budget, max_num_batched_tokens) and rows within `max_rows`. The padding
    then at most doubles a call's rows and its tokens."""
    shapes, t = [], min_tokens
    while t <= max_tokens:
        r = 1
        while r <= max_rows and r * t <= max_tokens:
            shapes.append((r, t))
            r *= 2
        t *= 2
    return tuple(shapes)


@dataclass
class _Shape:
    rows: int
    tokens: int
    ids: torch.Tensor  # [R, Tb] int64
    slots: torch.Tensor  # [R]
    pos0: torch.Tensor  # [R]
    n_real: torch.Tensor  # [R]
    graph: object = None  # torch.cuda.CUDAGraph ("cuda"), True once captured ("emulate")
    outs: tuple = ()  # (last [R, V], hidden [R, Tb, ...] when kept): views of the shared output buffers
    stats: dict = field(default_factory=dict)


class PrefillGraphs:
    """The prefill graph `gm` at fixed shapes (module docstring). `keep_hidden`: return the hidden output
    too (the MTP's admission reads it); `pad_slot`: the scratch cache slot padded rows point at."""

    def __init__(self, gm, device: torch.device, shapes, pad_slot: int, *, keep_hidden: bool,
                 mode: str = "cuda"):
        if mode not in ("cuda", "emulate"):
            raise ValueError(f"mode: expected 'cuda' or 'emulate', got {mode!r}")
        if mode == "cuda" and torch.device(device).type != "cuda":
            raise ValueError("mode 'cuda' needs a CUDA device; use mode='emulate' to test the padded path elsewhere")
        bad = [s for s in shapes if len(s) != 2 or min(s) < 1]
        if bad:
            raise ValueError(f"shapes: (rows, tokens) pairs of positive ints, got {bad}")
        self.gm, self.device, self.mode = gm, torch.device(device), mode
        self.pad_slot, self.keep_hidden = pad_slot, keep_hidden
        # smallest padded size first, so `fit` takes the least padding
        self.shapes = tuple(sorted({(int(r), int(t)) for r, t in shapes}, key=lambda s: (s[0] * s[1], s[1])))
        self._state: dict[tuple[int, int], _Shape] = {}
        self._bound: tuple | None = None  # (caches, weights) the graphs were captured with
        self._bufs: tuple | None = None  # the outputs of every shape: last [max R, V] (, hidden [max R·Tb, ...])
        self.pool = None
        self.stats = {"mode": mode, "replays": 0, "captures": 0, "capture_s": 0.0, "graph_bytes": 0,
                      "reserved_bytes": 0}

    def fit(self, B: int, T: int) -> tuple[int, int] | None:
        """The smallest shape that holds a [B, T] call, or None (the call runs op by op). Any padding pays on
        the slice: a call's host time is ~60 ms (1,400 launches), the kernel time of ~4,000 tokens, and
        `default_shapes` pads at most 2x in rows and in tokens."""
        return next(((r, t) for r, t in self.shapes if r >= B and t >= T), None)

    @torch.no_grad()
    def run(self, ids: torch.Tensor, slots: torch.Tensor, pos0: torch.Tensor, n_real: torch.Tensor,
            caches: dict, weights: dict) -> tuple:
        """ids [B, T], slots / pos0 / n_real [B] on the device -> (last [B, 1, V], hidden [B, T, ...] if kept):
        views of the static outputs, valid until the next call."""
        B, T = ids.shape
        shape = self.fit(B, T)
        if shape is None:
            raise ValueError(f"no prefill graph shape holds {B} rows x {T} tokens (shapes: {self.shapes})")
        self._check_bound(caches, weights)
        st = self._state.get(shape) or self._capture(shape, caches, weights)
        st.ids[:B, :T].copy_(ids)
        st.ids[:B, T:].fill_(PAD_TOKEN)
        st.slots[:B].copy_(slots)
        st.pos0[:B].copy_(pos0)
        st.n_real[:B].copy_(n_real)
        if B < st.rows:
            st.ids[B:].fill_(PAD_TOKEN)
            st.slots[B:].fill_(self.pad_slot)
            st.pos0[B:].zero_()
            st.n_real[B:].zero_()
        self._replay(st, caches, weights)
        self.stats["replays"] += 1
        st.stats["replays"] = st.stats.get("replays", 0) + 1
        last = st.outs[0][:B, None]  # [B, 1, V]
        return (last, st.outs[1][:B, :T]) if self.keep_hidden else (last,)

    def capture_all(self, caches: dict, weights: dict) -> float:
        """Capture every shape not captured yet (Session.warm_up); -> seconds."""
        t0 = time.perf_counter()
        self._check_bound(caches, weights)
        for shape in self.shapes:
            if shape not in self._state:
                self._capture(shape, caches, weights)
        return time.perf_counter() - t0

    # ---- internals ---------------------------------------------------------------------------------
    def _check_bound(self, caches: dict, weights: dict) -> None:
        """A captured graph reads the caches and weights at the addresses it was captured with."""
        if self._bound is None:
            self._bound = (caches, weights)
        elif caches is not self._bound[0] or weights is not self._bound[1]:
            raise RuntimeError("PrefillGraphs: called with other cache or weight dicts than the graphs were "
                               "captured with; caches and weights must stay the same tensors")

    def _forward(self, st: _Shape, caches: dict, weights: dict) -> tuple:
        """The graph on the shape's static inputs, reduced to the outputs kept (module docstring) and copied
        into the shared output buffers; -> the shape's views of them."""
        logits, hidden = self.gm(st.ids, st.slots, st.pos0, st.n_real, caches, weights)[:2]
        rows = torch.arange(st.rows, device=self.device)
        outs = (logits[rows, (st.n_real - 1).clamp(min=0)],) + ((hidden,) if self.keep_hidden else ())  # [R, V], ...
        if self._bufs is None:  # the first call, never inside a capture (capture runs a shape op by op first)
            big_r, big_rt = max(r for r, _ in self.shapes), max(r * t for r, t in self.shapes)
            self._bufs = (outs[0].new_empty(big_r, *outs[0].shape[1:]),) + tuple(
                o.new_empty(big_rt, *o.shape[2:]) for o in outs[1:])
        views = self._views(st)
        for v, o in zip(views, outs):
            v.copy_(o)
        return views

    def _views(self, st: _Shape) -> tuple:
        """The shape's outputs in the shared buffers: last [R, V] (, hidden [R, Tb, ...])."""
        R, Tb = st.rows, st.tokens
        return (self._bufs[0][:R],) + tuple(b[:R * Tb].view(R, Tb, *b.shape[1:]) for b in self._bufs[1:])

    def _capture(self, shape: tuple[int, int], caches: dict, weights: dict) -> _Shape:
        R, Tb = shape
        t0 = time.perf_counter()
        z = lambda: torch.zeros(R, dtype=torch.int64, device=self.device)  # noqa: E731
        st = _Shape(R, Tb, torch.full((R, Tb), PAD_TOKEN, dtype=torch.int64, device=self.device),
                    z().fill_(self.pad_slot), z(), z())  # n_real = 0 everywhere: the capture writes nothing
        if self.mode == "cuda":
            mem0, res0 = torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device)
            side = torch.cuda.Stream(device=self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._forward(st, caches, weights)  # Triton's JIT and the allocator's first blocks, outside capture
            torch.cuda.current_stream(self.device).wait_stream(side)
            torch.cuda.synchronize(self.device)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                st.outs = self._forward(st, caches, weights)
            st.graph = g
            torch.cuda.synchronize(self.device)
            # allocated: what stays live after the capture (the output buffers); reserved: what the allocator
            # took from the device for it (the shared pool grows only for a shape larger than the ones before)
            st.stats["graph_bytes"] = max(torch.cuda.memory_allocated(self.device) - mem0, 0)
            st.stats["reserved_bytes"] = max(torch.cuda.memory_reserved(self.device) - res0, 0)
            self.stats["graph_bytes"] += st.stats["graph_bytes"]
            self.stats["reserved_bytes"] += st.stats["reserved_bytes"]
        else:
            st.outs = self._forward(st, caches, weights)
            st.graph = True
        st.stats["capture_s"] = time.perf_counter() - t0
        self.stats["captures"] += 1
        self.stats["capture_s"] += st.stats["capture_s"]
        self._state[shape] = st
        return st

    def _replay(self, st: _Shape, caches: dict, weights: dict) -> None:
        if self.mode == "cuda":
            st.graph.replay()
        else:  # emulate: the padded call op by op, into the same output views
            self._forward(st, caches, weights)
