"""DDP's bucket default on CUDA: buckets of bucket_cap_mb=25 with a 1 MiB first bucket when Parallelize
runs on real CUDA devices (a GPU count stand-in here: nothing runs, the nets are inspected), none on CPU
devices or simulated CUDA, bucket_cap_mb as DDP names it, bytes kept, 0 turning buckets off."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from graphpar import data_parallel_model as dpm
from graphpar import optimizer
from graphpar.errors import ParallelizeError
from graphpar.model_helper import ModelHelper
from graphpar.models import mlp, resnet18
from graphpar.passes.bucketing import param_specs
from tests.fake_gpus import fake_gpus


@pytest.fixture
def two_gpus(monkeypatch):
    fake_gpus(monkeypatch, 2)  # two real GPUs, as far as Parallelize can tell


def _build(cpu: bool = False, **options):
    model = ModelHelper(name="buckets")
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=mlp,
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1), devices=[0, 1], cpu_device=cpu,
                    **options)
    return model


def _bucket_ops(model) -> list[str]:
    return [op.outputs[0] for op in model.net.Proto().ops if op.type == "Concat"]


def test_real_cuda_devices_get_ddp_buckets_by_default(two_gpus) -> None:
    model = _build()
    assert model._parallel.options.gradient_bucket_bytes == 25 * 1024 * 1024 == dpm.DEFAULT_BUCKET_CAP_MB << 20
    assert model._parallel.options.first_bucket_bytes == 1024 * 1024
    # the MLP's 4 gradients (< 1 MiB in all) fit the small first bucket: one bucket, flattened per device
    assert len(_bucket_ops(model)) == 2
    assert not _bucket_ops(_build(gradient_bucket_bytes=0))  # 0: one all-reduce per gradient
    assert not _bucket_ops(_build(cpu=True))  # CPU devices: no buckets unless asked for


def test_bucket_cap_mb_and_bytes_give_the_same_buckets(two_gpus) -> None:
    # reverse creation order: pred_b (40 B) + pred_w (1280 B) pass the 100 B first bucket and close it,
    # fc1_b (128 B) + fc1_w (2048 B) pass 1500 B: two buckets, flattened and concatenated per device
    by_mb = _build(bucket_cap_mb=1500 / (1024 * 1024), first_bucket_bytes=100)
    by_bytes = _build(gradient_bucket_bytes=1500, first_bucket_bytes=100)
    assert len(_bucket_ops(by_mb)) == 4 and by_mb._parallel.options.gradient_bucket_bytes == 1500
    assert [op.type for op in by_mb.net.Proto().ops] == [op.type for op in by_bytes.net.Proto().ops]
    on_cpu = _build(cpu=True, bucket_cap_mb=1500 / (1024 * 1024), first_bucket_bytes=100)
    assert len(_bucket_ops(on_cpu)) == 4  # asked for: buckets on CPU devices too


def test_bad_bucket_options_are_refused(two_gpus) -> None:
    with pytest.raises(ParallelizeError, match="gradient_bucket_bytes or bucket_cap_mb, not both"):
        _build(gradient_bucket_bytes=100, bucket_cap_mb=1)
    with pytest.raises(ParallelizeError, match="bucket_cap_mb must be a number of MiB > 0"):
        _build(bucket_cap_mb=0)


def test_the_default_gives_way_when_a_param_size_is_unknown(two_gpus) -> None:
    def forward(model, loss_scale):
        shape = model.param_init_net.GivenTensorInt64Fill([], "w_shape", shape=[1], values=[4])
        w = model.param_init_net.GaussianFill([shape], "w", input_as_shape=True)  # its size depends on a value
        model.AddParameter(w)
        out = model.net.Mul(["data", w], "out")
        return [model.net.Scale(model.net.AveragedLoss(out, "loss"), "scaled_loss", scale=loss_scale)]

    model = ModelHelper(name="unknown_size")
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=forward,
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1), devices=[0, 1])
    assert not _bucket_ops(model) and any(op.type == "Sum" for op in model.net.Proto().ops)
    with pytest.raises(ParallelizeError, match="needs the size of param"):
        dpm.Parallelize(ModelHelper(name="asked"), input_builder_fun=lambda m: None, forward_pass_builder_fun=forward,
                        optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1), devices=[0, 1],
                        gradient_bucket_bytes=100)


def _emitted_buckets(model, order: list[str]) -> list[list[str]]:
    """The buckets Parallelize's train net all-reduces, read off its ops: bucket k's gradients are the
    inputs of the Concat into `cpu_0/_bucket_k`; a bucket of one gradient is reduced without one."""
    concats = {op.outputs[0]: [name.removesuffix("_flat") for name in op.inputs]
               for op in model.net.Proto().ops if op.type == "Concat" and op.outputs[0].startswith("cpu_0/_bucket_")}
    bucketed = {name for names in concats.values() for name in names}
    singles = iter([[name] for name in order if name not in bucketed])
    count = len(concats) + len(order) - len(bucketed)
    return [concats.get(f"cpu_0/_bucket_{k}") or next(singles) for k in range(count)]


@pytest.mark.parametrize(("cap_mb", "first"), [(5, 1024 * 1024), (2, 2 * 1024 * 1024)])
def test_resnet18_buckets_are_ddps(cap_mb: int, first: int) -> None:
    """ResNet-18's gradients, in the order they are reduced (the last layer's first: DDP's ready order),
    go to the buckets torch.distributed's own assignment gives them, with DDP's limits (the first bucket
    1 MiB; torch 2.13's DDP uses the cap for it when bucket_cap_mb is given: first_bucket_bytes=cap)."""
    model = ModelHelper(name="resnet18_buckets")
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=resnet18,
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1), devices=[0, 1], cpu_device=True,
                    bucket_cap_mb=cap_mb, first_bucket_bytes=first)
    state = model._parallel
    order = [f"cpu_0/{name}" for name in reversed(state.grad_names)]
    params = {str(g): str(p) for p, g in model.param_to_grad.items()}
    specs = param_specs(model.param_init_net.Proto(), [params[name] for name in order])
    tensors = [torch.empty(specs[params[name]].shape, device="meta") for name in order]
    expected, _ = dist._compute_bucket_assignment_by_size(tensors, [first, cap_mb * 1024 * 1024],
                                                          [False] * len(order), list(range(len(order))))
    assert len(order) == 62 and len(expected) > 3
    assert _emitted_buckets(model, order) == [[order[i] for i in bucket] for bucket in expected]
