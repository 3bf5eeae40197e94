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

The rewritten program is never slower than the original, called the way it
will be called: where the program runs on CUDA, the pass races the
rewritten program against the unrewritten one and leaves unfused every
group of chains it does not win with (:mod:`.program_race`) -- host time
included for ``calling="eager"`` (the default), device time of CUDA-graph
replays for ``calling="graph"``. Semantics, as Python::

    def nvgemm(program, calling="eager"):
        # (run on a whole program: sibling GEMMs merged first where that wins; NvGemmPass.rewrite_program)
        chains = [c for c in find_epilogue_chains(program) if c.fusable]
        if program runs on CUDA and example inputs can be had and (calling == "eager" or capturable):
            if calling == "graph":
                chains += [c for c in find_epilogue_chains(program) if c.plain]  # plain GEMMs
            keep = race(chains, calling)  # eager: time per call, host-inclusive;
                                          # graph: device time per replay of a CUDA graph of one call
        else:                             # CPU: the fused op runs the same ATen ops, nothing to win
            keep = chains
        return program with each chain in keep replaced by one fused op

``capturable``: no control flow, no GPU value read on the host and no work
off the program's device (what one capture of a call can replay), or a
``ProgramRace.capture`` given that can.

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

import dataclasses
import logging
import math
from typing import Any, Iterator, Sequence

import torch
from torch._guards import detect_fake_mode
from torch.export.graph_signature import InputKind
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from branchyard.lowering.nvgemm.matcher import MATMUL_ROOTS, EpilogueChain, WeightRows, match_chain
from branchyard.lowering.nvgemm.op import fused_gemm_epilogue, tuned_result
from branchyard.lowering.nvgemm.program_race import (
    Calling,
    ProgramRace,
    RaceDecision,
    RaceResult,
    Variant,
    capture_replay,
    check_calling,
    placeholder_inputs,
    program_device,
    program_inputs,
    race_context,
)
from branchyard.lowering.nvgemm.siblings import merge_sibling_gemms
from branchyard.fx.graph_walk import copy_graph_module, iter_graph_modules
from branchyard.fx.pass_infra import BranchyardPass, Pipeline, PipelineResult, Program

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


def rewrite_chain(gm: GraphModule, chain: EpilogueChain, impl: str | None = None) -> Node:
    """Replace ``chain`` (which must be fusable) by one fused op; return it.
    ``impl``: the candidate the op runs for it (the spec's ``impl=``; ``None``: the tuner's choice)."""
    graph = gm.graph
    end = chain.end
    spec = str(dataclasses.replace(chain.spec, impl=impl) if impl is not None else chain.spec)
    target = fused_gemm_epilogue
    with graph.inserting_before(end):
        b, *operands = (_weight_rows(graph, v) if isinstance(v, WeightRows) else v
                        for v in (chain.b, *chain.operands))
        args = (chain.a, b, operands, spec)
        fused = graph.call_function(target, args)
        fused.meta["val"] = _fake_val(target, args)
        for key in _COPIED_META:
            if key in chain.root.meta:
                fused.meta[key] = chain.root.meta[key]
        result = fused
        if chain.out_view is not None and tuple(fused.meta["val"].shape) != tuple(end.meta["val"].shape):
            # the chain's leading dims; the last is N (a halved matmul's view has 2N there)
            shape = [*chain.out_view.args[1][:-1], fused.meta["val"].shape[-1]]
            result = graph.call_function(aten.view.default, (fused, shape))
            result.meta["val"] = _fake_val(aten.view.default, (fused, shape))
    end.replace_all_uses_with(result)
    for check in chain.checks:  # checks of intermediates that no longer exist
        graph.erase_node(check)
    for node in reversed(chain.nodes):
        graph.erase_node(node)
    chain.replaced_by = fused
    return fused


def _weight_rows(graph: torch.fx.Graph, rows: WeightRows) -> Node:
    """``rows`` as a graph value: ``aten.slice`` of its weight (a view, no copy)."""
    args = (rows.source, 0, rows.start, rows.stop)
    node = graph.call_function(aten.slice.Tensor, args)
    node.meta["val"] = _fake_val(aten.slice.Tensor, args)
    return node


