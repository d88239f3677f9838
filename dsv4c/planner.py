"""The memory planner (issue 24): which `ParallelPlan(tp, ep)` fits a model on N GPUs, and which is fastest.

For every plan with tp * ep = N whose degrees divide what they split (heads, output groups, indexer heads,
vocabulary, the dense/shared/expert intermediate dims over tp; the routed experts over ep), and whose tp
slices keep to the format's blocks (quantised experts; FP8 dense linears: `fp8_dense_problems`), it counts
the bytes one GPU holds:

- weights by kind from a meta-device model (`build_model(..., device="meta")`, nothing allocated)
  in the artifact's dtypes: dense tensors in the compile dtype (the target's, bf16 on GPUs; the fp32
  islands stay fp32, `keeps_fp32`; the FP8-stored linears an FP8 `dense_format` keeps at 1 byte are counted
  in that dtype too, an over-count), routed experts in the expert format's containers
  (`passes/quantize_experts.field_specs`, scales included, dims zero-padded to the format's block as the
  pass does, per shard). Sharding follows `dsv4c/parallel.py`: q/o projections, attention sinks and the
  indexer's heads split over tp (V4's grouped output projection by groups); the K=V latent, the
  compressors, norms, mHC and routers replicated; dense MLPs and the shared expert split by their
  intermediate dim; routed experts E/ep per row with each expert's intermediate dim split over tp;
  embedding and LM head vocabulary-parallel; the MTP block (only with --mtp K, as compile lifts it only
  then) sharded like a layer, its e/h projections replicated.
- caches at L x B from `runtime/kv_cache.cache_layout` (the Session's own layout, B + 1 slots): the plan
  replicates every cache (V4's ring, compressed entries, compressor state and indexer caches all come from
  the replicated latent and compressors; V3's c_KV latent, rope keys and V3.2 index keys likewise).
- graph workspace: an estimate, not a measurement (`workspace_bytes` says how): the live activations of one
  prefill chunk (the Session prefills min(L, PREFILL_CHUNK) tokens at a time), twice for allocator slack.
- reserve: CUDA context, cuBLAS/NCCL buffers (RESERVE_BYTES, an estimate).

A plan fits when the caches fit in the memory left after reserve, weights and workspace less the
Session's margin (kv_cache.allocate keeps SESSION_MARGIN of the free memory); headroom is what is left.

Speed: the byte roofline of a decode step at batch 1: each GPU reads its non-expert weights (one
embedding row), the routed experts that land on it (the expected maximum over the ep rows of the top-K
experts, uniform routing), and one sequence's cache at L (an upper bound: every cache row read once), at
the target's copy bandwidth; the slowest GPU counts. Plus all-reduces: per layer one over tp after the
attention and one over the FFN's group (the world for MoE layers, tp for dense ones), one for the
vocabulary-parallel embedding and an all-gather of the logits, each ALLREDUCE_LATENCY_S + 2(n-1)/n x
bytes / link bandwidth. The figures are data (HARDWARE) with their sources.
"""
from __future__ import annotations

import functools
import math
import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field

import torch

from dsv4c.config import ModelConfig
from dsv4c.parallel import ParallelPlan, PlanError

GiB = 1 << 30
PREFILL_CHUNK = 2048  # runtime/session.py's default max_num_batched_tokens (min(L, 2048) per prefill chunk)
RESERVE_BYTES = 2 * GiB  # per GPU: CUDA context, cuBLAS workspaces, NCCL buffers (estimate, not measured)
SESSION_MARGIN = 0.1  # runtime/kv_cache.allocate's default headroom: caches get 90% of the free memory
WORKSPACE_SLACK = 2.0  # the caching allocator's rounding and fragmentation, CUDA-graph pools (estimate)
ALLREDUCE_LATENCY_S = 10e-6  # per small-message all-reduce/all-gather in a CUDA graph (assumed; not measured)
KINDS = ("attention", "dense/shared", "routed experts", "embedding", "head", "norms/mHC/routers", "MTP")


