"""Ops that declare `Effects.elementwise` give the same bits on parts of their tensors as on the whole.

Parallelize(shard_optimizer_state=True) runs such ops on each replica's flat part of a param, its
gradient and its optimizer state (`passes.shard_updates`), and promises the unsharded run's params
bit for bit. That holds only if every element of the outputs depends on the same element of the
tensor inputs alone, computed the same way wherever the part starts and however long it is (a
vectorised kernel's tail, a part of one element, an empty part). Each declared op runs here on
tensors of 37 x 29 elements, whole and cut into uneven flat parts, with every example's arguments
and scalar inputs (`tests/ops/examples.py`); its in-place kernel (`reuse`) too.
"""

from __future__ import annotations

import pytest
import torch

from graphpar.core.ir import OperatorDef
from graphpar.core.schema import effects_of, get_schema, registered_types
from tests.ops.examples import EXAMPLES
from tests.ops.helpers import make_op, run_op

SHAPE = (37, 29)
CUTS = ([0, 1073], [500, 573], [1, 2, 3, 1067], [0, 8, 16, 1049], [358, 358, 357])


def _declared() -> list[str]:
    return [t for t in registered_types() if effects_of(OperatorDef(t)).elementwise is not None]


def test_the_update_ops_sharding_needs_are_declared() -> None:
    assert {"MomentumSGDUpdate", "Adam", "Adagrad", "WeightedSum", "Scale"} <= set(_declared())
    assert not {"Lars", "Ftrl", "Wngrad", "SumSqrElements", "MultiTensorAdam"} & set(_declared())


def _inputs(example_inputs: tuple[torch.Tensor, ...], tensors: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    """The example's inputs, its tensor inputs replaced by seeded positive values of SHAPE."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.rand(SHAPE, generator=gen, dtype=torch.float64).add(0.1).to(x.dtype) if i in tensors else x
            for i, x in enumerate(example_inputs)]


def _run(op: OperatorDef, inputs: list[torch.Tensor], reuse: bool) -> tuple[torch.Tensor, ...]:
    return run_op(op, [x.clone() for x in inputs], reuse=reuse)


@pytest.mark.parametrize("op_type", _declared())
def test_parts_give_the_bits_of_the_whole(op_type: str) -> None:
    schema = get_schema(op_type)
    for k, example in enumerate(EXAMPLES[op_type]):
        op = make_op(op_type, len(example.inputs), example.outputs, **example.args)
        tensors = schema.effects.elementwise.of(len(example.inputs))
        inputs = _inputs(example.inputs, tensors, seed=k)
        for reuse in (False, True) if schema.reuse is not None else (False,):
            whole = _run(op, inputs, reuse)
            assert all(out.shape == SHAPE for out in whole), (op_type, [out.shape for out in whole])
            for cut in CUTS:
                parts = [_run(op, [torch.split(x.reshape(-1), cut)[p] if i in tensors else x
                                   for i, x in enumerate(inputs)], reuse) for p in range(len(cut))]
                for o, out in enumerate(whole):
                    joined = torch.cat([part[o].reshape(-1) for part in parts])
                    assert torch.equal(joined, out.reshape(-1)), (op_type, example.args, reuse, cut, o)
