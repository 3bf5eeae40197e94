"""How many levels of a cond tree ``cond_to_switch`` flattens: a cost model
that keeps the rewrite from making a program larger or slower.

Flattening the top ``k`` levels of a tree replaces the conds of those levels
by one switch over the *frontier*: the branch graphs where the flattened
part ends (leaves, or branches whose deeper conds stay nested and may become
switches of their own later). Every switch branch takes every operand, so
that switch has ``B * O`` placeholders (``B`` frontier branches, ``O``
distinct operands they read), where the conds it replaces had one
placeholder per operand per branch graph. And the switch evaluates every
hoisted predicate on every call plus one ``where`` per cond, where the
nested program evaluates only those on its path.

For each ``k`` from the full depth down to 2, :meth:`FlattenCostModel.choose_levels`
takes the deepest one that meets both:

* **size** -- ``B * O`` is at most the placeholders of the branch graphs it
  replaces (so, level by level, the rewritten program never has more
  placeholders than the original);
* **time** -- the estimated eager cost of one switch call (``call +
  per_operand * O + per_branch * B + per_op * index ops``) is at most the
  mean, over the frontier, of the nested path's cost (per cond on the path:
  ``call + per_operand * operands + per_branch * 2``, plus its hoisted
  predicate's ops).

``B`` and ``O`` are upper bounds (before identical leaves merge; every root
operand counted for a branch whose enclosing bodies are inlined), so the
bound on placeholders holds for the graph the pass builds. The default
weights are microseconds of eager dispatch on a CPU (torch 2.14: a
higher-order op call about 30, each operand about 1.8, each branch module
about 3.7, a 0-d aten op about 2.1), measured by ``benchmarks/cond_switch.py``'s
machine; only their ratios matter::

    >>> FlattenCostModel().switch_cost(operands=10, branches=4, index_ops=6)
    75.4
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch.fx import Node

if TYPE_CHECKING:  # pragma: no cover
    from branchyard.passes.cond_tree import _Cond, _Sub

__all__ = ["FlattenCostModel"]


def _slice_ops(pred: Any) -> int:
    """Call nodes in ``pred``'s backward slice within its own graph."""
    if not isinstance(pred, Node):
        return 0
    seen: set[Node] = set()
    stack = [pred]
    while stack:
        n = stack.pop()
        if n in seen or n.op not in ("call_function", "call_method"):
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return len(seen)


@dataclass(frozen=True)
class FlattenCostModel:
    """Weights of the eager cost estimate (see the module docstring)."""

    call: float = 30.0  #: one higher-order op call, its branch module's call included
    per_operand: float = 1.8  #: each operand a cond/switch passes
    per_branch: float = 3.7  #: each branch module a cond/switch holds
    per_op: float = 2.1  #: each op computing the switch index (predicates and wheres)

    def switch_cost(self, operands: int, branches: int, index_ops: int) -> float:
        return round(self.call + self.per_operand * operands + self.per_branch * branches + self.per_op * index_ops, 6)

    def cond_cost(self, operands: int, pred_ops: int) -> float:
        return self.call + self.per_operand * operands + self.per_branch * 2 + self.per_op * pred_ops

    def choose_levels(self, root: "_Cond", conds: list["_Cond"], depth_of: dict[int, int]) -> tuple[int, str]:
        """The number of levels to flatten (1: none) and, when that is not
        the full depth, why the next level was not flattened."""
        full = max(depth_of.values())
        keys = [op if isinstance(op, Node) else ("literal", repr(op)) for op in root.parts.operands]
        all_keys = set(keys)
        # Cost of reaching each cond from the root along the nested program.
        path_cost: dict[int, float] = {}
        for c in conds:  # parents come before children
            parent = 0.0 if c.home is None else path_cost[id(c.home.parent)]
            pred_ops = 0 if c.home is None else _slice_ops(c.parts.pred)
            path_cost[id(c)] = parent + self.cond_cost(len(c.parts.operands), pred_ops)
        why = ""
        for k in range(full, 1, -1):
            cluster = [c for c in conds if depth_of[id(c)] <= k]
            frontier: list["_Sub"] = [
                sub for c in cluster for sub in (c.child(True), c.child(False))
                if sub.nested is None or depth_of[id(sub.nested)] > k
            ]
            used: set[Any] = set()
            for sub in frontier:
                if sub.root_args is None:
                    used = all_keys
                    break
                for ph, a in zip(sub.phs, sub.root_args):
                    if ph.users and isinstance(a, int):
                        used.add(keys[a])
            b, o = len(frontier), len(used)
            replaced = sum(len(c.child(True).phs) + len(c.child(False).phs) for c in cluster)
            index_ops = sum(1 + (_slice_ops(c.parts.pred) if c.home is not None else 0) for c in cluster)
            flat = self.switch_cost(o, b, index_ops)
            nested = sum(path_cost[id(sub.parent)] for sub in frontier) / b
            if b * o > replaced:
                why = (f"{k} levels would give a switch of {b} branches x {o} operands = {b * o} placeholders, "
                       f"more than the {replaced} of the {len(cluster)} conds it replaces")
            elif flat > nested:
                why = (f"{k} levels would cost about {flat:.0f} per call (one switch, {index_ops} index ops) "
                       f"against {nested:.0f} for the nested conds (mean over {b} paths)")
            else:
                return k, why
        return 1, why
