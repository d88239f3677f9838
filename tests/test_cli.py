"""The `dsv4c` command line, in process (`dsv4c.cli.main`) and once through the installed console script."""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dsv4c import ModelConfig, build_model, load_model, write_random_checkpoint
from dsv4c.cli import main
from dsv4c.model import count_parameters, randomize_
from dsv4c.model.generate import greedy

_UNITS = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}
FP32_ISLANDS = ("_fn", "_base", "_scale", "attn_sink", ".ape", "gate.bias")



def run(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def snapshot(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def printed_counts(out: str) -> tuple[float, float]:
    m = re.search(r"total ([\d.]+)([KMBT]?), active per token ([\d.]+)([KMBT]?)", out)
    assert m, out
    return float(m[1]) * _UNITS[m[2]], float(m[3]) * _UNITS[m[4]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """`dsv4c init v4-tiny-a -o DIR --seed 1 --quant release`, run once for the module."""
    out = tmp_path_factory.mktemp("cli") / "tiny"
    assert main(["init", "v4-tiny-a", "-o", str(out), "--seed", "1", "--quant", "release"]) == 0
    return out


def test_init_writes_a_loadable_seeded_release_checkpoint(ckpt, tmp_path):
    assert sorted(p.name for p in ckpt.iterdir()) == ["config.json", "model.safetensors"]
    stored = load_file(str(ckpt / "model.safetensors"))
    assert stored["layers.1.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert stored["layers.1.attn.wq_a.scale"].dtype == torch.float8_e8m0fnu
    assert stored["layers.1.ffn.experts.0.w1.weight"].dtype == torch.int8
    assert stored["embed.weight"].dtype == torch.bfloat16

    cfg = ModelConfig.preset("v4-tiny-a")
    loaded = load_model(ckpt)
    assert loaded.config.num_hidden_layers == cfg.num_hidden_layers and loaded.config.expert_dtype == "fp4"
    want = randomize_(build_model(cfg), seed=1).state_dict()  # --seed 1 reached the generator
    got = loaded.state_dict()
    for name in ("embed.weight", "layers.1.attn.compressor.wkv.weight", "norm.weight"):
        assert torch.equal(got[name], want[name].to(torch.bfloat16).float()), name
    for name in ("layers.0.hc_attn_fn", "layers.1.attn.attn_sink", "layers.0.ffn.gate.tid2eid"):
        assert torch.equal(got[name], want[name]), name
    seed0 = randomize_(build_model(cfg), seed=0).state_dict()
    assert not torch.equal(got["layers.0.hc_attn_fn"], seed0["layers.0.hc_attn_fn"])

    # the CLI writes what the library writes for the same arguments, byte for byte
    lib = write_random_checkpoint(cfg, tmp_path / "lib", seed=1, quant="release")
    assert snapshot(lib) == snapshot(ckpt)


def test_info_of_a_released_preset_prints_its_counts(capsys):
    rc, out, _ = run(capsys, "info", "v4-flash")
    assert rc == 0
    assert re.search(r"layers\s+43 \(\+1 MTP\)", out)
    assert "256 routed (top-6)" in out
    total, active = printed_counts(out)
    assert total == pytest.approx(284.33e9, abs=0.01e9)
    assert active == pytest.approx(13.80e9, abs=0.01e9)
    exact = count_parameters(build_model(ModelConfig.preset("v4-flash"), device="meta"))
    assert total == pytest.approx(exact["total"], rel=1e-4) and active == pytest.approx(exact["active"], rel=1e-4)


def test_info_of_a_checkpoint_folder_and_config_file(ckpt, capsys):
    cfg = ModelConfig.preset("v4-tiny-a")
    exact = count_parameters(build_model(cfg, device="meta"))
    for target in (ckpt, ckpt / "config.json"):
        rc, out, _ = run(capsys, "info", target)
        assert rc == 0
        assert re.search(r"model_type\s+deepseek_v4", out)
        assert re.search(r"hidden / vocab\s+64 / 256", out)
        assert re.search(r"compress ratios\s+\[0, 4, 8, 4\] \| MTP 0", out)
        total, active = printed_counts(out)
        assert total == pytest.approx(exact["total"], rel=1e-4)
        assert active == pytest.approx(exact["active"], rel=1e-4)


def test_generate_prints_the_greedy_continuation(ckpt, capsys):
    rc, out, _ = run(capsys, "generate", ckpt, "--ids", "1,2,3", "--max-new-tokens", "4")
    assert rc == 0
    line = out.strip().splitlines()[-1]
    assert re.fullmatch(r"\d+(,\d+){3}", line), line
    ids = [int(t) for t in line.split(",")]
    want = greedy(load_model(ckpt), torch.tensor([[1, 2, 3]]), 4)[0].tolist()
    assert ids == want
    assert all(0 <= t < 256 for t in ids)


@pytest.mark.parametrize("argv,names", [
    (["info", "v4-nope"], ["v4-nope", "preset"]),
    (["generate", "{ckpt}", "--ids", "1,2,256"], ["--ids", "256", "vocab_size=256"]),
    (["generate", "{ckpt}", "--ids", "1,-1"], ["--ids", "-1"]),
    (["generate", "{ckpt}", "--ids", "1,x"], ["--ids", "1,x"]),
    (["generate", "{tmp}/nowhere", "--ids", "1"], ["nowhere"]),
], ids=["unknown_preset", "id_above_vocab", "negative_id", "non_integer_id", "missing_checkpoint"])
def test_bad_inputs_exit_2_naming_the_problem(argv, names, ckpt, tmp_path, capsys):
    argv = [a.format(ckpt=ckpt, tmp=tmp_path) for a in argv]
    rc, out, err = run(capsys, *argv)
    assert rc == 2
    assert err.startswith(f"dsv4c {argv[0]}: error: ")
    for s in names:
        assert s in err, (s, err)
    assert out == ""


def test_init_with_unknown_preset_writes_nothing(tmp_path, capsys):
    rc, _, err = run(capsys, "init", "v4-nope", "-o", tmp_path / "out")
    assert rc == 2 and "v4-nope" in err
    assert not (tmp_path / "out").exists()


def test_init_into_non_empty_folder_needs_force(ckpt, tmp_path, capsys):
    folder = tmp_path / "ck"
    shutil.copytree(ckpt, folder)
    before = snapshot(folder)
    rc, _, err = run(capsys, "init", "v4-tiny-a", "-o", folder, "--seed", "2")
    assert rc == 2
    assert str(folder) in err and "--force" in err
    assert snapshot(folder) == before

    rc, _, _ = run(capsys, "init", "v4-tiny-a", "-o", folder, "--seed", "2", "--force")
    assert rc == 0
    after = snapshot(folder)
    assert after.keys() == before.keys() and after["model.safetensors"] != before["model.safetensors"]
    assert load_model(folder).config.quantization_config is None  # --quant none by default


def test_argparse_errors_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as ei:
        main(["init", "v4-tiny-a", "-o", str(tmp_path / "x"), "--quant", "bogus"])
    assert ei.value.code == 2
    assert "--quant" in capsys.readouterr().err
    with pytest.raises(SystemExit) as ei:
        main(["generate"])
    assert ei.value.code == 2


def _console_script() -> list[str]:
    """The installed `dsv4c` entry point (next to this interpreter, else on PATH), else the module."""
    here = Path(sys.executable).parent / "dsv4c"
    if here.is_file():
        return [str(here)]
    found = shutil.which("dsv4c")
    return [found] if found else [sys.executable, "-m", "dsv4c.cli"]


def test_console_script(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = _console_script()
    ok = subprocess.run(cmd + ["info", "v4-tiny-a"], cwd=tmp_path, env=env, capture_output=True, text=True,
                        timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "deepseek_v4" in ok.stdout
    total, _ = printed_counts(ok.stdout)
    assert total == pytest.approx(count_parameters(build_model(ModelConfig.preset("v4-tiny-a"),
                                                               device="meta"))["total"], rel=1e-4)
    bad = subprocess.run(cmd + ["info", "v4-nope"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "v4-nope" in bad.stderr


@pytest.mark.gpu
def test_compare_on_cuda_runs_the_targets_kernels(capsys):
    """`dsv4c compare --device cuda`: random weights drawn on the GPU, the h200 pipeline with its Triton
    kernels; the fusion passes stay within bf16 rounding of the eager model, and quantize_experts
    shows its own cost."""
    import json

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    assert main(["compare", "v4-tiny-a", "--device", "cuda", "--target", "h200", "--graphs", "decode",
                 "--dtype", "bfloat16", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["fuse_projections"]["snr_db"] == "inf" or rows["fuse_projections"]["snr_db"] > 30
    q = rows["quantize_experts"]["snr_prev_db"]
    assert q != "inf" and 15 < q < 60
