"""Sibling GEMMs into one: GEMMs that read the same input with constant
weights, and whose outputs are concatenated along the last dim, become one
GEMM with the weights concatenated once, at rewrite time. Attention's q, k, v
projections are the common case: three launches and a copy of their outputs
become one launch that writes the concatenated output directly. Before /
after::

    %q   = aten.linear(%x, %wq, %bq)              %w = <constant: cat([wq, wk, wv])>
    %k   = aten.linear(%x, %wk, %bk)        ->     %b = <constant: cat([bq, bk, bv])>
    %v   = aten.linear(%x, %wv, %bv)               %qkv = aten.linear(%x, %w, %b)
    %qkv = aten.cat([%q, %k, %v], -1)

Semantics, as Python (``layout``: the constant weight's own, ``nk`` for
``linear`` and for ``mm`` / ``addmm`` of a transposed constant, ``kn`` for
``mm``, ``matmul`` and ``addmm`` of a constant ``[K, N]``; weights are
concatenated along N, the weight's dim 0 or 1)::

    def merge(cat):                                 # cat = aten.cat(parts, dim=-1)
        for run in maximal runs of >= 2 consecutive parts that are GEMMs of one kind
                   (or views of them that regroup only their leading dims) on one
                   input (or views of one input of one shape), with constant 2-D
                   weights of one K, dtype and device, transposed alike (biases: all
                   constant [N] or all absent), each used by the cat only:
            w = torch.cat([weight(p) for p in run], dim=0 if layout == "nk" else 1)
            parts[run] = [view?(gemm(input, transpose?(w), cat of the biases))]
        return aten.cat(parts, -1) if len(parts) > 1 else parts[0]

A weight that is a graph input or that the program writes (not a constant),
a bias of another shape, an ``addmm`` with ``alpha`` / ``beta``, a transposed
weight or a part used by anything but the run, or a weight another run
merged already keeps a run from forming; the report says which. Only the
top-level graph is searched (not control-flow branches).

The merged weight is a copy taken at rewrite time, so the rewritten program
owns it: :func:`merge_sibling_gemms` makes the program's own parameters (the
parts' weights and biases) views of it, so loading new weights into the
rewritten program updates the merged weight too. Weights changed in place in
the *original* module after the rewrite are not seen (rewrite again).

    >>> import torch
    >>> class QKV(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.q, self.k = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)
    ...     def forward(self, x):
    ...         return torch.cat([self.q(x), self.k(x)], dim=-1)
    >>> ep = torch.export.export(QKV(), (torch.randn(2, 8),))
    >>> merged = merge_sibling_gemms(ep)
    >>> merged.groups
    ['2 GEMMs of x (linear, linear_1) as one: 8 x 12']
    >>> [n.target.__name__ for n in merged.program.graph.nodes if n.op == "call_function"]
    ['linear.default']
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, TensorArgument
from torch.fx import GraphModule, Node

from branchyard.errors import LoweringError
from branchyard.fx.control_flow import emit, fake_mode_of
from branchyard.fx.graph_walk import copy_graph_module, resolve_attr
from branchyard.fx.pass_infra import BranchyardPass, PassReport, Program
from branchyard.lowering.nvgemm.matcher import (
    TRANSPOSE_TARGETS,
    VIEW_TARGETS,
    first_write_within,
    input_source,
    is_transpose,
)

__all__ = ["MergeResult", "MergeSiblingGemms", "merge_sibling_gemms"]

aten = torch.ops.aten

#: GEMM targets that can merge: target -> (weight arg index, bias arg index or None, weight layout).
_GEMMS: dict[Any, tuple[int, int | None, str]] = {
    aten.linear.default: (1, 2, "nk"),
    aten.mm.default: (1, None, "kn"),
    aten.matmul.default: (1, None, "kn"),
    aten.addmm.default: (2, 0, "kn"),
}

#: ``constant(node) -> tensor``: the value of a graph node that is a constant of
#: the program (a parameter, buffer or constant), or ``None``.
ConstantOf = Callable[[Node], "torch.Tensor | None"]


@dataclass(frozen=True)
class _Part:
    """One GEMM of a run. ``out`` is what the cat reads (the GEMM, or a view of it
    that regroups its leading dims: ``view(addmm(b, view(x), t(w)))``, a 3-D
    ``linear`` decomposed); ``a`` the GEMM's input and ``source`` what it views (the
    same for the input of every member of a run); ``weight`` the constant node and
    ``wrap`` the transpose between it and the GEMM (``None``: none); ``layout`` the
    constant's own layout (``nk``: ``[N, K]``)."""

    node: Node
    out: Node
    a: Node
    source: tuple[Any, ...]
    weight: Node
    wrap: Node | None
    bias: Node | None
    w: torch.Tensor
    b: torch.Tensor | None
    layout: str

    @property
    def n(self) -> int:
        return self.w.shape[0] if self.layout == "nk" else self.w.shape[1]

    @property
    def k(self) -> int:
        return self.w.shape[1] if self.layout == "nk" else self.w.shape[0]


