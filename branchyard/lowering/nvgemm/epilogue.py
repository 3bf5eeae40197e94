"""The epilogue vocabulary: ONE table of the elementwise ops that may follow a
matmul and be fused into its store.

Each row (:class:`EpilogueOp`) says, as data:

* ``name`` -- the step's name in a spec string (``"gelu_tanh"``);
* ``targets`` / ``match`` -- which ATen ops it is matched from and the operand
  checks (a guard-clause function returning the operand or a reason string);
* ``operand`` -- what the step consumes besides the running value:
  ``"none"``, ``"scalar"`` (a Python float baked into the spec),
  ``"col"`` (a per-column vector, ``N`` elements), ``"matrix"`` (``[M, N]``),
  ``"weight"`` (a second ``[N, K]`` weight: the step consumes ``a @ w.T``, the
  product of the matmul's own input with it; see ``expands_to``) or ``"dtype"``
  (a cast);
* ``formula`` -- its math, written ONCE over a math namespace ``m``. The
  reference path evaluates it with :data:`TORCH_MATH` in fp32; the CuTeDSL
  kernel evaluates the same function with CuTeDSL math on registers. ``m`` must
  provide ``exp``, ``tanh``, ``erf`` and ``maximum(x, c)`` (``c`` a Python
  float); ``+ - * /`` are Python operators;
* ``aten`` -- the unfused eager op (the "unfused ATen chain" candidate, which
  rounds to the tensor dtype after every step, as the original graph did);
* ``kernel_formula`` -- the same function in the form the GPU kernel emits,
  where that is cheaper (``None``: the kernel runs ``formula``);
* ``product`` -- the ``weight`` row a step of this row becomes when its
  operand is a second matmul of the chain's own input (``mul`` and, where M
  is 1 and ``[1, N]`` reads as a per-column vector, ``scale_col``);
* ``expands_to`` -- for a ``weight`` row, the ``matrix`` row it is once the
  product ``a @ w.T`` is computed on its own (what every kernel but the
  small-M one, which reads both weights in one pass, runs);
* ``addmm`` / ``cublaslt`` -- what cuBLAS applies of it inside its GEMM
  (``addmm``'s ``alpha`` or ``C``; ``_addmm_activation``'s ReLU or GELU), read by
  the tuner's cuBLAS candidates through :func:`addmm_prefix` and
  :func:`cublaslt_prefix`.

Adding an epilogue op is one row here (plus its tests): the matcher, the
reference path, the kernel and the cuBLAS candidates all read the table.

A fused chain is an :class:`EpilogueSpec`: the ordered steps plus the output
dtype and the layout of the weight operand. Its semantics, as Python::

    acc = a.float() @ b_kn.float()               # fp32 accumulation
    for step in spec.steps:                      # fp32 epilogue
        v = operand(step)                        # a weight step's operand: a.float() @ w.float().T
        acc = step.op.apply(acc, v, TORCH_MATH)
    return acc.to(spec.out_dtype)                # one rounding, one store

GELU's erf and tanh forms are different rows and are never exchanged.

    >>> import torch
    >>> spec = EpilogueSpec.parse("w=nk;bias@0;gelu_tanh;residual@1;out=bfloat16")
    >>> [s.op.name for s in spec.steps], spec.out_dtype
    (['bias', 'gelu_tanh', 'residual'], torch.bfloat16)
    >>> EpilogueSpec.parse(str(spec)) == spec
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Literal, Union

import torch
from torch.fx import Node

from branchyard.errors import LoweringError

__all__ = [
    "OperandKind",
    "TENSOR_OPERANDS",
    "EpilogueOp",
    "EpilogueStep",
    "EpilogueSpec",
    "EPILOGUE_OPS",
    "EPILOGUE_TABLE",
    "ACTIVATIONS",
    "TORCH_MATH",
    "SUPPORTED_DTYPES",
    "reference_epilogue",
    "reference_fused_gemm",
    "unfused_aten_epilogue",
    "CublasPrefix",
    "addmm_prefix",
    "cublaslt_prefix",
    "without_casts",
    "expand_weight_steps",
    "weight_products",
]

OperandKind = Literal["none", "scalar", "col", "matrix", "weight", "dtype"]

#: The operand kinds that take a tensor from the op's ``operands`` list (numbered in step order).
TENSOR_OPERANDS: tuple[str, ...] = ("col", "matrix", "weight")

aten = torch.ops.aten

#: Matmul / output dtypes a spec may name (by their ``torch`` attribute name).
SUPPORTED_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}


class _TorchMath:
    """The math namespace over torch tensors (used by the reference path; it
    also provides the extra functions of the kernel formulas, so those are
    checked against the table's formulas on CPU)."""

    exp = staticmethod(torch.exp)
    exp2 = staticmethod(torch.exp2)
    tanh = staticmethod(torch.tanh)
    erf = staticmethod(torch.erf)
    sigmoid = staticmethod(torch.sigmoid)
    rcp = staticmethod(torch.reciprocal)

    @staticmethod
    def norm_cdf(x: torch.Tensor) -> torch.Tensor:
        return 0.5 * (1.0 + torch.erf(x * 0.7071067811865476))

    @staticmethod
    def maximum(x: torch.Tensor, c: float) -> torch.Tensor:
        return torch.clamp_min(x, c)


#: The namespace ``m`` that formulas see on the reference path.
TORCH_MATH = _TorchMath()


# --- operand checks (guard clauses: return the operand, or why not) ---------


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, Node) else None


