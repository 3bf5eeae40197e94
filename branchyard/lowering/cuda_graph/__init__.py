"""Lower a program with data-dependent control flow into ONE CUDA graph.

``torch.while_loop`` becomes a CUDA WHILE conditional node, ``torch.cond`` an
IF/ELSE node (two IF nodes before CUDA 12.8) and ``switch`` a SWITCH node, at
any nesting depth, so a replay never returns to the host::

    before (FX)                              after (one CUDA graph)
    i, x = while_loop(cond_fn, body_fn,      bufs = clone(i, x)
                      (i, x), (n,))          set(h, cond_fn(bufs)); WHILE(h) {
                                                 bufs <- body_fn(bufs); set(h, cond_fn(bufs)) }

Built on ``cuda-bindings`` (driver API + NVRTC), so it works on torch >= 2.11
with torch's caching allocator; importing this package needs neither CUDA nor
``cuda-bindings``. See ``docs/cuda_graph.md``.
"""

from __future__ import annotations

from typing import Any, Sequence

from branchyard.lowering._callable_package import make_package_callable
from branchyard.lowering.cuda_graph.analysis import ControlFlowReport, ControlFlowSite, analyze
from branchyard.lowering.cuda_graph.backend import cuda_graph_backend
from branchyard.lowering.cuda_graph.capture import CudaGraphFallbackWarning, CudaGraphModule
from branchyard.lowering.cuda_graph.handlers import HANDLERS, switch

__all__ = [
    "cuda_graph",
    "cuda_graph_backend",
    "CudaGraphModule",
    "CudaGraphFallbackWarning",
    "analyze",
    "ControlFlowReport",
    "ControlFlowSite",
    "HANDLERS",
    "switch",
]


def cuda_graph(
    program: Any,
    example_inputs: Sequence[Any],
    *,
    max_iterations: int | None = None,
    if_else: str = "auto",
    switch: str = "node",
    clone_outputs: bool = True,
) -> CudaGraphModule:
    """Capture ``program`` (an ExportedProgram or GraphModule) as one CUDA graph.

    Validates first (errors name the node; see :func:`analyze`), warms up every
    body and branch, captures once, and returns a module whose calls copy the
    inputs into static buffers and replay. ``max_iterations`` stops every
    ``while_loop`` after that many trips (``CudaGraphModule.iterations_exhausted()``
    says whether one was stopped); ``if_else`` picks ``"one_node"``,
    ``"two_nodes"`` or ``"auto"`` (one node where the driver is CUDA >= 12.8);
    ``switch="if_chain"`` lowers a switch as n IF nodes set by one kernel
    (XLA's way; for comparison) and ``"if_chain_each"`` as n IF nodes with a set
    kernel each, instead of one SWITCH node.
    Without CUDA it falls back to eager, warning once::

        >>> import torch, warnings
        >>> from branchyard.lowering.cuda_graph import cuda_graph
        >>> class Halve(torch.nn.Module):
        ...     def forward(self, x):
        ...         return torch.cond(x.sum() > 0, lambda t: t / 2, lambda t: -t, (x,))
        >>> x = torch.ones(2)
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     m = cuda_graph(torch.export.export(Halve(), (x,)), (x,))
        >>> m(x)
        tensor([0.5000, 0.5000])
    """
    return CudaGraphModule(
        program, example_inputs, max_iterations=max_iterations, if_else=if_else, switch=switch, clone_outputs=clone_outputs
    )


make_package_callable(__name__, cuda_graph)
