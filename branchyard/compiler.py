"""``branchyard.compile``: export, passes and CUDA-graph lowering as one step.

The top floor: it uses ``shapes`` (export with the spec), ``passes`` and
``lowering`` (``nvgemm``, ``cuda_graph``) and nothing below imports it::

    model, example inputs  (a @dynamic_spec module or function, or an ExportedProgram)
      -> export            shapes.export with the spec (unbacked sizes), else torch.export.export
      -> passes            by name, in order, e.g. cond_to_switch, nvgemm; each reports what it did
      -> cuda_graph        one capture per concrete input shape, in a bounded cache sharing one pool
      -> CompiledProgram   callable; .report says what every stage did

Semantics of a call, as Python::

    def __call__(*args):
        check args against the spec (SpecViolationError names the ShapeVar)  # before anything runs
        key = shapes and dtypes of args
        if key not in captures:                      # warm-up (every branch), capture
            captures[key] = cuda_graph(program, args, pool=shared_pool)
            evict the least recently used capture beyond max_captures
        return captures[key](*args)                  # replay; eager where capture was impossible

A stage that cannot run where it is asked to (no CUDA, torch without switch)
is skipped with its reason in the report; a capture that fails falls back to
eager for that shape with a warning; bad programs are ``branchyard`` errors.

    >>> import torch, warnings, branchyard
    >>> class Step(torch.nn.Module):
    ...     def forward(self, x):
    ...         return torch.cond(x.sum() > 0, lambda t: t * 2, lambda t: -t, (x,))
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")
    ...     fast = branchyard.compile(Step(), (torch.ones(3),), passes=())
    ...     fast(torch.ones(3))
    tensor([2., 2., 2.])
"""

from __future__ import annotations

import collections
import logging
import re
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch.utils import _pytree as pytree

from branchyard.errors import BranchyardError, ShapeSpecError, SpecViolationError, UnsupportedGraphError

__all__ = ["compile", "CompiledProgram", "CompileReport", "StageRecord", "CaptureRecord", "branchyard_backend"]

logger = logging.getLogger("branchyard")

DEFAULT_PASSES = ("cond_to_switch", "nvgemm")


# --------------------------------------------------------------------------- the report
@dataclass
class StageRecord:
    """One stage of :func:`compile`: what ran, how long, and why it was skipped if it was."""

    name: str
    status: str  # "ran", "unchanged", "skipped", "failed"
    seconds: float = 0.0
    detail: str = ""

    def __str__(self) -> str:
        text = f"{self.name:<16} {self.status:<9} {self.seconds * 1e3:9.1f} ms"
        return f"{text}  {self.detail}" if self.detail else text


@dataclass
class CaptureRecord:
    """One CUDA-graph capture: the input shapes it serves and what it holds."""

    shapes: str
    seconds: float
    lowered: bool
    reason: str | None = None
    conditional_nodes: dict[str, int] = field(default_factory=dict)
    #: every node of the graph, bodies included (None where the driver does not say)
    graph_nodes: int | None = None

    def __str__(self) -> str:
        if not self.lowered:
            return f"{self.shapes}: eager ({self.reason})"
        nodes = ", ".join(f"{k} {v}" for k, v in self.conditional_nodes.items() if v) or "no conditional nodes"
        if self.graph_nodes is not None:
            nodes += f"; {self.graph_nodes} nodes in all"
        return f"{self.shapes}: one CUDA graph ({nodes}), captured in {self.seconds * 1e3:.0f} ms"


