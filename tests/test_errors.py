"""Misuse a careful user could make: refused when recorded, or reported at the user's level (which blob,
which call to make), and a call that raises leaves the workspace and the model as they were."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from graphpar import core, model_helper, optimizer, workspace
from graphpar import data_parallel_model as dpm
from graphpar.errors import MissingBlobError, OperatorError
from graphpar.models import mlp

MLP = functools.partial(mlp, dim_in=6, hidden=(5,), num_classes=3)


def snapshot() -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in workspace.get_workspace().blobs.items()}


def assert_unchanged(before: dict[str, torch.Tensor]) -> None:
    after = workspace.get_workspace().blobs
    assert sorted(after) == sorted(before)
    for name, value in before.items():
        assert after[name].dtype == value.dtype and torch.equal(after[name], value), name


def parallelize(devices=(0, 1), **options) -> model_helper.ModelHelper:
    model = model_helper.ModelHelper(name="misuse")
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=MLP,
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1, momentum=0.9),
                    devices=list(devices), cpu_device=True, **options)
    return model


def feed(model, rows: int = 2, dtype=np.float32, skip: str = "") -> None:
    rng = np.random.default_rng(0)
    for d in model._devices:
        if f"cpu_{d}" != skip:
            workspace.FeedBlob(f"cpu_{d}/data", rng.standard_normal((rows, 6)).astype(dtype))
            workspace.FeedBlob(f"cpu_{d}/label", rng.integers(0, 3, rows).astype(np.int32))


# ---- item 8: refused when recorded --------------------------------------------------------------


def test_an_op_naming_one_blob_as_two_outputs_is_refused_when_recorded() -> None:
    net = core.Net("twice")
    with pytest.raises(ValueError, match="'s' as two of its outputs"):
        net.ChannelStats("x", ["s", "s"])
    assert net.Proto().ops == []
    with pytest.raises(ValueError, match="two of its outputs"):
        core.CreateOperator("ChannelStats", ["x"], ["s", "s"])


def test_bool_device_ids_are_refused() -> None:
    model = model_helper.ModelHelper(name="bools")
    with pytest.raises(TypeError, match="int device ids"):
        dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=MLP,
                        devices=[True, False], cpu_device=True)
    assert getattr(model, "_parallel", None) is None and model.net.Proto().ops == []


def test_a_float_iteration_counter_is_refused_at_create_net() -> None:
    model = parallelize()
    feed(model)
    dpm.RunInitNet(model)
    workspace.FeedBlob("optimizer_iteration", np.array([5.0], dtype=np.float32))
    before = snapshot()
    with pytest.raises(ValueError, match="iteration counter 'optimizer_iteration' is float32"):
        dpm.CreateNet(model, overwrite=True)
    assert_unchanged(before)


# ---- item 10: errors at the user's level --------------------------------------------------------


def test_float64_input_names_the_blob_and_says_to_cast() -> None:
    model = parallelize()
    feed(model)
    dpm.RunInitNet(model)
    feed(model, dtype=np.float64)
    before = snapshot()
    with pytest.raises(OperatorError, match=r"'cpu_\d/data' is float64 while other inputs are float32: "
                                            r"cast to float32"):
        dpm.RunNet(model, 1)
    assert_unchanged(before)


def test_running_before_run_init_net_says_to_call_run_init_net() -> None:
    model = parallelize()
    feed(model)
    before = snapshot()
    with pytest.raises(RuntimeError, match=r"call data_parallel_model.RunInitNet\(model\) first"):
        dpm.RunNet(model, 1)
    assert_unchanged(before)


def test_a_misspelt_fed_blob_gets_did_you_mean() -> None:
    model = parallelize()
    feed(model, skip="cpu_1")
    workspace.FeedBlob("cpu_1/dta", np.zeros((2, 6), np.float32))
    workspace.FeedBlob("cpu_1/label", np.zeros(2, np.int32))
    with pytest.raises(MissingBlobError, match=r"'cpu_1/data' does not exist(.|\n)*Did you mean 'cpu_1/dta'"):
        dpm.RunInitNet(model)
