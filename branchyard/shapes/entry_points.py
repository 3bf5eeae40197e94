"""``export``, ``compile`` and ``make_fx`` driven by one :class:`ShapesSpec`.

Each takes a function or ``nn.Module`` and the spec (explicitly, or attached
by :func:`~branchyard.shapes.dynamic_spec`; both at once is an error), and:

1. validates the concrete inputs against the spec before anything is traced
   or run (:mod:`branchyard.shapes.validation`);
2. traces with every declared dim an *unbacked* symbolic size with the
   declared range -- no 0/1 specialisation, no recompiles inside the range;
3. turns a data-dependent guard on a declared dim into a
   :class:`~branchyard.errors.DataDependentShapeError` in ShapeVar terms.

How step 2 is done per entry point:

=============  ==============================================================
``export``     our own fake inputs (one unbacked symbol per ShapeVar where it
               binds, and one per other dim tied to them by a named check,
               :mod:`branchyard.shapes.symbolic`) handed to
               ``torch.export.export``; plain functions are wrapped in a module
               that owns the ``nn.Module`` s they close over. ``strict=True``
               works too: the ties are stated again inside the trace, since
               Dynamo copies the fakes' symbols into a ShapeEnv of its own.
``make_fx``    the same fake inputs handed to torch's ``make_fx``; kwargs are
               bound to positions first; deferred runtime asserts are
               inserted into the graph.
``compile``    torch's native ``ShapesSpec`` (:func:`~branchyard.shapes.interop.to_torch_spec`)
               handed to ``torch.compile(dynamic_shapes=...)``: Dynamo
               allocates a symbol per occurrence and ties the copies to the
               first with ``Eq`` asserts (the ShapeEnv then replaces them by
               it); the backend is wrapped so the range checks Dynamo repeats
               for each copy are dropped before it sees the graph
               (:func:`~branchyard.shapes.graph_checks.drop_implied_range_checks`).
=============  ==============================================================

Where torch lacks what a route relies on (a private hook or class of torch
2.14.1), the entry point warns once with :class:`ShapesFallbackWarning` and
does what torch's native spec does instead.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import warnings
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils import _pytree as pytree

from branchyard.errors import ShapeSpecError, SpecViolationError
from branchyard.shapes.decorator import NATIVE_SPEC_ATTR, get_spec
from branchyard.shapes.diagnostics import explain, find_data_dependent_error
from branchyard.shapes.graph_checks import (
    drop_implied_range_checks,
    drop_tied_symbol_checks,
    insert_dim_checks,
    insert_runtime_asserts,
)
from branchyard.shapes.interop import HAS_NATIVE_SPEC, compiles_through_wrapper, to_torch_spec
from branchyard.shapes.shape_var import DimExpr, evaluate_terms
from branchyard.shapes.spec import ScalarEntry, ShapesSpec, TensorEntry
from branchyard.shapes.symbolic import SymbolicInputs, make_symbolic_inputs, tracing_with
from branchyard.shapes.validation import Binding, Leaf, bind, check_spec_matches_signature, is_tracing, signature_of

__all__ = ["export", "checked_module", "compile", "make_fx", "SpecCompiled", "ShapesFallbackWarning", "resolve_spec"]


logger = logging.getLogger("branchyard")


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", type(fn).__name__)


def _describe(spec: ShapesSpec) -> str:
    return ", ".join(v.describe_range() for v in spec.vars.values()) or "no ShapeVars"


def resolve_spec(fn: Any, spec: ShapesSpec | dict | None) -> ShapesSpec:
    """The spec to use: the explicit one or the attached one, never both, never neither."""
    attached = get_spec(fn)
    if spec is not None and attached is not None:
        raise ShapeSpecError(
            "a spec is attached with @dynamic_spec and another was passed",
            where=getattr(fn, "__qualname__", type(fn).__name__),
            hint="pass only one",
        )
    chosen = spec if spec is not None else attached
    if chosen is None:
        raise ShapeSpecError(
            "no dynamic spec: decorate with @dynamic_spec or pass spec=",
            where=getattr(fn, "__qualname__", type(fn).__name__),
        )
    return chosen if isinstance(chosen, ShapesSpec) else ShapesSpec(chosen)


class ShapesFallbackWarning(UserWarning):
    """branchyard.shapes fell back to torch's native behaviour (see the message)."""


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    logger.info("%s", message)
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, ShapesFallbackWarning, stacklevel=4)


@contextlib.contextmanager
def _without_native_spec(fn: Any) -> Iterator[None]:
    """Hide torch's ``_dynamic_spec`` while we trace with our own fake inputs.

    torch would otherwise read it and fakify our fakes a second time.
    """
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    holder = getattr(target, "__func__", target)
    saved = holder.__dict__.pop(NATIVE_SPEC_ATTR, None) if hasattr(holder, "__dict__") else None
    try:
        yield
    finally:
        if saved is not None:
            holder.__dict__[NATIVE_SPEC_ATTR] = saved


def _raise_explained(
    err: BaseException, inputs: SymbolicInputs, spec: ShapesSpec, int_symbols: dict[Any, str] | None = None
) -> None:
    """Re-raise ``err`` as a DataDependentShapeError in ShapeVar terms, if it is one.
    ``int_symbols``: the symbols torch made for int arguments (export), by var."""
    dde = find_data_dependent_error(err)
    if dde is not None:
        raise explain(err, dde, {**inputs.var_of_symbol(), **(int_symbols or {})}, spec.vars, inputs.derived) from err


# -- export ---------------------------------------------------------------------------


