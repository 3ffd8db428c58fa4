"""Issue 15: a call that raises changes nothing; resuming in a wrong order or onto other devices raises;
a failed step leaves the persistent state as it was; one net runs in one thread at a time."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from graphpar import checkpoint, model_helper, workspace
from graphpar import data_parallel_model as dpm
from graphpar.core import NetDef, OperatorDef
from graphpar.devices import cuda_on_cpu
from graphpar.errors import CheckpointError, MissingBlobError, OperatorError, ParallelizeError
from graphpar.executor import get_executor
from tests.executor import toy_ops
from tests.parallel.test_data_parallel_model import (
    MLP,
    MLP_PARAMS,
    _bn_forward,
    batches,
    feed,
    fetch_params,
    sgd,
)

BN_DATA = batches(3, 4, (2, 3, 3))
MLP_DATA = batches(3, 4, (6,))


def build(devices, forward=_bn_forward, cpu_device=True, **options) -> model_helper.ModelHelper:
    model = model_helper.ModelHelper(name="rel")
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=forward, devices=devices,
                    cpu_device=cpu_device, optimizer_builder_fun=sgd(), **options)
    return model


def trained(devices=(0, 1), steps=1, forward=_bn_forward, data=BN_DATA, **options) -> model_helper.ModelHelper:
    model = build(list(devices), forward, **options)
    feed(model, *data[0])
    dpm.RunInitNet(model)
    for x, y in data[:steps]:
        feed(model, x, y)
        dpm.RunNet(model, 1)
    return model


def snapshot() -> dict:
    """Everything a failed call must leave alone: each blob's value, dtype and device; the nets; the
    load records; the random streams' position."""
    ws = workspace.get_workspace()
    return {"blobs": {name: t.detach().clone() for name, t in ws.blobs.items()}, "nets": dict(ws.nets),
            "loaded": dict(getattr(ws, "loaded", {})), "compiles": ws._compiles, "current": workspace.CurrentWorkspace()}


def assert_same(before: dict, ignore: frozenset[str] = frozenset()) -> None:
    after = snapshot()
    names = set(before["blobs"]) - ignore
    assert set(after["blobs"]) - ignore == names
    for name in names:
        old, new = before["blobs"][name], after["blobs"][name]
        assert (old.dtype, old.device, old.shape) == (new.dtype, new.device, new.shape), name
        assert torch.equal(old, new), name
    for key in ("nets", "loaded", "compiles", "current"):
        assert after[key] == before[key], key


def model_state(model) -> tuple:
    state = model._parallel
    return (repr(model.net.Proto()), repr(model.param_init_net.Proto()), model._checkpoint_net,
            repr(state.grouped), list(state.sync_names))


def transients(model) -> frozenset[str]:
    """The train net's intermediates: a failed run removes them (they are not kept alive through a run)."""
    plan = workspace.get_workspace().nets[model.net.Proto().name]
    return frozenset(name for _, name in plan.frame.stale)


# ---- the property: a call that raises leaves the workspace and the model as they were ----------------


def _second_init(model, tmp_path):
    dpm.RunInitNet(model)


def _create_again(model, tmp_path):
    dpm.CreateNet(model)


def _bad_update(model, tmp_path):
    workspace.FeedBlob("cpu_0/pred_w_momentum", np.zeros(2, np.float32))  # fed before the snapshot
    return lambda: dpm.RunNet(model, 1)


def _bad_input(model, tmp_path):
    workspace.FeedBlob("cpu_0/data", workspace.FetchBlob("cpu_0/data"))  # every replica fed a new batch
    workspace.FeedBlob("cpu_1/data", np.zeros((2, 2, 4, 4), np.float32))
    return lambda: dpm.RunNet(model, 1)


def _some_devices_fed(model, tmp_path):
    workspace.FeedBlob("cpu_0/data", workspace.FetchBlob("cpu_0/data"))  # cpu_1 keeps its previous batch
    return lambda: dpm.RunNet(model, 1)


def _float_counter(model, tmp_path):
    workspace.FeedBlob("optimizer_iteration", np.array([1.0], np.float32))
    return lambda: dpm.RunNet(model, 1)


def _mismatched_create(model, tmp_path):
    workspace.FeedBlob("cpu_0/pred_w_momentum", np.zeros(2, np.float32))  # the state the one update reads
    dpm.CreateNet(model, overwrite=True)  # accepted, as Caffe2 did: the shapes are checked when the net runs
    return lambda: dpm.RunNet(model, 1)


def _bad_feed(model, tmp_path):
    workspace.FeedBlob("cpu_0/pred_w", object())


def _corrupt_load(model, tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"garbage")
    checkpoint.load(path)


def _bad_save(model, tmp_path):
    checkpoint.save(tmp_path / "x.safetensors", ["cpu_0/pred_w", "no_such_blob"])


