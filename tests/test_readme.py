"""The README's quick start runs as written and trains (the front door must stay true)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from graphpar import workspace

README = Path(__file__).resolve().parents[1] / "README.md"


def test_quick_start_runs_and_learns(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python quick start"
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)
    assert (tmp_path / "ckpt.safetensors").exists()
    assert int(workspace.FetchBlob("optimizer_iteration")[0]) == 100
    weights = [workspace.FetchBlob(f"cpu_{d}/fc1_w") for d in range(4)]
    for other in weights[1:]:
        np.testing.assert_array_equal(other, weights[0])


def test_every_python_block_runs_in_order(tmp_path, monkeypatch):
    """The cuda_on_cpu and introspection snippets run too, without Graphviz (DOT is always written)."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("shutil.which", lambda name: None)  # as on a machine without Graphviz
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    assert (tmp_path / "mlp.dot").exists() and not (tmp_path / "mlp.svg").exists()
    assert workspace.FetchBlob("gpu_1/fc1_w").shape == (32, 64)
