"""Run Caffe2's own Python tests against graphpar, changing nothing but their imports.

Usage: python tools/caffe2_tests.py CAFFE2_PYTHON_DIR [OUT_DIR] [-- PYTEST_ARGS...]

CAFFE2_PYTHON_DIR is `caffe2/python` of a PyTorch checkout from before Caffe2 was removed (v2.0 or
older). The test files listed in FILES are copied to OUT_DIR (default: a temporary folder) with their
import statements rewritten by IMPORTS below (graphpar's modules for Caffe2's, `unittest.mock` for
`mock`, `six` for `future`), then pytest runs them and prints each test's outcome. A name that
graphpar does not have is dropped from its import line and reported, so the tests that use it fail.
Nothing but import statements is changed; docs/caffe2_tests.md lists the results and the reasons.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

FILES = ("brew_test.py", "core_test.py", "data_parallel_model_test.py", "model_helper_test.py",
         "optimizer_test.py", "optimizer_test_util.py", "workspace_test.py")

# Caffe2 module -> the module that replaces it (None: graphpar has no counterpart; drop the import).
IMPORTS = {
    "caffe2.python": "graphpar",
    "caffe2.proto": "graphpar.proto",
    "caffe2.python.cnn": "graphpar.cnn",
    "caffe2.python.model_helper": "graphpar.model_helper",
    "caffe2.python.modeling.parameter_info": "graphpar.model_helper",
    "caffe2.python.modeling.initializers": "graphpar.model_helper",
    "caffe2.python.optimizer": "graphpar.optimizer",
    "caffe2.python.optimizer_context": "graphpar.optimizer_context",
    "caffe2.python.test_util": "graphpar.test_util",
    "caffe2.python.hypothesis_test_util": "graphpar.hypothesis_test_util",
    "caffe2.python.optimizer_test_util": "optimizer_test_util",  # the rewritten copy next to the tests
    "caffe2.python.task": None,
    "caffe2.python.net_builder": None,
    "mock": "unittest.mock",
    "future.utils": "six",
}

REPO = Path(__file__).resolve().parent.parent  # this checkout's graphpar, not an installed one
sys.path.insert(0, str(REPO))

_FROM = re.compile(r"^(?P<indent>\s*)from (?P<module>[\w.]+) import (?P<names>\(?[^#]*?\)?)\s*$")
_IMPORT = re.compile(r"^(?P<indent>\s*)import (?P<module>[\w.]+) as (?P<alias>\w+)\s*$")


def _has(module: str, name: str) -> bool:
    if module == "optimizer_test_util":
        return True
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return False
    if hasattr(mod, name):
        return True
    try:
        importlib.import_module(f"{module}.{name}")
    except ImportError:
        return False
    return True


def _statements(text: str) -> list[str]:
    """The file's lines with backslash- and parenthesis-continued import statements joined."""
    out: list[str] = []
    pending = ""
    for line in text.splitlines():
        if pending:
            pending += " " + line.strip()
        elif line.lstrip().startswith(("from ", "import ")):
            pending = line.rstrip()
        else:
            out.append(line)
            continue
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
        elif pending.count("(") > pending.count(")"):
            continue
        else:
            out.append(pending)
            pending = ""
    return out


def rewrite(text: str, dropped: list[str]) -> str:
    """`text` with its Caffe2 imports pointed at graphpar; appends each dropped name to `dropped`."""
    lines = []
    for line in _statements(text):
        match = _FROM.match(line)
        if match and match["module"] in IMPORTS:
            target = IMPORTS[match["module"]]
            names = [n.strip() for n in match["names"].strip("()").split(",") if n.strip()]
            kept = [n for n in names if target is not None and _has(target, n.split(" as ")[0])]
            dropped += [f"{match['module']}.{n}" for n in names if n not in kept]
            line = f"{match['indent']}from {target} import {', '.join(kept)}" if kept else f"{match['indent']}pass"
        match = _IMPORT.match(line)
        if match and match["module"] in IMPORTS:
            line = f"{match['indent']}import {IMPORTS[match['module']]} as {match['alias']}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    args, pytest_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    if not args:
        print(__doc__)
        return 2
    source = Path(args[0])
    out = Path(args[1]) if len(args) > 1 else Path(tempfile.mkdtemp(prefix="caffe2_tests_"))
    out.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        dropped: list[str] = []
        (out / name).write_text(rewrite((source / name).read_text(), dropped))
        if dropped:
            print(f"{name}: graphpar has no {', '.join(sorted(set(dropped)))}")
    (out / "conftest.py").write_text("")  # rootdir for pytest; no fixtures
    tests = [str(out / n) for n in FILES if n.endswith("_test.py")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.call([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", "-q",
                            "--rootdir", str(out), *pytest_args, *tests], cwd=out, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