@dataclass(frozen=True)
class MergedGroup:
    """One merge: its name (as in reports and races), the new constants' attribute
    names, and where each original weight / bias sits in them (``(node target, start, length)``)."""

    name: str
    weight_attr: str
    bias_attr: str | None
    weight_dim: int
    weights: tuple[tuple[str, int, int], ...]
    biases: tuple[tuple[str, int, int], ...]


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, Node) else None


def _views_a_gemm(node: Node) -> bool:
    return node.target in VIEW_TARGETS and isinstance(node.args[0], Node) and node.args[0].target in _GEMMS


def _part(item: Node, constant: ConstantOf, cat: Node) -> _Part | str:
    """``item`` (a concatenated value) as a run member, or why it is not one."""
    node = item
    if _views_a_gemm(item):
        node = item.args[0]  # view(gemm(...)): a decomposed N-D linear
        if list(node.users) != [item]:
            return f"'{node.name}' is used by more than the concatenation"
        inner, outer = _val(node), _val(item)
        if not (isinstance(inner, torch.Tensor) and isinstance(outer, torch.Tensor) and inner.dim() == 2
                and outer.shape[-1] == inner.shape[-1]):
            return f"'{item.name}' reshapes more than the leading dims of '{node.name}'"
    spec = _GEMMS.get(node.target)
    if spec is None:
        return f"'{node.name}' is not linear, mm, matmul or addmm"
    w_at, b_at, layout = spec
    if node.target is aten.addmm.default and (node.kwargs.get("alpha", 1) != 1 or node.kwargs.get("beta", 1) != 1):
        return f"'{node.name}' scales with alpha / beta"
    if list(item.users) != [cat]:
        return f"'{item.name}' is used by more than the concatenation"
    a, weight = (node.args[0] if node.target is not aten.addmm.default else node.args[1]), node.args[w_at]
    bias = node.kwargs.get("bias") if node.target is aten.linear.default else None
    if b_at is not None and len(node.args) > b_at and bias is None:
        bias = node.args[b_at]
    if not isinstance(a, Node) or not isinstance(weight, Node):
        return f"'{node.name}' has a non-graph input or weight"
    wrap = None
    if layout == "kn" and is_transpose(weight) and isinstance(weight.args[0], Node):
        if len(weight.users) != 1:
            return f"the transposed weight '{weight.name}' of '{node.name}' has other users"
        wrap, weight, layout = weight, weight.args[0], "nk"
    w = constant(weight)
    if not isinstance(w, torch.Tensor):
        return f"the weight '{weight.name}' of '{node.name}' is not a constant of the program"
    if w.dim() != 2:
        return f"the weight '{weight.name}' of '{node.name}' is {w.dim()}-D, not 2-D"
    b = None
    if bias is not None:
        b = constant(bias) if isinstance(bias, Node) else None
        n = w.shape[0] if layout == "nk" else w.shape[1]
        if not isinstance(b, torch.Tensor) or tuple(b.shape) != (n,):
            return f"the bias of '{node.name}' is not a constant of shape [{n}]"
    return _Part(node, item, a, input_source(a), weight, wrap, bias if b is not None else None, w, b, layout)


def _joins(run: list[_Part], p: _Part) -> bool:
    """Whether ``p`` can join ``run``: one kind of GEMM on one input, weights of one K, dtype and device."""
    first = run[0]
    return (p.node.target is first.node.target and p.source == first.source and p.layout == first.layout
            and (p.wrap is None) == (first.wrap is None) and (p.out is p.node) == (first.out is first.node)
            and p.k == first.k and p.w.dtype == first.w.dtype and p.w.device == first.w.device
            and (p.b is None) == (first.b is None)
            and (p.b is None or (p.b.dtype == first.b.dtype and p.b.device == first.b.device))  # type: ignore[union-attr]
            and len({id(q.w) for q in run} | {id(p.w)}) == len(run) + 1)


