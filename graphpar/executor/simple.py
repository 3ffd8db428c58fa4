"""Run a compiled Plan: the hot path of every RunNet.

The loop does per op only what cannot be done at CreateNet: look the input tensors up, call the
kernel, bind the output names. Steps are specialised by call kind (see `plan.Step`) so the common
one- and two-input ops build no argument lists. One try/except around the whole loop costs nothing
while all goes well; when an op fails, its step is still bound and the error is rewritten to name
the op. Outputs are bound only after the kernel returns, so a failed op leaves none half-written.
"""

from __future__ import annotations

from typing import Any

import torch

from graphpar.errors import MissingBlobError, OperatorError
from graphpar.executor.plan import BINARY, NARY, UNARY, Plan, Step, op_location, recorded_at


def run(plan: Plan) -> None:
    """Execute every step of `plan` once, in program order ("simple" and "dag" nets: see `Plan`).

    Raises:
        MissingBlobError: an input blob was removed from the workspace after CreateNet.
        OperatorError: a kernel raised; the message names the net, op, inputs and recording site.
    """
    blobs = plan.blobs
    index = -1
    try:
        for fn, kind, ins, out, index in plan.program:  # noqa: B007 - the except clause reads index
            if kind == UNARY:
                blobs[out] = fn(blobs[ins])
            elif kind == BINARY:
                blobs[out] = fn(blobs[ins[0]], blobs[ins[1]])
            elif kind == NARY:
                blobs[out] = fn(*[blobs[name] for name in ins])
            else:
                _store_all(blobs, out, fn(*[blobs[name] for name in ins]))
    except Exception as exc:
        raise _op_failure(plan, plan.steps[index], exc) from exc


def run_step(blobs: dict[str, torch.Tensor], step: Step) -> None:
    """Run one step exactly as `run` does (`run` inlines this body: a call per op would cost time)."""
    fn, kind, ins, out, _ = step
    if kind == UNARY:
        blobs[out] = fn(blobs[ins])
    elif kind == BINARY:
        blobs[out] = fn(blobs[ins[0]], blobs[ins[1]])
    elif kind == NARY:
        blobs[out] = fn(*[blobs[name] for name in ins])
    else:
        _store_all(blobs, out, fn(*[blobs[name] for name in ins]))


def _store_all(blobs: dict[str, torch.Tensor], outs: tuple[str, ...], results: Any) -> None:
    if not outs:
        return
    if not isinstance(results, (tuple, list)) or len(results) != len(outs):
        got = f"{len(results)} outputs" if isinstance(results, (tuple, list)) else type(results).__name__
        raise ValueError(f"the kernel returned {got}, expected a tuple of {len(outs)} tensors")
    for name, value in zip(outs, results):
        blobs[name] = value


def _input_names(step: Step) -> tuple[str, ...]:
    return (step.ins,) if step.kind == UNARY else tuple(step.ins)


def _op_failure(plan: Plan, step: Step, exc: Exception) -> Exception:
    """The error to raise for `exc` raised while running `step`."""
    netdef = plan.netdef
    op = netdef.ops[step.index]
    names = _input_names(step)
    missing = [(k, name) for k, name in enumerate(names) if name not in plan.blobs]
    if isinstance(exc, KeyError) and missing:
        k, name = missing[0]
        return MissingBlobError(
            f"{op_location(netdef, step.index)}: input {k} {name!r} is no longer in workspace "
            f"{plan.workspace_name!r}: it existed at CreateNet and has since been removed. Feed it again "
            f"before RunNet{recorded_at(op)}.")
    inputs = "\n".join(f"    input {k} {name!r}: {_describe(plan.blobs.get(name))}"
                       for k, name in enumerate(names))
    source = op.source or "unknown (the op was not recorded through a Net)"
    return OperatorError(f"{op_location(netdef, step.index)} failed: {type(exc).__name__}: {exc}\n"
                         f"  recorded at: {source}\n  inputs:\n{inputs or '    (none)'}")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"shape {list(value.shape)}, {str(value.dtype).removeprefix('torch.')}, {value.device}"
    return f"not a tensor ({type(value).__name__})"
