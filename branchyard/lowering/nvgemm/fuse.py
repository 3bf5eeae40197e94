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

Called eagerly, the rewritten program is never slower than the original:
where the program runs on CUDA and ``calling="eager"`` (the default), the
pass races the rewritten program against the unrewritten one, host time
included, and leaves unfused every group of chains it does not win with
(:mod:`.program_race`). Semantics, as Python::

    def nvgemm(program, calling="eager"):
        chains = [c for c in find_epilogue_chains(program) if c.fusable]
        if calling == "eager" and program runs on CUDA and example inputs can be had:
            keep = race(chains)         # by the program's time per call, host-inclusive
        else:                           # "graph": replayed from a CUDA graph, host work is not paid
            keep = chains               # CPU: the fused op runs the same ATen ops, nothing to win
        return program with each chain in keep replaced by one fused op

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

import logging
from typing import Any, Callable, Iterator, Sequence

import torch
from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node

from branchyard.lowering.nvgemm.matcher import MATMUL_ROOTS, EpilogueChain, match_chain
from branchyard.lowering.nvgemm.op import fused_gemm_epilogue
from branchyard.lowering.nvgemm.program_race import (
    Calling,
    ProgramRace,
    RaceResult,
    Variant,
    check_calling,
    placeholder_inputs,
    program_device,
    program_inputs,
    race_context,
)
from branchyard.fx.graph_walk import copy_graph_module, iter_graph_modules
from branchyard.fx.pass_infra import BranchyardPass, Pipeline, Program

__all__ = ["NvGemmPass", "chain_group", "nvgemm"]

logger = logging.getLogger("branchyard")

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


def _shape(node: Node) -> str:
    val = node.meta.get("val")
    shape = getattr(val, "shape", None)
    return "x".join(map(str, shape)) if shape is not None else "?"


def chain_group(chain: EpilogueChain) -> str:
    """The problem a fusable chain poses, in words: its spec and the shapes of
    its inputs and operands. Chains with the same group cost the same, so the
    eager race decides them together.

        >>> import torch
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> gm = make_fx(lambda x, w: torch.relu(x @ w))(torch.randn(4, 8), torch.randn(8, 16))
        >>> root = next(n for n in gm.graph.nodes if n.op == "call_function")
        >>> chain_group(match_chain(root))
        'w=kn;relu;out=float32 [4x8 @ 8x16]'
    """
    operands = "".join(f", {_shape(o)}" for o in chain.operands)
    return f"{chain.spec} [{_shape(chain.a)} @ {_shape(chain.b)}{operands}]"  # type: ignore[arg-type]


def _fusable_chains(graph_module: GraphModule) -> Iterator[tuple[GraphModule, Node, EpilogueChain]]:
    """Every root of every graph (control-flow branches and loop bodies
    included) with its chain, matched on the graph as the caller leaves it."""
    for gm in list(iter_graph_modules(graph_module)):
        # Snapshot the roots: a rewrite erases its own chain only, and a
        # root consumed as another chain's operand stays in the graph.
        roots = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in MATMUL_ROOTS]
        for root in roots:
            yield gm, root, match_chain(root)


def _fuse_groups(graph_module: GraphModule, groups: frozenset[str] | None) -> list[str]:
    """Rewrite the fusable chains whose group is in ``groups`` (all: ``None``); their groups, in order."""
    seen = []
    for gm, _, chain in _fusable_chains(graph_module):
        if chain.fusable:
            group = chain_group(chain)
            seen.append(group)
            if groups is None or group in groups:
                rewrite_chain(gm, chain)
    return seen


