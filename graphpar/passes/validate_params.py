"""Pass: refuse a parameter list that names a blob twice."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from graphpar.errors import ParallelizeError


def validate_params(params: Sequence[str]) -> None:
    """Check that no parameter is registered twice.

    Input: the model's trainable params (any order). Guarantees on return: every name occurs once.

    Raises:
        ParallelizeError: listing the duplicated names (sorted).
    """
    counts = Counter(str(p) for p in params)
    dupes = sorted(name for name, n in counts.items() if n > 1)
    if dupes:
        raise ParallelizeError(f"Duplicate entries in params: {dupes}. Each parameter must be created once "
                               f"(create_param returns the existing blob when a name is reused)")