class _FunctionModule(torch.nn.Module):
    """A plain function as a module; the modules it closes over become submodules,
    so their weights are parameters of the exported program, not constants."""

    def __init__(self, fn: Callable[..., Any]):
        super().__init__()
        for name, module in _referenced_modules(fn):
            self.add_module(name, module)
        # an instance attribute, not a bound method: the signature is fn's own
        object.__setattr__(self, "forward", fn)


def _referenced_modules(fn: Callable[..., Any]) -> list[tuple[str, torch.nn.Module]]:
    fn = inspect.unwrap(fn)  # @dynamic_spec's checking wrapper closes over the function, not its modules
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    found: dict[str, torch.nn.Module] = {}
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            value = cell.cell_contents
        except ValueError:  # empty cell
            continue
        if isinstance(value, torch.nn.Module):
            found[name] = value
    for name in code.co_names:
        value = fn.__globals__.get(name)
        if isinstance(value, torch.nn.Module):
            found.setdefault(name, value)
    return list(found.items())


def export(
    fn: Callable[..., Any] | torch.nn.Module,
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
    *,
    spec: ShapesSpec | dict | None = None,
    **export_kwargs: Any,
) -> torch.export.ExportedProgram:
    """``torch.export.export`` with the spec's dims as unbacked symbols, tied to one per ShapeVar.

    ``fn`` may be a plain function (wrapped in a module that owns the modules
    it refers to) or an ``nn.Module``. ``args``/``kwargs`` are example inputs;
    they must satisfy the spec. Extra keyword arguments go to
    ``torch.export.export`` (``strict=True`` too).
    Returns the ``ExportedProgram``; its ``range_constraints`` hold one entry
    per ShapeVar, plus one per other declared dim or int argument (a second
    ``batch``, ``2 * batch``, ``seq - 1``): each has a symbol of its own, tied
    to the vars by a check, so that every input owns the symbols of its sizes
    and torch's re-trace (``run_decompositions``, AOTInductor) keeps the
    checks. ``strict=True`` warns where Dynamo undid that.
    """
    spec = resolve_spec(fn, spec)
    strict = bool(export_kwargs.pop("strict", False))
    if "dynamic_shapes" in export_kwargs:
        raise ShapeSpecError("pass the shapes as spec=, not dynamic_shapes=")
    mod = fn if isinstance(fn, torch.nn.Module) else _FunctionModule(fn)
    if isinstance(args, torch.Tensor):  # export(f, x): one example input, not a tuple of rows
        args = (args,)
    binding = bind(spec, mod, tuple(args), kwargs)
    inputs = make_symbolic_inputs(spec, binding, export=True)
    int_symbols: dict[Any, str] = {}  # filled while tracing: torch's symbol for each var an int argument binds
    # the program takes its inputs the way the example call passed them (like
    # torch.export): keyword arguments stay keywords
    inputs.args, inputs.kwargs = _as_called(binding.arguments, len(tuple(args)))
    scalars = [leaf for leaf in binding.leaves if isinstance(leaf.entry, ScalarEntry) and isinstance(leaf.entry.dim, DimExpr)]
    if scalars:
        export_kwargs["dynamic_shapes"] = _scalar_spec(spec, binding, scalars, mod)
    # strict: Dynamo gives each dim with a symbol of its own a fresh symbol again, tied to nothing
    own_dims = inputs.own_dims if strict else []
    with (
        _without_native_spec(fn),
        # strict: Dynamo re-fakifies our fakes into a ShapeEnv of its own (same
        # symbols and ranges); ours must not be the ambient one then
        contextlib.nullcontext() if strict else tracing_with(inputs),
        _checking_forward(mod, spec, binding, scalars, restate_divisors=strict,
                          int_symbols=None if strict else int_symbols, tie_dims=own_dims),
    ):
        try:
            ep = torch.export.export(mod, inputs.args, inputs.kwargs, strict=strict, **export_kwargs)
        except Exception as err:
            if strict and (find_data_dependent_error(err) is not None or "data-dependent" in str(err)):
                # Dynamo reports its own symbols and no user frame: re-trace to name var and line
                diagnosis = _diagnose_with_make_fx(fn, spec, tuple(args), kwargs)
                if diagnosis is not None:
                    raise diagnosis from err
            _raise_explained(err, inputs, spec, int_symbols)
            raise
    var_of_symbol, derived = _strict_symbols(ep, inputs, binding) if strict else (inputs.var_of_symbol(), inputs.derived)
    if strict and own_dims and _shares_symbols(ep):
        warnings.warn(
            f"branchyard.shapes.export(strict=True) of {_name(fn)}: Dynamo wrote input sizes in other "
            "inputs' symbols; torch.export's re-trace (run_decompositions, "
            "AOTInductor) then does not check that those inputs agree. Export non-strict (the default) "
            "for those.",
            UserWarning,
            stacklevel=2,
        )
    insert_dim_checks(ep.graph_module, var_of_symbol, derived)
    drop_tied_symbol_checks(ep.graph_module, derived)
    # torch.export kept the fakes it was given; the program should carry the
    # caller's example inputs, as plain torch.export's does (save/load, ep.module()(*ep.example_inputs[0]))
    ep.example_inputs = (tuple(args), dict(kwargs or {}))
    # for checked_module(): the spec and the signature its keys name
    ep.branchyard_shapes = (spec, signature_of(mod))  # type: ignore[attr-defined]
    logger.info("shapes.export %s: %s; range constraints %s", _name(fn), _describe(spec), dict(ep.range_constraints))
    return ep


