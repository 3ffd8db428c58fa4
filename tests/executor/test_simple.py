"""run(): results equal eager PyTorch; failures name the op and leave no partial outputs."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphpar import core, devices, workspace
from graphpar.core import CUDA, DeviceOption
from graphpar.errors import MissingBlobError, OperatorError
from tests.executor import toy_ops


def _feed(name: str, value: np.ndarray) -> None:
    workspace.FeedBlob(name, np.asarray(value, dtype=np.float32))


def test_multi_output_nary_zero_output_and_in_place_ops_run() -> None:
    _feed("x", [-1.0, 2.0])
    toy_ops.SUNK.clear()
    net = core.Net("shapes")
    net._TestTwoOut("x", ["p", "q"])
    net._TestSum3(["x", "p", "q"], "s")
    net.Relu("s", "s")
    net._TestSink("s", [])
    workspace.RunNetOnce(net)
    np.testing.assert_array_equal(workspace.FetchBlob("p"), [0.0, 3.0])
    np.testing.assert_array_equal(workspace.FetchBlob("q"), [-2.0, 4.0])
    np.testing.assert_array_equal(workspace.FetchBlob("s"), [0.0, 9.0])
    assert len(toy_ops.SUNK) == 1 and toy_ops.SUNK[0] is workspace.FetchTensor("s")


def test_kernel_failure_names_net_op_inputs_and_recording_site() -> None:
    _feed("x", np.ones((4, 3)))
    _feed("w", np.ones((2, 3)))
    _feed("b", np.zeros(2))
    net = core.Net("mlp")
    net.Relu("x", "h")
    line = inspect.currentframe().f_lineno + 1
    net.FC(["h", "w", "b"], "y")
    workspace.CreateNet(net)
    _feed("w", np.ones((2, 5)))  # after CreateNet, whose shape inference would have refused it
    with pytest.raises(OperatorError) as info:
        workspace.RunNet(net)
    message = str(info.value)
    for part in (f"net '{net.Name()}'", "op #1 (FC)", "input 0 'h': shape [4, 3], float32, cpu",
                 "input 1 'w': shape [2, 5], float32, cpu", "input 2 'b': shape [2]",
                 f"test_simple.py:{line}"):
        assert part in message, (part, message)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert not workspace.HasBlob("h") and not workspace.HasBlob("y")  # a failed run changes nothing


def test_failed_op_leaves_no_partial_outputs() -> None:
    _feed("x", [1.0])
    _feed("a", [7.0])
    net = core.Net("fails")
    net._TestFail("x", ["a", "fresh"], message="kaputt")
    workspace.CreateNet(net)
    with pytest.raises(OperatorError, match=r"op #0 \(_TestFail\) failed: ValueError: kaputt"):
        workspace.RunNet(net)
    np.testing.assert_array_equal(workspace.FetchBlob("a"), [7.0])
    assert not workspace.HasBlob("fresh")


def test_wrong_output_count_from_a_kernel_is_an_operator_error() -> None:
    _feed("x", [1.0])
    net = core.Net("short")
    net._TestWrongCount("x", ["a", "b"])
    with pytest.raises(OperatorError, match="returned 1 outputs, expected a tuple of 2"):
        workspace.RunNetOnce(net)
    assert workspace.Blobs() == ["x"]


def test_blob_removed_after_create_net_is_a_missing_blob_at_run_net() -> None:
    _feed("x", [1.0, -1.0])
    net = core.Net("uses_x")
    net.Relu("x", "y")
    net.Scale("y", "z", scale=2.0)
    workspace.CreateNet(net)
    workspace.RunNet(net)
    del workspace.blobs["y"]  # recreated by op 0, so the net still runs
    workspace.RunNet(net)
    del workspace.blobs["x"]
    with pytest.raises(MissingBlobError) as info:
        workspace.RunNet(net)
    message = str(info.value)
    for part in (f"net '{net.Name()}'", "op #0 (Relu)", "input 0 'x'", "no longer in workspace"):
        assert part in message, (part, message)


def test_key_error_inside_a_kernel_is_an_operator_error() -> None:
    _feed("x", [1.0])
    net = core.Net("lookup")
    net._TestKeyError("x", "y")
    with pytest.raises(OperatorError, match="KeyError: 'absent'"):
        workspace.RunNetOnce(net)


def test_simulated_cuda_net_runs_on_the_cpu() -> None:
    with devices.cuda_on_cpu():
        _feed("gpu_1/x", [-3.0, 4.0])
        net = core.Net("sim")
        with core.DeviceScope(DeviceOption(CUDA, 1)):
            net.Relu("gpu_1/x", "gpu_1/y")
        workspace.RunNetOnce(net)
    np.testing.assert_array_equal(workspace.FetchBlob("gpu_1/y"), [0.0, 4.0])


# ---- random programs against eager PyTorch ---------------------------------------------------------

UNARY_OPS = {"Relu": torch.relu, "Scale": lambda x: x * 0.5}
BINARY_OPS = {"Add": torch.add, "Mul": torch.mul}

program = st.lists(st.tuples(st.sampled_from(sorted(UNARY_OPS) + sorted(BINARY_OPS) + ["FC"]),
                             st.integers(0, 1000), st.integers(0, 1000), st.booleans()),
                   min_size=1, max_size=12)


def _build(ops: list[tuple[str, int, int, bool]], net_type: str) -> tuple[core.Net, dict[str, torch.Tensor]]:
    """Record `ops` over blobs v0..; return the net and the eager reference values it must produce."""
    rng = np.random.RandomState(len(ops))
    values = {"v0": torch.tensor(rng.randn(4, 6), dtype=torch.float32),
              "v1": torch.tensor(rng.randn(4, 6), dtype=torch.float32),
              "w": torch.tensor(rng.randn(6, 6), dtype=torch.float32),
              "b": torch.tensor(rng.randn(6), dtype=torch.float32)}
    for name, value in values.items():
        workspace.FeedBlob(name, value)
    net = core.Net(f"random_{net_type}")
    net.Proto().type = net_type
    names = ["v0", "v1"]
    for op_type, i, j, in_place in ops:
        x, y = names[i % len(names)], names[j % len(names)]
        out = x if in_place and op_type in UNARY_OPS else f"v{len(names)}"
        if op_type in UNARY_OPS:
            getattr(net, op_type)(x, out, **({"scale": 0.5} if op_type == "Scale" else {}))
            values[out] = UNARY_OPS[op_type](values[x])
        elif op_type in BINARY_OPS:
            getattr(net, op_type)([x, y], out)
            values[out] = BINARY_OPS[op_type](values[x], values[y])
        else:
            net.FC([x, "w", "b"], out)
            values[out] = torch.nn.functional.linear(values[x], values["w"], values["b"])
        if out not in names:
            names.append(out)
    return net, values


@settings(max_examples=20)
@given(ops=program)
def test_random_programs_match_eager_and_dag_equals_simple(ops: list[tuple[str, int, int, bool]]) -> None:
    results = {}
    for net_type in ("simple", "dag"):
        workspace.ResetWorkspace()
        net, expected = _build(ops, net_type)
        workspace.CreateNet(net)
        workspace.RunNet(net)
        for name, value in expected.items():
            torch.testing.assert_close(workspace.FetchTensor(name), value, rtol=1e-5, atol=1e-5)
        results[net_type] = {name: workspace.FetchBlob(name) for name in workspace.Blobs()}
    assert results["simple"].keys() == results["dag"].keys()
    for name, value in results["simple"].items():
        np.testing.assert_array_equal(results["dag"][name], value)
