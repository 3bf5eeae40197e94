"""Which tensors a graph writes in place: the operands an op writes, traced back through views.

torch.export's training IR keeps a model's state updates as in-place ops on its
placeholders (an ExportedProgram's graph) or attributes (its ``module()``)::

    add_ = aten.add_.Tensor(b_calls, 1)                          # an int64 step counter
    index_copy_ = aten.index_copy_.default(b_cache, 0, pos, k)   # a KV cache row
    select = aten.select.int(b_cache, 0, 2); aten.copy_(select, k)   # the same, through a view
    aten.batch_norm.default(x, w, b, b_running_mean, b_running_var, True, ...)   # train mode

Anything that runs such a graph for its own purposes (a warm-up before a capture,
a race between rewrites) must run it on copies of those, or put them back.

    >>> import torch
    >>> class Step(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
    ...     def forward(self, x):
    ...         self.calls.add_(1)
    ...         return x * 2
    >>> ep = torch.export.export(Step(), (torch.ones(2),))
    >>> [n.name for n in written_roots(ep.graph)]
    ['b_calls']
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Graph, Node

__all__ = ["UNMARKED_WRITES", "written_operands", "written_roots"]

#: ATen ops that write operands their schema does not mark ``Tensor(a!)``: op -> those operands.
UNMARKED_WRITES: dict[Any, frozenset[str]] = {
    torch.ops.aten.batch_norm.default: frozenset({"running_mean", "running_var"}),
    torch.ops.aten.instance_norm.default: frozenset({"running_mean", "running_var"}),
}


def written_operands(node: Node) -> list[Node]:
    """The operand nodes ``node``'s op writes: marked ``Tensor(a!)`` in its schema, or by
    :data:`UNMARKED_WRITES`. Only ATen ops (``OpOverload``) have schemas; others write nothing here."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return []
    schema = target._schema.arguments
    unmarked = UNMARKED_WRITES.get(target, frozenset())
    given = [*zip(schema, node.args), *((a, node.kwargs[a.name]) for a in schema if a.name in node.kwargs)]
    return [
        value
        for arg, value in given
        if isinstance(value, Node)
        and (arg.name in unmarked or (arg.alias_info is not None and arg.alias_info.is_write))
    ]


def _base(node: Node) -> Node:
    """The node a chain of view ops (select, slice, view, ...) starts from."""
    while (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and node.target.is_view
        and node.args
        and isinstance(node.args[0], Node)
    ):
        node = node.args[0]
    return node


def written_roots(graph: Graph) -> list[Node]:
    """The placeholders and ``get_attr`` nodes of ``graph`` (this graph only, not bodies) that an
    op writes, directly or through views, in graph order."""
    roots = {
        base
        for node in graph.nodes
        for operand in written_operands(node)
        if (base := _base(operand)).op in ("placeholder", "get_attr")
    }
    return [n for n in graph.nodes if n in roots]
