"""Check that two programs agree on every control-flow path.

:func:`assert_equivalent` is the tool for unit-testing a graph transform
(yours or ours): give it the program before and after the transform and one
set of example inputs. It

1. finds every control decision of ``before`` *and* of ``after`` -- each
   ``cond`` predicate and each ``switch`` index, at any nesting depth -- and
   the graph inputs each one depends on (a backward slice that follows branch
   operands out to the top-level inputs), together with the constants the
   decision compares against (both programs' boundaries are probed, so a
   threshold that moved, ``x > 0`` -> ``x > 0.1``, is driven at both values);
2. drives those inputs: a 0-d bool takes both values; a 0-d integer takes
   every compared constant and its neighbours, every switch index, ``-1``,
   ``n`` and far out-of-range values; a float tensor takes sign flips, scaled
   copies and the compared constants; other inputs keep their example values.
   Explicit ``input_sets`` are run as well;
3. runs both programs on every input set under a recording
   ``torch.fx.Interpreter`` that notes the branch each ``cond``/``switch``
   took (and whether a switch index was clamped), and compares the outputs;
4. checks coverage: every branch of every ``cond``/``switch`` of ``before``
   reached, and for a switch whose index is clamped, an index below and one
   above the range seen. A branch never driven is an error, not a pass.

Semantics as code -- what "equivalent" means here::

    for inputs in driven_input_sets(before, example_inputs) + input_sets:
        try:
            expected, path_b = run_recording(before, inputs)
        except Exception:
            continue                      # before is undefined there
        actual, path_a = run_recording(after, inputs)   # must not raise
        assert allclose(flat(actual), flat(expected), rtol, atol)
    assert every branch of before was on some path_b

A minimal use::

    >>> import torch
    >>> from branchyard.testing import assert_equivalent
    >>> class M(torch.nn.Module):
    ...     def forward(self, flag, x):
    ...         return torch.cond(flag, lambda t: t + 1, lambda t: t - 1, (x,))
    >>> ep = torch.export.export(M(), (torch.tensor(True), torch.randn(3)))
    >>> report = assert_equivalent(ep, lambda flag, x: x + 1 if flag else x - 1,
    ...                            (torch.tensor(True), torch.randn(3)))
    >>> report.covered == report.required
    True
    >>> sorted(report.required)
    [('cond', 'false'), ('cond', 'true')]
"""

from __future__ import annotations

import itertools
import math
import operator
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.fx import GraphModule, Interpreter, Node

from branchyard.errors import BranchyardError, EquivalenceError
from branchyard.fx.control_flow import COND, SWITCH, TABLE, is_cond, is_switch, walk_control_flow

__all__ = [
    "Decision",
    "ControlSite",
    "EquivalenceReport",
    "IncompleteCoverageError",
    "assert_equivalent",
    "find_control_sites",
    "run_recording",
    "format_path",
]

_CLAMPS = {torch.ops.aten.clamp.default, torch.ops.aten.clamp.Tensor} if hasattr(torch.ops.aten, "clamp") else set()
#: Far out-of-range switch indices to try (before dtype limits are applied).
_FAR = 1 << 20


class IncompleteCoverageError(EquivalenceError):
    """Some branch of ``before`` was never driven, so equivalence is unproven there."""


# ---------------------------------------------------------------------------
# paths
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    """One control decision on a path: the site (``cond``/``switch`` node,
    nested sites are ``outer[branch]/inner``), the branch taken (``"true"``,
    ``"false"`` or the switch branch number as text) and, for a switch whose
    index was clamped, the raw index before clamping."""

    site: str
    kind: str
    branch: str
    raw_index: int | None = None

    def __str__(self) -> str:
        if self.raw_index is None:
            return f"{self.site} -> {self.branch}"
        return f"{self.site} -> {self.branch} (index {self.raw_index} clamped)"


Path = tuple  # tuple[Decision, ...]


