"""A machine without the optional packages (the GPU machines this project is checked on lack yacs):
`tools/without` makes yacs, scikit-learn, tqdm, matplotlib and protobuf unimportable in a process and
the processes it starts. graphpar imports and trains there, the preflight names what is absent, and
the whole suite collects (its tests that need one of them skip, naming it: tests/optional.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WITHOUT = ("yacs", "sklearn", "tqdm", "matplotlib", "google.protobuf")


def _run(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (str(ROOT / "tools" / "without"), str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "GRAPHPAR_WITHOUT": ",".join(WITHOUT)}
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


TRAINS = textwrap.dedent("""
    import importlib.util
    import numpy as np
    import graphpar
    from graphpar import data_parallel_model as dpm, model_helper, models, optimizer
    from graphpar.engine import Trainer

    for name in %r:
        assert importlib.util.find_spec(name.split(".")[0]) is None or name == "google.protobuf", name
    try:
        import graphpar.config
    except ModuleNotFoundError as exc:
        assert "yacs" in str(exc), exc
    else:
        raise AssertionError("graphpar.config imported without yacs")
    model = model_helper.ModelHelper(name="bare")
    dpm.Parallelize(model, input_builder_fun=lambda m: None,
                    forward_pass_builder_fun=lambda m, s: models.mlp(m, s, dim_in=4, hidden=(8,), num_classes=2),
                    optimizer_builder_fun=lambda m: optimizer.build_sgd(m, 0.1), devices=[0, 1], cpu_device=True)
    rng = np.random.default_rng(0)
    data = [{"data": rng.standard_normal((4, 4)).astype(np.float32), "label": rng.integers(0, 2, 4).astype(np.int32)}
            for _ in range(3)]
    Trainer(model, data, max_iter=3).train()
    print("trained", int(dpm.workspace.FetchBlob("optimizer_iteration")[0]))
    spec = importlib.util.spec_from_file_location("preflight", %r)  # in this process: one start-up of torch
    preflight = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(preflight)
    print("preflight exit", preflight.main([]))
""") % (WITHOUT, str(ROOT / "tools" / "preflight.py"))


def test_graphpar_trains_and_the_preflight_names_what_is_absent() -> None:
    done = _run(["-c", TRAINS], timeout=180)
    assert done.returncode == 0 and "trained 3" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]
    assert "preflight: ok" in done.stdout and done.stdout.strip().endswith("preflight exit 0"), done.stdout
    absent = [line.split()[1].rstrip(":") for line in done.stdout.splitlines() if line.strip().startswith("absent")]
    assert absent == list(WITHOUT)


@pytest.mark.slow
def test_the_whole_suite_collects_without_the_optional_packages() -> None:
    done = _run(["-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"], timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " error" not in done.stdout.splitlines()[-1] and "tests collected" in done.stdout.splitlines()[-1]
