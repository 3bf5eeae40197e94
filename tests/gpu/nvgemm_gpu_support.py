"""What the NVGEMM GPU tests share: whether CuTeDSL can run here, and the mark for tests that need it."""

import pytest
import torch

CUDA = torch.cuda.is_available()
if CUDA:
    from branchyard.lowering.nvgemm.kernel_config import GemmConfig, cutedsl_available

    CUTEDSL_OK, CUTEDSL_WHY = cutedsl_available()
else:
    GemmConfig = None
    CUTEDSL_OK, CUTEDSL_WHY = False, "no CUDA device"
needs_cutedsl = pytest.mark.skipif(not CUTEDSL_OK, reason=f"CuTeDSL unavailable: {CUTEDSL_WHY}")


def capture_after_warmup(fn):
    """Call ``fn()`` once on a side stream (its warm-up), then capture one call of it
    into a CUDA graph: ``(graph, what the captured call returned)``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out
