"""Run a graph split at its routers (`dsv4c.passes.split_at_routers`) segment by segment, with the
capturable segments as CUDA graphs per batch bucket.

    split = apply_plan(gm, plan)
    ex = SegmentExecutor(split, plan, "cuda")
    logits, streams = ex.run(ids, slots, pos0, n_real, caches)   # same call as gm

Modes (`mode=`):
  eager    run the split module as is (the default on CPU): equal to the unsplit graph.
  graphs   (CUDA, the default there) pad the batch to a bucket, capture every capturable segment once
           per bucket as a `torch.cuda.CUDAGraph`, all buckets sharing one memory pool and captured
           largest first; replay them, run the other segments eagerly in between, slice back.
  emulate  the `graphs` data flow without CUDA graphs, on any device: the same static buffers,
           padding and slicing; a "capture" runs the segment once and keeps its outputs as the
           static outputs, a "replay" runs it again and copies into them. CPU tests use it.
  full     (CUDA) the whole step, routed experts included, as one CUDA graph per bucket. Needs every
           segment capturable, i.e. a capture-safe expert op (`dsv4c.passes.select_kernels`). The
           experts then see the padding rows too: they are computed and dropped like every other
           padded row, and no tokens-per-expert count exists outside the op.
  full-emulate  the `full` data flow without CUDA graphs (CPU tests).

In `graphs`/`emulate` the dynamic segments always run eagerly between the captured ones, even when
their op is capture-safe: that is the piecewise mode the `full` mode is compared against.

Padding (decode/mtp graphs: T = 1 + k tokens per row is fixed; the bucket is over the batch B, so a
bucket b holds b·T tokens). A batch of B rows runs in the smallest bucket b >= B. Rows B..b-1 are
padding: n_real = 0 (the ops write nothing for them), pos0 = 0, slot = `pad_slot` (default: the
slot of row 0; any slot works because nothing is written), token ids 0. Dynamic segments (the routed
experts) get only the real tokens (the first B·T rows), so padded rows reach no expert and stay out
of the tokens-per-expert counts; their outputs are padded back with zeros. (A dynamic segment that a
target makes capturable is captured like the others and then sees all b rows.) Graph outputs are
sliced to the B real rows and copied out of the static buffers (`run(..., copy_outputs=False)`: views of
them, valid until the next run).

Staged inputs: a caller may write a step's slots / pos0 / n_real into the static buffers itself, in one
copy (`meta_staging`: the three share one [3, Bmax] block, so one pinned host-to-device copy of its values
fills every row, padding included), and pass the block's rows as those inputs: `run` then copies nothing
for them. runtime/session.py's decode steps do (three device copies fewer a step; they also take the logits
as views, a fourth).

Capture writes nothing to the caches: the capture pass runs on representative inputs (random token
ids, small distinct positions, the bucket's rows all treated as real for the experts) with
n_real = 0 in every row. The caches (and weights, when the graph takes them as inputs) must be the
same tensors at every call (their addresses are baked into the graphs); `run` checks that. With
`debug=True` every captured input's data_ptr is checked against its capture-time value at every
replay.

Graphs need a fixed T: a prefill graph (dynamic T) runs only in `eager` mode. A batch larger than
the largest bucket (or than `max_tokens` tokens) runs eagerly on the split module, unpadded.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node

from dsv4c.passes import get_param
from dsv4c.passes.split_at_routers import SegmentPlan
from dsv4c.targets import DEFAULT_BUCKETS

MODES = ("eager", "graphs", "emulate", "full", "full-emulate")
META_INPUTS = ("slots", "pos0", "n_real")  # the rows of the staged block (`SegmentExecutor.meta_staging`)


@dataclass
class _Binding:
    """How a captured segment's input is provided at replay."""

    kind: str  # static (same tensor every run) | copy (copied into `tensor` before replay) | const
    node: Node  # the parent-graph node the value comes from
    value: object  # the tensor the graph reads (static/copy), or the constant
    ptr: int = 0  # data_ptr at capture (tensors)


