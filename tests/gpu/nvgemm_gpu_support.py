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


def check_against_reference(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """``out`` has ``ref``'s shape and dtype, every element written (outputs are poisoned
    with NaN before a launch) and within the output dtype's tolerance of ``ref``."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, (what, out.shape, out.dtype, ref.shape, ref.dtype)
    if out.numel() == 0:
        return
    out, ref = out.cpu(), ref.cpu()
    unwritten = out.isnan() & ~ref.isnan()
    assert not unwritten.any(), (
        f"{what}: {int(unwritten.sum())} of {out.numel()} outputs never written, first at "
        f"{[int(i) for i in unwritten.nonzero()[0]]}"
    )
    tol = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-3}[out.dtype]
    scale = max(1.0, ref.double().abs().max().item())
    err = (out.double() - ref.double()).abs() - tol * ref.double().abs()
    worst = int(err.argmax())
    row, col = divmod(worst, out.shape[1])
    assert err.max().item() <= tol * scale / 4, (
        f"{what}: worst at [{row}, {col}]: got {out[row, col].item():.6g}, reference {ref[row, col].item():.6g}"
    )
