"""``@dynamic_spec``: declare once which sizes are dynamic, on the function or module.

A decorated function comes back as a checking wrapper (``functools.wraps``);
a decorated class or instance gets a new ``forward``. Before/after, as Python::

    @dynamic_spec(spec)              # becomes
    def f(x): ...                    def f(*args, **kwargs):       # a frame Dynamo runs, never traces
                                         if not tracing: bind(spec, args, kwargs)   # SpecViolationError
                                         return original_f(*args, **kwargs)        # the frame it compiles

    dynamic_spec(spec)(module)       # module.forward(*args, **kwargs):
                                     #     check as above, then forward_with_spec(forward, self, x, ...):
                                     #     a frame with forward's own parameter names, compiled by Dynamo

So torch's own ``torch.compile`` gets a spec violation as a
:class:`~branchyard.errors.SpecViolationError` on any call, and compiles a
frame whose parameter names are the spec's keys (a ``wrapper(*args,
**kwargs)`` frame would match none of them, and recompile per size). The
wrapper carries two attributes:

* ``__branchyard_spec__``: the :class:`ShapesSpec`, read by
  :func:`branchyard.shapes.export` / ``compile`` / ``make_fx``;
* ``_dynamic_spec``: torch's native ``ShapesSpec`` converted from it (torch >=
  2.14), read by torch's own ``torch.compile``, ``torch.export.export`` and
  ``make_fx`` -- so those see the same declaration with nothing else to pass.

It accepts what a person would write (``{"x": (batch, 768)}``) where torch
2.14.1's native decorator accepts the tuple form but then fails at trace time
(``unexpected leaf spec type tuple``). Spec keys are checked against the
signature when decorating, so a typo fails here, not at trace time.

    >>> import torch
    >>> from branchyard.shapes import ShapeVar, dynamic_spec, get_spec
    >>> model = torch.nn.Linear(768, 10)
    >>> batch = ShapeVar("batch", min=2, max=128)
    >>> @dynamic_spec({"x": (batch, 768)})
    ... def forward(x):
    ...     return model(x)
    >>> print(get_spec(forward).params["x"])
    (batch, 768)
"""

from __future__ import annotations

import functools
import inspect
import linecache
import types
from typing import Any, Callable, TypeVar

import torch

from branchyard.errors import ShapeSpecError
from branchyard.shapes.interop import HAS_NATIVE_SPEC, to_torch_spec
from branchyard.shapes.spec import ShapesSpec
from branchyard.shapes.validation import bind, check_spec_matches_signature, is_tracing, signature_of

__all__ = ["dynamic_spec", "get_spec", "SPEC_ATTR", "NATIVE_SPEC_ATTR"]

SPEC_ATTR = "__branchyard_spec__"
#: the attribute torch 2.14's ``_resolve_dynamic_shapes`` reads
NATIVE_SPEC_ATTR = "_dynamic_spec"

T = TypeVar("T")


def _check_attachable(fn: Callable[..., Any], spec: ShapesSpec) -> None:
    if getattr(fn, SPEC_ATTR, None) is not None or hasattr(fn, NATIVE_SPEC_ATTR):
        raise ShapeSpecError(
            "a dynamic spec is already attached",
            where=getattr(fn, "__qualname__", repr(fn)),
            hint="merge the declarations into one spec",
        )
    check_spec_matches_signature(spec, signature_of(fn), where=getattr(fn, "__qualname__", repr(fn)))


def _set_spec(fn: Callable[..., Any], spec: ShapesSpec, owner: Any) -> None:
    setattr(fn, SPEC_ATTR, spec)
    if HAS_NATIVE_SPEC:
        setattr(fn, NATIVE_SPEC_ATTR, to_torch_spec(spec, owner))


def _check(spec: ShapesSpec, sig: inspect.Signature, args: tuple, kwargs: dict) -> None:
    if not is_tracing(args, kwargs):
        bind(spec, None, args, kwargs, sig=sig)


