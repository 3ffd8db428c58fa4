"""profile_net runs the same kernels in the same order as RunNet, one record per op, and tables its times."""

from __future__ import annotations

import functools
import itertools
import re
from collections import Counter
from contextlib import nullcontext

import numpy as np
import pytest
import torch

from graphpar import core, model_helper, optimizer, profiler, workspace
from graphpar import data_parallel_model as dpm
from graphpar.devices import cuda_on_cpu
from graphpar.errors import OperatorError
from graphpar.executor.graphs import graph_backend
from graphpar.models import mlp


def _trained_model(devices: list[int], cpu_device: bool = True, net_type: str = "dag") -> model_helper.ModelHelper:
    model = model_helper.ModelHelper(name="prof")
    dpm.Parallelize(model, input_builder_fun=lambda m: None,
                    forward_pass_builder_fun=functools.partial(mlp, dim_in=6, hidden=(5,)),
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1, momentum=0.9),
                    devices=devices, cpu_device=cpu_device, net_type=net_type)
    rng = np.random.default_rng(0)
    prefix = "cpu" if cpu_device else "gpu"
    for d in devices:
        workspace.FeedBlob(f"{prefix}_{d}/data", rng.standard_normal((4, 6), dtype=np.float32))
        workspace.FeedBlob(f"{prefix}_{d}/label", rng.integers(0, 10, 4).astype(np.int32))
    dpm.RunInitNet(model)
    return model


def _snapshot() -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in workspace.get_workspace().blobs.items()}


def _restore(saved: dict[str, torch.Tensor]) -> None:
    blobs = workspace.get_workspace().blobs  # the dict the created plans read and write
    blobs.clear()
    blobs.update({name: tensor.clone() for name, tensor in saved.items()})


def _assert_same_blobs(expected: dict[str, torch.Tensor]) -> None:
    got = workspace.get_workspace().blobs
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def _check_profile_equals_run_net(model: model_helper.ModelHelper) -> profiler.Profile:
    before = _snapshot()
    workspace.RunNet(model.net, 2)
    after_run = _snapshot()
    _restore(before)
    prof = profiler.profile_net(model.net.Proto().name, num_iter=2)
    _assert_same_blobs(after_run)
    return prof


@pytest.mark.parametrize("net_type", ["simple", "dag"])
def test_profile_results_equal_run_net_and_records_cover_every_op(net_type: str) -> None:
    model = _trained_model([0, 1], net_type=net_type)
    prof = _check_profile_equals_run_net(model)
    ops = model.net.Proto().ops
    assert prof.net == model.net.Proto().name and prof.num_iter == 2
    assert [r.index for r in prof.records] == list(range(len(ops)))
    assert [r.type for r in prof.records] == [op.type for op in ops]
    assert [r.device for r in prof.records] == [f"cpu:{op.device_option.device_id}" for op in ops]
    assert all(r.total_ms >= 0 and r.mean_ms >= 0 and r.share >= 0 for r in prof.records)
    assert prof.total_ms == pytest.approx(sum(r.total_ms for r in prof.records))
    assert sum(r.share for r in prof.records) == pytest.approx(1.0)
    assert all(r.mean_ms == pytest.approx(r.total_ms / 2) for r in prof.records)
    if net_type == "simple":  # on "dag" the replicas' ops overlap, so their times may add up to more
        assert prof.wall_ms >= prof.total_ms


def test_fake_clock_gives_exact_times(monkeypatch) -> None:
    ticks = itertools.count(0, 1_000_000)  # every clock reading advances 1 ms
    monkeypatch.setattr(profiler, "_clock", lambda: next(ticks))
    workspace.FeedBlob("x", np.array([-1.0, 2.0], dtype=np.float32))
    net = core.Net("tiny")
    net.Relu("x", "y")
    net.Scale("y", "z", scale=3.0)
    prof = profiler.profile_net(net, num_iter=3)
    assert [(r.total_ms, r.mean_ms, r.share) for r in prof.records] == [(3.0, 1.0, 0.5)] * 2
    assert prof.total_ms == 6.0
    np.testing.assert_array_equal(workspace.FetchBlob("z"), [0.0, 6.0])
    assert "tiny" not in workspace.get_workspace().nets  # compiled for the profile only


