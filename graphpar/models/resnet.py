"""ResNet-18 and ResNet-50 (NCHW) with the layer names of Caffe2's model zoo (Detectron style).

Stem `conv1` (7x7/2) + `res_conv1_bn` + Relu + `pool1` (3x3/2 max); stages `res2`..`res5` of blocks
`res<s>_<i>` with convolutions `_branch2a`, `_branch2b` (and `_branch2c` for bottlenecks), each
followed by SpatialBN `<conv>_bn`; a projection shortcut `res<s>_0_branch1` (+ `_bn`) where the shape
changes; the block output `res<s>_<i>_sum` (+ Relu, in place); then `pool5` (global average) and
`pred`. Convolutions have no bias (the batch norm has one). The spatial size is free: global pooling.
"""

from __future__ import annotations

from graphpar.core.ir import BlobReference
from graphpar.model import brew
from graphpar.model.model_helper import ModelHelper
from graphpar.models.common import softmax_loss

_BLOCKS = {18: (2, 2, 2, 2), 50: (3, 4, 6, 3)}


class _Builder:
    """Records conv + batch-norm layers into `model`, train or test mode."""

    def __init__(self, model: ModelHelper, is_test: bool) -> None:
        self.model = model
        self.is_test = is_test

    def conv_bn(self, blob: str, name: str, dim_in: int, dim_out: int, kernel: int, stride: int = 1,
                relu: bool = True) -> BlobReference:
        pad = (kernel - 1) // 2
        conv = brew.conv(self.model, blob, name, dim_in=dim_in, dim_out=dim_out, kernel=kernel,
                         stride=stride, pad=pad, no_bias=True, weight_init=("MSRAFill", {}))
        out = brew.spatial_bn(self.model, conv, f"{name}_bn", dim_in=dim_out, epsilon=1e-5, momentum=0.9,
                              is_test=self.is_test)
        return brew.relu(self.model, out, out) if relu else out

    def shortcut(self, blob: str, prefix: str, dim_in: int, dim_out: int, stride: int) -> str:
        if dim_in == dim_out and stride == 1:
            return blob
        return self.conv_bn(blob, f"{prefix}_branch1", dim_in, dim_out, 1, stride, relu=False)

    def block(self, blob: str, prefix: str, dim_in: int, dim_inner: int, dim_out: int, stride: int,
              bottleneck: bool) -> BlobReference:
        if bottleneck:
            h = self.conv_bn(blob, f"{prefix}_branch2a", dim_in, dim_inner, 1, stride)
            h = self.conv_bn(h, f"{prefix}_branch2b", dim_inner, dim_inner, 3)
            h = self.conv_bn(h, f"{prefix}_branch2c", dim_inner, dim_out, 1, relu=False)
        else:
            h = self.conv_bn(blob, f"{prefix}_branch2a", dim_in, dim_out, 3, stride)
            h = self.conv_bn(h, f"{prefix}_branch2b", dim_out, dim_out, 3, relu=False)
        out = brew.sum(self.model, [h, self.shortcut(blob, prefix, dim_in, dim_out, stride)], f"{prefix}_sum")
        return brew.relu(self.model, out, out)


def _resnet(model: ModelHelper, loss_scale: float, depth: int, num_classes: int, in_channels: int,
            width: int, is_test: bool, data: str, label: str) -> list[BlobReference]:
    bottleneck = depth >= 50
    build = _Builder(model, is_test)
    blob = build.conv_bn(data, "conv1", in_channels, width, 7, stride=2)
    blob = brew.max_pool(model, blob, "pool1", kernel=3, stride=2, pad=1)
    dim_in = width
    for stage, count in enumerate(_BLOCKS[depth]):
        dim_inner = width * 2 ** stage
        dim_out = dim_inner * 4 if bottleneck else dim_inner
        for index in range(count):
            stride = 2 if stage > 0 and index == 0 else 1
            blob = build.block(blob, f"res{stage + 2}_{index}", dim_in, dim_inner, dim_out, stride, bottleneck)
            dim_in = dim_out
    pool = brew.average_pool(model, blob, "pool5", global_pooling=True)
    pred = brew.fc(model, pool, "pred", dim_in=dim_in, dim_out=num_classes)
    return softmax_loss(model, pred, label, loss_scale)