@dataclass
class CompileReport:
    """What every stage of :func:`compile` did (``str(report)`` reads it out)."""

    stages: list[StageRecord] = field(default_factory=list)
    pass_reports: list[Any] = field(default_factory=list)
    fused_chains: list[str] = field(default_factory=list)
    captures: list[CaptureRecord] = field(default_factory=list)
    cache_hits: int = 0
    cache_evictions: int = 0
    fallbacks: list[str] = field(default_factory=list)

    def stage(self, name: str) -> StageRecord | None:
        return next((s for s in self.stages if s.name == name), None)

    def __str__(self) -> str:
        lines = ["stages:"] + [f"  {s}" for s in self.stages]
        if self.fused_chains:
            lines.append(f"fused GEMM chains: {len(self.fused_chains)}")
            lines += [f"  {n} x {c}" for c, n in collections.Counter(self.fused_chains).most_common()]
        lines.append(f"captures: {len(self.captures)} (cache hits {self.cache_hits}, evictions {self.cache_evictions})")
        lines += [f"  {c}" for c in self.captures]
        if self.fallbacks:
            lines.append("fallbacks:")
            lines += [f"  {f}" for f in self.fallbacks]
        return "\n".join(lines)


# --------------------------------------------------------------------------- export
class _FunctionModule(torch.nn.Module):
    def __init__(self, fn: Callable[..., Any]):
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


def _export(model: Any, args: tuple, spec: Any) -> tuple[torch.export.ExportedProgram, Any, str]:
    """(program, spec or None, how) for any accepted model."""
    from branchyard.shapes import get_spec
    from branchyard.shapes import export as spec_export

    if isinstance(model, torch.export.ExportedProgram):
        attached = getattr(model, "branchyard_shapes", None)
        if spec is not None:
            raise ShapeSpecError(
                "an ExportedProgram already has its shapes; pass spec= with the model, not the program",
                where="branchyard.compile",
            )
        return model, (attached[0] if attached else None), "given"
    if not (isinstance(model, torch.nn.Module) or callable(model)):
        raise BranchyardError(
            f"expected an nn.Module, a function or an ExportedProgram, got {type(model).__name__}",
            where="branchyard.compile",
        )
    name = getattr(model, "__qualname__", type(model).__name__)
    try:
        if spec is not None or get_spec(model) is not None:
            ep = spec_export(model, args, spec=spec)
            return ep, ep.branchyard_shapes[0], "shapes.export (spec)"
        mod = model if isinstance(model, torch.nn.Module) else _FunctionModule(model)
        return torch.export.export(mod, args), None, "torch.export.export (static shapes)"
    except BranchyardError:
        raise
    except Exception as exc:  # torch's own export errors, said as ours with torch's first lines
        text = str(exc)
        raise UnsupportedGraphError(
            f"torch.export cannot export it: {type(exc).__name__}: {_first_lines(text)}",
            where=f"export of {name}",
            hint=next((hint for pattern, hint in _EXPORT_HINTS if pattern.search(text)), _EXPORT_HINT)
            + " (the full torch error is chained below)",
        ) from exc


def _first_lines(text: str, limit: int = 2, width: int = 300) -> str:
    """torch's message up to its first blank line, at most ``limit`` lines of ``width`` characters."""
    lines = []
    for line in text.splitlines():
        if not line.strip():
            if lines:
                break
            continue
        lines.append(line.strip()[:width])
        if len(lines) == limit:
            break
    return " ".join(lines) or "(no message)"


_EXPORT_HINT = ("loop carries must keep their shapes and dtypes; no .item() or data-dependent sizes inside "
                "loop bodies and branches")
#: torch export errors with a known cause, and what to do about them.
_EXPORT_HINTS: tuple[tuple[re.Pattern, str], ...] = (
    # a carry whose size came back as another unbacked symbol (u4 vs u0): torch.cond gives its
    # outputs fresh sizes when its operands' sizes are unbacked, though they are equal
    (re.compile(r"carried_inputs to have same metadata.*differ in 'shape: torch\.Size\(\[[^\]]*\bu\d+.* vs "
                r"torch\.Size\(\[[^\]]*\bu\d+", re.S),
     "a loop carry came back with a new unbacked size: torch.cond (and ops of data-dependent size) give "
     "their outputs fresh sizes when their operands' sizes are unbacked (a ShapeVar); if the sizes are "
     "equal, say so in the loop body before returning the carry, e.g. torch._check(y.shape[0] == x.shape[0])"),
)


