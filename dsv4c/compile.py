"""`dsv4c compile`: checkpoint -> a self-contained, versioned artifact folder.

    ART/
      manifest.json            format version, versions, target, model config, graphs with their pass
                               records, buckets, limits, quant map, weight table, sha256 + size of every file
      graphs/{kind}.pt2        torch.export programs with no state (weights lifted to a `weights` input)
      weights/weights-XXXXX.safetensors   every tensor the graphs read, by graph name
      tokenizer.json ...       copied from the checkpoint (tokenizer_config.json and chat_template.jinja: the chat template;
                               a V4 checkpoint without one gets dsv4c/chat_templates.py's, as chat_template.jinja)

The model is traced on the `meta` device (no weights in memory). Weights are then streamed: each
graph weight is read from the checkpoint one tensor at a time, transformed by the passes' recipes
(fused projections, absorbed kv_b_proj halves, quantised routed experts), cast, and written. Nothing in the artifact is a pickle.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import dsv4c
from dsv4c.chat_templates import builtin_chat_template, load_chat_template
from dsv4c.checkpoint import CheckpointReader, _ShardWriter, load_model, read_param
from dsv4c.config import ModelConfig
from dsv4c.convert import CheckpointExperts, check_format
from dsv4c.export import GraphSpec, example_inputs, export_graph, export_lifted, lift_weights
from dsv4c.parallel import PlanError
from dsv4c.passes import PassContext, get_param, run_pipeline
from dsv4c.passes.quantize_experts import RECIPE as EXPERTS_RECIPE
from dsv4c.passes.quantize_dense import RECIPE as DENSE_RECIPE
from dsv4c.passes.quantize_dense import (describe_dense, deterministic_dense_format, merge_dense_quant_map,
                                         with_dense_format)
from dsv4c.passes.quantize_experts import describe_quant_map, merge_quant_map
from dsv4c.passes.shard import slice_fp8_block, slice_weight
from dsv4c.provenance import describe_source, source_hashes
from dsv4c.targets import get_target

if TYPE_CHECKING:
    from dsv4c.parallel import ParallelPlan

FORMAT_VERSION = 3  # 2: caches carry one scratch slot (limits.cache_slots = max_batch + 1)
#                    3: V4 compressors keep c·m + K rows by position (v4_compress), not the open group
MANIFEST = "manifest.json"
SHARD_RECIPE = "shard"  # a rank's slice of one checkpoint weight (passes/shard.py's recipe)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja")  # the chat template: in tokenizer_config.json or this file


class ArtifactError(ValueError):
    """A bad artifact: the message names the file or manifest field."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            h.update(block)
    return h.hexdigest()


def sha256_many(paths: list[Path]) -> list[str]:
    """sha256 of each file, several at once: hashlib releases the GIL on large blocks, so a
    30 GB artifact hashes in seconds on a many-core host instead of ~20 s on one core."""
    from concurrent.futures import ThreadPoolExecutor

    if len(paths) < 2:
        return [sha256(p) for p in paths]
    with ThreadPoolExecutor(max_workers=min(len(paths), os.cpu_count() or 1, 16)) as pool:
        return list(pool.map(sha256, paths))


def graph_kinds(cfg: ModelConfig, mtp_k: int, fused_mtp: bool = True) -> list[tuple[str, str, int]]:
    """(artifact graph name, export kind, k): decode always takes one token per sequence; with
    --mtp K the artifact adds `verify` (1 + K tokens per sequence), the MTP block's graph and (unless
    `fused_mtp` is off) `verify_mtp`, verify and the MTP refresh in one graph (export.VerifyMTPStepModule).
    The fused graph writes MTP rows past the accepted prefix. Every V4 cache row is position-indexed
    now (the compressors' kept rows too, format 3), so that would be harmless with a compressor in the
    MTP block as well; no checkpoint has one and no test covers it, so such a block still gets no
    fused graph."""
    kinds = [("prefill", "prefill", 0), ("decode", "decode", 0)]
    if mtp_k > 0:
        if not cfg.num_nextn_predict_layers:
            raise ValueError(f"--mtp {mtp_k}: this checkpoint has no MTP block (num_nextn_predict_layers = 0)")
        kinds += [("verify", "decode", mtp_k), ("mtp", "mtp", mtp_k)]
        if fused_mtp and not (cfg.is_v4 and cfg.layer_ratio(cfg.num_hidden_layers)):
            kinds.append(("verify_mtp", "verify_mtp", mtp_k))
    return kinds


