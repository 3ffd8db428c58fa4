"""The DLRM model: N devices == 1 device on the whole batch, with sparse embedding updates."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from graphpar import data_parallel_model as dpm
from graphpar import model_helper, optimizer, workspace
from graphpar.core import GradientSlice
from graphpar.devices import cuda_on_cpu
from graphpar.models import dlrm
from graphpar.models.dlrm import split_clicks, synthetic_clicks

MODEL = functools.partial(dlrm, num_dense=3, table_rows=(40, 30), dim=4, bottom=(6,), top=(5,))
PARAMS = ["emb_0", "emb_1", "bot0_w", "bot1_b", "top0_w", "top1_w", "top1_b"]


def _batches(steps: int, batch: int, parts: int) -> list[dict[str, np.ndarray]]:
    """Click batches; in the first, the last chunk of examples looks nothing up in table 0."""
    out = []
    for step in range(steps):
        feeds = synthetic_clicks(batch, 3, (40, 30), seed=step)
        if step == 0:
            owner = np.repeat(np.arange(batch), feeds["lengths_0"])
            feeds["indices_0"] = feeds["indices_0"][owner < batch - batch // parts]
            feeds["lengths_0"][batch - batch // parts:] = 0
        out.append(feeds)
    return out


def _train(devices, build, data, gpu=False, **options):
    prefix = "gpu" if gpu else "cpu"
    workspace.ResetWorkspace()
    optimizer.reset_optimizer_instance_count()
    model = model_helper.ModelHelper(name=f"dlrm{len(devices)}")
    with cuda_on_cpu(gpu):
        dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=MODEL,
                        optimizer_builder_fun=build, devices=devices, cpu_device=not gpu, **options)
        for step, feeds in enumerate(data):
            for d, chunk in zip(devices, split_clicks(feeds, len(devices))):
                for name, value in chunk.items():
                    workspace.FeedBlob(f"{prefix}_{d}/{name}", value)
            if step == 0:
                dpm.RunInitNet(model)
                initial = {p: workspace.FetchBlob(f"{prefix}_{devices[0]}/{p}").copy() for p in PARAMS}
            dpm.RunNet(model, 1)
        final = {p: workspace.FetchBlob(f"{prefix}_{devices[0]}/{p}").copy() for p in PARAMS}
        for d in devices[1:]:
            for p in PARAMS:
                np.testing.assert_array_equal(workspace.FetchBlob(f"{prefix}_{d}/{p}"), final[p], err_msg=p)
    return model, initial, final


BUILDERS = {
    "momentum": lambda m: optimizer.build_sgd(m, 0.5, momentum=0.9),
    "adagrad": lambda m: optimizer.build_adagrad(m, 0.2, epsilon=1e-6),
    "adam": lambda m: optimizer.build_adam(m, 0.05),
}


@pytest.mark.slow
@pytest.mark.parametrize("opt", sorted(BUILDERS))
def test_dlrm_on_n_devices_equals_one_device(opt):
    data = _batches(4, 12, 3)
    model, initial, reference = _train([0], BUILDERS[opt], data)
    sparse = {dpm.stripBlobName(p) for p, g in model.param_to_grad.items() if isinstance(g, GradientSlice)}
    assert sparse == {"emb_0", "emb_1"}
    for p in PARAMS:
        assert np.abs(reference[p] - initial[p]).max() > 1e-4, p
    untouched = np.setdiff1d(np.arange(40), np.concatenate([f["indices_0"] for f in data]))
    np.testing.assert_array_equal(reference["emb_0"][untouched], initial["emb_0"][untouched])
    for devices, gpu in (([0, 1, 2], False), ([1, 2, 3], True)):
        _, _, final = _train(devices, BUILDERS[opt], data, gpu)
        for p in PARAMS:
            np.testing.assert_allclose(final[p], reference[p], rtol=1e-5, atol=1e-6, err_msg=p)  # float32 sums reordered


@pytest.mark.parametrize("option", ["optimize_gradient_memory", "dynamic_memory_management"])
def test_memory_options_keep_the_results(option):
    data = _batches(2, 12, 3)
    _, _, reference = _train([0, 1], BUILDERS["adagrad"], data)
    model, _, final = _train([0, 1], BUILDERS["adagrad"], data, **{option: True})
    if option == "optimize_gradient_memory":
        assert any(b.endswith("_shared") for op in model.net.Proto().ops for b in op.outputs)
    for p in PARAMS:
        np.testing.assert_array_equal(final[p], reference[p], err_msg=p)


def test_buckets_leave_sparse_gradients_out():
    data = _batches(2, 12, 3)
    _, _, reference = _train([0, 1, 2], BUILDERS["momentum"], data)
    model, _, final = _train([0, 1, 2], BUILDERS["momentum"], data, gradient_bucket_bytes=256, first_bucket_bytes=64)
    flattened = {op.inputs[0] for op in model.net.Proto().ops if op.type == "FlattenToVec"}
    assert flattened and not any("emb" in b or "pooled" in b for b in flattened)
    for p in PARAMS:
        np.testing.assert_array_equal(final[p], reference[p], err_msg=p)


def test_shared_model_updates_the_one_table_from_every_replica():
    data = _batches(2, 12, 3)
    _, _, reference = _train([0], BUILDERS["momentum"], data)
    workspace.ResetWorkspace()
    optimizer.reset_optimizer_instance_count()
    model = model_helper.ModelHelper(name="dlrm_shared")
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=MODEL,
                    optimizer_builder_fun=BUILDERS["momentum"], devices=[0, 1, 2], cpu_device=True,
                    shared_model=True)
    for step, feeds in enumerate(data):
        for d, chunk in enumerate(split_clicks(feeds, 3)):
            for name, value in chunk.items():
                workspace.FeedBlob(f"cpu_{d}/{name}", value)
        if step == 0:
            dpm.RunInitNet(model)
        dpm.RunNet(model, 1)
    assert not workspace.HasBlob("cpu_1/emb_0")
    for p in PARAMS:
        np.testing.assert_allclose(workspace.FetchBlob(f"cpu_0/{p}"), reference[p], rtol=1e-5, atol=1e-6, err_msg=p)
