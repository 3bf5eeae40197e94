"""Graph -> graph passes, one module per pass (plus the pieces one pass needs).

* :mod:`branchyard.passes.cond_to_switch` -- ``cond_to_switch``: each tree of
  nested conds becomes one switch over its distinct leaves;
* :mod:`branchyard.passes.cond_tree` -- finding and analysing those trees;
* :mod:`branchyard.passes.leaf_dedup` -- grouping identical leaf graphs;
* :mod:`branchyard.passes.switch_to_cond` -- ``switch_to_cond``: each switch
  becomes a balanced tree of conds.

Every pass is a :class:`~branchyard.fx.pass_infra.BranchyardPass` with a
function form taking an ``ExportedProgram`` or ``GraphModule``; the registry
of passes by name is :mod:`branchyard.registry`. See ``docs/passes.md``.
"""

from branchyard.passes.cond_to_switch import CondToSwitch, CondTree, cond_to_switch, find_cond_trees
from branchyard.passes.switch_to_cond import SwitchToCond, switch_to_cond

__all__ = ["CondToSwitch", "CondTree", "cond_to_switch", "find_cond_trees", "SwitchToCond", "switch_to_cond"]
