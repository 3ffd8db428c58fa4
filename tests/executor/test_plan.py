"""compile_net: validation, input checks, device placement and kernels built once at CreateNet."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import graphpar.executor.plan as plan_module
from graphpar import core, devices, workspace
from graphpar.core import CPU, CUDA, DeviceOption, NetDef, OperatorDef
from graphpar.core import schema as registry
from graphpar.errors import MissingBlobError, OperatorError
from graphpar.executor import compile_net
from tests.executor import toy_ops

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without a GPU")


def _feed(*names: str) -> None:
    for name in names:
        workspace.FeedBlob(name, np.ones(3, dtype=np.float32))


def test_kernels_are_built_once_at_create_net_not_per_run() -> None:
    _feed("x")
    net = core.Net("once")
    net._TestCounted("x", "y", name="built_once")
    net._TestCounted("y", "z", name="built_once", step=2.5)
    workspace.CreateNet(net)
    assert toy_ops.FACTORY_CALLS["built_once"] == 2
    workspace.RunNet(net, num_iter=5)
    assert toy_ops.FACTORY_CALLS["built_once"] == 2
    np.testing.assert_array_equal(workspace.FetchBlob("z"), [4.5] * 3)  # 1 + 1.0 default + 2.5


def test_run_net_does_no_validation_registry_look_ups_or_argument_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    """RunNet only executes the plan: everything that needs the schema happened at CreateNet."""
    _feed("x")
    net = core.Net("hot_path")
    net.Scale("x", "y", scale=2.0)
    net.Relu("y", "z")
    workspace.CreateNet(net)

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("called at RunNet")

    for module in (registry, plan_module):
        for name in ("get_schema", "parse_args", "check_operator"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, forbidden)
    monkeypatch.setattr(NetDef, "validate", forbidden)
    monkeypatch.setattr(NetDef, "copy", forbidden)
    workspace.RunNet(net, num_iter=3)
    np.testing.assert_array_equal(workspace.FetchBlob("z"), [2.0] * 3)


def test_steps_read_and_write_frame_slots() -> None:
    _feed("a", "b", "c")
    net = core.Net("kinds")
    net.Relu("a", "r")
    net.Add(["a", "b"], "s")
    net._TestSum3(["a", "b", "c"], "t")
    net._TestTwoOut("a", ["u", "v"])
    net._TestSink("a", [])
    plan = compile_net(net.Proto(), workspace.get_workspace())
    names = plan.frame.names
    assert [s.index for s in plan.steps] == [0, 1, 2, 3, 4]
    assert [[names[i] for i in s.inputs] for s in plan.steps] == [["a"], ["a", "b"], ["a", "b", "c"], ["a"], ["a"]]
    assert [[names[o] for o in s.outputs] for s in plan.steps] == [["r"], ["s"], ["t"], ["u", "v"], []]
    assert [(load.name, load.reader) for load in plan.frame.loads] == [("a", 0), ("b", 1), ("c", 2)]
    assert list(plan.frame.store_names) == ["r", "s", "t", "u", "v"]
    assert plan.dependencies == ((), (), (), (), ())
    assert plan.name == net.Name() and plan.workspace_name == "default"


def test_missing_input_at_create_net_names_blob_op_and_net() -> None:
    _feed("x")
    net = core.Net("needs_w")
    net.Relu("x", "h")
    net.FC(["h", "w", "b"], "y")
    with pytest.raises(MissingBlobError) as info:
        workspace.CreateNet(net)
    message = str(info.value)
    for part in (f"net '{net.Name()}'", "op #1 (FC)", "input 1 'w'", "'default'", "CreateNet"):
        assert part in message
    with pytest.raises(RuntimeError, match="has not been created"):  # not registered
        workspace.RunNet(net)


def test_input_produced_only_by_a_later_op_is_missing() -> None:
    _feed("x")
    netdef = NetDef("late", [OperatorDef("Relu", ["y"], ["z"]), OperatorDef("Relu", ["x"], ["y"])])
    with pytest.raises(MissingBlobError, match=r"op #0 \(Relu\): input 0 'y'"):
        workspace.RunNetOnce(netdef)
    assert workspace.Blobs() == ["x"]


def test_control_inputs_must_exist_too() -> None:
    _feed("x")
    ok = NetDef("ctl_ok", [OperatorDef("Relu", ["x"], ["a"]),
                           OperatorDef("Relu", ["x"], ["b"], control_inputs=["a"])])
    workspace.RunNetOnce(ok)
    bad = NetDef("ctl_bad", [OperatorDef("Relu", ["x"], ["b"], control_inputs=["nothing"])])
    with pytest.raises(MissingBlobError, match="control input 0 'nothing'"):
        workspace.RunNetOnce(bad)


def test_invalid_net_is_rejected_before_anything_runs() -> None:
    _feed("x")
    bad_arg = NetDef("bad_arg", [OperatorDef("Relu", ["x"], ["y"]), OperatorDef("Scale", ["y"], ["z"],
                                                                            args={"scael": 2.0})])
    with pytest.raises(TypeError, match="scael"):
        workspace.CreateNet(bad_arg)
    with pytest.raises(ValueError, match="net type must be one of 'async_scheduling', 'compiled', 'cuda_graph', 'dag', 'simple', got 'async'"):
        workspace.CreateNet(NetDef("bad_type", [], type="async"))
    assert workspace.Blobs() == ["x"]


def test_kernel_factory_failure_names_the_op() -> None:
    _feed("x")
    net = core.Net("no_build")
    net._TestBadFactory("x", "y")
    with pytest.raises(OperatorError, match=r"op #0 \(_TestBadFactory\).*cannot be built.*test_plan.py:\d+"):
        workspace.CreateNet(net)


def test_plan_is_a_snapshot_of_the_netdef() -> None:
    _feed("x")
    netdef = NetDef("snap", [OperatorDef("Scale", ["x"], ["y"], args={"scale": 2.0})])
    plan = compile_net(netdef, workspace.get_workspace())
    netdef.ops[0].outputs[0] = "changed"
    netdef.ops.append(OperatorDef("Relu", ["y"], ["w"]))
    assert len(plan.steps) == 1 and plan.netdef.ops[0].outputs == ["y"]


def test_op_device_is_op_option_else_net_option_else_cpu(placed: list[DeviceOption]) -> None:
    _feed("x")
    placed.clear()
    ops = [OperatorDef("_TestDevice", ["x"], ["a"], device_option=DeviceOption(CUDA, 1)),
           OperatorDef("_TestDevice", ["x"], ["b"])]
    workspace.CreateNet(NetDef("on_gpu2", ops, device_option=DeviceOption(CUDA, 2)))
    workspace.CreateNet(NetDef("default", [op.copy() for op in ops]))
    assert placed == [DeviceOption(CUDA, 1), DeviceOption(CUDA, 2), DeviceOption(CUDA, 1), DeviceOption(CPU, 0)]


def test_simulated_cuda_ops_get_the_cpu_device() -> None:
    _feed("x")
    toy_ops.DEVICES.clear()
    with devices.cuda_on_cpu():
        workspace.RunOperatorOnce(OperatorDef("_TestDevice", ["x"], ["y"], device_option=DeviceOption(CUDA, 3)))
    assert toy_ops.DEVICES == [torch.device("cpu")]


@NO_GPU
def test_missing_cuda_device_fails_at_create_net() -> None:
    _feed("x")
    net = core.Net("gpu_net")
    net.Relu("x", "y")
    missing = devices.num_cuda_devices()  # the first id past the machine's GPUs (0 without any)
    net.RunAllOnGPU(missing)
    with devices.cuda_on_cpu(False), pytest.raises(RuntimeError, match=rf"op #0 \(Relu\).*CUDA device {missing}"):
        workspace.CreateNet(net)


@pytest.mark.cuda
def test_cuda_net_computes_on_the_gpu() -> None:
    with devices.cuda_on_cpu(False):
        workspace.FeedBlob("gpu_0/x", np.array([-1.0, 2.0], dtype=np.float32))
        net = core.Net("gpu_relu")
        net.Relu("gpu_0/x", "gpu_0/y")
        net.RunAllOnGPU(0)
        workspace.RunNetOnce(net)
    assert workspace.FetchTensor("gpu_0/y").device == torch.device("cuda", 0)
    np.testing.assert_array_equal(workspace.FetchBlob("gpu_0/y"), [0.0, 2.0])


def test_compile_against_a_standalone_workspace_uses_its_blobs() -> None:
    ws = workspace.Workspace("standalone", seed=5)
    ws.feed_blob("x", np.array([1.0, -1.0], dtype=np.float32))
    plan = ws.create_net(NetDef("p", [OperatorDef("Relu", ["x"], ["y"])]))
    assert plan.workspace_name == "standalone"
    ws.run_net("p")
    np.testing.assert_array_equal(ws.fetch_blob("y"), [1.0, 0.0])
    assert not workspace.HasBlob("y")


def test_check_inputs_exist_names_the_first_missing_input_and_gains_what_the_net_writes():
    """A blob is there when defined before or written by an earlier op (not by its reader, nor later);
    control inputs count; on success `defined` gains every blob the net writes."""
    net = NetDef("inputs_exist")
    net.ops = [OperatorDef("Relu", ["a"], ["b"]), OperatorDef("Add", ["b", "c"], ["d"], control_inputs=["e"]),
               OperatorDef("Relu", ["d"], ["d"])]
    with pytest.raises(MissingBlobError, match=r"op #1 \(Add\).*control input 0 'e'"):
        plan_module.check_inputs_exist(net, {"a", "c"}, "ws")
    defined = {"a", "c", "e"}
    plan_module.check_inputs_exist(net, defined, "ws")
    assert defined == {"a", "b", "c", "d", "e"}
    late = NetDef("written_later")
    late.ops = [OperatorDef("Relu", ["x"], ["x"]), OperatorDef("Relu", ["y"], ["x"])]
    with pytest.raises(MissingBlobError, match=r"op #0 \(Relu\).*input 0 'x'"):
        plan_module.check_inputs_exist(late, {"y"}, "ws")
