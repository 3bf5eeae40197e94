"""Runtime checks in traced graphs whose inputs share unbacked symbols.

torch assumes each input placeholder owns the unbacked symbols in its sizes.
With one symbol per :class:`~branchyard.shapes.ShapeVar`, several inputs share
one, and some sizes are expressions (``2*u0``, ``u0*u1``). Three pieces put
the checks back where a graph needs them:

* :func:`bind_placeholder_symbols` -- each symbol is read (``unbacked_bindings``)
  at the first placeholder where it is a whole dim or a whole int argument;
* :func:`insert_dim_checks` -- every other dim built from vars is asserted
  against them, ``_assert_scalar(sym_size(y, 0) == 2 * sym_size(x, 0), ...)``;
* :func:`insert_runtime_asserts` -- the two above plus torch's deferred
  runtime asserts (ranges, divisors) for a ``make_fx`` graph.

``torch.export`` needs no binding of ours: there every dim but a var's anchor
slot has a symbol of its own (:mod:`branchyard.shapes.symbolic`), so each input
owns its sizes' symbols, as torch's own binding step expects;
:func:`drop_tied_symbol_checks` removes torch's copies of the named ties.

Under ``torch.compile`` the symbols are Dynamo's, one per occurrence and tied
by ``Eq`` asserts; :func:`drop_implied_range_checks` removes the range checks
those ties make redundant, leaving one set per var.

Before (make_fx of ``x + y`` with ``x: (batch, 4)``, ``y: (batch, 4)``)::

    x_1: f32[u0, 4], y_1: f32[u0, 4]  ->  add(x_1, y_1)

After::

    s = sym_size(x_1, 0); _assert_scalar(s >= 2); _assert_scalar(s <= 128)
    _assert_scalar(sym_size(y_1, 0) == s, "branchyard.shapes: input y_1 dim 0 must equal batch")
    add(x_1, y_1)
"""

from __future__ import annotations

import operator
from typing import Any

import sympy
import torch

from branchyard.errors import ShapeSpecError
from branchyard.fx.mutation import has_effects

__all__ = [
    "bind_placeholder_symbols",
    "insert_dim_checks",
    "insert_runtime_asserts",
    "drop_implied_range_checks",
    "drop_tied_symbol_checks",
]


def bind_placeholder_symbols(gm: torch.fx.GraphModule) -> None:
    """Tag placeholders with the ``unbacked_bindings`` of the symbols they introduce.

    torch's runtime-assert pass reads a symbol's value from the node whose
    ``unbacked_bindings`` name it. torch assumes each input placeholder owns
    its symbols; ours are shared, so each symbol is bound at the first
    placeholder where it appears bare (a dim ``u0``, or an int argument) --
    ``w: (u0*u1, u1)`` binds only ``u1`` and relies on ``x: (u0, 4)`` for ``u0``.
    """
    import sympy
    from torch.fx.experimental.symbolic_shapes import CallMethodKey, free_unbacked_symbols
    from torch.utils._pytree import SequenceKey

    bound: set[Any] = set()
    needed: dict[Any, str] = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        candidates: list[tuple[Any, tuple]] = []
        if isinstance(val, torch.SymInt):
            candidates.append((val.node.expr, ()))
        elif isinstance(val, torch.Tensor):
            candidates += [
                (d.node.expr, (CallMethodKey("size"), SequenceKey(i)))
                for i, d in enumerate(val.shape)
                if isinstance(d, torch.SymInt)
            ]
        bindings = {}
        for expr, path in candidates:
            for sym in free_unbacked_symbols(expr):
                needed.setdefault(sym, node.name)
            if isinstance(expr, sympy.Symbol) and free_unbacked_symbols(expr) and expr not in bound:
                bindings[expr] = path
                bound.add(expr)
        if bindings:
            node.meta["unbacked_bindings"] = bindings
    loose = {s: n for s, n in needed.items() if s not in bound}
    if loose:
        sym, name = next(iter(loose.items()))
        raise ShapeSpecError(
            f"input {name!r} has a size built from {sym}, which no input carries bare",
            hint="every ShapeVar needs one slot where it is the whole dim",
        )


