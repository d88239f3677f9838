"""`Session`: load a compiled artifact and generate text with it.

`Session.load(ART)` checks the manifest (format version, every file's sha256, the target against this
device), loads the stateless graphs and binds the weights by name, then allocates the static caches
(`max_batch` sequence slots of `max_tokens` positions). Generation is batched with continuous batching:
prompts wait for a free cache slot, are prefilled in chunks of at most `max_num_batched_tokens`, and
then decode together, one token per sequence per step, through the one decode graph. A finished
sequence frees its slot for the next prompt at once.

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

import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import torch

from dsv4c.compile import ArtifactError, read_manifest
from dsv4c.config import ModelConfig
from dsv4c.export import retarget_device
from dsv4c.model import register_ops
from dsv4c.targets import Target, check_runnable
from dsv4c.runtime.kv_cache import allocate, cache_layout, fill_value
from dsv4c.runtime.sampling import SamplingParams, sample


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
    finish: str | None = None
    spec: object = None  # speculative.SpecStats when generated with mtp != 0


PREFILL_CHUNK = 2048  # default max_num_batched_tokens: an 8192-token one-shot prefill of the slice needs
#                       16 GiB for one layer's attention scores; chunks give the same logits (tests)


class Session:
    def __init__(self, art: Path, manifest: dict, graphs: dict, weights: dict, device: torch.device, tokenizer,
                 graph_mode: str = "off"):
        self.art, self.manifest, self.device = art, manifest, device
        self.config = ModelConfig.from_dict(manifest["model_config"])
        self.graphs, self.weights, self.tokenizer = graphs, weights, tokenizer
        self.max_tokens = manifest["limits"]["max_tokens"]
        self.max_batch = manifest["limits"]["max_batch"]
        self.cache_slots = manifest["limits"]["cache_slots"]  # max_batch + the scratch slot
        # prefill chunk: bounded, since the prefill graph's attention holds [H, T, keys] scores
        self.max_num_batched_tokens = min(self.max_tokens, PREFILL_CHUNK)
        self.cache_info: dict = {}
        self._weights_by_graph: dict[str, dict[str, torch.Tensor]] = {}
        self.caches = self._allocate_caches()
        # positions live on the host: every step's n_real is decided there, so reading or moving them
        # never waits for the GPU; `_run` ships them with the step's other inputs in one copy
        self.pos = torch.zeros(self.cache_slots, dtype=torch.int64)
        self._staging = _Staging(self.device) if self.device.type == "cuda" else None
        self.executors = self._executors(graph_mode)

    # ---- loading ----------------------------------------------------------------------------------
    @classmethod
    def load(cls, art: str | Path, device: str | torch.device = "cpu", emulate: bool = False,
             graphs: str | None = None, max_num_batched_tokens: int | None = None,
             strict_source: bool = False, deterministic: bool = False) -> "Session":
        """Check and load an artifact. Errors name the file or field: missing/changed files, a newer
        format, or a target this device cannot run (`emulate=True` runs it on the reference ops).
        `graphs`: auto | off | piecewise | full | emulate | full-emulate (default: auto on a GPU, off on
        a CPU); see the module docstring. `max_num_batched_tokens`: prompt tokens per prefill chunk
        (default min(max_tokens, PREFILL_CHUNK)). An artifact compiled by other source than the running
        dsv4c warns naming the changed modules, or raises with `strict_source=True` (dsv4c/provenance.py).
        `deterministic=True` requires an artifact compiled with `--deterministic` (the kernels are chosen
        at compile time: passes/make_batch_invariant.py) and raises ArtifactError for any other."""
        from safetensors.torch import load_file

        from dsv4c.provenance import check_source

        art = Path(art)
        manifest = read_manifest(art, verify=True)
        check_source(manifest, str(art), strict=strict_source)
        if deterministic and not manifest.get("deterministic"):
            raise ArtifactError(f"{art}: deterministic=True needs an artifact compiled with --deterministic "
                                f"(manifest field 'deterministic' is {manifest.get('deterministic')!r})")
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
        graph_modules = {kind: retarget_device(torch.export.load(str(art / g["file"])).module(), device)
                         for kind, g in manifest["graphs"].items()}
        weights = {}
        for f in sorted({w["file"] for w in manifest["weights"].values()}):
            weights.update(load_file(str(art / f), device=str(device)))
        missing = set(manifest["weights"]) - set(weights)
        if missing:
            raise ArtifactError(f"{art}: weights missing from the weight files: {sorted(missing)[:5]}")
        tok = None
        if (art / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(art / "tokenizer.json"))
        sess = cls(art, manifest, graph_modules, weights, device, tok, graphs)
        if max_num_batched_tokens is not None:
            sess.max_num_batched_tokens = max_num_batched_tokens
        return sess

    def _allocate_caches(self, mtp: bool = False) -> dict[str, torch.Tensor]:
        """Static caches shaped as the graphs expect (runtime/kv_cache.py); CacheError if they do not fit.
        The V4 ring keeps W + k rows in a speculative (--mtp k) artifact."""
        extra = int(self.manifest.get("mtp_k", 0)) if self.config.is_v4 else 0
        layout = cache_layout(self.config, getattr(torch, self.manifest["dtype"]), self.cache_slots, self.max_tokens,
                              extra_ring_slots=extra, mtp=mtp)
        caches = allocate(layout, self.device, what="MTP caches" if mtp else "KV caches")
        self.cache_info[("mtp" if mtp else "main")] = {"bytes": layout.total_bytes, "by_kind": layout.by_kind(),
                                                       "describe": layout.describe()}
        return caches

    def _reset_slot(self, slot: int) -> None:
        for k, t in self.caches.items():
            t[slot].fill_(fill_value(k))
        self.pos[slot] = 0

    def _executors(self, mode: str) -> dict:
        """One SegmentExecutor per fixed-shape graph (none when `mode` is "off")."""
        from dsv4c.passes import PassContext
        from dsv4c.passes.split_at_routers import apply_plan, plan_segments
        from dsv4c.runtime.segments import SegmentExecutor

        if mode != "auto" and GRAPH_MODES[mode] == "eager":
            return {}
        out = {}
        for kind, g in self.manifest["graphs"].items():
            if g["tokens_per_seq"] is None:
                continue  # prefill: dynamic T, runs op by op
            gm = self.graphs[kind]
            plan = plan_segments(gm, PassContext(self.config, self.manifest["target"]["name"], g["kind"]))
            expected = self.manifest.get("segment_plan", {}).get(kind)
            if expected is not None and len(expected["segments"]) != len(plan.segments):
                raise ArtifactError(f"{self.art}: graph {kind} splits into {len(plan.segments)} segments, the "
                                    f"manifest's segment_plan says {len(expected['segments'])}")
            out[kind] = SegmentExecutor(apply_plan(gm, plan), plan, self.device, buckets=self.manifest["buckets"],
                                        mode=_executor_mode(mode, plan), pad_slot=self.cache_slots - 1)
        return out

    def _graph_weights(self, kind: str) -> dict[str, torch.Tensor]:
        """The weights graph `kind` reads, by name (built once: every decode step passes it)."""
        if kind not in self._weights_by_graph:
            self._weights_by_graph[kind] = {n: self.weights[n] for n in self.manifest["graphs"][kind]["weights"]}
        return self._weights_by_graph[kind]

    # ---- running the graphs ---------------------------------------------------------------------
    def _run(self, kind: str, ids: torch.Tensor, slots: list[int], n_real: list[int], *,
             hidden: torch.Tensor | None = None, pos: torch.Tensor | None = None,
             caches: dict[str, torch.Tensor] | None = None, outputs: bool = False):
        """Run graph `kind`; returns its logits, or every output with `outputs=True`. The mtp graph takes
        `hidden` first and its own `caches`/`pos` (runtime/speculative.py); `pos` advances by n_real."""
        pos = self.pos if pos is None else pos
        caches = self.caches if caches is None else caches
        ids, s, pos0, n = self._step_inputs(ids, slots, pos, n_real)
        run = self.executors[kind].run if kind in self.executors else self.graphs[kind]
        lead = () if hidden is None else (hidden.to(self.device),)
        out = run(*lead, ids, s, pos0, n, caches, self._graph_weights(kind))
        pos.numpy()[slots] += n_real  # slots are distinct
        return out if outputs else out[0]

    def _step_inputs(self, ids: torch.Tensor, slots: list[int], pos: torch.Tensor, n_real: list[int]):
        """ids [B, T], slots [B], pos0 [B], n_real [B] on the device. The host values (ids too, when
        they are on the host) go over in one pinned, non-blocking copy: a decode step has ~4 tiny
        inputs, and a pageable copy each cost ~20 us of host time on the H200 machine."""
        B = len(slots)
        meta = [*slots, *pos.numpy()[slots].tolist(), *n_real]
        if self.device.type != "cuda":
            t = torch.tensor(meta, dtype=torch.int64).view(3, B).to(self.device)
            return ids.to(self.device), t[0], t[1], t[2]
        host_ids = ids.device.type == "cpu"
        if host_ids:
            meta += ids.reshape(-1).tolist()
        dev = self._staging.send(meta)
        ids = dev[3 * B:].view(ids.shape) if host_ids else ids
        return ids, dev[:B], dev[B:2 * B], dev[2 * B:3 * B]

    def _prefill_chunks(self, ids: list[int], slot: int, outputs: bool = False, last_row: bool = False) -> list:
        """Prefill one sequence into `slot` in chunks of max_num_batched_tokens; logits [T_chunk, V] each
        (`outputs=True`: every graph output of each chunk, batch dim kept; `last_row`: only each chunk's
        last row, [1, V], so a long prompt does not hold T x V fp32 logits)."""
        step, outs = self.max_num_batched_tokens, []
        for i in range(0, len(ids), step):
            o = self._run("prefill", torch.tensor([ids[i : i + step]]), [slot], [len(ids[i : i + step])],
                          outputs=True)
            outs.append(o if outputs else o[0][0][-1:].clone() if last_row else o[0][0])  # clone: frees the chunk
        return outs

    def _prefill(self, req: _Request) -> torch.Tensor:
        """Prefill one prompt; returns the last position's logits [V]."""
        chunks = self._prefill_chunks(req.ids, req.slot, last_row=True)
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
            if self.tokenizer is None:
                raise ValueError(f"{self.art}: no tokenizer.json in the artifact; pass token ids")
            bos = [self.config.bos_token_id] if self.config.bos_token_id is not None else []
            return bos + self.tokenizer.encode(prompt).ids
        return [int(t) for t in prompt]

    def _requests(self, prompts, max_new_tokens, temperature, top_p, top_k, seed, stop) -> list[_Request]:
        params = SamplingParams(temperature, top_p, top_k)
        stop_ids = {self.config.eos_token_id} if self.config.eos_token_id is not None else set()
        stop_strs = []
        for s in stop or []:
            (stop_strs.append(s) if isinstance(s, str) else stop_ids.add(int(s)))
        reqs = []
        for i, p in enumerate(prompts):
            ids = self._check_prompt(self._encode(p), max_new_tokens)  # every prompt checked before any work
            reqs.append(_Request(i, ids, max_new_tokens, params, stop_ids, stop_strs,
                                 torch.Generator().manual_seed(seed + i)))
        return reqs

    @torch.no_grad()
    def stream(self, prompts, max_new_tokens: int = 32, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, seed: int = 0, stop=None, mtp: int | str = 0) -> Iterator[tuple[int, int]]:
        """Yield (request index, token) as tokens are produced, with continuous batching. `mtp`: see generate."""
        reqs = self._requests(prompts, max_new_tokens, temperature, top_p, top_k, seed, stop)
        yield from self._serve(reqs, mtp)

    def generate(self, prompts, max_new_tokens: int = 32, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int = 0, stop=None, mtp: int | str = 0) -> list[GenerationResult]:
        """Generate for a batch of prompts (strings or token-id lists); one result per prompt.
        `mtp`: 0 plain decoding; k = 1..K MTP speculative decoding with k drafts per round (exact: greedy
        output equals plain greedy, sampling keeps its distribution); "auto" picks k by calibration
        (runtime/speculative.py). Needs an artifact compiled with --mtp K."""
        reqs = self._requests(prompts, max_new_tokens, temperature, top_p, top_k, seed, stop)
        for _ in self._serve(reqs, mtp):
            pass
        return [self._result(r) for r in reqs]

    def _serve(self, reqs: list[_Request], mtp: int | str = 0) -> Iterator[tuple[int, int]]:
        spec = None
        if mtp:
            from dsv4c.runtime.speculative import plan_speculation

            spec, make_stats = plan_speculation(self, mtp, reqs)
        waiting, active = deque(reqs), {}
        free = list(range(self.max_batch))
        while waiting or active:
            while waiting and free:  # admit: prefill into a free slot, sample the first token
                r = waiting.popleft()
                r.slot, r.t_start = free.pop(0), time.perf_counter()
                self._reset_slot(r.slot)
                yield from self._emit(r, spec.prefill(r) if spec else self._prefill(r))
                if mtp:
                    r.spec = make_stats()
                if spec is not None and r.finish is None:
                    spec.admit(r, r.spec)
                (active.__setitem__(r.slot, r) if r.finish is None else free.append(r.slot))
            if not active:
                continue
            if spec is not None:  # draft-verify-accept rounds (pipelined) until a request finishes
                yield from spec.rounds(active)
                for s in [s for s, r in active.items() if r.finish is not None]:
                    spec.release(s)
                    del active[s]
                    free.append(s)
                continue
            if all(r.params.temperature == 0 for r in active.values()):
                yield from self._greedy_steps(active)
            else:
                slots = sorted(active)
                last = torch.tensor([[active[s].out[-1]] for s in slots])
                rows = self._run("decode", last, slots, [1] * len(slots))[:, -1].float().cpu()  # one copy
                for i, s in enumerate(slots):
                    yield from self._emit(active[s], rows[i])
            for s in [s for s, r in active.items() if r.finish is not None]:
                del active[s]
                free.append(s)

    def _greedy_launch(self, ids: torch.Tensor, slots: list[int]) -> "_Inflight":
        """Enqueue one greedy decode step; the tokens stay on the device (argmax there) and are copied
        to the host asynchronously."""
        logits = self._run("decode", ids, slots, [1] * len(slots))           # [B, 1, V] fp32
        return _Inflight(slots, logits[:, -1].argmax(-1, keepdim=True))       # [B, 1] int64

    def _greedy_steps(self, active: dict) -> Iterator[tuple[int, int]]:
        """Greedy decode steps for `active` until one of them finishes. Step t+1 is enqueued with step t's
        tokens still on the device, before the host reads them, so the GPU runs the steps back to back while
        the host does the previous step's bookkeeping. Each request's tokens equal one-step-at-a-time
        greedy decoding (argmax of the same fp32 logits; decode rows do not depend on each other). When a
        request finishes at step t, step t+1 is already in flight: its tokens are used by the requests
        still running, and dropped for the finished ones (their slot holds one more cache row, which
        `_reset_slot` clears before the slot is reused). So a request admitted into a freed slot starts
        one step later than without the pipeline, and `stream()` yields the running requests' step-t+1
        tokens before its first one; each request's own token order is unchanged."""
        slots = sorted(active)
        cur = self._greedy_launch(torch.tensor([[active[s].out[-1]] for s in slots]), slots)
        while True:
            more = any(len(active[s].out) + 1 < active[s].max_new for s in slots)
            nxt = self._greedy_launch(cur.tokens, slots) if more else None
            done = False
            for s, tok in zip(slots, cur.read()):
                yield from self._push(active[s], tok)
                done |= active[s].finish is not None
            if nxt is None:
                return
            if done:  # the step in flight: keep the tokens of the requests still running
                for s, tok in zip(slots, nxt.read()):
                    if active[s].finish is None:
                        yield from self._push(active[s], tok)
                return
            cur = nxt

    def _emit(self, r: _Request, logits: torch.Tensor) -> Iterator[tuple[int, int]]:
        yield from self._push(r, sample(logits.float().cpu(), r.params, r.gen))

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


class _Inflight:
    """A greedy step's tokens [B, 1] on the device, and their asynchronous copy to (pinned) host memory."""

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

    def send(self, values: list[int]) -> torch.Tensor:
        """The values as a device int64 tensor (a view of the buffer the next send rewrites)."""
        n = len(values)
        if n > self.host.numel():
            torch.cuda.synchronize(self.device)  # queued work may still read the old buffer
            self._alloc(2 * n)
        if self.copied is not None:
            self.copied.synchronize()
        self.host.numpy()[:n] = values
        dev = self.dev[:n]
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
