"""``ShapeVar``: a named dynamic size, and ``DimExpr``: integer expressions of them.

A :class:`ShapeVar` is one dynamic size (``batch``, ``seq``) with an inclusive
range and an optional divisor. Arithmetic on ShapeVars builds a
:class:`DimExpr` (a sympy expression over the vars' symbols), so a spec can say
that a dim is ``2 * batch``, ``seq - 1`` or ``batch * heads``::

    >>> batch = ShapeVar("batch", min=2, max=128)
    >>> heads = ShapeVar("heads", min=1, max=16)
    >>> (2 * batch, batch * heads, batch - 1)
    (2*batch, batch*heads, batch - 1)
    >>> (batch * heads).evaluate({"batch": 4, "heads": 3})
    12
    >>> ShapeVar("seq", min=1, max=8192, multiple_of=8)   # min rounds up to a multiple
    ShapeVar('seq', min=8, max=8192, multiple_of=8)

Semantics, as Python: a concrete size ``n`` satisfies ``ShapeVar(name, min,
max, multiple_of)`` iff ``min <= n <= max and n % multiple_of == 0``; a dim
declared as ``expr`` is satisfied iff ``n == expr.evaluate(values)`` where
``values`` maps every var to the size it was bound to elsewhere in the spec.

The same ``evaluate`` walks the sympy tree with ints *or* ``torch.SymInt`` s,
which is how an expression becomes a symbolic size at trace time.
"""

from __future__ import annotations

from typing import Any, Mapping, Union

import sympy

from branchyard.errors import ShapeSpecError

__all__ = ["ShapeVar", "DimExpr", "DimLike", "as_dim_expr"]

#: What a spec may put where a size goes: a fixed int, a var, or an expression.
DimLike = Union[int, "DimExpr"]


