"""Parallelize's options: one declaration each (`passes.options`), from which Parallelize's signature,
docstring and argument checks come."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from graphpar import data_parallel_model as dpm
from graphpar import model_helper
from graphpar.errors import ParallelizeError
from graphpar.models import mlp
from graphpar.passes.options import ParallelizeOptions, checked, declared

# Caffe2's data_parallel_model.Parallelize, in its order, with its defaults (graphpar's options follow)
CAFFE2 = [
    ("model_helper_obj", inspect.Parameter.empty), ("input_builder_fun", inspect.Parameter.empty),
    ("forward_pass_builder_fun", inspect.Parameter.empty), ("param_update_builder_fun", None),
    ("optimizer_builder_fun", None), ("post_sync_builder_fun", None), ("pre_grad_net_transformer_fun", None),
    ("net_transformer_fun", None), ("devices", None), ("rendezvous", None), ("net_type", "dag"),
    ("broadcast_computed_params", True), ("optimize_gradient_memory", False),
    ("dynamic_memory_management", False), ("blobs_to_keep", None), ("use_nccl", False),
    ("max_concurrent_distributed_ops", 16), ("cpu_device", False), ("ideep", False),
    ("num_threads_per_device", 4), ("shared_model", False), ("combine_spatial_bn", False),
    ("barrier_net_timeout_sec", 300),
]


def test_parallelize_takes_caffe2s_arguments_first_then_every_declared_option():
    parameters = list(inspect.signature(dpm.Parallelize).parameters.values())
    assert [(p.name, p.default) for p in parameters[:len(CAFFE2)]] == CAFFE2
    assert [p.name for p in parameters[1:]] == [f.name for f in declared()]
    assert all(p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD for p in parameters)


def test_parallelizes_parameters_are_written_out_as_the_options_declare_them():
    """Static tools read the def, not a generated `__signature__`: its parameters are the declared options
    (names, defaults, order), each annotated; so are the CPU/GPU/iDeep variants'."""
    assert "__signature__" not in vars(dpm.Parallelize)
    code = dpm.Parallelize.__code__
    written = code.co_varnames[:code.co_argcount]
    assert written == ("model_helper_obj", *(f.name for f in declared()))
    defaults = dict(zip(written[-len(dpm.Parallelize.__defaults__):], dpm.Parallelize.__defaults__, strict=True))
    assert defaults == {f.name: f.default for f in declared() if f.default is not dataclasses.MISSING}
    assert set(dpm.Parallelize.__annotations__) == {*written, "return"}
    for variant in (dpm.Parallelize_CPU, dpm.Parallelize_GPU, dpm.Parallelize_iDeep):
        assert inspect.signature(variant) == inspect.signature(dpm.Parallelize)
    assert inspect.signature(dpm.Parallelize_CPU_BMUF) == inspect.signature(dpm.Parallelize_BMUF)


def test_the_docstring_documents_every_declared_option_once_in_order():
    doc = inspect.getdoc(dpm.Parallelize)
    args = doc[doc.index("Args:"):doc.index("Warns")]
    entries = [line.split(":")[0].strip() for line in args.splitlines()[1:] if line.startswith("    ")
               and not line.startswith("        ")]
    assert entries == ["model_helper_obj", *(f.name for f in declared())]
    assert all(f.metadata["doc"] for f in declared())


def test_options_are_built_by_name_and_every_default_passes_its_check():
    with pytest.raises(TypeError):
        ParallelizeOptions(print, print)  # type: ignore[misc] - keyword-only
    builders = dict(input_builder_fun=print, forward_pass_builder_fun=print)
    defaults = checked(builders, "Parallelize")
    assert set(defaults) == {f.name for f in declared()} and defaults["blobs_to_keep"] == ()
    assert ParallelizeOptions(**defaults) == ParallelizeOptions(**{**defaults, **checked(defaults, "Parallelize")})
    assert "auto_buckets" not in defaults  # derived by Parallelize, not an argument


def _parallelize(*args, **options) -> None:  # noqa: ANN002
    model = model_helper.ModelHelper(name="opts")
    dpm.Parallelize(model, lambda m: None, lambda m, s: mlp(m, s, dim_in=4, hidden=(3,), num_classes=2), *args,
                    **{"devices": [0, 1], "cpu_device": True, **options})


def test_a_bad_call_raises_pythons_type_error_naming_parallelize():
    with pytest.raises(TypeError, match=r"Parallelize\(\) got an unexpected keyword argument 'devicez'"):
        _parallelize(devicez=[0])
    with pytest.raises(TypeError, match=r"Parallelize\(\) got multiple values for argument 'devices'"):
        _parallelize(None, None, None, None, None, [0])
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'forward_pass_builder_fun'"):
        dpm.Parallelize(model_helper.ModelHelper(name="few"), lambda m: None)


