"""The control-flow operators -- cond, switch, while_loop -- as graphs hold them.

One place that knows what ``torch.ops.higher_order.cond``, ``switch`` and
``while_loop`` look like in an FX graph (as ``torch.export``, ``make_fx`` and
Dynamo produce them), how to take such a node apart, how to build one, and
what each one means::

    true_graph_0 = self.true_graph_0                       # get_attr
    cond = torch.ops.higher_order.cond(pred, true_graph_0, false_graph_0, (x, y))
    getitem = cond[0]

    branch0 = self.branch0                                 # get_attr, one per branch
    switch = torch.ops.higher_order.switch(index, [branch0, branch1, ...], (x, y))
    getitem = switch[0]

    while_loop = torch.ops.higher_order.while_loop(cond_fn, body_fn, (i, x), (w,))
    getitem = while_loop[0]

Semantics, as Python (:func:`cond`, :func:`switch`, :func:`while_loop` below
are exactly this, and run)::

    def cond(pred, true_fn, false_fn, operands):
        return true_fn(*operands) if pred else false_fn(*operands)

    def switch(index, branches, operands):
        index = min(max(int(index), 0), len(branches) - 1)    # clamp
        return branches[index](*operands)

    def while_loop(cond_fn, body_fn, carried, additional):
        while cond_fn(*carried, *additional):
            carried = body_fn(*carried, *additional)
        return carried

The out-of-range rule of switch: **the index is clamped to ``[0, n - 1]``**,
as ``torch.switch`` (and JAX's ``lax.switch``) clamp it. ``torch.switch``
clamps before it calls the operator, so a traced switch node's index is in
range; the operator's own eager kernel rejects an out-of-range index instead
of clamping. Everything in branchyard that evaluates or lowers a switch node
clamps (``switch_to_cond``'s cond tree, the CUDA-graph SWITCH node, the
serialized form), and ``cond_to_switch`` only builds indices that are always
in range, so no result depends on the difference.

:data:`TABLE` holds one :class:`ControlFlowOp` row per operator: its
operator, where its operand tuples sit in ``node.args``, the function taking
a node apart into a validated dataclass (:class:`CondParts`,
:class:`SwitchParts`, :class:`WhileLoopParts`, each with ``rebuild``), and
its semantics. Taking a node apart raises
:class:`~branchyard.errors.MalformedGraphError` naming the node (branches
that are not graphs, operands that are not tensors or ints, branch outputs
that disagree in count, dtype or shape, a switch with no branches, a float
switch index). :func:`emit` creates a new node and fills its ``val`` /
``example_value`` meta by running the op on the fake values of its inputs, so
rewritten export graphs keep the metadata the verifier and later passes rely on.

    >>> import torch
    >>> switch(torch.tensor(7), [lambda x: (x + 1,), lambda x: (x * 10,)], (torch.tensor(2),))
    (tensor(20),)
    >>> sorted(TABLE)
    ['cond', 'switch', 'while_loop']
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch._ops import HigherOrderOperator
from torch.fx import Graph, GraphModule, Node

from branchyard._compat import HAS_SWITCH
from branchyard.errors import InternalError, MalformedGraphError
from branchyard.fx.graph_walk import graph_label, graph_path, note_subgraph, resolve_attr
from branchyard.fx.mutation import has_effects
from branchyard.fx.raise_free import may_raise

__all__ = [
    "COND",
    "SWITCH",
    "WHILE_LOOP",
    "GETITEM",
    "TABLE",
    "ControlFlowOp",
    "control_flow_op",
    "NestedNode",
    "walk_control_flow",
    "cond",
    "switch",
    "while_loop",
    "is_cond",
    "is_switch",
    "is_while_loop",
    "node_value",
    "CondParts",
    "SwitchParts",
    "WhileLoopParts",
    "cond_parts",
    "switch_parts",
    "while_loop_parts",
    "graph_outputs",
    "output_node",
    "emit",
    "fake_mode_of",
    "describe_node",
    "placeholders",
    "AttrSink",
    "inline_graph",
    "new_graph_module",
    "erase_dead_inputs",
    "replace_with_outputs",
    "returns_sequence",
    "merged_output_sizes",
]


# --------------------------------------------------------------------------- semantics
def cond(pred: Any, true_fn: Callable, false_fn: Callable, operands: Sequence[Any]) -> Any:
    """``true_fn(*operands) if pred else false_fn(*operands)``: what a cond node computes."""
    return true_fn(*operands) if bool(pred) else false_fn(*operands)


def switch(index: torch.Tensor | int, branches: Sequence[Callable], operands: Sequence[Any]) -> tuple:
    """Run ``branches[clamp(index, 0, len(branches) - 1)](*operands)``; return a tuple.

    The semantics of a switch node as plain Python (it syncs the host to read
    ``index``). It also serves as an FX ``call_function`` target standing for
    the switch operator on torch versions without it (torch < 2.14); the
    CUDA-graph lowering treats both alike.
    """
    if not branches:
        raise MalformedGraphError("switch needs at least one branch", where="switch")
    i = int(index.reshape(()).item()) if isinstance(index, torch.Tensor) else int(index)
    out = branches[min(max(i, 0), len(branches) - 1)](*operands)
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def while_loop(cond_fn: Callable, body_fn: Callable, carried: Sequence[Any], additional: Sequence[Any] = ()) -> tuple:
    """Run ``body_fn`` on the carries while ``cond_fn`` holds; return the final carries.

    >>> while_loop(lambda i: i < 3, lambda i: (i + 1,), (0,))
    (3,)
    """
    carried = tuple(carried)
    while bool(cond_fn(*carried, *additional)):
        out = body_fn(*carried, *additional)
        carried = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    return carried


# --------------------------------------------------------------------------- recognising nodes
COND: HigherOrderOperator = torch.ops.higher_order.cond
SWITCH: HigherOrderOperator | None = torch.ops.higher_order.switch if HAS_SWITCH else None
WHILE_LOOP: HigherOrderOperator = torch.ops.higher_order.while_loop

#: ``operator.getitem``, for matchers that test ``node.target is GETITEM``.
GETITEM = operator.getitem


def is_cond(node: Node) -> bool:
    """Whether ``node`` calls ``torch.ops.higher_order.cond``."""
    return node.op == "call_function" and node.target is COND


def is_switch(node: Node) -> bool:
    """Whether ``node`` calls ``torch.ops.higher_order.switch`` (never true before torch 2.14)."""
    return SWITCH is not None and node.op == "call_function" and node.target is SWITCH


def is_while_loop(node: Node) -> bool:
    """Whether ``node`` calls ``torch.ops.higher_order.while_loop``."""
    return node.op == "call_function" and node.target is WHILE_LOOP


# --------------------------------------------------------------------------- taking nodes apart
def describe_node(node: Node) -> str:
    """``node 'name'``, for error messages; below the root
    ``node 'name' in graph 'true_graph_0'`` (see
    :func:`~branchyard.fx.graph_walk.graph_path`), since every branch
    names its nodes afresh."""
    path = graph_path(node.graph.owning_module)
    return f"node '{node.name}' in graph '{path}'" if path else f"node '{node.name}'"


def node_value(node: Any) -> Any:
    """The example value of ``node``: ``meta['val']`` (export, make_fx) or
    ``meta['example_value']`` (Dynamo); a literal stands for itself; None if unknown."""
    if not isinstance(node, Node):
        return node
    if "val" in node.meta:
        return node.meta["val"]
    return node.meta.get("example_value")


def _value_key(node: Node) -> str:
    return "example_value" if "example_value" in node.meta and "val" not in node.meta else "val"


def output_node(gm: GraphModule) -> Node:
    """The output node of ``gm``; a graph without one (a branch must return
    something) raises MalformedGraphError naming the graph."""
    for n in reversed(gm.graph.nodes):
        if n.op == "output":
            return n
    raise MalformedGraphError(
        "graph has no output node", where=f"graph module {graph_label(gm)!r}",
        hint="end the graph with graph.output(...) returning the branch's values",
    )


def graph_outputs(gm: GraphModule) -> list[Any]:
    """The flat list of values ``gm``'s output node returns."""
    ret = output_node(gm).args[0]
    return list(ret) if isinstance(ret, (tuple, list)) else [ret]


