"""examples/accuracy_slice.py's cause parts (issue 22): the fp8_block emulation the compounding part
puts in the eager model is moe_grouped_ref's function, and the cause paragraphs follow the numbers."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import accuracy_slice as acc  # noqa: E402

import dsv4c.model.moe  # noqa: E402,F401  (registers dsv4c::moe_experts)
from dsv4c import quant as Q  # noqa: E402
from dsv4c.compare import error_metrics  # noqa: E402
from dsv4c.convert import quantize_stack  # noqa: E402
from dsv4c.kernels.moe_grouped import experts_from_tensors, moe_grouped_ref  # noqa: E402


def _experts(E, I, D, g):
    def mx(w):  # MXFP4 values, as the slice's release rounding leaves them (exact in fp8_block)
        return Q.dequant_mxfp4(*Q.quant_mxfp4(w))

    w1 = torch.stack([mx(torch.randn(I, D, generator=g) * D ** -0.5) for _ in range(E)])
    w3 = torch.stack([mx(torch.randn(I, D, generator=g) * D ** -0.5) for _ in range(E)])
    w2 = torch.stack([mx(torch.randn(D, I, generator=g) * I ** -0.5) for _ in range(E)])
    return w1, w3, w2


@pytest.fixture(scope="module")
def case():
    g = torch.Generator().manual_seed(0)
    E, I, D, T, K = 4, 128, 256, 12, 2
    w1, w3, w2 = _experts(E, I, D, g)
    x = torch.randn(T, D, generator=g).bfloat16()
    idx = torch.randint(0, E, (T, K), generator=g)
    w = torch.rand(T, K, generator=g)
    fp8 = experts_from_tensors("fp8_block", **quantize_stack("fp8_block", w1, w3, w2, I, D))
    return x, idx, w, w1, w3, w2, fp8


@pytest.mark.parametrize("limit", [0.0, 0.5])
def test_fp8_emulation_is_the_reference_kernel_function(case, limit):
    x, idx, w, w1, w3, w2, fp8 = case
    ref = moe_grouped_ref(x, idx, w, fp8, limit)
    emu = acc.fp8_moe_emulated(x.float(), idx, w, w1, w3, w2, limit, ue8m0=True)
    # per-expert fp32 GEMMs vs einsum: only where h sits on an e4m3 rounding boundary can they differ
    assert error_metrics(emu, ref)["snr_db"] >= 45
    exact = torch.ops.dsv4c.moe_experts(x.float(), idx, w, w1, w3, w2, limit)
    fmt = error_metrics(emu, exact)["snr_db"]
    assert 20 < fmt < 40  # e4m3 activations: ~2^-4 relative steps, not exact and not garbage
    f32 = acc.fp8_moe_emulated(x.float(), idx, w, w1, w3, w2, limit, ue8m0=False)
    assert not torch.equal(f32, emu)  # the scale format is honoured


def _pinned(db):
    return {"pinned": {"snr_db": db}}


def _res(kernel_db, fusion_db, floor_db, graph_fp8_db=20.0):
    row = {"layer": "layers.1", "tokens": 8, "experts": 40, "kernel_vs_ref": {"snr_db": kernel_db},
           "prefill_kernel_vs_ref": {"snr_db": "inf"}, "emulated_vs_ref": {"snr_db": 55.0}, "fp8_ue8m0_vs_exact": {"snr_db": 27.0},
           "fp8_fp32_scales_vs_exact": {"snr_db": 27.4}, "weights_only_vs_exact": {"snr_db": "inf"},
           "eager_bf16_vs_exact": {"snr_db": 45.0}}
    comp = {"all_ue8m0": {"logits": {"snr_db": 20.5}, "moe_out_db": {"layers.1": 27.0}},
            "all_fp32_scales": {"logits": {"snr_db": 21.0}, "moe_out_db": {"layers.1": 27.4}},
            "single": {"layers.1": 20.5}, "predicted_all_db": 20.5}
    return {"fp8": {"kernel": [row], "compounding": comp},
            "formats": [{"format": "fp8_block", **_pinned(graph_fp8_db)}],
            "floor": {"prompt": 256, "chunks": 2, "chunked_vs_one": {"snr_db": floor_db, "max_abs_err": 0.1},
                      "batch1_vs_batch2_row0": {"snr_db": floor_db + 3}},
            "passes": {"prefill": [{"name": "export", **_pinned(math.inf)},
                                   {"name": "fuse_hc", **_pinned(fusion_db)},
                                   {"name": "quantize_experts", **_pinned(10.0)}]}}


def test_the_cause_paragraphs_follow_the_numbers():
    good = " ".join(acc.fp8_cause(_res(60.0, 35.0, 34.0)) + acc.fusion_cause(_res(60.0, 35.0, 34.0)))
    assert "are right" in good and "the format, not the kernels" in good
    assert "within the spread" in good and "35.0 dB (fuse_hc)" in good
    bad = " ".join(acc.fp8_cause(_res(30.0, 30.0, 40.0, graph_fp8_db=12.0)) +
                   acc.fusion_cause(_res(30.0, 30.0, 40.0)))
    assert "a kernel defect" in bad and "beyond the format" in bad and "bar 47.0 dB" in bad
    assert "below the spread" in bad


def test_fp8_emulation_reuses_only_exact_conversions(case):
    x, idx, w, w1, w3, w2, _ = case
    lossless: dict = {}
    first = acc.fp8_moe_emulated(x.float(), idx, w, w1, w3, w2, 0.5, lossless=lossless)
    assert lossless and all(lossless.values())  # MXFP4 values convert to fp8_block exactly
    assert torch.equal(acc.fp8_moe_emulated(x.float(), idx, w, w1, w3, w2, 0.5, lossless=lossless), first)
    off = w1 + 1e-3 * torch.randn(w1.shape, generator=torch.Generator().manual_seed(1))  # not fp8-exact
    lossy: dict = {}
    acc.fp8_moe_emulated(x.float(), idx, w, off, w3, w2, 0.5, lossless=lossy)
    assert lossy and not any(lossy.values())
