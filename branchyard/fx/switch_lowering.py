"""One switch node lowered to a balanced tree of conds.

The library's one switch -> cond lowering: the ``switch_to_cond`` pass, the
CUDA-graph builders and serialization all call :func:`lower_switch`.

Before::

    switch = switch(index, [branch0, branch1, branch2], (x, w, b))
    # branch0 reads x, w;  branch1 reads x, b;  branch2 reads x

After (each cond passes on only what its side reads; the index only to a
side that still has a choice to make)::

    le = aten.le(index, 0)
    cond = cond(le, leaf0, split_1_3, (index, x, w, b))
    # leaf0(index, x, w, b): the body of branch0 on (x, w)
    # split_1_3(index, x, w, b):
    #     le = aten.le(index, 1)
    #     return cond(le, leaf1, leaf2, (x, b))
    # leaf1(x, b): branch1's body;  leaf2(x, b): branch2's body (b unused)

Semantics, as Python -- the switch's own, its index clamped to the first or
last branch (:mod:`branchyard.fx.control_flow`)::

    def lowered(index, operands, lo=0, hi=len(branches)):
        if hi - lo == 1:
            return branches[lo](*operands)
        mid = (lo + hi) // 2
        if index <= mid - 1:
            return lowered(index, operands, lo, mid)
        return lowered(index, operands, mid, hi)

The tree has ``n - 1`` conds and depth ``ceil(log2(n))``. A tensor index
whose dtype cannot hold every split constant (int8 with more than 129
branches, uint8 with more than 257) is widened to int64 once, before the
root cond, so that no comparison wraps. A one-branch
switch, or one with a literal index, is replaced by the chosen branch's body.
The switch may call ``torch.ops.higher_order.switch`` or the plain-Python
:func:`branchyard.fx.control_flow.switch` (which always returns a tuple, so
its tree does too)::

    >>> import operator, torch
    >>> from branchyard.fx import control_flow as cf
    >>> root = torch.nn.Module()
    >>> root.b0, root.b1, root.b2 = (torch.fx.symbolic_trace(f) for f in (lambda x: x + 1, lambda x: x * 10, lambda x: -x))
    >>> g = torch.fx.Graph()
    >>> i, x = g.placeholder("i"), g.placeholder("x")
    >>> sw = g.call_function(cf.switch, (i, [g.get_attr(f"b{k}") for k in range(3)], (x,)))
    >>> _ = g.output(g.call_function(operator.getitem, (sw, 0)))
    >>> gm = torch.fx.GraphModule(root, g)
    >>> lowered = lower_switch(gm, sw)
    >>> _ = gm.recompile()
    >>> lowered.conds_created, [gm(torch.tensor(k), torch.tensor(2)).item() for k in (-4, 0, 1, 2, 9)]
    (2, [3, 3, 20, -2, -2])
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

from branchyard.fx.control_flow import (
    COND,
    AttrSink,
    SwitchParts,
    emit,
    erase_dead_inputs,
    graph_outputs,
    inline_graph,
    new_graph_module,
    node_value,
    placeholders,
    replace_with_outputs,
    returns_sequence,
    switch,
    switch_parts,
)

__all__ = ["LoweredSwitch", "lower_switch"]

aten = torch.ops.aten

#: How to compare the index with a split point, by the index's kind.
_LE = {
    "tensor": aten.le.Scalar,
    "symint": operator.le,
}


@dataclass
class LoweredSwitch:
    """What :func:`lower_switch` made of one switch."""

    #: The outermost cond, now in the switch's place (None: the switch had
    #: nothing to choose and the chosen body was spliced in instead).
    root: Node | None
    #: Conds created, nested ones included (``n - 1`` for ``n`` branches).
    conds_created: int = 0
    #: Owner attributes (the switch's branch graphs) no ``get_attr`` reads any more.
    freed_attrs: list[str] = field(default_factory=list)


def _index_kind(val: Any) -> str:
    # switch_parts has rejected float, bool and non-integer indices already.
    return "symint" if isinstance(val, torch.SymInt) else "tensor"


def _value_meta(like: Any) -> dict[str, Any]:
    if not isinstance(like, Node):
        return {}
    return {k: v for k, v in like.meta.items() if k in ("val", "example_value")}


def _used_operands(branch: GraphModule) -> frozenset[int]:
    """Positions of the operands ``branch`` reads (a placeholder with users)."""
    return frozenset(i for i, ph in enumerate(placeholders(branch)) if ph.users)


class _Tree:
    """Builds the cond tree of one switch."""

    def __init__(self, parts: SwitchParts, as_tuple: bool, index: Any) -> None:
        self.parts = parts
        #: The index the predicates compare (the switch's own, or it widened; see _comparable_index).
        self.index = index
        self.kind = _index_kind(node_value(parts.index))
        self.out_meta = _value_meta(parts.node)
        self.used = [_used_operands(b) for b in parts.branches]
        self.n_outputs = len(graph_outputs(parts.branches[0]))
        #: Whether every level returns a tuple (the branches' structure, or a Python switch's).
        self.tuple_out = as_tuple or returns_sequence(parts.branches[0])
        self.conds = 0

    def needs(self, lo: int, hi: int) -> list[int]:
        """Operand positions some branch in [lo, hi) reads, in order."""
        return sorted(frozenset().union(*self.used[lo:hi]))

    def split(self, g: Graph, sink: AttrSink, index: Any, env: dict[int, Any], lo: int, hi: int) -> Node:
        """At ``g``'s insertion point: ``cond(index <= mid - 1, tree[lo, mid), tree[mid, hi))``;
        ``env`` maps operand positions to their values in ``g``."""
        mid = (lo + hi) // 2
        passed = self.needs(lo, hi)
        with_index = hi - lo > 2
        pred = emit(g, _LE[self.kind], (index, mid - 1), like=self.parts.node)
        left = g.get_attr(sink.add(f"switch_{lo}_{mid}", self.subtree(lo, mid, passed, with_index)))
        right = g.get_attr(sink.add(f"switch_{mid}_{hi}", self.subtree(mid, hi, passed, with_index)))
        operands = ((index,) if with_index else ()) + tuple(env[p] for p in passed)
        cond = g.call_function(COND, (pred, left, right, operands))
        cond.meta.update(self.out_meta)
        self.conds += 1
        return cond

    def subtree(self, lo: int, hi: int, passed: list[int], with_index: bool) -> GraphModule:
        """``(index?, *operands[passed]) -> outputs`` choosing among branches [lo, hi)."""
        g = Graph()
        index = None
        if with_index:
            index = g.placeholder("index")
            index.meta = _value_meta(self.index)
        env: dict[int, Any] = {}
        for p in passed:
            op = self.parts.operands[p]
            ph = g.placeholder(op.name if isinstance(op, Node) else f"const{p}")
            ph.meta = _value_meta(op)
            env[p] = ph
        sink = AttrSink()
        if hi - lo == 1:
            args = [env.get(p) for p in range(len(self.parts.operands))]  # unread ones stay None
            out = inline_graph(g, self.parts.branches[lo], args, sink)
            g.output(out if not self.tuple_out or isinstance(out, (tuple, list)) else (out,))
            return new_graph_module(sink.attrs, g)
        cond = self.split(g, sink, index, env, lo, hi)
        if self.tuple_out:
            g.output(tuple(self._getitem(g, cond, i) for i in range(self.n_outputs)))
        else:
            g.output(cond)
        return new_graph_module(sink.attrs, g)

    def _getitem(self, g: Graph, cond: Node, i: int) -> Node:
        item = g.call_function(operator.getitem, (cond, i))
        for key, val in self.out_meta.items():
            if isinstance(val, (tuple, list)):
                item.meta[key] = val[i]
        return item


def _comparable_index(graph: Graph, parts: SwitchParts) -> Any:
    """The switch's index, widened to int64 where a split constant would not
    fit its dtype: ``aten.le.Scalar`` casts the constant to the index's dtype,
    so with an int8 index ``index <= 199`` would compare against a wrapped
    value and pick the wrong branch. The constants are ``0 .. n - 2``, so
    int64 and uint64 never need it; without example values the dtype is
    unknown and the index is widened once the constants leave int8's range."""
    index = parts.index
    val = node_value(index)
    if _index_kind(val) != "tensor":
        return index  # a SymInt compares as a Python int
    largest = len(parts.branches) - 2
    dtype = val.dtype if isinstance(val, torch.Tensor) else torch.int8
    if dtype in (torch.int64, torch.uint64) or largest <= torch.iinfo(dtype).max:
        return index
    return emit(graph, aten._to_copy.default, (index,), {"dtype": torch.int64}, like=parts.node)


