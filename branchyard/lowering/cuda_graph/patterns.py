"""Patterns the capture folds into fewer CUDA graph nodes, as tables (no GPU needed).

Every node inside a loop body costs one node launch per trip, so the capture
recognises two shapes of FX node and emits less for them:

**Comparisons a set kernel evaluates itself.** A predicate ``a <op> b`` on 0-d
operands (``lt le gt ge eq ne``; tensors of one dtype, or a tensor and a Python
number) that only feeds a conditional node is not run as a torch kernel: the
set kernel reads ``a`` and ``b`` and compares them itself::

    before: p = lt(i, n); set(h, p)          after: set_cmp(h, "lt", &i, &n)

**Counters the step kernel increments.** A loop carry the body returns as
``i + k`` (``i`` a 0-d integer carry, ``k`` a Python int, the sum used for
nothing else) while ``cond_fn`` reads ``i`` only through a comparison the
set kernel evaluates: the addition moves into the loop's step kernel::

    before: j = add(i, 1); step(h, j < n, i <- j)       after: step(h, i += 1; i < n)

**Switch indices a set kernel computes itself.** The integer steps that
turn a value into a switch index -- ``clamp`` and Python-style ``remainder`` by
Python ints, after an optional ``argmax`` of a small tensor -- are not run as
torch kernels when they feed only the switch's index: the set kernel reads the
source, applies them and sets the handle (up to :data:`MAX_INDEX_STEPS` steps,
``argmax`` over up to :data:`MAX_ARGMAX_ELEMENTS` elements)::

    before: i = argmax(v); j = clamp(i, -1, 6); k = remainder(j, 7); set(h, k)
    after:  set_program(h, argmax(&v); max -1; min 6; mod 7)

**Routers a set kernel computes itself.** A mixture-of-experts router --
``argmax(x.mean(0) @ w)`` (or ``argmax(v @ w)`` for a vector ``v``) -- whose
argmax feeds only the switch's index is not run as a mean kernel, a GEMV and
the set kernel: one set kernel of one block reads ``x`` and ``w``, computes the
logits (each intermediate rounded to the input dtype, as torch stores it) and
sets the handle, for up to :data:`MAX_ROUTER_ELEMENTS` elements of ``x`` and
``w`` together (larger routers stay torch kernels, which are faster there)::

    before: m = mean(x, 0); l = matmul(m, w); i = argmax(l); set(h, i)
    after:  set_router(h, argmax(mean(&x) @ &w))

**Outputs written in place.** An op whose result is a branch's output and that
has an ``out=`` form writes straight into the conditional node's output buffer,
so no copy node follows it::

    before: t = add(u, b); copy(out, t)      after: add(u, b, out=out)

:func:`match_comparison` and :func:`out_form` return ``None`` (and say why at
debug level) when a node does not fit; the capture then runs it as torch would.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch

from branchyard.fx.mutation import call_writes, nothing_written_between

__all__ = [
    "COMPARE_CODES",
    "DTYPE_CODES",
    "COMPARISONS",
    "INCREMENTS",
    "Comparison",
    "IndexProgram",
    "INDEX_STEPS",
    "ROUTER_STEPS",
    "RouterLogits",
    "RowMean",
    "router_feeds_switch",
    "SET_KERNEL_STEPS",
    "set_kernel_step",
    "index_chain",
    "evaluate_index_chain",
    "match_router_step",
    "feeds_only_switch_index",
    "match_comparison",
    "match_index_step",
    "match_increment",
    "out_form",
]

log = logging.getLogger("branchyard")
aten = torch.ops.aten

#: comparison name -> the set kernel's op code (0 is "read a bool flag").
COMPARE_CODES: dict[str, int] = {"lt": 1, "le": 2, "gt": 3, "ge": 4, "eq": 5, "ne": 6}
#: ``b <op> a`` written as ``a <mirror> b``, for a number on the left.
_MIRROR = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq", "ne": "ne"}
#: tensor dtype -> the set kernel's dtype code; the kernel compares integers as int64 (exact).
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.int64: 1,
    torch.int32: 2,
    torch.float32: 3,
    torch.float64: 4,
    torch.int16: 5,
    torch.int8: 6,
    torch.uint8: 7,
}


def _comparison_targets() -> dict[Any, str]:
    table: dict[Any, str] = {}
    for name in COMPARE_CODES:
        table[getattr(operator, name)] = name  # symbolic_trace / Dynamo: operator.lt
        table[getattr(torch, name)] = name  # torch.lt
        packet = getattr(aten, name)  # export: aten.lt.Tensor / aten.lt.Scalar
        table[packet.Tensor] = name
        table[packet.Scalar] = name
    return table


#: FX ``call_function`` target -> comparison name.
COMPARISONS: dict[Any, str] = _comparison_targets()


@dataclass(frozen=True)
class Comparison:
    """``lhs <op> rhs`` left for a set kernel: ``lhs`` a 0-d tensor, ``rhs`` one of its dtype or a number."""

    op: str
    lhs: torch.Tensor
    rhs: torch.Tensor | int | float

    @property
    def dtype(self) -> torch.dtype:
        return self.lhs.dtype

    def evaluate(self) -> torch.Tensor:
        """The 0-d bool tensor torch would compute (for callers that need a tensor after all)."""
        return getattr(torch, self.op)(self.lhs, self.rhs)


def _scalar_fits(value: int | float, dtype: torch.dtype) -> str | None:
    """Why a Python number compared with a ``dtype`` tensor cannot be read as that dtype (None: it can)."""
    if isinstance(value, bool):
        return "a bool operand"
    if dtype.is_floating_point:
        return None  # torch compares in the tensor's float dtype: the kernel casts the same way
    if isinstance(value, float):
        return "an integer tensor against a float (torch promotes to the default float dtype)"
    info = torch.iinfo(dtype)
    if not info.min <= value <= info.max:
        return f"the number {value} does not fit {dtype}"
    return None


def match_comparison(target: Any, args: tuple, kwargs: dict, *, require_cuda: bool = True) -> Comparison | None:
    """A :class:`Comparison` if ``target(*args, **kwargs)`` is one a set kernel can evaluate exactly.

        >>> import operator, torch
        >>> i = torch.tensor(3)
        >>> match_comparison(operator.lt, (i, 10), {}, require_cuda=False).op
        'lt'
        >>> match_comparison(operator.lt, (10, i), {}, require_cuda=False).op   # mirrored: i > 10
        'gt'
        >>> match_comparison(operator.lt, (i, 2.5), {}, require_cuda=False) is None   # torch promotes to float
        True
    """
    op = COMPARISONS.get(target) if _hashable(target) else None
    if op is None:
        return None
    why = _why_not(args, kwargs, require_cuda)
    if why:
        log.debug("comparison %s stays a torch kernel: %s", op, why)
        return None
    lhs, rhs = args
    if not isinstance(lhs, torch.Tensor):
        lhs, rhs, op = rhs, lhs, _MIRROR[op]
    return Comparison(op, lhs, rhs)


def _why_not(args: tuple, kwargs: dict, require_cuda: bool) -> str | None:
    if kwargs or len(args) != 2:
        return "not two positional operands"
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    numbers = [a for a in args if isinstance(a, (int, float)) and not isinstance(a, torch.Tensor)]
    if not tensors or len(tensors) + len(numbers) != 2:
        return "operands are not a tensor and a tensor or number"
    if any(t.dim() != 0 for t in tensors):
        return "an operand is not 0-d"
    if require_cuda and any(not t.is_cuda for t in tensors):
        return "an operand is not on a CUDA device"
    dtype = tensors[0].dtype
    if dtype not in DTYPE_CODES:
        return f"dtype {dtype} has no set-kernel code"
    if len(tensors) == 2:
        return None if tensors[1].dtype == dtype else f"mixed dtypes {dtype} and {tensors[1].dtype}"
    return _scalar_fits(numbers[0], dtype)


def _hashable(target: Any) -> bool:
    try:
        hash(target)
    except TypeError:
        return False
    return True


# --------------------------------------------------------------------------- switch indices
#: Index steps per set kernel (its immediate operands).
MAX_INDEX_STEPS = 4
#: Largest tensor the set kernel's single thread takes an argmax of.
MAX_ARGMAX_ELEMENTS = 1024
#: step name -> the set kernel's op code.
INDEX_STEP_CODES: dict[str, int] = {"max": 1, "min": 2, "mod": 3}
#: dtype -> code for the tensor an argmax reads (the comparison codes plus two 16-bit floats).
ARGMAX_DTYPE_CODES: dict[torch.dtype, int] = {**DTYPE_CODES, torch.bfloat16: 8, torch.float16: 9}
#: FX targets of the index steps (export's aten overloads and their torch functions).
INDEX_STEPS: dict[Any, str] = {
    aten.clamp.default: "clamp", torch.clamp: "clamp",
    aten.remainder.Scalar: "remainder", torch.remainder: "remainder", operator.mod: "remainder",
    aten.argmax.default: "argmax", torch.argmax: "argmax",
}


@dataclass(frozen=True)
class IndexProgram:
    """A switch index left for the set kernel: ``source`` (a 0-d integer tensor, or
    with ``argmax`` a small contiguous tensor), then ``steps`` of ``("max", lo)``,
    ``("min", hi)`` or ``("mod", n)`` on int64. As Python::

        i = int(argmax(source)) if argmax else int(source)
        for op, a in steps:
            i = max(i, a) if op == "max" else min(i, a) if op == "min" else i % a
    """

    source: "torch.Tensor | RouterLogits"
    argmax: bool = False
    steps: tuple[tuple[str, int], ...] = ()

    def evaluate(self) -> torch.Tensor:
        """The index as the torch kernels compute it (where a tensor is needed after all)."""
        source = self.source.evaluate() if isinstance(self.source, RouterLogits) else self.source
        i = torch.argmax(source) if self.argmax else source
        for op, a in self.steps:
            i = torch.clamp(i, min=a) if op == "max" else torch.clamp(i, max=a) if op == "min" else torch.remainder(i, a)
        return i


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _index_steps(name: str, args: tuple, kwargs: dict) -> tuple[tuple[str, int], ...] | None:
    """The steps ``clamp``/``remainder`` with these operands stand for, or None."""
    if name == "clamp":
        bound = dict(zip(("min", "max"), args[1:]), **kwargs)
        if set(bound) - {"min", "max"} or len(args) > 3:
            return None
        lo, hi = bound.get("min"), bound.get("max")
        if any(b is not None and not _int(b) for b in (lo, hi)) or (lo is None and hi is None):
            return None
        return tuple(s for s in (("max", lo), ("min", hi)) if s[1] is not None)
    if kwargs or len(args) != 2 or not _int(args[1]) or args[1] == 0:
        return None
    return (("mod", args[1]),)


def match_index_step(target: Any, args: tuple, kwargs: dict) -> IndexProgram | None:
    """``target(*args, **kwargs)`` as an :class:`IndexProgram` (extending one passed as the
    first argument), or None when the set kernel cannot compute it exactly.

        >>> import torch
        >>> v = torch.tensor([0.5, 2.0, 2.0, -1.0])
        >>> p = match_index_step(torch.argmax, (v,), {})
        >>> p = match_index_step(torch.clamp, (p, -1, 2), {})
        >>> p = match_index_step(torch.remainder, (p, 3), {})
        >>> p.steps, int(p.evaluate())
        ((('max', -1), ('min', 2), ('mod', 3)), 1)
    """
    name = INDEX_STEPS.get(target) if _hashable(target) else None
    if name is None or not args:
        return None
    x = args[0]
    if name == "argmax":
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        if set(kwargs) - {"dim", "keepdim"} or len(args) > 3:
            return None
        if isinstance(x, RouterLogits):
            if dim is not None and not (len(x.shape) == 1 and dim in (0, -1)):
                return None
            return IndexProgram(x, argmax=True)
        if not isinstance(x, torch.Tensor):
            return None
        if dim is not None and not (x.dim() == 1 and dim in (0, -1)):
            return None  # a flat argmax (or one over the only dim) is what the kernel computes
        if x.dtype not in ARGMAX_DTYPE_CODES or not 0 < x.numel() <= MAX_ARGMAX_ELEMENTS or not x.is_contiguous():
            return None
        return IndexProgram(x, argmax=True)
    steps = _index_steps(name, args, kwargs)
    if steps is None:
        return None
    if isinstance(x, IndexProgram):
        program = x
    elif isinstance(x, torch.Tensor) and x.dim() == 0 and x.dtype in DTYPE_CODES and not x.dtype.is_floating_point:
        program = IndexProgram(x)
    else:
        return None
    # torch computes every step in the index's dtype (argmax: int64) and wraps a bound it
    # cannot hold (remainder(int8, 1000) is mod -24); the kernel's int64 steps would not.
    info = torch.iinfo(torch.int64 if program.argmax else program.source.dtype)
    if any(not info.min <= a <= info.max for _, a in steps):
        return None
    if len(program.steps) + len(steps) > MAX_INDEX_STEPS:
        return None
    return IndexProgram(program.source, program.argmax, program.steps + steps)


# --------------------------------------------------------------------------- routers
#: Widest router input (``K``) the router set kernel holds in shared memory.
MAX_ROUTER_K = 8192
#: Most elements of ``x`` and ``w`` together that the router set kernel's one block reads
#: (a larger router is faster as kernels spread over many blocks).
MAX_ROUTER_ELEMENTS = 1 << 17
#: dtype -> code of the tensors a router reads (the argmax codes of the three float types).
ROUTER_DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 3, torch.bfloat16: 8, torch.float16: 9}
#: FX targets of a router's steps. ``unsqueeze`` and ``squeeze`` are how a vector-matrix
#: ``mean(x, 0) @ w`` reads in core ATen (``ep.run_decompositions()``):
#: ``squeeze(mm(unsqueeze(mean(x, [0]), 0), w), [0])``.
ROUTER_STEPS: dict[Any, str] = {
    aten.mean.dim: "mean", torch.mean: "mean",
    aten.unsqueeze.default: "unsqueeze",
    aten.matmul.default: "matmul", torch.matmul: "matmul", operator.matmul: "matmul", aten.mm.default: "matmul",
    aten.squeeze.dims: "squeeze", aten.squeeze.dim: "squeeze",
}
#: The order of a router's steps; a chain has its matmul and keeps this order.
_ROUTER_ORDER = ("mean", "unsqueeze", "matmul", "squeeze")


@dataclass(frozen=True)
class RowMean:
    """``x.mean(0, keepdim)`` of a 2-D ``x``, left for a router set kernel (see :class:`RouterLogits`)."""

    x: torch.Tensor
    keepdim: bool = False

    def evaluate(self) -> torch.Tensor:
        return self.x.mean(0, keepdim=self.keepdim)


@dataclass(frozen=True)
class RouterLogits:
    """``matmul(a, w)`` left for the router set kernel: ``a`` a :class:`RowMean` of an
    ``(R, K)`` tensor or a ``K``-vector (shape ``(K,)`` or ``(1, K)``), ``w`` a contiguous
    ``(K, E)`` matrix of the same float dtype. The kernel computes, as Python::

        v = a.x.mean(0) if isinstance(a, RowMean) else a.reshape(-1)   # rounded to the dtype
        logits = (v @ w).reshape(-1)                                   # rounded to the dtype

    accumulating in float32 (the order of a sum may differ from torch's in the last bits)."""

    a: "RowMean | torch.Tensor"
    w: torch.Tensor
    target: Any
    shape: tuple[int, ...]

    @property
    def x(self) -> torch.Tensor:
        return self.a.x if isinstance(self.a, RowMean) else self.a

    @property
    def rows(self) -> int:
        return self.a.x.shape[0] if isinstance(self.a, RowMean) else 1

    def evaluate(self) -> torch.Tensor:
        a = self.a.evaluate() if isinstance(self.a, RowMean) else self.a
        return self.target(a, self.w).reshape(self.shape)  # (1, E) squeezed to (E,) by a squeeze step


def _router_tensor(t: Any) -> bool:
    # A model's parameters require grad; the capture runs under no_grad, where that records
    # nothing, so only a tensor that would record autograd history is refused.
    return (isinstance(t, torch.Tensor) and t.dtype in ROUTER_DTYPE_CODES and t.is_contiguous()
            and not (t.requires_grad and torch.is_grad_enabled()))


def match_router_step(target: Any, args: tuple, kwargs: dict) -> "RowMean | RouterLogits | None":
    """``target(*args, **kwargs)`` as the router set kernel's :class:`RowMean` or
    :class:`RouterLogits` (from a ``RowMean`` or vector operand), or None when it cannot
    compute it exactly.

        >>> import torch
        >>> x, w = torch.randn(4, 8), torch.randn(8, 3)
        >>> m = match_router_step(torch.ops.aten.mean.dim, (x, [0]), {})
        >>> r = match_router_step(torch.ops.aten.matmul.default, (m, w), {})
        >>> bool(torch.equal(r.evaluate(), x.mean(0) @ w)), r.rows
        (True, 4)
    """
    name = ROUTER_STEPS.get(target) if _hashable(target) else None
    if name == "unsqueeze":  # mean(x, 0) -> (1, K): the kernel's keepdim mean
        a = args[0] if args else None
        dim = args[1] if len(args) == 2 else kwargs.get("dim")
        if not isinstance(a, RowMean) or a.keepdim or dim not in (0, -2) or len(args) + len(kwargs) != 2:
            return None
        return RowMean(a.x, True)
    if name == "squeeze":  # (1, E) logits -> (E,): argmax reads them flat either way
        r = args[0] if args else None
        dims = args[1] if len(args) == 2 else kwargs.get("dim")
        dims = [dims] if isinstance(dims, int) else list(dims) if isinstance(dims, (list, tuple)) else None
        if not isinstance(r, RouterLogits) or len(r.shape) != 2 or dims not in ([0], [-2]) or len(args) + len(kwargs) != 2:
            return None
        return RouterLogits(r.a, r.w, r.target, r.shape[1:])
    if name == "mean":
        if len(args) < 2 or len(args) > 3 or set(kwargs) - {"keepdim"}:
            return None  # a dtype= mean converts first
        x, dims = args[0], args[1]
        keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
        dims = [dims] if isinstance(dims, int) else dims
        if not _router_tensor(x) or x.dim() != 2 or list(dims or []) not in ([0], [-2]) or not isinstance(keepdim, bool):
            return None
        if not 0 < x.shape[1] <= MAX_ROUTER_K or x.shape[0] == 0:
            return None
        return RowMean(x, keepdim)
    if name != "matmul" or len(args) != 2 or kwargs:
        return None
    a, w = args
    x = a.x if isinstance(a, RowMean) else a
    if not _router_tensor(x) or not _router_tensor(w) or w.dim() != 2 or w.dtype != x.dtype or w.device != x.device:
        return None
    k, e = w.shape
    if isinstance(a, RowMean):
        a_shape = (1, k) if a.keepdim else (k,)
        if x.shape[1] != k:
            return None
    else:
        a_shape = tuple(a.shape)
    if a_shape not in ((k,), (1, k)) or not 0 < k <= MAX_ROUTER_K or not 0 < e <= MAX_ARGMAX_ELEMENTS:
        return None
    if target is aten.mm.default and len(a_shape) != 2:
        return None
    if x.numel() + w.numel() > MAX_ROUTER_ELEMENTS:
        return None
    return RouterLogits(a, w, target, (e,) if len(a_shape) == 1 else (1, e))


def router_feeds_switch(node: Any, is_switch: Callable[[Any], bool]) -> bool:
    """Whether the FX ``node`` (a router step) starts the rest of a chain
    ``mean -> [unsqueeze] -> matmul -> [squeeze] -> argmax`` (or ``matmul -> [squeeze] ->
    argmax``) from ``node`` on, each the sole use of the one before as its first
    operand, whose argmax feeds only switch indices with nothing written in place from ``node`` on."""
    first = node
    kinds = [ROUTER_STEPS.get(node.target) if _hashable(node.target) else None]
    while True:
        users = list(getattr(node, "users", ()))
        if len(users) != 1:
            return False
        user = users[0]
        if user.op != "call_function" or not user.args or user.args[0] is not node:
            return False
        rest: list[Any] = []
        torch.fx.node.map_arg((user.args[1:], user.kwargs), rest.append)
        if node in rest or not _hashable(user.target):
            return False
        if INDEX_STEPS.get(user.target) == "argmax":
            break
        kind = ROUTER_STEPS.get(user.target)
        if kind is None:
            return False
        kinds.append(kind)
        node = user
    if None in kinds or ("matmul" not in kinds and kinds != ["squeeze"]):
        return False  # (a squeeze after the matmul: its match defers only a matmul's logits)
    order = [_ROUTER_ORDER.index(k) for k in kinds]
    if order != sorted(set(order)):
        return False  # each step once, in order
    return feeds_only_switch_index(user, is_switch, first)


def feeds_only_switch_index(node: Any, is_switch: Callable[[Any], bool], _source: Any = None) -> bool:
    """Whether every use of the FX ``node`` is as a switch's index (``is_switch(user)``,
    ``user.args[0] is node``) or as the first operand of an index step that itself
    feeds only switch indices -- the nodes a set kernel may compute instead, at the
    switch: so nothing between ``node`` and the switch may write a tensor in place
    (the kernel would read the source after the write)."""
    source = node if _source is None else _source
    users = list(getattr(node, "users", ()))
    if not users:
        return False
    for user in users:
        if user.op != "call_function" or not user.args or user.args[0] is not node:
            return False
        rest: list[Any] = []
        torch.fx.node.map_arg((user.args[1:], user.kwargs), rest.append)
        if node in rest:
            return False  # also an operand (of a branch, or a bound)
        if is_switch(user):
            if not nothing_written_between(source, user):
                return False
            continue
        if not (_hashable(user.target) and INDEX_STEPS.get(user.target) in ("clamp", "remainder")):
            return False
        if not feeds_only_switch_index(user, is_switch, source):
            return False
    return True


#: Nodes a switch's set kernel may compute instead of torch: (their FX targets, whether a node
#: feeds only switch indices that way, its deferred value or None when the kernel cannot).
SET_KERNEL_STEPS: tuple[tuple[dict, Callable, Callable], ...] = (
    (INDEX_STEPS, feeds_only_switch_index, match_index_step),   # argmax, clamp, remainder
    (ROUTER_STEPS, router_feeds_switch, match_router_step),     # a router's mean and matmul
)


def set_kernel_step(target: Any) -> "tuple[Callable, Callable] | None":
    """``(feeds_switch, match)`` of :data:`SET_KERNEL_STEPS` for an FX target, or None."""
    if _hashable(target):
        for steps, feeds_switch, match in SET_KERNEL_STEPS:
            if target in steps:
                return feeds_switch, match
    return None


def index_chain(switch: Any) -> "tuple[Any, list[Any]] | None":
    """``(source, chain)`` when the FX ``switch``'s index is computed from ONE graph input
    ``source`` by a ``chain`` of router and index steps (:data:`ROUTER_STEPS`,
    :data:`INDEX_STEPS`, in program order), each the sole use of the one before and
    every other tensor operand a graph input or attribute; else None. What a loop may
    compute for its next trip as soon as a trip's carries are known::

        m = mean(x, [0]); l = matmul(m, w); i = argmax(l); switch(i, ...)   ->   (x, [m, l, i])
    """
    if not switch.args or not isinstance(switch.args[0], torch.fx.Node):
        return None
    chain, node = [], switch.args[0]
    while node.op == "call_function":
        if set_kernel_step(node.target) is None:
            return None
        rest: list[Any] = []
        torch.fx.node.map_arg((node.args[1:], node.kwargs), rest.append)
        if not node.args or not isinstance(node.args[0], torch.fx.Node) or any(
            r.op not in ("placeholder", "get_attr") for r in rest
        ):
            return None
        chain.append(node)
        node = node.args[0]
    if not chain or node.op != "placeholder":
        return None
    chain.reverse()
    if any(list(a.users) != [b] for a, b in zip(chain, [*chain[1:], switch])):
        return None
    return node, chain


def evaluate_index_chain(chain: list[Any], env: dict[Any, Any]) -> "IndexProgram | None":
    """The :class:`IndexProgram` the set kernel computes for ``chain`` (from :func:`index_chain`),
    its operands' values in ``env`` (FX node -> value); None where a step does not fit the kernel."""
    values = dict(env)
    value: Any = None
    for node in chain:
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: values[n])
        _, match = set_kernel_step(node.target)
        value = match(node.target, args, kwargs)
        if value is None:
            return None
        values[node] = value
    return value if isinstance(value, IndexProgram) else None


