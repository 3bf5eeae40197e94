"""Example programs with nested ``torch.cond``: the input ``cond_to_switch`` is for.

Two model families, both selecting one of ``n`` small ``nn.Linear`` experts by
a 0-d integer tensor ``idx``:

* :class:`ExpertDispatch` -- an ``idx == k`` chain, the shape a Python
  ``if/elif`` ladder exports to. ``n`` experts give ``n - 1`` nested conds::

      cond(idx == 0, e0, cond(idx == 1, e1, ... cond(idx == n-2, e[n-2], e[n-1])))

* :class:`CondTree` -- a balanced binary tree of depth ``d`` over ``2**d``
  experts, each level halving the index range::

      cond(idx < mid, <left half>, <right half>)      # 2**d - 1 conds

Semantics, as Python (an out-of-range ``idx`` falls through the chain to
its last expert, and down the tree to its nearest end)::

    y = experts[i if 0 <= (i := int(idx)) < n else n - 1](x)   # ExpertDispatch
    y = experts[min(max(int(idx), 0), 2**d - 1)](x)            # CondTree

:func:`export_example` traces either one with ``torch.export``;
:func:`example_program` builds the same graph directly (fast at any size) and
is what the CLI's ``example`` command writes as a ``.pt2``::

    >>> import torch
    >>> m = ExpertDispatch(num_experts=3, dim=4)
    >>> x = torch.randn(2, 4)
    >>> torch.equal(m(x, torch.tensor(2)), m.experts[2](x))
    True
    >>> m.num_conds, CondTree(depth=3, dim=4).num_conds
    (2, 7)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F
from torch.export import ExportedProgram

from branchyard.errors import BranchyardError

__all__ = [
    "ExpertDispatch",
    "CondTree",
    "EXAMPLES",
    "ExampleSpec",
    "build_example",
    "export_example",
    "example_inputs",
    "example_program",
    "save_example",
]


def _cond(pred: torch.Tensor, true_fn: Callable, false_fn: Callable, operands: tuple) -> torch.Tensor:
    # The cond HOP itself, not torch.cond's wrapper: the wrapper compiles each
    # call with dynamo, and nested calls re-trace the inner levels again and
    # again, so exporting an 8-expert chain took ~55 s (16 experts: hours).
    # The HOP traces each branch once. It does not lift closed-over tensors,
    # so the experts' parameters are passed as operands explicitly -- the
    # same operands torch.cond would have lifted.
    return torch.ops.higher_order.cond(pred, true_fn, false_fn, operands)


def _flat_params(experts: nn.ModuleList) -> list[torch.Tensor]:
    return [t for e in experts for t in (e.weight, e.bias)]


def _experts(count: int, dim: int, seed: int) -> nn.ModuleList:
    # A fixed seed so the shipped example is the same program on every machine.
    gen = torch.Generator().manual_seed(seed)
    experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(count))
    with torch.no_grad():
        for e in experts:
            e.weight.copy_(torch.randn(e.weight.shape, generator=gen) / dim**0.5)
            e.bias.copy_(torch.randn(e.bias.shape, generator=gen))
    return experts


class ExpertDispatch(nn.Module):
    """``experts[idx](x)`` written as an ``idx == k`` chain of nested ``torch.cond``.

    ``forward(x, idx)`` takes ``x`` of shape ``(batch, dim)`` and a 0-d int64
    ``idx``; an ``idx`` outside ``[0, num_experts)`` runs the last expert (the
    ``else`` of the ladder).
    """

    def __init__(self, num_experts: int = 8, dim: int = 16, seed: int = 0) -> None:
        super().__init__()
        if num_experts < 2:
            raise BranchyardError(
                f"ExpertDispatch needs at least 2 experts, got num_experts={num_experts}",
                hint="a single expert has no control flow to dispatch",
            )
        self.dim = dim
        self.experts = _experts(num_experts, dim, seed)

    @property
    def num_conds(self) -> int:
        """Number of ``torch.cond`` calls the exported chain holds."""
        return len(self.experts) - 1

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return self._from(0, x, idx, *_flat_params(self.experts))

    def _from(self, k: int, x: torch.Tensor, idx: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        # params: (weight, bias) of experts k, k+1, ..., n-1
        if k == len(self.experts) - 1:
            return F.linear(x, *params)
        return _cond(
            idx == k,
            lambda x, idx, *p: F.linear(x, p[0], p[1]),
            lambda x, idx, *p: self._from(k + 1, x, idx, *p[2:]),
            (x, idx, *params),
        )


class CondTree(nn.Module):
    """``experts[idx](x)`` as a balanced binary tree of ``torch.cond``, ``depth`` levels deep.

    Each cond tests ``idx < mid`` for the middle of its index range, so the
    tree has ``2**depth`` experts and ``2**depth - 1`` conds.
    """

    def __init__(self, depth: int = 3, dim: int = 16, seed: int = 0) -> None:
        super().__init__()
        if depth < 1:
            raise BranchyardError(
                f"CondTree needs depth >= 1, got depth={depth}",
                hint="depth 1 is a single cond over two experts",
            )
        self.depth = depth
        self.dim = dim
        self.experts = _experts(2**depth, dim, seed)

    @property
    def num_conds(self) -> int:
        """Number of ``torch.cond`` calls the exported tree holds."""
        return len(self.experts) - 1

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return self._range(0, len(self.experts), x, idx, *_flat_params(self.experts))

    def _range(self, lo: int, hi: int, x: torch.Tensor, idx: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        # params: (weight, bias) of experts lo, ..., hi-1
        if hi - lo == 1:
            return F.linear(x, *params)
        mid = (lo + hi) // 2
        split = 2 * (mid - lo)
        return _cond(
            idx < mid,
            lambda x, idx, *p: self._range(lo, mid, x, idx, *p[:split]),
            lambda x, idx, *p: self._range(mid, hi, x, idx, *p[split:]),
            (x, idx, *params),
        )


@dataclass(frozen=True)
class ExampleSpec:
    """One shipped example: its module, how its size knob reads, and the
    nested-cond shape (``split``, see :data:`branchyard.examples.builder.SPLITS`)."""

    name: str
    module: Callable[[int, int], nn.Module]
    num_experts: Callable[[int], int]
    split: str
    size_name: str
    default_size: int
    summary: str
    #: the largest size built (deeper nesting exhausts Python's recursion in
    #: torch's serializer; a tree doubles per level)
    max_size: int = 256


#: CLI name -> example. ``size`` is the expert count or the tree depth.
EXAMPLES: dict[str, ExampleSpec] = {
    spec.name: spec
    for spec in (
        ExampleSpec(
            "expert-dispatch",
            lambda size, dim: ExpertDispatch(num_experts=size, dim=dim),
            lambda size: size,
            "chain",
            "experts",
            8,
            "experts[idx](x) as an idx == k chain of nested torch.cond (size - 1 conds)",
            max_size=32,  # 31 conds nested in one another; from about 40, torch's serializer recurses too deep
        ),
        ExampleSpec(
            "cond-tree",
            lambda size, dim: CondTree(depth=size, dim=dim),
            lambda size: 2**size,
            "tree",
            "depth",
            3,
            "experts[idx](x) as a balanced binary torch.cond tree (2**size - 1 conds)",
            max_size=8,
        ),
    )
}


def _spec(name: str) -> ExampleSpec:
    try:
        return EXAMPLES[name]
    except KeyError:
        known = ", ".join(sorted(EXAMPLES))
        raise BranchyardError(f"unknown example {name!r}; known examples: {known}") from None


def build_example(name: str, size: int | None = None, dim: int = 16) -> nn.Module:
    """The eager module of example ``name`` (see :data:`EXAMPLES`)."""
    spec = _spec(name)
    return spec.module(spec.default_size if size is None else size, dim)


def example_inputs(module: nn.Module, batch: int = 4, idx: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, idx)`` inputs for an example module: ``x`` is ``(batch, dim)``."""
    gen = torch.Generator().manual_seed(1)
    return torch.randn(batch, module.dim, generator=gen), torch.tensor(idx)


