"""The memory model: persistent vs transient blobs, freeing at last use, and runs that commit or change nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphpar import workspace
from graphpar.core import NetDef, OperatorDef
from graphpar.errors import OperatorError
from graphpar.executor.frame import layout_frame


def _net(**args: object) -> NetDef:
    """w is a param updated in place; h, g are intermediates; y is declared as an output."""
    return NetDef("frame", [
        OperatorDef("FC", ["x", "w", "b"], ["h"]),          # 0
        OperatorDef("Relu", ["h"], ["g"]),                   # 1
        OperatorDef("Scale", ["g"], ["y"], {"scale": 2.0}),  # 2
        OperatorDef("Sub", ["w", "w"], ["d"]),               # 3: d is dead after this op
        OperatorDef("Sum", ["w", "d"], ["w"]),               # 4: w written after being read
        OperatorDef("Iter", ["it"], ["it"]),                 # 5
    ], external_outputs=["y"], args=dict(args))


def _feed() -> None:
    workspace.FeedBlob("x", np.arange(6, dtype=np.float32).reshape(2, 3) - 2)
    workspace.FeedBlob("w", np.ones((4, 3), np.float32))
    workspace.FeedBlob("b", np.zeros(4, np.float32))
    workspace.FeedBlob("it", np.zeros(1, np.int64))


def test_persistent_blobs_are_those_read_first_outputs_and_kept_ones():
    layout = layout_frame(_net(blobs_to_keep=["g"]))
    assert layout.persistent == {"x", "w", "b", "it", "y", "g"}
    assert [load.name for load in layout.loads] == ["x", "w", "b", "it"]
    assert not layout.frees_memory and layout.drops == ()
    assert list(layout.store_names) == ["h", "g", "y", "d", "w", "it"]


def test_dynamic_memory_management_frees_each_transient_after_its_last_use():
    layout = layout_frame(_net(dynamic_memory_management=1))
    names = layout.names
    assert [[names[s] for s in step] for step in layout.frees_in(range(6))] == [[], ["h"], ["g"], [], ["d"], []]
    assert list(layout.store_names) == ["y", "w", "it"] and set(layout.drops) == {"h", "g", "d"}
    assert layout_frame(_net(dynamic_memory_management=1), keep_all=True).frees_memory is False


def test_freeing_changes_no_result_and_leaves_no_stale_blob():
    _feed()
    workspace.RunNetOnce(_net())
    kept = {name: workspace.FetchBlob(name) for name in workspace.Blobs()}
    workspace.ResetWorkspace()
    _feed()
    workspace.RunNetOnce(_net())  # leaves h, g, d behind: a freeing run must remove them, not keep them stale
    workspace.FeedBlob("w", np.ones((4, 3), np.float32))
    workspace.FeedBlob("it", np.zeros(1, np.int64))
    workspace.RunNetOnce(_net(dynamic_memory_management=1))
    assert workspace.Blobs() == ["b", "it", "w", "x", "y"]
    for name in workspace.Blobs():
        np.testing.assert_array_equal(workspace.FetchBlob(name), kept[name], err_msg=name)


def test_keep_all_keeps_every_blob_for_introspection():
    _feed()
    workspace.get_workspace().keep_all = True
    workspace.RunNetOnce(_net(dynamic_memory_management=1))
    assert {"h", "g", "d"} <= set(workspace.Blobs())


def test_a_failed_run_changes_nothing_in_the_workspace():
    _feed()
    net = _net()
    net.ops.insert(4, OperatorDef("Add", ["d", "z"], ["bad"]))  # [4, 3] + [4, 3]: fine at CreateNet...
    workspace.FeedBlob("z", np.zeros((4, 3), np.float32))
    workspace.CreateNet(net)
    workspace.FeedBlob("z", np.zeros((2, 3), np.float32))  # ...then a shape that fails at run, after earlier ops
    before = {name: workspace.FetchBlob(name) for name in workspace.Blobs()}
    with pytest.raises(OperatorError, match=r"op #4 \(Add\)"):
        workspace.RunNet(net.name)
    assert workspace.Blobs() == sorted(before)
    for name, value in before.items():
        np.testing.assert_array_equal(workspace.FetchBlob(name), value, err_msg=name)


def test_copy_never_aliases_its_input_even_on_the_same_device():
    workspace.FeedBlob("x", np.ones(3, np.float32))
    workspace.RunOperatorOnce(OperatorDef("Copy", ["x"], ["y"]))
    x, y = workspace.FetchTensor("x"), workspace.FetchTensor("y")
    assert torch.equal(x, y) and y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def test_each_version_of_a_reused_name_is_freed_after_its_own_users():
    net = NetDef("versions", [
        OperatorDef("Relu", ["x"], ["t"]),                 # 0: t version 0
        OperatorDef("Scale", ["t"], ["a"], {"scale": 2.0}),  # 1: last user of t v0
        OperatorDef("Relu", ["a"], ["t"]),                 # 2: t version 1 (not in place: frees v0 at 1)
        OperatorDef("Relu", ["t"], ["t"]),                 # 3: in place: v1 is replaced, not freed
        OperatorDef("Add", ["t", "a"], ["y"]),             # 4: last user of t v2 and of a
    ], external_outputs=["y"], args={"dynamic_memory_management": 1})
    layout = layout_frame(net)
    t, a = layout.slot["t"], layout.slot["a"]
    assert layout.frees_in(range(5)) == ((), (t,), (), (), (a, t))
    versions = list(zip(layout.version_slots, layout.version_users))
    assert versions == [(t, 2), (a, 3), (t, 2)]  # t v0 (ops 0, 1), a (1, 2, 4), t v2 (ops 3, 4)
    assert [list(r) for r in layout.releases] == [[0], [0, 1], [1], [2], [1, 2]]


@pytest.mark.parametrize("net_type", ["simple", "dag"])
def test_updates_run_last_and_values_are_freed_after_their_last_use_in_that_order(net_type):
    """`lr` is read by the update (op 2) and by op 3, which does not depend on the update: op 3 runs
    first, so `lr` may be freed only after the update, not after op 3 (its last user in program order)."""
    net = NetDef("staged", [
        OperatorDef("ConstantFill", [], ["lr"], {"shape": [1], "value": 0.5}),             # 0
        OperatorDef("Scale", ["w"], ["g"], {"scale": 1.0}),                                 # 1
        OperatorDef("MomentumSGDUpdate", ["g", "m", "lr", "w"], ["g", "m", "w"]),          # 2
        OperatorDef("Scale", ["lr"], ["y"], {"scale": 2.0}),                                # 3
    ], type=net_type, external_outputs=["y"], args={"dynamic_memory_management": True})
    workspace.FeedBlob("w", np.ones(3, np.float32))
    workspace.FeedBlob("m", np.zeros(3, np.float32))
    plan = workspace.get_workspace().create_net(net)
    assert plan.order == (0, 1, 3, 2) and plan.staged_from == 3
    frees = plan.frame.frees_in(plan.order)
    assert "lr" in [plan.frame.names[s] for s in frees[2]] and frees[3] == ()
    workspace.RunNet("staged")
    np.testing.assert_array_equal(workspace.FetchBlob("w"), np.full(3, 0.5, np.float32))
    np.testing.assert_array_equal(workspace.FetchBlob("y"), [1.0])