# --------------------------------------------------------------------------- counters
#: FX targets of ``a + b`` (with no ``alpha``).
INCREMENTS = frozenset({operator.add, torch.add, aten.add.Tensor, aten.add.Scalar})


def match_increment(node: Any, of: Any) -> int | None:
    """``k`` if the FX ``node`` computes ``of + k`` (or ``k + of``) for a Python int ``k``, else None.

    Structure only: the caller checks dtypes and that nothing else reads the sum.
    """
    if getattr(node, "op", None) != "call_function" or not _hashable(node.target) or node.target not in INCREMENTS:
        return None
    if node.kwargs or len(node.args) != 2:
        return None
    a, b = node.args
    if a is of and _int(b):
        return b
    if b is of and _int(a):
        return a
    return None


# --------------------------------------------------------------------------- out= forms
#: Python operators and torch functions (symbolic_trace / Dynamo graphs) -> a torch function taking ``out=``.
_TORCH_OUT_FORMS: dict[Any, Callable] = {
    operator.add: torch.add,
    operator.sub: torch.sub,
    operator.mul: torch.mul,
    operator.truediv: torch.div,
    operator.neg: torch.neg,
    **{f: f for f in (torch.add, torch.sub, torch.mul, torch.div, torch.lerp, torch.where, torch.clamp,
                      torch.maximum, torch.minimum, torch.neg, torch.abs, torch.exp, torch.sigmoid,
                      torch.tanh, torch.matmul, torch.mm, torch.addmm, torch.sin, torch.cos)},
}
_OUT_CACHE: dict[Any, Callable | None] = {}


