"""Shape inference: every op's rule against its kernel, unknown specs, devices, memoization and errors."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

import graphpar.executor.plan as plan_module
from graphpar import workspace
from graphpar.core import CPU, CUDA, DeviceOption, Net, NetDef, OperatorDef
from graphpar.core.graph import blob_devices
from graphpar.core.schema import (
    Arg,
    KernelContext,
    TensorSpec,
    Trait,
    get_schema,
    parse_args,
    register_op,
    registered_types,
    scoped_registry,
)
from graphpar.core.shapes import BlobSpec, infer_specs, on_meta
from graphpar.errors import ShapeInferenceError
from graphpar.ops.fill import DataType
from tests.ops.examples import EXAMPLES, Example
from tests.ops.helpers import make_op, run_op

OP_TYPES = [t for t in registered_types() if not t.startswith("_Test")]
CPU0, GPU0, GPU1 = DeviceOption(CPU, 0), DeviceOption(CUDA, 0), DeviceOption(CUDA, 1)
META = torch.device("meta")


def _op(op_type: str, example: Example) -> OperatorDef:
    return make_op(op_type, len(example.inputs), example.outputs, **example.args)


def test_every_registered_op_type_has_examples() -> None:
    """Add a new op type to tests/ops/examples.py: the tests below run every entry."""
    assert sorted(EXAMPLES) == OP_TYPES


@pytest.mark.parametrize("op_type", OP_TYPES)
def test_inferred_specs_are_those_of_the_kernels_outputs(op_type: str) -> None:
    """On each example, every output's inferred shape and dtype is the real one, or unknown (None)
    exactly where the example says the shape depends on input values."""
    for example in EXAMPLES[op_type]:
        op = _op(op_type, example)
        outputs = run_op(op, example.inputs, torch.Generator().manual_seed(0))
        specs = infer_specs(NetDef("example", [op]), dict(zip(op.inputs, example.inputs)))
        assert len(outputs) == len(op.outputs)
        for k, (name, real) in enumerate(zip(op.outputs, outputs)):
            got = None if specs[name] is None else specs[name][:2]
            expected = None if k in example.unknown else (tuple(real.shape), real.dtype)
            assert got == expected, (op_type, example.args, k)


def _reads_values_on_the_host(op_type: str, example: Example) -> bool:
    """Whether the kernel, run on meta tensors (no data), tries to read tensor values."""
    op, schema = _op(op_type, example), get_schema(op_type)
    ctx = KernelContext(op, META, lambda _option: META, lambda: lambda _device: torch.Generator())
    try:
        on_meta(schema.kernel(parse_args(schema, op.args), ctx), example.inputs)
    except (RuntimeError, NotImplementedError) as exc:
        if "meta tensor" in str(exc).lower():  # torch.unique: "with Meta tensors"
            return True
        raise
    return False


@pytest.mark.parametrize("op_type", OP_TYPES)
def test_host_sync_is_declared_by_exactly_the_kernels_that_read_values(op_type: str) -> None:
    reads = any(_reads_values_on_the_host(op_type, example) for example in EXAMPLES[op_type])
    assert reads == get_schema(op_type).has(Trait.HOST_SYNC)
    if reads:
        assert get_schema(op_type).infer is not None, f"{op_type} reads values: it needs a shape rule"


def test_unknown_outputs_come_only_from_ops_that_read_values() -> None:
    for op_type in OP_TYPES:
        if any(example.unknown for example in EXAMPLES[op_type]):
            assert get_schema(op_type).has(Trait.HOST_SYNC), op_type


@pytest.mark.parametrize("op_type", [t for t in OP_TYPES if get_schema(t).has(Trait.FILL)])
def test_fills_infer_without_allocating(op_type: str) -> None:
    """A fill of 2^40 elements: inference would run out of memory if it ran the kernel."""
    args = {"values": [1], "shape": [1]} if op_type.startswith("GivenTensor") else {"shape": [1 << 20, 1 << 20]}
    (spec,) = infer_specs(NetDef("huge", [OperatorDef(op_type, [], ["y"], args)])).values()
    assert spec.numel == (1 if op_type.startswith("GivenTensor") else 1 << 40)


# ---- nets ----------------------------------------------------------------------------------------------


def _mlp() -> Net:
    net = Net("mlp")
    net.FC(["x", "w1", "b1"], "h")
    net.Relu("h", "h")
    net.FC(["h", "w2", "b2"], "y")
    net.SoftmaxWithLoss(["y", "label"], ["p", "loss"])
    return net


def _mlp_feeds(inner: int = 3) -> dict[str, object]:
    return {"x": torch.zeros(8, 3), "w1": torch.zeros(5, inner), "b1": torch.zeros(5),
            "w2": BlobSpec((2, 5), torch.float32, CPU0), "b2": BlobSpec((2,), torch.float32, CPU0),
            "label": torch.zeros(8, dtype=torch.int32), "unused": "not a tensor, never read"}


def test_a_net_infers_in_program_order_from_tensors_and_specs() -> None:
    specs = infer_specs(_mlp().Proto(), _mlp_feeds())
    assert specs["h"] == BlobSpec((8, 5), torch.float32, CPU0)
    assert specs["p"] == BlobSpec((8, 2), torch.float32, CPU0)
    assert specs["loss"] == BlobSpec((), torch.float32, CPU0)
    assert specs["x"] == BlobSpec((8, 3), torch.float32, CPU0)  # the feeds the net reads are kept
    assert "unused" not in specs
    assert specs["w1"].nbytes == 60 and specs["loss"].numel == 1


def test_dtype_codes_and_names_infer_like_the_kernels() -> None:
    netdef = NetDef("casts", [OperatorDef("Cast", ["x"], [f"y{k}"], {"to": to})
                              for k, to in enumerate((DataType.INT64, "half", torch.bool))])
    specs = infer_specs(netdef, {"x": torch.zeros(2)})
    assert [specs[f"y{k}"].dtype for k in range(3)] == [torch.int64, torch.float16, torch.bool]


def test_a_feed_that_is_neither_a_spec_nor_a_tensor_is_refused() -> None:
    with pytest.raises(TypeError, match="feed 'x' must be a BlobSpec or a torch.Tensor, got ndarray"):
        infer_specs(_mlp().Proto(), {**_mlp_feeds(), "x": np.zeros((8, 3))})


def test_a_mismatch_names_the_net_op_recording_site_inputs_and_the_cause() -> None:
    netdef = _mlp().Proto()
    with pytest.raises(ValueError) as info:
        infer_specs(netdef, _mlp_feeds(inner=4))
    message = str(info.value)
    for part in ("net 'mlp", "op #0 (FC)", f"recorded at {netdef.ops[0].source}", "test_shapes.py:",
                 "input 0 'x': shape [8, 3], float32", "input 1 'w1': shape [5, 4], float32",
                 "RuntimeError: a and b must have same reduction dim"):
        assert part in message, (part, message)


def test_a_kernel_that_reads_values_without_a_shape_rule_is_told_the_fix() -> None:
    with scoped_registry():
        register_op("_TestReadsValues", kernel=lambda a, ctx: lambda n: torch.zeros(int(n.item())),
                    doc="Test op: a shape from a value, without a rule.")
        with pytest.raises(ValueError, match="_TestReadsValues's kernel reads tensor values on the host: declare "
                                             "Trait.HOST_SYNC and an `infer` rule"):
            infer_specs(NetDef("reads", [OperatorDef("_TestReadsValues", ["n"], ["y"])]), {"n": torch.ones(1)})


def test_unknown_propagates_without_error() -> None:
    """A blob that is not fed, or whose shape depends on values, is unknown, and so is what it feeds."""
    net = Net("unknowns")
    net.Reshape(["x", "new_shape"], ["r", "old_shape"])
    net.Relu("r", "relu")
    net.Add(["relu", "x"], "sum")
    net.Scale("missing", "scaled")
    net.Relu("x", "known")
    specs = infer_specs(net.Proto(), {"x": torch.zeros(2, 6), "new_shape": torch.tensor([3, 4])})
    assert [specs[b] for b in ("r", "relu", "sum", "scaled")] == [None] * 4
    assert specs["old_shape"] == BlobSpec((2,), torch.int64, CPU0)
    assert specs["known"] == BlobSpec((2, 6), torch.float32, CPU0)
    assert "missing" not in specs


def test_output_devices_follow_blob_devices() -> None:
    """The op's device, the net's, or the schema's device inference (counters and copies on the CPU)."""
    net = Net("placed")
    net.Proto().device_option = GPU1
    net.Iter("it", "it")
    net.LearningRate("it", "lr", base_lr=0.1)
    net.Concat(["x", "x"], ["both", "split_info"], axis=0)
    net.CopyGPUToCPU("both", "host")
    net.Relu("x", "y").Net().Proto().ops[-1].device_option = GPU0
    feeds = {"it": BlobSpec((1,), torch.int64, CPU0), "x": BlobSpec((2, 3), torch.float32, GPU1)}
    specs = infer_specs(net.Proto(), feeds)
    placed = blob_devices(net.Proto())
    assert {b: s.device for b, s in specs.items()} == {b: placed[b] for b in specs}
    assert [specs[b].device for b in ("it", "lr", "both", "split_info", "host", "y")] == [
        CPU0, GPU1, GPU1, CPU0, CPU0, GPU0]


