"""net_to_dot draws exactly the ops, blobs and edges of a net; render writes DOT and calls Graphviz safely."""

from __future__ import annotations

import functools
import re
import shutil
import stat
import sys

import pytest

from graphpar import data_parallel_model as dpm
from graphpar import model_helper, optimizer
from graphpar.core import CUDA, DeviceOption, NetDef, OperatorDef
from graphpar.core.graph import dependency_graph
from graphpar.models import mlp
from graphpar.visualize import net_to_dot, quote, render

NODE = re.compile(r'^\s*(\w+) \[(.*)\];$')
EDGE = re.compile(r'^\s*(\w+) -> (\w+)(?: \[(.*)\])?;$')
ATTR = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|[^,\s]+)')
GRADIENT_FILL, COMMUNICATION_FILL, FORWARD_FILL = "#f4cccc", "#c9daf8", "#ffffff"


def _unquote(value: str) -> str:
    if not value.startswith('"'):
        return value
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), value[1:-1])


def _attrs(text: str | None) -> dict[str, str]:
    return {key: _unquote(value) for key, value in ATTR.findall(text or "")}


def parse(dot: str) -> tuple[dict[str, dict[str, str]], list[tuple[str, str, dict[str, str]]]]:
    """(nodes {id: attrs}, edges [(src, dst, attrs)]); every line must be understood."""
    nodes, edges = {}, []
    for line in dot.splitlines():
        if (match := EDGE.match(line)) is not None:
            edges.append((match[1], match[2], _attrs(match[3])))
        elif (match := NODE.match(line)) is not None and match[1] not in ("node",):
            nodes[match[1]] = _attrs(match[2])
        else:
            assert re.match(r'^(digraph ".*" \{|\s*subgraph cluster_\d+ \{|\s*\}|\s*label=".*";|'
                            r'\s*labelloc=t;|\s*style=rounded;|\s*node \[.*\];)$', line), line
    return nodes, edges


def tiny_net() -> NetDef:
    """0 fill c; 1 relu x->y; 2 scale y->z after c (control); 3 a gradient op; 4 a copy; 5 overwrites y."""
    return NetDef(name="tiny", ops=[
        OperatorDef("ConstantFill", [], ["c"], {"shape": [1]}),
        OperatorDef("Relu", ["x"], ["y"]),
        OperatorDef("Scale", ["y"], ["z"], {"scale": 2.0}, control_inputs=["c"]),
        OperatorDef("ReluGradient", ["y", "z"], ["x_grad"], is_gradient_op=True),
        OperatorDef("Copy", ["z"], ["w"], device_option=DeviceOption(CUDA, 1)),
        OperatorDef("Relu", ["w"], ["y"]),
    ])


def test_tiny_net_has_exactly_its_ops_blobs_and_edges() -> None:
    dot = net_to_dot(tiny_net())
    nodes, edges = parse(dot)
    labels = {node: attrs["label"] for node, attrs in nodes.items()}
    assert {labels[n] for n in nodes if n.startswith("op_")} == {
        "ConstantFill #0\ncpu:0", "Relu #1\ncpu:0", "Scale #2\ncpu:0", "ReluGradient #3\ncpu:0",
        "Copy #4\ncuda:1", "Relu #5\ncpu:0"}
    assert sorted(labels[n] for n in nodes if n.startswith("blob_")) == sorted(["c", "x", "y", "z", "x_grad", "w"])
    assert all(nodes[n]["shape"] == ("box" if n.startswith("op_") else "ellipse") for n in nodes)
    assert {(labels[a], labels[b], attrs.get("style", "solid")) for a, b, attrs in edges} == {
        ("ConstantFill #0\ncpu:0", "c", "solid"),
        ("x", "Relu #1\ncpu:0", "solid"), ("Relu #1\ncpu:0", "y", "solid"),
        ("y", "Scale #2\ncpu:0", "solid"), ("c", "Scale #2\ncpu:0", "dashed"), ("Scale #2\ncpu:0", "z", "solid"),
        ("y", "ReluGradient #3\ncpu:0", "solid"), ("z", "ReluGradient #3\ncpu:0", "solid"),
        ("ReluGradient #3\ncpu:0", "x_grad", "solid"),
        ("z", "Copy #4\ncuda:1", "solid"), ("Copy #4\ncuda:1", "w", "solid"),
        ("w", "Relu #5\ncpu:0", "solid"), ("Relu #5\ncpu:0", "y", "solid"),
    }
    assert len(edges) == 13  # no duplicates
    fills = {labels[n].split("\n")[0]: nodes[n]["fillcolor"] for n in nodes if n.startswith("op_")}
    assert fills["ReluGradient #3"] == GRADIENT_FILL and fills["Copy #4"] == COMMUNICATION_FILL
    assert {fills[k] for k in ("ConstantFill #0", "Relu #1", "Scale #2", "Relu #5")} == {FORWARD_FILL}
    assert "subgraph" not in dot  # no replica scopes, no clusters
    assert dot.startswith('digraph "tiny" {') and dot.endswith("}\n")


def test_show_blobs_false_draws_the_dependency_graph() -> None:
    netdef = tiny_net()
    nodes, edges = parse(net_to_dot(netdef, name="deps", show_blobs=False))
    assert sorted(nodes) == [f"op_{i}" for i in range(6)]
    drawn = {(int(a[3:]), int(b[3:]), attrs["style"]) for a, b, attrs in edges}
    assert {(i, j) for i, j, _ in drawn} == set(dependency_graph(netdef).edges)
    assert drawn == {(0, 2, "dashed"),  # read of a control input
                     (1, 2, "solid"), (1, 3, "solid"), (2, 3, "solid"), (2, 4, "solid"), (4, 5, "solid"),
                     (1, 5, "dotted"), (2, 5, "dotted"), (3, 5, "dotted")}  # write-after-write/-read of y


