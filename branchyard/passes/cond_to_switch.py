"""``cond_to_switch``: replace trees of nested ``torch.cond`` by
``torch.ops.higher_order.switch`` over the trees' leaves.

Postcondition: every absorbable cond tree of depth >= 2 in the graph or its
subgraphs has had its top levels flattened into one switch, as many levels
as :class:`~branchyard.passes.flatten_cost.FlattenCostModel` finds
profitable (all of them with ``flatten="all"``), down to the point where
flattening one more level would add placeholders or eager cost; what lies
below stays nested inside the switch branches and is itself flattened the
same way. Each switch's branches are the distinct leaves of the flattened
part, its operands the leaves' outer inputs each passed once, and its index
always in range (or, when every leaf is identical, that leaf's body is
inlined). The program computes and raises exactly what it did before.

Before (``idx == 0 ? a : (idx == 1 ? b : c)`` as export traces it)::

    cond = cond(eq_0, true_graph_0, false_graph_0, (x, w, idx))
    # false_graph_0(x, w, idx):
    #     eq_1 = idx == 1
    #     cond = cond(eq_1, true_graph_0, false_graph_0, (x, w))
    #     return (cond[0],)

After::

    clamp = aten.clamp(idx, -1, 2)
    remainder = aten.remainder(clamp, 3)          # dispatch chain: the index is idx itself
    switch = switch(remainder, [branch0, branch1, branch2], (x, w))

Semantics, as Python (``pred_k`` are the tree's predicates, hoisted out of
the branches that computed them; ``leaf_of`` walks the tree)::

    def before(*operands):                       # the nested conds
        return leaf_of(pred_0, pred_1, ...)(*operands)

    def after(*operands):
        index = branch_of[leaf_number(pred_0, pred_1, ...)]   # nested where()s
        return branches[index](*deduplicated(operands))

    # For a dispatch chain on ``idx`` with contiguous constants lo .. lo+n-1:
    index = (clamp(idx - lo, -1, n)) % (n + 1)   # out-of-range -> n, the fall-through

Exceptions are preserved both ways: only predicates whose every op is on
the raise-free allow-list (:mod:`branchyard.passes.raise_free`) are hoisted,
so ``after`` raises exactly where ``before`` raises; a nested cond whose
predicate might raise stays nested, with the reason in the report.

A switch clamps its index to the first or last branch (the rule as
:mod:`branchyard.fx.control_flow` states it), whereas a cond chain sends
every value it does not match to its fall-through leaf; the index this pass
builds is always in range, so it reproduces the chain's fall-through for
every input, negatives and values >= n included, without relying on either
side of the rule. See ``docs/passes.md``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Callable

import torch
from torch.fx import GraphModule, Node

from branchyard._compat import switch_op
from branchyard.errors import BranchyardError, checked
from branchyard.passes.cond_tree import (
    LEFT_NESTED,
    CondTree,
    _Plan,
    _Sub,
    analyze_cond_tree,
    find_cond_trees,
    resolve_origin,
)
from branchyard.fx.control_flow import (
    AttrSink,
    emit,
    erase_dead_inputs,
    inline_graph,
    is_cond,
    new_graph_module,
    node_value,
    replace_with_outputs,
)
from branchyard.fx.graph_walk import inherit_graph_path, rewrite_graphs
from branchyard.fx.pass_infra import BranchyardPass, Program, apply_pass
from branchyard.passes.flatten_cost import FlattenCostModel

__all__ = ["CondToSwitch", "cond_to_switch", "find_cond_trees", "CondTree", "inductor_pre_grad_pass"]

aten = torch.ops.aten

#: Which ``where`` overload selects between two index values, by whether
#: each side is a node (True) or an int constant (False).
_WHERE = {
    (False, False): aten.where.Scalar,
    (True, False): aten.where.ScalarOther,
    (False, True): aten.where.ScalarSelf,
    (True, True): aten.where.self,
}

_STATS = ("cond_trees", "conds_removed", "switches_created", "leaves", "branches_after_dedup",
          "operands_before", "operands_after", "dispatch_index", "general_index", "conds_kept_nested_by_cost",
          "trees_left_nested_by_cost")


class _Hoister:
    """Copies predicate slices out of branch graphs into the owner graph
    (at its current insertion point), each node once."""

    def __init__(self, owner: GraphModule) -> None:
        self.graph = owner.graph
        self._memo: dict[tuple[int, Node], Any] = {}

    def __call__(self, node: Any, sub: _Sub | None) -> Any:
        sub, node = resolve_origin(node, sub)
        if not isinstance(node, Node) or sub is None:
            return node
        key = (id(sub), node)
        if key not in self._memo:
            self._memo[key] = self.graph.node_copy(node, lambda a: self(a, sub))
        return self._memo[key]


def _general_index(plan: _Plan, hoist: _Hoister, like: Node) -> Any:
    """Nested ``where``s over the hoisted predicates mapping each leaf to
    its branch; subtrees whose leaves share one branch fold to a constant."""
    leaf_pos = {id(leaf): i for i, leaf in enumerate(plan.leaves)}
    graph = hoist.graph

    index: dict[int, Any] = {}
    # plan.conds lists parents before children: walk it backwards so every
    # subtree's index exists before its parent's where() (no recursion, so
    # trees thousands deep are fine).
    for cond in reversed(plan.conds):
        t, f = (
            plan.branch_of_leaf[leaf_pos[id(sub)]] if sub.nested is None else index[id(sub.nested)]
            for sub in (cond.child(True), cond.child(False))
        )
        if not isinstance(t, Node) and not isinstance(f, Node) and t == f:
            index[id(cond)] = t
            continue
        pred = hoist(cond.parts.pred, cond.home)
        if node_value(pred).dtype != torch.bool:
            # cond takes any single-element tensor by truthiness; where wants bool.
            pred = emit(graph, aten.ne.Scalar, (pred, 0), like=like)
        index[id(cond)] = emit(graph, _WHERE[(isinstance(t, Node), isinstance(f, Node))], (pred, t, f), like=like)
    return index[id(plan.root)]


def _dispatch_index(plan: _Plan, hoist: _Hoister, like: Node) -> Node:
    """``clamp(idx - lo, -1, n) % (n + 1)``: idx in [lo, lo+n) -> idx - lo, anything else -> n."""
    chain = checked(plan.dispatch, "the plan's dispatch chain", where="cond_to_switch")
    graph = hoist.graph
    x = hoist(chain.value, chain.value_home)
    lo, n = min(chain.constants), len(chain.constants)
    if node_value(x).dtype != torch.int64:
        # Widen first so that idx - lo cannot wrap inside a narrow dtype.
        x = emit(graph, aten._to_copy.default, (x,), {"dtype": torch.int64}, like=like)
    if lo != 0:
        # Overflow at the int64 extremes moves the value far outside [0, n): still the fall-through.
        x = emit(graph, aten.sub.Scalar, (x, lo), like=like)
    x = emit(graph, aten.clamp.default, (x, -1, n), like=like)
    return emit(graph, aten.remainder.Scalar, (x, n + 1), like=like)


def _rewrite(tree: CondTree, dead_attrs: set[str]) -> None:
    """Replace ``tree.root`` by one switch (or, when every leaf is identical, by the leaf itself)."""
    plan = checked(tree._plan, "a cond tree's rewrite plan", where="cond_to_switch")
    owner, root = tree.owner, tree.root
    graph = owner.graph
    sink = AttrSink(owner)
    if plan.dispatch_order is not None:
        branch_leaves = plan.dispatch_order
    else:
        branch_leaves = plan.branch_reps
    with graph.inserting_before(root):
        if len(branch_leaves) == 1:
            # Every leaf computes the same function: no choice left to make.
            leaf = plan.leaf_graphs[branch_leaves[0]]
            gm = new_graph_module(plan.sinks[branch_leaves[0]].attrs, leaf)
            out = inline_graph(graph, gm, plan.operands, sink)
            result: Any = None
            replace_with_outputs(graph, root, out)
        else:
            hoist = _Hoister(owner)
            if plan.dispatch is not None:
                index = _dispatch_index(plan, hoist, root)
            else:
                index = _general_index(plan, hoist, root)
            attrs = []
            for b, leaf_i in enumerate(branch_leaves):
                gm = new_graph_module(plan.sinks[leaf_i].attrs, plan.leaf_graphs[leaf_i])
                inherit_graph_path(gm, plan.leaves[leaf_i].gm)  # errors and skips name the input's branch
                name = sink.add(f"{root.name}_branch{b}", gm)
                attrs.append(graph.get_attr(name))
            result = graph.call_function(switch_op(), (index, attrs, tuple(plan.operands)))
            result.meta = {k: v for k, v in root.meta.items() if k in ("val", "example_value", "stack_trace", "nn_module_stack")}
    if result is not None:
        root.replace_all_uses_with(result)
    graph.erase_node(root)
    erase_dead_inputs(graph, [plan.root.parts.pred, *plan.root.parts.operands])
    # dict.fromkeys: both sides may read one get_attr node (the same subgraph), erased once.
    for attr in dict.fromkeys((plan.root.parts.true_attr, plan.root.parts.false_attr)):
        if not attr.users:
            dead_attrs.add(str(attr.target))
            graph.erase_node(attr)


class CondToSwitch(BranchyardPass):
    """Flatten nested-cond trees into switches (see the module docstring).

    ``flatten="cost"`` (the default) flattens, per tree, only the top levels
    that make the program neither larger (placeholders) nor slower (eager
    dispatch) by :class:`~branchyard.passes.flatten_cost.FlattenCostModel`;
    deeper levels stay nested inside the switch branches and are considered
    again as trees of their own, and the report says what was kept and why.
    ``flatten="all"`` flattens every absorbable tree completely (one switch
    per tree, the fewest host reads of predicates, whatever it costs).
    """

    name = "cond_to_switch"
    pause_gc = True

    def __init__(self, flatten: str = "cost", cost_model: FlattenCostModel | None = None) -> None:
        super().__init__()
        if flatten not in ("cost", "all"):
            raise BranchyardError(f"flatten={flatten!r} is not one of 'cost', 'all'", where="CondToSwitch")
        self.flatten = flatten
        self.cost_model = None if flatten == "all" else (cost_model or FlattenCostModel())

    def run(self, graph_module: GraphModule) -> bool:
        for key in _STATS:
            self.report.stats[key] = 0
        switch_op()  # fail early and clearly on a torch without switch
        return rewrite_graphs(graph_module, self._rewrite_tree)

    def _rewrite_tree(self, gm: GraphModule, node: Node, dead_attrs: set[str]) -> bool:
        if not is_cond(node):
            return False
        tree = analyze_cond_tree(gm, node, self.skip, self.cost_model)
        if isinstance(tree, str):
            self.skip(node, tree)
            self.report.stats["trees_left_nested_by_cost"] += tree.startswith(LEFT_NESTED)
            return False
        _rewrite(tree, dead_attrs)
        self._count(tree)
        return True

    def _count(self, tree: CondTree) -> None:
        plan = checked(tree._plan, "a cond tree's rewrite plan", where="cond_to_switch")
        s = self.report.stats
        s["cond_trees"] += 1
        s["conds_removed"] += len(plan.conds)
        s["switches_created"] += int(tree.num_unique_leaves > 1)
        s["leaves"] += tree.num_leaves
        s["branches_after_dedup"] += tree.num_unique_leaves
        s["operands_before"] += tree.operands_before
        s["operands_after"] += tree.operands_after
        s["dispatch_index" if tree.index_form == "dispatch" else "general_index"] += 1
        s["conds_kept_nested_by_cost"] += tree.kept_nested

    @classmethod
    def as_inductor_pre_grad_pass(cls) -> Any:
        """A ``torch._inductor.config.pre_grad_custom_pass`` value running this pass.

        >>> import torch
        >>> torch._inductor.config.pre_grad_custom_pass = CondToSwitch.as_inductor_pre_grad_pass()
        >>> torch._inductor.config.pre_grad_custom_pass = None
        """
        return __getattr__("inductor_pre_grad_pass")


def cond_to_switch(program: Program, flatten: str = "cost") -> Program:
    """Function form of :class:`CondToSwitch`: a rewritten copy of ``program``
    (an ExportedProgram or a GraphModule; the result is of the same kind).
    ``flatten`` is ``"cost"`` (flatten what pays) or ``"all"``.

    >>> import torch
    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> def f(i, x):
    ...     inner = lambda x, i: torch.cond(i == 1, lambda x: x + 1, lambda x: x - 1, (x,))
    ...     return torch.cond(i == 0, lambda x, i: x * 2, inner, (x, i))
    >>> gm = cond_to_switch(make_fx(f)(torch.tensor(0), torch.randn(3)))
    >>> [n.target.name() for n in gm.graph.nodes if isinstance(n.target, torch._ops.HigherOrderOperator)]
    ['switch']
    >>> [gm(torch.tensor(i), torch.ones(2)).tolist() for i in (-1, 0, 1, 2)]
    [[0.0, 0.0], [2.0, 2.0], [2.0, 2.0], [0.0, 0.0]]
    """
    return apply_pass(program, CondToSwitch(flatten))


def _source_hash() -> str:
    h = hashlib.sha256()
    here = Path(__file__).parent
    for path in (here / "cond_to_switch.py", here / "cond_tree.py", here / "leaf_dedup.py", here / "raise_free.py",
                 here / "flatten_cost.py", here.parent / "fx" / "control_flow.py", here.parent / "fx" / "graph_walk.py"):
        h.update(path.read_bytes())
    return h.hexdigest()


def _make_inductor_pass() -> Callable[[torch.fx.Graph], None]:
    try:
        from torch._inductor.custom_graph_pass import CustomGraphPass
    except ImportError:  # pragma: no cover - very old torch
        CustomGraphPass = object  # type: ignore[assignment,misc]

    class _CondToSwitchPreGrad(CustomGraphPass):  # type: ignore[misc,valid-type]
        """Inductor pre-grad custom pass running :class:`CondToSwitch` in place.

        Implements ``uuid()`` (a hash of the pass sources) so Inductor can
        cache graphs compiled with it.
        """

        #: The report of the most recent run (Inductor discards the pass result).
        last_report: Any = None

        def __call__(self, graph: torch.fx.Graph) -> None:
            gm = graph.owning_module
            if gm is None:
                raise BranchyardError("pre-grad graph has no owning GraphModule; cannot reach its cond subgraphs")
            p = CondToSwitch()
            p(gm)
            self.last_report = p.report

        def uuid(self) -> str:
            return _source_hash()

    return _CondToSwitchPreGrad()


_INDUCTOR_PASS: Any = None


def __getattr__(name: str) -> Any:
    # ``inductor_pre_grad_pass``: the ready-made value for
    # ``torch._inductor.config.pre_grad_custom_pass``, built on first use so
    # importing branchyard does not import Inductor (about a second).
    global _INDUCTOR_PASS
    if name == "inductor_pre_grad_pass":
        if _INDUCTOR_PASS is None:
            _INDUCTOR_PASS = _make_inductor_pass()
        return _INDUCTOR_PASS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
