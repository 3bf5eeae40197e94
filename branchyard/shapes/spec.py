"""``ShapesSpec``: which sizes of which arguments are dynamic, declared once.

A spec maps parameter names to *entries*, written the way a person writes
shapes::

    {"x": (batch, 768),          # tensor: one item per dim
     "mask": (batch, seq - 1),   # derived dims are expressions of ShapeVars
     "n": seq,                   # int argument: a scalar size
     "cache": {"k": (batch, None)},   # dict argument: entries per key
     "args": [(batch, 8)]}       # *args: entries per position

A dim is an ``int >= 0`` (static, must match), ``None`` (static, taken from
the example input) or a :class:`~branchyard.shapes.ShapeVar` / expression
(dynamic, an unbacked symbolic size when traced). A tuple or list of dims is
a tensor, also when every dim is ``None`` (a tensor of that rank, all static)
and when it is empty (a 0-dim tensor). Parameters not named are static.

Rules checked when the spec is built (a :class:`~branchyard.errors.ShapeSpecError`
otherwise): vars that share a name agree on their range; every var used in a
derived dim also appears bare somewhere (that slot binds its value); a derived
dim is a sum of products of vars with positive coefficients plus or minus an
int (``2 * b``, ``s - 1``, ``b * h``, ``b * b``) and depends on at least one
var (``20 - b`` and ``0 * b`` are refused). Where such a dim would come out
negative (``s - 1`` at ``s = 0``), no input can have it, and validation says so.

    >>> from branchyard.shapes import ShapeVar, ShapesSpec
    >>> batch = ShapeVar("batch", min=2, max=128)
    >>> spec = ShapesSpec({"x": (batch, 768), "y": (2 * batch, 768)})
    >>> print(spec)
    argument  shape
    --------  -----------------
    x         (batch, 768)
    y         (2*batch, 768)
    <BLANKLINE>
    ShapeVar  range
    --------  -----------------
    batch     2 <= batch <= 128
    >>> ShapesSpec.from_json(spec.to_json()) == spec
    True
"""

from __future__ import annotations

import ast
import json
import operator
import re
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Union

import sympy

from branchyard.errors import ShapeSpecError
from branchyard.shapes.shape_var import DimExpr, ShapeVar, _merge_vars

__all__ = ["ShapesSpec", "TensorEntry", "ScalarEntry", "SeqEntry", "MapEntry", "Entry", "Dim"]

#: One dim of a tensor entry: static int, static-from-example None, or dynamic.
Dim = Union[int, None, DimExpr]

JSON_FORMAT = "branchyard.shapes/1"


@dataclass(frozen=True)
class TensorEntry:
    """A tensor argument: one :data:`Dim` per tensor dim."""

    dims: tuple[Dim, ...]

    def __str__(self) -> str:
        inner = ", ".join("_" if d is None else str(d) for d in self.dims)
        return f"({inner},)" if len(self.dims) == 1 else f"({inner})"


@dataclass(frozen=True)
class ScalarEntry:
    """An ``int`` argument that is a size: a var, an expression, or a fixed int."""

    dim: Union[int, DimExpr]

    def __str__(self) -> str:
        return f"int {self.dim}"


@dataclass(frozen=True)
class SeqEntry:
    """A list/tuple argument (or ``*args``): one entry per position, None = static."""

    items: tuple["Entry | None", ...]

    def __str__(self) -> str:
        return "[" + ", ".join("_" if e is None else str(e) for e in self.items) + "]"


@dataclass(frozen=True)
class MapEntry:
    """A dict argument (or ``**kwargs``): one entry per key; keys not named are static."""

    items: tuple[tuple[Union[str, int], "Entry | None"], ...]

    def get(self, key: Any) -> "Entry | None":
        return dict(self.items).get(key)

    def __str__(self) -> str:
        return "{" + ", ".join(f"{k!r}: {'_' if e is None else e}" for k, e in self.items) + "}"


Entry = Union[TensorEntry, ScalarEntry, SeqEntry, MapEntry]


def _is_dim(value: Any) -> bool:
    return value is None or isinstance(value, DimExpr) or (isinstance(value, int) and not isinstance(value, bool))


