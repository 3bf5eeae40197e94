"""Which graph nodes can never raise: the allow-list behind every decision
to compute something on a path the original program does not take.

A pass that moves a computation out of the branch guarding it (hoisting a
nested cond's predicate, dropping a dead node) changes *which inputs reach
it*. That is only sound when the node cannot raise for any input value of
the dtypes and shapes the graph was traced with. A node qualifies when its
target is in :data:`RAISE_FREE` and that row's condition holds for the node;
everything else (indexing, gathers, embeddings, integer division, ``item``,
asserts, random ops, anything not listed) is treated as possibly raising.
A list of ops that *may* raise always misses one; this list can only miss
an op that is safe, which costs an optimization, never correctness.

Shape and dtype errors (mismatched broadcasts, ``-`` on bools) are raised
while the graph is traced, from the example values, so they cannot appear
later for other values. Strides are not guarded: an input of the traced
shape may arrive transposed, so ``view`` (which raises where its strides
cannot express the new shape) is not on the list, while ``reshape`` is.
The table also guards against errors that depend on the *values*: an index out of range, an integer division by zero,
a negative integer power, a reduction with no identity over an empty
dimension whose size is only known at run time::

    >>> import torch
    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> f = lambda t, i, j: (torch.embedding(t, i).sum() > 0, i // 2, i // j)
    >>> gm = make_fx(f)(torch.ones(4, 2), torch.tensor(1), torch.tensor(2))
    >>> for n in gm.graph.nodes:
    ...     if n.op == "call_function":
    ...         print(n.name, "|", raise_reason(n))
    embedding | aten.embedding.default is not on the raise-free list
    sum_1 | None
    gt | None
    floor_divide | None
    floor_divide_1 | aten.floor_divide.default: it raises for some torch.int64 inputs (a zero divisor)
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.fx import Node

__all__ = ["RAISE_FREE", "RAISE_FREE_METHODS", "RaiseFreeRule", "raise_reason", "may_raise"]

aten = torch.ops.aten


def _val(x: Any) -> Any:
    if not isinstance(x, Node):
        return x
    return x.meta.get("val", x.meta.get("example_value"))


def _out_dtype(node: Node) -> torch.dtype | None:
    v = _val(node)
    return v.dtype if isinstance(v, torch.Tensor) else None


def _floating_result(node: Node, what: str) -> str | None:
    dt = _out_dtype(node)
    if dt is None:
        return "its result dtype is unknown"
    if dt.is_floating_point or dt.is_complex:
        return None
    return f"it raises for some {dt} inputs ({what})"


def _float_or_nonzero_divisor(node: Node) -> str | None:
    """``x / y``, ``x // y``, ``x % y`` raise only on integers, when ``y`` is zero."""
    c = node.args[1] if len(node.args) > 1 else None
    if isinstance(c, (int, float)) and not isinstance(c, bool) and c != 0:
        return None
    return _floating_result(node, "a zero divisor")


def _float_or_nonnegative_exponent(node: Node) -> str | None:
    """``x ** y`` raises only on integers, when ``y`` is negative."""
    e = node.args[1] if len(node.args) > 1 else None
    if isinstance(e, (int, float)) and not isinstance(e, bool) and e >= 0:
        return None
    return _floating_result(node, "a negative exponent")


def _float_only(node: Node) -> str | None:
    """Integer matrix products have no kernel on some devices."""
    return _floating_result(node, "no integer kernel on some devices")


def _static_nonempty_input(node: Node) -> str | None:
    """max/min/argmax/...: an empty reduction has no identity and raises."""
    v = _val(node.args[0]) if node.args else None
    if not isinstance(v, torch.Tensor):
        return "its input has no example value"
    if not all(isinstance(s, int) for s in v.shape):
        return f"its input shape {tuple(v.shape)} is symbolic and may be empty"
    if v.numel() == 0:
        return "its input is empty"
    return None


def _static_shape(node: Node) -> str | None:
    """select/unbind/split with constants: in range for the traced static shape."""
    v = _val(node.args[0]) if node.args else None
    if not isinstance(v, torch.Tensor):
        return "its input has no example value"
    if not all(isinstance(s, int) for s in v.shape):
        return f"its input shape {tuple(v.shape)} is symbolic"
    return None


def _same_device(node: Node) -> str | None:
    """A cast may not move data to another device (that can fail at run time)."""
    dev = node.kwargs.get("device")
    src = _val(node.args[0]) if node.args else None
    if dev is None or (isinstance(src, torch.Tensor) and torch.device(dev) == src.device):
        return None
    return "it moves data to another device"