def lower_switch(owner: GraphModule, node: Node, *, dead_attrs: set[str] | None = None) -> LoweredSwitch:
    """Replace the switch ``node`` of ``owner`` by a balanced cond tree (see the module docstring).

    ``node`` is validated first (:func:`~branchyard.fx.control_flow.switch_parts`:
    a malformed switch raises :class:`~branchyard.errors.MalformedGraphError`
    naming it). The switch, the index and operand computations nothing else
    reads, and the ``get_attr`` nodes of its branches are erased. The branch
    attributes nothing reads any more are added to ``dead_attrs`` when given
    (a caller rewriting many nodes deletes them once), else deleted from
    ``owner`` now; either way they are listed in the result. ``owner`` is not
    recompiled.
    """
    parts = switch_parts(owner, node)
    n = len(parts.branches)
    graph = owner.graph
    sink = AttrSink(owner)
    as_tuple = node.target is switch
    result = LoweredSwitch(None)
    with graph.inserting_before(node):
        if n == 1 or not isinstance(parts.index, Node):
            # Nothing to choose at run time: splice the chosen body in.
            k = 0 if n == 1 else min(max(int(parts.index), 0), n - 1)
            out = inline_graph(graph, parts.branches[k], parts.operands, sink)
            replace_with_outputs(graph, node, (out,) if as_tuple and not isinstance(out, (tuple, list)) else out)
        else:
            index = _comparable_index(graph, parts)
            tree = _Tree(parts, as_tuple, index)
            env = dict(enumerate(parts.operands))
            result.root = tree.split(graph, sink, index, env, 0, n)
            result.conds_created = tree.conds
            node.replace_all_uses_with(result.root)
    graph.erase_node(node)
    erase_dead_inputs(graph, [parts.index, *parts.operands])
    for attr in dict.fromkeys(parts.branch_attrs):
        if not attr.users:
            graph.erase_node(attr)
            result.freed_attrs.append(str(attr.target))
    if dead_attrs is not None:
        dead_attrs.update(result.freed_attrs)
    else:
        live = {str(x.target) for x in graph.nodes if x.op == "get_attr"}
        for name in result.freed_attrs:
            if name not in live and hasattr(owner, name):
                delattr(owner, name)
    return result
