"""The Parallelize pipeline: its order, checks after each pass, dumps, and the collective order it keeps."""

from __future__ import annotations

import dataclasses
import inspect
import os
import subprocess
import sys
import threading

import pytest

from graphpar import brew, model_helper, optimizer
from graphpar import data_parallel_model as dpm
from graphpar.core.ir import OperatorDef
from graphpar.core.schema import Trait, has_trait, registered_types
from graphpar.devices import cuda_on_cpu
from graphpar.models import mlp
from graphpar.passes import analyze, pipeline
from graphpar.passes.bmuf import bmuf_pipeline
from graphpar.passes.pipeline import PIPELINE, REDUCE_GRADIENTS, Pass, PassContext, edited
from graphpar.passes.state import ParallelState
from graphpar.visualize import op_kind
from tests.fake_gpus import fake_gpus


def _parallelize(name: str = "pipe", forward=None, **options) -> model_helper.ModelHelper:  # noqa: ANN001
    model = model_helper.ModelHelper(name=name)
    options.setdefault("devices", [0, 1])
    options.setdefault("cpu_device", True)
    dpm.Parallelize(model, input_builder_fun=lambda m: None,
                    forward_pass_builder_fun=forward or (lambda m, s: mlp(m, s, dim_in=4, hidden=(3,), num_classes=2)),
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1, momentum=0.9), **options)
    return model


def test_every_pass_is_documented_and_named_once():
    names = [entry.name for entry in PIPELINE]
    assert len(set(names)) == len(names)
    for entry in PIPELINE:
        assert inspect.getdoc(entry.run), entry.name
        assert list(inspect.signature(entry.run).parameters) == ["state"], entry.name


def test_the_state_lives_on_the_model_and_backs_caffe2_attribute_names():
    model = _parallelize()
    state = model._parallel
    assert isinstance(state, ParallelState)
    assert model._devices == [0, 1] and model._device_prefix == "cpu"
    assert model._device_grouped_blobs is state.grouped and model._grad_names == state.grad_names
    assert model._data_parallel_model_nets == [model.net]
    assert model_helper.ModelHelper(name="fresh")._device_grouped_blobs == {}


def test_a_planted_bad_pass_is_caught_after_it_runs_and_the_model_is_restored(monkeypatch: pytest.MonkeyPatch):
    def bad_pass(state: ParallelState) -> None:
        """Appends a Relu with two inputs, which its schema forbids."""
        state.model.net.Proto().ops.append(OperatorDef("Relu", ["cpu_0/fc1", "cpu_1/fc1"], ["cpu_0/bad"]))

    at = [e.name for e in PIPELINE].index("add_gradients") + 1
    monkeypatch.setattr(pipeline, "PIPELINE", (*PIPELINE[:at], Pass("planted", bad_pass), *PIPELINE[at:]))
    model = model_helper.ModelHelper(name="planted")
    with pytest.raises(ValueError, match=r"after Parallelize pass 'planted'.*\(Relu\): takes 1 inputs, got 2"):
        dpm.Parallelize(model, input_builder_fun=lambda m: None,
                        forward_pass_builder_fun=lambda m, s: mlp(m, s, dim_in=4, hidden=(3,), num_classes=2),
                        optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1), devices=[0, 1],
                        cpu_device=True)
    assert model._parallel is None and model.net.Proto().ops == []


def test_nets_are_dumped_after_each_pass(tmp_path):  # noqa: ANN001
    with PassContext(dump_dir=tmp_path):
        model = _parallelize("dumped")
    files = sorted(p.name for p in tmp_path.iterdir())
    train = model.net.Proto().name
    ran = [e.name for e in PIPELINE if e.when(model._parallel)]
    assert [f for f in files if f.endswith(f"_{train}.txt")] == [
        f"{PIPELINE.index(e):02d}_{e.name}_{train}.txt" for e in PIPELINE if e.name in ran]
    last = (tmp_path / f"{PIPELINE.index(PIPELINE[-1]):02d}_{PIPELINE[-1].name}_{train}.txt").read_text()
    assert last.strip() == repr(model.net.Proto()).strip()