def insert_dim_checks(gm: torch.fx.GraphModule, var_of_symbol: dict[Any, str],
                      derived: dict[Any, Any] | None = None) -> int:
    """Assert, in the graph, every declared dim that does not bind its own symbol.

    A var is bound where it first appears bare; every other dim built from
    vars (``y: (2*batch, 4)``, a second ``(batch, 4)``) gets one check::

        s = sym_size(y, 0); _assert_scalar(s == 2 * sym_size(x, 0), "y dim 0 must equal 2*batch")

    Without it the graph would trust its inputs: the fakes' sizes *are* the
    expressions, so tracing itself never records the relation. A dim whose
    symbol is a key of ``derived`` (an exported dim with a symbol of its own)
    is checked against its expression there, in the vars' terms. Returns the
    number of checks added.
    """
    import operator

    import sympy

    graph = gm.graph
    placeholders = list(graph.find_nodes(op="placeholder"))
    first_op = next((n for n in graph.nodes if n.op != "placeholder"), None)
    if first_op is None:
        return 0
    ours = set(var_of_symbol)
    derived = derived or {}
    binding: dict[Any, tuple[torch.fx.Node, int | None, Any]] = {}
    others: list[tuple[torch.fx.Node, int | None, Any, Any]] = []  # (placeholder, dim, size, expected)
    for ph in placeholders:
        val = ph.meta.get("val")
        dims = list(enumerate(val.shape)) if isinstance(val, torch.Tensor) else []
        if isinstance(val, torch.SymInt) and val.node.expr.free_symbols & ours:
            if val.node.expr in ours and val.node.expr not in binding:
                binding[val.node.expr] = (ph, None, val)
            else:
                others.append((ph, None, val, val.node.expr))
        for i, d in dims:
            raw = getattr(d.node, "_expr", None) if isinstance(d, torch.SymInt) else None
            if raw in derived:  # its own symbol, maybe replaced by its expression since
                others.append((ph, i, d, derived[raw]))
                continue
            if not isinstance(d, torch.SymInt) or not (d.node.expr.free_symbols & ours):
                continue
            if isinstance(d.node.expr, sympy.Symbol) and d.node.expr not in binding:
                binding[d.node.expr] = (ph, i, d)
            else:
                others.append((ph, i, d, d.node.expr))
    if not others:
        return 0

    def size_node(ph: torch.fx.Node, i: int | None, val: Any) -> torch.fx.Node:
        if i is None:
            return ph
        node = graph.call_function(torch.ops.aten.sym_size.int, (ph, i))
        node.meta["val"] = val
        return node

    def emit(fn: Any, a: torch.fx.Node | int, b: torch.fx.Node | int) -> torch.fx.Node:
        node = graph.call_function(fn, (a, b))
        va = a.meta["val"] if isinstance(a, torch.fx.Node) else a
        vb = b.meta["val"] if isinstance(b, torch.fx.Node) else b
        node.meta["val"] = fn(va, vb)
        return node

    def build(expr: Any, syms: dict[Any, torch.fx.Node]) -> torch.fx.Node | int:
        if isinstance(expr, sympy.Integer):
            return int(expr)
        if isinstance(expr, sympy.Symbol):
            return syms[expr]
        if isinstance(expr, sympy.Pow) and isinstance(expr.exp, sympy.Integer) and expr.exp > 0:
            op, args = operator.mul, [build(expr.base, syms)] * int(expr.exp)  # b**2 is b * b
        else:
            op = {sympy.Add: operator.add, sympy.Mul: operator.mul}.get(type(expr))
            if op is None:
                raise ShapeSpecError(f"cannot check dim {expr} in the graph (only +, - and * of vars)")
            args = [build(a, syms) for a in expr.args]
        out = args[0]
        for a in args[1:]:
            out = emit(op, out, a) if isinstance(out, torch.fx.Node) or isinstance(a, torch.fx.Node) else out + a  # type: ignore[operator]
        return out

    with graph.inserting_before(first_op):
        syms = {sym: size_node(*where) for sym, where in binding.items()}
        for ph, i, d, expr in others:
            actual = size_node(ph, i, d)
            expected = build(expr, syms)
            readable = expr.xreplace({s: sympy.Symbol(var_of_symbol[s]) for s in expr.free_symbols if s in var_of_symbol})
            eq = emit(operator.eq, actual, expected)
            graph.call_function(
                torch.ops.aten._assert_scalar.default,
                (eq, f"branchyard.shapes: input {ph.target}{'' if i is None else f' dim {i}'} must equal {readable}"),
            )
    gm.recompile()
    return len(others)


