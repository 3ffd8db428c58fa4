"""Example inputs of the sparse and sparse-update ops, merged into `tests.ops.examples.EXAMPLES`."""

from __future__ import annotations

import torch

from tests.ops.examples import Example, ex, f, ints, pos

_LENGTHS = ints(2, 0, 3)
_IDX = ints(4, 1, 4, 0, 2)


def _lr(value: float) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float32)


SPARSE_EXAMPLES: dict[str, list[Example]] = {
    "Gather": [ex(f(5, 3), _IDX), ex(f(5, 2, 3, dtype=torch.float64), ints(1, 0, 4, 4, dtype=torch.int64).reshape(2, 2))],
    "SparseLengthsSum": [ex(f(5, 3), _IDX, _LENGTHS)],
    "SparseLengthsMean": [ex(f(5, 3), _IDX, _LENGTHS)],
    "SparseLengthsWeightedSum": [ex(f(5, 3), f(5), _IDX, _LENGTHS)],
    "SparseLengthsSumGradient": [ex(f(3, 3), _LENGTHS, _IDX)],
    "SparseLengthsMeanGradient": [ex(f(3, 3), _LENGTHS, _IDX)],
    "SparseLengthsWeightedSumGradient": [ex(f(5), f(3, 3), f(5, 3), _IDX, _LENGTHS),
                                         ex(f(5), f(3, 3), f(5, 3), _IDX, _LENGTHS, outputs=2, grad_on_weights=1)],
    "LengthsToSegmentIds": [ex(_LENGTHS, unknown=(0,))],
    "SparseToDense": [ex(_IDX, f(5, 3), f(6, 2)), ex(_IDX, f(5, 3), unknown=(0,))],
    "ScatterWeightedSum": [ex(f(5, 3), _lr(1.0), _IDX, f(5, 3), _lr(-0.1)),
                           ex(f(5, 3), _lr(0.5), _IDX, f(5, 3), _lr(-0.1), f(5, 3), _lr(2.0))],
    "ScatterAssign": [ex(f(5, 3), _IDX, f(5, 3))],
    "SparseMomentumSGDUpdate": [ex(f(5, 3), f(6, 3), _lr(0.1), f(6, 3), _IDX, outputs=3, momentum=0.9),
                                ex(f(5, 3), f(6, 3), _lr(0.1), f(6, 3), _IDX, outputs=3, momentum=0.9, nesterov=1)],
    "Adagrad": [ex(f(4, 3), pos(4, 3), f(4, 3), _lr(-0.1), outputs=2)],
    "SparseAdagrad": [ex(f(6, 3), pos(6, 3), _IDX, f(5, 3), _lr(-0.1), outputs=2)],
    "RowWiseSparseAdagrad": [ex(f(6, 3), pos(6), _IDX, f(5, 3), _lr(-0.1), outputs=2)],
    "SparseAdam": [ex(f(6, 3), f(6, 3), pos(6, 3), _IDX, f(5, 3), _lr(-0.1), ints(2, dtype=torch.int64),
                      outputs=3)],
}
