"""The python blocks of the docs sections on DefaultTrainer (docs/feeding.md) and on one process per GPU
and graphpar.comm (docs/multihost.md) run verbatim; the 2-process block under graphpar.launch."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from graphpar import workspace
from tests.optional import needs

ROOT = Path(__file__).resolve().parents[1]


def _blocks(doc: str, heading: str) -> list[str]:
    text = (ROOT / "docs" / doc).read_text()
    section = text[text.index(heading):]
    following = section.find("\n## ", 1)
    return re.findall(r"```python\n(.*?)```", section if following < 0 else section[:following], flags=re.S)


@pytest.mark.slow
@needs("yacs", "graphpar.config")
def test_the_default_trainer_section_runs(tmp_path, monkeypatch, capsys) -> None:
    blocks = _blocks("feeding.md", "## Detectron2's DefaultTrainer")
    assert len(blocks) == 2
    monkeypatch.chdir(tmp_path)
    workspace.ResetWorkspace()
    for block in blocks:
        exec(compile(block, "docs/feeding.md", "exec"), {})
    assert (tmp_path / "toy_output" / "metrics.json").exists()
    assert "'top1': 0.5, 'top2': 1.0" in capsys.readouterr().out


def test_the_mmcv_and_data_parallel_section_runs(capsys) -> None:
    blocks = _blocks("feeding.md", "## MMCV and DataParallel details")
    assert len(blocks) == 1
    exec(compile(blocks[0], "docs/feeding.md", "exec"), {})
    out = capsys.readouterr().out
    assert "[(3, 4), (4, 4)]" in out and "tensor([0., 1., 2., 3.])" in out


def test_the_bucket_default_section_runs(capsys) -> None:
    blocks = _blocks("multihost.md", "## DDP's bucket default")
    assert len(blocks) == 1
    exec(compile(blocks[0], "docs/multihost.md", "exec"), {})
    assert capsys.readouterr().out.split() == ["1500", "4"]


@pytest.mark.slow
def test_the_sync_batch_norm_section_runs() -> None:
    blocks = _blocks("multihost.md", "## SyncBatchNorm's options")
    assert len(blocks) == 1
    exec(compile(blocks[0], "docs/multihost.md", "exec"), {})


@pytest.mark.slow
def test_the_one_process_per_gpu_section_runs_and_its_two_process_block_under_launch(tmp_path, capsys) -> None:
    blocks = _blocks("multihost.md", "## One process per GPU")
    assert len(blocks) == 2 and blocks[1].startswith("# needs: 2 processes")
    exec(compile(blocks[0], "docs/multihost.md", "exec"), {})
    assert "so processes would share GPUs" in capsys.readouterr().out
    script = tmp_path / "comm_demo.py"
    script.write_text(blocks[1])
    done = subprocess.run([sys.executable, "-m", "graphpar.launch", "--nproc-per-node", "2", str(script)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[0, 1] [0, 1]"]


@pytest.mark.slow
def test_the_first_multihost_block_prints_the_global_loss_on_one_process_and_on_two(tmp_path) -> None:
    """Issue 35 item 9: it printed its shard's part of the loss, half the loss on 2 processes."""
    script = tmp_path / "train.py"
    script.write_text(_blocks("multihost.md", "# Multi-host training")[0])
    runs = [[sys.executable, str(script)],
            [sys.executable, "-m", "graphpar.launch", "--nproc-per-node", "2", str(script)]]
    losses = []
    for command in runs:
        done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        losses.append(sorted(re.findall(r"shard \d of \d: loss ([0-9.]+)", done.stdout)))
    one, two = losses
    assert len(one) == 1 and len(two) == 2 and two == one * 2  # 1 x 2 devices == 2 x 2 devices, on every shard
