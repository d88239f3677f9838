"""Which source built an artifact: the sha256 of every module of the package (dsv4c, its passes,
runtime and kernels), recorded in the manifest as

    "source": {"sha256": <hash of the whole table>, "modules": {"dsv4c.passes.fuse_rope": <sha256>, ...}}

Two artifacts built by the same code have the same `sha256`; `changed_modules` names the modules
where two tables differ, so a stale artifact (compiled before a pass or kernel changed) is detected
by name rather than by a hand-bumped format number. `Session.load` warns on a stale artifact
(`StaleArtifactWarning`) and raises with `strict_source=True`; `dsv4c inspect` shows the comparison.
"""
from __future__ import annotations

import hashlib
import importlib
import warnings
from pathlib import Path

PACKAGES = ("dsv4c", "dsv4c.passes", "dsv4c.runtime", "dsv4c.kernels")


class StaleArtifactWarning(UserWarning):
    """The artifact was compiled by other source than the running dsv4c (modules named)."""


class StaleArtifactError(RuntimeError):
    """`strict_source=True`: the artifact was compiled by other source than the running dsv4c."""


def _package_files(package: str) -> dict[str, Path]:
    """dotted module name -> file, for the .py files of `package` and its subpackages, except the
    other PACKAGES (in a wheel dsv4c/passes lies inside dsv4c/; each is hashed under its own name)."""
    root = Path(importlib.import_module(package).__path__[0])
    others = [p for p in PACKAGES if p.startswith(package + ".")]
    out = {}
    for f in sorted(root.rglob("*.py")):
        name = ".".join([package, *(p for p in f.relative_to(root).with_suffix("").parts if p != "__init__")])
        if "__pycache__" in f.parts or any(name == p or name.startswith(p + ".") for p in others):
            continue
        out[name] = f
    return out


def source_hashes() -> dict:
    """The running code's source table (see the module docstring)."""
    modules = {}
    for pkg in PACKAGES:
        for name, f in _package_files(pkg).items():
            modules[name] = hashlib.sha256(f.read_bytes()).hexdigest()
    modules = dict(sorted(modules.items()))
    total = hashlib.sha256("".join(f"{k}={v}\n" for k, v in modules.items()).encode()).hexdigest()
    return {"sha256": total, "modules": modules}


def changed_modules(a: dict, b: dict) -> list[str]:
    """The modules whose source differs between two source tables (added or removed ones included)."""
    ma, mb = a.get("modules", {}), b.get("modules", {})
    return sorted(k for k in set(ma) | set(mb) if ma.get(k) != mb.get(k))


def describe_source(manifest: dict, current: dict | None = None) -> str:
    """One line for `dsv4c inspect`: the artifact's source hash and how it compares to the running code."""
    src = manifest.get("source")
    if src is None:
        return "not recorded (compiled before source provenance)"
    current = source_hashes() if current is None else current
    if src["sha256"] == current["sha256"]:
        return f"{src['sha256'][:12]}, the running code's"
    changed = changed_modules(src, current)
    return (f"{src['sha256'][:12]}; the running code differs in {len(changed)} module(s): "
            f"{', '.join(changed[:8])}{' ...' if len(changed) > 8 else ''}")


def check_source(manifest: dict, where: str, strict: bool = False) -> list[str]:
    """Compare an artifact's source table with the running code: warn (or with `strict` raise) when they
    differ, naming the modules. Returns the changed modules (empty: same code, or nothing recorded)."""
    src = manifest.get("source")
    if src is None:
        if strict:
            raise StaleArtifactError(f"{where}: the manifest records no source hashes (compiled before source "
                                     f"provenance); recompile it")
        return []
    current = source_hashes()
    if src["sha256"] == current["sha256"]:
        return []
    changed = changed_modules(src, current)
    msg = (f"{where}: compiled by other dsv4c source than is running ({len(changed)} module(s) differ: "
           f"{', '.join(changed[:8])}{' ...' if len(changed) > 8 else ''}); recompile for the current passes and kernels")
    if strict:
        raise StaleArtifactError(msg)
    warnings.warn(msg, StaleArtifactWarning, stacklevel=3)
    return changed
