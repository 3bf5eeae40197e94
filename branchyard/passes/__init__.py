"""Graph -> graph passes.

Every pass is a :class:`~branchyard.passes.infra.BranchyardPass` and has a
function form taking an ``ExportedProgram`` or ``GraphModule``. See
``docs/passes.md``.
"""

from branchyard.passes.infra import (
    PASS_REGISTRY,
    BranchyardPass,
    PassReport,
    Pipeline,
    PipelineResult,
    Skip,
    apply_pass,
    get_pass,
    register_pass,
)

__all__ = [
    "PASS_REGISTRY",
    "BranchyardPass",
    "PassReport",
    "Pipeline",
    "PipelineResult",
    "Skip",
    "apply_pass",
    "get_pass",
    "register_pass",
]

# cond <-> switch passes (importing registers them by CLI name).
from branchyard.passes.cond_to_switch import CondToSwitch, CondTree, cond_to_switch, find_cond_trees  # noqa: E402
from branchyard.passes.switch_to_cond import SwitchToCond, switch_to_cond  # noqa: E402

__all__ += ["CondToSwitch", "CondTree", "cond_to_switch", "find_cond_trees", "SwitchToCond", "switch_to_cond"]