# --------------------------------------------------------------------------- passes
def _pass_unavailable(name: str) -> str | None:
    from branchyard._compat import HAS_SWITCH

    if name == "cond_to_switch" and not HAS_SWITCH:
        return f"torch {torch.__version__} has no torch.ops.higher_order.switch"
    return None


def _run_pass(name: str, program: torch.export.ExportedProgram, report: CompileReport,
              cuda_graph: bool = False) -> torch.export.ExportedProgram:
    from branchyard.fx.pass_infra import Pipeline
    from branchyard.registry import get_pass

    start = time.perf_counter()
    why = _pass_unavailable(name)
    if why is not None:
        report.stages.append(StageRecord(name, "skipped", 0.0, why))
        return program
    the_pass = get_pass(name)  # an unknown name is a BranchyardError naming the known ones
    if hasattr(the_pass, "calling"):  # how the program will be called decides what a rewrite may cost
        the_pass.calling = "graph" if cuda_graph else "eager"
    if hasattr(the_pass, "bind_inputs"):  # a pass that times the program (nvgemm's race) uses its values, as in the CLI
        the_pass.bind_inputs(program)
    try:
        result = Pipeline([the_pass])(program)
    except BranchyardError:
        raise
    except Exception as exc:  # a pass bug must not cost the user the program: keep it unchanged
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        warnings.warn(f"branchyard.compile: pass {name} failed and was skipped: {reason}", RuntimeWarning, stacklevel=4)
        report.stages.append(StageRecord(name, "failed", time.perf_counter() - start, reason))
        report.fallbacks.append(f"pass {name} skipped: {reason}")
        return program
    pass_report = result.reports[0] if result.reports else None
    if pass_report is not None:
        report.pass_reports.append(pass_report)
        report.fused_chains += list(pass_report.stats.get("specs", ()) if name == "nvgemm" else ())
    detail = _pass_detail(name, pass_report)
    report.stages.append(StageRecord(name, "ran" if result.modified else "unchanged", time.perf_counter() - start, detail))
    return result.program


def _pass_detail(name: str, pass_report: Any) -> str:
    if pass_report is None:
        return ""
    stats = {k: v for k, v in pass_report.stats.items() if isinstance(v, (int, float))}
    skips = len(pass_report.skips)
    parts = [f"{k} {v}" for k, v in stats.items()]
    if skips:
        parts.append(f"{skips} candidate(s) left alone (see report.pass_reports)")
    return ", ".join(parts)


# --------------------------------------------------------------------------- shapes at call time
def _shape_key(flat: Sequence[Any]) -> tuple:
    return tuple(
        (tuple(x.shape), x.dtype, x.device) if isinstance(x, torch.Tensor) else ("value", type(x).__name__, x) for x in flat
    )


def _describe_key(key: tuple) -> str:
    parts = []
    for k in key:
        if k[0] == "value":
            parts.append(repr(k[2]))
        else:
            parts.append("x".join(map(str, k[0])) or "scalar")
    return "(" + ", ".join(parts) + ")"


def _symbol_range(program: torch.export.ExportedProgram, size: Any) -> tuple[int, int] | None:
    expr = getattr(getattr(size, "node", None), "expr", None)
    if expr is None:
        return None
    vr = program.range_constraints.get(expr)
    if vr is None:
        return None
    lower = int(vr.lower)
    upper = vr.upper
    return lower, (int(upper) if upper.is_finite else None)


