"""The README's quick start runs as written and learns (the front door must stay true). Every block of
README.md and docs/*.md runs in tests/test_docs.py; these check what the README's blocks leave behind."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from graphpar import workspace
from tests.test_docs import blocks, missing_packages

README = Path(__file__).resolve().parents[1] / "README.md"


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