def make_entry(value: Any, *, where: str) -> Entry | None:
    """Normalise one user-written spec value into an :data:`Entry` (None = static)."""
    if value is None:
        return None
    if isinstance(value, (TensorEntry, ScalarEntry, SeqEntry, MapEntry)):
        return value
    if isinstance(value, DimExpr) or (isinstance(value, int) and not isinstance(value, bool)):
        return ScalarEntry(value)
    if isinstance(value, (tuple, list)):
        # A sequence of sizes is a tensor shape; a sequence holding containers
        # is a list argument with one entry per position.
        if all(_is_dim(v) for v in value):  # () is a 0-dim tensor, (None, None) a static 2-dim one
            return TensorEntry(tuple(value))
        return SeqEntry(tuple(make_entry(v, where=f"{where}[{i}]") for i, v in enumerate(value)))
    if isinstance(value, Mapping):
        for k in value:
            if not isinstance(k, (str, int)):
                raise ShapeSpecError(f"dict spec keys must be str or int, got {k!r}", where=where)
        return MapEntry(tuple((k, make_entry(v, where=f"{where}[{k!r}]")) for k, v in value.items()))
    raise ShapeSpecError(
        f"cannot read {type(value).__name__} {value!r} as a spec entry",
        where=where,
        hint="use a tuple of sizes for a tensor, a ShapeVar/expression/int for an int argument, "
        "a dict or list for containers, None for static",
    )


def _check_dim(dim: Dim, where: str) -> None:
    """A static size is never negative, and a derived dim grows with its vars."""
    if isinstance(dim, int) and dim < 0:
        raise ShapeSpecError(f"size {dim} is negative", where=where, hint="a static dim is an int >= 0, or None")
    if not isinstance(dim, DimExpr) or dim.is_var:
        return
    if not dim.vars:
        raise ShapeSpecError(
            f"the derived dim is the constant {dim}: it depends on no ShapeVar", where=where, hint=f"write the int {dim}"
        )
    poly = sympy.Poly(dim.expr, *(v.symbol for v in dim.vars.values()))
    shrinking = [m for m, c in poly.terms() if any(m) and c < 0]
    if shrinking:
        raise ShapeSpecError(
            f"{dim} shrinks as a ShapeVar grows; a derived dim is a sum of products of ShapeVars "
            "with positive coefficients, plus or minus an int",
            where=where,
            hint="declare this dim as a ShapeVar of its own with the range it takes",
        )


def iter_dims(entry: Entry | None, path: str) -> Iterator[tuple[str, Dim]]:
    """Every dim slot under ``entry`` as ``(path, dim)``; ``path`` reads like ``x dim 0``."""
    if entry is None:
        return
    if isinstance(entry, TensorEntry):
        for i, d in enumerate(entry.dims):
            yield f"{path} dim {i}", d
    elif isinstance(entry, ScalarEntry):
        yield path, entry.dim
    elif isinstance(entry, SeqEntry):
        for i, e in enumerate(entry.items):
            yield from iter_dims(e, f"{path}[{i}]")
    else:
        for k, e in entry.items:
            yield from iter_dims(e, f"{path}[{k!r}]")


