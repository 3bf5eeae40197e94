"""The candidates the tuner races for one :class:`~.problem.Problem`: every
way this library knows to run a matmul + epilogue chain.

==================================  ============================================================
``cutedsl:gemv_m<rows>_w<warps>``   our small-M kernel (M <= 64, an ``[N, K]`` weight), one per
                                    config (:func:`~.kernel_config.small_m_configs`; ``_u<U>``
                                    appended for the configs that load U K steps at a time,
                                    ``_r32`` for those with 32 weight rows per CTA)
``cutedsl:<config>``                our fused kernel, one per tile config (:mod:`.cutedsl_gemm`)
``cutedsl:gemv_..._dual``           the small-M kernel reading both weights of a ``mul_mm`` chain in
                                    one pass; every other kernel runs such a chain expanded:
                                    ``a @ w2.T`` by ``torch.mm`` first, then its ``mul`` step
``cutlass_plain+epilogue``          cutlass-operators' plain GEMM, then the chain as ATen ops
``cublaslt:_addmm_activation``      cuBLASLt's fused bias + ReLU / GELU(tanh), when that is the chain
``cublas:addmm``                    cuBLAS's ``alpha`` and ``C`` input, when that is the chain
``cublaslt:_addmm_activation+aten`` cuBLASLt on the chain's prefix, the rest as ATen ops
``cublas:addmm+aten``               ``addmm`` on the chain's prefix, the rest as ATen ops
``triton:inductor``                 the unfused chain compiled by Inductor (max-autotune), no Dynamo
                                    (``triton:inductor[<mode>]`` with another ``torch.compile`` mode)
``aten:unfused``                    the original ATen ops, unfused: always offered, so the
                                    tuned choice is never slower than the program was
==================================  ============================================================

What cuBLAS(Lt) covers is read from the epilogue table's ``addmm`` and
``cublaslt`` columns (:func:`~.epilogue.addmm_prefix`,
:func:`~.epilogue.cublaslt_prefix`); nothing here names an epilogue op.

    >>> import torch
    >>> from branchyard.lowering.nvgemm.epilogue import EpilogueSpec
    >>> from branchyard.lowering.nvgemm.problem import Problem
    >>> spec = EpilogueSpec.parse("w=kn;bias@0;relu;out=float32")
    >>> p = Problem.of(torch.randn(8, 16), torch.randn(16, 32), [torch.randn(32)], spec)
    >>> [c.name for c in default_candidates(p, inductor=False)]
    ['cublaslt:_addmm_activation', 'cublas:addmm', 'cublaslt:_addmm_activation+aten', 'cublas:addmm+aten', 'aten:unfused']
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

from branchyard.errors import LoweringError
from branchyard.lowering.nvgemm.epilogue import (
    CublasPrefix,
    EpilogueSpec,
    addmm_prefix,
    cublaslt_prefix,
    expand_weight_steps,
    unfused_aten_epilogue,
    weight_products,
    without_casts,
)
from branchyard.lowering.nvgemm.kernel_config import (
    candidate_configs,
    cutedsl_available,
    dtype_name,
    small_m_configs,
    small_m_ineligibility,
)
from branchyard.lowering.nvgemm.problem import Impl, Problem, own_output

__all__ = ["Candidate", "INDUCTOR_MODE", "UNFUSED", "candidate_kind", "compile_chain", "default_candidates",
           "inductor_candidate_name", "unfused_impl"]

logger = logging.getLogger("branchyard")

#: The name of the candidate that leaves the chain unfused.
UNFUSED = "aten:unfused"


@dataclass(frozen=True)
class Candidate:
    """One way to run a problem. ``build(problem)`` returns an :data:`~.problem.Impl`
    or raises (the candidate is then excluded with the error as reason);
    ``applies(problem)`` returns ``None`` or why the candidate does not apply;
    ``available(problem)`` returns ``None`` or why this process cannot build it
    *now* (a per-process limit), though it could run the problem: a winner
    raced without it is not final, and a process that can build it tunes again."""

    name: str
    build: Callable[[Problem], Impl]
    applies: Callable[[Problem], str | None] = lambda problem: None
    available: Callable[[Problem], str | None] = lambda problem: None


def candidate_kind(name: str) -> str:
    """The kind of kernel a candidate runs: its library (the part of its name
    before ``:``), CuTeDSL's small-M and tiled kernels apart. Candidates of one
    kind are launched and scheduled alike, so where one loses inside a
    program for a reason its time alone did not show, its kin likely do too.

        >>> [candidate_kind(n) for n in ("cutedsl:gemv_m64_w16", "cutedsl:t64x64_c1x1_o1_rtma",
        ...                              "triton:inductor[default]", "cublas:addmm+aten", UNFUSED)]
        ['cutedsl:gemv', 'cutedsl:tiled', 'triton', 'cublas', 'aten']
    """
    library, _, kernel = name.partition(":")
    if library == "cutedsl":
        return "cutedsl:gemv" if kernel.startswith("gemv") else "cutedsl:tiled"
    return library


# --- the unfused chain -------------------------------------------------------


def unfused_impl(spec: EpilogueSpec) -> Impl:
    """The chain as the original program ran it: ``mm``, then one ATen op per step.
    Capturable in a CUDA graph (no host synchronisation, no compilation)."""

    def impl(a, b_kn, operands, out):
        return unfused_aten_epilogue(torch.mm(a, b_kn), spec, list(operands), a)

    return own_output(impl)


def _aten_build(problem: Problem) -> Impl:
    return unfused_impl(problem.spec)


# --- cuBLAS(Lt) epilogues ----------------------------------------------------


def _names(problem: Problem) -> str:
    return "+".join(problem.spec.names)


def _cuda_only(problem: Problem) -> str | None:
    if not problem.device.startswith("cuda"):
        return "cuBLASLt runs on CUDA only (the CPU kernel's GELU is the erf form)"
    return None


def _cublaslt_applies(problem: Problem) -> str | None:
    steps = without_casts(problem.spec.steps)
    prefix = cublaslt_prefix(steps)
    if prefix is None or prefix.length != len(steps):
        return f"_addmm_activation fuses only a bias and its ReLU or tanh-GELU, not {_names(problem)}"
    if problem.spec.out_dtype != problem.dtype or any(d != problem.dtype for d in problem.operand_dtypes):
        return "_addmm_activation needs the bias and output in the input dtype"
    return _cuda_only(problem)


@functools.lru_cache(maxsize=None)
def _addmm_gelu_form(device: str, dtype: torch.dtype) -> str:
    """Which GELU ``_addmm_activation(use_gelu=True)`` computes here: "tanh"
    or "erf" (torch's CPU kernel uses erf; cuBLASLt's epilogue is tanh).

    Probed once per device and dtype on x in [-4, -2.8] (through ``x @ I``,
    which is exact), where the two forms differ by 10-40% of the value: far
    above 16-bit rounding, which the tolerance check alone cannot tell apart.
    """
    x = torch.linspace(-4.0, -2.8, 64, device=device).reshape(8, 8).to(dtype)
    eye = torch.eye(8, device=device, dtype=dtype)
    got = torch._addmm_activation(torch.zeros(8, device=device, dtype=dtype), x, eye, use_gelu=True).double()
    xd = x.double()
    tanh, erf = torch.nn.functional.gelu(xd, approximate="tanh"), torch.nn.functional.gelu(xd)
    rel = lambda ref: ((got - ref).abs() / ref.abs()).mean().item()  # noqa: E731
    return "tanh" if rel(tanh) <= rel(erf) else "erf"


def _require_tanh_gelu(problem: Problem, use_gelu: bool, where: str) -> None:
    if use_gelu and _addmm_gelu_form(problem.device, problem.dtype) != "tanh":
        raise LoweringError(
            f"_addmm_activation on {problem.device} computes the erf GELU, not the tanh form this chain needs",
            where=where,
        )


#: What each cuBLAS candidate needs its chain to start with (named where one is built for another chain).
_LT_FORM = "a bias and its ReLU or tanh-GELU"
_ADDMM_FORM = "[scale +] bias or residual"


def _prefix(prefix: CublasPrefix | None, problem: Problem, form: str, where: str) -> CublasPrefix:
    """``prefix``, found in ``problem``'s chain; where the chain has none (the
    candidate built without its ``applies``), an error that excludes it."""
    if prefix is None:
        raise LoweringError(f"the chain [{problem.spec}] does not start with {form}", where=where)
    return prefix


def _cublaslt_build(problem: Problem) -> Impl:
    prefix = _prefix(cublaslt_prefix(without_casts(problem.spec.steps)), problem, _LT_FORM, "cublaslt candidate")
    _require_tanh_gelu(problem, prefix.use_gelu, "cublaslt candidate")
    bias, use_gelu = prefix.c, prefix.use_gelu

    def impl(a, b_kn, operands, out):
        return torch._addmm_activation(operands[bias], a, b_kn, use_gelu=use_gelu, out=out)

    return impl


def _same_dtype(problem: Problem, operand: int, what: str) -> str | None:
    if problem.operand_dtypes[operand] != problem.dtype:
        return f"{what} needs its C input in the matmul dtype"
    return None


def _addmm_applies(problem: Problem) -> str | None:
    prefix = addmm_prefix(problem.spec.steps)
    if prefix is None or prefix.length != len(problem.spec.steps):
        return f"addmm fuses only [scale +] bias or residual, not {_names(problem)}"
    if problem.spec.out_dtype != problem.dtype:
        return "addmm needs its input and output in the matmul dtype"
    return _same_dtype(problem, prefix.c, "addmm")


def _addmm_build(problem: Problem) -> Impl:
    prefix = _prefix(addmm_prefix(problem.spec.steps), problem, _ADDMM_FORM, "cublas:addmm candidate")
    c, alpha = prefix.c, prefix.alpha

    def impl(a, b_kn, operands, out):
        return torch.addmm(operands[c], a, b_kn, alpha=alpha, out=out)

    return impl


def _rest_spec(spec: EpilogueSpec, start: int) -> EpilogueSpec:
    """The steps from ``start`` on (operand indices still index the full list)."""
    return dataclasses.replace(spec, steps=spec.steps[start:])


def _lt_prefix_applies(problem: Problem) -> str | None:
    prefix = cublaslt_prefix(problem.spec.steps)
    if prefix is None or prefix.length == len(problem.spec.steps):
        return "the chain does not start with a bias and its ReLU or tanh-GELU followed by more steps"
    if problem.operand_dtypes[prefix.c] != problem.dtype:
        return "_addmm_activation needs the bias in the input dtype"
    return _cuda_only(problem)


def _lt_prefix_build(problem: Problem) -> Impl:
    prefix = _prefix(cublaslt_prefix(problem.spec.steps), problem, _LT_FORM, "cublaslt prefix candidate")
    _require_tanh_gelu(problem, prefix.use_gelu, "cublaslt prefix candidate")
    bias, use_gelu = prefix.c, prefix.use_gelu
    rest = _rest_spec(problem.spec, prefix.length)

    def impl(a, b_kn, operands, out):
        y = torch._addmm_activation(operands[bias], a, b_kn, use_gelu=use_gelu)
        return unfused_aten_epilogue(y, rest, list(operands), a)

    return own_output(impl)


def _addmm_prefix_applies(problem: Problem) -> str | None:
    prefix = addmm_prefix(problem.spec.steps)
    if prefix is None or prefix.length == len(problem.spec.steps):
        return "the chain does not start with [scale +] bias or residual followed by more steps"
    return _same_dtype(problem, prefix.c, "addmm")


def _addmm_and_rest(spec: EpilogueSpec, prefix: CublasPrefix) -> Callable[..., torch.Tensor]:
    """``fn(a, b_kn, operands)``: ``addmm`` on the chain's ``prefix``, its other steps as ATen ops."""
    rest, c, alpha = _rest_spec(spec, prefix.length), prefix.c, prefix.alpha
    return lambda a, b_kn, operands: unfused_aten_epilogue(torch.addmm(operands[c], a, b_kn, alpha=alpha), rest,
                                                           list(operands), a)


