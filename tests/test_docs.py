"""Every ```python block of README.md and docs/*.md runs as written (docs/extending.md#docs-whose-code-runs).

The blocks of one file run in order, in one fresh interpreter (so an op a block registers, or the
workspace it fills, cannot leak into other tests), sharing one namespace, in a temporary directory.
A block whose first line starts with `# In a fresh process` starts a new interpreter (in the same
directory, so it sees the files earlier blocks wrote, not their namespace or workspace).
A block whose first line is `# needs: N processes` runs on its own, as a script, under
`python -m graphpar.launch --nproc-per-node N`; `# needs: a GPU` runs on its own when CUDA is
available; `# needs: package yacs` (or several, comma-separated: `package a, b`) runs on its own where
those optional packages are installed and is skipped, naming them, elsewhere; any other
`# needs: ...` is skipped with that reason. A document whose every block needs optional packages says
so in a line `<!-- needs: package a, b -->`: its plain blocks are skipped, naming them, where one is
missing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(?P<indent>[ \t]*)```python[ \t]*\n(?P<code>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
NEEDS = re.compile(r"#\s*needs:\s*(?P<what>.+?)\s*$")
FRESH = re.compile(r"#\s*in a fresh process\b", re.I)
PROCESSES = re.compile(r"(?P<n>\d+) processes")
PACKAGES = re.compile(r"package (?P<modules>[\w.]+(?:, *[\w.]+)*)")
DOC_NEEDS = re.compile(r"^<!-- needs: (?P<what>.+?) -->$", re.M)
TIMEOUT = 600


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    code: str
    needs: str | None  # what the block's first line says it needs
    fresh: bool = False  # its first line says it runs in a fresh process

    @property
    def doc(self) -> str:
        return str(self.path.relative_to(ROOT)) if self.path.is_relative_to(ROOT) else self.path.name

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The ```python blocks of a Markdown file, dedented (a block may sit in a list item)."""
    text = path.read_text()
    found = []
    for match in FENCE.finditer(text):
        code = textwrap.dedent(match.group("code"))
        first = code.lstrip().splitlines()[0] if code.strip() else ""
        needs = NEEDS.fullmatch(first.strip())
        found.append(Block(path, text.count("\n", 0, match.start()) + 1, code,
                           needs.group("what") if needs else None, FRESH.match(first.strip()) is not None))
    return found


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "MPLBACKEND": "Agg"}


def _script(blocks_: list[Block]) -> str:
    """A program that runs the blocks in order in one namespace; a failure names the block's line."""
    calls = "\n".join(f"run({b.code!r}, {b.doc!r}, {b.line})" for b in blocks_)
    return ("namespace = {'__name__': '__main__'}\n"
            "def run(code, doc, fence):  # a traceback names the doc's own line numbers\n"
            "    exec(compile('\\n' * fence + code, doc, 'exec'), namespace)\n" + calls + "\n")