def compile_checkpoint(ckpt: str | Path, out: str | Path, target: str = "cpu", skip: tuple[str, ...] = (),
                       max_tokens: int = 4096, max_batch: int = 8, buckets: tuple[int, ...] | None = None,
                       mtp_k: int = 0, dtype: torch.dtype | None = None, force: bool = False,
                       progress: bool = False, kernels: dict[str, str] | None = None,
                       verify_boundaries: bool | None = None, expert_format: str | None = None,
                       fused_mtp: bool = True, convert_device: str | None = None,
                       plan: "ParallelPlan | None" = None, deterministic: bool = False,
                       dense_format: str | None = None, paged=None) -> dict:
    """Compile the checkpoint at `ckpt` for `target` into the artifact folder `out`; returns the manifest.
    `expert_format` overrides the target's routed-expert format (e.g. mxfp4_w4a16 on h200); the manifest
    records the format used and that it was chosen by hand. `fused_mtp=False` leaves out the
    `verify_mtp` graph (speculation then refreshes the MTP with separate `mtp` calls).
    `convert_device` is where routed experts are converted (default: a GPU when there is one; the
    conversions are exact, so the bytes written do not depend on it). `dense_format` overrides the target's
    format of the FP8-stored dense linears (passes/quantize_dense.py: bf16, fp8_block, fp8_block_w8a16).
    `plan`: a `ParallelPlan` with more than one rank writes a sharded artifact (`compile_sharded`);
    None or tp = ep = 1 writes the single-GPU layout.
    `deterministic`: batch-invariant kernels (`deterministic_target`, passes/make_batch_invariant.py; dense
    linears bf16 unless `dense_format` says otherwise); on a CUDA target it raises DeterminismError naming
    any op it cannot make batch-invariant.
    `paged`: a `dsv4c.runtime.block_pool.PagedConfig`: the caches that grow with the sequence in blocks of
    a shared pool, read through a block table (the manifest's "paged" entry; runtime/block_pool.py)."""
    if plan is not None and not plan.is_single:
        if deterministic:
            raise DeterminismError("--deterministic with --tp/--ep: the sharded compile has no deterministic mode yet")
        return compile_sharded(ckpt, out, plan, target=target, skip=skip, max_tokens=max_tokens,
                               max_batch=max_batch, buckets=buckets, mtp_k=mtp_k, dtype=dtype, force=force,
                               progress=progress, expert_format=expert_format, fused_mtp=fused_mtp,
                               convert_device=convert_device, paged=paged, dense_format=dense_format)
    t0 = time.perf_counter()
    ckpt, out = Path(ckpt), Path(out)
    tgt = get_target(target)
    if deterministic:
        tgt, kernels = deterministic_target(tgt, expert_format, kernels, mtp_k)
        expert_format = None
    if expert_format is not None and expert_format != tgt.expert_format:
        tgt = dataclasses.replace(tgt, expert_format=expert_format, expert_format_tokens=None,
                                  expert_format_reason=f"--expert-format {expert_format} (the target's own choice is "
                                                       f"{tgt.expert_format}: {tgt.expert_format_reason})")
    tgt = with_dense_format(tgt, dense_format)
    check_format(tgt)  # an expert format the target's GPU cannot run fails before any work
    if kernels:  # --kernel OP=IMPL overrides, checked before any work
        from dsv4c.model import register_ops
        from dsv4c.passes.select_kernels import implementation_op

        register_ops()
        for op, impl in kernels.items():
            if op not in tgt.kernels:
                raise ValueError(f"--kernel {op}={impl}: unknown op {op!r} (known: {sorted(tgt.kernels)})")
            implementation_op(op, impl)
        tgt = dataclasses.replace(tgt, kernels={**tgt.kernels, **kernels})
    overrides = tuple(sorted((kernels or {}).items()))
    dtype = dtype if dtype is not None else getattr(torch, tgt.dtype)
    check_limits(max_tokens=max_tokens, max_batch=max_batch, mtp_k=mtp_k, buckets=buckets)
    check_output(out, force)
    model = load_model(ckpt, device="meta", dtype=dtype)  # checks names and shapes, allocates nothing
    cfg = model.config
    tmp = _staging(out)  # written beside `out`, renamed into place once complete and checked
    try:
        manifest = _compile_into(tmp, out, ckpt=ckpt, model=model, cfg=cfg, tgt=tgt, target=target,
                                 overrides=overrides, skip=skip, max_tokens=max_tokens, max_batch=max_batch,
                                 buckets=buckets, mtp_k=mtp_k, dtype=dtype, fused_mtp=fused_mtp,
                                 convert_device=convert_device, progress=progress,
                                 verify_boundaries=verify_boundaries, t0=t0,
                                 deterministic=deterministic,
                                 paged=paged.layout(cfg, max_tokens, max_batch) if paged is not None else None)
        _move_into_place(tmp, out)
    except BaseException:  # a failed or interrupted compile leaves no half-written folder behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _compile_into(out: Path, final: Path, *, ckpt: Path, model, cfg: ModelConfig, tgt, target: str, overrides,
                  skip, max_tokens: int, max_batch: int, buckets, mtp_k: int, dtype: torch.dtype, fused_mtp: bool,
                  convert_device: str | None, progress: bool, verify_boundaries: bool | None, t0: float,
                  deterministic: bool = False, paged=None) -> dict:
    """compile_checkpoint's work, written into the staging folder `out` (`final`: where it will be)."""
    graphs, weight_specs, recipes, plans, quant_map, blockers = {}, {}, {}, {}, {}, {}
    fp8_stored = _fp8_stored(ckpt, cfg)  # quantize_dense rewrites only what the checkpoint stores in FP8
    for name, kind, k in graph_kinds(cfg, mtp_k, fused_mtp):
        # one cache slot more than sequences: the capture-safe ops' scratch slot (dsv4c/model/static_ops.py)
        spec = GraphSpec(kind, k=k, n_slots=max_batch + 1, max_len=max_tokens,
                         extra_ring_slots=mtp_k if cfg.is_v4 else 0,  # speculation: the ring keeps W + K rows
                         paged=paged)
        eg = export_graph(model, spec)
        ctx = PassContext(cfg, target, kind, overrides, tgt.expert_format, dense_format=tgt.dense_format,
                          fp8_stored=fp8_stored, deterministic=deterministic)
        gm, records = run_pipeline(eg.module(), ctx, skip=skip)
        if deterministic:
            blockers[name] = _blockers(records)
            if blockers[name] and tgt.device == "cuda":
                raise DeterminismError(f"--deterministic: graph {name!r} keeps ops whose kernels are not "
                                       f"batch-invariant: {blockers[name][:6]} ({len(blockers[name])} in all)")
        recipes.update(_recipes(records))
        merge_quant_map(quant_map, records, name)
        merge_dense_quant_map(quant_map, records, name)
        weights = lift_weights(gm)
        args = example_inputs(model, spec, torch.device("meta"))
        program = export_lifted(gm, spec, args, weights)
        if kind != "prefill":
            plans[name] = _plan_summary(program.module(), cfg, target, kind)
        path = out / "graphs" / f"{name}.pt2"
        torch.export.save(program, str(path))
        weight_specs.update({n: (tuple(t.shape), t.dtype) for n, t in weights.items()})
        graphs[name] = {"file": f"graphs/{name}.pt2", "kind": kind, "k": k, "tokens_per_seq": spec.tokens,
                        "export_seconds": round(eg.seconds, 2), "weights": sorted(weights),
                        "passes": [_record(r) for r in records]}
        if progress:
            print(f"{name}: exported in {eg.seconds:.1f}s, passes {[r.name for r in records if r.changed]}")
    if convert_device is None:
        convert_device = "cuda" if torch.cuda.is_available() else "cpu"
    weights_table = _write_weights(ckpt, cfg, model, weight_specs, recipes, out, progress, quant_map,
                                   torch.device(convert_device))
    chat_template = _copy_tokenizer(ckpt, out, cfg)
    manifest = {
        **_manifest_head(tgt, cfg, dtype, max_tokens, max_batch, buckets, mtp_k),
        "graphs": graphs,
        "segment_plan": plans,  # the router split of every fixed-T graph (Session re-plans and checks it)
        "quant_map": quant_map,  # per quantised module: format, scales, layer, MTP (passes/quantize_experts.py)
        "weights": weights_table,
        "chat_template": chat_template,  # "checkpoint", "built-in" (dsv4c/chat_templates.py) or None
        "compile_seconds": round(time.perf_counter() - t0, 2),
        "convert_device": str(convert_device),
        "deterministic": _determinism_record(tgt, blockers) if deterministic else False,
    }
    if paged is not None:  # the growing caches in blocks (runtime/block_pool.py); the graphs' shapes fix them
        manifest["paged"] = {"block_size": paged.block_size, "n_blocks": paged.n_blocks}
    manifest["files"] = _file_table(out)
    _write_manifest(out, manifest)  # the boundary check loads (and hash-checks) the artifact
    manifest["boundary_check"] = _boundary_check(out, manifest, verify_boundaries, progress, final)
    _write_manifest(out, manifest)
    return manifest


