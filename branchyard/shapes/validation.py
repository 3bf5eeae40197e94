"""Bind a :class:`ShapesSpec` to a call's concrete arguments, checking every size.

``bind(spec, fn, args, kwargs)`` is the one place where concrete inputs meet
the spec. It runs before any tracing or compiled call, so a bad input fails
here with a :class:`~branchyard.errors.SpecViolationError` that names the
argument, the dim, the ShapeVar, its range and the value -- instead of a guard
failure or a runtime assert deep inside torch.

Semantics, as Python (first bare occurrence binds a var; everything else checks)::

    values = {}
    for slot, dim in spec slots, in call order:
        size = actual size at slot
        if dim is int:            require size == dim
        elif dim is a ShapeVar:   require dim.contains(size); values.setdefault(dim.name, size) == size
    for slot, expr in derived slots:
        require size == expr.evaluate(values)

    >>> import torch
    >>> from branchyard.shapes import ShapeVar, ShapesSpec
    >>> batch = ShapeVar("batch", min=2, max=128)
    >>> spec = ShapesSpec({"x": (batch, 8), "y": (2 * batch, 8)})
    >>> def f(x, y): return x
    >>> spec.validate(f, torch.ones(4, 8), torch.ones(8, 8))
    {'batch': 4}
    >>> spec.validate(f, torch.ones(200, 8), torch.ones(400, 8))
    Traceback (most recent call last):
    ...
    branchyard.errors.SpecViolationError: argument 'x': x dim 0 has size 200, outside ShapeVar 'batch' (2 <= batch <= 128) (pass a size in range, or widen the ShapeVar)
"""

from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from branchyard.errors import ShapeSpecError, SpecViolationError
from branchyard.shapes.shape_var import DimExpr, ShapeVar
from branchyard.shapes.spec import Entry, MapEntry, ScalarEntry, SeqEntry, ShapesSpec, TensorEntry

__all__ = ["Binding", "Leaf", "bind", "signature_of", "check_spec_matches_signature", "is_tracing"]


@dataclass
class Leaf:
    """One tensor or int argument (or container element) that the spec covers."""

    path: str  # "x", "cache['k']", "args[0]"
    entry: TensorEntry | ScalarEntry
    value: Any
    keys: tuple = ()  # (param name, key or index, ...): how to reach the value from the bound arguments

    def get(self, arguments: dict[str, Any]) -> Any:
        """This leaf's value in another binding of the same call (e.g. the traced one)."""
        value: Any = arguments
        for k in self.keys:
            value = value[k]
        return value


@dataclass
class Binding:
    """The result of :func:`bind`: bound arguments, covered leaves, and each var's size."""

    arguments: inspect.BoundArguments
    leaves: list[Leaf]
    values: dict[str, int] = field(default_factory=dict)
    #: for each var, the slot that bound it (for messages)
    bound_at: dict[str, str] = field(default_factory=dict)
    #: for each var, the leaf that bound it (a tensor leaf whenever the var appears bare in one)
    anchor: dict[str, Leaf] = field(default_factory=dict)
    #: for each var, the dim of its anchor that is the var (None: the anchor is an int argument)
    anchor_dim: dict[str, int | None] = field(default_factory=dict)


def is_tracing(args: tuple, kwargs: dict | None = None) -> bool:
    """Whether a call is being traced (Dynamo, export, make_fx, fx): the traced
    program checks the spec itself, and symbolic sizes cannot be read as ints."""
    if torch.compiler.is_compiling() or torch.fx._symbolic_trace.is_fx_symbolic_tracing():
        return True
    from torch._subclasses.fake_tensor import FakeTensor

    # a plain walk, not pytree: this runs on every call of a decorated callable
    stack: list[Any] = [args, kwargs] if kwargs else [args]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            if isinstance(value, FakeTensor) or any(isinstance(d, torch.SymInt) for d in value.shape):
                return True
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (torch.SymInt, torch.fx.Proxy)):
            return True
    return False


def signature_of(fn: Any) -> inspect.Signature:
    """The signature a spec's keys refer to: ``forward``'s for a module (without ``self``)."""
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    try:
        return inspect.signature(target)
    except (TypeError, ValueError) as e:
        raise ShapeSpecError(f"cannot read the signature of {target!r}: {e}") from e


def check_spec_matches_signature(spec: ShapesSpec, sig: inspect.Signature, where: str) -> None:
    """Every spec key must name a parameter (typos fail at decoration, not at trace)."""
    names = [p for p in sig.parameters if p != "self"]
    for key in spec.params:
        if key not in sig.parameters:
            close = difflib.get_close_matches(key, names, n=1)
            raise ShapeSpecError(
                f"spec names argument {key!r}, but the parameters are {names}",
                where=where,
                hint=f"did you mean {close[0]!r}?" if close else "spec keys are parameter names",
            )


