"""Before a check: import every runtime and test dependency and name what is missing.

    python3 tools/preflight.py            # the packages: required (runtime, tests) and optional
    python3 tools/preflight.py --gpu      # also the GPU: CUDA, cuDNN batch norm, the APIs graphpar uses

Exit status 0 when every required package imports (and, with --gpu, the GPU checks pass); 1 otherwise.
A missing optional package is named with what needs it: the tests that need it skip, naming it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

REQUIRED = {  # module: what needs it
    "torch": "graphpar", "numpy": "graphpar", "networkx": "graphpar", "safetensors": "graphpar (checkpoints)",
    "pytest": "the tests", "hypothesis": "the tests",
}
OPTIONAL = {
    "pytest_timeout": "the check's per-test time limit (--timeout)", "xdist": "the check's parallel suite (-n)",
    "yacs": "graphpar.config and DefaultTrainer", "yaml": "yacs' config files", "sklearn": "the digits example",
    "tqdm": "the digits example's progress bar", "matplotlib": "the digits example's --plot",
    "google.protobuf": "Caffe2's protos (graphpar.caffe2.proto, .pb files, predictor export)",
}


def _version(module: object) -> str:
    return str(getattr(module, "__version__", "") or "")


def packages() -> tuple[list[str], list[str]]:
    """(lines to print, the required modules that are missing)."""
    lines, missing = [], []
    for table, required in ((REQUIRED, True), (OPTIONAL, False)):
        for name, what in table.items():
            try:
                version = _version(importlib.import_module(name))
                lines.append(f"  ok       {name} {version}".rstrip())
            except Exception as exc:  # noqa: BLE001 - any failure to import counts as missing
                lines.append(f"  {'MISSING' if required else 'absent '}  {name}: {what} "
                             f"({type(exc).__name__}: {exc})")
                if required:
                    missing.append(name)
    import graphpar  # noqa: F401 - the package itself, with whatever optional packages are absent

    lines.append("  ok       graphpar imports")
    return lines, missing


def _cudnn_batch_norm_runs() -> str:
    """SpatialBN on a CUDA input runs cuDNN's kernel (its saved mean carries cuDNN's reserve space)."""
    import numpy as np

    from graphpar.core.ir import CUDA, DeviceOption, OperatorDef
    from graphpar.ops import norm
    from graphpar.runtime import workspace

    gpu = DeviceOption(CUDA, 0)
    rng = np.random.default_rng(0)
    workspace.SwitchWorkspace("preflight", create_if_missing=True)
    workspace.FeedBlob("x", rng.standard_normal((8, 4, 5, 5)).astype(np.float32), gpu)
    for name, value in (("s", 1.0), ("b", 0.0), ("rm", 0.0), ("rv", 1.0)):
        workspace.FeedBlob(name, np.full(4, value, np.float32), gpu)
    workspace.RunOperatorOnce(OperatorDef("SpatialBN", ["x", "s", "b", "rm", "rv"],
                                          ["y", "rm", "rv", "mean", "inv_std"], {"is_test": 0}, gpu))
    assert getattr(workspace.FetchTensor("mean"), norm._CUDNN_RESERVE, None) is not None, \
        "SpatialBN did not run cuDNN's batch norm on CUDA"
    return "SpatialBN runs cuDNN's batch norm"


def _apis() -> str:
    import torch

    for name in ("_select_batch_norm_backend",):
        assert hasattr(torch._C, name), f"torch._C.{name} is missing"
    for name in ("_amp_foreach_non_finite_check_and_unscale_", "_foreach_mul"):
        assert hasattr(torch, name), f"torch.{name} is missing"
    for name in ("set_sync_debug_mode", "CUDAGraph", "graph_pool_handle"):
        assert hasattr(torch.cuda, name), f"torch.cuda.{name} is missing"
    return "torch has the CUDA APIs graphpar uses"


def gpu() -> tuple[list[str], bool]:
    """(lines, every check passed)."""
    import torch

    if not torch.cuda.is_available():
        return ["  FAILED   no CUDA device (torch.cuda.is_available() is False)"], False
    lines = [f"  ok       {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
             f"CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}"]
    passed = True
    checks: list[Callable[[], str]] = [_apis, _cudnn_batch_norm_runs]
    for check in checks:
        try:
            lines.append(f"  ok       {check()}")
        except Exception as exc:  # noqa: BLE001 - every check reports, one failure does not hide the others
            lines.append(f"  FAILED   {check.__name__}: {type(exc).__name__}: {exc}")
            passed = False
    return lines, passed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="also check the GPU")
    opts = parser.parse_args(argv)
    start = time.perf_counter()
    print(f"python {sys.version.split()[0]} at {sys.executable}")
    lines, missing = packages()
    print("packages:\n" + "\n".join(lines))
    ok = not missing
    if opts.gpu:
        gpu_lines, passed = gpu()
        print("GPU:\n" + "\n".join(gpu_lines))
        ok = ok and passed
    print(f"preflight: {'ok' if ok else 'FAILED'}"
          f"{'' if not missing else ' (missing: ' + ', '.join(missing) + ')'} in {time.perf_counter() - start:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
