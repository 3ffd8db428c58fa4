"""The top-level packages: SPEC §1's names for graphpar, graphpar.core and graphpar.workspace exist,
are documented, type-hinted and keep their Caffe2 signatures; `import graphpar` stays cheap."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

import pytest

import graphpar
from graphpar import core, workspace

CORE_NAMES = ["DeviceType", "CPU", "CUDA", "DeviceOption", "BlobReference", "GradientSlice", "OperatorDef",
              "NetDef", "Net", "CreateOperator", "NameScope", "DeviceScope", "CurrentNameScope",
              "CurrentDeviceScope", "ScopedName", "ScopedBlobReference"]
WORKSPACE_NAMES = ["Workspace", "FeedBlob", "FetchBlob", "FetchTensor", "HasBlob", "Blobs", "RunNetOnce",
                   "CreateNet", "RunNet", "RunOperatorOnce", "ResetWorkspace", "SwitchWorkspace",
                   "CurrentWorkspace", "NumCudaDevices"]
NET_METHODS = ["Proto", "Clone", "AppendNet", "AddExternalInput", "AddExternalOutput", "BlobIsDefined",
               "NextBlob", "RunAllOnGPU", "RunAllOnDevice", "AddGradientOperators"]


def test_top_level_reexports() -> None:
    for module in ("core", "workspace", "model_helper", "brew", "optimizer", "data_parallel_model",
                   "checkpoint", "data"):
        assert getattr(graphpar, module) is importlib.import_module(f"graphpar.{module}")  # old paths too
        assert module in dir(graphpar)
    from graphpar import data_parallel_model, model_helper

    assert graphpar.Parallelize is data_parallel_model.Parallelize
    assert graphpar.FinalizeAfterCheckpoint is data_parallel_model.FinalizeAfterCheckpoint
    assert graphpar.GetCheckpointParams is data_parallel_model.GetCheckpointParams
    assert graphpar.ModelHelper is model_helper.ModelHelper
    assert isinstance(graphpar.__version__, str)
    with pytest.raises(AttributeError, match="no attribute 'Parallelise'"):
        graphpar.Parallelise  # noqa: B018


def test_data_module_loads_on_first_use() -> None:
    """The README's `graphpar.data.feed_batch(...)` works after a bare `import graphpar`."""
    code = "import graphpar, sys; assert 'torch' not in sys.modules; print(graphpar.data.feed_batch.__name__)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "feed_batch"


@pytest.mark.parametrize("module, names", [(core, CORE_NAMES), (workspace, WORKSPACE_NAMES)],
                         ids=["core", "workspace"])
def test_spec_names_exist_documented_and_typed(module, names) -> None:
    for name in names:
        obj = getattr(module, name)
        if name in ("CPU", "CUDA"):
            assert obj is getattr(core.DeviceType, name)
            continue
        assert inspect.getdoc(obj), name
        if inspect.isfunction(obj):
            signature = inspect.signature(obj)
            assert signature.return_annotation is not inspect.Signature.empty, name
            assert all(p.annotation is not inspect.Parameter.empty for p in signature.parameters.values()), name
    for method in NET_METHODS:
        assert inspect.getdoc(getattr(core.Net, method)), method
    assert core.DeviceType.CPU == 0 and core.DeviceType.CUDA == 1
    assert issubclass(core.BlobReference, str)


def _parameters(fn) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


def test_caffe2_signatures() -> None:
    empty = inspect.Parameter.empty
    assert _parameters(core.CreateOperator) == [
        ("type", empty), ("inputs", empty), ("outputs", empty), ("name", ""), ("device_option", None),
        ("engine", ""), ("control_input", None), ("args", empty)]
    assert _parameters(core.NameScope) == [("prefix", empty), ("reset", False)]
    assert _parameters(core.DeviceScope) == [("device_option", empty), ("node_name", None)]
    assert core.DeviceOption() == core.DeviceOption(device_type=core.CPU, device_id=0)
    assert core.GradientSlice(indices="i", values="v") == ("i", "v")
    assert _parameters(workspace.FeedBlob) == [("name", empty), ("value", empty), ("device_option", None)]
    assert _parameters(workspace.CreateNet) == [("net", empty), ("overwrite", False)]
    assert _parameters(workspace.RunNet) == [("net_or_name", empty), ("num_iter", 1)]
    assert _parameters(workspace.SwitchWorkspace) == [("name", empty), ("create_if_missing", False)]