DETERMINISTIC_FP4 = ("mxfp4_w4a16", "nvfp4_w4a16")  # expert formats with a batch-invariant kernel path
DETERMINISTIC_EXPERTS = (*DETERMINISTIC_FP4, "fp8_block")  # ... and FP8 block (moe_experts_fp8_bi)


class DeterminismError(ValueError):
    """`--deterministic` asked for something this compiler cannot make batch-invariant; the message
    names the op or kernel."""


def deterministic_target(tgt, expert_format: str | None, kernels: dict | None, mtp_k: int):
    """The target and kernel overrides of the deterministic mode: routed experts unquantised (default;
    make_batch_invariant swaps in `moe_experts_bi`) or, with `expert_format` mxfp4_w4a16 / nvfp4_w4a16,
    FP4 weight-only as stored (`moe_experts_fp4_bi`: the FP4 GEMV at every token count; a quarter of the
    bf16 bytes), or fp8_block (`moe_experts_fp8_bi`: the grouped tensor-core kernel with one tile at every
    token count, an expert read once per 16 of its assignments; its step 1.10-1.18x the default's, run48),
    dense linears widened to bf16 unless `--dense-format` asks for FP8 (W8A16 then runs `fp8_linear_bi`; the
    default-mode FP8 kernels pick a path by token count), and `v4_attention=fused_det` where the target runs
    the fused attention (its key blocks follow absolute positions, so a verify step's rows reduce like decode
    rows: MTP k >= 0).
    Raises DeterminismError for what it cannot make invariant: NVFP4 W4A4 experts (without static input
    scales their activations are scaled by the amax over every row of the call)."""
    if expert_format not in (None, "reference") + DETERMINISTIC_EXPERTS:
        raise DeterminismError(f"--deterministic with --expert-format {expert_format}: its expert kernels choose their "
                               f"path by token count or scale activations over the whole call; the deterministic "
                               f"mode runs unquantised experts (moe_experts_bi), FP4 weight-only ones "
                               f"({', '.join(DETERMINISTIC_FP4)}: moe_experts_fp4_bi) or fp8_block "
                               f"(moe_experts_fp8_bi)")
    kernels = dict(kernels or {})
    if tgt.kernels.get("v4_attention") == "fused" and kernels.get("v4_attention", "fused_det") == "fused":
        raise DeterminismError("--deterministic with --kernel v4_attention=fused: its split count depends on B·T")
    if tgt.kernels.get("v4_attention") == "fused":
        kernels["v4_attention"] = "fused_det"
    if expert_format in DETERMINISTIC_FP4:
        why = (f"--deterministic --expert-format {expert_format}: FP4 weight-only experts, one kernel path "
               f"(kernels/batch_invariant.py moe_experts_fp4_bi)")
    elif expert_format == "fp8_block":
        why = ("--deterministic --expert-format fp8_block: FP8 block experts, one tile at every token count "
               "(kernels/batch_invariant.py moe_experts_fp8_bi)")
    else:
        expert_format = "reference"
        why = "--deterministic: unquantised experts, one kernel path (kernels/batch_invariant.py moe_experts_bi)"
    tgt = dataclasses.replace(tgt, expert_format=expert_format, expert_format_tokens=None, expert_format_reason=why,
                              dense_format=deterministic_dense_format(tgt.dense_format))
    return tgt, kernels


def _blockers(records) -> list[str]:
    for r in records:
        if r.name == "make_batch_invariant":
            return list(r.stats.get("blockers", []))
    return ["make_batch_invariant did not run (skipped?)"]


def _determinism_record(tgt, blockers: dict) -> dict:
    note = ("CUDA: batch-invariant kernels in every graph (compile refuses otherwise)" if tgt.device == "cuda" else
            "CPU target: the invariant ops run their torch references, whose batch invariance is not proven")
    return {"enabled": True, "note": note, "blockers": {k: v for k, v in blockers.items() if v}}


VERIFY_LIMIT_BYTES = 1 << 30  # boundary check by default only for artifacts whose weights fit comfortably


