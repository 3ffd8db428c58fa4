"""The executor tests run with the toy operators registered."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.executor import toy_ops


@pytest.fixture(autouse=True, scope="module")
def _toy_ops() -> Iterator[None]:
    with toy_ops.registered():
        yield
