"""Conversions between a branchyard :class:`ShapesSpec` and torch's spec types.

* :func:`to_torch_spec` -- torch 2.14's native
  ``torch.fx.experimental.dynamic_spec.ShapesSpec``: tuples become
  ``TensorSpec``, ShapeVars become torch ``ShapeVar`` s, derived dims become
  derived ``SymInt`` s over them, and ``multiple_of`` becomes an assumption
  ``var % m == 0``. This is what ``@dynamic_spec`` attaches for torch's own
  ``torch.compile`` / ``torch.export`` / ``make_fx`` to read.
* :func:`to_dynamic_shapes` / :func:`from_dynamic_shapes` -- ``torch.export``
  ``dynamic_shapes`` built from ``Dim`` objects, so code written against
  ``Dim`` can adopt a ShapesSpec or leave it. ``Dim`` can only say
  ``a * x + b``; ``multiple_of=m`` is written ``m * Dim(...)``, the way
  torch.export spells divisibility.

    >>> import torch
    >>> from branchyard.shapes import ShapeVar, ShapesSpec
    >>> seq = ShapeVar("seq", min=8, max=64, multiple_of=8)
    >>> ds = ShapesSpec({"x": (seq, 4), "y": (seq - 1,)}).to_dynamic_shapes()
    >>> ds["x"][0], ds["y"][0]
    (8*seq_div8, 8*seq_div8 - 1)
    >>> print(ShapesSpec.from_dynamic_shapes(ds, example_inputs={"x": torch.ones(8, 4), "y": torch.ones(7)}))
    argument  shape
    --------  -----------------------------
    x         (seq, 4)
    y         (seq - 1,)
    <BLANKLINE>
    ShapeVar  range
    --------  -----------------------------
    seq       8 <= seq <= 64, multiple of 8
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping

import sympy
import torch

from branchyard.errors import ShapeSpecError
from branchyard.shapes.shape_var import DimExpr, ShapeVar
from branchyard.shapes.spec import Entry, MapEntry, ScalarEntry, SeqEntry, ShapesSpec, TensorEntry

__all__ = ["HAS_NATIVE_SPEC", "to_torch_spec", "compiles_through_wrapper", "to_dynamic_shapes", "from_dynamic_shapes"]


def _has_native_spec() -> bool:
    try:
        import torch.fx.experimental.dynamic_spec  # noqa: F401
    except ImportError:
        return False
    return True


#: torch ships ``torch.fx.experimental.dynamic_spec`` (2.14 on).
HAS_NATIVE_SPEC: bool = _has_native_spec()


def _variadic_names(fn: Any) -> dict[str, str]:
    """Our keys for ``*args`` / ``**kwargs`` are their parameter names; torch's are sentinels."""
    if fn is None:
        return {}
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    out = {}
    for p in inspect.signature(target).parameters.values():
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            out[p.name] = "*args"
        elif p.kind is inspect.Parameter.VAR_KEYWORD:
            out[p.name] = "**kwargs"
    return out


class _DerivedSize(torch.SymInt):
    """A derived dim of torch's native spec (``S + 1``), able to say itself in JSON.

    Dynamo JSON-encodes its config, spec included, for its compile-metrics log
    on every compile; torch's own ``IntVar`` has ``to_jsonable`` but the
    ``SymInt`` its arithmetic builds does not, and torch 2.14.1 then logs a
    22-line ``ERROR`` traceback per compile (``Object of type SymInt is not
    JSON serializable``). Same node, same meaning to the compiler.
    """

    def to_jsonable(self) -> dict[str, Any]:
        return {"type": "SymInt", "expr": str(self.node.expr)}


