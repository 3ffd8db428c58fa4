"""The `ParallelState` that `Parallelize` leaves on a model, for the layers that read it without
importing `data_parallel_model` (checkpoint, comm) and for `data_parallel_model` itself."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from graphpar.errors import ParallelizeError

if TYPE_CHECKING:
    from graphpar.passes.state import ParallelState


def parallel_state(model: Any) -> ParallelState:
    """The ParallelState `Parallelize` left on `model`.

    Raises:
        ParallelizeError: the model was not parallelized.
    """
    state = getattr(model, "_parallel", None)
    if state is None:
        raise ParallelizeError(f"model {getattr(model, 'name', model)!r} is not parallelized: call "
                               f"data_parallel_model.Parallelize first")
    return state


def first_device_scope(model: Any) -> str:
    """The name scope of the model's first device, e.g. 'gpu_0/'. Raises as `parallel_state`."""
    layout = parallel_state(model).layout
    return layout.scoped(layout.master, "")