def _shares_symbols(ep: torch.export.ExportedProgram) -> bool:
    """Whether some input's size, as torch will read it, is written in a symbol an
    earlier input's size already is (the ShapeEnv replaced its own symbol)."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    seen: set[Any] = set()
    for node in ep.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        sizes = list(val.shape) if isinstance(val, torch.Tensor) else [val] if isinstance(val, torch.SymInt) else []
        mine = set()
        for d in sizes:
            if isinstance(d, torch.SymInt):
                if free_unbacked_symbols(d.node.expr) & seen:
                    return True
                mine |= free_unbacked_symbols(d.node.expr)
        seen |= mine
    return False


def _strict_symbols(
    ep: torch.export.ExportedProgram, inputs: SymbolicInputs, binding: Binding
) -> tuple[dict[Any, str], dict[Any, Any]]:
    """After a strict export: Dynamo's symbol for each var, checking that every
    declared tensor dim is still that expression of them; and each dim with a
    symbol of its own (``inputs.own_dims``) -> its expression in them.

    Dynamo numbers symbols in its own order (an int argument first takes
    ``u0``), so the symbols are found by position: the tensor user inputs
    follow the flattened example inputs, and a var's symbol is its anchor dim's.
    """
    import sympy
    from torch.utils import _pytree as pytree

    flat = [t for t in pytree.tree_leaves((inputs.args, inputs.kwargs)) if isinstance(t, torch.Tensor)]
    user = set(ep.graph_signature.user_inputs)
    placeholders = [
        n for n in ep.graph.find_nodes(op="placeholder") if n.name in user and isinstance(n.meta.get("val"), torch.Tensor)
    ]
    if len(flat) != len(placeholders):
        raise ShapeSpecError(
            f"strict export has {len(placeholders)} tensor inputs for {len(flat)} example tensors; "
            "cannot match its symbols to the ShapeVars",
            hint="use the default non-strict export",
        )
    traced = {id(fake): node for fake, node in zip(flat, placeholders)}
    fakes = {id(leaf): leaf.get(binding.arguments.arguments) for leaf in binding.leaves}

    def size(leaf: Leaf, i: int) -> Any:
        node = traced[id(fakes[id(leaf)])]
        return node, node.meta["val"].shape[i]

    own = {(id(leaf), i) for leaf, i, _ in inputs.own_dims}
    symbols: dict[str, Any] = {}
    for name, leaf in binding.anchor.items():
        if binding.anchor_dim[name] is not None:
            symbols[name] = size(leaf, binding.anchor_dim[name])[1].node.expr
    derived: dict[Any, Any] = {}
    for leaf in binding.leaves:
        if not isinstance(leaf.entry, TensorEntry):
            continue
        for i, dim in enumerate(leaf.entry.dims):
            if not isinstance(dim, DimExpr) or not set(dim.vars) <= set(symbols):
                continue
            node, actual = size(leaf, i)
            got = actual.node.expr if isinstance(actual, torch.SymInt) else sympy.Integer(actual)
            expected = dim.expr.xreplace({v.symbol: symbols[n] for n, v in dim.vars.items()})
            raw = getattr(actual.node, "_expr", None) if isinstance(actual, torch.SymInt) else None
            if (id(leaf), i) in own and isinstance(raw, sympy.Symbol) and raw not in symbols.values():
                derived[raw] = expected  # tied by the forward's check (_checking_forward's tie_dims)
                continue
            if sympy.simplify(got - expected) != 0:
                raise ShapeSpecError(
                    f"strict export traced {leaf.path} dim {i} as {got}, not {dim} = {expected}; "
                    "its relation to the ShapeVars would go unchecked",
                    where=f"argument {leaf.keys[0]!r}",
                    hint="use the default non-strict export",
                )
    return {sym: name for name, sym in symbols.items()}, derived


def _diagnose_with_make_fx(fn: Any, spec: ShapesSpec, args: tuple, kwargs: dict | None) -> BaseException | None:
    from branchyard.errors import DataDependentShapeError

    try:
        make_fx(fn, spec=None if get_spec(fn) is not None else spec)(*args, **(kwargs or {}))
    except DataDependentShapeError as e:
        return e
    except Exception:  # the re-trace failed differently: report torch's own error
        return None
    return None


def _as_called(arguments: inspect.BoundArguments, n_positional: int) -> tuple[tuple, dict[str, Any]]:
    """``(args, kwargs)`` from bound ``arguments``, the first ``n_positional`` values
    (counting ``*args`` items) positional and the rest keywords."""
    a, k = [], {}
    for p in arguments.signature.parameters.values():
        if p.name not in arguments.arguments:
            continue
        value = arguments.arguments[p.name]
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            a.extend(value)
        elif p.kind is inspect.Parameter.VAR_KEYWORD:
            k.update(value)
        elif p.kind is not inspect.Parameter.KEYWORD_ONLY and len(a) < n_positional:
            a.append(value)
        else:
            k[p.name] = value
    return tuple(a), k


def checked_module(ep: torch.export.ExportedProgram) -> torch.nn.Module:
    """``ep.module()`` that checks each call's inputs against the spec first.

    ``ep`` comes from :func:`export`. A violating input raises
    :class:`~branchyard.errors.SpecViolationError` (argument, dim, ShapeVar,
    range, value) before torch's own input guards and the graph's asserts
    run -- they raise a mix of ``AssertionError`` and ``RuntimeError``. So does
    a non-tensor argument the spec does not declare whose value differs from
    the one the program holds as a constant. A call may pass each argument by
    position or by keyword, whichever way the example call passed it.
    """
    found = getattr(ep, "branchyard_shapes", None)
    if found is None:
        raise ShapeSpecError("this ExportedProgram was not made by branchyard.shapes.export; it carries no spec")
    spec, sig = found
    module = ep.module()
    in_spec = ep.call_spec.in_spec
    # the user inputs the program holds as constants, in the order (args, kwargs) flatten
    from torch.export.graph_signature import ConstantArgument, InputKind

    user = [s.arg for s in ep.graph_signature.input_specs if s.kind is InputKind.USER_INPUT]

    # the leaves the program holds as constants: only they are compared per call
    constants = [(k, arg) for k, arg in enumerate(user) if isinstance(arg, ConstantArgument)]

    def check_inputs(_mod: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        binding = bind(spec, _mod, args, kwargs, sig=sig)
        call = _exported_call_form(binding.arguments, in_spec)
        leaves, got_spec = pytree.tree_flatten(call)
        if got_spec != in_spec:  # e.g. a list argument of another length: torch would raise a raw ValueError
            _raise_structure_mismatch(sig, call, in_spec)
        if len(leaves) == len(user):
            for k, arg in constants:
                if not _same_constant(arg.value, leaves[k]):
                    path, got = pytree.tree_flatten_with_path(call)[0][k]
                    raise _changed_constant(_call_path(sig, path), arg.value, got,
                                            made=("program", "exported", "export"))
        return call

    module.register_forward_pre_hook(check_inputs, with_kwargs=True, prepend=True)
    return module


class _Leaf:
    def __repr__(self) -> str:
        return "*"


def _raise_structure_mismatch(sig: inspect.Signature, call: tuple[tuple, dict], in_spec: Any) -> None:
    """A SpecViolationError naming the first argument whose containers differ from the
    exported call's, both drawn with ``*`` for each value (``[*, *, *]`` vs ``[*, *]``)."""
    expected = pytree.tree_unflatten([_Leaf()] * in_spec.num_leaves, in_spec)
    got = pytree.tree_map(lambda _: _Leaf(), call)
    for side in (0, 1):
        keys = range(len(got[0])) if side == 0 else list(got[1])
        for key in keys:
            want = expected[side][key] if (side == 0 and key < len(expected[0])) or (side == 1 and key in expected[1]) else None
            if repr(want) != repr(got[side][key]):
                name = _call_path(sig, (pytree.SequenceKey(side), pytree.SequenceKey(key) if side == 0 else pytree.MappingKey(key)))
                raise SpecViolationError(
                    f"{name} has the structure {got[side][key]!r}, but the program was exported with {want!r}",
                    where=f"argument {name!r}",
                    hint="pass containers shaped like the example call's to shapes.export, or export again",
                )
    raise SpecViolationError(f"the inputs have the structure {got!r}, but the program was exported with {expected!r}")


