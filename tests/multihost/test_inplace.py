"""Collectives reduce in place (no copy) only what nothing else sees: a fed blob as an update, a value
the run made when only the frame holds it; anything another blob, a view or the caller sees is copied
first (in one process, on a communicator stand-in that doubles, as two equal shards would)."""

from __future__ import annotations

import pytest
import torch

from graphpar import distributed, workspace
from graphpar.core.ir import NetDef, OperatorDef
from graphpar.executor.program import claim


class _Doubling:
    """A communicator stand-in: shard 0 of two shards holding the same values."""

    rank, size = 0, 2

    def allreduce(self, tensor: torch.Tensor) -> None:
        tensor.mul_(2)

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        pass


@pytest.fixture
def cw() -> str:
    workspace.FeedBlob("cw", torch.tensor(distributed.register_world(_Doubling())))
    return "cw"


def _run(ops: list[OperatorDef], inputs: list[str], net_type: str) -> None:
    net = NetDef("collect", ops, inputs)
    net.type = net_type
    workspace.CreateNet(net, overwrite=True)
    workspace.RunNet("collect")


@pytest.mark.parametrize("net_type", ["simple", "dag"])
def test_a_fed_blob_is_reduced_in_its_storage_in_the_update_phase(cw: str, net_type: str) -> None:
    workspace.FeedBlob("g", torch.ones(3))
    blobs = workspace.get_workspace().blobs
    storage = blobs["g"].data_ptr()
    _run([OperatorDef("Allreduce", [cw, "g"], ["g"])], [cw, "g"], net_type)
    assert workspace.get_workspace().nets["collect"].updates == frozenset({0})
    assert blobs["g"].tolist() == [2.0] * 3 and blobs["g"].data_ptr() == storage


@pytest.mark.parametrize("net_type", ["simple", "dag"])
def test_a_tensor_the_caller_holds_is_never_changed(cw: str, net_type: str) -> None:
    workspace.FeedBlob("g", torch.ones(3))
    held = workspace.get_workspace().blobs["g"]
    view = held[1:]
    _run([OperatorDef("Allreduce", [cw, "g"], ["g"])], [cw, "g"], net_type)
    assert held.tolist() == [1.0] * 3 and view.tolist() == [1.0] * 2
    assert workspace.FetchBlob("g").tolist() == [2.0] * 3


@pytest.mark.parametrize("net_type", ["simple", "dag"])
@pytest.mark.parametrize("make", ["Alias", "FlattenToVec"])
def test_a_value_that_aliases_another_blob_is_copied_first(cw: str, net_type: str, make: str) -> None:
    workspace.FeedBlob("x", torch.ones(3))
    _run([OperatorDef(make, ["x"], ["g"]), OperatorDef("Allreduce", [cw, "g"], ["g"]),
          OperatorDef("Scale", ["x"], ["y"])], [cw, "x"], net_type)
    assert workspace.FetchBlob("g").tolist() == [2.0] * 3
    assert workspace.FetchBlob("x").tolist() == [1.0] * 3 and workspace.FetchBlob("y").tolist() == [1.0] * 3


@pytest.mark.parametrize("net_type", ["simple", "dag"])
def test_a_value_the_run_made_is_reduced_in_phase_one(cw: str, net_type: str) -> None:
    workspace.FeedBlob("x", torch.ones(3))
    _run([OperatorDef("Scale", ["x"], ["g"], args={"scale": 3.0}), OperatorDef("Allreduce", [cw, "g"], ["g"]),
          OperatorDef("Broadcast", [cw, "g"], ["g"])], [cw, "x"], net_type)
    assert workspace.get_workspace().nets["collect"].updates == frozenset()
    assert workspace.FetchBlob("g").tolist() == [6.0] * 3 and workspace.FetchBlob("x").tolist() == [1.0] * 3


def test_claim_passes_a_tensor_only_the_frame_holds_and_copies_any_other() -> None:
    frame = [torch.ones(2), torch.ones(2)]
    assert claim(frame, 0, 0) is frame[0]
    held = frame[1]
    assert claim(frame, 1, 0) is not held and claim(frame, 1, 1) is held  # `holders` known others
    del held
    view = frame[1][:1]
    assert claim(frame, 1, 0) is not frame[1]  # a view shares its storage
    frame.append(view)
    del view
    assert claim(frame, 2, 0) is not frame[2]  # and so does its base
    copy = claim(frame, 2, 0)
    assert copy.tolist() == [1.0] and copy.data_ptr() != frame[2].data_ptr()


@pytest.mark.parametrize("net_type", ["simple", "dag"])
def test_param_gradients_and_their_local_sum_are_reduced_without_a_copy(cw: str, net_type: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from graphpar.executor import program

    copies = []

    def counting(frame: list, slot: int, holders: int) -> torch.Tensor:
        out = claim(frame, slot, holders)
        if out is not frame[slot]:
            copies.append(slot)
        return out

    monkeypatch.setattr(program, "claim", counting)
    for name, shape in (("x", (4, 3)), ("w", (2, 3)), ("dy", (4, 2))):
        workspace.FeedBlob(name, torch.ones(shape))
    _run([OperatorDef("FCGradient", ["x", "w", "dy"], ["dw", "db", "dx"]),
          OperatorDef("FCGradient", ["x", "w", "dy"], ["dw1", "db1", "dx1"]),
          OperatorDef("Sum", ["dw", "dw1"], ["dw"]),
          *(OperatorDef("Allreduce", [cw, g], [g]) for g in ("dw", "db"))], [cw, "x", "w", "dy"], net_type)
    assert copies == []
    assert workspace.FetchBlob("dw").tolist() == [[16.0] * 3] * 2 and workspace.FetchBlob("db").tolist() == [8.0] * 2
