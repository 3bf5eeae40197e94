"""Build control-flow GraphModules by hand, for torch versions whose tracers can't.

torch 2.11 (the GPU machine) has no ``torch.ops.higher_order.switch``, so a
switch cannot come out of ``torch.export`` there. These builders write the FX
graph directly: the loop or switch node, its bodies as ``get_attr``
submodules, and ``getitem`` nodes for the results. The switch node's target is
:func:`branchyard.lowering.cuda_graph.switch`, the plain-Python reference the
lowering treats exactly like the torch 2.14 operator::

    >>> import torch
    >>> from branchyard.lowering.cuda_graph.fx_builders import switch_module, while_loop_module
    >>> sw = switch_module([lambda x: x + 1, lambda x: x * 10], num_operands=1)
    >>> sw(torch.tensor(5), torch.tensor(2))   # index 5 clamps to the last branch
    (tensor(20),)
    >>> loop = while_loop_module(lambda i, x: i < 3, lambda i, x: (i + 1, x * 2), num_carried=2)
    >>> loop(torch.tensor(0), torch.tensor(1.0))
    (tensor(3), tensor(8.))
"""

from __future__ import annotations

import operator
from typing import Callable, Sequence

import torch
from torch.fx import Graph, GraphModule

from branchyard.fx.control_flow import switch
from branchyard.fx.switch_lowering import lower_switch

__all__ = [
    "as_graph_module", "trace", "while_loop_module", "switch_module", "cond_module", "cond_tree_module", "router_loop_module",
]


class _GraphModuleLeaves(torch.fx.Tracer):
    # Keep GraphModule submodules (e.g. a switch_module) as call_module nodes instead of
    # tracing into them: their control flow must reach the lowering intact.
    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        return isinstance(m, GraphModule) or super().is_leaf_module(m, qualname)


def trace(module: torch.nn.Module) -> GraphModule:
    """Symbolically trace ``module``, keeping its GraphModule submodules as ``call_module`` nodes.

    The way to put a :func:`switch_module` inside a loop body::

        >>> class Body(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.sw = switch_module([lambda x: x + 1, lambda x: x - 1], num_operands=1)
        ...     def forward(self, i, x):
        ...         return i + 1, self.sw(i % 2, x)[0]
        >>> body = trace(Body())
        >>> [n.op for n in body.graph.nodes if n.target == "sw"]
        ['call_module']
    """
    graph = _GraphModuleLeaves().trace(module)
    return GraphModule(module, graph)


def as_graph_module(fn: Callable | GraphModule) -> GraphModule:
    """``fn`` itself if it is a GraphModule, else ``torch.fx.symbolic_trace(fn)``."""
    return fn if isinstance(fn, GraphModule) else torch.fx.symbolic_trace(fn)


def _module(subs: dict[str, Callable | GraphModule], n_inputs: int, build: Callable) -> GraphModule:
    root = torch.nn.Module()
    for name, fn in subs.items():
        setattr(root, name, as_graph_module(fn))
    g = Graph()
    inputs = [g.placeholder(f"arg{i}") for i in range(n_inputs)]
    attrs = [g.get_attr(name) for name in subs]
    result = build(g, inputs, attrs)
    g.output(tuple(g.call_function(operator.getitem, (result, i)) for i in range(build.num_outputs)))
    return GraphModule(root, g)


def while_loop_module(
    cond_fn: Callable | GraphModule, body_fn: Callable | GraphModule, num_carried: int, num_additional: int = 0
) -> GraphModule:
    """``forward(*carried, *additional) -> tuple(carried after the loop)`` with one while_loop node."""

    def build(g, ins, attrs):
        return g.call_function(
            torch.ops.higher_order.while_loop, (attrs[0], attrs[1], tuple(ins[:num_carried]), tuple(ins[num_carried:]))
        )

    build.num_outputs = num_carried
    return _module({"cond_fn": cond_fn, "body_fn": body_fn}, num_carried + num_additional, build)


def switch_module(branches: Sequence[Callable | GraphModule], num_operands: int, num_outputs: int = 1) -> GraphModule:
    """``forward(index, *operands) -> branches[clamp(index)](*operands)`` with one switch node."""

    def build(g, ins, attrs):
        return g.call_function(switch, (ins[0], list(attrs), tuple(ins[1:])))

    build.num_outputs = num_outputs
    return _module({f"branch{i}": b for i, b in enumerate(branches)}, 1 + num_operands, build)