def test_wanted_infers_only_what_those_blobs_depend_on() -> None:
    net = NetDef("init", [
        OperatorDef("ConstantFill", [], ["bad"], {"shape": [1], "dtype": "complex"}),
        OperatorDef("XavierFill", [], ["w"], {"shape": [3, 2]}),
        OperatorDef("Scale", ["w"], ["w"], {"scale": 2.0}),
        OperatorDef("Transpose", ["w"], ["wt"]),
    ])
    assert infer_specs(net, wanted=["wt"]) == {"w": BlobSpec((3, 2), torch.float32, CPU0),
                                                "wt": BlobSpec((2, 3), torch.float32, CPU0)}
    with pytest.raises(ValueError, match=r"op #0 \(ConstantFill\).*unsupported dtype"):
        infer_specs(net)


# ---- memoization ---------------------------------------------------------------------------------------


@pytest.fixture
def counted() -> Iterator[dict[str, int]]:
    """_TestShapeRule (a counted shape rule) and _TestShapeKernel (a counted kernel factory)."""
    calls = {"rule": 0, "kernel": 0}

    def rule(a, ctx, inputs):  # noqa: ANN001, ANN202
        calls["rule"] += 1
        return [TensorSpec((*inputs[0].shape, int(a.extra)), inputs[0].dtype)]

    def kernel(a, ctx):  # noqa: ANN001, ANN202
        calls["kernel"] += 1
        return lambda x: x.unsqueeze(-1).expand(*x.shape, int(a.extra))

    extra = {"extra": Arg("any", 2)}
    with scoped_registry():
        register_op("_TestShapeRule", args=extra, kernel=kernel, infer=rule, doc="Test op: counted rule.")
        register_op("_TestShapeKernel", args=extra, kernel=kernel, doc="Test op: counted kernel.")
        yield calls


