"""The bundled model's decode with its dense pieces in onnxruntime and the MoE and cache ops in torch.

    python examples/onnx_roundtrip.py [--art ART] [--out DIR] [--tokens 8]

Compiles the bundled model (examples/models/v4-tiny-pystdlib) for the cpu target in fp32 unless --art
is given, exports and verifies its prefill and decode graphs' dense pieces (`dsv4c export-onnx`), then
generates greedily twice: with the plain Session, and with the same Session after `compose` swapped every
dense piece for an onnxruntime session. Prints both token lists and how many pieces ran in onnxruntime;
exits 1 if the tokens differ. CPU only.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

BUNDLE = Path(__file__).resolve().parent / "models" / "v4-tiny-pystdlib"
PROMPTS = [[0, 11, 23, 35, 47, 59], [0, 301, 7]]


def main() -> int:
    from dsv4c.compile import compile_checkpoint
    from dsv4c.onnx_export import compose, export_onnx, format_index
    from dsv4c.runtime import Session

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--art", type=Path, default=None, help="an fp32 cpu-target artifact (default: compile the bundle)")
    p.add_argument("--out", type=Path, default=None, help="where the ONNX files go (default: a temporary folder)")
    p.add_argument("--tokens", type=int, default=8)
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="dsv4c-onnx-"))
    art = a.art
    if art is None:
        art = tmp / "art"
        compile_checkpoint(BUNDLE, art, target="cpu", max_tokens=64, max_batch=2)
    out = a.out or tmp / "onnx"
    index = export_onnx(art, out, verify=True)
    print(format_index(index))
    ref = [r.tokens for r in Session.load(art, device="cpu").generate(PROMPTS, max_new_tokens=a.tokens)]
    sess = Session.load(art, device="cpu")
    mods = compose(sess, out)
    got = [r.tokens for r in sess.generate(PROMPTS, max_new_tokens=a.tokens)]
    calls = {k: sum(m.calls for m in v) for k, v in mods.items()}
    print(f"session tokens:      {ref}")
    print(f"onnx+torch tokens:   {got}")
    print(f"onnxruntime piece calls per graph: {calls} ({sum(len(v) for v in mods.values())} pieces)")
    same = ref == got and all(calls.values())
    print("same greedy tokens" if same else "MISMATCH")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
