from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from graphpar import workspace
from graphpar.core.ir import DeviceOption, NetDef, OperatorDef
from graphpar.core.schema import validate_net
from graphpar.core.shapes import BlobSpec
from graphpar.devices import cuda_on_cpu
from graphpar.errors import ParallelizeError
from graphpar.passes.bucketing import allreduce_buckets, param_specs, plan_buckets
from graphpar.passes.finish import chain_collectives
from tests.passes.helpers import cpu, fill, gpu, layout, reducer, summary

# Three params (created in this order) and their shapes: 24, 16 and 12 bytes of float32.
SHAPES = {"a": (2, 3), "b": (4,), "c": (3,)}
ORDER = ["c_grad", "b_grad", "a_grad"]  # reverse creation order, as Parallelize passes them


def _nets(lay):
    """param_init_net fills every replica's params; the train net fills gradient k on device position i
    with 10*k + i + 1."""
    init = NetDef("init", [fill(lay.scoped(d, p), lay.option(d), 0.0, s) for p, s in SHAPES.items()
                           for d in lay.devices])
    net = NetDef("grads", [fill(lay.scoped(d, f"{p}_grad"), lay.option(d), 10.0 * k + i + 1, s)
                           for k, (p, s) in enumerate(SHAPES.items()) for i, d in enumerate(lay.devices)])
    return init, net


def _bucketed(lay, bucket_bytes=40, first_bucket_bytes=12, to_all=True, **options):
    init, net = _nets(lay)
    grouped = {f"{p}_grad": lay.group(f"{p}_grad") for p in SHAPES}
    params = {f"{p}_grad": lay.scoped(lay.master, p) for p in SHAPES}
    ops = allreduce_buckets(net, init, ORDER, params, grouped, reducer(lay, **options), bucket_bytes,
                            first_bucket_bytes, to_all)
    chain_collectives(net.ops)
    return net, ops


def _unflatten(scope, dev):
    """The ops that cut bucket 1 of `scope` back into b_grad [4] and a_grad [2, 3]."""
    return [
        ("Split", [f"{scope}/_bucket_1"], [f"{scope}/b_grad_flat", f"{scope}/a_grad_flat"], dev, "", [],
         {"axis": 0, "split": [4, 6]}),
        ("Reshape", [f"{scope}/b_grad_flat"], [f"{scope}/b_grad", f"{scope}/b_grad_old_shape"], dev, "", [],
         {"shape": [4]}),
        ("Reshape", [f"{scope}/a_grad_flat"], [f"{scope}/a_grad", f"{scope}/a_grad_old_shape"], dev, "", [],
         {"shape": [2, 3]}),
    ]


def _flatten(scope, dev):
    return [
        ("FlattenToVec", [f"{scope}/b_grad"], [f"{scope}/b_grad_flat"], dev, "", [], {}),
        ("FlattenToVec", [f"{scope}/a_grad"], [f"{scope}/a_grad_flat"], dev, "", [], {}),
        ("Concat", [f"{scope}/b_grad_flat", f"{scope}/a_grad_flat"],
         [f"{scope}/_bucket_1", f"{scope}/_bucket_1_split_info"], dev, "", [], {"axis": 0}),
    ]


def _summary(ops):
    return [(*row, op.args) for row, op in zip(summary(ops), ops)]


def test_two_devices_a_small_first_bucket_then_one_flat_buffer_per_device():
    """c_grad (12 bytes) fills the first bucket alone and is reduced as without buckets; b_grad and
    a_grad (16 + 24 bytes) share the second: flattened, concatenated, one Sum, copied back, split."""
    lay = layout([0, 1])
    net, ops = _bucketed(lay)
    assert _summary(ops) == [
        ("Sum", ["cpu_0/c_grad", "cpu_1/c_grad"], ["cpu_0/c_grad"], cpu(0), "dpm", [], {"input_device_ids": [0, 1]}),
        ("Copy", ["cpu_0/c_grad"], ["cpu_1/c_grad"], cpu(1), "", [], {"input_device_ids": [0]}),
        *_flatten("cpu_0", cpu(0)),
        *_flatten("cpu_1", cpu(1)),
        ("Sum", ["cpu_0/_bucket_1", "cpu_1/_bucket_1"], ["cpu_0/_bucket_1"], cpu(0), "dpm", [],
         {"input_device_ids": [0, 1]}),
        ("Copy", ["cpu_0/_bucket_1"], ["cpu_1/_bucket_1"], cpu(1), "", [], {"input_device_ids": [0]}),
        *_unflatten("cpu_0", cpu(0)),
        *_unflatten("cpu_1", cpu(1)),
    ]
    assert net.ops[-len(ops):] == ops
    validate_net(net)


