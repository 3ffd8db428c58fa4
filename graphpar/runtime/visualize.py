"""Draw a net: Graphviz DOT text, and SVG/PNG files when Graphviz is installed.

`net_to_dot(net)` returns a DOT digraph. With `show_blobs=True` (the default) ops are boxes labelled
with type, index and device, blobs are ellipses, data inputs and outputs are solid edges and control
inputs dashed ones. With `show_blobs=False` only ops are drawn, joined by the dependency edges of
`graphpar.core.graph.dependency_graph` (read-after-write solid, dashed when the read is a control input;
write-after-write and write-after-read dotted). Gradient ops are red, communication ops (those with
Trait.CROSS_DEVICE, i.e. collectives and copies, and any op that touches blobs of several replicas,
such as the all-reduce `Sum`s) blue. When a net spans several replica scopes (`gpu_0/`, `cpu_1/`, ...),
each gets a cluster holding its ops and blobs; unscoped and cross-replica ones stay outside.

`render(net, "net.svg")` writes `net.dot` and runs Graphviz's `dot` on it (without a shell).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

from graphpar.core.graph import dependency_graph
from graphpar.core.ir import DeviceOption, NetDef, OperatorDef
from graphpar.core.naming import parse_device_scope
from graphpar.core.schema import Trait, has_trait

RENDER_FORMATS = ("svg", "png", "pdf")
_FILL = {"forward": "#ffffff", "gradient": "#f4cccc", "communication": "#c9daf8"}
_DEPENDENCY_STYLE = {"raw": "solid", "waw": "dotted", "war": "dotted"}
_RENDER_TIMEOUT_S = 300


def device_label(option: DeviceOption) -> str:
    """A short device name, torch style: 'cpu:0', 'cuda:1'."""
    return f"{option.device_type.name.lower()}:{option.device_id}"


def quote(text: str) -> str:
    """`text` as a DOT quoted string: backslashes and double quotes escaped, newlines as DOT's `\\n`."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\r", "")
    return '"' + escaped.replace("\n", "\\n") + '"'


def op_kind(op: OperatorDef) -> str:
    """'communication' (an op that moves data between devices, Trait.CROSS_DEVICE, or touches several
    replicas' blobs), 'gradient' or 'forward'."""
    if has_trait(op, Trait.CROSS_DEVICE) or len(_op_scopes(op)) > 1:
        return "communication"
    return "gradient" if op.is_gradient_op else "forward"


def net_to_dot(net_or_netdef: Any, name: str | None = None, show_blobs: bool = True) -> str:
    """The DOT digraph of a net (see the module docstring for what is drawn).

    Args:
        net_or_netdef: a `Net` (anything with `.Proto()`) or a `NetDef`.
        name: the graph's name and title (default: the net's name).
        show_blobs: draw blobs and their edges; if False, only ops and their dependency edges.

    Raises:
        TypeError: `net_or_netdef` is neither a Net nor a NetDef.
    """
    netdef = _as_netdef(net_or_netdef)
    title = netdef.name if name is None else name
    scopes = sorted({scope for op in netdef.ops for scope in _op_scopes(op)})
    clustered = len(scopes) > 1
    body: dict[tuple[str, int] | None, list[str]] = {None: [], **{scope: [] for scope in scopes}}

    for index, op in enumerate(netdef.ops):
        op_scopes = _op_scopes(op)
        home = next(iter(op_scopes)) if clustered and len(op_scopes) == 1 else None
        body[home].append(_op_node(netdef, index, op))
    edges: list[str] = []
    if show_blobs:
        blob_ids = _blob_ids(netdef)
        for blob, node in blob_ids.items():
            home = parse_device_scope(blob) if clustered else None
            body[home].append(f"{node} [shape=ellipse, label={quote(blob)}];")
        for index, op in enumerate(netdef.ops):
            edges += [f"{blob_ids[b]} -> op_{index};" for b in dict.fromkeys(op.inputs)]
            edges += [f"{blob_ids[b]} -> op_{index} [style=dashed];" for b in dict.fromkeys(op.control_inputs)]
            edges += [f"op_{index} -> {blob_ids[b]};" for b in dict.fromkeys(op.outputs)]
    else:
        for i, j, data in dependency_graph(netdef).edges(data=True):
            style = _DEPENDENCY_STYLE[data["kind"]]
            if data["kind"] == "raw" and data["blob"] not in netdef.ops[j].inputs:
                style = "dashed"  # the read is a control input
            edges.append(f"op_{i} -> op_{j} [style={style}, tooltip={quote(data['kind'] + ' ' + data['blob'])}];")

    lines = [f"digraph {quote(title)} {{", f"  label={quote(title)};", "  labelloc=t;",
             '  node [fontname="Helvetica", fontsize=10];']
    for k, scope in enumerate(scopes if clustered else []):
        lines += [f"  subgraph cluster_{k} {{", f"    label={quote(f'{scope[0]}_{scope[1]}/')};",
                  "    style=rounded;", *(f"    {line}" for line in body[scope]), "  }"]
    lines += [f"  {line}" for line in body[None] + edges]
    lines.append("}")
    return "\n".join(lines) + "\n"


