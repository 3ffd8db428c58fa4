"""Shared test settings: a deterministic hypothesis profile, fresh workspaces, and each test in its own
empty directory."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# Parallelize validates every net after each pass in tests: the default PassContext (read when graphpar is
# imported, so it holds in every thread) and the processes tests start (launcher, example, multi-host runs).
os.environ.setdefault("GRAPHPAR_CHECK_PASSES", "1")

settings.register_profile("graphpar", deadline=None, max_examples=25, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "graphpar"))


@pytest.fixture(autouse=True)
def fresh_workspace() -> None:
    """Every test starts in a fresh "default" workspace (the only one) with fixed seeds."""
    import numpy as np
    import torch

    from graphpar import workspace

    workspace.reset_all(seed=0)
    torch.manual_seed(0)
    np.random.seed(0)


@pytest.fixture(autouse=True)
def own_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test runs in its own empty temporary directory: no test reads or writes the directory pytest
    started in (the project root, where the main job leaves its checkpoint, say)."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def reuse_small_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let reuse kernels run on the tests' small tensors too (outside tests only values of
    `REUSE_MIN_BYTES` and up are reused), so every test exercises the riskier path."""
    import graphpar.executor.plan as plan

    monkeypatch.setattr(plan, "REUSE_MIN_BYTES", 0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def deterministic_cudnn(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tests that need a GPU run with cuDNN's deterministic kernels and no autotuning: cuDNN's atomics
    otherwise make two runs of one step differ in their last bits, which no bit-identity check of
    graphpar (captured == uncaptured, N devices == 1) is about."""
    if request.node.get_closest_marker("cuda") is None:
        yield
        return
    import torch

    cudnn = torch.backends.cudnn
    old = cudnn.deterministic, cudnn.benchmark
    cudnn.deterministic, cudnn.benchmark = True, False
    try:
        yield
    finally:
        cudnn.deterministic, cudnn.benchmark = old


@pytest.fixture(autouse=True)
def faked_gpu_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """With GRAPHPAR_FAKE_GPUS=<n>, every test runs as if the machine had n GPUs (tests/fake_gpus.py)."""
    count = os.environ.get("GRAPHPAR_FAKE_GPUS")
    if count:
        from tests.fake_gpus import fake_gpus

        fake_gpus(monkeypatch, int(count))


@pytest.fixture
def placed(monkeypatch: pytest.MonkeyPatch) -> list:
    """Record every DeviceOption the executor and FeedBlob resolve (logical CUDA runs on the CPU)."""
    import torch

    import graphpar.executor.plan as plan
    from graphpar import devices

    seen: list = []

    def record(option):  # noqa: ANN001, ANN202
        seen.append(option)
        return torch.device("cpu")

    monkeypatch.setattr(plan, "torch_device", record)
    with devices.cuda_on_cpu():
        yield seen


@pytest.fixture(autouse=True, scope="session")
def checked_passes() -> Iterator[None]:
    """Parallelize validates every net after each of its passes in tests (graphpar.passes.pipeline), even
    where the environment said GRAPHPAR_CHECK_PASSES=0."""
    from graphpar.passes.pipeline import PassContext

    with PassContext(check=True):
        yield
