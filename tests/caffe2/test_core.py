"""Caffe2's `core_test.py` behaviours: NameScope in CreateOperator, value equality of ops and nets,
device_option_equal, Net(netdef, inplace), Clone/ClonePartial, reroute_tensor, external lists."""

from __future__ import annotations

import sys

import pytest

from graphpar import core, workspace


def test_create_operator_applies_the_name_scope() -> None:
    with core.NameScope("name_scope"):
        op = core.CreateOperator("Relu", "x", "y")
    assert (op.input[0], op.output[0]) == ("name_scope/x", "name_scope/y")
    with core.NameScope("a"), core.NameScope("b"):
        op = core.CreateOperator("Relu", core.BlobReference("x"), "y")
    assert (op.input, op.output) == (["x"], ["a/b/y"])  # a BlobReference is taken as is


def test_operators_and_nets_compare_by_value() -> None:
    a = core.CreateOperator("Relu", "x", "y", name="r")
    b = core.CreateOperator("Relu", "x", "y", name="r")
    assert a == b and a is not b
    assert a != core.CreateOperator("Relu", "x", "z", name="r")
    net1, net2 = core.Net("eq"), core.Net("eq_other")
    for net in (net1, net2):
        net.Relu("x", "y")
    assert net1.Proto() != net2.Proto()  # the names differ
    assert net1.Proto().copy("same") == net2.Proto().copy("same")


def test_caffe2_field_names_read_the_proto() -> None:
    net = core.Net("fields")
    net.FC(["x", "w", "b"], "y", axis=1)
    proto = net.Proto()
    op = proto.op[0]
    assert (op.type, list(op.input), list(op.output)) == ("FC", ["x", "w", "b"], ["y"])
    assert [(arg.name, arg.i) for arg in op.arg] == [("axis", 1)]
    assert op.arg[0].HasField("i") and not op.arg[0].HasField("f")
    assert list(proto.external_input) == ["x", "w", "b"] and list(proto.external_output) == []
    proto.external_output.append("y")
    assert net.external_outputs == ["y"]


def test_device_option_equal() -> None:
    assert core.device_option_equal(core.DeviceOption(core.CPU, 0), core.DeviceOption(core.CPU, 1))
    assert core.device_option_equal(None, core.DeviceOption(core.CPU, 3))
    assert not core.device_option_equal(core.DeviceOption(core.CUDA, 0), core.DeviceOption(core.CUDA, 1))
    assert not core.device_option_equal(core.DeviceOption(core.CPU), core.DeviceOption(core.CUDA))
    named = core.DeviceOption(core.CUDA, 1, node_name="n1")
    assert core.device_option_equal(named, core.DeviceOption(core.CUDA, 1))
    assert not core.device_option_equal(named, core.DeviceOption(core.CUDA, 1), ignore_node_name=False)


def test_net_from_netdef_in_place_edits_that_netdef() -> None:
    proto = core.Net("src").Proto()
    copied, shared = core.Net(proto), core.Net(proto, inplace=True)
    shared.Relu("x", "y")
    assert len(proto.op) == 1 and shared.Proto() is proto
    assert len(copied.Proto().op) == 0


def test_clone_with_op_id_mask_and_updated_external_lists() -> None:
    net = core.Net("clone_src")
    net.Relu("x", "y")
    net.Relu("y", "z")
    net.AddExternalOutput("z")
    clone = net.Clone("clone_dst", op_id_mask=[1], update_external_list=True)
    assert [op.type for op in clone.Proto().op] == ["Relu"]
    assert (clone.Proto().external_input, clone.Proto().external_output) == (["y"], ["z"])
    assert net.Clone("clone_all").Proto().external_input == ["x"]


