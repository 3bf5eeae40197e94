"""Test models that read a train-mode batch norm's running statistics before it updates them.

torch's batch-norm schema marks no argument written, yet it writes its running
statistics in place (``branchyard.fx.mutation.UNMARKED_WRITES``): a read before it
must see the values from before the update, as eager does. Shared by the CPU tests
of Inductor regions and the GPU tests of the CUDA-graph lowering.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class GatedByRunningMean(torch.nn.Module):
    """``cond(rm[-1] > 0.5, ...)`` on the statistics a train-mode batch norm then updates:
    eager takes the false branch on the first call (0 > 0.5), the true one after (5 > 0.5)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("rm", torch.zeros(3))
        self.register_buffer("rv", torch.ones(3))

    def forward(self, data, x):
        p = self.rm[-1] > 0.5
        h = F.batch_norm(data, self.rm, self.rv, training=True)
        return torch.cond(p, lambda t: t + 1, lambda t: t - 1, (x + h.mean(),))
