"""The branchyard error hierarchy.

Every error a user can provoke with bad input is a :class:`BranchyardError`.
Messages name *what* was wrong and *where* (node, argument, dim, file) and,
where there is one, what to do about it::

    >>> from branchyard.errors import MalformedGraphError
    >>> str(MalformedGraphError("branch outputs differ in dtype", where="node 'cond_1'"))
    "node 'cond_1': branch outputs differ in dtype"
"""

from __future__ import annotations

from typing import TypeVar

__all__ = [
    "BranchyardError",
    "MalformedGraphError",
    "UnsupportedGraphError",
    "ShapeSpecError",
    "SpecViolationError",
    "DataDependentShapeError",
    "LoweringError",
    "SerializationError",
    "EquivalenceError",
    "InternalError",
    "checked",
]

T = TypeVar("T")


class BranchyardError(Exception):
    """Base class of every error branchyard raises on purpose.

    ``where`` names the place (a node, an argument, a file); ``hint`` says
    what to do. Both are kept as attributes for tools that want them.
    """

    def __init__(self, message: str, *, where: str | None = None, hint: str | None = None):
        self.message = message
        self.where = where
        self.hint = hint
        text = f"{where}: {message}" if where else message
        if hint:
            text = f"{text} ({hint})"
        super().__init__(text)


class MalformedGraphError(BranchyardError, ValueError):
    """The input graph is not well formed (fails lint, branches disagree, ...)."""


class UnsupportedGraphError(BranchyardError, NotImplementedError):
    """The graph is well formed but uses something this pass cannot handle."""


class ShapeSpecError(BranchyardError, ValueError):
    """A ShapeVar / dynamic_spec declaration is itself invalid."""


class SpecViolationError(BranchyardError, ValueError):
    """A concrete input does not satisfy the declared dynamic-shape spec."""


class DataDependentShapeError(BranchyardError, RuntimeError):
    """Python control flow branched on a declared dynamic dim."""


class LoweringError(BranchyardError, RuntimeError):
    """A program cannot be lowered (CUDA graphs, NVGEMM) as asked."""


class SerializationError(BranchyardError, RuntimeError):
    """A program could not be saved or loaded."""


class EquivalenceError(BranchyardError, AssertionError):
    """Two programs disagree on some control-flow path (raised by branchyard.testing)."""


class InternalError(BranchyardError, RuntimeError):
    """branchyard broke one of its own invariants: a bug to report, not bad input."""


def checked(value: T | None, what: str, *, where: str) -> T:
    """``value``, which an earlier step of branchyard guarantees is set; an
    :class:`InternalError` naming ``what`` and ``where`` where it is not (an
    ``assert`` would say neither, and vanishes under ``python -O``).

        >>> checked(3, "the plan", where="cond_to_switch")
        3
        >>> checked(None, "the plan", where="cond_to_switch")
        Traceback (most recent call last):
        ...
        branchyard.errors.InternalError: cond_to_switch: the plan is not set (a branchyard bug: please report it with the program)
    """
    if value is None:
        raise InternalError(f"{what} is not set (a branchyard bug: please report it with the program)",
                            where=where)
    return value