def to_torch_spec(spec: ShapesSpec, fn: Any = None, *, by_position: bool = False) -> Any:
    """torch's native ``ShapesSpec`` for ``spec`` (``fn`` names ``*args``/``**kwargs`` params).

    ``by_position=True`` keys the entries the way a frame ``inner(*args,
    **kwargs)`` sees them -- ``"*args"`` in ``fn``'s parameter order and
    ``"**kwargs"`` by name -- for modules Dynamo compiles through such a
    wrapper (see :func:`compiles_through_wrapper`).
    """
    if not HAS_NATIVE_SPEC:
        raise ShapeSpecError(
            f"torch {torch.__version__} has no torch.fx.experimental.dynamic_spec",
            hint="use branchyard.shapes.export / make_fx, which do not need it",
        )
    from torch.fx.experimental import dynamic_spec as native

    tvars = {name: native.ShapeVar(name, min=v.min, max=v.max) for name, v in spec.vars.items()}

    def dim(d: Any) -> Any:
        if not isinstance(d, DimExpr):
            return d
        value = d.evaluate(tvars)
        return value if d.is_var else _DerivedSize(value.node)

    def entry(e: Entry | None) -> Any:
        if e is None:
            return None
        if isinstance(e, TensorEntry):
            return native.TensorSpec([dim(d) for d in e.dims])
        if isinstance(e, ScalarEntry):
            return dim(e.dim)
        if isinstance(e, SeqEntry):
            return native.SeqSpec([entry(x) for x in e.items])
        return native.DictSpec({k: entry(x) for k, x in e.items})

    assumptions = [tvars[n] % v.multiple_of == 0 for n, v in spec.vars.items() if v.multiple_of > 1]
    if by_position:
        target = fn.forward if isinstance(fn, torch.nn.Module) else fn
        names = [
            p.name
            for p in inspect.signature(target).parameters.values()
            if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD) and p.name != "self"
        ]
        used = [n for n in names if n in spec.params]
        positional = [entry(spec.params.get(n)) for n in names[: names.index(used[-1]) + 1]] if used else []
        by_name = {n: entry(e) for n, e in spec.params.items()}
        params_pos = {"*args": positional, "**kwargs": by_name}
        return native.ShapesSpec(native.ParamsSpec(params_pos), assumptions=assumptions or None)

    renames = _variadic_names(fn)
    params: dict[str, Any] = {}
    for name, e in spec.params.items():
        key = renames.get(name, name)
        if key == "*args":
            params[key] = list(entry(e)._entries) if isinstance(e, SeqEntry) else [entry(e)]
        elif key == "**kwargs":
            params[key] = dict(entry(e)._entries) if isinstance(e, MapEntry) else {}
        else:
            params[key] = entry(e)
    return native.ShapesSpec(native.ParamsSpec(params), assumptions=assumptions or None)


def compiles_through_wrapper(fn: Any) -> bool:
    """Whether ``torch.compile(fn)`` traces a frame ``inner(*args, **kwargs)``
    instead of ``forward`` (torch.nn modules whose ``forward`` Dynamo's trace
    rules skip, e.g. ``nn.TransformerEncoderLayer``): parameter names then
    mean nothing to the spec lookup, positions do."""
    if not isinstance(fn, torch.nn.Module):
        return False
    try:
        from torch._dynamo import config
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:
        return False
    check = getattr(OptimizedModule, "_forward_has_skip_rule", None)
    return bool(getattr(config, "wrap_top_frame", False) or (check is not None and check(fn)))


