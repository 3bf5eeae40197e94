"""Walking, linting, copying and realizing nested graph modules.

A program with control flow is a tree of ``GraphModule``\\ s: each cond,
switch or while_loop node reads its branch bodies with ``get_attr`` from its
owner. Every module that needs "each graph of the program" walks it here:

* :func:`iter_graph_modules` -- the root and every GraphModule below it, each once;
* :func:`rewrite_graphs` -- call a rewrite on every node of every graph,
  parents before children, and drop the attributes the rewrites freed;
* :func:`lint_graph_module` -- ``Graph.lint`` on all of them, failing with
  :class:`~branchyard.errors.MalformedGraphError` naming the graph;
* :func:`graph_path` -- where a subgraph sits below the root the last walk
  started from (``"true_graph_0.false_graph_0"``), so that an error can tell
  apart nodes of the same name in different branches;
* :func:`copy_graph_module` / :func:`realize_graph_modules` -- a copy that keeps
  node names and generates code once per module, and turning lazily compiled
  modules into eager ones (Dynamo will not trace a lazy module)::

    >>> import torch
    >>> gm = torch.fx.symbolic_trace(lambda x: x + 1)
    >>> twin = copy_graph_module(gm)
    >>> len(list(iter_graph_modules(twin))), twin is gm, twin.code == gm.code
    (1, False, True)
"""

from __future__ import annotations

import copy
import weakref
from typing import Any, Callable, Iterator

import torch
from torch.fx import GraphModule, Node

from branchyard.errors import MalformedGraphError

__all__ = [
    "iter_graph_modules",
    "rewrite_graphs",
    "graph_path",
    "graph_label",
    "inherit_graph_path",
    "name_graphs",
    "note_subgraph",
    "resolve_attr",
    "lint_graph_module",
    "copy_graph_module",
    "realize_graph_modules",
]


#: Each subgraph's place below the root, in the coordinates of the program a
#: pass was given: named afresh by :func:`lint_graph_module` (every pass and
#: pipeline lints its input first), inherited by copies, and kept while a
#: rewrite moves the module (a module a rewrite makes gets its first place).
#: A place is ``(parent's place, name)``, ``None`` at the root: a chain shared
#: with the parent, so deep nesting costs memory linear in the depth.
_PATHS: weakref.WeakKeyDictionary[GraphModule, tuple | None] = weakref.WeakKeyDictionary()
#: Places deeper than this are shown by their first and last names only.
_SHOWN_LEVELS = 8


def note_subgraph(owner: torch.nn.Module, name: str, child: GraphModule, *, fresh: bool = False) -> None:
    """Record that ``child`` is ``owner``'s attribute ``name``, unless it has a
    place already (``fresh=True``: record it anyway)."""
    if not fresh and child in _PATHS:
        return
    parent = _PATHS.get(owner) if isinstance(owner, GraphModule) else None
    _PATHS[child] = (parent, name)


def inherit_graph_path(new: GraphModule, old: GraphModule) -> None:
    """Let ``new`` (a copy or rebuild of ``old``) stand where ``old`` did."""
    if old in _PATHS:
        _PATHS[new] = _PATHS[old]


def name_graphs(gm: GraphModule) -> list[GraphModule]:
    """Make ``gm`` a root and name every subgraph afresh from it; return
    ``gm`` and its subgraphs in :func:`iter_graph_modules` order."""
    _PATHS[gm] = None
    return list(_walk(gm, children_first=False, fresh=True))


def graph_path(gm: GraphModule | None) -> str:
    """Where ``gm`` sits below the root of the program the running pass was
    given (``"true_graph_0.body_graph_0"``); ``""`` for a root or a module no
    walk reached. A module shared by two programs is named in the one checked
    last, so a caller of the node-level functions (``cond_parts`` and the
    like) on a module of another program should lint that program first.

        >>> import torch
        >>> def f(p, x):
        ...     return torch.cond(p, lambda x: x + 1, lambda x: x - 1, (x,))
        >>> gm = torch.fx.experimental.proxy_tensor.make_fx(f)(torch.tensor(True), torch.ones(2))
        >>> lint_graph_module(gm)
        >>> [graph_path(m) for m in iter_graph_modules(gm)]
        ['', 'true_graph_0', 'false_graph_0']
        >>> lint_graph_module(gm.true_graph_0)  # a pass given the branch alone
        >>> graph_path(gm.true_graph_0)
        ''

    A place more than eight levels deep shows its first and last three
    names around ``[N more]``.
    """
    place = _PATHS.get(gm) if gm is not None else None
    names: list[str] = []
    while place is not None:
        place, name = place
        names.append(name)
    names.reverse()
    if len(names) > _SHOWN_LEVELS:
        head, tail = names[:3], names[-3:]
        names = [*head, f"[{len(names) - 6} more]", *tail]
    return ".".join(names)


