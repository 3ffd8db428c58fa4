"""LeNet as in Caffe2's MNIST tutorial: conv1, pool1, conv2, pool2, fc3 + Relu, pred."""

from __future__ import annotations

from collections.abc import Sequence

from graphpar.core.ir import BlobReference
from graphpar.model import brew
from graphpar.model.model_helper import ModelHelper
from graphpar.models.common import softmax_loss


def lenet(model: ModelHelper, loss_scale: float, in_channels: int = 1, image_size: int = 28,
          channels: Sequence[int] = (20, 50), hidden: int = 500, num_classes: int = 10,
          data: str = "data", label: str = "label") -> list[BlobReference]:
    """`data` [N, in_channels, image_size, image_size] -> two 5x5 conv + 2x2 max-pool stages -> FC -> loss.

    Raises:
        ValueError: an image too small for two conv+pool stages (it needs at least 16 pixels).
    """
    side = ((image_size - 4) // 2 - 4) // 2
    if side < 1:
        raise ValueError(f"lenet: image_size={image_size} is too small (at least 16)")
    conv1 = brew.conv(model, data, "conv1", dim_in=in_channels, dim_out=channels[0], kernel=5)
    pool1 = brew.max_pool(model, conv1, "pool1", kernel=2, stride=2)
    conv2 = brew.conv(model, pool1, "conv2", dim_in=channels[0], dim_out=channels[1], kernel=5)
    pool2 = brew.max_pool(model, conv2, "pool2", kernel=2, stride=2)
    fc3 = brew.fc(model, pool2, "fc3", dim_in=channels[1] * side * side, dim_out=hidden)
    fc3 = brew.relu(model, fc3, fc3)
    pred = brew.fc(model, fc3, "pred", dim_in=hidden, dim_out=num_classes)
    return softmax_loss(model, pred, label, loss_scale)
