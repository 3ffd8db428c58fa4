"""Executors by net type; any valid schedule gives the same results, random draws included."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

from graphpar import workspace
from graphpar.core import Net, NetDef, OperatorDef
from graphpar.executor import get_executor, net_types, register_executor
from graphpar.executor import registry as executor_registry
from graphpar.executor.plan import CompiledNet, Phase
from graphpar.executor.program import StepFailed, step_runs
from graphpar.executor.run import run_plan
from graphpar.executor.runtime import Runtime
from graphpar.executor.simple import SimpleExecutor


class ShuffledExecutor:
    """The documented executor contract (docs/extending.md), in a random order that respects
    `plan.dependencies`, phase by phase: the freedom of a concurrent executor. It runs through
    `run_plan`, calls the steps' generated runs and frees what `FrameLayout.frees_in` lists for its order."""

    op_by_op = "simple"

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.orders: list[list[int]] = []

    def keeps_outputs(self, netdef: NetDef) -> bool:
        return True

    def run(self, plan: CompiledNet, blobs: dict[str, torch.Tensor]) -> None:
        run_plan(plan, blobs, self.start)

    def start(self, plan: CompiledNet, runtime: Runtime, frame: list) -> _ShuffledLaunch:
        order: list[int] = []
        for phase in plan.phases:  # a random topological order of each phase, the phases in turn
            done: set[int] = set(order)
            pending = list(phase.steps)
            while pending:
                j = self.rng.choice([j for j in pending if done.issuperset(plan.dependencies[j])])
                order.append(j)
                done.add(j)
                pending.remove(j)
        self.orders.append(order)
        frees = plan.frame.frees_in(order) if plan.frame.frees_memory else None
        return _ShuffledLaunch(plan, frame, order, frees)


class _ShuffledLaunch:
    def __init__(self, plan: CompiledNet, frame: list, order: list[int], frees: Any) -> None:
        self.plan, self.frame, self.order, self.frees = plan, frame, order, frees

    def __call__(self, phase: Phase) -> None:
        runs, members = step_runs(self.plan), set(phase.steps)
        for j in (j for j in self.order if j in members):
            try:
                runs[j](self.frame)
            except Exception as exc:
                raise StepFailed(j) from exc
            for slot in self.frees[j] if self.frees is not None else ():
                self.frame[slot] = None

    def close(self) -> None:
        return None


