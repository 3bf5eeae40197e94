"""``switch_to_cond``: lower every ``torch.ops.higher_order.switch`` to a
balanced tree of ``torch.cond``, for consumers without switch (ONNX export,
torch < 2.14 runtimes).

Postcondition: the graph and its subgraphs hold no switch node; each became
a cond tree of depth ceil(log2(n)) selecting the same branch for every index,
out-of-range indices clamped to the first or last branch.

Before::

    switch = switch(index, [branch0, branch1, branch2], (x, w))

After (each inner graph takes the index as an extra first operand)::

    le = aten.le(index, 0)
    cond = cond(le, leaf0, inner_1_3, (index, x, w))
    # inner_1_3(index, x, w):
    #     le = aten.le(index, 1)
    #     return cond(le, leaf1, leaf2, (index, x, w))
    # leaf_k(index, x, w): the body of branch_k on (x, w)

Semantics, as Python::

    def switch(index, branches, operands):
        index = min(max(index, 0), len(branches) - 1)   # clamp, like torch.switch
        return branches[index](*operands)

    def lowered(index, lo=0, hi=len(branches)):          # the cond tree
        if hi - lo == 1:
            return branches[lo](*operands)
        mid = (lo + hi) // 2
        return lowered(index, lo, mid) if index <= mid - 1 else lowered(index, mid, hi)

A one-branch switch, or one with a literal index, is replaced by the chosen
branch's body. See ``docs/passes.md``.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

from branchyard.errors import MalformedGraphError
from branchyard.fx.control_flow import (
    COND,
    AttrSink,
    SwitchParts,
    describe_node,
    emit,
    erase_dead_inputs,
    graph_outputs,
    inline_graph,
    is_switch,
    new_graph_module,
    node_value,
    replace_with_outputs,
    returns_sequence,
    switch_parts,
)
from branchyard.fx.graph_walk import lint_graph_module, realize_graph_modules, rewrite_graphs
from branchyard.fx.pass_infra import BranchyardPass, Program, apply_pass

__all__ = ["SwitchToCond", "switch_to_cond"]

aten = torch.ops.aten

#: How to compare the index with a split point, by the index's kind.
_LE = {
    "tensor": aten.le.Scalar,
    "symint": operator.le,
}


def _index_kind(node: SwitchParts) -> str:
    val = node_value(node.index)
    if isinstance(val, torch.Tensor):
        if val.dtype.is_floating_point or val.dtype.is_complex or val.dtype == torch.bool:
            raise MalformedGraphError(
                f"switch index has dtype {val.dtype}; it must be an integer tensor",
                where=describe_node(node.node),
            )
        return "tensor"
    if isinstance(val, torch.SymInt):
        return "symint"
    if val is None:
        return "tensor"  # no example value (e.g. a hand-built graph): assume the common case
    raise MalformedGraphError(
        f"switch index is {type(val).__name__}; expected an integer tensor or SymInt",
        where=describe_node(node.node),
    )


def _value_meta(like: Any) -> dict[str, Any]:
    if not isinstance(like, Node):
        return {}
    return {k: v for k, v in like.meta.items() if k in ("val", "example_value", "tensor_meta")}


class _Lowering:
    """Builds the cond tree for one switch."""

    def __init__(self, parts: SwitchParts, kind: str) -> None:
        self.parts = parts
        self.kind = kind
        self.out_meta = _value_meta(parts.node)
        self.out_meta.pop("tensor_meta", None)

    def _fresh_graph(self) -> tuple[Graph, Node, list[Node]]:
        g = Graph()
        idx = g.placeholder("index")
        idx.meta = _value_meta(self.parts.index)
        ops = []
        for i, op in enumerate(self.parts.operands):
            ph = g.placeholder(op.name if isinstance(op, Node) else f"const{i}")
            ph.meta = _value_meta(op)
            ops.append(ph)
        return g, idx, ops

    def subtree(self, lo: int, hi: int) -> GraphModule:
        """Graph module ``(index, *operands) -> outputs`` choosing among branches [lo, hi)."""
        g, idx, ops = self._fresh_graph()
        sink = AttrSink()
        if hi - lo == 1:
            g.output(inline_graph(g, self.parts.branches[lo], ops, sink))
            return new_graph_module(sink.attrs, g)
        cond = self.emit_split(g, sink, idx, ops, lo, hi)
        if returns_sequence(self.parts.branches[0]):
            g.output(tuple(self._getitem(g, cond, i) for i in range(len(graph_outputs(self.parts.branches[0])))))
        else:
            g.output(cond)
        return new_graph_module(sink.attrs, g)

    def _getitem(self, g: Graph, cond: Node, i: int) -> Node:
        item = g.call_function(operator.getitem, (cond, i))
        val = self.out_meta.get("val", self.out_meta.get("example_value"))
        if isinstance(val, (tuple, list)):
            item.meta["val" if "val" in self.out_meta else "example_value"] = val[i]
        return item

    def emit_split(self, g: Graph, sink: AttrSink, idx: Any, ops: list[Any], lo: int, hi: int) -> Node:
        """At ``g``'s insertion point: ``cond(idx <= mid - 1, [lo, mid), [mid, hi))``."""
        mid = (lo + hi) // 2
        pred = emit(g, _LE[self.kind], (idx, mid - 1), like=self.parts.node)
        left = g.get_attr(sink.add(f"switch_{lo}_{mid}", self.subtree(lo, mid)))
        right = g.get_attr(sink.add(f"switch_{mid}_{hi}", self.subtree(mid, hi)))
        cond = g.call_function(COND, (pred, left, right, (idx, *ops)))
        cond.meta.update(self.out_meta)
        return cond


