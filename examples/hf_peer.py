"""HF transformers' DeepseekV4 as a peer of the dsv4c ladder (examples/compare_passes.py).

The bundled checkpoint is loaded by dsv4c (`load_model`, which dequantises FP8/FP4 weights to fp32), its
tensors are renamed to HF's in-memory names (dsv4c/names.py: `v4_official_to_hf`), and copied into
`DeepseekV4ForCausalLM` built from the same config. Every HF tensor must receive a value and every
checkpoint tensor must land somewhere, apart from DOCUMENTED_DROPS; HF's random init (zeroed sinks,
biases, `tid2eid`) would otherwise go unnoticed. tests/oracle.py builds the same HF model for the parity
tests (random weights); this module adds the dtype handling and the measurements the ladder needs.

`unavailable_reason()` says why no peer row can be built (transformers missing, no DeepseekV4);
any later failure is reported by the caller as a "not available: <reason>" row.
Legend: B batch rows, L prompt tokens, W window tokens, V vocab, E experts, I expert width, D hidden.
"""
from __future__ import annotations

import re
import time

import torch

# checkpoint tensors HF's model has no place for, with the reason (everything else must map)
DOCUMENTED_DROPS = {"mtp.": "the MTP block: HF's DeepseekV4ForCausalLM has no multi-token-prediction module"}


class PeerError(RuntimeError):
    """The checkpoint cannot be put into HF's model (a name or shape mismatch); the message says which."""


def unavailable_reason() -> str | None:
    """None when transformers with DeepseekV4 imports, else why not."""
    try:
        import transformers
    except ImportError as e:
        return f"transformers is not installed ({e})"
    try:
        from transformers import DeepseekV4Config, DeepseekV4ForCausalLM  # noqa: F401
    except ImportError:
        return f"transformers {transformers.__version__} has no DeepseekV4ForCausalLM"
    return None


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def hf_state_dict(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """`dsv4c.names.v4_to_hf_state_dict` dropping DOCUMENTED_DROPS; a name HF lacks raises PeerError."""
    from dsv4c.names import v4_to_hf_state_dict

    try:
        return v4_to_hf_state_dict(sd, tuple(DOCUMENTED_DROPS))
    except KeyError as e:
        raise PeerError(e.args[0]) from None


def hf_config(cfg):
    """DeepseekV4Config for a dsv4c ModelConfig; eager attention; no quantization_config (the weights
    arrive dequantised, and HF's FP8 quantizer must not rewrite the modules)."""
    from transformers import DeepseekV4Config

    d = {k: v for k, v in cfg.to_hf_dict().items() if k not in ("quantization_config", "expert_dtype")}
    hc = DeepseekV4Config(**d)
    hc._attn_implementation = "eager"
    return hc


def build(model, device: str | torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, dict]:
    """HF DeepseekV4ForCausalLM holding exactly `model`'s main-model weights, on `device` in `dtype`.
    Below fp32 it first keeps HF's `_keep_in_fp32_modules_strict` in fp32, as `from_pretrained(dtype=...)`
    does; when that model fails a short forward + generate on `device` (transformers 5.17's norms hand
    fp32 activations to bf16 linears), it casts everything to `dtype` and records why.
    -> (model, info). Raises PeerError on any name, shape or value mismatch."""
    hf, info = _build_fp32(model)
    if dtype == torch.float32:
        return hf.to(device), {**info, "dtype": "float32", "cast": "fp32"}
    fp32_sd = {n: t.clone() for n, t in hf.state_dict().items()}
    info["dtype"] = str(dtype).replace("torch.", "")
    try:
        info["kept_fp32"] = cast_(hf, dtype, keep_hf_fp32=True)
        hf.to(device)
        _smoke(hf)
        info["cast"] = f"{info['dtype']}, HF's fp32 modules kept ({info['kept_fp32']} tensors)"
        return hf, info
    except RuntimeError as e:
        why = " ".join(str(e).split())[:160]
    hf = hf.to("cpu").float()
    hf.load_state_dict(fp32_sd, strict=True)
    info["kept_fp32"] = cast_(hf, dtype, keep_hf_fp32=False)
    hf.to(device)
    _smoke(hf)
    info["cast"] = f"all {info['dtype']} (with HF's fp32 modules kept it fails: {why})"
    return hf, info


def _build_fp32(model) -> tuple[torch.nn.Module, dict]:
    from transformers import DeepseekV4ForCausalLM

    hf = DeepseekV4ForCausalLM(hf_config(model.config)).float().eval()
    return hf, _load_checked(hf, model)


def build_direct(model, dtype: torch.dtype,
                 device: str | torch.device | None = None) -> tuple[torch.nn.Module, dict]:
    """`build` for models whose fp32 copy does not fit the host (the Flash slice: `build` stages the model in
    fp32 on the CPU, and a second fp32 copy to fall back on): HF's model is made on `device` (default:
    `model`'s) in `dtype` (HF's strict-fp32 modules then cast to fp32, as `from_pretrained(dtype=...)` keeps
    them), loaded from `model`'s tensors one at a time and checked as `build` does. When that fails the smoke
    test, every tensor is cast to `dtype` (exact: the fp32 modules hold values of `model`'s dtype) and the
    reason recorded. For a model that does not fit the GPU twice (the Flash slice on an H100) the caller moves
    it to the CPU and passes the GPU as `device`: the load copies tensor by tensor, so the GPU holds one copy."""
    from transformers import DeepseekV4ForCausalLM

    dev = torch.device(device) if device is not None else next(model.parameters()).device
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            hf = DeepseekV4ForCausalLM(hf_config(model.config)).eval()
    finally:
        torch.set_default_dtype(prev)
    kept = _upcast_kept(hf) if dtype != torch.float32 else 0
    info = {**_load_checked(hf, model), "dtype": str(dtype).replace("torch.", ""), "kept_fp32": kept}
    try:
        _smoke(hf)
        info["cast"] = f"{info['dtype']}, HF's fp32 modules kept ({kept} tensors)" if kept else info["dtype"]
    except RuntimeError as e:
        why = " ".join(str(e).split())[:160]
        info["kept_fp32"] = cast_(hf, dtype, keep_hf_fp32=False)
        _smoke(hf)
        info["cast"] = f"all {info['dtype']} (with HF's fp32 modules kept it fails: {why})"
    return hf, info


def _load_checked(hf: torch.nn.Module, model) -> dict:
    """Copy `model`'s tensors (renamed to HF's) into `hf`: every HF tensor must get one and every checkpoint
    tensor must land (DOCUMENTED_DROPS aside), shapes equal, and each value must arrive (compared in HF's
    dtype). Raises PeerError. -> counts for the peer row."""
    mapped, dropped = hf_state_dict({k: v.detach() for k, v in model.state_dict().items()})
    target = hf.state_dict()
    missing, unexpected = sorted(set(target) - set(mapped)), sorted(set(mapped) - set(target))
    if missing or unexpected:
        raise PeerError(f"HF tensors without a checkpoint value: {missing[:6]}; checkpoint tensors HF lacks: "
                        f"{unexpected[:6]}")
    bad = [f"{n}: HF {tuple(target[n].shape)} vs {tuple(t.shape)}" for n, t in mapped.items()
           if target[n].shape != t.shape]
    if bad:
        raise PeerError(f"shape mismatch: {bad[:4]}")
    with torch.no_grad():  # tensor by tensor (copy_ casts and moves): no second copy of the model at once
        for n, t in mapped.items():
            target[n].copy_(t)
    for n, t in hf.state_dict().items():  # every HF tensor now holds the checkpoint's value
        if not torch.equal(t, mapped[n].to(device=t.device, dtype=t.dtype)):
            raise PeerError(f"{n}: the value did not arrive in HF's model")
    return {"tensors": len(mapped), "dropped": len(dropped), "dropped_why": list(DOCUMENTED_DROPS.values())}


def _upcast_kept(hf: torch.nn.Module) -> int:
    """HF's strict-fp32 modules' floating tensors to fp32; -> how many."""
    pat = _kept_pattern(hf)
    kept = [t for name, t in _floating(hf) if pat is not None and pat.search(name)]
    with torch.no_grad():
        for t in kept:
            t.data = t.data.float()
    return len(kept)


def _floating(hf: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(name, t) for name, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_floating_point()]


def _kept_pattern(hf: torch.nn.Module):
    keep = list(getattr(type(hf), "_keep_in_fp32_modules_strict", None) or [])
    return re.compile("|".join(rf"((^|\.){re.escape(k)}($|\.))" for k in keep)) if keep else None


@torch.no_grad()
def _smoke(hf) -> None:
    """A 2 x 24-token forward and a 2-token greedy generate: raises if the dtypes do not fit together."""
    dev = next(hf.parameters()).device
    ids = torch.arange(48, device=dev).reshape(2, 24) % hf.config.vocab_size
    hf(ids)
    hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, min_new_tokens=2, do_sample=False,
                pad_token_id=hf.config.eos_token_id)


