"""How the `cuda`-marked tests run where a GPU is present, checked on the CPU: a run of pytest in this
process, with the project's conftest, over a small test file, with torch.cuda saying a GPU exists."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tests.conftest as project_conftest

CUDA_TESTS = '''
import pytest
import torch

@pytest.mark.cuda
def test_bit_identity_runs_with_deterministic_cudnn():
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark

def test_other_tests_keep_the_settings_they_find():
    assert not torch.backends.cudnn.deterministic and torch.backends.cudnn.benchmark
'''


def test_cuda_tests_run_with_deterministic_cudnn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "test_cuda_flags.py").write_text(CUDA_TESTS)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # not skipped: "a GPU is present"
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    code = pytest.main([str(tmp_path), "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "--rootdir", str(tmp_path)],
                       plugins=[project_conftest])
    assert code == pytest.ExitCode.OK
    assert not torch.backends.cudnn.deterministic and torch.backends.cudnn.benchmark  # restored after the test
