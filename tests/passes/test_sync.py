from __future__ import annotations

import numpy as np
import pytest

from graphpar import workspace
from graphpar.core.ir import NetDef, OperatorDef
from graphpar.errors import ParallelizeError
from graphpar.passes.sync import (
    check_unprefixed,
    checkpoint_sync_names,
    checkpoint_sync_net,
    compute_blobs_to_sync,
    replica_init_outputs,
    sync_blobs,
)
from tests.passes.helpers import cpu, fill, gpu, layout, reducer, summary


def _init_net(devices: list[int]) -> NetDef:
    ops = []
    for d in devices:
        ops += [fill(f"cpu_{d}/w", cpu(d)), fill(f"cpu_{d}/rm", cpu(d)), fill(f"cpu_{d}/w_momentum", cpu(d))]
    ops += [fill("optimizer_iteration", cpu(0)), fill("cpu_0/w", cpu(0)), fill("gpu_0/other", cpu(0))]
    return NetDef("init", ops)


def test_replica_outputs_are_deduplicated_in_first_write_order():
    assert replica_init_outputs(_init_net([2, 1]), layout([2, 1])) == [
        "cpu_2/w", "cpu_2/rm", "cpu_2/w_momentum", "cpu_1/w", "cpu_1/rm", "cpu_1/w_momentum"]


def test_blobs_to_sync_sorted_by_device_position_then_first_write():
    lay = layout([2, 0])
    init = _init_net([0, 2])
    blobs, names = compute_blobs_to_sync(init, lay, ["cpu_0/w", "cpu_2/w"], ["cpu_0/rm", "cpu_2/rm"])
    assert names == ["w", "rm", "w_momentum"]
    assert blobs == ["cpu_2/w", "cpu_2/rm", "cpu_2/w_momentum", "cpu_0/w", "cpu_0/rm", "cpu_0/w_momentum"]


def test_shared_models_sync_only_computed_params():
    lay = layout([0, 1])
    blobs, names = compute_blobs_to_sync(_init_net([0, 1]), lay, ["cpu_0/w", "cpu_1/w"],
                                         ["cpu_0/rm", "cpu_1/rm"], shared_model=True)
    assert (blobs, names) == (["cpu_0/rm", "cpu_1/rm"], ["rm"])


def test_params_missing_from_the_init_net_are_refused():
    with pytest.raises(ParallelizeError, match=r"not instantiated in param_init_net: \['cpu_1/b'\]"):
        compute_blobs_to_sync(_init_net([0, 1]), layout([0, 1]), ["cpu_0/w", "cpu_1/b"], [])


def test_a_blob_the_first_device_lacks_cannot_be_synced():
    init = NetDef("init", [fill("cpu_0/w", cpu(0)), fill("cpu_1/w", cpu(1)), fill("cpu_1/extra", cpu(1))])
    with pytest.raises(ParallelizeError, match=r"\['extra'\].*first device 0"):
        compute_blobs_to_sync(init, layout([0, 1]), ["cpu_0/w", "cpu_1/w"], [])


def test_sync_copies_from_the_first_device_onto_each_blob_device():
    lay = layout([3, 1], gpu=True)
    net = NetDef("init", [fill("gpu_3/w", gpu(3)), fill("gpu_3/ITER", cpu(0))])
    ops = sync_blobs(net, ["w", "ITER"], reducer(lay, {"gpu_1/ITER": cpu(0)}))
    assert summary(ops) == [("Copy", ["gpu_3/w"], ["gpu_1/w"], gpu(1), "", []),
                            ("Copy", ["gpu_3/ITER"], ["gpu_1/ITER"], cpu(0), "", [])]
    assert net.ops[-2:] == ops and net.external_inputs == []
    assert sync_blobs(NetDef("n"), ["w"], reducer(layout([5]))) == []


def test_blob_sync_needs_unprefixed_names():
    lay = layout([0, 1])
    assert check_unprefixed(["a", "gpu_0/b", "cpu_time", "cpu_x/y"], lay) == ["a", "gpu_0/b", "cpu_time", "cpu_x/y"]
    with pytest.raises(ParallelizeError, match=r"unprefixed names, got \['cpu_1/x', 'cpu_7/y'\]; pass \['x', 'y'\]"):
        check_unprefixed(["ok", "cpu_1/x", "cpu_7/y"], lay)


def test_checkpoint_names_accept_scoped_and_unscoped_and_skip_global_blobs():
    lay = layout([0, 1])
    names = checkpoint_sync_names(["cpu_0/w", "w", "rm", "optimizer_iteration", "cpu_1/new"], {"w", "rm"}, lay)
    assert names == ["w", "rm", "new"]


@pytest.mark.parametrize("blob", ["cpu_2/w", "gpu_0/w"])
def test_checkpoint_names_of_other_devices_are_refused(blob):
    """A checkpoint saved from other devices: its values would silently go unused."""
    with pytest.raises(ParallelizeError, match=r"not in this model's replica scopes \(cpu_0/, cpu_1/\)"):
        checkpoint_sync_names(["cpu_0/w", blob], {"w"}, layout([0, 1]))


def test_checkpoint_sync_net_broadcasts_loaded_values():
    lay = layout([4, 2, 3])
    net = checkpoint_sync_net("ckpt", ["w", "rm"], reducer(lay))
    assert net.external_inputs == ["cpu_4/w", "cpu_4/rm"]
    assert [(op.inputs[0], op.outputs[0]) for op in net.ops] == [
        ("cpu_4/w", "cpu_2/w"), ("cpu_4/w", "cpu_3/w"), ("cpu_4/rm", "cpu_2/rm"), ("cpu_4/rm", "cpu_3/rm")]
    for d, value in ((4, 7.0), (2, 1.0), (3, 2.0)):
        workspace.FeedBlob(f"cpu_{d}/w", np.full(2, value, np.float32))
        workspace.FeedBlob(f"cpu_{d}/rm", np.full(3, value + 1, np.float32))
    workspace.RunNetOnce(net)
    for d in (2, 3):
        np.testing.assert_array_equal(workspace.FetchBlob(f"cpu_{d}/w"), np.full(2, 7.0, np.float32))
        np.testing.assert_array_equal(workspace.FetchBlob(f"cpu_{d}/rm"), np.full(3, 8.0, np.float32))


def test_initial_sync_runs():
    lay = layout([0, 1, 2])
    init = NetDef("init", [OperatorDef("UniformFill", [], [f"cpu_{d}/w"], {"shape": [4]}, cpu(d))
                           for d in lay.devices])
    sync_blobs(init, ["w"], reducer(lay))
    workspace.RunNetOnce(init)
    first = workspace.FetchBlob("cpu_0/w")
    for d in (1, 2):
        np.testing.assert_array_equal(workspace.FetchBlob(f"cpu_{d}/w"), first)