def _val_shape(node: Node | WeightRows | None) -> tuple[int, ...] | None:
    if isinstance(node, WeightRows):
        return tuple(node.shape)
    shape = getattr(getattr(node, "meta", {}).get("val"), "shape", None)
    return tuple(shape) if shape is not None else None


def _shape(node: Node | WeightRows) -> str:
    shape = _val_shape(node)
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
        # Snapshot the roots: a rewrite erases its own chain only (with a GLU's
        # second matmul, which its mul_mm step computes); a root that is another
        # chain's operand stays in the graph.
        roots = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in MATMUL_ROOTS]
        gone: set[Node] = set()
        for root in roots:
            if root in gone:  # taken into an earlier chain (a GLU's second matmul)
                continue
            chain = match_chain(root)
            yield gm, root, chain
            if chain.replaced_by is not None:  # the caller rewrote it
                gone.update(chain.nodes)


def _fuse_groups(graph_module: GraphModule, groups: frozenset[str] | None, pins: dict[str, str] | None = None,
                 plain: bool = False, calls: dict[str, tuple] | None = None) -> list[str]:
    """Rewrite the fusable chains (and, with ``plain``, the plain GEMMs) whose
    group is in ``groups`` (all: ``None``), each with the candidate ``pins``
    names for its group (else the tuner's choice); their groups, in order.
    ``calls`` gets, per group, what the op's plans for it are found by
    (:func:`~.op.tuned_result`: the spec and the shapes of the input and weight)."""
    seen = []
    pins = pins or {}
    for gm, _, chain in _fusable_chains(graph_module):
        if chain.fusable or (plain and chain.plain):
            group = chain_group(chain)
            seen.append(group)
            if calls is not None and group not in calls:
                calls[group] = (str(chain.spec), _val_shape(chain.a), _val_shape(chain.b))
            if groups is None or group in groups:
                rewrite_chain(gm, chain, pins.get(group))
    return seen