def _out_shape(x: Node) -> tuple[Any, ...]:
    return tuple(_val(x).shape)


def _other_operand(node: Node, x: Node) -> Any | str:
    """The operand of binary ``node`` that is not the running value ``x``."""
    if node.kwargs.get("alpha", 1) != 1:
        return f"{node.target} has alpha={node.kwargs['alpha']}"
    args = list(node.args[:2])
    if len(args) != 2:
        return f"{node.target} does not have two operands"
    if args[0] is x and args[1] is x:
        return "both operands are the matmul chain itself"
    if args[0] is x:
        return args[1]
    if args[1] is x:
        return args[0]
    return "the chain value is not an operand"


def known_eq(x: Any, y: Any) -> bool:
    """``x == y`` provably (sizes may be SymInts; never adds a guard)."""
    if isinstance(x, int) and isinstance(y, int):
        return x == y
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(x == y))


def same_shape(s1: Any, s2: Any) -> bool:
    """Shapes provably equal (symbolic sizes included; never adds a guard)."""
    s1, s2 = tuple(s1), tuple(s2)
    return len(s1) == len(s2) and all(known_eq(x, y) for x, y in zip(s1, s2))


def is_col_vector(t: Any, out: Any) -> bool:
    """``t`` broadcasts along the rows of an output of shape ``out`` only: shape
    ``[N]`` or ``[1, ..., 1, N]`` with no more dims than ``out`` (more would
    broadcast the output itself to a higher rank)."""
    shape, out = tuple(t.shape), tuple(out)
    return (1 <= len(shape) <= len(out) and known_eq(shape[-1], out[-1])
            and all(known_eq(d, 1) for d in shape[:-1]))


def _tensor_operand(node: Node, x: Node, want: Literal["col", "matrix"]) -> Node | str:
    other = _other_operand(node, x)
    if isinstance(other, str):
        return other
    if not isinstance(other, Node):
        return f"operand {other!r} is a Python scalar, not a tensor"
    t = _val(other)
    if not isinstance(t, torch.Tensor):
        return f"operand '{other.name}' has no tensor metadata"
    if not t.dtype.is_floating_point:
        return f"operand '{other.name}' has dtype {t.dtype}; epilogue operands must be floating point"
    out = _out_shape(x)
    n = out[-1]
    if want == "col":
        if t.dim() == 0:
            return f"operand '{other.name}' is a 0-d tensor; only per-column [N] vectors are fused"
        if not is_col_vector(t, out):
            return (f"operand '{other.name}' has shape {list(t.shape)}, not a per-column vector [{n}] "
                    f"for the output {list(out)}")
        return other
    if not same_shape(t.shape, out):
        return (
            f"operand '{other.name}' has shape {list(t.shape)}; a residual must have the output's "
            f"shape {list(out)} (no broadcasting)"
        )
    return other


