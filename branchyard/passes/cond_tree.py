"""Analysis of nested ``torch.cond``: maximal cond trees, their leaves, and
what a single switch replacing each tree would look like.

A *cond tree* is a cond node (the root) together with every cond nested in
its branches that can be absorbed. A branch graph absorbs its nested cond
when

* it contains exactly one cond node (two sequential conds would multiply the
  leaves; such a branch stays a leaf and its conds become roots of their own),
* its branches return the same concrete sizes (torch.export merges different ones
  into an unbacked size that the program is written against; such a cond,
  root or nested, is kept as it is),
* that cond's predicate is a tensor, and
* the predicate's backward slice is hoistable: every op in it is on the
  raise-free allow-list (:mod:`branchyard.passes.raise_free`: no indexing,
  no integer division by a tensor, no higher-order, in-place or random op,
  nothing that can raise for some input value), followed through the
  enclosing branches up to the root's operands. The switch evaluates every
  hoisted predicate on every call, also on inputs for which the original
  never reaches it; an op that is not known never to raise keeps its cond
  nested (a skip in the report).

The *leaves* are the branch graphs that absorb nothing, in depth-first order,
true side first. A leaf reached through branches that compute something
besides their nested cond (a prefix feeding its operands, a postfix on its
outputs) is *materialized* by inlining: the leaf graph is those enclosing
bodies with the nested cond replaced by the chosen branch. Every leaf is
materialized as a function of the root's operands, its inputs re-keyed to
the deduplicated outer values, and identical leaves are grouped
(:mod:`branchyard.passes.leaf_dedup`).

An ``idx == k`` chain (``cond(idx == 0, L0, cond(idx == 1, L1, ... Lfall))``,
either operand order, ``!=`` with the leaf on the false side, continuing on
either side) is recognised as a dispatch chain (:func:`match_dispatch_chain`).

:func:`find_cond_trees` reports every tree of depth >= 2 without touching
the graph::

    >>> import torch
    >>> from branchyard.passes.cond_tree import find_cond_trees
    >>> def f(i, x):
    ...     inner = lambda x, i: torch.cond(i == 1, lambda x: x + 1, lambda x: x - 1, (x,))
    ...     return torch.cond(i == 0, lambda x, i: x * 2, inner, (x, i))
    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> gm = make_fx(f)(torch.tensor(0), torch.randn(3))
    >>> [(t.depth, t.num_leaves, t.is_dispatch_chain) for t in find_cond_trees(gm)]
    [(2, 3, True)]
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch._ops import HigherOrderOperator
from torch.fx import Graph, GraphModule, Node

from branchyard.errors import checked
from branchyard.fx.control_flow import (
    AttrSink,
    CondParts,
    cond_parts,
    describe_node,
    graph_outputs,
    inline_graph,
    is_cond,
    merged_output_sizes,
    node_value,
    placeholders,
    returns_sequence,
)
from branchyard.fx.graph_walk import name_graphs
from branchyard.passes.leaf_dedup import group_identical
from branchyard.fx.raise_free import may_raise, raise_reason

if TYPE_CHECKING:  # pragma: no cover
    from branchyard.passes.flatten_cost import FlattenCostModel

__all__ = [
    "CondTree",
    "DispatchChain",
    "find_cond_trees",
    "analyze_cond_tree",
    "match_dispatch_chain",
    "resolve_origin",
]

aten = torch.ops.aten

#: How a tree the cost model declines to flatten at all is reported.
LEFT_NESTED = "left nested by the cost model"


@dataclass(frozen=True)
class _Literal:
    """A non-node operand (an int) passed to a cond."""

    value: Any


@dataclass(eq=False)
class _Sub:
    """One branch graph inside a cond tree."""

    gm: GraphModule
    parent: "_Cond"
    side: bool
    phs: list[Node]
    nested: "_Cond | None" = None
    #: Absorbing ``nested`` needs no inlining: its operands are our
    #: placeholders, our outputs are its outputs, nothing else has effects.
    trivial: bool = False
    #: Per placeholder: root operand position (int) or _Literal; None when
    #: some enclosing branch is not trivial (the leaf must then be inlined).
    root_args: list[Any] | None = None
    #: Per placeholder: where its value is computed, as (branch or None for
    #: the owner graph, node or literal). Filled top-down, so following a
    #: value out of a deep tree costs O(1), not O(depth).
    origins: list[tuple["_Sub | None", Any]] = field(default_factory=list)
    ph_pos: dict[Node, int] = field(default_factory=dict)


@dataclass(eq=False)
class _Cond:
    """One cond of a tree; ``home`` is the branch containing it (None: the root)."""

    parts: CondParts
    home: _Sub | None
    true: _Sub | None = None
    false: _Sub | None = None

    def child(self, side: bool) -> _Sub:
        # set by analyze_cond_tree before any use
        return checked(self.true if side else self.false, "a side of a cond", where="cond_tree")


@dataclass
class DispatchChain:
    """An ``idx == k0 ? L0 : idx == k1 ? L1 : ... : Lfall`` chain."""

    value: Node  #: the compared value (in the graph of ``value_home``)
    value_home: _Sub | None  #: branch graph containing ``value`` (None: the owner graph)
    constants: list[int]  #: k_i in chain order
    hits: list[_Sub]  #: the leaf taken when ``idx == k_i``
    fall: _Sub  #: the leaf taken when no comparison holds


@dataclass
class CondTree:
    """One maximal tree of nested conds and the switch that would replace it.

    ``operands_before`` sums the operand counts of every cond in the tree;
    ``operands_after`` is the operand count of the replacing switch;
    ``duplicated_operands`` names outer values passed more than once across
    the tree; ``index_form`` is ``"dispatch"`` when the switch index is the
    dispatch-chain integer with a range fix, else ``"general"``
    (``index_note`` says why the fast form was not used).
    """

    root: Node
    owner: GraphModule
    depth: int
    num_leaves: int
    num_unique_leaves: int
    operands_before: int
    operands_after: int
    duplicated_operands: list[str]
    is_dispatch_chain: bool
    index_form: str = "general"
    index_note: str = ""
    #: Conds right below the flattened levels that the cost model kept nested.
    kept_nested: int = 0
    # What the rewrite needs; not part of the report.
    _plan: "_Plan | None" = field(default=None, repr=False, compare=False)


@dataclass(eq=False)
class _Plan:
    root: _Cond
    conds: list[_Cond]
    leaves: list[_Sub]
    leaf_graphs: list[Graph]
    sinks: list[AttrSink]
    operands: list[Any]  #: the switch operands (outer nodes or ints), deduplicated
    branch_reps: list[int]  #: leaf index representing each branch
    branch_of_leaf: list[int]
    dispatch: DispatchChain | None
    dispatch_order: list[int] | None  #: leaf index per switch branch in dispatch form


# ---------------------------------------------------------------------------
# Hoistability: what may be computed outside the branch that contains it.

def _op_reason(node: Node) -> str | None:
    """Why ``node`` may not be computed where the original does not compute
    it, or None if it may: only ops on the raise-free allow-list qualify
    (:mod:`branchyard.passes.raise_free`), so a hoisted predicate can never
    raise on an input whose path in the original does not reach it."""
    if node.op == "call_function" and isinstance(node.target, HigherOrderOperator):
        return "it is a higher-order op"
    why = raise_reason(node)
    return None if why is None else f"it may raise: {why}"


class _Hoistability:
    """Memoised check that a node of some branch can be computed in the
    owner graph before the root cond."""

    def __init__(self) -> None:
        self._memo: dict[tuple[int, Node], str | None] = {}

    def reason(self, node: Any, sub: _Sub | None) -> str | None:
        """None if ``node`` (in ``sub``'s graph) is hoistable, else why not."""
        if not isinstance(node, Node) or sub is None:
            return None  # literals, and anything already in the owner graph
        key = (id(sub), node)
        if key in self._memo:
            return self._memo[key]
        self._memo[key] = None  # cycles are impossible in a DAG; guard anyway
        if node.op == "placeholder":
            result = self.reason(*reversed(resolve_origin(node, sub)))
        else:
            why = _op_reason(node)
            result = f"{describe_node(node)}: {why}" if why else None
            for inp in node.all_input_nodes if result is None else ():
                result = self.reason(inp, sub)
                if result is not None:
                    break
        self._memo[key] = result
        return result


def resolve_origin(node: Any, sub: _Sub | None) -> tuple[_Sub | None, Any]:
    """Follow placeholders outward: the branch (None: owner graph) where
    ``node``'s value is actually computed, and the node there."""
    if isinstance(node, Node) and sub is not None and node.op == "placeholder":
        return sub.origins[sub.ph_pos[node]]
    return sub, node


# ---------------------------------------------------------------------------
# Matchers: each returns a match or a reason string.


def _is_tensor_pred(pred: Any) -> bool:
    return isinstance(pred, Node) and isinstance(node_value(pred), torch.Tensor)


def _merged_sizes_reason(parts: CondParts) -> str | None:
    """Why a cond whose branches return different sizes is not flattened, or None.

    torch.export accepts such a cond and gives its output an unbacked size
    (``u0``) that the rest of the program (``sym_size``, runtime asserts) is
    written against. A switch over the leaves would carry that symbol without
    the cond that defines it, so the cond keeps its structure."""
    where = merged_output_sizes(parts.node, [parts.true_gm, parts.false_gm], ["true branch", "false branch"])
    if where is None:
        return None
    return f"its branches return different sizes ({where}); such a cond is kept as it is"


def match_nested_cond(sub: _Sub, hoist: _Hoistability) -> CondParts | str | None:
    """The cond ``sub`` can absorb, a reason it cannot, or None if it holds no cond."""
    conds = [n for n in sub.gm.graph.nodes if is_cond(n)]
    if not conds:
        return None
    if len(conds) > 1:
        return f"branch graph holds {len(conds)} conds; only a single nested cond is flattened"
    parts = cond_parts(sub.gm, conds[0])
    merged = _merged_sizes_reason(parts)
    if merged is not None:
        return f"{describe_node(conds[0])}: {merged}"
    if not _is_tensor_pred(parts.pred):
        return f"predicate of {describe_node(conds[0])} is not a tensor (a Python or symbolic bool)"
    why = hoist.reason(parts.pred, sub)
    if why is not None:
        return f"predicate of {describe_node(conds[0])} cannot be hoisted: {why}"
    return parts


def _is_trivial(sub: _Sub, parts: CondParts) -> bool:
    node = parts.node
    if not returns_sequence(parts.true_gm):
        return False  # cond yields a bare value; getitem on it would index the tensor
    if not returns_sequence(sub.gm):
        return False  # the branch unwraps the cond's tuple (returns c[0] bare): its leaves must be inlined
    if not all(not isinstance(o, Node) or o.op == "placeholder" for o in parts.operands):
        return False
    outs = graph_outputs(sub.gm)
    n_results = len(graph_outputs(parts.true_gm))
    if len(outs) != n_results:
        return False
    for i, o in enumerate(outs):
        if not (isinstance(o, Node) and o.target is operator.getitem and o.args[0] is node and o.args[1] == i):
            return False
    # Anything else in the branch must be droppable: no effects, and nothing
    # that might raise (the original computes it whichever leaf is taken).
    return not any(may_raise(n) for n in sub.gm.graph.nodes
                   if n.op in ("call_function", "call_method") and n is not node and n.target is not operator.getitem)


_EQ_TARGETS: dict[Any, bool] = {
    # comparison op -> whether the chain's leaf is on the true side
    aten.eq.Scalar: True,
    aten.ne.Scalar: False,
    operator.eq: True,
    operator.ne: False,
    torch.eq: True,
    torch.ne: False,
}


def _match_compare(pred: Any) -> tuple[Node, int, bool] | str:
    """``pred`` as ``(value, k, hit_side)`` for ``value ==/!= k`` with an int ``k``."""
    if not isinstance(pred, Node) or pred.op != "call_function" or pred.target not in _EQ_TARGETS:
        return f"predicate {getattr(pred, 'name', pred)!r} is not an ==/!= comparison"
    if len(pred.args) != 2 or pred.kwargs:
        return f"comparison {pred.name!r} does not have two positional arguments"
    a, b = pred.args
    if isinstance(b, Node) and not isinstance(a, Node):
        a, b = b, a
    if not isinstance(a, Node) or type(b) is not int:
        return f"comparison {pred.name!r} is not between a value and an int constant"
    return a, b, _EQ_TARGETS[pred.target]


def match_dispatch_chain(root: _Cond) -> DispatchChain | str:
    """The dispatch chain rooted at ``root``, or why the tree is not one."""
    constants: list[int] = []
    hits: list[_Sub] = []
    key: tuple[int, Node] | None = None
    value: Node | None = None
    home: _Sub | None = None
    cond = root
    while True:
        m = _match_compare(cond.parts.pred)
        if isinstance(m, str):
            return m
        v, k, hit_side = m
        vhome, vnode = resolve_origin(v, cond.home)
        this = (id(vhome), vnode)
        if key is None:
            key, value, home = this, vnode, vhome
        elif this != key:
            return f"{cond.parts.pred.name!r} compares a different value than the chain's first comparison"
        hit, other = cond.child(hit_side), cond.child(not hit_side)
        if hit.nested is not None:
            return f"the matching side of {describe_node(cond.parts.node)} is a nested cond, not a leaf"
        constants.append(k)
        hits.append(hit)
        if other.nested is None:
            value = checked(value, "the dispatch chain's compared value", where="cond_tree")
            return DispatchChain(value, home, constants, hits, other)
        cond = other.nested


def _dispatch_fast_form(chain: DispatchChain, branch_of_leaf: list[int], leaf_pos: dict[int, int]) -> list[int] | str:
    """Leaf order (by constant, then the fall-through) if the index can be
    ``clamp(idx - lo, -1, n) mod (n + 1)``, else why not."""
    val = node_value(chain.value)
    if not isinstance(val, torch.Tensor):
        return "compared value has no tensor example value"
    if val.dtype == torch.bool or val.dtype.is_floating_point or val.dtype.is_complex:
        return f"compared value has dtype {val.dtype}; the integer fast form would mis-handle non-integers"
    if not all(isinstance(s, int) for s in val.shape) or val.numel() != 1:
        return f"compared value has shape {tuple(val.shape)}, not a single element"
    ks = chain.constants
    if len(set(ks)) != len(ks):
        return "a constant repeats (a later comparison is unreachable)"
    lo, n = min(ks), len(ks)
    if max(ks) - lo != n - 1:
        return f"constants {sorted(ks)} are not contiguous"
    info = torch.iinfo(val.dtype)
    if lo < info.min or lo + n - 1 > info.max:
        return f"constants do not fit {val.dtype}"
    order = [leaf_pos[id(chain.hits[ks.index(lo + j)])] for j in range(n)] + [leaf_pos[id(chain.fall)]]
    if len({branch_of_leaf[i] for i in order}) != len(order):
        return "identical leaves were merged, so the index must remap several values to one branch"
    return order


# ---------------------------------------------------------------------------
# Building the tree, materializing its leaves.


def _value_meta(op: Any) -> dict[str, Any]:
    if not isinstance(op, Node):
        return {}
    return {k: v for k, v in op.meta.items() if k in ("val", "example_value", "tensor_meta")}


def _operand_key(op: Any) -> Any:
    return op if isinstance(op, Node) else _Literal(op)


def _materialize(root: _Cond, leaf: _Sub, sink: AttrSink) -> tuple[Graph, list[Node]]:
    """A graph computing ``leaf``'s outputs from the root operands (one placeholder per root operand)."""
    g = Graph()
    phs = []
    for i, op in enumerate(root.parts.operands):
        ph = g.placeholder(op.name if isinstance(op, Node) else f"const{i}")
        ph.meta = _value_meta(op)
        phs.append(ph)

    def bind(root_args: list[Any]) -> list[Any]:
        return [phs[a] if isinstance(a, int) else a.value for a in root_args]

    if leaf.root_args is not None:
        out = inline_graph(g, leaf.gm, bind(leaf.root_args), sink)
    else:
        chain = [leaf]
        while chain[-1].root_args is None:
            # root children always have root_args
            home = checked(chain[-1].parent.home, "a nested cond's home", where="cond_tree")
            chain.append(home)
        chain.reverse()
        out = _inline_chain(g, chain, 0, bind(chain[0].root_args or []), sink)
    g.output(out)
    # Unused nodes that might raise stay: the original computes them on this path.
    g.eliminate_dead_code(is_impure_node=may_raise)
    return g, phs


def _inline_chain(g: Graph, chain: list[_Sub], k: int, args: list[Any], sink: AttrSink) -> Any:
    sub = chain[k]
    if k == len(chain) - 1:
        return inline_graph(g, sub.gm, args, sink)
    nested = checked(sub.nested, "the nested cond on the chain", where="cond_tree")
    node = nested.parts.node

    def expand(env: dict[Node, Any]) -> Any:
        child_args = [env[o] if isinstance(o, Node) else o for o in nested.parts.operands]
        return _inline_chain(g, chain, k + 1, child_args, sink)

    return inline_graph(
        g, sub.gm, args, sink, replace={node: expand},
        drop=frozenset([nested.parts.true_attr, nested.parts.false_attr]),
    )


def _leaves_in_order(root: _Cond) -> list[_Sub]:
    """The branch graphs that absorb nothing, depth-first, true side first."""
    out: list[_Sub] = []
    stack = [root.child(False), root.child(True)]
    while stack:
        sub = stack.pop()
        if sub.nested is None:
            out.append(sub)
        else:
            stack += [sub.nested.child(False), sub.nested.child(True)]
    return out


def analyze_cond_tree(
    owner: GraphModule, node: Node, on_skip: Callable[[Node | str, str], None] = lambda w, r: None,
    cost_model: "FlattenCostModel | None" = None,
) -> CondTree | str:
    """Analyse the tree rooted at cond ``node`` of ``owner``: a
    :class:`CondTree` (with the plan the rewrite follows), or the reason it
    is not rewritten. Reasons for leaving nested conds out go to ``on_skip``.
    With a ``cost_model``, only the top levels it finds profitable are
    absorbed (see :class:`FlattenCostModel`); None absorbs everything it can.
    Raises MalformedGraphError for ill-formed conds."""
    root = _Cond(cond_parts(owner, node), None)
    if not _is_tensor_pred(root.parts.pred):
        return "predicate is not a tensor (a Python or symbolic bool); a switch index must be a tensor"
    merged = _merged_sizes_reason(root.parts)
    if merged is not None:
        return merged
    hoist = _Hoistability()
    conds, leaves = [root], []
    m = len(root.parts.operands)
    # Depth-first, true side first, so leaves come out in chain order.
    stack: list[tuple[_Cond, bool]] = [(root, False), (root, True)]
    depth_of: dict[int, int] = {id(root): 1}
    while stack:
        cond, side = stack.pop()
        gm = cond.parts.branch(side)
        sub = _Sub(gm, cond, side, placeholders(gm))
        sub.ph_pos = {ph: i for i, ph in enumerate(sub.phs)}
        sub.origins = [resolve_origin(o, cond.home) for o in cond.parts.operands]
        if side:
            cond.true = sub
        else:
            cond.false = sub
        home = cond.home
        if home is None:
            sub.root_args = list(range(m))
        elif home.trivial and home.root_args is not None:
            sub.root_args = [
                home.root_args[home.ph_pos[o]] if isinstance(o, Node) else _Literal(o) for o in cond.parts.operands
            ]
        match = match_nested_cond(sub, hoist)
        if match is None:
            leaves.append(sub)
            continue
        if isinstance(match, str):
            on_skip(next(n for n in gm.graph.nodes if is_cond(n)), f"kept as a leaf of {describe_node(node)}: {match}")
            leaves.append(sub)
            continue
        sub.trivial = _is_trivial(sub, match)
        child = _Cond(match, sub)
        sub.nested = child
        conds.append(child)
        depth_of[id(child)] = depth_of[id(cond)] + 1
        stack += [(child, False), (child, True)]
    if len(conds) == 1:
        return "no nested cond in either branch; a lone cond is left as is"
    kept: list[_Cond] = []
    if cost_model is not None:
        full = max(depth_of.values())
        levels, why = cost_model.choose_levels(root, conds, depth_of)
        if levels < full:
            kept = [c for c in conds if depth_of[id(c)] == levels + 1]
            note = (f"flattened {levels} of {full} levels; {len(kept)} cond(s) below level {levels} kept nested "
                    f"(they may form trees of their own): {why}")
            if levels == 1:
                return f"{LEFT_NESTED}: {why}"
            on_skip(node, note)
            conds = [c for c in conds if depth_of[id(c)] <= levels]
            for c in kept:
                checked(c.home, "a kept cond's home", where="cond_tree").nested = None
            depth_of = {id(c): depth_of[id(c)] for c in conds}
            leaves = _leaves_in_order(root)

    sinks = [AttrSink() for _ in leaves]
    graphs_phs = [_materialize(root, leaf, s) for leaf, s in zip(leaves, sinks)]

    # The switch operands: root operands any leaf reads, each outer value once.
    used: set[Any] = set()
    for _, phs in graphs_phs:
        for i, ph in enumerate(phs):
            if ph.users:
                used.add(_operand_key(root.parts.operands[i]))
    operands: list[Any] = []
    slot: dict[Any, int] = {}
    for op in root.parts.operands:
        key = _operand_key(op)
        if key in used and key not in slot:
            slot[key] = len(operands)
            operands.append(op)
    # Re-key each leaf's inputs to the switch operands in place: the first
    # placeholder of each outer value stays (root order = operand order),
    # later duplicates forward to it, unread ones go.
    first_pos: dict[Any, int] = {}
    for i, op in enumerate(root.parts.operands):
        first_pos.setdefault(_operand_key(op), i)
    leaf_graphs = []
    for g, phs in graphs_phs:
        for i, ph in enumerate(phs):
            key = _operand_key(root.parts.operands[i])
            keep = first_pos[key]
            if keep != i:
                ph.replace_all_uses_with(phs[keep])
                g.erase_node(ph)
            elif key not in used:
                g.erase_node(ph)
        leaf_graphs.append(g)

    reps, branch_of_leaf = group_identical([(g, s.attrs) for g, s in zip(leaf_graphs, sinks)])

    # Outer values passed more than once across the tree.
    seen: dict[Node, int] = {}
    for c in conds:
        for op in c.parts.operands:
            where, origin = resolve_origin(op, c.home)
            if isinstance(origin, Node) and where is None:
                seen[origin] = seen.get(origin, 0) + 1
    duplicated = [n.name for n, count in seen.items() if count > 1]

    chain = match_dispatch_chain(root)
    dispatch, order, note = None, None, ""
    if isinstance(chain, DispatchChain):
        leaf_pos = {id(leaf): i for i, leaf in enumerate(leaves)}
        fast = _dispatch_fast_form(chain, branch_of_leaf, leaf_pos)
        if isinstance(fast, str):
            note = f"dispatch chain uses the general index: {fast}"
            on_skip(node, note)
        elif _Hoistability().reason(chain.value, chain.value_home) is not None:
            note = "dispatch chain uses the general index: the compared value cannot be hoisted"
            on_skip(node, note)
        else:
            dispatch, order = chain, fast

    plan = _Plan(root, conds, leaves, leaf_graphs, sinks, operands, reps, branch_of_leaf, dispatch, order)
    return CondTree(
        root=node,
        owner=owner,
        depth=max(depth_of.values()),
        num_leaves=len(leaves),
        num_unique_leaves=len(reps),
        operands_before=sum(len(c.parts.operands) for c in conds),
        operands_after=len(operands),
        duplicated_operands=duplicated,
        is_dispatch_chain=isinstance(chain, DispatchChain),
        index_form="dispatch" if dispatch is not None else "general",
        index_note=note,
        kept_nested=len(kept),
        _plan=plan,
    )


def find_cond_trees(gm: GraphModule) -> list[CondTree]:
    """Every maximal tree of nested conds (depth >= 2) in ``gm`` and its
    subgraphs, outermost first. Analysis only: ``gm`` is not modified
    (errors name its subgraphs from ``gm``, see :func:`graph_path`)."""
    trees: list[CondTree] = []
    absorbed: set[Node] = set()
    for m in name_graphs(gm):
        for node in m.graph.nodes:
            if not is_cond(node) or node in absorbed:
                continue
            tree = analyze_cond_tree(m, node)
            if isinstance(tree, CondTree):
                trees.append(tree)
                plan = checked(tree._plan, "a cond tree's rewrite plan", where="cond_tree")
                absorbed.update(c.parts.node for c in plan.conds)
    return trees