def iter_graph_modules(gm: GraphModule, *, children_first: bool = False) -> Iterator[GraphModule]:
    """``gm`` and every GraphModule reachable from it as a submodule, each
    once (a module shared by several parents too), depth first with
    siblings in definition order: each module before its children, or with
    ``children_first=True`` after all of its descendants (the order in which
    rewriting a branch cannot affect a graph already seen)."""
    return _walk(gm, children_first=children_first, fresh=False)


def _walk(gm: GraphModule, *, children_first: bool, fresh: bool) -> Iterator[GraphModule]:
    """:func:`iter_graph_modules`, naming each subgraph from the parent it is
    first reached from (``fresh``: even one named before)."""
    seen: set[int] = set()
    named: set[int] = {id(gm)}
    stack: list[tuple[GraphModule, bool]] = [(gm, False)]
    while stack:
        m, expanded = stack.pop()
        if expanded:
            yield m
            continue
        if id(m) in seen:
            continue
        seen.add(id(m))
        if children_first:
            stack.append((m, True))
        else:
            yield m
        children = [(name, c) for name, c in m.named_children() if isinstance(c, GraphModule)]
        for name, c in children:
            if id(c) not in named:
                named.add(id(c))
                note_subgraph(m, name, c, fresh=fresh)
        stack.extend(reversed([(c, False) for _, c in children]))


def rewrite_graphs(gm: GraphModule, rewrite: Callable[[GraphModule, Node, set[str]], bool],
                   _seen: set[int] | None = None) -> bool:
    """Call ``rewrite(owner, node, dead_attrs)`` on every node of ``gm``, then
    of every GraphModule below it (each once, a parent before its children,
    so subgraphs a rewrite creates are visited too); afterwards drop from each
    owner the attributes a rewrite put in ``dead_attrs`` that no ``get_attr``
    or ``call_module`` node still uses. Returns whether any call changed something."""
    seen = set() if _seen is None else _seen
    if id(gm) in seen:
        return False
    seen.add(id(gm))
    changed = False
    dead: set[str] = set()
    for node in list(gm.graph.nodes):
        changed |= rewrite(gm, node, dead)
    if dead:
        live = {str(n.target) for n in gm.graph.nodes if n.op in ("get_attr", "call_module")}
        for name in dead - live:
            delattr(gm, name)
    for name, child in list(gm.named_children()):
        if isinstance(child, GraphModule):
            if id(child) not in seen:
                note_subgraph(gm, name, child)
            changed |= rewrite_graphs(child, rewrite, seen)
    return changed


def resolve_attr(gm: torch.nn.Module, target: str) -> Any:
    """The object a ``get_attr`` node with ``target`` reads from ``gm``."""
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def graph_label(gm: GraphModule) -> str:
    """``gm`` as errors name it: its :func:`graph_path`, else the label a pass
    gave it, else its class name (a root)."""
    return graph_path(gm) or getattr(gm, "_branchyard_label", type(gm).__name__)


def lint_graph_module(gm: GraphModule) -> None:
    """Lint ``gm`` and every subgraph; raise :class:`MalformedGraphError`
    naming the graph that fails. Names the subgraphs afresh from ``gm``
    (:func:`graph_path`)."""
    for sub in name_graphs(gm):
        try:
            sub.graph.lint()
        except Exception as exc:  # torch raises RuntimeError / AssertionError here
            raise MalformedGraphError(
                f"graph fails torch.fx lint: {exc}", where=f"graph module {graph_label(sub)!r}"
            ) from exc