def _resolve_subgraph(owner: GraphModule, arg: Any, node: Node, what: str) -> GraphModule:
    if not (isinstance(arg, Node) and arg.op == "get_attr"):
        raise MalformedGraphError(
            f"{what} is {arg!r}, expected a get_attr of a GraphModule",
            where=describe_node(node),
        )
    obj: Any = owner
    for part in str(arg.target).split("."):
        obj = getattr(obj, part, None)
    if not isinstance(obj, GraphModule):
        raise MalformedGraphError(
            f"{what} '{arg.target}' is {type(obj).__name__}, not a torch.fx.GraphModule",
            where=describe_node(node),
        )
    note_subgraph(owner, str(arg.target), obj)
    return obj


def _check_operands(node: Node, operands: Sequence[Any]) -> None:
    for i, op in enumerate(operands):
        if isinstance(op, Node):
            val = node_value(op)
            if val is None or isinstance(val, (torch.Tensor, torch.SymInt, int)) and not isinstance(val, bool):
                continue
            kind = type(val).__name__
        elif isinstance(op, int) and not isinstance(op, bool):
            continue
        else:
            kind = type(op).__name__
        raise MalformedGraphError(
            f"operand {i} is a {kind}; cond/switch operands must be tensors or ints",
            where=describe_node(node),
            hint="pass the value as a tensor, or close over it inside the branch",
        )