class SwitchToCond(BranchyardPass):
    """Lower every switch to a balanced cond tree (see the module docstring)."""

    name = "switch_to_cond"
    pause_gc = True

    def run(self, graph_module: GraphModule) -> bool:
        lint_graph_module(graph_module)
        self.report.stats.update(switches_lowered=0, conds_created=0)
        return rewrite_graphs(graph_module, self._lower_switch)

    def _lower_switch(self, gm: GraphModule, node: Node, dead: set[str]) -> bool:
        if not is_switch(node):
            return False
        self._lower(gm, node, dead)
        return True

    def _lower(self, gm: GraphModule, node: Node, dead: set[str]) -> None:
        parts = switch_parts(gm, node)
        n = len(parts.branches)
        graph = gm.graph
        sink = AttrSink(gm)
        with graph.inserting_before(node):
            if n == 1 or not isinstance(parts.index, Node):
                # Nothing to choose at run time: splice the chosen body in.
                k = 0 if n == 1 else min(max(int(parts.index), 0), n - 1)
                out = inline_graph(graph, parts.branches[k], parts.operands, sink)
                replace_with_outputs(graph, node, out)
                result = None
            else:
                low = _Lowering(parts, _index_kind(parts))
                result = low.emit_split(graph, sink, parts.index, list(parts.operands), 0, n)
                self.report.stats["conds_created"] += n - 1
        if result is not None:
            node.replace_all_uses_with(result)
        graph.erase_node(node)
        erase_dead_inputs(graph, [parts.index, *parts.operands])
        for attr in dict.fromkeys(parts.branch_attrs):
            if not attr.users:
                dead.add(str(attr.target))
                graph.erase_node(attr)
        self.report.stats["switches_lowered"] += 1


def switch_to_cond(program: Program) -> Program:
    """Function form of :class:`SwitchToCond`: a lowered copy of ``program``
    (an ExportedProgram or a GraphModule; the result is of the same kind)."""
    from branchyard.passes.cond_to_switch import _lint_program

    _lint_program(program)
    out = apply_pass(program, SwitchToCond())
    realize_graph_modules(out.graph_module if isinstance(out, torch.export.ExportedProgram) else out)
    return out