def test_clone_partial_renames_the_path_between_inputs_and_outputs() -> None:
    net = core.Net("partial_src")
    a = net.Relu("x", "a")
    b = net.Sum([a, "param"], "b")
    net.Sigmoid("x", "unrelated")
    c = net.Tanh(b, "c")
    net.AddGradientOperators([c])  # gradient ops are never cloned
    part, outputs = net.ClonePartial("p", {a: "a_in"}, [c])
    assert [(op.type, op.input, op.output) for op in part.Proto().op] == [
        ("Sum", ["a_in", "param"], ["p/b"]), ("Tanh", ["p/b"], ["p/c"])]
    assert (set(part.Proto().external_input), part.Proto().external_output) == ({"a_in", "param"}, ["p/c"])
    assert outputs == ["p/c"] and outputs[0].Net() is part
    same, _ = net.ClonePartial("q", [b], [c])
    assert [op.input for op in same.Proto().op] == [["b"]]
    with pytest.raises(ValueError, match="not read"):
        net.ClonePartial("r", ["x", b], [c])


def test_reroute_tensor_inserts_a_producer_for_later_readers() -> None:
    net = core.Net("reroute")
    net.Relu("x", "y")
    net.Sigmoid("y", "z")
    net.reroute_tensor("y", core.CreateOperator("Scale", "y", "y_scaled", scale=2.0))
    assert [(op.type, op.input) for op in net.Proto().op] == [
        ("Relu", ["x"]), ("Scale", ["y"]), ("Sigmoid", ["y_scaled"])]


def test_data_type_codes() -> None:
    assert (core.DataType.FLOAT, core.DataType.INT32, core.DataType.INT64, core.DataType.FLOAT16) == (1, 2, 10, 12)
    assert core.IsOperator("Relu") and not core.IsOperator("NoSuchOp")


def test_wrong_arity_is_an_error_at_run_time_not_recording() -> None:
    net = core.Net("arity")
    net.Relu(["x", "x2"], "y")
    with pytest.raises(ValueError, match="takes 1 inputs, got 2"):
        workspace.RunNetOnce(net)


def test_small_net_helpers() -> None:
    net = core.Net("helpers")
    with core.NameScope("s"):
        x = net.AddScopedExternalInputs("x")
    assert x == "s/x" and net.is_external_input("s/x")
    y = net.Relu(x, "y")
    assert net.UsesBlob("y") and net.UsedBlobNames() == {"s/x", "y"}
    assert net.GetBlobRef("y") == y and core.get_net_name(net) == net.Name()
    with pytest.raises(KeyError):
        net.GetBlobRef("nowhere")
    assert core.output_to_list(None) == [] and core.output_to_list(y) == [y]
    assert core.InferBlobDevices(net) == {"s/x": core.DeviceOption(), "y": core.DeviceOption()}
    assert core.IsGPUDeviceType(core.CUDA) and not core.IsGPUDeviceType(core.CPU)
    net._CheckLookupTables()  # Caffe2's self-check
    assert core.device_equal(core.DeviceOption(core.CPU, 0), None)
    assert not core.device_equal(core.DeviceOption(core.CPU, 0), core.DeviceOption(core.CPU, 1))


def test_populate_proto_with_file_name_names_ops_by_file_line_and_function() -> None:
    net = core.Net("named_ops")
    net.Relu("x", "y"); line = sys._getframe().f_lineno  # noqa: E702
    net.Relu("y", "z", name="kept")
    net.PopulateProtoWithFileName()
    assert net.Proto().op[0].name == f"{__file__}:{line}:{sys._getframe().f_code.co_name}"
    assert net.Proto().op[1].name == "kept"


def test_inject_cross_device_copies_adds_none_on_cpu_and_device_scope_takes_a_node_name() -> None:
    net = core.Net("cpu_only")
    with core.DeviceScope(0, node_name="node:1"):
        net.Proto().op.extend([core.CreateOperator("Placeholder:Recv", [], ["w"], src_node="node:0")])
        net.FC(["data", "w", "b"], "fc")
    assert net.Proto().op[1].device_option == core.DeviceOption(core.CPU, node_name="node:1")
    copied, devices = core.InjectCrossDeviceCopies(net, {"other": core.DeviceOption()}, placeHolderOps=["x"])
    assert [op.type for op in copied.Proto().op] == ["Placeholder:Recv", "FC"] and copied is not net
    assert set(devices) == {"other", "w", "data", "b", "fc"}
    gpu = core.Net("on_gpu")
    with core.DeviceScope(core.DeviceOption(core.CUDA, 0)):
        gpu.Relu("x", "y")
    with pytest.raises(NotImplementedError, match="all-CPU"):
        core.InjectCrossDeviceCopies(gpu)