class ShapesSpec:
    """A dynamic-shape declaration for one callable's parameters.

    ``ShapesSpec({"x": (batch, 768)})``: see the module docstring for the
    entry grammar. Build it once; hand it to :func:`~branchyard.shapes.dynamic_spec`,
    :func:`~branchyard.shapes.export`, :func:`~branchyard.shapes.compile` or
    :func:`~branchyard.shapes.make_fx`, or convert it with :meth:`to_torch`,
    :meth:`to_dynamic_shapes` and :meth:`to_json`.
    """

    def __init__(self, params: Mapping[str, Any] | "ShapesSpec"):
        if isinstance(params, ShapesSpec):
            params = params.params
        if not isinstance(params, Mapping):
            raise ShapeSpecError(
                f"a spec is a dict from parameter name to entry, got {type(params).__name__}",
                hint='e.g. {"x": (batch, 768)}',
            )
        self.params: dict[str, Entry] = {}
        for name, value in params.items():
            if not isinstance(name, str):
                raise ShapeSpecError(f"parameter names must be str, got {name!r}")
            entry = make_entry(value, where=f"argument {name!r}")
            if entry is not None:
                self.params[name] = entry
        self.vars: dict[str, ShapeVar] = {}
        bare: set[str] = set()
        for path, dim in self.iter_dims():
            _check_dim(dim, path)
            if isinstance(dim, DimExpr):
                self.vars = _merge_vars(self.vars, dim.vars)
                if dim.is_var:
                    bare.add(dim.name)
        self._check_anchored(bare)

    def _check_anchored(self, bare: set[str]) -> None:
        for path, dim in self.iter_dims():
            if isinstance(dim, DimExpr) and not dim.is_var:
                loose = sorted(set(dim.vars) - bare)
                if loose:
                    raise ShapeSpecError(
                        f"ShapeVar {loose[0]!r} appears only inside derived dims (here {dim}); "
                        "nothing binds its value",
                        where=path,
                        hint=f"give {loose[0]!r} a slot of its own (a dim or an int argument), "
                        "or declare this dim as its own ShapeVar with the range you need",
                    )

    # -- views ---------------------------------------------------------------------
    def iter_dims(self) -> Iterator[tuple[str, Dim]]:
        """Every declared dim slot as ``(path, dim)``, in declaration order."""
        for name, entry in self.params.items():
            yield from iter_dims(entry, name)

    def symbolic_slots(self) -> dict[str, list[str]]:
        """For each var, the slots where it appears bare (the ones that bind it)."""
        out: dict[str, list[str]] = {n: [] for n in self.vars}
        for path, dim in self.iter_dims():
            if isinstance(dim, ShapeVar):
                out[dim.name].append(path)
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ShapesSpec):
            return NotImplemented
        return self.params == other.params and self.vars == other.vars

    def __hash__(self) -> int:
        return hash(tuple(self.params))

    # -- pretty printing -----------------------------------------------------------
    def table(self) -> str:
        """The spec as two small tables: arguments and their shapes, vars and their ranges."""
        args = [(name, str(entry)) for name, entry in self.params.items()]
        ranges = [(n, v.describe_range()) for n, v in self.vars.items()]
        # one column width for both tables, so they read as one
        w0 = max([len("argument")] + [len(r[0]) for r in args + ranges])
        w1 = max([len("range")] + [len(r[1]) for r in args + ranges])
        text = _table(("argument", "shape"), args, w0, w1)
        if ranges:
            text += "\n\n" + _table(("ShapeVar", "range"), ranges, w0, w1)
        return text

    __str__ = table

    def __repr__(self) -> str:
        return f"ShapesSpec(\n{self.table()}\n)"

    # -- JSON ----------------------------------------------------------------------
    def to_json(self, **dumps_kwargs: Any) -> str:
        """A JSON document that :meth:`from_json` reads back into an equal spec."""
        doc = {
            "format": JSON_FORMAT,
            "vars": [
                {"name": v.name, "min": v.min, "max": v.max, "multiple_of": v.multiple_of}
                for v in self.vars.values()
            ],
            "params": {name: _entry_to_json(e) for name, e in self.params.items()},
        }
        return json.dumps(doc, **dumps_kwargs)

    @classmethod
    def from_json(cls, text: str) -> "ShapesSpec":
        """Read a spec written by :meth:`to_json`.

        The document is checked field by field (a :class:`~branchyard.errors.ShapeSpecError`
        names the field); dim expressions are parsed by a small parser of
        ``+ - * **``, parentheses, ints and the declared vars' names, never evaluated.
        """
        try:
            doc = json.loads(text)
        except (json.JSONDecodeError, TypeError) as e:
            raise ShapeSpecError(f"not JSON: {e}") from e
        except RecursionError:
            raise ShapeSpecError("not a spec: the JSON is nested too deeply") from None
        if not isinstance(doc, dict) or doc.get("format") != JSON_FORMAT:
            raise ShapeSpecError(f"not a {JSON_FORMAT} document (format={doc.get('format') if isinstance(doc, dict) else None!r})")
        _check_keys(doc, {"format", "vars", "params"}, "the document")
        if not isinstance(doc["vars"], list):
            raise ShapeSpecError(f"'vars' must be a list of ShapeVars, got {_json_type(doc['vars'])}", where="JSON 'vars'")
        vars: dict[str, ShapeVar] = {}
        for i, v in enumerate(doc["vars"]):
            var = _var_from_json(v, f"JSON vars[{i}]")
            if var.name in vars:
                raise ShapeSpecError(
                    f"ShapeVar {var.name!r} is declared twice ({vars[var.name]!r} and {var!r})", where=f"JSON vars[{i}]"
                )
            vars[var.name] = var
        if not isinstance(doc["params"], dict):
            raise ShapeSpecError(
                f"'params' must be an object from parameter name to entry, got {_json_type(doc['params'])}",
                where="JSON 'params'",
            )
        try:
            params = {name: _entry_from_json(e, vars, where=f"argument {name!r}") for name, e in doc["params"].items()}
        except RecursionError:
            raise ShapeSpecError("not a spec: its entries are nested too deeply", where="JSON 'params'") from None
        return cls(params)

    # -- conversions (torch's own spec types) -----------------------------------------
    def to_torch(self, fn: Any = None) -> Any:
        """torch's native ``torch.fx.experimental.dynamic_spec.ShapesSpec`` (torch >= 2.14).

        ``fn`` is needed only to name ``*args``/``**kwargs`` parameters. See
        :func:`branchyard.shapes.interop.to_torch_spec` for what carries over.
        """
        from branchyard.shapes.interop import to_torch_spec

        return to_torch_spec(self, fn)

    def to_dynamic_shapes(self, fn: Any = None) -> dict[str, Any]:
        """``torch.export`` ``dynamic_shapes`` (``Dim`` objects); ``fn`` adds None for unnamed params."""
        from branchyard.shapes.interop import to_dynamic_shapes

        return to_dynamic_shapes(self, fn)

    @classmethod
    def from_dynamic_shapes(
        cls, dynamic_shapes: Any, fn: Any = None, example_inputs: Mapping[str, Any] | None = None
    ) -> "ShapesSpec":
        """A spec from ``torch.export`` ``dynamic_shapes`` (see :func:`branchyard.shapes.interop.from_dynamic_shapes`)."""
        from branchyard.shapes.interop import from_dynamic_shapes

        return from_dynamic_shapes(dynamic_shapes, fn, example_inputs)

    def validate(self, fn: Any, *args: Any, **kwargs: Any) -> dict[str, int]:
        """Check concrete inputs of ``fn`` against the spec; return each var's size.

        Raises :class:`~branchyard.errors.SpecViolationError` naming the argument,
        dim, ShapeVar, range and value on the first violation.
        """
        from branchyard.shapes.validation import bind

        return bind(self, fn, args, kwargs).values


