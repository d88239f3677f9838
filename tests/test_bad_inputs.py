"""Bad inputs, table-driven: every one exits with code 2 and a one-line message naming the file, field or
limit (no traceback), before any heavy work, and leaves nothing lost or half-written on disk. Also the
malicious artifact: a pickle planted in a graph archive (manifest hashes recomputed) is refused by name
and never runs. One compile (the bundled model's config and tokenizer, 2 layers) serves the module
(`--max-batch 1`: single-stream artifacts compile and run)."""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pickle
import shutil
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from dsv4c.cli import main

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / "examples" / "models" / "v4-tiny-pystdlib"


def cli(*argv, stdin: bytes | None = None) -> tuple[int, str, str]:
    """`dsv4c.cli.main` in process: (exit code, stdout, stderr); argparse's SystemExit becomes the code."""
    out, err = io.StringIO(), io.StringIO()
    old_stdin = sys.stdin
    if stdin is not None:
        sys.stdin = io.TextIOWrapper(io.BytesIO(stdin))
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main([str(a) for a in argv])
            except SystemExit as e:
                rc = e.code
    finally:
        sys.stdin = old_stdin
    return rc, out.getvalue(), err.getvalue()


def tree(folder: Path) -> dict[str, str]:
    """Every file under `folder` (hidden ones too) -> sha256: what must survive a refused command."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def clone(art: Path, dst: Path) -> Path:
    """A copy of the artifact made of hard links (cheap); edits must replace files, never write into them."""
    shutil.copytree(art, dst, copy_function=os.link)
    return dst


def replace(path: Path, data: bytes) -> None:
    path.unlink()
    path.write_bytes(data)


def rehash(art: Path) -> None:
    """Recompute the manifest's file table and checksum, as an attacker can."""
    from dsv4c.compile import _file_table, _write_manifest

    m = json.loads((art / "manifest.json").read_text())
    m["files"] = _file_table(art)
    (art / "manifest.json").unlink()
    _write_manifest(art, m)


@pytest.fixture(scope="module")
def art(tmp_path_factory) -> Path:
    """The bundled model's config cut to 2 layers (a third of the compile time), random weights, its
    tokenizer; compiled once through the CLI with --max-batch 1."""
    import dataclasses

    from dsv4c import ModelConfig, write_random_checkpoint

    d = tmp_path_factory.mktemp("bad")
    cfg = ModelConfig.from_pretrained(BUNDLE)
    cfg = dataclasses.replace(cfg, num_hidden_layers=2, compress_ratios=(0, 4, 0), quantization_config=None)
    write_random_checkpoint(cfg, d / "ckpt", seed=0)
    shutil.copyfile(BUNDLE / "tokenizer.json", d / "ckpt" / "tokenizer.json")
    rc, _, err = cli("compile", d / "ckpt", "--target", "cpu", "-o", d / "art", "--max-tokens", "64",
                     "--max-batch", "1")
    assert rc == 0, err
    return d / "art"


@pytest.fixture(scope="module")
def session(art):
    from dsv4c.runtime import Session

    return Session.load(art)


