"""The pass infrastructure: base class, report, pipeline, function forms.

A branchyard pass is a :class:`torch.fx.passes.infra.pass_base.PassBase`:
calling it on a ``GraphModule`` returns ``PassResult(graph_module, modified)``.
Subclasses implement :meth:`BranchyardPass.run`, which rewrites the graph in
place and returns whether it changed anything (XLA's ``HloPassInterface::Run``).
Every candidate a pass declines is recorded with :meth:`BranchyardPass.skip`;
the reasons land in the pass's :class:`PassReport` and in the ``branchyard``
logger at DEBUG level.

Each pass also has a *function form* built by :func:`apply_pass`: it takes a
``torch.export.ExportedProgram`` or a ``torch.fx.GraphModule`` and returns a
new one of the same kind, leaving its argument untouched.

:class:`Pipeline` runs several passes with torch's ``PassManager`` on one
copy of the program, lints every graph (subgraphs included) of the input once
and again after each pass that changed it, verifies an ExportedProgram at the
end, and returns the reports of all passes::

    >>> import torch
    >>> from branchyard.fx.pass_infra import BranchyardPass, Pipeline
    >>> class DropNothing(BranchyardPass):
    ...     name = "drop_nothing"
    ...     def run(self, gm):
    ...         for node in gm.graph.nodes:
    ...             self.skip(node, "nothing to drop")
    ...         return False
    >>> gm = torch.fx.symbolic_trace(lambda x: x + 1)
    >>> result = Pipeline([DropNothing()])(gm)
    >>> result.modified, len(result.reports[0].skips)
    (False, 3)
"""

from __future__ import annotations

import abc
import contextlib
import gc
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator, Sequence, TypeVar

from torch.export import ExportedProgram
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassBase, PassResult
from torch.fx.passes.infra.pass_manager import PassManager

from branchyard.errors import BranchyardError
from branchyard.fx.control_flow import control_flow_op, describe_node
from branchyard.fx.graph_walk import copy_graph_module, iter_graph_modules, lint_graph_module, realize_graph_modules
from branchyard.fx.mutation import has_effects

__all__ = [
    "logger",
    "Skip",
    "PassReport",
    "BranchyardPass",
    "Program",
    "apply_pass",
    "check_graphs",
    "gc_paused",
    "Pipeline",
    "PipelineResult",
    "unwrapping_pass_manager_errors",
]

logger = logging.getLogger("branchyard")

Program = TypeVar("Program", ExportedProgram, GraphModule)


@dataclass(frozen=True)
class Skip:
    """One candidate a pass looked at and declined, and why."""

    pass_name: str
    where: str
    reason: str

    def __str__(self) -> str:
        return f"[{self.pass_name}] skipped {self.where}: {self.reason}"


@dataclass
class PassReport:
    """What one run of a pass did: whether it changed the graph, what it
    declined and why, and pass-specific counters (``stats``)."""

    pass_name: str
    modified: bool = False
    skips: list[Skip] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        head = f"{self.pass_name}: {'modified' if self.modified else 'unchanged'}"
        lines = [head]
        lines += [f"  {k}: {v}" for k, v in self.stats.items()]
        lines += [f"  {s}" for s in self.skips]
        return "\n".join(lines)


def check_graphs(gm: GraphModule) -> None:
    """Lint ``gm`` and every subgraph (naming them afresh from ``gm``, see
    :func:`~branchyard.fx.graph_walk.graph_path`) and take every control-flow
    node apart once: a malformed node is reported before any rewrite, in the
    coordinates of the program as given."""
    lint_graph_module(gm)
    for sub in iter_graph_modules(gm):
        for node in sub.graph.nodes:
            op = control_flow_op(node)
            if op is not None:
                op.parts(sub, node)


def _describe(where: Node | str) -> str:
    if isinstance(where, Node):
        return f"{describe_node(where)} ({where.op} {getattr(where.target, '__name__', where.target)})"
    return str(where)


