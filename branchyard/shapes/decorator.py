"""``@dynamic_spec``: declare once which sizes are dynamic, on the function or module.

The decorator attaches two things to the callable (for a module: to its
``forward``):

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
import types
from typing import Any, Callable, TypeVar

import torch

from branchyard.errors import ShapeSpecError
from branchyard.shapes.interop import HAS_NATIVE_SPEC, to_torch_spec
from branchyard.shapes.spec import ShapesSpec
from branchyard.shapes.validation import check_spec_matches_signature, signature_of

__all__ = ["dynamic_spec", "get_spec", "SPEC_ATTR", "NATIVE_SPEC_ATTR"]

SPEC_ATTR = "__branchyard_spec__"
#: the attribute torch 2.14's ``_resolve_dynamic_shapes`` reads
NATIVE_SPEC_ATTR = "_dynamic_spec"

T = TypeVar("T")


def _attach(fn: Callable[..., Any], spec: ShapesSpec, owner: Any) -> None:
    if getattr(fn, SPEC_ATTR, None) is not None or hasattr(fn, NATIVE_SPEC_ATTR):
        raise ShapeSpecError(
            "a dynamic spec is already attached",
            where=getattr(fn, "__qualname__", repr(fn)),
            hint="merge the declarations into one spec",
        )
    check_spec_matches_signature(spec, signature_of(fn), where=getattr(fn, "__qualname__", repr(fn)))
    setattr(fn, SPEC_ATTR, spec)
    if HAS_NATIVE_SPEC:
        setattr(fn, NATIVE_SPEC_ATTR, to_torch_spec(spec, owner))


def _forwarding(forward: Callable[..., Any]) -> Callable[..., Any]:
    """A fresh function object standing for ``forward``, so attributes land on it alone."""

    @functools.wraps(forward)
    def forward_with_spec(self: Any, *args: Any, **kwargs: Any) -> Any:
        return forward(self, *args, **kwargs)

    # functools.wraps copies __dict__, i.e. any spec already on ``forward``
    for attr in (SPEC_ATTR, NATIVE_SPEC_ATTR):
        forward_with_spec.__dict__.pop(attr, None)
    return forward_with_spec


def dynamic_spec(spec: ShapesSpec | dict[str, Any]) -> Callable[[T], T]:
    """Attach ``spec`` to a function, an ``nn.Module`` subclass, or an ``nn.Module`` instance.

    ``spec`` is a :class:`ShapesSpec` or the dict it is built from. Returns a
    decorator that returns its argument (the same function, class or
    instance) with the spec attached. Decorating ``forward`` inside a class
    body works too (spec keys are ``forward``'s parameters, without ``self``).
    """
    spec = spec if isinstance(spec, ShapesSpec) else ShapesSpec(spec)

    def decorate(obj: T) -> T:
        if isinstance(obj, type) and issubclass(obj, torch.nn.Module):
            forward = obj.__dict__.get("forward")
            if forward is None:  # inherited: give this class its own forward to carry the spec
                forward = _forwarding(obj.forward)
                obj.forward = forward  # type: ignore[method-assign]
            _attach(forward, spec, obj)
            return obj
        if isinstance(obj, torch.nn.Module):
            # Only this instance: bind a fresh forward to it.
            forward = _forwarding(type(obj).forward)
            _attach(forward, spec, obj)
            object.__setattr__(obj, "forward", types.MethodType(forward, obj))
            return obj
        if isinstance(obj, types.MethodType):
            raise ShapeSpecError(
                f"cannot attach a spec to the bound method {obj.__qualname__}",
                hint="decorate the function in the class body, the class, or the module instance",
            )
        if not callable(obj):
            raise ShapeSpecError(f"@dynamic_spec decorates a function or nn.Module, got {type(obj).__name__}")
        _attach(obj, spec, obj)  # type: ignore[arg-type]
        return obj

    return decorate


def get_spec(obj: Any) -> ShapesSpec | None:
    """The :class:`ShapesSpec` attached by :func:`dynamic_spec` to ``obj`` (module: its ``forward``)."""
    target = obj.forward if isinstance(obj, torch.nn.Module) else obj
    return getattr(target, SPEC_ATTR, None)