def copy_graph_module(gm: GraphModule, *, lazy: bool = False, share_tensors: bool = False) -> GraphModule:
    """Copy ``gm`` and every GraphModule under it, keeping every node's name.

    Tensors (parameters, buffers, constants) are deep-copied (with
    ``share_tensors=True`` the copy holds the same tensors); node ``meta`` is
    copied shallowly (its fake values are never mutated); a subgraph shared by
    several parents stays shared.

    Unlike ``copy.deepcopy``, names that shadow Python builtins survive
    (``input`` stays ``input``, which an ExportedProgram's signature needs),
    and code generation runs once per module instead of once per ancestor
    (every ``GraphModule.recompile`` recompiles all its descendants, so a deep
    copy of nested control flow is O(nodes x depth)). With ``lazy=True`` the
    copy's modules generate code on first use; :func:`realize_graph_modules`
    makes them eager.
    """
    memo: dict[int, Any] = {}
    if share_tensors:
        for m in iter_graph_modules(gm):
            for t in [*m.parameters(recurse=False), *m.buffers(recurse=False), *vars(m).values()]:
                if isinstance(t, torch.Tensor):
                    memo[id(t)] = t
    copy_ = _copy_lazily(gm, memo)
    return copy_ if lazy else realize_graph_modules(copy_)


def _copy_lazily(gm: GraphModule, memo: dict[int, Any]) -> GraphModule:
    from torch.fx._lazy_graph_module import _LazyGraphModule

    if id(gm) in memo:
        return memo[id(gm)]
    root = torch.nn.Module()
    for name, child in gm.named_children():
        twin = _copy_lazily(child, memo) if isinstance(child, GraphModule) else copy.deepcopy(child, memo)
        root.add_module(name, twin)
    for name, p in gm.named_parameters(recurse=False):
        root.register_parameter(name, copy.deepcopy(p, memo))
    for name, b in gm.named_buffers(recurse=False):
        root.register_buffer(name, copy.deepcopy(b, memo), persistent=name not in gm._non_persistent_buffers_set)
    for node in gm.graph.nodes:  # plain attributes (tensor constants, opaque objects)
        head = str(node.target).split(".")[0] if node.op == "get_attr" else None
        if head is not None and not hasattr(root, head):
            setattr(root, head, copy.deepcopy(getattr(gm, head), memo))
    graph = copy.deepcopy(gm.graph)
    for old_node, new_node in zip(gm.graph.nodes, graph.nodes):
        new_node.name = old_node.name  # deepcopy renames builtin-shadowing names
    new = _LazyGraphModule(root, graph, class_name=type(gm).__name__)
    new.meta = copy.copy(getattr(gm, "meta", {}))
    inherit_graph_path(new, gm)
    memo[id(gm)] = new
    return new


def realize_graph_modules(gm: GraphModule) -> GraphModule:
    """Replace every lazily compiled module in ``gm``'s tree by an eager one
    and return the new root (``gm`` itself when it is eager; its subtree is
    then updated in place).

    Dynamo refuses to trace ``_LazyGraphModule``'s lazy forward (torch.fx is
    on its skip list), so ``torch.compile(program.module())`` needs this. The
    function forms of passes return eager modules (the pipeline realizes
    them); pass objects, run inside compilers that call modules directly,
    leave the subgraphs they create lazy.
    """
    from torch.fx._lazy_graph_module import _LazyGraphModule

    def eager(m: GraphModule) -> GraphModule:
        # Children are still lazy here, so this recompiles only m's own code.
        out = GraphModule(m, m.graph, class_name=type(m).__name__)
        out.meta = copy.copy(getattr(m, "meta", {}))
        return out

    root = eager(gm) if isinstance(gm, _LazyGraphModule) else gm
    done: dict[int, GraphModule] = {}
    stack: list[torch.nn.Module] = [root]
    while stack:
        m = stack.pop()
        for name, child in list(m.named_children()):
            if isinstance(child, _LazyGraphModule):
                if id(child) not in done:
                    done[id(child)] = eager(child)
                    stack.append(done[id(child)])
                setattr(m, name, done[id(child)])
            elif isinstance(child, GraphModule):
                stack.append(child)
    return root
