"""`Session`: load a compiled artifact and generate text with it.

`Session.load(ART)` checks the manifest (format version, every file's sha256, the target against this
device), loads the stateless graphs and binds the weights by name, then allocates the static caches
(`max_batch` sequence slots of `max_tokens` positions). Generation is batched with continuous batching:
prompts wait for a free cache slot, are prefilled in chunks of at most `max_num_batched_tokens`, several
requests' chunks per prefill call (`Session._prefill_rows`: rows padded to the longest chunk, n_real per
row, rows x that chunk within `max_num_batched_tokens`), and then decode together, one token per sequence
per step, through the one decode graph. A finished
sequence frees its slot for the next prompt at once. `generate`/`stream` run that scheduler (`_Scheduler`)
to the end; the incremental API (`add_request`, `step`, `abort`; runtime/engine.py serves HTTP with it)
runs the same scheduler one step per call.

The fixed-shape graphs (decode, verify, MTP) run through a `SegmentExecutor`
(`dsv4c.runtime.segments`): split at the MoE routers by the plan `split_at_routers` makes, padded to
the artifact's batch buckets and replayed as CUDA graphs (`graphs="piecewise"`), or captured whole
(`graphs="full"`, when the expert op is capture-safe). The default on a GPU, `graphs="auto"`, captures
each graph whole when every segment of it is capturable (the CUDA targets' quantised experts are),
else piecewise. `graphs="off"` runs them op
by op (the default on a CPU); "emulate" / "full-emulate" run the bucketed data flow without CUDA graphs.
The caches hold one slot more than `max_batch`: the last is the capture-safe ops' scratch slot
(dsv4c/model/static_ops.py) and never holds a sequence.
"""
from __future__ import annotations

import numbers
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import torch

from dsv4c.artifact_safety import checked_bytes, inside, load_program
from dsv4c.compile import ArtifactError, read_manifest
from dsv4c.config import ModelConfig
from dsv4c.export import retarget_device
from dsv4c.model import register_ops
from dsv4c.targets import Target, check_runnable
from dsv4c.runtime.distributed import attach, rank_view
from dsv4c.runtime.kv_cache import allocate, cache_layout, fill_value
from dsv4c.runtime.block_pool import BlockPool, PagedCacheError, paged_bytes, paged_names
from dsv4c.runtime.prefix_cache import PrefixCacheConfig, prefix_cache_for
from dsv4c.runtime.sampling import DecodeSampler, PenaltyState, SamplingParams, penalize, sample_at


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    tokens: list[int]
    text: str | None
    finish_reason: str  # "length" | "stop"
    stats: dict = field(default_factory=dict)  # ttft_s, tokens_per_s, prefill_chunks, accepted_draft_tokens


@dataclass
class _Request:
    index: int
    ids: list[int]
    max_new: int
    params: SamplingParams
    stop_ids: set[int]
    stop_strs: list[str]
    gen: torch.Generator
    out: list[int] = field(default_factory=list)
    slot: int = -1
    t_start: float = 0.0
    t_first: float | None = None
    chunks: int = 0
    finish: str | None = None  # "stop" | "length" ("abort" | "error": the incremental API)
    spec: object = None  # speculative.SpecStats when generated with mtp != 0
    preempted: int = 0  # times its blocks were taken back (paged caches): it resumes from ids + out[:-1]
    order: int = 0  # admission order (the scheduler preempts the most recent)
    logprobs: int | None = None  # the incremental API: log-probability of each token and its top-n alternatives
    lps: list = field(default_factory=list)  # (logprob, [(token, logprob)] * n) per token when logprobs is set

    def context(self) -> list[int]:
        """The tokens its caches hold once (re)admitted: the prompt, and after a preemption the generated
        tokens but the last (not fed yet)."""
        return self.ids + self.out[:-1] if self.preempted else self.ids


@dataclass
class _Fill:
    """One slot's prefill in progress (`Session._prefill_rows`): `ids` for positions [start, ends[-1]) of
    `slot`, run in chunks that end at `ends`; `outs`: what each chunk gave; `req`: the scheduler's request."""

    slot: int
    ids: list[int]
    start: int
    ends: list[int]
    req: _Request | None = None
    k: int = 0  # chunks run
    at: int = 0  # position prefilled up to
    outs: list = field(default_factory=list)

    def __post_init__(self):
        self.at = self.start

    def next_len(self) -> int:
        return self.ends[self.k] - self.at

    def next_ids(self) -> list[int]:
        return self.ids[self.at - self.start:self.ends[self.k] - self.start]


@dataclass
class StepOutput:
    """What one `Session.step` produced for one request: its new tokens (and their log-probabilities when
    asked for), and how it finished (None while it runs). `admitted`: perf_counter time at which it got its
    cache slot, when that happened in this step; `stats`: GenerationResult.stats, once finished."""

    request_id: int
    tokens: list[int]
    finish_reason: str | None = None  # "stop" | "length"
    logprobs: list | None = None  # per new token: (logprob, [(token, logprob), ...top-n])
    admitted: float | None = None
    stats: dict | None = None


class StepError(RuntimeError):
    """A `Session.step` failed. The requests it was running (`request_ids`) are finished with "error" and
    their slots are free; waiting requests are kept, so the next step can go on."""

    def __init__(self, request_ids: list[int], cause: BaseException):
        super().__init__(f"step failed for requests {request_ids}: {type(cause).__name__}: {cause}")
        self.request_ids, self.cause = request_ids, cause


def _unchecked(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The loaded graph without torch.export's per-call input check (a pre-hook that re-validates every
    input's shape against the export's constraints: ~10% of a CPU decode step of the bundled model). Only the
    Session calls its graphs, with inputs it shapes from the manifest's limits and buckets."""
    gm.validate_inputs = False
    return gm


PREFILL_CHUNK = 2048  # default max_num_batched_tokens: an 8192-token one-shot prefill of the slice needs
#                       16 GiB for one layer's attention scores; chunks give the same logits (tests). A batched
#                       prefill call counts rows x T against it: the graph's memory (attention scores, MoE
#                       workspace, [B, T, V] fp32 logits) follows B·T with the padding, and 2048 tokens already
#                       amortise a call's fixed cost (the slice: ~7,700 tok/s at 2048-token chunks)


