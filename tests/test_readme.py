"""The README's quick start runs as written and learns (the front door must stay true). Every block of
README.md and docs/*.md runs in tests/test_docs.py; these check what the README's blocks leave behind."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from graphpar import workspace
from tests.optional import DIGITS
from tests.test_docs import blocks, missing_packages

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def test_quick_start_runs_and_learns(tmp_path, monkeypatch, capsys):
    found = blocks(README)
    assert found, "README has no python quick start"
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(found[0].code, str(README), "exec"), namespace)
    assert (tmp_path / "ckpt.safetensors").exists()
    first, last = map(float, re.search(r"loss ([0-9.]+) -> ([0-9.]+)$", capsys.readouterr().out, re.M).groups())
    assert first > 2.0 and last < 1.0  # chance is ln 10 = 2.30: the printed loss shows that it learned
    assert int(workspace.FetchBlob("optimizer_iteration")[0]) == 100
    weights = [workspace.FetchBlob(f"cpu_{d}/fc1_w") for d in range(4)]
    for other in weights[1:]:
        np.testing.assert_array_equal(other, weights[0])


def test_every_python_block_runs_in_order(tmp_path, monkeypatch):
    """The cuda_on_cpu and introspection snippets run too, without Graphviz (DOT is always written)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("shutil.which", lambda name: None)  # as on a machine without Graphviz
    namespace: dict = {}
    for block in blocks(README):
        if not missing_packages(block):  # a block of an optional package's (Caffe2's protobuf)
            exec(compile(block.code, str(README), "exec"), namespace)
    assert (tmp_path / "mlp.dot").exists() and not (tmp_path / "mlp.svg").exists()
    assert workspace.FetchBlob("gpu_1/fc1_w").shape == (32, 64)


def test_every_test_runs_in_its_own_empty_directory(tmp_path):
    """tests/conftest.py: what the directory pytest started in holds (the main job's checkpoint, say) cannot
    change a test's result, and no test leaves files there."""
    assert Path.cwd() == tmp_path and not any(tmp_path.iterdir())


@DIGITS
@pytest.mark.slow
def test_the_readme_commands_in_order_in_one_checkout_end_green(tmp_path):
    """The README's first command (the main job) leaves its checkpoint and metrics.json in the directory it
    ran in; the second (pytest), run there next, still passes: the tests that read the main job's default
    --checkpoint (issue 35: test_comm's parse_args hit the overwrite guard) among them."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    job = subprocess.run([sys.executable, "-m", "graphpar.examples.train", "--epochs", "1", "--devices", "2"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stderr
    assert (tmp_path / "graphpar_digits.safetensors").exists() and (tmp_path / "metrics.json").exists()
    affected = [str(ROOT / "tests" / "parallel" / "test_comm.py"),
                f"{__file__}::test_every_test_runs_in_its_own_empty_directory"]
    suite = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *affected],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert suite.returncode == 0, suite.stdout[-3000:]
    assert re.search(r"\b\d+ passed\b", suite.stdout) and "failed" not in suite.stdout
