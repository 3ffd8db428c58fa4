"""The Net builder and CreateOperator: validation, scoping, auto-naming, external inputs, net edits."""

from __future__ import annotations

import copy
import os
import sys
import types
from collections.abc import Iterator

import numpy as np
import pytest

import graphpar
from graphpar import workspace
from graphpar.core import (
    CPU,
    CUDA,
    BlobReference,
    CreateOperator,
    DeviceOption,
    DeviceScope,
    GradientSlice,
    NameScope,
    Net,
    NetDef,
    OperatorDef,
)
from graphpar.core import schema as registry
from graphpar.core.schema import Arg, register_op, scoped_registry, validate_net
from graphpar.errors import UnknownOperatorError


@pytest.fixture(autouse=True, scope="module")
def _test_ops() -> Iterator[None]:
    """This module's test-only operators, registered for its tests only."""
    with scoped_registry():
        register_op("_TestNetPair", inputs=1, outputs=2, kernel=lambda a, ctx: lambda x: (x, x),
                    doc="Test op: one input, two outputs.")
        register_op("_TestNetBody", inputs=0, outputs=1, args={"body": Arg("net", None), "values": Arg("floats", ())},
                    kernel=lambda a, ctx: lambda: None, doc="Test op: takes a net and a list argument.")
        yield


GPU1 = DeviceOption(CUDA, 1)


def _line_of(marker: str) -> str:
    """`file:line` of the line in this file that contains `marker` (for checking op.source)."""
    with open(__file__) as f:
        for number, line in enumerate(f, 1):
            if marker in line and "_line_of" not in line:
                return f"{__file__}:{number}"
    raise LookupError(marker)


def _summary(net: Net) -> list[tuple]:
    return [(op.type, op.inputs, op.outputs) for op in net.Proto().ops]


# ---- CreateOperator --------------------------------------------------------------------------------


def test_create_operator_scopes_plain_names_as_caffe2() -> None:
    with NameScope("gpu_0"), DeviceScope(GPU1):
        op = CreateOperator("FC", [BlobReference("x"), "w", "b"], "y",  # marker: create-op
                            name="fc", engine="CUDNN", control_input="dep", axis=2)
    assert isinstance(op, OperatorDef)
    assert (op.type, op.inputs, op.outputs, op.args) == ("FC", ["x", "gpu_0/w", "gpu_0/b"], ["gpu_0/y"],
                                                         {"axis": 2})
    assert all(type(b) is str for b in (*op.inputs, *op.outputs, *op.control_inputs))
    assert (op.name, op.engine, op.control_inputs, op.device_option) == ("fc", "CUDNN", ["gpu_0/dep"], GPU1)
    assert op.source == _line_of("marker: create-op")
    assert not op.is_gradient_op
    unset = CreateOperator("Relu", "x", "y", name=None, engine=None)  # Caffe2 code passes None
    assert (unset.name, unset.engine) == ("", "")


def test_create_operator_device_option_explicit_then_scope_then_none() -> None:
    assert CreateOperator("Relu", "x", "y").device_option is None
    with DeviceScope(GPU1):
        assert CreateOperator("Relu", "x", "y").device_option == GPU1
        assert CreateOperator("Relu", "x", "y", device_option=DeviceOption(CPU)).device_option == DeviceOption()
    with pytest.raises(TypeError, match="device_option must be a DeviceOption"):
        CreateOperator("Relu", "x", "y", device_option="cuda:0")


def test_create_operator_stores_plain_argument_values() -> None:
    inner = Net("test_net_inner_arg")
    inner.Relu("a", "b")
    op = CreateOperator("ConstantFill", [], "c", shape=np.array([2, 3]), value=np.float32(0.5))
    assert op.args["shape"] == [2, 3] and type(op.args["shape"][0]) is int
    assert op.args["value"] == 0.5 and type(op.args["value"]) is float
    values = [1.0, 2.0]
    op = CreateOperator("_TestNetBody", [], "c", body=inner, values=values)
    values.append(3.0)  # the op keeps its own copy
    assert op.args["values"] == [1.0, 2.0]
    assert isinstance(op.args["body"], NetDef) and op.args["body"] is not inner.Proto()
    assert [o.type for o in op.args["body"].ops] == ["Relu"]


