"""What a program holds, and what each branchyard pass would do to it.

:func:`inspect_program` walks an ``ExportedProgram`` or ``GraphModule`` (all
subgraphs included) and returns a :class:`ProgramSummary`:

* ``stats`` -- graph size: subgraphs, placeholders, nodes, control-flow nodes
  by kind and their operands (:func:`graph_stats`);
* ``cond_trees`` -- every nested-cond tree (depth >= 2) with its depth,
  leaves, duplicated operands and the switch ``cond_to_switch`` would build;
* ``switches`` / ``while_loops`` -- each with its operands, and for a switch
  the cond chain ``switch_to_cond`` would lower it to;
* ``epilogue_chains`` -- every matmul and the elementwise chain after it
  that the ``nvgemm`` pass would fuse into one kernel, or why it declines.

Nothing is modified. ``python -m branchyard inspect`` prints
:meth:`ProgramSummary.format` (or :meth:`ProgramSummary.to_dict` as JSON)::

    >>> from branchyard.examples.builder import build_dispatch_program
    >>> summary = inspect_program(build_dispatch_program(4, dim=8))
    >>> summary.stats.control_flow, summary.stats.subgraphs
    ({'cond': 3, 'switch': 0, 'while_loop': 0}, 6)
    >>> tree = summary.cond_trees[0]
    >>> tree.depth, tree.leaves, tree.dispatch_chain
    (3, 4, True)
    >>> tree.rewrite
    'cond_to_switch: 3 conds -> 1 switch over 4 branches; operands 24 -> 9'
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from torch.export import ExportedProgram
from torch.fx import GraphModule, Node

from branchyard.errors import BranchyardError
from branchyard.fx.control_flow import TABLE, control_flow_op
from branchyard.fx.graph_walk import iter_graph_modules

__all__ = [
    "GraphStats",
    "CondTreeInfo",
    "SwitchInfo",
    "WhileLoopInfo",
    "EpilogueChainInfo",
    "ProgramSummary",
    "graph_stats",
    "count_control_flow",
    "inspect_program",
]

def _hop_kind(node: Node) -> str | None:
    op = control_flow_op(node)
    return op.name if op is not None else None


def _operands(node: Node, kind: str) -> int:
    return len(TABLE[kind].operands(node))


def _graph_labels(gm: GraphModule) -> dict[int, str]:
    """id(graph module) -> its dotted path from the root ('<root>' for gm)."""
    labels = {id(gm): "<root>"}
    for name, mod in gm.named_modules(remove_duplicate=True):
        if name and isinstance(mod, GraphModule):
            labels.setdefault(id(mod), name)
    return labels


def _as_graph_module(program: Any) -> GraphModule:
    if isinstance(program, ExportedProgram):
        return program.graph_module
    if isinstance(program, GraphModule):
        return program
    raise BranchyardError(
        f"expected a torch.export.ExportedProgram or torch.fx.GraphModule, got {type(program).__name__}",
        hint="load a .pt2 with branchyard.serialization.load or torch.export.load",
    )


@dataclass
class GraphStats:
    """Size of a program, all subgraphs included.

    ``subgraphs`` counts graph modules other than the root; ``placeholders``
    and ``nodes`` are summed over every graph (a branch's placeholders are its
    operands), ``root_placeholders`` counts the root graph's alone (the
    program's inputs, parameters and buffers included); ``control_flow`` counts
    cond / switch / while_loop nodes; ``control_flow_operands`` sums their
    operand tuples (a while loop's carried and additional inputs).
    """

    subgraphs: int
    placeholders: int
    nodes: int
    control_flow: dict[str, int]
    control_flow_operands: int
    root_placeholders: int = 0

    @property
    def control_flow_nodes(self) -> int:
        """All control-flow nodes, whatever their kind."""
        return sum(self.control_flow.values())


def count_control_flow(gm: GraphModule) -> dict[str, int]:
    """Number of cond / switch / while_loop nodes in ``gm`` and its subgraphs."""
    return graph_stats(gm).control_flow


def graph_stats(program: ExportedProgram | GraphModule) -> GraphStats:
    """The :class:`GraphStats` of ``program``."""
    gm = _as_graph_module(program)
    counts = dict.fromkeys(TABLE, 0)
    subgraphs = placeholders = nodes = operands = 0
    root_placeholders = len(gm.graph.find_nodes(op="placeholder"))
    for sub in iter_graph_modules(gm):
        subgraphs += sub is not gm
        for node in sub.graph.nodes:
            nodes += 1
            placeholders += node.op == "placeholder"
            kind = _hop_kind(node)
            if kind is not None:
                counts[kind] += 1
                operands += _operands(node, kind)
    return GraphStats(subgraphs, placeholders, nodes, counts, operands, root_placeholders)


@dataclass
class CondTreeInfo:
    """One nested-cond tree and the switch ``cond_to_switch`` would build."""

    graph: str
    root: str
    depth: int
    conds: int
    leaves: int
    unique_leaves: int
    dispatch_chain: bool
    operands_before: int
    operands_after: int
    duplicated_operands: list[str]
    rewrite: str


@dataclass
class SwitchInfo:
    """One switch node and the cond chain ``switch_to_cond`` would lower it to."""

    graph: str
    node: str
    branches: int
    operands: int
    rewrite: str


@dataclass
class WhileLoopInfo:
    """One while_loop node: carried values and extra (read-only) inputs."""

    graph: str
    node: str
    carried: int
    additional: int


@dataclass
class EpilogueChainInfo:
    """One matmul and its epilogue, as the ``nvgemm`` pass sees it."""

    graph: str
    root: str
    steps: list[str]
    fusable: bool
    rewrite: str


@dataclass
class ProgramSummary:
    """Everything :func:`inspect_program` found (see the module docstring)."""

    stats: GraphStats
    cond_trees: list[CondTreeInfo] = field(default_factory=list)
    switches: list[SwitchInfo] = field(default_factory=list)
    while_loops: list[WhileLoopInfo] = field(default_factory=list)
    epilogue_chains: list[EpilogueChainInfo] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-serializable)."""
        out = asdict(self)
        out["stats"]["control_flow_nodes"] = self.stats.control_flow_nodes
        return out

    def format(self) -> str:
        """Readable multi-line text, one section per kind of finding."""
        s = self.stats
        cf = ", ".join(f"{v} {k}" for k, v in s.control_flow.items())
        lines = [
            f"program: {s.root_placeholders} inputs (parameters and buffers included); "
            f"{s.subgraphs} subgraphs; all graphs together: {s.nodes} nodes, {s.placeholders} placeholders",
            f"control flow: {cf} ({s.control_flow_operands} operands)",
        ]

        def section(title: str, items: list[Any], render: Any) -> None:
            lines.append(f"{title} ({len(items)}):")
            lines.extend(f"  {render(i)}" for i in items)
            if not items:
                lines.append("  none")

        section(
            "cond trees",
            self.cond_trees,
            lambda t: (
                f"{t.graph}:{t.root}: depth {t.depth}, {t.conds} conds, {t.leaves} leaves "
                f"({t.unique_leaves} distinct){', idx == k dispatch chain' if t.dispatch_chain else ''}; "
                f"duplicated operands: {len(t.duplicated_operands)}"
                + (f" ({', '.join(t.duplicated_operands[:6])}{', ...' if len(t.duplicated_operands) > 6 else ''})"
                   if t.duplicated_operands else "")
                + f"\n    -> {t.rewrite}"
            ),
        )
        section(
            "switches",
            self.switches,
            lambda w: f"{w.graph}:{w.node}: {w.branches} branches, {w.operands} operands\n    -> {w.rewrite}",
        )
        section(
            "while loops",
            self.while_loops,
            lambda w: f"{w.graph}:{w.node}: {w.carried} carried, {w.additional} additional inputs",
        )
        # chains alike (same steps, same verdict) print once, with where they are
        alike: dict[tuple[str, str], list[EpilogueChainInfo]] = {}
        for c in self.epilogue_chains:
            alike.setdefault((" -> ".join(c.steps) or "(matmul only)", c.rewrite), []).append(c)

        def chains(group: tuple[tuple[str, str], list[EpilogueChainInfo]]) -> str:
            (steps, rewrite), found = group
            where = (f"{found[0].graph}:{found[0].root}" if len(found) == 1
                     else f"{len(found)} chains ({_places(found)})")
            return f"{where}: {steps}\n    -> {rewrite}"

        lines.append(f"matmul+epilogue chains ({len(self.epilogue_chains)}):")
        lines.extend(f"  {chains(g)}" for g in alike.items())
        if not alike:
            lines.append("  none")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _places(found: list[Any]) -> str:
    """Where a group of findings is, short: node names, and how many graphs."""
    roots = sorted({c.root for c in found})
    graphs = {c.graph for c in found}
    names = ", ".join(roots[:3]) + (", ..." if len(roots) > 3 else "")
    return f"{names} in {len(graphs)} graph{'s' if len(graphs) != 1 else ''}"


def _cond_trees(gm: GraphModule, labels: dict[int, str]) -> list[CondTreeInfo]:
    from branchyard.passes.cond_to_switch import find_cond_trees

    infos = []
    for t in find_cond_trees(gm):
        conds = len(t._plan.conds) if t._plan is not None else t.num_leaves - 1
        switches = "1 switch" if t.num_unique_leaves > 1 else "no switch (all leaves identical)"
        rewrite = (
            f"cond_to_switch: {conds} conds -> {switches} over {t.num_unique_leaves} branches; "
            f"operands {t.operands_before} -> {t.operands_after}"
        )
        infos.append(
            CondTreeInfo(
                graph=labels.get(id(t.owner), "?"),
                root=t.root.name,
                depth=t.depth,
                conds=conds,
                leaves=t.num_leaves,
                unique_leaves=t.num_unique_leaves,
                dispatch_chain=t.is_dispatch_chain,
                operands_before=t.operands_before,
                operands_after=t.operands_after,
                duplicated_operands=list(t.duplicated_operands),
                rewrite=rewrite,
            )
        )
    return infos


def _hop_nodes(gm: GraphModule, labels: dict[int, str], kind: str) -> list[tuple[str, Node]]:
    return [
        (labels.get(id(sub), "?"), node)
        for sub in iter_graph_modules(gm)
        for node in sub.graph.nodes
        if _hop_kind(node) == kind
    ]


def _switches(gm: GraphModule, labels: dict[int, str]) -> list[SwitchInfo]:
    out = []
    for graph, node in _hop_nodes(gm, labels, "switch"):
        n = len(node.args[1])
        out.append(
            SwitchInfo(graph, node.name, n, len(node.args[2]),
                       f"switch_to_cond: -> {n - 1} nested conds (for runtimes without switch)")
        )
    return out


def _while_loops(gm: GraphModule, labels: dict[int, str]) -> list[WhileLoopInfo]:
    return [
        WhileLoopInfo(graph, node.name, len(node.args[2]), len(node.args[3]) if len(node.args) > 3 else 0)
        for graph, node in _hop_nodes(gm, labels, "while_loop")
    ]


def _epilogue_chains(gm: GraphModule, labels: dict[int, str]) -> list[EpilogueChainInfo]:
    from branchyard.lowering.nvgemm.matcher import find_epilogue_chains
    out = []
    for sub in iter_graph_modules(gm):
        for c in find_epilogue_chains(sub):
            steps = [op.name for op, _ in c.steps]
            if c.fusable:
                rewrite = f"nvgemm: {len(c.nodes)} nodes -> 1 fused_gemm_epilogue [{c.spec}]"
            else:
                rewrite = f"nvgemm declines: {c.reason}"
            out.append(EpilogueChainInfo(labels.get(id(sub), "?"), c.root.name, steps, c.fusable, rewrite))
    return out


def inspect_program(program: ExportedProgram | GraphModule) -> ProgramSummary:
    """Summarize ``program`` without modifying it (see the module docstring)."""
    gm = _as_graph_module(program)
    labels = _graph_labels(gm)
    summary = ProgramSummary(graph_stats(gm))
    summary.cond_trees = _cond_trees(gm, labels)
    summary.switches = _switches(gm, labels)
    summary.while_loops = _while_loops(gm, labels)
    summary.epilogue_chains = _epilogue_chains(gm, labels)
    in_trees = sum(t.conds for t in summary.cond_trees)
    lone = summary.stats.control_flow["cond"] - in_trees
    if lone > 0:
        summary.notes.append(f"{lone} cond(s) outside any nested tree: cond_to_switch leaves a lone cond as it is")
    return summary
