"""The model zoo's architectures as eager `nn.Module`s, for side-by-side benchmarks against graphpar.

Each mirrors a `graphpar.models` builder layer for layer (same shapes, no weight sharing between
the two: benchmarks compare time and memory, not numbers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn


def mlp(dim_in: int, hidden: Sequence[int], num_classes: int) -> nn.Module:
    """`graphpar.models.mlp`: FC + ReLU per hidden layer, then `pred`."""
    layers: list[nn.Module] = []
    width = dim_in
    for dim in hidden:
        layers += [nn.Linear(width, dim), nn.ReLU()]
        width = dim
    return nn.Sequential(nn.Flatten(), *layers, nn.Linear(width, num_classes))


def lenet(in_channels: int, image_size: int, channels: Sequence[int], hidden: int, num_classes: int) -> nn.Module:
    """`graphpar.models.lenet`: two 5x5 conv + 2x2 max-pool stages, FC + ReLU, `pred`."""
    side = ((image_size - 4) // 2 - 4) // 2
    return nn.Sequential(nn.Conv2d(in_channels, channels[0], 5), nn.MaxPool2d(2, 2),
                         nn.Conv2d(channels[0], channels[1], 5), nn.MaxPool2d(2, 2), nn.Flatten(),
                         nn.Linear(channels[1] * side * side, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))


def _conv_bn(dim_in: int, dim_out: int, kernel: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(dim_in, dim_out, kernel, stride, (kernel - 1) // 2, bias=False),
                         nn.BatchNorm2d(dim_out, eps=1e-5, momentum=0.1))


class _Basic(nn.Module):
    def __init__(self, dim_in: int, dim_out: int, stride: int) -> None:
        super().__init__()
        self.branch2a, self.branch2b = _conv_bn(dim_in, dim_out, 3, stride), _conv_bn(dim_out, dim_out, 3)
        self.branch1 = _conv_bn(dim_in, dim_out, 1, stride) if stride != 1 or dim_in != dim_out else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.branch2b(F.relu(self.branch2a(x))) + self.branch1(x))


def resnet18(in_channels: int, width: int, num_classes: int) -> nn.Module:
    """`graphpar.models.resnet18`: stem conv 7x7/2 + BN + ReLU + max pool, basic blocks 2-2-2-2, pool, `pred`."""
    blocks: list[nn.Module] = []
    dim_in = width
    for stage in range(4):
        dim_out = width * 2 ** stage
        for index in range(2):
            blocks.append(_Basic(dim_in, dim_out, 2 if stage > 0 and index == 0 else 1))
            dim_in = dim_out
    return nn.Sequential(_conv_bn(in_channels, width, 7, 2), nn.ReLU(), nn.MaxPool2d(3, 2, 1), *blocks,
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(dim_in, num_classes))


class _Bottleneck(nn.Module):
    def __init__(self, dim_in: int, dim_inner: int, dim_out: int, stride: int) -> None:
        super().__init__()
        self.branch2a, self.branch2b = _conv_bn(dim_in, dim_inner, 1, stride), _conv_bn(dim_inner, dim_inner, 3)
        self.branch2c = _conv_bn(dim_inner, dim_out, 1)
        self.branch1 = _conv_bn(dim_in, dim_out, 1, stride) if stride != 1 or dim_in != dim_out else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        h = F.relu(self.branch2b(F.relu(self.branch2a(x))))
        return F.relu(self.branch2c(h) + self.branch1(x))


def resnet50(in_channels: int, width: int, num_classes: int) -> nn.Module:
    """`graphpar.models.resnet50`: the stem, bottleneck blocks 3-4-6-3 (stride in the first 1x1, as
    Caffe2's), pool, `pred`."""
    blocks: list[nn.Module] = []
    dim_in = width
    for stage, count in enumerate((3, 4, 6, 3)):
        dim_inner = width * 2 ** stage
        for index in range(count):
            blocks.append(_Bottleneck(dim_in, dim_inner, dim_inner * 4, 2 if stage > 0 and index == 0 else 1))
            dim_in = dim_inner * 4
    return nn.Sequential(_conv_bn(in_channels, width, 7, 2), nn.ReLU(), nn.MaxPool2d(3, 2, 1), *blocks,
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(dim_in, num_classes))


def sgd_step(module: nn.Module, x: np.ndarray, y: np.ndarray, lr: float, momentum: float) -> Callable[[], None]:
    """One eager training step of `module` on the batch (x, y): zero_grad, cross-entropy, backward and
    `torch.optim.SGD(lr, momentum)`'s step, as the benchmarks' graphpar models train."""
    opt = torch.optim.SGD(module.parameters(), lr, momentum=momentum)
    data, label = torch.from_numpy(x), torch.from_numpy(y).long()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(module(data), label).backward()
        opt.step()

    return step