def _match_col(node: Node, x: Node) -> Node | str:
    return _tensor_operand(node, x, "col")


def _match_matrix(node: Node, x: Node) -> Node | str:
    other = _other_operand(node, x)
    if isinstance(other, Node) and isinstance(_val(other), torch.Tensor):
        t = _val(other)
        if is_col_vector(t, _out_shape(x)) and not same_shape(t.shape, _out_shape(x)):
            return "per-column operand (matched as bias/scale_col instead)"
    return _tensor_operand(node, x, "matrix")


_DIV = (aten.div.Tensor, aten.div.Scalar)
_FLOAT32 = torch.finfo(torch.float32)


def _float32_normal(v: float) -> bool:
    return _FLOAT32.tiny <= abs(v) <= _FLOAT32.max


def _match_scalar(node: Node, x: Node) -> float | str:
    if node.target in _DIV:
        # x / c is the scale 1/c (within an ulp); c / x is not a scale at all.
        if node.args[0] is not x:
            return "the chain value is the divisor"
        if node.kwargs.get("rounding_mode") is not None:
            return f"division with rounding_mode={node.kwargs['rounding_mode']!r}"
        c = node.args[1]
        if isinstance(c, bool) or not isinstance(c, (int, float)):
            return f"divisor {getattr(c, 'name', c)!r} is not a Python scalar"
        if not (_float32_normal(float(c)) and _float32_normal(1.0 / float(c))):
            return (f"divisor {c!r} or its reciprocal is outside float32's normal range (the epilogue "
                    "multiplies by 1/c in float32, which would differ from dividing)")
        return 1.0 / float(c)
    other = _other_operand(node, x)
    if isinstance(other, str):
        return other
    if isinstance(other, bool) or not isinstance(other, (int, float)):
        return f"operand {getattr(other, 'name', other)!r} is not a Python scalar"
    if not math.isfinite(float(other)):
        return f"scale {other!r} is not finite"
    return float(other)


def _match_unary(node: Node, x: Node) -> None | str:
    if node.args[0] is not x:
        return "the chain value is not the first argument"
    return None


def _match_gelu(approximate: str) -> Callable[[Node, Node], None | str]:
    def match(node: Node, x: Node) -> None | str:
        if node.args[0] is not x:
            return "the chain value is not the first argument"
        got = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        if got != approximate:
            return f"gelu approximate={got!r}, not {approximate!r}"
        return None

    return match


_CAST_TARGETS = (
    aten._to_copy.default,
    aten.to.dtype,
    torch.ops.prims.convert_element_type.default,
)


def cast_dtype(node: Node) -> torch.dtype | None:
    """The dtype a cast node converts to, or None if ``node`` is not a pure cast."""
    if node.target is aten._to_copy.default:
        extra = set(node.kwargs) - {"dtype"}
        if len(node.args) != 1 or extra or "dtype" not in node.kwargs:
            return None
        return node.kwargs["dtype"]
    if node.target is aten.to.dtype:
        dtype = node.kwargs.get("dtype", node.args[1] if len(node.args) > 1 else None)
        if any(node.kwargs.get(k) for k in ("non_blocking", "copy")) or node.kwargs.get("memory_format"):
            return None
        return dtype
    if node.target is torch.ops.prims.convert_element_type.default:
        return node.args[1]
    return None


def _match_cast(node: Node, x: Node) -> torch.dtype | str:
    if node.args[0] is not x:
        return "the chain value is not the cast's input"
    dtype = cast_dtype(node)
    if dtype is None:
        return "the conversion changes more than the dtype (device, layout or memory format)"
    name = str(dtype).removeprefix("torch.")
    if name not in SUPPORTED_DTYPES:
        return f"cast to {dtype}: only float16, bfloat16 and float32 outputs are fused"
    return dtype