@dataclass(frozen=True)
class GPU:
    """One GPU kind as data: memory, bandwidths, and where each figure comes from."""

    name: str
    memory_bytes: int  # the datasheet figure, in 10^9 bytes (the CUDA-visible total is a little larger)
    copy_bw: float  # bytes/s a device-to-device copy reaches (read + write counted)
    link_bw: float  # NVLink bytes/s per direction per GPU
    source: str


_H200_COPY = 4152e9  # BENCHMARKS.md, first H200 session: "Copy bandwidth, measured in the same run: 4152 GB/s"
_COPY_FRACTION = _H200_COPY / 4.8e12  # the H200's measured copy over its 4.8 TB/s datasheet HBM bandwidth
HARDWARE: dict[str, GPU] = {
    "h200": GPU("h200", 141 * 10**9, _H200_COPY, 450e9,
                "141 GB HBM3e (datasheet); copy bandwidth 4152 GB/s measured on the team's H200 (BENCHMARKS.md); "
                "NVLink 4 900 GB/s bidirectional = 450 GB/s per direction (datasheet)"),
    "h100": GPU("h100", 80 * 10**9, 3.35e12 * _COPY_FRACTION, 450e9,
                "H100 SXM 80 GB HBM3 (datasheet); copy bandwidth estimated as the 3.35 TB/s datasheet figure x "
                f"{_COPY_FRACTION:.3f} (the H200's measured/datasheet ratio), not measured; NVLink 4 450 GB/s per "
                "direction"),
    "b200": GPU("b200", 180 * 10**9, 8.0e12 * _COPY_FRACTION, 900e9,
                "B200 180 GB HBM3e (DGX B200 datasheet); copy bandwidth estimated as 8 TB/s x "
                f"{_COPY_FRACTION:.3f} (the H200's measured/datasheet ratio), not measured; NVLink 5 1.8 TB/s "
                "bidirectional = 900 GB/s per direction"),
}


class PlanRefused(ValueError):
    """No plan fits; the message names the best candidate's shortfall."""

    def __init__(self, msg: str, report: "PlanReport"):
        super().__init__(msg)
        self.report = report


# ---- which tensor splits how -------------------------------------------------------------------
# split: "rep" replicated, "tp" dim 0 or -1 divided by tp (size/tp either way), "vocab" rows / tp,
# "experts" the routed experts (E/ep experts of width I/tp, in the expert format)
_V4_RULES = [
    (r"attn\.(wq_b|wo_a|wo_b)\.weight$|attn\.attn_sink$|attn\.indexer\.(wq_b|weights_proj)\.weight$", "attention", "tp"),
    (r"attn\.", "attention", "rep"),  # wq_a, q_norm, wkv (K=V latent), kv_norm, compressors, rope
    (r"ffn\.shared_experts\.w[123]\.weight$", "dense/shared", "tp"),
    (r"ffn\.experts\.w[123]$", "routed experts", "experts"),
    (r"^embed\.weight$", "embedding", "vocab"),
    (r"^head\.weight$", "head", "vocab"),
]
_V3_RULES = [
    (r"self_attn\.(q_proj|q_b_proj|kv_b_proj|o_proj)\.weight$|self_attn\.indexer\.(wq_b|weights_proj)\.weight$",
     "attention", "tp"),
    (r"self_attn\.", "attention", "rep"),  # q_a, kv_a (the latent), norms, V3.2's indexer key
    (r"mlp\.(shared_experts\.)?(gate_proj|up_proj|down_proj)\.weight$", "dense/shared", "tp"),
    (r"mlp\.experts\.(gate_proj|up_proj|down_proj)$", "routed experts", "experts"),
    (r"^model\.embed_tokens\.weight$", "embedding", "vocab"),
    (r"^lm_head\.weight$", "head", "vocab"),
]


def _is_mtp(cfg: ModelConfig, name: str) -> bool:
    return name.startswith("mtp.") or name.startswith(f"model.layers.{cfg.num_hidden_layers}.")