def _exported_call_form(arguments: inspect.BoundArguments, in_spec: Any) -> tuple[tuple, dict[str, Any]]:
    """A validated call rearranged into the ``(args, kwargs)`` form the program was
    exported with (``in_spec``): the same positional count, the same keywords.

    A parameter the export call left out is baked in at its default: passing
    another value is refused (the program would silently ignore it).
    """
    args_spec, kwargs_spec = in_spec.child(0), in_spec.child(1)
    n_positional, keywords = args_spec.num_children, list(kwargs_spec.context)
    full = inspect.BoundArguments(arguments.signature, dict(arguments.arguments))
    full.apply_defaults()
    a, k = _as_called(full, n_positional)
    if len(a) != n_positional:
        raise SpecViolationError(
            f"got {len(a)} positional arguments, the program was exported with {n_positional}",
            hint="pass the arguments the way the example call to shapes.export did",
        )
    call_kwargs: dict[str, Any] = {}
    for key in keywords:
        if key not in k:
            raise SpecViolationError(
                f"the program was exported with keyword argument {key!r}, and this call does not give it",
                where=f"argument {key!r}",
            )
        call_kwargs[key] = k.pop(key)
    params = arguments.signature.parameters
    for key, value in k.items():
        given = key in arguments.arguments or key not in params
        default = params[key].default if key in params else inspect.Parameter.empty
        if given and not (default is not inspect.Parameter.empty and _same_constant(default, value)):
            raise SpecViolationError(
                f"{key} is {_show(value)}, but the program was exported without it"
                + (f" and holds its default {default!r}" if default is not inspect.Parameter.empty else ""),
                where=f"argument {key!r}",
                hint="pass it in the example call to shapes.export to make it an input of the program",
            )
    return a, call_kwargs