class NvGemmPass(BranchyardPass):
    """Fuse matmul + epilogue chains into ``branchyard.fused_gemm_epilogue``.

    ``calling``: how the rewritten program will be called -- ``"eager"``
    (the default: from Python) or ``"graph"`` (replayed from a CUDA graph,
    as ``branchyard.compile`` with ``cuda_graph=True`` runs it); the program
    is raced the way it will be called (see the module docstring). ``race``
    sets how programs are raced (its timer, blocks, devices and graph
    capture; :class:`~.program_race.ProgramRace`);
    ``example_inputs`` gives one value per graph placeholder (``None`` where
    a random tensor of the example shape will do; :meth:`bind_inputs` takes
    them from an ExportedProgram).

    ``merge_siblings``: run on a whole program (:meth:`rewrite_program`, which
    a :class:`~branchyard.fx.pass_infra.Pipeline` calls), the pass first merges
    sibling GEMMs (:mod:`.siblings`) and keeps the merge where it wins (see
    :func:`nvgemm`). Called on a bare GraphModule (``pass_(gm)``) it does not.

    ``report.stats``: ``fused`` (chains replaced), ``declined`` (roots left
    alone), ``specs`` (the spec of each fused chain, in graph order), ``race``
    (what the race found, or why it did not run),
    ``race_decisions`` (each group's time per call fused and unfused, the win measured and the win needed),
    ``merged`` (the sibling groups merged) and ``merge`` (what became of the
    merge, and why). Each chain the race left unfused is a skip with its figures.
    """

    name = "nvgemm"

    def __init__(self, calling: Calling = "eager", *, race: ProgramRace | None = None,
                 example_inputs: Sequence[Any] | None = None, merge_siblings: bool = True) -> None:
        super().__init__()
        self.calling = calling
        self.race = race if race is not None else ProgramRace()
        self.example_inputs = list(example_inputs) if example_inputs is not None else None
        self.merge_siblings = merge_siblings
        #: The last race's result (``None`` where none ran).
        self.race_result: RaceResult | None = None
        #: Per group the race kept fused by a runner-up of the tuner's, that candidate.
        self.race_pins: dict[str, str] = {}

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

    @property
    def _races_plain(self) -> bool:
        """Whether plain GEMMs join the race: replayed from a CUDA graph, another
        kernel than cuBLAS's can win one; called eagerly, the op's host cost on
        top of one ATen launch all but rules that out, so they are not timed."""
        return self.calling == "graph"

    def _why_not_race(self, graph_module: GraphModule) -> str | None:
        """Why the program is not raced (``None``: it is)."""
        device = program_device(graph_module, self.example_inputs or ())
        if device not in self.race.devices:
            where = ", where the fused op runs the original ATen ops" if device == "cpu" else ""
            return f"the program runs on {device}{where} (races run on {', '.join(self.race.devices) or 'no device'})"
        if device == "cuda" and not torch.cuda.is_available():
            return "the program is on CUDA but CUDA is not available here"
        if device == "cuda" and torch.cuda.is_current_stream_capturing():
            return "a CUDA graph is being captured on this stream (running the program would break it)"
        if detect_fake_mode() is not None:
            return "called while tracing with fake tensors (nothing real to time)"
        if self.calling == "graph" and self.race.capture is None:
            return _why_not_capturable(graph_module, device)
        return None

    def _race(self, graph_module: GraphModule) -> RaceResult | str:
        """Race copies of ``graph_module`` fusing different groups of chains; or why not."""
        everything = copy_graph_module(graph_module, share_tensors=True)  # tensors shared, not copied
        plain = self._races_plain
        calls: dict[str, tuple] = {}
        groups = _fuse_groups(everything, None, plain=plain, calls=calls)
        if not groups:
            return "nothing to fuse"
        inputs, why_not = placeholder_inputs(graph_module, self.example_inputs)
        if inputs is None:
            return why_not or "no inputs"
        programs = {frozenset(): graph_module, frozenset(groups): everything}
        variants: dict[frozenset[str], Variant] = {}
        calling = self.calling
        capture = self.race.capture or capture_replay
        pinned: dict[str, tuple[str, str]] = {}  # a runner-up's label -> (its group, its candidate)

        def alternatives(group: str) -> list[str]:
            """``group`` fused by each of its tuned runner-ups, as labels ``build`` takes."""
            labels = []
            for name in _runner_ups(group, calls.get(group), calling, self.race.runner_ups):
                label = f"{group} impl={name}"
                pinned[label] = (group, name)
                labels.append(label)
            return labels

        def resolve(fused: frozenset[str]) -> tuple[frozenset[str], dict[str, str]]:
            """The groups ``fused`` names, and per group fused by a runner-up its candidate."""
            groups_in = frozenset(pinned[label][0] if label in pinned else label for label in fused)
            return groups_in, dict(pinned[label] for label in fused if label in pinned)

        def build(fused: frozenset[str]) -> Variant:
            if fused not in variants:
                # The race holds the variants it still compares; the cache keeps only the
                # unrewritten one, so at most three captured graphs (and pools) live at once.
                for key in [k for k in variants if k]:
                    del variants[key]
                gm = programs.get(fused)
                if gm is None:
                    gm = copy_graph_module(graph_module, share_tensors=True)
                    _fuse_groups(gm, *resolve(fused), plain=plain)
                if fused:
                    for m in iter_graph_modules(gm):
                        m.recompile()
                variants[fused] = self._variant(fused, gm, inputs, capture)
            return variants[fused]

        with race_context(calling):
            try:
                build(frozenset())
            except _CaptureFailed as failed:
                return f"the unrewritten program could not be captured into a CUDA graph: {_first_line(failed.error)}"
            except Exception as exc:
                return f"the unrewritten program failed on the race inputs: {_first_line(exc)}"
            try:
                result = self.race.run(groups, build, alternatives)
                self.race_pins = resolve(result.fused)[1]
                return result
            except _CaptureFailed as failed:  # a fused program that cannot be replayed is not kept
                decisions = [RaceDecision(g, math.inf, math.nan, False) for g in dict.fromkeys(groups)]
                logger.warning("nvgemm: the program fusing %s could not be captured into a CUDA graph (%s); "
                               "left unfused", ", ".join(sorted(failed.fused)), _first_line(failed.error))
                return RaceResult(frozenset(), decisions, math.nan, math.nan,
                                  failure=f"the program fusing {len(failed.fused)} group(s) could not be captured "
                                          f"into a CUDA graph: {_first_line(failed.error)}")

    def _variant(self, fused: frozenset[str], gm: GraphModule, inputs: Sequence[Any],
                 capture: Any) -> Variant:
        """``gm`` called on ``inputs`` as the caller will call it: warmed up (its fused ops
        tune here, for that calling), and for graph calling captured into a CUDA graph."""
        run = lambda: gm(*inputs)  # noqa: E731
        run()
        if self.calling == "graph":
            try:
                run = capture(gm, inputs)
            except Exception as exc:
                raise _CaptureFailed(fused, exc) from exc
        return Variant(fused, run, gm, self.calling)

    def race_programs(self, label: str, candidate: tuple[GraphModule, Sequence[Any]],
                      baseline: tuple[GraphModule, Sequence[Any]]) -> RaceResult | str:
        """Race ``candidate`` against ``baseline`` (each a graph and its inputs), called
        the way this pass's programs are called; the candidate must win by the
        race's margin. One group, ``label``, fused in the candidate; or why no race ran."""
        why_not = self._why_not_race(candidate[0]) or self._why_not_race(baseline[0])
        if why_not is not None:
            return why_not
        capture = self.race.capture or capture_replay
        programs = {frozenset({label}): candidate, frozenset(): baseline}
        with race_context(self.calling):
            try:
                return self.race.run([label], lambda fused: self._variant(fused, *programs[fused], capture))
            except _CaptureFailed as failed:
                return f"a program could not be captured into a CUDA graph: {_first_line(failed.error)}"
            except Exception as exc:
                return f"a program failed on the race inputs: {_first_line(exc)}"

    def rewrite_program(self, program: Program) -> PipelineResult:
        """The pass on a whole program: sibling GEMMs merged first (with
        ``merge_siblings``) where the merged program, fused, wins (see :func:`nvgemm`)."""
        baseline = lambda: Pipeline([self], steps=1).run_graph_passes(program)  # noqa: E731
        if not self.merge_siblings:
            return baseline()
        try:
            merged = merge_sibling_gemms(program)
        except Exception as exc:  # an optimisation that cannot be made must not cost the rewrite
            logger.warning("nvgemm: sibling GEMMs not merged: %s", _first_line(exc))
            return self._noting(baseline(), [], f"not merged ({_first_line(exc)})")
        if not merged.changed:
            return self._noting(baseline(), [], "nothing to merge")
        label = "merged " + "; ".join(merged.groups)
        twin = NvGemmPass(self.calling, race=self.race, merge_siblings=False,
                          example_inputs=_merged_inputs(program, merged.program, self.example_inputs))
        candidate = Pipeline([twin], steps=1).run_graph_passes(merged.program)
        why_not = self._why_not_race(_graph_module(program))
        if why_not is not None:  # not raced (CPU, tracing, ...): kept, as unraced chains are
            return self._adopt(twin, candidate, merged.groups, f"kept (not raced: {why_not})")
        result = baseline()
        inputs = _race_inputs(program, candidate.program)
        if isinstance(inputs, str):
            return self._adopt(twin, candidate, merged.groups, f"kept (not raced: {inputs})")
        raced = self.race_programs(label, (_graph_module(candidate.program), inputs[1]),
                                   (_graph_module(result.program), inputs[0]))
        if isinstance(raced, RaceResult) and raced.fused:
            return self._adopt(twin, candidate, merged.groups,
                               f"kept ({raced.result_us:.1f} us against {raced.unrewritten_us:.1f} us without)")
        if isinstance(raced, RaceResult):
            why = raced.failure or (f"{raced.decisions[-1].fused_us:.1f} us with it against "
                                    f"{raced.unrewritten_us:.1f} us without" if raced.decisions else "not timed")
        else:
            why = raced
        logger.info("nvgemm: %s: not kept (%s)", label, why)
        for group in merged.groups:
            self.skip(group, f"not merged: the program {_CALLED[self.calling]} is no faster with it ({why})")
        return self._noting(result, [], f"not kept ({why})")

    def _noting(self, result: PipelineResult, groups: list[str], merge: str) -> PipelineResult:
        self.report.stats.update(merged=groups, merge=merge)
        return PipelineResult(result.program, result.modified, [self.report])

    def _adopt(self, twin: "NvGemmPass", result: PipelineResult, groups: list[str], merge: str) -> PipelineResult:
        """Take the merged program's run as this pass's own."""
        logger.info("nvgemm: merged %s: %s", "; ".join(groups), merge)  # as the not-kept line names them
        self.report, self.race_result, self.race_pins = twin.report, twin.race_result, twin.race_pins
        self.report.modified = True
        return self._noting(PipelineResult(result.program, True, [self.report]), groups, merge)

    def run(self, graph_module: GraphModule) -> bool:
        self.race_result, self.race_pins = None, {}
        why_not = self._why_not_race(graph_module)
        keep: frozenset[str] | None = None
        if why_not is None:
            raced = self._race(graph_module)
            if isinstance(raced, str):
                why_not = raced
            else:
                self.race_result, keep = raced, raced.fused
        fused, declined, specs, left, plain = 0, 0, [], 0, 0
        pins = self.race_pins
        for gm, root, chain in _fusable_chains(graph_module):
            group = chain_group(chain) if chain.fusable or chain.plain else ""
            won = keep is not None and (group in keep or group in pins)
            if chain.plain and self._races_plain and won:  # won its race
                specs.append(rewrite_chain(gm, chain, pins.get(group)).args[3])
                fused += 1
                plain += 1
                continue
            if not chain.fusable:
                declined += 1
                self.skip(root, chain.reason or "")
                continue
            if keep is not None and not won:
                result = self.race_result
                if result is not None and result.failure:
                    self.skip(root, f"left unfused: {result.failure}")
                else:
                    decision = result.decision(group) if result else None
                    self.skip(root, f"left unfused: the program {_CALLED[self.calling]} is faster without it "
                                    f"({decision})")
                left += 1
                continue
            if chain.near_miss and chain.stop_node is not None:
                self.skip(chain.stop_node, f"the chain from '{root.name}' stops here: {chain.stop}")
            specs.append(rewrite_chain(gm, chain, pins.get(group)).args[3])
            fused += 1
        self.report.stats.update(fused=fused, declined=declined, specs=specs, plain_fused=plain)
        result = self.race_result
        if result is None:
            self.report.stats["race"] = f"not raced: {why_not}"
        elif result.failure:
            self.report.stats["race"] = f"{_RACED[self.calling]}: {result.failure}; {left} chain(s) left unfused"
        else:
            self.report.stats["race"] = (
                f"{_RACED[self.calling]}: {result.result_us:.1f} us per {_PER[self.calling]} against "
                f"{result.unrewritten_us:.1f} us unrewritten; {left} chain(s) left unfused")
            self.report.stats["race_decisions"] = [str(d) for d in result.decisions]
            logger.info("nvgemm: %s", self.report.stats["race"])
        return fused > 0


