"""`--compile` on the main job and on resnet50_trainer: the train step runs compiled (net type
"compiled") and trains as the uncompiled run does (the tests compile with "aot_eager", which runs
the same aten ops; inductor's numbers differ by float reassociation)."""

from __future__ import annotations

import numpy as np
import pytest

from graphpar import workspace
from graphpar.examples import resnet50_trainer, train
from graphpar.runtime.workspace import get_workspace
from tests.optional import DIGITS


def _params() -> dict[str, np.ndarray]:
    return {b: workspace.FetchBlob(b) for b in workspace.Blobs() if b.startswith("cpu_0/") and b.endswith(("_w", "_b"))}


def _train_types() -> set[str]:
    return {plan.type for plan in get_workspace().nets.values()}


@DIGITS
def test_the_main_job_with_compile_trains_as_without(tmp_path, capsys):
    common = ["--cpu", "--devices", "2", "--epochs", "1", "--batch-size", "128"]
    assert train.main([*common, "--checkpoint", str(tmp_path / "a.safetensors")]) == 0
    expected = _params()
    assert train.main([*common, "--compile", "--compile-backend", "aot_eager",
                       "--checkpoint", str(tmp_path / "b.safetensors")]) == 0
    assert "compiled" in _train_types()
    got = _params()
    assert sorted(got) == sorted(expected) and len(got) >= 6
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-6, err_msg=name)
    with pytest.raises(SystemExit):
        train.parse_args(["--compile", "fastest"])
    assert train.compile_options(train.parse_args(["--compile", "reduce-overhead"])) == {
        "backend": "inductor", "mode": "reduce-overhead"}


def test_resnet50_trainer_takes_compile(monkeypatch):
    args = resnet50_trainer.parse_args(["--use_cpu", "--compile"])
    assert args.compile == "default"
    model = resnet50_trainer.build(resnet50_trainer.parse_args(["--use_cpu", "--compile", "max-autotune",
                                                                "--num_layers", "18", "--width", "4"]),
                                   [0], True, 10)
    proto = model.net.Proto()
    assert proto.type == "compiled" and proto.args["compile_mode"] == "max-autotune"
