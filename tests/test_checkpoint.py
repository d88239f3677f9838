"""Checkpoint I/O (deepseek_v4.md §2, deepseek_v3_mla.md §2, quant_formats.md §2/§4): round trips, the
released formats, seeded random checkpoints, the three V4 name forms, meta loads and error handling."""
from __future__ import annotations

import copy
import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dsv4c import CheckpointError, ModelConfig, build_model, load_model, save_checkpoint, write_random_checkpoint
from dsv4c.checkpoint import INDEX_FILE, CheckpointReader
from dsv4c.model import randomize_
from dsv4c.presets import PRESETS



V3_PARAMS = ["v3-tiny", "v32-tiny"]  # a V3 model that does not build fails these tests
V4_TINY = ["v4-tiny-a", "v4-tiny-b"]


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
_MODELS: dict[str, torch.nn.Module] = {}


def tiny_model(preset: str) -> torch.nn.Module:
    """A seeded random fp32 model (cached; tests must not modify it)."""
    if preset not in _MODELS:
        _MODELS[preset] = randomize_(build_model(ModelConfig.preset(preset)), seed=7)
    return _MODELS[preset]


def token_ids(cfg: ModelConfig, T: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logits(model, ids):
    return model(ids)


def assert_state_equal(a: dict, b: dict, skip=lambda name: False):
    a = {k: v for k, v in a.items() if not skip(k)}
    b = {k: v for k, v in b.items() if not skip(k)}
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


def snapshot(folder: Path) -> dict[str, str]:
    """File name -> sha256 of every file in the folder."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def safetensors_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def read_all(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in safetensors_files(folder):
        out.update(load_file(str(f)))
    return out


STACKED = (".experts.w1", ".experts.w2", ".experts.w3", ".experts.gate_proj", ".experts.up_proj",
           ".experts.down_proj")  # the eager models' stacked routed experts [E, ...]
FP32_ISLANDS = ("_fn", "_base", "_scale", "attn_sink", ".ape", "gate.bias")  # kept fp32 in any dtype (§2.2)


def disk_layout(model) -> dict[str, tuple[int, ...]]:
    """Expected on-disk (unquantised) name -> shape: the stacked experts split per expert (§2.2)."""
    out = {}
    for name, t in model.state_dict().items():
        if not name.endswith(STACKED):
            out[name] = tuple(t.shape)
            continue
        prefix, leaf = name.rsplit(".", 1)
        for e in range(t.shape[0]):
            out[f"{prefix}.{e}.{leaf}.weight"] = tuple(t.shape[1:])
    return out


# Independent decoders, written from quant_formats.md (no dsv4c code).
_E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)


def e8m0_values(s: torch.Tensor) -> torch.Tensor:
    assert s.dtype == torch.float8_e8m0fnu
    return torch.exp2(s.view(torch.uint8).double() - 127)


def fp8_block_ref(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W[i,j] = q[i,j] * scale[i//128, j//128] (quant_formats.md §2), fp32."""
    O, I = q.shape
    s = scale.double() if scale.dtype == torch.float32 else e8m0_values(scale)
    s = s.repeat_interleave(128, 0)[:O].repeat_interleave(128, 1)[:, :I]
    return (q.double() * s).float()


def mxfp4_ref(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W[n,k] = e2m1(code) * 2^(scale[n, k//32] - 127); element 2j = low nibble of byte j (§4)."""
    b = packed.view(torch.uint8).long()
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)
    return (_E2M1[codes] * e8m0_values(scale).repeat_interleave(32, -1)).float()


def test_reference_decoders_on_the_spec_vectors():
    # quant_formats.md §8: byte 0x2B with scale byte 0x80 -> [-3.0, 2.0]; e4m3 0x7E = 448, 0x38 = 1.
    packed = torch.tensor([[0x2B] + [0] * 15], dtype=torch.uint8).view(torch.int8)
    scale = torch.tensor([[0x80]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    assert mxfp4_ref(packed, scale)[0, :2].tolist() == [-3.0, 2.0]
    q = torch.tensor([[0x7E, 0x38]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.tensor([[126]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    assert fp8_block_ref(q, s).tolist() == [[224.0, 0.5]]


# ------------------------------------------------------------------------------------------------
# round trips, quant="none"
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("preset", V4_TINY + V3_PARAMS)
def test_round_trip_unquantised_is_bit_exact(preset, sharded, tmp_path):
    model = tiny_model(preset)
    limit = 150_000 if sharded else 4 << 30
    out = save_checkpoint(model, tmp_path / "ck", max_shard_bytes=limit)
    files = safetensors_files(out)
    if sharded:
        assert len(files) >= 3
        index = json.loads((out / INDEX_FILE).read_text())
        assert set(index["weight_map"].values()) == {f.name for f in files}
        for f in files:  # the index agrees with the shards, and every shard respects the limit
            with safe_open(str(f), "pt") as h:
                keys = set(h.keys())
                assert keys == {k for k, v in index["weight_map"].items() if v == f.name}
                sizes = [h.get_tensor(k).nbytes for k in keys]
            assert sum(sizes) <= limit or len(keys) == 1
    else:
        assert [f.name for f in files] == ["model.safetensors"] and not (out / INDEX_FILE).exists()
    assert set(read_all(out)) >= set(disk_layout(model))

    loaded = load_model(out)
    assert loaded.config == model.config
    assert_state_equal(loaded.state_dict(), model.state_dict())
    ids = token_ids(model.config)
    assert torch.equal(logits(loaded, ids), logits(model, ids))


def test_round_trip_in_bf16_rounds_only_the_non_fp32_tensors(tmp_path):
    model = tiny_model("v4-tiny-a")
    out = save_checkpoint(model, tmp_path / "ck", dtype=torch.bfloat16)
    stored = read_all(out)
    assert stored["embed.weight"].dtype == torch.bfloat16
    assert stored["layers.0.hc_attn_fn"].dtype == torch.float32
    loaded = load_model(out, dtype=torch.bfloat16)
    for name, t in model.state_dict().items():
        got = loaded.state_dict()[name]
        want = t if t.dtype == torch.int64 or name.endswith(FP32_ISLANDS) else t.to(torch.bfloat16)
        assert got.dtype == want.dtype and torch.equal(got, want), name


# ------------------------------------------------------------------------------------------------
# quant="release"
# ------------------------------------------------------------------------------------------------
_V4_FP8_SUFFIXES = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight",
                    "attn.wo_b.weight", "attn.indexer.wq_b.weight", "shared_experts.w1.weight",
                    "shared_experts.w2.weight", "shared_experts.w3.weight", "e_proj.weight", "h_proj.weight")


def v4_release_format(name: str) -> str:
    """The released format of a V4 tensor, from the table of deepseek_v4.md §2.2 and §6."""
    leaf = name.rsplit(".", 1)[-1]
    if ".experts." in name and "shared_experts" not in name:
        return "fp4"
    if name.endswith(_V4_FP8_SUFFIXES):
        return "fp8"
    if name.endswith("tid2eid"):
        return "int64"
    if leaf.startswith("hc_") or name.endswith(("attn_sink", ".ape", "gate.bias")):
        return "fp32"
    return "bf16"


@pytest.mark.parametrize("preset", V4_TINY)
def test_release_v4_files_hold_the_released_formats(preset, tmp_path):
    model = tiny_model(preset)
    out = save_checkpoint(model, tmp_path / "ck", quant="release")
    conf = json.loads((out / "config.json").read_text())
    assert conf["quantization_config"]["quant_method"] == "fp8"
    assert conf["quantization_config"]["scale_fmt"] == "ue8m0"
    assert conf["quantization_config"]["weight_block_size"] == [128, 128]
    assert conf["expert_dtype"] == "fp4"

    stored = read_all(out)
    layout = disk_layout(model)
    expected_names = set(layout) | {n[: -len("weight")] + "scale" for n in layout
                                    if v4_release_format(n) in ("fp8", "fp4")}
    assert set(stored) == expected_names
    seen = set()
    for name, (O, *rest) in layout.items():
        fmt, t = v4_release_format(name), stored[name]
        seen.add(fmt)
        if fmt == "fp8":
            I = rest[0]
            s = stored[name[: -len("weight")] + "scale"]
            assert t.dtype == torch.float8_e4m3fn and tuple(t.shape) == (O, I), name
            assert s.dtype == torch.float8_e8m0fnu and tuple(s.shape) == (-(-O // 128), -(-I // 128)), name
        elif fmt == "fp4":
            I = rest[0]
            s = stored[name[: -len("weight")] + "scale"]
            assert t.dtype == torch.int8 and tuple(t.shape) == (O, I // 2), name
            assert s.dtype == torch.float8_e8m0fnu and tuple(s.shape) == (O, I // 32), name
        else:
            want = {"bf16": torch.bfloat16, "fp32": torch.float32, "int64": torch.int64}[fmt]
            assert t.dtype == want and tuple(t.shape) == (O, *rest), name
    assert seen == {"fp8", "fp4", "bf16", "fp32", "int64"}
    for must in ("layers.1.attn.compressor.wkv.weight", "layers.1.attn.compressor.wgate.weight",
                 "layers.1.ffn.gate.weight", "norm.weight", "mtp.0.enorm.weight"):
        assert stored[must].dtype == torch.bfloat16, must
    assert stored["mtp.0.e_proj.weight"].dtype == torch.float8_e4m3fn
    assert stored["mtp.0.ffn.gate.bias"].dtype == torch.float32


@pytest.mark.parametrize("preset", V4_TINY)
def test_release_v4_load_equals_independent_dequantisation(preset, tmp_path):
    model = tiny_model(preset)
    out = save_checkpoint(model, tmp_path / "ck", quant="release", max_shard_bytes=200_000)
    assert len(safetensors_files(out)) > 1
    stored = read_all(out)
    loaded = load_model(out)
    assert loaded.config.expert_dtype == "fp4" and loaded.config.num_nextn_predict_layers == 1
    got = loaded.state_dict()
    orig = model.state_dict()
    n_checked = 0
    for name, t in got.items():
        stacked = name.endswith(STACKED)
        if stacked:
            pre, leaf = name.rsplit(".", 1)
            disk = [f"{pre}.{e}.{leaf}.weight" for e in range(t.shape[0])]
            want = torch.stack([mxfp4_ref(stored[d], stored[d[: -len("weight")] + "scale"]) for d in disk])
        else:
            fmt = v4_release_format(name)
            if fmt == "fp8":
                want = fp8_block_ref(stored[name], stored[name[: -len("weight")] + "scale"])
            else:
                want = stored[name].to(t.dtype)
        assert t.dtype == (torch.int64 if name.endswith("tid2eid") else torch.float32), name
        assert torch.equal(t, want), name
        # and the stored values are a faithful quantisation of the original
        o = orig[name]
        if stacked or v4_release_format(name) == "fp8":
            rel = ((t - o).norm() / o.norm()).item()
            assert rel < (0.2 if stacked else 0.05), (name, rel)
        elif v4_release_format(name) == "bf16":
            assert torch.equal(t, o.to(torch.bfloat16).float()), name
        else:
            assert torch.equal(t, o), name
        n_checked += 1
    assert n_checked == len(orig)


def test_release_scales_under_hf_names_load_the_same(tmp_path):
    """HF renames `.scale` to `weight_scale_inv` (§2.2); the loader accepts both."""
    model = tiny_model("v4-tiny-a")
    out = save_checkpoint(model, tmp_path / "ck", quant="release")
    ref = load_model(out)
    renamed = {(k[: -len(".scale")] + ".weight_scale_inv" if k.endswith(".scale") else k): v
               for k, v in load_file(str(out / "model.safetensors")).items()}
    assert any(k.endswith("weight_scale_inv") for k in renamed)
    save_file(renamed, str(out / "model.safetensors"))
    assert_state_equal(load_model(out).state_dict(), ref.state_dict())


_V3_FP8_LEAVES = ("q_a_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight", "kv_b_proj.weight",
                  "o_proj.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight",
                  "indexer.wq_b.weight", "indexer.wk.weight")


@pytest.mark.parametrize("preset", V3_PARAMS)
def test_release_v3_fp8_with_fp32_scale_inv(preset, tmp_path):
    model = tiny_model(preset)
    out = save_checkpoint(model, tmp_path / "ck", quant="release")
    stored = read_all(out)
    loaded = load_model(out).state_dict()
    n_fp8 = 0
    for name, (O, *rest) in disk_layout(model).items():
        t = stored[name]
        if name.endswith(_V3_FP8_LEAVES):
            s = stored[name[: -len("weight")] + "weight_scale_inv"]
            assert t.dtype == torch.float8_e4m3fn and s.dtype == torch.float32, name
            assert tuple(s.shape) == (-(-O // 128), -(-rest[0] // 128)), name
            n_fp8 += 1
        elif name.endswith("e_score_correction_bias"):
            assert t.dtype == torch.float32, name
        else:
            assert t.dtype == torch.bfloat16, name
    assert n_fp8 > 0
    for name, t in loaded.items():
        if name.endswith(STACKED):
            pre, leaf = name.rsplit(".", 1)
            want = torch.stack([fp8_block_ref(stored[f"{pre}.{e}.{leaf}.weight"],
                                              stored[f"{pre}.{e}.{leaf}.weight_scale_inv"])
                                for e in range(t.shape[0])])
        elif name.endswith(_V3_FP8_LEAVES):
            want = fp8_block_ref(stored[name], stored[name[: -len("weight")] + "weight_scale_inv"])
        else:
            want = stored[name].float()
        assert torch.equal(t, want), name


# ------------------------------------------------------------------------------------------------
# write_random_checkpoint
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["v4-tiny-a"] + V3_PARAMS[:1])
def test_random_checkpoint_equals_randomize(preset, tmp_path):
    cfg = ModelConfig.preset(preset)
    a = write_random_checkpoint(cfg, tmp_path / "a", seed=5, dtype=torch.float32)
    b = write_random_checkpoint(cfg, tmp_path / "b", seed=5, dtype=torch.float32, max_shard_bytes=100_000)
    c = write_random_checkpoint(cfg, tmp_path / "c", seed=6, dtype=torch.float32)
    assert len(safetensors_files(b)) > 1
    want = randomize_(build_model(cfg), seed=5).state_dict()
    assert_state_equal(load_model(a).state_dict(), want)
    assert_state_equal(load_model(b).state_dict(), want)  # sharding does not change the values
    other = load_model(c).state_dict()
    for name, t in want.items():
        if t.numel() > 1:
            assert not torch.equal(other[name], t), name


def test_random_checkpoint_default_bf16_storage(tmp_path):
    cfg = ModelConfig.preset("v4-tiny-b")
    out = write_random_checkpoint(cfg, tmp_path / "ck", seed=3)
    assert read_all(out)["layers.0.attn.wq_a.weight"].dtype == torch.bfloat16
    loaded = load_model(out).state_dict()
    for name, t in randomize_(build_model(cfg), seed=3).state_dict().items():
        keep = t.dtype == torch.int64 or name.endswith(FP32_ISLANDS)
        want = t if keep else t.to(torch.bfloat16).float()
        assert torch.equal(loaded[name], want), name


def test_random_tid2eid_rows_hold_distinct_experts(tmp_path):
    cfg = ModelConfig.preset("v4-tiny-a")
    out = write_random_checkpoint(cfg, tmp_path / "ck", seed=1)
    t = read_all(out)["layers.0.ffn.gate.tid2eid"]
    assert t.dtype == torch.int64 and tuple(t.shape) == (cfg.vocab_size, cfg.num_experts_per_tok)
    assert all(len(set(row)) == cfg.num_experts_per_tok for row in t.tolist())
    assert 0 <= int(t.min()) and int(t.max()) < cfg.n_routed_experts
    assert len(set(t.flatten().tolist())) == cfg.n_routed_experts  # routing spreads over all experts


# ------------------------------------------------------------------------------------------------
# HF name forms (§2.1)
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_models():
    from oracle import hf_v4_model

    return {p: hf_v4_model(tiny_model(p)) for p in V4_TINY}


def _main_only(name: str) -> bool:
    return name.startswith("mtp.")


@pytest.mark.parametrize("preset", V4_TINY)
def test_hf_save_pretrained_form_loads(preset, hf_models, tmp_path):
    model, hf = tiny_model(preset), hf_models[preset]
    hf.save_pretrained(tmp_path)
    names = set(read_all(tmp_path))
    assert "model.layers.0.attn.norm.weight" in names and "model.embed_tokens.weight" in names  # form 3
    assert "model.hc_head.hc_fn" in names and "head.weight" in names
    assert "model.layers.0.ffn.experts.0.w1.weight" in names
    loaded = load_model(tmp_path)
    assert loaded.config.num_nextn_predict_layers == 0  # HF has no MTP
    assert loaded.config == model.config.replace(num_nextn_predict_layers=0)
    assert_state_equal(loaded.state_dict(), model.state_dict(), skip=_main_only)
    ids = token_ids(model.config)
    ours = logits(loaded, ids)
    assert torch.equal(ours, logits(model, ids))
    with torch.no_grad():
        theirs = hf(ids).logits
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() < 1e-4


@pytest.mark.parametrize("preset", V4_TINY)
def test_hf_module_form_loads(preset, hf_models, tmp_path):
    """HF's in-memory state dict (fused gate_up_proj experts) plus our official config.json."""
    model, hf = tiny_model(preset), hf_models[preset]
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in sd and "model.layers.1.self_attn.sinks" in sd
    save_file(sd, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(model.config.to_dict()))
    loaded = load_model(tmp_path)
    assert loaded.config.num_nextn_predict_layers == 0
    assert_state_equal(loaded.state_dict(), model.state_dict(), skip=_main_only)
    ids = token_ids(model.config)
    assert torch.equal(logits(loaded, ids), logits(model, ids))


@pytest.mark.parametrize("preset", V4_TINY)
def test_official_form_with_official_config_loads(preset, tmp_path):
    """Official hub names (experts per expert, MTP included) written by hand, legacy-keys config."""
    model = tiny_model(preset)
    sd = {}
    for name, t in model.state_dict().items():
        if name.endswith(STACKED):
            pre, leaf = name.rsplit(".", 1)
            sd.update({f"{pre}.{e}.{leaf}.weight": t[e].clone() for e in range(t.shape[0])})
        else:
            sd[name] = t.contiguous()
    assert "layers.0.attn.kv_norm.weight" in sd and "mtp.0.e_proj.weight" in sd
    save_file(sd, str(tmp_path / "model.safetensors"))
    conf = copy.deepcopy(PRESETS[preset])
    for k in ("layer_types", "compress_rates", "mlp_layer_types"):
        conf.pop(k)
    (tmp_path / "config.json").write_text(json.dumps(conf))
    loaded = load_model(tmp_path)
    assert loaded.config == model.config and loaded.config.num_nextn_predict_layers == 1
    assert_state_equal(loaded.state_dict(), model.state_dict())
    ids = token_ids(model.config)
    assert torch.equal(logits(loaded, ids), logits(model, ids))


def test_reader_reports_the_name_form(hf_models, tmp_path):
    model, hf = tiny_model("v4-tiny-a"), hf_models["v4-tiny-a"]
    hf.save_pretrained(tmp_path / "saved")
    (tmp_path / "mod").mkdir()
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(tmp_path / "mod" / "model.safetensors"))
    save_checkpoint(model, tmp_path / "off")
    cfg = model.config
    forms = {d: CheckpointReader(tmp_path / d, cfg) for d in ("saved", "mod", "off")}
    assert {d: r.form for d, r in forms.items()} == {"saved": "hf_saved", "mod": "hf_module", "off": "official"}
    want = {n for n in disk_layout(model) if not n.startswith("mtp.")}
    for d, r in forms.items():  # all three normalise to the same official names and shapes
        names = {n for n in r.names() if not n.startswith("mtp.")}
        assert names == want, d
        assert r.shape("layers.1.ffn.experts.3.w3.weight") == (cfg.moe_intermediate_size, cfg.hidden_size), d
        assert r.shape("layers.1.attn.kv_norm.weight") == (cfg.head_dim,), d
        r.close()


# ------------------------------------------------------------------------------------------------
# meta loads
# ------------------------------------------------------------------------------------------------
def test_meta_load_allocates_nothing(tmp_path):
    model = tiny_model("v4-tiny-b")
    out = save_checkpoint(model, tmp_path / "ck", quant="release", max_shard_bytes=500_000)
    meta = load_model(out, device="meta")
    assert meta.config.num_nextn_predict_layers == 1
    tensors = list(meta.parameters()) + list(meta.buffers())
    assert tensors and all(t.is_meta for t in tensors)
    assert {k: tuple(v.shape) for k, v in meta.state_dict().items()} == \
        {k: tuple(v.shape) for k, v in model.state_dict().items()}


# ------------------------------------------------------------------------------------------------
# errors: each raises CheckpointError naming the file and/or tensor, and touches no file
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("base")
    model = tiny_model("v4-tiny-a")
    return {"single": save_checkpoint(model, root / "single", quant="release"),
            "sharded": save_checkpoint(model, root / "sharded", quant="release", max_shard_bytes=150_000)}


# A mutation edits a copy of a base checkpoint and returns a string the error must name, or None.
def _edit_tensors(fn):
    def mutate(folder: Path):
        f = folder / "model.safetensors"
        sd = load_file(str(f))
        fn(sd)
        save_file(sd, str(f))
    return mutate


def _edit_bytes(fn):
    def mutate(folder: Path):
        f = folder / "model.safetensors"
        f.write_bytes(fn(f.read_bytes()))
    return mutate


def _header_len(b: bytes) -> int:
    return int.from_bytes(b[:8], "little")


def _drop_shard(folder: Path):
    index = json.loads((folder / INDEX_FILE).read_text())
    shard = index["weight_map"]["layers.2.attn.wq_a.weight"]
    (folder / shard).unlink()
    return shard


def _index_names_missing_shard(folder: Path):
    index = json.loads((folder / INDEX_FILE).read_text())
    index["weight_map"]["layers.2.attn.wq_a.weight"] = "model-00099-of-00099.safetensors"
    (folder / INDEX_FILE).write_text(json.dumps(index))
    return "model-00099-of-00099.safetensors"


def _index_names_wrong_shard(folder: Path):
    index = json.loads((folder / INDEX_FILE).read_text())
    wm = index["weight_map"]
    other = next(v for v in wm.values() if v != wm["layers.2.attn.wq_a.weight"])
    wm["layers.2.attn.wq_a.weight"] = other
    (folder / INDEX_FILE).write_text(json.dumps(index))
    return other


W = "layers.2.attn.wq_a"  # an FP8 weight (HCA layer)
X = "layers.1.ffn.experts.3.w2"  # an MXFP4 routed expert
B = "layers.2.attn.compressor.wkv.weight"  # a bf16 weight

ERRORS = [
    # (id, base, mutation, strings the message must contain, also checked on the meta device)
    ("missing_tensor", "single", _edit_tensors(lambda sd: sd.pop(B)), [B], True),
    ("missing_expert", "single", _edit_tensors(lambda sd: (sd.pop(X + ".weight"), sd.pop(X + ".scale"))),
     [X + ".weight"], True),
    ("unexpected_tensor", "single", _edit_tensors(lambda sd: sd.update({"layers.2.attn.bogus": torch.zeros(3)})),
     ["layers.2.attn.bogus", "model.safetensors"], True),
    ("wrong_shape_bf16", "single", _edit_tensors(lambda sd: sd.update({B: torch.zeros(128, 65, dtype=torch.bfloat16)})),
     [B, "model.safetensors", "[128, 65]"], True),
    ("wrong_shape_fp8", "single",
     _edit_tensors(lambda sd: sd.update({W + ".weight": torch.zeros(33, 64).to(torch.float8_e4m3fn)})),
     [W + ".weight", "model.safetensors"], True),
    ("wrong_shape_fp4", "single", _edit_tensors(lambda sd: sd.update({X + ".weight": torch.zeros(64, 8, dtype=torch.int8)})),
     [X + ".weight", "model.safetensors"], True),
    ("wrong_fp8_scale_shape", "single",
     _edit_tensors(lambda sd: sd.update({W + ".scale": sd[W + ".scale"].view(torch.uint8).repeat(2, 1)
                                         .view(torch.float8_e8m0fnu)})),
     [W + ".weight", "model.safetensors"], False),
    ("wrong_fp8_scale_dtype", "single", _edit_tensors(lambda sd: sd.update({W + ".scale": torch.ones(1, 1)
                                                                            .to(torch.bfloat16)})),
     [W + ".weight", "model.safetensors"], False),
    ("wrong_fp4_scale_shape", "single",
     _edit_tensors(lambda sd: sd.update({X + ".scale": sd[X + ".scale"][:, :0].contiguous()})),
     [X + ".weight", "model.safetensors"], False),
    ("int_where_float_belongs", "single", _edit_tensors(lambda sd: sd.update({B: torch.zeros(128, 64, dtype=torch.int32)})),
     [B, "model.safetensors", "int32"], False),
    ("float_where_int_belongs", "single",
     _edit_tensors(lambda sd: sd.update({"layers.0.ffn.gate.tid2eid": sd["layers.0.ffn.gate.tid2eid"].float()})),
     ["layers.0.ffn.gate.tid2eid", "model.safetensors"], False),
    ("fp8_weight_without_scale", "single", _edit_tensors(lambda sd: sd.pop(W + ".scale")),
     [W + ".weight", "model.safetensors"], False),
    ("fp4_weight_without_scale", "single", _edit_tensors(lambda sd: sd.pop(X + ".scale")),
     [X + ".weight", "model.safetensors"], True),
    ("truncated_data", "single", _edit_bytes(lambda b: b[: len(b) // 2]), ["model.safetensors", "truncated"], True),
    ("truncated_last_byte", "single", _edit_bytes(lambda b: b[:-1]), ["model.safetensors", "truncated"], True),
    ("truncated_header", "single", _edit_bytes(lambda b: b[:100]), ["model.safetensors"], True),
    ("truncated_to_4_bytes", "single", _edit_bytes(lambda b: b[:4]), ["model.safetensors"], True),
    ("empty_file", "single", _edit_bytes(lambda b: b""), ["model.safetensors"], True),
    ("corrupt_header_length", "single", _edit_bytes(lambda b: b"\xff" * 8 + b[8:]), ["model.safetensors"], True),
    ("corrupt_header_json", "single", _edit_bytes(lambda b: b[:8] + b"garbage!" + b[16:]), ["model.safetensors"], True),
    ("header_not_an_object", "single",
     _edit_bytes(lambda b: b[:8] + b"[1, 2]".ljust(_header_len(b)) + b[8 + _header_len(b):]),
     ["model.safetensors"], True),
    ("header_entry_without_offsets", "single",
     _edit_bytes(lambda b: b[:8] + b'{"a": 5}'.ljust(_header_len(b)) + b[8 + _header_len(b):]),
     ["model.safetensors"], True),
    ("header_bad_dtype", "single",
     _edit_bytes(lambda b: b.replace(b'"dtype":"F32"', b'"dtype":"F16"', 1)), ["model.safetensors"], True),
    ("index_shard_deleted", "sharded", _drop_shard, [INDEX_FILE], True),
    ("index_names_missing_shard", "sharded", _index_names_missing_shard,
     [INDEX_FILE, "model-00099-of-00099.safetensors", W + ".weight"], True),
    ("index_names_wrong_shard", "sharded", _index_names_wrong_shard, [W + ".weight"], True),
]


# Meta loads check names and shapes from the headers only, not dtypes or scale contents.
_ERROR_PARAMS = [pytest.param(base, mutate, expect, device, id=f"{name}-{device}")
                 for name, base, mutate, expect, on_meta in ERRORS
                 for device in (("cpu", "meta") if on_meta else ("cpu",))]


@pytest.mark.parametrize("base,mutate,expect,device", _ERROR_PARAMS)
def test_load_error_names_the_problem_and_loses_nothing(base, mutate, expect, device, base_checkpoints, tmp_path):
    folder = tmp_path / "ck"
    shutil.copytree(base_checkpoints[base], folder)
    pristine = snapshot(folder)
    culprit = mutate(folder)
    before = snapshot(folder)
    assert before != pristine  # the mutation did something
    with pytest.raises(CheckpointError) as ei:
        load_model(folder, device=device)
    msg = str(ei.value)
    for s in expect + ([culprit] if culprit else []):
        assert s in msg, (s, msg)
    assert snapshot(folder) == before  # a failed load modifies and deletes nothing


def _extras(folder: Path) -> None:
    """What a hub download or a working folder holds beside the checkpoint."""
    save_file({"lora_A": torch.ones(2, 3)}, str(folder / "adapter_model.safetensors"))
    save_file({"logits": torch.zeros(4)}, str(folder / "outputs.safetensors"))
    save_file({"x": torch.zeros(1)}, str(folder / "model-00001-of-00002 (copy).safetensors"))
    (folder / "README.md").write_text("# a model card")


@pytest.mark.parametrize("base,drop_index", [("single", False), ("sharded", False), ("sharded", True)],
                         ids=["single", "indexed", "shards-without-index"])
def test_hub_folder_with_extra_safetensors_files_loads(base, drop_index, base_checkpoints, tmp_path):
    """index, else model.safetensors, else model-i-of-n shards; other .safetensors files are ignored."""
    folder = tmp_path / "ck"
    shutil.copytree(base_checkpoints[base], folder)
    if drop_index:
        (folder / INDEX_FILE).unlink()
    _extras(folder)
    if base == "sharded":  # with an index, a stray single file is not part of the checkpoint either
        save_file({"y": torch.zeros(1)}, str(folder / ("model.safetensors" if not drop_index else "consolidated.safetensors")))
    ref = load_model(base_checkpoints[base], device="meta")
    loaded = load_model(folder)
    assert set(loaded.state_dict()) == set(ref.state_dict())
    want = load_model(base_checkpoints[base]).state_dict()
    assert all(torch.equal(v, want[k]) for k, v in loaded.state_dict().items())


def test_shards_without_index_must_be_complete_and_named(base_checkpoints, tmp_path):
    folder = tmp_path / "ck"
    shutil.copytree(base_checkpoints["sharded"], folder)
    (folder / INDEX_FILE).unlink()
    shards = sorted(folder.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 3
    shards[1].unlink()
    with pytest.raises(CheckpointError, match=f"shard\\(s\\) \\[2\\] of {len(shards)} are missing"):
        load_model(folder)
    for f in folder.glob("model-*.safetensors"):
        f.rename(folder / f.name.replace("model-", "weights-"))
    with pytest.raises(CheckpointError, match="no shards named model-00001-of-0000N"):
        load_model(folder)


def test_bad_checkpoint_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_model(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text(json.dumps(ModelConfig.preset("v4-tiny-a").to_dict()))
    with pytest.raises(CheckpointError, match="empty"):
        load_model(tmp_path / "empty")


# ------------------------------------------------------------------------------------------------
# writing into existing folders
# ------------------------------------------------------------------------------------------------
def test_save_into_non_empty_folder_needs_overwrite(tmp_path):
    model = tiny_model("v4-tiny-a")
    out = save_checkpoint(model, tmp_path / "ck", max_shard_bytes=150_000)
    (out / "README.md").write_text("keep me")
    before = snapshot(out)
    with pytest.raises(FileExistsError, match=re.escape(str(out))):
        save_checkpoint(model, out)
    with pytest.raises(FileExistsError, match=re.escape(str(out))):
        write_random_checkpoint(model.config, out, seed=1)
    assert snapshot(out) == before

    # overwrite: the old shards and index go, so nothing stale can be picked up
    save_checkpoint(model, out, quant="release", overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert load_model(out).config.quantization_config is not None

    fresh = tmp_path / "fresh" / "nested"  # missing parents are created
    save_checkpoint(model, fresh)
    assert (fresh / "model.safetensors").is_file()