class DimExpr:
    """An integer expression over :class:`ShapeVar` s (``2 * batch``, ``seq - 1``).

    Built by arithmetic on ShapeVars, never directly. ``expr`` is the sympy
    expression; ``vars`` maps each symbol name to its :class:`ShapeVar`.
    """

    __slots__ = ("expr", "vars", "_terms")

    def __init__(self, expr: sympy.Expr, vars: Mapping[str, "ShapeVar"]):
        self.expr = sympy.expand(expr)
        # sorted: free_symbols is a set, and printing/JSON must not depend on hash order
        self.vars: dict[str, ShapeVar] = {n: vars[n] for n in sorted(s.name for s in self.expr.free_symbols)}
        self._terms: tuple[tuple[int, tuple[str, ...]], ...] | None = None

    # -- arithmetic builds new expressions ----------------------------------------
    def _combine(self, other: Any, op: str, reflected: bool = False) -> "DimExpr":
        other_expr = as_dim_expr(other, where=f"{self} {op} {other!r}")
        a, b = (other_expr, self) if reflected else (self, other_expr)
        merged = _merge_vars(a.vars, b.vars)
        expr = {"+": a.expr + b.expr, "-": a.expr - b.expr, "*": a.expr * b.expr}[op]
        return DimExpr(expr, merged)

    def __add__(self, other: Any) -> "DimExpr":
        return self._combine(other, "+")

    def __radd__(self, other: Any) -> "DimExpr":
        return self._combine(other, "+", reflected=True)

    def __sub__(self, other: Any) -> "DimExpr":
        return self._combine(other, "-")

    def __rsub__(self, other: Any) -> "DimExpr":
        return self._combine(other, "-", reflected=True)

    def __mul__(self, other: Any) -> "DimExpr":
        return self._combine(other, "*")

    def __rmul__(self, other: Any) -> "DimExpr":
        return self._combine(other, "*", reflected=True)

    # -- inspection ----------------------------------------------------------------
    @property
    def is_var(self) -> bool:
        """True for a bare :class:`ShapeVar` (not a derived expression)."""
        return False

    def evaluate(self, values: Mapping[str, Any]) -> Any:
        """The expression's value with each var replaced by ``values[name]``.

        ``values`` may hold ints (validation) or ``torch.SymInt`` s (tracing:
        the result is then a SymInt built from the same + and *).
        """
        missing = sorted(n for n in self.vars if n not in values)
        if missing:
            raise ShapeSpecError(
                f"cannot evaluate {self}: no size bound for {missing}",
                hint="every ShapeVar used in a derived dim needs a value",
            )
        return evaluate_terms(self.terms(), values)

    def terms(self) -> tuple[tuple[int, tuple[str, ...]], ...]:
        """The expression as ``(coefficient, var names)`` terms, a name repeated
        per power (``2*b*b - 1`` -> ``((2, ('b', 'b')), (-1, ()))``): plain data
        that code Dynamo traces can evaluate (:func:`evaluate_terms`)."""
        if self._terms is None:
            symbols = [v.symbol for v in self.vars.values()]
            try:
                poly = sympy.Poly(self.expr, *symbols) if symbols else None
            except sympy.PolynomialError as err:
                raise ShapeSpecError(
                    f"unsupported dim expression {self.expr} (only +, - and * of ShapeVars and ints)"
                ) from err
            if poly is None:
                self._terms = ((int(self.expr), ()),)
            else:
                names = list(self.vars)
                self._terms = tuple(
                    (int(coef), tuple(n for n, p in zip(names, powers) for _ in range(p)))
                    for powers, coef in poly.terms()
                )
        return self._terms

    def linear_root(self) -> tuple["ShapeVar", int, int] | None:
        """``(var, a, b)`` when the expression is ``a * var + b`` with ``a > 0``, else None."""
        if len(self.vars) != 1:
            return None
        (var,) = self.vars.values()
        poly = sympy.Poly(self.expr, var.symbol)
        if poly.degree() != 1:
            return None
        a, b = (int(c) for c in poly.all_coeffs())
        return (var, a, b) if a > 0 else None

    def bounds(self) -> tuple[int | None, int | None]:
        """Inclusive (lo, hi) the expression can take over its vars' ranges (None = unbounded).

        Exact for expressions increasing in every var (all we build: sums and
        products of vars with positive coefficients, minus constants).
        """
        lo_env = {n: v.min for n, v in self.vars.items()}
        lo = self.evaluate(lo_env)
        if any(v.max is None for v in self.vars.values()):
            return lo, None
        return lo, self.evaluate({n: v.max for n, v in self.vars.items()})

    def __str__(self) -> str:
        return str(self.expr)

    def __repr__(self) -> str:
        return str(self.expr)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DimExpr):
            return sympy.simplify(self.expr - other.expr) == 0 and self.vars == other.vars
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.expr)


