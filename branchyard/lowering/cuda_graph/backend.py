"""A ``torch.compile`` backend that lowers each captured graph to one CUDA graph.

    >>> import torch, branchyard.lowering
    >>> f = torch.compile(lambda x: torch.cond(x.sum() > 0, lambda t: t + 1, lambda t: t - 1, (x,)),
    ...                   backend=branchyard.lowering.cuda_graph_backend, fullgraph=True)
    >>> f(torch.ones(3))  # doctest: +SKIP
    tensor([2., 2., 2.])

Dynamo hands the backend a torch-level GraphModule with ``cond`` /
``while_loop`` higher-order operators in it; :func:`cuda_graph_backend` lowers
it on the first call (with the real arguments as example inputs) and replays
afterwards. Options go through :func:`functools.partial`::

    backend = functools.partial(cuda_graph_backend, max_iterations=10_000)
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

__all__ = ["cuda_graph_backend"]


def cuda_graph_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **options: Any) -> Callable[..., Any]:
    """``torch.compile`` backend: lower ``gm`` with :func:`branchyard.lowering.cuda_graph.cuda_graph`.

    Lowering waits for the first call because dynamo may pass fake example
    inputs; ``options`` are those of ``cuda_graph`` (``max_iterations``,
    ``if_else``, ``clone_outputs``).
    """
    from branchyard.lowering.cuda_graph.capture import CudaGraphModule

    lowered: list[CudaGraphModule] = []

    def run(*args: Any) -> Any:
        if not lowered:
            lowered.append(CudaGraphModule(gm, args, **options))
        return lowered[0](*args)

    run.lowered = lowered  # type: ignore[attr-defined]  # for tests and introspection
    return run
