"""A stand-in for `torch.cuda.nccl` over CPU tensors, so the NCCL branch of the collectives runs here."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch


class FakeNccl:
    """Implements the three calls the collectives make, in place over a list of tensors, and counts them."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def is_available(self, tensors: Sequence[torch.Tensor]) -> bool:
        return len({id(t) for t in tensors}) == len(tensors)

    def all_reduce(self, tensors: Sequence[torch.Tensor]) -> None:
        self.calls["all_reduce"] += 1
        total = torch.stack([t.to(tensors[0].device) for t in tensors]).sum(0)
        for t in tensors:
            t.copy_(total)

    def broadcast(self, tensors: Sequence[torch.Tensor], root: int = 0) -> None:
        self.calls["broadcast"] += 1
        for t in tensors:
            t.copy_(tensors[root])