def _getitem_of_tuple(node: Node) -> str | None:
    """``getitem`` on a multi-output op's tuple picks an output; on a tensor it indexes."""
    src = _val(node.args[0])
    if isinstance(src, (tuple, list)) and isinstance(node.args[1], int):
        return None
    return "it indexes a tensor or a sequence by a value"


def _always(node: Node) -> str | None:
    return None


@dataclass(frozen=True)
class RaiseFreeRule:
    """A family of targets that never raise for any input value, provided
    ``condition(node)`` returns None (else it returns why this node may)."""

    name: str
    targets: tuple[Any, ...]
    condition: Callable[[Node], str | None] = _always


def _ops(*names: str) -> tuple[Any, ...]:
    """aten overloads by ``"packet.overload"`` name; missing ones are skipped (older torch)."""
    out = []
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(aten, packet, None), overload or "default", None)
        if op is not None:
            out.append(op)
    return tuple(out)


#: The allow-list, one row per family. Anything absent may raise.
RAISE_FREE: tuple[RaiseFreeRule, ...] = (
    RaiseFreeRule("comparison", _ops(
        *(f"{op}.{ov}" for op in ("eq", "ne", "lt", "le", "gt", "ge") for ov in ("Scalar", "Tensor")),
        "isnan.default", "isinf.default", "isfinite.default", "isposinf.default", "isneginf.default",
        "signbit.default", "eq.default",
    ) + (operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge,
         torch.eq, torch.ne, torch.lt, torch.le, torch.gt, torch.ge)),
    RaiseFreeRule("logical and bitwise", _ops(
        "logical_and.default", "logical_or.default", "logical_xor.default", "logical_not.default",
        *(f"{op}.{ov}" for op in ("bitwise_and", "bitwise_or", "bitwise_xor", "__and__", "__or__", "__xor__")
          for ov in ("Tensor", "Scalar")),
        "bitwise_not.default", "__invert__.default",
    ) + (operator.and_, operator.or_, operator.xor, operator.invert, operator.not_,
         torch.logical_and, torch.logical_or, torch.logical_not, torch.sym_not)),
    RaiseFreeRule("elementwise arithmetic", _ops(
        "add.Tensor", "add.Scalar", "sub.Tensor", "sub.Scalar", "rsub.Tensor", "rsub.Scalar",
        "mul.Tensor", "mul.Scalar", "div.Tensor", "div.Scalar", "neg.default", "abs.default",
        "sign.default", "sgn.default", "maximum.default", "minimum.default", "fmax.default", "fmin.default",
        "clamp.default", "clamp.Tensor", "clamp_min.default", "clamp_max.default",
        "where.self", "where.ScalarSelf", "where.ScalarOther", "where.Scalar", "masked_fill.Scalar",
        "square.default", "lerp.Scalar", "addcmul.default",
    ) + (operator.add, operator.sub, operator.mul, operator.neg, operator.pos, operator.abs,
         torch.add, torch.sub, torch.mul, torch.neg, torch.abs, torch.where, torch.clamp,
         torch.maximum, torch.minimum, torch.sym_max, torch.sym_min)),
    RaiseFreeRule("elementwise math", _ops(
        "exp.default", "exp2.default", "expm1.default", "log.default", "log2.default", "log10.default",
        "log1p.default", "sqrt.default", "rsqrt.default", "reciprocal.default", "sin.default", "cos.default",
        "tan.default", "tanh.default", "sinh.default", "cosh.default", "asin.default", "acos.default",
        "atan.default", "atan2.default", "sigmoid.default", "relu.default", "gelu.default", "silu.default",
        "erf.default", "floor.default", "ceil.default", "round.default", "trunc.default", "frac.default",
        "hardtanh.default", "leaky_relu.default", "softplus.default", "nan_to_num.default",
    ) + (torch.sin, torch.cos, torch.exp, torch.tanh, torch.sigmoid, torch.relu)),
    RaiseFreeRule("division and remainder", _ops(
        "div.Tensor_mode", "div.Scalar_mode", "floor_divide.default", "floor_divide.Scalar", "remainder.Tensor",
        "remainder.Scalar", "fmod.Tensor", "fmod.Scalar",
    ), _float_or_nonzero_divisor),
    RaiseFreeRule("power", _ops("pow.Tensor_Tensor", "pow.Tensor_Scalar", "pow.Scalar"), _float_or_nonnegative_exponent),
    RaiseFreeRule("reduction with an identity", _ops(
        "sum.default", "sum.dim_IntList", "mean.default", "mean.dim", "prod.default", "prod.dim_int",
        "any.default", "any.dim", "any.dims", "all.default", "all.dim", "all.dims", "nansum.default",
        "count_nonzero.default", "count_nonzero.dim_IntList", "linalg_vector_norm.default", "norm.Scalar",
    ) + (torch.sum, torch.mean, torch.any, torch.all)),
    RaiseFreeRule("reduction without an identity", _ops(
        "max.default", "min.default", "amax.default", "amin.default", "argmax.default", "argmin.default",
        "max.dim", "min.dim", "aminmax.default", "logsumexp.default",
    ), _static_nonempty_input),
    # not view, view_as or _unsafe_view: they raise for an input whose strides the new shape cannot keep
    RaiseFreeRule("layout and views", _ops(
        "reshape.default", "expand.default", "permute.default",
        "transpose.int", "t.default", "squeeze.default", "squeeze.dim", "squeeze.dims", "unsqueeze.default",
        "flatten.using_ints", "slice.Tensor", "clone.default", "alias.default", "detach.default",
        "contiguous.default", "lift_fresh_copy.default", "cat.default", "stack.default", "expand_as.default",
        "broadcast_to.default",
    )),
    RaiseFreeRule("views at a constant position", _ops(
        "select.int", "unbind.int", "split.Tensor", "narrow.default",
    ), _static_shape),
    RaiseFreeRule("casts", _ops(
        "_to_copy.default", "to.dtype", "to.dtype_layout", "type_as.default", "_conj.default",
    ), _same_device),
    RaiseFreeRule("constants", _ops(
        "scalar_tensor.default", "full.default", "zeros.default", "ones.default", "zeros_like.default",
        "ones_like.default", "full_like.default", "empty_like.default",
    )),
    RaiseFreeRule("matrix products of floats", _ops(
        "mm.default", "bmm.default", "matmul.default", "linear.default", "addmm.default", "dot.default",
        "mv.default",
    ), _float_only),
    RaiseFreeRule("sizes", _ops(
        "sym_size.int", "sym_numel.default", "sym_stride.int", "sym_storage_offset.default",
    )),
    RaiseFreeRule("output of a multi-output op", (operator.getitem,), _getitem_of_tuple),
)