def out_form(target: Any, args: tuple, kwargs: dict | None = None) -> Callable | None:
    """A callable ``f(*args, out=buffer, **kwargs)`` that computes ``target(*args, **kwargs)`` into ``buffer``, or None.

    For an aten overload this is its ``.out`` sibling (same arguments plus one
    ``out`` tensor); for Python operators and common torch functions, the
    torch function. The first operand must be a tensor (``2 + x`` has no out form),
    and a call that writes memory in place (:func:`branchyard.fx.mutation.call_writes`:
    ``add_``, batch norm in training) keeps its own semantics.
    """
    if not args or not isinstance(args[0], torch.Tensor) or not _hashable(target):
        return None
    if call_writes(target, args, kwargs or {}):
        return None
    if isinstance(target, torch._ops.OpOverload):
        if target not in _OUT_CACHE:
            _OUT_CACHE[target] = _aten_out_overload(target)
        return _OUT_CACHE[target]
    return _TORCH_OUT_FORMS.get(target)


def _aten_out_overload(op: torch._ops.OpOverload) -> Callable | None:
    schema = op._schema
    if len(schema.returns) != 1 or schema.returns[0].alias_info is not None:
        return None  # views and multi-output ops keep their own semantics (writers: out_form)
    want = [(a.name, str(a.type)) for a in schema.arguments]
    packet = op._overloadpacket
    for name in packet.overloads():
        cand = getattr(packet, name)
        outs = [a for a in cand._schema.arguments if a.is_out]
        rest = [(a.name, str(a.type)) for a in cand._schema.arguments if not a.is_out]
        if len(outs) == 1 and outs[0].name == "out" and rest == want:
            return cand
    return None
