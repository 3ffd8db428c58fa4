"""The IR data types: DeviceOption, BlobReference, GradientSlice, OperatorDef, NetDef and validate()."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from graphpar.core import (
    CPU,
    CUDA,
    BlobReference,
    DeviceOption,
    DeviceType,
    GradientSlice,
    Net,
    NetDef,
    OperatorDef,
    device_option_equal,
)
from graphpar.core.schema import register_op, scoped_registry, validate_net
from graphpar.errors import UnknownOperatorError


@pytest.fixture(autouse=True, scope="module")
def _test_ops() -> Iterator[None]:
    """This module's test-only operators, registered for its tests only."""
    with scoped_registry():
        register_op("_TestIrUnary", inputs=1, outputs=1, inplace={(0, 0)}, args={"alpha": 1.0},
                    kernel=lambda a, ctx: lambda x: x, doc="Test op: in-place allowed.")
        register_op("_TestIrCopy", inputs=1, outputs=1, kernel=lambda a, ctx: lambda x: x,
                    doc="Test op: never in place.")
        register_op("_TestIrStats", inputs=2, outputs=2, enforce_inplace={(1, 1)}, args={"momentum": 0.9},
                    kernel=lambda a, ctx: lambda x, s: (x, s), doc="Test op: output 1 must be input 1.")
        yield



def test_device_option_defaults_equality_and_hashing() -> None:
    assert DeviceOption() == DeviceOption(CPU, 0)
    assert DeviceOption(1, 2) == DeviceOption(CUDA, 2)
    assert DeviceOption(1, 2).device_type is DeviceType.CUDA
    assert len({DeviceOption(CUDA, 0), DeviceOption(CUDA, 0), DeviceOption(CPU, 0)}) == 2
    assert repr(DeviceOption(CUDA, 3)) == "DeviceOption(CUDA, 3)"
    with pytest.raises(AttributeError):
        DeviceOption().device_id = 1  # type: ignore[misc]


@pytest.mark.parametrize("bad", [dict(device_type=2), dict(device_type="cuda"), dict(device_type=True),
                                 dict(device_id=-1), dict(device_id=1.0), dict(device_id=True)])
def test_device_option_rejects_bad_fields(bad: dict) -> None:
    with pytest.raises(TypeError):
        DeviceOption(**bad)


def test_device_option_equal_treats_unset_as_cpu0() -> None:
    assert device_option_equal(None, DeviceOption(CPU, 0))
    assert device_option_equal(None, None)
    assert not device_option_equal(None, DeviceOption(CUDA, 0))
    assert not device_option_equal(DeviceOption(CUDA, 0), DeviceOption(CUDA, 1))


def test_blob_reference_behaves_as_its_name() -> None:
    ref = BlobReference("gpu_1/fc_w")
    assert isinstance(ref, str) and ref == "gpu_1/fc_w" and hash(ref) == hash("gpu_1/fc_w")
    assert {"gpu_1/fc_w": 7}[ref] == 7 and {ref: 7}["gpu_1/fc_w"] == 7
    assert ref.GetNameScope() == "gpu_1/" and ref.GetUnscopedName() == "fc_w"
    assert BlobReference("x").GetNameScope() == "" and BlobReference("a/b/c").GetNameScope() == "a/b/"
    assert repr(ref) == "BlobReference('gpu_1/fc_w')"
    assert type(str(ref)) is str
    with pytest.raises(TypeError, match="must be a str"):
        BlobReference(3)  # type: ignore[arg-type]


def test_blob_reference_concatenation_keeps_type_and_net() -> None:
    net = Net("ir_concat")
    ref = BlobReference("w", net)
    for combined, expected in ((ref + "_grad", "w_grad"), ("gpu_0/" + ref, "gpu_0/w")):
        assert isinstance(combined, BlobReference) and combined == expected
        assert combined.Net() is net


def test_blob_reference_records_ops_on_its_net() -> None:
    net = Net("ir_sugar")
    x = net.AddExternalInput("x")
    y = x.Relu([], "y")
    z = y.FC(["w", "b"], "z", axis=1)
    assert y == "y" and y.Net() is net and z.Net() is net
    relu, fc = net.Proto().ops
    assert (relu.type, relu.inputs, relu.outputs) == ("Relu", ["x"], ["y"])
    assert (fc.type, fc.inputs, fc.outputs, fc.args) == ("FC", ["y", "w", "b"], ["z"], {"axis": 1})
    with pytest.raises(AttributeError, match="bound to no Net"):
        BlobReference("unbound").Relu()
    with pytest.raises(AttributeError):
        x._private  # noqa: B018


def test_blob_reference_attributes_are_only_registered_ops() -> None:
    """An unknown name fails at attribute access, naming close op types, so probing with hasattr works."""
    net = Net("ir_sugar_unknown")
    x = net.AddExternalInput("x")
    with pytest.raises(UnknownOperatorError, match="'Rleu'.*Did you mean Relu"):
        x.Rleu  # noqa: B018
    assert not hasattr(x, "tolist") and not hasattr(x, "Proto") and hasattr(x, "Relu")
    assert net.Proto().ops == []


