"""Our own CuTeDSL sm_90a GEMM with the epilogue applied in registers.

Contract::

    out[M, N] = epilogue(a[M, K] @ b[K, N])       # fp32 accumulation, one kernel

where ``epilogue`` is an ordered chain of element-wise steps (bias, scale,
activation, residual, cast), each applied to the fp32 accumulator fragment in
registers, after the last ``wgmma`` and before the single store of ``out``.
Semantics as Python, for one output element::

    x = sum(float32(a[i, k]) * float32(b[k, j]) for k in range(K))
    for step in chain:
        x = step(x, operand[j] | operand[i, j] | scalar | nothing)  # in fp32
    out[i, j] = out.dtype(x)

Why our own kernel: on Hopper neither Inductor's NVGEMM backend nor
``nvidia-cutlass-operators`` fuses an epilogue (their epilogue-fusing kernels
are SM100-only); cuBLASLt fuses only bias+relu and bias+gelu(tanh). A GEMM on
Hopper fuses an epilogue only when the kernel itself applies it to the
accumulators, which is what this module generates.

Kernel shape (``docs/nvgemm_kernel.md`` has the design notes and figures):

* one CTA per ``tile_m x tile_n`` output tile, ``tile_k = 64``; clusters of
  ``cluster_m x cluster_n`` CTAs share A/B tiles by TMA multicast;
* A and B tiles arrive by TMA into a ring of shared-memory stages guarded by
  mbarriers (producer: warp 0; consumers: every warpgroup issuing ``wgmma``);
* epilogue: per-column operands (bias, column scale) are gathered by the column
  index of each accumulator element; the first matrix operand (residual) is
  copied into shared memory by one TMA load after the K loop
  (``GemmConfig.residual_tma``; other matrix operands are gathered by
  (row, col)); the formulas of the shared epilogue table run on the fragment
  as fp32 vectors; the result is cast, written to shared memory with
  ``stmatrix`` and stored by TMA (which clips the ragged M/N edges).

Layouts taken: ``a`` row-major ``[M, K]``; ``b`` the logical ``[K, N]`` operand,
either a row-major ``[K, N]`` tensor (``b_layout="kn"``) or the transpose view of
a row-major ``[N, K]`` weight (``b_layout="nk"``, what ``F.linear`` holds);
``out`` row-major ``[M, N]``; residual row-major ``[M, N]``; vectors ``[N]``
contiguous. The tuning space and every eligibility rule are in
:mod:`.kernel_config`; the epilogue steps and the kernel's math namespace in
:mod:`.kernel_math`; the kernels themselves in the ``_cutedsl_*`` modules.

For M <= 64 a :class:`~.kernel_config.GemvConfig` selects the small-M kernel
(:mod:`._cutedsl_gemv`: weight rows streamed into warp-level MMAs, the
weight read once, the epilogue after the reduction over K); it takes the
``"nk"`` weight layout and also stores float32 outputs.

This module compiles a kernel for a parsed spec and config, keeps compiled
kernels in memory and in the on-disk :class:`~.kernel_cache.KernelCache`, and
launches them. It imports without CUDA or CuTeDSL: everything touching
``cutlass`` is imported inside functions.

    >>> from branchyard.lowering.nvgemm.epilogue import EpilogueSpec
    >>> spec = EpilogueSpec.parse("w=nk;bias@0;silu;out=bfloat16")
    >>> kernel_cache_key(plan_steps(spec), "bfloat16", "bfloat16", ["bfloat16"], "nk",
    ...                  GemmConfig(128, 256))["steps"]
    [['bias', 'col', 0, None, None], ['silu', 'none', None, None, None]]
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
from typing import Any, Callable, Sequence

from branchyard.errors import LoweringError
from branchyard.lowering.nvgemm.environment import package_version
from branchyard.lowering.nvgemm.epilogue import TENSOR_OPERANDS, EpilogueSpec
from branchyard.lowering.nvgemm.kernel_cache import KernelCache, default_kernel_cache
from branchyard.lowering.nvgemm.kernel_config import (
    GEMV_K_STEP,
    KERNEL_DTYPES,
    OPERAND_DTYPES,
    GemmConfig,
    GemvConfig,
    cutedsl_available,
    dtype_name,
)
from branchyard.lowering.nvgemm.kernel_math import KernelStep, plan_steps

__all__ = [
    "compile_fused_gemm",
    "kernel_cache_key",
]

_CACHE: dict[tuple, Any] = {}
_CACHE_LOCK = threading.Lock()


def _num_tensor_operands(steps: Sequence[KernelStep]) -> int:
    indices = sorted({s.index for s in steps if s.operand in TENSOR_OPERANDS})
    if indices != list(range(len(indices))):
        raise LoweringError(f"tensor operand indices {indices} are not 0..n-1", where="compile_fused_gemm")
    return len(indices)


#: ``kernel_cache`` default of :func:`compile_fused_gemm`: the process's on-disk cache.
_DEFAULT_CACHE = "default"


def compile_fused_gemm(
    spec: EpilogueSpec,
    dtype: Any,
    config: GemmConfig | GemvConfig,
    *,
    b_layout: str | None = None,
    out_dtype: Any | None = None,
    operand_dtypes: Sequence[Any] | None = None,
    kernel_cache: KernelCache | None | str = _DEFAULT_CACHE,
) -> Callable[..., None]:
    """Compile (or fetch from the in-process or on-disk cache) the fused GEMM for ``spec``.

    ``spec`` is the parsed :class:`~.epilogue.EpilogueSpec`; ``dtype`` the dtype of ``a`` and ``b`` (bfloat16 or float16);
    ``b_layout`` / ``out_dtype`` default to the spec's ``weight_layout`` /
    ``out_dtype`` (else ``"kn"`` / ``dtype``); ``operand_dtypes`` are the
    dtypes of ``operands[i]`` (default ``dtype``; other dtypes met at launch
    compile their own variant on first use). Shapes are not baked in: one
    compile serves every M, N, K.

    ``kernel_cache``: where compiled kernels persist across processes -- the
    default is :func:`~branchyard.lowering.nvgemm.kernel_cache.default_kernel_cache`
    (``$BRANCHYARD_CACHE_DIR/nvgemm/kernels``; off with
    ``BRANCHYARD_NVGEMM_KERNEL_CACHE=0``), a
    :class:`~branchyard.lowering.nvgemm.kernel_cache.KernelCache`, or ``None``
    (compile in memory only). A disk entry is the CuTeDSL ahead-of-time export
    of the compiled host + device code (``kernel.o``, loaded in milliseconds
    instead of a 1-3 s compile), keyed by :func:`kernel_cache_key`.

    Returns ``fn(a, b_kn, operands, out) -> None`` launching on the current
    torch CUDA stream: ``a`` ``[M, K]`` row-major; ``b_kn`` the logical
    ``[K, N]`` operand, a row-major ``[K, N]`` tensor (``b_layout="kn"``) or
    the ``.t()`` view of a row-major ``[N, K]`` weight (``"nk"``);
    ``operands[i]`` the tensor of the steps with operand index ``i`` (``[N]``
    contiguous or ``[M, N]`` row-major); ``out`` ``[M, N]`` row-major.

    Raises :class:`LoweringError`, never returns a kernel it could not build:
    CuTeDSL or an sm_90 device missing, a dtype/step the kernel does not
    support, or the DSL failing to compile (its message is included).
    """
    ok, reason = cutedsl_available()
    if not ok:
        raise LoweringError(f"cannot compile the CuTeDSL GEMM: {reason}", where="compile_fused_gemm")
    if not isinstance(config, (GemmConfig, GemvConfig)):
        raise LoweringError(f"config must be a GemmConfig or GemvConfig, got {type(config).__name__}",
                            where="compile_fused_gemm")
    name = dtype_name(dtype)
    if name not in KERNEL_DTYPES:
        raise LoweringError(f"input dtype {name}", where="compile_fused_gemm", hint="the kernel takes bfloat16 or float16")
    if not isinstance(spec, EpilogueSpec):
        raise LoweringError(f"spec must be a parsed EpilogueSpec, got {type(spec).__name__}",
                            where="compile_fused_gemm", hint="parse it once with EpilogueSpec.parse")
    b_layout = b_layout or spec.weight_layout
    if b_layout not in ("nk", "kn"):
        raise LoweringError(f"b_layout={b_layout!r}", where="compile_fused_gemm", hint="use 'nk' or 'kn'")
    if isinstance(config, GemvConfig) and b_layout != "nk":
        raise LoweringError(f"b_layout={b_layout!r}: the small-M kernel streams [N, K] weight rows",
                            where="compile_fused_gemm", hint="use a GemmConfig for a row-major [K, N] weight")
    out_name = dtype_name(out_dtype if out_dtype is not None else spec.out_dtype)
    # The small-M kernel stores element by element, so float32 too.
    if out_name not in KERNEL_DTYPES + (("float32",) if isinstance(config, GemvConfig) else ()):
        raise LoweringError(
            f"output dtype {out_name}: the kernel stores 16-bit outputs only (stmatrix + TMA store)",
            where="compile_fused_gemm",
        )
    steps = plan_steps(spec)
    count = _num_tensor_operands(steps)
    weights = [s.name for s in steps if s.operand == "weight"]
    dual = isinstance(config, GemvConfig) and config.dual
    if len(weights) > 1 or bool(weights) != dual:
        raise LoweringError(
            f"steps {[s.name for s in steps]} with config {config.name}: a second weight ({weights or 'none'}) "
            "runs only as the one weight step of a dual small-M config",
            where="compile_fused_gemm", hint="run expand_weight_steps(spec) with its weight_products first")
    if operand_dtypes is None:
        operand_dtypes = [name] * count
    if kernel_cache is _DEFAULT_CACHE:
        kernel_cache = default_kernel_cache()
    kernel = _FusedGemm(steps, name, out_name, b_layout, config, count, kernel_cache=kernel_cache)
    kernel.variant(tuple(dtype_name(d) for d in operand_dtypes))  # compile now: errors surface here
    return kernel


# --- the on-disk form of a compiled kernel -----------------------------------

#: Files of a kernel cache entry: the exported object (host launcher + cubin)
#: and what loading it needs.
_OBJECT_FILE = "kernel.o"
_META_FILE = "kernel.json"


@functools.lru_cache(maxsize=1)
def _source_digest() -> str:
    """sha256 of every module of this package: the kernel, its config and
    epilogue-table logic all live here, and any edit must invalidate the
    exported kernels (over-invalidating costs one recompile, a stale kernel
    would cost wrong results)."""
    import hashlib
    from pathlib import Path

    h = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:24]


def _target_arch() -> str:
    """The arch CuTeDSL compiles for: ``CUTE_DSL_ARCH`` if set, else the device's."""
    arch = os.environ.get("CUTE_DSL_ARCH")
    if arch:
        return arch
    import torch

    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"sm_{major}{minor}{'a' if major >= 9 else ''}"
    return "unknown"