# argv ({art}: the compiled artifact, {tmp}: a scratch folder, {file}: an existing file), the strings the
# message must hold, and whether the command may get as far as loading the artifact (never, here)
ROWS = [
    ("compile_max_tokens_0", ["compile", BUNDLE, "--target", "cpu", "-o", "{tmp}/out", "--max-tokens", "0"],
     ["--max-tokens", "at least 1", "got 0"]),
    ("compile_max_tokens_negative", ["compile", BUNDLE, "--target", "cpu", "-o", "{tmp}/out", "--max-tokens", "-5"],
     ["--max-tokens", "at least 1", "got -5"]),
    ("compile_max_batch_0", ["compile", BUNDLE, "--target", "cpu", "-o", "{tmp}/out", "--max-batch", "0"],
     ["--max-batch", "at least 1"]),
    ("compile_output_is_a_file", ["compile", BUNDLE, "--target", "cpu", "-o", "{file}"],
     ["{file}", "not a folder"]),
    ("compile_output_not_empty", ["compile", BUNDLE, "--target", "cpu", "-o", "{art}"],
     ["{art}", "not empty", "--force"]),
    ("compile_force_onto_non_artifact", ["compile", BUNDLE, "--target", "cpu", "-o", "{tmp}/full", "--force"],
     ["{tmp}/full", "only a dsv4c artifact", "manifest.json"]),
    ("compile_missing_checkpoint", ["compile", "{tmp}/nowhere", "--target", "cpu", "-o", "{tmp}/out"],
     ["nowhere"]),
    ("compile_non_json_config", ["compile", "{tmp}/badcfg", "--target", "cpu", "-o", "{tmp}/out"],
     ["config.json"]),
    ("run_max_new_tokens_0", ["run", "{art}", "--prompt", "x", "--max-new-tokens", "0"],
     ["--max-new-tokens", "at least 1", "got 0"]),
    ("run_max_new_tokens_negative", ["run", "{art}", "--prompt", "x", "--max-new-tokens", "-1"],
     ["--max-new-tokens", "at least 1", "got -1"]),
    ("run_prompt_not_utf8", ["run", "{art}", "--prompt", "def f(\udcff):"],  # argv bytes b"\xff" (surrogateescape)
     ["--prompt", "UTF-8", "0xff"]),
    ("run_prompt_file_not_utf8", ["run", "{art}", "--prompt-file", "{tmp}/latin1.txt"],
     ["latin1.txt", "UTF-8", "0xe9", "offset 7"]),
    ("run_prompt_file_missing", ["run", "{art}", "--prompt-file", "{tmp}/none.txt"], ["none.txt"]),
    ("run_device_tpu", ["run", "{art}", "--prompt", "x", "--device", "tpu"], ["--device", "tpu", "cpu or cuda"]),
    ("run_device_cuda_without_gpu", ["run", "{art}", "--prompt", "x", "--device", "cuda"],
     ["--device", "no CUDA GPU"]),
    ("run_mtp_above_the_artifacts_k", ["run", "{art}", "--prompt", "x", "--mtp", "99"], ["--mtp 99", "--mtp 0"]),
    ("run_mtp_not_a_number", ["run", "{art}", "--prompt", "x", "--mtp", "many"], ["--mtp", "auto"]),
    ("run_missing_artifact", ["run", "{tmp}/nowhere", "--prompt", "x"], ["nowhere", "manifest.json"]),
    ("run_presence_penalty_3", ["run", "{art}", "--prompt", "x", "--presence-penalty", "3"],
     ["--presence-penalty", "[-2, 2]", "got 3"]),
    ("run_repetition_penalty_0", ["run", "{art}", "--prompt", "x", "--repetition-penalty", "0"],
     ["--repetition-penalty", "(0, 2]"]),
    ("bench_batch_0", ["bench", "{art}", "--batch", "0"], ["--batch", "at least 1", "got 0"]),
    ("bench_output_len_0", ["bench", "{art}", "--output-len", "0"], ["--output-len", "at least 1"]),
    ("bench_mtp_above_the_artifacts_k", ["bench", "{art}", "--mtp", "3"], ["--mtp 3", "--mtp 0"]),
    ("inspect_plan_dir_inside_the_artifact", ["inspect", "{art}", "--plan", "--plan-dir", "{art}/plan"],
     ["--plan-dir", "inside the artifact"]),
]