def _addmm_prefix_build(problem: Problem) -> Impl:
    prefix = _prefix(addmm_prefix(problem.spec.steps), problem, _ADDMM_FORM, "cublas:addmm+aten candidate")
    chain = _addmm_and_rest(problem.spec, prefix)
    return own_output(lambda a, b_kn, operands, out: chain(a, b_kn, operands))


# --- Triton through Inductor ---------------------------------------------------
#
# The chain is traced to an FX graph for the exact inputs (make_fx on fake
# tensors) and compiled by Inductor directly: a plain function, no Dynamo
# frame, no guards to evaluate per call, and no shared code object for Dynamo's
# recompile limit to run into (torch.compile of many chains hit it after 8 and
# ran them eagerly, silently). Being unguarded, a compiled function is only
# ever called with the shapes and strides it was compiled for: the
# implementation looks its function up by them and compiles a new shape on
# first sight -- except inside a CUDA-graph capture, past the process cap, or
# when the compile fails, where it runs the chain eagerly (and says why once).

#: (spec, mode, dtypes, device), (M, N, K), every shape and stride -> the
#: compiled chain. Shared by the op's tuner and the benchmark, so each shape
#: compiles once per process.
_INDUCTOR_FNS: dict[tuple, Callable[..., torch.Tensor]] = {}
_INDUCTOR_LOCK = threading.RLock()
_INDUCTOR_SAID: set[str] = set()


