"""ResNet-18 and ResNet-50 (NCHW) with the layer names of Caffe2's model zoo (Detectron style).

Stem `conv1` (7x7/2) + `res_conv1_bn` + Relu + `pool1` (3x3/2 max); stages `res2`..`res5` of blocks
`res<s>_<i>` with convolutions `_branch2a`, `_branch2b` (and `_branch2c` for bottlenecks), each
followed by SpatialBN `<conv>_bn`; a projection shortcut `res<s>_0_branch1` (+ `_bn`) where the shape
changes; the block output `res<s>_<i>_sum` (+ Relu, in place); then `pool5` (global average) and
`pred`. Convolutions have no bias (the batch norm has one). The spatial size is free: global pooling.
"""

from __future__ import annotations

from graphpar import brew
from graphpar.core.ir import BlobReference
from graphpar.model_helper import ModelHelper
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
