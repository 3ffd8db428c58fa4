"""The DLRM example trains: its held-out accuracy beats chance by far."""

from __future__ import annotations

import re

import pytest

from graphpar.examples import dlrm

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("opt", ["adagrad", "adam"])
def test_short_run_learns_the_clicks(opt, capsys):
    assert dlrm.main(["--cpu", "--devices", "2", "--steps", "100", "--batch", "128", "--optimizer", opt]) == 0
    match = re.search(r"final loss ([0-9.]+), held-out accuracy ([0-9.]+)%", capsys.readouterr().out)
    assert match and float(match.group(1)) < 0.3 and float(match.group(2)) > 88