def _write_manifest(out: Path, manifest: dict) -> None:
    manifest["checksum"] = manifest_checksum(manifest)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def _boundary_check(out: Path, manifest: dict, verify: bool | None, progress: bool, name: Path | None = None) -> dict:
    """Run `runtime.segments.verify_artifact_boundaries` on the artifact just written (CPU, emulated
    buckets). It needs the weights in memory, so by default it runs only below VERIFY_LIMIT_BYTES; the
    GPU tests check the captured graphs the same way. A failed check fails the compile with an
    ArtifactError naming the batch size, bucket and error (`name`: the artifact's final path)."""
    name = name or out
    if not manifest["buckets"]:
        return {"ok": True, "skipped": "the target has no CUDA-graph buckets: nothing is padded"}
    size = sum(f.stat().st_size for f in (out / "weights").glob("*.safetensors"))
    if verify is None:
        verify = size <= VERIFY_LIMIT_BYTES
    if not verify:
        return _skipped(f"weights are {size / 2**30:.1f} GiB (> {VERIFY_LIMIT_BYTES / 2**30:.0f} GiB "
                        f"default limit, or disabled): run on the device", progress)
    fmt = manifest["target"].get("expert_format")
    if fmt in CPU_UNCHECKABLE_FORMATS and manifest["dtype"] != "float32":
        return _skipped(f"{fmt} experts quantise activations to FP4; in the CPU emulation a last-bit "
                        f"{manifest['dtype']} difference between batch shapes can move an activation by a whole FP4 "
                        f"step, more than the check's tolerance, so padding is not checkable here (it is in "
                        f"float32): check it on the target's GPU with "
                        f"dsv4c.runtime.segments.verify_artifact_boundaries(ART, device='cuda')",
                        progress)
    from dsv4c.runtime.segments import verify_artifact_boundaries

    t0 = time.perf_counter()
    report = verify_artifact_boundaries(out)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    if progress:
        print(f"boundary check: {'ok' if report['ok'] else 'FAILED'} ({len(report.get('cases', []))} cases, "
              f"{report['seconds']}s)")
    if not report["ok"]:
        raise ArtifactError(f"{name}: padding check failed at the segment boundaries (nothing written): "
                            + "; ".join(_describe_case(c, report["tolerance"]) for c in report["cases"] if not c["ok"]))
    return report


# expert formats whose CPU emulation the boundary check cannot hold to its tolerance (see _boundary_check)
CPU_UNCHECKABLE_FORMATS = ("nvfp4_w4a4",)


def _skipped(reason: str, progress: bool) -> dict:
    if progress:
        print(f"boundary check: skipped ({reason})")
    return {"ok": None, "skipped": reason}


def _describe_case(c: dict, tol: float) -> str:
    bucket = f"bucket {c['bucket']}" if c["bucket"] is not None else "no bucket (eager)"
    return (f"batch {c['batch']} ({bucket}, {c['mode']}): logits rel err {c['logits_rel_err']:.3g}, cache rel err "
            f"{c['cache_rel_err']:.3g} (tolerance {tol:g})")


def _file_table(out: Path) -> dict:
    files = [p for p in sorted(out.rglob("*")) if p.is_file() and p.name != MANIFEST]
    return {str(p.relative_to(out)): {"sha256": h, "size": p.stat().st_size}
            for p, h in zip(files, sha256_many(files))}


def manifest_checksum(m: dict) -> str:
    """sha256 of the manifest's canonical JSON without its own `checksum` field."""
    body = json.dumps({k: v for k, v in m.items() if k != "checksum"}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()


def _plan_summary(gm, cfg: ModelConfig, target: str, kind: str) -> dict:
    """The router-split plan of a graph, for the manifest and `dsv4c inspect --plan`."""
    from dsv4c.passes.split_at_routers import plan_segments

    plan = plan_segments(gm, PassContext(cfg, target, kind))
    segs = [{"index": s.index, "kind": s.kind, "ops": s.n_ops, "capturable": s.capturable, "reason": s.reason}
            for s in plan.segments]
    return {"segments": segs, "boundaries": len(plan.boundaries), "capturable": plan.n_capturable,
            "table": str(plan), "dot": plan.to_dot()}


def check_limits(max_tokens: int, max_batch: int, mtp_k: int = 0, buckets=None) -> None:
    """The compile limits, checked before any work (the CLI checks the same at parse time)."""
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"--max-tokens: positions per sequence must be at least 1, got {max_tokens}")
    if not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"--max-batch: sequences decoded together must be at least 1, got {max_batch}")
    if not isinstance(mtp_k, int) or mtp_k < 0:
        raise ValueError(f"--mtp: speculative tokens must be 0 or more, got {mtp_k}")
    if mtp_k >= max_tokens:
        raise ValueError(f"--mtp {mtp_k}: must be below --max-tokens {max_tokens}")
    bad = [b for b in buckets or () if b < 1]
    if bad:
        raise ValueError(f"--buckets: batch buckets must be at least 1, got {bad}")


def check_output(out: Path, force: bool) -> None:
    """Refuse an output that compile could not replace cleanly, before any work: a file, a non-empty
    folder without --force, or (with --force) a non-empty folder that is not a dsv4c artifact."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out}: exists and is not a folder (-o names the artifact folder to create)")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise FileExistsError(f"{out}: folder is not empty (pass --force to replace it)")
        if not (out / MANIFEST).is_file():
            raise FileExistsError(f"{out}: --force replaces only a dsv4c artifact, and this folder has no {MANIFEST}")
    if out.parent.exists() and not out.parent.is_dir():
        raise FileExistsError(f"{out.parent}: is not a folder")


def _staging(out: Path) -> Path:
    """A fresh temporary folder beside `out` (same file system, so the final rename is atomic)."""
    import tempfile

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    (tmp / "graphs").mkdir()
    (tmp / "weights").mkdir()
    return tmp


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished artifact `tmp` to `out`; a previous artifact there is renamed aside first
    and removed only after the new one is in place."""
    old = None
    if out.is_dir() and any(out.iterdir()):
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
    elif out.is_dir():
        out.rmdir()
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


def _record(r) -> dict:
    return {"name": r.name, "changed": r.changed, "skipped": r.skipped, "seconds": round(r.seconds, 3),
            "stats": json.loads(json.dumps(r.stats, default=str))}


