"""What a process started by an elastic agent (`python -m graphpar.launch`, torchrun) knows about its job
across restarts: how often the agent restarted it, the job's id, and which checkpoints the job wrote.

With `--max-restarts N` the agent starts the whole group again when a process dies; the new processes
see TORCHELASTIC_RESTART_COUNT > 0 and should continue from the last checkpoint their job wrote, as
`resume_or_load(resume=True)` would, not start over and not continue a checkpoint some other run left
in the same place. graphpar's trainers mark their checkpoints with the job's id (TORCHELASTIC_RUN_ID:
a fresh one per `python -m graphpar.launch` on one machine, `--rdzv-id` across machines) and, once
restarted, continue from the last one marked with theirs.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from graphpar.errors import CheckpointError

__all__ = ["JOB_KEY", "job_id", "job_metadata", "last_of_this_job", "restart_count", "written_by_this_job"]

JOB_KEY = "job"  # a checkpoint's metadata: the id of the job that wrote it


def restart_count() -> int:
    """How many times the agent has restarted this process's group (TORCHELASTIC_RESTART_COUNT, else 0)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


def job_id() -> str | None:
    """The id of the job this process belongs to (TORCHELASTIC_RUN_ID), None when no agent started it."""
    return os.environ.get("TORCHELASTIC_RUN_ID") or None


def job_metadata() -> dict[str, Any]:
    """What a checkpoint's metadata records of this job: {JOB_KEY: its id}, or {} outside an agent."""
    found = job_id()
    return {JOB_KEY: found} if found is not None else {}


def written_by_this_job(path: str | os.PathLike[str]) -> bool:
    """Whether checkpoint `path` exists and was written by this job (its metadata has this job's id)."""
    from graphpar.runtime import checkpoint  # torch: only when asked (the launcher imports this module)

    found = job_id()
    if found is None or not Path(path).is_file():
        return False
    try:
        return checkpoint.read_metadata(path).get("metadata", {}).get(JOB_KEY) == found
    except CheckpointError:  # unreadable: no checkpoint of this job's (a torn write cannot be: saves are atomic)
        return False


def last_of_this_job(paths: Iterable[str | os.PathLike[str]]) -> Path | None:
    """The last of `paths` (in their order: oldest first) that this job wrote, if any."""
    mine = [Path(p) for p in paths if written_by_this_job(p)]
    return mine[-1] if mine else None
