"""The form a switch takes in a ``.pt2``: a tagged, balanced ``cond`` tree.

torch 2.14's ``torch.export.save`` cannot write
``torch.ops.higher_order.switch`` (its serializer has no encoding for the
switch's list of branch graphs). :func:`encode_switches` therefore rewrites
every switch with :func:`branchyard.fx.switch_lowering.lower_switch` -- the
library's one switch -> cond lowering -- and tags the tree's top ``cond`` in
``node.meta["custom"]`` (which the ``.pt2`` format keeps)::

    before                                  after (in the .pt2)
    ------                                  -------------------
    out = switch(i, [b0, b1, b2], ops)      p   = i <= 0
                                            out = cond(p, leaf0, tree_1_3, (i, *ops))   # tagged
                                            tree_1_3(i, *ops) = cond(i <= 1, leaf1, leaf2, ops')
                                            leaf_k(...)       = b_k(*ops)

Each cond passes on the index only to a side that still has a choice to make
and only the operands its sides read (``ops'``: a subsequence of ``ops``). As
Python (``lo``/``hi`` bound the branches a subtree chooses among)::

    def tree(i, lo=0, hi=n):
        if hi - lo == 1:
            return branches[lo](*ops)
        mid = (lo + hi) // 2
        return tree(i, lo, mid) if i <= mid - 1 else tree(i, mid, hi)

which is ``branches[clamp(i, 0, n - 1)](*ops)``, the switch's own semantics.
The tree is ``ceil(log2 n)`` deep, so torch's recursive serializer handles
any width, in time linear in the program.

The tag::

    {"format": "branchyard-switch-as-cond", "version": 2, "num_branches": n,
     "num_operands": m, "name": "switch", "branch_names": ["b0", "b1", "b2"]}

:func:`decode_switches` turns a tagged tree back into a switch only when the
tree below the tag has exactly that shape for ``num_branches`` branches:
every predicate is ``index <= mid - 1`` on the tree's own index, every inner
graph passes its index and an in-order subsequence of its inputs to one cond
and returns that cond's outputs in order, every leaf ignores the index. Then
the switch computes what the cond tree computes, for every index. Any other
shape -- a tag edited to a wrong count, a missing or ill-typed field, branch
names that repeat for branches that differ -- is a
:class:`~branchyard.errors.SerializationError` naming the node; nothing is
guessed.

What the restore gives back: a switch with the same index, the same number of
branches, the same name, its outputs feeding the same users, and as operands
the switch's operands that some branch reads, in their order (``m`` of them;
an operand no branch reads is not kept). Each branch graph is its leaf's body
over those operands: the original branch's body, copied node for node.
Slots that shared one branch graph share one again.
"""

from __future__ import annotations

import builtins
import keyword
import operator
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.fx import Graph, GraphModule, Node

from branchyard._compat import HAS_SWITCH
from branchyard.errors import MalformedGraphError, SerializationError
from branchyard.fx.control_flow import (
    SWITCH,
    describe_node,
    is_cond,
    is_switch,
    placeholders,
    switch_parts,
)
from branchyard.fx.graph_walk import copy_graph_module, iter_graph_modules, realize_graph_modules, resolve_attr

__all__ = ["MARKER_KEY", "FORMAT", "VERSION", "encode_switches", "decode_switches"]

#: Key in ``node.meta["custom"]`` that tags the top ``cond`` of an encoded switch.
MARKER_KEY = "branchyard_switch"
FORMAT = "branchyard-switch-as-cond"
#: 1: an (n-1)-deep cond chain (branchyard 0.1); 2: the balanced tree.
VERSION = 2

#: The predicate targets of the tree: ``aten.le.Scalar`` for a tensor index, ``operator.le`` for a SymInt.
_LE_TARGETS = (torch.ops.aten.le.Scalar, operator.le)


# ---------------------------------------------------------------------------
# switch -> tagged cond tree
# ---------------------------------------------------------------------------


