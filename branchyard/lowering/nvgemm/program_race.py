"""The program-level guard of the ``nvgemm`` pass: a rewritten program is
never slower than the program it was made from, called the way it will be
called -- eagerly or replayed from a CUDA graph.

Each fused op is tuned so that its choice is never slower than the chain it
replaced, but a kernel timed alone does not see everything a program pays.
Called eagerly, the op's own host cost (its dispatch, the lookup of its
choice) is paid on every call, so in a host-bound program (small ``M``)
replacing a few ATen ops by one fused op can cost more host time than it
saves GPU time. Replayed from a CUDA graph, kernels run back to back: how one
overlaps the tail of the one before it, and what the program leaves in the
L2 for the next, are not what a kernel timed alone after an L2 flush shows.
So the pass races the programs themselves and keeps only what wins.
Semantics::

    def race(groups, build, compare, margin, alternatives):  # groups: the fused chains, grouped by problem
        def wins(fused, unfused):              # one time of each per round, taken side by side
            ratios = [f / u for f, u in zip(fused, unfused)]
            needed = max(margin, spread(ratios) * sqrt(blocks / max(blocks, len(ratios))))
            return median(ratios) < 1 - needed
        def runner_up(g, fused):               # g fused another way: another of the tuner's candidates
            for alt in alternatives(g):
                if wins(*compare(build(fused | {alt}), build(fused))):
                    return fused | {alt}
            return fused
        fused = set(groups)                    # build(fused): the program with those groups fused
        if len(groups) > 1:
            for g in groups:                   # greedily: each group left unfused in turn
                with_g, without_g = compare(build(fused), build(fused - {g}))
                if not wins(with_g, without_g):
                    fused = runner_up(g, fused - {g})
        if fused:
            rewritten, unrewritten = compare(build(fused), build(set()))
            if not wins(rewritten, unrewritten):
                fused = runner_up(groups[0], set()) if len(groups) == 1 else set()  # else as it was
        return fused

``alternatives(g)`` names the other ways to fuse group ``g`` (the pass
offers the tuner's runner-ups, up to ``runner_ups`` of them: a kernel
that wins timed alone can lose inside a program, where it overlaps the
kernel before it and finds the L2 as that one left it, and a kernel of
another kind can win there).

A race is limited to ``time_limit_s`` (600 s by default), read before each
comparison: past it the race stops and the program stays as it was (the
result's ``failure`` says so). A GPU that other processes keep busy makes
each round many times longer than on a quiet one.

``compare(a, b)`` times the two programs in rounds (A/B, then B/A, ...):
a block of calls of each, or, for graph replays, the replays of both
interleaved (one replay, or about 1 ms of them, at a time). A fused variant
must win by what the timing can tell apart: the ``margin`` (a fraction of
the unfused time; by default 3% for eager calls, whose host time is noisy,
and 1% for graph replays, timed on the device alone) or the ``spread`` of the round-by-round ratios (interquartile
range over median), whichever is larger. The ratios are taken within a
round because a clock that drifts from round to round (a GPU at its power
limit, a busy host) moves both blocks of a round alike: it cancels in their
ratio, while each program's blocks taken apart would spread with it and
hide a real win. A smaller win is no evidence, and on a tie the program as
it was is the safe choice. Over ``blocks`` rounds (9) the spread is about
three standard errors of the median ratio. A comparison whose win falls
short of it, but would clear it with more rounds, gets more rounds,
``blocks`` at a time up to ``max_blocks`` (27); the spread then counts as
``spread * sqrt(blocks / rounds)``: the same three standard errors, now of
more rounds. A win hidden by noise within the rounds is found that way,
and a tie stays a tie. The margin is of the whole program's time: a group
that is a small part of a long program must save several times the margin
of its own time, so the floor is kept low where the timing is steady.
Chains that pose the same problem (spec, shapes, dtypes) are one group: they
cost the same, and one decision for all of them keeps the race short in a
model that repeats its blocks.

The programs are timed the way their caller runs them, under
``torch.no_grad()``:

* ``calling="eager"``: called back to back with the same inputs,
  synchronised at both ends of each block (:func:`~.timing.host_timer`),
  under ``timing_mode("host")`` (the fused ops tune for eager calls while
  they warm up). What is timed is the program's graph called with its
  parameters and inputs; the wrapper of ``ExportedProgram.module()`` around
  it does the same work for both programs, so it cannot change which one is
  faster.
* ``calling="graph"``: each program warmed up under ``timing_mode("device")``
  (the fused ops tune for replays), captured into a CUDA graph of one call
  (``ProgramRace.capture``, default :func:`capture_replay`), and the two
  programs' replays timed on the device alone, interleaved within each round
  one replay (or about a millisecond of back-to-back replays of a short
  program) at a time (:func:`~.timing.device_interleaved_timer`): a GPU at
  its power limit moves its clock within milliseconds, which whole blocks
  timed one after the other see differently, while adjacent turns see alike.
  A program that has control flow, reads a GPU value on the host or computes
  on the CPU is not captured here (the pass says why, and fuses as it would
  without a race); a fused program that fails to capture is not kept.

Inputs are the program's example inputs where it has them
(:func:`program_inputs`), else random tensors of the placeholders' example
shapes (:func:`placeholder_inputs`); a program with symbolic sizes and no
example inputs is not raced, and the report says so.

    >>> fake_us = {frozenset(): 100.0, frozenset({"a"}): 90.0, frozenset({"b"}): 120.0,
    ...            frozenset({"a", "b"}): 110.0}
    >>> race = ProgramRace(timer=lambda variant: fake_us[variant.fused] / 1e3)
    >>> result = race.run(["a", "b"], lambda fused: Variant(fused, lambda: None))
    >>> sorted(result.fused), result.unrewritten_us, result.result_us
    (['a'], 100.0, 90.0)
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Literal, Sequence

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import GraphModule

from branchyard.errors import LoweringError
from branchyard.fx.graph_walk import resolve_attr
from branchyard.lowering.nvgemm.timing import (
    device_interleaved_timer,
    host_timer,
    time_round_robin,
    timing_mode,
)

__all__ = [
    "CALLINGS",
    "Calling",
    "Comparison",
    "GraphCapture",
    "MARGINS",
    "PairTimer",
    "ProgramRace",
    "RaceDecision",
    "RaceResult",
    "Variant",
    "capture_replay",
    "check_calling",
    "placeholder_inputs",
    "program_device",
    "program_inputs",
    "race_context",
]

#: How the caller runs the rewritten program: ``"eager"`` (calls from Python;
#: host work is paid) or ``"graph"`` (replayed from a CUDA graph; it is not).
Calling = Literal["eager", "graph"]
CALLINGS: tuple[Calling, ...] = ("eager", "graph")

#: The least win (a fraction of the unfused program's time) a fused variant must
#: show, per calling: eager calls include host time, which varies from block to
#: block by a few percent; graph replays are timed on the device alone.
MARGINS: dict[Calling, float] = {"eager": 0.03, "graph": 0.01}


def check_calling(calling: Any, where: str = "nvgemm") -> Calling:
    """``calling`` if it is one of :data:`CALLINGS`, else a :class:`~branchyard.errors.LoweringError` naming it."""
    if calling not in CALLINGS:
        raise LoweringError(
            f"calling={calling!r} is not a way to call a program",
            where=where,
            hint="use calling='eager' (called from Python) or calling='graph' (replayed from a CUDA graph)",
        )
    return calling


@dataclass(frozen=True)
class Variant:
    """One program in the race: the chain groups it fuses, one call of it (a
    replay of its CUDA graph where ``calling="graph"``), the program itself
    (the pass's: a ``GraphModule``) for timers that look, and how it is called."""

    fused: frozenset[str]
    run: Callable[[], Any] = field(compare=False)
    program: Any = field(default=None, compare=False, repr=False)
    calling: Calling = field(default="eager", compare=False)

    @property
    def name(self) -> str:
        return "unrewritten" if not self.fused else "fusing " + ", ".join(sorted(self.fused))


@dataclass(frozen=True)
class RaceDecision:
    """One group's verdict: the program's time per call with the group fused and
    without it (the rest as decided so far; medians), which was kept, the win
    measured round by round (``won``: one minus the median ratio of fused to
    unfused; negative where the fused program was slower) and the win the
    timing asked for (``needed``); both fractions of the unfused time."""

    chains: str
    fused_us: float
    unfused_us: float
    kept_fused: bool
    needed: float = math.nan
    won: float = math.nan
    #: Rounds the comparison took (0: not timed).
    rounds: int = 0

    def __str__(self) -> str:
        verdict = "fused" if self.kept_fused else "left unfused"
        parts = []
        if math.isfinite(self.won):
            over = f" ({self.rounds} rounds)" if self.rounds else ""
            parts.append(f"{self.won:.1%} faster round by round{over}" if self.won >= 0
                         else f"{-self.won:.1%} slower round by round{over}")
        if not math.isnan(self.needed):
            parts.append(f"a win of {self.needed:.1%} needed")
        tail = "; " + ", ".join(parts) if parts else ""
        return (f"{self.chains}: {verdict} ({self.fused_us:.1f} us per call fused, "
                f"{self.unfused_us:.1f} us unfused{tail})")


@dataclass(frozen=True)
class Comparison:
    """Two programs timed in rounds of one block each: each one's microseconds
    per call, one sample per round (``a[i]`` and ``b[i]`` ran one after the other)."""

    a: tuple[float, ...]
    b: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.a) != len(self.b) or not self.a:
            raise LoweringError(f"a comparison needs one block of each program per round "
                                f"(got {len(self.a)} and {len(self.b)} blocks)", where="Comparison")

    @property
    def a_us(self) -> float:
        return statistics.median(self.a)

    @property
    def b_us(self) -> float:
        return statistics.median(self.b)

    @property
    def ratios(self) -> tuple[float, ...]:
        """``a``'s time over ``b``'s, round by round (``inf`` for a round with a block that did not time)."""
        return tuple(x / y if math.isfinite(x) and math.isfinite(y) and y > 0 else math.inf
                     for x, y in zip(self.a, self.b))

    @property
    def ratio(self) -> float:
        """The median of :attr:`ratios`: below 1 where ``a`` is the faster program."""
        return statistics.median(self.ratios)

    @property
    def spread(self) -> float:
        """The interquartile range of :attr:`ratios` over their median (0 with one round).
        A clock that drifts between rounds moves both programs alike and leaves it small:

            >>> drifting = Comparison((97.0, 107.0, 116.0, 126.0), (100.0, 110.0, 120.0, 130.0))
            >>> round(drifting.spread, 3), round(drifting.ratio, 3)
            (0.002, 0.97)
        """
        return _spread(self.ratios)


