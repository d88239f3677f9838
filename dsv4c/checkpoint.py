"""Checkpoint I/O in the official hub layouts (deepseek_v4.md §2, deepseek_v3_mla.md §2, quant_formats.md).

Reading is lazy: safetensors files are memory-mapped and tensors are read one at a time, dequantised
(FP8 128x128 blocks with e8m0 or fp32 scales, MXFP4 experts) and copied into the model. Names arrive
in any of the accepted forms and are normalised to the *disk-canonical* form:
  * V4: official names (`layers.L.attn.wq_a.weight`, per-expert `layers.L.ffn.experts.e.w1.weight`);
  * V3/V3.2: HF hub names (`model.layers.L.self_attn.q_a_proj.weight`, per-expert).
The eager models hold the routed experts stacked; `expert_disk_name` bridges the two.

Writing streams too: `save_checkpoint` and `write_random_checkpoint` produce one tensor at a time and
cut shards at `max_shard_bytes`, so a full-size random checkpoint never lives in memory.
"""
from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dsv4c import quant as Q
from dsv4c.config import ModelConfig
from dsv4c.model import build_model, keeps_fp32, random_tensor
from dsv4c.names import (expert_disk_name, is_stacked, v4_hf_module_to_official, v4_hf_saved_to_official,
                         v4_name_form)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_SHARD_RE = re.compile(r"model-(\d+)-of-(\d+)\.safetensors")  # the release shards
_V4_FP8_RE = re.compile(r"(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|ffn\.shared_experts\.w[123]"
                        r"|e_proj|h_proj)\.weight$")
_V3_FP8_RE = re.compile(r"(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|gate_proj|up_proj|down_proj"
                        r"|indexer\.wq_b|indexer\.wk)\.weight$")


class CheckpointError(ValueError):
    """A checkpoint problem; the message names the file and/or tensor."""


# ------------------------------------------------------------------------------------------------
# names
# ------------------------------------------------------------------------------------------------
def scale_names(cfg: ModelConfig, weight_name: str) -> tuple[str, str]:
    """(preferred, alternative) scale tensor names for a quantised weight."""
    base = weight_name[: -len("weight")]
    v4 = (base + "scale", base + "weight_scale_inv")
    return v4 if cfg.is_v4 else v4[::-1]


def _v3_mtp_duplicates(cfg: ModelConfig) -> dict[str, str]:
    """V3's MTP layer stores copies of the embedding and head; the model shares the main ones."""
    if cfg.is_v4 or not cfg.num_nextn_predict_layers:
        return {}
    p = f"model.layers.{cfg.num_hidden_layers}."
    return {p + "embed_tokens.weight": "model.embed_tokens.weight", p + "shared_head.head.weight": "lm_head.weight"}


def _is_mtp(cfg: ModelConfig, name: str) -> bool:
    return name.startswith("mtp.") or name.startswith(f"model.layers.{cfg.num_hidden_layers}.")


# ------------------------------------------------------------------------------------------------
# reading
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Entry:
    file: Path
    key: str  # the name inside the file
    part: tuple | None = None  # (expert, row slice) for HF's fused expert tensors