class Session:
    def __init__(self, art: Path, manifest: dict, graphs: dict, weights: dict, device: torch.device, tokenizer,
                 graph_mode: str = "off", prefix_cache: bool | PrefixCacheConfig = False, side_stream: bool = True):
        self.art, self.manifest, self.device = art, manifest, device
        self.side_stream = side_stream  # the shared experts on a second stream in whole-step graphs (`_executors`)
        self.config = ModelConfig.from_dict(manifest["model_config"])
        self.graphs, self.weights, self.tokenizer = graphs, weights, tokenizer
        self.max_tokens = manifest["limits"]["max_tokens"]
        self.max_batch = manifest["limits"]["max_batch"]
        self.cache_slots = manifest["limits"]["cache_slots"]  # max_batch + the scratch slot
        # prefill chunk: bounded, since the prefill graph's attention holds [H, T, keys] scores
        self.max_num_batched_tokens = min(self.max_tokens, PREFILL_CHUNK)
        # prefill rows per call (Session._prefill_rows). A deterministic artifact prefills one request per call:
        # its promise is that a request's logits do not depend on the requests it runs with
        self.max_prefill_rows = 1 if manifest.get("deterministic") else self.max_batch
        self.prefill_stats = {"calls": 0, "rows": 0, "tokens": 0, "padded_tokens": 0,  # prefill graph calls
                              "replays": 0}  # of which replayed a prefill CUDA graph (runtime/prefill_graphs.py)
        self.warmup_s: dict[str, float] = {}  # Session.warm_up's seconds per case (load(warm_up=True))
        # seconds between consecutive pipelined plain decode steps read, per (rows, sampling mode): what a
        # plain step costs on the traffic (mtp="auto" plans with it: runtime/speculative.py `observed_costs`)
        self.step_seen: dict[tuple[int, str], deque] = {}
        self.cache_info: dict = {}
        self._weights_by_graph: dict[str, dict[str, torch.Tensor]] = {}
        self.paged = self._paged_layout()  # PagedLayout of a paged artifact (runtime/block_pool.py), else None
        self.caches = self._allocate_caches()
        self._pools = paged_names(self.caches) if self.paged else set()  # not per slot: never reset by slot
        # positions live on the host: every step's n_real is decided there, so reading or moving them
        # never waits for the GPU; `_run` ships them with the step's other inputs in one copy
        self.pos = torch.zeros(self.cache_slots, dtype=torch.int64)
        self._staging = _Staging(self.device) if self.device.type == "cuda" else None
        if self.paged:  # the block pool allocates blocks and shares prefixes' blocks (copy-free) itself
            self.prefix = BlockPool(self.config, self.caches, self.paged, self.max_batch, self.max_tokens, self.device,
                                    share=prefix_cache not in (False, None))
            self.cache_info["paged"] = {"block_size": self.paged.block_size, "blocks": self.paged.n_blocks,
                                        "pool_bytes": paged_bytes(self.caches), "prefix_sharing": self.prefix.share}
        else:
            self.prefix = prefix_cache_for(self, prefix_cache)  # runtime/prefix_cache.py; None: off
        self.executors = self._executors(graph_mode)
        self.prefill_graphs = None  # runtime/prefill_graphs.py: Session.load(prefill_graphs=...) sets it
        self.rank, self.mirror = 0, None  # runtime/distributed.py: rank 0's Leader on a sharded artifact
        self._live: _Scheduler | None = None  # the incremental API's scheduler (add_request / step / abort)
        # True: decode steps run one at a time with every row's logits on the host (`_emit`), as for requests
        # that ask for log-probabilities (tests record the rows); the tokens are the same
        self.host_steps = False
        self.penalty_state: PenaltyState | None = None  # the slots' penalty counts (`_penalties`)

    # ---- loading ----------------------------------------------------------------------------------
    @classmethod
    def load(cls, art: str | Path, device: str | torch.device = "cpu", emulate: bool = False,
             graphs: str | None = None, max_num_batched_tokens: int | None = None,
             strict_source: bool = False, prefix_cache: bool | PrefixCacheConfig = True,
             deterministic: bool = False, paged: bool | None = None, warm_up: bool = False,
             prefill_graphs: str | Sequence[tuple[int, int]] = "auto", side_stream: bool = True) -> "Session":
        """Check and load an artifact. Errors name the file or field: missing/changed files, a newer
        format, or a target this device cannot run (`emulate=True` runs it on the reference ops).
        `graphs`: auto | off | piecewise | full | emulate | full-emulate (default: auto on a GPU, off on
        a CPU); see the module docstring. `max_num_batched_tokens`: prompt tokens per prefill call, padding
        included: rows x the longest chunk (default min(max_tokens, PREFILL_CHUNK); a prompt longer than this
        is prefilled in chunks). An artifact compiled by other source than the running
        dsv4c warns naming the changed modules, or raises with `strict_source=True` (dsv4c/provenance.py).
        `prefix_cache`: reuse the state of cached prompt prefixes (runtime/prefix_cache.py; exact), a
        PrefixCacheConfig, or False..
        `deterministic=True` requires an artifact compiled with `--deterministic` (the kernels are chosen
        at compile time: passes/make_batch_invariant.py) and raises ArtifactError for any other.
        `paged`: the artifact's cache layout decides (compile with paged=PagedConfig(...): the growing caches
        in blocks of a shared pool, runtime/block_pool.py); True / False require that layout (ArtifactError).
        `warm_up=True`: `Session.warm_up()` before returning, so the kernels' JIT compiles are paid at load and
        not in the first requests' time to first token (`dsv4c serve` does it before /health turns 200).
        `prefill_graphs`: prefill calls replayed as CUDA graphs at fixed (rows, tokens) shapes
        (runtime/prefill_graphs.py): "auto" (on where the fixed-shape graphs are CUDA graphs and the artifact
        is not sharded: `prefill_graphs.default_shapes` of max_num_batched_tokens), "off", "emulate" (the
        padded data flow op by op, any device: tests), or a list of (rows, tokens) shapes (CUDA only).
        `side_stream`: in the graphs captured whole (`graphs` "full", or "auto" where every segment is
        capturable) each MoE layer's shared expert runs on a second CUDA stream beside its routed experts
        (passes/overlap_shared_experts.py; bit-identical outputs); False keeps one stream."""
        from safetensors.torch import load_file

        from dsv4c.provenance import check_source

        art = Path(art)
        manifest, rank = rank_view(art, read_manifest(art, verify=True))  # runtime/distributed.py
        check_source(manifest, str(art), strict=strict_source)
        if deterministic and not manifest.get("deterministic"):
            raise ArtifactError(f"{art}: deterministic=True needs an artifact compiled with --deterministic "
                                f"(manifest field 'deterministic' is {manifest.get('deterministic')!r})")
        if paged is not None and paged != bool(manifest.get("paged")):
            raise ArtifactError(f"{art}: paged={paged} but the artifact's caches are "
                                f"{'paged' if manifest.get('paged') else 'per slot'} (manifest field 'paged' is "
                                f"{manifest.get('paged')!r}; the layout is fixed at compile time)")
        limit = manifest["limits"]["max_tokens"]
        if max_num_batched_tokens is not None and not 1 <= max_num_batched_tokens <= limit:
            raise ValueError(f"max_num_batched_tokens: between 1 and the artifact's max_tokens ({limit}), "
                             f"got {max_num_batched_tokens}")
        t = manifest["target"]
        target = Target(t["name"], t["device"], tuple(t["capability"]) if t["capability"] else None,
                        t["expert_format"], t["dense_format"])
        device = torch.device(device)
        check_runnable(target, str(device), emulate)
        if graphs is None:
            graphs = "auto" if device.type == "cuda" and manifest["buckets"] else "off"
        if graphs == "auto" and device.type != "cuda":
            graphs = "off"  # CUDA graphs need a GPU; the emulated modes are asked for by name
        if graphs not in GRAPH_MODES:
            raise ValueError(f"graphs: expected one of {sorted(GRAPH_MODES)}, got {graphs!r}")
        register_ops()
        # every graph archive checked before any is loaded: loading never unpickles or evals anything from
        # the artifact (dsv4c/artifact_safety.py)
        archives = {kind: checked_bytes(art, g["file"], f"graphs.{kind}.file")
                    for kind, g in manifest["graphs"].items()}
        graph_modules = {kind: _unchecked(retarget_device(load_program(data).module(), device))
                         for kind, data in archives.items()}
        del archives
        weights = {}
        for f in sorted({w["file"] for w in manifest["weights"].values()}):
            weights.update(load_file(str(inside(art, f, "weights file")), device=str(device)))
        missing = set(manifest["weights"]) - set(weights)
        if missing:
            raise ArtifactError(f"{art}: weights missing from the weight files: {sorted(missing)[:5]}")
        tok = None
        if (art / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(inside(art, "tokenizer.json", "tokenizer")))
        # a sharded artifact: rank 0 schedules and mirrors (blocks, prefix-cache copies too), the others replay
        sess = cls(art, manifest, graph_modules, weights, device, tok, graphs, prefix_cache if not rank else False,
                   side_stream=side_stream)
        if rank is not None:
            attach(sess, rank)  # runtime/distributed.py
        if max_num_batched_tokens is not None:
            sess.max_num_batched_tokens = max_num_batched_tokens
        sess.prefill_graphs = sess._make_prefill_graphs(prefill_graphs, graphs, sharded=rank is not None)
        if warm_up:
            if rank is not None:
                raise ValueError("warm_up: a sharded artifact's ranks run together (runtime/distributed.py); "
                                 "warm up through the rank-0 session's requests instead")
            sess.warmup_s = sess.warm_up()
        return sess

    @torch.no_grad()
    def warm_up(self) -> dict[str, float]:
        """Run a few throwaway requests whose prefill calls cover the shape classes real requests bring, so
        the Triton kernels compile now: Triton specialises integer arguments (chunk tokens, rows) on == 1 and
        on divisibility by 16, and each new combination compiles every kernel of the prefill graph again
        (seconds on the slice). Cases: one row of the longest chunk (max_num_batched_tokens, a multiple of
        16), one row of 17 tokens, two rows of 16 and of 17 where the artifact takes two, and 16 rows of 16
        and of 17 where it takes 16 (a row count divisible by 16 is its own class: 16 prompts resuming from a
        cached prefix took ~7 s more cold than warm, examples/results/h200-2026-12-05). Each case decodes
        one step too. Random token ids, greedy, no MTP; the prefix cache stores nothing of them (slot caches:
        off meanwhile; paged: sharing off meanwhile); admission resets a slot before its next request. Then
        every prefill CUDA graph shape not captured yet is captured ("prefill_graphs").
        -> seconds per case."""
        limit = min(self.max_num_batched_tokens, self.max_tokens - 2)
        longest = limit // 16 * 16  # a multiple of 16 (0 when the limit is below 16: skipped below)
        cases = {f"1x{longest}": [longest], "1x17": [17]}
        for rows in (2, 16):
            if min(self.max_batch, self.max_prefill_rows) >= rows and rows * 17 <= self.max_num_batched_tokens:
                cases.update({f"{rows}x16": [16] * rows, f"{rows}x17": [17] * rows})
        g = torch.Generator().manual_seed(0)
        V = self.config.vocab_size
        prefix, share = self.prefix, getattr(self.prefix, "share", None)
        if self.paged:
            self.prefix.share = False
        else:
            self.prefix = None
        out = {}
        try:
            for name, lens in cases.items():
                if not 1 <= min(lens) <= limit:
                    continue
                t0 = time.perf_counter()
                self.generate([torch.randint(2, V, (n,), generator=g).tolist() for n in lens], max_new_tokens=2)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                out[name] = round(time.perf_counter() - t0, 3)
        finally:
            self.prefix = prefix
            if self.paged:
                self.prefix.share = share
        if self.prefill_graphs is not None:  # every shape captured now (its first call would capture it)
            pg = self.prefill_graphs
            out["prefill_graphs"] = round(pg.capture_all(self.caches, self._graph_weights("prefill")), 3)
        return out

    def _make_prefill_graphs(self, spec, graph_mode: str, sharded: bool):
        """The PrefillGraphs of Session.load's `prefill_graphs` (None: every prefill call runs op by op)."""
        from dsv4c.runtime.prefill_graphs import PrefillGraphs, capture_blocker, default_shapes

        self.prefill_graphs_off = None  # why "auto" left them off (stats, tests)
        if isinstance(spec, str):
            if spec not in ("auto", "off", "emulate"):
                raise ValueError(f"prefill_graphs: 'auto', 'off', 'emulate' or a list of (rows, tokens), got {spec!r}")
            cuda_graphs = self.device.type == "cuda" and GRAPH_MODES[graph_mode] in (None, "graphs", "full")
            if spec == "off" or (spec == "auto" and (not cuda_graphs or sharded)):
                return None
            shapes, mode = default_shapes(self.max_num_batched_tokens, min(self.max_batch, self.max_prefill_rows)), (
                "cuda" if spec == "auto" else "emulate")
        else:
            if self.device.type != "cuda":
                raise ValueError("prefill_graphs: a list of shapes captures CUDA graphs and needs a CUDA device; "
                                 "'emulate' runs the padded path elsewhere")
            shapes, mode = tuple(tuple(s) for s in spec), "cuda"
            budget = self.max_num_batched_tokens
            over = [s for s in shapes if len(s) == 2 and (s[0] > self.max_batch or s[0] * s[1] > budget)]
            if over:
                raise ValueError(f"prefill_graphs: shapes {over} exceed max_batch={self.max_batch} rows or "
                                 f"max_num_batched_tokens={self.max_num_batched_tokens} tokens")
        if sharded:
            raise ValueError("prefill_graphs: a sharded artifact's ranks run prefill op by op "
                             "(runtime/distributed.py); use 'auto' or 'off'")
        why = capture_blocker(self.graphs["prefill"]) if mode == "cuda" else None
        if why and spec == "auto":
            self.prefill_graphs_off = why
            return None
        if why:
            raise ValueError(f"prefill_graphs: the prefill graph cannot be captured: {why}")
        return PrefillGraphs(self.graphs["prefill"], self.device, shapes, self.cache_slots - 1,
                             keep_hidden="mtp" in self.manifest["graphs"], mode=mode)

    def _allocate_caches(self, mtp: bool = False) -> dict[str, torch.Tensor]:
        """Static caches shaped as the graphs expect (runtime/kv_cache.py); CacheError if they do not fit.
        The V4 ring keeps W + k rows in a speculative (--mtp k) artifact."""
        extra = int(self.manifest.get("mtp_k", 0)) if self.config.is_v4 else 0
        layout = cache_layout(self.config, getattr(torch, self.manifest["dtype"]), self.cache_slots, self.max_tokens,
                              extra_ring_slots=extra, mtp=mtp, paged=None if mtp else self.paged)
        caches = allocate(layout, self.device, what="MTP caches" if mtp else "KV caches")
        self.cache_info[("mtp" if mtp else "main")] = {"bytes": layout.total_bytes, "by_kind": layout.by_kind(),
                                                       "describe": layout.describe()}
        return caches

    def _paged_layout(self):
        p = self.manifest.get("paged")
        if not p:
            return None
        from dsv4c.model.common import PagedLayout

        return PagedLayout(int(p["block_size"]), int(p["n_blocks"]))

    def _reset_slot(self, slot: int) -> None:
        self._reset_slots([slot])

    def _reset_slots(self, slots: list[int]) -> None:
        """Ready `slots` for new requests: their rows of every per-slot cache at its fill value (one launch per
        cache for all of them), their paged blocks released, their positions 0."""
        if not slots:
            return
        idx = torch.tensor(slots, device=self.device) if len(slots) > 1 else None
        for k, t in self.caches.items():
            if k not in self._pools:
                if idx is None:
                    t[slots[0]].fill_(fill_value(k))
                else:
                    t.index_fill_(0, idx, fill_value(k))
        for slot in slots:
            if self.paged:
                self.prefix.release(slot)
            self.pos[slot] = 0
            if self.mirror is not None:
                self.mirror.reset("main", slot)

    def _executors(self, mode: str) -> dict:
        """One SegmentExecutor per fixed-shape graph (none when `mode` is "off")."""
        from dsv4c.passes import PassContext
        from dsv4c.passes.overlap_shared_experts import graph_copy, overlap_shared_experts
        from dsv4c.passes.split_at_routers import apply_plan, plan_segments
        from dsv4c.runtime.segments import SegmentExecutor

        if mode != "auto" and GRAPH_MODES[mode] == "eager":
            return {}
        out = {}
        for kind, g in self.manifest["graphs"].items():
            if g["tokens_per_seq"] is None:
                continue  # prefill: dynamic T, runs op by op
            gm = self.graphs[kind]
            ctx = PassContext(self.config, self.manifest["target"]["name"], g["kind"])
            plan = plan_segments(gm, ctx)
            ex_mode = _executor_mode(mode, plan)
            if self.side_stream and ex_mode in ("full", "full-emulate"):
                gm = overlap_shared_experts(graph_copy(gm), ctx).graph
                plan = plan_segments(gm, ctx)
            expected = self.manifest.get("segment_plan", {}).get(kind)
            if expected is not None and len(expected["segments"]) != len(plan.segments):
                raise ArtifactError(f"{self.art}: graph {kind} splits into {len(plan.segments)} segments, the "
                                    f"manifest's segment_plan says {len(expected['segments'])}")
            out[kind] = SegmentExecutor(apply_plan(gm, plan), plan, self.device, buckets=self.manifest["buckets"],
                                        mode=ex_mode, pad_slot=self.cache_slots - 1)
        return out

    def _graph_weights(self, kind: str) -> dict[str, torch.Tensor]:
        """The weights graph `kind` reads, by name (built once: every decode step passes it)."""
        if kind not in self._weights_by_graph:
            self._weights_by_graph[kind] = {n: self.weights[n] for n in self.manifest["graphs"][kind]["weights"]}
        return self._weights_by_graph[kind]

    # ---- running the graphs ---------------------------------------------------------------------
    def _run(self, kind: str, ids: torch.Tensor, slots: list[int], n_real: list[int], *,
             hidden: torch.Tensor | None = None, pos: torch.Tensor | None = None,
             caches: dict[str, torch.Tensor] | None = None, outputs: bool = False, replay: bool = False,
             views: bool = False):
        """Run graph `kind`; returns its logits, or every output with `outputs=True`. The mtp graph takes
        `hidden` first and its own `caches`/`pos` (runtime/speculative.py); `pos` advances by n_real.
        `replay`: a prefill call through `self.prefill_graphs` (outputs: the last real position's logits
        [B, 1, V], and the hidden output where kept; valid until the next call). `views`: a bucketed
        executor's outputs are views of its static buffers, valid until its next run (a caller that only
        reads them in stream order before that)."""
        pos = self.pos if pos is None else pos
        caches = self.caches if caches is None else caches
        if self.paged and kind != "mtp":  # every position the step writes has a block (the scheduler grew
            n = torch.as_tensor(n_real)  # them before the step; Session.logits grows here)
            end = pos[slots] + n
            for i in ((end > self.prefix.covered[slots]) & (n > 0)).nonzero().flatten().tolist():
                self.prefix.ensure(slots[i], int(end[i]))
            self.prefix.flush()  # table rows changed since the last step (released, admitted, grown)
        ex = self.executors.get(kind) if not replay else None
        ids, s, pos0, n = self._step_inputs(ids, slots, pos, n_real, ex)
        run = ex.run if ex is not None else self.graphs[kind]
        if replay:
            run = self.prefill_graphs.run
        lead = () if hidden is None else (hidden.to(self.device),)
        if self.mirror is not None:
            self.mirror.run(kind, ids, s, pos0, n, lead[0] if lead else None, caches)
        extra = {"copy_outputs": False} if views and ex is not None else {}
        out = run(*lead, ids, s, pos0, n, caches, self._graph_weights(kind), **extra)
        pos.numpy()[slots] += n_real  # slots are distinct
        return out if outputs else out[0]

    def _step_inputs(self, ids: torch.Tensor, slots: list[int], pos: torch.Tensor, n_real: list[int],
                     ex: SegmentExecutor | None = None):
        """ids [B, T], slots [B], pos0 [B], n_real [B] on the device. The host values (ids too, when
        they are on the host) go over in one pinned, non-blocking copy: a decode step has ~4 tiny
        inputs, and a pageable copy each cost ~20 us of host time on the H200 machine. With ids already
        on the device and a bucketed executor `ex` (`SegmentExecutor.meta_staging`), that copy writes
        slots / pos0 / n_real straight into the executor's static buffers, padding included, and the
        executor copies nothing for them."""
        B = len(slots)
        p0 = pos.numpy()[slots].tolist()
        staged = ex.meta_staging(slots, p0, n_real) if ex is not None and ids.device.type == self.device.type else None
        if staged is not None:
            block, values = staged
            if self._staging is not None:
                self._staging.send(values, dest=block.view(-1))
            else:
                block.view(-1).copy_(torch.tensor(values, dtype=torch.int64))
            return ids, block[0, :B], block[1, :B], block[2, :B]
        meta = [*slots, *p0, *n_real]
        if self.device.type != "cuda":
            t = torch.tensor(meta, dtype=torch.int64).view(3, B).to(self.device)
            return ids.to(self.device), t[0], t[1], t[2]
        host_ids = ids.device.type == "cpu"
        if host_ids:
            meta += ids.reshape(-1).tolist()
        dev = self._staging.send(meta)
        ids = dev[3 * B:].view(ids.shape) if host_ids else ids
        return ids, dev[:B], dev[B:2 * B], dev[2 * B:3 * B]

    def _fill(self, ids: list[int], slot: int, req: "_Request | None" = None) -> "_Fill":
        """Prefill job of `ids` into `slot` from its current position: cut in chunks of at most
        max_num_batched_tokens, plus the prefix cache's chunk ends at block ends (computed now, per row)."""
        step, p0 = self.max_num_batched_tokens, int(self.pos[slot])
        n = p0 + len(ids)
        ends = self.prefix.chunk_ends(slot, p0, n, step) if self.prefix else range(p0 + step, n + step, step)
        return _Fill(slot, ids, p0, [min(j, n) for j in ends], req)

    def _prefill_rows(self, fills: list["_Fill"], take=None, last_only: bool = False,
                      to_host: bool = False) -> Iterator["_Fill"]:
        """Run `fills` through the prefill graph, several rows per call; yield each fill once its last chunk
        ran, with `fill.outs` = take(outputs) per chunk (outputs: every graph output of the row's chunk,
        [1, n, ...], batch dim kept; default take: the tuple itself). `last_only`: `take` reads no logits but
        the chunk's last row, so a call may replay a prefill CUDA graph (`self.prefill_graphs`: its logits
        output is [1, 1, V]); `take` must then copy what it keeps (the next call overwrites the outputs).
        `to_host` (instead of `take`): the last logits row of every fill whose last chunk the call ran, fp32
        on the host, in one copy for all of them: `fill.outs` = [that row [V]] (one sync per call, not per row).

        A call takes the next chunk of each unfinished fill, oldest first, while rows x the longest chunk
        stays within max_num_batched_tokens (padded positions count: the graph computes them) and the rows
        within `max_prefill_rows`; a fill that does not fit waits for the next call, and the oldest always
        runs, so a fill's chunks go in order. Rows are padded to the longest chunk; n_real keeps the padding
        from writing any cache entry (the padding contract of the ops). The prefix cache's `after_chunk`
        runs per row, at that row's chunk end (a block end where the cuts put one)."""
        yield from (f for f in fills if not f.ends)  # nothing to prefill
        pending = [f for f in fills if f.ends]
        budget, cap = self.max_num_batched_tokens, max(1, self.max_prefill_rows)
        while pending:
            rows, T = [], 0
            for f in pending:
                t = f.next_len()
                if rows and (len(rows) == cap or (len(rows) + 1) * max(T, t) > budget):
                    continue
                rows.append(f)
                T = max(T, t)
            ids = torch.zeros(len(rows), T, dtype=torch.int64)  # [B, T]: padded past each row's n_real
            for b, f in enumerate(rows):
                ids[b, :f.next_len()] = torch.tensor(f.next_ids())
            n_real = [f.next_len() for f in rows]
            replay = last_only and self.prefill_graphs is not None and self.prefill_graphs.fit(len(rows), T) is not None
            out = self._run("prefill", ids, [f.slot for f in rows], n_real, outputs=True, replay=replay)
            st = self.prefill_stats
            st["calls"], st["rows"] = st["calls"] + 1, st["rows"] + len(rows)
            st["tokens"], st["padded_tokens"] = st["tokens"] + sum(n_real), st["padded_tokens"] + len(rows) * T
            st["replays"] += replay
            last = self._last_rows_to_host(out[0], rows, n_real, replay) if to_host else {}
            with self.prefix.batched_stores() if self.prefix else nullcontext():  # the rows' block stores at once
                for b, f in enumerate(rows):
                    if to_host:
                        f.outs = [last[b]] if b in last else []
                    else:
                        o = out if len(rows) == 1 and n_real[0] == T else tuple(x[b:b + 1, :n_real[b]] for x in out)
                        f.outs.append(o if take is None else take(o))
                    f.at = f.ends[f.k]
                    f.k += 1
                    if self.prefix:
                        self.prefix.after_chunk(f.slot, f.at)
            del out
            done = [f for f in rows if f.k == len(f.ends)]
            pending = [f for f in pending if f.k < len(f.ends)]
            yield from done

    @staticmethod
    def _last_rows_to_host(logits: torch.Tensor, rows: list["_Fill"], n_real: list[int],
                           replay: bool) -> dict[int, torch.Tensor]:
        """{b: last logits row [V], fp32 on the host} of the call's rows b whose last chunk this is, in one
        device-to-host copy. logits: [B, T, V] ([B, 1, V] when replayed: the last real position's row)."""
        done = [b for b, f in enumerate(rows) if f.k + 1 == len(f.ends)]
        if not done:
            return {}
        at = [0 if replay else n_real[b] - 1 for b in done]
        host = logits[torch.tensor(done, device=logits.device), torch.tensor(at, device=logits.device)].float().cpu()
        return {b: host[i] for i, b in enumerate(done)}  # [n_done, V] -> a view per row

    def _prefill_chunks(self, ids: list[int], slot: int, outputs: bool = False, last_row: bool = False,
                        take=None) -> list:
        """Prefill `ids` into `slot` from its current position, in chunks of max_num_batched_tokens (the prefix
        cache adds chunk ends at block ends); logits [T_chunk, V] each (`outputs=True`: every graph output of
        each chunk, batch dim kept; `last_row`: only each chunk's last row, [1, V], so a long prompt does not
        hold T x V fp32 logits; `take`: a `_prefill_rows` take that reads only the last logits row and copies
        what it keeps). One sequence: several run together through `_prefill_rows`."""
        last_only = take is not None or last_row
        if take is None:
            take = None if outputs else (lambda o: o[0][0][-1:].clone()) if last_row else (lambda o: o[0][0])
        (f,) = self._prefill_rows([self._fill(ids, slot)], take, last_only)  # clone: frees the chunk
        return f.outs

    def _prefill(self, req: _Request) -> torch.Tensor:
        """Prefill one prompt (past the prefix restored into its slot); returns the last position's logits [V]."""
        chunks = self._prefill_chunks(req.context()[int(self.pos[req.slot]):], req.slot, last_row=True)
        req.chunks += len(chunks)
        return chunks[-1][-1]

    @torch.no_grad()
    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        """Prefill logits [T, V] (fp32) for one token-id sequence, in chunks of max_num_batched_tokens."""
        ids = self._check_prompt(list(ids), 0)
        self._reset_slot(0)
        out = torch.cat(self._prefill_chunks(ids, 0), 0).float().cpu()
        self._reset_slot(0)
        return out

    # ---- generation -----------------------------------------------------------------------------
    def _check_prompt(self, ids: list[int], max_new: int) -> list[int]:
        V = self.config.vocab_size
        if not ids:
            raise ValueError("prompt is empty")
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary (vocab_size={V})")
        if len(ids) + max_new > self.max_tokens:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new}) exceeds the compiled "
                             f"limit max_tokens={self.max_tokens}")
        return ids

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            from dsv4c.validate import check_utf8

            check_utf8(prompt, "prompt")  # lone surrogates (bytes that were not UTF-8) fail in the tokenizer
            if self.tokenizer is None:
                raise ValueError(f"{self.art}: no tokenizer.json in the artifact; pass token ids")
            bos = [self.config.bos_token_id] if self.config.bos_token_id is not None else []
            return bos + self.tokenizer.encode(prompt).ids
        return [int(t) for t in prompt]

    def _requests(self, prompts, max_new_tokens, temperature, top_p, top_k, seed, stop,
                  sampling: dict | None = None) -> list[_Request]:
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be an integer >= 1, got {max_new_tokens!r}")
        if isinstance(prompts, str):
            prompts = [prompts]  # one prompt, not one per character
        params = SamplingParams(temperature, top_p, top_k, **(sampling or {}))
        big = [t for t, _ in params.logit_bias if t >= self.config.vocab_size]
        if big:
            raise ValueError(f"logit_bias: token ids {big[:5]} are outside the vocabulary (vocab_size="
                             f"{self.config.vocab_size})")
        stop_ids = {self.config.eos_token_id} if self.config.eos_token_id is not None else set()
        stop_strs = []
        for s in stop or []:
            (stop_strs.append(s) if isinstance(s, str) else stop_ids.add(int(s)))
        reqs = []
        for i, p in enumerate(prompts):
            ids = self._check_prompt(self._encode(p), max_new_tokens)  # every prompt checked before any work
            if self.prefix:
                self.prefix.check(ids, max_new_tokens)
            reqs.append(_Request(i, ids, max_new_tokens, params, stop_ids, stop_strs,
                                 torch.Generator().manual_seed(seed + i)))
        return reqs

    @torch.no_grad()
    def stream(self, prompts, max_new_tokens: int = 32, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, seed: int = 0, stop=None, mtp: int | str = 0,
               **sampling) -> Iterator[tuple[int, int]]:
        """Yield (request index, token) as tokens are produced, with continuous batching. `mtp`, `sampling`:
        see generate."""
        reqs = self._requests(prompts, max_new_tokens, temperature, top_p, top_k, seed, stop, sampling)
        yield from self._serve(reqs, mtp)

    def generate(self, prompts, max_new_tokens: int = 32, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int = 0, stop=None, mtp: int | str = 0,
                 **sampling) -> list[GenerationResult]:
        """Generate for a batch of prompts (strings or token-id lists); one result per prompt.
        `mtp`: 0 plain decoding; k = 1..K MTP speculative decoding with k drafts per round (exact: greedy
        output equals plain greedy, sampling keeps its distribution); "auto" picks k from calibrated costs
        and the acceptance it observes, and re-chooses while running (runtime/speculative.py `AutoRun`).
        Needs an artifact compiled with --mtp K. `sampling`: more SamplingParams fields (runtime/sampling.py):
        min_p, and presence_penalty, frequency_penalty, repetition_penalty (plain decoding only)."""
        reqs = self._requests(prompts, max_new_tokens, temperature, top_p, top_k, seed, stop, sampling)
        for _ in self._serve(reqs, mtp):
            pass
        return [self._result(r) for r in reqs]

    def _serve(self, reqs: list[_Request], mtp: int | str = 0, on_decode=None) -> Iterator[tuple[int, int]]:
        """Run `reqs` to the end. `on_decode`: called once, when the first decode step or round is about to
        be queued (the auto policy's calibration times from there)."""
        if self._live is not None and self._live.busy():
            raise RuntimeError("generate/stream: the incremental API (add_request/step) has requests running on "
                               "this session's cache slots; finish or abort them first")
        penalized = [r.params for r in reqs if r.params.penalized]
        if mtp and penalized:
            raise ValueError(penalized[0].plain_only("mtp=0"))
        sched = _Scheduler(self, *self._speculation(mtp, reqs), pipelined_rounds=True)
        sched.on_decode = on_decode
        sched.waiting.extend(reqs)
        try:
            while sched.busy():
                yield from sched.iterate()
        finally:
            if self.prefix:
                self.prefix.release_all()

    def _speculation(self, mtp: int | str, reqs: list[_Request], **auto) -> tuple:
        """(the Speculator or None, a per-request SpecStats factory or None) for `mtp` (see generate; `auto`:
        plan_auto's plain_steps and measure)."""
        if not mtp:
            return None, None
        from dsv4c.runtime.speculative import plan_speculation

        return plan_speculation(self, mtp, reqs, **auto)

    # ---- the incremental API --------------------------------------------------------------------
    # add_request / step / abort drive one long-lived scheduler, the same one generate() runs to the end:
    # what a request gets does not depend on which API ran it (greedy: the argmax; sampling: its own
    # seeded generator, and decode rows do not depend on each other). Not thread-safe: one caller.
    def set_mtp(self, mtp: int | str = 0, prompt=None) -> dict:
        """MTP speculative decoding for the incremental API: 0, k = 1..K, or "auto", decided now (auto:
        calibrated for greedy decoding at max_batch on `prompt`, default a short fixed one; while steps run
        it re-chooses k from the acceptance it observes and may go to plain decoding. From plain decoding
        it plans again, with that calibration and the acceptance observed, whenever a step finds requests
        waiting and none running, as a generate call does at its start: the plain steps since the last
        plan earn probe budget, and a probe or a k >= 1 makes the next admissions speculate. Requests
        that ask for logprobs hold it at plain decoding while they wait). Only while no incremental request
        runs. -> the decision (k, and the auto policy's reasoning)."""
        if self._live is not None and self._live.busy():
            raise RuntimeError("set_mtp: incremental requests are running")
        if prompt is None:
            prompt = "def main():\n" if self.tokenizer is not None else [self.config.bos_token_id or 0] * 8
        spec, make_stats = (None, None)
        if mtp:
            reqs = self._requests([prompt] * self.max_batch, 16, 0.0, 1.0, 0, 0, None)
            spec, make_stats = self._speculation(mtp, reqs)
        policy = make_stats().policy if make_stats is not None else None
        k = 0 if spec is None else spec.k
        if spec is None:
            make_stats = None  # auto chose plain decoding
        self._live = _Scheduler(self, spec, make_stats)
        if mtp == "auto" and policy is not None and "step_ms" in policy:  # calibrated: it can plan again
            self._live.replan_reqs = reqs
        return {"k": k, "policy": policy}

    def add_request(self, prompt, max_new_tokens: int = 32, temperature: float = 0.0, top_p: float = 1.0,
                    top_k: int = 0, seed: int = 0, stop=None, logprobs: int | None = None, **sampling) -> int:
        """Queue one request (text or token ids) for `step`; returns its id. Checked at once (ValueError
        naming the field); the sampling generator is seeded with `seed` (generate's request i: seed + i).
        `logprobs`: report each token's log-probability (log-softmax of the logits, before penalties) and its
        top-n. `sampling`: as generate's (penalties: plain decoding only)."""
        live = self._live if self._live is not None else self._new_live()
        # (auto decoding plain does not re-plan while such a request waits: _Scheduler.iterate)
        if logprobs is not None and (logprobs < 0 or live.spec is not None):
            raise ValueError("logprobs: must be >= 0" if logprobs < 0 else
                             "logprobs: not available with MTP speculative decoding (set_mtp(0))")
        (r,) = self._requests([prompt], max_new_tokens, temperature, top_p, top_k, seed, stop, sampling)
        if r.params.penalized and live.spec is not None:
            raise ValueError(r.params.plain_only("set_mtp(0)"))
        r.index, r.logprobs = live.next_id, logprobs
        live.next_id += 1
        live.waiting.append(r)
        return r.index

    def step(self) -> list[StepOutput]:
        """One scheduling step of the incremental API: admit waiting requests into free cache slots
        (prefill, first token), then one decode step (or MTP round) for every running request. Returns
        the requests that got tokens or finished. A failure raises StepError naming the requests it ran."""
        live = self._live if self._live is not None else self._new_live()
        outs: dict[int, StepOutput] = {}
        admitted = dict.fromkeys(r.index for r in live.waiting if not r.preempted)  # (a resumed one was reported)
        try:
            with torch.no_grad():
                for i, tok in live.iterate():
                    outs.setdefault(i, StepOutput(i, [])).tokens.append(tok)
        except Exception as e:
            raise StepError(live.fail_running(), e) from e
        for i, o in outs.items():
            r = live.by_id[i]
            if r.logprobs is not None:
                o.logprobs = r.lps[len(r.out) - len(o.tokens):]
            if i in admitted:
                o.admitted = r.t_start
            if r.finish is not None:
                o.finish_reason, o.stats = r.finish, self._result(r).stats
        live.forget_finished()
        return list(outs.values())

    def abort(self, request_id: int) -> bool:
        """Stop a request of the incremental API; its slot is free for the next step. False when it is
        unknown or already finished."""
        return self._live is not None and self._live.abort(request_id)

    def has_unfinished(self) -> bool:
        return self._live is not None and self._live.busy()

    def live_counts(self) -> tuple[int, int]:
        """(waiting, running) requests of the incremental API."""
        if self._live is None:
            return 0, 0
        return len(self._live.waiting), sum(r.finish is None for r in self._live.active.values())

    def _new_live(self) -> "_Scheduler":
        self._live = _Scheduler(self, None, None)
        return self._live

    def _free(self, slot: int, free: list[int], tokens: list[int] | None = None) -> None:
        """Give `slot` back; the prefix cache (or the paged pool) keeps the blocks its decode steps completed
        that `tokens` (the request's prompt and output) cover."""
        if self.prefix:
            self.prefix.release(slot, tokens)
        free.append(slot)

    def _decode_launch(self, ids: torch.Tensor, slots: list[int], sampler: DecodeSampler,
                       logits_out: list | None = None) -> "_Inflight":
        """Enqueue one decode step; the tokens are chosen on the device (argmax, or `sampler`'s draw at
        each row's position) and copied to the host asynchronously. `logits_out`: append the step's
        logits [B, V] (the host-step path reads them)."""
        pos = self.pos.numpy()[slots].tolist()  # the positions the step feeds (before _run advances them)
        logits = self._run("decode", ids, slots, [1] * len(slots), views=logits_out is None)[:, -1]  # [B, V] fp32
        if self.prefix:  # a block the step completes is kept (its state copied before the next step runs)
            b = self.prefix.block_size
            for s, p in zip(slots, pos):
                if (p + 1) % b == 0:
                    self.prefix.after_decode(s, p + 1)
        if logits_out is not None:
            logits_out.append(logits)
        return _Inflight(slots, sampler.tokens(logits, pos)[:, None])      # [B, 1] int64

    def _sampler(self, reqs: list[_Request]) -> DecodeSampler:
        penalized = any(r.params.penalized for r in reqs)
        return DecodeSampler([r.params for r in reqs], [_seed(r) for r in reqs], self.device,
                             slots=[r.slot for r in reqs] if penalized else None,
                             penalty=self._penalties() if penalized else None)

    def _penalties(self) -> PenaltyState:
        """The slots' penalty counts (runtime/sampling.py), made when the first penalized request comes."""
        if self.penalty_state is None:
            self.penalty_state = PenaltyState(self.cache_slots, self.config.vocab_size, self.device)
        return self.penalty_state

    def _emit(self, r: _Request, logits: torch.Tensor, tok: int | None = None) -> Iterator[tuple[int, int]]:
        """Push one token chosen from r's logits row [V] (sampled here at the row's position unless `tok`
        is given, after r's penalties), with its log-probabilities when r asks for them."""
        logits = logits.float().cpu()
        if tok is None:  # the row of position len(ids) + len(out) - 1
            chosen = penalize(logits, r.ids, r.out, r.params) if r.params.penalized else logits
            tok = sample_at(chosen, r.params, _seed(r), len(r.ids) + len(r.out) - 1)
        if r.logprobs is not None:
            lsm = logits.log_softmax(-1)
            top = lsm.topk(r.logprobs) if r.logprobs else None
            r.lps.append((float(lsm[tok]), [] if top is None else list(zip(top.indices.tolist(), top.values.tolist()))))
        yield from self._push(r, tok)

    def _push(self, r: _Request, tok: int) -> Iterator[tuple[int, int]]:
        """Append one token to r's output and check the stop conditions."""
        if r.t_first is None:
            r.t_first = time.perf_counter()
        r.out.append(tok)
        yield r.index, tok
        if tok in r.stop_ids or (r.stop_strs and self.tokenizer is not None
                                 and any(s in self.tokenizer.decode(r.out) for s in r.stop_strs)):
            r.finish = "stop"
        elif len(r.out) >= r.max_new:
            r.finish = "length"

    def _result(self, r: _Request) -> GenerationResult:
        now = time.perf_counter()
        text = self.tokenizer.decode(r.out) if self.tokenizer is not None else None
        decode_s = max(now - (r.t_first or now), 1e-9)
        stats = {"ttft_s": (r.t_first or now) - r.t_start, "tokens_per_s": max(len(r.out) - 1, 0) / decode_s,
                 "prefill_chunks": r.chunks, "accepted_draft_tokens": 0}
        if r.spec is not None:  # MTP: acceptance per draft position, mean accepted length, histogram, policy
            stats.update(r.spec.as_dict())
        return GenerationResult(r.ids, r.out, text, r.finish or "length", stats)