def _recipes(records) -> dict[str, tuple]:
    """Weights the passes created, as recipes over checkpoint weights (graph names)."""
    out = {}
    for r in records:
        for g in r.stats.get("groups", []) if r.name == "fuse_projections" else []:
            out[g["fused"]] = ("cat", tuple(g["members"]))
        for lay in r.stats.get("layers", []) if r.name == "absorb_mla" else []:
            out[lay["w_uk"]] = ("w_uk", lay["weight"])
            out[lay["w_uv"]] = ("w_uv", lay["weight"])
        for lay in r.stats.get("layers", []) if r.name == "quantize_experts" else []:
            for field, name in lay["tensors"].items():
                out[name] = (EXPERTS_RECIPE, {**lay, "field": field})
        for lin in r.stats.get("linears", []) if r.name == "quantize_dense" else []:
            for field, name in lin["tensors"].items():
                out[name] = (DENSE_RECIPE, {**lin, "field": field})
    return out


def _write_weights(ckpt: Path, cfg: ModelConfig, model, specs: dict, recipes: dict, out: Path,
                   progress: bool, quant_map: dict | None = None, device: torch.device = torch.device("cpu"),
                   slices: dict | None = None) -> dict:
    """Stream every graph weight from the checkpoint into safetensors shards under weights/ (and record
    the W4A4 activation scales the streaming chose in `quant_map`). `slices`: a sharded rank's slice
    recipes of checkpoint weights (passes/shard.py), which its FP8 dense weights follow."""
    reader = CheckpointReader(ckpt, cfg)
    experts = CheckpointExperts(reader, device)  # quantised routed experts, one layer at a time
    dense = _DenseFP8(reader, slices)  # the FP8 dense weights as stored (a rank's slices of them)
    writer = _ShardWriter(out / "weights", 2 << 30)

    def value(name: str, shape, dtype) -> torch.Tensor:
        if name in recipes:
            kind, src = recipes[name]
            if kind == SHARD_RECIPE:  # passes/shard.py: this rank's slice of a checkpoint weight
                canon = name[len("model."):]
                meta = get_param(model, canon)
                return slice_weight(read_param(reader, canon, tuple(meta.shape), meta.dtype), src)
            if kind == EXPERTS_RECIPE:
                return experts(src)
            if kind == DENSE_RECIPE:
                return dense(src)
            if kind == "cat":
                return torch.cat([value(m, None, dtype) for m in src], 0).to(dtype)
            W = value(src, None, dtype)  # a sharded artifact's rank: its heads' rows (the shard recipe)
            dn, dv = cfg.qk_nope_head_dim, cfg.v_head_dim
            H = W.shape[0] // (dn + dv)
            Wv = W.view(H, dn + dv, cfg.kv_lora_rank)
            return (Wv[:, :dn] if kind == "w_uk" else Wv[:, dn:]).contiguous()
        canon = name[len("model."):]
        if canon.endswith("inv_freq"):  # RoPE tables are computed, not stored in checkpoints
            return get_param(model, canon.rsplit(".", 1)[0]).make_inv_freq()
        meta = get_param(model, canon)
        return read_param(reader, canon, tuple(meta.shape), meta.dtype)

    table = {}
    items = sorted(specs.items())
    if progress:
        from tqdm import tqdm

        items = tqdm(items, desc="weights", unit="tensor")
    for name, (shape, dtype) in items:
        t = value(name, shape, dtype).to(dtype)
        if tuple(t.shape) != tuple(shape):
            raise ArtifactError(f"weight {name}: built shape {list(t.shape)}, the graph expects {list(shape)}")
        writer.add(name, t.contiguous())
        table[name] = {"shape": list(shape), "dtype": str(dtype).replace("torch.", "")}
    files = writer.close()
    if quant_map is not None:
        experts.annotate(quant_map)
        dense.annotate(quant_map)
    weight_map = json.loads((out / "weights" / "model.safetensors.index.json").read_text())["weight_map"] \
        if len(files) > 1 else {n: files[0] for n in table}
    for n in table:
        table[n]["file"] = f"weights/{weight_map[n]}"
    reader.close()
    return table