def test_create_operator_unknown_type_is_built_and_fails_at_create_net_suggesting_close_names() -> None:
    op = CreateOperator("Rleu", "x", "y", some_arg=[1, 2])  # as Caffe2: placeholder ops are fine here
    assert (op.type, op.inputs, op.outputs, op.args) == ("Rleu", ["x"], ["y"], {"some_arg": [1, 2]})
    workspace.FeedBlob("x", np.ones(2, np.float32))
    with pytest.raises(UnknownOperatorError, match="unknown operator type 'Rleu'.*Relu") as info:
        workspace.RunOperatorOnce(op)
    assert isinstance(info.value, AttributeError)
    with pytest.raises(TypeError, match="must be a str"):
        CreateOperator(3, "x", "y")  # type: ignore[arg-type]


@pytest.mark.parametrize("call, error, message", [
    (lambda: CreateOperator("FC", ["x", "w", "b"], "y", axis="one"), TypeError,
     "operator FC: argument 'axis' must be int, got str 'one'"),
    (lambda: CreateOperator("FC", ["x", "w", "b"], "y", axes=1), TypeError,
     "unknown argument 'axes'.*Did you mean axis"),
    (lambda: CreateOperator("FC", ["x", "w", "b"], "x"), ValueError, "may not run in place"),
    (lambda: CreateOperator("Relu", [3], "y"), TypeError, "inputs must be non-empty blob names"),
    (lambda: CreateOperator("Relu", "x", [""]), TypeError, "outputs must be non-empty blob names"),
    (lambda: CreateOperator("Relu", 3, "y"), TypeError, "inputs must be a blob name or a list"),
])
def test_create_operator_rejects_bad_ops(call, error, message) -> None:
    with pytest.raises(error, match=message):
        call()


def test_wrong_arity_is_reported_when_the_net_is_created_as_caffe2() -> None:
    op = CreateOperator("FC", ["x", "w"], "y")  # recorded: Caffe2 checked counts at creation
    with pytest.raises(ValueError, match="takes 3 inputs, got 2"):
        workspace.RunOperatorOnce(op)
    net = Net("test_net_wrong_arity")
    net.Relu(["x", "x2"], "y")
    assert len(net.Proto().op) == 1
    with pytest.raises(ValueError, match=r"op #0 \(Relu\): takes 1 inputs, got 2"):
        workspace.CreateNet(net)
    assert not workspace.HasBlob("y")


def test_each_op_signature_is_checked_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """check_operator runs again for any difference in type, counts, aliasing or arg names/types/values."""
    monkeypatch.setattr(registry, "_passed", set())
    checked = []
    real = registry._check_against
    monkeypatch.setattr(registry, "_check_against",
                        lambda schema, op, where: (checked.append(op.outputs[0]), real(schema, op, where))[1])
    net = Net("test_net_check_once")
    net.Conv(["x", "w"], "y1", kernels=[3, 3], stride=1)
    net.Conv(["x2", "w2"], "y2", kernels=[3, 3], stride=1)  # same signature, other blobs: not re-checked
    net.Conv(["x", "w"], "y3", kernels=[3, 3], stride=2)
    net.Conv(["x", "w"], "y4", kernels=[3, 3], stride=True)  # == 1, but another type
    net.Conv(["x", "w", "b"], "y5", kernels=[3, 3], stride=1)
    net.Conv(["x", "w"], "y6", stride=1, kernels=[3, 3])  # argument order differs: checked again
    net.Relu("r", "r")
    net.Relu("s", "s")
    net.Relu("r", "t")
    net.GivenTensorFill([], "v1", values=[0.0] * 17, shape=[17])  # long lists: checked every time
    net.GivenTensorFill([], "v2", values=[0.0] * 17, shape=[17])
    assert checked == ["y1", "y3", "y4", "y5", "y6", "r", "t", "v1", "v2"]


