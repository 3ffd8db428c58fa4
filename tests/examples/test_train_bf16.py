"""The main job in bfloat16 (`--dtype bfloat16`) reaches within 0.5 points of its fp32 accuracy."""

from __future__ import annotations

import re

import pytest
import torch

from graphpar import workspace
from graphpar.examples import train
from tests.optional import DIGITS

pytestmark = [pytest.mark.slow, DIGITS]


def _run(tmp_path, capsys, *argv: str) -> float:
    assert train.main([*argv, "--checkpoint", str(tmp_path / f"{len(argv)}.safetensors")]) == 0
    match = re.search(r"final test accuracy ([0-9.]+)%", capsys.readouterr().out)
    assert match
    return float(match.group(1))


def test_bf16_reaches_the_fp32_accuracy_within_half_a_point(tmp_path, capsys):
    fp32 = _run(tmp_path, capsys)
    bf16 = _run(tmp_path, capsys, "--dtype", "bfloat16")
    assert workspace.FetchTensor("cpu_0/conv1").dtype == torch.bfloat16  # it did run in bf16
    assert abs(bf16 - fp32) <= 0.5 and bf16 > 95.0, (bf16, fp32)  # measured: 98.61% both
