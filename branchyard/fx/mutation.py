"""What a call may write in place, and which tensors a graph writes: the one answer.

Every pass and lowering that reorders, fuses or defers work asks the same
question -- *may this node write memory, and which of its arguments?* -- and
asks it here (:func:`call_writes`, :func:`node_writes`, :func:`may_write`).
The answer, for each kind of call target:

=========================================  =====================================================
ATen op (overload, packet, torch builtin,  the arguments its schema marks ``Tensor(a!)``
Tensor method)                             (``out=`` included), plus :data:`UNMARKED_WRITES`
Python torch function (``F.relu``)         ``inplace=True``'s input, ``out=``, :data:`UNMARKED_WRITES`
name ending in ``_`` without a schema      its first argument (``torch.nn.init.zeros_``)
``x += y`` (``operator.iadd``), setitem    the first operand
control flow (cond, while_loop, switch)    nothing: torch requires bodies not to write their inputs
a called GraphModule                       what its nodes write, mapped back to the call's arguments
user code, a module without a graph,       every argument, and memory beyond them (``elsewhere``)
an unknown method or callable
=========================================  =====================================================

torch.export's training IR keeps a model's state updates as in-place ops on its
placeholders (an ExportedProgram's graph) or attributes (its ``module()``)::

    add_ = aten.add_.Tensor(b_calls, 1)                          # an int64 step counter
    index_copy_ = aten.index_copy_.default(b_cache, 0, pos, k)   # a KV cache row
    select = aten.select.int(b_cache, 0, 2); aten.copy_(select, k)   # the same, through a view
    aten.batch_norm.default(x, w, b, b_running_mean, b_running_var, True, ...)   # train mode

Anything that runs such a graph for its own purposes (a warm-up before a capture,
a race between rewrites) must run it on copies of those, or put them back
(:func:`written_roots`); anything that moves a read across such a node changes
what the read sees (:func:`nothing_written_between`).

    >>> import torch
    >>> class Step(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
    ...     def forward(self, x):
    ...         self.calls.add_(1)
    ...         return x * 2
    >>> ep = torch.export.export(Step(), (torch.ones(2),))
    >>> [n.name for n in written_roots(ep.graph)]
    ['b_calls']
    >>> aten = torch.ops.aten
    >>> call_writes(aten.batch_norm.default, ("x", None, None, "rm", "rv", True, 0.1, 1e-5, False), {}).names
    ('running_mean', 'running_var')
    >>> bool(call_writes(aten.batch_norm.default, ("x", None, None, "rm", "rv", False, 0.1, 1e-5, False), {}))
    False
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import Graph, GraphModule, Node

from branchyard.fx.call_arguments import BoundCall, aten_packet, bind_call

__all__ = [
    "UNMARKED_WRITES",
    "UnmarkedWrite",
    "Writes",
    "call_writes",
    "method_writes",
    "node_writes",
    "may_write",
    "has_effects",
    "nothing_written_between",
    "view_base",
    "written_operands",
    "written_roots",
]

aten = torch.ops.aten


@dataclass(frozen=True)
class UnmarkedWrite:
    """Arguments an op writes that its schema does not mark ``Tensor(a!)``: ``arguments``,
    whenever the argument named ``when`` is true (``None``: always). A value only known
    when the program runs (an FX node) counts as true."""

    arguments: tuple[str, ...]
    when: str | None = None


_STATS = ("running_mean", "running_var")

#: ATen ops (by packet: every overload) and Python torch functions that write arguments
#: their schema does not mark: the batch-norm family updates its running statistics.
UNMARKED_WRITES: dict[Any, UnmarkedWrite] = {
    aten.batch_norm: UnmarkedWrite(_STATS, "training"),
    aten.native_batch_norm: UnmarkedWrite(_STATS, "training"),
    aten._batch_norm_impl_index: UnmarkedWrite(_STATS, "training"),
    aten.cudnn_batch_norm: UnmarkedWrite(_STATS, "training"),
    aten.miopen_batch_norm: UnmarkedWrite(_STATS, "training"),
    aten.instance_norm: UnmarkedWrite(_STATS, "use_input_stats"),
    aten.batch_norm_update_stats: UnmarkedWrite(_STATS),
    aten.batch_norm_gather_stats: UnmarkedWrite(_STATS),
    aten.batch_norm_gather_stats_with_counts: UnmarkedWrite(_STATS),
    F.batch_norm: UnmarkedWrite(_STATS, "training"),
    F.instance_norm: UnmarkedWrite(_STATS, "use_input_stats"),
}

#: Python operators that write their first operand (``x += y`` on a tensor, ``x[i] = v``).
INPLACE_OPERATORS = frozenset(getattr(operator, f"i{name}") for name in (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift", "matmul",
)) | {operator.setitem, operator.delitem}
#: The same as Tensor methods (an FX ``call_method`` node).
INPLACE_DUNDERS = frozenset(f"__{f.__name__.strip('_')}__" for f in INPLACE_OPERATORS)
#: Modules whose functions follow torch's convention that a function writing its input
#: ends in ``_`` or says so by an argument; code from anywhere else may write anything.
_KNOWN_MODULES = ("torch", "branchyard", "operator", "_operator", "math", "builtins")


@dataclass(frozen=True, eq=False)
class Writes:
    """What one call may write in place: ``arguments`` (name, the value passed), and whether it
    may write memory beyond them (``elsewhere``: state it reaches itself, or code nobody can read).
    False when it writes nothing."""

    arguments: tuple[tuple[str, Any], ...] = ()
    elsewhere: bool = False

    def __bool__(self) -> bool:
        return bool(self.arguments) or self.elsewhere

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.arguments)

    def values(self) -> list[Any]:
        """The values written, lists of tensors (``Tensor(a!)[]``) flattened."""
        out: list[Any] = []
        for _, value in self.arguments:
            out.extend(value if isinstance(value, (list, tuple)) else [value])
        return [v for v in out if v is not None]


NOTHING = Writes()


def _may_be_true(value: Any) -> bool:
    return bool(value) if isinstance(value, (bool, int, float)) else value is not None


def _given(value: Any) -> bool:
    return value is not None and not (isinstance(value, (list, tuple)) and all(v is None for v in value))


def _everything(args: tuple, kwargs: dict) -> Writes:
    """Unknown code: any argument, and memory beyond them."""
    named = [(f"args[{i}]", a) for i, a in enumerate(args)] + list(kwargs.items())
    return Writes(tuple((n, v) for n, v in named if _given(v)), elsewhere=True)


def _unmarked_rule(key: Any) -> UnmarkedWrite | None:
    try:
        return UNMARKED_WRITES.get(key)
    except TypeError:  # unhashable
        return None


def _packet_of(schema: torch._C.FunctionSchema) -> Any:
    namespace, _, name = schema.name.partition("::")
    return aten_packet(name) if namespace == "aten" else None


def _bound_writes(target: Any, call: BoundCall) -> list[tuple[str, Any]]:
    """The arguments one binding writes: by its schema's marks, or the rules for Python functions."""
    bound = call.arguments
    if call.schema is not None:
        written = [a.name for a in call.schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        rule = _unmarked_rule(_packet_of(call.schema))
    else:
        written = [name for name in ("out",) if name in bound]
        if _may_be_true(bound.get("inplace", False)) and bound:
            written.append(next(iter(bound)))  # F.relu(x, inplace=True) writes x
        rule = _unmarked_rule(target)
    if rule is not None and (rule.when is None or _may_be_true(bound.get(rule.when, True))):
        written.extend(rule.arguments)
    return [(name, bound[name]) for name in dict.fromkeys(written) if _given(bound.get(name))]


def _union(target: Any, calls: list[BoundCall]) -> Writes:
    seen: dict[int, tuple[str, Any]] = {}  # one entry per value written, named by the first binding
    for call in calls:
        for name, value in _bound_writes(target, call):
            seen.setdefault(id(value), (name, value))
    return Writes(tuple(seen.values()))


def _first_argument(args: tuple, kwargs: dict, name: str = "self") -> Writes:
    if args:
        return Writes(((name, args[0]),)) if _given(args[0]) else NOTHING
    key = next((k for k in ("self", "input", "tensor") if k in kwargs), None)
    return Writes(((key, kwargs[key]),)) if key is not None else Writes(elsewhere=True)


def _in_place_name(name: str) -> bool:
    return name.endswith("_") and not name.startswith("__")


def _known_code(target: Any) -> bool:
    if isinstance(target, type(torch.Tensor.add_)):
        return issubclass(torch.Tensor, getattr(target, "__objclass__", object))
    module = getattr(target, "__module__", None) or ""
    return module.split(".")[0] in _KNOWN_MODULES


def call_writes(target: Any, args: tuple, kwargs: dict) -> Writes:
    """What ``target(*args, **kwargs)`` (an FX ``call_function``) may write (see the module's table).

        >>> import torch
        >>> aten = torch.ops.aten
        >>> call_writes(aten.index_copy_.default, ("cache", 0, "pos", "k"), {}).arguments
        (('self', 'cache'),)
        >>> call_writes(aten.add.out, ("a", "b"), {"out": "buf"}).arguments
        (('out', 'buf'),)
        >>> bool(call_writes(aten.add.Tensor, ("a", "b"), {}))
        False
    """
    if isinstance(target, torch._ops.HigherOrderOperator) or target is operator.getitem:
        return NOTHING
    try:
        if target in INPLACE_OPERATORS:
            return _first_argument(args, kwargs, "a")
    except TypeError:  # unhashable: nobody can say
        return _everything(args, kwargs)
    if not isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) and not _known_code(target):
        return _everything(args, kwargs)  # user code (torch.fx.wrap), a callable object
    return _by_signature(target, getattr(target, "__name__", ""), bind_call(target, args, kwargs), args, kwargs)


