"""The executor: `compile_net` builds a Plan once at CreateNet; `run` executes it on every RunNet."""

from graphpar.executor.plan import Plan, Step, compile_net
from graphpar.executor.simple import run

__all__ = ["Plan", "Step", "compile_net", "run"]