def test_an_executor_that_runs_out_of_program_order_frees_by_the_documented_contract(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under dynamic memory management, values read by several ops (`h` by ops 1 and 3, `lr` by the
    update and op 4) are freed after their last user in the order the executor chose; the results,
    and what the workspace keeps, equal "simple"'s for every order."""
    shuffled = ShuffledExecutor(seed=5)
    monkeypatch.setitem(executor_registry._EXECUTORS, "shuffled", shuffled)
    results = {}
    for net_type in ("simple", "shuffled"):
        workspace.ResetWorkspace()
        workspace.FeedBlob("x", np.arange(6, dtype=np.float32) - 2.0)
        workspace.FeedBlob("w", np.ones(6, np.float32))
        workspace.FeedBlob("m", np.zeros(6, np.float32))
        net = NetDef("freed", [
            OperatorDef("Relu", ["x"], ["h"]),                                    # 0
            OperatorDef("Scale", ["h"], ["a"], {"scale": 2.0}),                   # 1
            OperatorDef("ConstantFill", [], ["lr"], {"shape": [1], "value": 0.5}),  # 2
            OperatorDef("Sigmoid", ["h"], ["b"]),                                 # 3
            OperatorDef("Scale", ["lr"], ["c"], {"scale": 3.0}),                  # 4
            OperatorDef("Add", ["a", "b"], ["g"]),                                # 5
            OperatorDef("MomentumSGDUpdate", ["g", "m", "lr", "w"], ["g", "m", "w"], {"momentum": 0.9}),  # 6
        ], type=net_type, external_outputs=["c"], args={"dynamic_memory_management": True})
        workspace.CreateNet(net)
        for _ in range(6):
            workspace.RunNet("freed")
        results[net_type] = {name: workspace.FetchBlob(name) for name in workspace.Blobs()}
    assert len({tuple(order) for order in shuffled.orders}) > 1
    assert results["simple"].keys() == results["shuffled"].keys() == {"x", "w", "m", "c"}
    for name, value in results["simple"].items():
        np.testing.assert_array_equal(results["shuffled"][name], value, err_msg=name)


def _random_net(net_type: str) -> NetDef:
    net = Net("random_ops")
    for i in range(4):  # independent branches a concurrent executor may run in any order
        net.GaussianFill([], f"g{i}", shape=[16])
        net.Dropout(f"g{i}", [f"d{i}", f"m{i}"], ratio=0.5, is_test=0)
        net.UniformFill([], f"u{i}", shape=[3])
    proto = net.Proto().copy("random_ops")  # one name for both runs: the name keys the random streams
    proto.type = net_type
    return proto


def test_random_draws_do_not_depend_on_the_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    shuffled = ShuffledExecutor(seed=3)
    monkeypatch.setitem(executor_registry._EXECUTORS, "shuffled", shuffled)
    results = {}
    for net_type in ("simple", "shuffled"):
        workspace.ResetWorkspace()
        netdef = _random_net(net_type)
        workspace.CreateNet(netdef)
        runs = []
        for _ in range(3):
            workspace.RunNet(netdef.name)
            runs.append({name: workspace.FetchBlob(name) for name in workspace.Blobs()})
        results[net_type] = runs
    assert len(shuffled.orders) == 3 and shuffled.orders[0] != sorted(shuffled.orders[0])
    for simple, other in zip(results["simple"], results["shuffled"]):
        assert simple.keys() == other.keys() and len(simple) == 16
        for name, value in simple.items():
            np.testing.assert_array_equal(other[name], value, err_msg=name)
    assert not np.array_equal(results["simple"][0]["d0"], results["simple"][1]["d0"])  # a new mask each run


def test_random_streams_differ_per_op_and_per_compile_and_follow_the_seed() -> None:
    netdef = NetDef("fills", [OperatorDef("GaussianFill", [], [f"g{i}"], {"shape": [8]}) for i in range(2)])
    workspace.RunNetOnce(netdef)
    first = [workspace.FetchBlob(f"g{i}") for i in range(2)]
    assert not np.array_equal(first[0], first[1])  # two ops, two streams
    workspace.RunNetOnce(netdef)
    assert not np.array_equal(workspace.FetchBlob("g0"), first[0])  # a second compile draws afresh
    workspace.ResetWorkspace()
    workspace.RunNetOnce(netdef)
    np.testing.assert_array_equal(workspace.FetchBlob("g0"), first[0])  # reproducible from the seed
    workspace.ResetWorkspace()
    workspace.SetSeed(7)
    workspace.RunNetOnce(netdef)
    assert not np.array_equal(workspace.FetchBlob("g0"), first[0])


def test_an_op_drawing_random_numbers_must_declare_it() -> None:
    from graphpar.core.schema import register_op, scoped_registry

    with scoped_registry():
        register_op("_TestUndeclaredRandom", inputs=0,
                    kernel=lambda a, ctx: (lambda stream: lambda: torch.rand(2, generator=stream("cpu")))(
                        ctx.random_stream()), doc="Test op: random without the trait.")
        with pytest.raises(Exception, match="does not declare Trait.RANDOM"):
            workspace.RunOperatorOnce(OperatorDef("_TestUndeclaredRandom", [], ["r"]))


def test_net_types_name_registered_executors(monkeypatch: pytest.MonkeyPatch) -> None:
    assert {"simple", "dag"} <= set(net_types())
    assert isinstance(get_executor("simple"), SimpleExecutor)
    with pytest.raises(ValueError, match="already registered"):
        register_executor("simple", SimpleExecutor())
    with pytest.raises(ValueError, match=r"net 'n': net type must be one of .*'simple'.*got 'parallel'"):
        get_executor("parallel", "net 'n'")
    monkeypatch.setitem(executor_registry._EXECUTORS, "mine", SimpleExecutor())
    workspace.FeedBlob("x", np.array([-1.0, 2.0], dtype=np.float32))
    workspace.RunNetOnce(NetDef("typed", [OperatorDef("Relu", ["x"], ["y"])], type="mine"))
    np.testing.assert_array_equal(workspace.FetchBlob("y"), [0.0, 2.0])
