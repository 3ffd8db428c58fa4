"""benchmarks/precision.py's CPU quick mode runs and reports every candidate."""

from __future__ import annotations

import pytest

from benchmarks import precision

pytestmark = pytest.mark.slow


def test_quick_mode_reports_graphpar_and_eager_in_fp32_and_bf16(capsys):
    rows = precision.main(["--quick", "--repeats", "1"])
    assert {(r["system"], r["precision"]) for r in rows} == {
        (s, p) for s in ("graphpar", "eager") for p in ("fp32", "bf16")}
    assert all(r["images_per_s"] > 0 and r["batch"] == 8 for r in rows)
    assert "| 8 | graphpar | bf16 |" in capsys.readouterr().out