def classify(cfg: ModelConfig, name: str) -> tuple[str, str]:
    """(kind, split) of one parameter or buffer; the MTP block's tensors have kind "MTP"."""
    kind, split = "norms/mHC/routers", "rep"
    for pat, k, s in (_V4_RULES if cfg.is_v4 else _V3_RULES):
        if re.search(pat, name):
            kind, split = k, s
            break
    if _is_mtp(cfg, name):
        kind = "MTP"
    return kind, split


# ---- plans --------------------------------------------------------------------------------------
def plan_problems(cfg: ModelConfig, plan: ParallelPlan, expert_format: str | None = None,
                  dense_format: str | None = None) -> list[str]:
    """Why `plan` cannot shard `cfg` (empty when it can): each split dim must divide, with quantised
    routed experts each rank's intermediate columns must be whole blocks of the format (compile refuses
    a tp that cuts one: dsv4c/convert.py check_inter_split), and with an FP8 `dense_format` each rank's
    slice of an FP8-stored dense linear must keep to the 128x128 scale tiles (`fp8_dense_problems`)."""
    tp, ep = plan.tp, plan.ep
    need = [("num_attention_heads", cfg.num_attention_heads, tp), ("vocab_size", cfg.vocab_size, tp),
            ("moe_intermediate_size", cfg.moe_intermediate_size, tp), ("n_routed_experts", cfg.n_routed_experts, ep)]
    if cfg.is_v4:
        need += [("o_groups", cfg.o_groups, tp), ("index_n_heads", cfg.index_n_heads, tp)]
    else:
        if cfg.first_k_dense_replace:
            need.append(("intermediate_size", cfg.intermediate_size, tp))
        if cfg.has_dsa_indexer:
            need.append(("index_n_heads", cfg.index_n_heads, tp))
    out = [f"{f} {v} is not divisible by {'tp' if d == tp else 'ep'}={d}" for f, v, d in need if v % d]
    if expert_format is not None and tp > 1 and not out:
        from dsv4c.convert import KERNEL_FORMAT, check_inter_split

        kfmt = KERNEL_FORMAT.get(expert_format)
        try:
            if kfmt is not None:
                check_inter_split(kfmt, cfg.moe_intermediate_size, tp)
        except PlanError as e:
            out.append(str(e))
    if dense_format in ("fp8_block", "fp8_block_w8a16") and tp > 1 and not out:
        out += fp8_dense_problems(cfg, plan)
    return out


