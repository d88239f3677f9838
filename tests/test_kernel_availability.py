"""No silent fallbacks: a fusion pass whose kernel op is missing (its Triton module failed to import)
is an error on a CUDA target and a printed notice on the CPU target (passes/__init__.py: kernel_ops)."""
import subprocess
import sys
import textwrap

import pytest
import torch

from dsv4c.config import ModelConfig
from dsv4c.model import KERNEL_MODULES, register_ops
from dsv4c.passes import KernelUnavailableError, KernelUnavailableWarning, PassContext, kernel_ops

CFG = ModelConfig.preset("v4-tiny-a")


def test_all_kernel_modules_import_here():
    assert register_ops() == {}  # triton is installed in the test environment


def test_register_ops_reports_a_kernel_module_that_fails_to_import(monkeypatch):
    monkeypatch.setitem(sys.modules, "dsv4c.kernels.norm", None)  # import raises ImportError
    failed = register_ops()
    assert set(failed) == {"norm"} and "halted" in failed["norm"]
    assert set(KERNEL_MODULES) > {"norm"}


def test_a_missing_op_raises_on_cuda_targets_and_warns_on_cpu():
    assert kernel_ops(PassContext(CFG, "h200"), "rms_norm") == (torch.ops.dsv4c.rms_norm.default,)
    for target in ("h200", "b200"):
        with pytest.raises(KernelUnavailableError, match=rf"target '{target}' needs dsv4c::no_such_kernel"):
            kernel_ops(PassContext(CFG, target), "rms_norm", "no_such_kernel")
    with pytest.warns(KernelUnavailableWarning, match="dsv4c::no_such_kernel is not registered"):
        assert kernel_ops(PassContext(CFG, "cpu"), "no_such_kernel") is None


_NO_TRITON = textwrap.dedent("""
    import sys, warnings
    sys.modules["triton"] = None  # as on a machine without triton
    import torch
    from dsv4c.config import ModelConfig
    from dsv4c.passes import KernelUnavailableError, PassContext
    from dsv4c.passes.fuse_rmsnorm import fuse_rmsnorm

    gm = torch.fx.symbolic_trace(lambda x: torch.rsqrt(x))
    cfg = ModelConfig.preset("v4-tiny-a")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        res = fuse_rmsnorm(gm, PassContext(cfg, "cpu"))
    print("CPU", res.changed, res.stats.get("skipped"), "|", w[0].message)
    try:
        fuse_rmsnorm(gm, PassContext(cfg, "h200"))
    except KernelUnavailableError as e:
        print("H200", e)
""")


def test_without_triton_the_pass_fails_on_h200_and_notifies_on_cpu():
    out = subprocess.run([sys.executable, "-c", _NO_TRITON], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    cpu, h200 = out.stdout.strip().splitlines()[-2:]
    assert cpu.startswith("CPU False dsv4c::rms_norm unavailable") and "dsv4c.kernels.norm: ModuleNotFoundError" in cpu
    assert h200.startswith("H200 target 'h200' needs dsv4c::rms_norm") and "dsv4c.kernels.norm" in h200