def test_gradient_slice_fields() -> None:
    grad = GradientSlice("idx", "vals")
    assert grad.indices == "idx" and grad.values == "vals" and tuple(grad) == ("idx", "vals")


def test_operator_def_copy_is_independent() -> None:
    inner = NetDef("inner", [OperatorDef("_TestIrCopy", ["a"], ["b"])])
    op = OperatorDef("_TestIrUnary", ["x"], ["y"], {"alpha": 2.0, "net": inner, "shape": [2, 3]},
                     DeviceOption(CUDA, 1), "name", "ENGINE", ["c"], True, "f.py:3")
    dup = op.copy()
    for field in ("type", "inputs", "outputs", "device_option", "name", "engine", "control_inputs",
                  "is_gradient_op", "source"):
        assert getattr(dup, field) == getattr(op, field), field
    dup.inputs.append("z")
    dup.outputs[0] = "w"
    dup.control_inputs.clear()
    dup.args["alpha"] = 3.0
    dup.args["net"].ops[0].inputs[0] = "changed"
    dup.args["shape"].append(4)  # list args are copied too
    assert op.inputs == ["x"] and op.outputs == ["y"] and op.control_inputs == ["c"]
    assert op.args["alpha"] == 2.0 and inner.ops[0].inputs == ["a"] and op.args["shape"] == [2, 3]


def test_net_def_copy_and_op_device() -> None:
    op = OperatorDef("_TestIrCopy", ["x"], ["y"])
    own = OperatorDef("_TestIrCopy", ["y"], ["z"], device_option=DeviceOption(CPU, 0))
    netdef = NetDef("n", [op, own], ["x"], ["z"], "dag", 4, DeviceOption(CUDA, 2), {"k": 1})
    dup = netdef.copy("m")
    assert (dup.name, dup.type, dup.num_workers, dup.device_option, dup.args) == (
        "m", "dag", 4, DeviceOption(CUDA, 2), {"k": 1})
    dup.ops[0].inputs[0] = "q"
    dup.external_inputs.append("q")
    assert op.inputs == ["x"] and netdef.external_inputs == ["x"] and netdef.copy().name == "n"
    netdef.args["hosts"] = ["a"]
    netdef.copy().args["hosts"].append("b")  # net-level list args are copied as well
    assert netdef.args["hosts"] == ["a"]
    assert netdef.op_device(op) == DeviceOption(CUDA, 2)  # inherits the net's option
    assert netdef.op_device(own) == DeviceOption(CPU, 0)  # its own option wins
    assert NetDef("bare").op_device(op) == DeviceOption()  # nothing set: CPU 0


def _valid_net() -> NetDef:
    return NetDef("v", [
        OperatorDef("_TestIrUnary", ["x"], ["x"], {"alpha": 0.5}),  # allowed in place
        OperatorDef("_TestIrStats", ["x", "s"], ["y", "s"]),  # enforced pair respected
        OperatorDef("_TestIrCopy", ["y"], ["z"], control_inputs=["s"]),
    ], external_inputs=["x", "s"], external_outputs=["z", "x"])


def test_validate_accepts_a_good_net() -> None:
    netdef = _valid_net()
    assert netdef.validate() is netdef


@pytest.mark.parametrize("edit, error, message", [
    (lambda n: setattr(n, "type", ""), ValueError, "type must be a non-empty str"),
    (lambda n: setattr(n, "num_workers", 0), ValueError, "num_workers must be an int >= 1"),
    (lambda n: setattr(n, "num_workers", 2.0), ValueError, "num_workers must be an int >= 1"),
    (lambda n: setattr(n, "device_option", "cuda:0"), TypeError, "net 'v': device_option must be"),
    (lambda n: n.ops[2].inputs.__setitem__(0, ""), TypeError, "non-empty strings"),
    (lambda n: n.ops[2].control_inputs.append(3), TypeError, "non-empty strings"),
    (lambda n: setattr(n.ops[0], "device_option", "cuda:0"), TypeError, "DeviceOption"),
    (lambda n: n.ops[2].inputs.append("x"), ValueError, r"op #2 \(_TestIrCopy\): takes 1 inputs"),
    (lambda n: (setattr(n.ops[2], "outputs", ["y"]), n.external_outputs.remove("z")), ValueError,
     "may not run in place"),
    (lambda n: n.ops[1].outputs.__setitem__(1, "s2"), ValueError, "must be input 1"),
    (lambda n: n.ops[0].args.update(alpha="big"), TypeError, "argument 'alpha' must be float"),
    (lambda n: n.ops[0].args.update(alpah=1.0), TypeError, "unknown argument 'alpah'.*Did you mean alpha"),
    (lambda n: n.external_outputs.append("nowhere"), ValueError, r"external outputs \['nowhere'\]"),
])
def test_validate_names_the_first_violation(edit, error, message) -> None:
    netdef = _valid_net()
    edit(netdef)
    with pytest.raises(error, match=message):
        validate_net(netdef)
