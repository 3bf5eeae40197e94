"""The CUDA-event timers' control flow, on CPU: a fake GPU whose events count
device work (each call of the timed function is ``per_call_ms`` of it, each
L2 flush none), so what a timer returns, how often it calls and flushes, and
when it holds the GPU longer can be checked without CUDA."""

from __future__ import annotations

import time

import pytest
import torch

from branchyard.errors import LoweringError
from branchyard.lowering.nvgemm import timing


class FakeGpu:
    """Device time advances by ``per_call_ms`` per call of :meth:`work`; an event
    records the device time when it is recorded."""

    def __init__(self, per_call_ms: float):
        self.per_call_ms, self.now_ms = per_call_ms, 0.0
        self.log: list[str] = []
        self.holds: list[float] = []

    def work(self, host_s: float = 0.0) -> None:
        if host_s:
            time.sleep(host_s)
        self.now_ms += self.per_call_ms
        self.log.append("fn")

    def event(self, enable_timing: bool = False):
        gpu = self

        class Event:
            def record(self):
                self.at = gpu.now_ms

            def elapsed_time(self, end):
                return end.at - self.at

        return Event()


@pytest.fixture
def gpu(monkeypatch):
    fake = FakeGpu(per_call_ms=0.25)

    class Flush:
        def __init__(self, device):
            pass

        def __call__(self):
            fake.log.append("flush")

    monkeypatch.setattr(timing, "L2Flush", Flush)
    monkeypatch.setattr(timing, "_hold_gpu", lambda s: fake.holds.append(s))
    monkeypatch.setattr(torch.cuda, "Event", fake.event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return fake


def test_the_event_timer_flushes_before_every_run_and_returns_the_median(gpu):
    ms = timing.cuda_event_timer(gpu.work, warmup=2, reps=7)
    assert ms == pytest.approx(0.25)
    # warm-up, the issue probe (flushed after it), the device probe, then each timed run after a flush
    assert gpu.log == ["fn", "fn", "fn", "flush", "fn"] + ["flush", "fn"] * 7
    assert len(gpu.holds) == 2  # the probe's and the timed runs'


def test_the_event_timer_caps_runs_by_time(gpu):
    gpu.per_call_ms = 50.0
    timing.cuda_event_timer(gpu.work, warmup=0, reps=100, max_ms=400.0)
    assert gpu.log.count("fn") == 2 + 8  # two probes, then 400 ms / 50 ms runs


def test_host_time_shows_only_when_asked(gpu):
    timing.cuda_event_timer(gpu.work, warmup=0, reps=5, device_only=False)
    assert gpu.holds == []  # nothing holds the GPU: the host's pace shows


def test_the_block_timer_times_back_to_back_calls_without_flushing(gpu):
    ms = timing.device_block_timer(gpu.work, warmup=1, reps=20, max_ms=1000.0)
    assert ms == pytest.approx(0.25)
    assert "flush" not in gpu.log and gpu.log.count("fn") == 1 + 1 + 1 + 20
    assert len(gpu.holds) == 2 and gpu.holds[1] > gpu.holds[0]  # the block's hold covers its 20 calls


def test_the_block_timer_caps_calls_by_time(gpu):
    gpu.per_call_ms = 10.0
    timing.device_block_timer(gpu.work, warmup=0, reps=50, max_ms=30.0)
    assert gpu.log.count("fn") == 2 + 5  # two probes, then at least five calls


@pytest.mark.parametrize("timer", ["cuda_event_timer", "device_block_timer"])
def test_a_host_slower_than_the_hold_times_again_with_a_longer_hold(gpu, timer):
    calls = {"n": 0}

    def slows_down():
        calls["n"] += 1
        gpu.work(host_s=0.004 if calls["n"] > 3 else 0.0)  # fast through the probes, then 4 ms each

    getattr(timing, timer)(slows_down, warmup=1, reps=5)
    assert len(gpu.holds) == 3, gpu.holds  # the probe's, the first block's, and the longer one's
    assert gpu.holds[2] > 2 * 5 * 0.004 > gpu.holds[1]


class DriftingWork:
    """Functions on the fake GPU whose calls take ``ms * (1 + drift * calls so far)``:
    a clock that slows call by call, as a GPU at its power limit does."""

    def __init__(self, gpu: FakeGpu, drift: float):
        self.gpu, self.drift, self.calls = gpu, drift, 0

    def fn(self, name: str, ms: float):
        def call() -> None:
            self.gpu.now_ms += ms * (1 + self.drift * self.calls)
            self.calls += 1
            self.gpu.log.append(name)
        return call


def test_the_interleaved_timer_alternates_the_order_turn_by_turn(gpu):
    work = DriftingWork(gpu, drift=0.0)
    ms = timing.device_interleaved_timer([work.fn("a", 0.5), work.fn("b", 0.25)], warmup=1, reps=6,
                                         max_ms=1000.0, group_ms=0.0)
    assert ms == [pytest.approx(0.5), pytest.approx(0.25)]
    # each function's warm-up, issue probe and device probe, then six turns: a b, b a, ...
    assert gpu.log == ["a"] * 3 + ["b"] * 3 + ["a", "b", "b", "a"] * 3
    assert len(gpu.holds) == 3 and gpu.holds[2] > gpu.holds[0]  # two probes' holds, then one for all the turns


def test_short_programs_run_in_groups_of_about_group_ms_back_to_back(gpu):
    work = DriftingWork(gpu, drift=0.0)
    ms = timing.device_interleaved_timer([work.fn("a", 0.5), work.fn("b", 0.25)], warmup=1, reps=6,
                                         max_ms=1000.0, group_ms=1.0)
    assert ms == [pytest.approx(0.5), pytest.approx(0.25)]  # per call, not per group
    turns = gpu.log[6:]
    assert turns == (["a"] * 2 + ["b"] * 4 + ["b"] * 4 + ["a"] * 2) * 3  # 1 ms of each in turn


def test_a_group_of_very_short_calls_is_capped(gpu):
    work = DriftingWork(gpu, drift=0.0)
    ms = timing.device_interleaved_timer([work.fn("a", 1e-5)], warmup=0, reps=5, max_ms=1000.0, group_ms=1.0)
    assert ms == [pytest.approx(1e-5)]
    assert gpu.log.count("a") == 2 + 5 * 256  # two probes, then five turns of 256 calls, not of 1000


def test_the_interleaved_timer_caps_turns_by_the_time_of_all_functions(gpu):
    work = DriftingWork(gpu, drift=0.0)
    timing.device_interleaved_timer([work.fn("a", 3.0), work.fn("b", 5.0)], warmup=0, reps=50, max_ms=80.0,
                                    group_ms=1.0)  # one call per group: each takes longer than a group
    assert gpu.log.count("a") == 2 + 10 and gpu.log.count("b") == 2 + 10  # two probes each, then 80 ms / 8 ms turns


def test_a_clock_drifting_within_a_round_cancels_in_interleaved_calls_not_in_blocks(gpu):
    # a is 3% faster than b; the clock slows by 0.5% per call
    work = DriftingWork(gpu, drift=0.005)
    a, b = work.fn("a", 0.97), work.fn("b", 1.0)
    ms_a, ms_b = timing.device_interleaved_timer([a, b], warmup=0, reps=20, max_ms=1000.0, group_ms=0.0)
    assert ms_a / ms_b == pytest.approx(0.97, abs=0.002)
    work.calls = 0
    block_a = timing.device_block_timer(a, warmup=0, reps=20, max_ms=1000.0)
    block_b = timing.device_block_timer(b, warmup=0, reps=20, max_ms=1000.0)
    assert block_a / block_b < 0.90  # one block after the other: b's ran on a slower clock


def test_the_interleaved_timer_needs_a_function(gpu):
    with pytest.raises(LoweringError, match="at least one function"):
        timing.device_interleaved_timer([])
