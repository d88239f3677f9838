"""Manifest provenance (dsv4c/provenance.py): the artifact records the sha256 of every module that
built it; `dsv4c inspect` shows it and `Session.load` warns (or, strict, raises) when it is stale."""
import hashlib
import json
import shutil
import warnings

import pytest

from dsv4c.compile import describe_artifact, manifest_checksum
from dsv4c.passes import default_pipeline
from dsv4c.provenance import StaleArtifactError, StaleArtifactWarning, changed_modules, check_source, source_hashes
from dsv4c.runtime import Session


@pytest.fixture(scope="module")
def art(v3_tiny_mtp_art):
    """A dense + MoE layer artifact (tests/conftest.py: shared with other files; the tests below change a copy)."""
    return v3_tiny_mtp_art / "art"


def test_every_pass_and_kernel_module_is_hashed():
    src = source_hashes()
    mods = src["modules"]
    for name, fn in default_pipeline():
        assert mods[fn.__module__] == hashlib.sha256(open(__import__(fn.__module__, fromlist=["x"]).__file__, "rb")
                                                     .read()).hexdigest(), name
    import dsv4c.kernels.norm as norm

    assert mods["dsv4c.kernels.norm"] == hashlib.sha256(open(norm.__file__, "rb").read()).hexdigest()
    assert {"dsv4c.compile", "dsv4c.model.v4", "dsv4c.runtime.session", "dsv4c.passes.pattern"} <= set(mods)
    assert source_hashes() == src  # deterministic


def test_changed_modules_names_what_differs():
    a = source_hashes()
    b = json.loads(json.dumps(a))
    assert changed_modules(a, b) == []
    b["modules"]["dsv4c.passes.fuse_rope"] = "0" * 64
    del b["modules"]["dsv4c.kernels.swiglu"]
    b["modules"]["dsv4c.passes.new_pass"] = "1" * 64
    assert changed_modules(a, b) == ["dsv4c.kernels.swiglu", "dsv4c.passes.fuse_rope", "dsv4c.passes.new_pass"]


def _stale_copy(art, dst):
    shutil.copytree(art, dst)
    m = json.loads((dst / "manifest.json").read_text())
    m["source"]["modules"]["dsv4c.passes.fuse_rmsnorm"] = "0" * 64
    m["source"]["sha256"] = "f" * 64
    m["checksum"] = manifest_checksum(m)
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


def test_artifact_records_the_source_and_load_detects_a_stale_one(art, tmp_path):
    m = json.loads((art / "manifest.json").read_text())
    assert m["source"] == source_hashes()
    assert "the running code's" in describe_artifact(art)
    with warnings.catch_warnings():
        warnings.simplefilter("error", StaleArtifactWarning)
        assert check_source(m, str(art), strict=True) == []  # same code: neither warns nor raises
    stale = _stale_copy(art, tmp_path / "stale")
    assert "differs in 1 module(s): dsv4c.passes.fuse_rmsnorm" in describe_artifact(stale)
    with pytest.raises(StaleArtifactError, match="fuse_rmsnorm"):
        Session.load(stale, strict_source=True)
    with pytest.warns(StaleArtifactWarning, match="fuse_rmsnorm.*recompile"):
        Session.load(stale)