def kernel_cache_key(
    steps: Sequence[KernelStep], dtype: str, out_dtype: str, operand_dtypes: Sequence[str], b_layout: str,
    config: GemmConfig | GemvConfig,
) -> dict[str, Any]:
    """What a compiled kernel depends on besides the environment the
    :class:`~branchyard.lowering.nvgemm.kernel_cache.KernelCache` adds (GPU,
    driver, CUDA, torch, CuTeDSL): this package's source, the steps, dtypes,
    B layout, the kernel (``fused_gemm`` or the small-M ``gemv``), every config
    field, the target arch and the tvm-ffi version (the exported launcher's ABI).

        >>> from branchyard.lowering.nvgemm.epilogue import EpilogueSpec
        >>> key = kernel_cache_key(plan_steps(EpilogueSpec.parse("w=nk;bias@0;silu;out=bfloat16")), "bfloat16",
        ...                        "bfloat16", ["bfloat16"], "nk", GemmConfig(128, 256))
        >>> key["steps"], key["config"]["tile_n"]
        ([['bias', 'col', 0, None, None], ['silu', 'none', None, None, None]], 256)
    """
    return {
        "kernel": "gemv" if isinstance(config, GemvConfig) else "fused_gemm",
        "source": _source_digest(),
        # Formulas are named, not hashed: the table that maps names to them is part of ``source``.
        "steps": [[s.name, s.operand, s.index, s.value, s.dtype] for s in steps],
        "dtype": dtype,
        "out_dtype": out_dtype,
        "operand_dtypes": list(operand_dtypes),
        "b_layout": b_layout,
        "config": dataclasses.asdict(config),
        "arch": _target_arch(),
        "tvm_ffi": package_version("apache-tvm-ffi"),
    }