# ---- sharded artifacts (tensor/expert parallel) -------------------------------------------------
def compile_sharded(ckpt: str | Path, out: str | Path, plan: "ParallelPlan", target: str = "cpu",
                    skip: tuple[str, ...] = (), max_tokens: int = 4096, max_batch: int = 8,
                    buckets: tuple[int, ...] | None = None, mtp_k: int = 0, dtype: torch.dtype | None = None,
                    force: bool = False, progress: bool = False, expert_format: str | None = None,
                    fused_mtp: bool = True, convert_device: str | None = None, paged=None,
                    dense_format: str | None = None) -> dict:
    """A sharded artifact: every graph exported once on `meta`, then per rank the shard pass
    (passes/shard.py) and the default pipeline; each rank's weights streamed from the checkpoint one
    tensor at a time and sliced by the shard pass's recipes.

        ART/manifest.json                 `parallel` (the plan), `ranks[r]` {graphs, weights, segment_plan},
                                          `files` (every file's sha256); `graphs`/`weights` = rank 0's
        ART/rank{r}/graphs/{kind}.pt2     ART/rank{r}/weights/*.safetensors

    Quantised routed experts: each rank's experts are built over their whole intermediate dim, as
    the single-GPU artifact builds them, and cut to the rank's columns on the format's block boundaries
    (`convert.shard_inter`): a rank holds the single-GPU artifact's bytes of its slice. A tp that cuts
    a block raises naming the limit (`convert.check_inter_split`); nvfp4_w4a4 (static per-layer
    activation scales) is not sharded yet. V3/V3.2: absorb_mla takes the rank's head count from its
    kv_b_proj rows, so the absorbed W_UK/W_UV are the rank's heads too. `paged` (a PagedConfig): every rank's
    graphs read its own pool through the one block table that rank 0 decides (runtime/distributed.py).
    `dense_format` (as compile_checkpoint's): a rank's FP8 dense weights are its slices of the stored FP8
    bytes and their scale tiles (`shard.slice_fp8_block`; a slice that would split a scale tile raises)."""
    t0 = time.perf_counter()
    ckpt, out = Path(ckpt), Path(out)
    tgt = get_target(target)
    if expert_format is not None and expert_format != tgt.expert_format:
        tgt = dataclasses.replace(tgt, expert_format=expert_format, expert_format_tokens=None,
                                  expert_format_reason=f"--expert-format {expert_format}")
    tgt = with_dense_format(tgt, dense_format)
    check_format(tgt)
    dtype = dtype if dtype is not None else getattr(torch, tgt.dtype)
    model = load_model(ckpt, device="meta", dtype=dtype)
    cfg = model.config
    _check_sharded_experts(cfg, plan, tgt.expert_format)
    check_limits(max_tokens=max_tokens, max_batch=max_batch, mtp_k=mtp_k, buckets=buckets)
    check_output(out, force)
    tmp = _staging(out)  # written beside `out`, renamed into place once complete (as compile_checkpoint)
    try:
        layout = paged.layout(cfg, max_tokens, max_batch) if paged is not None else None
        manifest = _compile_sharded_into(tmp, ckpt, model, cfg, plan, tgt, target, skip, max_tokens, max_batch,
                                         buckets, mtp_k, dtype, fused_mtp, progress, t0, convert_device, layout)
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _compile_sharded_into(out: Path, ckpt: Path, model, cfg: ModelConfig, plan: "ParallelPlan", tgt, target: str,
                          skip, max_tokens: int, max_batch: int, buckets, mtp_k: int, dtype: torch.dtype,
                          fused_mtp: bool, progress: bool, t0: float, convert_device: str | None = None,
                          paged=None) -> dict:
    """compile_sharded's work, written into the staging folder `out`."""
    from dsv4c.passes import default_pipeline
    from dsv4c.passes.shard import shard_pass

    for r in range(plan.world_size):
        (out / f"rank{r}" / "graphs").mkdir(parents=True)
        (out / f"rank{r}" / "weights").mkdir()
    fp8_stored = _fp8_stored(ckpt, cfg)  # quantize_dense rewrites only what the checkpoint stores in FP8
    exported = []
    for name, kind, k in graph_kinds(cfg, mtp_k, fused_mtp):
        spec = GraphSpec(kind, k=k, n_slots=max_batch + 1, max_len=max_tokens,
                         extra_ring_slots=mtp_k if cfg.is_v4 else 0, paged=paged)
        exported.append((name, kind, k, spec, export_graph(model, spec)))
    ranks = []
    for r in range(plan.world_size):
        rank_dir = out / f"rank{r}"
        graphs, weight_specs, recipes, plans, quant_map, rank_slices = {}, {}, {}, {}, {}, {}
        for name, kind, k, spec, eg in exported:
            ctx = PassContext(cfg, target, kind, (), tgt.expert_format, dense_format=tgt.dense_format,
                              fp8_stored=fp8_stored)
            gm, records = run_pipeline(eg.module(), ctx, passes=[("shard", shard_pass(plan, r)), *default_pipeline()],
                                       skip=skip)
            slices = records[0].stats.get("slices", {})
            rank_slices.update(slices)
            recipes.update(_shard_expert_recipes(model, _recipes(records), slices))
            for w, rec in slices.items():
                recipes[w] = (SHARD_RECIPE, [tuple(x) for x in rec])
            merge_quant_map(quant_map, records, name)
            merge_dense_quant_map(quant_map, records, name)
            for kind_, rec in recipes.values():  # each quantised module's slice of the unsplit stack
                if kind_ == EXPERTS_RECIPE and rec["module"] in quant_map.get("modules", {}):
                    quant_map["modules"][rec["module"]]["shard"] = rec["shard"]
            weights = lift_weights(gm)
            program = export_lifted(gm, spec, example_inputs(model, spec, torch.device("meta")), weights)
            if kind != "prefill":
                plans[name] = _plan_summary(program.module(), cfg, target, kind)
            rel = f"rank{r}/graphs/{name}.pt2"
            torch.export.save(program, str(out / rel))
            weight_specs.update({n: (tuple(t.shape), t.dtype) for n, t in weights.items()})
            graphs[name] = {"file": rel, "kind": kind, "k": k, "tokens_per_seq": spec.tokens,
                            "export_seconds": round(eg.seconds, 2), "weights": sorted(weights),
                            "passes": [_record(x) for x in records]}
        table = _write_weights(ckpt, cfg, model, weight_specs, recipes, rank_dir, progress, quant_map,
                               torch.device(convert_device or ("cuda" if torch.cuda.is_available() else "cpu")),
                               slices=rank_slices)
        for v in table.values():
            v["file"] = f"rank{r}/{v['file']}"
        ranks.append({"rank": r, "coords": list(plan.coords(r)), "graphs": graphs, "weights": table,
                      "segment_plan": plans, "quant_map": quant_map})
        if progress:
            print(f"rank {r}: {len(graphs)} graphs, {len(table)} weights")
    chat_template = _copy_tokenizer(ckpt, out, cfg)
    manifest = {
        **_manifest_head(tgt, cfg, dtype, max_tokens, max_batch, buckets, mtp_k),
        "parallel": plan.to_dict(), "ranks": ranks,
        "graphs": ranks[0]["graphs"], "segment_plan": ranks[0]["segment_plan"], "quant_map": ranks[0]["quant_map"],
        "weights": ranks[0]["weights"], "chat_template": chat_template,
        "compile_seconds": round(time.perf_counter() - t0, 2),
        "boundary_check": {"ok": None, "skipped": "sharded artifact: the padding check needs every rank running"},
    }
    if paged is not None:
        manifest["paged"] = {"block_size": paged.block_size, "n_blocks": paged.n_blocks}
    manifest["files"] = _file_table(out)
    _write_manifest(out, manifest)
    return manifest