@pytest.mark.parametrize("outputs, args, error, message", [
    ("z", {"kernels": [3, 3], "stride": 1.0}, TypeError, "argument 'stride' must be int, got float 1.0"),
    ("z", {"kernels": [3, 3.0], "stride": 1}, TypeError, "argument 'kernels' must be ints"),
    ("z", {"kernels": [3, 3], "stride": "1"}, TypeError, "argument 'stride' must be int, got str"),
    ("z", {"kernels": [3, 3], "stride": 1, "strid": 1}, TypeError, "unknown argument 'strid'"),
    ("x", {"kernels": [3, 3], "stride": 1}, ValueError, "may not run in place"),
])
def test_a_passed_signature_hides_no_error(monkeypatch: pytest.MonkeyPatch, outputs, args, error, message) -> None:
    monkeypatch.setattr(registry, "_passed", set())
    net = Net("test_net_check_cached")
    net.Conv(["x", "w"], "y", kernels=[3, 3], stride=1)  # passes: its signature is remembered
    with pytest.raises(error, match=message):
        net.Conv(["x", "w"], outputs, **args)


# ---- recording ops into a Net ------------------------------------------------------------------------


def test_ops_return_references_bound_to_the_net() -> None:
    net = Net("test_net_refs")
    y = net.Relu("x", "y")
    a, b = net._TestNetPair(y, ["a", "b"])
    assert isinstance(y, BlobReference) and y == "y" and y.Net() is net
    assert (a, b) == ("a", "b") and a.Net() is net and b.Net() is net
    z = y.Relu([], "z")  # sugar for net.Relu([y], "z")
    assert _summary(net) == [("Relu", ["x"], ["y"]), ("_TestNetPair", ["y"], ["a", "b"]),
                             ("Relu", ["y"], ["z"])]
    assert z.Net() is net


def test_plain_names_are_scoped_and_references_taken_as_is() -> None:
    net = Net("test_net_scoping")
    outside = BlobReference("shared/w")
    with NameScope("gpu_0"):
        h = net.FC(["x", outside, BlobReference("b")], "h")
        with NameScope("block"):
            net.Relu(h, "r", control_input=["c", BlobReference("d")])
    fc, relu = net.Proto().ops
    assert (fc.inputs, fc.outputs) == (["gpu_0/x", "shared/w", "b"], ["gpu_0/h"])
    assert (relu.inputs, relu.outputs) == (["gpu_0/h"], ["gpu_0/block/r"])
    assert relu.control_inputs == ["gpu_0/block/c", "d"]


def test_external_inputs_are_recorded_once_in_order() -> None:
    net = Net("test_net_external")
    net.Relu("x", "x")  # in place on an input nobody produced: x is external
    net.FC(["x", "w", "b"], "y")
    net.FC(["y", "w", "b2"], "z")  # y is produced here, w is already external
    net.Relu("z", "z", control_input="never_made")  # control inputs are not data inputs
    assert net.Proto().external_inputs == ["x", "w", "b", "b2"]
    assert all(net.BlobIsDefined(b) for b in ("x", "w", "b", "b2", "y", "z"))
    assert not net.BlobIsDefined("never_made")


def test_auto_naming_follows_caffe2_and_never_collides() -> None:
    net = Net("test_net_auto")
    name = net.Name()
    net.AddExternalInput(f"{name}/Relu_2")  # an existing blob takes a candidate name
    first, second, third = net.Relu("x"), net.Relu("x"), net.Relu("x")
    assert (first, second, third) == (f"{name}/Relu", f"{name}/Relu_3", f"{name}/Relu_4")
    assert net._TestNetPair("x", 2) == (f"{name}/_TestNetPair:0", f"{name}/_TestNetPair:1")
    assert net._TestNetPair("x", 2) == (f"{name}/_TestNetPair_2:0", f"{name}/_TestNetPair_2:1")
    with NameScope("gpu_3"):
        assert net.Relu("x") == f"gpu_3/{name}/Relu"
    assert net.Relu("x", 1) == (f"{name}/Relu_5:0")