def placeholders(gm: GraphModule) -> list[Node]:
    """The placeholder nodes of ``gm``, in order."""
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _check_arity(node: Node, gms: Sequence[GraphModule], labels: Sequence[str], n_operands: int) -> None:
    for gm, label in zip(gms, labels):
        n = len(placeholders(gm))
        if n != n_operands:
            raise MalformedGraphError(
                f"{label} takes {n} inputs but the node passes {n_operands} operands",
                where=describe_node(node),
            )


def _node_output(node: Node, i: int) -> Any:
    """The example value of output ``i`` of the cond/switch ``node`` itself, or None."""
    val = node_value(node)
    if isinstance(val, (tuple, list)):
        return val[i] if i < len(val) else None
    return val if i == 0 else None


def _merged_size(node: Node, i: int, d: int) -> bool:
    """Whether ``node``'s own output ``i`` has a symbolic size in dim ``d``:
    torch.export (2.14) accepts branches returning different concrete sizes
    there and merges them into an unbacked symbol in the node's meta."""
    out = _node_output(node, i)
    return isinstance(out, torch.Tensor) and d < out.dim() and isinstance(out.shape[d], torch.SymInt)


def _differing_sizes(a: torch.Tensor, b: torch.Tensor) -> Iterator[tuple[int, int, int]]:
    """``(dim, size in a, size in b)`` where two outputs of equal rank have
    different concrete sizes. Symbolic sizes are not compared: each branch of
    a dynamic-shape program names its batch afresh (``u0``, ``u4``), the same
    size at run time."""
    for d, (x, y) in enumerate(zip(a.shape, b.shape)):
        if isinstance(x, int) and isinstance(y, int) and x != y:
            yield d, x, y


def merged_output_sizes(node: Node, branches: Sequence[GraphModule], labels: Sequence[str]) -> str | None:
    """Where the branches of the cond/switch ``node`` return different concrete
    sizes (which torch merges into an unbacked size of ``node``'s output), as
    text for a skip reason; None when they return none (see
    :func:`_differing_sizes`)."""
    ref = [node_value(v) for v in graph_outputs(branches[0])]
    for gm, label in zip(branches[1:], labels[1:]):
        for i, (a, b) in enumerate(zip(ref, (node_value(v) for v in graph_outputs(gm)))):
            if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dim() != b.dim():
                continue
            for d, x, y in _differing_sizes(a, b):
                merged = f" (merged into {_node_output(node, i).shape[d]})" if _merged_size(node, i, d) else ""
                return f"output {i} dim {d} is {x} in {labels[0]} but {y} in {label}{merged}"
    return None