# --- the table ---------------------------------------------------------------


@dataclass(frozen=True)
class EpilogueOp:
    """One row of the epilogue table (see the module docstring)."""

    name: str
    targets: tuple[Any, ...]
    operand: OperandKind
    match: Callable[[Node, Node], Any]
    formula: Callable[..., Any]
    aten: Callable[..., torch.Tensor]
    doc: str = ""
    #: The same function in the form the GPU kernel emits, where that differs
    #: (no IEEE division, fewer instructions); ``None``: the kernel runs ``formula``.
    kernel_formula: Callable[..., Any] | None = None
    #: How cuBLAS's ``addmm(C, A, B, alpha=...)`` applies this step inside the
    #: GEMM: ``"alpha"`` (scales the product), ``"c"`` (added as ``C``), or ``None``.
    addmm: Literal["alpha", "c"] | None = None
    #: The activation cuBLASLt fuses after a bias (``torch._addmm_activation``):
    #: ``"relu"``, ``"gelu"`` (its tanh form), or ``None``.
    cublaslt: Literal["relu", "gelu"] | None = None
    #: A ``weight`` row's ``matrix`` row: the step applied to the product ``a @ w.T``.
    expands_to: str | None = None
    #: The ``weight`` row this step becomes when its operand is ``a @ w2.T`` (a GLU's ``up``).
    product: str | None = None

    def apply(self, x: Any, operand: Any, m: Any) -> Any:
        """Evaluate the formula; ``operand`` is ignored for ``none``/``dtype`` rows."""
        return self._eval(self.formula, x, operand, m)

    def apply_kernel(self, x: Any, operand: Any, m: Any) -> Any:
        """Evaluate the kernel's form of the formula (see ``kernel_formula``)."""
        return self._eval(self.kernel_formula or self.formula, x, operand, m)

    def _eval(self, fn: Callable[..., Any], x: Any, operand: Any, m: Any) -> Any:
        if self.operand in ("none", "dtype"):
            return fn(x, m)
        return fn(x, operand, m)


def _gelu_erf(x, m):
    return 0.5 * x * (1.0 + m.erf(x * 0.7071067811865476))