def _spread(samples: Sequence[float]) -> float:
    if not all(math.isfinite(x) for x in samples):
        return math.inf  # a block that failed to time: no win can be told apart from it
    if len(samples) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    middle = statistics.median(samples)
    return (q3 - q1) / middle if middle > 0 else 0.0


@dataclass
class RaceResult:
    """What the race kept, every decision, and the two ends: the unrewritten
    program's and the kept program's time per call (us); ``failure`` where a
    fused program could not be run the way it will be called."""

    fused: frozenset[str]
    decisions: list[RaceDecision]
    unrewritten_us: float
    result_us: float
    #: Why the race stopped short, keeping the program as it was ("": it did not).
    failure: str = ""

    def decision(self, group: str) -> RaceDecision | None:
        """The last decision about ``group`` (the one that stands)."""
        return next((d for d in reversed(self.decisions) if d.chains == group), None)


class _OutOfTime(Exception):
    """A race's time limit passed (caught in :meth:`ProgramRace.run`)."""


#: ``timer(variant) -> milliseconds per call``.
VariantTimer = Callable[[Variant], float]


def _default_timer(variant: Variant) -> float:
    return host_timer(variant.run, warmup=1, reps=30, max_ms=30.0)


#: ``pair_timer(a, b) -> (ms_a, ms_b)``: one round of both variants, milliseconds per call of each.
PairTimer = Callable[[Variant, Variant], tuple[float, float]]