def _check_branch_outputs(node: Node, branches: Sequence[GraphModule], labels: Sequence[str]) -> None:
    kinds = [returns_sequence(gm) for gm in branches]
    for kind, label in zip(kinds[1:], labels[1:]):
        if kind != kinds[0]:
            raise MalformedGraphError(
                f"{labels[0]} returns {'a tuple' if kinds[0] else 'a bare value'} but {label} "
                f"returns {'a tuple' if kind else 'a bare value'}",
                where=describe_node(node),
                hint="every branch must return the same output structure",
            )
    ref = [node_value(v) for v in graph_outputs(branches[0])]
    for gm, label in zip(branches[1:], labels[1:]):
        outs = [node_value(v) for v in graph_outputs(gm)]
        if len(outs) != len(ref):
            raise MalformedGraphError(
                f"{labels[0]} returns {len(ref)} outputs but {label} returns {len(outs)}",
                where=describe_node(node),
                hint="every branch must return the same number of tensors",
            )
        for i, (a, b) in enumerate(zip(ref, outs)):
            if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
                continue
            if a.dtype != b.dtype:
                raise MalformedGraphError(
                    f"output {i} is {a.dtype} in {labels[0]} but {b.dtype} in {label}",
                    where=describe_node(node),
                    hint="branches must agree in dtype; cast inside the branch",
                )
            # different concrete sizes only where the node's own output merged them into a symbol
            if a.dim() != b.dim() or not all(_merged_size(node, i, d) for d, _, _ in _differing_sizes(a, b)):
                raise MalformedGraphError(
                    f"output {i} has shape {tuple(a.shape)} in {labels[0]} but {tuple(b.shape)} in {label}",
                    where=describe_node(node),
                    hint="branches must agree in shape",
                )


@dataclass(frozen=True)
class CondParts:
    """A validated ``cond`` node: predicate, both branch graphs, operands."""

    node: Node
    pred: Any
    true_gm: GraphModule
    false_gm: GraphModule
    true_attr: Node
    false_attr: Node
    operands: tuple[Any, ...]

    def branch(self, side: bool) -> GraphModule:
        """The true (``side=True``) or false branch graph."""
        return self.true_gm if side else self.false_gm

    def args(self) -> tuple[Any, ...]:
        """The node's ``args`` as these parts describe them."""
        return (self.pred, self.true_attr, self.false_attr, self.operands)

    def rebuild(self, graph: Graph) -> Node:
        """A new cond node from these parts at ``graph``'s insertion point (meta copied);
        change a part first with ``dataclasses.replace``."""
        return _rebuild(graph, self.node, self.args())


def cond_parts(owner: GraphModule, node: Node) -> CondParts:
    """Take the cond ``node`` of ``owner`` apart; raise MalformedGraphError if it is ill-formed."""
    if len(node.args) != 4 or node.kwargs:
        raise MalformedGraphError(
            f"cond takes (pred, true_fn, false_fn, operands), got {len(node.args)} args and kwargs {list(node.kwargs)}",
            where=describe_node(node),
        )
    pred, t, f, operands = node.args
    if not isinstance(operands, (tuple, list)):
        raise MalformedGraphError(f"cond operands are {type(operands).__name__}, expected a tuple", where=describe_node(node))
    true_gm = _resolve_subgraph(owner, t, node, "true branch")
    false_gm = _resolve_subgraph(owner, f, node, "false branch")
    _check_operands(node, operands)
    _check_arity(node, [true_gm, false_gm], ["true branch", "false branch"], len(operands))
    _check_branch_outputs(node, [true_gm, false_gm], ["true branch", "false branch"])
    return CondParts(node, pred, true_gm, false_gm, t, f, tuple(operands))  # type: ignore[arg-type]


