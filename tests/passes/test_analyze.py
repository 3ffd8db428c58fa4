from __future__ import annotations

import pytest

from graphpar.core.ir import NetDef, OperatorDef
from graphpar.errors import ParallelizeError
from graphpar.passes.analyze import analyze_operators, is_cross_device_op
from tests.passes.helpers import cpu, gpu, layout


def _op(type_, inputs, outputs, device, name="", source=""):
    op = OperatorDef(type_, inputs, outputs, {}, device, name)
    op.source = source
    return op


def test_replica_local_ops_collectives_copies_and_dpm_sums_pass():
    lay = layout([0, 1], gpu=True)
    net = NetDef("n", [
        _op("Relu", ["gpu_0/x"], ["gpu_0/y"], gpu(0)),
        _op("LearningRate", ["optimizer_iteration"], ["lr_gpu1"], gpu(1)),
        _op("Iter", ["gpu_1/ITER"], ["gpu_1/ITER"], cpu(0)),  # a CPU op of replica 1
        _op("Sum", ["gpu_0/g", "gpu_1/g"], ["gpu_0/g"], gpu(0), name="dpm"),
        _op("Copy", ["gpu_0/g"], ["gpu_1/g"], gpu(1)),
        _op("NCCLAllreduce", ["gpu_0/g", "gpu_1/g"], ["gpu_0/g", "gpu_1/g"], gpu(0)),
        _op("Relu", ["cpu_0/x"], ["cpu_1/x"], gpu(0)),  # another prefix: not a replica of this model
    ])
    analyze_operators([net], lay)
    assert [is_cross_device_op(op) for op in net.ops] == [False, False, False, True, True, True, False]


@pytest.mark.parametrize("op", [
    _op("Add", ["cpu_0/x", "cpu_1/y"], ["cpu_0/z"], cpu(0), source="model.py:12"),
    _op("Sum", ["cpu_0/x", "cpu_1/y"], ["cpu_0/z"], cpu(0)),  # not a dpm Sum
    _op("Relu", ["cpu_1/x"], ["cpu_0/y"], cpu(1)),  # writes another replica's blob
])
def test_cpu_replicas_may_not_touch_each_other(op):
    with pytest.raises(ParallelizeError, match=r"belongs to replica cpu_0/ but touches 'cpu_1/[xy]'"):
        analyze_operators([NetDef("train", [op])], layout([0, 1]))


def test_error_names_net_op_and_source():
    op = _op("Add", ["cpu_0/x", "cpu_1/y"], ["cpu_0/z"], cpu(0), source="model.py:12")
    with pytest.raises(ParallelizeError, match=r"net 'train' op #1 Add \(recorded at model.py:12\) belongs to "
                                               r"replica cpu_0/ but touches 'cpu_1/y'"):
        analyze_operators([NetDef("init"), NetDef("train", [_op("Relu", ["a"], ["b"], cpu(0)), op])],
                          layout([0, 1]))


def test_a_cuda_op_must_run_on_its_replica_device():
    with pytest.raises(ParallelizeError, match="belongs to replica gpu_1/ but touches 'gpu_0/y'"):
        analyze_operators([NetDef("n", [_op("Relu", ["gpu_0/x"], ["gpu_0/y"], gpu(1))])], layout([0, 1], gpu=True))


def test_host_ops_writing_only_shared_blobs_may_read_every_replica():
    """The gradient of a shared CPU embedding table accumulates every replica's slice (Caffe2's
    cpu_indices model); a CUDA op, or one writing a replica's blob, still may not."""
    lay = layout([0, 1], gpu=True)
    shared = _op("Concat", ["gpu_0/indices", "gpu_1/indices"], ["cpu/vecs_grad_indices", "cpu/split"], cpu(0))
    analyze_operators([NetDef("train", [shared])], lay)
    on_gpu = _op("Concat", ["gpu_0/indices", "gpu_1/indices"], ["cpu/vecs_grad_indices", "cpu/split"], gpu(0))
    into_replica = _op("Concat", ["gpu_0/indices", "gpu_1/indices"], ["gpu_0/both", "cpu/split"], cpu(0))
    for op in (on_gpu, into_replica):
        with pytest.raises(ParallelizeError, match="touches 'gpu_1/indices'"):
            analyze_operators([NetDef("train", [op])], lay)