def _interleaved_pair_timer(a: Variant, b: Variant) -> tuple[float, float]:
    ms_a, ms_b = device_interleaved_timer([a.run, b.run], warmup=1, reps=50, max_ms=40.0)
    return ms_a, ms_b


#: ``capture(program, inputs) -> replay``: ``program(*inputs)`` captured into a
#: CUDA graph; ``replay()`` replays it once and returns the program's outputs.
GraphCapture = Callable[[GraphModule, Sequence[Any]], Callable[[], Any]]


def capture_replay(program: Callable[..., Any], inputs: Sequence[Any]) -> Callable[[], Any]:
    """``program(*inputs)`` captured into a CUDA graph of its own memory pool,
    as a user captures one call: one warm-up call first (lazy initialisation
    is not captured), then the capture, on a stream of branchyard's own
    (:func:`~branchyard.lowering.cuda_graph.guarded_capture.guarded_capture`:
    a host sync during it is an error before it reaches CUDA, and a failed
    capture leaves no stream capturing and no allocator routed to a dead
    pool). The result replays the graph and returns the captured call's outputs."""
    from branchyard.lowering.cuda_graph.guarded_capture import guarded_capture

    device = torch.device("cuda", torch.cuda.current_device())
    program(*inputs)
    graph = torch.cuda.CUDAGraph()
    with guarded_capture(graph, pool=torch.cuda.graph_pool_handle(), device=device, side_streams=0):
        outputs = program(*inputs)

    def replay() -> Any:
        graph.replay()
        return outputs

    return replay