def test_four_devices_reduce_each_bucket_with_the_tree_over_positions():
    lay = layout([7, 4, 9, 5], gpu=True)
    _, ops = _bucketed(lay)
    sums = [(op.inputs, op.outputs[0]) for op in ops if op.type == "Sum"]
    tree = [(7, 4), (9, 5), (7, 9)]
    assert sums == [([f"gpu_{a}/{g}", f"gpu_{b}/{g}"], f"gpu_{a}/{g}") for g in ("c_grad", "_bucket_1")
                    for a, b in tree]
    bucket = ops[6:]  # after c_grad's 3 Sums and 3 Copies
    assert _summary(bucket[:12]) == [row for d in (7, 4, 9, 5) for row in _flatten(f"gpu_{d}", gpu(d))]
    assert [(op.type, op.outputs) for op in bucket[15:18]] == [
        ("Copy", [f"gpu_{d}/_bucket_1"]) for d in (4, 9, 5)]
    assert _summary(bucket[18:]) == [row for d in (7, 4, 9, 5) for row in _unflatten(f"gpu_{d}", gpu(d))]
    assert len(bucket) == 30


def test_nccl_is_one_allreduce_per_bucket_in_one_chain():
    lay = layout([7, 4, 9, 5], gpu=True)
    init, net = _nets(lay)
    net.ops.append(OperatorDef("NCCLBroadcast", ["gpu_7/rm", "gpu_4/rm"], ["gpu_7/rm", "gpu_4/rm"], {"root": 0},
                               gpu(7)))
    grouped = {f"{p}_grad": lay.group(f"{p}_grad") for p in SHAPES}
    params = {f"{p}_grad": f"gpu_7/{p}" for p in SHAPES}
    ops = allreduce_buckets(net, init, ORDER, params, grouped, reducer(lay, use_nccl=True), 40, 12)
    chain_collectives(net.ops)
    collectives = [(op.inputs, op.control_inputs) for op in ops if op.type == "NCCLAllreduce"]
    assert collectives == [([f"gpu_{d}/c_grad" for d in (7, 4, 9, 5)], ["gpu_7/rm"]),
                           ([f"gpu_{d}/_bucket_1" for d in (7, 4, 9, 5)], ["gpu_7/c_grad"])]
    assert [op.type for op in ops] == ["NCCLAllreduce", *["FlattenToVec", "FlattenToVec", "Concat"] * 4,
                                       "NCCLAllreduce", *["Split", "Reshape", "Reshape"] * 4]


def test_shared_models_unflatten_on_the_first_device_only():
    _, ops = _bucketed(layout([0, 1, 2]), to_all=False)
    assert [op.type for op in ops] == ["Sum", *["FlattenToVec", "FlattenToVec", "Concat"] * 3, "Sum", "Split",
                                       "Reshape", "Reshape"]


def test_buckets_large_enough_for_everything_make_one_and_one_device_adds_nothing():
    _, ops = _bucketed(layout([0, 1]), bucket_bytes=1 << 20, first_bucket_bytes=1 << 20)
    concat = next(op for op in ops if op.type == "Concat")
    assert concat.inputs == ["cpu_0/c_grad_flat", "cpu_0/b_grad_flat", "cpu_0/a_grad_flat"]
    assert concat.outputs[0] == "cpu_0/_bucket_0"
    assert sum(op.type == "Sum" for op in ops) == 1
    assert _bucketed(layout([3]))[1] == []


@pytest.mark.parametrize("count", [2, 3, 4])
@pytest.mark.parametrize("gpu_", [False, True])
def test_every_copy_holds_the_sum_with_its_shape(count, gpu_):
    lay = layout(list(range(2, 2 + count)), gpu=gpu_)
    for use_nccl in (False, True) if gpu_ else (False,):
        net, _ = _bucketed(lay, use_nccl=use_nccl, peer_access=lambda a, b: a == b)
        with cuda_on_cpu():
            workspace.RunNetOnce(net)
            for k, (p, shape) in enumerate(SHAPES.items()):
                expected = np.full(shape, sum(10.0 * k + i + 1 for i in range(count)), np.float32)
                for blob in lay.group(f"{p}_grad").values():
                    np.testing.assert_array_equal(workspace.FetchBlob(blob), expected, err_msg=blob)


# ---- planning -----------------------------------------------------------------------------------


def _spec(shape, dtype=torch.float32):
    return BlobSpec(shape, dtype, DeviceOption())


def _specs(**sizes):
    return {n: _spec((s,)) for n, s in sizes.items()}


def _ddp(names, specs, bucket_bytes, first_bucket_bytes):
    """torch.distributed's own assignment of `names` (in ready order) to buckets, as DDP's Reducer
    rebuilds them: the gradients' tensors in that order with their indices, limits [first, cap]."""
    tensors = [torch.empty(specs[n].shape, dtype=specs[n].dtype, device="meta") for n in names]
    buckets, _ = dist._compute_bucket_assignment_by_size(tensors, [first_bucket_bytes, bucket_bytes],
                                                         [False] * len(names), list(range(len(names))))
    return [[names[i] for i in bucket] for bucket in buckets]