class BranchyardPass(PassBase):
    """Base class of branchyard passes.

    Subclasses set ``name`` (snake_case; the same name the registry,
    the command line and reports use) and implement :meth:`run`. After a run
    that modified the graph every graph (subgraphs included) is recompiled.

    Checking is done once, by whoever drives the pass: called on its own
    (``pass_(gm)``, torch's ``PassBase.__call__``), the pass lints its input
    in :meth:`requires` and, when it changed something, its output in
    :meth:`ensures`; inside a :class:`Pipeline` the pipeline lints instead
    and calls :meth:`call` directly, so no graph is linted twice.
    """

    name: ClassVar[str] = "branchyard_pass"
    #: Whether to run DCE on every graph after a modifying run.
    eliminate_dead_code: ClassVar[bool] = False
    #: Whether to pause the cyclic GC for the run, recompile and lint (see
    #: :func:`gc_paused`); worth it for passes that create many subgraphs.
    pause_gc: ClassVar[bool] = False

    def __init__(self) -> None:
        self.report = PassReport(self.name)

    @abc.abstractmethod
    def run(self, graph_module: GraphModule) -> bool:
        """Rewrite ``graph_module`` in place; return whether anything changed."""

    def skip(self, where: Node | str, reason: str) -> None:
        """Record that a candidate was declined (report + DEBUG log)."""
        entry = Skip(self.name, _describe(where), reason)
        self.report.skips.append(entry)
        logger.debug("%s", entry)

    def requires(self, graph_module: GraphModule) -> None:
        """Check the input (a pass called on its own; a :class:`Pipeline` checks for it)."""
        check_graphs(graph_module)

    def ensures(self, graph_module: GraphModule) -> None:
        """Check the output if the run changed it (a pass called on its own)."""
        if self.report.modified:
            check_graphs(graph_module)

    def call(self, graph_module: GraphModule) -> PassResult:
        """Run the pass on ``graph_module`` in place; no checks (see the class docstring)."""
        start = time.perf_counter()
        with gc_paused() if self.pause_gc else contextlib.nullcontext():
            result = self._call(graph_module)
        logger.info("%s: %s in %.2f s", self.name, "modified" if result.modified else "unchanged",
                    time.perf_counter() - start)
        return result

    def _call(self, graph_module: GraphModule) -> PassResult:
        self.report = PassReport(self.name)
        modified = bool(self.run(graph_module))
        if modified:
            for gm in iter_graph_modules(graph_module):
                if self.eliminate_dead_code:  # keeps what writes memory torch calls pure (batch norm stats)
                    gm.graph.eliminate_dead_code(is_impure_node=has_effects)
                gm.recompile()
        self.report.modified = modified
        return PassResult(graph_module, modified)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for a rewrite.

    A pass over a large graph allocates many small objects while millions of
    fake tensors and nodes are alive; each generation-2 collection walks all of
    them, so rewrite time would grow faster than linearly with the graph.
    Nothing a rewrite creates needs cycle collection before it ends.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _check_input(program: Any) -> None:
    if not isinstance(program, (ExportedProgram, GraphModule)):
        raise BranchyardError(
            f"expected a torch.export.ExportedProgram or torch.fx.GraphModule, got {type(program).__name__}",
            hint="export the model with torch.export.export or trace it with make_fx first",
        )


def apply_pass(program: Program, *passes: PassBase) -> Program:
    """Run ``passes`` once each on a copy of ``program``; return the copy.

    ``program`` may be an ``ExportedProgram`` (the result is re-verified) or a
    ``GraphModule``; the result is of the same kind. The input is not mutated.
    """
    return Pipeline(list(passes), steps=1)(program).program


@dataclass
class PipelineResult:
    """The rewritten program, whether any pass changed it, and every report."""

    program: Any
    modified: bool
    reports: list[PassReport]

    def report(self) -> str:
        """All pass reports as readable text."""
        return "\n".join(str(r) for r in self.reports)