@dataclass(frozen=True)
class ProgramRace:
    """How programs are raced: ``pair_timer(a, b)`` (one round of two
    variants: ms per call of each) or ``timer(variant)`` (ms per call of one,
    the variants timed in turn), by default
    :func:`~.timing.host_timer` of short blocks of back-to-back calls for
    eager calling and :func:`~.timing.device_interleaved_timer` of the two
    programs' replays for graph calling; ``blocks`` rounds per comparison
    (up to ``max_blocks`` where the first ``blocks`` leave a possible win undecided), the device types
    on which a race is worth running (``devices``; on CPU the fused op runs
    the original ATen ops, so there is nothing to win there), the ``margin``
    by which a fused variant must be faster to be kept (``None``: per
    calling, :data:`MARGINS`; the measured spread raises it where the timing
    is noisier), and ``capture``, how a program is captured for graph calling
    (default :func:`capture_replay`)."""

    timer: VariantTimer | None = None
    blocks: int = 9
    devices: tuple[str, ...] = ("cuda",)
    margin: float | None = None
    capture: GraphCapture | None = None
    max_blocks: int = 27
    pair_timer: PairTimer | None = None
    #: How many other ways to fuse it a group that loses is offered (``alternatives``; 0: none).
    runner_ups: int = 3
    #: Seconds one :meth:`run` may take (``None``: no limit), read before each comparison.
    #: Past it the race stops and keeps the program as it was (``RaceResult.failure`` says
    #: why): on a GPU other processes keep busy, timing takes many times longer.
    time_limit_s: float | None = 600.0
    #: The clock :attr:`time_limit_s` is read on (seconds).
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        if not isinstance(self.blocks, int) or self.blocks < 1:
            raise LoweringError(f"blocks={self.blocks!r}: a race needs at least one block", where="ProgramRace")
        if not isinstance(self.runner_ups, int) or isinstance(self.runner_ups, bool) or self.runner_ups < 0:
            raise LoweringError(f"runner_ups={self.runner_ups!r}: a count of other ways to fuse a group, 0 or more",
                                where="ProgramRace")
        if not isinstance(self.max_blocks, int) or isinstance(self.max_blocks, bool) or self.max_blocks < self.blocks:
            raise LoweringError(f"max_blocks={self.max_blocks!r}: at least blocks={self.blocks}",
                                where="ProgramRace", hint="max_blocks=blocks times every comparison once")
        limit = self.time_limit_s
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float))
                                  or not 0 < limit < math.inf):
            raise LoweringError(f"time_limit_s={limit!r}: seconds a race may take, more than 0, or None "
                                "(no limit)", where="ProgramRace")
        margin = self.margin
        if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))
                                   or not 0 <= margin < 1):
            raise LoweringError(f"margin={margin!r}: a fraction in [0, 1) of the unfused time, or None "
                                "(per calling)", where="ProgramRace")

    def margin_for(self, calling: Calling) -> float:
        """The margin a fused variant called ``calling``'s way must win by, before the spread."""
        return MARGINS[calling] if self.margin is None else float(self.margin)

    def needed(self, comparison: Comparison, calling: Calling = "eager") -> float:
        """The win ``comparison`` asks for: the margin or its spread, whichever is
        larger, the spread shrunk as the square root of the rounds beyond ``blocks``."""
        return self._needed_after(comparison, calling, len(comparison.a))

    def _needed_after(self, comparison: Comparison, calling: Calling, rounds: int) -> float:
        """The win asked for of ``comparison``'s spread measured over ``rounds`` rounds."""
        return max(self.margin_for(calling), comparison.spread * math.sqrt(self.blocks / max(self.blocks, rounds)))

    def wins(self, comparison: Comparison, calling: Calling = "eager") -> bool:
        """Whether ``comparison.a`` (fused) beats ``comparison.b`` (unfused) round by round by :meth:`needed`."""
        return comparison.ratio < 1 - self.needed(comparison, calling)

    def compare(self, a: Variant, b: Variant) -> Comparison:
        """``a`` and ``b`` timed in interleaved rounds (microseconds per call, one
        sample per round): ``blocks`` rounds, and ``blocks`` more at a time (up to
        ``max_blocks``) while ``a`` shows a win that more rounds could confirm."""
        timed = self._rounds(a, b, self.blocks, a_first=True)
        while self._undecided(timed, a.calling):
            more = self._rounds(a, b, min(self.blocks, self.max_blocks - len(timed.a)), a_first=len(timed.a) % 2 == 0)
            timed = Comparison(timed.a + more.a, timed.b + more.b)
        return timed

    def _rounds(self, a: Variant, b: Variant, rounds: int, a_first: bool) -> Comparison:
        pair = self.pair_timer or (_interleaved_pair_timer if self.timer is None and a.calling == "graph" else None)
        if pair is not None:
            times_a, times_b = [], []
            for r in range(rounds):  # who goes first alternates from round to round
                ms_a, ms_b = pair(a, b) if a_first == (r % 2 == 0) else pair(b, a)[::-1]
                times_a.append(float(ms_a) * 1e3)
                times_b.append(float(ms_b) * 1e3)
            return Comparison(tuple(times_a), tuple(times_b))
        timer = self.timer or _default_timer
        order = {"a": a, "b": b} if a_first else {"b": b, "a": a}  # the A/B, B/A alternation goes on
        times = time_round_robin(order, rounds, lambda _, variant: float(timer(variant)) * 1e3)
        return Comparison(tuple(times["a"]), tuple(times["b"]))

    def _undecided(self, timed: Comparison, calling: Calling) -> bool:
        """Whether ``timed`` falls short of a win that it could still show by ``max_blocks`` rounds."""
        if len(timed.a) >= self.max_blocks or self.wins(timed, calling):
            return False
        return timed.ratio < 1 - self._needed_after(timed, calling, self.max_blocks)

    def decide(self, group: str, timed: Comparison, calling: Calling = "eager") -> RaceDecision:
        """``group``'s verdict from ``timed`` (``a`` fusing it, ``b`` not): whether it
        wins, the win measured and the win needed."""
        return RaceDecision(group, timed.a_us, timed.b_us, self.wins(timed, calling), self.needed(timed, calling),
                            1 - timed.ratio, len(timed.a))

    def run(self, groups: Sequence[str], build: Callable[[frozenset[str]], Variant],
            alternatives: Callable[[str], Sequence[str]] | None = None) -> RaceResult:
        """Race the programs ``build(fused)`` makes (see the module docstring);
        ``alternatives(group)``: labels ``build`` takes for ``group`` fused
        another way (the first :attr:`runner_ups` of them are tried)."""
        deadline = None if self.time_limit_s is None else self.clock() + self.time_limit_s
        decisions: list[RaceDecision] = []

        def compare(a: Variant, b: Variant) -> Comparison:
            if deadline is not None and self.clock() > deadline:
                raise _OutOfTime
            return self.compare(a, b)

        try:
            return self._run(list(dict.fromkeys(groups)), build, alternatives, compare, decisions)
        except _OutOfTime:
            return RaceResult(frozenset(), decisions, math.nan, math.nan,
                              failure=f"the race ran past its time limit of {self.time_limit_s:g} s "
                                      "(ProgramRace.time_limit_s; is another process using the GPU?)")

    def _run(self, groups: list[str], build: Callable[[frozenset[str]], Variant],
             alternatives: Callable[[str], Sequence[str]] | None, compare: Callable[[Variant, Variant], Comparison],
             decisions: list[RaceDecision]) -> RaceResult:
        labels = list(groups)  # the groups, then each alternative tried

        def runner_up(group: str, without: Variant) -> Variant:
            """``without`` plus ``group`` fused the first other way that wins against it, else ``without``."""
            if alternatives is None or not self.runner_ups:
                return without
            for label in list(alternatives(group))[:self.runner_ups]:
                labels.append(label)
                other = build(without.fused | {label})
                decisions.append(self.decide(label, compare(other, without), without.calling))
                if decisions[-1].kept_fused:
                    return other
                del other
            return without

        current = build(frozenset(groups))
        calling = current.calling
        if len(groups) > 1:
            for group in groups:
                if group not in current.fused:
                    continue
                without = build(current.fused - {group})
                decisions.append(self.decide(group, compare(current, without), calling))
                if not decisions[-1].kept_fused:
                    current = without  # the losing program (and captured graph) goes before the next is built
                    current = runner_up(group, current)
                del without
        if not current.fused:  # every group lost on its own: the last comparison timed the program as it was
            last = decisions[-1]
            return RaceResult(frozenset(), decisions, last.unfused_us, last.unfused_us)
        unrewritten = build(frozenset())
        timed = compare(current, unrewritten)
        final = [self.decide(g, timed, calling) for g in labels if g in current.fused]
        if not final[0].kept_fused:
            decisions += final
            if len(groups) == 1:  # the one group's tuned choice lost: its runner-ups may not
                del current
                kept = runner_up(groups[0], unrewritten)
                if kept.fused:
                    return RaceResult(kept.fused, decisions, decisions[-1].unfused_us, decisions[-1].fused_us)
            return RaceResult(frozenset(), decisions, timed.b_us, timed.b_us)
        if len(groups) == 1:
            decisions += final
        return RaceResult(current.fused, decisions, timed.b_us, timed.a_us)


