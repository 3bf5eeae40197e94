"""``switch_to_cond``: lower every ``torch.ops.higher_order.switch`` to a
balanced tree of ``torch.cond``, for consumers without switch (ONNX export,
torch < 2.14 runtimes).

Postcondition: the graph and its subgraphs hold no switch node; each became
a cond tree of depth ceil(log2(n)) selecting the same branch for every index,
out-of-range indices clamped to the first or last branch, each cond passing
on only the operands its side reads.

Before::

    switch = switch(index, [branch0, branch1, branch2], (x, w))

After (the inner graph takes the index as an extra first operand)::

    le = aten.le(index, 0)
    cond = cond(le, leaf0, switch_1_3, (index, x, w))
    # switch_1_3(index, x, w):
    #     le = aten.le(index, 1)
    #     return cond(le, leaf1, leaf2, (x, w))
    # leaf_k(...): the body of branch_k

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
branch's body. The lowering of one switch is
:func:`branchyard.fx.switch_lowering.lower_switch`. See ``docs/passes.md``.
"""

from __future__ import annotations

from torch.fx import GraphModule, Node

from branchyard.fx.control_flow import is_switch
from branchyard.fx.graph_walk import rewrite_graphs
from branchyard.fx.pass_infra import BranchyardPass, Program, apply_pass
from branchyard.fx.switch_lowering import lower_switch

__all__ = ["SwitchToCond", "switch_to_cond"]


class SwitchToCond(BranchyardPass):
    """Lower every switch to a balanced cond tree (see the module docstring)."""

    name = "switch_to_cond"
    pause_gc = True

    def run(self, graph_module: GraphModule) -> bool:
        self.report.stats.update(switches_lowered=0, conds_created=0)
        return rewrite_graphs(graph_module, self._lower_switch)

    def _lower_switch(self, gm: GraphModule, node: Node, dead: set[str]) -> bool:
        if not is_switch(node):
            return False
        lowered = lower_switch(gm, node, dead_attrs=dead)
        self.report.stats["switches_lowered"] += 1
        self.report.stats["conds_created"] += lowered.conds_created
        return True


def switch_to_cond(program: Program) -> Program:
    """Function form of :class:`SwitchToCond`: a lowered copy of ``program``
    (an ExportedProgram or a GraphModule; the result is of the same kind)."""
    return apply_pass(program, SwitchToCond())
