"""Turn a validated :class:`Binding` into fake inputs with unbacked symbolic sizes.

This is the part torch's native spec wiring cannot do for us (torch 2.14.1
allocates one unbacked symbol per *occurrence* of a var and ties them with
``Eq`` runtime asserts). Here each :class:`ShapeVar` becomes exactly one
unbacked symbol, created once in a fresh ``ShapeEnv``:

    u = shape_env.create_unbacked_symint()
    torch._check(u >= var.min); torch._check(u <= var.max)       # the declared range
    torch._check(u % var.multiple_of == 0)                       # a fact: Mod(u, m) joins ShapeEnv.divisible

and every declared dim is built from those symbols (``2 * batch`` becomes the
SymInt ``2*u0``). Fake tensors with those sizes, in a ``FakeTensorMode`` over
that ``ShapeEnv``, are what ``make_fx`` and non-strict ``torch.export`` trace.
For ``torch.export``, every tensor dim but the slot that binds a var (a second
``batch``, ``2 * batch``, ``seq - 1``) gets a symbol of its own, tied by
``torch._check(u2 == u1 - 1)``, so that each input owns the symbols of its
sizes: torch binds an input's symbols only from a size that is a symbol or an
int times one (the latter by a division it never checks), and when it traces
the program again (``run_decompositions``, AOTInductor) it refuses any other
size and drops every check it can prove from the sizes alone -- with one
symbol for two inputs, that the two agree, so a compiled program would read
the second input with the first one's size.
Range and divisibility checks are recorded once per var, so the traced graph
carries one set of runtime asserts per var however many inputs share it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch

from branchyard.errors import ShapeSpecError
from branchyard.shapes.shape_var import DimExpr
from branchyard.shapes.spec import ScalarEntry, ShapesSpec
from branchyard.shapes.validation import Binding, Leaf

__all__ = ["SymbolicInputs", "make_symbolic_inputs"]


@dataclass
class SymbolicInputs:
    """Fake arguments for one trace, and how their symbols map back to the spec."""

    fake_mode: Any
    shape_env: Any
    args: tuple
    kwargs: dict
    #: var name -> the SymInt standing for it
    symbols: dict[str, torch.SymInt] = field(default_factory=dict)
    #: export only: the symbol of each dim that got one of its own -> its expression over the vars' symbols
    derived: dict[sympy.Symbol, sympy.Expr] = field(default_factory=dict)
    #: export only: ``(leaf, dim, declared dim)`` of each tensor dim that got a symbol of its own
    own_dims: list[tuple[Leaf, int, DimExpr]] = field(default_factory=list)

    def var_of_symbol(self) -> dict[sympy.Symbol, str]:
        """Unbacked sympy symbol (``u0``) -> ShapeVar name, for error messages."""
        return {s.node.expr: name for name, s in self.symbols.items()}


def _contiguous_strides(sizes: list[Any]) -> list[Any]:
    strides: list[Any] = [1] * len(sizes)
    for i in range(len(sizes) - 2, -1, -1):
        strides[i] = strides[i + 1] * sizes[i + 1]
    return strides


def make_symbolic_inputs(spec: ShapesSpec, binding: Binding, *, export: bool) -> SymbolicInputs:
    """Fake inputs for ``binding`` with one unbacked symbol per ShapeVar.

    ``export=True`` builds the ShapeEnv the way non-strict ``torch.export``
    expects (tracked fakes, traced asserts) and leaves int arguments as they
    are: torch.export accepts no SymInt inputs, so
    :func:`branchyard.shapes.entry_points.export` makes them unbacked through
    torch's own spec and ties them to the vars while tracing. A var that only
    an int argument binds then has no symbol here, and no tensor dim may use it.
    Every other declared tensor dim than a var's anchor slot gets a fresh
    symbol, tied to its expression (``derived``, ``own_dims``).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    shape_env = ShapeEnv(tracked_fakes=[] if export else None, trace_asserts=export)
    fake_mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=True, export=export)

    symbols: dict[str, torch.SymInt] = {}
    derived: dict[sympy.Symbol, sympy.Expr] = {}
    own_dims: list[tuple[Leaf, int, DimExpr]] = []
    # Vars in binding order: the first slot that binds a var names its symbol u0, u1, ...
    with shape_env.ignore_fresh_unbacked_symbols():
        for name, anchor in binding.anchor.items():
            if export and isinstance(anchor.entry, ScalarEntry):
                continue
            symbols[name] = shape_env.create_unbacked_symint()
    for name, sym in symbols.items():
        var = spec.vars[name]
        torch._check(sym >= var.min)
        if var.max is not None:
            torch._check(sym <= var.max)
        if var.multiple_of > 1:
            torch._check(sym % var.multiple_of == 0)

    # the slots whose sizes *are* the vars' symbols
    anchors = {(id(binding.anchor[n]), i) for n, i in binding.anchor_dim.items() if i is not None}

    def size_of(dim: Any, actual: int, where: str, slot: tuple[Leaf, int] | None = None) -> Any:
        if dim is None:
            return actual
        if isinstance(dim, DimExpr):
            unanchored = sorted(set(dim.vars) - set(symbols))
            if unanchored:
                raise ShapeSpecError(
                    f"{where} is {dim}, but {unanchored[0]!r} is bound only by an int argument, "
                    "which torch.export cannot make a tensor size depend on",
                    hint=f"let a tensor dim carry {unanchored[0]!r} bare, or use branchyard.shapes.make_fx / compile",
                )
            value = dim.evaluate(symbols)
            if export and slot is not None and (id(slot[0]), slot[1]) not in anchors:
                with shape_env.ignore_fresh_unbacked_symbols():
                    own = shape_env.create_unbacked_symint()
                torch._check(own == value)  # its range and the relation, for reasoning while tracing
                derived[own.node.expr] = value.node.expr
                own_dims.append((slot[0], slot[1], dim))
                return own
            return value
        return dim

    replaced: dict[int, Any] = {}
    with fake_mode:
        for leaf in binding.leaves:
            if export and isinstance(leaf.entry, ScalarEntry):
                continue
            replaced[id(leaf)] = _fake_leaf(leaf, size_of)

    arguments = binding.arguments
    new_arguments = {}
    for name, value in arguments.arguments.items():
        new_arguments[name] = _substitute(value, name, binding.leaves, replaced)
    arguments.arguments.update(new_arguments)
    return SymbolicInputs(fake_mode, shape_env, tuple(arguments.args), dict(arguments.kwargs), symbols, derived, own_dims)