@dataclass(frozen=True)
class SwitchParts:
    """A validated ``switch`` node: index, branch graphs, operands."""

    node: Node
    index: Any
    branches: tuple[GraphModule, ...]
    branch_attrs: tuple[Node, ...]
    operands: tuple[Any, ...]

    def args(self) -> tuple[Any, ...]:
        """The node's ``args`` as these parts describe them."""
        return (self.index, list(self.branch_attrs), self.operands)

    def rebuild(self, graph: Graph) -> Node:
        """A new switch node from these parts at ``graph``'s insertion point (meta copied)."""
        return _rebuild(graph, self.node, self.args())


def switch_parts(owner: GraphModule, node: Node) -> SwitchParts:
    """Take the switch ``node`` of ``owner`` apart; raise MalformedGraphError if it is ill-formed."""
    if len(node.args) != 3 or node.kwargs:
        raise MalformedGraphError(
            f"switch takes (index, branches, operands), got {len(node.args)} args", where=describe_node(node)
        )
    index, branches, operands = node.args
    if not isinstance(branches, (tuple, list)) or len(branches) == 0:
        raise MalformedGraphError(
            "switch has zero branches; it needs at least one branch graph",
            where=describe_node(node),
        )
    if not isinstance(operands, (tuple, list)):
        raise MalformedGraphError(f"switch operands are {type(operands).__name__}, expected a tuple", where=describe_node(node))
    _check_index(node, index)
    gms = tuple(_resolve_subgraph(owner, b, node, f"branch {i}") for i, b in enumerate(branches))
    _check_operands(node, operands)
    _check_arity(node, gms, [f"branch {i}" for i in range(len(gms))], len(operands))
    _check_branch_outputs(node, gms, [f"branch {i}" for i in range(len(gms))])
    return SwitchParts(node, index, gms, tuple(branches), tuple(operands))  # type: ignore[arg-type]


@dataclass(frozen=True)
class WhileLoopParts:
    """A validated ``while_loop`` node: both body graphs, carried and additional inputs."""

    node: Node
    cond_gm: GraphModule
    body_gm: GraphModule
    cond_attr: Node
    body_attr: Node
    carried: tuple[Any, ...]
    additional: tuple[Any, ...]

    @property
    def operands(self) -> tuple[Any, ...]:
        """Every input the bodies take: the carries, then the additional inputs."""
        return (*self.carried, *self.additional)

    def args(self) -> tuple[Any, ...]:
        """The node's ``args`` as these parts describe them."""
        return (self.cond_attr, self.body_attr, self.carried, self.additional)

    def rebuild(self, graph: Graph) -> Node:
        """A new while_loop node from these parts at ``graph``'s insertion point (meta copied)."""
        return _rebuild(graph, self.node, self.args())


def while_loop_parts(owner: GraphModule, node: Node) -> WhileLoopParts:
    """Take the while_loop ``node`` of ``owner`` apart; raise MalformedGraphError if it is ill-formed."""
    if len(node.args) != 4:
        raise MalformedGraphError(
            f"while_loop takes (cond_fn, body_fn, carried, additional), got {len(node.args)} args",
            where=describe_node(node),
        )
    c, b, carried, additional = node.args
    for what, seq in (("carried inputs", carried), ("additional inputs", additional)):
        if not isinstance(seq, (tuple, list)):
            raise MalformedGraphError(
                f"while_loop {what} are {type(seq).__name__}, expected a tuple", where=describe_node(node)
            )
    cond_gm = _resolve_subgraph(owner, c, node, "cond_fn")
    body_gm = _resolve_subgraph(owner, b, node, "body_fn")
    operands = (*carried, *additional)
    _check_operands(node, operands)
    _check_arity(node, [cond_gm, body_gm], ["cond_fn", "body_fn"], len(operands))
    n_out = len(graph_outputs(body_gm))
    if n_out != len(carried):
        raise MalformedGraphError(
            f"body_fn returns {n_out} values for {len(carried)} loop carries", where=describe_node(node)
        )
    return WhileLoopParts(node, cond_gm, body_gm, c, b, tuple(carried), tuple(additional))  # type: ignore[arg-type]


def _rebuild(graph: Graph, like: Node, args: tuple[Any, ...]) -> Node:
    new = graph.call_function(like.target, args, dict(like.kwargs))  # type: ignore[arg-type]
    new.meta = dict(like.meta)
    return new