def cast_(hf: torch.nn.Module, dtype: torch.dtype, keep_hf_fp32: bool) -> int:
    """Floating parameters and buffers to `dtype`, except (keep_hf_fp32) HF's strict fp32 modules;
    -> how many were kept fp32."""
    pat = _kept_pattern(hf) if keep_hf_fp32 else None
    kept = 0
    with torch.no_grad():
        for name, t in _floating(hf):
            if pat is not None and pat.search(name):
                kept += 1
            else:
                t.data = t.data.to(dtype)
    return kept


def _sync(dev) -> None:
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def window_logits(hf, windows: torch.Tensor) -> torch.Tensor:
    """One full forward per window batch: windows [n, W+1] -> logits [n, W, V] fp32 on the CPU."""
    dev = next(hf.parameters()).device
    W = windows.shape[1] - 1
    return hf(windows[:, :W].to(dev)).logits.float().cpu()


class _FirstTokenClock:
    """A logits processor that only notes when the first token's logits exist (after the prefill)."""

    def __init__(self, dev):
        self.dev, self.t = dev, None

    def __call__(self, input_ids, scores):
        if self.t is None:
            _sync(self.dev)
            self.t = time.perf_counter()
        return scores


@torch.no_grad()
def generate_speed(hf, prompts: list[list[int]], n_new: int) -> dict:
    """Greedy `generate` of n_new tokens for B equal-length prompts in one batch.
    Prefill = until the first token's logits; decode = the n_new - 1 steps after it."""
    from transformers import LogitsProcessorList

    dev = next(hf.parameters()).device
    ids = torch.tensor(prompts, device=dev)  # [B, L]
    B, L = ids.shape
    clock = _FirstTokenClock(dev)
    _sync(dev)
    t0 = time.perf_counter()
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, min_new_tokens=n_new,
                      do_sample=False, pad_token_id=hf.config.eos_token_id,
                      logits_processor=LogitsProcessorList([clock]))
    _sync(dev)
    t2 = time.perf_counter()
    t1 = clock.t or t0
    prefill_s, decode_s = max(t1 - t0, 1e-9), max(t2 - t1, 1e-9)
    return {"batch": B, "prefill_tokens_per_s": B * L / prefill_s, "prefill_ms": prefill_s * 1e3,
            "decode_tokens_per_s": B * (n_new - 1) / decode_s, "decode_ms_per_step": decode_s / max(n_new - 1, 1) * 1e3,
            "outputs": out[:, L:].tolist()}
