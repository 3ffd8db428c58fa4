"""Ops declare what they are at registration; core, the passes and the executors read that, never op-type names.

Every module of `graphpar/core`, `graphpar/passes` and `graphpar/executor` is read with `ast`: a comparison
with a registered op type's name (`op.type == "Conv"`, `op.type in ("SpatialBN", ...)`) or a collection of
them (a tuple, list or set, or a dict keyed by them) is a second place that says what an op is, which a new
op of the kind would miss. Creating an op by its type (`make_op("Sum", ...)`) is not a role and is allowed.
The op's own registration (`graphpar/ops/`) is the one place: a trait, its effects, its precision rule,
`predict_as`.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from graphpar.core.ir import NetDef, OperatorDef
from graphpar.core.schema import (
    Effects,
    Precision,
    PredictAs,
    Trait,
    precision_rule,
    register_op,
    registered_types,
    scoped_registry,
    stops_gradient,
)
from graphpar.passes.channels_last import rewrite_channels_last
from graphpar.passes.inter_device_bn import inter_device_batch_norm
from graphpar.passes.predictor import extract_predictor_net
from tests.passes.helpers import layout, reducer

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "graphpar"
SCANNED = ("core", "passes", "executor")


def _named_types(node: ast.AST, types: set[str]) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and n.value in types]


def op_type_tables(source: str, types: set[str]) -> list[tuple[int, str, list[str]]]:
    """(line, what, names) for each comparison with op-type names and each collection of them in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [side for side in (node.left, *node.comparators)
                     if isinstance(side, (ast.Constant, ast.Tuple, ast.List, ast.Set))]
            names = [name for side in sides for name in _named_types(side, types)]
            what = "comparison"
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            names = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in types]
            what = "collection"
        elif isinstance(node, ast.Dict):
            names = [k.value for k in node.keys if isinstance(k, ast.Constant) and k.value in types]
            what = "dict"
        else:
            continue
        if names:
            found.append((node.lineno, what, names))
    return found


def test_the_scan_finds_tables_and_comparisons_of_op_type_names():
    types = {"Conv", "SpatialBN", "Sum"}
    source = ('BN = ("SpatialBN", "Other")\nRULES = {"Conv": 1}\nif op.type == "Conv": pass\n'
              'if op.type not in {"Sum"}: pass\nmake_op("Sum", [a], [b])\nlog("Conv")\n')
    assert op_type_tables(source, types) == [
        (1, "collection", ["SpatialBN"]), (2, "dict", ["Conv"]), (3, "comparison", ["Conv"]),
        (4, "comparison", ["Sum"]), (4, "collection", ["Sum"])]


@pytest.mark.parametrize("layer", SCANNED)
def test_no_op_type_names_outside_the_ops_registrations(layer: str):
    types = set(registered_types())
    found = {f"{path.relative_to(PACKAGE.parent)}:{line}": f"{what} of {names}"
             for path in sorted((PACKAGE / layer).rglob("*.py"))
             for line, what, names in op_type_tables(path.read_text(), types)}
    assert found == {}, ("declare the role at the op's registration (a Trait, Effects, precision=, predict_as=) "
                         "and read it from the schema")


def test_the_built_in_roles_are_declared_by_their_ops():
    assert precision_rule("Conv").compute is Precision.LOW and precision_rule("Relu").compute is Precision.FOLLOW
    assert precision_rule("SpatialBN").inputs == (0,) and precision_rule("HalfToFloat").dtype == "float32"
    assert stops_gradient(OperatorDef("StopGradient", ["x"], ["x"]))
    assert not stops_gradient(OperatorDef("Copy", ["x"], ["y"])) and not stops_gradient(OperatorDef("Nope", [], []))


def _identity(_args: object, _ctx: object) -> object:
    return lambda x, *rest: x


def test_a_new_convolution_joins_channels_last_by_its_registration():
    with scoped_registry():
        register_op("MyConv", inputs=(2, 3), kernel=_identity, traits=(Trait.CONVOLUTION,),
                    precision=Precision.LOW, doc="test: a convolution-like op")
        net = NetDef("t", [OperatorDef("MyConv", ["x", "w"], ["c1"]), OperatorDef("Relu", ["c1"], ["r"]),
                           OperatorDef("MyConv", ["r", "w2"], ["c2"])])
        rewrite_channels_last(net)
    assert [(op.type, op.inputs[0]) for op in net.ops] == [
        ("ChannelsLast", "x"), ("MyConv", "x_cl"), ("Relu", "c1"), ("MyConv", "r")]


def test_a_new_batch_norm_joins_inter_device_batch_norm_by_its_registration():
    lay = layout([0, 1])
    with scoped_registry():
        register_op("MyBN", inputs=(5, 8), outputs=(1, 5), args={"is_test": False, "num_batches": 1},
                    kernel=_identity, traits=(Trait.BATCH_NORM,), doc="test: a batch-norm-like op")
        ops = [OperatorDef("MyBN", [lay.scoped(d, b) for b in ("x", "s", "b", "rm", "rv")],
                           [lay.scoped(d, b) for b in ("y", "rm", "rv", "sm", "siv")], {}, lay.option(d))
               for d in lay.devices]
        net = inter_device_batch_norm(NetDef("bn", ops), reducer(lay))
    combined = [op for op in net.ops if op.type == "MyBN"]
    assert [op.inputs[5:] for op in combined] == [
        [f"cpu_{d}/x_sums", f"cpu_{d}/x_sumsq", f"cpu_{d}/x_count"] for d in lay.devices]
    assert all(op.args["num_batches"] == 2 for op in combined)
    assert [op.type for op in net.ops[:2]] == ["ChannelStats", "ChannelStats"]


def test_a_new_loss_and_gradient_stop_join_the_predictor_by_their_registration():
    with scoped_registry():
        register_op("MyLoss", inputs=2, outputs=2, args={"axis": 1}, kernel=lambda a, c: lambda p, y: (p, p.sum()),
                    predict_as=PredictAs(unused=(1,), type="Softmax", inputs=(0,), outputs=(0,), args=("axis",)),
                    doc="test: a loss that computes a prediction")
        register_op("MyStop", inplace={(0, 0)}, kernel=lambda a, c: torch.clone, gradient=None,
                    effects=Effects(same_value={(0, 0)}), doc="test: no gradient maker (not a stop)")
        train = NetDef("train", [OperatorDef("StopGradient", ["d"], ["d"]), OperatorDef("MyStop", ["d"], ["e"]),
                                 OperatorDef("FC", ["e", "w", "b"], ["p"]),
                                 OperatorDef("MyLoss", ["p", "label"], ["prob", "loss"], {"axis": 1})],
                       external_inputs=["d", "w", "b", "label"])
        net, params = extract_predictor_net(train, ["d"], ["prob"])
    assert [(op.type, op.inputs, op.outputs, op.args) for op in net.ops] == [
        ("MyStop", ["d"], ["e"], {}), ("FC", ["e", "w", "b"], ["p"], {}), ("Softmax", ["p"], ["prob"], {"axis": 1})]
    assert params == ["w", "b"]