def _finalize_missing(model, tmp_path):
    workspace.get_workspace().remove_blob("cpu_0/bn_s")  # removed before the snapshot
    return lambda: dpm.FinalizeAfterCheckpoint(model)


def _finalize_orphans(model, tmp_path):
    path = tmp_path / "c.safetensors"
    with cuda_on_cpu():
        workspace.FeedBlob("gpu_3/pred_w", np.zeros((3, 18), np.float32))
        checkpoint.save(path, ["gpu_3/pred_w"])
        workspace.get_workspace().remove_blob("gpu_3/pred_w")
        checkpoint.load(path)
    return lambda: dpm.FinalizeAfterCheckpoint(model)


def _create_unbuildable(model, tmp_path):
    with toy_ops.registered():
        workspace.CreateNet(NetDef("bad", [OperatorDef("_TestBadFactory", ["cpu_0/pred_w"], ["out"])]))


def _run_once_failing(model, tmp_path):
    with toy_ops.registered():
        workspace.RunNetOnce(NetDef("bad", [OperatorDef("GaussianFill", [], ["noise"], {"shape": [2]}),
                                            OperatorDef("_TestFail", ["noise"], ["out"])]))


def _parallelize_again(model, tmp_path):
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=_bn_forward,
                    devices=[0, 1], cpu_device=True)


CASES = {
    "RunInitNet twice": (_second_init, RuntimeError),
    "CreateNet of created nets": (_create_again, RuntimeError),
    "RunNet failing in an update": (_bad_update, OperatorError),
    "RunNet failing in the forward pass": (_bad_input, OperatorError),
    "RunNet feeding only some devices": (_some_devices_fed, RuntimeError),
    "RunNet with a float counter": (_float_counter, OperatorError),
    "RunNet after CreateNet of a [2] momentum for a [3, 18] param": (_mismatched_create, ValueError),
    "FeedBlob": (_bad_feed, TypeError),
    "checkpoint.load": (_corrupt_load, CheckpointError),
    "checkpoint.save": (_bad_save, CheckpointError),
    "FinalizeAfterCheckpoint, missing blob": (_finalize_missing, MissingBlobError),
    "FinalizeAfterCheckpoint, other device": (_finalize_orphans, CheckpointError),
    "Parallelize": (_parallelize_again, ParallelizeError),
    "workspace.CreateNet": (_create_unbuildable, OperatorError),
    "workspace.RunNetOnce": (_run_once_failing, OperatorError),
}
DIRECT = {"RunInitNet twice", "CreateNet of created nets", "FeedBlob", "checkpoint.load", "checkpoint.save",
          "Parallelize", "workspace.CreateNet", "workspace.RunNetOnce"}