@dataclass
class _Captured:
    seg: int
    bindings: list[_Binding]
    outputs: tuple  # static outputs (tensors in the graph pool / ints)
    graph: object = None  # torch.cuda.CUDAGraph (graphs mode)
    args: tuple = ()  # the static argument tuple (emulate mode re-runs on it)


@dataclass
class _Bucket:
    size: int
    captured: dict[int, _Captured] = field(default_factory=dict)
    full: object = None  # full mode: the CUDA graph of the whole step (or True when emulating)
    full_env: dict = field(default_factory=dict)  # full mode: the static env (inputs and every value)
    flat_views: dict[int, torch.Tensor] = field(default_factory=dict)  # flat input index -> buffer[:size]
    pad_bufs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (seg, out) -> [size*T, ...]
    owned: list[torch.Tensor] = field(default_factory=list)  # copy-binding buffers


@dataclass
class _Step:
    seg: int
    call: Node  # the call_module node in the parent graph
    module: torch.nn.Module
    args: tuple[Node, ...]
    outs: list[Node | None]  # parent node per submodule output (getitem or the call itself)
    real_in: frozenset[int]  # argument positions sized to real tokens (dynamic segments)
    real_out: frozenset[int]  # output positions sized to real tokens
    captured: bool  # captured (graphs/emulate) or eager


