"""Every python block of docs/precision.md runs as written, and prints what the comments say."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "precision.md"


def test_every_python_block_runs(tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 5
    monkeypatch.chdir(tmp_path)
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "torch.bfloat16 float32"
    assert out[1] == ("[('Cast', ['a']), ('Cast', ['b']), ('MyMatMul', ['a_bf16', 'b_bf16']), ('Cast', ['c']), "
                      "('SoftmaxWithLoss', ['c_fp32', 'label'])]")
    assert out[-1] == "True"
