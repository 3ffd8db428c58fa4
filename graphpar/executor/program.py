"""How a step calls its kernel: encoded once (`_statement`), generated as Python source for every way
a plan runs.

A step is one statement over frame slots (`frame[3] = k2(frame[1], frame[0])`). From it this module
generates, once per plan:

- `straight_line(plan, steps, frees, label)`: `program(frame)`, which runs `steps` in that order on
  the frame, frees after each step what `frees` lists for it (`FrameLayout.frees_in` of the order the
  run uses), and raises `StepFailed` carrying the failing step's index. The "simple" loop unrolled: a
  run does per op only the kernel call and its frame reads and writes (torch.fx generates Python from
  its graphs the same way); generating costs about 20 µs per op, once per plan.
- `step_runs(plan)`: one `run(frame)` per step, for executors that launch steps one at a time (the
  dag's workers, a CUDA graph's host prologue); made on first use and kept in the plan's runtime.
- `functional(plan, steps, inputs, outputs, label)`: `program(*inputs) -> outputs`, the same
  statements over local variables instead of frame slots, a pure function of its inputs but for the
  in-place updates the kernels declare: what the compiled executor hands to `torch.compile`.

A step whose kernel overwrites inputs (Trait.OVERWRITES_INPUTS) gets each such input through
`claim(frame, slot, holders)`: the tensor itself when nothing but the frame (and `holders` known
others: the workspace, for a loaded blob) holds it and no other tensor shares its memory, else a copy.
A step with a reuse kernel (`core.schema.InputReuse`, `Step.reuse`) calls it when `owns(frame, slot)`
says the same of the input it may overwrite, and its ordinary kernel otherwise: the results are the
same bits, without allocating where the run owns the input (`x = relu(x)` as `relu_`). A functional
program calls only ordinary kernels: reference counts mean nothing to a tracer, and the compiler
plans buffer reuse itself.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from graphpar.executor.runtime import runtime_of

if TYPE_CHECKING:
    from graphpar.executor.plan import CompiledNet, Step


class StepFailed(Exception):
    """Raised by a generated program when step `index` failed; the kernel's error is the cause."""

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.index = index


class Reuse(NamedTuple):
    """A step's reuse kernel (`core.schema.InputReuse`), the position of the input it may overwrite,
    and that input's known holders besides the frame (1: the workspace, for a blob loaded from it)."""

    kernel: Callable[..., Any]
    input: int
    holders: int = 0


def _frame_slot(slot: int) -> str:
    return f"frame[{slot}]"


def _local(slot: int) -> str:
    return f"s{slot}"


def _statement(step: Step, functional: bool) -> str:
    """The one statement that runs `step`: read its input slots, call its kernel, write its output slots
    (frame slots, or locals named after them when `functional`)."""
    j, ref = step.index, _local if functional else _frame_slot
    if functional:
        kernel, args = f"k{j}", [ref(i) for i in step.inputs]
    else:
        claims = dict(step.claims)
        args = [f"claim(frame, {i}, {claims[p]})" if p in claims else ref(i) for p, i in enumerate(step.inputs)]
        reuse = step.reuse
        kernel = f"(r{j} if owns(frame, {step.inputs[reuse.input]}, {reuse.holders}) else k{j})" if reuse else f"k{j}"
    call = f"{kernel}({', '.join(args)})"
    if len(step.outputs) == 1:
        return f"{ref(step.outputs[0])} = {call}"
    if not step.outputs:
        return call
    if functional:
        return f"{', '.join(map(ref, step.outputs))}, = {call}"
    return f"store(frame, {step.outputs!r}, {call})"


def _build(plan: CompiledNet, steps: Sequence[int], label: str, source: str, functional: bool) -> Any:
    """Compile `source`, which defines `program` inside `make(<kernels of steps>)`, and return `program`."""
    used = [plan.steps[j] for j in steps]
    reusing = [] if functional else [step for step in used if step.reuse]
    names = ["store", "claim", "owns", "StepFailed", *(f"k{step.index}" for step in used),
             *(f"r{step.index}" for step in reusing)]
    namespace: dict = {}
    header = f"def make({', '.join(names)}):\n"
    exec(compile(header + source + "    return program\n", f"<plan {plan.name} {label}>", "exec"), namespace)  # noqa: S102 - our own generated code
    return namespace["make"](store_all, claim, owns, StepFailed, *(step.kernel for step in used),
                             *(step.reuse.kernel for step in reusing if step.reuse))


def straight_line(plan: CompiledNet, steps: Sequence[int], frees: Sequence[Sequence[int]] | None,
                  label: str) -> Callable[[list], None]:
    """`program(frame)` running `steps` in that order, freeing `frees[j]` after step j (None: nothing)."""
    lines = []
    for j in steps:
        lines.append(f"i = {j}; {_statement(plan.steps[j], functional=False)}")
        if frees is not None:
            lines.extend(f"frame[{slot}] = None" for slot in frees[j])
    body = "\n".join(f"            {line}" for line in lines) or "            pass"
    source = (f"    def program(frame):\n"
              f"        i = 0\n"
              f"        try:\n{body}\n"
              f"        except Exception as exc:\n"
              f"            raise StepFailed(i) from exc\n")
    return _build(plan, steps, label, source, functional=False)


def step_runs(plan: CompiledNet) -> tuple[Callable[[list], None], ...]:
    """Per step: `run(frame)`, running that step alone (its kernel's exception propagates as it is)."""
    runtime = runtime_of(plan)
    if runtime.runs is None:
        with runtime.lock:
            if runtime.runs is None:
                steps = range(len(plan.steps))
                source = "".join(f"    def run{j}(frame):\n        {_statement(plan.steps[j], functional=False)}\n"
                                 for j in steps)
                source += f"    program = ({''.join(f'run{j}, ' for j in steps)})\n"
                runtime.runs = _build(plan, steps, "steps", source, functional=False)
    return runtime.runs


def functional(plan: CompiledNet, steps: Sequence[int], inputs: Sequence[int], outputs: Sequence[int],
               label: str) -> Callable[..., tuple]:
    """`program(*inputs) -> outputs`: `steps` in that order over local variables, one per slot."""
    lines = [_statement(plan.steps[j], functional=True) for j in steps]
    lines.append(f"return ({''.join(f'{_local(slot)}, ' for slot in outputs)})")
    body = "".join(f"        {line}\n" for line in lines)
    source = f"    def program({', '.join(map(_local, inputs))}):\n{body}"
    return _build(plan, steps, label, source, functional=True)


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
