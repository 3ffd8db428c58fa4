from __future__ import annotations

import pytest

from graphpar.core.ir import BlobReference
from graphpar.errors import ParallelizeError
from graphpar.passes.validate_params import validate_params


def test_unique_params_pass():
    validate_params([BlobReference("cpu_0/w"), "cpu_0/b", "cpu_1/w"])


def test_duplicates_are_listed_sorted():
    with pytest.raises(ParallelizeError, match=r"Duplicate entries in params: \['cpu_0/b', 'cpu_0/w'\]"):
        validate_params(["cpu_0/w", "cpu_0/b", BlobReference("cpu_0/w"), "cpu_0/b", "cpu_1/w"])