def format_path(path: Path | None) -> str:
    """A path as readable text."""
    if path is None:
        return "(not recorded: opaque callable)"
    if not path:
        return "(no control flow)"
    return ", ".join(str(d) for d in path)


# ---------------------------------------------------------------------------
# static analysis: control sites and the inputs that drive them
# ---------------------------------------------------------------------------


@dataclass
class ControlSite:
    """A ``cond`` or ``switch`` of a program, at any depth.

    ``labels`` are the branches it must take for full coverage (``"true"``,
    ``"false"``; ``"0"`` .. ``"n-1"``, plus ``"below range"``/``"above range"``
    when the switch index comes from a clamp); ``inputs`` the top-level
    placeholder positions its decision depends on; ``constants`` the numbers
    the decision is computed with.
    """

    site: str
    kind: str
    node: Node
    labels: list[str]
    inputs: set[int] = field(default_factory=set)
    constants: set[float] = field(default_factory=set)
    thresholds: set[float] = field(default_factory=set)
    num_branches: int = 2


def _operands(node: Node) -> Sequence:
    return TABLE["cond" if is_cond(node) else "switch"].operands(node)


def _is_control(node: Node) -> bool:
    return is_cond(node) or is_switch(node)


def _clamp_source(node: Node) -> Node | None:
    """The raw index feeding a switch through ``clamp(raw, 0, n - 1)``, if any."""
    index = node.args[0]
    if isinstance(index, Node) and index.op == "call_function" and index.target in _CLAMPS:
        src = index.args[0]
        return src if isinstance(src, Node) else None
    return None


def _numbers(args: Any) -> Iterable[float]:
    for leaf in pytree.tree_leaves(args):
        if isinstance(leaf, (int, float)) and not isinstance(leaf, bool) and math.isfinite(leaf):
            yield leaf


#: Comparisons whose scalar operand is a threshold worth driving a float input to.
_COMPARISONS = {
    getattr(torch.ops.aten, name).Scalar for name in ("eq", "ne", "lt", "le", "gt", "ge")
} | {operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge}


def _slice(start: Any, chain: tuple) -> tuple[set[int], set[float], set[float]]:
    """Top-level placeholder positions, constants and comparison thresholds
    the value ``start`` depends on. ``chain`` is (hop node, parent chain)
    leading from the graph of ``start`` out to the top-level graph: a
    placeholder of a branch continues at the matching operand of its hop."""
    inputs: set[int] = set()
    consts: set[float] = set()
    thresholds: set[float] = set()
    seen: set[tuple[int, int]] = set()
    work = [(start, chain)] if isinstance(start, Node) else []
    while work:
        node, ch = work.pop()
        key = (id(node), id(ch))
        if key in seen:
            continue
        seen.add(key)
        if node.op == "placeholder":
            pos = [n for n in node.graph.nodes if n.op == "placeholder"].index(node)
            if not ch:
                inputs.add(pos)
                continue
            hop, parent = ch
            ops = _operands(hop)
            if pos < len(ops) and isinstance(ops[pos], Node):
                work.append((ops[pos], parent))
            continue
        numbers = set(_numbers((node.args, node.kwargs)))
        consts |= numbers
        if node.target in _COMPARISONS:
            thresholds |= numbers
        work.extend((n, ch) for n in node.all_input_nodes if n.op != "get_attr")
    return inputs, consts, thresholds


def find_control_sites(gm: GraphModule) -> list[ControlSite]:
    """Every ``cond``/``switch`` in ``gm`` and its branches, depth first."""
    sites: list[ControlSite] = []
    for nested in walk_control_flow(gm, kinds=("cond", "switch")):
        node = nested.node
        labels = [label for label, _ in nested.op.branch_args(node)]
        num_branches = len(labels)
        decision = node.args[0]
        if nested.op.name == "switch":
            raw = _clamp_source(node)
            if raw is not None:
                labels += ["below range", "above range"]
                decision = raw
        chain: tuple = ()
        for hop, _ in nested.path:
            chain = (hop, chain)
        inputs, consts, thresholds = _slice(decision, chain)
        sites.append(ControlSite(nested.site, nested.op.name, node, labels, inputs, consts, thresholds, num_branches))
    return sites