def _inductor_cap() -> int:
    return int(os.environ.get("BRANCHYARD_NVGEMM_INDUCTOR_MAX", "32"))


def _inductor_options(mode: str) -> dict[str, Any]:
    """What ``torch.compile(mode=mode)`` would set in Inductor's config, less
    Inductor's own CUDA graphs: the op is captured into its caller's graphs,
    and those cannot nest."""
    import torch._inductor

    options = dict(torch._inductor.list_mode_options(mode))
    options["triton.cudagraphs"] = False
    return options


def chain_to_trace(spec: EpilogueSpec, a: torch.Tensor, operands: list[torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The chain as ATen ops, ``fn(a, b_kn, *operands)``, for Inductor to compile.

    A chain that starts with what ``addmm`` applies (a bias or residual in the
    inputs' dtype, after an optional scale) is ``addmm`` and the rest, as the
    program had it (``nn.Linear``'s bias is an ``addmm``): Inductor then tunes
    the problem ``torch.compile`` of the model tunes, GEMM templates with the
    bias in their epilogue, not a plain ``mm`` followed by adds.

        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> spec = EpilogueSpec.parse("w=kn;bias@0;residual@1;out=float32")
        >>> a, b, bias, res = torch.randn(4, 8), torch.randn(8, 16), torch.randn(16), torch.randn(4, 16)
        >>> gm = make_fx(chain_to_trace(spec, a, [bias, res]))(a, b, bias, res)
        >>> [n.target.__name__ for n in gm.graph.nodes if n.op == "call_function"]
        ['addmm.default', 'view.default', 'add.Tensor']
    """
    prefix = addmm_prefix(spec.steps)
    if prefix is None or operands[prefix.c].dtype != a.dtype:
        return lambda a, b_kn, *ops: unfused_aten_epilogue(torch.mm(a, b_kn), spec, list(ops), a)
    chain = _addmm_and_rest(spec, prefix)
    return lambda a, b_kn, *ops: chain(a, b_kn, ops)


def compile_chain(spec: EpilogueSpec, mode: str, a: torch.Tensor, b_kn: torch.Tensor,
                  operands: list[torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The unfused chain compiled by Inductor for exactly these inputs' shapes,
    strides, dtypes and device: ``fn(a, b_kn, *operands) -> result``, without
    Dynamo (:func:`chain_to_trace` traced with ``make_fx`` on fake tensors,
    compiled with ``torch._inductor.compile`` and ``mode``'s options)."""
    import torch._inductor
    from torch.fx.experimental.proxy_tensor import make_fx

    chain = chain_to_trace(spec, a, operands)
    inputs = [a, b_kn, *operands]
    graph = make_fx(chain, tracing_mode="fake")(*inputs)
    return torch._inductor.compile(graph, inputs, options=_inductor_options(mode))


def _capturing(a: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on ``a``'s device (no compiling then)."""
    return a.is_cuda and torch.cuda.is_current_stream_capturing()


def _eager_chain(spec: EpilogueSpec, reason: str) -> Callable[..., torch.Tensor]:
    """The chain as ATen ops, for a shape that is not compiled; its
    ``eager_reason`` says why (logged once per reason)."""
    if reason not in _INDUCTOR_SAID:
        _INDUCTOR_SAID.add(reason)
        logger.warning("nvgemm: triton:inductor runs its chain eagerly: %s", reason)

    def eager(a, b_kn, *ops):
        return unfused_aten_epilogue(torch.mm(a, b_kn), spec, list(ops), a)

    eager.eager_reason = reason  # type: ignore[attr-defined]
    return eager


def _inductor_fn(key: tuple, spec: EpilogueSpec, mode: str, a, b_kn, operands) -> Callable[..., torch.Tensor]:
    """The compiled chain for ``key`` (see :data:`_INDUCTOR_FNS`), compiled now
    if it is new, or the eager chain where compiling is not allowed or fails."""
    with _INDUCTOR_LOCK:
        fn = _INDUCTOR_FNS.get(key)
        if fn is not None:
            return fn
        shape = f"a {list(a.shape)}{tuple(a.stride())}, b {list(b_kn.shape)}{tuple(b_kn.stride())} [{spec}]"
        if _capturing(a):
            return _eager_chain(spec, f"{shape} first seen inside a CUDA-graph capture (no compiling while capturing)")
        cap = _inductor_cap()
        if len(_INDUCTOR_FNS) >= cap:
            fn = _eager_chain(spec, f"{shape}: {cap} Inductor compiles already made in this process "
                                    "(raise BRANCHYARD_NVGEMM_INDUCTOR_MAX to allow more)")
        else:
            try:
                fn = compile_chain(spec, mode, a, b_kn, list(operands))
            except Exception as exc:  # a shape Inductor cannot compile: never an error out of the op
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                fn = _eager_chain(spec, f"{shape}: the compile failed: {type(exc).__name__}: {first}")
        _INDUCTOR_FNS[key] = fn
        return fn


#: The ``torch.compile`` mode of the ``triton:inductor`` candidate.
INDUCTOR_MODE = "max-autotune-no-cudagraphs"
#: The modes offered unless ``BRANCHYARD_NVGEMM_INDUCTOR_MODE`` lists others
#: (comma-separated). ``default`` keeps cuBLAS for the GEMMs and fuses the
#: chain's elementwise tail into one Triton kernel; max-autotune may pick a
#: Triton GEMM from a short benchmark that cuBLAS beats over a whole program.
INDUCTOR_MODES = (INDUCTOR_MODE, "default")


def inductor_modes() -> tuple[str, ...]:
    """The Inductor modes offered as candidates (each its own candidate).

        >>> inductor_modes()
        ('max-autotune-no-cudagraphs', 'default')
    """
    text = os.environ.get("BRANCHYARD_NVGEMM_INDUCTOR_MODE", "")
    modes = tuple(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    return modes or INDUCTOR_MODES


def inductor_candidate_name(mode: str = INDUCTOR_MODE) -> str:
    """``triton:inductor``, with the mode appended where it is not the default: a
    winner raced against one mode's kernels says nothing about another's.

        >>> inductor_candidate_name(), inductor_candidate_name("default")
        ('triton:inductor', 'triton:inductor[default]')
    """
    return "triton:inductor" if mode == INDUCTOR_MODE else f"triton:inductor[{mode}]"


def _inductor_head(problem: Problem, mode: str) -> tuple:
    return (str(problem.spec), mode, problem.dtype, problem.operand_dtypes, problem.device)


def _inductor_unavailable(problem: Problem, mode: str) -> str | None:
    """Why this process compiles no new shape for ``problem`` (its cap is reached), or ``None``."""
    head, mnk = _inductor_head(problem, mode), (problem.m, problem.n, problem.k)
    cap = _inductor_cap()
    if len(_INDUCTOR_FNS) >= cap and not any(key[:2] == (head, mnk) for key in _INDUCTOR_FNS):
        return f"{cap} Inductor compiles already made in this process (max-autotune's take minutes each)"
    return None


def _inductor_build(problem: Problem, mode: str) -> Impl:
    head = _inductor_head(problem, mode)
    unavailable = _inductor_unavailable(problem, mode)
    if unavailable is not None:
        raise LoweringError(unavailable, where="triton:inductor candidate",
                            hint="raise BRANCHYARD_NVGEMM_INDUCTOR_MAX to allow more")
    spec = problem.spec

    def impl(a, b_kn, operands, out):
        layout = [a.shape, a.stride(), b_kn.shape, b_kn.stride()]
        for t in operands:
            layout += (t.shape, t.stride())
        key = (head, (a.shape[0], b_kn.shape[1], a.shape[1]), tuple(layout))
        fn = _INDUCTOR_FNS.get(key)
        if fn is None:
            fn = _inductor_fn(key, spec, mode, a, b_kn, operands)
        return fn(a, b_kn, *operands)

    return own_output(impl)


# --- our kernel and cutlass-operators' plain GEMM -----------------------------


def _cutedsl_build(problem: Problem, config: Any) -> Impl:
    from branchyard.lowering.nvgemm import cutedsl_gemm

    spec, dtypes = problem.spec, list(problem.operand_dtypes)
    expand = bool(spec.weight_operands) and not getattr(config, "dual", False)
    if expand:  # a @ w2.T by torch.mm first: the kernel's operand is that [M, N] product
        dtypes = [problem.dtype if i in spec.weight_operands else d for i, d in enumerate(dtypes)]
        spec = expand_weight_steps(spec)
    # compile_fused_gemm keeps compiled kernels in the on-disk KernelCache, so
    # a later process loads them in milliseconds instead of recompiling.
    fn = cutedsl_gemm.compile_fused_gemm(
        spec, problem.dtype, config, b_layout=problem.b_layout, out_dtype=spec.out_dtype, operand_dtypes=dtypes,
    )
    if expand:
        original = problem.spec

        def impl(a, b_kn, operands, out):
            fn(a, b_kn, weight_products(a, original, operands), out)
            return out

        return impl
    return _KernelImpl(fn)


class _KernelImpl:
    """The :data:`~.problem.Impl` of a compiled fused kernel (it writes ``out``
    and returns it), with the kernel's ``bind`` (the launch alone, for the op's
    call plans: see ``op.CallPlan.launch``)."""

    __slots__ = ("kernel",)

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel

    def __call__(self, a, b_kn, operands, out):
        self.kernel(a, b_kn, list(operands), out)
        return out

    def bind(self, a, b_kn, operands, out) -> Callable[..., None]:
        return self.kernel.bind(a, b_kn, list(operands), out)


def _small_m_applies(problem: Problem, rows: int = 16) -> str | None:
    why = small_m_ineligibility(problem.m, problem.n, problem.k, problem.dtype, problem.b_layout,
                                problem.spec.out_dtype, rows)
    weights = problem.spec.weight_operands
    if why is None and weights:
        if len(weights) > 1:
            return f"{len(weights)} second weights: the dual small-M kernel reads one"
        if problem.operand_dtypes[weights[0]] != problem.dtype:  # type: ignore[index]
            return "the second weight's dtype differs from the input's"
        if problem.operand_layouts[weights[0]] != "row":  # type: ignore[index]
            return "the second weight is not row-major [N, K]"
    return why


def _cutedsl_candidates(problem: Problem) -> list[Candidate]:
    """The tile configs, and the small-M kernel's configs where M <= 64 (each
    list cut to ``BRANCHYARD_NVGEMM_MAX_CONFIGS`` when that is set)."""
    ok, why = cutedsl_available()
    if not ok:
        logger.info("nvgemm: no CuTeDSL candidates: %s", why)
        return []
    configs = candidate_configs(problem.m, problem.n, problem.k, dtype_name(problem.dtype))
    dual = bool(problem.spec.weight_operands)
    small = small_m_configs(problem.m, problem.n, problem.k, dual) if _small_m_applies(problem) is None else []
    limit = os.environ.get("BRANCHYARD_NVGEMM_MAX_CONFIGS")
    if limit:
        configs, small = configs[: max(1, int(limit))], small[: max(1, int(limit))]
    return [
        Candidate(f"cutedsl:{c.name}", functools.partial(_cutedsl_build, config=c),
                  functools.partial(_small_m_applies, rows=c.rows)) for c in small
    ] + [
        Candidate(f"cutedsl:{c.name}", functools.partial(_cutedsl_build, config=c)) for c in configs
    ]


def _cutlass_plain_candidates(problem: Problem) -> list[Candidate]:
    """cutlass-operators' plain GEMM followed by the chain as ATen ops (see
    :mod:`.cutlass_operators`); none when that package is missing."""
    try:
        from branchyard.lowering.nvgemm import cutlass_operators
    except Exception as exc:  # module absent or its package missing
        logger.info("nvgemm: no cutlass-operators candidate: %s", exc)
        return []
    ok, why = cutlass_operators.plain_gemm_available()
    if not ok:
        logger.info("nvgemm: no cutlass-operators candidate: %s", why)
        return []
    return [Candidate("cutlass_plain+epilogue",
                      functools.partial(_cutlass_plain_build, compile_plain=cutlass_operators.compile_plain_gemm))]


def _cutlass_plain_build(problem: Problem, compile_plain: Callable[..., Any]) -> Impl:
    gemm = compile_plain(problem.dtype, problem.b_layout)
    spec = problem.spec

    def impl(a, b_kn, operands, out):
        y = torch.empty((a.shape[0], b_kn.shape[1]), dtype=a.dtype, device=a.device)
        gemm(a, b_kn, y)
        return unfused_aten_epilogue(y, spec, list(operands), a)

    return own_output(impl)


def default_candidates(problem: Problem, *, inductor: bool | None = None) -> list[Candidate]:
    """The candidates for ``problem``, ours first, the unfused chain last.

    ``BRANCHYARD_NVGEMM_MAX_CONFIGS=n`` keeps only the first ``n`` CuTeDSL tile
    configs (each is a separate compile). ``inductor`` (default: env
    ``BRANCHYARD_NVGEMM_INDUCTOR`` != ``0``) adds one Inductor candidate per
    mode of :func:`inductor_modes` (max-autotune compiles for minutes); at
    most ``BRANCHYARD_NVGEMM_INDUCTOR_MAX`` (default 32) compiles per process.
    """
    if inductor is None:
        inductor = os.environ.get("BRANCHYARD_NVGEMM_INDUCTOR", "1") != "0"
    out = _cutedsl_candidates(problem) + _cutlass_plain_candidates(problem)
    out.append(Candidate("cublaslt:_addmm_activation", _cublaslt_build, _cublaslt_applies))
    out.append(Candidate("cublas:addmm", _addmm_build, _addmm_applies))
    out.append(Candidate("cublaslt:_addmm_activation+aten", _lt_prefix_build, _lt_prefix_applies))
    out.append(Candidate("cublas:addmm+aten", _addmm_prefix_build, _addmm_prefix_applies))
    for mode in inductor_modes() if inductor else ():
        out.append(Candidate(inductor_candidate_name(mode), functools.partial(_inductor_build, mode=mode),
                             available=functools.partial(_inductor_unavailable, mode=mode)))
    out.append(Candidate(UNFUSED, _aten_build))
    return out
