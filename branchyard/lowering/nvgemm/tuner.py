"""Choose the fastest implementation of a fused GEMM by timing it on the real shape.

For one :class:`~.problem.Problem` the :class:`Autotuner`:

1. lists the candidates that apply (:func:`~.candidates.default_candidates`,
   the unfused ATen chain among them, so the choice is never slower than the
   program the user had);
2. builds each one; a build failure excludes it, with the reason logged;
3. runs each once against the fp32 reference (wrong numerics exclude it);
4. times the survivors the way the caller runs the op (:mod:`.timing`:
   host issue time plus device time for eager calls, so host work is paid
   rather than hidden behind the candidate's own kernels; device-only in a
   CUDA graph), re-times the close ones -- and, for eager calls, always the
   unfused chain, the program the user had -- in rotating rounds, settles
   the closest in adjacent pairs, and keeps the fastest;
5. records the winner in the :class:`~.winners.WinnerDB`, keyed by the
   environment, spec, dtypes, layouts, ``N``, ``K``, an ``M`` bucket and the
   timing mode, so later processes skip 2-4.

Everything the decision depends on is injectable (candidates, timer, pair
function, database, environment), so the logic is tested on CPU with fake
timings::

    >>> import torch, tempfile
    >>> from branchyard.lowering.nvgemm.candidates import Candidate
    >>> from branchyard.lowering.nvgemm.epilogue import EpilogueSpec, unfused_aten_epilogue
    >>> from branchyard.lowering.nvgemm.winners import WinnerDB
    >>> spec = EpilogueSpec.parse("w=kn;relu;out=float32")
    >>> def aten(p):
    ...     return lambda a, b, ops, out: unfused_aten_epilogue(a @ b, p.spec, ops)
    >>> fake_ms = {"slow": 2.0, "fast": 1.0}
    >>> tuner = Autotuner([Candidate("slow", aten), Candidate("fast", aten)],
    ...                   timer=lambda name, fn: fake_ms[name], progress=False,
    ...                   db=WinnerDB(tempfile.mkdtemp()), env={"gpu": "test"})
    >>> a, b = torch.randn(8, 16), torch.randn(16, 32)
    >>> tuner.tune(a, b, [], spec).winner
    'fast'
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from branchyard.errors import LoweringError
from branchyard.lowering.nvgemm.candidates import UNFUSED, Candidate, candidate_kind, default_candidates
from branchyard.lowering.nvgemm.environment import environment
from branchyard.lowering.nvgemm.epilogue import EpilogueSpec, reference_fused_gemm
from branchyard.lowering.nvgemm.problem import Impl, Problem, TimingMode, bound_launch, m_bucket
from branchyard.lowering.nvgemm.progress import ProgressBar
from branchyard.lowering.nvgemm.timing import (
    cuda_event_timer,
    current_timing_mode,
    eager_cost_timer,
    paired_ratio,
    time_round_robin,
)
from branchyard.lowering.nvgemm.winners import WinnerDB

__all__ = [
    "Autotuner",
    "CONTENDER_MARGIN",
    "HOST_RANKING",
    "PLAYOFF_MARGIN",
    "RUNNER_UP_MARGIN",
    "TuneResult",
    "get_autotuner",
    "numerics_error",
    "select",
    "set_autotuner",
]

logger = logging.getLogger("branchyard")


#: A runner-up (:meth:`TuneResult.runner_ups`) is at most this factor slower than the
#: winner timed alone: inside a program the kernels seen losing or winning against
#: their time alone did so by 3-16%.
RUNNER_UP_MARGIN = 1.25


@dataclass
class TuneResult:
    """What one tuning run found: the winner, every survivor's median time in
    ms, and every excluded candidate with its reason."""

    key: str
    winner: str
    timings: dict[str, float] = field(default_factory=dict)
    excluded: dict[str, str] = field(default_factory=dict)
    #: The excluded candidates this process could not build now (``Candidate.available``).
    unavailable: list[str] = field(default_factory=list)
    from_cache: bool = False
    #: How many timings each re-timed contender's median is over (empty: one pass decided).
    rounds: dict[str, int] = field(default_factory=dict)
    #: The paired playoff, in order: each candidate's time over the then leader's (< 1: it took the lead).
    playoff: list[dict[str, Any]] = field(default_factory=list)
    impl: Impl | None = field(default=None, repr=False, compare=False)

    def runner_ups(self, limit: int, within: float = RUNNER_UP_MARGIN) -> list[str]:
        """What to run instead where the winner, inside a program, loses (see
        :class:`~.program_race.ProgramRace`): the fastest timed candidate of each
        other kind (:func:`~.candidates.candidate_kind`) than the winner's and
        the unfused chain's (leaving a chain unfused is what the race compares
        with), fastest first, at most ``limit``, each within ``within`` of
        the winner's time.

            >>> r = TuneResult("k", "cutedsl:t64x64", {"cutedsl:t64x64": 8.7e-3, "cutedsl:t64x128": 8.8e-3,
            ...     "cutedsl:gemv_m64_w16": 9.0e-3, "triton:inductor": 9.3e-3, "aten:unfused": 9.4e-3,
            ...     "cutlass_plain+epilogue": 18.6e-3})
            >>> r.runner_ups(3)
            ['cutedsl:gemv_m64_w16', 'triton:inductor']
        """
        best = self.timings.get(self.winner)
        if best is None:
            return []
        bound = best * within
        seen = {candidate_kind(self.winner), candidate_kind(UNFUSED)}
        picked: list[str] = []
        for name, ms in sorted(self.timings.items(), key=lambda kv: kv[1]):
            kind = candidate_kind(name)
            if len(picked) >= limit or ms > bound:
                break
            if kind not in seen:
                seen.add(kind)
                picked.append(name)
        return picked

    def table(self) -> str:
        """A readable summary (fastest first)."""
        rows = [f"{name:<28} {ms * 1e3:10.1f} us" for name, ms in sorted(self.timings.items(), key=lambda kv: kv[1])]
        rows += [f"{name:<28} excluded: {why}" for name, why in self.excluded.items()]
        return "\n".join(rows)


_TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float32: 1e-3}


def numerics_error(got: torch.Tensor, ref: torch.Tensor, out_dtype: torch.dtype) -> str | None:
    """``None`` if ``got`` is within ``out_dtype`` tolerance of the fp32 ``ref``,
    else what is wrong (shape, dtype, NaNs, or the worst element)."""
    if tuple(got.shape) != tuple(ref.shape):
        return f"result shape {list(got.shape)}, expected {list(ref.shape)}"
    if got.dtype != out_dtype:
        return f"result dtype {got.dtype}, expected {out_dtype}"
    g, r = got.float(), ref.float()
    if torch.isnan(g).any() and not torch.isnan(r).any():
        return "result has NaNs"
    tol = _TOLERANCE.get(out_dtype, 1e-3)
    scale = r.abs().mean().clamp_min(1e-6)
    err = (g - r).abs() - tol * r.abs() - tol * scale
    worst = float(err.max()) if err.numel() else 0.0
    if worst > 0:
        idx = int(err.argmax())
        row, col = divmod(idx, r.shape[-1]) if r.dim() > 1 else (0, idx)
        return f"numerics off at [{row}, {col}]: got {float(g.flatten()[idx]):.6g}, reference {float(r.flatten()[idx]):.6g}"
    return None


#: Candidates whose first timing is within this factor of the fastest are timed again.
CONTENDER_MARGIN = 1.10

#: After the rounds, candidates whose median is within this factor of the leader's meet it
#: in a paired comparison (:func:`~.timing.paired_ratio`), which decides the winner.
PLAYOFF_MARGIN = 1.05

#: Exact call signatures remembered per tuner before the table starts over (serving with many M).
_EXACT_LIMIT = 4096


#: How ``"host"`` timing ranks candidates; part of a host-mode winner's database
#: key, so winners ranked another way (back-to-back time, or our kernels timed
#: with the per-call checks the op no longer makes, see :func:`_as_called`) are
#: tuned again.
HOST_RANKING = "host_issue+device+bound_launch"


def _default_timer(mode: TimingMode) -> Callable[[str, Callable[[], Any]], float]:
    if mode == "device":
        return lambda name, fn: cuda_event_timer(fn)
    return lambda name, fn: eager_cost_timer(fn)


class Autotuner:
    """Pick, build and cache the fastest candidate per problem.

    ``candidates``: a list, or a function ``problem -> list`` (default
    :func:`~.candidates.default_candidates`); ``timer(name, fn) -> ms``
    (default: by the timing mode, :func:`~.timing.eager_cost_timer` or
    :func:`~.timing.cuda_event_timer`); ``db`` (default :class:`~.winners.WinnerDB`
    in the cache folder); ``env`` (default :func:`~.environment.environment`);
    ``progress`` (default: env ``BRANCHYARD_NVGEMM_PROGRESS`` != ``0``);
    ``rounds`` (default: env ``BRANCHYARD_NVGEMM_TUNE_ROUNDS``, else 3);
    ``pair(fn_a, fn_b) -> time_a / time_b`` for the playoff (default:
    :func:`~.timing.paired_ratio` with env ``BRANCHYARD_NVGEMM_TUNE_PAIRS``
    pairs, else 40, where the default timer is used; no playoff with a
    custom ``timer`` and no ``pair``).

    Every candidate is timed once; those within :data:`CONTENDER_MARGIN` of
    the fastest -- in ``"host"`` timing the unfused chain (:data:`~.candidates.UNFUSED`)
    too, wherever it was timed, so one unlucky first timing cannot drop the
    original program from the race -- are timed again in ``rounds``
    round-robin rounds and ranked by the median of all their timings (a GPU's clock drifts as it heats, so
    one pass in a fixed order favours whoever ran on the cooler chip). Last,
    the leader meets every candidate within :data:`PLAYOFF_MARGIN` of it in
    adjacent pairs, and the faster of each pair leads on.
    """

    def __init__(
        self,
        candidates: Sequence[Candidate] | Callable[[Problem], Sequence[Candidate]] | None = None,
        *,
        timer: Callable[[str, Callable[[], Any]], float] | None = None,
        db: WinnerDB | None = None,
        env: Mapping[str, str] | None = None,
        progress: bool | None = None,
        stream: Any = None,
        rounds: int | None = None,
        pair: Callable[[Callable[[], Any], Callable[[], Any]], float] | None = None,
    ) -> None:
        self._candidates = candidates if candidates is not None else default_candidates
        self._pairs = 0
        if pair is None and timer is None:
            self._pairs = int(os.environ.get("BRANCHYARD_NVGEMM_TUNE_PAIRS", "40"))
        self.pair = pair
        self.timer = timer
        self.db = db if db is not None else WinnerDB()
        self.env = dict(env) if env is not None else None
        self.progress = progress if progress is not None else os.environ.get("BRANCHYARD_NVGEMM_PROGRESS", "1") != "0"
        self.stream = stream
        self.rounds = rounds if rounds is not None else int(os.environ.get("BRANCHYARD_NVGEMM_TUNE_ROUNDS", "3"))
        self._impls: dict[tuple, Impl] = {}
        self._exact: dict[tuple, Impl] = {}
        #: The fused op's decision per call signature (``op.CallPlan``), made on a
        #: signature's first call; a re-tune (:meth:`tune`) clears it.
        self.call_plans: dict[tuple, Any] = {}
        #: The op's shortcut to ``call_plans`` (``op._guarded_entry``): per coarse key,
        #: plans found there, each with a C++ guard of its signature; cleared with it.
        self.guarded_plans: dict[tuple, tuple] = {}
        self._lock = threading.RLock()
        #: Every tuning result of this process, by key (the benchmark reads it).
        self.results: dict[str, TuneResult] = {}

    def candidates(self, problem: Problem) -> list[Candidate]:
        """The candidates for ``problem`` (before applicability checks)."""
        c = self._candidates
        return list(c(problem) if callable(c) else c)

    def _env(self, problem: Problem) -> Mapping[str, str]:
        env = self.env if self.env is not None else environment(problem.device)
        return {**env, "host_ranking": HOST_RANKING} if problem.timing == "host" else env

    def _timer(self, problem: Problem) -> Callable[[str, Callable[[], Any]], float]:
        return self.timer if self.timer is not None else _default_timer(problem.timing)

    def _pair(self, problem: Problem) -> Callable[[Callable[[], Any], Callable[[], Any]], float] | None:
        if self.pair is not None:
            return self.pair
        if self._pairs <= 0:
            return None
        device_only = problem.timing == "device"
        return lambda f, g: paired_ratio(f, g, pairs=self._pairs, device_only=device_only)[0]

    @staticmethod
    def _bucket_key(a, b_kn, operands, spec_text: str, mode: TimingMode) -> tuple:
        return (
            spec_text, mode, a.shape[1], b_kn.shape[1], m_bucket(a.shape[0]), a.dtype, a.stride(1) == 1,
            b_kn.stride(0) == 1, tuple((t.dtype, t.dim(), t.stride(-1) == 1) for t in operands), a.device,
        )

    @staticmethod
    def _exact_key(a, b_kn, operands, spec_text: str, mode: TimingMode) -> tuple:
        return (spec_text, mode, a.shape, a.stride(), b_kn.shape, b_kn.stride(), a.dtype, a.device,
                *[(t.dtype, t.shape, t.stride()) for t in operands])

    def select(
        self, a: torch.Tensor, b_kn: torch.Tensor, operands: Sequence[torch.Tensor], spec: EpilogueSpec,
        spec_text: str | None = None, mode: TimingMode | None = None,
    ) -> Impl:
        """The implementation to run for this call (tuning it on first sight).

        Two in-memory levels keep the per-call cost low: the exact shapes and
        strides of this call, then the problem's bucket key; only a miss on
        both consults the database or tunes. ``mode`` defaults to
        :func:`~.timing.current_timing_mode`.
        """
        text = spec_text or str(spec)
        mode = mode or current_timing_mode()
        exact = self._exact_key(a, b_kn, operands, text, mode)
        impl = self._exact.get(exact)
        if impl is not None:
            return impl
        fast = self._bucket_key(a, b_kn, operands, text, mode)
        impl = self._impls.get(fast)
        if impl is None:
            with self._lock:
                impl = self._impls.get(fast)
                if impl is None:
                    impl = self._select_slow(a, b_kn, operands, spec, mode)
                    self._impls[fast] = impl
        if len(self._exact) > _EXACT_LIMIT:  # many distinct M (serving): start over, the bucket level remains
            self._exact.clear()
        self._exact[exact] = impl
        return impl

    def problem_key(self, a: torch.Tensor, b_kn: torch.Tensor, operands: Sequence[torch.Tensor],
                    spec: EpilogueSpec, mode: TimingMode) -> str:
        """The key under which this call's problem is tuned (in :attr:`results` and the database)."""
        problem = Problem.of(a, b_kn, operands, spec, mode)
        return problem.key(self._env(problem))

    def _select_slow(self, a, b_kn, operands, spec, mode) -> Impl:
        problem = Problem.of(a, b_kn, operands, spec, mode)
        cands = {c.name: c for c in self.candidates(problem)}
        if spec.impl is not None:
            pinned = self._pinned(problem, cands, spec.impl, a, b_kn, operands)
            if pinned is not None:
                return pinned
        key = problem.key(self._env(problem))
        # what this process can build now: an entry must have raced all of it
        entry = self.db.get(key, known=[n for n, c in cands.items() if c.available(problem) is None])
        if entry is not None:
            try:
                impl = cands[entry["winner"]].build(problem)
                self.results[key] = TuneResult(key, entry["winner"], dict(entry.get("timings") or {}),
                                               dict(entry.get("excluded") or {}),
                                               list(entry.get("unavailable") or []), from_cache=True)
                logger.info("nvgemm: %s -> %s (from %s)", problem, entry["winner"], self.db.path)
                return impl
            except Exception as exc:  # the recorded winner no longer builds: retune
                logger.warning("nvgemm: cached winner %s fails to build (%s); retuning", entry["winner"], exc)
        return self._tune(problem, key, list(cands.values()), a, b_kn, operands).impl  # type: ignore[return-value]

    def _pinned(self, problem, cands, name, a, b_kn, operands) -> Impl | None:
        """The candidate a spec names (``impl=``), built and checked against the
        reference once; ``None`` where it cannot run ``problem`` here (unknown,
        not applicable, not available, failing to build, or wrong numbers), with
        the reason logged: the tuner's choice runs instead."""
        cand = cands.get(name)
        why = f"no candidate named {name!r} here" if cand is None else cand.applies(problem) or cand.available(problem)
        built: dict[str, Impl] = {}
        if why is None:
            ref = reference_fused_gemm(a, b_kn, list(operands), problem.spec)
            why = self._try(cand, problem, a, b_kn, operands, ref, TuneResult("", ""), built, lambda *_: 0.0)
        if why is not None:
            logger.warning("nvgemm: %s: the pinned implementation %s cannot run it (%s); running the tuned "
                           "choice instead", problem, name, why)
            return None
        logger.info("nvgemm: %s -> %s (pinned by the spec)", problem, name)
        return built[name]

    def tune(
        self, a: torch.Tensor, b_kn: torch.Tensor, operands: Sequence[torch.Tensor], spec: EpilogueSpec,
        mode: TimingMode | None = None,
    ) -> TuneResult:
        """Tune this problem now (ignoring the database's entry) and record the winner."""
        mode = mode or current_timing_mode()
        problem = Problem.of(a, b_kn, operands, spec, mode)
        key = problem.key(self._env(problem))
        with self._lock:
            result = self._tune(problem, key, self.candidates(problem), a, b_kn, operands)
            self._impls[self._bucket_key(a, b_kn, operands, str(spec), mode)] = result.impl  # type: ignore[assignment]
            self._exact.clear()
            self.clear_call_plans()
        return result

    def clear_call_plans(self) -> None:
        """Forget the op's call plans and, with them, its guarded shortcuts to them."""
        self.call_plans.clear()
        self.guarded_plans.clear()

    def _tune(self, problem, key, cands, a, b_kn, operands) -> TuneResult:
        result = TuneResult(key, winner="")
        bar = ProgressBar(len(cands), str(problem), stream=self.stream, enabled=self.progress)
        ref = reference_fused_gemm(a, b_kn, list(operands), problem.spec)
        timer = self._timer(problem)
        built: dict[str, Impl] = {}
        for cand in cands:
            why = cand.applies(problem)
            if why is None and (now := cand.available(problem)) is not None:
                why = f"not available in this process: {now}"
                result.unavailable.append(cand.name)
            if why is None:
                why = self._try(cand, problem, a, b_kn, operands, ref, result, built, timer)
            if why is not None:
                result.excluded[cand.name] = why
                logger.info("nvgemm: %s excluded for %s: %s", cand.name, problem, why)
                bar.step(f"{cand.name}: excluded")
            else:
                bar.step(f"{cand.name}: {result.timings[cand.name] * 1e3:.1f} us")
        if not result.timings:
            raise LoweringError(
                f"no candidate can run {problem}: "
                + "; ".join(f"{n}: {w}" for n, w in result.excluded.items()),
                where="nvgemm autotune",
                hint="the op runs the unfused path instead; check the exclusion reasons",
            )
        self._rerun_contenders(problem, a, b_kn, operands, result, built, timer)
        result.winner = self._playoff(problem, a, b_kn, operands, result, built)
        result.impl = built[result.winner]
        self.results[key] = result
        self.db.put(key, {
            "winner": result.winner, "timings": result.timings, "excluded": result.excluded,
            "unavailable": result.unavailable,
            "playoff": result.playoff, "timing": problem.timing,
            "problem": str(problem), "tuned_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        })
        logger.info("nvgemm: %s -> %s\n%s", problem, result.winner, result.table())
        return result

    def _rerun_contenders(self, problem, a, b_kn, operands, result, built, timer) -> None:
        best = min(result.timings.values())
        close = [n for n, t in result.timings.items()
                 if t <= best * CONTENDER_MARGIN or (n == UNFUSED and problem.timing == "host")]
        if len(close) < 2 or self.rounds < 1:
            return
        samples = time_round_robin(
            self._callers(problem, a, b_kn, operands, built, close),
            self.rounds, lambda name, fn: float(timer(name, fn)),
        )
        for name in close:
            samples[name].insert(0, result.timings[name])
            result.timings[name] = statistics.median(samples[name])
        result.rounds = {n: len(v) for n, v in samples.items()}

    @staticmethod
    def _callers(problem, a, b_kn, operands, built, names) -> dict[str, Callable[[], Any]]:
        """A no-argument call of each named built candidate, all writing one output buffer."""
        out = torch.empty((problem.m, problem.n), dtype=problem.spec.out_dtype, device=a.device)
        ops = list(operands)
        return {n: _as_called(built[n], a, b_kn, ops, out) for n in names}

    def _playoff(self, problem, a, b_kn, operands, result, built) -> str:
        leader = min(result.timings, key=result.timings.__getitem__)
        close = sorted((n for n, t in result.timings.items()
                        if n != leader and t <= result.timings[leader] * PLAYOFF_MARGIN), key=result.timings.get)
        pair = self._pair(problem)
        if pair is None or not close:
            return leader
        run = self._callers(problem, a, b_kn, operands, built, [leader, *close])
        for name in close:
            ratio = float(pair(run[name], run[leader]))
            result.playoff.append({"candidate": name, "leader": leader, "ratio": ratio})
            if ratio < 1.0:
                leader = name
        return leader

    def _try(self, cand, problem, a, b_kn, operands, ref, result, built, timer) -> str | None:
        try:
            impl = cand.build(problem)
        except Exception as exc:
            return f"build failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        out = torch.empty((problem.m, problem.n), dtype=problem.spec.out_dtype, device=a.device)
        ops = list(operands)
        try:
            got = impl(a, b_kn, ops, out)
        except Exception as exc:
            return f"run failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        got = out if got is None else got
        bad = numerics_error(got, ref, problem.spec.out_dtype)
        if bad is not None:
            return bad
        try:
            result.timings[cand.name] = float(timer(cand.name, _as_called(impl, a, b_kn, ops, out)))
        except Exception as exc:
            return f"timing failed: {type(exc).__name__}: {exc}"
        built[cand.name] = impl
        return None


def _as_called(impl: Impl, a: torch.Tensor, b_kn: torch.Tensor, operands: list[torch.Tensor],
              out: torch.Tensor) -> Callable[[], Any]:
    """A no-argument call of ``impl`` on these arguments as the op's tuned calls
    run it (what is timed): the launch its ``bind`` returns where it has one
    (our fused kernels: their checks done once, the weight given ``[N, K]``),
    else ``impl`` itself (also where ``bind`` refuses, as the op does)."""
    launch, takes_nk = bound_launch(impl, a, b_kn, operands, out)
    weight = b_kn.t() if takes_nk else b_kn
    return lambda: launch(a, weight, operands, out)


_default: Autotuner | None = None
_default_lock = threading.Lock()


def get_autotuner() -> Autotuner:
    """The process-wide autotuner the fused op uses."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Autotuner()
        return _default


def set_autotuner(tuner: Autotuner | None) -> None:
    """Replace the process-wide autotuner (``None``: a fresh default one next time)."""
    global _default
    with _default_lock:
        _default = tuner


def select(
    a: torch.Tensor, b_kn: torch.Tensor, operands: Sequence[torch.Tensor], spec: EpilogueSpec,
    spec_text: str | None = None,
) -> Impl:
    """The implementation the process-wide autotuner picks for this call."""
    tuner = _default if _default is not None else get_autotuner()
    return tuner.select(a, b_kn, operands, spec, spec_text)
