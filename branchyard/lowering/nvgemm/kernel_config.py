"""What the fused CuTeDSL kernel can run, in one place: its tuning space
(:class:`GemmConfig`, :func:`candidate_configs`) and every eligibility rule
(CuTeDSL and the device, dtypes, sizes, strides, pointer alignment).

The op asks :func:`fused_kernel_ineligibility` before it hands a call to the
tuner; the kernel asserts the same rules; the persistent kernel's shared
memory plan (:func:`persistent_stages`) lives next to the config it sizes.
Imports without CUDA or CuTeDSL (those are imported inside functions).

    >>> GemmConfig(128, 256).name
    't128x256_c1x1_o1'
    >>> all(c.tile_m == 64 for c in candidate_configs(16, 4096, 4096, "bfloat16"))
    True
    >>> check_eligible(128, 100, 4096, "bfloat16")
    'N=100 is not a multiple of 8 (TMA needs 16-byte rows of 16-bit elements)'

The small-M kernel (:class:`GemvConfig`) has its own space and rules
(:func:`small_m_configs`, :func:`small_m_ineligibility`):

    >>> [c.name for c in small_m_configs(5, 14336, 4096)][:5]
    ['gemv_m8_w8', 'gemv_m8_w4', 'gemv_m8_w16', 'gemv_m8_w8_u2', 'gemv_m8_w8_u4']
    >>> small_m_ineligibility(128, 4096, 4096, "bfloat16", "nk")
    'M=128 is above 64 (the small-M kernel reads the weight once per 64 rows of the input)'
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from branchyard.errors import LoweringError

__all__ = [
    "ALIGN_BYTES",
    "ALIGN_ELEMENTS",
    "KERNEL_DTYPES",
    "OPERAND_DTYPES",
    "GEMV_K_STEP",
    "GEMV_ROWS",
    "GemmConfig",
    "GemvConfig",
    "SMALL_M_MAX",
    "TILE_K",
    "PP_EPI_BUFFERS",
    "candidate_configs",
    "check_eligible",
    "cutedsl_available",
    "dtype_name",
    "fused_kernel_ineligibility",
    "layout_ineligibility",
    "persistent_stages",
    "small_m_configs",
    "small_m_ineligibility",
]

TILE_K = 64
#: Shared memory one CTA may use on sm_90 (227 KiB), and what we keep for mbarriers.
_SMEM_CAPACITY = 232448
_SMEM_RESERVED = 1024
_EPI_STAGES = 4
_MAX_AB_STAGES = 8
#: Input and output dtypes of the kernel (TMA + wgmma on 16-bit types, stmatrix stores).
KERNEL_DTYPES = ("bfloat16", "float16")
#: Dtypes an epilogue operand tensor may have (converted to fp32 in registers).
OPERAND_DTYPES = ("bfloat16", "float16", "float32")
#: TMA: every row (leading dimension) a multiple of 16 bytes, i.e. 8 16-bit elements,
#: and every base pointer 16-byte aligned.
ALIGN_ELEMENTS = 8
ALIGN_BYTES = 16


def dtype_name(dtype: Any) -> str:
    """'bfloat16' for torch.bfloat16, 'bfloat16', or cutlass.BFloat16."""
    text = str(dtype).lower()
    for name in ("bfloat16", "float16", "float32"):
        if text.endswith(name):
            return name
    return text


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
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return False, f"the kernel uses sm_90a instructions (wgmma, TMA); this device is sm_{major}{minor}"
    return True, ""



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
PP_EPI_BUFFERS = 2


def persistent_stages(tile_m: int, tile_n: int, residual_bytes: int, itemsize: int = 2) -> int:
    """A/B ring stages of the persistent kernel next to its epilogue buffers
    (``PP_EPI_BUFFERS`` sub-tiles of 64 x min(32, tile_n) per consumer
    warpgroup) and, for a TMA residual, ``residual_bytes`` (one tile).

        >>> persistent_stages(128, 128, 0), persistent_stages(128, 128, 128 * 128 * 2)
        (6, 5)
    """
    per_stage = (tile_m + tile_n) * TILE_K * itemsize
    epi = 2 * 64 * min(32, tile_n) * itemsize * PP_EPI_BUFFERS
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
    # Large M: the persistent ping-pong kernel in 2-CTA clusters (B multicast halves the
    # L2 traffic of B) first, then the one-tile-per-CTA 128x256 tile (docs/nvgemm_kernel.md).
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
    name = dtype_name(dtype)
    if name not in KERNEL_DTYPES:
        return f"dtype {name} is not supported (bfloat16 and float16 only)"
    if m < 1 or n < 1 or k < 1:
        return f"empty GEMM (M={m}, N={n}, K={k})"
    for dim, size in (("K", k), ("N", n)):
        if size % ALIGN_ELEMENTS:
            return f"{dim}={size} is not a multiple of 8 (TMA needs 16-byte rows of 16-bit elements)"
    return None


def _row_major_rows(t: torch.Tensor) -> bool:
    """2-D ``t`` has unit column stride and a row stride TMA can address."""
    return t.stride(1) == 1 and (t.shape[0] <= 1 or t.stride(0) % ALIGN_ELEMENTS == 0)


def layout_ineligibility(
    a: torch.Tensor, b_kn: torch.Tensor, operands: Sequence[torch.Tensor], k: int, n: int
) -> str | None:
    """Why dtypes, sizes, strides or pointers rule out the fused kernel, or
    ``None``. ``a`` is ``[M, K]``, ``b_kn`` the logical ``[K, N]`` weight,
    ``operands`` the 2-D/1-D views the kernel reads. Device-independent, so it
    is testable on CPU; each reason names the value at fault.

        >>> import torch
        >>> h = torch.float16
        >>> layout_ineligibility(torch.randn(4, 8, dtype=h), torch.randn(16, 16, dtype=h)[:, ::2].t(), [], 8, 16)
        'the weight [8, 16] has strides (2, 16): neither row-major [K, N] nor the transpose of a row-major [N, K]'
    """
    if a.dtype not in (torch.float16, torch.bfloat16):
        return f"input dtype {a.dtype}: the fused kernels take float16 or bfloat16"
    if b_kn.dtype != a.dtype:
        return f"weight dtype {b_kn.dtype} differs from input dtype {a.dtype}"
    if k < 1:
        return f"K={k}: an empty reduction"
    why = check_eligible(max(int(a.shape[0]), 1), n, k, a.dtype)
    if why is not None:
        return why
    if not _row_major_rows(a):
        return (f"the input {list(a.shape)} has strides {tuple(a.stride())}: the kernel reads a row-major "
                f"input with rows a multiple of {ALIGN_ELEMENTS} elements apart")
    if not (_row_major_rows(b_kn) or _row_major_rows(b_kn.t())):
        return (f"the weight {list(b_kn.shape)} has strides {tuple(b_kn.stride())}: neither row-major [K, N] "
                "nor the transpose of a row-major [N, K]")
    for i, t in enumerate(operands):
        if dtype_name(t.dtype) not in OPERAND_DTYPES:
            return f"operand {i} has dtype {t.dtype}: epilogue operands are float16, bfloat16 or float32"
        if t.dim() == 1 and t.stride(0) != 1 and t.shape[0] > 1:
            return f"operand {i} (a per-column vector) has stride {t.stride(0)}, not 1"
        if t.dim() == 2 and not _row_major_rows(t):
            return f"operand {i} {list(t.shape)} has strides {tuple(t.stride())}, not row-major"
    named = [("input", a), ("weight", b_kn)] + [(f"operand {i}", t) for i, t in enumerate(operands)]
    for name, t in named:
        if t.data_ptr() % ALIGN_BYTES:
            return f"the {name} pointer is not 16-byte aligned"
    return None


def fused_kernel_ineligibility(
    a: torch.Tensor, b_kn: torch.Tensor, operands: Sequence[torch.Tensor], k: int, n: int
) -> str | None:
    """Why the GPU implementations cannot take this call, or ``None``.

    Checked in order: device, then :func:`layout_ineligibility`. CuTeDSL is
    not required: without it (or on a GPU other than sm_90) the tuner races
    the candidates that remain -- cuBLAS(Lt), Triton through Inductor and the
    unfused chain (``candidates.default_candidates`` drops the CuTeDSL ones).
    """
    for t in (a, b_kn, *operands):
        if t.device.type != "cuda":
            return f"tensors are on {t.device.type}, not CUDA"
        if t.device != a.device:
            return f"tensors are on several devices ({a.device}, {t.device})"
    return layout_ineligibility(a, b_kn, operands, k, n)



# --- the small-M (memory-bound) kernel -----------------------------------------

#: The largest M the small-M kernel is offered for: above it the weight is no
#: longer the only traffic worth counting and the tiled kernels win.
SMALL_M_MAX = 64
#: Weight rows (output columns) per CTA: the M extent of one m16n8k16 MMA.
GEMV_ROWS = 16
#: K elements one warp consumes per step: 4 lanes x 2 chunks x 8 elements per row.
GEMV_K_STEP = 64
_GEMV_M_BLOCKS = (8, 16, 32, 64)
_GEMV_WARPS = (4, 8, 16)
_GEMV_UNROLLS = (1, 2, 4)
_GEMV_ROWS_PER_CTA = (16, 32)
#: 32-bit registers per SM and per thread (sm_90).
_SM_REGISTERS = 65536
_MAX_THREAD_REGISTERS = 255


@dataclass(frozen=True)
class GemvConfig:
    """One point of the small-M kernel's tuning space (:mod:`._cutedsl_gemv`).

    ``m_block`` input rows per CTA (8, 16, 32 or 64: one, two, four or eight
    m16n8k16 MMAs per k16 step; a larger M runs ``ceil(M / m_block)`` CTA
    rows, each reading the weight again); ``warps`` warps per CTA, which split
    K between them (more warps: more loads in flight per CTA for narrow N);
    ``unroll`` K steps (1, 2 or 4) whose loads a warp issues before it waits
    for any of them: U x 2 KiB of weight in flight per warp instead of 2 KiB,
    each step in its own register buffers; ``rows`` weight rows per CTA (16,
    one m16n8k16 tile, or 32: two tiles sharing each loaded input fragment, so
    a warp loads half the input bytes per weight byte; N must then be a
    multiple of 32); ``dual``: the chain multiplies by a second weight's
    product (a ``mul_mm`` step, a GLU's ``up``), and each CTA holds one 16-row
    tile of each weight, every loaded input fragment feeding both (``rows``
    is then 16). Configs other than U = 1, 16 rows, one weight are allowed only where
    the :attr:`registers` estimate fits one thread (255) and the CTA fits an
    SM's register file (so it launches, and ptxas need not spill)::

        >>> GemvConfig(16, 8, 4).name, GemvConfig(16, 8, 1).name, GemvConfig(16, 8, 2, rows=32).name
        ('gemv_m16_w8_u4', 'gemv_m16_w8', 'gemv_m16_w8_u2_r32')
        >>> GemvConfig(64, 8, 2)
        Traceback (most recent call last):
        ...
        branchyard.errors.LoweringError: GemvConfig: invalid GemvConfig: unroll=2, rows=16 with m_block=64, warps=8 needs about 312 registers per thread; at most 255 fit
    """

    m_block: int = 16
    warps: int = 8
    unroll: int = 1
    rows: int = GEMV_ROWS
    dual: bool = False

    def __post_init__(self) -> None:
        problems = []
        if self.m_block not in _GEMV_M_BLOCKS:
            problems.append(f"m_block={self.m_block} (must be one of {_GEMV_M_BLOCKS})")
        if self.warps not in _GEMV_WARPS:
            problems.append(f"warps={self.warps} (must be one of {_GEMV_WARPS})")
        if self.unroll not in _GEMV_UNROLLS:
            problems.append(f"unroll={self.unroll} (must be one of {_GEMV_UNROLLS})")
        if self.rows not in _GEMV_ROWS_PER_CTA:
            problems.append(f"rows={self.rows} (must be one of {_GEMV_ROWS_PER_CTA})")
        if self.dual and self.rows != GEMV_ROWS:
            problems.append(f"dual with rows={self.rows} (a dual CTA holds {GEMV_ROWS} rows of each weight)")
        base = (self.unroll, self.rows, self.dual) == (1, GEMV_ROWS, False)  # the first form, always allowed
        if not problems and not base and self.registers > self.register_cap:
            problems.append(f"unroll={self.unroll}, rows={self.rows}{', dual' if self.dual else ''} with m_block={self.m_block}, "
                            f"warps={self.warps} needs about {self.registers} registers per thread; "
                            f"at most {self.register_cap} fit")
        if problems:
            raise LoweringError("invalid GemvConfig: " + "; ".join(problems), where="GemvConfig")

    @property
    def threads(self) -> int:
        """Threads per CTA."""
        return 32 * self.warps

    @property
    def registers(self) -> int:
        """Estimated 32-bit registers per thread: per K step in flight, 16 per 16-row
        weight tile (two rows' 2 x 16 bytes) and 8 per 8 input rows, and 24 + 2 per
        input row and tile of accumulators, fragments and addresses (ptxas 13.0 used
        94 / 124 / 168 where this says 88 / 120 / 184 for m8 U2, m16 U2, m32 U2).

            >>> GemvConfig(16, 8, 2).registers, GemvConfig(16, 8, 2, rows=32).registers
            (120, 184)
        """
        return self.unroll * (16 * self.tiles + self.m_block) + 24 + 2 * self.m_block * self.tiles

    @property
    def tiles(self) -> int:
        """16-row weight tiles per CTA: two for 32 rows or two weights, else one."""
        return 2 if self.dual else self.rows // GEMV_ROWS

    @property
    def register_cap(self) -> int:
        """Registers one thread may hold: 255, and the SM's 64 K shared by the CTA's threads."""
        return min(_MAX_THREAD_REGISTERS, _SM_REGISTERS // self.threads)

    @property
    def name(self) -> str:
        """Short stable name (the candidate is ``cutedsl:<name>``); ``_u<U>`` only for U > 1 and
        ``_r<rows>`` only for 32 rows, so the first form keeps the names its winners were recorded under."""
        return (f"gemv_m{self.m_block}_w{self.warps}" + (f"_u{self.unroll}" if self.unroll > 1 else "")
                + (f"_r{self.rows}" if self.rows != GEMV_ROWS else "") + ("_dual" if self.dual else ""))


def small_m_configs(m: int, n: int, k: int, dual: bool = False) -> list[GemvConfig]:
    """The small-M configs worth timing: the smallest ``m_block`` holding M
    (every CTA then reads its weight rows once), with 8, 4 and 16 warps one
    K step at a time, then the variants of :data:`_GEMV_VARIANTS` whose
    registers fit (the 32-row ones only where N is a multiple of 32). Each
    config listed runs every K that :func:`small_m_ineligibility` allows (a
    warp's steps left over by the unrolled loop run one at a time). With
    ``dual`` (a chain with a second weight), the 16-row configs whose two
    tiles fit the registers, each ``dual``.

        >>> [c.name for c in small_m_configs(17, 4096, 4096)]
        ['gemv_m32_w8', 'gemv_m32_w4', 'gemv_m32_w16', 'gemv_m32_w8_u2', 'gemv_m32_w4_u2', 'gemv_m32_w8_r32']
        >>> [c.name for c in small_m_configs(17, 4112, 4096)][-1]
        'gemv_m32_w4_u2'
        >>> [c.name for c in small_m_configs(64, 4096, 4096)]
        ['gemv_m64_w8', 'gemv_m64_w4', 'gemv_m64_w16']
        >>> [c.name for c in small_m_configs(1, 14336, 4096, dual=True)]
        ['gemv_m8_w8_dual', 'gemv_m8_w4_dual', 'gemv_m8_w16_dual', 'gemv_m8_w8_u2_dual', 'gemv_m8_w8_u4_dual', 'gemv_m8_w4_u4_dual', 'gemv_m8_w4_u2_dual']
    """
    m_block = next((b for b in _GEMV_M_BLOCKS if b >= m), _GEMV_M_BLOCKS[-1])
    shapes = [(w, 1, GEMV_ROWS) for w in (8, 4, 16)] + list(_GEMV_VARIANTS)
    configs = []
    for warps, unroll, rows in shapes:
        if n % rows or (dual and rows != GEMV_ROWS):
            continue
        try:
            configs.append(GemvConfig(m_block, warps, unroll, rows, dual))
        except LoweringError:  # too many registers for this m_block
            continue
    return configs


#: (warps, unroll, rows) of the small-M configs the tuner races after the first form's,
#: in this order.
_GEMV_VARIANTS = ((8, 2, 16), (8, 4, 16), (4, 4, 16), (4, 2, 16), (16, 2, 16), (8, 1, 32), (8, 2, 32), (4, 2, 32))


def small_m_ineligibility(m: int, n: int, k: int, dtype: Any, b_layout: str, out_dtype: Any = None,
                          rows: int = GEMV_ROWS) -> str | None:
    """Why the small-M kernel does not take this problem, or ``None``.

    On top of :func:`layout_ineligibility` (which the op checks for every
    fused kernel): M in 1..:data:`SMALL_M_MAX`, the ``nn.Linear`` weight
    layout (``[N, K]`` row-major, each output column one contiguous weight
    row), ``N`` a multiple of ``rows`` (the config's weight rows per CTA,
    :data:`GEMV_ROWS` or 32), ``K`` a multiple of
    :data:`GEMV_K_STEP`, and a 16-bit or float32 output.

        >>> small_m_ineligibility(16, 14336, 4096, "bfloat16", "nk") is None
        True
        >>> small_m_ineligibility(16, 4096, 4096, "bfloat16", "kn")
        "the weight layout is 'kn': the small-M kernel streams the rows of an [N, K] (nn.Linear) weight"
    """
    name = dtype_name(dtype)
    if name not in KERNEL_DTYPES:
        return f"dtype {name} is not supported (bfloat16 and float16 only)"
    if m < 1:
        return f"M={m}: nothing to compute"
    if m > SMALL_M_MAX:
        return f"M={m} is above {SMALL_M_MAX} (the small-M kernel reads the weight once per {SMALL_M_MAX} rows of the input)"
    if b_layout != "nk":
        return (f"the weight layout is {b_layout!r}: the small-M kernel streams the rows of an [N, K] "
                "(nn.Linear) weight")
    if n < 1 or n % GEMV_ROWS:
        return f"N={n} is not a multiple of {GEMV_ROWS} (one MMA's rows per CTA)"
    if n % rows:
        return f"N={n} is not a multiple of {rows} (this config's weight rows per CTA)"
    if k < 1 or k % GEMV_K_STEP:
        return f"K={k} is not a multiple of {GEMV_K_STEP} (one warp's step along K)"
    if out_dtype is not None and dtype_name(out_dtype) not in KERNEL_DTYPES + ("float32",):
        return f"output dtype {dtype_name(out_dtype)} (bfloat16, float16 or float32 only)"
    return None