# --- the program's inputs ----------------------------------------------------


def program_inputs(program: ExportedProgram | GraphModule) -> list[Any] | None:
    """The values of an ExportedProgram's graph placeholders, in order: its
    parameters, buffers and constants, and its example inputs where it kept
    them (``None`` for each input it has no value for). ``None`` for a
    GraphModule (its placeholders are its inputs; none are known)."""
    if not isinstance(program, ExportedProgram):
        return None
    example = program.example_inputs
    if example is not None:
        try:
            return list(program._graph_module_flat_inputs(*example))
        except Exception:  # example inputs that no longer match: bind what the program owns
            pass
    values: list[Any] = []
    for spec in program.graph_signature.input_specs:
        target = spec.target
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            value = program.state_dict.get(target) if target in program.state_dict else program.constants.get(target)
            values.append(value)
        else:
            values.append(None)
    return values


def _random_like(val: torch.Tensor) -> torch.Tensor:
    t = torch.empty_strided(tuple(int(s) for s in val.shape), tuple(int(s) for s in val.stride()),
                            dtype=val.dtype, device=val.device)
    if t.is_floating_point() or t.is_complex():
        t.normal_()
    else:
        t.zero_()  # indices and masks: 0 is valid wherever any value is
    return t


def _concrete(val: torch.Tensor) -> bool:
    return all(isinstance(s, int) for s in val.shape) and all(isinstance(s, int) for s in val.stride())


