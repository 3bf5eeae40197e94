"""branchyard: graph-compiler passes for control flow and dynamic shapes.

* :mod:`branchyard.passes` -- graph -> graph (``cond_to_switch``, ``switch_to_cond``)
* :mod:`branchyard.shapes` -- ``ShapeVar`` / ``dynamic_spec`` -> unbacked symbolic sizes
* :mod:`branchyard.lowering` -- graph -> CUDA graphs with conditional nodes, fused NVGEMM kernels
* :mod:`branchyard.testing` -- helpers for testing your own graph transforms
"""

__version__ = "0.1.0"

from branchyard.serialization import load, save

__all__ = ["__version__", "load", "save"]
