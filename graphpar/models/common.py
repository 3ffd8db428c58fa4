"""The loss head every model of the zoo ends with."""

from __future__ import annotations

from graphpar.core.ir import BlobReference
from graphpar.model.model_helper import ModelHelper


def softmax_loss(model: ModelHelper, pred: str, label: str, loss_scale: float) -> list[BlobReference]:
    """`SoftmaxWithLoss([pred, label]) -> softmax, loss`, then `scaled_loss = loss * loss_scale`."""
    _, loss = model.net.SoftmaxWithLoss([pred, label], ["softmax", "loss"])
    return [model.net.Scale(loss, "scaled_loss", scale=loss_scale)]