def _export(compiled: Any, directory: Any, function: str, seconds: float) -> None:
    """Write ``compiled`` (a CuTeDSL tvm-ffi function) into a cache entry."""
    import json

    compiled.export_to_c(str(directory / _OBJECT_FILE), function_name=function)
    meta = {"function": function, "compile_s": round(seconds, 3), "call": "fn(a, b_nk, out, (*operands, 0.0))"}
    (directory / _META_FILE).write_text(json.dumps(meta, sort_keys=True))


def _load(directory: Any) -> Any:
    """The tvm-ffi function of an exported entry: called exactly like the
    compiled one (same four arguments, the launch on torch's current stream)."""
    import json

    from cutlass.cute.runtime import load_module

    function = json.loads((directory / _META_FILE).read_text())["function"]
    module = load_module(str(directory / _OBJECT_FILE), enable_tvm_ffi=True)
    return getattr(module, function)


def _no_launch(a: Any, b_nk: Any, operands: Sequence[Any], out: Any) -> None:
    """The launch of an empty problem (M = 0): nothing."""


class _FusedGemm:
    """The callable :func:`compile_fused_gemm` returns (one spec, dtype, layout, config)."""

    def __init__(
        self, steps, dtype: str, out_dtype: str, b_layout: str, config: GemmConfig | GemvConfig, count: int, *,
        kernel_cache: Any = None,
    ) -> None:
        self.steps = steps
        self.dtype = dtype
        self.out_dtype = out_dtype
        self.b_layout = b_layout
        self.config = config
        self.num_operands = count
        self.kernel_cache = kernel_cache
        # The small-M kernel covers N in whole CTAs of config.rows weight rows and K in 64-wide steps.
        self.nk_multiple = (config.rows, GEMV_K_STEP) if isinstance(config, GemvConfig) else (1, 1)

    def variant(self, operand_dtypes: tuple[str, ...]) -> Any:
        """The compiled kernel for these operand dtypes: from this process's
        memory, else from the on-disk cache, else compiled (and exported there)."""
        key = (tuple(s.key for s in self.steps), self.dtype, self.out_dtype, operand_dtypes, self.b_layout, self.config)
        with _CACHE_LOCK:
            hit = _CACHE.get(key)
        if hit is not None:
            return hit
        for d in operand_dtypes:
            if d not in OPERAND_DTYPES:
                raise LoweringError(f"epilogue operand dtype {d}", where="compile_fused_gemm")
        if self.kernel_cache is None:
            compiled = self._compile(operand_dtypes)
        else:
            import hashlib
            import json
            import time

            disk_key = kernel_cache_key(self.steps, self.dtype, self.out_dtype, operand_dtypes, self.b_layout, self.config)
            text = json.dumps(disk_key, sort_keys=True)
            # A unique exported symbol per kernel, so many loaded modules never clash.
            function = "branchyard_nvgemm_" + hashlib.sha256(text.encode()).hexdigest()[:16]

            def build(directory):
                t0 = time.perf_counter()
                compiled = self._compile(operand_dtypes)
                _export(compiled, directory, function, time.perf_counter() - t0)

            compiled = self.kernel_cache.get_or_build(disk_key, build, _load)
        with _CACHE_LOCK:
            _CACHE[key] = compiled
        return compiled

    def _compile(self, operand_dtypes: tuple[str, ...]) -> Any:
        try:
            return _compile(self.steps, self.dtype, self.out_dtype, operand_dtypes, self.b_layout, self.config)
        except Exception as exc:  # the DSL raises its own error types; surface them as one
            raise LoweringError(
                f"CuTeDSL failed to compile config {self.config.name} for steps "
                f"{[s.name for s in self.steps]}: {type(exc).__name__}: {str(exc).strip()[:2000]}",
                where="compile_fused_gemm",
            ) from exc

    def _checked(self, a: Any, b_kn: Any, operands: Sequence[Any], out: Any) -> tuple[Any, Any]:
        """``(b_kn.t(), the compiled variant)`` for these arguments, after the
        checks a launch needs (all of them fixed by shapes, strides and dtypes)."""
        if len(operands) != self.num_operands:
            raise LoweringError(
                f"{len(operands)} operand tensors for a kernel built for {self.num_operands}",
                where="fused gemm launch",
            )
        b_nk = b_kn.t()  # the kernel reads B as (N, K)
        for step in self.steps:
            w = operands[step.index] if step.operand == "weight" else None
            if w is not None and (tuple(w.shape) != tuple(b_nk.shape) or w.stride(1) != 1):
                raise LoweringError(
                    f"the second weight (operand {step.index}) has shape {list(w.shape)} and strides "
                    f"{tuple(w.stride())}; the kernel reads it like the weight, row-major {list(b_nk.shape)}",
                    where="fused gemm launch")
        if b_nk.shape[0] % self.nk_multiple[0] or b_nk.shape[1] % self.nk_multiple[1]:
            raise LoweringError(
                f"N={b_nk.shape[0]}, K={b_nk.shape[1]}: the small-M kernel {self.config.name} needs N a multiple "
                f"of {self.nk_multiple[0]} and K of {self.nk_multiple[1]}",
                where="fused gemm launch",
            )
        unit = 1 if self.b_layout == "nk" else 0
        if b_nk.stride(unit) != 1 or a.stride(1) != 1 or out.stride(1) != 1:
            raise LoweringError(
                f"strides a={tuple(a.stride())}, b_kn={tuple(b_kn.stride())}, out={tuple(out.stride())} do not "
                f"match a row-major a/out and a {self.b_layout!r} weight",
                where="fused gemm launch",
            )
        return b_nk, self.variant(tuple(dtype_name(t.dtype) for t in operands))

    def __call__(self, a: Any, b_kn: Any, operands: Sequence[Any], out: Any) -> None:
        b_nk, compiled = self._checked(a, b_kn, operands, out)
        if a.shape[0] == 0:
            return  # nothing to compute (and no empty grid to launch)
        # A trailing scalar keeps the operand tuple non-empty (the DSL cannot pass an empty one).
        compiled(a, b_nk, out, (*operands, 0.0))

    def bind(self, a: Any, b_kn: Any, operands: Sequence[Any], out: Any) -> Callable[[Any, Any, Sequence[Any], Any], None]:
        """``self(a, b_kn, operands, out)``'s checks and variant lookup, done now,
        and the launch alone for later calls whose tensors have these shapes,
        strides and dtypes (what the op's call plans keep):
        ``launch(a, b_nk, operands, out)``, the weight given as the kernel reads
        it, ``[N, K]`` (``b_kn.t()``: the op passes an ``[N, K]`` weight as it is).
        Raises what ``self(...)`` raises for these arguments."""
        _, compiled = self._checked(a, b_kn, operands, out)
        if a.shape[0] == 0:
            return _no_launch

        def launch(a: Any, b_nk: Any, operands: Sequence[Any], out: Any) -> None:
            compiled(a, b_nk, out, (*operands, 0.0))

        return launch

    @property
    def name(self) -> str:
        """The config's name (what the autotuner records)."""
        return self.config.name


