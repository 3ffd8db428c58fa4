"""Run operator kernels and gradient makers directly, without a workspace (shared by the op tests).

`run_kernel` builds one OperatorDef, resolves its kernel the way CreateNet does and calls it.
`check_gradient` asks the op's gradient maker for gradient ops, runs their kernels, and compares the
input gradients with `torch.autograd.grad` of an independent eager-PyTorch reference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphpar.core.ir import CUDA, DeviceOption, GradientSlice, OperatorDef
from graphpar.core.schema import (
    NO_GRADIENT,
    NOT_DIFFERENTIABLE,
    KernelContext,
    check_operator,
    get_schema,
    parse_args,
)
from graphpar.naming import grad_name


def make_op(op_type: str, n_inputs: int, n_outputs: int | None = None, **args: Any) -> OperatorDef:
    """An op with inputs X0.. and outputs Y0.. (an output the schema forces in place takes its input's name)."""
    schema = get_schema(op_type)
    n_out = schema.num_outputs[0] if n_outputs is None else n_outputs
    inputs = [f"X{i}" for i in range(n_inputs)]
    outputs = [f"Y{o}" for o in range(n_out)]
    for i, o in schema.enforced_pairs(n_inputs, n_out):
        outputs[o] = inputs[i]
    return OperatorDef(op_type, inputs, outputs, dict(args))


def _context(op: OperatorDef, device: str, generator: torch.Generator | None) -> KernelContext:
    dev = torch.device(device)
    gen = generator if generator is not None else torch.Generator().manual_seed(0)

    def device_of(option: DeviceOption | None) -> torch.device:
        return dev if option is not None and option.device_type == CUDA else torch.device("cpu")

    return KernelContext(op, dev, device_of, lambda: lambda _d: gen)


def run_op(op: OperatorDef, inputs: Sequence[torch.Tensor], generator: torch.Generator | None = None,
           device: str = "cpu", reuse: bool = False) -> tuple[torch.Tensor, ...]:
    """Check `op` against its schema, build its kernel (with `reuse`, the one that may overwrite an
    input, `OpSchema.reuse`) and run it; always returns a tuple."""
    schema = check_operator(op)
    factory = schema.reuse.kernel if reuse and schema.reuse is not None else schema.kernel
    fn = factory(parse_args(schema, op.args), _context(op, device, generator))
    out = fn(*inputs)
    return out if isinstance(out, tuple) else (out,)


def run_kernel(op_type: str, inputs: Sequence[torch.Tensor], n_outputs: int | None = None,
               generator: torch.Generator | None = None, device: str = "cpu",
               **args: Any) -> tuple[torch.Tensor, ...]:
    """Run one `op_type` kernel on `inputs` with `args`; returns the tuple of output tensors."""
    op = make_op(op_type, len(inputs), n_outputs, **args)
    return run_op(op, inputs, generator, device)


def gradient_ops(op: OperatorDef, grad_outputs: Sequence[str | None]) -> tuple[list[OperatorDef], list]:
    """The op's gradient ops, with forward args copied in as autodiff does (the grad op's own args win)."""
    schema = get_schema(op.type)
    if schema.gradient in (None, NO_GRADIENT, NOT_DIFFERENTIABLE):
        raise ValueError(f"{op.type} has no gradient maker ({schema.gradient!r})")
    grad_ops, grad_inputs = schema.gradient(op, list(grad_outputs))
    for gop in grad_ops:
        if schema.copy_args_to_gradient:
            gop.args = {**op.args, **gop.args}
        check_operator(gop)
    return grad_ops, list(grad_inputs)


def run_gradient(op: OperatorDef, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
                 grad_outputs: dict[int, torch.Tensor]) -> list[torch.Tensor | None]:
    """Run the gradient ops of `op` given output gradients {output index: dY}; one entry per input
    (a sparse GradientSlice gradient densified)."""
    names = [grad_name(o) if i in grad_outputs else None for i, o in enumerate(op.outputs)]
    grad_ops, grad_inputs = gradient_ops(op, names)
    blobs: dict[str, torch.Tensor] = dict(zip(op.inputs, inputs))
    blobs.update(zip(op.outputs, outputs))
    blobs.update({grad_name(op.outputs[i]): g for i, g in grad_outputs.items()})
    for gop in grad_ops:
        blobs.update(zip(gop.outputs, run_op(gop, [blobs[name] for name in gop.inputs])))
    return [None if g is None else _dense(g, blobs, x) for g, x in zip(grad_inputs, inputs)]


def _dense(gradient: str | GradientSlice, blobs: dict[str, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """A gradient's tensor; a GradientSlice is summed into zeros shaped like its input (duplicates add)."""
    if not isinstance(gradient, GradientSlice):
        return blobs[gradient]
    indices = blobs[gradient.indices].reshape(-1).long()
    values = blobs[gradient.values].reshape(indices.numel(), *like.shape[1:])
    return torch.zeros_like(like).index_add_(0, indices, values)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max(max |expected|, 1e-12)."""
    if actual.shape != expected.shape:
        raise AssertionError(f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    diff = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    scale = expected.double().abs().max().item() if expected.numel() else 0.0
    return diff / max(scale, 1e-12)


def check_gradient(op_type: str, inputs: Sequence[torch.Tensor], reference: Callable[..., Any],
                   wrt: Sequence[int] = (0,), grad_outputs: Sequence[int] = (0,),
                   n_outputs: int | None = None, rtol: float = 1e-6, seed: int = 0,
                   **args: Any) -> list[torch.Tensor | None]:
    """Compare the op's forward (values and dtypes) and input gradients (`wrt`) with eager `reference`
    and torch.autograd.

    `reference(*inputs)` mirrors the op's outputs (a tensor or a tuple). Random output gradients
    (seeded) are fed for the outputs in `grad_outputs`. Raises AssertionError on a mismatch;
    returns the gradients graphpar computed, one per input.
    """
    op = make_op(op_type, len(inputs), n_outputs, **args)
    outputs = run_op(op, inputs)
    leaves = [x.detach().clone().requires_grad_(i in wrt) for i, x in enumerate(inputs)]
    expected = reference(*leaves)
    expected = expected if isinstance(expected, tuple) else (expected,)
    for k, (got, want) in enumerate(zip(outputs, expected)):
        if rel_err(got, want.detach()) >= rtol or got.dtype != want.dtype:
            raise AssertionError(f"{op_type} output {k}: rel. err {rel_err(got, want.detach()):.3g}, "
                                 f"dtype {got.dtype} (expected {want.dtype})")
    gen = torch.Generator().manual_seed(seed)
    dys = {i: torch.randn(outputs[i].shape, generator=gen, dtype=torch.float64).to(outputs[i].dtype)
           for i in grad_outputs}
    auto = torch.autograd.grad([expected[i] for i in grad_outputs], [leaves[i] for i in wrt],
                               [dys[i] for i in grad_outputs], allow_unused=True)
    got = run_gradient(op, inputs, outputs, dys)
    for i, want in zip(wrt, auto):
        want = torch.zeros_like(inputs[i]) if want is None else want
        if got[i] is None:
            raise AssertionError(f"{op_type}: input {i} got no gradient")
        err = rel_err(got[i], want)
        if err >= rtol or got[i].dtype != inputs[i].dtype:
            raise AssertionError(f"{op_type} gradient of input {i}: rel. err {err:.3g}, "
                                 f"dtype {got[i].dtype} (input {inputs[i].dtype})")
    return got


def randn(shape: Sequence[int], dtype: torch.dtype = torch.float64, seed: int = 0) -> torch.Tensor:
    """A seeded standard-normal tensor (drawn in float64, then cast to `dtype`)."""
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64).to(dtype)