def _cat_dim_is_last(cat: Node) -> bool:
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    val = _val(cat)
    return isinstance(val, torch.Tensor) and isinstance(dim, int) and dim in (-1, val.dim() - 1)


class MergeSiblingGemms(BranchyardPass):
    """Merge runs of sibling GEMMs feeding a last-dim ``cat`` (module docstring).

    ``constant(node)`` gives the value of a node that is a constant of the
    program (default: a ``get_attr`` tensor of the graph module). Each merged
    weight (and bias) is registered on the graph module as a buffer read by a
    ``get_attr`` node; :attr:`merged` lists what each merge took from where.
    ``only``: merge just the groups with these names. Top-level graph only.

    ``report.stats``: ``merged`` (groups merged) and ``groups`` (their names).
    """

    name = "merge_sibling_gemms"

    def __init__(self, constant: ConstantOf | None = None, *, only: frozenset[str] | None = None) -> None:
        super().__init__()
        self._constant = constant
        self.only = only
        self.merged: list[MergedGroup] = []

    def run(self, graph_module: GraphModule) -> bool:
        self.merged = []
        constant = self._constant or _get_attr_constant(graph_module)
        taken: set[int] = set()  # weights already merged: each becomes a view of one merged weight only
        cats = [n for n in graph_module.graph.nodes if n.op == "call_function" and n.target is aten.cat.default]
        for cat in cats:
            if not _cat_dim_is_last(cat) or not isinstance(cat.args[0], (list, tuple)):
                continue
            parts: list[Any] = list(cat.args[0])
            runs = self._runs(cat, parts, constant)
            for run in reversed(runs):  # from the back, so earlier indices stay valid
                start = parts.index(run[0].out)
                name = _group_name(run)
                if self.only is not None and name not in self.only:
                    continue
                if any(id(p.w) in taken for p in run):
                    self.skip(run[0].node, f"not merged ({name}): a weight is merged elsewhere already")
                    continue
                write = first_write_within(cat, [p.node for p in run])
                if write is not None:  # the merged GEMM reads its input where the first part did
                    self.skip(run[0].node, f"not merged ({name}): '{write.name}' ({write.target}) writes in "
                                           "place between the siblings")
                    continue
                taken.update(id(p.w) for p in run)
                parts[start:start + len(run)] = [self._merge(graph_module, cat, run, name)]
            replaced = [n for n in cat.args[0] if n not in parts]
            if not replaced:
                continue
            if len(parts) == 1:
                cat.replace_all_uses_with(parts[0])
                graph_module.graph.erase_node(cat)
            else:
                cat.args = (parts, *cat.args[1:])
            for node in replaced:  # the merged parts, and what only they used (views, transposes)
                _erase_dead(graph_module.graph, node)
        self.report.stats.update(merged=len(self.merged), groups=[g.name for g in self.merged])
        return bool(self.merged)

    def _runs(self, cat: Node, parts: Sequence[Any], constant: ConstantOf) -> list[list[_Part]]:
        runs: list[list[_Part]] = []
        current: list[_Part] = []
        for item in parts:
            part = _part(item, constant, cat) if isinstance(item, Node) else "not a graph value"
            if isinstance(part, str):
                if isinstance(item, Node) and (item.target in _GEMMS or _views_a_gemm(item)):
                    self.skip(item, f"not merged with its siblings: {part}")
                current = []
            elif current and _joins(current, part):
                current.append(part)
            else:
                current = [part]
            if current and (not runs or runs[-1] is not current):
                runs.append(current)
        return [r for r in runs if len(r) >= 2]

    def _merge(self, gm: GraphModule, cat: Node, run: list[_Part], name: str) -> Node:
        first = run[0]
        dim = 0 if first.layout == "nk" else 1
        with torch.no_grad():
            w = torch.cat([p.w for p in run], dim=dim).contiguous()
            b = torch.cat([p.b for p in run]).contiguous() if first.b is not None else None  # type: ignore[misc]
        index = len(self.merged)
        while hasattr(gm, f"_nvgemm_merged_weight_{index}"):
            index += 1
        weight_attr, bias_attr = f"_nvgemm_merged_weight_{index}", (f"_nvgemm_merged_bias_{index}" if b is not None
                                                                     else None)
        graph = gm.graph
        mode = fake_mode_of([_val(n) for n in graph.nodes])
        with graph.inserting_before(first.node):
            w_node = self._constant_node(gm, weight_attr, w, mode)
            b_node = self._constant_node(gm, bias_attr, b, mode) if bias_attr is not None else None
            if first.wrap is not None:
                w_node = emit(graph, first.wrap.target, (w_node, *first.wrap.args[1:]), like=first.wrap)
            target = first.node.target
            if target is aten.linear.default:
                args: tuple = (first.a, w_node) + ((b_node,) if b_node is not None else ())
            elif target is aten.addmm.default:
                args = (b_node, first.a, w_node)
            else:
                args = (first.a, w_node)
            merged = emit(graph, target, args, like=first.node)
            if first.out is not first.node:  # view(gemm): the same view, to the merged width
                shape = [*_val(first.out).shape[:-1], sum(p.n for p in run)]
                merged = emit(graph, first.out.target, (merged, shape), like=first.out)
        for key in ("nn_module_stack", "source_fn_stack"):
            if key in first.node.meta:
                merged.meta[key] = first.node.meta[key]

        def spans(nodes_vals: list[tuple[Node | None, int]]) -> tuple[tuple[str, int, int], ...]:
            out, start = [], 0
            for node, n in nodes_vals:
                if node is not None:
                    out.append((str(node.target), start, n))
                start += n
            return tuple(out)

        self.merged.append(MergedGroup(
            name, weight_attr, bias_attr, dim,
            spans([(p.weight, p.n) for p in run]),
            spans([(p.bias, p.n) for p in run]) if b is not None else (),
        ))
        return merged

    @staticmethod
    def _constant_node(gm: GraphModule, attr: str, value: torch.Tensor, mode: Any) -> Node:
        gm.register_buffer(attr, value)
        node = gm.graph.get_attr(attr)
        node.meta["val"] = mode.from_tensor(value, static_shapes=True) if mode is not None else value
        node.meta["nn_module_stack"] = {}
        return node