def test_first_bucket_then_buckets_that_close_once_they_reach_the_limit():
    specs = _specs(a=1, b=1, c=2, d=1, e=3, f=1, g=9, h=1)  # 4 bytes per element
    assert plan_buckets(list(specs), specs, 12, 8) == [["a", "b"], ["c", "d"], ["e"], ["f", "g"], ["h"]]
    assert plan_buckets(list(specs), specs, 1000, 4) == [["a"], ["b", "c", "d", "e", "f", "g", "h"]]
    for cap, first in ((12, 8), (1000, 4), (4, 4), (20, 1 << 20)):
        assert plan_buckets(list(specs), specs, cap, first) == _ddp(list(specs), specs, cap, first)


def test_each_dtype_fills_buckets_of_its_own_as_ddp_does():
    specs = {**_specs(a=1, big=100, b=1, empty=0, c=1), "half": _spec((2,), torch.float16),
             "half2": _spec((8,), torch.float16), "d": _spec((1,))}
    names = ["a", "big", "b", "half", "empty", "c", "half2", "d"]
    assert plan_buckets(names, specs, 16, 8) == [["a", "big"], ["half", "half2"], ["b", "empty", "c", "d"]]
    assert plan_buckets(names, specs, 16, 8) == _ddp(names, specs, 16, 8)
    assert plan_buckets(names, specs, 64, 64) == [["a", "big"], ["b", "empty", "c", "d"], ["half", "half2"]]


def test_param_spec_follows_the_fill_ops_dtype_rules():
    init = NetDef("init", [
        OperatorDef("XavierFill", [], ["w"], {"shape": [3, 2]}),
        OperatorDef("ConstantFill", [], ["i"], {"shape": [2], "value": 1}),
        OperatorDef("ConstantFill", [], ["h"], {"shape": [2], "extra_shape": [5], "dtype": "float16"}),
        OperatorDef("GivenTensorDoubleFill", [], ["g"], {"shape": [], "values": [1.0]}),
        OperatorDef("Scale", ["w"], ["w"], {"scale": 2.0}),  # a later writer that keeps the spec
    ])
    assert param_specs(init, ["w", "i", "h", "g"]) == {
        "w": _spec((3, 2)), "i": _spec((2,), torch.int64), "h": _spec((2, 5), torch.float16),
        "g": _spec((), torch.float64)}
    assert param_specs(init, ["w"])["w"].nbytes == 24


def test_params_created_by_any_op_whose_shape_is_inferable_are_sized():
    """Not only fills: a param copied from, or computed out of, other blobs of param_init_net."""
    init = NetDef("init", [
        OperatorDef("GaussianFill", [], ["base"], {"shape": [4, 3]}),
        OperatorDef("Copy", ["base"], ["copied"], {}),
        OperatorDef("Transpose", ["base"], ["flipped"], {}),
        OperatorDef("ConstantFill", ["flipped"], ["like"], {"value": 1, "extra_shape": [2]}),
        OperatorDef("ConstantFill", [], ["unused"], {"shape": [1], "dtype": "complex"}),  # not needed: not inferred
    ], device_option=DeviceOption(1, 3))
    gpu3 = DeviceOption(1, 3)
    assert param_specs(init, ["copied", "flipped", "like"]) == {
        "copied": BlobSpec((4, 3), torch.float32, gpu3), "flipped": BlobSpec((3, 4), torch.float32, gpu3),
        "like": BlobSpec((3, 4, 2), torch.int64, gpu3)}


def test_a_param_created_by_a_non_fill_op_is_bucketed_as_a_filled_one():
    lay = layout([0, 1])
    _, expected = _bucketed(lay)
    init, net = _nets(lay)
    k = next(i for i, op in enumerate(init.ops) if op.outputs == ["cpu_0/a"])
    init.ops[k:k + 1] = [fill("cpu_0/a_src", cpu(0), 0.0, SHAPES["a"]),
                         OperatorDef("Copy", ["cpu_0/a_src"], ["cpu_0/a"], {}, cpu(0))]
    grouped = {f"{p}_grad": lay.group(f"{p}_grad") for p in SHAPES}
    params = {f"{p}_grad": lay.scoped(lay.master, p) for p in SHAPES}
    ops = allreduce_buckets(net, init, ORDER, params, grouped, reducer(lay), 40, 12)
    assert _summary(ops) == _summary(expected)


def test_params_of_unknown_size_are_named_in_the_error():
    init = NetDef("init", [
        OperatorDef("GivenTensorInt64Fill", [], ["s"], {"shape": [1], "values": [3]}),
        OperatorDef("ConstantFill", ["s"], ["w"], {"input_as_shape": True}),
        OperatorDef("Relu", ["w"], ["v"], {}),
        OperatorDef("ConstantFill", [], ["bad"], {"shape": [1], "dtype": "complex"}),
    ])
    for param, message in (("w", "'w', but shape inference .* depends on tensor values"),
                           ("v", "'v', but shape inference .* depends on tensor values"),
                           ("nothing", "'nothing', but no op of param_init_net creates it"),
                           ("bad", r"op #3 \(ConstantFill\).*-> bad\): unsupported dtype 'complex'")):
        with pytest.raises(ParallelizeError, match=message):
            param_specs(init, [param])