@functools.cache
def _check_outside_dynamo() -> Callable[..., None]:
    """``_check`` for a wrapper's frame: as is when no Dynamo frame hook is active
    (an eager call), else disabled for Dynamo, so that it runs as Python and
    never inside a compiled graph. Made on first use: importing branchyard.shapes
    does not import torch._dynamo (~1.4 s)."""
    disabled = torch._dynamo.disable(_check)
    try:
        from torch._C._dynamo.eval_frame import get_eval_frame_callback
    except ImportError:  # a torch without it: always the disabled form (~10 us more per call)
        return disabled

    def check(spec: ShapesSpec, sig: inspect.Signature, args: tuple, kwargs: dict) -> None:
        (_check if get_eval_frame_callback() is None else disabled)(spec, sig, args, kwargs)

    skip_code_of(check)
    return check


def skip_code_of(fn: Callable[..., Any]) -> None:
    """Dynamo runs ``fn``'s frames as Python (and still compiles the frames they call)."""
    from torch._dynamo.eval_frame import skip_code

    skip_code(fn.__code__)


def _skip_frame(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Dynamo runs ``fn``'s own frame as Python and compiles the frames it calls
    (what ``torch.compiler.disable(recursive=False)`` does, without a wrapper
    that refuses torch.export): so the spec check runs before Dynamo
    fakifies, and guards, the inputs."""
    skip_code_of(fn)
    _check_outside_dynamo()  # made now: a first call from the wrapper would be a frame Dynamo compiles
    return fn


def _checked_function(fn: Callable[..., Any], spec: ShapesSpec) -> Callable[..., Any]:
    """``fn`` behind a check of its inputs against ``spec`` on every call not being traced."""
    sig = signature_of(fn)

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():  # inlined by Dynamo into a caller's graph: no check
            _check_outside_dynamo()(spec, sig, args, kwargs)
        return fn(*args, **kwargs)

    return _skip_frame(checked)


def _named_frame(func: types.FunctionType) -> Callable[..., Any]:
    """``frame(func, <func's parameters>)`` calling ``func``: a function of its
    own whose parameters carry ``func``'s names, for Dynamo to compile.

    torch looks the spec up by the names of the compiled frame's locals, and
    torch.nn's own forwards are frames Dynamo's trace rules skip; a frame with
    a code object per decoration also keeps one compiled-code cache (and one
    recompile limit) per decorated module.
    """
    sig = inspect.signature(func)
    defaults = {n: p.default for n, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}
    params, call = ["_spec_target_"], ["_spec_target_"]
    star_done = False
    for n, p in sig.parameters.items():
        d = f"=_defaults_[{n!r}]" if n in defaults else ""
        if p.kind is inspect.Parameter.POSITIONAL_ONLY:
            params.append(n + d)
            call.append(n)
        elif p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            params.append(n + d)
            call.append(n)
        elif p.kind is inspect.Parameter.VAR_POSITIONAL:
            params.append("*" + n)
            call.append("*" + n)
            star_done = True
        elif p.kind is inspect.Parameter.KEYWORD_ONLY:
            if not star_done:
                params.append("*")
                star_done = True
            params.append(n + d)
            call.append(f"{n}={n}")
        else:
            params.append("**" + n)
            call.append("**" + n)
    if any(p.kind is inspect.Parameter.POSITIONAL_ONLY for p in sig.parameters.values()):
        last = max(i for i, p in enumerate(sig.parameters.values()) if p.kind is inspect.Parameter.POSITIONAL_ONLY)
        params.insert(last + 2, "/")
    name = f"{func.__name__}_with_spec"
    filename = f"<dynamic_spec: {func.__qualname__}>"
    source = f"def {name}({', '.join(params)}):\n    return {call[0]}({', '.join(call[1:])})\n"
    namespace: dict[str, Any] = {"_defaults_": defaults}
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 -- names come from a signature
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    return namespace[name]


def _module_forward(forward: Callable[..., Any], spec: ShapesSpec) -> Callable[..., Any]:
    """A ``forward`` for a decorated module: check the inputs, then call
    ``forward`` through the frame Dynamo compiles (:func:`_named_frame`)."""
    func = getattr(forward, "__func__", forward)
    frame = _named_frame(func)
    sig = signature_of(func)
    sig = sig.replace(parameters=list(sig.parameters.values())[1:])  # without self

    @functools.wraps(func)
    def forward_with_spec(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            _check_outside_dynamo()(spec, sig, args, kwargs)
        return frame(func, self, *args, **kwargs)

    for attr in (SPEC_ATTR, NATIVE_SPEC_ATTR):  # functools.wraps copies __dict__
        forward_with_spec.__dict__.pop(attr, None)
    return _skip_frame(forward_with_spec)


def dynamic_spec(spec: ShapesSpec | dict[str, Any]) -> Callable[[T], T]:
    """Attach ``spec`` to a function, an ``nn.Module`` subclass, or an ``nn.Module`` instance.

    ``spec`` is a :class:`ShapesSpec` or the dict it is built from. Returns a
    decorator. A function comes back wrapped (``functools.wraps``: same name,
    signature and ``__wrapped__``); a class or instance comes back itself, with
    a new ``forward``. Decorating ``forward`` inside a class body works too
    (spec keys are ``forward``'s parameters, without ``self``).

    Every call that is not being traced checks its inputs first: an input
    outside the spec raises :class:`~branchyard.errors.SpecViolationError`
    naming the argument, dim and ShapeVar -- eagerly, and through torch's own
    ``torch.compile`` on the first call as on any later one.
    """
    spec = spec if isinstance(spec, ShapesSpec) else ShapesSpec(spec)

    def decorate(obj: T) -> T:
        if isinstance(obj, type) and issubclass(obj, torch.nn.Module):
            own = obj.__dict__.get("forward")
            if own is not None:
                _check_attachable(own, spec)  # a spec on this class's own forward already: two declarations
                forward = own
            else:  # inherited: this class gets its own forward, with its own spec
                forward = _without_spec(obj.forward)
                check_spec_matches_signature(spec, signature_of(forward), where=obj.__qualname__)
            _require_python_function(forward)
            new = _module_forward(forward, spec)
            _set_spec(new, spec, new)
            obj.forward = new  # type: ignore[method-assign]
            return obj
        if isinstance(obj, torch.nn.Module):
            # Only this instance: bind a fresh forward to it (its class's spec, if any, gives way).
            if "forward" in obj.__dict__:
                _check_attachable(obj.__dict__["forward"], spec)
            forward = _without_spec(type(obj).forward)
            check_spec_matches_signature(spec, signature_of(obj), where=type(obj).__qualname__)
            _require_python_function(forward)
            new = _module_forward(forward, spec)
            _set_spec(new, spec, new)
            object.__setattr__(obj, "forward", types.MethodType(new, obj))
            return obj
        if isinstance(obj, types.MethodType):
            raise ShapeSpecError(
                f"cannot attach a spec to the bound method {obj.__qualname__}",
                hint="decorate the function in the class body, the class, or the module instance",
            )
        if isinstance(obj, (staticmethod, classmethod)):
            # decorate the function inside and keep the wrapper: a bare function in
            # a class body would become an instance method (self taken as the first input)
            return type(obj)(decorate(obj.__func__))  # type: ignore[return-value]
        if not callable(obj):
            raise ShapeSpecError(f"@dynamic_spec decorates a function or nn.Module, got {type(obj).__name__}")
        _check_attachable(obj, spec)  # type: ignore[arg-type]
        checked = _checked_function(obj, spec)  # type: ignore[arg-type]
        _set_spec(checked, spec, obj)
        return checked  # type: ignore[return-value]

    return decorate


def _without_spec(forward: Any) -> Any:
    """The function under a forward that :func:`dynamic_spec` made (inherited from a
    decorated class), so that a new spec replaces the old instead of stacking on it."""
    func = getattr(forward, "__func__", forward)
    if getattr(func, SPEC_ATTR, None) is not None and hasattr(func, "__wrapped__"):
        return func.__wrapped__
    return func


def _require_python_function(forward: Any) -> None:
    func = getattr(forward, "__func__", forward)
    if not isinstance(func, types.FunctionType):
        raise ShapeSpecError(
            f"cannot attach a spec to a forward of type {type(func).__name__}",
            where=getattr(func, "__qualname__", repr(func)),
            hint="define forward as a Python method",
        )


def get_spec(obj: Any) -> ShapesSpec | None:
    """The :class:`ShapesSpec` attached by :func:`dynamic_spec` to ``obj`` (module: its ``forward``)."""
    target = obj.forward if isinstance(obj, torch.nn.Module) else obj
    return getattr(target, SPEC_ATTR, None)
