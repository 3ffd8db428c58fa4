from __future__ import annotations

from graphpar.core.ir import CPU, CUDA, NetDef, OperatorDef
from graphpar.core.schema import validate_net
from graphpar.passes.common import declare_external_inputs, make_op
from tests.passes.helpers import gpu, layout


def test_layout_names_scopes_and_devices():
    lay = layout([4, 5, 7], gpu=True)
    assert lay.device_type == CUDA and lay.master == 4
    assert lay.scoped(7, "fc_w") == "gpu_7/fc_w" and lay.scope(5) == "gpu_5"
    assert lay.option(5) == gpu(5) and lay.option(5) is lay.option(5)  # one shared option per replica
    assert lay.option(6) == gpu(6)  # not a replica: still the device of that id
    assert lay.group("w") == {4: "gpu_4/w", 5: "gpu_5/w", 7: "gpu_7/w"}
    assert [lay.replica_of(b) for b in ("gpu_5/a/b", "gpu_6/x", "cpu_5/x", "x", "gpu_5")] == [5, None, None,
                                                                                          None, None]
    assert layout([0]).device_type == CPU


def test_declare_external_inputs_adds_blobs_read_before_written_in_first_read_order():
    net = NetDef("n", [OperatorDef("ConstantFill", [], ["a"], {"shape": [1]}),
                       make_op("Sum", ["a", "x", "y"], ["z"], None), make_op("Copy", ["z"], ["w"], None),
                       make_op("Sum", ["q", "w"], ["q"], None)], external_inputs=["x"])
    assert declare_external_inputs(net) == ["y", "q"]
    assert net.external_inputs == ["x", "y", "q"]
    assert declare_external_inputs(net) == []
    validate_net(net)
