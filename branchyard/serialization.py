"""Save and load exported programs that hold a ``switch`` to/from ``.pt2``.

torch 2.14's ``torch.export.save`` cannot write a program holding
``torch.ops.higher_order.switch``: the serializer has no encoding for the
switch's *list* of branch graphs and raises ``SerializeError``.
:func:`save` therefore writes every switch as an equivalent chain of
``cond`` nodes (which torch serializes natively), tags the chain with a
marker in the nodes' ``meta["custom"]`` (which the ``.pt2`` format keeps),
and records how many switches it lowered in an extra file of the archive.
:func:`load` reads the archive with ``torch.export.load`` and turns every
tagged chain back into the original switch.

The lowering, for ``switch(index, [b0, ..., b{n-1}], ops)`` (``n >= 2``)::

    before                          after (in the .pt2)
    ------                          -------------------
    out = switch(i, [b0..bn-1], ops)   p0  = i <= 0
                                       out = cond(p0, w0, r1, (*ops, i))
                                       r_k(*ops, i) = cond(i == k, w_k, r_{k+1}, (*ops, i))
                                       r_{n-1} = w_{n-1}

where ``w_k`` is ``b_k`` with one extra, unused trailing placeholder for
``i``. As Python: ``b0 if i <= 0 else b1 if i == 1 else ... else b{n-1}``,
which is ``branches[clamp(i, 0, n - 1)]`` -- the switch's own semantics for
every index, in range or not.

The restore is exact: the same number of branches, the same branch graphs
(the extra placeholder removed), the same operands in the same order, the
same index node, and the switch's outputs feed the same users. A ``.pt2``
written by :func:`save` also loads with plain ``torch.export.load``; that
gives the ``cond``-chain program above, which computes the same outputs.

Programs without a switch are written and read by torch's own save/load
unchanged::

    >>> import torch, tempfile, os, branchyard.serialization as bs
    >>> class AddOne(torch.nn.Module):
    ...     def forward(self, x):
    ...         return x + 1
    >>> ep = torch.export.export(AddOne(), (torch.zeros(2),))
    >>> path = os.path.join(tempfile.mkdtemp(), "add_one.pt2")
    >>> bs.save(ep, path)
    >>> bs.load(path).module()(torch.zeros(2))
    tensor([1., 1.])
"""

from __future__ import annotations

import copy
import io
import json
import operator
import os
from typing import Any, Union

import torch
from torch.export import ExportedProgram
from torch.fx import Graph, GraphModule, Node

from branchyard._compat import HAS_SWITCH, TORCH_VERSION
from branchyard.errors import SerializationError
from branchyard.fx.graph_walk import copy_graph_module, iter_graph_modules

__all__ = ["save", "load", "lower_switches_for_save", "restore_switches", "MARKER_FILE", "MARKER_KEY"]

#: Name of the extra file in the ``.pt2`` archive that records the lowering.
MARKER_FILE = "branchyard_switch.json"
#: Key in ``node.meta["custom"]`` that tags the outer ``cond`` of a lowered switch.
MARKER_KEY = "branchyard_switch"
_FORMAT = "branchyard-switch-as-cond"
_VERSION = 1

PathLike = Union[str, "os.PathLike[str]"]
_cond_op = torch.ops.higher_order.cond


def _is_switch(node: Node) -> bool:
    return HAS_SWITCH and node.op == "call_function" and node.target is torch.ops.higher_order.switch


def _fresh_attr(owner: torch.nn.Module, base: str) -> str:
    name, k = base, 0
    while hasattr(owner, name):
        k += 1
        name = f"{base}_{k}"
    return name


