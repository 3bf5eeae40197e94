"""``nvidia-cutlass-operators`` as a comparison candidate: its plain sm_90 GEMM.

On Hopper that package cannot fuse an epilogue (its epilogue-fusing "EFC"
kernels are SM100-only); what it offers on sm_90 is a plain persistent
wgmma/TMA GEMM. The autotuner (:mod:`branchyard.lowering.nvgemm.autotune`)
runs it followed by the chain as ATen ops, so that our fused kernel is also
measured against "the vendor's CuTeDSL GEMM + an unfused epilogue".

Interface (what the autotuner looks up)::

    plain_gemm_available() -> (ok, reason)
    compile_plain_gemm(dtype, b_layout) -> fn(a [M, K], b_kn [K, N], out [M, N]) -> None

``fn`` picks and compiles the package's sm_90 operator on first use of each
problem shape (the package compiles per argument set), preferring a
128x256 tile, and launches on the current torch stream. Imports without the
package: ``plain_gemm_available()`` then says why not.

    >>> ok, reason = plain_gemm_available()
    >>> isinstance(ok, bool) and isinstance(reason, str)
    True
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

from branchyard.errors import LoweringError

__all__ = ["plain_gemm_available", "compile_plain_gemm", "PREFERRED_TILES"]

#: Tile (M, N) and cluster (M, N) shapes tried first, in order; any sm_90 operator otherwise.
PREFERRED_TILES: tuple[tuple[tuple[int, int], tuple[int, int]], ...] = (
    ((128, 256), (2, 1)),
    ((128, 256), (1, 1)),
    ((128, 128), (1, 1)),
)


@functools.lru_cache(maxsize=1)
def plain_gemm_available() -> tuple[bool, str]:
    """``(True, "")`` when the package imports and an sm_90 GPU is present."""
    try:
        import cutlass.operators  # noqa: F401
    except Exception as exc:  # ImportError, or the DSL under it failing to load
        return False, f"nvidia-cutlass-operators is not importable: {exc}"
    import torch

    if not torch.cuda.is_available():
        return False, "no CUDA device"
    cap = torch.cuda.get_device_capability()
    if cap != (9, 0):
        return False, f"this candidate is the sm_90 GEMM; the device is sm_{cap[0]}{cap[1]}"
    return True, ""


def _design(operator: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    design = operator.metadata.design
    return tuple(design.tile_shape[:2]), tuple(design.cluster_shape[:2])


def _pick(operators: list[Any]) -> Any:
    designs = {}
    for op in operators:
        try:
            designs.setdefault(_design(op), op)
        except AttributeError:  # metadata without a tile/cluster design: usable, not preferred
            continue
    for preferred in PREFERRED_TILES:
        if preferred in designs:
            return designs[preferred]
    return operators[0]


def compile_plain_gemm(dtype: Any, b_layout: str) -> Callable[[Any, Any, Any], None]:
    """A plain ``out = a @ b_kn`` (fp32 accumulation) through the package.

    ``b_layout`` is ``"kn"`` (row-major ``[K, N]``) or ``"nk"`` (``b_kn`` is the
    ``.t()`` view of a row-major ``[N, K]`` weight). Raises
    :class:`LoweringError` when the package is missing or offers no sm_90
    operator for the arguments.
    """
    ok, why = plain_gemm_available()
    if not ok:
        raise LoweringError(f"cutlass-operators plain GEMM unavailable: {why}", where="compile_plain_gemm")
    if b_layout not in ("kn", "nk"):
        raise LoweringError(f"b_layout={b_layout!r}", where="compile_plain_gemm", hint="use 'kn' or 'nk'")
    import torch
    import cutlass.operators as ops

    cache: dict[tuple, tuple[Any, Any]] = {}
    lock = threading.Lock()

    def build(a: torch.Tensor, b_kn: torch.Tensor, out: torch.Tensor, args: Any) -> tuple[Any, Any]:
        try:
            operators = ops.get_operators(args, target_sm="90a")
        except Exception as exc:
            raise LoweringError(f"get_operators failed: {exc}", where="compile_plain_gemm") from exc
        if not operators:
            raise LoweringError(
                f"no sm_90 operator for {a.dtype} a{list(a.shape)} @ b{list(b_kn.shape)} ({b_layout})",
                where="compile_plain_gemm",
            )
        operator = _pick(operators)
        try:
            artifact = operator.compile(args, target_sm="90a")
        except Exception as exc:
            raise LoweringError(f"compiling {type(operator).__name__} failed: {exc}", where="compile_plain_gemm") from exc
        return operator, artifact

    def gemm(a: torch.Tensor, b_kn: torch.Tensor, out: torch.Tensor) -> None:
        if a.dtype != dtype or b_kn.dtype != dtype:
            raise LoweringError(f"built for {dtype}, called with {a.dtype}/{b_kn.dtype}", where="cutlass plain gemm")
        args = ops.GemmArguments(a, b_kn, out, accumulator_type=torch.float32)
        key = (tuple(a.shape), tuple(a.stride()), tuple(b_kn.shape), tuple(b_kn.stride()), tuple(out.stride()), out.dtype)
        with lock:
            entry = cache.get(key)
        if entry is None:
            entry = build(a, b_kn, out, args)
            with lock:
                cache[key] = entry
        operator, artifact = entry
        operator.run(args, artifact, stream=torch.cuda.current_stream(), assume_supported_args=True)

    return gemm