def _iter_leaves(entry: Entry, value: Any, path: str, keys: tuple) -> Iterator[Leaf]:
    if value is None:
        return  # an optional argument left out: nothing to check or trace
    if isinstance(entry, TensorEntry):
        if not isinstance(value, torch.Tensor):
            raise SpecViolationError(
                f"spec declares a tensor of shape {entry}, got {type(value).__name__}", where=f"argument {path!r}"
            )
        if value.dim() != len(entry.dims):
            raise SpecViolationError(
                f"spec declares {len(entry.dims)} dims {entry}, got a tensor with {value.dim()} dims "
                f"{tuple(value.shape)}",
                where=f"argument {path!r}",
            )
        yield Leaf(path, entry, value, keys)
    elif isinstance(entry, ScalarEntry):
        if type(value) is not int:
            raise SpecViolationError(
                f"spec declares an int size ({entry.dim}), got {type(value).__name__}", where=f"argument {path!r}"
            )
        yield Leaf(path, entry, value, keys)
    elif isinstance(entry, SeqEntry):
        if not isinstance(value, (list, tuple)):
            raise SpecViolationError(f"spec declares a sequence, got {type(value).__name__}", where=f"argument {path!r}")
        if len(entry.items) > len(value):
            raise SpecViolationError(
                f"spec has {len(entry.items)} entries, the sequence has {len(value)}", where=f"argument {path!r}"
            )
        for i, (e, v) in enumerate(zip(entry.items, value)):
            if e is not None:
                yield from _iter_leaves(e, v, f"{path}[{i}]", keys + (i,))
    elif isinstance(entry, MapEntry):
        if not isinstance(value, dict):
            raise SpecViolationError(f"spec declares a dict, got {type(value).__name__}", where=f"argument {path!r}")
        for k, e in entry.items:
            if k not in value:
                raise SpecViolationError(f"spec names key {k!r}, the dict has {sorted(value, key=repr)}", where=f"argument {path!r}")
            if e is not None:
                yield from _iter_leaves(e, value[k], f"{path}[{k!r}]", keys + (k,))


def _slots(leaf: Leaf) -> Iterator[tuple[str, Any, int]]:
    """(slot name, declared dim, actual size) for each dim of a leaf."""
    if isinstance(leaf.entry, ScalarEntry):
        yield leaf.path, leaf.entry.dim, leaf.value
    else:
        for i, d in enumerate(leaf.entry.dims):
            yield f"{leaf.path} dim {i}", d, int(leaf.value.shape[i])


def bind(
    spec: ShapesSpec, fn: Any, args: tuple, kwargs: dict | None = None, sig: inspect.Signature | None = None
) -> Binding:
    """Bind ``(args, kwargs)`` to ``fn``'s signature and check them against ``spec``.

    ``sig``: ``fn``'s signature, already checked against the spec (a caller
    binding every call, like a compiled function, reads it once).
    """
    if sig is None:
        sig = signature_of(fn)
        check_spec_matches_signature(spec, sig, where=getattr(fn, "__qualname__", type(fn).__name__))
    try:
        arguments = sig.bind(*args, **(kwargs or {}))
    except TypeError as e:
        raise SpecViolationError(f"arguments do not match the signature {sig}: {e}") from e
    # Check defaults too, but keep ``arguments`` as passed: a traced program
    # takes the inputs the caller gave, not every defaulted parameter.
    given = arguments.arguments
    if all(name in given for name in spec.params):
        values = given
    else:
        with_defaults = inspect.BoundArguments(sig, dict(given))
        with_defaults.apply_defaults()
        values = with_defaults.arguments
    leaves = [
        leaf
        for name, entry in spec.params.items()
        for leaf in _iter_leaves(entry, values[name], name, (name,))
    ]
    binding = Binding(arguments, leaves)
    derived: list[tuple[str, DimExpr, int, str]] = []
    # tensor leaves first: a var appearing bare in a tensor is anchored there,
    # so traced sizes never depend on a scalar argument
    ordered = [leaf for leaf in leaves if isinstance(leaf.entry, TensorEntry)]
    ordered += [leaf for leaf in leaves if isinstance(leaf.entry, ScalarEntry)]
    for leaf in ordered:
        tensor = isinstance(leaf.entry, TensorEntry)
        for i, (slot, dim, size) in enumerate(_slots(leaf)):
            if dim is None:
                continue
            if isinstance(dim, int):
                if size != dim:
                    raise SpecViolationError(
                        f"{slot} has size {size}, the spec fixes it at {dim}", where=f"argument {leaf.path!r}"
                    )
            elif isinstance(dim, ShapeVar):
                _bind_var(binding, dim, slot, size, leaf, i if tensor else None)
            else:
                derived.append((slot, dim, size, leaf.path))
    for slot, expr, size, path in derived:
        expected = expr.evaluate(binding.values)
        if size != expected:
            sources = ", ".join(f"{n} = {binding.values[n]} from {binding.bound_at[n]}" for n in sorted(expr.vars))
            raise SpecViolationError(
                f"{slot} has size {size}, but the spec says {expr} = {expected} ({sources})",
                where=f"argument {path!r}",
            )
    return binding


def _bind_var(binding: Binding, var: ShapeVar, slot: str, size: int, leaf: Leaf, dim: int | None) -> None:
    path = leaf.path
    if var.name in binding.values:
        first = binding.values[var.name]
        if size != first:
            raise SpecViolationError(
                f"{slot} has size {size}, but ShapeVar {var.name!r} is {first} from {binding.bound_at[var.name]}",
                where=f"argument {path!r}",
                hint="dims declared with the same ShapeVar must be equal",
            )
        return
    if not var.contains(size):
        raise SpecViolationError(
            f"{slot} has size {size}, outside ShapeVar {var.name!r} ({var.describe_range()})",
            where=f"argument {path!r}",
            hint="pass a size in range, or widen the ShapeVar",
        )
    binding.values[var.name] = size
    binding.bound_at[var.name] = slot
    binding.anchor[var.name] = leaf
    binding.anchor_dim[var.name] = dim
