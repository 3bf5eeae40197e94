"""Packages that are also their main function.

``branchyard.lowering.nvgemm(program)`` and
``branchyard.lowering.cuda_graph(program, inputs)`` are the documented entry
points, while ``branchyard.lowering.nvgemm.matcher`` etc. must still import as
submodules. A function bound to the package's name in its parent would shadow
the package on ``import branchyard.lowering.nvgemm.matcher as m``; giving the
package module a ``__call__`` keeps both working.
"""

from __future__ import annotations

import sys
import types
from typing import Callable


def make_package_callable(package_name: str, entry_point: Callable) -> None:
    """Calling the (already imported) package ``package_name`` calls ``entry_point``."""

    class CallablePackage(types.ModuleType):
        __call__ = staticmethod(entry_point)

    CallablePackage.__doc__ = f"Package whose call runs {entry_point.__qualname__}."
    sys.modules[package_name].__class__ = CallablePackage