def _erase_dead(graph: Any, node: Node) -> None:
    """Erase ``node`` if nothing uses it, then its inputs that only it used
    (views and transposes of a merged part; constants and inputs stay)."""
    if node.users or node.op != "call_function":
        return
    inputs = list(node.all_input_nodes)
    graph.erase_node(node)
    for n in inputs:
        if n.target in _GEMMS or n.target in VIEW_TARGETS or n.target in TRANSPOSE_TARGETS:
            _erase_dead(graph, n)


def _group_name(run: list[_Part]) -> str:
    n = sum(p.n for p in run)
    a = run[0].source[0] if len(run[0].source) > 1 else run[0].a
    return (f"{len(run)} GEMMs of {a.name} ({', '.join(p.node.name for p in run)}) as one: "
            f"{run[0].k} x {n}")


def _written(node: Node) -> bool:
    """Whether an op that may write its inputs reads ``node`` (then its value is not a constant)."""
    return any(isinstance(u.target, torch._ops.OpOverload) and u.target._schema.is_mutable for u in node.users)


def _get_attr_constant(gm: GraphModule) -> ConstantOf:
    def constant(node: Node) -> torch.Tensor | None:
        if node.op != "get_attr" or "." in str(node.target) or _written(node):
            return None  # a submodule's attribute is not the copy's to alias (see merge_sibling_gemms)
        try:
            value = resolve_attr(gm, str(node.target))
        except AttributeError:
            return None
        return value if isinstance(value, torch.Tensor) else None

    return constant


@dataclass
class MergeResult:
    """The program with its sibling GEMMs merged, the merge pass's report and
    the merged groups' names (empty: the program came back unchanged)."""

    program: Program
    report: PassReport
    groups: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.groups)