def insert_runtime_asserts(gm: torch.fx.GraphModule, shape_env: Any, var_of_symbol: dict[Any, str]) -> None:
    """Put each var's range/divisor checks, and the dim checks, into a make_fx graph."""
    from torch.fx.passes.runtime_assert import insert_deferred_runtime_asserts

    bind_placeholder_symbols(gm)
    insert_deferred_runtime_asserts(gm, shape_env, "branchyard.shapes")
    insert_dim_checks(gm, var_of_symbol)
    gm.recompile()


# -- torch.compile: one set of range checks per var ----------------------------------------

# FX comparison targets -> the sympy relation they compute, to read an assert's condition
_RELATIONS = {operator.ge: sympy.Ge, operator.gt: sympy.Gt, operator.le: sympy.Le, operator.lt: sympy.Lt, operator.eq: sympy.Eq}


def _raw_expr(arg: Any) -> Any:
    """The sympy expression an FX argument stands for, *before* ShapeEnv replacements
    (``u1``, not the ``u0`` it was tied to), or None if it is not a size."""
    import sympy

    if isinstance(arg, int) and not isinstance(arg, bool):
        return sympy.Integer(arg)
    if not isinstance(arg, torch.fx.Node):
        return None
    val = arg.meta.get("example_value", arg.meta.get("val"))
    if not isinstance(val, torch.SymInt):
        return None
    node = val.node
    return getattr(node, "_expr", node.expr)


def _condition(assert_node: torch.fx.Node) -> Any:
    """The relation an ``_assert_scalar`` checks, over raw symbols; None if unreadable."""
    cond = assert_node.args[0] if assert_node.args else None
    if not isinstance(cond, torch.fx.Node) or cond.op != "call_function":
        return None
    rel = _RELATIONS.get(cond.target)
    if rel is None or len(cond.args) != 2:
        return None
    lhs, rhs = (_raw_expr(a) for a in cond.args)
    if lhs is None or rhs is None:
        return None
    return rel(lhs, rhs, evaluate=False)


def _as_bound(relation: Any) -> tuple[Any, str, Any] | None:
    """``u1 >= 2`` -> (u1, "lower", 2); ``u1 < 9`` -> (u1, "upper", 8); else None."""
    import sympy

    lhs, rhs = relation.lhs, relation.rhs
    flipped = {sympy.Ge: sympy.Le, sympy.Gt: sympy.Lt, sympy.Le: sympy.Ge, sympy.Lt: sympy.Gt}
    kind = type(relation)
    if isinstance(rhs, sympy.Symbol) and isinstance(lhs, sympy.Integer):
        lhs, rhs, kind = rhs, lhs, flipped.get(kind)
    if not (isinstance(lhs, sympy.Symbol) and isinstance(rhs, sympy.Integer)):
        return None
    c = int(rhs)
    table = {sympy.Ge: ("lower", c), sympy.Gt: ("lower", c + 1), sympy.Le: ("upper", c), sympy.Lt: ("upper", c - 1)}
    if kind not in table:
        return None
    side, value = table[kind]
    return lhs, side, value


def _symbol_order(sym: Any) -> tuple[int, str]:
    # u12 -> 12: Dynamo numbers unbacked symbols in allocation order, and the
    # first occurrence of a var is allocated first; later ones are the copies
    digits = str(sym).lstrip("abcdefghijklmnopqrstuvwxyz_")
    return (int(digits) if digits.isdigit() else -1, str(sym))