class ShapeVar(DimExpr):
    """A named dynamic size with an inclusive range and an optional divisor.

    ``min``/``max`` bound the size (``max=None``: unbounded; ``min=None`` is
    ``min=0``, sizes being never negative); ``multiple_of`` (``None`` is 1)
    says every size is divisible by it, a fact the compiler gets (e.g. for
    tensor-core alignment). ``min`` is rounded up to the first multiple. Two
    ShapeVars with the same name are the same var only if they agree on the
    range; a spec that mixes them is rejected.
    """

    __slots__ = ("name", "min", "max", "multiple_of", "symbol")

    def __init__(self, name: str, *, min: int | None = 0, max: int | None = None, multiple_of: int | None = 1):
        # None means "no bound" for max, and the default for min (0) and multiple_of (1)
        min = 0 if min is None else min
        multiple_of = 1 if multiple_of is None else multiple_of
        if not isinstance(name, str) or not name.isidentifier():
            raise ShapeSpecError(f"ShapeVar name must be a Python identifier, got {name!r}")
        for label, value in (("min", min), ("max", max), ("multiple_of", multiple_of)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ShapeSpecError(f"{label} must be an int, got {value!r}", where=f"ShapeVar {name!r}")
        if min < 0:
            raise ShapeSpecError(f"min={min} < 0; a size is never negative", where=f"ShapeVar {name!r}")
        if multiple_of < 1:
            raise ShapeSpecError(f"multiple_of={multiple_of} must be >= 1", where=f"ShapeVar {name!r}")
        min = -(-min // multiple_of) * multiple_of  # first multiple at or above min
        if max is not None and max < min:
            raise ShapeSpecError(
                f"empty range: min={min} > max={max}"
                + (f" (after rounding min up to a multiple of {multiple_of})" if multiple_of > 1 else ""),
                where=f"ShapeVar {name!r}",
            )
        self.name = name
        self.min = min
        self.max = max
        self.multiple_of = multiple_of
        self.symbol = sympy.Symbol(name, integer=True, nonnegative=True)
        super().__init__(self.symbol, {name: self})

    @property
    def is_var(self) -> bool:
        return True

    def contains(self, size: int) -> bool:
        """Whether a concrete size satisfies this var's range and divisor."""
        return (
            self.min <= size
            and (self.max is None or size <= self.max)
            and size % self.multiple_of == 0
        )

    def describe_range(self) -> str:
        """The constraint in words, e.g. ``2 <= batch <= 128, multiple of 8``."""
        hi = "inf" if self.max is None else str(self.max)
        text = f"{self.min} <= {self.name} <= {hi}"
        if self.multiple_of > 1:
            text += f", multiple of {self.multiple_of}"
        return text

    def same_as(self, other: "ShapeVar") -> bool:
        """Same name, range and divisor."""
        return (self.name, self.min, self.max, self.multiple_of) == (
            other.name,
            other.min,
            other.max,
            other.multiple_of,
        )

    def __repr__(self) -> str:
        parts = [repr(self.name), f"min={self.min}"]
        if self.max is not None:
            parts.append(f"max={self.max}")
        if self.multiple_of > 1:
            parts.append(f"multiple_of={self.multiple_of}")
        return f"ShapeVar({', '.join(parts)})"

    def __str__(self) -> str:
        return self.name

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ShapeVar):
            return self.same_as(other)
        if isinstance(other, DimExpr):
            return False
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.name, self.min, self.max, self.multiple_of))


def as_dim_expr(value: Any, *, where: str) -> DimExpr:
    """Lift an int or DimExpr to a DimExpr; anything else is a ShapeSpecError."""
    if isinstance(value, DimExpr):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return DimExpr(sympy.Integer(value), {})
    raise ShapeSpecError(
        f"expected an int, a ShapeVar or an expression of ShapeVars, got {type(value).__name__}: {value!r}",
        where=where,
    )


def _merge_vars(a: Mapping[str, ShapeVar], b: Mapping[str, ShapeVar]) -> dict[str, ShapeVar]:
    merged = dict(a)
    for name, var in b.items():
        if name in merged and not merged[name].same_as(var):
            raise ShapeSpecError(
                f"two different ShapeVars are named {name!r}: {merged[name]!r} and {var!r}",
                hint="give them distinct names, or reuse one ShapeVar object",
            )
        merged[name] = var
    return merged


def evaluate_terms(terms: tuple[tuple[int, tuple[str, ...]], ...], env: Mapping[str, Any]) -> Any:
    """The value of :meth:`DimExpr.terms` with each var replaced by ``env[name]``,
    by plain ``+`` and ``*`` (not ``subs``: the values may be SymInts), in loops
    (Dynamo traces it, and cannot trace a generator fed to a builtin). A bare
    var's value is returned as it is, not rebuilt."""
    total: Any = None
    for coef, names in terms:
        term: Any = None
        for name in names:
            term = env[name] if term is None else term * env[name]
        if term is None or coef != 1:
            term = coef if term is None else coef * term
        total = term if total is None else total + term
    return 0 if total is None else total