#: How each calling is named in the report: the race, its unit, the program as called.
_RACED = {"eager": "raced eagerly", "graph": "raced in a CUDA graph"}
_PER = {"eager": "call", "graph": "replay"}
_CALLED = {"eager": "called eagerly", "graph": "replayed from a CUDA graph"}


class _CaptureFailed(Exception):
    """A variant of the race could not be captured into a CUDA graph."""

    def __init__(self, fused: frozenset[str], error: BaseException) -> None:
        super().__init__(str(error))
        self.fused, self.error = fused, error


def _first_line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"


def _why_not_capturable(graph_module: GraphModule, device: str = "cuda") -> str | None:
    """Why one CUDA-graph capture of a call of ``graph_module``, a program on
    ``device``, cannot replay it (``None``: it can): control flow (the
    CUDA-graph lowering turns it into conditional nodes; a plain capture
    records one path), a GPU value read on the host (a sync, which
    invalidates a capture), or work on another device (on the CPU: done once
    at capture, never replayed; a copy to the host syncs)."""
    for node in graph_module.graph.nodes:
        if node.op != "call_function":
            continue
        val = node.meta.get("val")
        if isinstance(node.target, torch._ops.HigherOrderOperator):
            return (f"calling='graph' and the program has control flow ('{node.name}'), which one CUDA-graph "
                    "capture of a call cannot replay (ProgramRace(capture=...) can race it)")
        if node.target is aten._local_scalar_dense.default or free_unbacked_symbols(val):
            return (f"calling='graph' and '{node.name}' reads a GPU value on the host, which a CUDA-graph "
                    "capture cannot do")
        off = [t.device.type for t in torch.utils._pytree.tree_leaves(val)
               if isinstance(t, torch.Tensor) and t.device.type != device]
        if off:
            return f"calling='graph' and '{node.name}' computes on the {off[0]}, which a CUDA graph does not replay"
    return None