def render(net_or_netdef: Any, path: str | Path, format: str | None = None) -> Path:
    """Write the net's DOT file and, unless only DOT was asked for, render it with Graphviz.

    The DOT file is `path` with suffix `.dot`. The rendered format is `format`, else `path`'s suffix
    (`.svg`, `.png`, `.pdf`); a `.dot` (or no) suffix and no `format` writes only the DOT file.
    Returns the path of the file asked for (the rendered one, or the DOT file).

    Args:
        net_or_netdef: a `Net` or a `NetDef`.
        path: where to write; its suffix picks the format unless `format` is given.
        format: 'svg', 'png' or 'pdf'.

    Raises:
        ValueError: the format is not one of RENDER_FORMATS (checked before anything is written).
        TypeError: `net_or_netdef` is neither a Net nor a NetDef.
        RuntimeError: Graphviz's `dot` is not installed (the DOT file is still written; the message
            names it and how to install Graphviz), or it failed.
    """
    path = Path(path)
    fmt = (format or path.suffix.removeprefix(".")).lower()
    if fmt in ("", "dot", "gv"):
        fmt = ""
    elif fmt not in RENDER_FORMATS:
        raise ValueError(f"render({str(path)!r}): cannot render format {fmt!r}; use one of "
                         f"{', '.join(RENDER_FORMATS)} (or a .dot path for DOT text only)")
    dot_text = net_to_dot(net_or_netdef)
    dot_path = path.with_suffix(".dot")
    dot_path.write_text(dot_text, encoding="utf-8")
    if not fmt:
        return dot_path
    out_path = path if path.suffix.lower() == f".{fmt}" else path.with_suffix(f".{fmt}")
    executable = shutil.which("dot")
    if executable is None:
        raise RuntimeError(f"render: wrote {str(dot_path)!r}, but Graphviz's 'dot' executable was not found, "
                           f"so no {fmt.upper()} was made. Install Graphviz (e.g. 'apt-get install graphviz' "
                           f"or 'brew install graphviz') and retry, or run "
                           f"'dot -T{fmt} {dot_path} -o {out_path}' yourself.")
    result = subprocess.run([executable, f"-T{fmt}", str(dot_path), "-o", str(out_path)],
                            capture_output=True, text=True, check=False, timeout=_RENDER_TIMEOUT_S)
    if result.returncode != 0:
        raise RuntimeError(f"render: Graphviz failed (exit {result.returncode}) on {str(dot_path)!r}: "
                           f"{result.stderr.strip() or result.stdout.strip()}")
    return out_path


def _as_netdef(net: Any) -> NetDef:
    if isinstance(net, NetDef):
        return net
    if hasattr(net, "Proto"):
        return net.Proto()
    raise TypeError(f"expected a Net or a NetDef, got {type(net).__name__}: {net!r:.80}")


def _op_scopes(op: OperatorDef) -> set[tuple[str, int]]:
    """The replica scopes (('gpu', 0), ...) of the blobs an op reads or writes."""
    found = (parse_device_scope(b) for b in (*op.inputs, *op.control_inputs, *op.outputs))
    return {scope for scope in found if scope is not None}


def _op_node(netdef: NetDef, index: int, op: OperatorDef) -> str:
    title = f"{op.type} #{index}" + (f" ({op.name})" if op.name else "")
    label = f"{title}\n{device_label(netdef.op_device(op))}"
    return f"op_{index} [shape=box, style=filled, fillcolor={quote(_FILL[op_kind(op)])}, label={quote(label)}];"


def _blob_ids(netdef: NetDef) -> dict[str, str]:
    """{blob: node id}, numbered in order of first use (ids stay valid whatever the names hold)."""
    ids: dict[str, str] = {}
    for op in netdef.ops:
        for blob in (*op.inputs, *op.control_inputs, *op.outputs):
            if blob not in ids:
                ids[blob] = f"blob_{len(ids)}"
    return ids