@pytest.mark.parametrize("op_type,counter", [("_TestShapeRule", "rule"), ("_TestShapeKernel", "kernel")])
def test_replicated_ops_are_inferred_once(counted: dict[str, int], op_type: str, counter: str) -> None:
    """16 replicas (other blobs, other devices of one type) cost one inference; another input shape,
    arg, or device type costs one more each."""
    ops = [OperatorDef(op_type, [f"gpu_{d}/x"], [f"gpu_{d}/y"], {}, DeviceOption(CUDA, d)) for d in range(16)]
    feeds = {f"gpu_{d}/x": BlobSpec((4, 3), torch.float32, DeviceOption(CUDA, d)) for d in range(16)}
    specs = infer_specs(NetDef("replicas", ops), feeds)
    assert counted[counter] == 1
    assert {specs[f"gpu_{d}/y"] for d in range(16)} == {BlobSpec((4, 3, 2), torch.float32, DeviceOption(CUDA, d))
                                                         for d in range(16)}
    ops += [OperatorDef(op_type, ["gpu_0/y"], ["gpu_0/z"], {}, GPU0),  # another input shape
            OperatorDef(op_type, ["gpu_0/x"], ["gpu_0/u"], {"extra": 3}, GPU0),  # another arg
            OperatorDef(op_type, ["gpu_0/x"], ["gpu_0/v"], {"extra": 2.0}, GPU0),  # another arg type
            OperatorDef(op_type, ["gpu_0/x"], ["gpu_0/w"], {}, CPU0)]  # another device type
    counted[counter] = 0
    infer_specs(NetDef("replicas", ops), feeds)
    assert counted[counter] == 5