def test_odd_names_are_escaped() -> None:
    odd = ['say "hi"', "back\\slash", "new\nline", "semi;colon {x} -> y", "ünï cødé", "a\\\"b"]
    netdef = NetDef(name='my "net"\\', ops=[OperatorDef("Sum", odd[:3], [odd[3]]),
                                            OperatorDef("Copy", [odd[3]], [odd[4]], control_inputs=[odd[5]])])
    dot = net_to_dot(netdef)
    nodes, edges = parse(dot)
    blob_labels = sorted(attrs["label"] for node, attrs in nodes.items() if node.startswith("blob_"))
    assert blob_labels == sorted(odd)
    assert len(edges) == 7
    assert dot.splitlines()[0] == 'digraph "my \\"net\\"\\\\" {'
    assert quote('a"b\\c\nd') == '"a\\"b\\\\c\\nd"'


def _parallel_model(devices: list[int]) -> model_helper.ModelHelper:
    model = model_helper.ModelHelper(name="viz")
    dpm.Parallelize(model, input_builder_fun=lambda m: None,
                    forward_pass_builder_fun=functools.partial(mlp, dim_in=4, hidden=(3,)),
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1, momentum=0.9),
                    devices=devices, cpu_device=True, cpu_update_once=False)  # an update per replica
    return model


def _clusters(dot: str) -> dict[str, list[str]]:
    blocks = re.findall(r"  subgraph (cluster_\d+) \{\n(.*?)\n  \}", dot, flags=re.S)
    return {re.search(r'label="(.*?)";', body)[1]: body.splitlines() for _, body in blocks}


def test_one_cluster_per_replica_for_a_parallelized_model() -> None:
    model = _parallel_model([0, 1])
    netdef = model.net.Proto()
    dot = net_to_dot(model.net)
    nodes, edges = parse(dot)
    clusters = _clusters(dot)
    assert sorted(clusters) == ["cpu_0/", "cpu_1/"]
    inside = set()
    for scope, lines in clusters.items():
        for line in lines:
            if (match := re.match(r"\s*(\w+) \[", line)) is None:
                continue
            node, label = match[1], nodes[match[1]]["label"]
            inside.add(node)
            if node.startswith("blob_"):
                assert label.startswith(scope)
            else:
                assert label.endswith(f"\ncpu:{scope[4]}") and nodes[node]["fillcolor"] != COMMUNICATION_FILL
    outside = {n for n in nodes if n not in inside}
    outside_ops = sorted(int(n[3:]) for n in outside if n.startswith("op_"))
    # the all-reduce (Sum across replicas, Copy back) and the unscoped optimizer ops stay outside
    assert {netdef.ops[i].type for i in outside_ops} == {"Sum", "Copy", "Iter", "LearningRate"}
    for i in outside_ops:
        kind_fill = nodes[f"op_{i}"]["fillcolor"]
        assert kind_fill == (COMMUNICATION_FILL if netdef.ops[i].type in ("Sum", "Copy") else FORWARD_FILL)
    assert all("/" not in nodes[n]["label"] for n in outside if n.startswith("blob_"))
    grads = [n for n in nodes if n.startswith("op_") and netdef.ops[int(n[3:])].is_gradient_op]
    assert grads and all(nodes[n]["fillcolor"] == GRADIENT_FILL for n in grads)
    assert len([n for n in nodes if n.startswith("op_")]) == len(netdef.ops)
    # without blobs the clusters hold the same ops
    assert _clusters(net_to_dot(model.net, show_blobs=False)).keys() == clusters.keys()


def test_a_single_replica_gets_no_cluster() -> None:
    assert "subgraph" not in net_to_dot(_parallel_model([0]).net)


def test_render_without_graphviz_raises_and_leaves_the_dot_file(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    target = tmp_path / "tiny.svg"
    with pytest.raises(RuntimeError, match=r"(?s)tiny\.dot.*Graphviz.*apt-get install graphviz"):
        render(tiny_net(), target)
    assert (tmp_path / "tiny.dot").read_text() == net_to_dot(tiny_net())
    assert not target.exists()


def test_render_dot_only_and_bad_format(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    assert render(tiny_net(), tmp_path / "n.dot") == tmp_path / "n.dot"
    assert (tmp_path / "n.dot").read_text() == net_to_dot(tiny_net())
    with pytest.raises(ValueError, match="cannot render format 'jpeg'"):
        render(tiny_net(), tmp_path / "m.jpeg")
    assert not (tmp_path / "m.dot").exists()


def test_render_calls_dot_with_an_argument_list(tmp_path, monkeypatch) -> None:
    fake = tmp_path / "fake_dot"
    fake.write_text(f"#!{sys.executable}\nimport pathlib, sys\nargs = sys.argv[1:]\n"
                    f"pathlib.Path(args[args.index('-o') + 1]).write_text(' '.join(args))\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: str(fake) if name == "dot" else None)
    odd_dir = tmp_path / "a dir; echo x"
    odd_dir.mkdir()
    out = render(tiny_net(), odd_dir / "net.svg", format="png")
    assert out == odd_dir / "net.png"
    assert out.read_text() == f"-Tpng {odd_dir / 'net.dot'} -o {out}"


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz is not installed")
def test_render_with_real_graphviz(tmp_path) -> None:
    out = render(_parallel_model([0, 1]).net, tmp_path / "model.svg")
    assert "<svg" in out.read_text()