@pytest.mark.parametrize("net_type", ["simple", "dag"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_call_that_raises_leaves_workspace_and_model_as_they_were(case, net_type, tmp_path):
    model = trained(net_type=net_type)
    setup, error = CASES[case]
    call = (lambda: setup(model, tmp_path)) if case in DIRECT else setup(model, tmp_path)
    before, state = snapshot(), model_state(model)
    with pytest.raises(error):
        call()
    assert_same(before, transients(model) if case.startswith("RunNet") else frozenset())
    assert model_state(model) == state


# ---- 2: check, then act ---------------------------------------------------------------------------------


def test_a_second_run_init_net_keeps_the_trained_state():
    model = trained()
    before = snapshot()
    with pytest.raises(RuntimeError, match="initialised already"):
        dpm.RunInitNet(model)
    assert_same(before)


def test_run_init_net_with_a_missing_input_runs_nothing():
    model = build([0, 1])
    workspace.FeedBlob("cpu_0/data", BN_DATA[0][0][:2])  # cpu_1/data and the labels are missing
    before = snapshot()
    with pytest.raises(MissingBlobError, match="before RunInitNet"):
        dpm.RunInitNet(model)
    assert_same(before)
    assert not workspace.HasBlob("cpu_0/pred_w")


# ---- 3: a failed step leaves params, optimizer state, computed params and counters as they were --------


@pytest.mark.parametrize("net_type", ["simple", "dag"])
def test_a_step_failing_in_its_updates_changes_no_state_and_the_rerun_equals_the_clean_run(net_type):
    trained(steps=2, net_type=net_type)
    expected = snapshot()["blobs"]
    workspace.ResetWorkspace()
    model = trained(steps=1, net_type=net_type)
    momentum = workspace.FetchBlob("cpu_0/pred_w_momentum")  # the state the one update reads
    workspace.FeedBlob("cpu_0/pred_w_momentum", np.zeros(2, np.float32))  # a corrupted state blob
    feed(model, *BN_DATA[1])
    persistent = [n for n in workspace.Blobs() if n not in transients(model) and n != "cpu_0/pred_w_momentum"]
    before = {n: workspace.FetchBlob(n) for n in persistent}
    with pytest.raises(OperatorError, match="pred_w_momentum.*at CreateNet"):
        dpm.RunNet(model, 1)
    for name in persistent:
        np.testing.assert_array_equal(workspace.FetchBlob(name), before[name], err_msg=name)
    workspace.FeedBlob("cpu_0/pred_w_momentum", momentum)
    dpm.RunNet(model, 1)
    for name in persistent:
        assert torch.equal(workspace.FetchTensor(name), expected[name]), name


def test_updates_run_after_every_step_that_does_not_depend_on_them():
    """The plan's two phases: an op placed after the updates that does not depend on them runs first."""
    model = build([0])
    model.net.Scale("cpu_0/data", "cpu_0/late", scale=2.0)  # after the updates in program order
    feed(model, *BN_DATA[0])
    dpm.RunInitNet(model)
    plan = workspace.get_workspace().nets[model.net.Proto().name]
    late = len(plan.steps) - 1
    assert plan.updates and late not in plan.updates
    assert plan.order.index(late) < plan.staged_from <= min(plan.order.index(u) for u in plan.updates)


# ---- 1 and 9: resuming ------------------------------------------------------------------------------------


def _saved(tmp_path, devices=(0, 1), steps=1, **options):
    workspace.SwitchWorkspace("saved", True)
    model = trained(devices, steps, forward=MLP, data=MLP_DATA, **options)
    path = tmp_path / "ckpt.safetensors"
    checkpoint.save(path, dpm.GetCheckpointParams(model))
    workspace.SwitchWorkspace("default")
    return path


def _resumable(devices, cpu_device=True):
    model = build(list(devices), MLP, cpu_device=cpu_device)
    feed(model, *MLP_DATA[1])
    dpm.RunInitNet(model)
    return model


@pytest.mark.parametrize("saved_on, resumed_on", [((0, 1), (2, 3)), ((1, 2), (0, 1))],
                         ids=["not a replica", "a replica but not the first"])
def test_resume_onto_another_first_device_is_refused_without_mapping_and_exact_with_it(tmp_path, saved_on,
                                                                                      resumed_on):
    workspace.SwitchWorkspace("uninterrupted", True)
    expected = fetch_params(trained(saved_on, 2, forward=MLP, data=MLP_DATA), MLP_PARAMS)
    path = _saved(tmp_path, saved_on)

    model = _resumable(list(resumed_on))
    checkpoint.load(path)  # names cpu_<saved_on[0]>/...: not the model's first device
    before = snapshot()
    with pytest.raises(CheckpointError, match="another first device"):
        dpm.FinalizeAfterCheckpoint(model)
    assert_same(before)
    with pytest.raises(CheckpointError, match="FinalizeAfterCheckpoint"):
        dpm.RunNet(model, 1)
    assert_same(before)

    workspace.ResetWorkspace()
    model = _resumable(list(resumed_on))
    loaded = checkpoint.load(path, model=model)
    assert f"cpu_{resumed_on[0]}/fc1_w" in loaded and "optimizer_iteration" in loaded
    dpm.FinalizeAfterCheckpoint(model)
    feed(model, *MLP_DATA[1])
    dpm.RunNet(model, 1)
    for d in resumed_on:
        for name, value in fetch_params(model, MLP_PARAMS, d).items():
            np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-6, err_msg=f"{name} on {d}")
    assert workspace.FetchBlob("optimizer_iteration").tolist() == [2]


@pytest.mark.parametrize("saved_on_gpu", [True, False], ids=["cuda to cpu", "cpu to cuda"])
def test_resume_onto_another_device_type_maps_the_names_and_devices(tmp_path, saved_on_gpu):
    """CUDA is simulated on the CPU: the names and the logical devices change."""
    with cuda_on_cpu():
        path = _saved(tmp_path, devices=(1,), cpu_device=not saved_on_gpu)
        model = build([0, 2], MLP, cpu_device=saved_on_gpu)
        feed(model, *MLP_DATA[1])
        dpm.RunInitNet(model)
        loaded = checkpoint.load(path, model=model)
        first = "cpu_0" if saved_on_gpu else "gpu_0"
        assert f"{first}/fc1_w" in loaded
        dpm.FinalizeAfterCheckpoint(model)
        dpm.RunNet(model, 1)
    for name in MLP_PARAMS:
        np.testing.assert_array_equal(workspace.FetchBlob(f"{first[:3]}_2/{name}"),
                                      workspace.FetchBlob(f"{first}/{name}"))
    assert workspace.FetchBlob("optimizer_iteration").tolist() == [2]


def test_a_checkpoint_of_several_devices_is_not_mapped(tmp_path):
    path = _saved(tmp_path)
    workspace.SwitchWorkspace("saved")
    checkpoint.save(path, ["cpu_0/fc1_w", "cpu_1/fc1_w"])
    workspace.SwitchWorkspace("default")
    model = _resumable([2, 3])
    before = snapshot()
    with pytest.raises(CheckpointError, match="several devices"):
        checkpoint.load(path, model=model)
    assert_same(before)


@pytest.mark.parametrize("direct", [False, True], ids=["dpm.RunNet", "workspace.RunNet"])
def test_skipping_finalize_after_checkpoint_is_detected(tmp_path, direct):
    path = _saved(tmp_path)
    model = _resumable([0, 1])
    checkpoint.load(path)
    feed(model, *MLP_DATA[1])
    before = snapshot()
    with pytest.raises(CheckpointError, match="FinalizeAfterCheckpoint"):
        workspace.RunNet(model.net) if direct else dpm.RunNet(model, 1)
    assert_same(before)
    dpm.FinalizeAfterCheckpoint(model)
    dpm.RunNet(model, 1)
    for name, value in fetch_params(model, MLP_PARAMS, 1).items():
        np.testing.assert_array_equal(value, workspace.FetchBlob(f"cpu_0/{name}"))
    assert workspace.get_workspace().loaded == {}


def test_a_checkpoint_of_every_replica_needs_no_broadcast(tmp_path):
    model = _resumable([0, 1])
    path = tmp_path / "all.safetensors"
    checkpoint.save(path, [n for n in workspace.Blobs() if n.startswith(("cpu_0/", "cpu_1/")) and "fc" in n])
    checkpoint.load(path)
    dpm.RunNet(model, 1)


def test_loading_before_run_init_net_is_detected(tmp_path):
    path = _saved(tmp_path)
    model = build([0, 1], MLP)
    feed(model, *MLP_DATA[1])
    checkpoint.load(path)
    before = snapshot()
    with pytest.raises(CheckpointError, match="loaded before the init net"):
        dpm.RunInitNet(model)
    assert_same(before)


def test_a_loaded_blob_fed_anew_or_used_is_forgotten(tmp_path):
    workspace.FeedBlob("w", np.ones(2, np.float32))
    path = tmp_path / "w.safetensors"
    checkpoint.save(path, ["w"])
    checkpoint.load(path)
    assert workspace.get_workspace().loaded == {"w": str(path)}
    workspace.FeedBlob("w", np.zeros(2, np.float32))
    assert workspace.get_workspace().loaded == {}


# ---- 4: threads --------------------------------------------------------------------------------------------


def test_one_net_run_from_two_threads_is_refused(monkeypatch):
    model = trained((0,), net_type="simple")
    executor = get_executor("simple")
    entered, release = threading.Event(), threading.Event()
    run = executor.run

    def slow_run(plan, blobs):
        entered.set()
        release.wait(10)
        run(plan, blobs)

    monkeypatch.setattr(executor, "run", slow_run)
    first = threading.Thread(target=lambda: dpm.RunNet(model, 1))
    first.start()
    assert entered.wait(10)
    try:
        with pytest.raises(RuntimeError, match="already running in another thread"):
            dpm.RunNet(model, 1)
    finally:
        release.set()
        first.join(10)
    monkeypatch.undo()
    dpm.RunNet(model, 1)  # free again


def test_the_current_workspace_is_per_thread():
    seen: dict[str, str] = {}

    def other() -> None:
        seen["start"] = workspace.CurrentWorkspace()
        workspace.SwitchWorkspace("thread_ws", True)
        workspace.FeedBlob("x", np.ones(1, np.float32))
        seen["end"] = workspace.CurrentWorkspace()

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen == {"start": "default", "end": "thread_ws"}
    assert workspace.CurrentWorkspace() == "default" and not workspace.HasBlob("x")
    assert workspace.get_workspace("thread_ws").has_blob("x")


# ---- issue 23 ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("first_run", [True, False])
def test_a_replica_fed_a_zero_row_batch_is_refused_at_run_net(first_run):
    """Issue 23 item 15: FeedBlob of an empty batch on one replica trained silently on half the gradient."""
    model = build([0, 1], MLP)
    feed(model, *MLP_DATA[0])
    dpm.RunInitNet(model)
    if not first_run:
        dpm.RunNet(model, 1)
    x, y = MLP_DATA[1]
    feed(model, x, y)
    workspace.FeedBlob("cpu_1/data", x[:0])
    workspace.FeedBlob("cpu_1/label", y[:0])
    before = snapshot()
    with pytest.raises(ValueError, match=r"RunNet\('rel'\): replica\(s\) cpu_1 were fed an empty batch"):
        dpm.RunNet(model, 1)
    assert_same(before)
    feed(model, x, y)
    dpm.RunNet(model, 1)
