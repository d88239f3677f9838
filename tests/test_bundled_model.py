"""The bundled trained model (examples/models/v4-tiny-pystdlib): real-text checks on the CPU."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from dsv4c import load_model, quant
from dsv4c.model import build_model
from dsv4c.model.generate import greedy

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / "examples" / "models" / "v4-tiny-pystdlib"
HELD_OUT_LOSS_BOUND = 4.2  # nats/token over the first 8 held-out windows of 512 (measured 3.73 on CPython 3.11)
PROMPTS = ["import os\nimport sys\n", "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n", "x = 1\ny = 2\n",
           "__all__ = [", "class Error(Exception):\n    pass\n\n\n", "if __name__ == '__main__':\n",
           "for i in range(10):\n", "def _check(value):\n    if value is None:\n"]


@pytest.fixture(scope="module")
def bundle():
    from tokenizers import Tokenizer

    return load_model(BUNDLE), Tokenizer.from_file(str(BUNDLE / "tokenizer.json"))


def _train_tiny():
    sys.path.insert(0, str(ROOT / "examples"))
    import train_tiny

    return train_tiny


@torch.no_grad()
def test_held_out_loss_is_below_the_documented_bound(bundle):
    model, tok = bundle
    tt = _train_tiny()
    _, held = tt.stdlib_files()
    assert len(held) == len(tt.HELD_OUT)
    stream = tt.encode_files(tok, held)
    figures = tt.evaluate(model, stream, 512, torch.device("cpu"), max_windows=8)
    assert figures["loss"] < HELD_OUT_LOSS_BOUND, figures
    assert figures["mtp_top1"] > 0.25, figures  # the MTP block predicts t+2 far above chance (1/4096)
    # a random model of the same config is near the uniform loss ln(4096) = 8.3: the bound means something
    rand = tt.evaluate(build_model(model.config), stream[: 2 * 512 + 1], 512, torch.device("cpu"), max_windows=1)
    assert rand["loss"] > HELD_OUT_LOSS_BOUND + 2


def test_release_format_on_disk_and_loaded_exactly(bundle):
    """The bundle stores FP8 attention and MXFP4 experts; loading gives exactly their dequantised values."""
    from safetensors import safe_open

    model, _ = bundle
    sd = model.state_dict()
    checked = 0
    for f in sorted(BUNDLE.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for name in h.keys():
                if name.endswith("layers.2.attn.wq_a.weight"):
                    w, s = h.get_tensor(name), h.get_tensor(name[: -len("weight")] + "scale")
                    assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu
                    assert torch.equal(sd[name], quant.dequant_fp8_block(w, s))
                    checked += 1
                if name.endswith("layers.3.ffn.experts.5.w2.weight"):
                    w, s = h.get_tensor(name), h.get_tensor(name[: -len("weight")] + "scale")
                    assert w.dtype == torch.int8 and s.dtype == torch.float8_e8m0fnu
                    assert torch.equal(sd["layers.3.ffn.experts.w2"][5], quant.dequant_mxfp4(w, s))
                    checked += 1
    assert checked == 2


def _compiles_with_new_code(prompt: str, text: str) -> bool:
    """The continuation, cut at its last full line, compiles and adds a line that is real code."""
    cut = text[: text.rfind("\n") + 1]
    new = [ln for ln in cut[len(prompt):].splitlines() if ln.strip() and not ln.strip().startswith("#")]
    try:
        compile(cut, "<generated>", "exec")
    except SyntaxError:
        return False
    return bool(new)


@torch.no_grad()
def test_greedy_generation_writes_python_that_compiles(bundle):
    model, tok = bundle

    def n_compiling(m) -> int:
        ok = 0
        for p in PROMPTS:
            ids = [0] + tok.encode(p).ids
            out = greedy(m, torch.tensor([ids]), 40)[0].tolist()
            ok += _compiles_with_new_code(p, p + tok.decode(out))
        return ok

    trained = n_compiling(model)
    assert trained >= 2, trained
    assert n_compiling(build_model(model.config)) < trained  # random weights of the same shape do worse