def cond_module(true_fn: Callable | GraphModule, false_fn: Callable | GraphModule, num_operands: int, num_outputs: int = 1) -> GraphModule:
    """``forward(pred, *operands) -> (true_fn if pred else false_fn)(*operands)`` with one cond node."""

    def build(g, ins, attrs):
        return g.call_function(torch.ops.higher_order.cond, (ins[0], attrs[0], attrs[1], tuple(ins[1:])))

    build.num_outputs = num_outputs
    return _module({"true_fn": true_fn, "false_fn": false_fn}, 1 + num_operands, build)


def cond_tree_module(branches: Sequence[Callable | GraphModule], num_operands: int) -> GraphModule:
    """``forward(index, *operands) -> branches[clamp(index)](*operands)`` as nested conds.

    What :func:`branchyard.passes.switch_to_cond` makes of a ``torch.switch``
    (which needs torch >= 2.14's switch operator to run on), built on any
    torch: a :func:`switch_module` whose index is clamped to ``[0, n-1]`` as
    ``torch.switch`` traces it, lowered by the same
    :func:`branchyard.fx.switch_lowering.lower_switch` -- a balanced tree
    ``cond(index <= mid - 1, left, right)`` of ``n - 1`` conds, each branch
    body inlined in a leaf. ``index`` must be a 0-d integer tensor (a cond
    predicate is 0-d); outputs are always a tuple::

        >>> tree = cond_tree_module([lambda x: x + 1, lambda x: x * 10, lambda x: -x], num_operands=1)
        >>> [tree(torch.tensor(i), torch.tensor(2))[0].item() for i in (-4, 0, 1, 2, 9)]
        [3, 3, 20, -2, -2]
    """
    traced = [as_graph_module(b) for b in branches]
    out = next(n for n in reversed(traced[0].graph.nodes) if n.op == "output").args[0]
    gm = switch_module(traced, num_operands, num_outputs=len(out) if isinstance(out, (tuple, list)) else 1)
    node = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is switch)
    with gm.graph.inserting_before(node):
        clamped = gm.graph.call_function(torch.ops.aten.clamp.default, (node.args[0], 0, len(traced) - 1))
    node.args = (clamped, *node.args[1:])
    lower_switch(gm, node)
    gm.recompile()
    return gm


def router_loop_module(branches: Sequence[Callable | GraphModule], w: torch.Tensor, trips_until: int) -> GraphModule:
    """``forward(i, x) -> (i, x)`` after ``while i < trips_until: i, x = i + 1,
    branches[clamp(argmax(mean(x, 0) @ w))](x)``: one while_loop whose body's switch
    is indexed by a router of the carry ``x`` (``w`` a buffer of the body), the
    shape of an LLM decode step's expert dispatch::

        >>> loop = router_loop_module([lambda x: x + 2, lambda x: x - 1], torch.tensor([[-1.0, 1.0]]), 3)
        >>> loop(torch.tensor(0), torch.tensor([[0.0]]))   # x: 0 -> 2 -> 1 -> 0 (picks 0, 1, 1)
        (tensor(3), tensor([[0.]]))
    """
    aten = torch.ops.aten
    body = switch_module(branches, num_operands=1)
    body.register_buffer("router_w", w)
    g = body.graph
    i, x = [n for n in g.nodes if n.op == "placeholder"]
    node = next(n for n in g.nodes if n.op == "call_function" and n.target is switch)
    with g.inserting_before(node):
        mean = g.call_function(aten.mean.dim, (x, [0]))
        index = g.call_function(aten.argmax.default, (g.call_function(aten.matmul.default, (mean, g.get_attr("router_w"))),))
    node.args = (index, *node.args[1:])
    out = next(n for n in g.nodes if n.op == "output")
    (y,) = out.args[0]
    with g.inserting_before(out):
        out.args = ((g.call_function(aten.add.Tensor, (i, 1)), y),)
    body.recompile()
    return while_loop_module(lambda i, x: i < trips_until, body, num_carried=2)
