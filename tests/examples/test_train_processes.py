"""The main job over processes: 2 processes x 2 devices record and print the losses of 1 process x 4
devices (they printed half of it: the local shard's mean divided by the shard count)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.optional import DIGITS

ROOT = Path(__file__).resolve().parents[2]
pytestmark = DIGITS


def _run(tmp_path: Path, name: str, *argv: str) -> tuple[str, list[dict]]:
    done = subprocess.run([sys.executable, "-m", "graphpar.examples.train", "--epochs", "1", *argv, "--checkpoint",
                           str(tmp_path / name / "ckpt.safetensors")], cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr
    lines = (tmp_path / name / "metrics.json").read_text().splitlines()
    return done.stdout, [json.loads(line) for line in lines]


def _epoch_line(out: str) -> str:
    """The epoch's log line without its time and rank prefix ('[03:12:51 rank0] epoch  1  loss ...')."""
    return next(x.split("] ", 1)[-1] for x in out.splitlines() if "epoch  1  loss" in x)


@pytest.mark.slow
def test_two_processes_of_two_devices_print_the_loss_of_one_process_of_four(tmp_path: Path) -> None:
    out4, metrics4 = _run(tmp_path, "four", "--devices", "4")
    out22, metrics22 = _run(tmp_path, "two", "--devices", "2", "--num-processes", "2")
    assert _epoch_line(out4) == _epoch_line(out22)
    for a, b in zip(metrics4, metrics22, strict=True):
        assert {k: v for k, v in a.items() if k != "time"} == {k: v for k, v in b.items() if k != "time"}
    assert metrics4[-1]["epoch_loss"] > 1.0  # 10 digits: the first epoch's mean loss starts near ln 10