def _run(command: list[str], cwd: Path, what: str) -> None:
    done = subprocess.run(command, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, (f"{what} failed (exit status {done.returncode}):\n{done.stdout[-3000:]}\n"
                                  f"{done.stderr[-6000:]}")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _cases() -> list:
    cases = []
    for path in DOCS:
        found = blocks(path)
        plain = [b for b in found if b.needs is None]
        if plain:
            cases.append(pytest.param(plain, id=str(path.relative_to(ROOT))))
        cases.extend(pytest.param([b], id=b.where, marks=pytest.mark.slow) for b in found if b.needs is not None)
    return cases


@pytest.mark.parametrize("docs_blocks", _cases())
def test_python_blocks_run(docs_blocks: list[Block], tmp_path: Path) -> None:
    run_blocks(docs_blocks, tmp_path)


def _processes(plain: list[Block]) -> list[list[Block]]:
    """The plain blocks grouped by interpreter: a `# In a fresh process` block starts a new group."""
    groups: list[list[Block]] = []
    for block in plain:
        if block.fresh or not groups:
            groups.append([])
        groups[-1].append(block)
    return groups


def run_blocks(docs_blocks: list[Block], tmp_path: Path) -> None:
    """Run one file's plain blocks together, or one `# needs:` block (see the module docstring)."""
    first = docs_blocks[0]
    script = tmp_path / "blocks.py"
    if first.needs is None:
        missing = doc_missing_packages(first.path)
        if missing:
            pytest.skip(f"{first.doc} needs {', '.join(missing)} (not installed)")
        for group in _processes(docs_blocks):
            script.write_text(_script(group))
            _run([sys.executable, str(script)], tmp_path, f"{first.doc} (from line {group[0].line})")
        return
    script.write_text(first.code)
    processes = PROCESSES.fullmatch(first.needs)
    if processes:
        _run([sys.executable, "-m", "graphpar.launch", "--nproc-per-node", processes.group("n"), str(script)],
             tmp_path, f"{first.where} under the launcher")
    elif first.needs == "a GPU" and _cuda():
        _run([sys.executable, str(script)], tmp_path, first.where)
    elif PACKAGES.fullmatch(first.needs):
        missing = missing_packages(first)
        if missing:
            pytest.skip(f"{first.where} needs {', '.join(missing)} (not installed)")
        _run([sys.executable, str(script)], tmp_path, first.where)
    else:
        pytest.skip(f"{first.where} needs {first.needs}")


def missing_packages(block: Block) -> list[str]:
    """The optional packages a `# needs: package ...` block names that are not installed."""
    return _missing(block.needs or "")


def doc_missing_packages(path: Path) -> list[str]:
    """The optional packages a document's `<!-- needs: package ... -->` line names that are not installed."""
    named = DOC_NEEDS.search(path.read_text())
    return _missing(named.group("what")) if named else []


def _missing(needs: str) -> list[str]:
    from tests.optional import installed

    named = PACKAGES.fullmatch(needs)
    return [m.strip() for m in named.group("modules").split(",") if not installed(m.strip())] if named else []


def test_a_block_that_needs_a_package_runs_where_it_is_installed(tmp_path: Path) -> None:
    doc = tmp_path / "pkg.md"
    doc.write_text("```python\n# needs: package json, email.mime\nimport json\nprint(json.dumps(1))\n```\n"
                   "```python\n# needs: package json, no_such_package_here\nraise SystemExit(1)\n```\n")
    runs, absent = blocks(doc)
    assert missing_packages(runs) == [] and missing_packages(absent) == ["no_such_package_here"]
    run_blocks([runs], tmp_path)
    with pytest.raises(pytest.skip.Exception, match="pkg.md:6 needs no_such_package_here"):
        run_blocks([absent], tmp_path)
    doc.write_text("<!-- needs: package json, no_such_package_here -->\n```python\nraise SystemExit(1)\n```\n")
    assert doc_missing_packages(doc) == ["no_such_package_here"]
    with pytest.raises(pytest.skip.Exception, match="pkg.md needs no_such_package_here"):
        run_blocks(blocks(doc), tmp_path)


def test_no_block_imports_the_repositorys_tests() -> None:
    """A reader runs the blocks outside this checkout, where the `tests` package is not installed."""
    found = [b.where for path in DOCS for b in blocks(path)
             if re.search(r"^\s*(from|import)\s+tests\b", b.code, re.M)]
    assert not found, f"blocks importing the repository's tests package: {found}"


def test_the_extractor_reads_indented_blocks_and_needs(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text("text\n```python\nx = 1\n```\n- item:\n\n  ```python\n  # needs: 2 processes\n  y = 2\n  ```\n"
                   "```\nnot python\n```\n```python\n# In a fresh process: z\nz = 3\n```\n")
    found = blocks(doc)
    assert [(b.line, b.code, b.needs, b.fresh) for b in found] == [
        (2, "x = 1\n", None, False), (7, "# needs: 2 processes\ny = 2\n", "2 processes", False),
        (14, "# In a fresh process: z\nz = 3\n", None, True)]


def test_a_fresh_process_block_sees_the_files_not_the_namespace(tmp_path: Path) -> None:
    doc = tmp_path / "fresh.md"
    doc.write_text("```python\nimport os\nvalue = os.getpid()\nopen('pid', 'w').write(str(value))\n```\n"
                   "```python\n# In a fresh process\nimport os\nassert 'value' not in globals()\n"
                   "assert open('pid').read() != str(os.getpid())\n```\n")
    run_blocks(blocks(doc), tmp_path)
    (tmp_path / "pid").write_text(str(os.getpid()))
    doc.write_text(doc.read_text().replace("# In a fresh process\n", ""))
    with pytest.raises(AssertionError, match="'value' not in globals"):
        run_blocks(blocks(doc), tmp_path)


def test_a_failing_block_fails_the_test(tmp_path: Path) -> None:
    doc = tmp_path / "bad.md"
    doc.write_text("```python\nvalue = 1\n```\n\n```python\nprint(value)\nundefined_name\n```\n")
    with pytest.raises(AssertionError, match=r"(?s)File \"bad.md\", line 7, .*NameError: name 'undefined_name' is not defined"):
        run_blocks(blocks(doc), tmp_path)
