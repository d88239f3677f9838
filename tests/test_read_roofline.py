"""examples/read_roofline.py (issue 6's read-stream ceiling) on the CPU: the read kernel under the
Triton interpreter touches every word exactly once, and the per-token byte count is the MXFP4
experts' size."""
from __future__ import annotations

import importlib.util
import sys
from functools import reduce
from pathlib import Path

import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _module():
    sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location("read_roofline", EXAMPLES / "read_roofline.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_reader_reads_every_word_once():
    rr = _module()
    g = torch.Generator().manual_seed(0)
    for n, steps in ((5000, 2), (4096, 4), (1, 8)):     # a partial last block, whole blocks, a single word
        buf = torch.randint(-2 ** 31, 2 ** 31 - 1, (n,), dtype=torch.int32, generator=g)
        launch, out = rr.reader(buf, steps, block=256)
        launch()
        got = reduce(lambda a, b: a ^ b, out.tolist(), 0)
        want = reduce(lambda a, b: a ^ b, buf.tolist(), 0)
        assert got == want, (n, steps)


def test_flash_token_bytes():
    rr = _module()
    w13, w2 = rr.flash_token_bytes()
    # 6 experts; W1 and W3: 2 x 2048 x 4096 e2m1 (half a byte) + one e8m0 byte per 32 weights; W2 the same size / 2
    assert w13 == 6 * (2 * 2048 * 4096) * 17 // 32
    assert w2 == 6 * (2048 * 4096) * 17 // 32
