"""Detectron2's learning-rate schedules: BASE_LR's multiplier at each iteration, as its current
`build_lr_scheduler` computes it.

Detectron2 wraps a schedule of fvcore's in `WarmupParamScheduler` and evaluates it at
`where = iteration / MAX_ITER` (`LRMultiplier`). The schedule is a multi-step one
(`WarmupMultiStepLR`: GAMMA ** (the STEPS passed)), a cosine from 1 to BASE_LR_END / BASE_LR
(`WarmupCosineLR`) or GAMMA ** k over NUM_DECAYS + 1 equal parts (`WarmupStepWithFixedGammaLR`).
The warmup covers the first WARMUP_ITERS iterations: linear from WARMUP_FACTOR times the schedule's
first value to the schedule's value where the warmup ends (not to 1: for the cosine that is its value
at WARMUP_ITERS), or constant at the first; after it the schedule runs on its own clock
(RESCALE_INTERVAL: restarted at the end of the warmup). The arithmetic is fvcore's, its 1e-6
`WHERE_EPSILON` included, so the values are Detectron2's to the last bit.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger(__name__)

Schedule = Callable[[float], float]  # where in [0, 1] -> value
WHERE_EPSILON = 1e-6  # fvcore's: a where this close below a boundary counts as past it
SCHEDULES = ("WarmupMultiStepLR", "WarmupCosineLR", "WarmupStepWithFixedGammaLR")


def multi_step(values: list[float], num_updates: int, milestones: list[int]) -> Schedule:
    """fvcore's MultiStepParamScheduler: values[k] from milestone k - 1 on (milestones in updates)."""
    def schedule(where: float) -> float:
        if where > 1.0:
            raise ValueError(f"the multi-step schedule ends at MAX_ITER ({num_updates} iterations); asked at "
                             f"{where * num_updates:g}")
        return values[bisect.bisect_right(milestones, int((where + WHERE_EPSILON) * num_updates))]
    return schedule


def cosine(start: float, end: float) -> Schedule:
    """fvcore's CosineParamScheduler: half a cosine from `start` (where 0) to `end` (where 1)."""
    return lambda where: end + 0.5 * (start - end) * (1 + math.cos(math.pi * where))


def linear(start: float, end: float) -> Schedule:
    """fvcore's LinearParamScheduler."""
    return lambda where: end * where + start * (1 - where)


def steps_of_equal_length(values: list[float]) -> Schedule:
    """fvcore's StepParamScheduler: `values` in equal parts of the training."""
    return lambda where: values[min(int((where + WHERE_EPSILON) * len(values)), len(values) - 1)]


def with_warmup(schedule: Schedule, factor: float, length: float, method: str, rescale: bool) -> Schedule:
    """Detectron2's WarmupParamScheduler: fvcore's CompositeParamScheduler of the warmup (rescaled to
    its `length`, a fraction of the training) then `schedule` (its own clock, or restarted: `rescale`)."""
    end, start = schedule(length), factor * schedule(0.0)
    warmup = linear(start, end) if method == "linear" else (lambda where: start)
    rest = 1.0 - length
    begins = (length + rest) - rest  # where fvcore's composite starts the schedule (its rounding kept)

    def composite(where: float) -> float:
        if where + WHERE_EPSILON <= length:
            return warmup(where / length)
        return schedule((where - begins) / rest if rescale else where)
    return composite


