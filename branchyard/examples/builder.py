"""Build nested-cond ``ExportedProgram`` s directly in torch.fx, without tracing.

Why: exporting nested ``torch.cond`` costs time *exponential* in the nesting
depth on torch 2.14 (each level's branches are re-traced by the level above
it: an 8-expert ``idx == k`` chain took ~55 s on the 2-core CI machine, a
16-expert one would take hours). The example and benchmark programs need
chains of 16 experts, trees 7 levels deep and stacks of 1,000 conds, so this
module writes the graph torch.export *would* produce -- node for node: the
same ``aten.eq.Scalar`` / ``aten.lt.Scalar`` predicates, ``true_graph_i`` /
``false_graph_i`` submodules, ``higher_order.cond`` over
``(x, idx, weight, bias, ...)``, ``aten.linear.default`` leaves, ``val`` and
``tensor_meta`` on every value -- and wraps it in an ``ExportedProgram`` that
``torch.export`` verifies. ``tests/test_inspection.py`` checks it against a
real export of the same model on small sizes.

A program is a stack of ``layers`` dispatch blocks sharing one ``idx``; each
block selects one of its experts for ``x``::

    for layer in range(layers):
        x = experts[layer][clamp(idx)](x)     # written as nested conds
    return x

``split`` says how a block of experts ``[lo, hi)`` becomes conds (see
:data:`SPLITS`): ``"chain"`` is ``idx == lo ? e[lo] : <[lo+1, hi)>``,
``"tree"`` is ``idx < mid ? <[lo, mid)> : <[mid, hi)>``.

    >>> import torch
    >>> ep = build_dispatch_program(num_experts=4, dim=8, split="chain")
    >>> from branchyard.inspection import count_control_flow
    >>> count_control_flow(ep.graph_module)["cond"]
    3
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch._export.verifier import TrainingIRVerifier
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export import ExportedProgram
from torch.export.exported_program import ModuleCallEntry, ModuleCallSignature
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
    TensorArgument,
)
from torch.fx import Graph, GraphModule, Node
from torch.fx.passes.shape_prop import _extract_tensor_metadata
from torch.utils import _pytree as pytree

from branchyard.errors import BranchyardError

__all__ = ["SPLITS", "Split", "build_dispatch_program"]


@dataclass(frozen=True)
class Split:
    """How one cond divides the expert range ``[lo, hi)``: the predicate
    ``aten.<op>(idx, value)`` sends ``[lo, mid)`` to the true branch."""

    op: torch._ops.OpOverload
    value: int
    mid: int


#: split name -> (lo, hi) -> Split. Patterns as data: one row per family.
SPLITS: dict[str, Callable[[int, int], Split]] = {
    "chain": lambda lo, hi: Split(torch.ops.aten.eq.Scalar, lo, lo + 1),
    "tree": lambda lo, hi: Split(torch.ops.aten.lt.Scalar, (lo + hi) // 2, (lo + hi) // 2),
}


class _Builder:
    """Writes graphs bottom-up; owns the fake mode every ``val`` lives in."""

    def __init__(self, split: Callable[[int, int], Split], batch: int, dim: int) -> None:
        self.split = split
        self.mode = FakeTensorMode()
        self.x = self.mode.from_tensor(torch.empty(batch, dim))
        self.idx = self.mode.from_tensor(torch.empty((), dtype=torch.int64))
        self.pred = self.mode.from_tensor(torch.empty((), dtype=torch.bool))
        self.weight = self.mode.from_tensor(torch.empty(dim, dim))
        self.bias = self.mode.from_tensor(torch.empty(dim))

    @staticmethod
    def set_val(node: Node, val: torch.Tensor) -> Node:
        node.meta["val"] = val
        node.meta["tensor_meta"] = _extract_tensor_metadata(val)
        return node

    def placeholder(self, g: Graph, name: str, val: torch.Tensor) -> Node:
        return self.set_val(g.placeholder(name), val)

    def emit_block(self, owner: torch.nn.Module, g: Graph, x: Node, idx: Node, params: list[Node], lo: int, hi: int) -> Node:
        """Emit experts ``[lo, hi)`` applied to ``x`` into ``g`` (whose module is
        ``owner``); ``params`` are the (weight, bias) nodes of those experts."""
        if hi - lo == 1:
            out = g.call_function(torch.ops.aten.linear.default, (x, params[0], params[1]))
            return self.set_val(out, self.x)
        s = self.split(lo, hi)
        if not lo < s.mid < hi:
            raise BranchyardError(f"split of experts [{lo}, {hi}) at {s.mid} leaves a side empty")
        pred = self.set_val(g.call_function(s.op, (idx, s.value)), self.pred)
        k = sum(1 for n in owner.named_children() if n[0].startswith("true_graph_"))
        cut = 2 * (s.mid - lo)
        true_gm = self.branch(params_names(params), lo, s.mid, keep=slice(0, cut))
        false_gm = self.branch(params_names(params), s.mid, hi, keep=slice(cut, None))
        owner.register_module(f"true_graph_{k}", true_gm)
        owner.register_module(f"false_graph_{k}", false_gm)
        tg = g.get_attr(f"true_graph_{k}")
        fg = g.get_attr(f"false_graph_{k}")
        out = g.call_function(torch.ops.higher_order.cond, (pred, tg, fg, (x, idx, *params)))
        return self.set_val(out, self.x)

    def branch(self, names: list[str], lo: int, hi: int, keep: slice) -> GraphModule:
        """A branch graph taking ``(x, idx, *all params)`` and running ``[lo, hi)``
        with the params selected by ``keep`` (the others are passed through
        unused, as torch.export leaves them)."""
        g = Graph()
        owner = torch.nn.Module()
        x = self.placeholder(g, "x", self.x)
        idx = self.placeholder(g, "idx", self.idx)
        ps = [self.placeholder(g, n, self.weight if i % 2 == 0 else self.bias) for i, n in enumerate(names)]
        g.output(self.emit_block(owner, g, x, idx, ps[keep], lo, hi))
        return GraphModule(owner, g)


def params_names(params: list[Node]) -> list[str]:
    return [p.name for p in params]


def build_dispatch_program(
    num_experts: int,
    *,
    dim: int = 16,
    batch: int = 4,
    split: str = "chain",
    layers: int = 1,
    seed: int = 0,
) -> ExportedProgram:
    """An ``ExportedProgram`` of ``layers`` stacked blocks, each selecting one
    of ``num_experts`` ``Linear(dim, dim)`` experts by a 0-d int64 ``idx``
    through nested ``torch.cond`` (``split`` = ``"chain"`` or ``"tree"``).

    Inputs ``(x, idx)`` with ``x`` of shape ``(batch, dim)``; parameters are
    named ``layers.<l>.experts.<e>.weight`` / ``.bias`` (with ``layers == 1``:
    ``experts.<e>.weight`` as in :class:`~branchyard.examples.expert_dispatch.ExpertDispatch`,
    whose parameters -- same ``seed`` -- it uses). Each block holds
    ``num_experts - 1`` conds.
    """
    if split not in SPLITS:
        raise BranchyardError(f"unknown split {split!r}; known splits: {', '.join(SPLITS)}")
    if num_experts < 2 or layers < 1:
        raise BranchyardError(
            f"need num_experts >= 2 and layers >= 1, got num_experts={num_experts}, layers={layers}"
        )
    from branchyard.examples.expert_dispatch import _experts

    b = _Builder(SPLITS[split], batch, dim)
    g = Graph()
    root = torch.nn.Module()
    state_dict: dict[str, torch.Tensor] = {}
    input_specs: list[InputSpec] = []
    layer_params: list[list[Node]] = []
    for layer in range(layers):
        prefix = "" if layers == 1 else f"layers.{layer}."
        experts = _experts(num_experts, dim, seed + layer)
        nodes = []
        for e, module in enumerate(experts):
            for kind, tensor in (("weight", module.weight), ("bias", module.bias)):
                target = f"{prefix}experts.{e}.{kind}"
                name = "p_" + target.replace(".", "_")
                state_dict[target] = tensor
                input_specs.append(InputSpec(InputKind.PARAMETER, TensorArgument(name), target))
                nodes.append(b.placeholder(g, name, b.mode.from_tensor(tensor)))
        layer_params.append(nodes)
    x = b.placeholder(g, "x", b.x)
    idx = b.placeholder(g, "idx", b.idx)
    input_specs += [InputSpec(InputKind.USER_INPUT, TensorArgument(n), None) for n in ("x", "idx")]
    for nodes in layer_params:
        x = b.emit_block(root, g, x, idx, nodes, 0, num_experts)
    g.output((x,))

    in_spec = pytree.tree_flatten(((torch.empty(0), torch.empty(0)), {}))[1]
    out_spec = pytree.tree_flatten(torch.empty(0))[1]
    signature = ExportGraphSignature(
        input_specs, [OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(x.name), None)]
    )
    call_graph = [
        ModuleCallEntry("", ModuleCallSignature([], [], in_spec, out_spec, forward_arg_names=["x", "idx"]))
    ]
    return ExportedProgram(
        root=GraphModule(root, g),
        graph=g,
        graph_signature=signature,
        state_dict=state_dict,
        range_constraints={},
        module_call_graph=call_graph,
        verifiers=[TrainingIRVerifier],
    )
