"""The largest value a size in a traced graph can take.

A size in a node's fake value is an ``int`` or, for a dynamic dim, a
``torch.SymInt`` whose symbols carry the ranges the trace asserted (a
:class:`~branchyard.shapes.ShapeVar`'s ``min``/``max``). A decision made once
for a whole graph -- "is this tensor small enough for a one-block kernel?" --
needs the size's upper bound over every shape the graph will run with::

    upper_bound(6)                         == 6
    upper_bound(x.numel() + 2048)          == 256 * 64 + 2048   # x: (u0, 256), u0 in [1, 64]
    upper_bound(y.numel())                 is None              # a symbol with no upper bound
"""

from __future__ import annotations

from typing import Any

import sympy
import torch

__all__ = ["upper_bound"]


def upper_bound(size: Any) -> int | None:
    """``size`` if it is an ``int``; for a ``torch.SymInt`` the largest value its
    expression takes over its symbols' ranges; None when that is unbounded or
    ``size`` is neither."""
    if isinstance(size, bool):
        return None
    if isinstance(size, int):
        return size
    if not isinstance(size, torch.SymInt):
        return None
    node = size.node
    if node.is_nested_int():
        return None
    bound = node.shape_env.bound_sympy(node.expr).upper
    return int(bound) if isinstance(bound, sympy.Integer) else None  # not torch's int_oo nor sympy's oo