class NvGemmPass(BranchyardPass):
    """Fuse matmul + epilogue chains into ``branchyard.fused_gemm_epilogue``.

    ``calling``: how the rewritten program will be called -- ``"eager"``
    (the default: from Python, the program is raced, see the module
    docstring) or ``"graph"`` (replayed from a CUDA graph, as
    ``branchyard.compile`` with ``cuda_graph=True`` runs it: every fusable
    chain is fused). ``race`` sets how programs are raced (its timer,
    blocks and devices; :class:`~.program_race.ProgramRace`);
    ``example_inputs`` gives one value per graph placeholder (``None`` where
    a random tensor of the example shape will do; :meth:`bind_inputs` takes
    them from an ExportedProgram).

    ``report.stats``: ``fused`` (chains replaced), ``declined`` (roots left
    alone), ``specs`` (the spec of each fused chain, in graph order), ``race``
    (what the eager race found, or why it did not run) and
    ``race_decisions`` (each group's time per call fused and unfused). Each
    chain the race left unfused is a skip with its figures.
    """

    name = "nvgemm"

    def __init__(self, calling: Calling = "eager", *, race: ProgramRace | None = None,
                 example_inputs: Sequence[Any] | None = None) -> None:
        super().__init__()
        self.calling = calling
        self.race = race if race is not None else ProgramRace()
        self.example_inputs = list(example_inputs) if example_inputs is not None else None
        #: The last race's result (``None`` where none ran).
        self.race_result: RaceResult | None = None

    @property
    def calling(self) -> Calling:
        return self._calling

    @calling.setter
    def calling(self, value: Calling) -> None:
        self._calling = check_calling(value, where="NvGemmPass")

    def bind_inputs(self, program: Program) -> "NvGemmPass":
        """Race with ``program``'s own values: its parameters, buffers and
        example inputs (:func:`~.program_race.program_inputs`)."""
        self.example_inputs = program_inputs(program)
        return self

    def _why_not_race(self, graph_module: GraphModule) -> str | None:
        """Why the program is not raced (``None``: it is)."""
        if self.calling == "graph":
            return "calling='graph': replayed from a CUDA graph, where host work is not paid"
        device = program_device(graph_module, self.example_inputs or ())
        if device not in self.race.devices:
            return (f"the program runs on {device}, where the fused op runs the original ATen ops "
                    f"(races run on {', '.join(self.race.devices)})")
        if device == "cuda" and not torch.cuda.is_available():
            return "the program is on CUDA but CUDA is not available here"
        if device == "cuda" and torch.cuda.is_current_stream_capturing():
            return "a CUDA graph is being captured on this stream (running the program would break it)"
        if detect_fake_mode() is not None:
            return "called while tracing with fake tensors (nothing real to time)"
        return None

    def _race(self, graph_module: GraphModule) -> RaceResult | str:
        """Race copies of ``graph_module`` fusing different groups of chains; or why not."""
        everything = copy_graph_module(graph_module, share_tensors=True)  # tensors shared, not copied
        groups = _fuse_groups(everything, None)
        if not groups:
            return "nothing to fuse"
        inputs, why_not = placeholder_inputs(graph_module, self.example_inputs)
        if inputs is None:
            return why_not or "no inputs"
        programs = {frozenset(): graph_module, frozenset(groups): everything}
        variants: dict[frozenset[str], Variant] = {}

        def build(fused: frozenset[str]) -> Variant:
            if fused not in variants:
                gm = programs.get(fused)
                if gm is None:
                    gm = copy_graph_module(graph_module, share_tensors=True)
                    _fuse_groups(gm, fused)
                if fused:
                    for m in iter_graph_modules(gm):
                        m.recompile()
                run = lambda gm=gm: gm(*inputs)  # noqa: E731
                run()  # warm-up: the fused ops tune here, for eager calls
                variants[fused] = Variant(fused, run, gm)
            return variants[fused]

        with race_context():
            try:
                build(frozenset())
            except Exception as exc:
                first = str(exc).splitlines()[0] if str(exc) else ""
                return f"the unrewritten program failed on the race inputs: {type(exc).__name__}: {first}"
            return self.race.run(groups, build)

    def run(self, graph_module: GraphModule) -> bool:
        self.race_result = None
        why_not = self._why_not_race(graph_module)
        keep: frozenset[str] | None = None
        if why_not is None:
            raced = self._race(graph_module)
            if isinstance(raced, str):
                why_not = raced
            else:
                self.race_result, keep = raced, raced.fused
        fused, declined, specs, left = 0, 0, [], 0
        for gm, root, chain in _fusable_chains(graph_module):
            if not chain.fusable:
                declined += 1
                self.skip(root, chain.reason or "")
                continue
            group = chain_group(chain)
            if keep is not None and group not in keep:
                decision = self.race_result.decision(group) if self.race_result else None
                self.skip(root, f"left unfused: the program called eagerly is faster without it ({decision})")
                left += 1
                continue
            if chain.near_miss and chain.stop_node is not None:
                self.skip(chain.stop_node, f"the chain from '{root.name}' stops here: {chain.stop}")
            specs.append(str(chain.spec))
            rewrite_chain(gm, chain)
            fused += 1
        self.report.stats.update(fused=fused, declined=declined, specs=specs)
        result = self.race_result
        if result is None:
            self.report.stats["race"] = f"not raced: {why_not}"
        else:
            self.report.stats["race"] = (
                f"raced eagerly: {result.result_us:.1f} us per call against {result.unrewritten_us:.1f} us "
                f"unrewritten; {left} chain(s) left unfused")
            self.report.stats["race_decisions"] = [str(d) for d in result.decisions]
            logger.info("nvgemm: %s", self.report.stats["race"])
        return fused > 0


def nvgemm(program: Program, *, calling: Calling = "eager", race: ProgramRace | None = None) -> Program:
    """Function form of :class:`NvGemmPass`: a rewritten copy of ``program``
    (an ``ExportedProgram`` or an ATen-level ``GraphModule``).

    ``calling="eager"`` (the default) for a program called from Python: on
    CUDA, chains the program is faster without stay unfused, so the result
    is never slower than ``program`` (see the module docstring); its own
    parameters and example inputs are what the race runs on.
    ``calling="graph"`` for a program replayed from a CUDA graph: every
    fusable chain is fused. ``race`` as in :class:`NvGemmPass`.

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
    the_pass = NvGemmPass(check_calling(calling), race=race).bind_inputs(program)
    return Pipeline([the_pass], steps=1)(program).program
