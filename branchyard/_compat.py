"""Feature detection across the torch versions we support (2.11 on the GPU
machine, 2.14 as the target). Import-time safe on both."""

from __future__ import annotations

import torch

TORCH_VERSION: tuple[int, int] = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])  # type: ignore[assignment]

#: ``torch.ops.higher_order.switch`` exists from torch 2.14 on.
HAS_SWITCH: bool = hasattr(torch.ops.higher_order, "switch")


def switch_op():
    """The switch higher-order operator, or a clear error where torch lacks it."""
    if not HAS_SWITCH:
        from branchyard.errors import UnsupportedGraphError

        raise UnsupportedGraphError(
            f"torch {torch.__version__} has no torch.ops.higher_order.switch",
            hint="switch needs torch >= 2.14; use branchyard.passes.switch_to_cond for older runtimes",
        )
    return torch.ops.higher_order.switch