def nvgemm(program: Program, *, calling: Calling = "eager", race: ProgramRace | None = None,
           merge_siblings: bool = True) -> Program:
    """Function form of :class:`NvGemmPass`: a rewritten copy of ``program``
    (an ``ExportedProgram`` or an ATen-level ``GraphModule``).

    ``calling="eager"`` (the default) for a program called from Python: on
    CUDA, chains the program is faster without stay unfused, so the result
    is never slower than ``program`` (see the module docstring); its own
    parameters and example inputs are what the race runs on.
    ``calling="graph"`` for a program replayed from a CUDA graph: chains
    that its replays are faster without stay unfused. ``race`` as in
    :class:`NvGemmPass`.

    ``merge_siblings`` also merges GEMMs that read one input with constant
    weights and whose outputs are concatenated (attention's q, k, v) into one
    GEMM (:mod:`.siblings`). Where the program is raced, the merge is kept
    only if the merged program, fused, beats the program fused without it
    (called the same way, by the race's margin)::

        result = fuse(program)                 # the race above
        merged = merge_sibling_gemms(program)
        if merged changed anything:
            candidate = fuse(merged)
            if not raced or wins(candidate, result):
                result = candidate

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
    the_pass = NvGemmPass(check_calling(calling), race=race, merge_siblings=merge_siblings).bind_inputs(program)
    return Pipeline([the_pass], steps=1)(program).program


def _runner_ups(group: str, call: tuple | None, calling: Calling, limit: int) -> list[str]:
    """The tuner's runner-ups for ``group`` (:meth:`~.tuner.TuneResult.runner_ups`), from the
    tuning behind the op's plan for ``call`` (its spec and the shapes of its input and
    weight; see :func:`~.op.tuned_result`) for this ``calling``; none where it was not tuned."""
    if call is None or limit <= 0 or None in call:
        return []
    spec, a_shape, b_shape = call
    result = tuned_result(spec, "host" if calling == "eager" else "device", a_shape, b_shape)
    return result.runner_ups(limit) if result is not None else []


def _graph_module(program: Program) -> GraphModule:
    return program if isinstance(program, GraphModule) else program.graph_module


def _merged_inputs(original: Program, merged: Program, given: Sequence[Any] | None) -> list[Any] | None:
    """``given`` (one value per placeholder of ``original``, or ``None``) for ``merged``."""
    return None if given is None else _carry_user_inputs(original, given, merged)


def _race_inputs(original: Program, rewritten: Program) -> tuple[list[Any], list[Any]] | str:
    """Placeholder values of ``original`` and of ``rewritten``, the user inputs shared."""
    base, why_not = placeholder_inputs(_graph_module(original), program_inputs(original))
    if base is None:
        return why_not or "no inputs"
    return base, _carry_user_inputs(original, base, rewritten)


def _carry_user_inputs(original: Program, values: Sequence[Any], merged: Program) -> list[Any]:
    """``values`` (one per placeholder of ``original``) for ``merged``, the same program with
    sibling GEMMs merged: the same user inputs, and the merged program's own values for
    what it owns (an ExportedProgram gains constants; a GraphModule's placeholders stay)."""
    if isinstance(original, GraphModule):
        return list(values)
    user = iter(v for v, spec in zip(values, original.graph_signature.input_specs)
                if spec.kind == InputKind.USER_INPUT)
    owned = program_inputs(merged) or [None] * len(merged.graph_signature.input_specs)
    return [next(user, None) if spec.kind == InputKind.USER_INPUT else value
            for value, spec in zip(owned, merged.graph_signature.input_specs)]
