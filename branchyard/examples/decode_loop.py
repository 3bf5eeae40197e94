"""An LLM-style decode loop with expert dispatch: the program ``branchyard.compile`` is for.

``torch.while_loop`` over steps; each step routes the batch through one of
``n`` expert MLPs (Linear d→h, erf-GELU, Linear h→d, residual) picked by a
router's argmax through an ``idx == k`` chain of ``n - 1`` nested
``torch.cond``, then RMS-normalises. Semantics, as Python::

    def forward(x, steps):
        i = 0
        while i < steps:
            idx = argmax(mean(x, 0) @ router)
            e = experts[idx]
            x = rms_norm(x + e.down(gelu(e.up(x))))
            i += 1
        return i, x

    >>> import torch
    >>> from branchyard.examples.decode_loop import DecodeLoop
    >>> m = DecodeLoop(dim=8, hidden=16, num_experts=3)
    >>> steps, y = m(torch.randn(2, 8), torch.tensor(4))
    >>> int(steps), tuple(y.shape)
    (4, (2, 8))
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["DecodeLoop", "Expert"]


class Expert(nn.Module):
    """``x + down(gelu(up(x)))``."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class DecodeLoop(nn.Module):
    """``steps`` decode steps, each dispatching to one of ``num_experts`` experts (see the module docstring)."""

    def __init__(self, dim: int = 1024, hidden: int = 4096, num_experts: int = 8, eps: float = 1e-6):
        super().__init__()
        if num_experts < 2:
            raise ValueError(f"num_experts must be at least 2, got {num_experts}")
        self.router = nn.Parameter(torch.randn(dim, num_experts) / dim**0.5)
        self.experts = nn.ModuleList(Expert(dim, hidden) for _ in range(num_experts))
        self.eps = eps

    def _dispatch(self, k: int, idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if k == len(self.experts) - 1:
            return self.experts[k](x)
        return torch.cond(
            idx == k,
            lambda idx, x: self.experts[k](x),
            lambda idx, x: self._dispatch(k + 1, idx, x),
            (idx, x),
        )

    def step(self, x: torch.Tensor) -> torch.Tensor:
        idx = torch.argmax(x.mean(0) @ self.router)
        y = self._dispatch(0, idx, x)
        # torch's cond gives its outputs fresh unbacked sizes when the batch is unbacked; the loop
        # carry must keep x's size, so say that they are equal.
        torch._check(y.shape[0] == x.shape[0])
        return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor, steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start = torch.zeros((), dtype=torch.int64, device=x.device)
        return torch._higher_order_ops.while_loop(
            lambda i, y: i < steps,
            lambda i, y: (i + 1, self.step(y)),
            (start, x),
        )