class SegmentExecutor:
    """Runs `split_gm` (from `apply_plan`) with `plan`; see the module docstring."""

    def __init__(self, split_gm: GraphModule, plan: SegmentPlan, device, buckets=DEFAULT_BUCKETS,
                 max_tokens: int | None = None, *, mode: str | None = None, pad_slot: int | None = None,
                 debug: bool = False, warmup: int = 2, seed: int = 0):
        self.gm, self.plan = split_gm, plan
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.mode = mode or ("graphs" if self.device.type == "cuda" else "eager")
        if self.mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {self.mode!r}")
        if self.mode in ("graphs", "full") and self.device.type != "cuda":
            raise ValueError(f"mode {self.mode!r} needs a CUDA device; use 'emulate' / 'full-emulate' to test the "
                             f"bucketed path elsewhere")
        self.full = self.mode.startswith("full")
        self.cuda_graphs = self.mode in ("graphs", "full")
        if self.full and plan.n_capturable != len(plan.segments):
            bad = next(s for s in plan.segments if not s.capturable)
            raise ValueError(f"mode {self.mode!r} captures the whole step, but segment {bad.index} ({bad.kind}) is "
                             f"not capturable: {bad.reason}")
        self.debug, self.warmup, self.seed, self.pad_slot = debug, warmup, seed, pad_slot
        self.T = plan.tokens_per_row
        self.stats: dict = {"mode": self.mode, "runs": 0, "replays": 0, "eager_segment_runs": 0,
                            "eager_fallbacks": 0, "capture_s": 0.0, "graph_bytes": 0, "graph_reserved_bytes": 0,
                            "static_buffer_bytes": 0, "buckets": {}}
        if self.mode == "eager":
            self.buckets: tuple[int, ...] = ()
            return
        if self.T is None:
            raise ValueError(f"{plan.graph_kind} graph: bucketed execution needs a fixed number of tokens per row "
                             f"(decode/mtp graphs); run it with mode='eager'")
        self._check_device()
        self.max_tokens = max_tokens if max_tokens is not None else max(buckets) * self.T
        bs = sorted(b for b in set(buckets) if b * self.T <= self.max_tokens)
        if plan.n_slots is not None:  # no batch has more rows than cache slots (the graphs' limit too)
            bs = sorted({min(b, plan.n_slots) for b in bs})
        if not bs:
            raise ValueError(f"no bucket fits max_tokens={self.max_tokens} at {self.T} tokens per row")
        self.buckets = tuple(bs)
        self._parse()
        self._bucket_state: dict[int, _Bucket] = {}
        self._flat_bufs: dict[int, torch.Tensor] = {}
        self._meta_block: torch.Tensor | None = None  # [3, Bmax] int64: the META_INPUTS' buffers, one per row
        self._meta_idx: dict[int, int] = {}  # flat index -> its row of _meta_block
        self._externals: dict[int, int] = {}  # flat index -> data_ptr of the caches/weights captured against
        self._captured_all = False
        self._fast_flatten: bool | None = None  # decided on the first call (`_flatten`)
        self.pool = None

    # ---- public ------------------------------------------------------------------------------
    @torch.no_grad()
    def run(self, *args, copy_outputs: bool = True):
        """Same call and result as `split_gm(*args)` (the outputs are fresh tensors; with `copy_outputs=False`
        the bucketed path returns views of its static outputs, which the next run overwrites: for a caller
        that consumes them in stream order first)."""
        self.stats["runs"] += 1
        if self.mode == "eager":
            return self.gm(*args)
        flat = self._flatten(args)
        B = flat[self._ids].shape[0]
        if flat[self._ids].shape[1] != self.T:
            raise ValueError(f"expected {self.T} tokens per row, got {flat[self._ids].shape[1]}")
        b = next((x for x in self.buckets if x >= B), None)
        if b is None:
            self.stats["eager_fallbacks"] += 1
            return self.gm(*args)
        if not self._captured_all:
            self.capture(*args)
        self._check_externals(flat)
        st = self._bucket_state[b]
        self._fill_inputs(st, flat, B)
        if self.full:
            env = self._replay_full(st)
        else:
            env = self._base_env(st, flat)
            for step in self._steps:
                if step.captured:
                    self._replay(st, step, env)
                else:
                    self._run_eager(st, step, env, B * self.T)
        outs = []
        for v, n in zip(self.plan.graph_outputs, self._out_nodes):
            t = env[n]
            if isinstance(t, torch.Tensor) and v.rows in ("batch", "tokens"):
                t = t[: B if v.rows == "batch" else B * self.T]
                t = t.clone() if copy_outputs else t
            outs.append(t)
        return self._unflatten(outs)

    __call__ = run

    @torch.no_grad()
    def run_direct(self, *args):
        """The whole step's kernels launched on `args` as given: no static buffers, no padding, no replay
        of this executor's graphs. For a caller that captures a larger CUDA graph around the call
        (runtime/speculative.py `RoundGraphs`: one graph per MTP round): replaying a captured graph
        inside another stream capture is not relied on. Only the full modes, where every segment is
        capture-safe; the experts see every row of `args`, padded rows included (as in `full`)."""
        if not self.full:
            raise ValueError(f"{self.plan.graph_kind} graph: run_direct needs mode 'full' or 'full-emulate' (every "
                             f"segment capture-safe), this executor runs {self.mode!r}")
        flat = self._flatten(args)
        if flat[self._ids].shape[1] != self.T:
            raise ValueError(f"expected {self.T} tokens per row, got {flat[self._ids].shape[1]}")
        env = {n: flat[i] for i, n in enumerate(self._placeholders)}
        env.update(self._weights)
        self._run_steps(env)
        self.stats["direct_calls"] = self.stats.get("direct_calls", 0) + 1  # host calls (a captured round counts once)
        return self._unflatten([env[n] for n in self._out_nodes])

    @torch.no_grad()
    def capture(self, *args) -> None:
        """Capture every bucket, largest first, against the caches in `args` (nothing is written to
        them). `run` calls this on its first bucketed call."""
        if self.mode == "eager" or self._captured_all:
            return
        flat = self._flatten(args)
        self._externals = {i: flat[i].data_ptr() for i in self._cache_idx}
        Bmax = max(self.buckets)
        meta = self._meta_idx = self._meta_rows(flat)
        if meta:
            self._meta_block = torch.zeros((len(META_INPUTS), Bmax), dtype=torch.int64, device=self.device)
        for i in self._padded_idx:
            x = flat[i]
            if i in meta:
                buf = self._meta_block[meta[i]]
            else:
                buf = torch.zeros((Bmax, *x.shape[1:]), dtype=x.dtype, device=x.device)
            self._flat_bufs[i] = buf
            self.stats["static_buffer_bytes"] += buf.numel() * buf.element_size()
        if self.cuda_graphs:
            self.pool = torch.cuda.graph_pool_handle()
        t_all = time.perf_counter()
        for b in sorted(self.buckets, reverse=True):
            self._capture_bucket(b, flat)
        self.stats["capture_s"] = time.perf_counter() - t_all
        self._captured_all = True

    def meta_staging(self, slots: list[int], pos0: list[int], n_real: list[int]
                     ) -> tuple[torch.Tensor, list[int]] | None:
        """For a caller that writes a step's slots / pos0 / n_real (B rows each) into the static buffers itself:
        the block [3, Bmax] int64 (rows `META_INPUTS`) and the 3·Bmax values to write into it, each row's real
        values followed by the padding `_fill_inputs` would set (pad_slot or slots[0]; 0; 0). Pass
        `block[j, :B]` as the three inputs: `run` copies and pads nothing for them. None before the first run
        captured the buckets, when the graph's inputs are not three int64 rows, or when B rows have no
        bucket (the eager fallback takes its inputs as they are)."""
        B = len(slots)
        if self._meta_block is None or not 0 < B <= max(self.buckets) or B * self.T > self.max_tokens:
            return None
        pad = [0] * (self._meta_block.shape[1] - B)
        pad_slot = slots[0] if self.pad_slot is None else self.pad_slot
        return self._meta_block, [*slots, *[pad_slot] * len(pad), *pos0, *pad, *n_real, *pad]

    def _meta_rows(self, flat) -> dict[int, int]:
        """flat index -> row of the staged block for the META_INPUTS, when the graph takes all three as
        int64 [B] (decode / verify / MTP graphs); else {}."""
        rows = {i: META_INPUTS.index(self._placeholders[i].name) for i in self._padded_idx
                if self._placeholders[i].name in META_INPUTS}
        ok = len(rows) == len(META_INPUTS) and all(flat[i].dim() == 1 and flat[i].dtype == torch.int64 for i in rows)
        return rows if ok else {}

    # ---- setup --------------------------------------------------------------------------------
    def _check_device(self) -> None:
        for name, p in list(self.gm.named_parameters()) + list(self.gm.named_buffers()):
            if p.device != self.device:
                raise ValueError(f"{name} lives on {p.device}, not {self.device}: export the graph from a model on "
                                 f"{self.device} (graphs hold device constants, so .to() is not enough)")

    def _parse(self) -> None:
        g = self.gm.graph
        self._placeholders = [n for n in g.nodes if n.op == "placeholder"]
        names = [n.name for n in self._placeholders]
        roles = {v.name: v for v in self.plan.graph_inputs}
        if names != [v.name for v in self.plan.graph_inputs]:
            raise ValueError("split module and plan disagree on the graph inputs")
        self._ids = names.index("input_ids") if "input_ids" in names else 0
        self._padded_idx = [i for i, n in enumerate(names) if roles[n].role in ("padded", "meta")]
        self._cache_idx = [i for i, n in enumerate(names) if roles[n].role in ("cache", "weight")]
        self._weights = {n: get_param(self.gm, n.target) for n in g.nodes if n.op == "get_attr"}
        out = g.find_nodes(op="output")[0]
        self._out_nodes = [a for a in torch.utils._pytree.tree_leaves(out.args[0]) if isinstance(a, Node)]
        calls = [n for n in g.nodes if n.op == "call_module" and n.target.startswith("submod_")]
        self._steps = []
        for seg, call in zip(self.plan.segments, calls):
            mod = getattr(self.gm, call.target)
            n_out = len(seg.outputs)
            getitems = {u.args[1]: u for u in call.users if u.op == "call_function"}
            outs = [call] if n_out == 1 and not getitems else [getitems.get(i) for i in range(n_out)]
            real_in = frozenset(i for i, v in enumerate(seg.inputs) if v.role == "real" and v.rows == "tokens")
            real_out = frozenset(i for i, v in enumerate(seg.outputs) if v.role == "real" and v.rows == "tokens")
            captured = seg.capturable and (self.full or seg.kind == "static")
            self._steps.append(_Step(seg.index, call, mod, tuple(call.args), outs, real_in, real_out, captured))
        if len(self._steps) != len(self.plan.segments):
            raise ValueError("split module and plan disagree on the segments")

    def _flatten(self, args) -> list:
        """The graph's flat inputs. pytree's flatten of a step's ~230 leaves (the cache and weight
        dicts) took ~100 us of host time per call; a step's args are tensors and one-level dicts of
        tensors, whose leaves are just their values in order. The first call checks that this gives
        pytree's leaves; later calls use it while the leaf count stays the same."""
        if self._fast_flatten:
            flat = _one_level_leaves(args)
            if flat is not None and len(flat) == len(self._placeholders):
                return flat
        slow = list(self.gm.graph._codegen.process_inputs(*args))
        if self._fast_flatten is None:
            fast = _one_level_leaves(args)
            self._fast_flatten = fast is not None and len(fast) == len(slow) and all(a is b for a, b in zip(fast, slow))
        return slow

    def _unflatten(self, outs: list):
        return self.gm.graph._codegen.process_outputs(outs)

    # ---- inputs -------------------------------------------------------------------------------
    def _check_externals(self, flat) -> None:
        for i, ptr in self._externals.items():
            if flat[i].data_ptr() != ptr:
                raise RuntimeError(f"input {self._placeholders[i].name} is not the tensor the graphs were captured "
                                   f"with (data_ptr changed); caches and weights must keep their addresses")

    def _fill_inputs(self, st: _Bucket, flat, B: int) -> None:
        """Copy the real rows into the static buffers and set the padded rows (an input that is its buffer's
        own first B rows, staged by the caller through `meta_staging`, is neither copied nor padded)."""
        b = st.size
        for i in self._padded_idx:
            view, x = st.flat_views[i], flat[i]
            if i in self._meta_idx and self._staged(view, x, B):
                continue
            view[:B].copy_(x)
            if B < b:
                name = self._placeholders[i].name
                if name == "slots":
                    if self.pad_slot is None:
                        view[B:].copy_(x[:1].expand(b - B))
                    else:
                        view[B:].fill_(self.pad_slot)
                else:  # n_real = 0 (write nothing), pos0 = 0, ids 0, hidden 0
                    view[B:].zero_()

    def _staged(self, view: torch.Tensor, x: torch.Tensor, B: int) -> bool:
        """x, given for a META_INPUTS buffer `view` (a row of the staged block), is that row's first B entries:
        written and padded by the caller."""
        return x.data_ptr() == view.data_ptr() and tuple(x.shape) == (B,) and x.dtype == view.dtype

    def _base_env(self, st: _Bucket, flat) -> dict:
        env: dict = {}
        for i, n in enumerate(self._placeholders):
            env[n] = st.flat_views[i] if i in st.flat_views else flat[i]
        if self.debug:  # weights may have been re-bound since capture
            env.update({n: get_param(self.gm, n.target) for n in self._weights})
        else:
            env.update(self._weights)
        return env

    def _representative(self, st: _Bucket, flat) -> None:
        """Capture-time inputs: real-looking ids/positions/slots, n_real = 0 (nothing gets written)."""
        b = st.size
        g = torch.Generator(device="cpu").manual_seed(self.seed + b)
        n_slots = self.plan.n_slots or b
        for i in self._padded_idx:
            view, name = st.flat_views[i], self._placeholders[i].name
            if name == "input_ids":
                v = torch.randint(0, self.plan.vocab_size, tuple(view.shape), generator=g)
            elif name == "slots":
                v = torch.arange(b) % n_slots
            elif name == "pos0":
                v = torch.arange(b) % 4
            elif name == "n_real":
                v = torch.zeros(b, dtype=view.dtype)
            elif view.dtype.is_floating_point:
                v = torch.randn(tuple(view.shape), generator=g)
            else:
                v = torch.zeros(tuple(view.shape), dtype=view.dtype)
            view.copy_(v.to(view.dtype))

    # ---- capture ------------------------------------------------------------------------------
    def _capture_bucket(self, b: int, flat) -> None:
        st = _Bucket(b)
        self._bucket_state[b] = st
        for i, buf in self._flat_bufs.items():
            st.flat_views[i] = buf[:b]
        self._representative(st, flat)
        env = self._base_env(st, flat)
        if self.full:
            return self._capture_full(st, env)
        static_ids = {id(v) for v in env.values() if isinstance(v, torch.Tensor)}
        t0 = time.perf_counter()
        mem0, res0 = self._mem()
        n_captured = 0
        for step in self._steps:
            if not step.captured:
                self._run_eager(st, step, env, b * self.T)  # experts see all b rows as real here
                for t in st.pad_bufs.values():
                    static_ids.add(id(t))
                continue
            bindings, args = [], []
            for a in step.args:
                v = env[a]
                if isinstance(v, torch.Tensor):
                    if id(v) not in static_ids:  # produced by an eager segment: own a buffer, copy per replay
                        v = v.detach().clone()
                        st.owned.append(v)
                        static_ids.add(id(v))
                        bindings.append(_Binding("copy", a, v, v.data_ptr()))
                    else:
                        bindings.append(_Binding("static", a, v, v.data_ptr()))
                else:
                    bindings.append(_Binding("const", a, v))
                args.append(v)
            args = tuple(args)
            cap = _Captured(step.seg, bindings, (), args=args)
            if self.cuda_graphs:
                cap.graph, outs = self._cuda_capture(step.module, args)
            else:
                outs = _as_tuple(step.module(*args))
            cap.outputs = outs
            st.captured[step.seg] = cap
            n_captured += 1
            for node, o in zip(step.outs, outs):
                if node is not None:
                    env[node] = o
                if isinstance(o, torch.Tensor):
                    static_ids.add(id(o))
        env.clear()  # drop the eager segments' outputs before measuring
        mem1, res1 = self._mem()
        dt = time.perf_counter() - t0
        static = sum(t.numel() * t.element_size() for t in [*st.pad_bufs.values(), *st.owned])
        graph = max(mem1 - mem0 - static, 0) if self.cuda_graphs else 0
        self.stats["buckets"][b] = {"captured_segments": n_captured, "eager_segments": len(self._steps) - n_captured,
                                    "capture_s": dt, "graph_bytes": graph, "graph_reserved_bytes": res1 - res0,
                                    "static_buffer_bytes": static}
        self.stats["graph_bytes"] += graph
        self.stats["graph_reserved_bytes"] += res1 - res0
        self.stats["static_buffer_bytes"] += static

    def _run_steps(self, env: dict) -> None:
        """Every segment in order on `env` (full mode: no padding logic, the experts see every row)."""
        for step in self._steps:
            outs = _as_tuple(step.module(*[env[a] for a in step.args]))
            for node, o in zip(step.outs, outs):
                if node is not None:
                    env[node] = o

    def _capture_full(self, st: _Bucket, env: dict) -> None:
        t0 = time.perf_counter()
        mem0, res0 = self._mem()
        if self.cuda_graphs:
            s = torch.cuda.Stream(device=self.device)
            s.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(s):
                for _ in range(self.warmup):
                    self._run_steps(dict(env))
            torch.cuda.current_stream(self.device).wait_stream(s)
            torch.cuda.synchronize(self.device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self._run_steps(env)
            st.full = g
        else:
            self._run_steps(env)
            st.full = True
        keep = set(self._out_nodes)
        st.full_env = {n: v for n, v in env.items() if n in keep or n.op == "placeholder"}
        env.clear()
        mem1, res1 = self._mem()
        graph = max(mem1 - mem0, 0) if self.cuda_graphs else 0
        self.stats["buckets"][st.size] = {"captured_segments": len(self._steps), "eager_segments": 0,
                                          "capture_s": time.perf_counter() - t0, "graph_bytes": graph,
                                          "graph_reserved_bytes": res1 - res0, "static_buffer_bytes": 0}
        self.stats["graph_bytes"] += graph
        self.stats["graph_reserved_bytes"] += res1 - res0

    def _replay_full(self, st: _Bucket) -> dict:
        if self.cuda_graphs:
            st.full.replay()
        else:  # emulate: recompute on the static inputs, copy into the captured outputs
            env = {n: v for n, v in st.full_env.items() if n.op == "placeholder"}
            env.update(self._weights)
            self._run_steps(env)
            for n in self._out_nodes:
                o = st.full_env[n]
                if isinstance(o, torch.Tensor):
                    o.copy_(env[n])
        self.stats["replays"] += 1
        return st.full_env

    def _cuda_capture(self, module, args):
        """Warm up on a side stream, capture into the shared pool, replay once (so the static outputs
        hold real values for the segments captured after this one)."""
        s = torch.cuda.Stream(device=self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            for _ in range(self.warmup):
                module(*args)
        torch.cuda.current_stream(self.device).wait_stream(s)
        torch.cuda.synchronize(self.device)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            outs = module(*args)
        outs = _as_tuple(outs)
        g.replay()
        return g, outs

    def _mem(self) -> tuple[int, int]:
        if not self.cuda_graphs:
            return 0, 0
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device)

    # ---- running ------------------------------------------------------------------------------
    def _replay(self, st: _Bucket, step: _Step, env: dict) -> None:
        cap = st.captured[step.seg]
        for bd in cap.bindings:
            v = env[bd.node]
            if bd.kind == "copy":
                if v is not bd.value:
                    bd.value.copy_(v)
            elif bd.kind == "const":
                if v != bd.value:
                    raise RuntimeError(f"segment {step.seg}: input {bd.node.name} = {v}, captured with {bd.value}")
            elif self.debug and (v.data_ptr() != bd.ptr or v.shape != bd.value.shape):
                raise RuntimeError(f"segment {step.seg}: input {bd.node.name} moved since capture "
                                   f"(data_ptr {bd.ptr:#x} -> {v.data_ptr():#x})")
            if self.debug and isinstance(bd.value, torch.Tensor) and bd.value.data_ptr() != bd.ptr:
                raise RuntimeError(f"segment {step.seg}: static buffer of {bd.node.name} moved since capture")
        if cap.graph is not None:
            cap.graph.replay()
        else:  # emulate: recompute from the static arguments into the static outputs
            new = _as_tuple(step.module(*cap.args))
            for o, n in zip(cap.outputs, new):
                if isinstance(o, torch.Tensor):
                    if o.data_ptr() != n.data_ptr():
                        o.copy_(n)
                elif o != n:
                    raise RuntimeError(f"segment {step.seg}: output {o} changed to {n} between replays")
        self.stats["replays"] += 1
        for node, o in zip(step.outs, cap.outputs):
            if node is not None:
                env[node] = o

    def _run_eager(self, st: _Bucket, step: _Step, env: dict, real_rows: int) -> None:
        args = [env[a] for a in step.args]
        for i in step.real_in:  # dynamic segment: only the real tokens
            args[i] = args[i][:real_rows]
        outs = _as_tuple(step.module(*args))
        self.stats["eager_segment_runs"] += 1
        for j, (node, o) in enumerate(zip(step.outs, outs)):
            if j in step.real_out:
                key = (step.seg, j)
                buf = st.pad_bufs.get(key)
                if buf is None:
                    buf = torch.zeros((st.size * self.T, *o.shape[1:]), dtype=o.dtype, device=o.device)
                    st.pad_bufs[key] = buf
                buf[:real_rows].copy_(o)
                buf[real_rows:].zero_()
                o = buf
            if node is not None:
                env[node] = o


def _one_level_leaves(args) -> list | None:
    """Leaves of a tuple of tensors / scalars / dicts of tensors, in pytree order; None for any
    other structure."""
    flat = []
    for a in args:
        if type(a) is dict:
            flat.extend(a.values())
        elif a is None or isinstance(a, (torch.Tensor, int, float)):
            flat.append(a)
        else:
            return None
    return flat


def _as_tuple(out) -> tuple:
    """A submodule returns its single output bare, several as a tuple (and none as ())."""
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


# ---- boundary verification (called by `dsv4c compile`) ------------------------------------------
def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| over finite entries; infinities must sit in the same places."""
    a, b = a.float(), b.float()
    if not torch.equal(torch.isinf(a), torch.isinf(b)):
        return float("inf")
    fin = torch.isfinite(b)
    if not fin.any():
        return 0.0
    return ((a[fin] - b[fin]).abs().max() / b[fin].abs().max().clamp(min=1e-30)).item()


@torch.no_grad()
def boundary_sizes(buckets, max_batch: int) -> list[int]:
    """The batch sizes the padding check runs: in every gap between two buckets the size just above
    the lower bucket (the most padding rows that gap can have), and the largest size that is not a
    bucket. Every gap's padding arithmetic is exercised without running all max_batch sizes (with
    buckets up to 64 that would be 55 sizes, thousands of prefills). No gap: [max_batch]."""
    bs = sorted(set(buckets))
    sizes = {lo + 1 for lo, hi in zip([0] + bs, bs) if hi - lo > 1 and lo + 1 <= max_batch}
    others = [b for b in range(1, max_batch + 1) if b not in bs]
    if others:
        sizes.add(others[-1])
    return sorted(sizes) or [max_batch]


def verify_artifact_boundaries(art, seed: int = 0, steps: int = 3, device: str = "cpu") -> dict:
    """Padding at the segment boundaries, checked on a compiled artifact: the bucketed, split run
    (`emulate`; also `full-emulate` when every segment is capturable) of batches whose size is *not* a
    bucket must give the unsplit graph's logits for the real rows and the same cache contents in every
    real slot (the padded rows may only touch the scratch slot). Returns a report; `ok` says whether
    every comparison held within the dtype's tolerance."""
    from dsv4c.runtime import Session

    sess = Session.load(art, device=device, emulate=True, graphs="off")  # one load, executors swapped below
    if not sess.manifest["buckets"]:
        return {"ok": True, "skipped": "the target has no CUDA-graph buckets: nothing is padded"}
    tol = 1e-4 if sess.manifest["dtype"] == "float32" else 3e-2
    modes = ["emulate"]
    plan = next(iter(sess.manifest["segment_plan"].values()), None)
    if plan is not None and plan["capturable"] == len(plan["segments"]):
        modes.append("full-emulate")
    sizes = boundary_sizes(sess.manifest["buckets"], sess.max_batch)
    g = torch.Generator().manual_seed(seed)
    V = sess.config.vocab_size
    cases = []
    for B in sizes:
        prompts = [torch.randint(0, V, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(B)]
        ids = [torch.randint(0, V, (B, 1), generator=g) for _ in range(steps)]
        slots = sorted(torch.randperm(sess.max_batch, generator=g)[:B].tolist())
        sess.executors = {}
        ref_logits, ref_caches = _drive(sess, prompts, slots, ids)
        for mode in modes:
            sess.executors = sess._executors(mode)
            logits, caches = _drive(sess, prompts, slots, ids)
            err_logits = max(_rel_err(a, b) for a, b in zip(logits, ref_logits))
            err_cache = max(_rel_err(caches[k][:-1], ref_caches[k][:-1]) for k in ref_caches)
            bucket = next((b for b in sess.executors["decode"].buckets if b >= B), None)  # None: runs eagerly
            cases.append({"batch": B, "bucket": bucket, "mode": mode, "logits_rel_err": err_logits,
                          "cache_rel_err": err_cache, "ok": err_logits <= tol and err_cache <= tol})
    return {"ok": all(c["ok"] for c in cases), "tolerance": tol, "cases": cases}


def _drive(sess, prompts, slots, ids):
    """Prefill `prompts` into `slots`, then decode the given token steps; -> (logits per step, caches)."""
    for s, p in zip(slots, prompts):
        sess._reset_slot(s)
        sess._prefill_chunks(p, s)
    out = [sess._run("decode", x, slots, [1] * len(slots)).float().cpu() for x in ids]
    caches = {k: t.detach().cpu().clone() for k, t in sess.caches.items()}
    if getattr(sess, "paged", None):  # pools: each slot's written rows in order (block ids differ between runs;
        table = caches.pop("block_table")  # a block's rows past its slot's position hold what it held before)
        for k in sess._pools - {"block_table"}:
            rows = caches[k][table].flatten(1, 2)  # [slots, NB·RB, w]
            div = sess.paged.block_size // caches[k].shape[1]  # positions per row
            rows[torch.arange(rows.shape[1]) >= (sess.pos // div)[:, None]] = 0
            caches[k] = rows
    return out, caches