def test_aggregation_by_type_and_tables(monkeypatch) -> None:
    model = _trained_model([0, 1])
    prof = profiler.profile_net(model.net.Proto().name)
    counts = Counter(op.type for op in model.net.Proto().ops)
    by_type = prof.by_type()
    assert {r.type: r.count for r in by_type} == counts
    for row in by_type:
        assert row.total_ms == pytest.approx(sum(r.total_ms for r in prof.records if r.type == row.type))
    assert [r.total_ms for r in by_type] == sorted((r.total_ms for r in by_type), reverse=True)
    assert sum(r.share for r in by_type) == pytest.approx(1.0)

    table = prof.table(by="type")
    lines = table.splitlines()
    assert lines[0] == "| type | ops | total ms | ms/iter | share |" and lines[1] == "|---|---|---|---|---|"
    assert [line.split(" | ")[0].removeprefix("| ") for line in lines[2:]] == [r.type for r in by_type]
    op_lines = str(prof).splitlines()
    assert op_lines[0] == "| # | type | device | total ms | ms/iter | share |"
    assert len(op_lines) == 2 + len(prof.records)
    totals = [float(line.split(" | ")[4]) for line in op_lines[2:]]
    assert totals == sorted(totals, reverse=True)
    assert all(re.fullmatch(r"\d+\.\d%", line.split(" | ")[-1].rstrip(" |")) for line in op_lines[2:])
    assert len(prof.table(top=3).splitlines()) == 5
    with pytest.raises(ValueError, match="by must be one of"):
        prof.table(by="device")
    with pytest.raises(ValueError, match="top must be a positive int"):
        prof.table(top=0)


def test_errors_match_run_net() -> None:
    with pytest.raises(RuntimeError, match="has not been created"):
        profiler.profile_net("nope")
    with pytest.raises(ValueError, match="num_iter must be a positive int"):
        profiler.profile_net("nope", num_iter=0)
    workspace.FeedBlob("x", np.ones((4, 3), dtype=np.float32))
    workspace.FeedBlob("w", np.ones((2, 3), dtype=np.float32))
    workspace.FeedBlob("b", np.ones(2, dtype=np.float32))
    net = core.Net("bad")
    net.FC(["x", "w", "b"], "y")
    workspace.CreateNet(net)
    workspace.FeedBlob("w", np.ones((2, 5), dtype=np.float32))  # a kernel failure, not a CreateNet one
    with pytest.raises(OperatorError, match=r"net 'bad' op #0 \(FC\) failed"):
        profiler.profile_net("bad", workspace="default")
    assert not workspace.HasBlob("y")


def test_cuda_plans_synchronise_around_every_op(monkeypatch) -> None:
    """Logical CUDA devices (here on the CPU) make the profiler wait for each device after each op."""
    from graphpar.devices import cuda_on_cpu

    with cuda_on_cpu():
        model = _trained_model([0, 1], cpu_device=False)
    calls: list[torch.device] = []
    monkeypatch.setattr(profiler, "torch_device", lambda option: torch.device(
        "cuda", option.device_id) if option.device_type == core.CUDA else torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    prof = profiler.profile_net(model.net.Proto().name, num_iter=2)
    num_ops = len(model.net.Proto().ops)
    assert Counter(calls) == {torch.device("cuda", 0): 1 + 2 * num_ops, torch.device("cuda", 1): 1 + 2 * num_ops}
    assert {r.device for r in prof.records} >= {"cuda:0", "cuda:1"}


@pytest.mark.cuda
def test_profile_on_real_gpus_equals_run_net() -> None:
    from graphpar.devices import num_cuda_devices

    prof = _check_profile_equals_run_net(_trained_model(list(range(min(2, num_cuda_devices()))), cpu_device=False))
    assert all(r.device.startswith("cuda:") or r.type in ("Iter", "LearningRate") for r in prof.records)


def test_a_cuda_graph_net_is_profiled_op_by_op_without_capturing() -> None:
    captures = []

    class Recording:
        def check(self, net_name, devices):  # noqa: ANN001, ANN202
            return None

        def warming(self, devices):  # noqa: ANN001, ANN202
            return nullcontext()

        def capture(self, body, devices):  # noqa: ANN001, ANN202
            captures.append(devices)
            return body

    with cuda_on_cpu(), graph_backend(Recording()):
        model = _trained_model([0], cpu_device=False, net_type="cuda_graph")
        workspace.RunNet(model.net, 3)  # two warm-up runs, then the capture
        prof = profiler.profile_net(model.net.Proto().name, num_iter=4)
    assert len(captures) == 1  # the profile captured nothing (its timed plan would capture after 2 runs)
    assert len(prof.records) == len(model.net.Proto().ops) and all(r.total_ms > 0 for r in prof.records)