def merge_sibling_gemms(program: Program, *, only: frozenset[str] | None = None) -> MergeResult:
    """A copy of ``program`` (an ``ExportedProgram`` or a ``GraphModule``) with
    its sibling GEMMs merged (module docstring); ``program`` is not changed.

    In an ExportedProgram the merged weights become constants of the program
    (``CONSTANT_TENSOR`` inputs), and the parameters and buffers they were
    made from become views of them. In a GraphModule, weights are its
    top-level ``get_attr`` tensors (placeholders are inputs, not constants);
    they too become views of the merged weight.
    """
    if isinstance(program, ExportedProgram):
        return _merge_exported(program, only)
    if not isinstance(program, GraphModule):
        raise LoweringError(f"expected a torch.export.ExportedProgram or torch.fx.GraphModule, got "
                            f"{type(program).__name__}", where="merge_sibling_gemms")
    gm = copy_graph_module(program, share_tensors=True)
    the_pass = MergeSiblingGemms(only=only)
    the_pass.call(gm)
    _alias_parts(the_pass.merged, lambda attr: getattr(gm, attr),
                 lambda target, view: setattr(gm, target, _like(getattr(gm, target), view)))
    if the_pass.merged:
        gm.recompile()
    return MergeResult(gm if the_pass.merged else program, the_pass.report, [g.name for g in the_pass.merged])


def _alias_parts(groups: Sequence[MergedGroup], merged: Callable[[str], torch.Tensor],
                 assign: Callable[[str, torch.Tensor], None]) -> None:
    """``assign(target, view)`` each merged part's own weight and bias as a view of
    the merged tensor (``merged(attr)``) it was copied into."""
    for group in groups:
        for attr, spans, dim in ((group.weight_attr, group.weights, group.weight_dim),
                                 (group.bias_attr, group.biases, 0)):
            if attr is not None:
                for target, start, length in spans:
                    assign(target, merged(attr).narrow(dim, start, length))


def _like(old: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """``view`` as what ``old`` was: a parameter (with its ``requires_grad``) or a plain tensor."""
    return torch.nn.Parameter(view, requires_grad=old.requires_grad) if isinstance(old, torch.nn.Parameter) else view


def _merge_exported(ep: ExportedProgram, only: frozenset[str] | None) -> MergeResult:
    from torch._export.passes.lift_constants_pass import ConstantAttrMap, lift_constants_pass

    gm = copy_graph_module(ep.graph_module, share_tensors=True)
    sig = ep.graph_signature
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    owned = {n: spec for n, spec in zip(placeholders, sig.input_specs)
             if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)}
    target_of = {n.name: spec.target for n, spec in owned.items()}
    mutated = set(sig.buffers_to_mutate.values())

    def constant(node: Node) -> torch.Tensor | None:
        spec = owned.get(node)
        if spec is None or spec.target in mutated or _written(node):
            return None
        value = ep.state_dict.get(spec.target) if spec.target in ep.state_dict else ep.constants.get(spec.target)
        return value if isinstance(value, torch.Tensor) else None

    the_pass = MergeSiblingGemms(constant, only=only)
    the_pass.call(gm)
    if not the_pass.merged:
        return MergeResult(ep, the_pass.report, [])
    names = ConstantAttrMap()
    taken = set(ep.state_dict) | set(ep.constants)
    merged_values: dict[str, torch.Tensor] = {}
    for group in the_pass.merged:
        for attr, spans in ((group.weight_attr, group.weights), (group.bias_attr, group.biases)):
            if attr is None:
                continue
            fqn = _fresh(taken, "nvgemm_" + "_".join(target_of[t].replace(".", "_") for t, _, _ in spans))
            names.add(getattr(gm, attr), fqn)
            merged_values[attr] = getattr(gm, attr)
    new_sig = copy.deepcopy(sig)
    lifted = lift_constants_pass(gm, new_sig, names)
    for group in the_pass.merged:
        for attr in (group.weight_attr, group.bias_attr):
            if attr is not None and hasattr(gm, attr):
                delattr(gm, attr)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for spec, arg in zip(new_sig.output_specs, output.args[0]):
        if isinstance(spec.arg, TensorArgument) and isinstance(arg, Node):
            spec.arg = TensorArgument(name=arg.name)
    state_dict, constants = dict(ep.state_dict), {**ep.constants, **lifted}

    def assign(placeholder: str, view: torch.Tensor) -> None:
        target = target_of[placeholder]
        store = state_dict if target in state_dict else constants
        store[target] = _like(store[target], view)

    _alias_parts(the_pass.merged, merged_values.__getitem__, assign)
    gm.recompile()
    out = ep._update(gm, new_sig, state_dict=state_dict, constants=constants)
    return MergeResult(out, the_pass.report, [g.name for g in the_pass.merged])


def _fresh(taken: set[str], name: str) -> str:
    candidate, i = name, 1
    while candidate in taken:
        candidate, i = f"{name}_{i}", i + 1
    taken.add(candidate)
    return candidate
