"""Caffe2's execution plans: `ExecutionStep` (nets and sub-steps run `num_iter` times) and `Plan` (its
steps), as `caffe2_pb2` ExecutionStep / PlanDef messages for `workspace.RunPlan`. Only the plain
sequential form is supported (no stop criteria, report nets or concurrent sub-steps); a Python loop
over `workspace.RunNet` does the same."""

from __future__ import annotations

from typing import Any

from graphpar.core.net import Net


class ExecutionStep:
    """Run `nets` (a Net or a list), then the sub-steps, `num_iter` times (once when None)."""

    def __init__(self, name: str, nets: Net | list[Net] | None = None, num_iter: int | None = None) -> None:
        self._name, self._num_iter = str(name), num_iter
        self._nets: list[Net] = []
        self._substeps: list[ExecutionStep] = []
        for net in nets if isinstance(nets, (list, tuple)) else ([] if nets is None else [nets]):
            self.AddNet(net)

    def Name(self) -> str:  # noqa: N802 - Caffe2 names
        return self._name

    def AddNet(self, net: Net) -> None:  # noqa: N802
        if not isinstance(net, Net):
            raise TypeError(f"ExecutionStep {self._name!r}: nets must be Nets, got {type(net).__name__}")
        self._nets.append(net)

    def AddSubstep(self, substep: ExecutionStep) -> None:  # noqa: N802
        self._substeps.append(substep)

    def SetIter(self, num_iter: int) -> None:  # noqa: N802
        self._num_iter = num_iter

    def Nets(self) -> list[Net]:  # noqa: N802
        """This step's nets and its sub-steps', each once, in order."""
        nets = list(self._nets)
        for sub in self._substeps:
            nets += [n for n in sub.Nets() if n not in nets]
        return nets

    def Substeps(self) -> list[ExecutionStep]:  # noqa: N802
        return list(self._substeps)

    def Proto(self) -> Any:  # noqa: N802
        """A caffe2_pb2.ExecutionStep (needs protobuf)."""
        from graphpar.caffe2.proto import caffe2_pb2

        step = caffe2_pb2.ExecutionStep(name=self._name, network=[n.Name() for n in self._nets])
        if self._num_iter is not None:
            step.num_iter = int(self._num_iter)
        step.substep.extend(sub.Proto() for sub in self._substeps)
        return step


class Plan:
    """Caffe2's Plan: named, with execution steps (a Plan made from a step takes its name)."""

    def __init__(self, name_or_step: str | ExecutionStep) -> None:
        self._steps: list[ExecutionStep] = []
        if isinstance(name_or_step, ExecutionStep):
            self._name = name_or_step.Name()
            self.AddStep(name_or_step)
        else:
            self._name = str(name_or_step)

    def Name(self) -> str:  # noqa: N802
        return self._name

    def AddStep(self, step: ExecutionStep) -> None:  # noqa: N802
        if not isinstance(step, ExecutionStep):
            raise TypeError(f"Plan {self._name!r}: AddStep needs an ExecutionStep, got {type(step).__name__}")
        self._steps.append(step)

    def Steps(self) -> list[ExecutionStep]:  # noqa: N802
        return list(self._steps)

    def Nets(self) -> list[Net]:  # noqa: N802
        nets: list[Net] = []
        for step in self._steps:
            nets += [n for n in step.Nets() if n not in nets]
        return nets

    def Proto(self) -> Any:  # noqa: N802
        """A caffe2_pb2.PlanDef holding its nets and steps (needs protobuf)."""
        from graphpar.caffe2.proto import caffe2_pb2
        from graphpar.caffe2.proto.convert import to_proto

        plan = caffe2_pb2.PlanDef(name=self._name)
        plan.network.extend(to_proto(net.Proto()) for net in self.Nets())
        plan.execution_step.extend(step.Proto() for step in self._steps)
        return plan
