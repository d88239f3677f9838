import os
import sys

import torch

# The repository's kernels/ folder is the package dsv4c.kernels (pyproject's package-dir). With the root on
# sys.path (`python -m pytest` puts the working directory there, in xdist's workers too) it would also import as
# the top-level `kernels`, in place of Hugging Face's `kernels` package, which transformers (the oracle) imports.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]
sys.path.insert(0, os.path.dirname(__file__))  # tests/oracle.py and other helpers

# The test models are tiny: one thread avoids oversubscription on 2-core CI machines.
torch.set_num_threads(1)

# Triton kernels run under the interpreter on CPU-only machines. triton.jit decides interpreter vs
# compiler when a kernel module is imported, and any test may import them first (register_ops loads
# the quantised-expert op), so the switch is set here, before every test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# ---- artifacts shared by several test files --------------------------------------------------------
# A compile is most of a test file's setup. The artifacts below serve several files; under xdist each is
# built once per run (the first worker to ask builds it under a file lock in the run's shared temp folder,
# the others wait and read it), without xdist once per session. Tests only read them (copy to change).
import pytest  # noqa: E402


def _shared(tmp_path_factory, worker_id: str, name: str, build):
    """`build(folder)` into a folder shared by this run's workers, once; returns the folder."""
    from filelock import FileLock

    if worker_id == "master":  # no xdist: this process is the run
        root = tmp_path_factory.getbasetemp() / "shared"
    else:  # xdist: each worker's basetemp is <run's basetemp>/popen-gwN
        root = tmp_path_factory.getbasetemp().parent / "shared"
    root.mkdir(exist_ok=True)
    d = root / name
    with FileLock(str(root / f"{name}.lock")):
        if not (d / ".complete").exists():
            if d.exists():
                import shutil

                shutil.rmtree(d)  # a build that failed in another worker: start over
            d.mkdir()
            build(d)
            (d / ".complete").touch()
    return d


@pytest.fixture(scope="session")
def v3_tiny_mtp_art(tmp_path_factory, worker_id):
    """cut_presets.small('v3-tiny') (one dense, one MoE layer), random fp32 checkpoint (seed 1) in `ckpt`,
    compiled for the cpu target with --mtp 2 (prefill, decode, verify, mtp, verify_mtp) into `art`."""
    def build(d):
        from cut_presets import small

        from dsv4c import write_random_checkpoint
        from dsv4c.compile import compile_checkpoint

        write_random_checkpoint(small("v3-tiny"), d / "ckpt", seed=1, dtype=torch.float32)
        compile_checkpoint(d / "ckpt", d / "art", target="cpu", max_tokens=32, max_batch=2, mtp_k=2)

    return _shared(tmp_path_factory, worker_id, "v3-tiny-mtp", build)


@pytest.fixture(scope="session")
def bundle2_art(tmp_path_factory, worker_id):
    """The bundled model's first two layers (cut_presets.bundle_cut: trained weights, MTP block, tokenizer)
    in `ckpt`, compiled for the cpu target (max_tokens 64, max_batch 8, no MTP graphs) into `art`."""
    def build(d):
        from cut_presets import bundle_cut

        from dsv4c.compile import compile_checkpoint

        compile_checkpoint(bundle_cut(d / "ckpt", 2), d / "art", target="cpu", max_tokens=64, max_batch=8)

    return _shared(tmp_path_factory, worker_id, "bundle2", build)


# ---- scheduling: the longest files first -----------------------------------------------------------
# `-n 2 --dist loadfile` hands each worker whole files. xdist's default (--loadscope-reorder) queues files by
# their number of tests, which put the few-test, minute-long integration files last, where one of them ran on
# alone while the other worker sat idle. pyproject's addopts turn that reorder off, and this hook queues the
# files below first, longest first (their seconds under `--durations=0` on a 2-core machine, 2026-12-07). The
# figures only order the queue: a stale one costs time, never a result. Other files keep collection order.
FILE_SECONDS = {
    "test_mtp_quantized.py": 102, "test_bench_artifact.py": 94, "test_quantize_experts.py": 79,
    "test_deterministic.py": 78, "test_compare_passes.py": 68, "test_bench_prefix_cache.py": 66,
    "test_compile_session.py": 60, "test_kernels_moe_grouped.py": 57, "test_paged_session.py": 49,
    "test_profile_step.py": 47, "test_speculative_compiled.py": 47, "test_kernels_moe_fp4_gemv.py": 46,
    "test_kernels_v4_attention.py": 45, "test_kernels_batch_invariant.py": 43, "test_export_passes.py": 42,
    "test_batched_prefill.py": 41, "test_speculative.py": 40, "test_fuse_hc.py": 37,
    "test_kernels_moe_fp8_gemv.py": 36, "test_parallel_run.py": 35, "test_v4_model.py": 35,
    "test_shard_dense_fp8.py": 35, "test_mtp_pipeline.py": 34, "test_serve.py": 32, "test_prefetch_weights.py": 29,
    "test_staged_inputs.py": 60,  # added in the forty-second session (118 s beside a CI run: a guess alone)
}


def pytest_collection_modifyitems(config, items):
    """Stable sort by file: FILE_SECONDS' files first, longest first; a file's tests stay together and in order."""
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))
