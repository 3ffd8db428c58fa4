"""A multi-layer perceptron: FC + Relu layers `fc1`, `fc2`, ..., then `pred`."""

from __future__ import annotations

from collections.abc import Sequence

from graphpar.core.ir import BlobReference
from graphpar.model import brew
from graphpar.model.model_helper import ModelHelper
from graphpar.models.common import softmax_loss


def mlp(model: ModelHelper, loss_scale: float, dim_in: int = 16, hidden: Sequence[int] = (32,),
        num_classes: int = 10, data: str = "data", label: str = "label") -> list[BlobReference]:
    """`data` [N, dim_in] (or any shape flattening to it) -> hidden FC+Relu layers -> `pred` -> loss."""
    blob, width = data, dim_in
    for index, dim in enumerate(hidden, start=1):
        blob = brew.fc(model, blob, f"fc{index}", dim_in=width, dim_out=dim)
        blob = brew.relu(model, blob, blob)
        width = dim
    pred = brew.fc(model, blob, "pred", dim_in=width, dim_out=num_classes)
    return softmax_loss(model, pred, label, loss_scale)
