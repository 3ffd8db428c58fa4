"""The operator library: importing it registers every operator (see `registry`)."""

from graphpar.ops import collective, fill, loss, nn, norm, optim, registry, tensor  # noqa: F401
