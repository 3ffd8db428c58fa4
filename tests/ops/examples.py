"""Valid example inputs and args for every registered op type: the table the registry-wide tests run.

Each op type maps to one or more `Example`s that its kernel accepts; together they should take every
branch of its shape rule (optional inputs and outputs, args that change shapes or dtypes, sizes read
from values). `unknown` lists the outputs whose spec depends on input values, which shape inference
must leave unknown. tests/core/test_shapes.py fails for a registered op type missing here, so a new op
needs an entry.
"""

from __future__ import annotations

import atexit
import os
import tempfile
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from graphpar import distributed
from graphpar.core.ir import NetDef, OperatorDef

_GEN = torch.Generator().manual_seed(0)


class Example(NamedTuple):
    inputs: tuple[torch.Tensor, ...]
    args: dict[str, Any]
    outputs: int | None  # the op's output count (None: the schema's minimum)
    unknown: frozenset[int]  # outputs whose shape depends on input values


def ex(*inputs: torch.Tensor, outputs: int | None = None, unknown: tuple[int, ...] = (), **args: Any) -> Example:
    return Example(inputs, args, outputs, frozenset(unknown))


def f(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Seeded standard-normal values."""
    return torch.randn(shape, generator=_GEN, dtype=torch.float64).to(dtype)


def pos(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Seeded values in [0.5, 1.5)."""
    return (torch.rand(shape, generator=_GEN, dtype=torch.float64) + 0.5).to(dtype)


def ints(*values: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def _checkpoint() -> str:
    """A checkpoint file holding Y0 (float32 [2, 3]) and Y1 (int64 [4]), for Load."""
    from graphpar import checkpoint
    from graphpar.workspace import Workspace

    ws = Workspace("load_example")
    ws.feed_blob("Y0", f(2, 3))
    ws.feed_blob("Y1", ints(1, 2, 3, 4, dtype=torch.int64))
    path = tempfile.NamedTemporaryFile(suffix=".safetensors", delete=False).name
    checkpoint.save(path, ["Y0", "Y1"], ws)
    atexit.register(os.remove, path)
    return path


def _net(*ops: tuple[str, list[str], list[str]]) -> NetDef:
    """A NetDef argument (If/While) of (type, inputs, outputs) ops."""
    return NetDef("inner", [OperatorDef(t, i, o) for t, i, o in ops])


def probs(rows: int, cols: int) -> torch.Tensor:
    return torch.softmax(f(rows, cols), 1)


# a communicator of one shard and a store, registered in this process, for the cross-shard ops
_WORLD = torch.tensor(distributed.create_world("examples", None, None, 0, 1, "GLOO", 5.0), dtype=torch.int64)
_STORE = torch.tensor(distributed.register_store(torch.distributed.HashStore()), dtype=torch.int64)
_STORE_DIR = tempfile.mkdtemp(prefix="graphpar_examples_")

_X4 = f(2, 3, 6, 6)
_POOLED, _INDICES = F.max_pool2d(_X4, 2, 2, return_indices=True)
_POOL = {"kernel": 2, "stride": 2}
_CONV = {"kernel": 3, "pad": 1, "stride": 2}
_SCHEDULE = {"base_lr": -0.1, "policy": "step", "stepsize": 2, "gamma": 0.5}

_CHECKPOINT = _checkpoint()

EXAMPLES: dict[str, list[Example]] = {
    "Abs": [ex(f(2, 3))],
    "AbsGradient": [ex(f(2, 3), f(2, 3))],
    "Accuracy": [ex(f(4, 3), ints(0, 2, 1, 1)), ex(f(4, 3, dtype=torch.float64), ints(0, 2, 1, 1), top_k=2)],
    "Adadelta": [ex(f(3, 2), pos(3, 2), pos(3, 2), f(3, 2), f(1), outputs=3)],
    "Adam": [ex(f(3, 2), f(3, 2), pos(3, 2), f(3, 2), f(1), ints(1, dtype=torch.int64), outputs=3)],
    "Add": [ex(f(2, 3), f(3)), ex(f(2, 3, 4), f(3), broadcast=1, axis=1)],
    "CheckFinite": [ex(f(1), outputs=0), ex(f(2, 3), f(1, dtype=torch.float64), outputs=0)],
    "Print": [ex(f(2, 3), outputs=0), ex(ints(1, 2), outputs=0, limit=1, every_n=2)],
    "AddGradient": [ex(f(2, 3), f(2, 3), f(3)), ex(f(2, 3, 4), f(2, 3, 4), f(3), broadcast=1, axis=1)],
    "Alias": [ex(f(2))],
    "AtomicIter": [ex(torch.zeros((), dtype=torch.uint8), ints(3, dtype=torch.int64))],
    "AveragePool": [ex(_X4, **_POOL), ex(_X4, global_pooling=1), ex(_X4, kernel=3, pads=[1, 0, 0, 1])],
    "AveragePoolGradient": [ex(_X4, _POOLED, f(2, 3, 3, 3), **_POOL)],
    "AveragedLoss": [ex(f(4, 3))],
    "AveragedLossGradient": [ex(f(4, 3), f())],
    "Cast": [ex(f(2, 3), to="int32"), ex(f(2, 3), to=13)],
    "CastGradient": [ex(f(2, 3, dtype=torch.float64), f(2, 3), to="float")],
    "ChannelBackpropStats": [ex(f(2, 3, 4, 4), f(3), pos(3), f(2, 3, 4, 4))],
    "ChannelStats": [ex(f(2, 3, 4, 4)), ex(f(5, 3, dtype=torch.float64))],
    "Clip": [ex(f(2, 3), min=-0.5, max=0.5)],
    "ClipGradient": [ex(f(2, 3), f(2, 3), min=-0.5, max=0.5)],
    "ClipTensorByScaling": [ex(f(3, 2), pos(1), threshold=0.5), ex(f(3, 2), pos(1), pos(1), threshold=0.5)],
    "Concat": [ex(f(2, 3), f(2, 4)), ex(f(2, 3), f(2, 3), axis=0, add_axis=1), ex(f(1, 2, 2, 2), f(1, 3, 2, 2),
                                                                                   order="NCHW")],
    "ConstantFill": [ex(shape=[2, 3], value=1), ex(shape=[2], extra_shape=[3], value=True),
                     ex(f(2, 3, dtype=torch.float64), value=1.5), ex(ints(2, 3), value=2.0, extra_shape=[4]),
                     ex(shape=[2], dtype="float16"), ex(ints(2, 3, dtype=torch.int64), input_as_shape=1, unknown=(0,))],
    "Conv": [ex(f(2, 3, 8, 8), f(4, 3, 3, 3), f(4), **_CONV), ex(f(2, 3, 8, 8), f(4, 3, 3, 3), pads=[1, 0, 0, 1]),
             ex(f(1, 4, 7, 7), f(4, 2, 3, 3), group=2, dilation=2)],
    "ConvGradient": [ex(f(2, 3, 8, 8), f(4, 3, 3, 3), f(2, 4, 4, 4), outputs=3, **_CONV),
                     ex(f(2, 3, 8, 8), f(4, 3, 3, 3), f(2, 4, 4, 4), outputs=2, no_gradient_to_input=1, **_CONV),
                     ex(f(2, 3, 8, 8), f(4, 3, 3, 3), f(2, 4, 7, 7), outputs=2, pads=[1, 0, 0, 1])],
    "Copy": [ex(f(2, 3))],
    "CopyCPUToGPU": [ex(f(2))],
    "CopyGPUToCPU": [ex(f(2))],
    "CopyOnDeviceLike": [ex(f(2), f(3, dtype=torch.float64))],
    "CreateMutex": [ex()],
    "CrossEntropy": [ex(probs(4, 3), probs(4, 3))],
    "CrossEntropyGradient": [ex(probs(4, 3), probs(4, 3), f(4))],
    "Div": [ex(f(2, 3), pos(2, 3)), ex(f(2, 3), pos(3, dtype=torch.float64))],
    "DivGradient": [ex(f(2, 3), f(2, 3), pos(2, 3), f(2, 3))],
    "Dropout": [ex(f(4, 5), outputs=2, ratio=0.5), ex(f(4, 5), is_test=1), ex(f(4, 5), outputs=2, is_test=1)],
    "DropoutGrad": [ex(f(4, 5), torch.rand(4, 5, generator=_GEN) > 0.5, ratio=0.5), ex(f(4, 5), is_test=1)],
    "Exp": [ex(f(2, 3))],
    "ExpGradient": [ex(pos(2, 3), f(2, 3))],
    "FC": [ex(f(4, 3), f(2, 3), f(2)), ex(f(2, 3, 4), f(5, 4), f(5), axis=2),
           ex(f(4, 3, dtype=torch.float64), f(2, 3, 1, dtype=torch.float64), f(2, dtype=torch.float64))],
    "FCGradient": [ex(f(4, 3), f(2, 3), f(4, 2), outputs=3),
                   ex(f(4, 3), f(2, 3), f(4, 2), outputs=2, no_gradient_to_input=1)],
    "Flatten": [ex(f(2, 3, 4), axis=2)],
    "FlattenToVec": [ex(f(2, 3))],
    "FloatToHalf": [ex(f(2, 3))],
    "CheckGradients": [ex(f(2, 3), f(4, dtype=torch.float16), outputs=0, loss_scale=8.0)],
    "ChannelsLast": [ex(f(2, 3, 4, 5)), ex(f(2, 3))],
    "BackoffLossScale": [ex(pos(), ints(3, dtype=torch.int64).reshape(()), outputs=2, backoff_factor=0.25)],
    "UnscaleGradients": [ex(f(2, 3), f(4, dtype=torch.float16), pos(), outputs=2), ex(f(3), pos(), outputs=1)],
    "UpdateLossScale": [ex(pos(), ints(1, dtype=torch.int64).reshape(()), outputs=2, growth_interval=2)],
    "Ftrl": [ex(f(3, 2), pos(3, 2, 2), f(3, 2), outputs=2), ex(f(4), pos(4, 2), f(4), outputs=2, alpha=0.5, lambda1=0.3)],
    "GaussianFill": [ex(shape=[2, 3], mean=1.0, std=2.0), ex(f(2, 3, dtype=torch.float64), extra_shape=[2]),
                     ex(ints(2, 3), input_as_shape=1, unknown=(0,))],
    "GivenTensorBoolFill": [ex(values=[1, 0, 1], shape=[3])],
    "GivenTensorDoubleFill": [ex(values=[1.0, 2.0], shape=[2, 1])],
    "GivenTensorFill": [ex(values=[1.0] * 6, shape=[2, 3]), ex(values=[4.0], shape=[])],
    "GivenTensorInt64Fill": [ex(values=[3], shape=[1])],
    "GivenTensorIntFill": [ex(values=[1, 2, 3, 4], shape=[2, 2])],
    "HalfToFloat": [ex(f(2, 3, dtype=torch.float16))],
    "Iter": [ex(ints(0, dtype=torch.int64))],
    "LabelCrossEntropy": [ex(probs(4, 3), ints(0, 2, 1, 1))],
    "LabelCrossEntropyGradient": [ex(probs(4, 3), ints(0, 2, 1, 1, dtype=torch.int64), f(4))],
    "Lars": [ex(f(3, 2), f(3, 2), pos(1), pos(1), pos(1)), ex(torch.zeros(3), f(3), pos(1), pos(1), pos(1), lr_min=0.0)],
    "LeakyRelu": [ex(f(2, 3), alpha=0.2)],
    "LeakyReluGradient": [ex(f(2, 3), f(2, 3), alpha=0.2)],
    "LearningRate": [ex(ints(5, dtype=torch.int64), **_SCHEDULE)],
    "Log": [ex(pos(2, 3))],
    "LogGradient": [ex(pos(2, 3), f(2, 3))],
    "MSRAFill": [ex(shape=[4, 3, 2, 2]), ex(shape=[0, 3]), ex(ints(2, 3), input_as_shape=1, unknown=(0,))],
    "Max": [ex(f(2, 3)), ex(f(2, 3), f(3), f(2, 1))],
    "MaxGradient": [ex(f(2, 3), f(2, 3), f(2, 3), f(3), outputs=2)],
    "MaxPool": [ex(_X4, **_POOL), ex(_X4, outputs=2, **_POOL), ex(_X4, kernel=3, pads=[1, 0, 0, 1]),
                ex(_X4, global_pooling=1)],
    "MaxPoolGradient": [ex(_X4, _POOLED, f(2, 3, 3, 3), **_POOL)],
    "MaxPoolWithIndexGradient": [ex(_X4, f(2, 3, 3, 3), _INDICES, **_POOL)],
    "MomentumSGDUpdate": [ex(f(3, 2), f(3, 2), pos(1), f(3, 2), momentum=0.9),
                          ex(f(3, 2), f(3, 2), pos(1), f(3, 2), momentum=0.9, nesterov=1)],
    "Mul": [ex(f(2, 3), f(2, 1))],
    "MultiTensorAdam": [ex(f(3, 2), f(4), f(3, 2), f(4), pos(3, 2), pos(4), f(3, 2), f(4), f(1),
                           ints(2, dtype=torch.int64), outputs=6)],
    "MultiTensorMomentumSGDUpdate": [ex(f(3, 2), f(4), f(3, 2), f(4), f(3, 2), f(4), pos(1), outputs=6,
                                        momentum=0.9),
                                     ex(f(3, 2), f(3, 2), f(3, 2), pos(1), outputs=3, momentum=0.5, nesterov=1)],
    "MulGradient": [ex(f(2, 3), f(2, 3), f(2, 1))],
    "Allreduce": [ex(_WORLD, f(2, 3), outputs=1), ex(_WORLD, f(2), ints(3, 4), outputs=2, order="tree")],
    "Allgather": [ex(_WORLD, f(3, 2), unknown=(0,)), ex(_WORLD, ints(4, 5, dtype=torch.int64), unknown=(0,))],
    "Barrier": [ex(_WORLD, outputs=0)],
    "ReduceScatter": [ex(_WORLD, f(2, 3), split=[6]), ex(_WORLD, f(4), order="tree", unknown=(0,))],
    "CheckFiniteAcrossShards": [ex(_WORLD, f(1), unknown=(0,)), ex(_WORLD, f(2, 3), f(1), unknown=(0,))],
    "Broadcast": [ex(_WORLD, f(2, 3), outputs=1, root=0)],
    "CreateCommonWorld": [ex(_STORE, size=1, rank=0, name="example_cw"), ex(size=1, rank=0, name="example_cw")],
    "FileStoreHandlerCreate": [ex(path=_STORE_DIR, prefix="example")],
    "Storm": [ex(f(3, 2), f(3, 2), pos(1), f(3, 2), f(1), outputs=3, momentum=5.0, beta=0.5)],
    "SparseStorm": [ex(f(5, 2), f(5, 2), pos(1), f(3, 2), ints(1, 3, 1), f(1), outputs=3)],
    "DecayAdagrad": [ex(f(3, 2), f(3, 2), pos(3, 2), f(3, 2), f(1), ints(2, dtype=torch.int64), outputs=3,
                        weight_decay=0.1)],
    "GFtrl": [ex(f(3, 2), pos(3, 2, 2), f(3, 2), outputs=2), ex(f(4), pos(4, 2), f(4), pos(1), outputs=2)],
    "YellowFin": [ex(f(3, 2), f(3, 2), pos(1), pos(1), f(4), f(3, 2), pos(3, 2), pos(5), f(3, 2),
                     ints(3, dtype=torch.int64), outputs=8, curv_win_width=4)],
    "SmartDecaySparseAdam": [ex(f(5, 2), f(5, 2), pos(5, 2), ints(0, 1, 0, 2, 0, dtype=torch.int64), ints(1, 3, 1),
                                f(3, 2), f(1), ints(4, dtype=torch.int64), outputs=4)],
    "RowWiseCounter": [ex(ints(0, 1, 0, 2, 0, dtype=torch.int64), pos(5, dtype=torch.float64), ints(1, 3, 1),
                          ints(4, dtype=torch.int64), outputs=2, counter_halflife=3)],
    **{name: [ex(f(2, 3), f(2, 3)), ex(f(2, 3), f(3), broadcast=1), ex(ints(1, 2, 3), ints(2))]
       for name in ("LT", "LE", "GT", "GE", "EQ", "NE")},
    "If": [ex(torch.tensor(True), f(2, 3), outputs=1, unknown=(0,), then_net=_net(("Relu", ["X1"], ["Y0"]))),
           ex(torch.tensor([False]), f(2), f(3), outputs=1, unknown=(0,), then_net=_net(("Copy", ["X1"], ["Y0"])),
              else_net=_net(("Copy", ["X2"], ["Y0"])))],
    "While": [ex(torch.tensor(True), ints(0), ints(3), ints(1), outputs=2, unknown=(0, 1),
                 cond_net=_net(("LT", ["X1", "X2"], ["X0"]), ("Copy", ["X0"], ["Y0"]), ("Copy", ["X1"], ["Y1"])),
                 loop_net=_net(("Add", ["X1", "X3"], ["X1"])))],
    "Load": [ex(outputs=2, db=_CHECKPOINT, absolute_path=True)],
    "RAdam": [ex(f(3, 2), f(3, 2), pos(3, 2), f(3, 2), f(1), ints(1, dtype=torch.int64), outputs=3)],
    "SparseRAdam": [ex(f(5, 2), f(5, 2), pos(5, 2), ints(1, 3, 1), f(3, 2), f(1), ints(7, dtype=torch.int64), outputs=3)],
    "TCPStoreHandlerCreate": [ex(host="127.0.0.1", port=0, is_master=True)],
    "NCCLAllreduce": [ex(f(2, 3), f(2, 3), outputs=2), ex(f(4), outputs=1)],
    "NCCLBroadcast": [ex(f(2, 3), f(2, 3), f(2, 3), outputs=3, root=1)],
    "NCHW2NHWC": [ex(f(2, 3, 4, 5))],
    "NHWC2NCHW": [ex(f(2, 3, 4, 5))],
    "Negative": [ex(f(2, 3))],
    "ReduceFrontSum": [ex(f(4, 3)), ex(f(2, 3, 4), num_reduce_dim=2)],
    "ReduceFrontSumGradient": [ex(f(2, 3, 4), f(4), num_reduce_dim=2)],
    "Relu": [ex(f(2, 3))],
    "ReluGradient": [ex(f(2, 3), f(2, 3))],
    "Reshape": [ex(f(2, 3, 4), shape=[0, -1]), ex(f(2, 3, 4), ints(4, 6, dtype=torch.int64), unknown=(0,))],
    "ResizeLike": [ex(f(6), f(2, 3, dtype=torch.float64))],
    "RmsProp": [ex(f(3, 2), pos(3, 2), f(3, 2), f(1), outputs=3, momentum=0.5)],
    "Scale": [ex(f(2, 3), scale=2.0)],
    "Sigmoid": [ex(f(2, 3))],
    "SigmoidCrossEntropyWithLogits": [ex(f(4, 3), torch.rand(4, 3, generator=_GEN))],
    "SigmoidCrossEntropyWithLogitsGradient": [ex(f(4), f(4, 3), torch.rand(4, 3, generator=_GEN))],
    "SigmoidGradient": [ex(f(2, 3), f(2, 3))],
    "Softmax": [ex(f(4, 3)), ex(f(2, 3, 4), axis=2)],
    "SoftmaxGradient": [ex(probs(4, 3), f(4, 3))],
    "SoftmaxWithLoss": [ex(f(4, 3), ints(0, 2, 1, 1), outputs=2),
                        ex(f(4, 3), ints(0, 2, 1, 1), pos(4), outputs=2, scale=0.5),
                        ex(f(4, 3), probs(4, 3), outputs=2, label_prob=1)],
    "SoftmaxWithLossGradient": [ex(f(4, 3), ints(0, 2, 1, 1), probs(4, 3), f()),
                                ex(f(4, 3), ints(0, 2, 1, 1), pos(4), probs(4, 3), f())],
    "SparseAdadelta": [ex(f(5, 2), pos(5, 2), pos(5, 2), ints(1, 3, 1), f(3, 2), f(1), outputs=3)],
    "SparseFtrl": [ex(f(5, 2), pos(5, 2, 2), ints(0, 3, 0), f(3, 2), outputs=2)],
    "SparseWngrad": [ex(f(5, 2), pos(1), ints(0, 3), f(2, 2), f(1), outputs=2)],
    "SpatialBN": [ex(f(2, 3, 4, 4), pos(3), f(3), f(3), pos(3), outputs=5),
                  ex(f(2, 3, 4, 4), pos(3), f(3), f(3), pos(3), is_test=1),
                  ex(f(2, 3, 4, 4), pos(3), f(3), f(3), pos(3), f(3), pos(3) * 100, outputs=5, num_batches=2)],
    "SpatialBNGradient": [ex(f(2, 3, 4, 4), pos(3), f(2, 3, 4, 4), f(3), pos(3)),
                          ex(f(2, 3, 4, 4), pos(3), f(2, 3, 4, 4), f(3), pos(3), is_test=1),
                          ex(f(2, 3, 4, 4), pos(3), f(2, 3, 4, 4), f(3), pos(3), f(3), f(3), num_batches=2)],
    "Slice": [ex(f(4, 6), starts=[1, 2], ends=[3, -1]), ex(f(8), starts=[2], ends=[5]), ex(f(3), starts=[-2], ends=[-1])],
    "SliceGradient": [ex(f(4, 6), f(2, 4), starts=[1, 2], ends=[3, -1])],
    "Split": [ex(f(6, 2), outputs=2, axis=0, split=[2, 4]), ex(f(2, 6), outputs=3),
              ex(f(2, 3, 2), outputs=3, axis=1, add_axis=1),
              ex(f(6, 2), ints(2, 4), outputs=2, axis=0, unknown=(0, 1))],
    "Sqr": [ex(f(2, 3))],
    "SqrGradient": [ex(f(2, 3), f(2, 3))],
    "Sqrt": [ex(pos(2, 3))],
    "SqrtGradient": [ex(pos(2, 3), f(2, 3))],
    "SquaredL2Distance": [ex(f(4, 3), f(4, 3))],
    "SquaredL2DistanceGradient": [ex(f(4, 3), f(4, 3), f(4))],
    "StopGradient": [ex(f(2, 3))],
    "Sub": [ex(f(2, 3), f(2, 3, dtype=torch.float64))],
    "SubGradient": [ex(f(2, 3), f(2, 3), f(2, 3))],
    "Sum": [ex(f(2, 3), f(2, 3), f(2, 3)), ex(ints(1, 2))],
    "SumElements": [ex(f(2, 3)), ex(f(2, 3), average=1)],
    "SumElementsGradient": [ex(f(2, 3), f(), average=1)],
    "SumSqrElements": [ex(f(2, 3), average=1)],
    "SumSqrElementsGradient": [ex(f(2, 3), f())],
    "Tanh": [ex(f(2, 3))],
    "TanhGradient": [ex(f(2, 3), f(2, 3))],
    "Transpose": [ex(f(2, 3, 4)), ex(f(2, 3, 4), axes=[1, 2, 0])],
    "UniformFill": [ex(shape=[2, 3], min=-1.0, max=1.0), ex(shape=[2], dtype="double"),
                    ex(ints(3, dtype=torch.int64), input_as_shape=1, extra_shape=[2], unknown=(0,))],
    "WeightedSum": [ex(f(2, 3), f(1), f(2, 3), f(1))],
    "WeightedSumGradient": [ex(f(2, 3), f(1), f(1), outputs=2),
                            ex(f(2, 3), f(2, 3), f(1), f(2, 3), f(1), outputs=4, grad_on_w=1)],
    "Wngrad": [ex(f(3, 2), pos(1), f(3, 2), f(1), outputs=2)],
    "XavierFill": [ex(shape=[3, 4]), ex(f(5, 2, dtype=torch.float64), dtype="float64"),
                   ex(ints(2, 3), input_as_shape=1, unknown=(0,))],
}

from tests.ops.sparse_examples import SPARSE_EXAMPLES  # noqa: E402 - it builds on the helpers above

EXAMPLES.update(SPARSE_EXAMPLES)