def export_example(name: str, size: int | None = None, dim: int = 16) -> ExportedProgram:
    """Export example ``name`` with ``torch.export.export``.

    Tracing cost grows exponentially with the nesting depth (see
    :mod:`branchyard.examples.builder`); keep ``size`` small (<= 6 experts,
    depth <= 3) or use :func:`example_program`, which builds the same graph
    directly.
    """
    module = build_example(name, size, dim).eval()
    with torch.no_grad():
        return torch.export.export(module, example_inputs(module))


def example_program(name: str, size: int | None = None, dim: int = 16) -> ExportedProgram:
    """Example ``name`` as an ``ExportedProgram``, built directly in torch.fx
    (the graph :func:`export_example` traces, in linear time; same parameters)."""
    from branchyard.examples.builder import build_dispatch_program

    spec = _spec(name)
    size = spec.default_size if size is None else size
    if size < (2 if spec.split == "chain" else 1):
        raise BranchyardError(
            f"example {name!r} needs {spec.size_name} >= {2 if spec.split == 'chain' else 1}, got {size}"
        )
    if size > spec.max_size:
        raise BranchyardError(
            f"example {name!r} is built up to {spec.size_name} = {spec.max_size} "
            f"({spec.num_experts(spec.max_size)} experts), got {size}")
    return build_dispatch_program(spec.num_experts(size), dim=dim, split=spec.split)


def save_example(name: str, path: str | Path, size: int | None = None, dim: int = 16) -> ExportedProgram:
    """Build example ``name`` (:func:`example_program`), write it to ``path``
    (a ``.pt2``) and return it."""
    from branchyard.serialization import save

    program = example_program(name, size, dim)
    save(program, str(path))
    return program
