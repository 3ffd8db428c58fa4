"""The engine end to end: every executor and engine option trains bit-identically to the simple loop."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from graphpar import data_parallel_model as dpm
from graphpar import model_helper, optimizer, workspace
from graphpar.devices import cuda_on_cpu
from graphpar.errors import MissingBlobError
from graphpar.models import lenet, mlp, resnet18

STEPS = 3
MODELS = {
    "mlp": (functools.partial(mlp, dim_in=6, hidden=(8, 5), num_classes=3), (6,)),
    "cnn": (functools.partial(lenet, channels=(2, 3), hidden=4, num_classes=3, image_size=16), (1, 16, 16)),
    "resnet18": (functools.partial(resnet18, num_classes=3, in_channels=1, width=4), (1, 16, 16)),
}


def _batches(shape: tuple[int, ...], size: int, seed: int = 5) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((size, *shape), dtype=np.float32), rng.integers(0, 3, size).astype(np.int32))
            for _ in range(STEPS)]


def train(model_name: str, devices: list[int], gpu: bool = False, **options) -> dict[str, np.ndarray]:
    """STEPS momentum-SGD steps in a fresh workspace; afterwards every replica's params, computed params,
    gradients, optimizer state and loss, and the iteration counter."""
    workspace.ResetWorkspace()
    forward, shape = MODELS[model_name]
    model = model_helper.ModelHelper(name=f"engine_{model_name}")
    with cuda_on_cpu():
        dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=forward,
                        optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.05, momentum=0.9),
                        devices=devices, cpu_device=not gpu, **options)
        prefix = model._device_prefix
        for step, (x, y) in enumerate(_batches(shape, 2 * len(devices))):
            for i, d in enumerate(devices):
                workspace.FeedBlob(f"{prefix}_{d}/data", x[2 * i:2 * i + 2])
                workspace.FeedBlob(f"{prefix}_{d}/label", y[2 * i:2 * i + 2])
            if step == 0:
                dpm.RunInitNet(model)
            dpm.RunNet(model, 1)
        names = [str(b) for copies in model._device_grouped_blobs.values() for b in copies.values()]
        names += [str(loss) for losses in model._losses_by_gpu.values() for loss in losses]
        return {name: workspace.FetchBlob(name) for name in [*names, "optimizer_iteration"]
                if workspace.HasBlob(name)}  # a shared model has only the first replica's params


def assert_identical(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        np.testing.assert_array_equal(actual[name], value, err_msg=name)


CASES = {
    "mlp": ("mlp", [0, 1, 2], {}),
    "mlp shared model": ("mlp", [0, 1], {"shared_model": True}),
    "mlp buckets": ("mlp", [0, 1, 2, 3], {"gradient_bucket_bytes": 64}),
    "cnn combined bn on cuda with nccl": ("cnn", [1, 0], {"combine_spatial_bn": True, "use_nccl": True, "gpu": True}),
    "resnet18 combined bn": ("resnet18", [0, 1], {"combine_spatial_bn": True}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_dag_trains_bit_identically_to_simple(case: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("GRAPHPAR_NUM_THREADS", "2")
    model_name, devices, options = CASES[case]
    simple = train(model_name, devices, net_type="simple", **options)
    assert_identical(train(model_name, devices, net_type="dag", **options), simple)


@pytest.mark.parametrize("case", ["mlp buckets", "resnet18 combined bn", "mlp shared model"])
def test_dynamic_memory_management_trains_identically_and_keeps_what_a_user_fetches(case: str):
    model_name, devices, options = CASES[case]
    reference = train(model_name, devices, **options)
    freed = train(model_name, devices, dynamic_memory_management=True, blobs_to_keep=["softmax"], **options)
    kept = {name: value for name, value in reference.items() if not name.endswith("_grad")}
    assert_identical(freed, kept)  # params, momenta, computed params, losses and the counter: gradients freed
    assert workspace.HasBlob("cpu_1/softmax" if not options.get("gpu") else "gpu_1/softmax")
    intermediate = "cpu_0/pred_grad"
    with pytest.raises(MissingBlobError, match=r"frees after its last use \(dynamic_memory_management\).*"
                                               r"blobs_to_keep"):
        workspace.FetchBlob(intermediate)


@pytest.mark.parametrize("case", ["mlp", "cnn combined bn on cuda with nccl", "resnet18 combined bn", "mlp buckets"])
def test_gradient_memory_sharing_trains_identically_alone_and_with_freeing(case: str):
    model_name, devices, options = CASES[case]
    reference = train(model_name, devices, **options)
    shared = train(model_name, devices, optimize_gradient_memory=True, **options)
    assert_identical(shared, reference)
    both = train(model_name, devices, optimize_gradient_memory=True, dynamic_memory_management=True, **options)
    assert_identical(both, {name: value for name, value in reference.items() if not name.endswith("_grad")})


def test_optimize_gradient_memory_shares_names_and_recycles_activations_on_request():
    counts = {}
    for recycle in (False, True):
        workspace.ResetWorkspace()
        model = model_helper.ModelHelper(name="memonger")
        dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=MODELS["resnet18"][0],
                        optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.05, momentum=0.9),
                        devices=[0, 1], cpu_device=True)
        before = {b for op in model.net.Proto().ops for b in op.outputs}
        dpm.OptimizeGradientMemory(model, {}, ["softmax"], recycle_activations=recycle)
        after = {b for op in model.net.Proto().ops for b in op.outputs}
        assert {"cpu_0/softmax", "cpu_1/softmax"} <= after and {g for g in model.param_to_grad.values()} <= after
        counts[recycle] = (len(before), len(after))
    assert counts[True][1] < counts[False][1] < counts[False][0]
