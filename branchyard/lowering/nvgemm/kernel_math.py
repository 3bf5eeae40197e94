"""The epilogue as the kernel evaluates it: the parsed spec planned into
:class:`KernelStep` records, and the math namespace (:class:`CuteMath`) the
table's kernel formulas run on inside the kernel.

Semantics, for one output element (``x`` the fp32 accumulator)::

    for step in plan_steps(spec):
        x = step.fn(x, m)                      # "none", "dtype" (stays fp32; one rounding at the store)
        x = step.fn(x, step.value, m)          # "scalar"
        x = step.fn(x, operands[step.index][col], m)         # "col"
        x = step.fn(x, operands[step.index][row, col], m)    # "matrix"
        x = step.fn(x, (a @ operands[step.index].T)[row, col], m)  # "weight": the small-M
                                                             # kernel's second accumulator

``step.fn`` is the row's ``kernel_formula`` (else its ``formula``) from
:data:`~branchyard.lowering.nvgemm.epilogue.EPILOGUE_TABLE`; nothing here
knows an op by name. Imports without CuTeDSL (``CuteMath`` imports it when built).

    >>> from branchyard.lowering.nvgemm.epilogue import EpilogueSpec
    >>> [s.operand for s in plan_steps(EpilogueSpec.parse("w=nk;bias@0;gelu_erf;residual@1;out=bfloat16"))]
    ['col', 'none', 'matrix']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from branchyard.errors import LoweringError
from branchyard.lowering.nvgemm.epilogue import TENSOR_OPERANDS, EpilogueSpec
from branchyard.lowering.nvgemm.kernel_config import OPERAND_DTYPES, dtype_name

__all__ = ["CuteMath", "KernelStep", "kernel_formula", "plan_steps"]

#: How a step's operand is read inside the kernel (the table's operand kinds).
_OPERAND_KINDS = ("none", "scalar", "col", "matrix", "weight", "dtype")

@dataclass(frozen=True)
class KernelStep:
    """One epilogue step as the kernel emits it.

    ``operand`` is the table row's operand kind: ``"none"`` (``fn(x, m)``),
    ``"scalar"`` (``fn(x, value, m)`` with ``value`` a Python float baked into
    the kernel), ``"col"`` (``fn(x, v[col], m)`` with ``v = operands[index]``
    of ``N`` elements), ``"matrix"`` (``fn(x, r[row, col], m)`` with
    ``r = operands[index]``, ``[M, N]`` row-major), ``"weight"`` (``fn(x, y, m)``
    with ``y`` the product of the input and the ``[N, K]`` weight
    ``operands[index]``, which only the small-M kernel computes) or ``"dtype"`` (``fn(x, m)``,
    a cast inside the chain: the value stays fp32 and is rounded once at the
    store). ``fn`` is the row's kernel formula, written over a math namespace
    ``m``; the kernel runs it on fp32 register fragments.
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
        if self.operand in TENSOR_OPERANDS and self.index is None:
            raise LoweringError(f"epilogue step {self.name!r} reads a tensor but has no operand index")
        if self.operand == "scalar" and self.value is None:
            raise LoweringError(f"epilogue step {self.name!r} is a scalar step without a value")
        if self.operand == "dtype" and self.dtype not in OPERAND_DTYPES:
            raise LoweringError(f"cast step to {self.dtype!r}", hint="the kernel casts to bfloat16, float16 or float32")

    @property
    def key(self) -> tuple:
        """What makes two steps emit the same code (formulas by identity: one per table row)."""
        return (self.name, self.operand, id(self.fn), self.index, self.value, self.dtype)


def plan_steps(spec: EpilogueSpec) -> tuple[KernelStep, ...]:
    """The kernel steps of a parsed spec, read from its table rows.

        >>> plan_steps(EpilogueSpec.parse("w=kn;scale:0.5;out=float16"))[0].value
        0.5
    """
    if not isinstance(spec, EpilogueSpec):
        raise LoweringError(f"plan_steps takes a parsed EpilogueSpec, got {type(spec).__name__}",
                            hint="parse the spec string once with EpilogueSpec.parse")
    planned = []
    for step in spec.steps:
        row = step.op
        fn = row.kernel_formula or row.formula
        if row.operand == "dtype":
            planned.append(KernelStep(row.name, "dtype", fn, dtype=dtype_name(step.operand)))
        elif row.operand == "scalar":
            planned.append(KernelStep(row.name, "scalar", fn, value=float(step.operand)))  # type: ignore[arg-type]
        elif row.operand in TENSOR_OPERANDS:
            planned.append(KernelStep(row.name, row.operand, fn, index=int(step.operand)))  # type: ignore[arg-type]
        else:
            planned.append(KernelStep(row.name, "none", fn))
    return tuple(planned)


def kernel_formula(step: KernelStep) -> Callable[..., Any]:
    """The formula the kernel emits for ``step`` (the row's kernel form, else its formula)."""
    return step.fn  # type: ignore[return-value]


#: log2(e): exp(x) = 2^(x log2 e), and ex2.approx is one MUFU instruction.
_LOG2E = 1.4426950408889634
#: Abramowitz & Stegun 7.1.26: erf(z) = 1 - t (a1 + t (a2 + ...)) e^(-z^2), t = 1 / (1 + p z), z >= 0;
#: absolute error <= 1.5e-7 (far below bf16 / fp16 rounding of the outputs).
_ERF_P = 0.3275911
_ERF_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)
_SQRT_HALF = 0.7071067811865476


class CuteMath:
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