def _check_sharded_experts(cfg: ModelConfig, plan: "ParallelPlan", fmt: str) -> None:
    """A plan whose tp cuts the quantised experts' blocks, or a format not sharded yet, fails before any work."""
    from dsv4c.convert import KERNEL_FORMAT, check_inter_split

    kfmt = KERNEL_FORMAT[fmt]
    if kfmt is None:
        return
    if kfmt == "nvfp4_w4a4":
        raise ArtifactError("--tp/--ep with --expert-format nvfp4_w4a4: its static per-layer activation scales "
                            "are not sharded yet (use nvfp4_w4a16, mxfp4_w4a16 or fp8_block)")
    if plan.tp > 1 and cfg.moe_intermediate_size:
        check_inter_split(kfmt, cfg.moe_intermediate_size, plan.tp)


def _shard_expert_recipes(model, found: dict, slices: dict) -> dict:
    """Add each quantised-experts recipe's shard: which experts and intermediate columns of the
    unsplit stack this rank holds (from the shard pass's slice of its w1), and the stack's E and I."""
    out = {}
    for w, (kind, rec) in found.items():
        if kind == EXPERTS_RECIPE:
            w1 = rec["sources"]["w1"]
            E, I, _ = get_param(model, w1[len("model."):]).shape
            cut = {d: [lo, hi] for d, lo, hi in slices.get(w1, ())}
            rec = {**rec, "shard": {"experts": cut.get(0, [0, E]), "inter": cut.get(1, [0, I]), "E": E, "I": I}}
        out[w] = (kind, rec)
    return out


def _copy_tokenizer(ckpt: Path, out: Path, cfg: ModelConfig) -> str | None:
    """Copy the tokenizer files; a checkpoint with a tokenizer but no chat template gets the built-in one for
    its family (dsv4c/chat_templates.py), written as chat_template.jinja. -> where the chat template came
    from ("checkpoint", "built-in", or None: no chat template)."""
    for name in TOKENIZER_FILES:
        if (ckpt / name).is_file():
            shutil.copyfile(ckpt / name, out / name)
    if load_chat_template(ckpt) is not None:
        return "checkpoint"
    builtin = builtin_chat_template(cfg)
    if builtin is None or not (ckpt / "tokenizer.json").is_file():
        return None
    (out / "chat_template.jinja").write_text(builtin)
    return "built-in"


def _manifest_head(tgt, cfg: ModelConfig, dtype: torch.dtype, max_tokens: int, max_batch: int, buckets,
                   mtp_k: int) -> dict:
    """The manifest entries every artifact has, single-GPU or sharded: versions, source hashes, target,
    model, dtype, limits, buckets, MTP depth."""
    return {
        "format_version": FORMAT_VERSION,
        "versions": {"dsv4c": dsv4c.__version__, "torch": torch.__version__, "triton": _triton_version()},
        "source": source_hashes(),  # sha256 of every module that built it (dsv4c/provenance.py)
        "target": tgt.to_dict(),
        "model_config": cfg.to_dict(),
        "dtype": str(dtype).replace("torch.", ""),
        "limits": {"max_tokens": max_tokens, "max_batch": max_batch, "cache_slots": max_batch + 1},
        "buckets": list(buckets if buckets is not None else tgt.buckets),
        "mtp_k": mtp_k,
    }


def rank_manifest(m: dict, rank: int) -> dict:
    """The manifest as rank `rank` of a sharded artifact sees it (its graphs, weights and segment plans)."""
    if "parallel" not in m:
        return m
    r = m["ranks"][rank]
    return {**m, "graphs": r["graphs"], "weights": r["weights"], "segment_plan": r["segment_plan"],
            "quant_map": r["quant_map"]}


def _fp8_stored(ckpt: Path, cfg: ModelConfig) -> frozenset[str]:
    reader = CheckpointReader(ckpt, cfg)
    try:
        return reader.fp8_names()
    finally:
        reader.close()


