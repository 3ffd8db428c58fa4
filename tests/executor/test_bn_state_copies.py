"""SpatialBN's running statistics: copies per step (issue 21), counted on the CPU with a stand-in.

On the H100, a ResNet-50 step made about 106 device-to-device copies: SpatialBN cloned its running
mean and variance every step, since both torch kernels (native and cuDNN) update them in place and a
failed run must leave them unchanged. A CUDA-graph step cannot fail on the host once captured, so
there the kernels update the capture's static buffers in place (`graphpar.core.capture`), and those
stay the workspace's blobs, with no copy into them before each replay either. `Copies` (a
TorchDispatchMode) counts `clone` / `copy_` / `_to_copy` inside each op type's kernels and, outside
them, the copies into a captured net's static buffers by blob name.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphpar import data_parallel_model as dpm
from graphpar import workspace
from graphpar.devices import cuda_on_cpu
from graphpar.executor.graphs import graph_backend
from graphpar.executor.runtime import runtime_of
from graphpar.model_helper import ModelHelper
from graphpar.ops import norm
from tests.executor.test_graphs import RecordingGraphs, _cnn, _sgd

aten = torch.ops.aten
COPIES = {aten.clone.default, aten.copy_.default, aten._to_copy.default}


class Copies(TorchDispatchMode):
    """Counts copies per op type (`op`, set by the wrapped kernels) and, outside the ops, by destination."""

    def __init__(self) -> None:
        super().__init__()
        self.op: str | None = None
        self.in_ops: Counter[str] = Counter()
        self.into: list[torch.Tensor] = []  # destinations of copies outside the ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func in COPIES:
            if self.op is not None:
                self.in_ops[self.op] += 1
            elif func is aten.copy_.default:
                self.into.append(args[0])
        return func(*args, **(kwargs or {}))


def _watch(mode: Copies, net_name: str) -> None:
    ws = workspace.get_workspace()
    plan = ws.nets[net_name]

    def wrapped(kernel, op_type):  # noqa: ANN001, ANN202
        def run(*args):  # noqa: ANN002, ANN202
            mode.op = op_type
            try:
                return kernel(*args)
            finally:
                mode.op = None
        return run

    ws.nets[net_name] = plan.with_steps(tuple(
        step.with_kernel(wrapped(step.kernel, plan.netdef.ops[step.index].type),
                         step.reuse and wrapped(step.reuse.kernel, plan.netdef.ops[step.index].type))
        for step in plan.steps))


def _copies(devices: list[int], steps: int, **options) -> tuple[Counter, list[str], dict[str, np.ndarray]]:  # noqa: ANN003
    """Per op type, the copies in `steps` steady-state steps of the BN CNN (fed once); the blobs
    copied into outside the ops (a captured net's static buffers); every blob afterwards."""
    rng = np.random.default_rng(0)
    workspace.ResetWorkspace()
    model = ModelHelper(name="bn_copies")
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=_cnn,
                    optimizer_builder_fun=_sgd, devices=devices, **options)
    for d in devices:
        workspace.FeedBlob(f"gpu_{d}/data", rng.standard_normal((2, 3, 4, 4)).astype(np.float32))
        workspace.FeedBlob(f"gpu_{d}/label", rng.integers(0, 3, 2).astype(np.int32))
    dpm.RunInitNet(model)
    name = model.net.Proto().name
    mode = Copies()
    _watch(mode, name)
    dpm.RunNet(model, 3)  # warm-up (and, for a CUDA-graph net, its capture and first replay)
    mode.in_ops.clear()
    mode.into.clear()
    with mode:
        dpm.RunNet(model, steps)
    plan = workspace.get_workspace().nets[name]
    graph = runtime_of(plan).graph
    statics = {id(t): plan.frame.names[slot] for slot, t in graph.statics.items()} if graph else {}
    into = sorted({statics.get(id(t), "?") for t in mode.into})
    return mode.in_ops, into, {b: workspace.FetchBlob(b) for b in workspace.Blobs() if "Optimizer" not in b}


@pytest.mark.parametrize(("devices", "options"), [([0], {}), ([0, 1], {}), ([0, 1], {"combine_spatial_bn": True})],
                         ids=["one_device", "two_devices", "inter_device_bn"])