def test_the_innermost_pass_context_holds_and_the_tests_check_every_pass():
    outer = PassContext.current()
    assert outer.check  # tests/conftest.py
    with PassContext(dump_dir="d") as first, PassContext(disabled=["interleave"]) as second:
        assert PassContext.current() is second and second.disabled == frozenset({"interleave"})
    assert PassContext.current() is outer and not first.check
    with pytest.raises(TypeError, match="collection of pass names"):
        PassContext(disabled="interleave")


def test_each_thread_has_its_own_pass_contexts():
    """One thread's `with` exit pops only its own context (they were one process-wide stack: thread A's
    exit popped thread B's context, leaving B's passes run under A's)."""
    a_entered, b_entered, a_exited = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def thread_a() -> None:
        with PassContext(dump_dir="a") as mine:
            a_entered.set()
            b_entered.wait(10)
            seen["a"] = PassContext.current() is mine
        a_exited.set()

    def thread_b() -> None:
        a_entered.wait(10)
        seen["b_before"] = PassContext.current().dump_dir  # a fresh thread: outside every `with`
        with PassContext(disabled={"interleave"}) as mine:
            b_entered.set()
            a_exited.wait(10)
            seen["b"] = PassContext.current() is mine
        seen["b_after"] = PassContext.current().disabled

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert seen == {"a": True, "b_before": None, "b": True, "b_after": frozenset()}
    assert PassContext.current().check and PassContext.current().dump_dir is None  # this thread's, untouched