class _DenseFP8:
    """The weights of passes/quantize_dense.py's recipes: each fused or single weight's FP8 rows and
    scale rows, the members' stored bytes concatenated (no requantisation; the pass only rewrites
    weights the checkpoint stores in FP8)."""

    def __init__(self, reader: CheckpointReader, slices: dict | None = None):
        self.reader, self.sources, self._last, self.slices = reader, {}, (None, None), slices or {}

    def __call__(self, rec: dict) -> torch.Tensor:
        if self._last[0] != rec["weight"]:
            self._last = (rec["weight"], self._build(rec))
        return self._last[1][rec["field"]]

    def _build(self, rec: dict) -> dict[str, torch.Tensor]:
        from dsv4c.checkpoint import read_fp8_block

        e8m0 = rec["scale"] == "uint8"  # ue8m0 bytes (passes/quantize_dense.py: scale_dtype)
        names = [m[len("model."):] if m.startswith("model.") else m for m in rec["members"]]
        stored = [read_fp8_block(self.reader, n, torch.float8_e8m0fnu if e8m0 else torch.float32) for n in names]
        missing = [n for n, st in zip(names, stored) if st is None]
        if missing:  # the pass saw them in the headers as FP8 (ctx.fp8_stored): a changed checkpoint
            raise ArtifactError(f"{rec['weight']}: members {missing} are not stored as FP8 in {self.reader.path}")
        stored = [self._rank_slice(m, q, s) for m, (q, s) in zip(rec["members"], stored)]
        self.sources[rec["weight"]] = "checkpoint fp8 bytes"
        w_s = torch.cat([s for _, s in stored])
        return {"w_q": torch.cat([q for q, _ in stored]), "w_s": w_s.view(torch.uint8) if e8m0 else w_s}

    def _rank_slice(self, member: str, w_q: torch.Tensor, w_s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A sharded rank's slice of one member's stored FP8 rows / columns and scale tiles (unsharded: all)."""
        recipe = self.slices.get(member)
        if not recipe:
            return w_q, w_s
        try:
            return slice_fp8_block(w_q, w_s, [tuple(x) for x in recipe], name=member)
        except PlanError as e:
            raise ArtifactError(str(e)) from None

    def annotate(self, qmap: dict) -> dict:
        for name, src in self.sources.items():
            if name in qmap.get("dense", {}).get("modules", {}):
                qmap["dense"]["modules"][name]["source"] = src
        return qmap


# ---- reading --------------------------------------------------------------------------------------
def read_manifest(art: str | Path, verify: bool = True) -> dict:
    """Load and check an artifact's manifest: format version, and every file's size and sha256."""
    art = Path(art)
    path = art / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{path}: missing; {art} is not a dsv4c artifact")
    try:
        m = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path}: not valid JSON ({e})") from None
    version = m.get("format_version")
    if not isinstance(version, int):
        raise ArtifactError(f"{path}: format_version is missing")
    if version > FORMAT_VERSION:
        raise ArtifactError(f"{path}: format_version {version} is newer than this dsv4c reads ({FORMAT_VERSION}); "
                            f"upgrade dsv4c or recompile")
    if version < FORMAT_VERSION:
        raise ArtifactError(f"{path}: format_version {version} is older than this dsv4c reads ({FORMAT_VERSION}: "
                            f"its caches have another layout); recompile the checkpoint")
    for key in ("target", "model_config", "graphs", "weights", "files", "limits", "checksum"):
        if key not in m:
            raise ArtifactError(f"{path}: field {key!r} is missing")
    from dsv4c.artifact_safety import check_manifest_paths

    check_manifest_paths(art, m)  # every path stays inside the artifact folder
    if verify and manifest_checksum(m) != m["checksum"]:
        raise ArtifactError(f"{path}: checksum does not match its contents (the manifest was edited)")
    if verify:
        for rel, info in m["files"].items():
            f = art / rel
            if not f.is_file():
                raise ArtifactError(f"{f}: listed in the manifest but missing")
            if f.stat().st_size != info["size"]:
                raise ArtifactError(f"{f}: size {f.stat().st_size} != {info['size']} in the manifest")
        rels = list(m["files"])
        for rel, h in zip(rels, sha256_many([art / r for r in rels])):
            if h != m["files"][rel]["sha256"]:
                raise ArtifactError(f"{art / rel}: sha256 does not match the manifest (file changed or corrupt)")
    return m


def describe_artifact(art: str | Path) -> str:
    """`dsv4c inspect`: the manifest, readably."""
    m = read_manifest(art, verify=False)
    cfg = m["model_config"]
    lines = [f"artifact   {art}", f"format     v{m['format_version']}  (dsv4c {m['versions']['dsv4c']}, "
             f"torch {m['versions']['torch']}, triton {m['versions']['triton']})",
             f"target     {m['target']['name']} ({m['target']['device']}, capability {m['target']['capability']}); "
             f"{m['target']['status']}",
             f"model      {cfg['model_type']}, {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
             f"dtype {m['dtype']}",
             f"source     {describe_source(m)}",
             f"limits     max_tokens {m['limits']['max_tokens']}, max_batch {m['limits']['max_batch']}; "
             f"buckets {m['buckets']}; mtp k={m['mtp_k']}"]
    for kind, g in m["graphs"].items():
        changed = [p["name"] for p in g["passes"] if p["changed"]]
        lines.append(f"graph      {kind:10} {g['file']:24} tokens/seq {g['tokens_per_seq'] or 'dynamic'}, "
                     f"{len(g['weights'])} weights, passes applied: {', '.join(changed) or 'none'}")
    size = sum(f["size"] for f in m["files"].values())
    lines.append(f"files      {len(m['files'])} files, {size / 1e6:.1f} MB; {len(m['weights'])} weight tensors")
    for name, p in (m.get("segment_plan") or {}).items():
        lines.append(f"segments   {name}: {len(p['segments'])} segments, {p['boundaries']} router boundaries, "
                     f"{p['capturable']} capturable (the Session replays the capturable ones as CUDA graphs per bucket)")
    lines.append(f"quant map  {describe_quant_map(m['quant_map'])}")
    lines.append(f"dense      {describe_dense(m['quant_map'])}")
    chat = {"checkpoint": "the checkpoint's", "built-in": "dsv4c's DeepSeek-V4 template (the checkpoint has none)",
            None: "none (chat completions are refused)"}
    if "chat_template" in m:  # artifacts compiled before it do not say
        lines.append(f"chat       {chat.get(m['chat_template'], m['chat_template'])}")
    return "\n".join(lines)


def write_plan(art: str | Path, out_dir: str | Path) -> list[Path]:
    """`dsv4c inspect --plan`: the plan table and DOT per graph, plus a PNG drawn with matplotlib."""
    m = read_manifest(art, verify=False)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, p in (m.get("segment_plan") or {}).items():
        (out_dir / f"{name}.plan.txt").write_text(p["table"] + "\n")
        (out_dir / f"{name}.plan.dot").write_text(p["dot"])
        written += [out_dir / f"{name}.plan.txt", out_dir / f"{name}.plan.dot"]
        png = _draw_plan(p, out_dir / f"{name}.plan.png")
        if png:
            written.append(png)
    return written


def _draw_plan(p: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    segs = p["segments"]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(segs)), 1.8))
    for i, s in enumerate(segs):
        color = "#9ecae1" if s["capturable"] else ("#fdae6b" if s["kind"] == "dynamic" else "#d9d9d9")
        ax.add_patch(plt.Rectangle((i, 0), 0.8, 1, color=color))
        ax.text(i + 0.4, 0.5, f"{s['index']}\n{s['kind'][:3]}\n{s['ops']} ops", ha="center", va="center", fontsize=7)
        if i:
            ax.annotate("", (i, 0.5), (i - 0.2, 0.5), arrowprops={"arrowstyle": "->"})
    ax.set_xlim(-0.2, len(segs))
    ax.set_ylim(0, 1)
    ax.axis("off")
    ax.set_title("segments: blue capturable, orange router/experts (dynamic), grey static not capturable", fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
