"""Training with graphpar (brew + optimizer builders, run through the workspace) equals eager PyTorch.

An MLP and a conv + batch-norm + max-pool CNN are trained for several steps by graphpar and by
`torch.nn` + `torch.optim` from the same initial weights (graphpar's, copied into the torch model) on
the same batches; every param (and the batch-norm running statistics) is compared after every step.
Both run in float64, so the bounds are tight: any difference in the update rule shows up at once.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from graphpar import brew, optimizer, workspace
from graphpar.model_helper import ModelHelper

STEPS = 4
BATCH = 6
LR = 0.125  # exactly representable in float32, so the LearningRate blob's dtype does not matter
WD = 2.0**-7  # likewise for the weight-decay constant


def _mlp(model: ModelHelper) -> str:
    h = brew.fc(model, "data", "fc1", dim_in=8, dim_out=16)
    h = brew.relu(model, h, h)
    return brew.fc(model, h, "pred", dim_in=16, dim_out=4)


class TorchMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.pred = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pred(F.relu(self.fc1(x)))


def _cnn(model: ModelHelper) -> str:
    h = brew.conv(model, "data", "conv1", dim_in=3, dim_out=4, kernel=3, pad=1, no_bias=True)
    h = brew.spatial_bn(model, h, "bn1", dim_in=4, epsilon=1e-5, momentum=0.9)
    h = brew.relu(model, h, h)
    h = brew.max_pool(model, h, "pool1", kernel=2, stride=2)
    return brew.fc(model, h, "pred", dim_in=4 * 4 * 4, dim_out=5)


class TorchCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1, bias=False)  # batch norm cancels a bias
        self.bn1 = nn.BatchNorm2d(4, eps=1e-5, momentum=0.1)  # torch's momentum = 1 - Caffe2's
        self.pred = nn.Linear(64, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2, 2)
        return self.pred(h.flatten(1))


# graphpar blob -> torch state_dict key
MLP_BLOBS = {"fc1_w": "fc1.weight", "fc1_b": "fc1.bias", "pred_w": "pred.weight", "pred_b": "pred.bias"}
CNN_BLOBS = {"conv1_w": "conv1.weight", "bn1_s": "bn1.weight", "bn1_b": "bn1.bias",
             "bn1_rm": "bn1.running_mean", "bn1_riv": "bn1.running_var", "pred_w": "pred.weight",
             "pred_b": "pred.bias"}
MODELS = {"mlp": (_mlp, TorchMLP, MLP_BLOBS, (8,), 4), "cnn": (_cnn, TorchCNN, CNN_BLOBS, (3, 8, 8), 5)}

# name -> (graphpar builder, torch optimizer factory, clip norm)
OPTIMIZERS: dict[str, tuple[Callable, Callable, float | None]] = {
    "sgd": (lambda m: optimizer.build_sgd(m, LR), lambda p: torch.optim.SGD(p, LR), None),
    "momentum": (lambda m: optimizer.build_sgd(m, LR, momentum=0.9),
                 lambda p: torch.optim.SGD(p, LR, momentum=0.9), None),
    "nesterov": (lambda m: optimizer.build_sgd(m, LR, momentum=0.9, nesterov=True),
                 lambda p: torch.optim.SGD(p, LR, momentum=0.9, nesterov=True), None),
    "weight_decay": (lambda m: optimizer.build_sgd(m, LR, momentum=0.5, weight_decay=WD),
                     lambda p: torch.optim.SGD(p, LR, momentum=0.5, weight_decay=WD), None),
    "clipped": (lambda m: optimizer.build_sgd(m, LR, momentum=0.9, max_gradient_norm=0.5),
                lambda p: torch.optim.SGD(p, LR, momentum=0.9), 0.5),
    "adam": (lambda m: optimizer.build_adam(m, 0.0625, beta1=0.8, beta2=0.95, epsilon=1e-6),
             lambda p: torch.optim.Adam(p, 0.0625, betas=(0.8, 0.95), eps=1e-6), None),
    "adagrad": (lambda m: optimizer.build_adagrad(m, 0.0625, epsilon=1e-6),
                lambda p: torch.optim.Adagrad(p, 0.0625, eps=1e-6), None),
}


# torch.nn.utils.clip_grad_norm_ scales by max_norm / (norm + 1e-6), graphpar by max_norm / norm
TOLERANCE = {"clipped": (1e-5, 1e-7)}  # (rtol, atol); float64 round-off otherwise


def _build_graphpar(forward: Callable, build_optimizer: Callable) -> ModelHelper:
    model = ModelHelper(name="equivalence")
    pred = forward(model)
    _, loss = model.net.SoftmaxWithLoss([pred, "label"], ["softmax", "loss"])
    model.AddGradientOperators([loss])
    build_optimizer(model)
    workspace.RunNetOnce(model.param_init_net)
    for name in workspace.Blobs():  # every float blob (params, optimizer state, constants) to float64
        tensor = workspace.FetchTensor(name)
        if tensor.is_floating_point():
            workspace.FeedBlob(name, tensor.double())
    return model


def _batches(shape: tuple[int, ...], classes: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(42)
    return [(rng.standard_normal((BATCH, *shape)), rng.integers(0, classes, BATCH).astype(np.int32))
            for _ in range(STEPS)]


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_training_matches_torch_step_by_step(model_name, opt_name):
    forward, torch_cls, blobs, shape, classes = MODELS[model_name]
    build_optimizer, torch_optimizer, clip = OPTIMIZERS[opt_name]
    model = _build_graphpar(forward, build_optimizer)
    reference = torch_cls().double()
    reference.load_state_dict({key: workspace.FetchTensor(blob) for blob, key in blobs.items()}, strict=False)
    opt = torch_optimizer(reference.parameters())
    batches, (rtol, atol) = _batches(shape, classes), TOLERANCE.get(opt_name, (1e-9, 1e-12))
    for step, (x, y) in enumerate(batches, start=1):
        workspace.FeedBlob("data", x)
        workspace.FeedBlob("label", y)
        if step == 1:
            workspace.CreateNet(model.net)
        workspace.RunNet(model.net)

        opt.zero_grad()
        loss = F.cross_entropy(reference(torch.from_numpy(x)), torch.from_numpy(y).long())
        loss.backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(reference.parameters(), clip)
        opt.step()

        np.testing.assert_allclose(workspace.FetchBlob("loss"), loss.item(), rtol=rtol)
        state = reference.state_dict()
        for blob, key in blobs.items():
            np.testing.assert_allclose(workspace.FetchBlob(blob), state[key].numpy(), rtol=rtol, atol=atol,
                                       err_msg=f"{blob} after step {step}")
    assert workspace.FetchBlob("optimizer_iteration").tolist() == [STEPS]
