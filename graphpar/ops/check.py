"""Ops that stop a run when a value is wrong, before it reaches the params.

`CheckFinite` reads its inputs on the host (one device sync per op), so Parallelize adds it only when
asked (`check_finite_loss=True`): one op per replica over that replica's losses, placed before every
gradient and update op. Executors start no in-place update before every op that precedes the first
update has finished, and a failed run writes nothing back, so a NaN or infinite loss stops the step
with the params and optimizer state as they were.

Over several shards the decision must be every shard's: a step that stopped on one shard only would
let the others run their collectives, which would then meet the stopped shard's next step's.
`CheckFiniteAcrossShards` checks this shard's losses, sums one flag per shard over the shards (one
small all-reduce) and raises on every shard when any shard has a non-finite loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from types import SimpleNamespace

import torch

from graphpar.core.ir import CPU, DeviceOption, OperatorDef
from graphpar.core.schema import NO_GRADIENT, Arg, KernelContext, TensorSpec, Trait, register_op
from graphpar.platform import distributed

_ADVICE = ("Lower the learning rate, check the batch for NaN or inf, or clip gradients (optimizer.build_sgd("
           "max_gradient_norm=...))")


def _first_not_finite(names: Sequence[str], xs: Sequence[torch.Tensor]) -> str | None:
    """'<name> is <value>' for the first input holding a NaN or an infinity, else None (one host read
    when all are finite)."""
    if len(xs) == 1 and xs[0].numel() == 1:
        if math.isfinite(xs[0].item()):
            return None
    elif bool(torch.stack([torch.isfinite(x).all().to(xs[0].device) for x in xs]).all()):
        return None
    for name, x in zip(names, xs):
        if not bool(torch.isfinite(x).all()):
            return f"{name!r} is {x[~torch.isfinite(x)].reshape(-1)[0].item()}"
    return None


def _check_finite(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., tuple]:
    names = ctx.op.inputs

    def run(*xs: torch.Tensor) -> tuple:
        bad = _first_not_finite(names, xs)
        if bad is not None:
            raise FloatingPointError(
                f"{bad} (not finite): the step stopped before any parameter update, so the params and "
                f"optimizer state are those of the previous step. {a.why or _ADVICE}")
        return ()

    return run


def _no_outputs(_a: SimpleNamespace, _ctx: KernelContext, _inputs: list[TensorSpec]) -> list[TensorSpec | None]:
    return []


register_op(
    "CheckFinite", inputs=(1, None), outputs=0, args={"why": ""}, kernel=_check_finite, gradient=NO_GRADIENT,
    traits=(Trait.HOST_SYNC,), infer=_no_outputs,
    doc="[X_1, ...] -> nothing: raises FloatingPointError naming the first input holding a NaN or an "
        "infinity (read on the host, once when all are finite), ending with `why` (default: advice for a "
        "diverging loss). Parallelize(check_finite_loss=True) puts one per replica on its losses, and a "
        "float16 all-reduce without a loss scale one on the gradient sums.")


def _check_finite_across_shards(_a: SimpleNamespace, ctx: KernelContext) -> Callable[..., torch.Tensor]:
    names = ctx.op.inputs[1:]

    def run(world: torch.Tensor, *xs: torch.Tensor) -> torch.Tensor:
        comm = distributed.get_world(int(world))
        bad = _first_not_finite(names, xs)
        flags = torch.zeros(comm.size, dtype=torch.int32, device=xs[0].device)
        flags[comm.rank] = bad is not None
        comm.allreduce(flags)  # every shard learns which shards stop
        stopped = [shard for shard, flag in enumerate(flags.tolist()) if flag]
        if not stopped:
            return flags
        where = (f"{bad} (not finite) on shard {comm.rank}" if bad is not None else
                 f"shard(s) {stopped} of {comm.size} had a loss that is not finite")
        raise FloatingPointError(
            f"{where}: the step stopped on every shard before any parameter update, so the params and "
            f"optimizer state are those of the previous step on every shard, and their collectives stay "
            f"matched (feed every shard its next batch and go on). {_ADVICE}")

    return run


def _check_devices(op: OperatorDef, device: DeviceOption) -> tuple[list, list]:
    """The communicator on the host; input i + 1 on device `input_device_ids[i]` of the op's type."""
    ids = op.args.get("input_device_ids") or ()
    losses = [DeviceOption(device.device_type, ids[i]) if i < len(ids) else device for i in range(len(op.inputs) - 1)]
    return [DeviceOption(CPU, 0), *losses], [device]


def _flags_rule(_a: SimpleNamespace, _ctx: KernelContext, _inputs: list[TensorSpec]) -> list[TensorSpec | None]:
    return [None]  # one flag per shard: the length is the communicator's


register_op(
    "CheckFiniteAcrossShards", inputs=(2, None), outputs=1, args={"input_device_ids": Arg("ints", ())},
    kernel=_check_finite_across_shards, gradient=NO_GRADIENT, infer=_flags_rule, device_inference=_check_devices,
    traits=(Trait.COLLECTIVE, Trait.CROSS_DEVICE, Trait.DISTRIBUTED, Trait.HOST_SYNC),
    doc="[communicator, X_1, ...] -> [flags]: reads this shard's X (each on device `input_device_ids[i]`) on "
        "the host, all-reduces one flag per shard (int32 [shards], all zeros when it returns), and raises "
        "FloatingPointError on every shard if any shard's X holds a NaN or an infinity (naming it on that "
        "shard). Parallelize(check_finite_loss=True) over several shards puts one on every replica's "
        "losses, ahead of every later cross-shard collective.")
