"""Caffe2's execution plans run in the current workspace: `RunPlan` and `RunPlanInBackground`
(re-exported by `graphpar.workspace`)."""

from __future__ import annotations

import threading
from typing import Any

from graphpar.caffe2.plan import ExecutionStep, Plan
from graphpar.runtime.workspace import CurrentWorkspace, WorkspaceGuard, _as_netdef, get_workspace


def RunPlan(plan_or_step: Any) -> bool:  # noqa: N802
    """Run a Caffe2 execution plan in the current workspace: a core.Plan or ExecutionStep, a
    caffe2_pb2.PlanDef, or its serialized bytes (needs protobuf). Each step runs its networks, then its
    sub-steps, `num_iter` times (once if unset); returns True. Raises NotImplementedError for the
    step features graphpar does not run (stop criteria, report nets, concurrent sub-steps)."""
    from graphpar.caffe2.proto import caffe2_pb2  # needs protobuf

    if isinstance(plan_or_step, ExecutionStep):
        plan_or_step = Plan(plan_or_step)
    if isinstance(plan_or_step, Plan):
        plan_or_step = plan_or_step.Proto()
    plan = caffe2_pb2.PlanDef.FromString(plan_or_step) if isinstance(plan_or_step, (bytes, bytearray)) \
        else plan_or_step
    nets = {net.name: _as_netdef(net) for net in plan.network}
    ws = get_workspace()

    def run(step: Any) -> None:
        unsupported = [f for f in ("criteria_network", "report_net", "should_stop_blob", "concurrent_substeps",
                                   "run_every_ms", "create_workspace", "only_once") if step.HasField(f)]
        if unsupported:
            raise NotImplementedError(f"RunPlan: step {step.name!r} uses {unsupported}, which graphpar does "
                                      f"not run; loop over RunNet in Python instead")
        for _ in range(step.num_iter if step.HasField("num_iter") else 1):
            for name in step.network:
                if name not in ws.nets:
                    ws.create_net(nets[name])
                ws.run_net(name)
            for sub in step.substep:
                run(sub)

    for step in plan.execution_step:
        run(step)
    return True


class _BackgroundPlan:
    """RunPlanInBackground's handle: `is_done()`, `is_succeeded()` and `wait()`."""

    def __init__(self, plan: Any) -> None:
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(plan, CurrentWorkspace()), daemon=True)
        self._thread.start()

    def _run(self, plan: Any, workspace_name: str) -> None:
        try:
            with WorkspaceGuard(workspace_name):
                RunPlan(plan)
        except BaseException as exc:  # noqa: BLE001 - reported through is_succeeded
            self._error = exc

    def is_done(self) -> bool:
        return not self._thread.is_alive()

    def is_succeeded(self) -> bool:
        return self.is_done() and self._error is None

    def wait(self) -> None:
        """Block until the plan has run; re-raise its error, if any."""
        self._thread.join()
        if self._error is not None:
            raise self._error


def RunPlanInBackground(plan_or_step: Any) -> _BackgroundPlan:  # noqa: N802
    """RunPlan on a background thread; returns a handle with is_done() / is_succeeded()."""
    return _BackgroundPlan(plan_or_step)
