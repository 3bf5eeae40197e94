"""Graph analysis and validation of the CUDA-graph lowering (no GPU needed).

:func:`analyze` runs the VALIDATE phase of :mod:`.capture` on fake copies of the
example inputs: every loop body and branch, at any nesting depth, runs once on
fake tensors, and each control-flow site is checked before anything touches a
GPU. It raises a :class:`~branchyard.errors.BranchyardError` naming the node
(and the path of bodies leading to it) for

* a ``cond``/``while_loop`` predicate that is not a 0-d bool tensor on the device,
* a non-tensor loop carry, or a carry whose shape/dtype/device the body changes,
* branches of ``cond``/``switch`` that disagree in output shapes or dtypes,
* a random op inside a body or branch (a replay would repeat its numbers),
* a tensor on another device than the one lowered for (CPU tensors),
* anything that needs the host to read device values (``.item()``,
  data-dependent shapes), which no CUDA graph can replay,

and otherwise returns a :class:`ControlFlowReport`::

    >>> import torch
    >>> from branchyard.lowering.cuda_graph import analyze
    >>> class Count(torch.nn.Module):
    ...     def forward(self, x, n):
    ...         def cond_fn(i, y):
    ...             return i < n
    ...         def body_fn(i, y):
    ...             return i + 1, torch.cond(y.sum() > 0, lambda t: t * 2, lambda t: t - 1, (y,))
    ...         return torch._higher_order_ops.while_loop(cond_fn, body_fn, (torch.zeros((), dtype=torch.int64), x))
    >>> args = (torch.ones(4), torch.tensor(3))
    >>> report = analyze(torch.export.export(Count(), args), args)
    >>> report.counts, report.max_depth
    ({'while_loop': 1, 'cond': 1}, 2)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch.utils import _pytree as pytree

from branchyard.lowering.cuda_graph.capture import LoweringContext, Phase, _as_graph_module, validate

__all__ = ["ControlFlowSite", "ControlFlowReport", "analyze"]


@dataclass(frozen=True)
class ControlFlowSite:
    """One control-flow operator in the program: its kind, where it is, how deep."""

    kind: str
    where: str
    depth: int


@dataclass
class ControlFlowReport:
    """What :func:`analyze` found: every control-flow site, by kind and depth."""

    sites: list[ControlFlowSite] = field(default_factory=list)

    @property
    def counts(self) -> dict[str, int]:
        """Number of sites per operator kind, in order of first appearance."""
        out: dict[str, int] = {}
        for s in self.sites:
            out[s.kind] = out.get(s.kind, 0) + 1
        return out

    @property
    def max_depth(self) -> int:
        """1 for flat control flow, 2 for control flow inside a body, ... (0: none)."""
        return max((s.depth + 1 for s in self.sites), default=0)

    def conditional_nodes(self, if_else_one_node: bool = True) -> dict[str, int]:
        """Conditional nodes the capture creates (each site once; a body holds its nested nodes once)."""
        per_kind = {"while_loop": ("WHILE", 1), "switch": ("SWITCH", 1), "cond": ("IF", 1 if if_else_one_node else 2)}
        out: dict[str, int] = {}
        for s in self.sites:
            node, n = per_kind[s.kind]
            out[node] = out.get(node, 0) + n
        return out


def analyze(program: Any, example_inputs: Sequence[Any], *, device: str | torch.device | None = None) -> ControlFlowReport:
    """Validate ``program`` for the CUDA-graph lowering and list its control flow.

    ``device`` is the device every tensor must live on (``None``: don't check
    devices). Runs on fake tensors: no GPU and no real compute is needed.
    """
    ctx = LoweringContext(Phase.VALIDATE, torch.device(device) if device is not None else None)
    gm = _as_graph_module(program)
    validate(gm, list(pytree.tree_leaves(tuple(example_inputs))), ctx)
    return ControlFlowReport([ControlFlowSite(kind, where, depth) for kind, where, depth in ctx.sites])