def method_writes(name: Any, args: tuple, kwargs: dict) -> Writes:
    """What ``args[0].<name>(*args[1:], **kwargs)`` (an FX ``call_method``) may write.

        >>> method_writes("mul_", ("x", 2), {}).arguments
        (('self', 'x'),)
        >>> bool(method_writes("reshape", ("x", -1), {}))
        False
    """
    if not isinstance(name, str):
        return _everything(args, kwargs)
    if name in INPLACE_DUNDERS:
        return _first_argument(args, kwargs)
    if not hasattr(torch.Tensor, name):
        return _everything(args, kwargs)  # not a Tensor method: some object's own code
    return _by_signature(name, name, bind_call(name, args, kwargs, method=True), args, kwargs)


def _by_signature(target: Any, name: str, calls: list[BoundCall] | None, args: tuple, kwargs: dict) -> Writes:
    """The writes of the ways a call binds; a name in ``_`` with no binding that says so
    writes its first argument (``torch.relu_``, ``torch.nn.init.zeros_``, ``x.resize_(2, 3)``)."""
    writes = _union(target, calls) if calls else NOTHING
    if not writes and _in_place_name(name):
        writes = _first_argument(args, kwargs)
    out = kwargs.get("out")
    if _given(out) and all(value is not out for value in writes.values()):
        writes = Writes((*writes.arguments, ("out", out)), writes.elsewhere)
    return writes


