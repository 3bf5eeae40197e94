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
