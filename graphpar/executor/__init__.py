"""The engine: `compile_net` builds an immutable CompiledNet once at CreateNet; an executor, chosen by the
net's type (`registry`), runs it on every RunNet against a per-run frame (`frame`)."""

from graphpar.executor.plan import CompiledNet, Step, compile_net
from graphpar.executor.registry import Executor, get_executor, net_types, register_executor

__all__ = ["Executor", "CompiledNet", "Step", "compile_net", "get_executor", "net_types", "register_executor"]