def _gelu_tanh(x, m):
    return 0.5 * x * (1.0 + m.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


def _silu(x, m):
    return x / (1.0 + m.exp(-x))


def _sigmoid(x, m):
    return 1.0 / (1.0 + m.exp(-x))


# The kernel's forms. An IEEE fp32 division is a ~10-instruction sequence with
# a slow path, so the kernel evaluates the dividing formulas through
# ``m.sigmoid`` / ``m.rcp`` (one approximate reciprocal) instead.

#: log2(e): exp(x) = 2^(x log2 e), one ex2 instruction.
_LOG2E = 1.4426950408889634
#: -2 sqrt(2/pi) log2(e) and -2 sqrt(2/pi) 0.044715 log2(e): sigmoid(2u) = 1 / (1 + 2^(x (K1 + K3 x^2))).
_GELU_TANH_K1 = -2.0 * 0.7978845608028654 * _LOG2E
_GELU_TANH_K3 = -2.0 * 0.7978845608028654 * 0.044715 * _LOG2E


def _silu_kernel(x, m):
    return x * m.sigmoid(x)


def _sigmoid_kernel(x, m):
    return m.sigmoid(x)


def _gelu_tanh_kernel(x, m):
    # 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3): one ex2 and
    # one reciprocal, log2(e) folded into the cubic.
    return x * m.rcp(1.0 + m.exp2(x * (_GELU_TANH_K1 + _GELU_TANH_K3 * (x * x))))


def _gelu_erf_kernel(x, m):
    # x * Phi(x), Phi from erfc directly: 0.5 x (1 + erf(x / sqrt 2)) without the
    # sign flip, the 1 + erf and the two halvings.
    return x * m.norm_cdf(x)


_ADD = (aten.add.Tensor,)
_MUL = (aten.mul.Tensor, aten.mul.Scalar)

EPILOGUE_TABLE: tuple[EpilogueOp, ...] = (
    EpilogueOp("bias", _ADD, "col", _match_col,
               lambda x, v, m: x + v, lambda x, v: x + v, "x + bias[N]", addmm="c"),
    EpilogueOp("scale", _MUL + _DIV, "scalar", _match_scalar,
               lambda x, c, m: x * c, lambda x, c: x * c, "x * c, or x / (1/c) (c a Python float)",
               addmm="alpha"),
    EpilogueOp("scale_col", _MUL, "col", _match_col,
               lambda x, v, m: x * v, lambda x, v: x * v, "x * scale[N]", product="mul_mm"),
    EpilogueOp("residual", _ADD, "matrix", _match_matrix,
               lambda x, r, m: x + r, lambda x, r: x + r, "x + residual[M, N]", addmm="c"),
    EpilogueOp("mul", _MUL, "matrix", _match_matrix,
               lambda x, y, m: x * y, lambda x, y: x * y, "x * y[M, N] (a gate, as in SwiGLU)",
               product="mul_mm"),
    EpilogueOp("mul_mm", (), "weight", lambda node, x: "matched from a 'mul' whose operand is a matmul",
               lambda x, y, m: x * y, lambda x, y: x * y, "x * (a @ w2.T), w2 [N, K] (gate and up of a GLU)",
               expands_to="mul"),
    EpilogueOp("relu", (aten.relu.default,), "none", _match_unary,
               lambda x, m: m.maximum(x, 0.0), torch.relu, "max(x, 0)", cublaslt="relu"),
    EpilogueOp("gelu_erf", (aten.gelu.default,), "none", _match_gelu("none"),
               _gelu_erf, lambda x: torch.nn.functional.gelu(x), "0.5x(1+erf(x/sqrt2))",
               kernel_formula=_gelu_erf_kernel),
    EpilogueOp("gelu_tanh", (aten.gelu.default,), "none", _match_gelu("tanh"),
               _gelu_tanh, lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
               "0.5x(1+tanh(sqrt(2/pi)(x+0.044715x^3)))", kernel_formula=_gelu_tanh_kernel, cublaslt="gelu"),
    EpilogueOp("silu", (aten.silu.default,), "none", _match_unary,
               _silu, torch.nn.functional.silu, "x*sigmoid(x)", kernel_formula=_silu_kernel),
    EpilogueOp("sigmoid", (aten.sigmoid.default,), "none", _match_unary,
               _sigmoid, torch.sigmoid, "1/(1+exp(-x))", kernel_formula=_sigmoid_kernel),
    EpilogueOp("tanh", (aten.tanh.default,), "none", _match_unary,
               lambda x, m: m.tanh(x), torch.tanh, "tanh(x)"),
    EpilogueOp("cast", _CAST_TARGETS, "dtype", _match_cast,
               lambda x, m: x, lambda x, dtype: x.to(dtype), "round to dtype"),
)

#: name -> row.
EPILOGUE_OPS: dict[str, EpilogueOp] = {op.name: op for op in EPILOGUE_TABLE}
#: The activation rows (operand kind ``none``).
ACTIVATIONS: tuple[str, ...] = tuple(op.name for op in EPILOGUE_TABLE if op.operand == "none")


# --- specs -------------------------------------------------------------------


@dataclass(frozen=True)
class EpilogueStep:
    """One step of a chain: a table row plus its operand.

    ``operand`` is an index into the fused op's ``operands`` list (``col`` and
    ``matrix`` rows), a float (``scalar``), a ``torch.dtype`` (``dtype``) or
    ``None`` (activations).
    """

    op: EpilogueOp
    operand: Union[int, float, torch.dtype, None] = None

    def __str__(self) -> str:
        kind = self.op.operand
        if kind in TENSOR_OPERANDS:
            return f"{self.op.name}@{self.operand}"
        if kind == "scalar":
            return f"{self.op.name}:{float(self.operand)!r}"  # repr round-trips exactly
        if kind == "dtype":
            return f"{self.op.name}:{str(self.operand).removeprefix('torch.')}"
        return self.op.name


def _dtype(name: str, where: str) -> torch.dtype:
    try:
        return SUPPORTED_DTYPES[name]
    except KeyError:
        raise LoweringError(
            f"unknown dtype {name!r}", where=where, hint=f"use one of {', '.join(SUPPORTED_DTYPES)}"
        ) from None


@dataclass(frozen=True)
class EpilogueSpec:
    """A fused chain: ``steps`` applied in order to the fp32 accumulator, the
    result rounded once to ``out_dtype``. ``weight_layout`` says how the op's
    ``b`` argument is laid out: ``"kn"`` (``mm``'s second operand, ``[K, N]``)
    or ``"nk"`` (an ``nn.Linear`` weight, ``[N, K]``).

    The string form (``str(spec)`` / :meth:`parse`) is what the custom op
    carries, e.g. ``"w=nk;bias@0;gelu_erf;out=bfloat16"``.

    ``impl`` names the candidate the op runs for this chain (``";impl=<name>"``
    at the end of the string), where the program race found that another of
    the tuner's candidates than its winner makes the program faster; ``None``
    (the default): the tuner's choice. It says how to run the chain, not what
    it computes, so a :class:`~.problem.Problem` leaves it out.
    """

    steps: tuple[EpilogueStep, ...]
    out_dtype: torch.dtype
    weight_layout: Literal["kn", "nk"] = "kn"
    impl: str | None = None

    def __str__(self) -> str:
        parts = [f"w={self.weight_layout}", *map(str, self.steps)]
        parts.append(f"out={str(self.out_dtype).removeprefix('torch.')}")
        if self.impl is not None:
            parts.append(f"impl={self.impl}")
        return ";".join(parts)

    @property
    def num_operands(self) -> int:
        """How many tensors the op's ``operands`` list carries."""
        return sum(1 for s in self.steps if s.op.operand in TENSOR_OPERANDS)

    @property
    def weight_operands(self) -> tuple[int, ...]:
        """The ``operands`` indices that are second ``[N, K]`` weights (``weight`` steps), in step order."""
        return tuple(s.operand for s in self.steps if s.op.operand == "weight")  # type: ignore[misc]

    @property
    def names(self) -> tuple[str, ...]:
        """The step names in order, e.g. ``("bias", "gelu_erf")``."""
        return tuple(s.op.name for s in self.steps)

    @staticmethod
    def parse(text: str) -> "EpilogueSpec":
        """Inverse of ``str(spec)``; raises :class:`LoweringError` naming the bad part."""
        where = f"epilogue spec {text!r}"
        layout = "kn"
        out: torch.dtype | None = None
        impl: str | None = None
        steps: list[EpilogueStep] = []
        for part in filter(None, text.split(";")):
            if impl is not None:
                raise LoweringError(f"'impl={impl}' must come last, not before {part!r}", where=where)
            if part.startswith("impl="):
                impl = part[5:].strip()
                if not impl or impl != part[5:]:
                    raise LoweringError(f"{part!r} names no implementation", where=where,
                                        hint="impl=<a candidate name>, e.g. impl=cublas:addmm+aten")
                continue
            if part.startswith("w="):
                layout = part[2:]
                if layout not in ("kn", "nk"):
                    raise LoweringError(f"weight layout {layout!r} is not 'kn' or 'nk'", where=where)
                continue
            if part.startswith("out="):
                out = _dtype(part[4:], where)
                continue
            name, sep, arg = part.partition("@") if "@" in part else part.partition(":")
            op = EPILOGUE_OPS.get(name)
            if op is None:
                raise LoweringError(
                    f"unknown epilogue step {name!r}", where=where,
                    hint=f"known steps: {', '.join(EPILOGUE_OPS)}",
                )
            try:
                operand: Any = {
                    "none": lambda: None,
                    "col": lambda: int(arg),
                    "matrix": lambda: int(arg),
                    "weight": lambda: int(arg),
                    "scalar": lambda: float(arg),
                    "dtype": lambda: _dtype(arg, where),
                }[op.operand]()
            except ValueError:
                raise LoweringError(f"step {part!r} has a malformed operand", where=where) from None
            if op.operand != "none" and not sep:
                raise LoweringError(f"step {name!r} needs an operand", where=where)
            steps.append(EpilogueStep(op, operand))
        if out is None:
            raise LoweringError("missing 'out=<dtype>'", where=where)
        spec = EpilogueSpec(tuple(steps), out, layout, impl)  # type: ignore[arg-type]
        indices = [s.operand for s in spec.steps if s.op.operand in TENSOR_OPERANDS]
        if indices != list(range(len(indices))):
            raise LoweringError(
                f"tensor operands must be numbered 0, 1, ... in step order, got {indices}", where=where
            )
        return spec


# --- reference semantics -----------------------------------------------------


def _as_kn(b: torch.Tensor, layout: str) -> torch.Tensor:
    return b.t() if layout == "nk" else b


def _prepare_operand(step: EpilogueStep, t: torch.Tensor, m_rows: int, n: int) -> torch.Tensor:
    if step.op.operand == "col":
        return t.reshape(n)
    return t.reshape(m_rows, n)


def _need_input(a: torch.Tensor | None, step: EpilogueStep) -> torch.Tensor:
    if a is None:
        raise LoweringError(f"step {step} multiplies by a second weight and needs the matmul's input",
                            where="epilogue", hint="pass a=")
    return a


def reference_epilogue(
    acc: torch.Tensor, spec: EpilogueSpec, operands: list[torch.Tensor], m: Any = TORCH_MATH,
    a: torch.Tensor | None = None,
) -> torch.Tensor:
    """Apply ``spec``'s steps to the fp32 ``[M, N]`` accumulator, in fp32 (no final cast).
    ``a`` (``[M, K]``) is the matmul's input, which ``weight`` steps multiply their weight by."""
    rows, n = acc.shape
    x = acc
    for step in spec.steps:
        v: Any = step.operand
        kind = step.op.operand
        if kind == "weight":
            v = _need_input(a, step).float() @ operands[step.operand].float().t()  # type: ignore[index]
        elif kind in TENSOR_OPERANDS:
            v = _prepare_operand(step, operands[step.operand], rows, n).float()  # type: ignore[index]
        x = step.op.apply(x, v, m)
    return x


def reference_fused_gemm(
    a: torch.Tensor, b: torch.Tensor, operands: list[torch.Tensor], spec: EpilogueSpec
) -> torch.Tensor:
    """The semantics of the fused op: fp32 matmul + fp32 epilogue + one cast.

    ``a`` is ``[..., K]``; the result is ``[..., N]`` in ``spec.out_dtype``.
    """
    b_kn = _as_kn(b, spec.weight_layout)
    lead = a.shape[:-1]
    a2d = a.reshape(-1, a.shape[-1])
    acc = a2d.float() @ b_kn.float()
    out = reference_epilogue(acc, spec, operands, a=a2d)
    return out.to(spec.out_dtype).reshape(*lead, b_kn.shape[1])


def unfused_aten_epilogue(
    y: torch.Tensor, spec: EpilogueSpec, operands: list[torch.Tensor], a: torch.Tensor | None = None
) -> torch.Tensor:
    """The chain as separate eager ops on the matmul output ``y`` ``[M, N]``,
    in the tensors' own dtypes (one HBM round trip per op, like the original
    graph). A ``weight`` step multiplies its weight by ``a`` (``[M, K]``) with
    ``torch.mm`` first, as the original program's second matmul did."""
    rows, n = y.shape
    for step in spec.steps:
        kind = step.op.operand
        if kind == "weight":
            y = step.op.aten(y, torch.mm(_need_input(a, step), operands[step.operand].t()))  # type: ignore[index]
        elif kind in TENSOR_OPERANDS:
            y = step.op.aten(y, _prepare_operand(step, operands[step.operand], rows, n))  # type: ignore[index]
        elif kind in ("scalar", "dtype"):
            y = step.op.aten(y, step.operand)
        else:
            y = step.op.aten(y)
    return y.to(spec.out_dtype)


def expand_weight_steps(spec: EpilogueSpec) -> EpilogueSpec:
    """``spec`` with each ``weight`` step replaced by its ``expands_to`` row, whose
    operand (same index) is the product ``a @ w.T`` (see :func:`weight_products`).

        >>> str(expand_weight_steps(EpilogueSpec.parse("w=nk;silu;mul_mm@0;out=bfloat16")))
        'w=nk;silu;mul@0;out=bfloat16'
    """
    if not spec.weight_operands:
        return spec
    steps = tuple(EpilogueStep(EPILOGUE_OPS[s.op.expands_to], s.operand) if s.op.operand == "weight" else s  # type: ignore[index]
                  for s in spec.steps)
    return EpilogueSpec(steps, spec.out_dtype, spec.weight_layout)


def weight_products(a: torch.Tensor, spec: EpilogueSpec, operands: Any) -> list[torch.Tensor]:
    """``operands`` with each ``weight`` step's ``[N, K]`` weight replaced by
    ``torch.mm(a, w.T)`` (``[M, N]``, in the inputs' dtype): the operands of
    :func:`expand_weight_steps` ``(spec)``."""
    out = list(operands)
    for i in spec.weight_operands:
        out[i] = torch.mm(a, out[i].t())
    return out


# --- what cuBLAS(Lt) applies inside its GEMM (read from the table's columns) -


@dataclass(frozen=True)
class CublasPrefix:
    """The leading steps of a chain that one cuBLAS(Lt) call applies.

    ``length`` steps are covered; ``c`` is the operand index of the bias /
    residual passed as ``C``; ``alpha`` scales the product (``addmm``);
    ``use_gelu`` picks ``_addmm_activation``'s GELU over its ReLU (cuBLASLt).
    """

    length: int
    c: int
    alpha: float = 1.0
    use_gelu: bool = False


def addmm_prefix(steps: tuple[EpilogueStep, ...]) -> CublasPrefix | None:
    """``[alpha row] + c row``: what ``torch.addmm(C, A, B, alpha=...)`` applies.

        >>> addmm_prefix(EpilogueSpec.parse("w=kn;scale:0.5;residual@0;relu;out=float16").steps)
        CublasPrefix(length=2, c=0, alpha=0.5, use_gelu=False)
    """
    i, alpha = 0, 1.0
    if steps and steps[0].op.addmm == "alpha":
        i, alpha = 1, float(steps[0].operand)  # type: ignore[arg-type]
    if i < len(steps) and steps[i].op.addmm == "c":
        return CublasPrefix(i + 1, int(steps[i].operand), alpha)  # type: ignore[arg-type]
    return None


def cublaslt_prefix(steps: tuple[EpilogueStep, ...]) -> CublasPrefix | None:
    """``per-column c row + cublaslt row``: what ``torch._addmm_activation`` applies.

        >>> cublaslt_prefix(EpilogueSpec.parse("w=kn;bias@0;gelu_tanh;out=float16").steps)
        CublasPrefix(length=2, c=0, alpha=1.0, use_gelu=True)
        >>> cublaslt_prefix(EpilogueSpec.parse("w=kn;bias@0;gelu_erf;out=float16").steps) is None
        True
    """
    if len(steps) < 2 or steps[0].op.addmm != "c" or steps[0].op.operand != "col" or steps[1].op.cublaslt is None:
        return None
    return CublasPrefix(2, int(steps[0].operand), use_gelu=steps[1].op.cublaslt == "gelu")  # type: ignore[arg-type]


def without_casts(steps: tuple[EpilogueStep, ...]) -> tuple[EpilogueStep, ...]:
    """The steps that change a value in fp32 (a cast inside the chain does not:
    the fused op rounds once, at the store)."""
    return tuple(s for s in steps if s.op.operand != "dtype")
