"""What the NVGEMM GPU tests share: whether CuTeDSL can run here, and the mark for tests that need it."""

import os
import statistics

import pytest
import torch

CUDA = torch.cuda.is_available()
if CUDA:
    from branchyard.lowering.nvgemm.kernel_config import GemmConfig, cutedsl_available
    from branchyard.lowering.nvgemm.timing import device_interleaved_timer

    CUTEDSL_OK, CUTEDSL_WHY = cutedsl_available()
else:
    GemmConfig = None
    CUTEDSL_OK, CUTEDSL_WHY = False, "no CUDA device"
needs_cutedsl = pytest.mark.skipif(not CUTEDSL_OK, reason=f"CuTeDSL unavailable: {CUTEDSL_WHY}")


def gpu_shared() -> str | None:
    """Why this run's timings measure other runs' load too (``None``: the GPU
    and the host are this run's): an xdist worker, or ``BRANCHYARD_GPU_SHARED``
    set by whoever starts several runs on one GPU."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return "other xdist workers share the GPU and the host"
    if os.environ.get("BRANCHYARD_GPU_SHARED"):
        return "BRANCHYARD_GPU_SHARED is set: other runs share the GPU and the host"
    return None


def skip_timing_if_shared(what: str) -> None:
    """Skip the rest of a ``timing`` test (its outputs and reports already
    checked) where :func:`gpu_shared` says the GPU is not its own."""
    why = gpu_shared()
    if why is not None:
        pytest.skip(f"{what} needs the GPU to itself ({why}): run `pytest -m timing tests/gpu` alone")


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


# --- the small-M kernel against float64 (test_nvgemm_small_m_gpu.py, test_nvgemm_glu_gpu.py) ---


def small_m_inputs(spec, m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    """``(a [M, K], w [N, K], operands)`` for ``spec`` on CUDA: per-column vectors,
    ``[M, N]`` matrices and second ``[N, K]`` weights where its steps take them."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a = (torch.randn(m, k, generator=gen, device="cuda") / k**0.25).to(dtype)
    w = (torch.randn(n, k, generator=gen, device="cuda") / k**0.25).to(dtype)
    ops = []
    for step in spec.steps:
        kind = step.op.operand
        if kind == "col":
            ops.append(torch.randn(n, generator=gen, device="cuda").to(dtype))
        elif kind == "matrix":
            ops.append(torch.randn(m, n, generator=gen, device="cuda").to(dtype))
        elif kind == "weight":
            ops.append((torch.randn(n, k, generator=gen, device="cuda") / k**0.25).to(dtype))
    return a, w, ops


def float64_reference(a, w, ops, spec) -> torch.Tensor:
    """float64 products and epilogue, one rounding to the output dtype."""
    from branchyard.lowering.nvgemm.epilogue import reference_epilogue

    acc = a.double() @ w.double().t()
    return reference_epilogue(acc, spec, [o.double() for o in ops], a=a.double()).to(spec.out_dtype)


def launch_small_m(spec, config, a, w, ops) -> torch.Tensor:
    """Compile ``spec`` for ``config`` and run it once into a NaN-poisoned output."""
    from branchyard.lowering.nvgemm import cutedsl_gemm

    fn = cutedsl_gemm.compile_fused_gemm(spec, a.dtype, config, operand_dtypes=[o.dtype for o in ops])
    out = torch.full((a.shape[0], w.shape[0]), float("nan"), dtype=spec.out_dtype, device="cuda")
    fn(a, w.t(), ops, out)
    torch.cuda.synchronize()
    return out


def check_small_m_shapes(spec, config, m: int, shapes, dtype: torch.dtype = torch.bfloat16) -> None:
    """``config`` against the float64 reference at every ``(N, K)``; every failure is reported."""
    failures = []
    for n, k in shapes:
        a, w, ops = small_m_inputs(spec, m, n, k, dtype, seed=n + k + m)
        try:
            check_against_reference(launch_small_m(spec, config, a, w, ops), float64_reference(a, w, ops, spec),
                                    f"M={m} N={n} K={k} {config.name}")
        except AssertionError as exc:
            failures.append(str(exc))
    assert not failures, "\n".join(failures)


def replay_ratio(first, second, windows: int = 9, **timer_kw) -> tuple[float, list[list[float]]]:
    """``second``'s device time per replay over ``first``'s: the median over
    ``windows`` windows of the two interleaved (the graph race's own timer,
    :func:`~branchyard.lowering.nvgemm.timing.device_interleaved_timer`, 30
    turns and ``timer_kw``), and the windows' ms per replay."""
    times = [device_interleaved_timer([first, second], reps=30, **timer_kw) for _ in range(windows)]
    return statistics.median(b / a for a, b in times), times
