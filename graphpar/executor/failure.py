"""Errors of a run, in one place for every executor: what failed, where it was recorded, on what inputs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from graphpar.core.ir import NetDef, OperatorDef
from graphpar.core.shapes import float64_hint
from graphpar.errors import MissingBlobError, OperatorError

if TYPE_CHECKING:
    from graphpar.executor.plan import CompiledNet


def op_location(netdef: NetDef, index: int) -> str:
    """`net 'name' op #index (Type)`, the prefix of every executor message about an op."""
    return f"net {netdef.name!r} op #{index} ({netdef.ops[index].type})"


def recorded_at(op: OperatorDef) -> str:
    """A message suffix saying where the op was recorded (empty if unknown)."""
    return f" (recorded at {op.source})" if op.source else ""


def missing_at_run(plan: CompiledNet, name: str) -> MissingBlobError:
    """The error for a blob the net reads that was removed from the workspace after CreateNet."""
    load = next(load for load in plan.frame.loads if load.name == name)
    op = plan.netdef.ops[load.reader]
    return MissingBlobError(
        f"{op_location(plan.netdef, load.reader)}: input {load.position} {name!r} is no longer in workspace "
        f"{plan.workspace_name!r}: it existed at CreateNet and has since been removed. Feed it again "
        f"before RunNet{recorded_at(op)}.")


def op_failure(plan: CompiledNet, frame: list, index: int, exc: BaseException) -> OperatorError:
    """The error to raise for `exc`, raised by step `index` of `plan` while running on `frame`."""
    netdef = plan.netdef
    op = netdef.ops[index]
    names = plan.frame.names
    inputs = "\n".join(f"    input {k} {names[slot]!r}: {_describe(frame[slot])}"
                       for k, slot in enumerate(plan.steps[index].inputs))
    source = op.source or "unknown (the op was not recorded through a Net)"
    values = [frame[slot] for slot in plan.steps[index].inputs]
    hint = float64_hint(op.inputs, [v.dtype for v in values]) if all(map(torch.is_tensor, values)) else ""
    return OperatorError(f"{op_location(netdef, index)} failed: {type(exc).__name__}: {exc}\n"
                         f"  recorded at: {source}\n  inputs:\n{inputs or '    (none)'}{hint}")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"shape {list(value.shape)}, {str(value.dtype).removeprefix('torch.')}, {value.device}"
    return f"not a tensor ({type(value).__name__})"
