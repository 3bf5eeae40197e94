"""How candidates are timed, and which kind of time counts.

The op is run in one of two ways, and the fastest candidate differs between them:

* ``"host"`` (the default): called eagerly. The caller pays for the host
  work (Python, dispatch, one launch per kernel of an unfused chain) as well
  as the GPU's, so a candidate is ranked by both (:func:`eager_cost_timer`:
  host issue time plus device time). At small M the host work can exceed
  the kernels' time.
* ``"device"``: replayed inside a CUDA graph, where host work is not paid;
  candidates are timed on the device alone (:func:`cuda_event_timer`).

:func:`timing_mode` says which, for the code it wraps; the tuner keys its
choice on it, so one process can hold both answers. A CUDA-graph lowering
wraps its warm-up (where tuning happens) and capture in
``timing_mode("device")``::

    >>> current_timing_mode()
    'host'
    >>> with timing_mode("device"):
    ...     current_timing_mode()
    'device'

Timers take ``fn`` (no arguments) and return milliseconds. The helpers for
ranking close candidates (:func:`time_round_robin`, :func:`paired_ratio`)
exist because a GPU's clock drifts as it heats: a fixed order of timings
favours whichever candidate always ran first, and two functions timed in
separate blocks see different clocks, while the two of one adjacent pair
see the same one.
"""

from __future__ import annotations

import contextlib
import contextvars
import statistics
import time
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from branchyard.errors import LoweringError
from branchyard.lowering.nvgemm.problem import TimingMode

__all__ = [
    "L2Flush",
    "TIMING_MODES",
    "cuda_event_timer",
    "current_timing_mode",
    "device_block_timer",
    "device_interleaved_timer",
    "eager_cost_timer",
    "host_issue_timer",
    "host_timer",
    "paired_order",
    "paired_ratio",
    "ratio_summary",
    "round_order",
    "time_round_robin",
    "timing_mode",
]

TIMING_MODES: tuple[TimingMode, ...] = ("host", "device")

_MODE: contextvars.ContextVar[TimingMode] = contextvars.ContextVar("branchyard_nvgemm_timing", default="host")


@contextlib.contextmanager
def timing_mode(mode: TimingMode) -> Iterator[None]:
    """Within the block, the op is tuned (and its choice looked up) for ``mode``:
    ``"host"`` (eager calls) or ``"device"`` (calls replayed in a CUDA graph)."""
    if mode not in TIMING_MODES:
        raise LoweringError(f"timing mode {mode!r}", where="nvgemm.timing_mode", hint="use 'host' or 'device'")
    token = _MODE.set(mode)
    try:
        yield
    finally:
        _MODE.reset(token)


def current_timing_mode() -> TimingMode:
    """The mode set by the innermost :func:`timing_mode` (default ``"host"``)."""
    return _MODE.get()