def to_dynamic_shapes(spec: ShapesSpec, fn: Any = None) -> dict[str, Any]:
    """``torch.export`` ``dynamic_shapes`` with ``Dim`` s; ``fn`` fills unnamed params with None."""
    from torch.export import Dim

    roots: dict[str, Any] = {}

    def root(var: ShapeVar) -> Any:
        if var.name not in roots:
            if var.multiple_of > 1:
                m = var.multiple_of
                k = Dim(f"{var.name}_div{m}", min=var.min // m, max=None if var.max is None else var.max // m)
                roots[var.name] = m * k
            else:
                roots[var.name] = Dim(var.name, min=var.min, max=var.max)
        return roots[var.name]

    def dim(d: Any, where: str) -> Any:
        if d is None or isinstance(d, int):
            return d
        if d.is_var:
            return root(d)
        lin = d.linear_root()
        if lin is None:
            raise ShapeSpecError(
                f"{d} is not of the form a*x + b, the only derived dims torch.export's Dim can express",
                where=where,
                hint="use branchyard.shapes.export, which takes the ShapesSpec directly",
            )
        var, a, b = lin
        return a * root(var) + b if b else a * root(var)

    def entry(e: Entry | None, where: str) -> Any:
        if e is None:
            return None
        if isinstance(e, TensorEntry):
            # ints stay: torch.export reads an int dim as "static, must equal"
            return {i: dim(d, f"{where} dim {i}") for i, d in enumerate(e.dims) if d is not None}
        if isinstance(e, ScalarEntry):
            if isinstance(e.dim, DimExpr):
                # torch.export takes only Dim.DYNAMIC / Dim.AUTO for an int: it would
                # lose the tie to the var (and its range), so refuse rather than weaken
                raise ShapeSpecError(
                    f"int argument declared as {e.dim}: torch.export's dynamic_shapes cannot make an int "
                    "argument a named Dim (only Dim.DYNAMIC, which drops its tie to the ShapeVar)",
                    where=where,
                    hint="use branchyard.shapes.export, which takes the ShapesSpec directly, or leave the int static",
                )
            return None
        if isinstance(e, SeqEntry):
            return [entry(x, f"{where}[{i}]") for i, x in enumerate(e.items)]
        return {k: entry(x, f"{where}[{k!r}]") for k, x in e.items}

    out = {name: entry(e, name) for name, e in spec.params.items()}
    if fn is not None:
        target = fn.forward if isinstance(fn, torch.nn.Module) else fn
        out = {p: out.get(p) for p in inspect.signature(target).parameters if p != "self"}
    return out


def _dim_bound(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, sympy.Integer)) and not isinstance(value, bool) and abs(int(value)) < 2**62 else None