def _table(header: tuple[str, str], rows: list[tuple[str, str]], w0: int, w1: int) -> str:
    lines = [f"{header[0]:<{w0}}  {header[1]}", f"{'-' * w0}  {'-' * w1}"]
    lines += [f"{a:<{w0}}  {b}" for a, b in rows]
    return "\n".join(lines)


def _dim_to_json(d: Dim) -> Any:
    return str(d) if isinstance(d, DimExpr) else d


def _entry_to_json(e: Entry | None) -> Any:
    if e is None:
        return None
    if isinstance(e, TensorEntry):
        return {"tensor": [_dim_to_json(d) for d in e.dims]}
    if isinstance(e, ScalarEntry):
        return {"int": _dim_to_json(e.dim)}
    if isinstance(e, SeqEntry):
        return {"seq": [_entry_to_json(x) for x in e.items]}
    return {"dict": [[k, _entry_to_json(x)] for k, x in e.items]}


def _json_type(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), type(value).__name__
    )


def _check_keys(obj: dict, expected: set[str], where: str) -> None:
    missing, extra = sorted(expected - set(obj)), sorted(set(obj) - expected)
    if missing:
        raise ShapeSpecError(f"missing field {missing[0]!r}", where=where)
    if extra:
        raise ShapeSpecError(f"unknown field {extra[0]!r} (expected {sorted(expected)})", where=where)


def _var_from_json(v: Any, where: str) -> ShapeVar:
    if not isinstance(v, dict):
        raise ShapeSpecError(f"a ShapeVar is an object with name, min, max, multiple_of; got {_json_type(v)}", where=where)
    _check_keys(v, {"name", "min", "max", "multiple_of"}, where)
    for field in ("min", "max", "multiple_of"):  # ShapeVar takes None for each of them
        if v[field] is not None and (type(v[field]) is not int):
            raise ShapeSpecError(f"{field!r} must be an integer or null, got {_json_type(v[field])} {v[field]!r}", where=where)
    try:
        return ShapeVar(v["name"], min=v["min"], max=v["max"], multiple_of=v["multiple_of"])
    except ShapeSpecError as e:
        raise ShapeSpecError(str(e), where=where) from e


