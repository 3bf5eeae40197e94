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
contiguous. 16-bit types need K and N multiples of 8 and 16-byte aligned
pointers (``check_eligible`` says which rule a shape breaks).

The module imports without CUDA or CuTeDSL: everything touching ``cutlass`` is
imported inside functions. ``cutedsl_available()`` says whether it can run.

    >>> from branchyard.lowering.nvgemm.cutedsl_gemm import GemmConfig, candidate_configs
    >>> GemmConfig(128, 256).name
    't128x256_c1x1_o1'
    >>> all(c.tile_m == 64 for c in candidate_configs(16, 4096, 4096, "bfloat16"))
    True
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from branchyard.errors import LoweringError

__all__ = [
    "GemmConfig",
    "KernelStep",
    "TILE_K",
    "cutedsl_available",
    "candidate_configs",
    "check_eligible",
    "compile_fused_gemm",
    "kernel_cache_key",
    "plan_steps",
]

#: K-depth of one pipeline stage (four 16-deep wgmma instructions for 16-bit types).
TILE_K = 64
#: Shared memory one CTA may use on sm_90 (227 KiB), and what we keep for mbarriers.
_SMEM_CAPACITY = 232448
_SMEM_RESERVED = 1024
_EPI_STAGES = 4
_MAX_AB_STAGES = 8
_SUPPORTED_DTYPES = ("bfloat16", "float16")


def _dtype_name(dtype: Any) -> str:
    """'bfloat16' for torch.bfloat16, 'bfloat16', or cutlass.BFloat16."""
    text = str(dtype).lower()
    for name in ("bfloat16", "float16", "float32"):
        if text.endswith(name):
            return name
    return text


# ---------------------------------------------------------------------------
# Availability
# ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def cutedsl_available() -> tuple[bool, str]:
    """Whether this process can compile and launch the CuTeDSL kernel.

    Returns ``(True, "")`` or ``(False, reason)``; the reason says what is
    missing (the package, a CUDA device, an sm_90 device).

        >>> ok, reason = cutedsl_available()
        >>> isinstance(ok, bool) and isinstance(reason, str)
        True
    """
    try:
        import cutlass  # noqa: F401
        import cutlass.cute  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install raising anything
        return False, f"CuTeDSL (nvidia-cutlass-dsl) is not importable: {exc}"
    try:
        import tvm_ffi  # noqa: F401
    except Exception as exc:
        return False, f"apache-tvm-ffi (CuTeDSL's launch path) is not importable: {exc}"
    import torch

    if not torch.cuda.is_available():
        return False, "no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return False, f"the kernel uses sm_90a instructions (wgmma, TMA); this device is sm_{major}{minor}"
    return True, ""