def resnet18(model: ModelHelper, loss_scale: float, num_classes: int = 1000, in_channels: int = 3,
             width: int = 64, is_test: bool = False, data: str = "data",
             label: str = "label") -> list[BlobReference]:
    """ResNet-18 (basic blocks 2-2-2-2); `width` is the stem's channel count (64 in the paper)."""
    return _resnet(model, loss_scale, 18, num_classes, in_channels, width, is_test, data, label)


def resnet50(model: ModelHelper, loss_scale: float, num_classes: int = 1000, in_channels: int = 3,
             width: int = 64, is_test: bool = False, data: str = "data",
             label: str = "label") -> list[BlobReference]:
    """ResNet-50 (bottleneck blocks 3-4-6-3, 4x expansion); `width` is the stem's channel count."""
    return _resnet(model, loss_scale, 50, num_classes, in_channels, width, is_test, data, label)


# ---- Caffe2's model-zoo builders (caffe2/python/models/resnet.py): its signatures and blob names ------

RESNEXT_BLOCK_CONFIG = {18: (2, 2, 2, 2), 34: (3, 4, 6, 3), 50: (3, 4, 6, 3), 101: (3, 4, 23, 3),
                        152: (3, 8, 36, 3), 200: (3, 24, 36, 3)}
RESNEXT_STRIDES = (1, 2, 2, 2)


class _Caffe2Blocks:
    """Caffe2's ResNetBuilder naming: component k's convolutions `comp_<k>_conv_<i>`, their batch norms
    `comp_<k>_spatbn_<i>`, its sum `comp_<k>_sum_<i>`, and `shortcut_projection_<k>` (+ `_spatbn`)."""

    def __init__(self, model: ModelHelper, blob: str, no_bias: bool, is_test: bool, bn_epsilon: float,
                 bn_momentum: float) -> None:
        self.model, self.blob, self.no_bias, self.is_test = model, blob, int(bool(no_bias)), is_test
        self.bn = {"epsilon": bn_epsilon, "momentum": bn_momentum, "is_test": is_test}
        self.comp = 0

    def _conv_bn(self, index: int, dim_in: int, dim_out: int, kernel: int, stride: int = 1, group: int = 1,
                 pad: int = 0) -> BlobReference:
        conv = brew.conv(self.model, self.blob, f"comp_{self.comp}_conv_{index}", dim_in, dim_out,
                         weight_init=("MSRAFill", {}), kernel=kernel, stride=stride, group=group, pad=pad,
                         no_bias=self.no_bias)
        return brew.spatial_bn(self.model, conv, f"comp_{self.comp}_spatbn_{index}", dim_out, **self.bn)

    def bottleneck(self, dim_in: int, dim_inner: int, dim_out: int, stride: int, group: int) -> None:
        shortcut = self.blob
        for index, (d_in, d_out, kernel, s, g, pad) in enumerate(
                ((dim_in, dim_inner, 1, 1, 1, 0), (dim_inner, dim_inner, 3, stride, group, 1)), start=1):
            bn = self._conv_bn(index, d_in, d_out, kernel, s, g, pad)
            self.blob = brew.relu(self.model, bn, bn)
        last = self._conv_bn(3, dim_inner, dim_out, 1)
        if dim_out != dim_in:
            shortcut = brew.conv(self.model, shortcut, f"shortcut_projection_{self.comp}", dim_in, dim_out,
                                 weight_init=("MSRAFill", {}), kernel=1, stride=stride, no_bias=self.no_bias)
            shortcut = brew.spatial_bn(self.model, shortcut, f"shortcut_projection_{self.comp}_spatbn", dim_out,
                                       **self.bn)
        out = brew.sum(self.model, [shortcut, last], f"comp_{self.comp}_sum_3")
        self.blob = brew.relu(self.model, out, out)
        self.comp += 1