def _read_header(path: Path) -> dict:
    """Parse and check a safetensors header; truncation or corruption raises naming the file."""
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        n = struct.unpack("<Q", raw)[0]
        if n > size - 8:
            raise CheckpointError(f"{path}: corrupt or truncated safetensors header (claims {n} bytes, file has {size})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (a JSON {type(header).__name__}, not an object)")
    data = size - 8 - n
    for key, info in header.items():
        if key == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise CheckpointError(f"{path}: corrupt safetensors header (tensor {key!r} has no valid data_offsets)")
        end = offsets[1]
        if end > data:
            raise CheckpointError(f"{path}: truncated: tensor {key!r} ends at byte {end} of a {data}-byte data section")
    return header


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files that make up a checkpoint, as the hub lays them out: a file is itself;
    a folder's `model.safetensors.index.json` names its shards when present, else `model.safetensors`,
    else the release-named shards `model-0000i-of-0000n.safetensors` (all n of them). Any other
    `.safetensors` file in the folder (an output, an adapter, a copy) is not part of the checkpoint."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint file or folder")
    if (path / INDEX_FILE).is_file():
        return sorted({path / f for f in _weight_map(path / INDEX_FILE).values()})
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    shards = [(f, _SHARD_RE.fullmatch(f.name)) for f in path.glob("*.safetensors")]
    shards = sorted((f, int(m[1]), int(m[2])) for f, m in shards if m)
    if not shards:
        raise CheckpointError(f"{path}: no {INDEX_FILE}, no {SINGLE_FILE} and no shards named "
                              f"model-00001-of-0000N.safetensors")
    counts = {n for _, _, n in shards}
    if len(counts) > 1:
        raise CheckpointError(f"{path}: shards of different sets ({', '.join(f.name for f, _, _ in shards)})")
    n = counts.pop()
    missing = sorted(set(range(1, n + 1)) - {i for _, i, _ in shards})
    if missing:
        raise CheckpointError(f"{path}: shard(s) {missing} of {n} are missing (model-{missing[0]:05d}-of-{n:05d}"
                              f".safetensors)")
    return [f for f, _, _ in shards]


def _weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError(f"weight_map is a JSON {type(weight_map).__name__}, not an object")
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
    return weight_map


def _checkpoint_files(path: Path) -> dict[str, Path]:
    """name -> file, from the index or from the files `checkpoint_files` picks."""
    index = path / INDEX_FILE
    if path.is_dir() and index.is_file():
        out, headers = {}, {}
        for name, fname in _weight_map(index).items():
            f = path / fname
            if f not in headers:
                if not f.is_file():
                    raise CheckpointError(f"{index}: shard {fname!r} (holding {name!r}) is missing")
                headers[f] = _read_header(f)
            if name not in headers[f]:
                raise CheckpointError(f"{f}: index says it holds {name!r}, but it does not")
            out[name] = f
        return out
    out = {}
    for f in checkpoint_files(path):
        for k in _read_header(f):
            if k != "__metadata__":
                out[k] = f
    return out


class CheckpointReader:
    """Lazy, memory-mapped access to a checkpoint by disk-canonical tensor name."""

    def __init__(self, path: str | Path, cfg: ModelConfig):
        self.path, self.cfg = Path(path), cfg
        raw = _checkpoint_files(self.path)
        self.entries: dict[str, _Entry] = {}
        self._handles: dict[Path, object] = {}
        self.form = v4_name_form(raw) if cfg.is_v4 else "hf"
        for key, f in raw.items():
            for name, part in self._canonical(key, f):
                self.entries[name] = _Entry(f, key, part)

    def _canonical(self, key: str, f: Path) -> Iterator[tuple[str, tuple | None]]:
        if self.form in ("official", "hf"):
            yield key, None
        elif self.form == "hf_saved":
            yield v4_hf_saved_to_official(key), None
        elif key.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            layer = key.split(".")[2]
            shape = self._handle(f).get_slice(key).get_shape()
            for e in range(shape[0]):
                pre = f"layers.{layer}.ffn.experts.{e}."
                if key.endswith("down_proj"):
                    yield pre + "w2.weight", (e, None)
                else:
                    half = shape[1] // 2
                    yield pre + "w1.weight", (e, slice(0, half))
                    yield pre + "w3.weight", (e, slice(half, None))
        else:
            yield v4_hf_module_to_official(key), None

    def _handle(self, f: Path):
        if f not in self._handles:
            try:
                self._handles[f] = safe_open(str(f), framework="pt")
            except Exception as e:  # safetensors raises its own error types
                raise CheckpointError(f"{f}: cannot open as safetensors ({e})") from None
        return self._handles[f]

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def names(self) -> set[str]:
        return set(self.entries)

    def where(self, name: str) -> Path:
        return self.entries[name].file

    def shape(self, name: str) -> tuple[int, ...]:
        e = self.entries[name]
        shape = list(self._handle(e.file).get_slice(e.key).get_shape())
        if e.part is not None:
            shape = shape[1:]
            if e.part[1] is not None:
                shape[0] = len(range(shape[0])[e.part[1]])
        return tuple(shape)

    def fp8_names(self) -> frozenset[str]:
        """The tensors stored as float8_e4m3fn (from the safetensors headers; nothing is read)."""
        return frozenset(n for n, e in self.entries.items()
                         if self._handle(e.file).get_slice(e.key).get_dtype() == "F8_E4M3")

    def get(self, name: str) -> torch.Tensor:
        if name not in self.entries:
            raise CheckpointError(f"{self.path}: missing tensor {name!r}")
        e = self.entries[name]
        try:
            if e.part is None:
                return self._handle(e.file).get_tensor(e.key)
            sl = self._handle(e.file).get_slice(e.key)
            t = sl[e.part[0]]
            return t if e.part[1] is None else t[e.part[1]].contiguous()
        except CheckpointError:
            raise
        except Exception as ex:
            raise CheckpointError(f"{e.file}: cannot read tensor {e.key!r} ({ex})") from None

    def close(self) -> None:
        self._handles.clear()