def test_bn_copies_its_running_stats_per_step_except_in_a_cuda_graph(devices, options) -> None:  # noqa: ANN001
    with cuda_on_cpu():
        eager, eager_into, expected = _copies(devices, 4, net_type="simple", **options)
    with cuda_on_cpu(), graph_backend(RecordingGraphs()):
        captured, captured_into, got = _copies(devices, 4, cuda_graph=True, **options)
    # eager: the local kernels clone mean and variance (2 per layer, device and step), since a failed
    # run must leave the workspace's running stats unchanged; inter-device BN computes new ones
    assert eager["SpatialBN"] == (0 if options else 2 * len(devices) * 4) and eager_into == []
    assert captured["SpatialBN"] == 0  # in place on the static buffers
    # ... which stay the workspace's blobs: no copy into them before a replay. (The other replicas'
    # running stats are Copy ops' outputs, device 0's each step, as in Caffe2: new tensors, refreshed.)
    assert [b for b in captured_into if b.startswith("gpu_0/bn_r")] == []
    assert sorted(got) == sorted(expected)
    for blob, value in expected.items():
        np.testing.assert_array_equal(got[blob], value, err_msg=blob)


def test_the_cudnn_branch_updates_in_place_only_when_captured(monkeypatch) -> None:  # noqa: ANN001
    """The cuDNN branch (no GPU here: cuDNN's kernels are faked by the native ones, which also update
    the running stats they are given in place) copies them in eager runs, not in a capture."""
    calls = []

    def fake_cudnn(x, scale, bias, rm, rv, factor, epsilon):  # noqa: ANN001, ANN202
        calls.append((rm, rv))
        y, mean, inv_std = torch.native_batch_norm(x, scale, bias, rm, rv, True, factor, epsilon)
        return y, mean, inv_std, torch.empty(0)

    monkeypatch.setattr(norm, "_uses_cudnn", lambda *args: True)
    monkeypatch.setattr(norm, "_cudnn_forward", fake_cudnn)
    monkeypatch.setattr(norm, "_cudnn_backward", lambda x, dy, scale, mean, inv_std, eps, reserve: (
        aten.native_batch_norm_backward(dy, x, scale, None, None, mean, inv_std, True, eps, (True,) * 3)))
    with cuda_on_cpu():
        eager, _, expected = _copies([0], 3, net_type="simple")
    with cuda_on_cpu(), graph_backend(RecordingGraphs()):
        captured, _, got = _copies([0], 3, cuda_graph=True)
    assert calls and eager["SpatialBN"] == 2 * 3 and captured["SpatialBN"] == 0
    for blob, value in expected.items():
        np.testing.assert_array_equal(got[blob], value, err_msg=blob)


@pytest.mark.parametrize("net_type", ["simple", "dag"])
def test_a_run_failing_after_bn_leaves_its_running_stats_unchanged(net_type: str) -> None:
    """Why eager runs copy: a later op fails (CheckFinite of a NaN) after SpatialBN updated the stats."""
    from graphpar.core import NetDef, OperatorDef
    from graphpar.errors import OperatorError

    rng = np.random.default_rng(0)
    workspace.ResetWorkspace()
    blobs = {"x": rng.standard_normal((4, 3, 2, 2)), "s": np.ones(3), "b": np.zeros(3), "rm": rng.random(3),
             "rv": 1 + rng.random(3), "bad": np.full(1, np.nan)}
    for name, value in blobs.items():
        workspace.FeedBlob(name, value.astype(np.float32))
    net = NetDef(name="bn_then_fail", type=net_type, ops=[
        OperatorDef("SpatialBN", ["x", "s", "b", "rm", "rv"], ["y", "rm", "rv", "sm", "siv"], args={"momentum": 0.5}),
        OperatorDef("Mul", ["y", "bad"], ["z"], args={"broadcast": 1}),
        OperatorDef("CheckFinite", ["z"], [])])
    workspace.CreateNet(net)
    before = {name: workspace.FetchBlob(name) for name in ("rm", "rv")}
    with pytest.raises(OperatorError, match="CheckFinite"):
        workspace.RunNet("bn_then_fail")
    for name, value in before.items():
        np.testing.assert_array_equal(workspace.FetchBlob(name), value, err_msg=name)
    workspace.FeedBlob("bad", np.ones(1, np.float32))
    workspace.RunNet("bn_then_fail")
    assert not np.array_equal(workspace.FetchBlob("rm"), before["rm"])  # a run that succeeds updates them