def drop_implied_range_checks(gm: torch.fx.GraphModule) -> int:
    """Remove range asserts that the graph's own equality asserts already imply.

    torch.compile (Dynamo) gives every occurrence of a var its own unbacked
    symbol and ties the copies to the first with an ``Eq`` runtime assert
    (``Eq(u1, u0)``, ``Eq(u2, 2*u0)``); the ShapeEnv then replaces the copies
    by the first, so the compiler reasons with one symbol -- but the graph
    still checks each copy's range. Those checks are implied: ``u1 == u0``
    and ``2 <= u0 <= 128`` give ``2 <= u1 <= 128``. Before::

        u0 >= 2; u0 <= 128; u1 >= 2; u1 <= 128; Eq(u1, u0); u2 >= 2; u2 <= 128; Eq(u2, u0)

    After (one set of range checks, one equality per extra input)::

        u0 >= 2; u0 <= 128; Eq(u1, u0); Eq(u2, u0)

    A bound is dropped only when an equality solved for its symbol gives an
    expression whose range, from bounds still asserted in the graph, lies
    inside it; each drop leans only on checks that stay, so nothing the graph
    checked before goes unchecked. Returns the number of asserts removed.
    """
    import sympy
    from torch.utils._sympy.value_ranges import ValueRanges, bound_sympy

    asserts = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten._assert_scalar.default]
    bounds: dict[Any, list[tuple[str, int, torch.fx.Node]]] = {}
    equalities: list[Any] = []
    for node in asserts:
        rel = _condition(node)
        if rel is None:
            continue
        if isinstance(rel, sympy.Eq):
            equalities.append(rel)
            continue
        bound = _as_bound(rel)
        if bound is not None:
            sym, side, value = bound
            bounds.setdefault(sym, []).append((side, value, node))

    def asserted_range(sym: Any) -> ValueRanges:
        lo = max((v for side, v, _ in bounds.get(sym, []) if side == "lower"), default=-sympy.oo)
        hi = min((v for side, v, _ in bounds.get(sym, []) if side == "upper"), default=sympy.oo)
        return ValueRanges(lo, hi)

    removed: list[torch.fx.Node] = []
    for sym in sorted(bounds, key=_symbol_order, reverse=True):
        for eq in equalities:
            if sym not in eq.free_symbols:
                continue
            try:
                solutions = sympy.solve(eq.lhs - eq.rhs, sym)
            except Exception:  # sympy cannot solve it (NotImplementedError, PolynomialError, ...): keep the checks
                continue
            if len(solutions) != 1 or sym in solutions[0].free_symbols:
                continue
            expr = solutions[0]
            implied = bound_sympy(expr, {t: asserted_range(t) for t in expr.free_symbols})
            keep = []
            for side, value, node in bounds[sym]:
                if (side == "lower" and implied.lower >= value) or (side == "upper" and implied.upper <= value):
                    removed.append(node)
                else:
                    keep.append((side, value, node))
            bounds[sym] = keep
            if not keep:
                break
    for node in removed:
        _erase_with_inputs(gm.graph, node)
    if removed:
        gm.recompile()
    return len(removed)


def drop_tied_symbol_checks(gm: torch.fx.GraphModule, derived: dict[Any, Any]) -> int:
    """In an exported graph, remove torch's checks on the symbols that
    :func:`insert_dim_checks` ties by name (``derived``: own symbol -> expression).

    Each such symbol's ``Eq`` assert repeats the named check, and its range was
    derived by torch from that equality and the vars' ranges, which stay
    checked. Before (``y: (batch, 4)`` after ``x: (batch, 4)``)::

        "y dim 0 must equal batch": sym_size(y, 0) == sym_size(x, 0)
        u0 >= 2; u0 <= 128; u1 >= 2; u1 <= 128; Eq(u1, u0)

    After::

        "y dim 0 must equal batch": sym_size(y, 0) == sym_size(x, 0)
        u0 >= 2; u0 <= 128

    torch states them again when it traces the program anew
    (``run_decompositions``). Returns the number of asserts removed.
    """
    import sympy

    removed = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten._assert_scalar.default:
            continue
        message = node.args[1] if len(node.args) > 1 else None
        if isinstance(message, str) and message.startswith("branchyard.shapes:"):
            continue  # a named check: the one that stays
        rel = _condition(node)
        own = rel.free_symbols & derived.keys() if rel is not None else set()
        if len(own) != 1:
            continue
        (sym,) = own
        if isinstance(rel, sympy.Eq):  # torch's copy of the tie, either way round
            tie = sym - derived[sym]
            if sympy.expand(rel.lhs - rel.rhs - tie) == 0 or sympy.expand(rel.lhs - rel.rhs + tie) == 0:
                removed.append(node)
        elif _as_bound(rel) is not None:  # a range check of a tied symbol
            removed.append(node)
    for node in removed:
        _erase_with_inputs(gm.graph, node)
    if removed:
        gm.recompile()
    return len(removed)


def _erase_with_inputs(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """Erase ``node``, then any pure computation that only it used (its condition, sizes);
    "pure" as every dead-code pass of branchyard asks it (:func:`branchyard.fx.mutation.has_effects`)."""
    inputs = [a for a in node.all_input_nodes if a.op == "call_function"]
    graph.erase_node(node)
    for a in inputs:
        if not a.users and a.target is not torch.ops.aten._assert_scalar.default and not has_effects(a):
            _erase_with_inputs(graph, a)
