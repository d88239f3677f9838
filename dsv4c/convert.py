"""Routed-expert weight conversion: the tensors of each expert format (issue 6, quant_formats.md).

The graph rewrite is passes/quantize_experts.py; this module produces what the rewritten graph reads:
the format tables (kernel container, capability, block alignment, scale kind), the containers built
one expert at a time from float or MXFP4 weights (`expert_tensors`, `quantize_stack`), the checkpoint
stream compile uses (`CheckpointExperts`), and nvfp4_w4a4's static activation scales.

Weights: with real weights in the graph, the pass has them converted now (`quantize_stack`: tests,
`dsv4c compare`). On the meta device (`dsv4c compile`) the pass creates meta tensors of the shapes
`field_specs` gives and records a *recipe* per new weight; compile streams the checkpoint through
`CheckpointExperts`, one layer's experts at a time and one expert at a time inside it. MXFP4
checkpoint experts convert without loss where quant_formats.md §6 says (to mxfp4: the same bytes; to
nvfp4: §6.1; to fp8_block: §6.2); an expert whose conversion would change a value is quantised from
its dequantised values.

W4A4 activation global scales (nvfp4_w4a4 only): every layer gets STATIC fp32 [1] global scales
g = amax/(6*448) for x (input_scale_13) and h (input_scale_2), so a row's W4A4 result never depends
on the other rows of the batch (a dynamic batch amax made MTP verify, 1+k rows per sequence, quantise
differently from decode, and speculative greedy differed from plain greedy). Sources, first found:
  1. "checkpoint": the checkpoint's ModelOpt `input_scale` of every expert of the layer (x: the max
     over the experts' w1 and w3, h: over w2; one global per layer is what the kernels take);
  2. "calibration": an eager fp32 forward of the unquantised model (main layers and the MTP block) on
     CALIBRATION's seeded random tokens records each layer's amax of x and of h (before quantisation);
     the scale covers ACT_MARGIN x that amax, capped at the bound below. Only for checkpoints up to
     CALIBRATION_LIMIT_BYTES (the eager model is loaded on the CPU); compile only, when weights stream;
  3. "bound": `activation_bounds`, from the weights alone (the ffn norm weight, the SwiGLU clamp, the
     routing scale): a true upper bound, so nothing clips; used for bigger checkpoints and when the pass
     runs on in-memory weights (tests, `dsv4c compare`) unless `quantize_experts_as(..., act_amax=)`.
A larger g than the batch amax costs little: block scales are e4m3 relative to g and stay normal for
blocks down to margin/28672 of g's range. The quant map records the source and the values.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch


# target expert format -> container format of kernels/moe_grouped.py (None: leave the op alone)
KERNEL_FORMAT: dict[str, str | None] = {
    "reference": None, "bf16": "bf16", "fp8_block": "fp8_block", "mxfp4_w4a16": "mxfp4",
    "nvfp4_w4a16": "nvfp4", "nvfp4_w4a4": "nvfp4_w4a4",
}
# the minimum CUDA capability a format's kernels need on a GPU
FORMAT_CAPABILITY: dict[str, tuple[int, int]] = {
    "bf16": (8, 0), "fp8_block": (8, 9), "mxfp4_w4a16": (8, 0), "nvfp4_w4a16": (8, 0), "nvfp4_w4a4": (10, 0),
}
# D and I must be multiples of this (else zero-padded)
ALIGN = {"bf16": 1, "fp8_block": 128, "mxfp4": 32, "nvfp4": 16, "nvfp4_w4a4": 16}
SCALE_KIND = {
    "bf16": "none",
    "fp8_block": "e4m3 weights, fp32 (power-of-two) scale per 128x128 tile; W8A8: x and h e4m3 per 1x128, ue8m0",
    "mxfp4": "e2m1 weights, ue8m0 scale per 32 input columns; weight-only (bf16 activations)",
    "nvfp4": "e2m1 weights, e4m3 scale per 16 input columns + fp32 global per expert (w1/w3 share it); "
             "weight-only (bf16 activations)",
    "nvfp4_w4a4": "e2m1 weights, e4m3 scale per 16 + fp32 global per expert (w1/w3 share it); W4A4: x and h "
                  "NVFP4 per 16 with a static per-layer global scale amax/(6*448) (checkpoint, calibration or "
                  "bound)",
}
FIELDS = ("w13", "w13_scale", "w13_global", "w2", "w2_scale", "w2_global")
ACT_FIELDS = ("input_scale_13", "input_scale_2")  # nvfp4_w4a4's static activation global scales
RECIPE = "experts_q"  # the recipe kind compile.py streams
ACT_MARGIN = 4.0  # calibrated amax x this (random calibration tokens gave up to 1.7x less h amax than text)
CALIBRATION = {"seed": 0, "batch": 4, "tokens": 64}
CALIBRATION_LIMIT_BYTES = 1 << 30  # calibrate only checkpoints whose files fit comfortably in CPU memory
_SILU_MIN = 0.2785  # |min silu| = 0.27846..
_BF16_ROUND = 1 + 2 ** -8  # the bf16 cast of x may round its amax up by this



class QuantizeError(ValueError):
    """An expert format the target cannot use; the message names the capability needed."""


def check_format(target) -> None:
    """Raise QuantizeError if `target.expert_format` is unknown or needs a newer GPU than the target's."""
    fmt = target.expert_format
    if fmt not in KERNEL_FORMAT:
        raise QuantizeError(f"target {target.name}: unknown expert_format {fmt!r}; expected one of {sorted(KERNEL_FORMAT)}")
    need = FORMAT_CAPABILITY.get(fmt)
    if target.device == "cuda" and need is not None and tuple(target.capability or (0, 0)) < need:
        have = target.capability or (0, 0)
        raise QuantizeError(f"target {target.name}: expert_format {fmt} needs CUDA compute capability "
                            f"{need[0]}.{need[1]}+ (sm_{need[0]}{need[1]}), the target declares {have[0]}.{have[1]}; "
                            f"choose nvfp4_w4a16, mxfp4_w4a16 or fp8_block")


