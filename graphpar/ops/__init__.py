"""The operator library: importing it registers every operator (see `registry`)."""

from graphpar.ops import registry  # noqa: F401
from graphpar.ops import collective, fill, loss, nn, norm, optim, tensor  # noqa: F401