def _encode_switch(gm: GraphModule, node: Node) -> None:
    """Rewrite one switch of ``gm`` as its tagged balanced cond tree."""
    from branchyard.fx.switch_lowering import lower_switch

    try:
        parts = switch_parts(gm, node)
    except MalformedGraphError as exc:
        raise SerializationError(f"cannot save a malformed switch: {exc.message}", where=exc.where,
                                 hint=exc.hint) from exc
    if not isinstance(parts.index, Node):
        raise SerializationError(
            f"switch with a constant index {parts.index!r} cannot be saved",
            where=describe_node(node),
            hint="fold the constant switch into its selected branch before saving",
        )
    n = len(parts.branches)
    names = [str(b.target) for b in parts.branch_attrs]
    name, meta = node.name, dict(node.meta)
    if n == 1:  # a two-leaf tree over the branch twice (the restore checks the leaves are equal)
        node.args = (parts.index, [parts.branch_attrs[0]] * 2, node.args[2])
    cond = lower_switch(gm, node).root
    if cond is None:  # lower_switch splices a body in only for one slot or a literal index, excluded above
        raise SerializationError("the switch was not lowered to a cond tree", where=describe_node(node))
    tag = {
        "format": FORMAT,
        "version": VERSION,
        "num_branches": n,
        "num_operands": len(cond.args[3]) - (1 if n > 2 else 0),
        "name": name,
        "branch_names": names,
    }
    # The switch's source-level meta (stack trace, module stack, user
    # ``custom`` entries) goes to its stand-in, with the tag added.
    for key, value in meta.items():
        if key == "custom" and isinstance(value, dict):
            cond.meta["custom"] = {**value, **cond.meta.get("custom", {})}
        elif key not in ("val", "example_value"):
            cond.meta.setdefault(key, value)
    cond.meta.setdefault("custom", {})[MARKER_KEY] = tag
    # The cond takes the switch's name: the program's output specs may name it.
    cond.name = name


def encode_switches(program: ExportedProgram) -> tuple[ExportedProgram, int]:
    """A copy of ``program`` with every switch (at any depth) rewritten as a
    tagged balanced cond tree, and the number of switches rewritten.

    ``program`` itself is not changed. Raises SerializationError naming the
    node for a switch that cannot be written (no branches, a constant or a
    float index, branches that disagree).
    """
    if not any(is_switch(n) for m in iter_graph_modules(program.graph_module) for n in m.graph.nodes):
        return program, 0
    gm = copy_graph_module(program.graph_module)
    count = 0
    # Children before parents: a switch's branches hold no switch by the time
    # their bodies are copied into its leaves, and each graph is scanned once.
    for m in list(iter_graph_modules(gm, children_first=True)):
        switches = [n for n in m.graph.nodes if is_switch(n)]
        for node in switches:
            _encode_switch(m, node)
        if switches:
            m.recompile()
        count += len(switches)
    realize_graph_modules(gm)
    return program._update(gm, program.graph_signature), count


# ---------------------------------------------------------------------------
# tagged cond tree -> switch
# ---------------------------------------------------------------------------


def _fresh_attr(owner: torch.nn.Module, base: str) -> str:
    name, k = base, 0
    while hasattr(owner, name):
        k += 1
        name = f"{base}_{k}"
    return name


def _tag_of(node: Node) -> Any:
    """The marker on ``node`` (any value, to be checked), or None."""
    custom = node.meta.get("custom")
    return custom.get(MARKER_KEY) if isinstance(custom, dict) else None


def _corrupt(where: str, what: str) -> SerializationError:
    return SerializationError(
        f"encoded switch is malformed: {what}",
        where=where,
        hint="the .pt2 was edited after branchyard.save wrote it; re-save the original program",
    )


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_name(x: Any) -> bool:
    """A name FX could have given a node or a submodule: an identifier that is
    no keyword, builtin or name FX's generated code uses (``torch``, ``self``),
    of a sane length."""
    return (isinstance(x, str) and x.isidentifier() and len(x) <= 256 and not keyword.iskeyword(x)
            and not hasattr(builtins, x) and x != "self"
            and x not in getattr(torch.fx.graph, "_custom_builtins", ("torch", "inf", "nan")))


