"""Executors by net type; any valid schedule gives the same results, random draws included."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from graphpar import workspace
from graphpar.core import Net, NetDef, OperatorDef
from graphpar.executor import get_executor, net_types, register_executor
from graphpar.executor import registry as executor_registry
from graphpar.executor.frame import commit, open_frame
from graphpar.executor.plan import CompiledNet
from graphpar.executor.program import step_runs
from graphpar.executor.simple import SimpleExecutor


class ShuffledExecutor:
    """Runs the steps in a random order that respects `plan.dependencies`: the freedom of a concurrent one."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.orders: list[list[int]] = []

    def run(self, plan: CompiledNet, blobs: dict[str, torch.Tensor]) -> None:
        frame = open_frame(plan, blobs)
        done: set[int] = set()
        order: list[int] = []
        pending = list(range(len(plan.steps)))
        while pending:
            j = self.rng.choice([j for j in pending if done.issuperset(plan.dependencies[j])])
            step_runs(plan)[j](frame)
            done.add(j)
            order.append(j)
            pending.remove(j)
        self.orders.append(order)
        commit(plan, frame, blobs)


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
