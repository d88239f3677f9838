"""kernels/l2_prefetch.py: the requests one launch makes (the kernel's index arithmetic under the Triton
interpreter), the wrapper's contracts, the sm_90 build, and on the GPU that a prefetch changes no value (in a
CUDA graph too)."""
from __future__ import annotations

import textwrap

import pytest
import torch
from sm90_compile import run_sm90_script

from dsv4c.kernels import l2_prefetch as L


def _coverage(rows: torch.Tensor, r: int, n: int) -> torch.Tensor:
    """How many requests of range r cover each of its n bytes."""
    cov = torch.zeros(n, dtype=torch.int32)
    for _, off, size in rows[rows[:, 0] == r].tolist():
        cov[off:off + size] += 1
    return cov


@pytest.mark.parametrize("sizes", [[16], [L.CHUNK * L.LANES], [300_016, 48, L.CHUNK * L.LANES * 3 + 32],
                                   [4096, 8192, 12288, 16384 + 16]])
def test_each_byte_is_requested_once_in_16_byte_pieces(sizes):
    """Every byte of every range is in exactly one request; requests start and end on 16-byte boundaries, no
    request is larger than CHUNK and none lies past its range."""
    ranges = [(i << 30, n) for i, n in enumerate(sizes)]
    rows = L.prefetch_plan(ranges)
    assert set(rows[:, 0].tolist()) == set(range(len(sizes)))
    assert bool((rows[:, 1] % 16 == 0).all()) and bool((rows[:, 2] % 16 == 0).all())
    assert bool((rows[:, 2] > 0).all()) and bool((rows[:, 2] <= L.CHUNK).all())
    for r, n in enumerate(sizes):
        assert bool((_coverage(rows, r, n) == 1).all()), (r, n)


def test_ranges_are_clipped_inward_to_16_bytes():
    buf = torch.zeros(4096, dtype=torch.uint8)
    w = buf[3:]  # an address 3 bytes past an aligned one
    (start, count), = L._ranges([w], [1000])
    assert start % 16 == 0 and count % 16 == 0
    assert w.data_ptr() <= start and start + count <= w.data_ptr() + 1000
    assert start - w.data_ptr() < 16 and w.data_ptr() + 1000 - (start + count) < 16
    assert L._ranges([buf[:10]], [10]) == []  # nothing whole to ask for


@pytest.mark.parametrize("case", ["strided", "too_many_bytes", "negative", "too_many", "lengths"])
def test_bad_calls_name_the_weight_and_the_limit(case):
    w = torch.zeros(64, 64)
    args = {"strided": ([w.t()], [16]), "too_many_bytes": ([w], [w.numel() * 4 + 16]), "negative": ([w], [-16]),
            "too_many": ([w] * (L.MAX_RANGES + 1), [16] * (L.MAX_RANGES + 1)), "lengths": ([w, w], [16])}[case]
    want = {"strided": r"weights\[0\].*not contiguous", "too_many_bytes": r"nbytes\[0\].*16384 bytes",
            "negative": r"nbytes\[0\] = -16", "too_many": "at most 4 weights", "lengths": "2 weights but 1"}[case]
    with pytest.raises(ValueError, match=want):
        L.l2_prefetch(*args)


def test_the_op_on_cpu_changes_nothing():
    w = torch.randn(256, 128)
    before = w.clone()
    assert torch.ops.dsv4c.l2_prefetch([w, w[:64]], [w.numel() * 4, 4096]) is None
    assert torch.equal(w, before)
    assert L.l2_prefetch_ref([w], [128]) is None


_SM90_SCRIPT = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from dsv4c.kernels import l2_prefetch as L

    fn = L._prefetch_kernel
    names = list(fn.arg_names)
    for r in (1, 4):
        consts = dict(R=r, CHUNK=4096, LANES=32, DRY_RUN=False, PDL=True)
        sig = {nm: "constexpr" if nm in consts else ("*i64" if nm == "rec_ptr" else "i64") for nm in names}
        src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1}).asm["ptx"]
        body = ptx[ptx.index(".entry"):]
        key = "cp.async.bulk.prefetch.L2.global"
        wait = body.index("griddepcontrol.wait")
        print("kernel", r, body.count(key), body[:wait].count(key), body.count("ld.global"))
''')


def test_the_kernel_builds_for_sm90_with_every_request_before_the_pdl_wait(tmp_path):
    """Compiled (not run) for sm_90: one bulk prefetch per range, all of them before the PDL wait; the kernel loads
    nothing."""
    rows = {int(r[0]): tuple(int(x) for x in r[1:]) for r in run_sm90_script(tmp_path, _SM90_SCRIPT)}
    for r in (1, 4):
        assert rows[r] == (r, r, 0)


# ---- CUDA (the device) ------------------------------------------------------------------------------
@pytest.mark.gpu
def test_a_prefetch_changes_no_value_and_captures_in_a_cuda_graph():
    """Flash's wo_b (33.5 MB of e4m3) through the one-token FP8 GEMV from a flushed L2, with and without a prefetch
    of its weight before it: the same bits; the prefetch is also captured in a CUDA graph and replayed. Whether it
    is faster depends on the card (the median GEMV after a 60k-cycle wait, run64 H200: 18.8 vs 20.4 µs cold; run65
    H100: 68.1 vs 21.3 µs, three times slower), so no target asks for it and this test times nothing."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from dsv4c.kernels.fp8_gemv import fp8_gemv_w8a16

    w = torch.randn(4096, 8192, device="cuda").to(torch.float8_e4m3fn)
    ws = torch.rand(32, 64, device="cuda") + 0.5
    a = torch.randn(1, 8192, device="cuda", dtype=torch.bfloat16)
    flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")

    def gemv(prefetch: bool) -> torch.Tensor:
        flush.zero_()
        if prefetch:
            L.l2_prefetch([w], [w.numel()])
        return fp8_gemv_w8a16(a, w, ws)

    cold = gemv(False)
    assert torch.equal(gemv(True), cold)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        L.l2_prefetch([w, w[:16]], [w.numel(), 4096])
        y = fp8_gemv_w8a16(a, w, ws)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, cold)