def placeholder_inputs(gm: GraphModule, given: Sequence[Any] | None = None) -> tuple[list[Any] | None, str | None]:
    """``(values, None)``: one value per placeholder of ``gm`` -- ``given[i]``
    where it is not ``None`` (a copy of it where the graph writes it in place: a
    race runs the program many times, and a model's step counter, KV cache or
    example input must not change), else a random tensor of the placeholder's
    example value (``meta['val']``) -- or ``(None, why)`` where a value cannot be made."""
    from branchyard.fx.mutation import written_roots

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if given is not None and len(given) != len(placeholders):
        return None, f"{len(given)} example values for {len(placeholders)} graph inputs"
    written = set(written_roots(gm.graph))
    values: list[Any] = []
    for i, node in enumerate(placeholders):
        if given is not None and given[i] is not None:
            value = given[i]
            values.append(value.detach().clone() if node in written and isinstance(value, torch.Tensor) else value)
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            if not _concrete(val):
                return None, (f"input '{node.name}' has symbolic sizes {list(val.shape)} and the program "
                              "has no example inputs")
            values.append(_random_like(val))
        elif isinstance(val, (int, float, bool)) or (val is None and not node.users):
            values.append(val)
        else:
            return None, f"no example value for input '{node.name}' ({type(val).__name__})"
    return values, None


def program_device(gm: GraphModule, values: Sequence[Any] = ()) -> str:
    """``"cuda"`` if any input, parameter or constant of ``gm`` (or of ``values``)
    lives on a CUDA device, else ``"cpu"``."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    tensors += [n.meta["val"] for n in gm.graph.nodes
                if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)]
    tensors += list(gm.parameters()) + list(gm.buffers())
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            try:
                obj = resolve_attr(gm, str(n.target))
            except AttributeError:
                continue
            if isinstance(obj, torch.Tensor):
                tensors.append(obj)
    return "cuda" if any(t.device.type == "cuda" for t in tensors) else "cpu"


@contextlib.contextmanager
def race_context(calling: Calling = "eager") -> Iterator[None]:
    """Where variants run: no autograd, fused ops tuned for the way the program
    is called (host time for eager calls, device time for graph replays)."""
    with torch.no_grad(), timing_mode("host" if calling == "eager" else "device"):
        yield