# ---------------------------------------------------------------------------
# dynamic: run under a recording interpreter
# ---------------------------------------------------------------------------


class _Recorder(Interpreter):
    """Runs a graph like ``torch.fx.Interpreter`` and appends a
    :class:`Decision` to ``path`` at every cond/switch, nested ones included."""

    def __init__(self, gm: GraphModule, path: list, prefix: str = "") -> None:
        # Keep every value: a clamped switch index's raw value is read after
        # its last ordinary use.
        super().__init__(gm, garbage_collect_values=False)
        self.path = path
        self.prefix = prefix

    def run_node(self, n: Node) -> Any:
        if _is_control(n):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            return _HANDLERS[n.target](self, n, *args, **kwargs)
        return super().run_node(n)

    def run_branch(self, site: str, label: str, branch: GraphModule, operands: Sequence) -> Any:
        return _Recorder(branch, self.path, f"{site}[{label}]/").run(*operands, enable_io_processing=False)


def _run_cond(rec: _Recorder, node: Node, pred: Any, true_fn: GraphModule, false_fn: GraphModule,
              operands: Sequence) -> Any:
    take = bool(pred.item() if isinstance(pred, torch.Tensor) else pred)
    label = "true" if take else "false"
    site = f"{rec.prefix}{node.name}"
    rec.path.append(Decision(site, "cond", label))
    return rec.run_branch(site, label, true_fn if take else false_fn, operands)


def _run_switch(rec: _Recorder, node: Node, index: Any, branches: Sequence[GraphModule], operands: Sequence) -> Any:
    i = int(index.item() if isinstance(index, torch.Tensor) else index)
    site = f"{rec.prefix}{node.name}"
    if not 0 <= i < len(branches):
        # Same contract as the switch HOP itself: callers clamp first.
        raise IndexError(f"switch {site!r}: index {i} out of range for {len(branches)} branches")
    raw_node = _clamp_source(node)
    raw = None
    if raw_node is not None:
        value = rec.env[raw_node]
        raw_i = int(value.item() if isinstance(value, torch.Tensor) else value)
        raw = raw_i if raw_i != i else None
    rec.path.append(Decision(site, "switch", str(i), raw))
    return rec.run_branch(site, str(i), branches[i], operands)


#: How each control-flow operator is run and recorded (one row per operator).
_HANDLERS: dict[Any, Callable[..., Any]] = {COND: _run_cond}
if SWITCH is not None:
    _HANDLERS[SWITCH] = _run_switch


def run_recording(gm: GraphModule, *args: Any) -> tuple[Any, Path]:
    """Run ``gm`` on ``args``; return its outputs and the path it took."""
    path: list[Decision] = []
    out = _Recorder(gm, path).run(*args)
    return out, tuple(path)


def _covered_labels(path: Path) -> Iterable[tuple[str, str]]:
    for d in path:
        yield (d.site, d.branch)
        if d.raw_index is not None:
            yield (d.site, "below range" if d.raw_index < int(d.branch) else "above range")


# ---------------------------------------------------------------------------
# programs under test
# ---------------------------------------------------------------------------


@dataclass
class _Program:
    role: str
    call: Callable[..., Any]
    gm: GraphModule | None

    def run(self, args: tuple) -> tuple[Any, Path | None]:
        if self.gm is None:
            return self.call(*args), None
        return run_recording(self.gm, *args)


def _module_state(obj: Any) -> list[torch.Tensor]:
    """The tensors a call of ``obj`` may update in place: the buffers and
    tensor constants (plain tensor attributes) of every submodule. Parameters
    are left out: export does not allow a forward to mutate one, and a
    training step updates them outside the call."""
    if not isinstance(obj, torch.nn.Module):
        return []
    out = list(obj.buffers())
    for mod in obj.modules():
        out += [v for v in vars(mod).values() if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter)]
    return out


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter
        return None


