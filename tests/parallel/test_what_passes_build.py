"""What the passes build is on the ParallelState, never written onto the model by a pass; Parallelize sets the
attributes Caffe2's code reads in one place; passes that run after Parallelize (the Trainer's memory options)
run through the pipeline."""

from __future__ import annotations

import ast
import functools
import pathlib

import numpy as np
import pytest

from graphpar import data_parallel_model as dpm
from graphpar import model_helper, optimizer, workspace
from graphpar.core.naming import DYNAMIC_MEMORY_ARG, KEEP_ARG
from graphpar.models import mlp
from graphpar.passes.pipeline import Pass, PassContext

PASSES = pathlib.Path(dpm.__file__).resolve().parent.parent / "passes"
MLP = functools.partial(mlp, dim_in=4, hidden=(3,), num_classes=2)
CAFFE2_ATTRIBUTES = {"_accumulate_net", "_loss_scale_backoff_net", "_global_model_init_net",
                     "_global_model_param_updates_net", "_warmup_iterations", "_warmup_broadcast"}


def _is_model(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "model") or (isinstance(node, ast.Attribute)
                                                                    and node.attr == "model")


def model_writes(source: str) -> list[int]:
    """Lines that write a private attribute of a model (`model._x = ...`, `state.model._x += ...`,
    `setattr(model, ...)`) or change one in place (`model._x.update(...)`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        private = isinstance(node, ast.Attribute) and _is_model(node.value) and node.attr.startswith("_") \
            and not node.attr.startswith("__")
        if private and isinstance(node.ctx, (ast.Store, ast.Del)):
            found.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                isinstance(node.func.value, ast.Attribute) and _is_model(node.func.value.value) and \
                node.func.value.attr.startswith("_"):
            found.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" and \
                node.args and _is_model(node.args[0]):
            found.append(node.lineno)
    return found


def test_the_scan_finds_writes_onto_the_model():
    source = ("model._a = 1\nstate.model._b += 1\nsetattr(state.model, 'c', 2)\nmodel._casts.update(x)\n"
              "state.accumulate_net = n\nx = model._parallel\nmodel.params = []\n")
    assert model_writes(source) == [1, 2, 3, 4]


def test_no_pass_writes_a_private_attribute_onto_the_model():
    found = {f"{path.name}:{line}" for path in sorted(PASSES.glob("*.py")) for line in model_writes(path.read_text())}
    assert found == set(), "keep what a pass builds on the ParallelState (passes/state.py)"


def _parallelize(name: str, **options) -> model_helper.ModelHelper:
    model = model_helper.ModelHelper(name=name)
    dpm.Parallelize(model, lambda m: None, lambda m, s: MLP(m, s), devices=[0, 1], cpu_device=True,
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1, momentum=0.9), **options)
    return model


def _bmuf(name: str) -> model_helper.ModelHelper:
    model = model_helper.ModelHelper(name=name)
    dpm.Parallelize_BMUF(model, lambda m: None, lambda m, s: MLP(m, s),
                         lambda m: optimizer.build_sgd(m, 0.1), devices=[0, 1], cpu_device=True,
                         warmup_iterations=2)
    return model


def test_the_attributes_caffe2_reads_come_from_the_state_and_one_place(monkeypatch: pytest.MonkeyPatch):
    plain = set(vars(model_helper.ModelHelper(name="plain")))
    monkeypatch.setattr(dpm, "_set_caffe2_attributes", lambda model, state: None)
    built = [_parallelize("acc", accumulate_gradients=2, loss_scale="dynamic"), _bmuf("bmuf")]
    assert [set(vars(model)) - plain for model in built] == [set(), set()]  # _parallel, _parallel_runs: at init
    monkeypatch.undo()
    model, bmuf = _parallelize("acc2", accumulate_gradients=2, loss_scale="dynamic"), _bmuf("bmuf2")
    state, nets = model._parallel, bmuf._parallel.bmuf
    assert model._accumulate_net is state.accumulate_net and model._loss_scale_backoff_net is state.loss_scale_backoff_net
    assert (bmuf._global_model_init_net, bmuf._global_model_param_updates_net, bmuf._warmup_iterations,
            bmuf._warmup_broadcast) == (nets.global_init, nets.global_update, 2, nets.warmup_broadcast)
    assert set(vars(model)) | set(vars(bmuf)) >= CAFFE2_ATTRIBUTES
    assert not CAFFE2_ATTRIBUTES & set(vars(_parallelize("neither")))


def test_memory_options_after_parallelize_run_their_passes_through_the_pipeline(tmp_path: pathlib.Path):
    model = _parallelize("lean")
    with PassContext(dump_dir=tmp_path):
        dpm.enable_memory_options(model, keep=["cpu_0/extra"])
    assert sorted({p.name.split("_", 1)[1].rsplit("_lean", 1)[0] for p in tmp_path.iterdir()}) == [
        "free_intermediates", "share_gradient_memory"]
    options = model._parallel.options
    assert options.optimize_gradient_memory and options.dynamic_memory_management
    args = model.net.Proto().args
    assert args[DYNAMIC_MEMORY_ARG] == 1 and "cpu_0/extra" in args[KEEP_ARG]
    dpm.enable_memory_options(model)  # both on already: nothing runs again
    assert args[KEEP_ARG].count("cpu_0/extra") == 1


def test_memory_options_refuse_created_nets_and_leave_everything_as_it_was_on_error(monkeypatch: pytest.MonkeyPatch):
    model = _parallelize("failing")
    before, options = repr(model.net.Proto()), model._parallel.options

    def bad_pass(state) -> None:  # noqa: ANN001
        state.model.net.Proto().args["half_done"] = 1
        raise RuntimeError("planted")

    monkeypatch.setattr(dpm, "PIPELINE", tuple(Pass(e.name, bad_pass, e.when) if e.name == "free_intermediates"
                                               else e for e in dpm.PIPELINE))
    with pytest.raises(RuntimeError, match="planted"):
        dpm.enable_memory_options(model)
    assert repr(model.net.Proto()) == before and model._parallel.options is options
    monkeypatch.undo()
    for d in (0, 1):
        workspace.FeedBlob(f"cpu_{d}/data", np.zeros((2, 4), np.float32))
        workspace.FeedBlob(f"cpu_{d}/label", np.zeros(2, np.int32))
    dpm.RunInitNet(model)
    with pytest.raises(RuntimeError, match="was created already"):
        dpm.enable_memory_options(model)
    assert model._parallel.options is options