_TABLE: dict[Any, RaiseFreeRule] = {t: rule for rule in RAISE_FREE for t in rule.targets}

#: ``call_method`` names (graphs from ``torch.fx.symbolic_trace``) that never raise.
RAISE_FREE_METHODS = frozenset(
    "eq ne lt le gt ge __eq__ __ne__ __lt__ __le__ __gt__ __ge__ logical_and logical_or logical_xor logical_not "
    "__and__ __or__ __xor__ __invert__ bitwise_not add sub mul neg abs sign clamp maximum minimum __add__ "
    "__sub__ __mul__ __neg__ __radd__ __rsub__ __rmul__ exp log sqrt sin cos tanh sigmoid relu floor ceil round "
    "sum mean any all float double half bool size dim reshape unsqueeze squeeze permute transpose t expand "
    "contiguous clone detach isnan isfinite".split()
)


def _target_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{target._opname}.{target._overloadname}" if target.namespace == "aten" else str(target)
    return getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)


def raise_reason(node: Node) -> str | None:
    """None if ``node`` can never raise for any input value (see the module
    docstring), else why it might. Placeholders and constants never raise."""
    if node.op in ("placeholder", "output"):
        return None
    if node.op == "get_attr":
        return f"it reads attribute '{node.target}'"
    if node.op == "call_method":
        return None if node.target in RAISE_FREE_METHODS else f"method '{node.target}' is not on the raise-free list"
    if node.op != "call_function":
        return f"it is a {node.op} node"
    rule = _TABLE.get(node.target)
    if rule is None:
        return f"{_target_name(node.target)} is not on the raise-free list"
    why = rule.condition(node)
    return None if why is None else f"{_target_name(node.target)}: {why}"


def may_raise(node: Node) -> bool:
    """Whether dead-code elimination must keep ``node``: it has side effects
    (:meth:`Node.is_impure`, placeholders and outputs included) or might
    raise. Pass it as ``Graph.eliminate_dead_code(is_impure_node=may_raise)``
    so that removing unused nodes never removes an exception."""
    if node.is_impure():
        return True
    return node.op != "get_attr" and raise_reason(node) is not None
