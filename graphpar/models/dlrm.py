"""A small DLRM-style click model: embedding bags, a bottom and a top MLP, and feature interactions.

Inputs, in the current name scope: `dense` [N, num_dense] float32; per table k, `indices_k` (int32 or
int64, 1-D) and `lengths_k` [N] int32 (example i looks up the next lengths_k[i] rows of table k);
`label` [N, 1] float32 clicks (0 or 1). The embedding tables `emb_k` [rows, dim] get sparse
(GradientSlice) gradients, so every optimizer updates only the rows a batch looked up.

    bottom = MLP(dense) -> [N, dim];  e_k = SparseLengthsSum(emb_k, indices_k, lengths_k) -> [N, dim]
    z = concat(bottom, e_1..e_K, x_i * x_j for every pair i < j of {bottom, e_1..e_K})
    loss = mean(SigmoidCrossEntropyWithLogits(top MLP(z), label)) * loss_scale

The pairwise products are DLRM's dot interaction before its sum over the feature axis (the top MLP
learns that sum), which keeps the model to ops graphpar has.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from graphpar.core.ir import BlobReference
from graphpar.model import brew
from graphpar.model.model_helper import Initializer, ModelHelper


def _mlp(model: ModelHelper, blob: str, width: int, dims: Sequence[int], name: str, relu_last: bool) -> str:
    for index, dim in enumerate(dims):
        blob = brew.fc(model, blob, f"{name}{index}", dim_in=width, dim_out=dim)
        if relu_last or index < len(dims) - 1:
            blob = brew.relu(model, blob, blob)
        width = dim
    return blob


def dlrm(model: ModelHelper, loss_scale: float, num_dense: int = 4, table_rows: Sequence[int] = (100, 100),
         dim: int = 8, bottom: Sequence[int] = (16,), top: Sequence[int] = (16,)) -> list[BlobReference]:
    """Record the DLRM forward pass and its scaled loss (`scaled_loss`) in the current scopes."""
    features = [_mlp(model, "dense", num_dense, [*bottom, dim], "bot", relu_last=True)]
    for k, rows in enumerate(table_rows):
        scale = rows ** -0.5
        table = model.create_param(f"emb_{k}", [rows, dim], Initializer("UniformFill", min=-scale, max=scale))
        features.append(model.net.SparseLengthsSum([table, f"indices_{k}", f"lengths_{k}"], f"pooled_{k}"))
    products = [model.net.Mul([a, b], f"inter_{i}_{j}")
                for i, a in enumerate(features) for j, b in enumerate(features) if i < j]
    z, _ = model.net.Concat([*features, *products], ["interaction", "interaction_split"], axis=1)
    width = dim * (len(features) + len(products))
    logit = _mlp(model, z, width, [*top, 1], "top", relu_last=False)
    xent = model.net.SigmoidCrossEntropyWithLogits([logit, "label"], "xent")
    loss = model.net.AveragedLoss(xent, "loss")
    return [model.net.Scale(loss, "scaled_loss", scale=loss_scale)]


def synthetic_clicks(batch: int, num_dense: int = 4, table_rows: Sequence[int] = (100, 100),
                     max_lookups: int = 3, seed: int = 0) -> dict[str, np.ndarray]:
    """A batch of `dlrm`'s inputs: normal dense features, 0..max_lookups Zipf-skewed lookups per
    example and table (popular rows repeat, as in click logs), and clicks from a hidden linear rule."""
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {"dense": rng.standard_normal((batch, num_dense)).astype(np.float32)}
    score = feeds["dense"][:, 0].copy()
    for k, rows in enumerate(table_rows):
        lengths = rng.integers(0, max_lookups + 1, batch).astype(np.int32)
        indices = (rng.zipf(1.3, int(lengths.sum())) - 1) % rows
        feeds[f"lengths_{k}"], feeds[f"indices_{k}"] = lengths, indices.astype(np.int64)
        score += np.bincount(np.repeat(np.arange(batch), lengths), weights=(indices % 2) - 0.5, minlength=batch)
    feeds["label"] = (score > 0).astype(np.float32).reshape(batch, 1)
    return feeds


def split_clicks(feeds: dict[str, np.ndarray], parts: int) -> list[dict[str, np.ndarray]]:
    """Split a batch into `parts` equal consecutive chunks of examples (each with its own lookups)."""
    batch = len(feeds["label"])
    if batch % parts:
        raise ValueError(f"split_clicks: a batch of {batch} does not split into {parts} equal parts")
    size = batch // parts
    chunks: list[dict[str, np.ndarray]] = [{} for _ in range(parts)]
    for name, value in feeds.items():
        if name.startswith("indices_"):
            continue
        for p in range(parts):
            chunks[p][name] = value[p * size:(p + 1) * size]
    for name in (n for n in feeds if n.startswith("lengths_")):
        k = name[len("lengths_"):]
        ends = np.cumsum(feeds[name])
        for p in range(parts):
            start = ends[p * size - 1] if p else 0
            chunks[p][f"indices_{k}"] = feeds[f"indices_{k}"][start:ends[(p + 1) * size - 1]]
    return chunks
