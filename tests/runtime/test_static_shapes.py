"""Caffe2's `static_shapes`: Parallelize records the promise on the nets RunNet runs, and running them
refuses a fed input whose shape or dtype changed, before anything changes (`runtime.static_shapes`)."""

from __future__ import annotations

import numpy as np
import pytest

from graphpar import core, model_helper, optimizer, workspace
from graphpar import data_parallel_model as dpm
from graphpar.core.naming import STATIC_SHAPES_ARG
from graphpar.models import mlp


def _model(**options) -> model_helper.ModelHelper:  # noqa: ANN003
    model = model_helper.ModelHelper(name="static")
    dpm.Parallelize(model, lambda m: None, lambda m, s: mlp(m, s, dim_in=4, hidden=(3,), num_classes=2),
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1), devices=[0, 1], cpu_device=True,
                    **options)
    return model


def _feed(model: model_helper.ModelHelper, rows: int, dtype: type = np.float32) -> None:
    rng = np.random.default_rng(rows)
    for d in model._devices:
        workspace.FeedBlob(f"cpu_{d}/data", rng.standard_normal((rows, 4)).astype(dtype))
        workspace.FeedBlob(f"cpu_{d}/label", rng.integers(0, 2, rows).astype(np.int32))


def _state() -> dict[str, np.ndarray]:
    return {name: workspace.FetchBlob(name).copy() for name in workspace.Blobs()}


def test_parallelize_records_the_promise_on_the_nets_it_runs():
    assert STATIC_SHAPES_ARG not in _model().net.Proto().args
    model = _model(static_shapes=True, accumulate_gradients=2)
    assert model.net.Proto().args[STATIC_SHAPES_ARG] == 1
    assert model._accumulate_net.Proto().args[STATIC_SHAPES_ARG] == 1
    assert model._parallel.options.static_shapes is True


def test_a_fed_input_of_another_shape_is_refused_naming_it_before_anything_changes():
    model = _model(static_shapes=True)
    _feed(model, 3)
    dpm.RunInitNet(model)
    dpm.RunNet(model, 2)
    _feed(model, 3)
    dpm.RunNet(model, 1)  # the same shapes again: fine
    _feed(model, 2)  # a short last batch
    before = _state()
    with pytest.raises(ValueError, match=r"input 'cpu_0/data' is \[2, 4\] float32 but was \[3, 4\] float32 .*"
                                         r"static_shapes=True.*drop_last=True.*nothing ran"):
        dpm.RunNet(model, 1)
    after = _state()
    assert before.keys() == after.keys()
    for name, value in before.items():
        np.testing.assert_array_equal(after[name], value, err_msg=name)
    _feed(model, 3, np.float64)
    with pytest.raises(ValueError, match=r"'cpu_0/data' is \[3, 4\] float64 but was \[3, 4\] float32"):
        workspace.RunNet(model.net.Proto().name)  # the workspace's RunNet keeps the promise too


def test_without_the_promise_shapes_may_change():
    model = _model()
    _feed(model, 3)
    dpm.RunInitNet(model)
    _feed(model, 2)
    dpm.RunNet(model, 1)


def test_an_input_fed_after_createnet_is_held_to_its_shape_at_the_first_run():
    net = core.Net("plain")
    net.Relu("x", "y")
    net.Proto().args[STATIC_SHAPES_ARG] = 1
    name = net.Proto().name
    workspace.CreateBlob("x")
    workspace.CreateNet(net)
    workspace.FeedBlob("x", np.ones((2, 3), np.float32))
    workspace.RunNet(name)
    workspace.FeedBlob("x", np.ones((2, 3), np.float32))
    workspace.RunNet(name)
    workspace.FeedBlob("x", np.ones((4, 3), np.float32))
    with pytest.raises(ValueError, match=rf"RunNet\('{name}'\): input 'x' is \[4, 3\] float32 but was \[2, 3\]"):
        workspace.RunNet(name)
    workspace.CreateNet(net, overwrite=True)  # a new net is a new promise
    workspace.RunNet(name)