def _check_tag(tag: Any, where: str, num_operands: int) -> tuple[int, list[str], str]:
    """``(num_branches, branch_names, name)`` of a well-formed tag; raise otherwise."""
    if not isinstance(tag, dict):
        raise _corrupt(where, f"marker is a {type(tag).__name__}, not an object")
    if tag.get("format") != FORMAT:
        raise _corrupt(where, f"unknown marker format {tag.get('format')!r}")
    if tag.get("version") != VERSION:
        if tag.get("version") == 1:
            raise SerializationError(
                "written by branchyard 0.1 (switch format 1, a cond chain), which this version does not read",
                where=where,
                hint="torch.export.load reads it as the equivalent cond chain; re-save it to get the switch back",
            )
        raise _corrupt(where, f"unknown marker version {tag.get('version')!r}")
    n, m, names, name = (tag.get(k) for k in ("num_branches", "num_operands", "branch_names", "name"))
    if not _is_int(n) or n < 1:
        raise _corrupt(where, f"num_branches is {n!r}, expected a positive int")
    if not _is_int(m) or m != num_operands:
        raise _corrupt(where, f"num_operands is {m!r} but the cond passes {num_operands} operands after the index")
    if not isinstance(names, list) or len(names) != n:
        raise _corrupt(where, f"branch_names is {names!r}, expected a list of {n} names")
    bad = [x for x in names if not _is_name(x)]
    if bad:
        raise _corrupt(where, f"branch_names holds {str(bad[0])[:80]!r}, not an attribute name")
    if not _is_name(name):
        raise _corrupt(where, f"name is {str(name)[:80]!r}, not a node name")
    return n, names, name


def _check_pred(pred: Any, index: Any, bound: int, where: str) -> None:
    """``pred`` must be ``index <= bound``."""
    ok = (isinstance(pred, Node) and pred.op == "call_function" and pred.target in _LE_TARGETS
          and not pred.kwargs and len(pred.args) == 2 and pred.args[0] is index
          and _is_int(pred.args[1]) and pred.args[1] == bound)
    if not ok:
        got = f"{pred.target}{pred.args}" if isinstance(pred, Node) else repr(pred)
        raise _corrupt(where, f"a predicate should be (index <= {bound}), found {got}")


def _subgraph(owner: GraphModule, arg: Any, where: str) -> GraphModule:
    if not (isinstance(arg, Node) and arg.op == "get_attr"):
        raise _corrupt(where, f"a cond branch is {arg!r}, not a get_attr")
    try:
        gm = resolve_attr(owner, str(arg.target))
    except AttributeError:
        gm = None
    if not isinstance(gm, GraphModule):
        raise _corrupt(where, f"a cond branch '{arg.target}' is not a graph")
    return gm


def _check_inner(gm: GraphModule, where: str) -> Node:
    """An inner graph of the tree: placeholders -> pred -> one cond over all of
    them -> its outputs, in order. Returns the cond."""
    conds = [n for n in gm.graph.nodes if is_cond(n)]
    if len(conds) != 1:
        raise _corrupt(where, f"an inner graph of the tree holds {len(conds)} conds, expected 1")
    (cond,) = conds
    if _tag_of(cond) is not None:
        raise _corrupt(where, "an inner cond of the tree carries a switch marker")
    if len(cond.args) != 4 or cond.kwargs:
        raise _corrupt(where, "an inner cond does not take (pred, true, false, operands)")
    pred, t, f, _ = cond.args
    getitems = [u for u in cond.users if u.op == "call_function" and u.target is operator.getitem]
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    allowed = {*placeholders(gm), pred, t, f, cond, *getitems, out}
    extra = [n for n in gm.graph.nodes if n not in allowed]
    if extra:
        raise _corrupt(where, f"an inner graph of the tree computes more than its cond ({extra[0].name})")
    ret = out.args[0]
    if ret is not cond:
        items = list(ret) if isinstance(ret, (tuple, list)) else [ret]
        if not all(isinstance(x, Node) and x in getitems and x.args == (cond, k) for k, x in enumerate(items)) \
                or len(items) != len(getitems):
            raise _corrupt(where, "an inner graph of the tree does not return its cond's outputs in order")
    return cond