# ---------------------------------------------------------------------------
# Tunables
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GemmConfig:
    """One point of the kernel's tuning space.

    ``tile_m`` in {64, 128} rows and ``tile_n`` in {64, 128, 256} columns per
    CTA; ``cluster_m x cluster_n`` CTAs per cluster (A is multicast along N,
    B along M); ``occupancy`` is how many CTAs per SM the shared-memory stage
    count is sized for (2 lets one CTA's epilogue overlap another's main loop).
    ``raster_group`` is how many cluster rows are walked together so that
    CTAs running at the same time share B tiles in L2. ``residual_tma`` brings
    the first ``[M, N]`` operand into shared memory with one TMA copy after the
    K loop (into the then idle B ring) instead of gathering it element by
    element from global memory (no effect on chains without one).

    ``persistent`` selects the persistent warp-specialised kernel: a grid of
    #SMs CTAs, each with a TMA producer warpgroup and two consumer
    warpgroups that own alternate ``tile_m x tile_n`` tiles ("ping-pong", one
    warpgroup's epilogue overlaps the other's main loop); there ``tile_m x
    tile_n`` is one warpgroup's tile (at most 128 x 128 fp32 accumulators per
    thread), clusters run along M only (``cluster_m`` 1 or 2, B multicast),
    and the residual tile comes in by TMA as the tile's main loop starts.
    """

    tile_m: int = 128
    tile_n: int = 256
    cluster_m: int = 1
    cluster_n: int = 1
    occupancy: int = 1
    raster_group: int = 8
    residual_tma: bool = False
    persistent: bool = False

    def __post_init__(self) -> None:
        problems = []
        if self.tile_m not in (64, 128):
            problems.append(f"tile_m={self.tile_m} (must be 64 or 128)")
        if self.tile_n not in (64, 128, 256):
            problems.append(f"tile_n={self.tile_n} (must be 64, 128 or 256)")
        for name in ("cluster_m", "cluster_n"):
            value = getattr(self, name)
            if value not in (1, 2, 4):
                problems.append(f"{name}={value} (must be 1, 2 or 4)")
        if self.cluster_m * self.cluster_n > 4:
            problems.append("cluster_m * cluster_n > 4")
        if self.occupancy not in (1, 2):
            problems.append(f"occupancy={self.occupancy} (must be 1 or 2)")
        if self.occupancy == 2 and self.tile_n > 128:
            problems.append("occupancy=2 with a 256-wide tile does not fit the register file")
        if self.raster_group < 1:
            problems.append(f"raster_group={self.raster_group} (must be >= 1)")
        if self.persistent:
            if self.tile_m * self.tile_n > 128 * 128:
                problems.append(
                    f"persistent tile {self.tile_m}x{self.tile_n} (one warpgroup holds at most 128x128 accumulators)"
                )
            if self.cluster_n != 1 or self.cluster_m > 2:
                problems.append("persistent clusters are cluster_m in {1, 2} with cluster_n = 1")
            if self.occupancy != 1:
                problems.append("persistent kernels run one CTA per SM (occupancy=1)")
        if problems:
            raise LoweringError("invalid GemmConfig: " + "; ".join(problems), where="GemmConfig")

    @property
    def warpgroups(self) -> int:
        """Warpgroups issuing wgmma: two (64 rows each) for 128-row tiles, else one.

        One warpgroup holding a 128x128 fp32 tile needs 128 accumulator registers
        per thread and spilled once an epilogue was added; two halve that. (The
        persistent kernel has two consumer warpgroups, each with a whole tile,
        and its 232-register budget holds that.)
        """
        if self.persistent:
            return 2
        return 2 if self.tile_m == 128 else 1

    @property
    def threads(self) -> int:
        """Threads per CTA (the persistent kernel adds a producer warpgroup)."""
        return 128 * (self.warpgroups + (1 if self.persistent else 0))

    def ab_stages(self, itemsize: int = 2) -> int:
        """Shared-memory stages of the A/B ring that fit ``occupancy`` CTAs per SM."""
        if self.persistent:
            return persistent_stages(self.tile_m, self.tile_n, 0, itemsize)
        per_stage = (self.tile_m + self.tile_n) * TILE_K * itemsize
        epi = self.epi_tile[0] * self.epi_tile[1] * itemsize * _EPI_STAGES
        budget = _SMEM_CAPACITY // self.occupancy - _SMEM_RESERVED - epi
        return max(2, min(_MAX_AB_STAGES, budget // per_stage))

    @property
    def epi_tile(self) -> tuple[int, int]:
        """The sub-tile the epilogue stores at a time (rows, columns)."""
        rows = 64 * self.warpgroups
        return rows, min(32, self.tile_n)

    @property
    def name(self) -> str:
        """Short stable name, used in logs and in the autotuner's database."""
        tail = ("_rtma" if self.residual_tma else "") + ("_pp" if self.persistent else "")
        if self.raster_group != 8:
            tail += f"_g{self.raster_group}"
        return f"t{self.tile_m}x{self.tile_n}_c{self.cluster_m}x{self.cluster_n}_o{self.occupancy}{tail}"


#: Store buffers (64 x 32 sub-tiles) per consumer warpgroup of the persistent kernel: two
#: are enough there (its epilogue is hidden) and leave shared memory to the A/B ring.
_PP_EPI_BUFFERS = 2


def persistent_stages(tile_m: int, tile_n: int, residual_bytes: int, itemsize: int = 2) -> int:
    """A/B ring stages of the persistent kernel next to its epilogue buffers
    (``_PP_EPI_BUFFERS`` sub-tiles of 64 x min(32, tile_n) per consumer
    warpgroup) and, for a TMA residual, ``residual_bytes`` (one tile).

        >>> persistent_stages(128, 128, 0), persistent_stages(128, 128, 128 * 128 * 2)
        (6, 5)
    """
    per_stage = (tile_m + tile_n) * TILE_K * itemsize
    epi = 2 * 64 * min(32, tile_n) * itemsize * _PP_EPI_BUFFERS
    budget = _SMEM_CAPACITY - _SMEM_RESERVED - epi - residual_bytes
    return max(2, min(_MAX_AB_STAGES, budget // per_stage))


def candidate_configs(m: int, n: int, k: int, dtype: Any) -> list[GemmConfig]:
    """The configs worth timing for an ``[m, k] @ [k, n]`` GEMM of ``dtype``.

    Every config has ``residual_tma`` on unless the environment sets
    ``BRANCHYARD_NVGEMM_RESIDUAL_TMA=0``. Small M gets 64-row tiles and narrower N tiles (more CTAs on the SMs);
    large M gets the persistent ping-pong kernel (2-CTA clusters first) and the
    one-tile-per-CTA 128x256 tile. Fastest first (as measured), so a caller
    that times only the first few loses little.

        >>> [c.name for c in candidate_configs(1, 4096, 4096, "float16")][:2]
        ['t64x64_c1x1_o1_rtma', 't64x128_c1x1_o1_rtma']
    """
    configs = _candidate_configs(m)
    if os.environ.get("BRANCHYARD_NVGEMM_RESIDUAL_TMA", "1") != "0":
        configs = [dataclasses.replace(c, residual_tma=True) for c in configs]
    return configs


def _candidate_configs(m: int) -> list[GemmConfig]:
    if m <= 64:
        return [
            GemmConfig(64, 64),
            GemmConfig(64, 128),
            GemmConfig(64, 64, occupancy=2),
            GemmConfig(64, 128, occupancy=2),
            GemmConfig(64, 256),
        ]
    if m <= 256:
        return [
            GemmConfig(64, 128),
            GemmConfig(64, 256),
            GemmConfig(128, 128),
            GemmConfig(128, 128, occupancy=2),
            GemmConfig(128, 256),
        ]
    # Large M, measured on the H200 (docs/nvgemm_kernel.md, version 4): the persistent
    # ping-pong kernel in 2-CTA clusters (B multicast) leads on 22 of 24 (shape, chain)
    # rows at M = 2048 / 8192; the one-tile-per-CTA 128x256 wins some M = 2048 rows; the
    # persistent kernel without a cluster is L2-bound (1.1-1.3x slower), 64x256 worse still.
    return [
        GemmConfig(128, 128, cluster_m=2, persistent=True),
        GemmConfig(128, 256),
        GemmConfig(128, 128, persistent=True),
        GemmConfig(128, 256, cluster_m=2),
    ]


def check_eligible(m: int, n: int, k: int, dtype: Any) -> str | None:
    """``None`` when the kernel can run this shape and dtype, else the rule broken.

        >>> check_eligible(8192, 14336, 4096, "bfloat16") is None
        True
        >>> check_eligible(128, 100, 4096, "bfloat16")
        'N=100 is not a multiple of 8 (TMA needs 16-byte rows of 16-bit elements)'
    """
    name = _dtype_name(dtype)
    if name not in _SUPPORTED_DTYPES:
        return f"dtype {name} is not supported (bfloat16 and float16 only)"
    if m < 1 or n < 1 or k < 1:
        return f"empty GEMM (M={m}, N={n}, K={k})"
    if k % 8:
        return f"K={k} is not a multiple of 8 (TMA needs 16-byte rows of 16-bit elements)"
    if n % 8:
        return f"N={n} is not a multiple of 8 (TMA needs 16-byte rows of 16-bit elements)"
    return None


# ---------------------------------------------------------------------------
# Epilogue steps the kernel applies
# ---------------------------------------------------------------------------

#: How a step's operand is read inside the kernel.
_OPERAND_KINDS = ("none", "scalar", "col", "mat", "cast")
#: The shared table's operand kinds -> ours.
_TABLE_OPERAND_KINDS = {"none": "none", "scalar": "scalar", "col": "col", "matrix": "mat", "dtype": "cast"}


@dataclass(frozen=True)
class KernelStep:
    """One epilogue step as the kernel emits it.

    ``operand`` is ``"none"`` (``fn(x, m)``), ``"scalar"`` (``fn(x, value, m)``
    with ``value`` a Python float baked into the kernel), ``"col"``
    (``fn(x, v[col], m)`` with ``v = operands[index]`` of ``N`` elements),
    ``"mat"`` (``fn(x, r[row, col], m)`` with ``r = operands[index]``,
    ``[M, N]`` row-major) or ``"cast"`` (``fn(x, m)``, the table's meaning of a
    cast inside the chain: the value stays fp32 and is rounded once at the store).
    ``fn`` is the formula of the shared epilogue table, written once over a
    math namespace ``m``; the kernel runs it on fp32 register fragments.
    """

    name: str
    operand: str
    fn: Callable[..., Any] | None = None
    index: int | None = None
    value: float | None = None
    dtype: str | None = None

    def __post_init__(self) -> None:
        if self.operand not in _OPERAND_KINDS:
            raise LoweringError(
                f"epilogue step {self.name!r} has operand kind {self.operand!r}",
                hint=f"use one of {_OPERAND_KINDS}",
            )
        if self.operand in ("col", "mat") and self.index is None:
            raise LoweringError(f"epilogue step {self.name!r} reads a tensor but has no operand index")
        if self.operand == "scalar" and self.value is None:
            raise LoweringError(f"epilogue step {self.name!r} is a scalar step without a value")
        if self.operand == "cast" and self.dtype not in ("bfloat16", "float16", "float32"):
            raise LoweringError(f"cast step to {self.dtype!r}", hint="the kernel casts to bfloat16, float16 or float32")

    @property
    def key(self) -> tuple:
        """What makes two steps emit the same code (formulas by identity: one per table row)."""
        return (self.name, self.operand, id(self.fn), self.index, self.value, self.dtype)


def plan_steps(spec: Any) -> tuple[KernelStep, ...]:
    """The kernel steps for an :class:`~branchyard.lowering.nvgemm.epilogue.EpilogueSpec`.

    Accepts the spec, its string form, or a sequence of :class:`KernelStep`.
    Each spec step contributes its table row's formula and operand kind; a row
    the kernel cannot load raises :class:`LoweringError` naming it.

        >>> [s.operand for s in plan_steps("w=nk;bias@0;gelu_erf;residual@1;out=bfloat16")]
        ['col', 'none', 'mat']
        >>> plan_steps("w=kn;scale:0.5;out=float16")[0].value
        0.5
    """
    if spec is None:
        return ()
    if isinstance(spec, str):
        from branchyard.lowering.nvgemm.epilogue import EpilogueSpec

        spec = EpilogueSpec.parse(spec)
    steps = getattr(spec, "steps", spec)
    planned = []
    for position, step in enumerate(steps):
        if isinstance(step, KernelStep):
            planned.append(step)
            continue
        row = step.op
        kind = _TABLE_OPERAND_KINDS.get(row.operand)
        if kind is None:
            raise LoweringError(
                f"step {row.name!r} has operand kind {row.operand!r}, which the kernel cannot load",
                where=f"epilogue step {position}",
            )
        if kind == "cast":
            planned.append(KernelStep(row.name, "cast", row.formula, dtype=_dtype_name(step.operand)))
        elif kind == "scalar":
            planned.append(KernelStep(row.name, "scalar", row.formula, value=float(step.operand)))
        elif kind in ("col", "mat"):
            planned.append(KernelStep(row.name, kind, row.formula, index=int(step.operand)))
        else:
            planned.append(KernelStep(row.name, "none", row.formula))
    return tuple(planned)


#: log2(e): exp(x) = 2^(x log2 e), and ex2.approx is one MUFU instruction.
_LOG2E = 1.4426950408889634
#: Abramowitz & Stegun 7.1.26: erf(z) = 1 - t (a1 + t (a2 + ...)) e^(-z^2), t = 1 / (1 + p z), z >= 0;
#: absolute error <= 1.5e-7 (far below bf16 / fp16 rounding of the outputs).
_ERF_P = 0.3275911
_ERF_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)
_SQRT_HALF = 0.7071067811865476
#: -2 sqrt(2/pi) log2(e) and -2 sqrt(2/pi) 0.044715 log2(e): sigmoid(2u) = 1 / (1 + 2^(x (K1 + K3 x^2))).
_GELU_TANH_K1 = -2.0 * 0.7978845608028654 * _LOG2E
_GELU_TANH_K3 = -2.0 * 0.7978845608028654 * 0.044715 * _LOG2E


#: Table rows whose formula divides: an IEEE fp32 division is a ~10-instruction
#: sequence with a slow path, so the kernel evaluates the same function through
#: ``m.sigmoid`` (one approximate reciprocal). Every other row runs its table formula.
_KERNEL_FORMULAS: dict[str, Callable[..., Any]] = {
    "silu": lambda x, m: x * m.sigmoid(x),
    "sigmoid": lambda x, m: m.sigmoid(x),
    # 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3): one ex2 and
    # one reciprocal, log2(e) folded into the cubic (7 instructions per element, not 12).
    "gelu_tanh": lambda x, m: x * m.rcp(1.0 + m.exp2(x * (_GELU_TANH_K1 + _GELU_TANH_K3 * (x * x)))),
    # x * Phi(x) with Phi from erfc directly: 0.5 x (1 + erf(x / sqrt 2)) without the
    # sign flip, the 1 + erf and the two halvings (4 of ~20 instructions per element).
    "gelu_erf": lambda x, m: x * m.norm_cdf(x),
}


def kernel_formula(step: KernelStep) -> Callable[..., Any]:
    """The formula the kernel emits for ``step``: the table's, or its division-free form.

        >>> kernel_formula(plan_steps("w=nk;silu;out=bfloat16")[0]) is _KERNEL_FORMULAS["silu"]
        True
    """
    return _KERNEL_FORMULAS.get(step.name, step.fn)


class _CuteMath:
    """The math namespace ``m`` the shared formulas see inside the kernel.

    Values are fp32 ``TensorSSA`` fragments (or scalars). The kernel writes
    16-bit outputs only, so the transcendental functions use the hardware's
    approximate ``ex2`` and reciprocal (relative error ~2^-22 and ~2^-23)
    instead of the accurate library sequences (~3x the instructions), in
    forms whose *absolute* error stays ~1e-7 where the formulas cancel
    (``1 + tanh(u)`` and ``1 + erf(z)`` near -1); ``tanh.approx`` (2^-11
    relative, ~5e-4 absolute there) would blur erf- and tanh-GELU apart in
    float16. Measured over [-12, 12] against float64: gelu_erf and gelu_tanh
    within 7e-7 absolute, as the accurate fp32 functions.
    """

    def __init__(self) -> None:
        import cutlass.cute as cute

        self._cute = cute

    def exp(self, x: Any) -> Any:
        return self._cute.math.exp2(x * _LOG2E, fastmath=True)

    def exp2(self, x: Any) -> Any:
        return self._cute.math.exp2(x, fastmath=True)

    def rcp(self, x: Any) -> Any:
        return self._cute.math.rcp(x, approx=True, ftz=True)

    def tanh(self, x: Any) -> Any:
        # 1 - 2 / (1 + e^(2x)): saturates to +-1 through inf / 0, no cancellation of its own.
        return 1.0 - 2.0 * self.rcp(1.0 + self._cute.math.exp2(x * (2.0 * _LOG2E), fastmath=True))

    def norm_cdf(self, x: Any) -> Any:
        """Phi(x) = (1 + erf(x / sqrt 2)) / 2 through the same erfc approximation."""
        a = self.abs(x)
        t = self.rcp(1.0 + (_ERF_P * _SQRT_HALF) * a)
        poly = 0.5 * _ERF_A[4]
        for coef in reversed(_ERF_A[:4]):
            poly = poly * t + 0.5 * coef
        h = poly * t * self._cute.math.exp2((x * x) * (-0.5 * _LOG2E), fastmath=True)
        return self._cute.where(x < 0.0, h, 1.0 - h)

    def erf(self, x: Any) -> Any:
        a = self.abs(x)
        t = self.rcp(1.0 + _ERF_P * a)
        poly = _ERF_A[4]
        for coef in reversed(_ERF_A[:4]):
            poly = poly * t + coef
        e = 1.0 - poly * t * self._cute.math.exp2(-(a * a) * _LOG2E, fastmath=True)
        return self._cute.where(x < 0.0, -e, e)

    def log(self, x: Any) -> Any:
        return self._cute.math.log(x)

    def sqrt(self, x: Any) -> Any:
        return self._cute.math.sqrt(x)

    def rsqrt(self, x: Any) -> Any:
        return self._cute.math.rsqrt(x)

    def abs(self, x: Any) -> Any:
        return self._cute.where(x < 0.0, -x, x)

    def sigmoid(self, x: Any) -> Any:
        return self.rcp(1.0 + self.exp(-x))

    def maximum(self, x: Any, y: Any) -> Any:
        return self._cute.where(x > y, x, self._full(x, y))

    def minimum(self, x: Any, y: Any) -> Any:
        return self._cute.where(x < y, x, self._full(x, y))

    def where(self, cond: Any, x: Any, y: Any) -> Any:
        return self._cute.where(cond, x, y)

    def relu(self, x: Any) -> Any:
        return self.maximum(x, 0.0)

    def _full(self, like: Any, value: Any) -> Any:
        if isinstance(value, (int, float)):
            return self._cute.full_like(like, float(value))
        return value


# ---------------------------------------------------------------------------
# Compile + launch
# ---------------------------------------------------------------------------

_CACHE: dict[tuple, Any] = {}
_CACHE_LOCK = threading.Lock()


def _num_tensor_operands(steps: Sequence[KernelStep]) -> int:
    indices = sorted({s.index for s in steps if s.operand in ("col", "mat")})
    if indices != list(range(len(indices))):
        raise LoweringError(f"tensor operand indices {indices} are not 0..n-1", where="compile_fused_gemm")
    return len(indices)


#: ``kernel_cache`` default of :func:`compile_fused_gemm`: the process's on-disk cache.
_DEFAULT_CACHE = "default"


def compile_fused_gemm(
    spec: Any,
    dtype: Any,
    config: GemmConfig,
    *,
    b_layout: str | None = None,
    out_dtype: Any | None = None,
    operand_dtypes: Sequence[Any] | None = None,
    kernel_cache: Any = _DEFAULT_CACHE,
) -> Callable[..., None]:
    """Compile (or fetch from the in-process or on-disk cache) the fused GEMM for ``spec``.

    ``spec`` is an ``EpilogueSpec`` (or its string, or ``KernelStep`` steps);
    ``dtype`` the dtype of ``a`` and ``b`` (bfloat16 or float16);
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
    if not isinstance(config, GemmConfig):
        raise LoweringError(f"config must be a GemmConfig, got {type(config).__name__}", where="compile_fused_gemm")
    name = _dtype_name(dtype)
    if name not in _SUPPORTED_DTYPES:
        raise LoweringError(f"input dtype {name}", where="compile_fused_gemm", hint="the kernel takes bfloat16 or float16")
    if isinstance(spec, str):
        from branchyard.lowering.nvgemm.epilogue import EpilogueSpec

        spec = EpilogueSpec.parse(spec)
    b_layout = b_layout or getattr(spec, "weight_layout", None) or "kn"
    if b_layout not in ("nk", "kn"):
        raise LoweringError(f"b_layout={b_layout!r}", where="compile_fused_gemm", hint="use 'nk' or 'kn'")
    spec_out = getattr(spec, "out_dtype", None)
    out_name = _dtype_name(out_dtype if out_dtype is not None else (spec_out if spec_out is not None else name))
    if out_name not in _SUPPORTED_DTYPES:
        raise LoweringError(
            f"output dtype {out_name}: the kernel stores 16-bit outputs only (stmatrix + TMA store)",
            where="compile_fused_gemm",
        )
    steps = plan_steps(spec)
    count = _num_tensor_operands(steps)
    if operand_dtypes is None:
        operand_dtypes = [name] * count
    if kernel_cache is _DEFAULT_CACHE:
        from branchyard.lowering.nvgemm.kernel_cache import default_kernel_cache

        kernel_cache = default_kernel_cache()
    kernel = _FusedGemm(steps, name, out_name, b_layout, config, count, kernel_cache=kernel_cache)
    kernel.variant(tuple(_dtype_name(d) for d in operand_dtypes))  # compile now: errors surface here
    return kernel


# ---------------------------------------------------------------------------
# The on-disk form of a compiled kernel
# ---------------------------------------------------------------------------

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


def _version(package: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def kernel_cache_key(
    steps: Sequence[KernelStep], dtype: str, out_dtype: str, operand_dtypes: Sequence[str], b_layout: str,
    config: GemmConfig,
) -> dict[str, Any]:
    """What a compiled kernel depends on besides the environment the
    :class:`~branchyard.lowering.nvgemm.kernel_cache.KernelCache` adds (GPU,
    driver, CUDA, torch, CuTeDSL): this package's source, the steps, dtypes,
    B layout, every config field, the target arch and the tvm-ffi version (the
    exported launcher's ABI).

        >>> key = kernel_cache_key(plan_steps("w=nk;bias@0;silu;out=bfloat16"), "bfloat16",
        ...                        "bfloat16", ["bfloat16"], "nk", GemmConfig(128, 256))
        >>> key["steps"], key["config"]["tile_n"]
        ([['bias', 'col', 0, None, None], ['silu', 'none', None, None, None]], 256)
    """
    return {
        "kernel": "fused_gemm",
        "source": _source_digest(),
        # Formulas are named, not hashed: the table that maps names to them is part of ``source``.
        "steps": [[s.name, s.operand, s.index, s.value, s.dtype] for s in steps],
        "dtype": dtype,
        "out_dtype": out_dtype,
        "operand_dtypes": list(operand_dtypes),
        "b_layout": b_layout,
        "config": dataclasses.asdict(config),
        "arch": _target_arch(),
        "tvm_ffi": _version("apache-tvm-ffi"),
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


class _FusedGemm:
    """The callable :func:`compile_fused_gemm` returns (one spec, dtype, layout, config)."""

    def __init__(
        self, steps, dtype: str, out_dtype: str, b_layout: str, config: GemmConfig, count: int, *,
        kernel_cache: Any = None,
    ) -> None:
        self.steps = steps
        self.dtype = dtype
        self.out_dtype = out_dtype
        self.b_layout = b_layout
        self.config = config
        self.num_operands = count
        self.kernel_cache = kernel_cache

    def variant(self, operand_dtypes: tuple[str, ...]) -> Any:
        """The compiled kernel for these operand dtypes: from this process's
        memory, else from the on-disk cache, else compiled (and exported there)."""
        key = (tuple(s.key for s in self.steps), self.dtype, self.out_dtype, operand_dtypes, self.b_layout, self.config)
        with _CACHE_LOCK:
            hit = _CACHE.get(key)
        if hit is not None:
            return hit
        for d in operand_dtypes:
            if d not in ("bfloat16", "float16", "float32"):
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

    def __call__(self, a: Any, b_kn: Any, operands: Sequence[Any], out: Any) -> None:
        if len(operands) != self.num_operands:
            raise LoweringError(
                f"{len(operands)} operand tensors for a kernel built for {self.num_operands}",
                where="fused gemm launch",
            )
        b_nk = b_kn.t()  # the kernel reads B as (N, K)
        unit = 1 if self.b_layout == "nk" else 0
        if b_nk.stride(unit) != 1 or a.stride(1) != 1 or out.stride(1) != 1:
            raise LoweringError(
                f"strides a={tuple(a.stride())}, b_kn={tuple(b_kn.stride())}, out={tuple(out.stride())} do not "
                f"match a row-major a/out and a {self.b_layout!r} weight",
                where="fused gemm launch",
            )
        compiled = self.variant(tuple(_dtype_name(t.dtype) for t in operands))
        # A trailing scalar keeps the operand tuple non-empty (the DSL cannot pass an empty one).
        compiled(a, b_nk, out, (*operands, 0.0))

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
    config: GemmConfig,
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
    kinds = {s.index: s.operand for s in steps if s.operand in ("col", "mat")}
    fake_ops: list[Any] = []
    for index, op_dtype in enumerate(operand_dtypes):
        if kinds[index] == "col":
            fake_ops.append(make_fake_tensor(types[op_dtype], (n,), (1,)))
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
def _kernel_class() -> type:
    """Define the kernel class on first use (it needs cutlass at class-body time)."""
    from branchyard.lowering.nvgemm import _cutedsl_kernel

    return _cutedsl_kernel.build_kernel_class()