class _Scheduler:
    """Continuous batching over one session's cache slots: requests wait for a free slot, are prefilled
    into it (their first token sampled), then decode together; a finished request frees its slot at
    once. `generate`/`stream` run one to the end; the incremental API keeps one across `step` calls.

    `iterate()` is one scheduling step: admit what fits, then one MTP round (with a speculator) or one
    decode step for every active request. Decode steps are pipelined, greedy and sampled alike: the
    tokens are chosen on the device (argmax, or `DecodeSampler`'s draw with the request's counter-based
    uniforms, runtime/sampling.py), and step t+1 is enqueued with step t's tokens still on the device,
    before the host reads them, so the GPU runs the steps back to back while the host does the previous
    step's bookkeeping; the step in flight is carried into the next `iterate()`. Each request's tokens
    equal one-step-at-a-time decoding (the same fp32 logits and draws; decode rows do not depend on each
    other). Requests that ask for log-probabilities (or `Session.host_steps`) take one step at a time
    with the logits on the host (`_host_step`), with the same tokens. When a request finishes at step t, step t+1 is
    already in flight: its tokens are used by the requests still running and dropped for the finished
    ones (their slot holds one more cache row, which `_reset_slot` clears before the slot is reused). So
    a request admitted into a freed slot starts one step later than without the pipeline, and `stream()`
    yields the running requests' step-t+1 tokens before its first one; each request's own token order is
    unchanged.

    Paged caches (runtime/block_pool.py): before each decode step / MTP round every running request gets
    the blocks of the positions it writes (`_make_room`); a pipelined step is queued ahead only when its
    blocks can be had without preempting. When they cannot be had, the most recently admitted request is
    preempted (`_preempt`): back to the head of the waiting queue with its tokens, and nothing is admitted
    until a running request finishes (no admit-preempt thrash); it resumes by prefilling ids + out[:-1]
    (its first token is not sampled again)."""

    def __init__(self, sess: Session, spec=None, make_stats=None, pipelined_rounds: bool = False):
        self.sess, self.spec, self.make_stats = sess, spec, make_stats
        self.auto = getattr(spec, "auto", None)  # mtp="auto": its AutoRun (runtime/speculative.py), bound per step
        self.pipelined_rounds = pipelined_rounds  # MTP: rounds until a request finishes (generate), else one
        self.waiting: deque[_Request] = deque()
        self.active: dict[int, _Request] = {}  # by slot
        self.free = list(range(sess.max_batch))
        self.inflight: _Inflight | None = None  # a decode step enqueued, its tokens not read yet
        self.sampler: tuple[list[_Request], DecodeSampler] | None = None  # the active requests' device sampler
        self.on_decode = None  # called once before the first decode step or round (Session._serve)
        self.next_id = 0  # the incremental API's request ids
        self.by_id: dict[int, _Request] = {}  # its requests until finished and reported
        self.admissions = 0
        self.hold = False  # a request was preempted: admit nothing until a running one finishes
        self.replan_reqs: list[_Request] | None = None  # the incremental API's mtp="auto": set_mtp's plan requests
        self.plain_steps = 0  # plain decode steps since the last plan (they earn the auto policy's probe budget)
        # (slots, clock, step_seen cell or None) of the last plain step read (`_time_step`)
        self._step_mark: tuple[tuple[int, ...], float, tuple | None] | None = None

    def busy(self) -> bool:
        return bool(self.waiting or self.active)

    def iterate(self) -> Iterator[tuple[int, int]]:
        if (self.replan_reqs is not None and self.spec is None and not self.active and self.inflight is None
                and self.waiting and all(r.logprobs is None and not r.params.penalized for r in self.waiting)):
            self._replan()
        if self.spec is not None:
            self.spec.auto = self.auto  # the Speculator is the session's; this scheduler's auto run steers it
            if self.auto is not None and self.auto.k == 0:
                self._stop_speculating()
        sess, spec = self.sess, self.spec
        admitting = self.waiting and self.free and not (self.hold and self.active)
        if self.inflight is not None and (admitting or any(r.finish is not None for r in self.active.values())):
            yield from self._drain()  # the active set changes: read the step in flight first
        self._retire()
        yield from self._admit()
        if not self.active:
            return
        if self.on_decode is not None:
            self.on_decode, hook = None, self.on_decode
            hook()
        yield from self._make_room(1 + spec.k if spec is not None else 1)
        if not self.active:  # the step in flight finished them all
            return
        if spec is not None:  # draft-verify-accept rounds: pipelined until a request finishes, or one
            self._step_mark = None
            yield from (spec.rounds(self.active) if self.pipelined_rounds else spec.round(self.active))
        elif sess.host_steps or any(r.logprobs is not None for r in self.active.values()):
            self.plain_steps += 1
            self._step_mark = None
            yield from self._host_step()
        else:
            self.plain_steps += 1
            yield from self._decode_step()
        self._retire()

    def _replan(self) -> None:
        """mtp="auto" in the incremental API, decoding plain and idle with requests waiting: plan as a generate
        call starts (set_mtp's cell and calibration, no timed generation; the plain steps since the last plan
        earn probe budget). A probe or k >= 1 makes the waiting requests' admission speculative."""
        spec, make_stats = self.sess._speculation("auto", self.replan_reqs, plain_steps=self.plain_steps,
                                                  measure=False)
        self.plain_steps = 0
        if spec is not None:
            self.spec, self.make_stats, self.auto = spec, make_stats, spec.auto

    def _stop_speculating(self) -> None:
        """mtp="auto" chose plain decoding while running: the running requests go on with plain decode steps
        (their main caches and positions are those of the last round read; the MTP state is dropped), and
        later admissions are plain."""
        for s in list(self.active):
            self.spec.release(s)
        self.spec.auto = None
        self.spec = None

    # ---- admission: waves of requests prefilled together --------------------------------------------
    def _admit(self) -> Iterator[tuple[int, int]]:
        """Admit what fits, in waves: each wave's requests take free slots (and their cached prefix), then
        prefill together (`Session._prefill_rows`: several rows per prefill call) and sample their first
        tokens as their last chunks finish."""
        while self.waiting and self.free and not (self.hold and self.active):
            wave, blocked = self._admit_wave()
            if wave:
                self._step_mark = None  # the next step's or round's interval would hold the prefill
                if self.auto is not None:
                    self.auto.restart_timing()
                yield from self._prefill_wave(wave)
            if not wave or (blocked and all(r.finish is None for r in wave)):
                break  # nothing admitted, or blocks held by running requests that none of the wave freed

    def _admit_wave(self) -> tuple[list[_Request], bool]:
        """Take waiting requests, in order, into free slots (restoring their cached prefix). Stops before a
        request that shares a prompt block with what this wave prefills past its resume points: admitted after
        the wave, it resumes from those blocks (as one request after another would). -> (the wave, True when
        stopped because the prompt's blocks are held by running requests)."""
        sess, wave = self.sess, []
        if not self.waiting or not self.free or (self.hold and self.active):
            return wave, False
        # every slot the wave may take is reset at once (a free slot holds nothing: resetting one it does not
        # take is harmless), and the prefix restores into them run grouped when the wave is complete
        sess._reset_slots(self.free[:len(self.waiting)])
        with sess.prefix.batched_restores() if sess.prefix is not None else nullcontext():
            return self._admit_into_reset_slots(wave)

    def _admit_into_reset_slots(self, wave: list[_Request]) -> tuple[list[_Request], bool]:
        """`_admit_wave`'s loop: the free slots are reset already."""
        sess, spec = self.sess, self.spec
        sharing = sess.prefix is not None and getattr(sess.prefix, "share", True)
        claimed: set[bytes] = set()  # keys of the wave's prompt blocks past its members' resume points
        while self.waiting and self.free and not (self.hold and self.active):
            r, t0 = self.waiting[0], time.perf_counter()
            ctx = r.context()
            keys = sess.prefix.keys(ctx) if sharing else []
            if claimed and not claimed.isdisjoint(keys):
                return wave, False
            if sess.prefix and not sess.prefix.admit(ctx, self.free[0], sess.pos, spec is not None,
                                                     limit=len(r.ids) + r.max_new, keys=keys if sharing else None):
                return wave, True  # its prompt's blocks are held by running requests: wait for one to finish
            self.waiting.popleft()
            self.hold, self.admissions = False, self.admissions + 1
            r.slot, r.order = self.free.pop(0), self.admissions
            r.t_start = r.t_start if r.preempted else t0
            self.active[r.slot] = r
            self.by_id[r.index] = r
            claimed.update(keys[int(sess.pos[r.slot]) // sess.prefix.block_size:] if sharing else ())
            wave.append(r)
        return wave, False

    def _prefill_wave(self, wave: list[_Request]) -> Iterator[tuple[int, int]]:
        """Prefill the wave's prompts together; each request samples its first token (a resumed one has it)
        as soon as its last chunk ran, then joins the MTP speculator."""
        sess, spec = self.sess, self.spec
        fills = [sess._fill(r.context()[int(sess.pos[r.slot]):], r.slot, r) for r in wave]
        # plain: the last logits rows of a call's finishing rows go to the host together (`to_host`)
        rows = sess._prefill_rows(fills, spec.take, last_only=True) if spec is not None else sess._prefill_rows(
            fills, last_only=True, to_host=True)
        for f in rows:
            r = f.req
            r.chunks += f.k
            logits = spec.prefilled(r, f.outs) if spec is not None else f.outs[-1]
            f.outs = []
            if not r.preempted:  # a resumed request has its next token already
                yield from sess._emit(r, logits)
            if r.params.penalized:  # decode steps count its tokens on the device from here
                sess._penalties().admit(r.slot, r.ids, r.out)
            if self.make_stats is not None and r.spec is None:
                r.spec = self.make_stats()
            if spec is not None and r.finish is None:
                spec.admit(r, r.spec)
            if r.finish is not None:
                self._retire()

    def _step_sampler(self, slots: list[int]) -> DecodeSampler:
        """The device sampler of the active requests (made again when the active set changes)."""
        reqs = [self.active[s] for s in slots]
        if self.sampler is None or len(self.sampler[0]) != len(reqs) or any(
                a is not b for a, b in zip(self.sampler[0], reqs)):
            self.sampler = (reqs, self.sess._sampler(reqs))
        return self.sampler[1]

    def _host_step(self) -> Iterator[tuple[int, int]]:
        """One decode step read at once: the logits go to the host (log-probabilities), the tokens are
        the device sampler's, as in `_decode_step`."""
        if self.inflight is not None:
            yield from self._drain()
        sess, slots, logits = self.sess, sorted(self.active), []
        last = torch.tensor([[self.active[s].out[-1]] for s in slots])
        toks = sess._decode_launch(last, slots, self._step_sampler(slots), logits).read()
        rows = logits[0].float().cpu()  # one copy
        for i, s in enumerate(slots):
            yield from sess._emit(self.active[s], rows[i], toks[i])

    def _decode_step(self) -> Iterator[tuple[int, int]]:
        """One decode step for the active requests, greedy or sampled on the device (see the class
        docstring)."""
        sess, active = self.sess, self.active
        slots = sorted(active)
        if self.inflight is not None and self.inflight.slots != slots:
            yield from self._drain()
        sampler = self._step_sampler(slots)
        cur = self.inflight or sess._decode_launch(torch.tensor([[active[s].out[-1]] for s in slots]), slots, sampler)
        self.inflight = None
        more = any(len(active[s].out) + 1 < active[s].max_new for s in slots) and self.grow(slots, 1)
        nxt = sess._decode_launch(cur.tokens, slots, sampler) if more else None
        done = False
        toks = cur.read()
        self._time_step(slots)
        for s, tok in zip(slots, toks):
            yield from sess._push(active[s], tok)
            done |= active[s].finish is not None
        self.inflight = nxt
        if done:  # the step in flight: keep the tokens of the requests still running
            yield from self._drain()

    def _time_step(self, slots: list[int]) -> None:
        """The interval since the last plain step read, when it ran the same slots with nothing between
        (`Session.step_seen`, keyed by rows and the requests' common sampling mode; the cell is worked out
        once per set of slots, not per step)."""
        now, key, last = time.perf_counter(), tuple(slots), self._step_mark
        if last is None or last[0] != key:
            self._step_mark = (key, now, self._step_cell(slots))
            return
        self._step_mark = (key, now, last[2])
        seen = self.sess.step_seen.get(last[2]) if last[2] is not None else None
        if seen is not None:  # (a cell cleared since its first step records nothing more)
            seen.append(now - last[1])

    def _step_cell(self, slots: list[int]) -> tuple[int, str] | None:
        """The `Session.step_seen` cell of a step over `slots` (made when new), or None when their requests
        sample in different modes."""
        from dsv4c.runtime.speculative import STEP_SAMPLES, cost_mode

        modes = {cost_mode(self.active[s].params) for s in slots}
        if len(modes) != 1:
            return None
        cell = (len(slots), modes.pop())
        self.sess.step_seen.setdefault(cell, deque(maxlen=STEP_SAMPLES))
        return cell

    def _drain(self) -> Iterator[tuple[int, int]]:
        cur, self.inflight = self.inflight, None
        if cur is None:
            return
        for s, tok in zip(cur.slots, cur.read()):
            r = self.active.get(s)
            if r is not None and r.finish is None:
                yield from self.sess._push(r, tok)

    def _retire(self) -> None:
        for s in [s for s, r in self.active.items() if r.finish is not None]:
            if self.spec is not None:
                self.spec.release(s)
            r = self.active.pop(s)
            self.sess._free(s, self.free, r.ids + r.out)
            self.hold = False

    # ---- paged caches: blocks grown as requests decode --------------------------------------------
    def grow(self, slots: list[int], tokens: int) -> bool:
        """Paged caches: blocks for the next `tokens` positions of each of `slots` (from its host position,
        steps in flight included), oldest request first, without preempting. False: some could not grow."""
        sess = self.sess
        if not sess.paged:
            return True
        slots = sorted(slots, key=lambda s: self.active[s].order)
        pos = sess.pos.numpy()
        return sess.prefix.grow_all(slots, [int(pos[s]) + tokens for s in slots])

    def _make_room(self, tokens: int) -> Iterator[tuple[int, int]]:
        """Every running request holds the blocks of the positions the next step writes (`tokens` each):
        read the step in flight, then preempt the most recently admitted request, until they can be had."""
        while not self.grow(list(self.active), tokens):
            if self.inflight is not None:  # its tokens may finish a request (and free blocks)
                yield from self._drain()
                self._retire()
                continue
            if len(self.active) == 1:  # cannot happen: check() refused requests larger than the pool
                (r,) = self.active.values()
                raise PagedCacheError(f"paged cache: request {r.index} alone cannot get blocks for position "
                                      f"{int(self.sess.pos[r.slot]) + tokens} ({self.sess.prefix.n_blocks} blocks "
                                      f"of {self.sess.prefix.block_size} tokens, PagedConfig.max_blocks)")
            self._preempt(max(self.active.values(), key=lambda r: r.order))

    def _preempt(self, r: _Request) -> None:
        """Take r's blocks back (its registered prompt blocks stay cached); it waits at the head of the
        queue and resumes from ids + out[:-1] once a running request finishes."""
        if self.spec is not None:
            self.spec.release(r.slot)
        del self.active[r.slot]
        self.sess._free(r.slot, self.free)
        r.slot, r.preempted = -1, r.preempted + 1
        self.waiting.appendleft(r)
        self.hold = True
        self.sess.prefix.counters["preemptions"] += 1

    def abort(self, request_id: int) -> bool:
        r = self.by_id.get(request_id)
        if r is None or (r.preempted and any(w is r for w in self.waiting)):  # waiting (a preempted one: known by id)
            r = next((w for w in self.waiting if w.index == request_id), None)
            if r is None:
                return False
            self.waiting.remove(r)
            r.finish = "abort"
            self.by_id.pop(request_id, None)
            return True
        if r.finish is not None:
            return False
        r.finish = "abort"  # the next iterate() reads the step in flight and frees the slot
        if self.inflight is None:
            self._retire()
        self.by_id.pop(request_id)
        return True

    def fail_running(self) -> list[int]:
        """After a failed step: finish every admitted request with "error" and free its slot."""
        self.inflight = None
        failed = [r.index for r in self.active.values() if r.finish is None]
        for r in self.active.values():
            r.finish = r.finish or "error"
        self._retire()
        for i in failed:
            self.by_id.pop(i, None)
        return failed

    def forget_finished(self) -> None:
        for i in [i for i, r in self.by_id.items() if r.finish is not None]:
            del self.by_id[i]


def _seed(r: _Request) -> int:
    """The request's seed (generate's request i: seed + i), as the RNG contract's counter_uniforms take it."""
    return r.gen.initial_seed() & ((1 << 63) - 1)


class _Inflight:
    """A decode step's tokens [B, 1] on the device, and their asynchronous copy to (pinned) host memory."""

    def __init__(self, slots: list[int], tokens: torch.Tensor):
        self.slots, self.tokens = slots, tokens
        if tokens.device.type == "cuda":
            self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.host.copy_(tokens, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record(torch.cuda.current_stream(tokens.device))
        else:
            self.host, self.done = tokens, None

    def read(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.host[:, 0].tolist()


class _Staging:
    """One pinned host buffer and one device buffer for a step's small int64 inputs: one host-to-device
    copy per step, without a pinned allocation each time. The device buffer is reused in stream order
    (everything that reads a step's inputs is queued before the next step's copy). The host buffer is
    rewritten only once its previous copy has run: with greedy steps queued back to back that copy sits
    behind the step before, so the host runs at most one step ahead of the GPU."""

    def __init__(self, device: torch.device, n: int = 4096):
        self.device = device
        self._alloc(n)

    def _alloc(self, n: int) -> None:
        self.host = torch.empty(n, dtype=torch.int64, pin_memory=True)
        self.dev = torch.empty(n, dtype=torch.int64, device=self.device)
        self.copied: torch.cuda.Event | None = None

    def send(self, values: list[int], dest: torch.Tensor | None = None) -> torch.Tensor:
        """The values as a device int64 tensor (a view of the buffer the next send rewrites), or copied into
        `dest` (a contiguous device int64 tensor of len(values), read by work queued after this copy)."""
        n = len(values)
        if n > self.host.numel():
            torch.cuda.synchronize(self.device)  # queued work may still read the old buffer
            self._alloc(2 * n)
        if self.copied is not None:
            self.copied.synchronize()
        self.host.numpy()[:n] = values
        dev = self.dev[:n] if dest is None else dest
        dev.copy_(self.host[:n], non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record(torch.cuda.current_stream(self.device))
        return dev


def _executor_mode(mode: str, plan) -> str:
    """The SegmentExecutor mode of Session.load's `graphs=` for one graph's plan ("auto": whole-step
    capture when every segment is capturable, else piecewise)."""
    if mode == "auto":
        return "full" if plan.n_capturable == len(plan.segments) else "graphs"
    return GRAPH_MODES[mode]


GRAPH_MODES = {"auto": None, "off": "eager", "piecewise": "graphs", "full": "full", "emulate": "emulate",
               "full-emulate": "full-emulate"}  # Session.load(graphs=) -> SegmentExecutor mode
