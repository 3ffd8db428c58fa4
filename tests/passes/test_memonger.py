"""The memory optimiser: exact sharing on tiny nets, and what it never shares."""

from __future__ import annotations

from graphpar.core.ir import NetDef, OperatorDef
from graphpar.core.schema import validate_net
from graphpar.passes.memonger import share_blobs


def _op(type_: str, inputs: list[str], outputs: list[str], **args: object) -> OperatorDef:
    return OperatorDef(type_, inputs, outputs, dict(args), is_gradient_op=True)


def _chain() -> NetDef:
    """A backward-like chain: g0 -> g1 -> g2 -> g3, each dead once the next exists; w_grad is read at the end."""
    return NetDef("chain", [
        _op("Relu", ["cpu_0/x"], ["cpu_0/g0"]),             # 0
        _op("Scale", ["cpu_0/g0"], ["cpu_0/g1"], scale=2.0),  # 1
        _op("Scale", ["cpu_0/g1"], ["cpu_0/g2"], scale=2.0),  # 2
        _op("Scale", ["cpu_0/g2"], ["cpu_0/g3"], scale=2.0),  # 3
        _op("Mul", ["cpu_0/g3", "cpu_0/x"], ["cpu_0/w_grad"]),  # 4
        OperatorDef("Copy", ["cpu_0/w_grad"], ["cpu_1/w_grad"], {"input_device_ids": [0]}),  # 5
    ], external_inputs=["cpu_0/x"])


def test_blobs_whose_lifetimes_do_not_touch_share_names_first_fit():
    net = _chain()
    renames = share_blobs(net, "cpu_0/", lambda blob: True)
    # g0 [0,1] and g2 [2,3] share; g1 [1,2] and g3 [3,4] share; w_grad is touched by a copy: kept.
    assert renames == {"cpu_0/g0": "cpu_0/__m0_shared", "cpu_0/g1": "cpu_0/__m1_shared",
                       "cpu_0/g2": "cpu_0/__m0_shared", "cpu_0/g3": "cpu_0/__m1_shared"}
    assert [(op.inputs, op.outputs) for op in net.ops[:4]] == [
        (["cpu_0/x"], ["cpu_0/__m0_shared"]), (["cpu_0/__m0_shared"], ["cpu_0/__m1_shared"]),
        (["cpu_0/__m1_shared"], ["cpu_0/__m0_shared"]), (["cpu_0/__m0_shared"], ["cpu_0/__m1_shared"])]
    validate_net(net)  # no op reads and writes one shared name (lifetimes must not even touch)


def test_inputs_outputs_excluded_and_other_scopes_keep_their_names():
    net = _chain()
    net.external_outputs = ["cpu_0/g3"]
    renames = share_blobs(net, "cpu_0/", lambda blob: blob != "cpu_0/g1", dont_share={"cpu_0/g2"})
    assert renames == {"cpu_0/g0": "cpu_0/__m0_shared"}  # g1 rejected, g2 excluded, g3 an output, x an input
    assert share_blobs(_chain(), "cpu_1/", lambda blob: True) == {}


def test_same_spec_is_preferred_when_specs_are_known():
    net = NetDef("specs", [
        _op("Relu", ["x"], ["s/a"]), _op("Relu", ["x"], ["s/b"]),  # a: [4], b: [8]
        _op("Add", ["s/a", "x"], ["s/c"]), _op("Relu", ["s/b"], ["s/d"]),
        _op("Relu", ["s/c"], ["s/e"]), _op("Relu", ["s/d"], ["s/f"]),
        _op("Sum", ["s/e", "s/f"], ["s/y"])], external_inputs=["x"], external_outputs=["s/y"])
    specs = {"s/a": (4,), "s/b": (8,), "s/c": (4,), "s/d": (8,), "s/e": (8,), "s/f": (4,)}
    renames = share_blobs(net, "s/", lambda blob: True, specs=specs)
    # d takes a's name (the only free one), e the name b ([8]) held though c's ([4]) was free first,
    # and f the name c ([4]) held.
    assert renames["s/d"] == renames["s/a"] and renames["s/e"] == renames["s/b"]
    assert renames["s/f"] == renames["s/c"] != renames["s/e"]
