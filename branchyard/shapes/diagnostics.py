"""Explain a data-dependent guard on a declared dim in the user's terms.

A declared dim is an unbacked symbolic size: while tracing, its value is
unknown, so Python control flow on it (``if x.shape[0] > 64:``) cannot be
decided and torch raises ``GuardOnDataDependentSymNode`` about ``u0 > 64``.
That is the design -- a branch on a dynamic size must be in the graph or ruled
out by the range. :func:`explain` turns torch's error into a
:class:`~branchyard.errors.DataDependentShapeError` that names the ShapeVar,
the condition in ShapeVar names, the user's source line, and the two ways out:
``torch.cond`` or a range narrow enough to decide the condition (computed, when
the condition involves one var).
"""

from __future__ import annotations

import os
import re
import sysconfig
import traceback
from typing import Iterator, Mapping

import sympy
import torch

import branchyard
from branchyard.errors import DataDependentShapeError
from branchyard.shapes.shape_var import ShapeVar

__all__ = ["find_data_dependent_error", "explain"]

_SKIP_DIRS = tuple(
    os.path.dirname(p) + os.sep
    for p in (torch.__file__, branchyard.__file__)
) + (sysconfig.get_paths()["stdlib"] + os.sep,)
# range sizes above this are not scanned for a suggested narrower range
_MAX_SCAN = 200_000