def from_dynamic_shapes(
    dynamic_shapes: Any,
    fn: Callable[..., Any] | None = None,
    example_inputs: Mapping[str, Any] | None = None,
) -> ShapesSpec:
    """A :class:`ShapesSpec` for ``torch.export`` ``dynamic_shapes``.

    ``dynamic_shapes`` is a dict keyed by parameter name, or a tuple/list in
    parameter order (then ``fn`` gives the names). A tensor's dims written as
    ``{index: Dim}`` leave its rank open, so ``example_inputs`` (by name) must
    give the tensor; the list form ``[Dim, None]`` carries the rank itself.
    ``Dim.DYNAMIC`` / ``Dim.AUTO`` become a fresh ShapeVar ``<arg>_dim<i>``
    with the hint's range, ``Dim.STATIC`` becomes static, and ``m * Dim("k")``
    whose root appears nowhere else becomes ``ShapeVar(..., multiple_of=m)``.
    """
    from torch.export import Dim
    from torch.export.dynamic_shapes import _DerivedDim, _DimHint, _DimHintType

    if isinstance(dynamic_shapes, (tuple, list)):
        if fn is None:
            raise ShapeSpecError("dynamic_shapes given by position needs fn to name the parameters")
        target = fn.forward if isinstance(fn, torch.nn.Module) else fn
        names = [p for p in inspect.signature(target).parameters if p != "self"]
        dynamic_shapes = dict(zip(names, dynamic_shapes))
    if not isinstance(dynamic_shapes, Mapping):
        raise ShapeSpecError(f"dynamic_shapes must be a dict or tuple, got {type(dynamic_shapes).__name__}")
    examples = dict(example_inputs or {})

    # Roots that appear bare somewhere bind themselves; a root seen only as
    # m * root (torch's way to say "divisible by m") is folded into one var.
    bare_roots: set[str] = set()
    derived: list[Any] = []

    def scan(v: Any) -> None:
        if isinstance(v, _DerivedDim):
            derived.append(v)
        elif isinstance(v, Dim) and not isinstance(v, _DimHint):
            bare_roots.add(v.__name__)
        elif isinstance(v, Mapping):
            for x in v.values():
                scan(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                scan(x)

    scan(dynamic_shapes)
    vars: dict[str, ShapeVar] = {}

    def linear(d: Any) -> tuple[sympy.Expr, int, int]:
        expr = d.fn(sympy.Symbol(d.root.__name__, integer=True, nonnegative=True))
        a, b = (int(c) for c in sympy.Poly(expr, *expr.free_symbols).all_coeffs())
        return expr, a, b

    # A root with no bare slot: the smallest m with m*root in the spec becomes
    # ShapeVar(multiple_of=m); other a*root + b are rewritten over it.
    folded: dict[str, tuple[ShapeVar, int]] = {}
    for d in derived:
        root = d.root
        if root.__name__ in bare_roots:
            continue
        _, a, b = linear(d)
        if b == 0 and (root.__name__ not in folded or a < folded[root.__name__][1]):
            lo, hi = _dim_bound(root.min) or 0, _dim_bound(root.max)
            var = ShapeVar(_fold_name(root.__name__), min=a * lo, max=None if hi is None else a * hi, multiple_of=a)
            folded[root.__name__] = (var, a)

    def var_for_root(d: Any, where: str) -> ShapeVar:
        name = d.__name__
        var = ShapeVar(name, min=_dim_bound(d.min) or 0, max=_dim_bound(d.max))
        if name in vars and not vars[name].same_as(var):
            # torch.export refuses this too; merging would let one slot take the other's range
            raise ShapeSpecError(
                f"two different Dims are named {name!r}: {vars[name].describe_range()} and {var.describe_range()}",
                where=where,
                hint="give them distinct names, or reuse one Dim object",
            )
        return vars.setdefault(name, var)

    def convert_dim(d: Any, where: str) -> Any:
        if d is None or isinstance(d, int):
            return d
        if isinstance(d, _DimHint):
            if d.type is _DimHintType.STATIC:
                return None
            name = where.replace(" dim ", "_dim").replace("[", "_").replace("]", "").replace("'", "")
            return ShapeVar(name, min=_dim_bound(d.min) or 0, max=_dim_bound(d.max))
        if isinstance(d, _DerivedDim):
            expr, a, b = linear(d)
            if d.root.__name__ in bare_roots:
                var = var_for_root(d.root, where)
                return DimExpr(expr, {var.name: var})
            if d.root.__name__ not in folded or a % folded[d.root.__name__][1]:
                raise ShapeSpecError(
                    f"derived dim {d.__name__} uses {d.root.__name__!r}, which has no dim of its own",
                    where=where,
                    hint=f"give {d.root.__name__!r} a dim of its own, or also use m*{d.root.__name__} for an m dividing {a}",
                )
            var, m = folded[d.root.__name__]
            return var if (a, b) == (m, 0) else (a // m) * var + b
        if isinstance(d, Dim):
            return var_for_root(d, where)
        raise ShapeSpecError(f"cannot read {d!r} as a dim", where=where)

    def convert(v: Any, where: str, example: Any) -> Any:
        if v is None:
            return None
        if isinstance(v, Mapping) and all(isinstance(k, int) for k in v) and not isinstance(example, dict):
            if not isinstance(example, torch.Tensor):
                raise ShapeSpecError(
                    "a {index: Dim} entry leaves the tensor's rank open",
                    where=where,
                    hint="pass example_inputs={name: tensor}, or write the dims as a list",
                )
            return tuple(convert_dim(v.get(i), f"{where} dim {i}") for i in range(example.dim()))
        if isinstance(v, Mapping):
            return {k: convert(x, f"{where}[{k!r}]", (example or {}).get(k)) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            if all(x is None or isinstance(x, (int, Dim, _DimHint)) for x in v) and not isinstance(example, (list, tuple)):
                return tuple(convert_dim(x, f"{where} dim {i}") for i, x in enumerate(v))
            return [convert(x, f"{where}[{i}]", example[i] if example else None) for i, x in enumerate(v)]
        return convert_dim(v, where)

    params = {name: convert(v, name, examples.get(name)) for name, v in dynamic_shapes.items()}
    return ShapesSpec(params)


def _fold_name(root_name: str) -> str:
    # "seq_div8" -> "seq" when the root follows our own naming; otherwise the root's name
    suffix = root_name.rsplit("_div", 1)
    return suffix[0] if len(suffix) == 2 and suffix[1].isdigit() else root_name