def test_auto_naming_sees_blobs_named_by_hand() -> None:
    net = Net("test_net_auto_hand")
    net.Relu("x", f"{net.Name()}/Relu")
    assert net.Relu("x") == f"{net.Name()}/Relu_2"


def test_device_scope_is_stamped_and_explicit_option_wins() -> None:
    net = Net("test_net_devices")
    net.Relu("x", "a")
    with DeviceScope(GPU1):
        net.Relu("a", "b")
        net.Relu("b", "c", device_option=DeviceOption(CPU, 0))
    assert [op.device_option for op in net.Proto().ops] == [None, GPU1, DeviceOption(CPU, 0)]


def test_ops_record_the_users_call_site() -> None:
    net = Net("test_net_source")
    net.Relu("x", "y")  # marker: net-source
    assert net.Proto().ops[0].source == _line_of("marker: net-source")


def test_call_site_skips_library_frames_but_not_the_model_zoo() -> None:
    package = os.path.dirname(os.path.abspath(graphpar.__file__))
    helper_code = "def build(net, out):\n    return net.Relu('x', out)\n"
    library, zoo = {}, {}
    exec(compile(helper_code, os.path.join(package, "fake_helper.py"), "exec"), library)
    exec(compile(helper_code, os.path.join(package, "models", "fake_zoo.py"), "exec"), zoo)
    net = Net("test_net_call_site")
    library["build"](net, "a")  # marker: via-library
    zoo["build"](net, "b")
    assert [op.source for op in net.Proto().ops] == [
        _line_of("marker: via-library"), f"{os.path.join(package, 'models', 'fake_zoo.py')}:2"]


def test_net_names_are_unique_per_process() -> None:
    base = "test_net_unique_names"
    nets = [Net(base), Net(base), Net(NetDef(base)), Net(base)]
    assert [n.Name() for n in nets] == [base, f"{base}_1", f"{base}_2", f"{base}_3"]
    assert nets[2].Proto().name == f"{base}_2"
    with pytest.raises(TypeError, match="a name or a NetDef"):
        Net(3)  # type: ignore[arg-type]


def test_unknown_and_private_attributes() -> None:
    net = Net("test_net_attrs")
    with pytest.raises(UnknownOperatorError, match="'Rlu'.*Did you mean.*Relu"):
        net.Rlu("x", "y")
    assert hasattr(net, "Relu") and not hasattr(net, "Rlu")
    for private in ("_not_an_op", "__deepcopy_me__"):
        with pytest.raises(AttributeError) as info:
            getattr(net, private)
        assert not isinstance(info.value, UnknownOperatorError)
    assert net.Proto().ops == []


def test_deep_copies_record_into_themselves() -> None:
    net = Net("test_net_deepcopy")
    net.Relu("x", "y")
    dup = copy.deepcopy(net)
    dup.Relu("y", "z")
    assert _summary(net) == [("Relu", ["x"], ["y"])]
    assert _summary(dup) == [("Relu", ["x"], ["y"]), ("Relu", ["y"], ["z"])]


def test_failed_op_creation_changes_nothing() -> None:
    net = Net("test_net_atomic")
    net.Relu("x", "y")
    for bad in (lambda: net.FC(["y", "w", "b"], "z", axis="one"),
                lambda: net.FC(["y", "w", "b"], "y"),  # forbidden in place
                lambda: net.FC(["y", "w"], "z", axes=1)):  # wrong counts wait for CreateNet; args do not
        with pytest.raises((TypeError, ValueError)):
            bad()
    assert _summary(net) == [("Relu", ["x"], ["y"])]
    assert net.Proto().external_inputs == ["x"]
    assert net.Relu("y") == f"{net.Name()}/Relu"


# ---- the rest of the Net API -------------------------------------------------------------------------


