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
  runtime asserts (ranges, divisors) for a ``make_fx`` graph;
  :func:`shared_symbol_bindings` lets ``torch.export`` use the first one.

Before (make_fx of ``x + y`` with ``x: (batch, 4)``, ``y: (batch, 4)``)::

    x_1: f32[u0, 4], y_1: f32[u0, 4]  ->  add(x_1, y_1)

After::

    s = sym_size(x_1, 0); _assert_scalar(s >= 2); _assert_scalar(s <= 128)
    _assert_scalar(sym_size(y_1, 0) == s, "branchyard.shapes: input y_1 dim 0 must equal batch")
    add(x_1, y_1)
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from branchyard.errors import ShapeSpecError

__all__ = ["bind_placeholder_symbols", "insert_dim_checks", "insert_runtime_asserts", "shared_symbol_bindings"]


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


@contextlib.contextmanager
def shared_symbol_bindings() -> Iterator[None]:
    """Let torch.export bind our shared symbols (it assumes one owner per placeholder)."""
    import torch.export._trace as trace_module

    name = "_add_input_unbacked_bindings"
    original = getattr(trace_module, name, None)
    if original is None:  # older torch binds inputs differently
        yield
        return
    setattr(trace_module, name, bind_placeholder_symbols)
    try:
        yield
    finally:
        setattr(trace_module, name, original)


def insert_dim_checks(gm: torch.fx.GraphModule, var_of_symbol: dict[Any, str]) -> int:
    """Assert, in the graph, every declared dim that does not bind its own symbol.

    A var is bound where it first appears bare; every other dim built from
    vars (``y: (2*batch, 4)``, a second ``(batch, 4)``) gets one check::

        s = sym_size(y, 0); _assert_scalar(s == 2 * sym_size(x, 0), "y dim 0 must equal 2*batch")

    Without it the graph would trust its inputs: the fakes' sizes *are* the
    expressions, so tracing itself never records the relation. Returns the
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
    binding: dict[Any, tuple[torch.fx.Node, int | None, Any]] = {}
    others: list[tuple[torch.fx.Node, int | None, Any]] = []
    for ph in placeholders:
        val = ph.meta.get("val")
        dims = list(enumerate(val.shape)) if isinstance(val, torch.Tensor) else []
        if isinstance(val, torch.SymInt) and val.node.expr.free_symbols & ours:
            if val.node.expr in ours and val.node.expr not in binding:
                binding[val.node.expr] = (ph, None, val)
            else:
                others.append((ph, None, val))
        for i, d in dims:
            if not isinstance(d, torch.SymInt) or not (d.node.expr.free_symbols & ours):
                continue
            if isinstance(d.node.expr, sympy.Symbol) and d.node.expr not in binding:
                binding[d.node.expr] = (ph, i, d)
            else:
                others.append((ph, i, d))
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
        op = {sympy.Add: operator.add, sympy.Mul: operator.mul}.get(type(expr))
        if op is None:
            raise ShapeSpecError(f"cannot check dim {expr} in the graph (only + and * of vars)")
        args = [build(a, syms) for a in expr.args]
        out = args[0]
        for a in args[1:]:
            out = emit(op, out, a) if isinstance(out, torch.fx.Node) or isinstance(a, torch.fx.Node) else out + a  # type: ignore[operator]
        return out

    with graph.inserting_before(first_op):
        syms = {sym: size_node(*where) for sym, where in binding.items()}
        for ph, i, d in others:
            expr = d.node.expr
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