class L2Flush:
    """A buffer larger than any L2 (H200: 50 MiB), zeroed before each timed run,
    so that every run reads its operands from HBM as a call in a model does."""

    def __init__(self, device: torch.device, nbytes: int = 256 << 20) -> None:
        self.buf = torch.empty(nbytes // 4, dtype=torch.int32, device=device)

    def __call__(self) -> None:
        self.buf.zero_()


#: Assumed GPU clock for ``torch.cuda._sleep`` (cycles); a slower clock only makes the hold longer.
_SLEEP_HZ = 2.0e9


def _hold_gpu(seconds: float) -> None:
    """Keep the current stream busy for about ``seconds`` with a spinning kernel, so
    that the host can enqueue the timed launches before the GPU reaches them."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None and seconds > 0:
        sleep(int(min(seconds, 0.5) * _SLEEP_HZ))


def _probe(fn: Callable[[], Any], warmup: int, hold: Callable[[float], None],
           after: Callable[[], Any] = lambda: None) -> tuple[float, float]:
    """After ``warmup`` calls: the host seconds to enqueue one run (``fn`` then
    ``after``), and the device milliseconds of one run of ``fn`` alone, timed
    behind a hold so the host's pace does not show."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    issue = time.perf_counter()
    fn()
    after()
    issue = time.perf_counter() - issue
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    hold(2 * issue + 1e-3)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return issue, max(start.elapsed_time(end), 1e-3)


def _enqueue_held(enqueue: Callable[[], Any], held: float, hold: Callable[[float], None], retry: bool = True) -> None:
    """Enqueue timed work behind a spinning kernel of ``held`` seconds; where the
    host took longer than that (a loaded machine: the GPU idled between
    launches), enqueue it again behind a hold twice as long as the host took."""
    for _ in range(3):
        hold(held)
        took = time.perf_counter()
        enqueue()
        took = time.perf_counter() - took
        torch.cuda.synchronize()
        if not retry or took < held:
            return
        held = 2 * took + 1e-3


def cuda_event_timer(
    fn: Callable[[], Any], *, warmup: int = 3, reps: int = 20, max_ms: float = 400.0, device_only: bool = True,
) -> float:
    """Median milliseconds of ``fn`` between CUDA events, L2 flushed before each run.

    ``device_only`` (the default): device time. A spinning kernel holds the
    GPU while the host enqueues every run, so host overhead does not count
    (what a CUDA-graph replay pays). ``device_only=False`` lets host time show
    wherever it exceeds the GPU's work. ``reps`` shrinks for slow functions so
    one candidate takes about ``max_ms``.
    """
    hold = _hold_gpu if device_only else (lambda seconds: None)
    flush = L2Flush(torch.device("cuda", torch.cuda.current_device()))
    issue, once = _probe(fn, warmup, hold, after=flush)
    reps = max(5, min(reps, int(max_ms / once)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]

    def enqueue() -> None:
        for s, e in zip(starts, ends):
            flush()
            s.record()
            fn()
            e.record()

    _enqueue_held(enqueue, 2 * reps * issue + 1e-3, hold, retry=device_only)
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def device_block_timer(
    fn: Callable[[], Any], *, warmup: int = 2, reps: int = 50, max_ms: float = 30.0,
    hold: Callable[[float], None] | None = None,
) -> float:
    """Milliseconds per call of ``fn`` called back to back, device time only:
    a spinning kernel holds the GPU while the host enqueues ``reps`` calls
    between two CUDA events, so no call waits for the host. How a program
    replayed from a CUDA graph is timed (:mod:`.program_race`): a replay's
    host work is not the program's, but how its kernels follow one another
    is. The L2 is not flushed: consecutive replays of a whole program see
    what the program itself leaves there. ``reps`` shrinks for slow
    functions so a block takes about ``max_ms``.
    """
    hold = hold if hold is not None else _hold_gpu
    issue, once = _probe(fn, warmup, hold)
    reps = max(5, min(reps, int(max_ms / once)))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def enqueue() -> None:
        start.record()
        for _ in range(reps):
            fn()
        end.record()

    _enqueue_held(enqueue, 2 * reps * issue + 1e-3, hold)
    return start.elapsed_time(end) / reps


#: The most back-to-back calls in one group of :func:`device_interleaved_timer`: a call of a
#: few microseconds fills ~1 ms by then, and the host's enqueueing stays within one hold.
_MAX_GROUP = 256


def device_interleaved_timer(
    fns: Sequence[Callable[[], Any]], *, warmup: int = 1, reps: int = 50, max_ms: float = 40.0,
    group_ms: float = 1.0, hold: Callable[[float], None] | None = None,
) -> list[float]:
    """Milliseconds per call of each of ``fns``, device time only, their calls
    interleaved: ``reps`` turns, each running a group of back-to-back calls of
    every function (the order reversed every other turn: A B, B A, A B, ...
    for two), an event recorded between groups, all enqueued behind one hold
    as in :func:`device_block_timer`. A group is one call, or as many as take
    about ``group_ms``: a GPU at its power limit moves its clock within
    milliseconds, which two blocks timed one after the other see differently
    (a spread of their ratio that hides a win of a few percent), while two
    adjacent groups see one clock; and a short program keeps being timed as it
    runs when replayed again and again, back to back with itself (at most
    256 calls to a group). ``reps`` shrinks so the turns take about
    ``max_ms``. No L2 flush.
    """
    if not fns:
        raise LoweringError("device_interleaved_timer needs at least one function to time",
                            where="nvgemm.timing")
    hold = hold if hold is not None else _hold_gpu
    probes = [_probe(fn, warmup, hold) for fn in fns]
    group = [min(_MAX_GROUP, max(1, int(group_ms / once))) for _, once in probes]
    issue = sum(k * p[0] for k, p in zip(group, probes))
    turn_ms = sum(k * p[1] for k, p in zip(group, probes))
    reps = max(5, min(reps, int(max_ms / turn_ms)))
    order = [list(range(len(fns))) if t % 2 == 0 else list(reversed(range(len(fns)))) for t in range(reps)]
    slots = [j for turn in order for j in turn]  # which function each interval between events timed
    events = [torch.cuda.Event(enable_timing=True) for _ in range(len(slots) + 1)]

    def enqueue() -> None:
        events[0].record()
        for i, j in enumerate(slots):
            for _ in range(group[j]):
                fns[j]()
            events[i + 1].record()

    _enqueue_held(enqueue, 2 * reps * issue + 1e-3, hold)
    totals = [0.0] * len(fns)
    for i, j in enumerate(slots):
        totals[j] += events[i].elapsed_time(events[i + 1])
    return [total / (reps * k) for total, k in zip(totals, group)]


def host_timer(
    fn: Callable[[], Any], *, warmup: int = 3, reps: int = 50, max_ms: float = 400.0,
    sync: Callable[[], None] | None = None, clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Milliseconds per call of ``fn`` called back to back, as an eager caller
    waits for it: wall-clock time of ``reps`` calls, synchronised at both ends.

    In a loop, a call costs the larger of its host work and its GPU work, so
    this is the time to compare candidates by when nothing hides the host
    work. The L2 is not flushed between calls (a flush kernel would hide the
    host work it is meant to expose). ``sync`` defaults to
    ``torch.cuda.synchronize`` on CUDA, a no-op otherwise.

        >>> host_timer(lambda: None, sync=lambda: None) >= 0.0
        True
    """
    if sync is None:
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    start = clock()
    fn()
    sync()
    once = max(clock() - start, 1e-7) * 1e3
    reps = max(5, min(reps, int(max_ms / once)))
    start = clock()
    for _ in range(reps):
        fn()
    sync()
    return (clock() - start) * 1e3 / reps


def host_issue_timer(
    fn: Callable[[], Any], *, warmup: int = 3, reps: int = 50, max_ms: float = 100.0,
    sync: Callable[[], None] | None = None, hold: Callable[[float], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Milliseconds of host work per call of ``fn``: the time to *issue* it.

    ``reps`` calls run back to back while a spinning kernel keeps the GPU
    busy (``hold(seconds)``, default :func:`_hold_gpu` on CUDA), so no call
    waits for the GPU: what is measured is Python, dispatch and launch work
    only, the part of a call that a host-bound program pays in full. ``reps``
    shrinks for slow functions so the calls take about ``max_ms``.

        >>> ticks = iter(range(100))
        >>> host_issue_timer(lambda: None, reps=10, sync=lambda: None, hold=lambda s: None,
        ...                  clock=lambda: next(ticks) * 1e-3)   # 1 ms per clock read
        0.1
    """
    if sync is None:
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    if hold is None:
        hold = _hold_gpu if torch.cuda.is_available() else (lambda seconds: None)
    for _ in range(warmup):
        fn()
    sync()
    start = clock()
    fn()
    once = max(clock() - start, 1e-7)
    sync()
    reps = max(5, min(reps, int(max_ms / (once * 1e3))))
    hold(2 * reps * once + 1e-3)
    start = clock()
    for _ in range(reps):
        fn()
    elapsed = clock() - start
    sync()
    return elapsed * 1e3 / reps


def eager_cost_timer(
    fn: Callable[[], Any], *,
    host: Callable[[Callable[[], Any]], float] | None = None,
    device: Callable[[Callable[[], Any]], float] | None = None,
) -> float:
    """What one eager call of ``fn`` costs a program, in milliseconds: its host
    issue time (``host``, default :func:`host_issue_timer`) plus its device
    time (``device``, default :func:`cuda_event_timer`). How ``"host"``
    timing ranks candidates.

    Why the sum, not the back-to-back time of :func:`host_timer` (which is
    ``max(host, device)`` per call): in a host-bound program the GPU waits
    for the host, so a candidate's host work adds to the program's time in
    full, and its GPU work adds wherever the host work that follows it is
    shorter; in a device-bound program its GPU work adds in full. The sum is
    the cost that holds in both (one call from an idle GPU: the kernels start
    when issued and the caller waits for them); it is never below what either
    kind of program pays, and it reduces to the back-to-back time where one
    part is negligible. Back-to-back timing lets a candidate with heavy host
    work (a compiled graph's wrapper, many launches) hide it behind its own
    GPU time, which it cannot do between the host-bound ops of a real program.

        >>> eager_cost_timer(lambda: None, host=lambda fn: 0.25, device=lambda fn: 0.5)
        0.75
    """
    host = host if host is not None else host_issue_timer
    device = device if device is not None else cuda_event_timer
    return float(host(fn)) + float(device(fn))


def paired_order(pairs: int) -> list[tuple[int, int]]:
    """Run order of :func:`paired_ratio`: pair ``i`` runs (0, 1) when ``i`` is
    even and (1, 0) when odd, so neither function always runs first."""
    return [(0, 1) if i % 2 == 0 else (1, 0) for i in range(pairs)]


def ratio_summary(first_ms: Sequence[float], second_ms: Sequence[float]) -> tuple[float, float]:
    """Median and half the interquartile range of the per-pair ratios ``first / second``."""
    if len(first_ms) != len(second_ms) or not first_ms:
        raise LoweringError(f"paired_ratio: paired timings need two equal, non-empty lists "
                            f"(got {len(first_ms)} and {len(second_ms)} timings)")
    ratios = sorted(a / b for a, b in zip(first_ms, second_ms))
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return statistics.median(ratios), (q[2] - q[0]) / 2


def paired_ratio(
    first: Callable[[], Any], second: Callable[[], Any], *, pairs: int = 40, warmup: int = 2,
    device_only: bool = True,
) -> tuple[float, float]:
    """Time of ``first`` over ``second``, measured in adjacent pairs.

    Each pair runs both functions back to back (L2 flushed before each, the
    order alternating between pairs, see :func:`paired_order`) and gives one
    ratio; returns the median ratio and half its interquartile range. Within
    a pair both functions see the same GPU clock. ``device_only`` as in
    :func:`cuda_event_timer`.
    """
    device = torch.device("cuda", torch.cuda.current_device())
    flush = L2Flush(device)
    fns = (first, second)
    for _ in range(warmup):
        first()
        second()
    torch.cuda.synchronize()
    host = time.perf_counter()
    for fn in fns:
        flush()
        fn()
    host = time.perf_counter() - host  # enqueue time of one pair
    torch.cuda.synchronize()
    events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(pairs)]
              for _ in fns]
    if device_only:
        _hold_gpu(2 * pairs * host + 1e-3)
    for i, order in enumerate(paired_order(pairs)):
        for which in order:
            start, end = events[which][i]
            flush()
            if not device_only:
                torch.cuda.synchronize()  # the flush must not hide the host work of the timed call
            start.record()
            fns[which]()
            end.record()
    torch.cuda.synchronize()
    first_ms, second_ms = ([s.elapsed_time(e) for s, e in evs] for evs in events)
    return ratio_summary(first_ms, second_ms)


def round_order(names: Sequence[str], r: int) -> list[str]:
    """The order of round ``r``: ``names`` rotated by ``r`` and, on odd rounds
    (of three or more names), reversed, so over rounds each name runs in every
    position and after both neighbours (two names: rotating alternates them)."""
    names = list(names)
    shift = r % len(names) if names else 0
    order = names[shift:] + names[:shift]
    return order[::-1] if r % 2 and len(names) > 2 else order


def time_round_robin(
    fns: Mapping[str, Callable[[], Any]], rounds: int, timer: Callable[[str, Callable[[], Any]], float],
) -> dict[str, list[float]]:
    """``timer(name, fn)`` of every function, ``rounds`` times, round ``r`` in
    :func:`round_order`."""
    names = list(fns)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in round_order(names, r):
            samples[name].append(timer(name, fns[name]))
    return samples