# --------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class ControlFlowOp:
    """One control-flow operator: how a graph holds it and what it means."""

    name: str
    #: The higher-order operator (None: this torch lacks it).
    op: HigherOrderOperator | None
    #: Positions in ``node.args`` of the tuples of values passed to the bodies.
    operand_args: tuple[int, ...]
    #: Take a node apart (validated): ``parts(owner, node)``.
    parts: Callable[[GraphModule, Node], Any]
    #: The operator's meaning as Python, runnable on callables.
    semantics: Callable[..., Any]

    def matches(self, node: Node) -> bool:
        """Whether ``node`` calls this operator."""
        return self.op is not None and node.op == "call_function" and node.target is self.op

    def operands(self, node: Node) -> tuple[Any, ...]:
        """The values ``node`` passes to its bodies, unvalidated (for counting)."""
        return tuple(v for i in self.operand_args if i < len(node.args) for v in node.args[i])

    def branches(self, owner: GraphModule, node: Node) -> list[tuple[str, GraphModule]]:
        """``(label, body graph)`` for each body of ``node``, unvalidated:
        ``true``/``false``, ``0`` .. ``n-1``, or ``cond_fn``/``body_fn``."""
        attrs = self.branch_args(node)
        return [(label, resolve_attr(owner, str(a.target))) for label, a in attrs]

    def branch_args(self, node: Node) -> list[tuple[str, Node]]:
        """``(label, get_attr node)`` for each body of ``node``."""
        if self.name == "cond":
            return [("true", node.args[1]), ("false", node.args[2])]
        if self.name == "switch":
            return [(str(k), b) for k, b in enumerate(node.args[1])]
        return [("cond_fn", node.args[0]), ("body_fn", node.args[1])]


#: cond, switch, while_loop: one row each.
TABLE: dict[str, ControlFlowOp] = {
    row.name: row
    for row in (
        ControlFlowOp("cond", COND, (3,), lambda owner, node: cond_parts(owner, node), cond),
        ControlFlowOp("switch", SWITCH, (2,), lambda owner, node: switch_parts(owner, node), switch),
        ControlFlowOp("while_loop", WHILE_LOOP, (2, 3), lambda owner, node: while_loop_parts(owner, node), while_loop),
    )
}


def control_flow_op(node: Node) -> ControlFlowOp | None:
    """The :data:`TABLE` row of the operator ``node`` calls, or None."""
    if node.op != "call_function" or not isinstance(node.target, HigherOrderOperator):
        return None
    row = TABLE.get(node.target.name())
    return row if row is not None and row.matches(node) else None


@dataclass(frozen=True)
class NestedNode:
    """A control-flow node at any depth: the graph that holds it, and the
    (node, branch label) pairs enclosing it, outermost first."""

    owner: GraphModule
    node: Node
    op: ControlFlowOp
    path: tuple[tuple[Node, str], ...]

    @property
    def site(self) -> str:
        """``outer[true]/inner[2]/node``: where the node sits, as a readable path."""
        return "".join(f"{n.name}[{label}]/" for n, label in self.path) + self.node.name


def walk_control_flow(gm: GraphModule, kinds: Sequence[str] = tuple(TABLE)) -> Iterator[NestedNode]:
    """Every control-flow node of the ``kinds`` in ``gm`` and, depth first,
    in the bodies of those nodes (a body is entered once per node using it;
    bodies of other kinds are not entered)."""
    for node in gm.graph.nodes:
        yield from _walk_node(gm, node, kinds, ())


def _walk_node(owner: GraphModule, node: Node, kinds: Sequence[str], path: tuple) -> Iterator[NestedNode]:
    op = control_flow_op(node)
    if op is None or op.name not in kinds:
        return
    yield NestedNode(owner, node, op, path)
    for label, body in op.branches(owner, node):
        for inner in body.graph.nodes:
            yield from _walk_node(body, inner, kinds, (*path, (node, label)))