class _Snapshot:
    """Copies of ``tensors`` as found, to put back after every run, so that
    each run of either program starts from the same state (two programs that
    share a buffer would otherwise each advance it, and a program that
    updates an input would feed the next run a changed one). Only tensors
    whose version counter moved are copied back."""

    def __init__(self, tensors: Iterable[Any]) -> None:
        unique = {id(t): t for t in tensors if isinstance(t, torch.Tensor)}
        self._saved = [[t, t.detach().clone(), _version(t)] for t in unique.values()]

    def restore(self) -> None:
        with torch.no_grad():
            for entry in self._saved:
                t, saved, version = entry
                now = _version(t)
                if now is not None and now == version:
                    continue
                if t.shape != saved.shape:
                    t.resize_(saved.shape)
                t.copy_(saved)
                entry[2] = _version(t)


def _detached(value: Any) -> Any:
    """``value`` with every tensor copied: an output may alias state that is restored next."""
    return pytree.tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, value)


def _as_program(role: str, obj: Any) -> _Program:
    if isinstance(obj, ExportedProgram):
        gm = obj.module()
        return _Program(role, gm, gm)
    if isinstance(obj, GraphModule):
        return _Program(role, obj, obj)
    if callable(obj):
        return _Program(role, obj, None)
    raise BranchyardError(
        f"`{role}` must be an ExportedProgram, GraphModule, nn.Module or callable, got {type(obj).__name__}",
        where=f"argument {role!r}",
    )


# ---------------------------------------------------------------------------
# input driving
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Variant:
    label: str
    value: Any


def _int_range(dtype: torch.dtype) -> tuple[int, int]:
    info = torch.iinfo(dtype)
    return info.min, info.max


def _variants(v: Any, consts: set[float], thresholds: set[float],
              switch_sizes: set[int]) -> tuple[list[_Variant], list[_Variant]]:
    """(core, extended) variants of one control input's example value ``v``.

    Integers: every constant of the decision's slice (an index is shifted,
    clamped or wrapped by them), both neighbours of every comparison
    threshold, every switch index, -1, n, two and three past the smallest
    and largest of those, and far out of range. Floats: sign
    flips, the comparison thresholds and +-0.5 around them; scaled copies
    and zeros as the extension."""
    if not isinstance(v, torch.Tensor):
        return [_Variant(repr(v), v)], []
    if v.dtype == torch.bool:
        if v.numel() == 1:
            return [_Variant(str(b), torch.full_like(v, b)) for b in (False, True)], []
        return [_Variant("x", v), _Variant("~x", ~v), _Variant("all True", torch.ones_like(v)),
                _Variant("all False", torch.zeros_like(v))], []
    if not v.is_floating_point() and not v.is_complex():
        lo, hi = _int_range(v.dtype)
        if v.numel() == 1:
            ints = {int(v.item())}
            for c in consts:  # offsets, clamp bounds, moduli: the value itself
                ints.update({math.floor(c), math.ceil(c)})
            for c in thresholds:  # compared against: both sides of it too
                ints.update({math.floor(c) - 1, math.floor(c), math.ceil(c), math.ceil(c) + 1})
            for n in switch_sizes:
                ints.update(range(-1, n + 1))
            # Out of range by a little (catches an index wrapped by a modulus
            # instead of clamped) and by a lot.
            ints.update({min(ints) - 2, min(ints) - 3, max(ints) + 2, max(ints) + 3, -_FAR, _FAR})
            ints = sorted(i for i in ints if lo <= i <= hi)
            return [_Variant(str(i), torch.full_like(v, i)) for i in ints], []
        core = [_Variant("x", v), _Variant("-x", -v if lo < 0 else v), _Variant("zeros", torch.zeros_like(v)),
                _Variant("x+1", v + 1)]
        return core, [_Variant("x*3", v * 3)]
    core = [_Variant("x", v), _Variant("-x", -v)]
    for c in sorted(thresholds)[:8]:
        for d in (-0.5, 0.0, 0.5):
            core.append(_Variant(f"all {c + d:g}", torch.full_like(v, c + d)))
    ext = [_Variant("x*3", v * 3), _Variant("x*-3", v * -3), _Variant("x/3", v / 3), _Variant("x/-3", v / -3),
           _Variant("zeros", torch.zeros_like(v))]
    return core, ext


