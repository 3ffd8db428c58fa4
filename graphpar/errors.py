"""Project exception classes: each names what was wrong and what to do about it."""

from __future__ import annotations


class GraphparError(Exception):
    """Base class of graphpar's own errors."""


class UnknownOperatorError(AttributeError, GraphparError):
    """An operator type that is not registered (an AttributeError, as in Caffe2)."""


class MissingBlobError(KeyError, RuntimeError, GraphparError):
    """A blob an operator or a caller needs does not exist in the workspace.

    A KeyError (a missing name) and a RuntimeError, which is what Caffe2 raised.
    """

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class DuplicateHelperError(ValueError, AttributeError, GraphparError):
    """A brew helper registered under a name that is taken (an AttributeError, as in Caffe2)."""


class OperatorError(RuntimeError, GraphparError):
    """A kernel failed; the message names the net, the op, its inputs and where it was recorded."""


class ShapeInferenceError(ValueError, RuntimeError, GraphparError):
    """An op's output shapes cannot be inferred from its inputs' (the workspace checks before a net runs,
    where Caffe2 raised, so nothing runs). A ValueError, and a RuntimeError as the `[enforce fail ...]`
    Caffe2 raised when the op ran."""


class GradientError(ValueError, GraphparError):
    """Automatic differentiation cannot produce a correct gradient for the net as recorded."""


class ParallelizeError(ValueError, GraphparError):
    """A misuse of Parallelize or one of its helpers, found before the model was changed."""


class DeviceScopeError(ParallelizeError, AssertionError):
    """Parallelize called inside a non-CPU DeviceScope: an AssertionError too, as Caffe2's assert."""


class PartialCloneError(ValueError, AssertionError, GraphparError):
    """`Net.ClonePartial` cannot cut the net as asked: a ValueError, and an AssertionError as Caffe2's assert."""


class CheckpointError(ValueError, GraphparError):
    """A checkpoint file is corrupt or does not match the workspace or model."""


class GradientOverflowError(FloatingPointError, GraphparError):
    """A loss-scaled step's gradients hold an inf or a NaN: the step is skipped (`graphpar.passes.loss_scale`)."""