#: The tokens a dim expression may hold (as ``str(DimExpr)`` writes it): names (any
#: identifier, ``ü`` and keywords like ``lambda`` included), ASCII integers, ``+ - * ( )``.
_EXPR_TOKEN = re.compile(r"([^\W\d]\w*)|([0-9]+)|(\s+|[+\-*()])")
_MAX_POWER = 64  # b**2 is what b*b prints as; a huge power of an int would never end
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _parse_dim_expr(text: str, vars: Mapping[str, ShapeVar], where: str) -> sympy.Expr:
    """``text`` (``2*batch + 1``, ``b**2``, ``(s - 1)*h``) as a sympy expression over
    the vars' symbols. Python's parser reads it, with each name replaced by a
    placeholder first (so ``lambda`` or ``None`` are names); only ``+ - *``,
    integer powers, ints and the declared names are taken, nothing is evaluated."""
    shown = text if len(text) <= 60 else text[:57] + "..."

    def bad(why: str) -> ShapeSpecError:
        return ShapeSpecError(f"bad dim expression {shown!r} in JSON: {why}", where=where)

    names: list[str] = []
    pieces, pos = [], 0
    for m in _EXPR_TOKEN.finditer(text):
        if m.start() != pos:
            break
        pos = m.end()
        if m.group(1):
            names.append(m.group(1))
            pieces.append(f"_v{len(names) - 1}")
        else:
            pieces.append(m.group(0))
    if pos != len(text):
        raise bad(f"unexpected {text[pos:pos + 20]!r}")
    unknown = sorted(set(names) - set(vars))
    if unknown:
        raise ShapeSpecError(f"dim {text!r} names undeclared ShapeVar(s) {unknown}", where=where)
    if not text.strip():
        raise bad("it is empty")
    try:
        tree = ast.parse("".join(pieces), mode="eval").body
    except SyntaxError as e:
        raise bad(e.msg) from None
    except (RecursionError, MemoryError):
        raise bad("nested too deeply") from None

    def build(node: ast.expr) -> sympy.Expr:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return sympy.Integer(node.value)
        if isinstance(node, ast.Name):
            return vars[names[int(node.id[2:])]].symbol
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -build(node.operand)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            exp = node.right
            if not (isinstance(exp, ast.Constant) and type(exp.value) is int and 1 <= exp.value <= _MAX_POWER):
                raise bad(f"a power must be an integer from 1 to {_MAX_POWER}")
            return build(node.left) ** exp.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return _BINARY[type(node.op)](build(node.left), build(node.right))
        raise bad("only +, -, *, integer powers, integers and ShapeVar names are allowed")

    try:
        return build(tree)
    except RecursionError:
        raise bad("nested too deeply") from None


def _dim_from_json(d: Any, vars: Mapping[str, ShapeVar], where: str) -> Dim:
    if d is None or type(d) is int:  # not bool: JSON true is no size
        return d
    if not isinstance(d, str):
        raise ShapeSpecError(f"bad dim {json.dumps(d)} in JSON: a dim is an integer, null or an expression string", where=where)
    expr = _parse_dim_expr(d, vars, where)
    if isinstance(expr, sympy.Symbol):
        return vars[expr.name]
    return DimExpr(expr, vars)


def _entry_from_json(e: Any, vars: Mapping[str, ShapeVar], where: str) -> Entry | None:
    if e is None:
        return None
    if not isinstance(e, dict) or len(e) != 1:
        raise ShapeSpecError(
            f"bad entry {json.dumps(e)} in JSON: an entry is null or an object with one of 'tensor', 'int', 'seq', 'dict'",
            where=where,
        )
    ((kind, body),) = e.items()
    if kind == "int":
        return ScalarEntry(_dim_from_json(body, vars, where))
    if kind not in ("tensor", "seq", "dict"):
        raise ShapeSpecError(f"unknown entry kind {kind!r} in JSON", where=where)
    if not isinstance(body, list):
        raise ShapeSpecError(f"a {kind!r} entry holds a list, got {_json_type(body)}", where=where)
    if kind == "tensor":
        return TensorEntry(tuple(_dim_from_json(d, vars, f"{where} dim {i}") for i, d in enumerate(body)))
    if kind == "seq":
        return SeqEntry(tuple(_entry_from_json(x, vars, f"{where}[{i}]") for i, x in enumerate(body)))
    items: list[tuple[str | int, Entry | None]] = []
    for i, pair in enumerate(body):
        if not (isinstance(pair, list) and len(pair) == 2 and type(pair[0]) in (str, int)):
            raise ShapeSpecError(
                f"a 'dict' entry holds [key, entry] pairs with a string or integer key, got {json.dumps(pair)}",
                where=f"{where} dict item {i}",
            )
        key = pair[0]
        if any(k == key for k, _ in items):
            raise ShapeSpecError(f"key {key!r} appears twice", where=where)
        items.append((key, _entry_from_json(pair[1], vars, f"{where}[{key!r}]")))
    return MapEntry(tuple(items))