def fp8_dense_problems(cfg: ModelConfig, plan: ParallelPlan) -> list[str]:
    """The FP8-stored dense weights (the release's, `checkpoint.release_format`) whose tp slices compile
    would refuse: a rank's slice must start on a 128 boundary or lie inside one scale tile
    (passes/shard.py `weight_recipe`, `slice_fp8_block`). V4's grouped wo_a is one of them (its rows split by
    whole groups of o_lora_rank rows)."""
    from dsv4c.checkpoint import release_format
    from dsv4c.passes.shard import weight_recipe
    from dsv4c.quant import FP8_BLOCK

    bad: dict[str, list] = {}  # weight kind (the name past its layer) -> [(name, dim, lo, hi)]
    for t in model_tensors(cfg, torch.bfloat16):
        name = t.name[len("model."):] if t.name.startswith("model.") else t.name
        if len(t.shape) != 2 or release_format(cfg, name) != "fp8":
            continue
        cuts = [(name, dim, lo, hi) for r in range(plan.world_size)
                for dim, lo, hi in weight_recipe(name, t.shape, plan, r)
                if lo % FP8_BLOCK and lo // FP8_BLOCK != (hi - 1) // FP8_BLOCK]
        if cuts:
            bad.setdefault(name.split(".", 2)[-1], []).append(cuts[0])
    return [f"{hits[0][0]} (and {len(hits) - 1} more like it): tp={plan.tp} slices dim {hits[0][1]} into "
            f"[{hits[0][2]}, {hits[0][3]}), across a {FP8_BLOCK}-wide FP8 scale tile (FP8 dense shards on tile "
            f"boundaries; --dense-format bf16 widens instead)" for hits in bad.values()]


def candidate_plans(gpus: int) -> list[ParallelPlan]:
    if not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"--gpus: must be an integer >= 1, got {gpus!r}")
    return [ParallelPlan(tp=t, ep=gpus // t) for t in range(1, gpus + 1) if gpus % t == 0]


# ---- bytes --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Tensor:
    name: str
    kind: str
    split: str
    numel: int
    itemsize: int
    shape: tuple[int, ...]
    decode_reads: bool = True  # read by a decode step (V3's naive kv_b_proj serves only prefill)


@functools.lru_cache(maxsize=8)
def model_tensors(cfg: ModelConfig, dtype: torch.dtype) -> tuple[_Tensor, ...]:
    """Every tensor the artifact's graphs hold, in the artifact's dtypes (memoised: a full-size model takes
    seconds to build even on meta): the meta model's parameters and buffers (rope inv_freq included: the
    graphs lift it), plus V3's absorbed W_UK/W_UV (passes/absorb_mla.py absorbs kv_b_proj in the decode and
    MTP graphs and leaves the prefill graph naive, so a main layer holds both forms, the MTP layer only the
    absorbed one)."""
    from dsv4c.model import build_model

    model = build_model(cfg, device="meta", dtype=dtype)
    out = []
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        kind, split = classify(cfg, name)
        shape = tuple(t.shape)
        if not cfg.is_v4 and name.endswith("self_attn.kv_b_proj.weight"):
            absorbed = _Tensor(name + "(absorbed W_UK, W_UV)", kind, split, t.numel(), t.dtype.itemsize, shape)
            out.append(absorbed)
            if kind == "MTP":
                continue
            out.append(_Tensor(name, kind, split, t.numel(), t.dtype.itemsize, shape, decode_reads=False))
            continue
        out.append(_Tensor(name, kind, split, t.numel(), t.dtype.itemsize, shape))
    return tuple(out)


@functools.lru_cache(maxsize=16)
def _layout(cfg: ModelConfig, dtype: torch.dtype, slots: int, max_tokens: int, extra: int, mtp: bool):
    from dsv4c.runtime.kv_cache import cache_layout

    return cache_layout(cfg, dtype, slots, max_tokens, extra_ring_slots=extra, mtp=mtp)


def _padded(n: int, a: int) -> int:
    return -(-n // a) * a


def expert_shard_bytes(n_experts: int, inter: int, hidden: int, expert_format: str, dtype: torch.dtype) -> int:
    """Bytes of `n_experts` routed experts of width `inter` on hidden `hidden` in `expert_format`
    (quantize_experts' containers, dims zero-padded to the format's block; "reference": unquantised)."""
    from dsv4c.passes.quantize_experts import ACT_FIELDS, ALIGN, KERNEL_FORMAT, field_specs

    if expert_format not in KERNEL_FORMAT:
        raise ValueError(f"--expert-format: unknown format {expert_format!r}; expected one of {sorted(KERNEL_FORMAT)}")
    kfmt = KERNEL_FORMAT[expert_format]
    if kfmt is None:
        return 3 * n_experts * inter * hidden * dtype.itemsize
    a = ALIGN[kfmt]
    specs = field_specs(kfmt, n_experts, _padded(inter, a), _padded(hidden, a))
    n = sum(math.prod(s) * d.itemsize for s, d in specs.values())
    return n + (len(ACT_FIELDS) * 4 if kfmt == "nvfp4_w4a4" else 0)  # static per-layer fp32 [1] input scales


def _moe_modules(tensors: tuple[_Tensor, ...]) -> dict[str, list[_Tensor]]:
    mods: dict[str, list[_Tensor]] = defaultdict(list)
    for t in tensors:
        if t.split == "experts":
            mods[t.name.rsplit(".", 1)[0]].append(t)
    return mods


def weight_bytes(cfg: ModelConfig, tensors: tuple[_Tensor, ...], plan: ParallelPlan, expert_format: str,
                 dtype: torch.dtype, mtp: bool) -> dict[str, int]:
    """Bytes one GPU holds per kind under `plan` (every rank holds the same amount: the splits divide)."""
    out = {k: 0 for k in KINDS}
    for t in tensors:
        if t.split == "experts" or (t.kind == "MTP" and not mtp):
            continue
        share = t.numel * t.itemsize
        out[t.kind] += share // plan.tp if t.split in ("tp", "vocab") else share
    for mod, ts in _moe_modules(tensors).items():
        if ts[0].kind == "MTP" and not mtp:
            continue
        e, inter, hidden = ts[0].shape  # w1 / gate_proj [E, I, D] (stacked)
        if any(t.shape[0] != e for t in ts):
            raise ValueError(f"{mod}: routed experts with different counts {[t.shape for t in ts]}")
        b = expert_shard_bytes(e // plan.ep, inter // plan.tp, hidden, expert_format, dtype)
        out["MTP" if ts[0].kind == "MTP" else "routed experts"] += b
    return out


def workspace_bytes(cfg: ModelConfig, plan: ParallelPlan, max_tokens: int, act_dtype: torch.dtype) -> tuple[int, str]:
    """Estimated graph workspace per GPU and how it was estimated (not measured)."""
    t = min(max_tokens, PREFILL_CHUNK)
    d, v, k = cfg.hidden_size, cfg.vocab_size, cfg.num_experts_per_tok
    heads = cfg.num_attention_heads // plan.tp
    hd = cfg.head_dim if cfg.is_v4 else cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    hc = cfg.hc_mult if cfg.is_v4 else 1
    logits = t * v * 4 * (1 + 1 / plan.tp)  # fp32 [T, V/tp] shard + the gathered [T, V]
    layer = (3 * t * hc * d * 4  # residual streams in/out + the mixed input, fp32
             + 2 * t * heads * hd * 4  # q and o, fp32
             + 2 * t * k * 2 * cfg.moe_intermediate_size // plan.tp * act_dtype.itemsize  # routed w13 out, h
             + 2 * t * k * d * 4)  # routed outputs before the weighted sum
    indexer = 0
    if cfg.is_v4 and any(cfg.layer_ratio(i) == 4 for i in range(cfg.num_hidden_layers)):
        indexer = 2 * t * (max_tokens // 4) * 4  # CSA indexer scores [T, L/4] fp32 and the top-k workspace
    elif not cfg.is_v4 and cfg.has_dsa_indexer:
        indexer = 2 * t * max_tokens * 4
    layer += indexer
    n = int(WORKSPACE_SLACK * (logits + layer))
    how = (f"estimate: one prefill chunk of {t} tokens (min(L, {PREFILL_CHUNK})): fp32 logits, one layer's "
           f"residual streams, q/o, routed-expert activations{' and indexer scores' if indexer else ''}; "
           f"x{WORKSPACE_SLACK:g} for allocator slack and graph pools")
    return n, how


def expected_max_experts(n_experts: int, k: int, ep: int) -> float:
    """E[max over the ep rows of how many of a token's top-k experts the row holds], for k distinct experts
    drawn uniformly from n_experts split evenly into ep rows (multivariate hypergeometric)."""
    g = n_experts // ep
    total = math.comb(n_experts, k)
    e = 0.0
    for m in range(k):  # E[max] = sum_{m >= 0} P(max > m)
        poly = [1]  # ways to choose j experts with every row holding <= m of them
        row = [math.comb(g, i) for i in range(min(m, g) + 1)]
        for _ in range(ep):
            nxt = [0] * min(len(poly) + len(row) - 1, k + 1)
            for a, pa in enumerate(poly):
                for b, rb in enumerate(row):
                    if a + b <= k:
                        nxt[a + b] += pa * rb
            poly = nxt
        e += 1 - (poly[k] if k < len(poly) else 0) / total
    return e


@dataclass
class Candidate:
    plan: ParallelPlan
    problems: list[str] = field(default_factory=list)  # non-empty: the plan cannot shard this model
    weights: dict[str, int] = field(default_factory=dict)
    caches: int = 0
    workspace: int = 0
    reserve: int = RESERVE_BYTES
    total: int = 0
    headroom: int = 0  # memory - total; the caches also need SESSION_MARGIN of what they get
    fits: bool = False
    shortfall: int = 0  # bytes missing per GPU when it does not fit
    step_s: float = 0.0
    bytes_read: int = 0
    comm_s: float = 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["plan"] = self.plan.to_dict()
        return d


@dataclass
class PlanReport:
    model: str
    gpus: int
    target: str
    gpu: GPU
    expert_format: str
    dtype: str
    max_tokens: int
    max_batch: int
    mtp_k: int
    cache_by_kind: dict
    workspace_how: str
    candidates: list[Candidate]
    chosen: ParallelPlan | None
    assumptions: list[str]

    def to_dict(self) -> dict:
        return {"model": self.model, "gpus": self.gpus, "target": self.target, "gpu": asdict(self.gpu),
                "expert_format": self.expert_format, "dtype": self.dtype, "max_tokens": self.max_tokens,
                "max_batch": self.max_batch, "mtp_k": self.mtp_k, "cache_by_kind": self.cache_by_kind,
                "workspace_how": self.workspace_how, "candidates": [c.to_dict() for c in self.candidates],
                "chosen": self.chosen.to_dict() if self.chosen else None, "assumptions": self.assumptions}

    def format(self) -> str:
        g = lambda n: f"{n / 1e9:.1f}"  # noqa: E731 (GB, as the datasheets count)
        lines = [f"{self.model} on {self.gpus} x {self.target} ({g(self.gpu.memory_bytes)} GB each), routed experts "
                 f"{self.expert_format}, dense {self.dtype}, caches {self.max_batch} x {self.max_tokens} tokens"
                 f"{f', MTP k={self.mtp_k}' if self.mtp_k else ''}; per-GPU GB:"]
        head = ["plan", *KINDS, "caches", "workspace", "reserve", "total", "headroom", "fits", "step ms", "tok/s"]
        rows = []
        for c in self.candidates:
            name = f"tp={c.plan.tp} ep={c.plan.ep}"
            if c.problems:
                rows.append([name, "cannot shard: " + "; ".join(c.problems)])
                continue
            rows.append([name, *(g(c.weights[k]) for k in KINDS), g(c.caches), g(c.workspace), g(c.reserve),
                         g(c.total), g(c.headroom), "yes" if c.fits else f"no (-{g(c.shortfall)})",
                         f"{c.step_s * 1e3:.2f}", f"{1 / c.step_s:.0f}" if c.step_s else "-"])
        widths = [max(len(head[i]), *(len(r[i]) for r in rows if len(r) > i)) for i in range(len(head))]
        lines.append("  ".join(h.rjust(w) for h, w in zip(head, widths)))
        for r in rows:
            lines.append("  ".join(c.rjust(w) for c, w in zip(r, widths)) if len(r) > 2 else f"{r[0]:>{widths[0]}}  {r[1]}")
        lines.append(f"chosen: {self.chosen}" if self.chosen else "chosen: none fits")
        lines += [f"  - {a}" for a in self.assumptions]
        return "\n".join(lines)


def _comm_seconds(cfg: ModelConfig, plan: ParallelPlan, gpu: GPU, act_bytes: int) -> float:
    def collective(n: int, nbytes: float) -> float:
        return 0.0 if n == 1 else ALLREDUCE_LATENCY_S + 2 * (n - 1) / n * nbytes / gpu.link_bw

    msg = cfg.hidden_size * act_bytes  # one token's [D] at batch 1
    s = 0.0
    for i in range(cfg.num_hidden_layers):
        s += collective(plan.tp, msg)  # attention output
        s += collective(plan.world_size if cfg.is_moe_layer(i) else plan.tp, msg)  # FFN output
    s += collective(plan.tp, msg)  # vocabulary-parallel embedding
    if plan.tp > 1:  # logits all-gather: (n-1)/n of [V] fp32 arrives at each rank
        s += ALLREDUCE_LATENCY_S + (plan.tp - 1) / plan.tp * cfg.vocab_size * 4 / gpu.link_bw
    return s


def _step(cfg: ModelConfig, tensors: tuple[_Tensor, ...], plan: ParallelPlan, weights: dict[str, int],
          expert_format: str, dtype: torch.dtype, cache_per_seq: int, gpu: GPU) -> tuple[int, float, float]:
    """(bytes the slowest GPU reads per batch-1 decode step, step seconds, of which communication)."""
    main = {k: v for k, v in weights.items() if k not in ("routed experts", "MTP", "embedding")}
    nbytes = sum(main.values()) + cfg.hidden_size * dtype.itemsize  # + one embedding row
    nbytes -= sum(t.numel * t.itemsize // plan.tp for t in tensors if not t.decode_reads)
    per_row = expected_max_experts(cfg.n_routed_experts, cfg.num_experts_per_tok, plan.ep)
    for mod, ts in _moe_modules(tensors).items():
        if ts[0].kind == "MTP":
            continue
        e, inter, hidden = ts[0].shape
        nbytes += per_row / (e // plan.ep) * expert_shard_bytes(e // plan.ep, inter // plan.tp, hidden,
                                                                 expert_format, dtype)
    nbytes += cache_per_seq
    comm = _comm_seconds(cfg, plan, gpu, dtype.itemsize)
    return int(nbytes), nbytes / gpu.copy_bw + comm, comm


def choose_plan(config: ModelConfig | str, gpus: int, target: str, expert_format: str | None = None,
                max_tokens: int = 4096, max_batch: int = 8, mtp_k: int = 0,
                dtype: torch.dtype | None = None, dense_format: str | None = None) -> tuple[ParallelPlan, PlanReport]:
    """The fastest plan that fits `config` on `gpus` GPUs of `target`, and the report of every candidate.
    Raises PlanRefused (a ValueError, `.report` attached) naming the shortfall when none fits.
    `dense_format` (default: the target's) decides which tp slices the FP8 dense linears allow."""
    report = plan_report(config, gpus, target, expert_format, max_tokens, max_batch, mtp_k, dtype, dense_format)
    if report.chosen is None:
        ok = [c for c in report.candidates if not c.problems]
        if not ok:
            raise PlanRefused(f"no plan of {gpus} GPUs can shard {report.model}: "
                              + " | ".join(f"{c.plan}: {'; '.join(c.problems)}" for c in report.candidates), report)
        best = min(ok, key=lambda c: c.shortfall)
        parts = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in best.weights.items() if v)
        raise PlanRefused(
            f"{report.model} does not fit on {gpus} x {target} ({report.gpu.memory_bytes / 1e9:.0f} GB each) with "
            f"{report.expert_format} experts and caches for {max_batch} x {max_tokens} tokens: the best plan, "
            f"{best.plan}, needs {best.total / 1e9:.1f} GB per GPU (weights: {parts}; caches {best.caches / 1e9:.1f}, "
            f"workspace {best.workspace / 1e9:.1f}, reserve {best.reserve / 1e9:.1f} GB), short by "
            f"{best.shortfall / 1e9:.1f} GB; use more GPUs, a smaller expert format, or a smaller "
            f"--max-batch/--max-tokens", report)
    return report.chosen, report


def plan_report(config: ModelConfig | str, gpus: int, target: str, expert_format: str | None = None,
                max_tokens: int = 4096, max_batch: int = 8, mtp_k: int = 0,
                dtype: torch.dtype | None = None, dense_format: str | None = None) -> PlanReport:
    """Every candidate plan's per-GPU bytes and decode-step roofline (no refusal; `chosen` None if none fits)."""
    from dsv4c.targets import get_target

    cfg = config if isinstance(config, ModelConfig) else ModelConfig.resolve(config)
    name = config if isinstance(config, str) else cfg.model_type
    if target not in HARDWARE:
        raise ValueError(f"--target: the planner knows the GPUs {sorted(HARDWARE)}, not {target!r}")
    if max_batch < 1 or max_tokens < 1:
        raise ValueError(f"--max-batch/--max-tokens: must be >= 1, got {max_batch} / {max_tokens}")
    if mtp_k and not cfg.num_nextn_predict_layers:
        raise ValueError(f"--mtp {mtp_k}: this model has no MTP block (num_nextn_predict_layers = 0)")
    gpu, tgt = HARDWARE[target], get_target(target)
    fmt, dense = expert_format or tgt.expert_format, dense_format or tgt.dense_format
    dtype = dtype or getattr(torch, tgt.dtype)
    tensors = model_tensors(cfg, dtype)
    extra = mtp_k if cfg.is_v4 else 0
    layouts = [_layout(cfg, dtype, max_batch + 1, max_tokens, extra, False)]
    if mtp_k:
        layouts.append(_layout(cfg, dtype, max_batch + 1, max_tokens, extra, True))
    caches = sum(lay.total_bytes for lay in layouts)
    by_kind: dict[str, int] = defaultdict(int)
    for lay in layouts:
        for k, v in lay.by_kind().items():
            by_kind[k] += v
    per_seq = layouts[0].bytes_per_slot
    cands, how = [], ""
    for plan in candidate_plans(gpus):
        c = Candidate(plan, plan_problems(cfg, plan, fmt, dense))
        if not c.problems:
            c.weights = weight_bytes(cfg, tensors, plan, fmt, dtype, mtp=bool(mtp_k))
            c.caches = caches
            c.workspace, how = workspace_bytes(cfg, plan, max_tokens, dtype)
            c.total = sum(c.weights.values()) + c.caches + c.workspace + c.reserve
            c.headroom = gpu.memory_bytes - c.total
            free = gpu.memory_bytes - (c.total - c.caches)  # what the Session sees before allocating caches
            need = c.caches / (1 - SESSION_MARGIN)
            c.fits = need <= free
            c.shortfall = max(0, math.ceil(need - free))
            c.bytes_read, c.step_s, c.comm_s = _step(cfg, tensors, plan, c.weights, fmt, dtype, per_seq, gpu)
        cands.append(c)
    fitting = [c for c in cands if c.fits]
    chosen = min(fitting, key=lambda c: (c.step_s, -c.headroom)).plan if fitting else None
    assumptions = [
        f"weights counted from the meta-device model: dense in {str(dtype).replace('torch.', '')} (fp32 "
        f"islands fp32; the dense format is {dense}: fp8_block / fp8_block_w8a16 keep the "
        f"FP8-stored linears at 1 byte, each rank its slice, counted here in the compile dtype: an over-count), "
        f"routed experts "
        f"in {fmt} (quantize_experts containers, scales included)",
        f"caches: runtime/kv_cache.cache_layout for {max_batch + 1} slots x {max_tokens} tokens, replicated on every GPU",
        f"workspace: {how}",
        f"reserve {RESERVE_BYTES / GiB:.0f} GiB per GPU (CUDA context, cuBLAS/NCCL buffers; estimate); fits = caches "
        f"fit in {1 - SESSION_MARGIN:.0%} of the memory left (the Session's margin)",
        f"step: bytes read by the slowest GPU at batch 1 (its non-expert weights, one embedding row, the expected "
        f"busiest expert row's experts, one sequence's cache at L) / copy bandwidth {gpu.copy_bw / 1e9:.0f} GB/s, "
        f"+ per collective {ALLREDUCE_LATENCY_S * 1e6:.0f} us latency (assumed) + 2(n-1)/n bytes / NVLink "
        f"{gpu.link_bw / 1e9:.0f} GB/s. {gpu.source}",
        "computed, not measured",
    ]
    return PlanReport(name, gpus, target, gpu, fmt, str(dtype).replace("torch.", ""), max_tokens, max_batch, mtp_k,
                      dict(by_kind), how, cands, chosen, assumptions)
