"""Small blocks the CPU tests of the nvgemm program race rewrite (imported by
test modules of this folder)."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """Two chains: ``silu(fc1(x))`` and ``fc2(.) + x``."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)

    def forward(self, x):
        return self.fc2(torch.nn.functional.silu(self.fc1(x))) + x


class AttnProj(nn.Module):
    """q, k, v of one input, concatenated (siblings the pass merges), and ``x + o(h)``."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x, h):
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1), x + self.o(h)
