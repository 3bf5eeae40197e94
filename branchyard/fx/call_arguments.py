"""The arguments one call binds, by name, defaults filled in.

Rules about calls read arguments by name -- ``batch_norm`` writes ``running_mean``
when ``training``; ``dropout`` draws nothing when ``train`` is False -- while an FX
node passes them by position, by keyword or not at all. :func:`bind_call` names
them once for every kind of call target:

* an ATen overload (``aten.add_.Tensor``): its schema;
* an op packet (``aten.add_``, ``torch.ops.mylib.op``): each overload the call fits;
* a torch builtin (``torch.batch_norm``), a Tensor method (``"add_"`` of a
  ``call_method`` node, ``torch.Tensor.add_``): the schemas of its ATen op;
* a Python function (``F.dropout``, ``operator.iadd``): its signature.

Each :class:`BoundCall` carries the schema it was bound to (``None`` for a Python
signature), whose alias annotations (``Tensor(a!)``) say what the call writes.

    >>> import torch
    >>> (call,) = bind_call(torch.ops.aten.dropout.default, (torch.ones(2), 0.5), {"train": False})
    >>> call.arguments["train"], call.schema.name
    (False, 'aten::dropout')
    >>> [c.arguments["input"] for c in bind_call(torch.nn.functional.relu, ("x",), {})]
    ['x']
    >>> bind_call(lambda *a: None, (), {})[0].arguments
    {'a': ()}
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["BoundCall", "bind_call", "aten_packet"]


@dataclass(frozen=True, eq=False)
class BoundCall:
    """One way a call binds: argument name -> value (defaults filled in), and the
    ATen schema it was bound to (``None``: a Python signature)."""

    arguments: dict[str, Any]
    schema: torch._C.FunctionSchema | None = None


def bind_call(target: Any, args: tuple, kwargs: dict, *, method: bool = False) -> list[BoundCall] | None:
    """Every way ``target(*args, **kwargs)`` binds to a signature of ``target``.

    ``method=True``: ``target`` is the name of a Tensor method called on ``args[0]``
    (an FX ``call_method`` node). ``[]``: no signature of ``target`` takes these
    arguments; ``None``: ``target`` has no signature to read.
    """
    schemas = _schemas(target, method)
    if schemas is not None:
        bound = [(s, _bind_schema(s, args, kwargs)) for s in schemas]
        return [BoundCall(b, s) for s, b in bound if b is not None]
    if method:
        return None
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    try:
        call = signature.bind(*args, **kwargs)
    except TypeError:
        return []
    call.apply_defaults()
    return [BoundCall(dict(call.arguments))]


def aten_packet(name: str) -> torch._ops.OpOverloadPacket | None:
    """``torch.ops.aten.<name>``, or None where ATen has no op of that name."""
    return _packet("aten", name)


@functools.lru_cache(maxsize=None)
def _packet(namespace: str, name: str) -> torch._ops.OpOverloadPacket | None:
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return None
    return packet if isinstance(packet, torch._ops.OpOverloadPacket) else None


def _schemas(target: Any, method: bool) -> list[torch._C.FunctionSchema] | None:
    if method:
        packet = aten_packet(target) if isinstance(target, str) else None
        return None if packet is None else _packet_schemas(packet)
    if isinstance(target, torch._ops.OpOverload):
        return [target._schema]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return _packet_schemas(target)
    try:
        return _builtin_schemas(target)
    except TypeError:  # unhashable
        return None


def _packet_schemas(packet: torch._ops.OpOverloadPacket) -> list[torch._C.FunctionSchema]:
    return [getattr(packet, name)._schema for name in packet.overloads()]


@functools.lru_cache(maxsize=None)
def _builtin_schemas(target: Any) -> list[torch._C.FunctionSchema] | None:
    """The ATen schemas of a torch builtin (``torch.batch_norm``) or Tensor method
    descriptor (``torch.Tensor.add_``); None for anything else."""
    if not isinstance(target, (type(torch.add), type(torch.Tensor.add_))):
        return None  # Python functions bind by their own signature
    objclass = getattr(target, "__objclass__", None)
    if objclass is not None:
        if not issubclass(torch.Tensor, objclass):
            return None
        packet = aten_packet(target.__name__)
        return None if packet is None else _packet_schemas(packet)
    try:
        _, schemas = torch.fx.operator_schemas.get_signature_for_torch_op(target, return_schemas=True)
    except Exception:  # torch's lookup of a builtin it does not know
        return None
    return list(schemas) if schemas else None


def _bind_schema(schema: torch._C.FunctionSchema, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """Bind as the dispatcher does: positional arguments in order, the rest by name or default."""
    params = schema.arguments
    positional = [a for a in params if not a.kwarg_only]
    if len(args) > len(positional):
        return None
    bound = {a.name: value for a, value in zip(positional, args)}
    names = {a.name for a in params}
    for key, value in kwargs.items():
        name = "self" if key == "input" and "input" not in names else key  # torch.* calls ``self`` ``input``
        if name not in names or name in bound:
            return None
        bound[name] = value
    for a in params:
        if a.name not in bound:
            if not a.has_default_value():
                return None
            bound[a.name] = a.default_value
    return bound