def _walk(owner: GraphModule, cond: Node, index: Any, available: dict[Node, int] | None, lo: int, hi: int,
          leaves: list[tuple[GraphModule, list[int]]], where: str) -> list[int]:
    """Check the subtree of ``cond`` chooses among branches ``[lo, hi)``;
    append ``(leaf, positions)`` for its leaves, ``positions`` naming the
    switch operand each non-index leaf input is. ``available`` maps the
    inputs of ``cond``'s graph to switch operand positions (None at the top:
    the top cond's operands define the positions). Returns the positions
    ``cond`` passes."""
    pred, t, f, ops = cond.args
    if not isinstance(ops, (tuple, list)):
        raise _corrupt(where, "a cond of the tree has no operand tuple")
    ops = list(ops)
    with_index = hi - lo > 2
    if with_index and (not ops or ops[0] is not index):
        raise _corrupt(where, "a cond of the tree does not pass its index first")
    passed = ops[1:] if with_index else ops
    if available is None:
        positions = list(range(len(passed)))
    else:
        if not all(isinstance(x, Node) and x in available for x in passed):
            raise _corrupt(where, "a cond of the tree passes a value that is not an input of its graph")
        positions = [available[x] for x in passed]
        if any(a >= b for a, b in zip(positions, positions[1:])):
            raise _corrupt(where, "a cond of the tree passes its inputs out of order")
    mid = (lo + hi) // 2
    _check_pred(pred, index, mid - 1, where)
    for arg, a, b in ((t, lo, mid), (f, mid, hi)):
        gm = _subgraph(owner, arg, where)
        phs = placeholders(gm)
        if len(phs) != len(ops):
            raise _corrupt(where, f"a subgraph takes {len(phs)} inputs, the cond passes {len(ops)}")
        sub_index, inputs = (phs[0], phs[1:]) if with_index else (None, phs)
        if b - a == 1:
            if sub_index is not None and sub_index.users:
                raise _corrupt(where, f"leaf {a} reads the index")
            leaves.append((gm, positions))
        else:
            if sub_index is None:
                raise _corrupt(where, f"the subtree of branches {a}..{b - 1} is not given the index")
            _walk(gm, _check_inner(gm, where), sub_index, dict(zip(inputs, positions)), a, b, leaves, where)
    return positions


def _branch(leaf: GraphModule, positions: list[int], operands: list[Any]) -> GraphModule:
    """The branch graph of ``leaf``: its body over all the switch's
    ``operands`` (``positions`` places the leaf's own inputs among them)."""
    phs = placeholders(leaf)[-len(positions):] if positions else []
    graph = Graph()
    new = []
    for k, op in enumerate(operands):
        ph = graph.placeholder(op.name if isinstance(op, Node) else f"operand_{k}")
        if isinstance(op, Node):
            ph.meta = {key: v for key, v in op.meta.items() if key in ("val", "example_value", "tensor_meta")}
        new.append(ph)
    env: dict[Node, Node] = {}
    for ph, pos in zip(phs, positions):
        new[pos].meta = dict(ph.meta)
        env[ph] = new[pos]
    for ph in placeholders(leaf)[: len(placeholders(leaf)) - len(positions)]:
        if ph.users:  # the index of a leaf; _walk checked it is unread
            raise SerializationError("a leaf reads its index", where=f"graph {type(leaf).__name__}")
    out = next(n for n in reversed(leaf.graph.nodes) if n.op == "output")
    for n in leaf.graph.nodes:
        if n.op not in ("placeholder", "output"):
            env[n] = graph.node_copy(n, env.__getitem__)
    result = graph.output(torch.fx.node.map_arg(out.args[0], env.__getitem__))
    result.meta = dict(out.meta)
    return GraphModule(leaf, graph, class_name="GraphModule")


def _signature(gm: GraphModule) -> tuple:
    """What ``gm`` computes, for comparing two leaves: its code and, by
    attribute name, its subgraphs' signatures and its other attributes."""
    attrs = []
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            obj = resolve_attr(gm, str(n.target))
            if isinstance(obj, GraphModule):
                attrs.append((n.target, _signature(obj)))
            elif isinstance(obj, torch.Tensor):
                attrs.append((n.target, obj.dtype, tuple(obj.shape), obj.detach().cpu().flatten().tolist()))
            else:
                attrs.append((n.target, repr(obj)))
    return (gm.code, tuple(attrs))