_FLAG = (TypeError, "must be True or False, got 'yes'")
# A bad value of every option, with the error it raises: a new option needs its line here.
BAD_VALUES = {
    "input_builder_fun": (3, TypeError, "Parallelize: input_builder_fun must be a function, got int"),
    "forward_pass_builder_fun": (3, TypeError, "forward_pass_builder_fun must be a function, got int"),
    "param_update_builder_fun": (3, TypeError, "param_update_builder_fun must be a function or None, got int"),
    "optimizer_builder_fun": (3, TypeError, "optimizer_builder_fun must be a function or None"),
    "post_sync_builder_fun": (3, TypeError, "post_sync_builder_fun must be a function or None"),
    "pre_grad_net_transformer_fun": (3, TypeError, "pre_grad_net_transformer_fun must be a function or None"),
    "net_transformer_fun": ("f", TypeError, "net_transformer_fun must be a function or None, got str"),
    "devices": ([0, 0], ParallelizeError, r"device ids must be unique and >= 0, got \[0, 0\]"),
    "rendezvous": ("host:29500", ParallelizeError, "Parallelize: rendezvous must be a dict, got str"),
    "net_type": (3, ParallelizeError, "net_type must be the name of an executor type, got 3"),
    "broadcast_computed_params": ("yes", *_FLAG),
    "optimize_gradient_memory": ("yes", *_FLAG),
    "dynamic_memory_management": ("yes", *_FLAG),
    "blobs_to_keep": ("fc1", TypeError, "blobs_to_keep must be a list of blob names"),
    "use_nccl": ("yes", *_FLAG),
    "max_concurrent_distributed_ops": (0, ParallelizeError, "max_concurrent_distributed_ops must be an int >= 1"),
    "cpu_device": ("yes", *_FLAG),
    "ideep": (2, TypeError, "Parallelize: ideep must be True or False, got 2"),
    "num_threads_per_device": (0, ParallelizeError, "Parallelize: num_threads_per_device must be an int >= 1, got 0"),
    "shared_model": (None, TypeError, "shared_model must be True or False, got None"),
    "combine_spatial_bn": ("yes", ParallelizeError, "combine_spatial_bn must be True, False, 'shard' or groups"),
    "barrier_net_timeout_sec": (-1, ParallelizeError, "barrier_net_timeout_sec must be a number of seconds > 0"),
    "static_shapes": ("yes", *_FLAG),
    "gradient_bucket_bytes": ("1", TypeError, "gradient_bucket_bytes must be an int number of bytes"),
    "first_bucket_bytes": (0, ParallelizeError, "first_bucket_bytes must be >= 1 byte, got 0"),
    "bucket_cap_mb": (0, ParallelizeError, "bucket_cap_mb must be a number of MiB > 0, got 0"),
    "average_computed_params": ("yes", *_FLAG),
    "uneven_batches": ("yes", *_FLAG),
    "check_finite_loss": ("yes", *_FLAG),
    "accumulate_gradients": (0, ParallelizeError, "accumulate_gradients must be an int >= 1"),
    "cpu_update_once": ("yes", *_FLAG),
    "cuda_graph": ("yes", *_FLAG),
    "compile": ("fastest", ParallelizeError, "Parallelize: compile: mode must be one of default, reduce-overhead"),
    "compute_dtype": ("int8", ParallelizeError, "Parallelize: compute_dtype='int8'"),
    "loss_scale": (-1.0, ParallelizeError, "loss_scale: .* needs 0 < init_scale"),
    "channels_last": ("yes", *_FLAG),
    "allreduce_dtype": ("int8", ParallelizeError, "Parallelize: allreduce_dtype='int8'"),
    "shard_optimizer_state": ("yes", *_FLAG),
    "shard_gradients": (None, TypeError, "shard_gradients must be True or False, got None"),
}


def test_every_option_is_checked():
    assert sorted(BAD_VALUES) == sorted(f.name for f in declared())
    assert [f.name for f in declared() if f.metadata["check"] is None] == []


@pytest.mark.parametrize("option", sorted(BAD_VALUES))
def test_each_declared_check_raises_its_message_before_anything_changes(option: str):
    value, error, message = BAD_VALUES[option]
    model = model_helper.ModelHelper(name="opts")
    arguments = dict(input_builder_fun=lambda m: None,
                     forward_pass_builder_fun=lambda m, s: mlp(m, s, dim_in=4, hidden=(3,), num_classes=2),
                     devices=[0, 1], cpu_device=True)
    with pytest.raises(error, match=message):
        dpm.Parallelize(model, **{**arguments, option: value})
    assert model._parallel is None and model.net.Proto().ops == [] and model.param_init_net.Proto().ops == []


def test_the_checked_options_are_canonical():
    model = model_helper.ModelHelper(name="canon")
    dpm.Parallelize(model, lambda m: None, lambda m, s: mlp(m, s, dim_in=4, hidden=(3,), num_classes=2),
                    devices=[1, 0], ideep=True, blobs_to_keep=["fc1"], barrier_net_timeout_sec=10,
                    compute_dtype="bf16", uneven_batches=1)
    options = model._parallel.options
    assert (options.devices, options.cpu_device, options.blobs_to_keep, options.barrier_net_timeout_sec,
            options.compute_dtype, options.uneven_batches) == ((1, 0), True, ("fc1",), 10.0, "bfloat16", True)
    assert dataclasses.fields(options)[-1].name == "auto_buckets" and options.check_finite_loss is False


def test_combine_spatial_bn_takes_groups_of_shards_or_a_process_group(tmp_path) -> None:
    import torch.distributed as dist

    from graphpar.passes.options import _spatial_bn

    assert _spatial_bn([[0, 2], (1,)], "P") == ((0, 2), (1,)) and _spatial_bn("shard", "P") == "shard"
    assert _spatial_bn(True, "P") is True and _spatial_bn(0, "P") == 0
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert _spatial_bn(dist.new_group([0]), "P") == ((0,),)  # SyncBatchNorm's process_group
    finally:
        dist.destroy_process_group()