def test_add_external_input_and_output() -> None:
    net = Net("test_net_ext_api")
    x = net.AddExternalInput("x")
    w, b = net.AddExternalInput("w", BlobReference("b"))
    assert isinstance(x, BlobReference) and x.Net() is net and (w, b) == ("w", "b")
    with NameScope("gpu_0"):
        assert net.AddExternalInput("s") == "s"  # names are taken as given
    with pytest.raises(ValueError, match=r"already has external input\(s\) \['x'\]"):
        net.AddExternalInput("new", "x")
    with pytest.raises(ValueError, match=r"\['dup'\]"):
        net.AddExternalInput("dup", "dup")
    with pytest.raises(ValueError, match="at least one"):
        net.AddExternalInput()
    assert net.Proto().external_inputs == ["x", "w", "b", "s"]
    y = net.FC([x, w, b], "y")
    with pytest.raises(ValueError, match=r"\['ghost'\].*no op produces"):
        net.AddExternalOutput(y, "ghost")
    net.AddExternalOutput(y, x)
    net.AddExternalOutput(y)
    assert net.Proto().external_outputs == ["y", "x"]
    validate_net(net.Proto())


def test_next_blob_never_repeats() -> None:
    net = Net("test_net_next_blob")
    net.Relu("x", "tmp_auto_1")
    names = [net.NextBlob("tmp") for _ in range(4)]
    assert names == ["tmp", "tmp_auto_0", "tmp_auto_2", "tmp_auto_3"]
    assert net.NextBlob("x") == "x_auto_0"
    with NameScope("gpu_1"):
        assert net.NextScopedBlob("tmp") == "gpu_1/tmp"
    assert net.Relu("x") == f"{net.Name()}/Relu"


def test_clone_remaps_every_blob_list() -> None:
    net = Net("test_net_clone_src")
    net.Relu("x", "h")
    net.FC(["h", "w", "b"], "y", control_input="h")
    net.AddExternalOutput("y")
    net.RunAllOnGPU(2)
    clone = net.Clone("test_net_clone", blob_remap={"x": "gpu_0/x", BlobReference("h"): "gpu_0/h", "y": "out"})
    assert clone.Name() == "test_net_clone" and clone.Proto() is not net.Proto()
    assert _summary(clone) == [("Relu", ["gpu_0/x"], ["gpu_0/h"]),
                               ("FC", ["gpu_0/h", "w", "b"], ["out"])]
    proto = clone.Proto()
    assert proto.ops[1].control_inputs == ["gpu_0/h"]
    assert (proto.external_inputs, proto.external_outputs) == (["gpu_0/x", "w", "b"], ["out"])
    assert proto.device_option == DeviceOption(CUDA, 2)
    assert _summary(net) == [("Relu", ["x"], ["h"]), ("FC", ["h", "w", "b"], ["y"])]  # untouched
    clone.Relu("out", "z")  # the clone's tables know its blobs
    assert clone.Proto().external_inputs == ["gpu_0/x", "w", "b"]
    assert net.Clone("test_net_clone").Name() == "test_net_clone_1"


def test_append_net_merges_inputs_and_copies_ops() -> None:
    net = Net("test_net_append_dst")
    net.Relu("x", "h")
    other = Net("test_net_append_src")
    other.FC(["h", "w", "b"], "y")
    other.Relu("y", "z")
    other.AddExternalOutput("z")
    other.RunAllOnGPU(1)
    assert net.AppendNet(other) is net
    assert _summary(net) == [("Relu", ["x"], ["h"]), ("FC", ["h", "w", "b"], ["y"]), ("Relu", ["y"], ["z"])]
    proto = net.Proto()
    assert proto.external_inputs == ["x", "w", "b"]  # h is produced here
    assert proto.external_outputs == ["z"]
    assert [op.device_option for op in proto.ops] == [None, DeviceOption(CUDA, 1), DeviceOption(CUDA, 1)]
    proto.ops[1].inputs[0] = "edited"
    assert other.Proto().ops[0].inputs[0] == "h" and other.Proto().ops[0].device_option is None


