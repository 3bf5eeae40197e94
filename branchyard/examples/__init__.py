"""Example programs shipped with branchyard (``python -m branchyard example``).

* :mod:`branchyard.examples.expert_dispatch` -- nn.Modules selecting an
  expert through nested ``torch.cond`` (an ``idx == k`` chain, a balanced tree);
* :mod:`branchyard.examples.builder` -- the same programs built directly in
  torch.fx, for sizes where tracing nested conds is too slow.
"""

from branchyard.examples.expert_dispatch import (
    EXAMPLES,
    CondTree,
    ExpertDispatch,
    build_example,
    example_inputs,
    example_program,
    export_example,
    save_example,
)

__all__ = [
    "EXAMPLES",
    "CondTree",
    "ExpertDispatch",
    "build_example",
    "example_inputs",
    "example_program",
    "export_example",
    "save_example",
]
