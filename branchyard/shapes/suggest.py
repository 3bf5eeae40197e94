"""``suggest``: propose a :class:`ShapesSpec` from several sets of example inputs.

Semantics, as Python::

    slots = every tensor dim and int argument of the call, the same in every set
    dynamic = slots whose value differs between sets
    group dynamic slots by their value vector; each group is one ShapeVar,
        unless its vector is a*w + b or w1*w2 of other vars' vectors (derived)
    ShapeVar range = [min seen, max seen]; multiple_of = gcd of the values seen

A relation needs evidence: with two sets only *equal* dims share a var
(``a*w + b`` fits any two points); derived dims are proposed from three sets
on. The result is a starting point to edit -- widen the ranges to what the
model must accept; the observed range is only what the examples showed.

    >>> import torch
    >>> from branchyard.shapes import suggest
    >>> def f(x, mask, n):
    ...     return x
    >>> sets = [(torch.ones(b, 2 * b, 8), torch.ones(b, 2 * b - 1), 2 * b) for b in (2, 4, 8)]
    >>> print(suggest(f, *sets))
    argument  shape
    --------  -------------------------------
    x         (x_dim0, 2*x_dim0, 8)
    mask      (x_dim0, 2*x_dim0 - 1)
    n         int 2*x_dim0
    <BLANKLINE>
    ShapeVar  range
    --------  -------------------------------
    x_dim0    2 <= x_dim0 <= 8, multiple of 2
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Iterator

import torch

from branchyard.errors import ShapeSpecError
from branchyard.shapes.shape_var import DimExpr, ShapeVar
from branchyard.shapes.spec import ShapesSpec
from branchyard.shapes.validation import signature_of

__all__ = ["suggest"]


def _slots(value: Any, path: str, keys: tuple) -> Iterator[tuple[tuple, str, int | None, int]]:
    """(keys, path, dim index or None for an int, value) for every size in ``value``."""
    if isinstance(value, torch.Tensor):
        for i, n in enumerate(value.shape):
            yield keys, path, i, int(n)
    elif type(value) is int:
        yield keys, path, None, value
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _slots(v, f"{path}[{i}]", keys + (i,))
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _slots(v, f"{path}[{k!r}]", keys + (k,))


def _name(path: str, dim: int | None) -> str:
    base = re.sub(r"\W+", "_", path).strip("_")
    return f"{base}_dim{dim}" if dim is not None else base


def _fit_linear(v: tuple[int, ...], w: tuple[int, ...]) -> tuple[int, int] | None:
    """(a, b) with v == a*w + b for every set, a a positive int, else None."""
    pairs = list(zip(w, v))
    w0, v0 = pairs[0]
    other = next((p for p in pairs[1:] if p[0] != w0), None)
    if other is None:
        return None
    w1, v1 = other
    num, den = v1 - v0, w1 - w0
    if den == 0 or num % den:
        return None
    a = num // den
    b = v0 - a * w0
    if a < 1 or any(vi != a * wi + b for vi, wi in zip(v, w)):
        return None
    return a, b


def suggest(fn: Callable[..., Any] | torch.nn.Module, *example_inputs_sets: Any) -> ShapesSpec:
    """A spec for ``fn`` from several example input sets (each a tuple of args, or a dict of kwargs)."""
    if len(example_inputs_sets) < 2:
        raise ShapeSpecError(
            f"got {len(example_inputs_sets)} example input set(s); at least two are needed to see which dims vary"
        )
    sig = signature_of(fn)
    per_set: list[list[tuple[tuple, str, int | None, int]]] = []
    for n, inputs in enumerate(example_inputs_sets):
        args, kwargs = ((), inputs) if isinstance(inputs, dict) else (tuple(inputs), {})
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as e:
            raise ShapeSpecError(f"example set {n} does not match the signature {sig}: {e}") from e
        bound.apply_defaults()
        per_set.append([s for name, v in bound.arguments.items() for s in _slots(v, name, (name,))])
    layout = [(k, p, d) for k, p, d, _ in per_set[0]]
    for n, slots in enumerate(per_set[1:], 1):
        if [(k, p, d) for k, p, d, _ in slots] != layout:
            raise ShapeSpecError(
                f"example set {n} has a different structure (tensor ranks, containers) from set 0",
                hint="every set must pass the same arguments with the same ranks",
            )
    vectors = [tuple(s[i][3] for s in per_set) for i in range(len(layout))]

    # One var per distinct varying vector, in order of first appearance;
    # later vectors are written through earlier vars when a relation fits.
    dims: list[Any] = []
    vars_by_vector: dict[tuple[int, ...], DimExpr] = {}
    base: list[tuple[tuple[int, ...], ShapeVar]] = []
    for (keys, path, d), v in zip(layout, vectors):
        if len(set(v)) == 1:
            dims.append(v[0] if d is not None else None)
            continue
        if v not in vars_by_vector:
            vars_by_vector[v] = _derive(v, base, len(example_inputs_sets)) or _new_var(v, path, d, base)
        dims.append(vars_by_vector[v])
    _fold_products(vars_by_vector, base, len(example_inputs_sets))
    dims = [vars_by_vector.get(v, dim) if isinstance(dim, DimExpr) else dim for v, dim in zip(vectors, dims)]

    params: dict[str, Any] = {}
    for ((keys, path, d), dim) in zip(layout, dims):
        _place(params, keys, d, dim)
    return ShapesSpec({k: _finish(v) for k, v in params.items() if _finish(v) is not None})


def _new_var(v: tuple[int, ...], path: str, d: int | None, base: list) -> ShapeVar:
    g = math.gcd(*v)
    var = ShapeVar(_name(path, d), min=min(v), max=max(v), multiple_of=g if g > 1 else 1)
    base.append((v, var))
    return var


def _derive(v: tuple[int, ...], base: list[tuple[tuple[int, ...], ShapeVar]], n_sets: int) -> DimExpr | None:
    if n_sets < 3:
        return None
    for w, var in base:
        fit = _fit_linear(v, w)
        if fit is not None:
            a, b = fit
            return a * var + b if b else a * var
    for i, (w1, v1) in enumerate(base):
        for w2, v2 in base[i:]:
            if all(x == p * q for x, p, q in zip(v, w1, w2)):
                return v1 * v2
    return None


def _fold_products(vars_by_vector: dict, base: list, n_sets: int) -> None:
    """A var that came first but is the product of two later vars (``q: (b*h, d)``
    before ``k: (b, d)`` and ``heads``) becomes that product, if nothing is derived from it."""
    if n_sets < 3:
        return
    for v, var in list(base):
        used = any(not e.is_var and var.name in e.vars for e in vars_by_vector.values())
        others = [(w, x) for w, x in base if x is not var]
        for i, (w1, x1) in enumerate(others):
            match = next((x2 for w2, x2 in others[i:] if all(p == a * b for p, a, b in zip(v, w1, w2))), None)
            if match is not None and not used:
                vars_by_vector[v] = x1 * match
                base.remove((v, var))
                break


class _Tensor(list):
    """Dims of one tensor while the spec is assembled."""


def _place(params: dict, keys: tuple, d: int | None, dim: Any) -> None:
    node: Any = params
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    last = keys[-1]
    if d is None:
        node[last] = dim
    else:
        node.setdefault(last, _Tensor()).append(dim)


def _finish(value: Any) -> Any:
    """Tensors whose dims are all fixed, and ints that never vary, are left static."""
    if isinstance(value, _Tensor):
        return tuple(value) if any(isinstance(x, DimExpr) for x in value) else None
    if isinstance(value, dict):
        done = {k: _finish(v) for k, v in value.items()}
        done = {k: v for k, v in done.items() if v is not None}
        if not done:
            return None
        if all(isinstance(k, int) for k in done):
            return [done.get(i) for i in range(max(done) + 1)]
        return done
    return value