def _placeholders(gm: GraphModule) -> list[Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _where(file: Any) -> str:
    return f"file {os.fspath(file)!r}" if isinstance(file, (str, os.PathLike)) else f"file object {file!r}"


# ---------------------------------------------------------------------------
# switch -> tagged cond chain
# ---------------------------------------------------------------------------


def _pred(graph: Graph, index: Node, index_val: Any, k: int, first: bool) -> Node:
    """``index <= 0`` for the first level, ``index == k`` below it; tensor or SymInt index."""
    if isinstance(index_val, torch.Tensor):
        target = torch.ops.aten.le.Scalar if first else torch.ops.aten.eq.Scalar
        node = graph.call_function(target, (index, k))
        node.meta["val"] = target(index_val, k)
    else:  # SymInt index: a symbolic comparison gives a SymBool predicate
        target = operator.le if first else operator.eq
        node = graph.call_function(target, (index, k))
        node.meta["val"] = target(index_val, k)
    return node


def _add_index_placeholder(branch: GraphModule, index_val: Any) -> None:
    """Append an unused placeholder so the branch takes ``(*ops, index)``."""
    last = _placeholders(branch)[-1] if _placeholders(branch) else None
    graph = branch.graph
    ctx = graph.inserting_after(last) if last is not None else graph.inserting_before(next(iter(graph.nodes)))
    with ctx:
        ph = graph.placeholder("branchyard_index")
    ph.meta["val"] = index_val
    branch.recompile()


def _emit_cond(graph: Graph, owner: torch.nn.Module, pred: Node, true_gm: GraphModule, false_gm: GraphModule,
               operands: tuple, out_val: Any, tag: dict, name_hint: str) -> Node:
    t_name = _fresh_attr(owner, f"{name_hint}_true")
    owner.register_module(t_name, true_gm)
    f_name = _fresh_attr(owner, f"{name_hint}_false")
    owner.register_module(f_name, false_gm)
    t_node = graph.get_attr(t_name)
    f_node = graph.get_attr(f_name)
    cond = graph.call_function(_cond_op, (pred, t_node, f_node, tuple(operands)))
    cond.meta["val"] = out_val
    cond.meta["custom"] = {MARKER_KEY: tag}
    return cond


def _copy_meta(src: Node, dst: Node) -> None:
    """Carry the switch's source-level meta (stack trace, module stack, user
    ``custom`` entries) over to its stand-in, keeping our marker."""
    for key, value in src.meta.items():
        if key == "custom":
            dst.meta["custom"] = {**value, **dst.meta.get("custom", {})}
        elif key != "val":
            dst.meta.setdefault(key, value)


def _chain_level(k: int, n: int, branches: list[GraphModule], operand_vals: list, index_val: Any,
                 out_val: Any, tag: dict) -> GraphModule:
    """``r_k(*ops, i) = cond(i == k, w_k, r_{k+1}, (*ops, i))`` as its own GraphModule."""
    graph = Graph()
    owner = torch.nn.Module()
    phs = []
    for j, val in enumerate(operand_vals):
        ph = graph.placeholder(f"operand_{j}")
        ph.meta["val"] = val
        phs.append(ph)
    index = graph.placeholder("branchyard_index")
    index.meta["val"] = index_val
    pred = _pred(graph, index, index_val, k, first=False)
    rest = branches[k + 1] if k + 1 == n - 1 else _chain_level(k + 1, n, branches, operand_vals, index_val, out_val, tag)
    cond = _emit_cond(graph, owner, pred, branches[k], rest, (*phs, index), out_val,
                      {**tag, "level": k}, f"level{k}")
    if isinstance(out_val, (tuple, list)):
        outs = []
        for j, v in enumerate(out_val):
            g = graph.call_function(operator.getitem, (cond, j))
            g.meta["val"] = v
            outs.append(g)
        graph.output(tuple(outs))
    else:
        # Branches that return a bare value (not a tuple): so does this level.
        graph.output(cond)
    return GraphModule(owner, graph, class_name=f"branchyard_switch_level{k}")


def _lower_switch(gm: GraphModule, node: Node) -> None:
    """Rewrite one switch of ``gm`` as a tagged cond chain (``gm`` is
    recompiled by the caller, once for all its switches)."""
    index, branch_nodes, operands = node.args
    branches = [getattr(gm, b.target) for b in branch_nodes]
    n = len(branches)
    index_val = index.meta["val"] if isinstance(index, Node) else index
    if not isinstance(index, Node):
        raise SerializationError(
            f"switch with a constant index {index!r} cannot be saved",
            where=f"node {node.name!r}",
            hint="fold the constant switch into its selected branch before saving",
        )
    out_val = node.meta["val"]
    operand_vals = [o.meta["val"] for o in operands]
    # A branch graph used in several slots gets one copy per extra slot, so
    # each slot's stand-in can take the extra index input once; the restore
    # re-shares them by name.
    seen: set[int] = set()
    for k, b in enumerate(branches):
        if id(b) in seen:
            branches[k] = copy.deepcopy(b)
        seen.add(id(b))
    for b in branches:
        _add_index_placeholder(b, index_val)
    tag = {
        "format": _FORMAT,
        "version": _VERSION,
        "num_branches": n,
        "num_operands": len(operands),
        "name": node.name,
        "branch_names": [b.target for b in branch_nodes],
        "level": 0,
    }
    # One branch: both sides of the cond are the same graph (a copy, so the
    # restore can take the true side and drop the other).
    if n == 1:
        branches = [branches[0], copy.deepcopy(branches[0])]
    with gm.graph.inserting_before(node):
        pred = _pred(gm.graph, index, index_val, 0, first=True)
        rest = branches[1] if len(branches) == 2 else _chain_level(1, n, branches, operand_vals, index_val, out_val, tag)
        cond = _emit_cond(gm.graph, gm, pred, branches[0], rest, (*operands, index), out_val, tag,
                          f"{node.name}_as_cond")
    _copy_meta(node, cond)
    node.replace_all_uses_with(cond)
    gm.graph.erase_node(node)
    # The cond takes the switch's name: the program's output specs name a
    # switch that is itself a graph output.
    cond.name = tag["name"]
    for b in dict.fromkeys(branch_nodes):
        if not b.users:
            gm.graph.erase_node(b)
            # The branch graphs now live under the cond's attributes.
            delattr(gm, b.target)


def lower_switches_for_save(program: ExportedProgram) -> tuple[ExportedProgram, int]:
    """A copy of ``program`` with every switch (at any depth) rewritten as a
    tagged ``cond`` chain, and the number of switches rewritten.

    ``program`` itself is not changed. The copy runs like the original for
    every index (out-of-range ones clamp the same way) and torch can save it.
    """
    gm = copy_graph_module(program.graph_module)
    count = 0
    # Children before parents: a switch's branches hold no switch by the time
    # it is lowered, so the copies made for shared branch slots need no
    # further lowering, and each graph is scanned and recompiled once (the
    # walk is linear in the program, not quadratic in its switches).
    for m in list(iter_graph_modules(gm, children_first=True)):
        switches = [n for n in m.graph.nodes if _is_switch(n)]
        for node in switches:
            _lower_switch(m, node)
        if switches:
            m.recompile()
        count += len(switches)
    if count == 0:
        return program, 0
    return program._update(gm, program.graph_signature), count


# ---------------------------------------------------------------------------
# tagged cond chain -> switch
# ---------------------------------------------------------------------------


def _tag(node: Node) -> dict | None:
    if node.op != "call_function" or node.target is not _cond_op:
        return None
    custom = node.meta.get("custom") or {}
    tag = custom.get(MARKER_KEY)
    return tag if isinstance(tag, dict) and tag.get("level") == 0 else None


def _corrupt(where: str, what: str) -> SerializationError:
    return SerializationError(
        f"lowered switch is malformed: {what}",
        where=where,
        hint="the .pt2 was edited after branchyard.save wrote it; re-save the original program",
    )


def _restore_switch(gm: GraphModule, cond: Node, tag: dict) -> Node:
    """Replace one tagged cond chain of ``gm`` by its switch and return the
    switch (the caller recompiles ``gm`` and restores node names)."""
    where = f"node {cond.name!r}"
    if tag.get("format") != _FORMAT or tag.get("version") != _VERSION:
        raise _corrupt(where, f"unknown marker {tag!r}")
    n, m = int(tag["num_branches"]), int(tag["num_operands"])
    pred, t_node, f_node, ops = cond.args
    if len(ops) != m + 1:
        raise _corrupt(where, f"expected {m} operands and the index, found {len(ops)} operands")
    index, operands = ops[-1], tuple(ops[:-1])
    branches = [getattr(gm, t_node.target)]
    rest = getattr(gm, f_node.target)
    for k in range(1, n - 1):
        inner = [x for x in rest.graph.nodes if x.op == "call_function" and x.target is _cond_op]
        if len(inner) != 1 or (inner[0].meta.get("custom") or {}).get(MARKER_KEY, {}).get("level") != k:
            raise _corrupt(where, f"level {k} of the cond chain is missing")
        _, t_k, f_k, _ = inner[0].args
        branches.append(getattr(rest, t_k.target))
        rest = getattr(rest, f_k.target)
    if n >= 2:
        branches.append(rest)
    for k, b in enumerate(branches):
        phs = _placeholders(b)
        if len(phs) != m + 1 or phs[-1].users:
            raise _corrupt(where, f"branch {k} does not take (*operands, index) with the index unused")
        b.graph.erase_node(phs[-1])
        b.recompile()

    names = tag.get("branch_names") or []
    with gm.graph.inserting_before(cond):
        getattrs = []
        by_name: dict[str, Node] = {}  # slots that shared one branch graph share it again
        for k, b in enumerate(branches):
            want = names[k] if k < len(names) and isinstance(names[k], str) else f"{cond.name}_branch{k}"
            if want in by_name:
                getattrs.append(by_name[want])
                continue
            name = _fresh_attr(gm, want)
            gm.register_module(name, b)
            by_name[want] = gm.graph.get_attr(name)
            getattrs.append(by_name[want])
        switch = gm.graph.call_function(torch.ops.higher_order.switch, (index, getattrs, operands))
    switch.meta = dict(cond.meta)
    cond.replace_all_uses_with(switch)
    # The deserializer copies a HOP's meta onto its getitem users: drop our
    # marker everywhere it landed -- only there: a cond with one output feeds
    # its users directly, and such a user may be the next lowered switch.
    getitems = [u for u in switch.users if u.op == "call_function" and u.target is operator.getitem]
    for n in (switch, *getitems):
        custom = dict(n.meta.get("custom") or {})
        if custom.pop(MARKER_KEY, None) is not None:
            if custom:
                n.meta["custom"] = custom
            else:
                n.meta.pop("custom", None)
    gm.graph.erase_node(cond)
    for a in (t_node, f_node):
        if not a.users:
            gm.graph.erase_node(a)
            delattr(gm, a.target)
    if isinstance(pred, Node) and not pred.users:
        gm.graph.erase_node(pred)
    return switch


def _restore_names(graph: Graph, renames: list[tuple[Node, Any]]) -> None:
    """Give each restored switch its saved name where no other node has it."""
    taken = {n.name for n in graph.nodes}
    for switch, want in renames:
        if isinstance(want, str) and want != switch.name and want not in taken:
            taken.discard(switch.name)
            switch.name = want
            taken.add(want)


def restore_switches(program: ExportedProgram) -> tuple[ExportedProgram, int]:
    """Turn every tagged ``cond`` chain written by :func:`save` back into the
    switch it came from; return the program and how many were restored."""
    if not HAS_SWITCH:
        raise SerializationError(
            f"the program holds switch nodes, which torch {torch.__version__} lacks",
            hint="load it with plain torch.export.load to get the equivalent cond chains",
        )
    gm = program.graph_module
    # One scan finds every chain; restoring one chain keeps the branch graph
    # objects (and so the chains nested in them) as they are.
    found = [(m, n, t) for m in list(iter_graph_modules(gm)) for n in list(m.graph.nodes) if (t := _tag(n)) is not None]
    renames: dict[int, tuple[GraphModule, list[tuple[Node, Any]]]] = {}
    for m, node, tag in found:
        switch = _restore_switch(m, node, tag)
        renames.setdefault(id(m), (m, []))[1].append((switch, tag.get("name")))
    for m, pairs in renames.values():
        _restore_names(m.graph, pairs)
        m.recompile()
    count = len(found)
    if count == 0:
        return program, 0
    return program._update(gm, program.graph_signature), count


# ---------------------------------------------------------------------------
# public save / load
# ---------------------------------------------------------------------------


def save(program: ExportedProgram, path: PathLike | io.BytesIO) -> None:
    """Write ``program`` to a ``.pt2`` file, switches included.

    Programs without a switch are written exactly as ``torch.export.save``
    writes them. Raises :class:`~branchyard.errors.SerializationError` naming
    the file when ``program`` is not an ExportedProgram or the file cannot
    be written.
    """
    where = _where(path)
    if not isinstance(program, ExportedProgram):
        raise SerializationError(
            f"can only save a torch.export.ExportedProgram, got {type(program).__name__}",
            where=where,
            hint="export the model with torch.export.export first",
        )
    lowered, count = lower_switches_for_save(program)
    marker = json.dumps({"format": _FORMAT, "version": _VERSION, "switches": count,
                         "torch": ".".join(map(str, TORCH_VERSION))})
    try:
        torch.export.save(lowered, path, extra_files={MARKER_FILE: marker})
    except (OSError, RuntimeError, TypeError, ValueError) as exc:
        raise SerializationError(f"could not write the program: {exc}", where=where) from exc


def load(path: PathLike | io.BytesIO) -> ExportedProgram:
    """Read a ``.pt2`` written by :func:`save` (or by ``torch.export.save``)
    and return the ExportedProgram with its switches restored.

    Raises :class:`~branchyard.errors.SerializationError` naming the file when
    it is missing, is not a ``.pt2`` archive, or holds a malformed marker.
    """
    where = _where(path)
    if isinstance(path, (str, os.PathLike)) and not os.path.isfile(path):
        raise SerializationError("no such file", where=where, hint="check the path")
    extra = {MARKER_FILE: ""}
    try:
        program = torch.export.load(path, extra_files=extra)
    except Exception as exc:  # zipfile / pickle / torch errors all mean "not a readable .pt2"
        raise SerializationError(
            f"not a readable .pt2 archive ({type(exc).__name__}: {exc})", where=where
        ) from exc
    raw = extra.get(MARKER_FILE) or ""
    if not raw:
        return program  # written by plain torch.export.save
    try:
        marker = json.loads(raw)
        expected = int(marker["switches"])
        if marker.get("format") != _FORMAT:
            raise ValueError(f"unknown format {marker.get('format')!r}")
    except (ValueError, KeyError, TypeError) as exc:
        raise SerializationError(f"malformed {MARKER_FILE}: {exc}", where=where) from exc
    if expected == 0:
        return program
    try:
        restored, count = restore_switches(program)
    except SerializationError as exc:
        raise SerializationError(exc.message, where=f"{where}, {exc.where}", hint=exc.hint) from exc
    if count != expected:
        raise SerializationError(
            f"{MARKER_FILE} records {expected} switch(es) but {count} were found", where=where,
            hint="the archive was edited after it was written; re-save the original program",
        )
    return restored