def _decode_switch(gm: GraphModule, cond: Node, tag: Any) -> tuple[Node, str]:
    """Replace one tagged cond tree of ``gm`` by its switch; return the switch
    and the name it should get (the caller recompiles ``gm``)."""
    where = describe_node(cond)
    if len(cond.args) != 4 or cond.kwargs or not isinstance(cond.args[3], (tuple, list)):
        raise _corrupt(where, "the tagged cond does not take (pred, true, false, operands)")
    pred, ops = cond.args[0], list(cond.args[3])
    if not (isinstance(pred, Node) and pred.args and isinstance(pred.args[0], Node)):
        raise _corrupt(where, "the tagged cond's predicate does not compare an index")
    index = pred.args[0]
    val = index.meta.get("val")
    if isinstance(val, torch.Tensor) and (val.dtype.is_floating_point or val.dtype.is_complex):
        raise _corrupt(where, f"the index is {val.dtype}; a switch index is an integer or bool")
    n_tag = tag.get("num_branches") if isinstance(tag, dict) else None
    wide = _is_int(n_tag) and n_tag > 2
    n, names, name = _check_tag(tag, where, len(ops) - (1 if wide else 0))
    leaves: list[tuple[GraphModule, list[int]]] = []
    positions = _walk(gm, cond, index, None, 0, max(n, 2), leaves, where)
    operands = ops[1:] if n > 2 else ops
    if len(positions) != len(operands):
        raise _corrupt(where, "the tagged cond's operands do not match its tree")
    branches = [_branch(leaf, pos, operands) for leaf, pos in leaves]
    if n == 1:
        if _signature(branches[0]) != _signature(branches[1]):
            raise _corrupt(where, "a one-branch switch is stored as two leaves that differ")
        branches = branches[:1]
    # Slots that shared a branch graph when saved share one again -- only if
    # their branches compute the same thing.
    first: dict[str, int] = {}
    for k, want in enumerate(names):
        j = first.setdefault(want, k)
        if j != k and _signature(branches[j]) != _signature(branches[k]):
            raise _corrupt(where, f"branches {j} and {k} are both named {want!r} but differ")
    with gm.graph.inserting_before(cond):
        attrs: dict[str, Node] = {}
        for want in names:
            if want not in attrs:
                attr = _fresh_attr(gm, want)
                gm.register_module(attr, branches[first[want]])
                attrs[want] = gm.graph.get_attr(attr)
        switch = gm.graph.call_function(SWITCH, (index, [attrs[w] for w in names], tuple(operands)))
    switch.meta = dict(cond.meta)
    cond.replace_all_uses_with(switch)
    # torch's loader copies a HOP's meta onto its getitem users: drop the tag
    # there too -- only there: a one-output cond feeds its users directly, and
    # such a user may be the next encoded switch.
    getitems = [u for u in switch.users if u.op == "call_function" and u.target is operator.getitem]
    for node in (switch, *getitems):
        custom = dict(node.meta.get("custom") or {})
        if custom.pop(MARKER_KEY, None) is not None:
            if custom:
                node.meta["custom"] = custom
            else:
                node.meta.pop("custom", None)
    pred, t, f, _ = cond.args
    gm.graph.erase_node(cond)
    for a in dict.fromkeys((t, f)):
        if not a.users:
            gm.graph.erase_node(a)
            if not any(x.op == "get_attr" and x.target == a.target for x in gm.graph.nodes):
                delattr(gm, str(a.target))
    if isinstance(pred, Node) and not pred.users:
        gm.graph.erase_node(pred)
    return switch, name


def _restore_names(graph: Graph, renames: list[tuple[Node, str]]) -> None:
    """Give each restored switch its saved name where no other node has it."""
    taken = {n.name for n in graph.nodes}
    for switch, want in renames:
        if want != switch.name and want not in taken:
            taken.discard(switch.name)
            switch.name = want
            taken.add(want)


def decode_switches(program: ExportedProgram) -> tuple[ExportedProgram, int]:
    """Turn every tagged cond tree written by :func:`encode_switches` back into
    its switch; return the program (changed in place) and how many were restored."""
    gm = program.graph_module
    # torch's loader copies a cond's meta onto its getitem users and branch
    # get_attrs; only a cond's own tag counts (a moved tag fails the count).
    # Children first: a switch nested in a branch is restored before the
    # outer restore copies that branch's body into the new branch graph.
    found = [(m, [n for n in m.graph.nodes if is_cond(n) and _tag_of(n) is not None])
             for m in list(iter_graph_modules(gm, children_first=True))]
    found = [(m, nodes) for m, nodes in found if nodes]
    if not found:
        return program, 0
    if not HAS_SWITCH:
        raise SerializationError(
            f"the program holds switch nodes, which torch {torch.__version__} lacks",
            hint="load it with plain torch.export.load to get the equivalent cond trees",
        )
    for m, nodes in found:
        renames = [_decode_switch(m, node, _tag_of(node)) for node in nodes]
        _restore_names(m.graph, renames)
        m.recompile()
    found = [n for _, nodes in found for n in nodes]
    try:
        return program._update(gm, program.graph_signature), len(found)
    except Exception as exc:  # torch's verifier: e.g. a tag's name that the signature does not know
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise _corrupt(describe_node(found[0]) if len(found) == 1 else f"{len(found)} switches",
                       f"the restored program does not verify ({type(exc).__name__}: {first[:200]})") from exc