@pytest.mark.parametrize("argv,names", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_bad_input_exits_2_naming_the_problem(argv, names, art, tmp_path, monkeypatch):
    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    (tmp_path / "file").write_text("not a folder\n")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("keep me\n")
    (tmp_path / "badcfg").mkdir()
    (tmp_path / "badcfg" / "config.json").write_text("{not json")
    (tmp_path / "latin1.txt").write_bytes("def caf\xe9():".encode("latin-1"))
    fmt = {"art": art, "tmp": tmp_path, "file": tmp_path / "file"}
    argv = [a.format(**fmt) if isinstance(a, str) else a for a in argv]
    before_art, before_tmp = tree(art), tree(tmp_path)

    from dsv4c.runtime import Session

    def no_load(*a, **k):
        raise AssertionError("the artifact was loaded before the bad input was refused")

    monkeypatch.setattr(Session, "load", no_load)  # every row is refused before any heavy work
    monkeypatch.chdir(tmp_path)
    rc, out, err = cli(*argv)
    assert rc == 2, (rc, err)
    lines = [ln for ln in err.splitlines() if ln.startswith("dsv4c")]
    assert lines and "error" in lines[-1] and "Traceback" not in err, err
    for s in names:
        assert s.format(**fmt) in err, (s, err)
    assert tree(art) == before_art  # nothing lost or changed
    assert tree(tmp_path) == before_tmp and not (tmp_path / "out").exists()  # nothing half-written


@pytest.mark.parametrize("damage", ["truncated_weights", "flipped_graph_byte", "missing_file", "edited_manifest",
                                    "path_outside", "symlink_outside"])
def test_damaged_artifact_is_named_before_loading(damage, art, tmp_path):
    bad = clone(art, tmp_path / "art")
    w = sorted((bad / "weights").glob("*.safetensors"))[0]
    m = json.loads((bad / "manifest.json").read_text())
    if damage == "truncated_weights":
        replace(w, w.read_bytes()[:-100])
        names = [w.name, "size"]
    elif damage == "flipped_graph_byte":
        g = bad / "graphs" / "decode.pt2"
        data = bytearray(g.read_bytes())
        data[len(data) // 2] ^= 0x01
        replace(g, bytes(data))
        names = ["decode.pt2", "sha256"]
    elif damage == "missing_file":
        (bad / "tokenizer.json").unlink()
        names = ["tokenizer.json", "missing"]
    elif damage == "edited_manifest":
        m["limits"]["max_tokens"] = 4096
        replace(bad / "manifest.json", json.dumps(m).encode())
        names = ["manifest.json", "checksum"]
    elif damage == "path_outside":
        m["graphs"]["decode"]["file"] = "../../outside.pt2"
        (bad / "manifest.json").unlink()
        from dsv4c.compile import _write_manifest

        _write_manifest(bad, m)
        names = ["graphs.decode.file", "../../outside.pt2", "inside the artifact"]
    else:
        (tmp_path / "elsewhere.json").write_text((bad / "tokenizer.json").read_text())
        (bad / "tokenizer.json").unlink()
        (bad / "tokenizer.json").symlink_to(tmp_path / "elsewhere.json")
        rehash(bad)
        names = ["tokenizer.json", "outside the artifact"]
    rc, _, err = cli("run", bad, "--prompt", "x", "--max-new-tokens", "1")
    assert rc == 2, err
    assert "Traceback" not in err
    for s in names:
        assert s in err, (s, err)
    assert tree(art)  # the original, hard-linked, is untouched
    from dsv4c.compile import read_manifest

    read_manifest(art)


class _Marker:
    """Unpickling this creates the marker file (a stand-in for any code an attacker would run)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _rebuild_pt2(path: Path, entries: dict[str, bytes]) -> None:
    """Rewrite a .pt2 archive with some entries replaced or added (names relative to its root folder)."""
    src = zipfile.ZipFile(io.BytesIO(path.read_bytes()))
    root = src.namelist()[0].split("/", 1)[0]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for info in src.infolist():
            rel = info.filename.split("/", 1)[1]
            z.writestr(info.filename, entries.pop(rel, src.read(info.filename)))
        for rel, data in entries.items():
            z.writestr(f"{root}/{rel}", data)
    replace(path, buf.getvalue())


def test_a_pickle_planted_in_a_graph_archive_never_runs(art, tmp_path):
    """The issue's attack: decode.pt2's sample-inputs entry replaced by a pickle that creates a file, the
    manifest's hashes recomputed. Loading refuses it by file and entry, and the pickle never runs."""
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Marker(str(marker)), protocol=4)
    bad = clone(art, tmp_path / "art")
    _rebuild_pt2(bad / "graphs" / "decode.pt2", {"data/sample_inputs/model.pt": payload})
    rehash(bad)
    from dsv4c.compile import read_manifest

    read_manifest(bad)  # the hashes pass: they catch accidents, not attacks
    rc, _, err = cli("run", bad, "--prompt", "def f(x):", "--max-new-tokens", "2")
    assert rc == 2 and "Traceback" not in err, err
    assert "decode.pt2" in err and "data/sample_inputs/model.pt" in err and "sample inputs" in err, err
    assert not marker.exists()
    from dsv4c.artifact_safety import UnsafeArtifactError
    from dsv4c.runtime import Session

    with pytest.raises(UnsafeArtifactError, match="decode.pt2: entry data/sample_inputs/model.pt"):
        Session.load(bad)
    assert not marker.exists()
    # the payload is live: torch.export.load hands this entry to torch.load(weights_only=False) after
    # weights_only=True fails (torch/_export/serde/serialize.py: deserialize_torch_artifact)
    with pytest.raises(Exception):
        torch.load(io.BytesIO(payload), weights_only=True)
    with pytest.raises(RuntimeError, match="magic number"):  # ... after the pickle ran
        torch.load(io.BytesIO(payload), weights_only=False)
    assert marker.exists()


def test_pickled_entries_are_refused_by_name(art, tmp_path):
    """The other pickles torch.export.load would unpickle: a weight marked use_pickle, an opaque object."""
    from dsv4c.artifact_safety import UnsafeArtifactError, checked_bytes

    bad = clone(art, tmp_path / "art")
    g = bad / "graphs" / "decode.pt2"
    cfg = {"config": {"w": {"path_name": "weight_0", "is_param": True, "use_pickle": True, "tensor_meta": None}}}
    _rebuild_pt2(g, {"data/weights/model_weights_config.json": json.dumps(cfg).encode(),
                     "data/weights/weight_0": pickle.dumps(_Marker(str(tmp_path / "pwned")))})
    with pytest.raises(UnsafeArtifactError, match=r"decode.pt2: entry data/weights/model_weights_config.json .*"
                                                  r"pickled: \['w'\]"):
        checked_bytes(bad, "graphs/decode.pt2")
    _rebuild_pt2(g, {"data/weights/model_weights_config.json": b'{"config": {}}',
                     "data/constants/opaque_obj_0": pickle.dumps(_Marker(str(tmp_path / "pwned")))})
    with pytest.raises(UnsafeArtifactError, match="entry data/(weights/weight_0 is a pickle|constants/opaque_obj_0)"):
        checked_bytes(bad, "graphs/decode.pt2")
    assert not (tmp_path / "pwned").exists()


def test_max_batch_1_artifact_runs_and_a_bare_string_is_one_prompt(art, session):
    m = json.loads((art / "manifest.json").read_text())
    assert m["limits"]["max_batch"] == 1 and m["limits"]["cache_slots"] == 2
    one = session.generate("def f(x):", max_new_tokens=3)
    assert len(one) == 1 and len(one[0].tokens) == 3
    assert one[0].prompt_ids == session.generate(["def f(x):"], max_new_tokens=1)[0].prompt_ids
    two = session.generate(["def f(x):", "class A:"], max_new_tokens=2)  # one slot: served one after the other
    assert [r.tokens for r in two][0] == one[0].tokens[:2]
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_new_tokens: must be an integer >= 1"):
            session.generate("x", max_new_tokens=bad)
    with pytest.raises(ValueError, match="prompt: not valid UTF-8 .*0xff"):
        session.generate("a\udcffb", max_new_tokens=1)


def test_run_prefills_in_chunks_of_max_num_batched_tokens(art, session, monkeypatch):
    """`dsv4c run --max-num-batched-tokens 2`: the Session loads with 2-token prefill calls, and a 9-token prompt
    gives the tokens of the default chunking."""
    from dsv4c.runtime import Session

    seen = {}
    real = Session.load.__func__

    def load(cls, *args, **kw):
        seen.update(kw)
        return real(cls, *args, **kw)

    monkeypatch.setattr(Session, "load", classmethod(load))
    rc, out, err = cli("run", art, "--prompt-ids", "5,6,7,8,9,10,11,12,13", "--max-new-tokens", "3",
                       "--max-num-batched-tokens", "2", "--stats")
    assert rc == 0, err
    assert seen["max_num_batched_tokens"] == 2
    want = session.generate([[5, 6, 7, 8, 9, 10, 11, 12, 13]], max_new_tokens=3)[0].text
    line, stats = out.splitlines()[:2]
    assert line == "5,6,7,8,9,10,11,12,13" + want and "prefill chunks 5]" in stats  # ceil(9 / 2) calls


def test_run_reads_prompt_files_and_stdin(art, session, tmp_path, monkeypatch):
    from dsv4c.runtime import Session

    monkeypatch.setattr(Session, "load", lambda *a, **k: session)  # the module's session: no second load
    (tmp_path / "p.txt").write_text("def g(y):")
    rc, out, err = cli("run", art, "--prompt-file", tmp_path / "p.txt", "--prompt-file", "-", "--max-new-tokens",
                       "2", stdin="class B:".encode())
    assert rc == 0, err
    want = [r.text for r in session.generate(["def g(y):", "class B:"], max_new_tokens=2)]
    assert out == f"def g(y):{want[0]}\nclass B:{want[1]}\n"


def test_inspect_plan_writes_to_the_current_folder_not_the_artifact(art, tmp_path, monkeypatch):
    before = tree(art)
    monkeypatch.chdir(tmp_path)
    rc, out, err = cli("inspect", art, "--plan")
    assert rc == 0, err
    assert (tmp_path / "art.plan" / "decode.plan.dot").read_text().startswith("digraph")
    assert tree(art) == before


def test_version_and_defaults_in_help():
    import dsv4c

    rc, out, _ = cli("--version")
    assert rc == 0 and out.strip().startswith(f"dsv4c {dsv4c.__version__}")
    rc, out, _ = cli("compile", "--help")
    assert rc == 0 and "(default: 4096)" in out and "(default: 8)" in out
    rc, out, _ = cli("run", "--help")
    assert "(default: 32)" in out and "--prompt-file" in out


def test_failed_or_interrupted_compile_leaves_the_previous_artifact(art, tmp_path, monkeypatch):
    """compile writes into a staging folder beside -o; a failure (or Ctrl-C) removes it and leaves the
    previous artifact as it was; success replaces it whole."""
    import dsv4c.compile as comp

    prev = clone(art, tmp_path / "art")
    before = tree(prev)
    for exc in (comp.ArtifactError("boom"), KeyboardInterrupt()):
        def fail(tmp, final, exc=exc, **kw):
            (tmp / "graphs" / "decode.pt2").write_bytes(b"half")  # work done before the failure
            raise exc

        monkeypatch.setattr(comp, "_compile_into", fail)
        with pytest.raises(type(exc)):
            comp.compile_checkpoint(BUNDLE, prev, target="cpu", max_tokens=64, max_batch=1, force=True)
        assert tree(prev) == before
        assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]  # no staging folder left

    def succeed(tmp, final, **kw):
        (tmp / "manifest.json").write_text("{}")
        return {}

    monkeypatch.setattr(comp, "_compile_into", succeed)
    comp.compile_checkpoint(BUNDLE, prev, target="cpu", max_tokens=64, max_batch=1, force=True)
    assert tree(prev) == {"manifest.json": hashlib.sha256(b"{}").hexdigest()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_boundary_check_failure_names_batch_bucket_and_error(tmp_path, monkeypatch):
    import dsv4c.compile as comp
    import dsv4c.runtime.segments as seg

    report = {"ok": False, "tolerance": 0.03, "cases": [
        {"batch": 3, "bucket": 4, "mode": "emulate", "logits_rel_err": 0.034, "cache_rel_err": 0.038, "ok": False},
        {"batch": 5, "bucket": 8, "mode": "emulate", "logits_rel_err": 0.001, "cache_rel_err": 0.0, "ok": True}]}
    monkeypatch.setattr(seg, "verify_artifact_boundaries", lambda art: dict(report))
    (tmp_path / "weights").mkdir()
    manifest = {"buckets": [1, 2, 4, 8], "dtype": "bfloat16", "target": {"expert_format": "fp8_block"}}
    with pytest.raises(comp.ArtifactError) as ei:
        comp._boundary_check(tmp_path, manifest, True, False, Path("out/final"))
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith("out/final: padding check failed")
    assert "batch 3 (bucket 4, emulate): logits rel err 0.034, cache rel err 0.038 (tolerance 0.03)" in msg
    assert "batch 5" not in msg
    # W4A4 in bf16 on the CPU: skipped, with the reason printed and recorded
    manifest["target"]["expert_format"] = "nvfp4_w4a4"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        res = comp._boundary_check(tmp_path, manifest, True, True)
    assert res["ok"] is None and "nvfp4_w4a4" in res["skipped"] and "skipped" in out.getvalue()
    manifest["dtype"] = "float32"  # checkable in float32: runs (and here fails, as reported)
    with pytest.raises(comp.ArtifactError, match="batch 3"):
        comp._boundary_check(tmp_path, manifest, True, False)