def _compile(
    steps: Sequence[KernelStep],
    dtype: str,
    out_dtype: str,
    operand_dtypes: Sequence[str],
    b_layout: str,
    config: GemmConfig | GemvConfig,
) -> Any:
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    types = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16, "float32": cutlass.Float32}
    ab = types[dtype]
    # Dynamic sizes; K/N and leading dims divisible by 8 elements (16 bytes) for TMA.
    m, n, k = cute.sym_int(), cute.sym_int(divisibility=8), cute.sym_int(divisibility=8)
    lda, ldb, ldc = (cute.sym_int64(divisibility=8) for _ in range(3))
    fake_a = make_fake_tensor(ab, (m, k), (lda, 1), assumed_align=16)
    if b_layout == "nk":
        fake_b = make_fake_tensor(ab, (n, k), (ldb, 1), assumed_align=16)
    else:
        fake_b = make_fake_tensor(ab, (n, k), (1, ldb), assumed_align=16)
    fake_c = make_fake_tensor(types[out_dtype], (m, n), (ldc, 1), assumed_align=16)
    kinds = {s.index: s.operand for s in steps if s.operand in TENSOR_OPERANDS}
    fake_ops: list[Any] = []
    for index, op_dtype in enumerate(operand_dtypes):
        if kinds[index] == "col":
            fake_ops.append(make_fake_tensor(types[op_dtype], (n,), (1,)))
        elif kinds[index] == "weight":  # a second [N, K] weight, read like B
            fake_ops.append(make_fake_tensor(types[op_dtype], (n, k), (cute.sym_int64(divisibility=8), 1),
                                             assumed_align=16))
        else:
            fake_ops.append(make_fake_tensor(types[op_dtype], (m, n), (cute.sym_int64(), 1)))
    fake_ops.append(cutlass.Float32(0.0))
    kernel = _kernel_class()(tuple(steps), config, types)
    return cute.compile(
        kernel,
        fake_a,
        fake_b,
        fake_c,
        tuple(fake_ops),
        make_fake_stream(use_tvm_ffi_env_stream=True),
        options="--enable-tvm-ffi",
    )


@functools.lru_cache(maxsize=1)
def _kernel_class() -> Callable[..., Any]:
    """``make(steps, config, types)``: the kernel object for a config, its class
    defined on first use (it needs ``cutlass`` at class-body time)."""

    def make(steps: tuple, config: GemmConfig | GemvConfig, types: dict) -> Any:
        if isinstance(config, GemvConfig):
            from branchyard.lowering.nvgemm._cutedsl_gemv import build_gemv_class

            return build_gemv_class()(steps, config, types)
        if config.persistent:
            from branchyard.lowering.nvgemm._cutedsl_persistent import build_persistent_class

            return build_persistent_class()(steps, config, types)
        from branchyard.lowering.nvgemm._cutedsl_kernel import build_tile_class

        return build_tile_class()(steps, config, types)

    return make
