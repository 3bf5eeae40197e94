"""Finding structurally identical branch graphs.

Two graphs are *structurally identical* when their node lists match one to
one, in order: same op kind, same target, same constant arguments, inputs
drawn from corresponding nodes, the same placeholder positions, and
``get_attr`` objects that are themselves identical (subgraphs compared
recursively, tensors by value). Identical graphs compute the same function
of the same operands, so a switch needs only one of them.

Grouping is two-staged so that it stays linear in the total graph size:
:func:`graph_hash` (networkx's Weisfeiler-Lehman hash over a labelled
DiGraph, computed once per graph) buckets the candidates, and
:func:`structurally_equal` confirms each candidate against the
representatives of its bucket only::

    >>> import torch
    >>> from branchyard.passes.leaf_dedup import group_identical
    >>> a = torch.fx.symbolic_trace(lambda x: x.sin() + 1)
    >>> b = torch.fx.symbolic_trace(lambda y: y.sin() + 1)
    >>> c = torch.fx.symbolic_trace(lambda x: x.cos() + 1)
    >>> group_identical([(g.graph, g) for g in (a, b, c)])
    ([0, 2], [0, 0, 1])
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import networkx as nx
import torch
import torch.utils._pytree as pytree
from torch.fx import Graph, GraphModule, Node

from branchyard.fx.graph_walk import resolve_attr

__all__ = ["graph_hash", "structurally_equal", "group_identical"]

#: An attribute holder: a module, or a plain dict of name -> object.
Attrs = Any


def _lookup(attrs: Attrs, target: str) -> Any:
    if isinstance(attrs, dict):
        return attrs[target]
    return resolve_attr(attrs, target)


def _target_label(target: Any) -> str:
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)
    return f"{module}.{name}" if not hasattr(target, "_schema") else str(target)


def _render(a: Any, inputs: list[Node], out: list[str]) -> None:
    # A hand-rolled flatten: pytree's is several times slower and this runs
    # once per node of every leaf.
    if isinstance(a, Node):
        inputs.append(a)
        out.append("%")
    elif isinstance(a, (tuple, list)):
        out.append("(" if isinstance(a, tuple) else "[")
        for x in a:
            _render(x, inputs, out)
            out.append(",")
        out.append(")" if isinstance(a, tuple) else "]")
    elif isinstance(a, dict):
        out.append("{")
        for k, x in a.items():
            out.append(f"{k}:")
            _render(x, inputs, out)
            out.append(",")
        out.append("}")
    else:
        out.append(f"{type(a).__name__}:{a!r}")


def _template(node: Node) -> tuple[list[Node], str]:
    """The node's input nodes in argument order and its arguments with every
    node replaced by ``%``, rendered as text (constants keep their type)."""
    inputs: list[Node] = []
    out: list[str] = []
    _render(node.args, inputs, out)
    _render(node.kwargs, inputs, out)
    return inputs, "".join(out)


def _attr_label(obj: Any, memo: dict[int, str]) -> str:
    if isinstance(obj, GraphModule):
        return "graph:" + graph_hash(obj.graph, obj, memo)
    if isinstance(obj, torch.Tensor):
        return f"tensor:{obj.dtype}:{tuple(obj.shape)}"
    return f"obj:{type(obj).__name__}"


def graph_hash(graph: Graph, attrs: Attrs, memo: dict[int, str] | None = None) -> str:
    """Weisfeiler-Lehman hash of ``graph`` (``attrs`` resolves its get_attrs).

    Equal graphs hash equal; different hashes prove the graphs differ. Node
    labels carry op, target, constant arguments and placeholder position;
    edge labels carry the argument position.
    """
    memo = {} if memo is None else memo
    if id(graph) in memo:
        return memo[id(graph)]
    g = nx.DiGraph()
    n_ph = 0
    for node in graph.nodes:
        inputs, consts = _template(node)
        if node.op == "placeholder":
            label = f"ph{n_ph}"
            n_ph += 1
        elif node.op == "get_attr":
            label = _attr_label(_lookup(attrs, str(node.target)), memo)
        else:
            label = f"{node.op}|{_target_label(node.target)}|{consts}"
        g.add_node(node.name, label=label)
        edges: dict[str, list[str]] = {}
        for pos, src in enumerate(inputs):
            edges.setdefault(src.name, []).append(str(pos))
        for src, positions in edges.items():
            g.add_edge(src, node.name, label=",".join(positions))
    with warnings.catch_warnings():
        # networkx >= 3.5 notes that directed hashes changed once; we only compare within one run.
        warnings.simplefilter("ignore", UserWarning)
        h = nx.weisfeiler_lehman_graph_hash(g, node_attr="label", edge_attr="label")
    memo[id(graph)] = h
    return h


def _same_const(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    try:
        return bool(a == b)
    except Exception:  # objects without a usable ==
        return a is b


def _same_attr(a: Any, b: Any) -> bool:
    if isinstance(a, GraphModule) and isinstance(b, GraphModule):
        return structurally_equal(a.graph, a, b.graph, b)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and a.device == b.device and bool(torch.equal(a, b))
    return a is b


def structurally_equal(a: Graph, a_attrs: Attrs, b: Graph, b_attrs: Attrs) -> bool:
    """Whether ``a`` and ``b`` match node for node, in order (see module docstring)."""
    a_nodes, b_nodes = list(a.nodes), list(b.nodes)
    if len(a_nodes) != len(b_nodes):
        return False
    pair: dict[Node, Node] = {}
    for x, y in zip(a_nodes, b_nodes):
        if x.op != y.op:
            return False
        if x.op == "get_attr":
            if not _same_attr(_lookup(a_attrs, str(x.target)), _lookup(b_attrs, str(y.target))):
                return False
        elif x.op != "placeholder" and x.target != y.target:
            return False
        xl, xs = pytree.tree_flatten((x.args, x.kwargs))
        yl, ys = pytree.tree_flatten((y.args, y.kwargs))
        if xs != ys or len(xl) != len(yl):
            return False
        for u, v in zip(xl, yl):
            if isinstance(u, Node) or isinstance(v, Node):
                if not (isinstance(u, Node) and isinstance(v, Node) and pair.get(u) is v):
                    return False
            elif not _same_const(u, v):
                return False
        pair[x] = y
    return True


def group_identical(items: Sequence[tuple[Graph, Attrs]]) -> tuple[list[int], list[int]]:
    """Group structurally identical graphs.

    Returns ``(representatives, group_of)``: the indices of the first graph of
    each group in order of first appearance, and for every item the position
    of its group in ``representatives``.
    """
    memo: dict[int, str] = {}
    buckets: dict[str, list[int]] = {}  # hash -> group ids whose representative has it
    reps: list[int] = []
    group_of: list[int] = []
    for i, (graph, attrs) in enumerate(items):
        h = graph_hash(graph, attrs, memo)
        for gid in buckets.get(h, ()):
            rg, ra = items[reps[gid]]
            if structurally_equal(rg, ra, graph, attrs):
                group_of.append(gid)
                break
        else:
            buckets.setdefault(h, []).append(len(reps))
            group_of.append(len(reps))
            reps.append(i)
    return reps, group_of
