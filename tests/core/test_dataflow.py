"""core.dataflow: the facts against definitions written out per blob, and the cache's invalidation."""

from __future__ import annotations

import random

import pytest

from graphpar.core.dataflow import Load, dataflow, facts
from graphpar.core.ir import NetDef, OperatorDef


def _net() -> NetDef:
    return NetDef("n", [
        OperatorDef("Relu", ["x"], ["a"]),                           # 0
        OperatorDef("Add", ["a", "w"], ["a"]),                       # 1: a in place
        OperatorDef("Scale", ["a"], ["b"], control_inputs=["c"]),    # 2: c only waited on
        OperatorDef("Scale", ["b"], ["w"]),                          # 3: w overwritten after its read
    ])


def test_facts_of_a_small_net():
    flow = dataflow(_net())
    assert flow.loads == {"x": Load(0, 0), "w": Load(1, 1)}
    assert flow.read_first == {"x", "w", "c"}
    assert flow.first_write == {"a": 0, "b": 2, "w": 3}
    assert flow.written_before("w", 3) is False and flow.written_before("a", 1) is True
    assert flow.data_blobs == ("x", "a", "w", "b")
    assert flow.lifetimes == {"x": (0, 0), "a": (0, 2), "w": (1, 3), "c": (2, 2), "b": (2, 3)}
    assert [(v.blob, set(v.users), v.rewritten_in_place) for v in flow.versions] == [
        ("a", {0, 1}, True), ("a", {1, 2}, False), ("b", {2, 3}, False), ("w", {3}, False)]
    assert flow.predecessors == ((), (0,), (1,), (1, 2))
    assert flow.edges[(1, 3)] == ("war", "w")
    assert flow.readers == {"x": [0], "a": [1, 2], "w": [1], "b": [3]}
    assert flow.writers == {"a": [0, 1], "b": [2], "w": [3]} and flow.waiters == {"c": [2]}
    assert list(flow.loaded_readers("w")) == [1] and not flow.loaded_readers("a") and not flow.loaded_readers("c")
    assert flow.last_write_before("a", 1) == 0 and flow.last_write_before("a", 2) == 1
    assert flow.last_write_before("a", 0) is None and flow.last_write_before("x", 3) is None


def _random_net(rng: random.Random) -> NetDef:
    blobs = [f"b{k}" for k in range(6)]
    ops = [OperatorDef("Op", rng.sample(blobs, rng.randint(0, 3)), rng.sample(blobs, rng.randint(1, 2)),
                       control_inputs=rng.sample(blobs, rng.randint(0, 1))) for _ in range(rng.randint(1, 12))]
    return NetDef("random", ops)


@pytest.mark.parametrize("seed", range(30))
def test_facts_match_their_definitions_blob_by_blob(seed: int):
    net = _random_net(random.Random(seed))
    flow, ops = dataflow(net), net.ops
    names = {b for op in ops for b in (*op.inputs, *op.outputs, *op.control_inputs)}
    for blob in names:
        reads = [i for i, op in enumerate(ops) if blob in op.inputs]
        waits = [i for i, op in enumerate(ops) if blob in op.control_inputs]
        writes = [i for i, op in enumerate(ops) if blob in op.outputs]
        first_write = min(writes, default=len(ops))
        assert (blob in flow.loads) == (bool(reads) and reads[0] <= first_write)
        if blob in flow.loads:
            assert flow.loads[blob] == Load(reads[0], ops[reads[0]].inputs.index(blob))
        assert (blob in flow.read_first) == (min(reads + waits, default=len(ops)) <= first_write and bool(reads + waits))
        assert list(flow.readers.get(blob, ())) == reads and list(flow.writers.get(blob, ())) == writes
        assert list(flow.waiters.get(blob, ())) == waits
        assert list(flow.loaded_readers(blob)) == [r for r in reads if r <= first_write]
        for k in range(len(ops) + 1):
            assert flow.last_write_before(blob, k) == max((w for w in writes if w < k), default=None)
        uses = sorted(reads + waits + writes)
        assert flow.lifetimes[blob] == (uses[0], uses[-1])
        versions = [v for v in flow.versions if v.blob == blob]
        assert [min(v.users) for v in versions] == writes  # one version per write, started by it
        for v, start in zip(versions, writes):
            end = next((w for w in writes if w > start), len(ops))
            assert v.users == {start} | {r for r in reads if start < r <= end}
            assert v.rewritten_in_place == (end < len(ops) and end in reads)
    for j, before in enumerate(flow.predecessors):
        for i in before:  # every edge is a real conflict on some blob
            a, b = ops[i], ops[j]
            assert i < j and (set(a.outputs) & {*b.inputs, *b.control_inputs, *b.outputs}
                              or set(b.outputs) & {*a.inputs, *a.control_inputs})


def test_cached_until_a_blob_changes():
    net = _net()
    first = dataflow(net)
    assert dataflow(net) is first
    net.ops[0].args["unused"] = 1  # types, arguments and devices move no blob: the facts stand
    net.ops[0].type = "Sigmoid"
    assert dataflow(net) is first
    net.ops[2].control_inputs.append("x")  # edited in place
    second = dataflow(net)
    assert second is not first and second.lifetimes["x"] == (0, 2)
    assert first.lifetimes["x"] == (0, 0)  # an earlier version's facts are a snapshot
    net.ops[1].inputs = ["a", "v"]  # rebound
    assert "v" in dataflow(net).loads
    net.ops.append(OperatorDef("Relu", ["b"], ["y"]))
    assert dataflow(net).first_write["y"] == 4
    del net.ops[0]
    assert "a" in dataflow(net).loads
    assert dataflow(net.copy()) is not dataflow(net)  # a copy has its own cache


def test_facts_of_a_list_of_ops_equal_those_of_its_net():
    net = _net()
    draft = facts(net.ops)
    assert draft is not dataflow(net) and draft.ops == dataflow(net).ops
    assert draft.readers == dataflow(net).readers