def test_the_default_pass_context_starts_from_the_environment(tmp_path):  # noqa: ANN001
    code = "from graphpar.passes.pipeline import PassContext; c = PassContext.current(); print(c.check, c.dump_dir)"
    env = {**os.environ, "GRAPHPAR_CHECK_PASSES": "1", "GRAPHPAR_DUMP_PASSES": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", str(tmp_path)]


def test_a_disabled_pass_does_not_run_and_an_unknown_name_changes_nothing():
    with PassContext(disabled={"check_finite_losses"}):
        model = _parallelize("unchecked")
    assert not any(op.type == "CheckFinite" for op in model.net.Proto().ops)
    assert any(op.type == "CheckFinite" for op in _parallelize("checked").net.Proto().ops)
    model = model_helper.ModelHelper(name="typo")
    with PassContext(disabled={"allreduce"}), pytest.raises(ValueError, match=r"\['allreduce'\] are not in"):
        dpm.Parallelize(model, input_builder_fun=lambda m: None,
                        forward_pass_builder_fun=lambda m, s: mlp(m, s, dim_in=4, hidden=(3,), num_classes=2),
                        devices=[0, 1], cpu_device=True)
    assert model._parallel is None and model.net.Proto().ops == []


def test_the_bmuf_pipeline_is_the_standard_one_with_its_own_entries():
    bmuf = bmuf_pipeline(None)  # type: ignore[arg-type] - the options are only read when global_nets runs
    own = [entry.name for entry in bmuf if entry not in PIPELINE]
    assert own == ["group_params", "initial_sync", "global_nets"]
    assert {entry.name for entry in PIPELINE} - {entry.name for entry in bmuf} == {
        *(entry.name for entry in REDUCE_GRADIENTS), "fuse_updates", "compute_sync_blobs",
        "mark_first_iteration_serial", "set_net_lists"}
    renamed = ["set_net_lists" if entry.name == "global_nets" else entry.name for entry in bmuf]
    assert renamed == [entry.name for entry in PIPELINE if entry.name in renamed]  # the standard order
    with pytest.raises(ValueError, match=r"passes \['nope'\] are not in the pipeline"):
        edited(PIPELINE, remove=["nope"])


def test_forward_only_models_skip_the_training_passes():
    model = model_helper.ModelHelper(name="fwd", init_params=False)
    dpm.Parallelize(model, input_builder_fun=lambda m: None,
                    forward_pass_builder_fun=lambda m, s: mlp(m, s, dim_in=4, hidden=(3,), num_classes=2),
                    devices=[0, 1], cpu_device=True)
    assert not any(op.is_gradient_op for op in model.net.Proto().ops)
    assert model._data_parallel_model_nets == [model.net] and model._grad_names == []


def _conv_bn(model: model_helper.ModelHelper, loss_scale: float) -> list:
    conv = brew.conv(model, "data", "conv", dim_in=3, dim_out=4, kernel=3)
    h = brew.relu(model, brew.spatial_bn(model, conv, "bn", dim_in=4), "relu")
    pred = brew.fc(model, brew.average_pool(model, h, "pool", global_pooling=True), "pred", dim_in=4, dim_out=2)
    _, loss = model.net.SoftmaxWithLoss([pred, "label"], ["softmax", "loss"])
    return [model.net.Scale(loss, "scaled_loss", scale=loss_scale)]


def test_every_collective_is_chained_to_the_one_before_it_in_program_order():
    """NCCL for gradients (in buckets), batch-norm statistics and computed params: one fixed order."""
    with cuda_on_cpu():
        model = _parallelize("chain", forward=_conv_bn, devices=[1, 0, 2], cpu_device=False, use_nccl=True,
                             combine_spatial_bn=True, gradient_bucket_bytes=256)
    for net in (model.net.Proto(), model.param_init_net.Proto()):
        collectives = [op for op in net.ops if has_trait(op, Trait.COLLECTIVE)]
        for before, op in zip(collectives, collectives[1:]):
            assert before.outputs[0] in op.control_inputs, (net.name, op)
    assert len([op for op in model.net.Proto().ops if has_trait(op, Trait.COLLECTIVE)]) > 4


def test_visualize_and_analyze_agree_on_what_moves_data_between_devices():
    for op_type in registered_types():
        op = OperatorDef(op_type)
        assert (op_kind(op) == "communication") == analyze.is_cross_device_op(op), op_type
        assert has_trait(op, Trait.COLLECTIVE) <= has_trait(op, Trait.CROSS_DEVICE), op_type


def test_peers_without_p2p_access_get_copies_on_real_cuda(monkeypatch: pytest.MonkeyPatch):
    """The wiring from torch.cuda.can_device_access_peer to the reducer (CUDA placed on the CPU to run),
    on a faked 4-GPU machine: the test once asked a real 1-GPU machine about devices 1-3."""
    islands = {0: 0, 1: 0, 2: 1, 3: 1}
    fake_gpus(monkeypatch, 4, peer=lambda a, b: islands[a] == islands[b])  # Parallelize plans for real GPUs...
    # per-gradient all-reduce (real CUDA devices get DDP buckets by default)
    model = _parallelize("p2p", devices=[0, 1, 2, 3], cpu_device=False, gradient_bucket_bytes=0)
    copies = [op for op in model.net.Proto().ops if op.type == "Copy" and op.outputs[0].endswith("_gpu2_copy")]
    assert [op.outputs[0] for op in copies] == [f"gpu_0/{g}_gpu2_copy" for g in reversed(model._grad_names)]
    assert all(op.args["input_device_ids"] == [2] for op in copies)
    with cuda_on_cpu():  # ...and the nets run where CUDA is placed on the CPU
        import numpy as np

        from graphpar import workspace

        for d in model._devices:
            workspace.FeedBlob(f"gpu_{d}/data", np.ones((2, 4), np.float32))
            workspace.FeedBlob(f"gpu_{d}/label", np.zeros(2, np.int32))
        dpm.RunInitNet(model)
        dpm.RunNet(model, 1)
        first = workspace.FetchBlob("gpu_0/fc1_w")
        for d in (1, 2, 3):
            np.testing.assert_array_equal(workspace.FetchBlob(f"gpu_{d}/fc1_w"), first)


def test_options_are_frozen():
    model = _parallelize("frozen")
    with pytest.raises(dataclasses.FrozenInstanceError):
        model._parallel.options.use_nccl = True  # type: ignore[misc]