def _check_against_program(program: torch.export.ExportedProgram, flat: Sequence[Any]) -> None:
    """Tensor inputs vs the program's tensor placeholders: static dims equal, dynamic dims in range.

    Non-tensor inputs the program specialised on (a Python int, float, bool, str) must
    have the value it was exported with: torch would only fail an assert in its guards.
    """
    from torch.export.graph_signature import ConstantArgument, InputKind

    specs = [s for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    if len(specs) == len(flat):
        for spec, value in zip(specs, flat):
            if isinstance(spec.arg, ConstantArgument) and not isinstance(value, torch.Tensor):
                want = spec.arg.value
                if type(value) is not type(want) or not (value is want or value == want):
                    raise SpecViolationError(
                        f"got {value!r}; the program was exported with {want!r} there: a Python "
                        f"{type(want).__name__} argument is a constant of the program, not an input",
                        where=f"input {spec.arg.name!r}",
                        hint="pass a tensor there (a 0-d tensor for a step count) to make it an input, "
                        "or compile once per value",
                    )
    user_inputs = set(program.graph_signature.user_inputs)
    placeholders = [
        n for n in program.graph.nodes
        if n.op == "placeholder" and n.name in user_inputs and isinstance(n.meta.get("val"), torch.Tensor)
    ]
    tensors = [x for x in flat if isinstance(x, torch.Tensor)]
    if len(placeholders) != len(tensors):
        raise SpecViolationError(
            f"expected {len(placeholders)} tensor inputs, got {len(tensors)}", where="compiled program call"
        )
    for node, x in zip(placeholders, tensors):
        val = node.meta["val"]
        if x.dim() != val.dim() or x.dtype != val.dtype:
            raise SpecViolationError(
                f"got {x.dtype} of {x.dim()} dims {tuple(x.shape)}, the program was exported for {val.dtype} of "
                f"{val.dim()} dims",
                where=f"input {node.name!r}",
            )
        for d, (want, got) in enumerate(zip(val.shape, x.shape)):
            if isinstance(want, int):
                if want != got:
                    raise SpecViolationError(
                        f"dim {d} has size {got}; the program was exported with size {want} there (a static dim)",
                        where=f"input {node.name!r}",
                        hint="declare the dim dynamic with @dynamic_spec / ShapeVar",
                    )
                continue
            bounds = _symbol_range(program, want)
            if bounds is not None and not (bounds[0] <= got and (bounds[1] is None or got <= bounds[1])):
                raise SpecViolationError(
                    f"dim {d} has size {got}, outside {bounds[0]} <= {want} <= {bounds[1]}",
                    where=f"input {node.name!r}",
                )


def _resized_args(spec: Any, fn: Any, args: tuple, sizes: Mapping[str, int]) -> tuple:
    """``args`` with every dim of the spec's vars in ``sizes`` resized (example data repeated along it).

    The containers holding a resized tensor (dicts, lists, tuples) are copies: the caller's
    example inputs stay as they were.
    """
    from branchyard.shapes.shape_var import DimExpr
    from branchyard.shapes.spec import ScalarEntry, TensorEntry
    from branchyard.shapes.validation import bind

    binding = bind(spec, fn, args)
    values = {**binding.values, **sizes}
    arguments = binding.arguments.arguments

    def replaced(container: Any, keys: tuple, value: Any) -> Any:
        # a copy of the container with the leaf at ``keys`` replaced: the caller's dicts,
        # lists and tuples (their example inputs) stay as they were
        if not keys:
            return value
        inner = replaced(container[keys[0]], keys[1:], value)
        if isinstance(container, tuple):
            items = (*container[: keys[0]], inner, *container[keys[0] + 1 :])
            return type(container)(*items) if hasattr(container, "_fields") else type(container)(items)
        copy = container.copy()
        copy[keys[0]] = inner
        return copy

    def put(keys: tuple, value: Any) -> None:
        arguments[keys[0]] = replaced(arguments[keys[0]], keys[1:], value)

    for leaf in binding.leaves:
        if isinstance(leaf.entry, ScalarEntry):
            if isinstance(leaf.entry.dim, DimExpr):
                put(leaf.keys, int(leaf.entry.dim.evaluate(values)))
            continue
        if not isinstance(leaf.entry, TensorEntry):
            continue
        t = leaf.value
        for d, dim in enumerate(leaf.entry.dims):
            if isinstance(dim, DimExpr):
                new = int(dim.evaluate(values))
                if new != t.shape[d]:
                    if t.shape[d] == 0:
                        t = t.new_zeros((*t.shape[:d], new, *t.shape[d + 1 :]))
                    else:
                        index = torch.arange(new, device=t.device) % t.shape[d]
                        t = t.index_select(d, index)
        put(leaf.keys, t)
    return tuple(binding.arguments.args)


# --------------------------------------------------------------------------- the compiled program
class CompiledProgram(torch.nn.Module):
    """What :func:`compile` returns: call it like the model.

    ``program`` is the exported program after the passes, ``report`` what each
    stage did; with ``cuda_graph=True`` each concrete input shape gets its own
    capture (:attr:`captures`), kept in a least-recently-used cache of
    ``max_captures`` graphs that share one memory pool.
    """

    def __init__(
        self,
        program: torch.export.ExportedProgram,
        report: CompileReport,
        *,
        model: Any,
        spec: Any,
        cuda_graph: bool,
        max_captures: int,
        graph_options: dict[str, Any],
    ) -> None:
        super().__init__()
        self.program = program
        self.report = report
        self.spec = spec
        self._model = model
        self._use_cuda_graph = cuda_graph
        self.max_captures = max_captures
        self._graph_options = graph_options
        self._gm = program.module()
        self.inductor_regions = 0
        if graph_options.pop("inductor", False):
            from branchyard.fx.graph_walk import copy_graph_module
            from branchyard.lowering.cuda_graph.inductor_regions import fuse_regions

            start = time.perf_counter()
            # ``program.module()`` shares its control-flow bodies with ``program``: fuse regions
            # in a copy of the graphs (same tensors), so the program (the caller's, when an
            # ExportedProgram is given) keeps its ATen graph.
            self._gm = copy_graph_module(self._gm, share_tensors=True)
            self.inductor_regions = fuse_regions(self._gm)
            report.stages.append(
                StageRecord(
                    "inductor", "ran" if self.inductor_regions else "unchanged", time.perf_counter() - start,
                    f"{self.inductor_regions} region(s) of plain ATen ops become Inductor kernels (compiled at warm-up)",
                )
            )
        self.captures: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
        self._pool: Any = None
        self._sig_fn = model if not isinstance(model, torch.export.ExportedProgram) else None
        attached = getattr(program, "branchyard_shapes", None)
        if self._sig_fn is None and attached is not None:
            self._sig_fn = _SignatureOnly(attached[1])

    # -- checks ---------------------------------------------------------------------
    def check_inputs(self, args: tuple) -> None:
        """Raise :class:`~branchyard.errors.SpecViolationError` if ``args`` are outside the spec / program."""
        if self.spec is not None and self._sig_fn is not None:
            self.spec.validate(self._sig_fn, *args)
        _check_against_program(self.program, pytree.tree_leaves(args))

    # -- captures -------------------------------------------------------------------
    def _capture(self, key: tuple, flat: list[Any]) -> Any:
        from branchyard.lowering.cuda_graph.capture import CudaGraphModule

        if self._pool is None and _cuda_available():
            self._pool = _new_pool()
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lowered = CudaGraphModule(self._gm, flat, pool=self._pool, **self._graph_options)
        for w in caught:  # say each fallback once, as the lowering does, under our name
            if lowered.lowered or str(w.message) not in self.report.fallbacks:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        record = CaptureRecord(
            _describe_key(key), time.perf_counter() - start, lowered.lowered, lowered.fallback_reason,
            dict(lowered.conditional_nodes),
            getattr(getattr(lowered, "graph_nodes", None), "total", None),
        )
        self.report.captures.append(record)
        if not lowered.lowered:
            self.report.fallbacks.append(f"{record.shapes}: eager: {lowered.fallback_reason}")
        self.captures[key] = lowered
        while len(self.captures) > self.max_captures:
            self.captures.popitem(last=False)
            self.report.cache_evictions += 1
        return lowered

    def capture(self, *args: Any) -> None:
        """Capture for these inputs now (before the first call with their shapes)."""
        self.check_inputs(args)
        flat = pytree.tree_leaves(args)
        key = _shape_key(flat)
        if key not in self.captures:
            self._capture(key, flat)

    def capture_sizes(self, sizes: Sequence[int] | Mapping[str, Sequence[int]], example_args: tuple) -> None:
        """Capture ahead of time for each size of the spec's var(s) (``[1, 2, 4]`` names the first var)."""
        if self.spec is None or self._sig_fn is None:
            raise ShapeSpecError(
                "capture_sizes needs a dynamic_spec: the sizes are values of its ShapeVars",
                where="branchyard.compile",
                hint="decorate the model with @dynamic_spec or pass spec=",
            )
        if not isinstance(sizes, Mapping):
            names = list(self.spec.vars)
            if not names:
                raise ShapeSpecError("the spec declares no ShapeVar to size", where="capture_sizes")
            sizes = {names[0]: list(sizes)}
        for name, values in sizes.items():
            if name not in self.spec.vars:
                raise ShapeSpecError(f"no ShapeVar {name!r} in the spec (it has {sorted(self.spec.vars)})", where="capture_sizes")
            for size in values:
                self.capture(*_resized_args(self.spec, self._sig_fn, tuple(example_args), {name: int(size)}))

    # -- calls ----------------------------------------------------------------------
    def forward(self, *args: Any) -> Any:
        self.check_inputs(args)
        if not self._use_cuda_graph:
            return self._gm(*args)
        flat = pytree.tree_leaves(args)
        key = _shape_key(flat)
        lowered = self.captures.get(key)
        if lowered is None:
            lowered = self._capture(key, flat)
        else:
            self.captures.move_to_end(key)
            self.report.cache_hits += 1
        return lowered(*flat)


class _SignatureOnly:
    """Stands in for the original model when only its signature is known (a program from shapes.export)."""

    def __init__(self, sig: Any):
        self.__signature__ = sig

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - never called
        raise TypeError("signature only")


# --------------------------------------------------------------------------- the entry point
def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _new_pool() -> Any:
    """One memory pool for every capture of a compiled program."""
    return torch.cuda.graph_pool_handle()


def _fallback_warning() -> type[Warning]:
    from branchyard.lowering.cuda_graph.capture import CudaGraphFallbackWarning

    return CudaGraphFallbackWarning


def compile(
    model: Any,
    example_inputs: Sequence[Any],
    *,
    passes: Sequence[str] = DEFAULT_PASSES,
    cuda_graph: bool = True,
    spec: Any = None,
    capture_sizes: Sequence[int] | Mapping[str, Sequence[int]] | None = None,
    max_captures: int = 16,
    max_iterations: int | None = None,
    clone_outputs: bool = True,
    inductor: bool = False,
) -> CompiledProgram:
    """Export ``model``, run ``passes`` on it and lower it to CUDA graphs, in one step.

    ``model``: an ``nn.Module`` or function (with ``@dynamic_spec`` for dynamic
    dims, or ``spec=``), or an ``ExportedProgram``. ``passes``: names from
    ``branchyard passes`` (``cond_to_switch`` needs torch >= 2.14 and is skipped,
    with the reason in the report, elsewhere). ``cuda_graph=True`` captures one
    CUDA graph per concrete input shape on first use (``capture_sizes`` captures
    sizes of the spec's vars ahead of time), keeping at most ``max_captures``.
    ``max_iterations`` and ``clone_outputs`` are those of
    :func:`branchyard.lowering.cuda_graph.cuda_graph`. ``inductor=True`` compiles
    the runs of plain ATen ops in every body with Inductor before capture
    (:mod:`branchyard.lowering.cuda_graph.inductor_regions`): fewer graph nodes
    per step. The example inputs are captured at compile time, so lowering
    errors surface here.
    """
    if not isinstance(max_captures, int) or max_captures < 1:
        raise BranchyardError(f"max_captures must be a positive int, got {max_captures!r}", where="branchyard.compile")
    if isinstance(passes, str):
        passes = (passes,)
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    report = CompileReport()

    start = time.perf_counter()
    program, spec, how = _export(model, args, spec)
    report.stages.append(StageRecord("export", "ran", time.perf_counter() - start, how))
    for name in passes:
        program = _run_pass(name, program, report, cuda_graph=cuda_graph and _cuda_available())
    if spec is not None and getattr(program, "branchyard_shapes", None) is None:
        attached = getattr(model, "branchyard_shapes", None) if isinstance(model, torch.export.ExportedProgram) else None
        if attached is not None:
            program.branchyard_shapes = attached  # type: ignore[attr-defined]

    options = {"max_iterations": max_iterations, "clone_outputs": clone_outputs, "inductor": inductor}
    compiled = CompiledProgram(
        program, report, model=model, spec=spec, cuda_graph=cuda_graph, max_captures=max_captures, graph_options=options
    )
    if not cuda_graph:
        report.stages.append(StageRecord("cuda_graph", "skipped", 0.0, "cuda_graph=False"))
        return compiled
    if not _cuda_available():
        from branchyard.lowering.cuda_graph import analyze

        analyze(compiled._gm, pytree.tree_leaves(args))  # what would stop a capture is an error on any machine
        reason = "torch.cuda.is_available() is False (no CUDA device): calls run the program eagerly"
        warnings.warn(f"branchyard.compile: {reason}", _fallback_warning(), stacklevel=2)
        report.stages.append(StageRecord("cuda_graph", "skipped", 0.0, reason))
        report.fallbacks.append(f"cuda_graph: {reason}")
        compiled.check_inputs(args)
        compiled._use_cuda_graph = False
        return compiled
    start = time.perf_counter()
    compiled.capture(*args)
    if capture_sizes:
        compiled.capture_sizes(capture_sizes, args)
    lowered = sum(c.lowered for c in report.captures)
    status = "ran" if lowered else "skipped"
    detail = f"{lowered} of {len(report.captures)} capture(s) replay as CUDA graphs"
    if not lowered and report.captures:
        detail += f"; eager because {report.captures[0].reason}"
    report.stages.append(StageRecord("cuda_graph", status, time.perf_counter() - start, detail))
    return compiled


# --------------------------------------------------------------------------- torch.compile backend
def branchyard_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **options: Any) -> Callable[..., Any]:
    """``torch.compile(model, backend="branchyard")``: each Dynamo graph through :func:`compile`.

    Dynamo may hand fake example inputs, so the graph is exported and compiled
    on its first call per input shape (with the real arguments); ``options``
    are :func:`compile`'s keyword arguments (pass them with ``functools.partial``
    or ``torch.compile(..., options=...)``).
    """
    compiled: collections.OrderedDict[tuple, CompiledProgram] = collections.OrderedDict()
    limit = int(options.get("max_captures", 16))

    def run(*args: Any) -> Any:
        key = _shape_key(args)
        program = compiled.get(key)
        if program is None:
            program = compile(gm, args, **{**options, "max_captures": 1})
            compiled[key] = program
            while len(compiled) > limit:
                compiled.popitem(last=False)
        else:
            compiled.move_to_end(key)
        return program(*args)

    run.compiled = compiled  # type: ignore[attr-defined]
    return run


def _register_backend() -> None:
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "branchyard" not in _BACKENDS:
        register_backend(name="branchyard")(branchyard_backend)


_register_backend()
