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
# files below first, longest first (their seconds under `--durations=0` on a 2-core AMD EPYC, 2026-12-08: setup,
# call and teardown summed; a shared artifact's build counts in the file that asked first). The
# figures only order the queue: a stale one costs time, never a result. Other files keep collection order.
FILE_SECONDS = {
    "test_mtp_quantized.py": 271, "test_quantize_experts.py": 221, "test_deterministic.py": 218,
    "test_kernels_moe_grouped.py": 204, "test_bench_artifact.py": 175, "test_compare_passes.py": 172,
    "test_bench_prefix_cache.py": 159, "test_compile_session.py": 158, "test_paged_session.py": 136,
    "test_speculative_compiled.py": 127, "test_kernels_moe_fp4_gemv.py": 126, "test_kernels_v4_attention.py": 120,
    "test_kernels_batch_invariant.py": 118, "test_export_passes.py": 116, "test_batched_prefill.py": 116,
    "test_split.py": 113, "test_profile_step.py": 112, "test_fuse_hc.py": 101, "test_v4_model.py": 100,
    "test_speculative.py": 100, "test_shard_dense_fp8.py": 95, "test_kernels_moe_fp8_gemv.py": 92,
    "test_mtp_pipeline.py": 90, "test_parallel_run.py": 88, "test_fuse_hc_chain.py": 81, "test_serve.py": 76,
    "test_prefetch_weights.py": 70, "test_paged_ops.py": 70, "test_staged_inputs.py": 61,
    "test_overlap_shared_experts.py": 59,
}


def pytest_collection_modifyitems(config, items):
    """Stable sort by file: FILE_SECONDS' files first, longest first; a file's tests stay together and in order."""
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))