class LRMultiplier:
    """BASE_LR's multiplier at an iteration (see the module docstring), from SOLVER's settings.

    Stateless in the iteration: `state_dict` keeps its settings and the last iteration asked for,
    `load_state_dict` restores the iteration (and warns if the settings differ from the config's).

    Raises (at construction, ValueError): an unknown schedule or warmup method, STEPS that do not
    increase or reach MAX_ITER (steps past MAX_ITER are dropped with a warning, as Detectron2 does),
    BASE_LR_END / BASE_LR outside [0, 1], a GAMMA <= 0 or NUM_DECAYS < 1 for the fixed-gamma schedule,
    MAX_ITER < 1.
    """

    def __init__(self, name: str, max_iter: int, steps: tuple = (), gamma: float = 0.1,
                 warmup_factor: float = 0.001, warmup_iters: int = 0, warmup_method: str = "linear", *,
                 end_value: float = 0.0, num_decays: int = 3, rescale_interval: bool = False) -> None:
        self.settings: dict[str, Any] = {"name": name, "max_iter": max_iter, "steps": list(steps), "gamma": gamma,
                         "warmup_factor": warmup_factor, "warmup_iters": warmup_iters, "warmup_method": warmup_method,
                         "end_value": end_value, "num_decays": num_decays, "rescale_interval": bool(rescale_interval)}
        self._multiplier = with_warmup(_schedule(self.settings), warmup_factor, min(warmup_iters / max_iter, 1.0),
                                       _warmup_method(warmup_method), bool(rescale_interval))
        self.last_iter = -1

    def __call__(self, iteration: int) -> float:
        self.last_iter = iteration
        return self._multiplier(iteration / self.settings["max_iter"])

    def state_dict(self) -> dict[str, Any]:
        return {**self.settings, "last_iter": self.last_iter}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        settings = {k: v for k, v in state.items() if k != "last_iter"}
        if settings != self.settings:
            log.warning("LRMultiplier: the checkpoint's schedule %s differs from the config's %s; using the config's",
                        settings, self.settings)
        self.last_iter = int(state["last_iter"])


def _schedule(s: Mapping[str, Any]) -> Schedule:
    """The schedule `s["name"]` names, its settings checked."""
    name, max_iter = s["name"], s["max_iter"]
    if name not in SCHEDULES:
        raise ValueError(f"SOLVER.LR_SCHEDULER_NAME must be one of {', '.join(SCHEDULES)}, got {name!r}")
    if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 1:
        raise ValueError(f"SOLVER.MAX_ITER must be an int >= 1, got {max_iter!r}")
    if name == "WarmupCosineLR":
        if not 0.0 <= s["end_value"] <= 1.0:
            raise ValueError(f"SOLVER.BASE_LR_END / SOLVER.BASE_LR must be in [0, 1], got {s['end_value']}")
        return cosine(1.0, s["end_value"])
    if name == "WarmupStepWithFixedGammaLR":
        if not s["gamma"] > 0 or isinstance(s["num_decays"], bool) or not isinstance(s["num_decays"], int) \
                or s["num_decays"] < 1:
            raise ValueError(f"WarmupStepWithFixedGammaLR needs SOLVER.GAMMA > 0 and an int SOLVER.NUM_DECAYS >= 1, "
                             f"got {s['gamma']} and {s['num_decays']!r}")
        values = [1.0]
        for _ in range(s["num_decays"]):
            values.append(values[-1] * s["gamma"])  # fvcore multiplies, rather than raising to a power
        return steps_of_equal_length(values)
    steps = [x for x in s["steps"] if x <= max_iter]
    if len(steps) != len(s["steps"]):
        log.warning("SOLVER.STEPS %s has steps after SOLVER.MAX_ITER (%d); they are ignored", s["steps"], max_iter)
    if any(b <= a for a, b in zip([0, *steps], steps)) or (steps and steps[-1] >= max_iter):
        raise ValueError(f"SOLVER.STEPS must be increasing iterations in (0, MAX_ITER={max_iter}), got "
                         f"{tuple(s['steps'])}")
    if max_iter < len(steps) + 1:
        raise ValueError(f"SOLVER.MAX_ITER ({max_iter}) must be at least the number of LR values "
                         f"({len(steps) + 1})")
    return multi_step([s["gamma"] ** k for k in range(len(steps) + 1)], max_iter, steps)


def _warmup_method(method: str) -> str:
    if method not in ("linear", "constant"):
        raise ValueError(f"SOLVER.WARMUP_METHOD must be 'linear' or 'constant', got {method!r}")
    return method
