"""The ``nvgemm`` pass: replace each matmul + epilogue chain by one fused op.

After this pass, every fusable chain found by
:func:`~branchyard.lowering.nvgemm.matcher.find_epilogue_chains` -- in the
top-level graph and in every subgraph (``cond``/``while_loop`` branches) -- is a single
``branchyard.fused_gemm_epilogue`` call; every declined chain is in the
pass report with its reason. Before / after::

    %mm   = aten.mm(%x, %w)                 %f = branchyard.fused_gemm_epilogue(
    %add  = aten.add.Tensor(%mm, %b)    ->           %x, %w, [%b, %r],
    %gelu = aten.gelu(%add)                          "w=kn;bias@0;gelu_erf;residual@1;out=bfloat16")
    %out  = aten.add.Tensor(%gelu, %r)

Chains are matched on the current graph one at a time, so two chains never
claim the same node. The rewrite inserts the fused op just before the
chain's last node (every operand of the chain is defined by then), rewires
that node's users and erases the chain.

    >>> import torch
    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> gm = make_fx(lambda x, w, b: torch.sigmoid(x @ w + b))(
    ...     torch.randn(4, 8), torch.randn(8, 16), torch.randn(16))
    >>> p = NvGemmPass()
    >>> out = p(gm).graph_module
    >>> [n.target.__name__ for n in out.graph.nodes if n.op == "call_function"]
    ['fused_gemm_epilogue.default']
    >>> p.report.stats["fused"]
    1
"""

from __future__ import annotations

import torch
from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node

from branchyard.lowering.nvgemm.matcher import MATMUL_ROOTS, EpilogueChain, match_chain
from branchyard.lowering.nvgemm.op import fused_gemm_epilogue
from branchyard.fx.graph_walk import iter_graph_modules
from branchyard.fx.pass_infra import BranchyardPass, Program, apply_pass

__all__ = ["NvGemmPass", "nvgemm"]

aten = torch.ops.aten

_COPIED_META = ("stack_trace", "nn_module_stack", "source_fn_stack", "from_node", "seq_nr", "custom")


def _fake_val(target, args) -> object:
    """Run ``target`` on the fake values of ``args`` (the node's meta['val'])."""
    vals = torch.fx.node.map_arg(args, lambda n: n.meta["val"])
    flat = [v for v in torch.utils._pytree.tree_leaves(vals) if isinstance(v, torch.Tensor)]
    try:
        fake_mode = detect_fake_mode(flat)
    except AssertionError:  # values from several fake modes (make_fx graphs)
        fake_mode = None
    if fake_mode is None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        vals = torch.utils._pytree.tree_map_only(torch.Tensor, fake_mode.from_tensor, vals)
    with fake_mode:
        return target(*vals)


def rewrite_chain(gm: GraphModule, chain: EpilogueChain) -> Node:
    """Replace ``chain`` (which must be fusable) by one fused op; return it."""
    graph = gm.graph
    end = chain.end
    spec = str(chain.spec)
    target = fused_gemm_epilogue
    args = (chain.a, chain.b, list(chain.operands), spec)
    with graph.inserting_before(end):
        fused = graph.call_function(target, args)
        fused.meta["val"] = _fake_val(target, args)
        for key in _COPIED_META:
            if key in chain.root.meta:
                fused.meta[key] = chain.root.meta[key]
        result = fused
        if chain.out_view is not None and tuple(fused.meta["val"].shape) != tuple(end.meta["val"].shape):
            shape = chain.out_view.args[1]
            result = graph.call_function(aten.view.default, (fused, shape))
            result.meta["val"] = _fake_val(aten.view.default, (fused, shape))
    end.replace_all_uses_with(result)
    for check in chain.checks:  # checks of intermediates that no longer exist
        graph.erase_node(check)
    for node in reversed(chain.nodes):
        graph.erase_node(node)
    return fused


class NvGemmPass(BranchyardPass):
    """Fuse matmul + epilogue chains into ``branchyard.fused_gemm_epilogue``.

    ``report.stats``: ``fused`` (chains replaced), ``declined`` (roots left
    alone), ``specs`` (the spec of each fused chain, in graph order).
    """

    name = "nvgemm"

    def run(self, graph_module: GraphModule) -> bool:
        fused, declined, specs = 0, 0, []
        # Every graph, control-flow branch and loop bodies included: a matmul
        # inside a torch.cond branch is fused like one at the top level.
        for gm in list(iter_graph_modules(graph_module)):
            # Snapshot the roots: a rewrite erases its own chain only, and a
            # root consumed as another chain's operand stays in the graph.
            roots = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in MATMUL_ROOTS]
            for root in roots:
                chain = match_chain(root)
                if not chain.fusable:
                    declined += 1
                    self.skip(root, chain.reason or "")
                    continue
                if chain.near_miss and chain.stop_node is not None:
                    self.skip(chain.stop_node, f"the chain from '{root.name}' stops here: {chain.stop}")
                specs.append(str(chain.spec))
                rewrite_chain(gm, chain)
                fused += 1
        self.report.stats.update(fused=fused, declined=declined, specs=specs)
        return fused > 0


def nvgemm(program: Program) -> Program:
    """Function form of :class:`NvGemmPass`: a rewritten copy of ``program``
    (an ``ExportedProgram`` or an ATen-level ``GraphModule``).

    >>> import torch
    >>> class MLP(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.fc = torch.nn.Linear(16, 32)
    ...     def forward(self, x):
    ...         return torch.nn.functional.gelu(self.fc(x))
    >>> ep = torch.export.export(MLP(), (torch.randn(4, 16),))
    >>> fused = nvgemm(ep)
    >>> [n.args[3] for n in fused.graph.nodes if n.op == "call_function"]
    ['w=nk;bias@0;gelu_erf;out=float32']
    """
    return apply_pass(program, NvGemmPass())
