"""The CUDA-event timers' control flow, on CPU: a fake GPU whose events count
device work (each call of the timed function is ``per_call_ms`` of it, each
L2 flush none), so what a timer returns, how often it calls and flushes, and
when it holds the GPU longer can be checked without CUDA."""

from __future__ import annotations

import time

import pytest
import torch

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