def _check_index(node: Node, index: Any) -> None:
    val = node_value(index)
    if isinstance(val, torch.Tensor):
        if val.dtype.is_floating_point or val.dtype.is_complex or val.dtype == torch.bool:
            raise MalformedGraphError(
                f"switch index has dtype {val.dtype}; it must be an integer tensor",
                where=describe_node(node),
            )
        if val.numel() != 1:
            raise MalformedGraphError(
                f"switch index has shape {tuple(val.shape)}; it must hold one element",
                where=describe_node(node),
            )
    elif val is not None and (isinstance(val, bool) or not isinstance(val, (int, torch.SymInt))):
        raise MalformedGraphError(
            f"switch index is {type(val).__name__}; expected an integer tensor, int or SymInt",
            where=describe_node(node),
        )


def fake_mode_of(values: Sequence[Any]) -> Any:
    """The FakeTensorMode behind the first fake tensor in ``values``, or None."""
    for v in values:
        mode = getattr(v, "fake_mode", None)
        if mode is not None:
            return mode
    return None


def emit(graph: Graph, target: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any] | None = None,
         *, like: Node | None = None) -> Node:
    """Create ``call_function target(*args)`` at the graph's insertion point
    and fill its example-value meta by running ``target`` on fake inputs.

    ``like`` is a node whose meta key convention (``val`` vs ``example_value``)
    and stack trace the new node copies.
    """
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    key = _value_key(like) if like is not None else "val"
    if like is not None and "stack_trace" in like.meta:
        node.meta["stack_trace"] = like.meta["stack_trace"]
    vals_args = torch.fx.node.map_arg(args, node_value)
    vals_kwargs = torch.fx.node.map_arg(kwargs, node_value)
    leaves = torch.utils._pytree.tree_leaves((vals_args, vals_kwargs))
    if any(node_value(a) is None for a in node.all_input_nodes):
        return node  # no example values upstream (e.g. a symbolic_trace graph): leave meta empty
    mode = fake_mode_of(leaves)
    if mode is None:
        node.meta[key] = target(*vals_args, **vals_kwargs)
        return node
    with mode:
        # Branch graphs traced by make_fx carry values from their own fake
        # modes; re-create foreign ones in ``mode`` before mixing them.
        def adopt(v: Any) -> Any:
            if isinstance(v, torch.Tensor) and getattr(v, "fake_mode", mode) is not mode:
                return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
            return v

        vals_args, vals_kwargs = torch.utils._pytree.tree_map(adopt, (vals_args, vals_kwargs))
        node.meta[key] = target(*vals_args, **vals_kwargs)
    return node


class AttrSink:
    """Collects the attributes (subgraphs, constants) that copied ``get_attr``
    nodes refer to, under names unique within one destination module;
    with an ``owner`` module they are also registered on it at once."""

    def __init__(self, owner: torch.nn.Module | None = None) -> None:
        self.attrs: dict[str, Any] = {}
        self.owner = owner
        self._counts: dict[str, int] = {}

    def add(self, base: str, obj: Any) -> str:
        """Store ``obj`` under a fresh name derived from ``base``; return the name."""
        base = base.replace(".", "_")
        name, n = base, self._counts.get(base, 0)
        while name in self.attrs or (self.owner is not None and hasattr(self.owner, name)):
            n += 1
            name = f"{base}_{n}"
        self._counts[base] = n
        self.attrs[name] = obj
        if self.owner is not None:
            # Register before any get_attr node refers to it.
            if isinstance(obj, torch.nn.Module):
                self.owner.add_module(name, obj)
            else:
                setattr(self.owner, name, obj)
        return name


