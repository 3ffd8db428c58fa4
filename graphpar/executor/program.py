"""How steps call their kernels on a frame: one step at a time (`make_run`), or a whole plan as one
straight-line Python function (`straight_line`), the "simple" executor's loop unrolled.

`straight_line(plan, phase)` generates, compiles and returns `program(frame)`, which calls the kernel
of every step of one of the plan's phases (`executor.plan.CompiledNet`) in program order on frame slots
(`frame[3] = k2(frame[1], frame[0])`), frees what the plan frees after each step (`plan.frame.frees`,
in that order), and on an exception raises `StepFailed` carrying the failing step's index.
`executor.run.run_plan` runs the phases one after the other.
With no per-op loop, tuple unpacking or dispatch left, RunNet's per-op cost is that of the kernel
call itself (torch.fx generates Python code from its graphs the same way). Generating costs about
20 µs per op, once per plan, on its first run.

A step whose kernel overwrites inputs (Trait.OVERWRITES_INPUTS) gets each such input through
`claim(frame, slot, holders)`: the tensor itself when nothing but the frame (and `holders` known
others: the workspace, for a loaded blob) holds it and no other tensor shares its memory, else a copy.
A step with a reuse kernel (`core.schema.InputReuse`, `Step.reuse`) calls it when `owns(frame, slot)`
says the same of the input it may overwrite, and its ordinary kernel otherwise: the results are the
same bits, without allocating where the run owns the input (`x = relu(x)` as `relu_`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

if TYPE_CHECKING:
    from graphpar.executor.plan import CompiledNet, Phase


class StepFailed(Exception):
    """Raised by a straight-line program when step `index` failed; the kernel's error is the cause."""

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.index = index


def straight_line(plan: CompiledNet, phase: Phase, frees: bool) -> Callable[[list], None]:
    """`program(frame)` running the steps of `phase` in its order (freeing `plan.frame.frees` if `frees`)."""
    lines = []
    for j in phase.steps:
        step = plan.steps[j]
        claims = dict(step.claims)
        args = (f"claim(frame, {i}, {claims[p]})" if p in claims else f"frame[{i}]" for p, i in enumerate(step.inputs))
        reuse = step.reuse
        kernel = f"(r{j} if owns(frame, {step.inputs[reuse.input]}, {reuse.holders}) else k{j})" if reuse else f"k{j}"
        call = f"{kernel}({', '.join(args)})"
        if len(step.outputs) == 1:
            lines.append(f"i = {j}; frame[{step.outputs[0]}] = {call}")
        elif step.outputs:
            lines.append(f"i = {j}; store(frame, {step.outputs!r}, {call})")
        else:
            lines.append(f"i = {j}; {call}")
        if frees:
            lines.extend(f"frame[{slot}] = None" for slot in plan.frame.frees[j])
    body = "\n".join(f"            {line}" for line in lines) or "            pass"
    used = [plan.steps[j] for j in phase.steps]
    reusing = [step for step in used if step.reuse]
    params = ", ".join(["store", "claim", "owns", "StepFailed", *(f"k{step.index}" for step in used),
                        *(f"r{step.index}" for step in reusing)])
    source = (f"def make({params}):\n"
              f"    def program(frame):\n"
              f"        i = 0\n"
              f"        try:\n{body}\n"
              f"        except Exception as exc:\n"
              f"            raise StepFailed(i) from exc\n"
              f"    return program\n")
    namespace: dict = {}
    exec(compile(source, f"<plan {plan.name} phase {phase.index}>", "exec"), namespace)  # noqa: S102 - our own generated code
    return namespace["make"](store_all, claim, owns, StepFailed, *(step.kernel for step in used),
                             *(step.reuse.kernel for step in reusing))


class Reuse(NamedTuple):
    """A step's reuse kernel (`core.schema.InputReuse`), the position of the input it may overwrite,
    and that input's known holders besides the frame (1: the workspace, for a blob loaded from it)."""

    kernel: Callable[..., Any]
    input: int
    holders: int = 0


