"""Every pass by its one name, loaded on first use.

:data:`PASSES` maps a pass's name -- the ``name`` of its class, what
``--passes`` on the command line and every report use -- to where it lives,
``"module:Class"``. Nothing registers itself by being imported: adding a pass
means adding its row here. The module sits above every floor (``fx/``,
``passes/``, ``lowering/``), so listing a lowering here makes no lower floor
import a higher one; a pass's module is imported only when it is asked for::

    >>> get_pass("cond_to_switch").name
    'cond_to_switch'
    >>> sorted(PASSES)
    ['cond_to_switch', 'nvgemm', 'switch_to_cond']
"""

from __future__ import annotations

import importlib

from branchyard.errors import BranchyardError
from branchyard.fx.pass_infra import BranchyardPass

__all__ = ["PASSES", "OPS", "load_ops", "pass_names", "pass_class", "get_pass"]

#: Pass name -> ``"module:Class"``.
PASSES: dict[str, str] = {
    "cond_to_switch": "branchyard.passes.cond_to_switch:CondToSwitch",
    "switch_to_cond": "branchyard.passes.switch_to_cond:SwitchToCond",
    "nvgemm": "branchyard.lowering.nvgemm.fuse:NvGemmPass",
}


#: Operator namespace::name -> the module that defines it, for reading programs
#: that call it (a program ``nvgemm`` rewrote calls the fused op).
OPS: dict[str, str] = {
    "branchyard::fused_gemm_epilogue": "branchyard.lowering.nvgemm.op",  # and its .out overload
}


def load_ops() -> None:
    """Import the modules of :data:`OPS`, so that a program calling them can be loaded."""
    for module in sorted(set(OPS.values())):
        importlib.import_module(module)


def pass_names() -> list[str]:
    """The known pass names, sorted."""
    return sorted(PASSES)


def pass_class(name: str) -> type[BranchyardPass]:
    """The class of the pass ``name``, importing its module now.

    Raises :class:`~branchyard.errors.BranchyardError` for an unknown name
    (listing the known ones) or a module that cannot be imported here.
    """
    try:
        location = PASSES[name]
    except KeyError:
        raise BranchyardError(f"unknown pass {name!r}; known passes: {', '.join(pass_names())}") from None
    module_name, _, class_name = location.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BranchyardError(f"pass {name!r} is unavailable: importing {module_name} failed: {exc}") from exc
    return getattr(module, class_name)


def get_pass(name: str) -> BranchyardPass:
    """A fresh instance of the pass ``name``."""
    return pass_class(name)()