# ---- CreateNet ------------------------------------------------------------------------------------------


def test_run_net_reports_a_shape_mismatch_naming_the_op_before_anything_runs() -> None:
    """CreateNet accepts a net whose blobs do not fit it yet (Caffe2 found that when the op ran); each
    RunNet checks again before any op runs, until the blobs fit."""
    for name, value in _mlp_feeds(inner=4).items():
        if isinstance(value, torch.Tensor):
            workspace.FeedBlob(name, value.numpy())
    workspace.FeedBlob("w2", np.zeros((2, 5), np.float32))
    workspace.FeedBlob("b2", np.zeros(2, np.float32))
    net = _mlp()
    workspace.CreateNet(net)
    before = {name: workspace.FetchBlob(name) for name in workspace.Blobs()}
    for _ in range(2):
        with pytest.raises(ShapeInferenceError, match=r"\[enforce fail at shape inference\] .*op #0 \(FC\) "
                                                      r"\(recorded at .*test_shapes.py:\d+\).*same reduction dim"):
            workspace.RunNet(net)
        assert workspace.Blobs() == sorted(before)
    workspace.FeedBlob("w1", np.zeros((5, 3), np.float32))
    workspace.RunNet(net)
    assert workspace.FetchBlob("p").shape == (8, 2)
    workspace.FeedBlob("w1", np.zeros((5, 7), np.float32))
    with pytest.raises(ShapeInferenceError, match="same reduction dim"):
        workspace.RunNetOnce(net)


def test_a_net_of_a_blob_fed_later_is_created_as_in_caffe2() -> None:
    """Caffe2's partial-clone test creates nets on empty feeds (a Sum of a still-empty float64 blob and a
    float32 one); the net is created, and runs once fed what fits."""
    workspace.RunNetOnce(NetDef("params", [OperatorDef("ConstantFill", [], ["p1"], {"shape": [2], "value": 1.0})]))
    net = NetDef("clone", [OperatorDef("Sum", ["b1", "p1"], ["c1"])], external_inputs=["b1", "p1"])
    workspace.FeedBlob("b1", np.array([]))
    workspace.CreateNet(net)
    workspace.FeedBlob("b1", np.array([1.0, 2.0], np.float32))
    workspace.RunNet(net)
    np.testing.assert_array_equal(workspace.FetchBlob("c1"), [2.0, 3.0])


def test_inference_at_create_net_leaves_the_random_streams_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dropout and random fills draw the same values as if CreateNet inferred nothing."""
    netdef = NetDef("random", [OperatorDef("GaussianFill", [], ["g"], {"shape": [64]}),
                               OperatorDef("Dropout", ["g"], ["y", "mask"], {"ratio": 0.5})])

    def run() -> list[np.ndarray]:
        workspace.ResetWorkspace()
        workspace.CreateNet(netdef)
        workspace.RunNet(netdef, 2)
        return [workspace.FetchBlob(b) for b in ("g", "y", "mask")]

    inferred = run()
    monkeypatch.setattr(plan_module, "infer_specs", lambda netdef, feeds: {})
    for got, expected in zip(run(), inferred):
        np.testing.assert_array_equal(got, expected)