class Pipeline:
    """Run passes in order with torch's ``PassManager``, checking once.

    * ``lint=True`` lints every graph and subgraph of the input once (before
      copying it: a graph that fails lint may not even copy) and of the
      result after each pass that changed it;
    * the passes run on one lazily compiled copy, realized once at the end
      (the input is never mutated);
    * ``steps`` > 1 repeats the whole list until nothing changes (fixed point);
    * an ExportedProgram is rebuilt with the rewritten graph and verified;
    * an error raised by a pass reaches the caller as itself, not wrapped in
      the bare ``Exception`` torch's ``PassManager`` raises;
    * a pass with a ``rewrite_program(program) -> PipelineResult`` method
      rewrites the whole program itself (it may change what the program owns,
      e.g. add constants, which a graph pass inside an ExportedProgram cannot):
      the passes before it run as one pipeline, then it, then the rest
      (``steps`` applies to each run of graph passes).
    """

    def __init__(self, passes: Sequence[PassBase], *, lint: bool = True, steps: int = 1) -> None:
        for p in passes:
            if not isinstance(p, PassBase):
                raise BranchyardError(
                    f"pipeline entry {p!r} is not a torch.fx PassBase",
                    hint="instantiate the pass class, e.g. CondToSwitch()",
                )
        self.passes = list(passes)
        self.lint = lint
        self.steps = steps

    def _step(self, p: PassBase) -> Callable[[GraphModule], PassResult]:
        """``p`` as one PassManager step: run it, then lint what it changed."""

        def step(gm: GraphModule) -> PassResult:
            # A BranchyardPass's own requires/ensures would lint again: call it bare.
            res = p.call(gm) if isinstance(p, BranchyardPass) else p(gm)
            if res is None:
                raise BranchyardError(f"pass {p!r} returned None instead of a PassResult")
            if self.lint and res.modified:
                check_graphs(res.graph_module)
            return res

        step.__name__ = getattr(p, "name", type(p).__name__)
        return step

    def _run(self, gm: GraphModule) -> tuple[GraphModule, bool]:
        with unwrapping_pass_manager_errors():
            res = PassManager([self._step(p) for p in self.passes], steps=self.steps)(gm)
        return res.graph_module, bool(res.modified)

    def __call__(self, program: Program) -> PipelineResult:
        _check_input(program)
        if any(_rewrites_programs(p) for p in self.passes):
            return self._run_segments(program)
        return self.run_graph_passes(program)

    def _run_segments(self, program: Program) -> PipelineResult:
        """Runs of graph passes as pipelines and program-level passes on their own, in order."""
        reports: list[PassReport] = []
        modified = False
        segment: list[PassBase] = []

        def flush(program: Any) -> Any:
            nonlocal modified
            if not segment:
                return program
            res = Pipeline(segment, lint=self.lint, steps=self.steps)(program)
            segment.clear()
            reports.extend(res.reports)
            modified = modified or res.modified
            return res.program

        for p in self.passes:
            if not _rewrites_programs(p):
                segment.append(p)
                continue
            program = flush(program)
            res = p.rewrite_program(program)  # type: ignore[attr-defined]
            reports.extend(res.reports)
            modified = modified or res.modified
            program = res.program
        program = flush(program)
        return PipelineResult(program, modified, reports)

    def run_graph_passes(self, program: Program) -> PipelineResult:
        """Run every pass as a graph pass (none's ``rewrite_program``): what a
        ``rewrite_program`` calls to run its own graph pass."""
        _check_input(program)
        if self.lint:
            check_graphs(program if isinstance(program, GraphModule) else program.graph_module)
        if isinstance(program, GraphModule):
            gm, modified = self._run(copy_graph_module(program, lazy=True))
            out: Any = realize_graph_modules(gm)
        else:
            # Run on a copy of the graph; the state dict and constants are shared.
            fresh = program._update(copy_graph_module(program.graph_module, lazy=True), program.graph_signature)
            holder: dict[str, bool] = {}

            def run_all(gm: GraphModule) -> PassResult:
                new_gm, changed = self._run(gm)
                holder["modified"] = changed
                return PassResult(new_gm, changed)

            with unwrapping_pass_manager_errors():
                out = fresh._transform_do_not_use(run_all)
            modified = holder.get("modified", False)
            realize_graph_modules(out.graph_module)
            if modified:
                out.validate()
        reports = [p.report for p in self.passes if isinstance(p, BranchyardPass)]
        return PipelineResult(out, modified, reports)


def _rewrites_programs(p: PassBase) -> bool:
    return callable(getattr(p, "rewrite_program", None))


@contextlib.contextmanager
def unwrapping_pass_manager_errors() -> Iterator[None]:
    """Re-raise the error a pass raised, which torch's ``PassManager`` (also
    the one inside ``ExportedProgram``'s transform) wraps in a bare
    ``Exception("An error occurred when running the ... pass")``, as itself:
    a :class:`~branchyard.errors.MalformedGraphError` naming the node reaches
    the caller the same way whether the program was a GraphModule or an
    ExportedProgram."""
    try:
        yield
    except Exception as exc:
        inner: BaseException = exc
        while type(inner) is Exception and isinstance(inner.__cause__, Exception) and str(inner).startswith(_WRAPPED):
            inner = inner.__cause__
        if inner is exc:
            raise
        raise inner.with_traceback(inner.__traceback__) from None


#: How torch's PassManager starts the message of the exception it wraps a pass's error in.
_WRAPPED = "An error occurred when running the"