def _call_path(sig: inspect.Signature, path: tuple) -> str:
    """A readable name for the leaf at ``path`` of ``(args, kwargs)``: ``n``, ``args[1]``, ``cache['k']``."""
    top, rest = path[0].idx, path[1:]
    if top == 1:
        return str(path[1].key) + pytree.keystr(path[2:])
    index = path[1].idx
    positional = [p for p in sig.parameters.values() if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                                    inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    if index < len(positional):
        return positional[index].name + pytree.keystr(rest[1:])
    var = next((p.name for p in sig.parameters.values() if p.kind is inspect.Parameter.VAR_POSITIONAL), "args")
    return f"{var}[{index - len(positional)}]" + pytree.keystr(rest[1:])


def _scalar_spec(spec: ShapesSpec, binding: Binding, scalars: list[Leaf], mod: torch.nn.Module) -> Any:
    """torch's own spec, covering only the int arguments: each becomes an unbacked
    ``IntVar`` with the range its expression can take (torch.export takes no SymInt
    inputs, so this is the one way in). Tensors are absent: they are our fakes."""
    if not HAS_NATIVE_SPEC:
        raise ShapeSpecError(
            f"dynamic int arguments need torch.fx.experimental.dynamic_spec, absent in torch {torch.__version__}",
            hint="make the int static, or use branchyard.shapes.make_fx",
        )
    from torch.fx.experimental import dynamic_spec as native

    def nest(keys: tuple, leaf_spec: Any, into: dict) -> None:
        *parents, last = keys
        node = into
        for k in parents:
            node = node.setdefault(k, {})
        node[last] = leaf_spec

    tree: dict = {}
    for leaf in scalars:
        lo, hi = leaf.entry.dim.bounds()
        nest(leaf.keys, native.IntVar(leaf.path, min=lo, max=hi), tree)

    sig = inspect.signature(mod.forward)

    def as_native(value: Any, param: inspect.Parameter | None) -> Any:
        if not isinstance(value, dict):
            return value
        if param is not None and param.kind is inspect.Parameter.VAR_POSITIONAL or all(isinstance(k, int) for k in value):
            n = max(value) + 1
            return native.SeqSpec([as_native(value.get(i), None) for i in range(n)])
        return native.DictSpec({k: as_native(v, None) for k, v in value.items()})

    params: dict[str, Any] = {}
    for name, sub in tree.items():
        param = sig.parameters[name]
        converted = as_native(sub, param)
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            params["*args"] = list(converted._entries)
        elif param.kind is inspect.Parameter.VAR_KEYWORD:
            params["**kwargs"] = dict(converted._entries)
        else:
            params[name] = converted
    return native.ShapesSpec(native.ParamsSpec(params))


def _anchor_size(binding: Binding, name: str, arguments: dict[str, Any]) -> Any:
    """The size that binds var ``name`` in ``arguments`` (a traced call's bound arguments):
    the dim of its anchor tensor where it is bare, or its int argument."""
    value = binding.anchor[name].get(arguments)
    i = binding.anchor_dim[name]
    return value if i is None else value.shape[i]


@contextlib.contextmanager
def _checking_forward(
    mod: torch.nn.Module,
    spec: ShapesSpec,
    binding: Binding,
    scalars: list[Leaf],
    *,
    restate_divisors: bool,
    int_symbols: dict[Any, str] | None = None,
    tie_dims: Sequence[tuple[Leaf, int, DimExpr]] = (),
) -> Iterator[None]:
    """While exporting, run ``forward`` behind checks written with ``torch._check``:

    * each int argument is tied to its var, ``torch._check(n == expr(vars))`` --
      a runtime assert in the graph, and a replacement the ShapeEnv uses;
    * with ``restate_divisors`` (strict export), each ``multiple_of`` is stated
      again on the traced sizes: Dynamo re-fakifies our inputs into a ShapeEnv
      of its own that keeps the symbols and ranges but not the divisibility facts;
    * each of ``tie_dims`` (strict export: the dims with a symbol of their own,
      which Dynamo's copy leaves tied to nothing) is tied to its expression.

    The vars' values are read from the traced arguments, never closed over:
    Dynamo cannot take a SymInt from outside the frame. Non-strict, the symbol
    torch made for each var an int argument binds goes into ``int_symbols``
    (for error messages in ShapeVar terms).
    """
    divisors = [n for n, v in spec.vars.items() if v.multiple_of > 1] if restate_divisors else []
    if not scalars and not divisors and not tie_dims:
        yield
        return
    original = mod.forward
    sig = inspect.signature(original)
    # sympy is not traced by Dynamo: each expression as plain data, evaluated by evaluate_terms
    scalar_terms = [None if leaf.entry.dim.is_var else leaf.entry.dim.terms() for leaf in scalars]
    tied = [(leaf, i, dim.terms()) for leaf, i, dim in tie_dims]

    def forward_checking(*args: Any, **kwargs: Any) -> Any:
        arguments = sig.bind(*args, **kwargs)
        arguments.apply_defaults()
        env = {name: _anchor_size(binding, name, arguments.arguments) for name in binding.anchor}
        for name in divisors:
            torch._check(env[name] % spec.vars[name].multiple_of == 0)
        for leaf, terms in zip(scalars, scalar_terms):
            value = leaf.get(arguments.arguments)
            dim = leaf.entry.dim
            if dim.is_var and binding.anchor[dim.name] is leaf:
                if int_symbols is not None and isinstance(value, torch.SymInt):
                    int_symbols[value.node.expr] = dim.name
                if dim.multiple_of > 1 and dim.name not in divisors:
                    torch._check(value % dim.multiple_of == 0)
                continue
            torch._check(value == (env[dim.name] if terms is None else evaluate_terms(terms, env)))
        for leaf, i, terms in tied:
            torch._check(leaf.get(arguments.arguments).shape[i] == evaluate_terms(terms, env))
        return original(*args, **kwargs)

    forward_checking.__signature__ = sig  # type: ignore[attr-defined]
    had_instance_forward = "forward" in mod.__dict__
    object.__setattr__(mod, "forward", forward_checking)
    try:
        yield
    finally:
        if had_instance_forward:
            object.__setattr__(mod, "forward", original)
        else:
            del mod.__dict__["forward"]


# -- make_fx --------------------------------------------------------------------------


def make_fx(
    fn: Callable[..., Any] | torch.nn.Module,
    *,
    spec: ShapesSpec | dict | None = None,
    **make_fx_kwargs: Any,
) -> Callable[..., torch.fx.GraphModule]:
    """Like ``torch.fx.experimental.proxy_tensor.make_fx(fn)``, driven by the spec.

    Returns ``trace(*args, **kwargs) -> GraphModule``. Keyword arguments are
    accepted (bound to their positions; the graph takes every argument
    positionally, in signature order). The graph carries runtime asserts for
    each ShapeVar's range and divisor. Tensors ``fn`` closes over (a model's
    weights) become constants of the graph.
    """
    from torch.fx.experimental.proxy_tensor import make_fx as torch_make_fx

    spec = resolve_spec(fn, spec)
    if "dynamic_shapes" in make_fx_kwargs or make_fx_kwargs.get("tracing_mode", "fake") != "fake":
        raise ShapeSpecError("make_fx with a spec traces in 'fake' mode and takes the shapes as spec=")
    make_fx_kwargs.pop("tracing_mode", None)
    make_fx_kwargs.setdefault("_allow_non_fake_inputs", True)

    @functools.wraps(fn if not isinstance(fn, torch.nn.Module) else fn.forward)
    def trace(*args: Any, **kwargs: Any) -> torch.fx.GraphModule:
        binding = bind(spec, fn, args, kwargs)
        sig = binding.arguments.signature
        _apply_named_defaults(binding.arguments)
        inputs = make_symbolic_inputs(spec, binding, export=False)
        fake = sig.bind(*inputs.args, **inputs.kwargs)  # the same binding, fakes in place
        if any(p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD and p.kind is not inspect.Parameter.POSITIONAL_ONLY
               for p in sig.parameters.values()) or inputs.kwargs:
            # make_fx takes positional arguments only: pass every parameter by position
            names = list(fake.arguments)

            def call(*flat: Any) -> Any:
                a, k = _call_arguments(sig, names, flat)
                return fn(*a, **k)

            target, call_args = call, [fake.arguments[n] for n in names]
        else:
            names = list(sig.parameters)[: len(inputs.args)]
            target, call_args = fn, list(inputs.args)
        with _without_native_spec(fn):
            try:
                gm = torch_make_fx(target, tracing_mode="fake", **make_fx_kwargs)(*call_args)
            except Exception as err:
                _raise_explained(err, inputs, spec)
                raise
        insert_runtime_asserts(gm, inputs.shape_env, inputs.var_of_symbol())
        gm.meta["branchyard_shape_symbols"] = {n: s.node.expr for n, s in inputs.symbols.items()}
        gm.register_forward_pre_hook(_InputCheck(spec, sig, names, call_args))
        logger.info("shapes.make_fx %s: %s; %d nodes", _name(fn), _describe(spec), len(gm.graph.nodes))
        return gm

    return trace


def _apply_named_defaults(arguments: inspect.BoundArguments) -> None:
    """Fill in every named parameter the call left out with its default (in place).

    torch's ``make_fx`` passes one value per named parameter of the traced
    function; the graph then takes the defaults as inputs too, and its input
    check fills them in when a call leaves them out. ``*args`` / ``**kwargs``
    that were not passed stay absent.
    """
    given = set(arguments.arguments)
    arguments.apply_defaults()
    for p in arguments.signature.parameters.values():
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD) and p.name not in given:
            del arguments.arguments[p.name]


