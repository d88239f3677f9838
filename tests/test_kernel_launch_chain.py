"""The step-wide PDL chain's invariant (ARCHITECTURE.md §10, kernels/_tl.py): every Triton kernel of
kernels/ waits for its predecessor (`pdl_wait(PDL)`) before it loads or stores anything, and every launch
asks for programmatic dependent launch (`**pdl_launch(t)`, or the FP4 GEMV chain's own `launch_pdl`).
Read from the source: a new kernel that forgets either fails here, not as a race on some GPU."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parent.parent / "kernels"
# kernels that request inputs fixed before the chain started (expert weights, routing, mHC's fn) ahead of the wait
EARLY_READS = {("moe_fp4_gemv.py", "_gemv13_kernel"), ("moe_fp4_gemv.py", "_gemv2_kernel"),
               ("moe_fp8_gemv.py", "_gemv13_kernel"), ("moe_fp8_gemv.py", "_gemv2_kernel"),
               ("mhc.py", "_hc_post_mix_kernel"),
               ("l2_prefetch.py", "_prefetch_kernel")}  # its L2 prefetches of weights (its dry run's records: PDL off)
MEMORY_OPS = {"load", "store", "atomic_add", "atomic_max", "atomic_min", "atomic_cas", "atomic_xchg"}


def _is_jit(fn: ast.FunctionDef) -> bool:
    return any(ast.unparse(d).startswith(("triton.jit", "jit")) for d in fn.decorator_list)


def _calls(node: ast.AST) -> list[ast.Call]:
    """Calls in source order (including those inside helper calls' arguments)."""
    found = [n for n in ast.walk(node) if isinstance(n, ast.Call)]
    return sorted(found, key=lambda c: (c.lineno, c.col_offset))


def _name(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _kernels():
    for path in sorted(KERNELS.glob("*.py")):
        tree = ast.parse(path.read_text())
        helpers = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef) and _is_jit(f)}
        for fn in helpers.values():
            if fn.name.endswith("_kernel"):
                yield path.name, fn, helpers


def _first_wait_or_memory(fn: ast.FunctionDef, helpers: dict, seen: set) -> str | None:
    """'wait' if the kernel's first memory-touching call (following same-file jit helpers) is the PDL
    wait, 'memory' if a load/store/atomic comes first, None if neither happens."""
    for c in _calls(fn):
        name = _name(c)
        if name == "pdl_wait":
            return "wait"
        if name in MEMORY_OPS and ast.unparse(c.func).startswith("tl."):
            return "memory"
        if name in helpers and name not in seen:
            got = _first_wait_or_memory(helpers[name], helpers, seen | {name})
            if got:
                return got
    return None


KERNEL_CASES = [(f, fn.name) for f, fn, _ in _kernels()]


def test_the_kernel_list_is_read():
    names = {k for _, k in KERNEL_CASES}
    assert len(KERNEL_CASES) >= 30 and {"_rms_norm_kernel", "_argmax_part_kernel", "_gemv13_kernel"} <= names


def _waits(fn: ast.FunctionDef, helpers: dict, seen: set) -> bool:
    """The kernel calls pdl_wait somewhere (itself or through a same-file jit helper)."""
    return any(_name(c) == "pdl_wait" or (_name(c) in helpers and _name(c) not in seen
                                          and _waits(helpers[_name(c)], helpers, seen | {_name(c)}))
               for c in _calls(fn))


@pytest.mark.parametrize("file,kernel", KERNEL_CASES)
def test_every_kernel_waits_before_touching_memory(file, kernel):
    fn, helpers = next((fn, h) for f, fn, h in _kernels() if (f, fn.name) == (file, kernel))
    assert "PDL" in [a.arg for a in fn.args.args], f"{file}:{kernel} takes no PDL constexpr"
    if (file, kernel) in EARLY_READS:   # documented early reads: the wait must still come
        assert _waits(fn, helpers, set()), f"{file}:{kernel} never calls pdl_wait"
    else:
        assert _first_wait_or_memory(fn, helpers, set()) == "wait", \
            f"{file}:{kernel} touches memory before pdl_wait(PDL)"


def _launches():
    """(file, kernel, launch call, source of the function that launches it) for every `kernel[grid](...)`."""
    for path in sorted(KERNELS.glob("*.py")):
        tree = ast.parse(path.read_text())
        jit = {f.name for f in tree.body if isinstance(f, ast.FunctionDef) and _is_jit(f)}
        for outer in ast.walk(tree):
            if not isinstance(outer, ast.FunctionDef) or outer.name in jit:
                continue
            for node in ast.walk(outer):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                        and isinstance(node.func.value, ast.Name) and node.func.value.id in jit):
                    yield path.name, node.func.value.id, node, ast.unparse(outer)


def test_every_launch_asks_for_pdl():
    launches = list(_launches())
    assert len(launches) >= 30
    for file, kernel, call, outer in launches:
        kws = [ast.unparse(k) for k in call.keywords]
        ok = (any(k.startswith(("**pdl_launch(", "**U.pdl_launch(")) for k in kws)
              or ("**launch" in kws and "'launch_pdl': True" in outer))   # the FP4 GEMV chain's own switch
        assert ok, f"{file}: the launch of {kernel} at line {call.lineno} passes no **pdl_launch(...)"
