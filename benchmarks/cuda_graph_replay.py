"""One helper the benchmark scripts share: time a callable as a CUDA-graph replay."""

from __future__ import annotations

from typing import Callable

import torch


def graph_replay(fn: Callable[[], object]) -> Callable[[], None]:
    """``fn`` captured in a CUDA graph after two warm-up calls on a side stream
    (as ``torch.cuda.graph`` asks); returns the graph's ``replay``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay
