"""The mixed-precision pass: the ops it emits on a tiny net, the dtype of every op of a rewritten ResNet,
no cast pairs, and shape inference agreeing with a run."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from graphpar import data_parallel_model as dpm
from graphpar import model_helper, optimizer, workspace
from graphpar.core.ir import NetDef, OperatorDef
from graphpar.core.schema import (
    Precision,
    PrecisionRule,
    get_schema,
    precision_rule,
    register_op,
    scoped_registry,
)
from graphpar.core.shapes import infer_specs
from graphpar.errors import ParallelizeError
from graphpar.models import lenet, resnet18
from graphpar.passes.precision import check_compute_dtype, convert_model, init_dtypes, rewrite_net

LOW = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _op(type_: str, inputs: list[str], outputs: list[str], **args) -> OperatorDef:
    return OperatorDef(type_, inputs, outputs, args)


def _ops(net: NetDef) -> list[tuple]:
    return [(op.type, op.inputs, op.outputs, op.args.get("to")) for op in net.ops]


def test_tiny_net_gets_one_cast_per_blob_and_dtype_where_the_rule_changes():
    net = NetDef("t", [
        _op("FC", ["x", "w1", "b1"], ["h"]),
        _op("Relu", ["h"], ["h"]),
        _op("FC", ["h", "w2", "b2"], ["y"]),
        _op("Add", ["y", "h2"], ["z"]),  # h2 fp32: a mixed FOLLOW op promotes to fp32
        _op("SoftmaxWithLoss", ["y", "label"], ["p", "loss"]),
        _op("FC", ["x", "w1", "b1"], ["h3"]),  # x, w1, b1 already cast: the casts are reused
    ])
    rewrite_net(net, "bfloat16")
    assert _ops(net) == [
        ("Cast", ["x"], ["x_bf16"], "bfloat16"), ("Cast", ["w1"], ["w1_bf16"], "bfloat16"),
        ("Cast", ["b1"], ["b1_bf16"], "bfloat16"), ("FC", ["x_bf16", "w1_bf16", "b1_bf16"], ["h"], None),
        ("Relu", ["h"], ["h"], None),
        ("Cast", ["w2"], ["w2_bf16"], "bfloat16"), ("Cast", ["b2"], ["b2_bf16"], "bfloat16"),
        ("FC", ["h", "w2_bf16", "b2_bf16"], ["y"], None),
        ("Cast", ["y"], ["y_fp32"], "float32"), ("Add", ["y_fp32", "h2"], ["z"], None),
        ("SoftmaxWithLoss", ["y_fp32", "label"], ["p", "loss"], None),
        ("FC", ["x_bf16", "w1_bf16", "b1_bf16"], ["h3"], None),
    ]


def test_a_rewritten_blob_is_cast_again_and_in_place_fp32_ops_write_the_cast():
    net = NetDef("t", [
        _op("FC", ["x", "w", "b"], ["y"]),
        _op("Softmax", ["y"], ["y"]),  # FP32 in place on a low blob: it writes y_fp32, which holds y now
        _op("FC", ["y", "w", "b"], ["z"]),  # reads that value: cast down again (not a pair: Softmax wrote it)
        _op("Cast", ["z"], ["z32"], to="float32"),  # a user's cast: its output is fp32
        _op("Relu", ["z32"], ["r"]),
    ])
    rewrite_net(net, "float16")
    assert _ops(net) == [
        ("Cast", ["x"], ["x_fp16"], "float16"), ("Cast", ["w"], ["w_fp16"], "float16"),
        ("Cast", ["b"], ["b_fp16"], "float16"), ("FC", ["x_fp16", "w_fp16", "b_fp16"], ["y"], None),
        ("Cast", ["y"], ["y_fp32"], "float32"), ("Softmax", ["y_fp32"], ["y_fp32"], None),
        ("Cast", ["y_fp32"], ["y_fp32_fp16"], "float16"), ("FC", ["y_fp32_fp16", "w_fp16", "b_fp16"], ["z"], None),
        ("Cast", ["z"], ["z32"], "float32"), ("Relu", ["z32"], ["r"], None),
    ]


def test_batch_norm_keeps_x_low_and_its_statistics_fp32():
    net = NetDef("t", [
        _op("Conv", ["x", "w"], ["c"], kernel=1),
        _op("SpatialBN", ["c", "s", "b", "rm", "rv"], ["y", "rm", "rv", "sm", "siv"]),
        _op("Mul", ["sm", "y"], ["q"]),  # sm fp32, y low: promoted
    ])
    rewrite_net(net, "bfloat16", taken={"x_bf16"})
    assert _ops(net)[0] == ("Cast", ["x"], ["x_bf16_1"], "bfloat16")  # a taken name is avoided
    assert _ops(net)[3][:3] == ("SpatialBN", ["c", "s", "b", "rm", "rv"], ["y", "rm", "rv", "sm", "siv"])
    assert _ops(net)[4:] == [("Cast", ["y"], ["y_fp32"], "float32"), ("Mul", ["sm", "y_fp32"], ["q"], None)]


def test_an_op_declares_its_own_rule_and_unknown_ops_run_in_fp32():
    with scoped_registry():
        register_op("MyMatMul", inputs=2, kernel=lambda a, c: torch.matmul, doc="test",
                    precision=PrecisionRule(Precision.LOW))
        register_op("MyNorm", kernel=lambda a, c: lambda x: x, doc="test")
        assert precision_rule("MyMatMul").compute is Precision.LOW
        assert precision_rule("MyNorm").compute is Precision.FP32
        net = NetDef("t", [_op("MyMatMul", ["a", "b"], ["c"]), _op("MyNorm", ["c"], ["d"])])
        rewrite_net(net, "bfloat16")
        assert [op.type for op in net.ops] == ["Cast", "Cast", "MyMatMul", "Cast", "MyNorm"]
    assert precision_rule("Conv").compute is Precision.LOW and precision_rule("SoftmaxWithLoss").compute is Precision.FP32


def test_init_dtypes_know_pseudo_fp16_params_and_low_fills():
    init = NetDef("i", [_op("XavierFill", [], ["w_fp32"], shape=[2]), _op("FloatToHalf", ["w_fp32"], ["w"]),
                        _op("ConstantFill", [], ["z"], shape=[2], dtype="bfloat16"),
                        _op("Cast", ["w"], ["w2"], to=1)])
    assert init_dtypes(init) == {"w": "float16", "z": "bfloat16"}
    net = NetDef("t", [_op("FC", ["x", "w", "b"], ["y"])])
    rewrite_net(net, "float16", init_dtypes(init))
    assert [op.inputs for op in net.ops] == [["x"], ["b"], ["x_fp16", "w", "b_fp16"]]  # w is fp16 already


@pytest.mark.parametrize("value, expected", [(None, None), ("float32", None), ("BF16", "bfloat16"),
                                             (torch.float16, "float16"), ("half", "float16")])
def test_compute_dtype_names(value, expected):
    assert check_compute_dtype(value) == expected


def test_bad_compute_dtype_raises_before_the_model_changes():
    model = model_helper.ModelHelper(name="bad_compute_dtype")
    with pytest.raises(ParallelizeError, match="compute_dtype='int8'"):
        dpm.Parallelize(model, lambda m: None, lenet, optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1),
                        devices=[0], cpu_device=True, compute_dtype="int8")
    assert not model.net.Proto().ops


def _rule_of(op: OperatorDef) -> PrecisionRule:
    schema = get_schema(op.type)
    return precision_rule(schema.gradient_of or op.type)


def _train_resnet(compute_dtype: str, devices=(0, 1)):
    workspace.ResetWorkspace()
    model = model_helper.ModelHelper(name="rn")
    dpm.Parallelize(model, lambda m: None, functools.partial(resnet18, num_classes=3, width=4),
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.05, momentum=0.9),
                    devices=list(devices), cpu_device=True, compute_dtype=compute_dtype)
    rng = np.random.default_rng(0)
    for d in devices:
        workspace.FeedBlob(f"cpu_{d}/data", rng.standard_normal((2, 3, 8, 8), dtype=np.float32))
        workspace.FeedBlob(f"cpu_{d}/label", rng.integers(0, 3, 2).astype(np.int32))
    dpm.RunInitNet(model)
    return model


@pytest.mark.parametrize("compute_dtype", ["bfloat16", "float16"])
def test_every_op_of_a_rewritten_resnet_runs_in_its_rules_dtype(compute_dtype):
    """Forward and gradient ops alike (a gradient op follows its forward op's rule): no op the table
    keeps fp32 sees a low input or makes a low output; Conv/FC and their gradients are low; the
    all-reduce and the updates are fp32; and shape inference agrees with a run on every blob."""
    low = LOW[compute_dtype]
    model = _train_resnet(compute_dtype)
    ws = workspace.get_workspace()
    before = dict(ws.blobs)
    net = model.net.Proto()
    specs = infer_specs(net, before)
    workspace.get_workspace().keep_all = True
    try:
        dpm.RunNet(model, 1)
    finally:
        workspace.get_workspace().keep_all = False
    floats = {name for name, spec in specs.items() if spec is not None and spec.dtype.is_floating_point}
    for name in floats:  # inference agrees with the run
        assert workspace.FetchTensor(name).dtype == specs[name].dtype, name
    kinds = {Precision.LOW: 0, Precision.FP32: 0}
    for op in net.ops:
        rule = _rule_of(op)
        dtypes = [specs[b].dtype for b in (*op.inputs, *op.outputs) if b in floats]
        if rule.compute is Precision.FP32 and not op.type.startswith("Cast"):
            assert all(d == torch.float32 for d in dtypes), (op.type, op.inputs, dtypes)
            kinds[Precision.FP32] += 1
        elif rule.compute is Precision.LOW:
            assert all(d == low for d in dtypes), (op.type, op.inputs, dtypes)
            kinds[Precision.LOW] += 1
        elif op.type.startswith("SpatialBN"):  # X, Y (dY, dX) low; scale, statistics (dscale, dbias) fp32
            lows = (0, 2) if op.type == "SpatialBNGradient" else (0,)
            assert {specs[b].dtype for k, b in enumerate(op.inputs) if k not in lows} == {torch.float32}
            assert {specs[b].dtype for b in op.outputs[1:]} == {torch.float32}
            assert {specs[op.inputs[k]].dtype for k in lows} == {specs[op.outputs[0]].dtype} == {low}
    assert kinds[Precision.LOW] >= 2 * 2 * 21 and kinds[Precision.FP32] > 20  # forward + gradient, 2 devices
    for param in model.GetParams():
        assert ws.blobs[param].dtype == torch.float32 and ws.blobs[str(model.param_to_grad[param])].dtype == torch.float32


def _cast_pairs(net: NetDef) -> list[tuple]:
    """Casts reading a blob whose last writer is a Cast (or CastGradient): `X -> a -> b` pairs."""
    writer: dict[str, str] = {}
    pairs = []
    for op in net.ops:
        if op.type in ("Cast", "CastGradient") and writer.get(op.inputs[-1]) in ("Cast", "CastGradient"):
            pairs.append((op.inputs, op.outputs))
        writer.update(dict.fromkeys(op.outputs, op.type))
    return pairs


@pytest.mark.parametrize("forward", [lenet, functools.partial(resnet18, num_classes=3, width=4)])
def test_no_cast_pair_is_left_in_forward_or_backward(forward):
    model = model_helper.ModelHelper(name="pairs")
    dpm.Parallelize(model, lambda m: None, forward, optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1),
                    devices=[0, 1], cpu_device=True, compute_dtype="bfloat16")
    net = model.net.Proto()
    assert sum(op.type == "Cast" for op in net.ops) > 0
    assert _cast_pairs(net) == []


def test_cast_pair_finder_finds_a_pair():
    net = NetDef("t", [_op("Cast", ["x"], ["y"], to="bfloat16"), _op("Cast", ["y"], ["z"], to="float32")])
    assert _cast_pairs(net) == [(["y"], ["z"])]


def test_convert_model_for_a_plain_model_helper_trains_and_refuses_a_net_with_gradients():
    workspace.ResetWorkspace()
    model = model_helper.ModelHelper(name="plain")
    loss, = lenet(model, 1.0, image_size=16, channels=(2, 3), hidden=8)
    convert_model(model, "bfloat16")
    model.AddGradientOperators([loss])
    optimizer.build_sgd(model, 0.1)
    workspace.FeedBlob("data", np.random.default_rng(0).standard_normal((4, 1, 16, 16), dtype=np.float32))
    workspace.FeedBlob("label", np.arange(4, dtype=np.int32))
    workspace.RunNetOnce(model.param_init_net)
    workspace.CreateNet(model.net)
    workspace.RunNet(model.net)
    assert workspace.FetchTensor("conv1").dtype == torch.bfloat16
    assert np.isfinite(workspace.FetchBlob("loss"))
    with pytest.raises(ValueError, match="before AddGradientOperators"):
        convert_model(model, "bfloat16")


def test_casts_of_fed_inputs_get_no_gradient_like_the_inputs():
    """The cast of the data gets no gradient, so conv1's ConvGradient skips dX, as without the pass."""
    model = model_helper.ModelHelper(name="fed")
    dpm.Parallelize(model, lambda m: None, lenet, optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1),
                    devices=[0], cpu_device=True, compute_dtype="bfloat16")
    assert model._input_casts == {"cpu_0/data_bf16"}
    ops = model.net.Proto().ops
    assert not [op for op in ops if any(b.startswith(("cpu_0/data", "cpu_0/label")) for b in op.outputs)
                and op.is_gradient_op]
    conv1_grad = next(op for op in ops if op.type == "ConvGradient" and op.inputs[0] == "cpu_0/data_bf16")
    assert conv1_grad.args["no_gradient_to_input"] and len(conv1_grad.outputs) == 2
