"""Caffe2's `optimizer_context`: choose, by parameter tag, which optimizer a parameter is meant for.

Inside `with UseOptimizer(opt)` (or `UseOptimizer({"TAG": opt, ...})`) every parameter created by
`ModelHelper.create_param` records the optimizer for its tags (else the `DEFAULT_OPTIM` entry) in
its `ParameterInfo.optimizer`. As in Caffe2, `build_sgd` and friends do not read it: code that
builds per-parameter optimizers does (`model.get_param_info(p).optimizer`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

DEFAULT_OPTIM = "DEFAULT"

_state = threading.local()


def _stack() -> list[dict[str, Any]]:
    if not hasattr(_state, "stack"):
        _state.stack = []
    return _state.stack


class OptimizerContext:
    """The active optimizer mapping (tag -> optimizer), innermost `UseOptimizer` first."""

    @staticmethod
    def current() -> OptimizerContext:
        """The (thread-local) context; its methods read the active `UseOptimizer` blocks."""
        return OptimizerContext()

    def has_optimizer(self, name: str) -> bool:
        """Whether an active block maps tag `name`."""
        return any(name in layer for layer in _stack())

    def get_optimizer(self, name: str) -> Any:
        """The innermost optimizer for tag `name`. Raises KeyError if none is active."""
        for layer in reversed(_stack()):
            if name in layer:
                return layer[name]
        raise KeyError(f"no optimizer for tag {name!r} is active (use `with UseOptimizer(...)`)")

    def for_tags(self, tags: Iterable[str]) -> Any:
        """The optimizer of the first tag that has one, else the default one, else None."""
        for tag in (*tags, DEFAULT_OPTIM):
            if self.has_optimizer(tag):
                return self.get_optimizer(tag)
        return None


@contextmanager
def UseOptimizer(optim_or_dict: Any) -> Iterator[None]:  # noqa: N802 - Caffe2 name
    """Within the block, new parameters record `optim_or_dict` (one optimizer for every tag, or a
    {tag: optimizer} dict) as theirs."""
    layer = dict(optim_or_dict) if isinstance(optim_or_dict, dict) else {DEFAULT_OPTIM: optim_or_dict}
    _stack().append(layer)
    try:
        yield
    finally:
        _stack().pop()
