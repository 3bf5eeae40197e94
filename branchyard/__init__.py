"""branchyard: graph-compiler passes for control flow and dynamic shapes.

* :mod:`branchyard.fx` -- the ground floor: control-flow operators in a graph, nested-graph walks, pass infrastructure
* :mod:`branchyard.passes` -- graph -> graph (``cond_to_switch``, ``switch_to_cond``)
* :mod:`branchyard.registry` -- every pass by its one name, loaded on first use
* :mod:`branchyard.shapes` -- ``ShapeVar`` / ``dynamic_spec`` -> unbacked symbolic sizes
* :mod:`branchyard.lowering` -- graph -> CUDA graphs with conditional nodes, fused NVGEMM kernels
* :mod:`branchyard.testing` -- helpers for testing your own graph transforms
* :func:`branchyard.compile` -- export, passes and CUDA graphs as one step (:mod:`branchyard.compiler`)
"""

__version__ = "0.1.0"

from typing import Any

from branchyard.serialization import load, save

__all__ = ["__version__", "load", "save", "compile", "CompiledProgram", "CompileReport"]


def __getattr__(name: str) -> Any:
    # branchyard.compile pulls in every floor (shapes, passes, lowering): import it on first use.
    if name in ("compile", "CompiledProgram", "CompileReport"):
        from branchyard import compiler

        return getattr(compiler, name)
    raise AttributeError(f"module 'branchyard' has no attribute {name!r}")