def make_run(fn: Callable[..., Any], ins: tuple[int, ...], outs: tuple[int, ...],
             claims: tuple[tuple[int, int], ...] = (), reuse: Reuse | None = None) -> Callable[[list], None]:
    """The step function: read `ins` from the frame, call `fn`, write its result(s) to `outs`.

    Specialised by arity so that the common one- and two-input ops build no argument lists. `claims`:
    (input position, known holders) of the inputs `fn` overwrites, passed through `claim`; `reuse`:
    the kernel to call instead when the run owns the input it may overwrite (`owns`).
    """
    if reuse is not None:
        reused, slot, holders = reuse.kernel, ins[reuse.input], reuse.holders

        def reusing(frame: list) -> None:
            kernel = reused if owns(frame, slot, holders) else fn
            result = kernel(*[frame[i] for i in ins])
            store_all(frame, outs, (result,) if len(outs) == 1 else result)

        return reusing
    if claims:
        holders = dict(claims)

        def claiming(frame: list) -> None:
            args = [claim(frame, i, holders[p]) if p in holders else frame[i] for p, i in enumerate(ins)]
            store_all(frame, outs, (fn(*args),) if len(outs) == 1 else fn(*args))

        return claiming
    if len(outs) == 1:
        (o,) = outs
        if len(ins) == 1:
            (i,) = ins

            def unary(frame: list) -> None:
                frame[o] = fn(frame[i])

            return unary
        if len(ins) == 2:
            i, j = ins

            def binary(frame: list) -> None:
                frame[o] = fn(frame[i], frame[j])

            return binary

        def nary(frame: list) -> None:
            frame[o] = fn(*[frame[i] for i in ins])

        return nary

    def multi(frame: list) -> None:
        store_all(frame, outs, fn(*[frame[i] for i in ins]))

    return multi


def store_all(frame: list, outs: tuple[int, ...], results: Any) -> None:
    """Write a multi-output kernel's results to their slots; ValueError unless it returned one per slot."""
    if not outs:
        return
    if not isinstance(results, (tuple, list)) or len(results) != len(outs):
        got = f"{len(results)} outputs" if isinstance(results, (tuple, list)) else type(results).__name__
        raise ValueError(f"the kernel returned {got}, expected a tuple of {len(outs)} tensors")
    for slot, value in zip(outs, results):
        frame[slot] = value


_getrefcount = sys.getrefcount
_storage_users = getattr(torch._C, "_storage_Use_Count", None)  # None: never claim or reuse: always copy


def _frame_references() -> int:
    """What `owns` counts for a value that only the frame (and `owns` itself) refers to."""
    frame = [object()]
    value = frame[0]
    return _getrefcount(value)


def _sole_storage_users() -> int:
    """What `owns` counts for the storage of a tensor that no other tensor shares it with."""
    tensor = torch.empty(1)
    return _storage_users(tensor.untyped_storage()._cdata) if _storage_users else -1


_OWNED = _frame_references()
_SOLE_STORAGE = _sole_storage_users()


def claim(frame: list, slot: int, holders: int) -> Any:
    """`frame[slot]` itself if only the frame and `holders` others reference it and no other tensor (a
    view, a base) shares its storage, so a kernel may overwrite it unseen; else a copy of it."""
    return frame[slot] if owns(frame, slot, holders) else frame[slot].clone()


def owns(frame: list, slot: int, holders: int = 0) -> bool:
    """Whether only the frame and `holders` others reference the tensor `frame[slot]`, no other tensor
    (a view, a base) shares its storage and no two of its elements share memory (it is contiguous;
    a kernel may return a stride-0 tensor of its own): a kernel may then overwrite it unseen. (On
    every reusing step of every run: the cheap tests come first.)"""
    value = frame[slot]
    return (_getrefcount(value) == _OWNED + holders and value.__class__ is torch.Tensor
            and value.layout is torch.strided and value.is_contiguous() and _storage_users is not None
            and _storage_users(value.untyped_storage()._cdata) == _SOLE_STORAGE)