def _load_weight(reader: CheckpointReader, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                 used: set[str]) -> torch.Tensor:
    """Read one disk tensor, dequantising FP8 / MXFP4, and check its shape and dtype."""
    if name not in reader:
        raise CheckpointError(f"{reader.path}: missing tensor {name!r} (expected shape {list(shape)})")
    used.add(name)
    t = reader.get(name)
    where = reader.where(name)
    if not dtype.is_floating_point:
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise CheckpointError(f"{where}: tensor {name!r} has dtype {t.dtype}, expected an integer tensor")
        t = t.to(dtype)
    elif t.dtype == torch.float8_e4m3fn:
        scale = _scale(reader, name, used)
        try:
            t = Q.dequant_fp8_block(t, scale, dtype=torch.float32)
        except ValueError as e:
            raise CheckpointError(f"{where}: tensor {name!r}: {e}") from None
    elif t.dtype in (torch.int8, torch.uint8):
        sname = _scale_name(reader, name)
        scale = reader.get(sname)
        used.add(sname)
        if len(shape) != 2 or tuple(t.shape) != (shape[0], shape[1] // 2):
            raise CheckpointError(f"{where}: packed FP4 tensor {name!r} has shape {list(t.shape)}, "
                                  f"expected {[shape[0], shape[1] // 2] if len(shape) == 2 else 'a matrix'}")
        try:
            t = Q.dequant_mxfp4(t, scale, dtype=torch.float32)
        except ValueError as e:
            raise CheckpointError(f"{where}: tensor {name!r}: {e}") from None
    elif not t.dtype.is_floating_point:
        raise CheckpointError(f"{where}: tensor {name!r} has dtype {t.dtype}, expected a floating-point weight")
    if tuple(t.shape) != tuple(shape):
        raise CheckpointError(f"{where}: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
    return t.to(dtype)


def _scale_name(reader: CheckpointReader, name: str) -> str:
    for s in scale_names(reader.cfg, name):
        if s in reader:
            return s
    raise CheckpointError(f"{reader.where(name)}: quantised tensor {name!r} has no scale "
                          f"({' or '.join(repr(s) for s in scale_names(reader.cfg, name))})")


def _scale(reader: CheckpointReader, name: str, used: set[str]) -> torch.Tensor:
    sname = _scale_name(reader, name)
    used.add(sname)
    return reader.get(sname)


def read_fp8_block(reader: CheckpointReader, name: str, scale_dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The stored FP8 block form of one disk-canonical weight, not dequantised: (w_q float8_e4m3fn
    [N, K], scale [ceil(N/128), ceil(K/128)] in `scale_dtype`), or None when the checkpoint stores
    the weight unquantised. A scale stored in another dtype is converted only when that is exact
    (fp32 powers of two <-> ue8m0); otherwise CheckpointError names the tensor."""
    if name not in reader:
        raise CheckpointError(f"{reader.path}: missing tensor {name!r}")
    q = reader.get(name)
    if q.dtype != torch.float8_e4m3fn:
        return None
    where = reader.where(name)
    s = _scale(reader, name, set())
    want = tuple(-(-d // Q.FP8_BLOCK) for d in q.shape)
    if q.dim() != 2 or tuple(s.shape) != want:
        raise CheckpointError(f"{where}: FP8 tensor {name!r} {list(q.shape)} has scale shape {list(s.shape)}, "
                              f"expected {list(want)} (128x128 tiles)")
    if s.dtype != scale_dtype:
        f = Q.e8m0_to_float(s) if s.dtype == torch.float8_e8m0fnu else s.float()
        try:
            conv = Q.float_to_e8m0(f) if scale_dtype == torch.float8_e8m0fnu else f.to(scale_dtype)
        except ValueError:  # not powers of two
            conv = None
        back = None if conv is None else (Q.e8m0_to_float(conv) if conv.dtype == torch.float8_e8m0fnu else conv.float())
        if back is None or not torch.equal(back, f):
            raise CheckpointError(f"{where}: scale of {name!r} is {s.dtype} and not exactly representable as "
                                  f"{scale_dtype}")
        s = conv
    return q.contiguous(), s.contiguous()


def _mtp_in_checkpoint(cfg: ModelConfig, reader: CheckpointReader) -> bool:
    return any(_is_mtp(cfg, n) for n in reader.names() if n not in _v3_mtp_duplicates(cfg))


@torch.no_grad()
def load_state_(model: torch.nn.Module, reader: CheckpointReader, progress: bool = False) -> None:
    """Copy every tensor of `model.state_dict()` from `reader`; unexpected checkpoint tensors raise."""
    cfg = model.config
    used: set[str] = set()
    meta = next(model.parameters()).is_meta
    items = list(model.state_dict(keep_vars=True).items())
    for name, dst in _progress(items, progress, "load"):
        if meta:
            _check_shapes(reader, _disk_parts(name, tuple(dst.shape)), used)
            continue
        dst.copy_(read_param(reader, name, tuple(dst.shape), dst.dtype, used))
    dups = _v3_mtp_duplicates(cfg)
    used |= {d for d in dups if d in reader}
    extra = sorted(reader.names() - used)
    if extra:
        shown = ", ".join(repr(n) for n in extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        raise CheckpointError(f"{reader.where(extra[0])}: unexpected tensor(s) for this {cfg.model_type} config: {shown}")


def _disk_parts(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """The disk tensors behind one model tensor: itself, or one per expert for a stacked one."""
    if is_stacked(name):
        return [(expert_disk_name(name, e), shape[1:]) for e in range(shape[0])]
    return [(name, shape)]


def read_param(reader: CheckpointReader, name: str, shape: tuple[int, ...], dtype: torch.dtype,
               used: set[str] | None = None) -> torch.Tensor:
    """One model tensor (canonical name, stacked experts included), dequantised and checked."""
    used = set() if used is None else used
    vals = [_load_weight(reader, n, s, dtype, used) for n, s in _disk_parts(name, shape)]
    return torch.stack(vals) if is_stacked(name) else vals[0]


def _check_shapes(reader: CheckpointReader, parts, used: set[str]) -> None:
    """Meta-device load: check names and shapes from the headers only."""
    for n, shape in parts:
        if n not in reader:
            raise CheckpointError(f"{reader.path}: missing tensor {n!r} (expected shape {list(shape)})")
        used.add(n)
        got = reader.shape(n)
        if len(got) == 2 and len(shape) == 2 and got[1] * 2 == shape[1] and got[0] == shape[0]:
            used.add(_scale_name(reader, n))  # packed FP4
        elif got != shape:
            raise CheckpointError(f"{reader.where(n)}: tensor {n!r} has shape {list(got)}, expected {list(shape)}")
        for s in scale_names(reader.cfg, n):
            if s in reader:
                used.add(s)


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               progress: bool = False) -> torch.nn.Module:
    """Build the eager model for the checkpoint at `path` and load its weights.

    `device="meta"` allocates nothing: names and shapes are checked against the headers only.
    A checkpoint without any MTP tensor (e.g. one saved by HF transformers) loads without the MTP block."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such checkpoint file or folder")
    cfg = ModelConfig.from_pretrained(path if path.is_dir() else path.parent)
    reader = CheckpointReader(path, cfg)
    if cfg.num_nextn_predict_layers and not _mtp_in_checkpoint(cfg, reader):
        cfg = cfg.replace(num_nextn_predict_layers=0)
    model = build_model(cfg, device=device, dtype=dtype, init=False)
    try:
        load_state_(model, reader, progress)
    finally:
        reader.close()
    return model


# ------------------------------------------------------------------------------------------------
# writing
# ------------------------------------------------------------------------------------------------
def release_format(cfg: ModelConfig, name: str) -> str | None:
    """'fp8', 'fp4' or None (kept unquantised) for a disk-canonical weight name in the release layout."""
    if cfg.is_v4:
        if ".experts." in name and "shared_experts" not in name:
            return "fp8" if cfg.expert_dtype == "fp8" else "fp4"
        return "fp8" if _V4_FP8_RE.search(name) else None
    return "fp8" if _V3_FP8_RE.search(name) else None


def _encode(cfg: ModelConfig, name: str, t: torch.Tensor, quant: str, dtype: torch.dtype | None):
    """Yield the (name, tensor) pairs stored on disk for one logical tensor."""
    if not t.dtype.is_floating_point:
        yield name, t.contiguous()
        return
    if keeps_fp32(name):
        yield name, t.float().contiguous()
        return
    fmt = release_format(cfg, name) if quant == "release" else None
    if fmt is None:
        out = dtype or (torch.bfloat16 if quant == "release" else t.dtype)
        yield name, t.to(out).contiguous()
        return
    sname = scale_names(cfg, name)[0]
    if fmt == "fp4":
        w, s = Q.quant_mxfp4(t.float())
    else:
        ue8m0 = cfg.is_v4 or (cfg.quantization_config is not None and cfg.quantization_config.scale_fmt == "ue8m0")
        w, s = Q.quant_fp8_block(t.float(), scale_fmt="ue8m0" if ue8m0 else "fp32")
        if not cfg.is_v4 and s.dtype != torch.float32:
            s = Q.e8m0_to_float(s)
    yield name, w.contiguous()
    yield sname, s.contiguous()


class _ShardWriter:
    """Accumulates tensors and writes `model-0000i-of-0000n.safetensors` shards plus the index."""

    def __init__(self, out: Path, max_shard_bytes: int):
        self.out, self.max = out, max_shard_bytes
        self.buf: dict[str, torch.Tensor] = {}
        self.size = self.total = 0
        self.shards: list[list[str]] = []

    def add(self, name: str, t: torch.Tensor) -> None:
        t = t.detach().cpu()  # a GPU model's tensors are written from host memory
        nbytes = t.numel() * t.element_size()
        if self.buf and self.size + nbytes > self.max:
            self._flush()
        self.buf[name] = t
        self.size += nbytes
        self.total += nbytes

    def _flush(self) -> None:
        i = len(self.shards) + 1
        save_file(self.buf, str(self.out / f"_shard{i:05d}.safetensors"), metadata={"format": "pt"})
        self.shards.append(list(self.buf))
        self.buf, self.size = {}, 0

    def close(self) -> list[str]:
        if self.buf or not self.shards:
            self._flush()
        n = len(self.shards)
        if n == 1:
            (self.out / "_shard00001.safetensors").rename(self.out / "model.safetensors")
            return ["model.safetensors"]
        files, weight_map = [], {}
        for i, names in enumerate(self.shards, 1):
            fname = f"model-{i:05d}-of-{n:05d}.safetensors"
            (self.out / f"_shard{i:05d}.safetensors").rename(self.out / fname)
            files.append(fname)
            weight_map.update({k: fname for k in names})
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out / INDEX_FILE).write_text(json.dumps(index, indent=2))
        return files


def _prepare_out(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{out_dir}: folder is not empty (pass overwrite=True / --force to replace it)")
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in list(out_dir.glob("*.safetensors")) + [out_dir / INDEX_FILE]:
        old.unlink(missing_ok=True)


def _release_config(cfg: ModelConfig, quant: str) -> dict:
    d = cfg.to_dict()
    if quant == "release":
        q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
        if cfg.is_v4 or (cfg.quantization_config and cfg.quantization_config.scale_fmt):
            q["scale_fmt"] = "ue8m0"
        d["quantization_config"] = q
        if cfg.is_v4:
            d["expert_dtype"] = cfg.expert_dtype or "fp4"
    else:
        d.pop("quantization_config", None)
    return d


def _write(cfg: ModelConfig, out_dir: str | Path, tensors: Iterator[tuple[str, torch.Tensor]], n_items: int,
           quant: str, dtype: torch.dtype | None, max_shard_bytes: int, overwrite: bool, progress: bool) -> Path:
    if quant not in ("none", "release"):
        raise ValueError(f"quant: expected 'none' or 'release', got {quant!r}")
    out = Path(out_dir)
    _prepare_out(out, overwrite)
    writer = _ShardWriter(out, max_shard_bytes)
    for name, t in _progress(tensors, progress, "write", total=n_items):
        for n, enc in _encode(cfg, name, t, quant, dtype):
            writer.add(n, enc)
    writer.close()
    (out / "config.json").write_text(json.dumps(_release_config(cfg, quant), indent=2) + "\n")
    return out


def _disk_items(model_sd: dict[str, torch.Tensor], cfg: ModelConfig,
                get: Callable[[str, str, int | None], torch.Tensor]) -> tuple[Iterator, int]:
    """Iterate disk-canonical (name, tensor) pairs: stacked experts split, V3 MTP copies added."""
    plan = []
    for name, t in model_sd.items():
        if is_stacked(name):
            plan += [(expert_disk_name(name, e), name, e) for e in range(t.shape[0])]
        else:
            plan.append((name, name, None))
    has_mtp = any(_is_mtp(cfg, n) for n in model_sd)
    dups = _v3_mtp_duplicates(cfg) if has_mtp else {}
    plan += [(dup, src, None) for dup, src in dups.items()]

    def item(disk: str, src: str, e: int | None) -> tuple[str, torch.Tensor]:
        t = get(disk, src, e)
        return disk, t.clone() if disk in dups else t  # a copy: safetensors refuses tensors sharing storage

    return (item(disk, src, e) for disk, src, e in plan), len(plan)


def save_checkpoint(model: torch.nn.Module, out_dir: str | Path, quant: str = "none", dtype: torch.dtype | None = None,
                    max_shard_bytes: int = 4 << 30, overwrite: bool = False, progress: bool = False) -> Path:
    """Write `model` in the official layout: `quant="none"` keeps the weights unquantised (in `dtype`,
    default the model's), `"release"` writes the released formats (V4: FP8 attention/shared expert,
    MXFP4 routed experts; V3: FP8 with fp32 scales)."""
    sd = model.state_dict()
    items, n = _disk_items(sd, model.config, lambda disk, src, e: sd[src] if e is None else sd[src][e])
    return _write(model.config, out_dir, items, n, quant, dtype, max_shard_bytes, overwrite, progress)


def write_random_checkpoint(cfg: ModelConfig, out_dir: str | Path, seed: int = 0, quant: str = "none",
                            dtype: torch.dtype = torch.bfloat16, max_shard_bytes: int = 4 << 30,
                            overwrite: bool = False, progress: bool = False) -> Path:
    """`dsv4c init`: a seeded random checkpoint for any config, generated one tensor at a time.
    Loading it gives exactly `randomize_(build_model(cfg), seed)` (up to the storage dtype/format)."""
    sd = build_model(cfg, device="meta").state_dict()

    def get(disk: str, src: str, e: int | None) -> torch.Tensor:
        shape = tuple(sd[src].shape if e is None else sd[src].shape[1:])
        dt = sd[src].dtype if not sd[src].dtype.is_floating_point else torch.float32
        return random_tensor(disk if e is not None else src, shape, cfg, seed, dt)

    items, n = _disk_items(sd, cfg, get)
    return _write(cfg, out_dir, items, n, quant, dtype, max_shard_bytes, overwrite, progress)


def _progress(it, enabled: bool, desc: str, total: int | None = None):
    if not enabled:
        return it
    from tqdm import tqdm

    return tqdm(it, desc=desc, total=total, unit="tensor")