def _combinations(choices: list[list[_Variant]], limit: int, rng: random.Random,
                  skip: set[tuple[str, ...]]) -> list[tuple[_Variant, ...]]:
    """All combinations if there are at most ``limit``; else a sample that
    still uses every variant of every input at least once."""
    total = math.prod(len(c) for c in choices)
    if total <= limit:
        combos = list(itertools.product(*choices))
    else:
        width = max(len(c) for c in choices)
        combos = [tuple(c[(r + k) % len(c)] for k, c in enumerate(choices)) for r in range(width)]
        while len(combos) < limit:
            combos.append(tuple(rng.choice(c) for c in choices))
    out, seen = [], set(skip)
    for combo in combos:
        key = tuple(v.label for v in combo)
        if key not in seen:
            seen.add(key)
            out.append(combo)
    return out


def _search_order(choices: list[list[_Variant]], limit: int, rng: random.Random) -> Iterable[tuple[_Variant, ...]]:
    """Up to ``limit`` combinations in random order: all of them shuffled when
    they fit, else independent random draws. Random order finds a rare
    combination far sooner than walking the product lexicographically."""
    total = math.prod(len(c) for c in choices)
    if total <= limit:
        combos = list(itertools.product(*choices))
        rng.shuffle(combos)
        yield from combos
        return
    for _ in range(limit):
        yield tuple(rng.choice(c) for c in choices)


# ---------------------------------------------------------------------------
# comparison
# ---------------------------------------------------------------------------

#: How many of a decision's inputs the guided search changes at once, in turn.
_GUIDED_RADII = (1, 2, 3)


def _first_difference(expected: list, actual: list, rtol: float, atol: float) -> str | None:
    if len(expected) != len(actual):
        return f"before returned {len(expected)} outputs, after returned {len(actual)}"
    for k, (e, a) in enumerate(zip(expected, actual)):
        if isinstance(e, torch.Tensor) != isinstance(a, torch.Tensor):
            return f"output {k}: before gave {type(e).__name__}, after gave {type(a).__name__}"
        if not isinstance(e, torch.Tensor):
            if e != a:
                return f"output {k}: before {e!r}, after {a!r}"
            continue
        if e.shape != a.shape:
            return f"output {k}: shape {list(e.shape)} in before, {list(a.shape)} in after"
        if e.dtype != a.dtype:
            return f"output {k}: dtype {e.dtype} in before, {a.dtype} in after"
        if torch.allclose(a.detach(), e.detach(), rtol=rtol, atol=atol, equal_nan=True) if e.is_floating_point() \
                or e.is_complex() else torch.equal(a, e):
            continue
        diff = (a.detach().double() - e.detach().double()).abs()
        diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
        worst = int(diff.flatten().argmax())
        return (f"output {k} (shape {list(e.shape)}, {e.dtype}): max abs diff {diff.max().item():.6g} "
                f"at flat position {worst} (before {e.flatten()[worst].item():.6g}, "
                f"after {a.flatten()[worst].item():.6g})")
    return None


# ---------------------------------------------------------------------------
# report and entry point
# ---------------------------------------------------------------------------