def create_resnext(model: ModelHelper, data: str, num_input_channels: int, num_labels: int, num_layers: int,
                   num_groups: int, num_width_per_group: int, label: str | None = None, is_test: bool = False,
                   no_loss: bool = False, no_bias: bool = True, conv1_kernel: int = 7, conv1_stride: int = 2,
                   final_avg_kernel: int = 7, log: object = None, bn_epsilon: float = 1e-5,
                   bn_momentum: float = 0.9) -> BlobReference | tuple[BlobReference, BlobReference]:
    """Caffe2's ResNe(X)t builder (Xie et al. 2016): `conv1` + `conv1_spatbn_relu` + `pool1`, four stages
    of bottlenecks (`num_groups` groups of `num_width_per_group` channels in the 3x3 convolution, doubled
    per stage; the stride on the 3x3, as torchvision's ResNeXt), global average pooling `final_avg` and
    the classifier `last_out_L<num_labels>`.

    Returns the logits with `no_loss`; else (softmax, loss) of a SoftmaxWithLoss when `label` is given,
    or the softmax. `final_avg_kernel` and `log` are accepted for Caffe2's signature (the pooling is
    global).

    Raises:
        ValueError: a depth not in RESNEXT_BLOCK_CONFIG.
    """
    if num_layers not in RESNEXT_BLOCK_CONFIG:
        raise ValueError(f"create_resnext: {num_layers} layers is not a ResNe(X)t depth; use one of "
                         f"{sorted(RESNEXT_BLOCK_CONFIG)}")
    filters = (64, 64, 128, 256, 512) if num_layers in (18, 34) else (64, 256, 512, 1024, 2048)
    conv = brew.conv(model, data, "conv1", num_input_channels, filters[0], weight_init=("MSRAFill", {}),
                     kernel=conv1_kernel, stride=conv1_stride, pad=3, no_bias=int(bool(no_bias)))
    bn = brew.spatial_bn(model, conv, "conv1_spatbn_relu", filters[0], epsilon=bn_epsilon, momentum=bn_momentum,
                         is_test=is_test)
    pool = brew.max_pool(model, brew.relu(model, bn, bn), "pool1", kernel=3, stride=2, pad=1)
    blocks = _Caffe2Blocks(model, pool, no_bias, is_test, 1e-5, 0.9)  # Caffe2's stages use these, as here
    inner = num_groups * num_width_per_group
    for stage, (count, stride) in enumerate(zip(RESNEXT_BLOCK_CONFIG[num_layers], RESNEXT_STRIDES)):
        dim_in = filters[stage]
        for index in range(count):
            blocks.bottleneck(dim_in, inner, filters[stage + 1], stride if index == 0 else 1, num_groups)
            dim_in = filters[stage + 1]
        inner *= 2
    final_avg = brew.average_pool(model, blocks.blob, "final_avg", kernel=final_avg_kernel, stride=1,
                                  global_pooling=True)
    last_out = brew.fc(model, final_avg, f"last_out_L{num_labels}", filters[-1], num_labels)
    if no_loss:
        return last_out
    if label is not None:
        return tuple(model.net.SoftmaxWithLoss([last_out, label], ["softmax", "loss"]))
    return brew.softmax(model, last_out, "softmax")


def create_resnet50(model: ModelHelper, data: str, num_input_channels: int, num_labels: int,
                    label: str | None = None, is_test: bool = False, no_loss: bool = False, no_bias: bool = False,
                    conv1_kernel: int = 7, conv1_stride: int = 2,
                    final_avg_kernel: int = 7) -> BlobReference | tuple[BlobReference, BlobReference]:
    """Caffe2's ResNet-50: `create_resnext` with 1 group of 64 channels (convolutions with biases unless
    `no_bias`, as Caffe2's default)."""
    return create_resnext(model, data, num_input_channels, num_labels, 50, 1, 64, label=label, is_test=is_test,
                          no_loss=no_loss, no_bias=no_bias, conv1_kernel=conv1_kernel, conv1_stride=conv1_stride,
                          final_avg_kernel=final_avg_kernel)