def _causes(err: BaseException) -> Iterator[BaseException]:
    """``err``, then each exception of its cause/context chain, once."""
    seen: set[int] = set()
    cur: BaseException | None = err
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def find_data_dependent_error(err: BaseException) -> BaseException | None:
    """The ``GuardOnDataDependentSymNode`` in ``err``'s cause/context chain, if any."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return next((e for e in _causes(err) if isinstance(e, GuardOnDataDependentSymNode)), None)


def _user_frame(err: BaseException) -> traceback.FrameSummary | None:
    frames = traceback.extract_tb(err.__traceback__)
    user = [f for f in frames if not f.filename.startswith(_SKIP_DIRS) and not f.filename.startswith("<frozen")]
    return user[-1] if user else None


_HOP_FILE = re.compile(r"_higher_order_ops[/\\](\w+)\.py$")
#: torch's control-flow ops by the file that traces them.
_CONTROL_FLOW_OPS = {"cond": "torch.cond", "while_loop": "torch.while_loop", "map": "torch.map",
                     "scan": "scan", "associative_scan": "associative_scan"}
_FAKEIFY_FILE = re.compile(r"_subclasses[/\\]meta_utils\.py$")


def _tracing_control_flow_op(err: BaseException) -> str | None:
    """The torch control-flow op (``torch.cond``, ``torch.while_loop``, ...) whose tracing raised
    ``err`` while making a fake tensor of one of its operands (torch asking for the value of the
    operand's size), not while running the user's code inside a branch or body."""
    for cur in _causes(err):
        op = None
        for frame in traceback.extract_tb(cur.__traceback__):
            m = _HOP_FILE.search(frame.filename)
            if m and m.group(1) in _CONTROL_FLOW_OPS:
                op = _CONTROL_FLOW_OPS[m.group(1)]
            elif op is not None and _FAKEIFY_FILE.search(frame.filename):
                return op
    return None


def _suggest_range(cond: sympy.Basic, var: ShapeVar) -> str | None:
    """A narrower range on which ``cond`` (over ``var`` only) has one answer."""
    if cond.free_symbols != {var.symbol}:
        return None
    if var.max is None or (var.max - var.min) // var.multiple_of > _MAX_SCAN:
        return None
    sizes = range(var.min, var.max + 1, var.multiple_of)
    truth = [bool(cond.subs(var.symbol, n)) for n in sizes]
    if all(truth) or not any(truth):
        return None
    # the longest run of one answer is the most useful narrower range
    best = (0, 0, 0)
    start = 0
    for i in range(1, len(truth) + 1):
        if i == len(truth) or truth[i] != truth[start]:
            if i - start > best[1] - best[0]:
                best = (start, i, truth[start])
            start = i
    lo, hi = sizes[best[0]], sizes[best[1] - 1]
    extra = f", multiple_of={var.multiple_of}" if var.multiple_of > 1 else ""
    return f"ShapeVar({var.name!r}, min={lo}, max={hi}{extra}) makes it always {best[2]}"


def _python(expr: sympy.Basic) -> str:
    """The condition as the Python a user wrote (``seq % 8 != 0``), not sympy's ``Ne(Mod(seq, 8), 0)``."""
    from torch.utils._sympy.printers import PythonPrinter

    try:
        return PythonPrinter().doprint(expr)
    except Exception:  # a printer gap must not hide the real error
        return str(expr)


def _mod_divisors(expr: sympy.Basic) -> list[int]:
    """Constant divisors ``k`` of ``Mod(_, k)`` in a condition: a divisibility question."""
    out = []
    for atom in expr.atoms(sympy.Function, sympy.Mod):
        if type(atom).__name__ in ("Mod", "PythonMod") and len(atom.args) == 2 and atom.args[1].is_Integer:
            out.append(int(atom.args[1]))
    return sorted(set(out))


def explain(
    err: BaseException,
    dde: BaseException,
    var_of_symbol: Mapping[sympy.Symbol, str],
    vars: Mapping[str, ShapeVar],
    derived: Mapping[sympy.Symbol, sympy.Expr] | None = None,
) -> DataDependentShapeError:
    """A DataDependentShapeError for ``dde`` (found in ``err``) in ShapeVar terms.
    ``derived``: symbols that stand for an expression of the vars' symbols."""
    cond = getattr(dde, "cond", None)
    names = {}
    if isinstance(cond, sympy.Basic):
        cond = cond.xreplace(dict(derived or {}))
        for sym in cond.free_symbols:
            name = var_of_symbol.get(sym)
            if name is not None:
                names[sym] = vars[name].symbol
        readable = cond.xreplace(names)
    else:
        readable = None
    involved = sorted({vars[var_of_symbol[s]].name for s in names})
    frame = _user_frame(err) or _user_frame(dde)
    where = f"{frame.filename}:{frame.lineno}" if frame else None
    op = _tracing_control_flow_op(err)  # err's chain holds dde
    if op is not None and involved and isinstance(readable, sympy.Symbol):
        message, hints = _unbacked_operand(op, readable, involved)
    else:
        message, hints = _user_control_flow(cond, readable, bool(names), involved, vars)
    if frame is not None and frame.line:
        message += f", at `{frame.line.strip()}`"
    out = DataDependentShapeError(message, where=where, hint="; ".join(hints))
    out.condition = readable  # type: ignore[attr-defined]
    out.shape_vars = involved  # type: ignore[attr-defined]
    return out


def _user_control_flow(
    cond: object, readable: sympy.Basic | None, named: bool, involved: list[str], vars: Mapping[str, ShapeVar]
) -> tuple[str, list[str]]:
    """Message and hints for Python control flow on a declared dim (or another unbacked value)."""
    subject = (
        "ShapeVar " + ", ".join(repr(n) for n in involved) if involved else "a data-dependent value (not a declared ShapeVar)"
    )
    message = f"Python control flow depends on {subject}"
    if readable is not None:
        message += f": the condition `{_python(readable)}` cannot be decided while tracing"
        if named:
            message += f" ({cond} in torch's symbols)"
    hints = ["a declared dim is an unbacked symbolic size, unknown while tracing; "
             "use torch.cond(pred, true_fn, false_fn, operands) to keep both branches in the graph"]
    divisors = _mod_divisors(readable) if readable is not None else []
    if len(involved) == 1 and divisors:
        var = vars[involved[0]]
        hints.append(f"or, if every {var.name} is a multiple of {divisors[0]}, declare it: "
                     f"ShapeVar({var.name!r}, min={var.min}, max={var.max}, multiple_of={divisors[0]})")
    elif len(involved) == 1 and readable is not None:
        suggestion = _suggest_range(readable, vars[involved[0]])
        hints.append(
            f"or narrow the range so the condition has one answer: {suggestion}"
            if suggestion
            else f"or narrow {involved[0]!r}'s range so the condition has one answer on all of it"
        )
    return message, hints


def _unbacked_operand(op: str, readable: sympy.Symbol, involved: list[str]) -> tuple[str, list[str]]:
    """Message and hints when torch asked for the value of a declared dim (no comparison: a bare
    size) while faking an operand of its own control-flow op: torch before 2.14 cannot trace an
    operand of unbacked size."""
    names = ", ".join(repr(n) for n in involved)
    message = (f"torch {torch.__version__.split('+')[0]}'s {op} cannot trace an operand whose size is "
               f"ShapeVar {names}: it asked for the size's value (`{readable}`), which an unbacked "
               "symbolic size does not have while tracing")
    return message, [f"torch >= 2.14 traces {op} over unbacked sizes; on this torch compile without the "
                     "ShapeVar (a static size: one program per size)"]