def _fake_leaf(leaf: Leaf, size_of: Any) -> Any:
    if isinstance(leaf.entry, ScalarEntry):
        return size_of(leaf.entry.dim, leaf.value, leaf.path)
    # _iter_leaves yields only scalar and tensor leaves
    t: torch.Tensor = leaf.value
    sizes = [size_of(d, int(n), f"{leaf.path} dim {i}", (leaf, i)) for i, (d, n) in enumerate(zip(leaf.entry.dims, t.shape))]
    fake = torch.empty_strided(sizes, _contiguous_strides(sizes), dtype=t.dtype, device=t.device)
    if t.requires_grad:
        fake.requires_grad_(True)
    return fake


def _substitute(value: Any, path: str, leaves: list[Leaf], replaced: dict[int, Any]) -> Any:
    """Rebuild ``value`` with every covered leaf under ``path`` replaced by its fake."""
    for leaf in leaves:
        if leaf.path == path:
            return replaced.get(id(leaf), value)
    if not any(leaf.path.startswith(path + "[") for leaf in leaves):
        return value
    if isinstance(value, (list, tuple)):
        items = [_substitute(v, f"{path}[{i}]", leaves, replaced) for i, v in enumerate(value)]
        return type(value)(items) if not hasattr(value, "_fields") else type(value)(*items)
    if isinstance(value, dict):
        return {k: _substitute(v, f"{path}[{k!r}]", leaves, replaced) for k, v in value.items()}
    return value


@contextlib.contextmanager
def tracing_with(inputs: SymbolicInputs):
    """A ``TracingContext`` whose fake mode is ours, so torch.export keeps our fakes."""
    from torch._guards import TracingContext, tracing

    with tracing(TracingContext(inputs.fake_mode)):
        yield