@dataclass
class EquivalenceReport:
    """What :func:`assert_equivalent` ran and covered.

    ``required``/``covered``: (site, branch) pairs of the reference program;
    ``paths_before``/``paths_after``: each distinct path and how many input
    sets took it; ``skipped``: input sets on which ``before`` itself raised.
    """

    input_sets: int
    required: set[tuple[str, str]]
    covered: set[tuple[str, str]]
    paths_before: Counter
    paths_after: Counter
    skipped: list[str]
    reference: str

    def __str__(self) -> str:
        lines = [
            f"{self.input_sets} input sets compared ({len(self.skipped)} skipped: before raised)",
            f"coverage of {self.reference}: {len(self.covered & self.required)}/{len(self.required)} branches",
            f"{len(self.paths_before)} distinct paths in before, {len(self.paths_after)} in after",
        ]
        return "\n".join(lines)


#: How a driven input was made from the example value, in words (variant label -> text).
_MADE_FROM = {
    "x": "the example value",
    "-x": "the example value negated",
    "~x": "the example value inverted",
    "x+1": "the example value plus 1",
    "x*3": "the example value times 3",
    "x*-3": "the example value times -3",
    "x/3": "the example value divided by 3",
    "x/-3": "the example value divided by -3",
    "zeros": "all zeros",
}


def show_value(value: Any, *, max_elements: int = 8) -> str:
    """A value as a person reads it: a number, a small tensor's elements, or a
    large tensor's dtype, shape and range."""
    if not isinstance(value, torch.Tensor):
        return repr(value)
    if value.numel() == 1 and value.dim() == 0:
        return repr(value.item())
    if value.numel() <= max_elements:
        items = value.detach().flatten().tolist()
        text = ", ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in items)
        shape = "" if value.dim() == 1 else f" shape {list(value.shape)}"
        return f"[{text}]{shape}"
    if value.numel() == 0:
        return f"empty {str(value.dtype).removeprefix('torch.')} tensor of shape {list(value.shape)}"
    flat = value.detach().flatten()
    if value.dtype == torch.bool:
        spread = f"{int(flat.sum())} True"
    else:
        spread = f"min {flat.min().item():.4g}, max {flat.max().item():.4g}"
    return f"{str(value.dtype).removeprefix('torch.')} tensor of shape {list(value.shape)} ({spread})"


def _describe(names: list[str], choice: dict[int, _Variant]) -> str:
    """``idx = 3; x = [-0.5, 1.25] (the example value negated)``: each driven
    input's value, and how it was made where that says more than the value."""
    parts = []
    for i, v in sorted(choice.items()):
        how = _MADE_FROM.get(v.label)
        if how is None and v.label.startswith("all ") and isinstance(v.value, torch.Tensor) and v.value.numel() > 1:
            how = f"every element {v.label[4:]}"
        text = f"{names[i]} = {show_value(v.value)}"
        parts.append(f"{text} ({how})" if how and v.label != "x" else text)
    return "; ".join(parts) or "the example inputs"