def _call_arguments(sig: inspect.Signature, names: list[str], flat: Any) -> tuple[list[Any], dict[str, Any]]:
    """``fn``'s ``(args, kwargs)`` from one value per parameter in ``names`` (``*args`` a tuple, ``**kwargs`` a dict)."""
    a: list[Any] = []
    k: dict[str, Any] = {}
    for n, v in zip(names, flat):
        kind = sig.parameters[n].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            a.extend(v)
        elif kind is inspect.Parameter.VAR_KEYWORD:
            k.update(v)
        elif kind is inspect.Parameter.KEYWORD_ONLY:
            k[n] = v
        else:
            a.append(v)
    return a, k


class _InputCheck:
    """A forward pre-hook on the graph :func:`make_fx` returns: each call's inputs
    are checked against the spec, and everything the graph was traced static
    against what it was traced with -- every tensor dim traced as an int (an int
    or ``None`` in the spec, or a parameter the spec does not name), and every
    non-tensor value the spec does not declare (an ``int``, ``float``, ``bool``,
    ``str``, ...: make_fx bakes it into the graph as a constant). The graph
    would otherwise run and silently compute with the traced value."""

    def __init__(self, spec: ShapesSpec, sig: inspect.Signature, names: list[str], traced: list[Any]):
        self.spec, self.sig, self.names = spec, sig, names
        #: per argument: its pytree structure and, per leaf, (path, traced static value or dims)
        self.static: list[tuple[Any, list[tuple[str, Any]]]] = []
        for name, value in zip(names, traced):
            flat, tree = pytree.tree_flatten_with_path(value)
            leaves = []
            for path, leaf in flat:
                if isinstance(leaf, torch.Tensor):
                    leaf = _TracedTensor(tuple(None if isinstance(d, torch.SymInt) else int(d) for d in leaf.shape))
                elif isinstance(leaf, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                    leaf = _DYNAMIC  # declared in the spec: checked by bind()
                leaves.append((name + pytree.keystr(path), leaf))
            self.static.append((tree, leaves))

    def __call__(self, module: torch.nn.Module, args: tuple) -> tuple | None:
        if is_tracing(args):
            return None
        filled = len(args) < len(self.names) and all(
            self.sig.parameters[n].default is not inspect.Parameter.empty for n in self.names[len(args):]
        )
        if filled:  # a call leaving out defaulted parameters, as the traced call may have
            args = tuple(args) + tuple(self.sig.parameters[n].default for n in self.names[len(args):])
        if len(args) != len(self.names):
            raise SpecViolationError(
                f"the graph takes {len(self.names)} inputs ({', '.join(self.names)}), got {len(args)}",
                hint="pass every argument positionally, in the order of the traced function's parameters",
            )
        a, k = _call_arguments(self.sig, self.names, args)
        bind(self.spec, None, tuple(a), k, sig=self.sig)
        for name, value, (tree, traced) in zip(self.names, args, self.static):
            flat, got_tree = pytree.tree_flatten(value)
            if got_tree != tree:
                raise SpecViolationError(
                    f"{name} has the structure {got_tree}, but the graph was traced with {tree}",
                    where=f"argument {name!r}",
                    hint="pass the same structure as when tracing, or trace again",
                )
            for (path, want), got in zip(traced, flat):
                _check_static_leaf(path, want, got)
        return args if filled else None


class _TracedTensor(tuple):
    """A tensor leaf's dims as traced: an int where static, None where symbolic."""


_DYNAMIC = object()  # a leaf traced symbolic: nothing to compare


def _same_constant(want: Any, got: Any) -> bool:
    """Whether ``got`` is the value the graph baked in as ``want``: the same type
    (``5`` and ``5.0`` and ``True`` trace differently) and equal (``nan`` equals
    ``nan``); an object without a plain ``==`` must be the same object."""
    if got is want:
        return True
    if type(got) is not type(want):
        return False
    try:
        equal = want == got
    except Exception:
        return False
    if not isinstance(equal, bool):  # e.g. an elementwise comparison
        return False
    return equal or (isinstance(want, (float, complex)) and want != want and got != got)


def _show(value: Any) -> str:
    """A value for a message: a tensor by its shape, anything else by a short repr."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def _check_static_leaf(path: str, want: Any, got: Any) -> None:
    where = f"argument {path!r}"
    if want is _DYNAMIC:
        return
    if isinstance(want, _TracedTensor):
        if not isinstance(got, torch.Tensor):
            raise SpecViolationError(f"got {type(got).__name__}, the graph was traced with a tensor", where=where)
        if got.dim() != len(want):
            raise SpecViolationError(
                f"got a tensor with {got.dim()} dims {tuple(got.shape)}, the graph was traced with {len(want)}",
                where=where,
            )
        for i, (size, actual) in enumerate(zip(want, got.shape)):
            if size is not None and size != actual:
                raise SpecViolationError(
                    f"{path} dim {i} has size {actual}, but the graph was traced with the static size {size}",
                    where=where,
                    hint="declare the dim with a ShapeVar in the spec to make it dynamic, or trace again",
                )
        return
    if not _same_constant(want, got):
        raise _changed_constant(path, want, got, made=("graph", "traced", "trace"))


def _changed_constant(name: str, want: Any, got: Any, *, made: tuple[str, str, str]) -> SpecViolationError:
    """The error for argument ``name`` given ``got`` where the graph or program
    holds the constant ``want``; ``made``: what holds it, how it was made, the verb."""
    what, made_how, verb = made
    dynamic = f"declare it in the spec as an int size (a ShapeVar) to make it dynamic, or {verb} again"
    return SpecViolationError(
        f"{name} is {_show(got)}, but the {what} was {made_how} with the static value "
        f"{_show(want)}, which it holds as a constant",
        where=f"argument {name!r}",
        hint=dynamic if type(want) is int else f"{verb} again with this value",
    )


# -- compile --------------------------------------------------------------------------


class SpecCompiled:
    """``torch.compile`` d callable that checks each call's inputs against the spec first.

    ``compiled`` is what ``torch.compile`` returned; ``spec`` the spec. A
    violating input raises :class:`~branchyard.errors.SpecViolationError`
    before Dynamo sees it; a data-dependent branch on a declared dim raises
    :class:`~branchyard.errors.DataDependentShapeError` (diagnosed by
    re-tracing the failing call with :func:`make_fx`).
    """

    def __init__(self, fn: Any, spec: ShapesSpec, compiled: Callable[..., Any], validate: bool):
        self.fn = fn
        self.spec = spec
        self.compiled = compiled
        self.validate = validate
        self._signature = signature_of(fn)
        check_spec_matches_signature(spec, self._signature, where=getattr(fn, "__qualname__", type(fn).__name__))
        functools.update_wrapper(self, fn if not isinstance(fn, torch.nn.Module) else fn.forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.validate:
            bind(self.spec, self.fn, args, kwargs, sig=self._signature)
        try:
            return self.compiled(*args, **kwargs)
        except Exception as err:
            if find_data_dependent_error(err) is None and "data-dependent" not in str(err):
                raise
            diagnosis = self._diagnose(args, kwargs)
            if diagnosis is None:
                raise
            raise diagnosis from err

    def __getattr__(self, name: str) -> Any:
        # a compiled module still answers .parameters(), .state_dict(), ...
        if name in ("fn", "spec", "compiled", "validate", "_signature"):
            raise AttributeError(name)
        return getattr(self.compiled, name)

    def _diagnose(self, args: tuple, kwargs: dict) -> BaseException | None:
        return _diagnose_with_make_fx(self.fn, self.spec, args, kwargs)


class _OneRangeCheckPerVar:
    """A ``torch.compile`` backend: drops the range checks Dynamo repeats for each
    copy of a shared var (:func:`~branchyard.shapes.graph_checks.drop_implied_range_checks`),
    then hands the graph to the backend the user asked for."""

    def __init__(self, inner: Any):
        self.inner = inner
        # torch names the backend after this (repro scripts, logs)
        self.__name__ = getattr(inner, "compiler_name", None) or getattr(inner, "__name__", type(inner).__name__)
        self.dropped = 0  # range asserts removed so far, over all graphs

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list, **kwargs: Any) -> Any:
        dropped = drop_implied_range_checks(gm)
        self.dropped += dropped
        logger.debug("shapes.compile: dropped %d range checks implied by Eq ties", dropped)
        return self.inner(gm, example_inputs, **kwargs)

    def reset(self) -> None:  # torch._dynamo.reset() resets backends that have it
        if hasattr(self.inner, "reset"):
            self.inner.reset()

    def get_compiler_config(self) -> Any:
        get = getattr(self.inner, "get_compiler_config", None)
        return get() if get is not None else None


#: The private classes torch.compile (2.14) builds its backend object with, and
#: how they are called: (mode, options, dynamic, name) / (backend, mode, options, dynamic).
TORCH_BACKEND_CLASSES = {"inductor": "_TorchCompileInductorWrapper", "other": "_TorchCompileWrapper"}


def _torch_backend(backend: Any, mode: str | None, options: dict | None, name: str | None) -> Any:
    """The backend object ``torch.compile`` itself builds from backend/mode/options,
    or None (after a one-time warning) where this torch has no such classes or
    they take other arguments."""
    try:
        if backend == "inductor":
            return getattr(torch, TORCH_BACKEND_CLASSES["inductor"])(mode, options, None, name)
        return getattr(torch, TORCH_BACKEND_CLASSES["other"])(backend, mode, options, None)
    except (AttributeError, TypeError) as err:
        _warn_once(
            "compile-backend",
            f"branchyard.shapes.compile cannot wrap the backend on torch {torch.__version__} ({err}); "
            "shared vars keep Dynamo's range check per input",
        )
        return None


def _share_range_checks(compile_kwargs: dict[str, Any]) -> None:
    """Route ``compile_kwargs``'s backend through :class:`_OneRangeCheckPerVar` (in place).

    ``mode`` / ``options`` are consumed here, the way ``torch.compile`` would;
    ``guard_filter_fn``, an option ``torch.compile`` reads itself, stays with it.
    """
    if compile_kwargs.get("mode") is not None and compile_kwargs.get("options") is not None:
        return  # torch.compile refuses both at once; let it say so
    options = dict(compile_kwargs.get("options") or {})
    if options.get("use_aoti"):
        _warn_once("aoti", "branchyard.shapes.compile with use_aoti: shared vars keep Dynamo's range check per input")
        return
    backend = compile_kwargs.get("backend")
    if backend is None:
        try:
            from torch._dynamo.backends.registry import get_default_backend

            backend = get_default_backend()
        except ImportError:
            backend = "inductor"
    torch_level = {k: options.pop(k) for k in ("guard_filter_fn",) if k in options}
    inner = _torch_backend(backend, compile_kwargs.get("mode"), options or None, compile_kwargs.get("name"))
    if inner is None:
        return
    compile_kwargs.pop("mode", None)
    compile_kwargs["options"] = torch_level or None
    compile_kwargs["backend"] = _OneRangeCheckPerVar(inner)


def compile(
    fn: Callable[..., Any] | torch.nn.Module,
    *,
    spec: ShapesSpec | dict | None = None,
    validate: bool = True,
    **compile_kwargs: Any,
) -> SpecCompiled:
    """``torch.compile(fn)`` with the spec's dims unbacked, plus input validation.

    Extra keyword arguments go to ``torch.compile`` (``backend``, ``mode``,
    ``options``, ...); ``fullgraph`` defaults to True, so a data-dependent
    branch on a declared dim is an error rather than a silent graph break.
    ``validate=False`` skips the per-call check (a few microseconds of Python
    per call). A var shared by several inputs is one symbol to the compiler,
    with one set of range checks in the graph the backend receives.
    """
    spec = resolve_spec(fn, spec)
    if not HAS_NATIVE_SPEC:
        raise ShapeSpecError(
            f"torch {torch.__version__} has no torch.fx.experimental.dynamic_spec for torch.compile to read",
            hint="use branchyard.shapes.export or make_fx on this torch",
        )
    if "dynamic_shapes" in compile_kwargs or "dynamic" in compile_kwargs:
        raise ShapeSpecError("the spec decides what is dynamic: drop dynamic= / dynamic_shapes=")
    # The spec promises one graph for every size in range; a graph break would
    # hide a data-dependent branch on a declared dim instead of reporting it.
    compile_kwargs.setdefault("fullgraph", True)
    _share_range_checks(compile_kwargs)
    attached_native = getattr(fn.forward if isinstance(fn, torch.nn.Module) else fn, NATIVE_SPEC_ATTR, None)
    if compiles_through_wrapper(fn):
        # Dynamo traces inner(*args, **kwargs): key the spec by position, and
        # hide the by-name spec @dynamic_spec attached, which torch would prefer
        compile_kwargs["dynamic_shapes"] = to_torch_spec(spec, fn, by_position=True)
        with _without_native_spec(fn):
            compiled = torch.compile(fn, **compile_kwargs)
    else:
        if attached_native is None:
            compile_kwargs["dynamic_shapes"] = to_torch_spec(spec, fn)
        compiled = torch.compile(fn, **compile_kwargs)
    logger.info("shapes.compile %s: %s", _name(fn), _describe(spec))
    return SpecCompiled(fn, spec, compiled, validate)