def _called_graph(node: Node) -> GraphModule | None:
    """The GraphModule a ``call_module`` node runs: the module itself, or the one a module
    that runs a graph (an Inductor region) exposes as ``graph_module``."""
    root = node.graph.owning_module
    if root is None:
        return None
    try:
        sub = root.get_submodule(node.target)
    except AttributeError:
        return None
    if isinstance(sub, GraphModule):
        return sub
    inner = getattr(sub, "graph_module", None)
    return inner if isinstance(inner, GraphModule) else None


def _module_writes(node: Node) -> Writes:
    gm = _called_graph(node)
    if gm is None:
        return _everything(node.args, node.kwargs)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    written: dict[int, tuple[str, Any]] = {}
    elsewhere = False
    for inner in gm.graph.nodes:
        writes = node_writes(inner)
        elsewhere |= writes.elsewhere
        for value in writes.values():
            base = view_base(value) if isinstance(value, Node) else None
            if base is None or base.op != "placeholder":
                elsewhere = True  # the module's own state, or memory it made: not an argument
                continue
            i = placeholders.index(base)
            outer = node.args[i] if i < len(node.args) else node.kwargs.get(str(base.target))
            if _given(outer):
                written.setdefault(i, (str(base.target), outer))
    return Writes(tuple(written[i] for i in sorted(written)), elsewhere)


def node_writes(node: Node) -> Writes:
    """What the FX ``node`` may write when it runs (placeholders, attributes and outputs: nothing)."""
    if node.op == "call_function":
        return call_writes(node.target, node.args, node.kwargs)
    if node.op == "call_method":
        return method_writes(node.target, node.args, node.kwargs)
    if node.op == "call_module":
        return _module_writes(node)
    return NOTHING


def may_write(node: Node) -> bool:
    """Whether the FX ``node`` may write memory in place (conservative: unknown code may)."""
    return bool(node_writes(node))


def has_effects(node: Node) -> bool:
    """Whether removing the FX ``node`` when nobody uses its result could change what the
    program does: torch's ``Node.is_impure`` (placeholders, outputs, asserts, mutable
    schemas) or :func:`may_write` (a train-mode batch norm, ``x.add_(1)`` as a method,
    unknown code). What dead-code elimination must keep."""
    return node.is_impure() or may_write(node)


def nothing_written_between(first: Node, last: Node) -> bool:
    """Whether no node strictly between ``first`` and ``last`` (one graph, in order) may write
    memory: what a value computed at ``first`` and read at ``last`` needs, when the read
    happens only at ``last`` (a set kernel reading its operands at the conditional node)."""
    node = first.next
    while node is not last:
        if node.op == "root" or may_write(node):
            return False
        node = node.next
    return True


def written_operands(node: Node) -> list[Node]:
    """The operand nodes ``node`` may write (:func:`node_writes`), in argument order."""
    return [v for v in node_writes(node).values() if isinstance(v, Node)]


def view_base(node: Node) -> Node:
    """The node a chain of view ops (select, slice, view, ...) starts from."""
    while (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and node.target.is_view
        and node.args
        and isinstance(node.args[0], Node)
    ):
        node = node.args[0]
    return node


def written_roots(graph: Graph) -> list[Node]:
    """The placeholders and ``get_attr`` nodes of ``graph`` (this graph only, not bodies) that an
    op writes, directly or through views, in graph order."""
    roots = {
        base
        for node in graph.nodes
        for operand in written_operands(node)
        if (base := view_base(operand)).op in ("placeholder", "get_attr")
    }
    return [n for n in graph.nodes if n in roots]