def assert_equivalent(
    before: Any,
    after: Any,
    example_inputs: Sequence[Any],
    *,
    input_sets: Iterable[Sequence[Any]] = (),
    rtol: float = 1.3e-6,
    atol: float = 1e-5,
    check_coverage: bool = True,
    max_input_sets: int = 512,
    max_search: int = 20_000,
    seed: int = 0,
) -> EquivalenceReport:
    """Assert that ``after`` computes what ``before`` computes on every path.

    ``before``/``after``: an ``ExportedProgram``, a ``GraphModule``, an
    ``nn.Module`` or any callable. Control decisions are found in ``before``
    when it is a graph (ExportedProgram or GraphModule), else in ``after``;
    paths are recorded for every graph argument. ``example_inputs`` is the
    positional argument tuple; inputs that feed no decision keep these values.
    ``input_sets``: extra argument tuples to compare on as well.
    ``max_input_sets`` caps the first round of driven combinations (beyond
    it they are sampled, every value of every control input still used);
    while a branch stays undriven, up to ``max_search`` further combinations
    (scaled copies included) are tried until it is reached: first input sets
    that already reach the branch's cond or switch, with one, two, then
    three of the inputs its decision reads changed, then random ones.

    Raises :class:`~branchyard.errors.EquivalenceError` on the first
    disagreement, naming the inputs, the path each program took and the first
    differing output; :class:`IncompleteCoverageError` when a branch of the
    reference program was never driven (pass ``input_sets`` that reach it, or
    ``check_coverage=False``). Returns an :class:`EquivalenceReport`.
    """
    example = tuple(example_inputs)
    progs = {"before": _as_program("before", before), "after": _as_program("after", after)}
    ref = progs["before"] if progs["before"].gm is not None else progs["after"]
    sites = find_control_sites(ref.gm) if ref.gm is not None else []
    flat, spec = pytree.tree_flatten(example)
    placeholders = [n for n in ref.gm.graph.nodes if n.op == "placeholder"] if ref.gm is not None else []
    names = [n.name for n in placeholders] + [f"input{k}" for k in range(len(placeholders), len(flat))]
    if ref.gm is not None and len(placeholders) != len(flat):
        raise BranchyardError(
            f"{ref.role} takes {len(placeholders)} flat inputs but example_inputs flatten to {len(flat)}",
            where="argument 'example_inputs'",
            hint="pass the positional arguments the program is called with",
        )

    # Inputs are driven at the decisions of both programs: a threshold that
    # after moved (x > 0 became x > 0.1) is probed at both values, where the
    # reference's own boundaries alone would pass it with full coverage.
    probed = list(sites)
    other = progs["after"] if ref is progs["before"] else progs["before"]
    if other.gm is not None and other is not ref:
        if len([n for n in other.gm.graph.nodes if n.op == "placeholder"]) == len(flat):
            probed += find_control_sites(other.gm)
    control: dict[int, tuple[set[float], set[float], set[int]]] = {}
    for s in probed:
        for i in s.inputs:
            consts, thresholds, sizes = control.setdefault(i, (set(), set(), set()))
            consts.update(s.constants)
            thresholds.update(s.thresholds)
            if s.kind == "switch":
                sizes.add(s.num_branches)
    order = sorted(control)
    core_ext = [_variants(flat[i], *control[i]) for i in order]
    rng = random.Random(seed)

    required = {(s.site, label) for s in sites for label in s.labels}
    covered: set[tuple[str, str]] = set()
    paths = {"before": Counter(), "after": Counter()}
    skipped: list[str] = []
    runs = 0

    # Both programs run from the state found here (buffers and constants,
    # which a transformed program may share with its original) and leave it so.
    state = _Snapshot([*_module_state(before), *_module_state(progs["before"].call),
                       *_module_state(after), *_module_state(progs["after"].call)])

    def run(role: str, args: tuple) -> tuple[Any, Path | None]:
        inputs = _Snapshot(pytree.tree_leaves(args))
        try:
            out, path = progs[role].run(args)
            return _detached(out), path
        finally:
            state.restore()
            inputs.restore()

    def compare(args: tuple, what: str) -> Path | None:
        """Run both programs on ``args``; return the path the reference took."""
        nonlocal runs
        try:
            expected, path_b = run("before", args)
        except Exception as exc:  # before is undefined here (e.g. an index it cannot take)
            skipped.append(f"{what}: {type(exc).__name__}: {exc}")
            return None
        runs += 1
        try:
            actual, path_a = run("after", args)
        except Exception as exc:
            raise EquivalenceError(
                f"after raised {type(exc).__name__}: {exc}\n  inputs: {what}\n  before took: {format_path(path_b)}"
            ) from exc
        if path_b is not None:
            paths["before"][path_b] += 1
        if path_a is not None:
            paths["after"][path_a] += 1
        ref_path = path_b if ref is progs["before"] else path_a
        if ref_path is not None:
            covered.update(_covered_labels(ref_path))
        problem = _first_difference(pytree.tree_leaves(expected), pytree.tree_leaves(actual), rtol, atol)
        if problem is not None:
            err = EquivalenceError(
                f"programs disagree\n  inputs: {what}\n  before took: {format_path(path_b)}\n"
                f"  after took:  {format_path(path_a)}\n  first difference: {problem}"
            )
            err.path_before, err.path_after, err.difference = path_b, path_a, problem
            raise err
        return ref_path

    def run_combo(combo: tuple[_Variant, ...]) -> None:
        done.add(tuple(v.label for v in combo))
        leaves = list(flat)
        for i, v in zip(order, combo):
            leaves[i] = v.value
        path = compare(tuple(pytree.tree_unflatten(leaves, spec)), _describe(names, dict(zip(order, combo))))
        for site, label in _covered_labels(path or ()):
            reached.setdefault(site, {}).setdefault(label, combo)

    def neighbours(base: tuple[_Variant, ...], slots: list[int], radius: int) -> Iterator[tuple[_Variant, ...]]:
        """``base`` with exactly ``radius`` of ``slots`` changed, every way."""
        for chosen in itertools.combinations(slots, radius):
            for values in itertools.product(*(full[k] for k in chosen)):
                combo = list(base)
                for k, v in zip(chosen, values):
                    combo[k] = v
                yield tuple(combo)

    def guided(budget: int) -> int:
        """Drive each undriven branch from input sets that already reach its
        site (one per branch taken there): change one of the inputs its
        decision reads, every way, then two, then three. Returns the
        combinations run."""
        ran = 0
        for radius in _GUIDED_RADII:
            progress = True
            while progress and required - covered and ran < budget:
                progress = False
                for site, label in sorted(required - covered):
                    if (site, label) in covered or site not in reached:
                        continue
                    slots = [order.index(i) for i in sorted(by_site[site].inputs) if i in control]
                    if radius > len(slots):
                        continue
                    for combo in (c for base in list(reached[site].values()) for c in neighbours(base, slots, radius)):
                        if tuple(v.label for v in combo) in done:
                            continue
                        before_covered = len(covered)
                        run_combo(combo)
                        ran += 1
                        progress |= len(covered) > before_covered
                        if (site, label) in covered or ran >= budget:
                            break
        return ran

    done: set[tuple[str, ...]] = set()
    reached: dict[str, dict[str, tuple[_Variant, ...]]] = {}  # site -> branch -> an input set taking it
    by_site = {s.site: s for s in sites}
    full = [core + ext for core, ext in core_ext]
    if order:
        # Round 1: every combination of the core values (a covering sample
        # when there are too many).
        for combo in _combinations([core for core, _ in core_ext], max_input_sets, rng, done):
            run_combo(combo)
        # Round 2, only while some branch is still undriven: first from the
        # input sets that reach its site, varying what its decision reads;
        # then random combinations of core and extended values.
        spent = guided(max_search // 2) if required - covered else 0
        if required - covered:
            for combo in _search_order(full, max_search - spent, rng):
                if not required - covered:
                    break
                if tuple(v.label for v in combo) not in done:
                    run_combo(combo)
    else:
        compare(example, "the example inputs")
    for k, args in enumerate(input_sets):
        compare(tuple(args), f"input_sets[{k}]: " + _describe(names, {i: _Variant("", a) for i, a in
                                                                     enumerate(pytree.tree_leaves(tuple(args)))}))

    if runs == 0:
        raise EquivalenceError(
            f"before raised on every input set, so nothing was compared; first: {skipped[0] if skipped else '?'}",
            where="argument 'example_inputs'",
            hint="pass example_inputs (or input_sets) on which before runs",
        )
    report = EquivalenceReport(runs, required, covered, paths["before"], paths["after"], skipped, ref.role)
    missing = sorted(required - covered)
    if check_coverage and missing:
        listing = "; ".join(f"{site} -> {label}" for site, label in missing)
        raise IncompleteCoverageError(
            f"{len(missing)} branch(es) of {ref.role} never driven: {listing}",
            where=f"{runs} input sets",
            hint="pass input_sets that reach them, or check_coverage=False if they are unreachable",
        )
    return report