def new_graph_module(attrs: dict[str, Any], graph: Graph) -> GraphModule:
    """A GraphModule over ``graph`` whose Python code is generated lazily
    (on first call or ``.code``): a pass creating hundreds of branch graphs
    should not pay for code generation the next compiler stage never uses.
    See :func:`~branchyard.fx.graph_walk.realize_graph_modules` for handing
    results to Dynamo."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    return _LazyGraphModule(attrs, graph)


def returns_sequence(gm: GraphModule) -> bool:
    """Whether ``gm`` returns a tuple/list (then a cond/switch over it yields
    a sequence that ``getitem`` picks from) rather than a bare value."""
    return isinstance(output_node(gm).args[0], (tuple, list))


def inline_graph(
    dst: Graph,
    src: GraphModule,
    args: Sequence[Any],
    sink: AttrSink,
    *,
    replace: dict[Node, Callable[[dict[Node, Any]], Any]] | None = None,
    drop: frozenset[Node] = frozenset(),
) -> Any:
    """Copy ``src``'s body into ``dst`` at its insertion point, its
    placeholders bound to ``args``; return what it outputs, in the same
    structure (a tuple of values, or a bare value).

    ``replace[node]`` is called with the environment instead of copying
    ``node`` and returns its value in the same way; when that is a tuple,
    ``getitem`` nodes on it resolve to its elements directly. Nodes in
    ``drop`` are not copied (the get_attrs of a replaced node). ``get_attr``
    nodes are re-pointed at copies stored in ``sink``. A graph without an
    output node, or given a different number of ``args`` than it has
    placeholders, raises MalformedGraphError naming it.
    """
    replace = replace or {}
    env: dict[Node, Any] = {}
    multi: dict[Node, Sequence[Any]] = {}
    output_node(src)  # a graph without one is malformed: say which, before copying anything
    n_inputs = len(placeholders(src))
    if n_inputs != len(args):
        raise MalformedGraphError(
            f"graph takes {n_inputs} inputs but is inlined with {len(args)} values",
            where=f"graph module {graph_label(src)!r}",
        )
    it = iter(args)
    for n in src.graph.nodes:
        if n.op == "placeholder":
            env[n] = next(it)
        elif n.op == "output":
            return torch.fx.node.map_arg(n.args[0], env.__getitem__)
        elif n in drop:
            continue
        elif n in replace:
            env[n] = replace[n](env)
            if isinstance(env[n], (tuple, list)):
                multi[n] = env[n]
        elif n.target is GETITEM and isinstance(n.args[0], Node) and n.args[0] in multi:
            env[n] = multi[n.args[0]][n.args[1]]
        elif n.op == "get_attr":
            name = sink.add(str(n.target), resolve_attr(src, str(n.target)))
            env[n] = dst.get_attr(name)
            env[n].meta = dict(n.meta)
        else:
            env[n] = dst.node_copy(n, env.__getitem__)
    raise InternalError("inline_graph walked past the output node", where=f"graph module {graph_label(src)!r}")


def erase_dead_inputs(graph: Graph, nodes: Sequence[Any]) -> None:
    """Erase ``nodes`` and, transitively, their inputs once they have no
    users left, no side effects (:func:`branchyard.fx.mutation.has_effects`:
    a train-mode batch norm, ``x.add_(1)`` as a method stay) and cannot raise
    (:func:`branchyard.fx.raise_free.may_raise`: an unused operand that might
    raise is still computed, as the original computed it)."""
    work = [n for n in nodes if isinstance(n, Node)]
    while work:
        n = work.pop()
        if n.users or n.op not in ("call_function", "call_method") or n.graph is not graph:
            continue
        if has_effects(n) or may_raise(n):
            continue
        inputs = n.all_input_nodes
        graph.erase_node(n)
        work.extend(inputs)


def replace_with_outputs(graph: Graph, node: Node, value: Any) -> None:
    """Make every user of ``node`` (a cond/switch being replaced) read
    ``value``, its replacement: for a tuple, ``node[i]`` becomes
    ``value[i]`` and any other use sees the tuple; a bare value replaces
    ``node`` outright."""
    if not isinstance(value, (tuple, list)):
        node.replace_all_uses_with(value)
        return
    for user in list(node.users):
        if user.target is GETITEM and user.args[0] is node and isinstance(user.args[1], int):
            user.replace_all_uses_with(value[user.args[1]])
            graph.erase_node(user)
        else:
            whole = tuple(value)
            user.args = torch.fx.node.map_arg(user.args, lambda a: whole if a is node else a)  # type: ignore[arg-type,return-value]
            user.kwargs = torch.fx.node.map_arg(user.kwargs, lambda a: whole if a is node else a)  # type: ignore[arg-type,return-value]
