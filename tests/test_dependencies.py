"""pyproject.toml says what the package needs: every third-party module that dsv4c, passes, runtime or
kernels import is a declared dependency, or an optional extra's (then imported lazily, inside a
function, as `OPTIONAL` lists); and every declared dependency is imported somewhere."""
import ast
import re
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("dsv4c", "passes", "runtime", "kernels")
DIST = {}  # import name -> distribution name, where they differ (e.g. "yaml": "pyyaml")
OPTIONAL = {"matplotlib": "plot", "onnxruntime": "onnx", "fastapi": "serve", "uvicorn": "serve",
            "prometheus_client": "serve", "pydantic": "serve", "jinja2": "serve"}  # import name -> its extra
DIST = {**DIST, "prometheus_client": "prometheus-client"}
# modules that are themselves optional (imported only inside functions, e.g. by `dsv4c serve`): they may
# import their extra's packages at module level
OPTIONAL_MODULES = {"runtime/serve.py": "serve"}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _req_name(req: str) -> str:
    return re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].strip().lower().replace("_", "-")


def _imports(package: bool = False) -> dict[str, list[tuple[str, bool]]]:
    """third-party top-level module -> [(file:line, imported at module level)]; with `package`, the
    package's own modules by full name instead."""
    out: dict[str, list[tuple[str, bool]]] = {}
    for d in PACKAGE_DIRS:
        for f in sorted((ROOT / d).rglob("*.py")):
            tree = ast.parse(f.read_text())
            top = {id(n) for n in tree.body}
            for n in ast.walk(tree):
                if isinstance(n, ast.Import):
                    names = [a.name for a in n.names]
                elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
                    names = [n.module]
                else:
                    continue
                for name in names:
                    mod = name.split(".")[0]
                    if package:
                        if mod == "dsv4c":
                            out.setdefault(name, []).append((f"{f.relative_to(ROOT)}:{n.lineno}", id(n) in top))
                        continue
                    if mod in sys.stdlib_module_names or mod == "dsv4c":
                        continue
                    out.setdefault(mod, []).append((f"{f.relative_to(ROOT)}:{n.lineno}", id(n) in top))
    return out


def _package_imports() -> dict[str, list[tuple[str, bool]]]:
    return _imports(package=True)


def test_every_import_is_declared_and_every_dependency_used():
    proj = _pyproject()["project"]
    required = {_req_name(r) for r in proj["dependencies"]}
    extras = {k: {_req_name(r) for r in v} for k, v in proj["optional-dependencies"].items()}
    imports = _imports()
    assert {"torch", "safetensors", "triton"} <= set(imports)  # the scan sees the package
    for mod, sites in imports.items():
        dist = DIST.get(mod, mod).lower()
        if dist in required:
            continue
        extra = OPTIONAL.get(mod)
        assert extra is not None, f"{mod} is imported ({sites[0][0]}) but not in [project] dependencies"
        assert dist in extras.get(extra, set()), f"{mod}: the {extra!r} extra does not list {dist}"
        eager = [s for s, at_top in sites if at_top and OPTIONAL_MODULES.get(s.split(":")[0]) != extra]
        assert not eager, f"{mod} is optional ({extra!r} extra) but imported at module level: {eager}"
    for path in OPTIONAL_MODULES:  # an optional module is imported lazily everywhere in the package
        name = "dsv4c." + path[:-3].replace("/", ".")
        eager = [s for m, sites in _package_imports().items() if m == name for s, at_top in sites if at_top]
        assert not eager, f"{name} is optional but imported at module level: {eager}"
    used = {DIST.get(m, m).lower() for m in imports}
    assert required <= used, f"declared but never imported: {sorted(required - used)}"


def test_triton_is_a_runtime_dependency_on_linux():
    deps = _pyproject()["project"]["dependencies"]
    triton = [r for r in deps if _req_name(r) == "triton"]
    assert triton and "platform_system == 'Linux'" in triton[0]