def test_append_net_accepts_a_netdef_and_itself() -> None:
    net = Net("test_net_append_self")
    net.Relu("x", "x")
    net.AppendNet(net)
    net.AppendNet(NetDef("raw", [OperatorDef("Relu", ["q"], ["r"])], external_inputs=["q"]))
    assert _summary(net) == [("Relu", ["x"], ["x"])] * 2 + [("Relu", ["q"], ["r"])]
    assert net.Proto().external_inputs == ["x", "q"]
    with pytest.raises(TypeError, match="Net or a NetDef"):
        net.AppendNet("x")  # type: ignore[arg-type]


def test_run_all_on_gpu_and_device() -> None:
    net = Net("test_net_run_all")
    net.Relu("x", "a")
    with DeviceScope(DeviceOption(CPU)):
        net.Relu("a", "b")
    net.RunAllOnGPU(3)
    proto = net.Proto()
    assert proto.device_option == DeviceOption(CUDA, 3)
    assert [proto.op_device(op) for op in proto.ops] == [DeviceOption(CUDA, 3), DeviceOption(CPU, 0)]
    net.RunAllOnGPU()
    assert proto.device_option == DeviceOption(CUDA, 0)
    net.RunAllOnDevice(DeviceOption(CPU, 1))
    assert proto.device_option == DeviceOption(CPU, 1)
    with pytest.raises(TypeError, match="DeviceOption"):
        net.RunAllOnDevice("cpu")  # type: ignore[arg-type]


def test_blob_is_produced_ignores_external_inputs() -> None:
    net = Net("test_net_produced")
    net.Relu("x", "y")
    assert net.BlobIsProduced("y") and not net.BlobIsProduced("x") and net.BlobIsDefined("x")
    net.Proto().ops[0].outputs = ["z"]  # edits through Proto() are seen
    assert net.BlobIsProduced("z") and not net.BlobIsProduced("y")


def test_recording_does_not_rescan_the_net(monkeypatch: pytest.MonkeyPatch) -> None:
    """Op creation is O(1): the look-up tables are rebuilt only after Proto() was handed out."""
    net = Net("test_net_o1")
    rebuilds = []
    original = Net._rebuild_tables
    monkeypatch.setattr(Net, "_rebuild_tables", lambda self: (rebuilds.append(1), original(self)))
    for i in range(200):
        net.Relu(f"x{i}", f"y{i}")
        net.Relu(f"y{i}")
    net.AddExternalInput("fed")
    net.NextBlob("tmp")
    assert rebuilds == [] and len(net.Proto().ops) == 400
    net.Relu("y0", "z")
    net.Relu("z", "w")
    assert rebuilds == [1]


def test_appending_a_net_does_not_rescan_either(monkeypatch: pytest.MonkeyPatch) -> None:
    net = Net("test_net_append_o1")
    net.Relu("x", "y")
    other = Net("test_net_append_o1_other")
    other.Relu("fed", "z")  # brings a new external input along
    other.Relu("z", "w")
    other_proto = other.Proto()
    rebuilds = []
    original = Net._rebuild_tables
    monkeypatch.setattr(Net, "_rebuild_tables", lambda self: (rebuilds.append(1), original(self)))
    net.AppendNet(other_proto)
    net.Relu("w", "v")
    assert rebuilds == [] and net.BlobIsProduced("w") and net.Proto().external_inputs == ["x", "fed"]


def test_proto_is_live_and_edits_are_seen() -> None:
    net = Net("test_net_live")
    net.Relu("x", "y")
    proto = net.Proto()
    proto.ops[0].outputs[0] = "renamed"  # edited in place after Proto()
    net.Relu("renamed", "z")
    assert proto.external_inputs == ["x"] and net.BlobIsDefined("renamed") and not net.BlobIsDefined("y")
    proto.ops.pop()  # removing ops frees their names
    proto.external_inputs.append("fed")
    assert not net.BlobIsDefined("z") and net.BlobIsDefined("fed")
    proto.ops = []
    assert not net.BlobIsDefined("renamed")


def test_net_from_netdef_copies_it() -> None:
    source = NetDef("test_net_from_proto", [OperatorDef("Relu", ["x"], ["y"])], external_inputs=["x"])
    net = Net(source)
    assert net.BlobIsDefined("y") and net.BlobIsDefined("x")
    net.Relu("y", "z")
    assert len(source.ops) == 1 and source.name == "test_net_from_proto"
    assert net.Proto().external_inputs == ["x"]