def field_specs(kfmt: str, e: int, i: int, d: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of each container field for E experts of width I on hidden D (padded dims)."""
    if kfmt == "bf16":
        return {"w13": ((e, 2 * i, d), torch.bfloat16), "w2": ((e, d, i), torch.bfloat16)}
    if kfmt == "fp8_block":
        f8 = torch.float8_e4m3fn
        return {"w13": ((e, 2 * i, d), f8), "w13_scale": ((e, 2 * i // 128, d // 128), torch.float32),
                "w2": ((e, d, i), f8), "w2_scale": ((e, d // 128, i // 128), torch.float32)}
    if kfmt == "mxfp4":  # ue8m0 scales travel as their bytes: torch 2.11's export serialiser has no e8m0 dtype
        s = torch.uint8
        return {"w13": ((e, 2 * i, d // 2), torch.uint8), "w13_scale": ((e, 2 * i, d // 32), s),
                "w2": ((e, d, i // 2), torch.uint8), "w2_scale": ((e, d, i // 32), s)}
    s = torch.float8_e4m3fn
    return {"w13": ((e, 2 * i, d // 2), torch.uint8), "w13_scale": ((e, 2 * i, d // 16), s),
            "w13_global": ((e,), torch.float32), "w2": ((e, d, i // 2), torch.uint8),
            "w2_scale": ((e, d, i // 16), s), "w2_global": ((e,), torch.float32)}


def padded(n: int, a: int) -> int:
    """`n` rounded up to a multiple of `a` (the format's block)."""
    return -(-n // a) * a


# ---- building the quantised tensors -----------------------------------------------------------
def _pad_float(w1, w3, w2, ip: int, dp: int):
    """Zero-pad fp32 w1/w3 [E, I, D] -> [E, Ip, Dp] and w2 [E, D, I] -> [E, Dp, Ip]."""
    pad = torch.nn.functional.pad
    i, d = w1.shape[-2], w1.shape[-1]
    return (pad(w1.float(), (0, dp - d, 0, ip - i)), pad(w3.float(), (0, dp - d, 0, ip - i)),
            pad(w2.float(), (0, ip - i, 0, dp - d)))


def quantize_float(kfmt: str, w1, w3, w2, ip: int, dp: int):
    """Container of format `kfmt` from float weights (zero-padded to Ip, Dp first)."""
    from dsv4c.kernels.moe_grouped import _CONTAINERS

    return _CONTAINERS[kfmt].from_float(*_pad_float(w1, w3, w2, ip, dp))


VIA_MXFP4 = ("nvfp4", "nvfp4_w4a4", "fp8_block")  # formats with a lossless conversion from MXFP4


def exact_via_mxfp4(kfmt: str, w1, w3, w2, ip: int, dp: int):
    """Float weights whose values are exactly MXFP4 (the release values, e.g. an eager model loaded
    from a release checkpoint, or rounded to it) -> the lossless conversion compile applies to the
    checkpoint's MXFP4 bytes, so in-memory quantisation (`dsv4c compare`, tests) gives the artifact's
    values: quantising them from float instead cost NVFP4 ~20 dB (issue 22). None when the weights are
    not exactly MXFP4 (then they are quantised from float), the conversion would change a value, or
    the padded dims are not multiples of 32."""
    if ip % 32 or dp % 32:
        return None
    p1, p3, p2 = _pad_float(w1, w3, w2, ip, dp)
    from dsv4c.kernels.moe_grouped import Mxfp4Experts

    mx = Mxfp4Experts.from_float(p1, p3, p2)
    if not all(torch.equal(a, b) for a, b in zip(mx.dequantize(), (p1, p3, p2))):
        return None
    return convert_mxfp4(kfmt, mx)


def convert_mxfp4(kfmt: str, mx):
    """Lossless conversion of an Mxfp4Experts container (None if a value would change or the format
    has no exact conversion)."""
    from dsv4c.kernels.moe_grouped import (
        Fp8BlockExperts,
        Nvfp4Experts,
        Nvfp4W4A4Experts,
    )

    try:
        if kfmt == "mxfp4":
            return mx
        if kfmt in ("nvfp4", "nvfp4_w4a4"):
            nv = Nvfp4Experts.from_mxfp4(mx)
            return nv if kfmt == "nvfp4" else Nvfp4W4A4Experts(*(getattr(nv, f) for f in FIELDS))
        if kfmt == "fp8_block":
            return Fp8BlockExperts.from_mxfp4(mx)
    except ValueError:  # lossy here, or shapes the conversion does not take
        return None
    return None


def _stack(containers: list) -> dict[str, torch.Tensor]:
    out = {}
    for f in FIELDS:
        vals = [getattr(c, f, None) for c in containers]
        if vals[0] is not None:
            t = torch.cat(vals, 0).contiguous()
            out[f] = t.view(torch.uint8) if t.dtype == torch.float8_e8m0fnu else t  # see field_specs
    return out


def _on(c, device: torch.device):
    """The container `c` with every tensor field moved to `device`."""
    moved = {f.name: getattr(c, f.name) for f in dataclasses.fields(c)}
    return type(c)(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()})


def expert_tensors(kfmt: str, n_experts: int, read: Callable[[int], tuple], ip: int, dp: int,
                   device: str | torch.device = "cpu", out_device: str | torch.device = "cpu") -> tuple[dict, int]:
    """Build the stacked fields on `out_device` one expert at a time. `read(e)` gives ("float", w1,
    w3, w2) or ("mxfp4", w1, s1, w3, s3, w2, s2) for expert e (2-d checkpoint tensors). Each
    expert is converted on `device` (a GPU converts a Flash layer in a second; the same arithmetic,
    so the same bytes). Returns (fields, the number of experts quantised from dequantised values
    although the source was MXFP4)."""
    from dsv4c.kernels.moe_grouped import Mxfp4Experts

    device, out_device = torch.device(device), torch.device(out_device)
    parts, requant = [], 0
    for e in range(n_experts):
        src = read(e)
        src = (src[0], *(t.to(device) for t in src[1:]))
        c = None
        if src[0] == "mxfp4":
            w1, s1, w3, s3, w2, s2 = (t.unsqueeze(0) for t in src[1:])
            mx = Mxfp4Experts.from_checkpoint(w1, s1, w3, s3, w2, s2)
            _, i, d = mx.dims
            c = convert_mxfp4(kfmt, mx) if (i, d) == (ip, dp) else None
            if c is None:
                requant += 1
                c = quantize_float(kfmt, *mx.dequantize(), ip, dp)
        else:
            w = tuple(t.unsqueeze(0) for t in src[1:])
            c = exact_via_mxfp4(kfmt, *w, ip, dp) if kfmt in VIA_MXFP4 else None
            c = c if c is not None else quantize_float(kfmt, *w, ip, dp)
        parts.append(c if device == out_device else _on(c, out_device))
    return _stack(parts), requant


# Where the intermediate dim I sits in each container field: (dim, I per index along that dim, halves).
# w13 holds W1's rows then W3's (two halves of padded I each); fp4 fields pack two values per byte.
_INTER_LAYOUT: dict[str, dict[str, tuple[int, int, bool]]] = {
    "bf16": {"w13": (1, 1, True), "w2": (2, 1, False)},
    "fp8_block": {"w13": (1, 1, True), "w13_scale": (1, 128, True), "w2": (2, 1, False), "w2_scale": (2, 128, False)},
    "mxfp4": {"w13": (1, 1, True), "w13_scale": (1, 1, True), "w2": (2, 2, False), "w2_scale": (2, 32, False)},
    "nvfp4": {"w13": (1, 1, True), "w13_scale": (1, 1, True), "w2": (2, 2, False), "w2_scale": (2, 16, False)},
}


def check_inter_split(kfmt: str, inter: int, parts: int) -> None:
    """Raise PlanError("tp") unless I = `inter` splits `parts` ways on the format's block boundaries:
    then every rank's columns are whole blocks of the unsplit container (`shard_inter`), so a sharded
    artifact holds the single-GPU artifact's bytes (a block straddling two ranks would need its own
    scale on each, and nvfp4's per-expert global scale of half an expert is another number)."""
    from dsv4c.parallel import PlanError

    a = ALIGN[kfmt]
    if inter % parts or (inter // parts) % a:
        raise PlanError("tp", f"routed experts: moe_intermediate_size {inter} split over tp = {parts} gives "
                            f"{inter / parts:g} columns per rank, not a multiple of {kfmt}'s block of {a}; "
                            f"use a smaller tp, more ep, or another --expert-format")


def shard_inter(kfmt: str, fields: dict[str, torch.Tensor], ip: int, lo: int, hi: int) -> dict[str, torch.Tensor]:
    """Columns [lo, hi) of the intermediate dim of stacked container fields built over the whole
    (padded) I = `ip`: W1's and W3's rows of w13 (and their scale rows or tiles), w2's input columns
    (and their scale groups); per-expert global scales unchanged. `lo` and `hi` are multiples of the
    format's block (`check_inter_split`), so each piece is a whole block with its own scale:
    the result is the container that slice of I has in the unsplit artifact, byte for byte."""
    layout = _INTER_LAYOUT[kfmt]
    out = {}
    for f, t in fields.items():
        if f not in layout:
            out[f] = t
            continue
        dim, unit, halves = layout[f]
        a, b, half = lo // unit, hi // unit, ip // unit
        parts = [t.narrow(dim, off + a, b - a) for off in ((0, half) if halves else (0,))]
        out[f] = torch.cat(parts, dim).contiguous()
    return out


def checkpoint_reader_fn(reader, names: dict[str, str]) -> Callable[[int], tuple]:
    """`read(e)` over a CheckpointReader for the stacked experts `names` {"w1", "w3", "w2":
    graph name, "model.<canonical name>"}: the raw MXFP4 codes and scales when the checkpoint stores
    them, else dequantised fp32."""
    from dsv4c.checkpoint import _load_weight, _scale_name
    from dsv4c.names import expert_disk_name

    canon = {k: v.removeprefix("model.") for k, v in names.items()}

    def read(e: int) -> tuple:
        disk = {k: expert_disk_name(v, e) for k, v in canon.items()}
        raw = {k: reader.get(n) for k, n in disk.items()}
        if all(t.dtype in (torch.int8, torch.uint8) for t in raw.values()):
            sc = {k: reader.get(_scale_name(reader, n)) for k, n in disk.items()}
            return ("mxfp4", raw["w1"], sc["w1"], raw["w3"], sc["w3"], raw["w2"], sc["w2"])
        vals = []
        for k in ("w1", "w3", "w2"):
            t = raw[k]
            shape = tuple(t.shape) if t.dtype not in (torch.int8, torch.uint8) else (t.shape[0], t.shape[1] * 2)
            vals.append(_load_weight(reader, disk[k], shape, torch.float32, set()))
        return ("float", *vals)

    return read


# ---- W4A4 static activation global scales -----------------------------------------------------
def act_global(amax: float) -> torch.Tensor:
    """NVFP4 activation global scale fp32 [1] = amax/(6*448) (the ModelOpt `input_scale`)."""
    from dsv4c.quant import E2M1_MAX, E4M3_MAX

    return torch.tensor([max(float(amax), 1e-30) / (E2M1_MAX * E4M3_MAX)], dtype=torch.float32)


def norm_weight_name(module: str) -> str:
    """The RMSNorm weight that makes the experts' input, from the experts' name (graph or canonical):
    V4 `P.ffn.experts` -> `P.ffn_norm.weight`, V3 `P.mlp.experts` -> `P.post_attention_layernorm.weight`."""
    for moe, norm in ((".ffn.experts", ".ffn_norm.weight"), (".mlp.experts", ".post_attention_layernorm.weight")):
        if module.endswith(moe):
            return module[: -len(moe)] + norm
    raise QuantizeError(f"{module}: no known RMSNorm feeds these experts (expected a name ending in "
                        f".ffn.experts or .mlp.experts)")


def _row_l1_max(w: torch.Tensor) -> float:
    return float(w.float().abs().sum(-1).max()) if w.numel() else 0.0


def activation_bounds(cfg, norm_weight: torch.Tensor, limit: float,
                      row_l1: Callable[[], tuple[float, float]]) -> tuple[float, float]:
    """Upper bounds of |x| and |h| of one MoE layer from weights alone.
    x is an RMSNorm output: |x_i| = |w_i| |u_i| / sqrt(mean(u^2) + eps) <= sqrt(D) |w_i| (times the bf16
    cast's rounding). h = silu(min(g, L)) * clamp(v, -L, L) * r, with routing weight r <= the routing scale
    (normalised top-k, or sigmoid scores <= 1): |h| <= max(L, 0.2785) * L * scale for L > 0; without a
    clamp |g| <= max row L1 norm of W1 * bound(x) (likewise v and W3) and |silu(g)| <= |g|; `row_l1()`
    gives those two norms (read only then)."""
    d = norm_weight.numel()
    bx = d ** 0.5 * float(norm_weight.float().abs().max()) * _BF16_ROUND
    r = float(cfg.routed_scaling_factor)
    if limit > 0:
        return bx, max(limit, _SILU_MIN) * limit * r
    l1, l3 = row_l1()
    return bx, (l1 * bx) * (l3 * bx) * r


class _MoeAmax:
    """Records amax(x) and amax(h) of every dsv4c.moe_experts call, by experts module (`names`: the
    data_ptr of each stacked w1 -> its module name); h as the kernels form it, before quantisation."""

    def __init__(self, names: dict[int, str]):
        self.names = names
        self.amax: dict[str, list[float]] = {}

    def __call__(self, x, idx, w, w1, w3, w2, limit) -> None:
        xf = x.float()
        rows = torch.arange(x.shape[0]).repeat_interleave(idx.shape[1])          # [N_A]
        flat = idx.reshape(-1).long()
        g = torch.einsum("nd,nid->ni", xf[rows], w1[flat].float())               # [N_A, I]
        v = torch.einsum("nd,nid->ni", xf[rows], w3[flat].float())
        if limit > 0:
            g, v = g.clamp(max=limit), v.clamp(-limit, limit)
        h = torch.nn.functional.silu(g) * v * w.reshape(-1, 1).float()
        a = self.amax.setdefault(self.names[w1.data_ptr()], [0.0, 0.0])
        a[0] = max(a[0], float(xf.abs().max()) if xf.numel() else 0.0)
        a[1] = max(a[1], float(h.abs().max()) if h.numel() else 0.0)


@torch.no_grad()
def calibrate_activations(model, seed: int = CALIBRATION["seed"], batch: int = CALIBRATION["batch"],
                          tokens: int = CALIBRATION["tokens"]) -> dict[str, tuple[float, float]]:
    """{graph module name ("model." + the eager experts module): (amax x, amax h)} from an eager forward
    of `model` (unquantised) on `batch` x `tokens` seeded random tokens, then its MTP block on the
    main model's output at t and the token at t+1 (as the drafts see it)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from dsv4c.model import register_ops
    from dsv4c.names import is_stacked

    register_ops()
    cfg = model.config
    ops = (torch.ops.dsv4c.moe_experts.default, torch.ops.dsv4c.moe_experts_gathered.default)
    names = {p.data_ptr(): "model." + n.rsplit(".", 1)[0] for n, p in model.named_parameters()
             if is_stacked(n) and n.endswith((".w1", ".gate_proj"))}
    rec = _MoeAmax(names)

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in ops:
                rec(*args)
            return func(*args, **(kwargs or {}))

    ids = torch.randint(0, cfg.vocab_size, (batch, tokens), generator=torch.Generator().manual_seed(seed))
    ids = ids.to(next(model.parameters()).device)
    with Mode():
        if cfg.is_v4:
            _, hidden = model.forward_with_streams(ids)
        else:
            _, hidden = model.forward_with_hidden(ids)
        if cfg.num_nextn_predict_layers and tokens > 1:
            model.mtp_forward(hidden[:, :-1], ids[:, 1:], model.new_mtp_cache(batch, max_len=tokens))
    return {k: (a[0], a[1]) for k, a in rec.amax.items()}


def checkpoint_input_scales(reader, sources: dict[str, str], n_experts: int) -> tuple[float, float] | None:
    """(x, h) activation global scales from the checkpoint's ModelOpt `input_scale` tensors
    (`...experts.{e}.w1.input_scale`, one per expert and projection): the max over the experts' w1/w3
    for x and over w2 for h. None unless every expert has all three."""
    from dsv4c.names import expert_disk_name

    canon = {k: v.removeprefix("model.") for k, v in sources.items()}
    vals: dict[str, list[float]] = {"w1": [], "w3": [], "w2": []}
    for e in range(n_experts):
        for k, v in canon.items():
            name = expert_disk_name(v, e).removesuffix(".weight") + ".input_scale"
            if name not in reader:
                return None
            t = reader.get(name).float()
            if t.numel() != 1 or not bool(torch.isfinite(t).all()) or float(t) <= 0:
                raise QuantizeError(f"{name}: expected one finite positive fp32 activation scale, got "
                                    f"{tuple(t.shape)} {t.flatten()[:4].tolist()}")
            vals[k].append(float(t))
    return max(vals["w1"] + vals["w3"]), max(vals["w2"])


def activation_record(source: str, x: float, h: float, **extra) -> dict:
    """One layer's static scales: the two global scales (g = covered amax / (6*448)) and how they came."""
    gx, gh = act_global(x), act_global(h)
    return {"source": source, "input_scale_13": float(gx), "input_scale_2": float(gh),
            "covered_amax": {"x": x, "h": h}, **extra}


def _combine(amax: tuple[float, float] | None, bound: tuple[float, float], source: str) -> dict:
    """Calibrated amax x ACT_MARGIN capped at the bound, or the bound alone."""
    if amax is None:
        return activation_record("bound", *bound, bound={"x": bound[0], "h": bound[1]})
    cover = tuple(min(ACT_MARGIN * a, b) for a, b in zip(amax, bound))
    return activation_record(source, *cover, calibrated_amax={"x": amax[0], "h": amax[1]}, margin=ACT_MARGIN,
                             bound={"x": bound[0], "h": bound[1]},
                             **({"calibration": dict(CALIBRATION)} if source == "calibration" else {}))


class CheckpointExperts:
    """Compile-time weight source for the recipes: builds one layer's quantised experts when one of
    its fields is asked for and keeps only that layer (the fields of a layer are adjacent in the
    sorted weight list, so each layer is built once). W4A4 activation scales (ACT_FIELDS) come from
    `activation(recipe)`; `activation_scales` keeps each layer's record for the manifest."""

    def __init__(self, reader, device: str | torch.device = "cpu"):
        self.reader = reader
        self.device = torch.device(device)
        self._key = None
        self._fields: dict[str, torch.Tensor] = {}
        self.requantised: dict[str, int] = {}
        self.activation_scales: dict[str, dict] = {}
        self._calibrated: dict[str, tuple[float, float]] | None = None

    def __call__(self, recipe: dict) -> torch.Tensor:
        key = recipe["module"]
        if recipe["field"] in ACT_FIELDS:
            return torch.tensor([self.activation(recipe)[recipe["field"]]], dtype=torch.float32)
        if key != self._key:
            self._fields = {}
            self._fields, n = self._build(recipe)
            self.requantised[key] = n
            self._key = key
        return self._fields[recipe["field"]]

    def _build(self, recipe: dict) -> tuple[dict, int]:
        """The layer's fields; a sharded artifact's recipe carries `shard` {"experts": [e0, e1], "inter":
        [lo, hi], "E", "I"} (passes/shard.py's slice of the unquantised stack): experts e0..e1-1 are
        built over their whole I, exactly as the single-GPU artifact builds them, then cut to [lo, hi)."""
        kfmt, read = recipe["kernel_format"], checkpoint_reader_fn(self.reader, recipe["sources"])
        shard = recipe.get("shard")
        if shard is None:
            return expert_tensors(kfmt, recipe["experts"], read, recipe["padded"]["I"], recipe["padded"]["D"],
                                  self.device)
        (e0, e1), (lo, hi) = shard["experts"], shard["inter"]
        ip = padded(shard["I"], ALIGN[kfmt])
        fields, n = expert_tensors(kfmt, e1 - e0, lambda j: read(e0 + j), ip, recipe["padded"]["D"], self.device)
        if (lo, hi) != (0, shard["I"]):
            fields = shard_inter(kfmt, fields, ip, lo, hi)
        return fields, n

    def activation(self, recipe: dict) -> dict:
        """The layer's static W4A4 scales: checkpoint input_scale, else calibration (small checkpoints),
        else the weight bound (module docstring)."""
        key = recipe["module"]
        if key in self.activation_scales:
            return self.activation_scales[key]
        found = checkpoint_input_scales(self.reader, recipe["sources"], recipe["experts"])
        if found is not None:
            from dsv4c.quant import E2M1_MAX, E4M3_MAX

            rec = {"source": "checkpoint", "input_scale_13": found[0], "input_scale_2": found[1],
                   "covered_amax": {"x": found[0] * E2M1_MAX * E4M3_MAX, "h": found[1] * E2M1_MAX * E4M3_MAX}}
        else:
            rec = _combine(self._calibration().get(key), self._bound(recipe), "calibration")
        self.activation_scales[key] = rec
        return rec

    def _bound(self, recipe: dict) -> tuple[float, float]:
        from dsv4c.checkpoint import read_param

        cfg, d = self.reader.cfg, recipe["dims"]["D"]
        norm = read_param(self.reader, norm_weight_name(recipe["module"]).removeprefix("model."), (d,), torch.float32)

        def row_l1() -> tuple[float, float]:
            read = checkpoint_reader_fn(self.reader, recipe["sources"])
            l1 = l3 = 0.0
            for e in range(recipe["experts"]):
                src = read(e)
                if src[0] == "mxfp4":
                    from dsv4c.kernels.moe_grouped import Mxfp4Experts

                    w1, w3, _ = Mxfp4Experts.from_checkpoint(*(t.unsqueeze(0) for t in src[1:])).dequantize()
                else:
                    w1, w3 = src[1], src[2]
                l1, l3 = max(l1, _row_l1_max(w1)), max(l3, _row_l1_max(w3))
            return l1, l3

        return activation_bounds(cfg, norm, recipe["limit"], row_l1)

    def _calibration(self) -> dict[str, tuple[float, float]]:
        if self._calibrated is None:
            files = {e.file for e in self.reader.entries.values()}
            size = sum(f.stat().st_size for f in files)
            self._calibrated = {}
            if size <= CALIBRATION_LIMIT_BYTES:
                from dsv4c.checkpoint import load_model

                model = load_model(self.reader.path, device="cpu", dtype=torch.float32).eval()
                self._calibrated = calibrate_activations(model)
                del model
        return self._calibrated

    def annotate(self, qmap: dict) -> dict:
        """Write each layer's activation-scale record into the artifact quant map's modules."""
        for module, rec in self.activation_scales.items():
            if module in qmap.get("modules", {}):
                qmap["modules"][module]["activation_scales"] = rec
        return qmap


# ---- in-memory weights (the pass on a graph that holds them) ----------------------------------
def quantize_stack(kfmt: str, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, ip: int, dp: int) -> dict:
    """The container fields of stacked float experts w1/w3 [E, I, D], w2 [E, D, I], one expert at a time
    as compile streams them (no fp32 copy of a whole stack), converted where the weights are and kept
    there; checked against `field_specs`, which the streamed (compile) path relies on."""
    specs = field_specs(kfmt, w1.shape[0], ip, dp)
    fields, _ = expert_tensors(kfmt, w1.shape[0], lambda j: ("float", w1[j].detach(), w3[j].detach(), w2[j].detach()),
                               ip, dp, device=w1.device, out_device=w1.device)
    out = {f: fields[f] for f in specs}
    for f, (s, dt) in specs.items():
        assert tuple(out[f].shape) == s and out[f].dtype == dt, (f, out[f].shape, out[f].dtype, s, dt)
    return out


def given_activation_record(cfg, module: str, norm: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, limit: float,
                            act_amax: dict | None) -> dict:
    """nvfp4_w4a4's static scales for in-memory weights: `act_amax[module]` x ACT_MARGIN capped at the
    weight bound, else the bound (module docstring)."""
    bound = activation_bounds(cfg, norm.detach(), limit, lambda: (_row_l1_max(w1.detach()), _row_l1_max(w3.detach())))
    return _combine((act_amax or {}).get(module), bound, "given")
