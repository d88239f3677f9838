"""ONNX export of the dense pieces (dsv4c/onnx_export.py, issue 30): onnxruntime vs torch on recorded inputs,
the composed Session (ONNX dense pieces + torch MoE/cache ops), and the reasons for what stays in torch.

To stay within the CI budget the bundled model is cut to its first two layers (its trained weights) and each
graph exports only its last dense piece (max_pieces=1: the final MoE combine, mHC head, norm and LM head,
with the graph's dynamic rows);
`dsv4c export-onnx` and examples/onnx_roundtrip.py export all of them."""
import json

import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")


from dsv4c.cli import main  # noqa: E402
from dsv4c.onnx_export import REL_TOL, compose, export_onnx  # noqa: E402
from dsv4c.runtime import Session  # noqa: E402


@pytest.fixture(scope="module")
def bundled(bundle2_art, tmp_path_factory):
    """(folder holding `art` and `onnx`, the export index): the bundled model's first two layers compiled for
    the cpu target (tests/conftest.py: shared with tests/test_serve.py, read only)."""
    d = tmp_path_factory.mktemp("onnx")
    (d / "art").symlink_to(bundle2_art / "art", target_is_directory=True)
    index = export_onnx(d / "art", d / "onnx", verify=True, graphs=("prefill", "decode"), max_pieces=1)
    return d, index


def _exported(index, kind):
    return [e for e in index["graphs"][kind]["pieces"] if e["kind"] == "dense" and e.get("exportable")]


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_bundled_dense_pieces_export_and_verify(bundled, kind):
    d, index = bundled
    assert json.loads((d / "onnx" / "index.json").read_text())["graphs"][kind]["dense"] == index["graphs"][kind]["dense"]
    pieces = index["graphs"][kind]["pieces"]
    exported = _exported(index, kind)
    assert len(exported) == 1 and exported[-1]["piece"] == max(e["piece"] for e in pieces if e["kind"] == "dense")
    for e in exported:
        v = e["verify"]
        assert v["ok"] and v["max_rel_err"] <= REL_TOL, (e["piece"], v)
        model = onnx.load(str(d / "onnx" / kind / e["file"]), load_external_data=False)
        if e["weights"]:  # weights are initialisers; the large ones (all matrices here) stored as external data
            big = [i for i in model.graph.initializer if len(i.dims) == 2]
            assert big and all(i.data_location == onnx.TensorProto.EXTERNAL for i in big)
        # the graph's symbolic rows (decode: batch; prefill: tokens, B*T rows) stay dynamic axes in ONNX
        act = next(i for i in e["inputs"] if i["dynamic_dims"])
        proto = next(i for i in model.graph.input if i.name == f"in.{act['name']}")
        assert all(proto.type.tensor_type.shape.dim[k].dim_param for k in act["dynamic_dims"])
    torch_pieces = [e for e in pieces if e["kind"] == "torch"]
    ops = {e["op"] for e in torch_pieces}
    assert "dsv4c.moe_experts" in ops and "dsv4c.v4_attention" in ops
    for e in torch_pieces:  # each says why it stays in torch
        assert ("routed experts" in e["reason"]) == (e["op"] == "dsv4c.moe_experts")
        if e["op"] == "dsv4c.v4_attention":
            assert "in place" in e["reason"] and e["mutates"]


def test_composed_decode_gives_the_sessions_greedy_tokens(bundled):
    d, _ = bundled
    prompts = [[0, 11, 23, 35, 47, 59], [0, 301, 7]]
    ref = [r.tokens for r in Session.load(d / "art").generate(prompts, max_new_tokens=4)]
    sess = Session.load(d / "art")
    mods = compose(sess, d / "onnx")
    got = [r.tokens for r in sess.generate(prompts, max_new_tokens=4)]
    assert got == ref
    assert all(m.calls > 0 for m in mods["decode"]) and all(m.calls > 0 for m in mods["prefill"])


def test_v3_tiny_exports_and_says_why_cache_and_moe_ops_do_not(v3_tiny_mtp_art, tmp_path):
    # small('v3-tiny'): one dense, one MoE layer (tests/conftest.py, shared)
    index = export_onnx(v3_tiny_mtp_art / "art", tmp_path / "onnx", segments="all", verify=True, graphs=("decode",),
                        max_pieces=1)
    exported = _exported(index, "decode")
    assert len(exported) == 1 and all(e["verify"]["ok"] for e in exported)
    torch_pieces = [e for e in index["graphs"]["decode"]["pieces"] if e["kind"] == "torch"]
    assert {e["op"] for e in torch_pieces} >= {"dsv4c.mla_cache_update", "dsv4c.moe_experts"}
    for e in torch_pieces:  # --segments all: torch.onnx was tried on the op alone and its own error recorded
        assert e["reason"] and e["onnx_export"].startswith("failed:"), e
        assert "dsv4c" in e["onnx_export"] or "mla_cache_update" in e["onnx_export"] or "moe" in e["onnx_export"]


def test_cli_names_a_missing_artifact(tmp_path, capsys):
    assert main(["export-onnx", str(tmp_path / "nope"), "-o", str(tmp_path / "out")]) == 2
    assert "nope" in capsys.readouterr().err