def test_printing_shows_the_ops() -> None:
    net = Net("test_net_print")
    with DeviceScope(GPU1):
        net.FC(["x", "w", "b"], "y", axis=1, control_input="dep")
    text = str(net)
    assert text == repr(net)
    assert f"Net '{net.Name()}' (simple, 1 ops)" in text
    assert "external inputs: x, w, b" in text
    assert "#0 y = FC(x, w, b) after(dep) {axis=1} @CUDA:1" in text


# ---- gradients --------------------------------------------------------------------------------------


def test_add_gradient_operators_appends_and_binds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plumbing, against a stand-in backward_pass (autodiff itself is tested in test_autodiff)."""
    calls = []

    def backward_pass(forward_ops, ys, no_gradient_to=()):
        calls.append(([op.type for op in forward_ops], ys, list(no_gradient_to)))
        grad_ops = [OperatorDef("ReluGradient", ["y", "seed"], ["x_grad"], is_gradient_op=True)]
        return grad_ops, {"y": "seed", "x": "x_grad", "emb": GradientSlice("idx", "vals")}

    monkeypatch.setitem(sys.modules, "graphpar.core.autodiff", types.SimpleNamespace(backward_pass=backward_pass))
    net = Net("test_net_grad_plumbing")
    y = net.Relu("x", "y")
    grads = net.AddGradientOperators({y: "seed"}, no_gradient_to=["x"])
    assert calls == [(["Relu"], {"y": "seed"}, ["x"])]
    assert _summary(net)[-1] == ("ReluGradient", ["y", "seed"], ["x_grad"])
    assert net.Proto().external_inputs == ["x", "seed"]  # the fed seed is an input of the net
    assert grads == {"y": "seed", "x": "x_grad", "emb": ("idx", "vals")}
    assert all(isinstance(k, BlobReference) and k.Net() is net for k in grads)
    assert grads["x"].Net() is net and isinstance(grads["emb"], GradientSlice)
    assert grads["emb"].values.Net() is net


def test_add_gradient_operators_with_autodiff() -> None:
    net = Net("test_net_grad")
    h = net.FC(["x", "w", "b"], "h")
    y = net.Relu(h, "y")
    grads = net.AddGradientOperators([y])
    for blob in ("x", "w", "b", "h", "y"):
        assert grads[blob] == f"{blob}_grad" and grads[blob].Net() is net
    types_ = [op.type for op in net.Proto().ops]
    assert types_[:2] == ["FC", "Relu"] and "ReluGradient" in types_ and "FCGradient" in types_
    assert all(op.is_gradient_op for op in net.Proto().ops[3:])
    assert net.Proto().external_inputs == ["x", "w", "b"]
    validate_net(net.Proto())


def test_array_arguments_are_flattened_as_caffe2_did():
    import numpy as np

    net = Net("given")
    net.GivenTensorFill([], "w", values=np.arange(6.0).reshape(2, 3), shape=[2, 3])
    op = net.Proto().ops[-1]
    assert op.args["values"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    net.ConstantFill([], "c", shape=np.array([2, 3]), value=np.float32(1.5))
    assert net.Proto().ops[-1].args == {"shape": [2, 3], "value": 1.5}


def test_clone_with_an_op_mask_recomputes_external_inputs_and_outputs_by_caffe2s_rule():
    net = Net("externals")
    net.Relu(["x"], ["a"])          # 0
    net.Add(["a", "w"], ["a"])      # 1: a rewritten in place
    net.Scale(["a"], ["b"])         # 2
    net.Mul(["b", "v"], ["c"])      # 3
    clone = net.Clone("masked", op_id_mask=[1, 2, 3], update_external_list=True).Proto()
    # read before any kept op writes them, in first-read order; written and never read afterwards
    assert clone.external_inputs == ["a", "w", "v"]
    assert clone.external_outputs == ["c"]
    assert net.Clone("whole", update_external_list=True).Proto().external_outputs == ["c"]
