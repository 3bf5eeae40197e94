"""The nvgemm pass's eager race: the rewritten program, called eagerly, is
never slower than the unrewritten one. On CPU, with injected timers that
say which program is faster (``ProgramRace(devices=("cpu",))`` lets a CPU
program race; by default only CUDA programs do)."""

from __future__ import annotations

import math
import random
import re
import statistics

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import branchyard
from branchyard.errors import LoweringError
from branchyard.fx.pass_infra import Pipeline
from branchyard.lowering.nvgemm import program_race as race_mod
from branchyard.lowering.nvgemm.fuse import NvGemmPass, chain_group, nvgemm
from branchyard.lowering.nvgemm.program_race import CALLINGS, MARGINS, Comparison, ProgramRace, Variant

FUSED = torch.ops.branchyard.fused_gemm_epilogue.default

pytestmark = pytest.mark.filterwarnings("ignore::branchyard.lowering.nvgemm.op.NvGemmFallbackWarning")


class Block(nn.Module):
    """Two chains of different problems: fc1 + bias + silu, fc2 + bias + residual."""

    def __init__(self, d: int = 16, h: int = 32):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)

    def forward(self, x):
        return self.fc2(torch.nn.functional.silu(self.fc1(x))) + x


def _block_ep(m: int = 4):
    torch.manual_seed(0)
    block = Block().eval()
    x = torch.randn(m, 16)
    return block, x, torch.export.export(block, (x,))


def _fused_specs(program) -> list[str]:
    graph = program.graph if hasattr(program, "graph") else program.graph_module.graph
    return sorted(n.args[3] for n in graph.nodes if n.target is FUSED)


class FakeClock:
    """A timer for the race: a program's time is ``base`` plus each fused group's
    delta (groups named by a word of their label). Runs every variant it times,
    checking that its output matches the unrewritten program's."""

    def __init__(self, base: float, deltas: dict[str, float], reference=None):
        self.base, self.deltas, self.reference = base, deltas, reference
        self.timed: list[frozenset[str]] = []

    def us(self, fused: frozenset[str]) -> float:
        total = self.base
        for group in fused:
            total += sum(d for word, d in self.deltas.items() if word in group)
        return total

    def __call__(self, variant: Variant) -> float:
        self.timed.append(variant.fused)
        out = variant.run()  # an ExportedProgram's graph returns its flat outputs
        if self.reference is not None:
            torch.testing.assert_close(list(out), [self.reference()], rtol=1e-4, atol=1e-4)
        return self.us(variant.fused) / 1e3


def _race(clock: FakeClock, **kw) -> ProgramRace:
    return ProgramRace(timer=clock, devices=("cpu",), blocks=kw.pop("blocks", 3), **kw)


def test_a_slower_rewrite_leaves_every_chain_unfused_and_says_why():
    block, x, ep = _block_ep()
    clock = FakeClock(100.0, {"silu": 5.0, "residual": 7.0})  # each fused chain adds host time
    p = NvGemmPass(race=_race(clock)).bind_inputs(ep)
    out = Pipeline([p])(ep)
    assert _fused_specs(out.program) == [] and out.modified is False
    assert p.report.stats["fused"] == 0
    assert p.report.stats["race"] == ("raced eagerly: 100.0 us per call against 100.0 us unrewritten; "
                                      "2 chain(s) left unfused")
    left = [s for s in p.report.skips if s.reason.startswith("left unfused")]
    assert {s.where.split("'")[1] for s in left} == {"linear", "linear_1"}
    silu = next(s.reason for s in left if "'linear'" in s.where)
    assert "w=nk;bias@0;silu;out=float32 [4x16 @ 32x16, 32]" in silu
    assert "112.0 us per call fused, 107.0 us unfused" in silu  # the first greedy step, both chains fused
    torch.testing.assert_close(out.program.module()(x), block(x))


def test_a_faster_rewrite_keeps_every_chain():
    block, x, ep = _block_ep()
    clock = FakeClock(100.0, {"silu": -5.0, "residual": -7.0}, reference=lambda: ep.module()(x))
    p = NvGemmPass(race=_race(clock)).bind_inputs(ep)
    out = Pipeline([p])(ep).program
    assert _fused_specs(out) == ["w=nk;bias@0;residual@1;out=float32", "w=nk;bias@0;silu;out=float32"]
    assert p.report.stats["fused"] == 2 and not [s for s in p.report.skips if "left unfused" in s.reason]
    assert p.race_result is not None and p.race_result.result_us == 88.0 and p.race_result.unrewritten_us == 100.0
    assert len(p.report.stats["race_decisions"]) == 2
    assert all(d.kept_fused for d in p.race_result.decisions)
    torch.testing.assert_close(out.module()(x), block(x))


def test_mixed_verdicts_keep_exactly_the_winning_chains():
    block, x, ep = _block_ep()
    clock = FakeClock(100.0, {"silu": -5.0, "residual": 9.0}, reference=lambda: ep.module()(x))
    out = nvgemm(ep, race=_race(clock))
    assert _fused_specs(out) == ["w=nk;bias@0;silu;out=float32"]
    torch.testing.assert_close(out.module()(x), block(x))
    # every program the race timed computed what the unrewritten one does (the clock checked)
    assert {len(f) for f in clock.timed} == {0, 1, 2}


@pytest.mark.parametrize("seed", range(6))
def test_with_additive_costs_the_race_keeps_the_best_set_and_is_never_slower(seed):
    rng = random.Random(seed)
    groups = [f"g{i}" for i in range(rng.randint(1, 6))]
    delta = {g: rng.uniform(-10, 10) for g in groups}
    us = lambda fused: 100.0 + sum(delta[g] for g in fused)  # noqa: E731
    result = ProgramRace(timer=lambda v: us(v.fused) / 1e3, blocks=1, margin=0.0).run(
        groups, lambda fused: Variant(fused, lambda: None))
    assert result.fused == frozenset(g for g in groups if delta[g] < 0)
    assert result.result_us == pytest.approx(us(result.fused)) and result.result_us <= 100.0 + 1e-9
    assert result.unrewritten_us == pytest.approx(100.0)


@pytest.mark.parametrize("gain_us, kept", [(1.0, False), (2.9, False), (3.1, True), (8.0, True)])
def test_a_fused_group_must_win_by_the_margin(gain_us, kept):
    us = {frozenset(): 100.0, frozenset({"g"}): 100.0 - gain_us}
    result = ProgramRace(timer=lambda v: us[v.fused] / 1e3, blocks=1, margin=0.03).run(
        ["g"], lambda fused: Variant(fused, lambda: None))
    assert result.fused == (frozenset({"g"}) if kept else frozenset())
    assert result.result_us == pytest.approx(100.0 - gain_us if kept else 100.0)
    assert [d.kept_fused for d in result.decisions] == [kept]


@pytest.mark.parametrize("margin", [-0.1, 1.0, "3%", True])
def test_a_margin_outside_zero_to_one_is_a_clear_error(margin):
    with pytest.raises(LoweringError, match=r"margin=.*fraction in \[0, 1\)"):
        ProgramRace(margin=margin)


@pytest.mark.parametrize("calling, gain_us, kept", [
    ("graph", 0.9, False), ("graph", 1.5, True), ("eager", 1.5, False), ("eager", 3.5, True)])
def test_the_default_margin_is_lower_for_graph_replays(calling, gain_us, kept):
    # device-timed replays are steady: 1% of a long program can be one GEMM's real gain
    us = {frozenset(): 100.0, frozenset({"g"}): 100.0 - gain_us}
    result = ProgramRace(timer=lambda v: us[v.fused] / 1e3, blocks=3).run(
        ["g"], lambda fused: Variant(fused, lambda: None, calling=calling))
    assert result.fused == (frozenset({"g"}) if kept else frozenset())
    assert result.decisions[-1].needed == pytest.approx(MARGINS[calling])


def test_an_explicit_margin_holds_for_both_callings():
    us = {frozenset(): 100.0, frozenset({"g"}): 98.5}
    race = ProgramRace(timer=lambda v: us[v.fused] / 1e3, blocks=3, margin=0.02)
    for calling in CALLINGS:
        result = race.run(["g"], lambda fused: Variant(fused, lambda: None, calling=calling))
        assert result.fused == frozenset() and result.decisions[-1].needed == pytest.approx(0.02)


class NoisyClock:
    """The unfused program's blocks vary by ``noise`` in turn from one round to the
    next while the fused ones do not; counts the blocks timed."""

    def __init__(self, us: dict, noise=(-4.0, 0.0, 4.0)):
        self.us, self.noise, self.calls, self.unfused = us, noise, 0, 0

    def __call__(self, v: Variant) -> float:
        self.calls += 1
        extra = 0.0
        if not v.fused:
            extra, self.unfused = self.noise[self.unfused % len(self.noise)], self.unfused + 1
        return (self.us[v.fused] + extra) / 1e3


def _graph_race(race: ProgramRace):
    return race.run(["g"], lambda fused: Variant(fused, lambda: None, calling="graph"))


def test_a_noisy_timing_asks_for_a_win_larger_than_its_spread():
    # +-4 us of noise: the rounds' ratios spread by 8% (IQR over median), and in 9 rounds a 5% win is within it
    base = {frozenset(): 100.0, frozenset({"g"}): 95.0}
    result = _graph_race(ProgramRace(timer=NoisyClock(base), blocks=9, max_blocks=9))
    decision = result.decisions[-1]
    assert result.fused == frozenset()
    assert decision.fused_us == pytest.approx(95.0) and decision.unfused_us == pytest.approx(100.0)
    assert decision.needed == pytest.approx(0.08, abs=1e-3) and decision.won == pytest.approx(0.05)
    assert "5.0% faster round by round (9 rounds), a win of 8.0% needed" in str(decision)
    # the same win on steady timings is kept
    steady = ProgramRace(timer=lambda v: base[v.fused] / 1e3, blocks=9).run(
        ["g"], lambda fused: Variant(fused, lambda: None, calling="graph"))
    assert steady.fused == frozenset({"g"})


def test_a_win_within_the_noise_of_9_rounds_is_confirmed_by_more_rounds():
    # the 5% win above: 27 rounds bring the bar to 8% * sqrt(9 / 27) = 4.6%, the same three standard errors
    clock = NoisyClock({frozenset(): 100.0, frozenset({"g"}): 95.0})
    result = _graph_race(ProgramRace(timer=clock, blocks=9))
    decision = result.decisions[-1]
    assert result.fused == frozenset({"g"}) and decision.rounds == 27 and clock.calls == 2 * 27
    assert decision.needed == pytest.approx(0.08 * (9 / 27) ** 0.5, abs=1e-3) and decision.won == pytest.approx(0.05)
    assert "5.0% faster round by round (27 rounds), a win of 4.6% needed" in str(decision)


@pytest.mark.parametrize("fused_us, why", [
    (100.0, "a tie"), (104.0, "a loss"),
    (98.0, "a 2% win, under what 27 rounds could confirm (4.6%)")])
def test_only_a_win_that_more_rounds_could_confirm_gets_them(fused_us, why):
    clock = NoisyClock({frozenset(): 100.0, frozenset({"g"}): fused_us})
    result = _graph_race(ProgramRace(timer=clock, blocks=9))
    assert result.fused == frozenset() and clock.calls == 2 * 9, why
    assert result.decisions[-1].rounds == 9


def test_more_rounds_go_on_alternating_which_program_runs_first():
    order: list[str] = []
    clock = NoisyClock({frozenset(): 100.0, frozenset({"x"}): 96.0})

    def timer(v: Variant) -> float:
        order.append("a" if v.fused else "b")
        return clock(v)

    timed = ProgramRace(timer=timer, blocks=3, max_blocks=9).compare(
        Variant(frozenset({"x"}), lambda: None, calling="graph"), Variant(frozenset(), lambda: None, calling="graph"))
    # a 4% win, within the ratios' spread of 4% in three rounds and 8% in six or nine: timed to max_blocks
    assert len(timed.a) == 9 and not ProgramRace(blocks=3, max_blocks=9).wins(timed, "graph")
    assert "".join(order) == "abbaab" + "baabba" + "abbaab"  # round by round: a first, b first, ...


def _noisy_race_gain(seed: int, max_blocks: int) -> float:
    """One random program (1-4 groups, each changing its time by -6% to +3%) raced on a
    clock with Gaussian noise of 0.5-3% per block and a drift: the kept program's true
    time over the unrewritten program's."""
    rng = random.Random(seed)
    groups = [f"g{i}" for i in range(rng.randint(1, 4))]
    delta = {g: rng.uniform(-0.06, 0.03) for g in groups}
    true_us = lambda fused: 100.0 * (1 + sum(delta[g] for g in fused))  # noqa: E731
    sigma, blocks = rng.choice([0.005, 0.01, 0.02, 0.03]), [0]

    def timer(v: Variant) -> float:
        blocks[0] += 1
        return true_us(v.fused) * (1 + 0.002 * (blocks[0] // 2)) * (1 + rng.gauss(0, sigma)) / 1e3

    result = ProgramRace(timer=timer, blocks=9, max_blocks=max_blocks).run(
        groups, lambda fused: Variant(fused, lambda: None, calling="graph"))
    return true_us(result.fused) / true_us(frozenset())


def test_on_noisy_clocks_more_rounds_keep_more_real_wins_and_never_a_slower_program():
    nine = [_noisy_race_gain(seed, max_blocks=9) for seed in range(150)]
    more = [_noisy_race_gain(seed, max_blocks=27) for seed in range(150)]
    assert max(nine) <= 1.0 and max(more) <= 1.0  # never slower than the program as it was, in true time
    assert statistics.mean(more) < statistics.mean(nine) - 0.002  # and faster on average (0.4% here)


def test_max_blocks_below_blocks_is_refused():
    with pytest.raises(LoweringError, match="max_blocks=3: at least blocks=9"):
        ProgramRace(blocks=9, max_blocks=3)


class DriftingClock:
    """Both programs' blocks on a clock that slows by ``drift`` per round (a GPU
    heating up at its power limit): round ``r`` of a variant takes
    ``us[fused] * (1 + drift * r)``, ``jitter`` added to the unfused program's blocks in turn."""

    def __init__(self, us: dict, drift: float, jitter: tuple[float, ...] = (0.0,)):
        self.us, self.drift, self.jitter = us, drift, jitter
        self.blocks: dict[frozenset, int] = {}

    def __call__(self, v: Variant) -> float:
        r = self.blocks.get(v.fused, 0)
        self.blocks[v.fused] = r + 1
        extra = 0.0 if v.fused else self.jitter[r % len(self.jitter)]
        return (self.us[v.fused] * (1 + self.drift * r) + extra) / 1e3


def test_a_drifting_clock_does_not_hide_a_win_made_in_every_round():
    # each program's blocks spread by ~12% as the clock drifts 3% per round, but within every round the
    # fused program is 3% faster: the ratios do not spread, and the 3% win clears the 1% floor
    clock = DriftingClock({frozenset(): 100.0, frozenset({"g"}): 97.0}, drift=0.03)
    result = ProgramRace(timer=clock, blocks=9).run(["g"], lambda fused: Variant(fused, lambda: None, calling="graph"))
    decision = result.decisions[-1]
    assert result.fused == frozenset({"g"})
    assert decision.won == pytest.approx(0.03) and decision.needed == pytest.approx(MARGINS["graph"])
    timed = ProgramRace(timer=DriftingClock(clock.us, drift=0.03), blocks=9).compare(
        Variant(frozenset({"g"}), lambda: None), Variant(frozenset(), lambda: None))
    assert _spread_of(timed.b) > 0.1 and timed.spread < 1e-9


def test_a_drifting_clock_does_not_make_a_win_out_of_a_tie():
    for jitter in ((0.0,), (-3.0, 0.0, 3.0)):
        clock = DriftingClock({frozenset(): 100.0, frozenset({"g"}): 100.0}, drift=0.05, jitter=jitter)
        result = ProgramRace(timer=clock, blocks=9).run(
            ["g"], lambda fused: Variant(fused, lambda: None, calling="graph"))
        assert result.fused == frozenset() and not result.decisions[-1].kept_fused


def test_a_comparison_needs_one_block_of_each_program_per_round():
    with pytest.raises(LoweringError, match="one block of each program per round .got 2 and 3 blocks"):
        Comparison((1.0, 2.0), (1.0, 2.0, 3.0))


def _spread_of(samples) -> float:
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return (q3 - q1) / statistics.median(samples)


def test_compare_interleaves_the_two_programs_and_takes_medians():
    order: list[str] = []
    drift = iter(range(100))

    def timer(v: Variant) -> float:  # a clock that drifts up by 1 us per block
        order.append(v.name)
        return (10.0 * len(v.fused) + next(drift)) / 1e3

    a, b = Variant(frozenset({"x"}), lambda: None), Variant(frozenset(), lambda: None)
    timed = ProgramRace(timer=timer, blocks=4).compare(a, b)
    a_us, b_us = timed.a_us, timed.b_us
    assert order == ["fusing x", "unrewritten", "unrewritten", "fusing x"] * 2
    # a's blocks at drift 0, 3, 4, 7 and b's at 1, 2, 5, 6: equal medians apart from the 10 us
    assert (a_us, b_us) == (pytest.approx(13.5), pytest.approx(3.5))


def test_graph_replays_are_timed_interleaved_in_each_round_and_eager_calls_in_turn(monkeypatch):
    calls: list[tuple[str, ...]] = []
    runs = {"a": lambda: None, "b": lambda: None}
    names = {id(f): n for n, f in runs.items()}

    def interleaved(fns, **kw):  # a 10 us, b 12 us, whichever goes first
        calls.append(tuple(names[id(f)] for f in fns))
        return [0.010 if names[id(f)] == "a" else 0.012 for f in fns]

    monkeypatch.setattr(race_mod, "device_interleaved_timer", interleaved)
    monkeypatch.setattr(race_mod, "host_timer", lambda fn, **kw: calls.append(("host", names[id(fn)])) or 0.02)
    a = Variant(frozenset({"x"}), runs["a"], calling="graph")
    b = Variant(frozenset(), runs["b"], calling="graph")
    timed = ProgramRace(blocks=4).compare(a, b)
    assert calls == [("a", "b"), ("b", "a")] * 2  # one interleaved window per round, first place alternating
    assert timed.a == (10.0,) * 4 and timed.b == (12.0,) * 4
    calls.clear()
    eager = ProgramRace(blocks=2).compare(Variant(a.fused, runs["a"]), Variant(b.fused, runs["b"]))
    assert calls == [("host", "a"), ("host", "b"), ("host", "b"), ("host", "a")] and eager.ratio == 1.0


def test_a_given_pair_timer_times_every_round_and_a_given_timer_replaces_the_interleaving():
    seen: list[str] = []

    def pair(first: Variant, second: Variant) -> tuple[float, float]:
        seen.append(first.name)
        return (len(first.fused) + 1) / 1e3, (len(second.fused) + 1) / 1e3

    a, b = Variant(frozenset({"x"}), lambda: None, calling="graph"), Variant(frozenset(), lambda: None, calling="graph")
    timed = ProgramRace(pair_timer=pair, blocks=3).compare(a, b)
    assert seen == ["fusing x", "unrewritten", "fusing x"] and timed.a == (2.0,) * 3 and timed.b == (1.0,) * 3
    per_variant = ProgramRace(timer=lambda v: (len(v.fused) + 3) / 1e3, blocks=2).compare(a, b)
    assert per_variant.a == (4.0,) * 2 and per_variant.b == (3.0,) * 2


def test_identical_chains_are_one_group_decided_together():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x):
            return torch.relu(self.b(torch.relu(self.a(x))))

    x = torch.randn(4, 16)
    ep = torch.export.export(Twice().eval(), (x,))
    clock = FakeClock(50.0, {"relu": 3.0})
    p = NvGemmPass(race=_race(clock)).bind_inputs(ep)
    out = Pipeline([p])(ep).program
    assert _fused_specs(out) == []
    assert {len(f) for f in clock.timed} == {0, 1}  # one group: all fused or none
    assert len([s for s in p.report.skips if "left unfused" in s.reason]) == 2
    assert p.report.stats["race_decisions"] == [
        "w=nk;bias@0;relu;out=float32 [4x16 @ 16x16, 16]: left unfused (53.0 us per call fused, 50.0 us unfused; "
        "6.0% slower round by round (3 rounds), a win of 3.0% needed)"]


class FakeCapture:
    """A CPU stand-in for ``ProgramRace.capture``: records the timing mode it
    was called under and replays by calling the program; ``fail_when(fused
    chain count)`` makes it raise for those programs."""

    def __init__(self, fail_when=lambda n_fused: False):
        self.modes: list[str] = []
        self.fail_when = fail_when

    def __call__(self, gm, inputs):
        from branchyard.lowering.nvgemm.timing import current_timing_mode

        self.modes.append(current_timing_mode())
        if self.fail_when(len(_fused_specs(gm))):
            raise RuntimeError("operation not permitted when stream is capturing\nmore detail")
        return lambda: gm(*inputs)


def test_graph_calling_races_replays_of_captured_programs():
    block, x, ep = _block_ep()
    clock = FakeClock(100.0, {"silu": -5.0, "residual": 9.0}, reference=lambda: ep.module()(x))
    capture = FakeCapture()
    p = NvGemmPass("graph", race=_race(clock, capture=capture)).bind_inputs(ep)
    out = Pipeline([p])(ep).program
    assert _fused_specs(out) == ["w=nk;bias@0;silu;out=float32"]
    # every timed program was captured first, once, with the fused ops tuning for device time
    assert len(capture.modes) == len(set(clock.timed)) == 4 and set(capture.modes) == {"device"}
    assert p.report.stats["race"] == ("raced in a CUDA graph: 95.0 us per replay against 100.0 us unrewritten; "
                                      "1 chain(s) left unfused")
    (left,) = [s.reason for s in p.report.skips if s.reason.startswith("left unfused")]
    assert left.startswith("left unfused: the program replayed from a CUDA graph is faster without it (")
    assert "104.0 us per call fused, 95.0 us unfused" in left
    torch.testing.assert_close(out.module()(x), block(x))


def test_the_eager_race_captures_nothing_and_tunes_for_host_time():
    _, x, ep = _block_ep()
    modes: list[str] = []

    def timer(v: Variant) -> float:
        from branchyard.lowering.nvgemm.timing import current_timing_mode

        modes.append(current_timing_mode())
        assert v.calling == "eager"
        return (100.0 - 5.0 * len(v.fused)) / 1e3

    capture = FakeCapture()
    out = nvgemm(ep, race=ProgramRace(timer=timer, devices=("cpu",), blocks=1, capture=capture))
    assert len(_fused_specs(out)) == 2 and capture.modes == [] and set(modes) == {"host"}


def test_a_graph_program_that_cannot_be_captured_is_fused_as_without_a_race():
    _, _, ep = _block_ep()
    clock = FakeClock(100.0, {"silu": 50.0, "residual": 50.0})
    p = NvGemmPass("graph", race=_race(clock, capture=FakeCapture(lambda n: True))).bind_inputs(ep)
    out = Pipeline([p])(ep).program
    assert len(_fused_specs(out)) == 2 and clock.timed == []
    assert p.report.stats["race"] == ("not raced: the unrewritten program could not be captured into a CUDA "
                                      "graph: RuntimeError: operation not permitted when stream is capturing")


def test_a_fused_program_that_cannot_be_captured_is_not_kept(caplog):
    block, x, ep = _block_ep()
    clock = FakeClock(100.0, {"silu": -50.0, "residual": -50.0})  # fused would win, if it could be replayed
    p = NvGemmPass("graph", race=_race(clock, capture=FakeCapture(lambda n: n > 0))).bind_inputs(ep)
    with caplog.at_level("WARNING", logger="branchyard"):
        out = Pipeline([p])(ep)
    assert _fused_specs(out.program) == [] and not out.modified and clock.timed == []
    failure = ("the program fusing 2 group(s) could not be captured into a CUDA graph: RuntimeError: operation "
               "not permitted when stream is capturing")
    assert p.report.stats["race"] == f"raced in a CUDA graph: {failure}; 2 chain(s) left unfused"
    left = [s.reason for s in p.report.skips if s.reason.startswith("left unfused")]
    assert left == [f"left unfused: {failure}"] * 2
    assert "could not be captured into a CUDA graph" in caplog.text
    torch.testing.assert_close(out.program.module()(x), block(x))


def test_graph_calling_without_a_capture_for_control_flow_fuses_everything_and_says_why():
    block = Branchy().eval()
    x, f = torch.randn(4, 16), torch.tensor([1])
    ep = torch.export.export(block, (x, f))
    clock = FakeClock(100.0, {"relu": 50.0, "sigmoid": 50.0})
    p = NvGemmPass("graph", race=_race(clock)).bind_inputs(ep)
    out = Pipeline([p])(ep).program
    assert len(_all_fused_specs(out.graph_module)) == 2 and clock.timed == []
    assert re.fullmatch(r"not raced: calling='graph' and the program has control flow \('cond(_\d+)?'\), which "
                        r"one CUDA-graph capture of a call cannot replay \(ProgramRace\(capture=\.\.\.\) can race "
                        r"it\)", p.report.stats["race"]), p.report.stats["race"]
    # a capture that can replay control flow (the CUDA-graph lowering's, say) races it
    p = NvGemmPass("graph", race=_race(clock, capture=FakeCapture())).bind_inputs(ep)
    Pipeline([p])(ep)
    assert p.report.stats["race"].startswith("raced in a CUDA graph: ") and clock.timed


class ReadsOnHost(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, n):
        k = n.item()
        torch._check(k >= 0)
        torch._check(k <= x.shape[0])
        return torch.relu(self.fc(x))[:k]


def test_graph_calling_of_a_program_that_reads_the_gpu_on_the_host_is_not_raced():
    x, n = torch.randn(4, 16), torch.tensor(3)
    ep = torch.export.export(ReadsOnHost().eval(), (x, n))
    clock = FakeClock(100.0, {"relu": 50.0})
    p = NvGemmPass("graph", race=_race(clock)).bind_inputs(ep)
    out = Pipeline([p])(ep).program
    assert len(_fused_specs(out)) == 1 and clock.timed == []
    assert re.fullmatch(r"not raced: calling='graph' and '\w+' reads a GPU value on the host, which a CUDA-graph "
                        r"capture cannot do", p.report.stats["race"]), p.report.stats["race"]


def test_a_cpu_program_is_not_raced_by_default_and_the_report_says_why():
    _, x, ep = _block_ep()
    clock = FakeClock(100.0, {"silu": 50.0})
    p = NvGemmPass(race=ProgramRace(timer=clock)).bind_inputs(ep)
    out = Pipeline([p])(ep).program
    assert len(_fused_specs(out)) == 2 and clock.timed == []
    assert p.report.stats["race"] == ("not raced: the program runs on cpu, where the fused op runs the original "
                                      "ATen ops (races run on cuda)")


@pytest.mark.parametrize("bad", ["cuda_graph", "EAGER", None, 1])
def test_a_bad_calling_value_is_an_error_naming_it(bad):
    _, _, ep = _block_ep()
    with pytest.raises(LoweringError, match=f"calling={bad!r} is not a way to call a program") as info:
        nvgemm(ep, calling=bad)
    assert "calling='eager'" in str(info.value) and "calling='graph'" in str(info.value)
    with pytest.raises(LoweringError, match=f"NvGemmPass: calling={bad!r}"):
        NvGemmPass(bad)
    p = NvGemmPass()
    with pytest.raises(LoweringError, match=f"calling={bad!r}"):
        p.calling = bad


def test_race_blocks_must_be_positive():
    with pytest.raises(LoweringError, match="blocks=0"):
        ProgramRace(blocks=0)


def _dynamic_ep():
    block = Block().eval()
    x = torch.randn(6, 16)
    return block, x, torch.export.export(block, (x,), dynamic_shapes=({0: torch.export.Dim("m", min=2, max=64)},))


def test_symbolic_sizes_without_example_inputs_are_not_raced():
    _, _, ep = _dynamic_ep()
    clock = FakeClock(10.0, {"silu": -1.0})
    p = NvGemmPass(race=_race(clock))  # not bound to the program: its graph alone has no example inputs
    res = p(ep.graph_module)
    assert res.modified and clock.timed == []
    assert re.fullmatch(r"not raced: input 'x' has symbolic sizes \[s\d+, 16\] and the program has no "
                        r"example inputs", p.report.stats["race"])


def test_a_dynamic_program_races_on_its_example_inputs():
    _, _, ep = _dynamic_ep()
    seen: list[tuple[int, ...]] = []
    inputs = race_mod.program_inputs(ep)
    assert inputs is not None and inputs[-1] is ep.example_inputs[0][0]
    assert inputs[0] is ep.state_dict["fc1.weight"]  # the program's own parameters, not copies

    def timer(v: Variant) -> float:
        seen.append(tuple(v.run()[0].shape))
        return (100.0 - 5.0 * len(v.fused)) / 1e3  # each fused chain wins 5%

    out = nvgemm(ep, race=ProgramRace(timer=timer, devices=("cpu",), blocks=1))
    assert len(_fused_specs(out)) == 2 and set(seen) == {(6, 16)}


def test_a_graph_module_races_on_random_inputs_of_its_example_shapes():
    gm = make_fx(lambda x, w, b: torch.relu(x @ w + b))(torch.randn(4, 8), torch.randn(8, 16), torch.randn(16))
    shapes: list[tuple[int, ...]] = []

    def timer(v: Variant) -> float:
        shapes.append(tuple(v.run().shape))
        return (20.0 + 5.0 * len(v.fused)) / 1e3

    out = nvgemm(gm, race=ProgramRace(timer=timer, devices=("cpu",), blocks=1))
    assert _fused_specs(out) == [] and set(shapes) == {(4, 16)}


def test_placeholder_inputs_say_what_they_cannot_make():
    gm = make_fx(lambda x, w: x @ w)(torch.randn(4, 8), torch.randn(8, 16))
    values, why = race_mod.placeholder_inputs(gm, [None, torch.ones(8, 16)])
    assert why is None and values[0].shape == (4, 8) and values[1] is not None and bool((values[1] == 1).all())
    values, why = race_mod.placeholder_inputs(gm, [None])
    assert values is None and why == "1 example values for 2 graph inputs"
    ints = make_fx(lambda i, w: w[i])(torch.tensor([0, 1]), torch.randn(8, 16))
    values, _ = race_mod.placeholder_inputs(ints)
    assert values[0].dtype == torch.int64 and bool((values[0] == 0).all())  # indices stay in range


def test_the_unrewritten_program_failing_on_race_inputs_means_no_race():
    def f(i, x, w):
        return torch.relu(x[i] @ w)

    gm = make_fx(f)(torch.tensor([0, 1]), torch.randn(4, 8), torch.randn(8, 16))
    p = NvGemmPass(race=ProgramRace(timer=lambda v: 1.0, devices=("cpu",)),
                   example_inputs=[torch.tensor([7, 9]), None, None])  # out of range for x
    assert p(gm).modified
    assert p.report.stats["race"].startswith("not raced: the unrewritten program failed on the race inputs: ")


def test_chain_group_names_spec_and_shapes():
    gm = make_fx(lambda x, w, r: torch.relu(x @ w) + r)(torch.randn(4, 8), torch.randn(8, 16), torch.randn(4, 16))
    from branchyard.lowering.nvgemm.matcher import match_chain

    root = next(n for n in gm.graph.nodes if n.op == "call_function")
    assert chain_group(match_chain(root)) == "w=kn;relu;residual@0;out=float32 [4x8 @ 8x16, 4x16]"


def test_compile_tells_the_pass_how_the_program_is_called():
    from branchyard import compiler

    block, x, _ = _block_ep()
    fast = branchyard.compile(block, (x,), passes=("nvgemm",), cuda_graph=False)
    (report,) = fast.report.pass_reports
    assert report.stats["race"].startswith("not raced: the program runs on cpu")  # eager calls, CPU program
    torch.testing.assert_close(fast(x), block(x))
    ep = torch.export.export(block, (x,))
    graph_report = compiler.CompileReport()
    compiler._run_pass("nvgemm", ep, graph_report, cuda_graph=True)
    assert graph_report.pass_reports[0].stats["race"].startswith("not raced: the program runs on cpu")


@pytest.mark.parametrize("cuda_graph, raced", [(True, "raced in a CUDA graph: "), (False, "raced eagerly: ")])
def test_compile_races_the_program_the_way_it_will_be_called(monkeypatch, cuda_graph, raced):
    from branchyard import compiler
    from branchyard.lowering.nvgemm import fuse

    _, _, ep = _block_ep()
    capture = FakeCapture()
    clock = FakeClock(100.0, {"silu": -5.0, "residual": -5.0})
    monkeypatch.setattr(fuse, "ProgramRace", lambda: _race(clock, capture=capture))
    report = compiler.CompileReport()
    compiler._run_pass("nvgemm", ep, report, cuda_graph=cuda_graph)
    assert report.pass_reports[0].stats["race"].startswith(raced)
    assert bool(capture.modes) is cuda_graph


class Branchy(nn.Module):
    """A chain in each branch of a torch.cond: relu after one linear, sigmoid after the other."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x, flag):
        return torch.cond(flag.sum() > 0, lambda t: torch.relu(self.a(t)),
                          lambda t: torch.sigmoid(self.b(t)), (x,))


def _all_fused_specs(gm) -> list[str]:
    return sorted(n.args[3] for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
                  for n in m.graph.nodes if n.target is FUSED)


@pytest.mark.parametrize("flag", [1, -1])
def test_chains_inside_cond_branches_race_like_top_level_ones(flag):
    torch.manual_seed(0)
    block = Branchy().eval()
    x, f = torch.randn(4, 16), torch.tensor([flag])
    ep = torch.export.export(block, (x, f))
    clock = FakeClock(100.0, {"relu": -5.0, "sigmoid": 5.0}, reference=lambda: ep.module()(x, f))
    out = nvgemm(ep, race=_race(clock))
    assert _all_fused_specs(out.graph_module) == ["w=nk;bias@0;relu;out=float32"]
    for g in (torch.tensor([1]), torch.tensor([-1])):  # both branches compute what the block does
        torch.testing.assert_close(out.module()(x, g), block(x, g))


def _tensors(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A module's own tensors: parameters, buffers and plain tensor attributes."""
    out = dict(m.named_parameters(recurse=False)) | dict(m.named_buffers(recurse=False))
    return out | {n: t for n, t in vars(m).items() if isinstance(t, torch.Tensor)}


def test_a_graph_module_with_weights_as_attributes_races_without_copying_them():
    torch.manual_seed(0)
    block = Block().eval()
    x = torch.randn(4, 16)
    gm = make_fx(block)(x)
    weights = {id(t) for t in _tensors(gm).values()}
    assert len(weights) == 4
    held: list[set[int]] = []

    def timer(v: Variant) -> float:
        # the race's programs hold the very tensors of the program, not copies
        held.append({id(t) for t in _tensors(v.program).values()})
        assert len(_fused_specs(v.program)) == len(v.fused)  # the program fuses what the variant says
        return (100.0 - 3.0 * len(v.fused)) / 1e3

    p = NvGemmPass(race=ProgramRace(timer=timer, devices=("cpu",), blocks=1))
    out = p(gm).graph_module
    assert held and all(h == weights for h in held)
    assert len(_fused_specs(out)) == 2
    torch.testing.assert_close(out(x), block(x))


def test_copy_graph_module_shares_tensors_only_when_asked():
    from branchyard.fx.graph_walk import copy_graph_module

    gm = make_fx(Block().eval())(torch.randn(4, 16))
    tensors = _tensors(gm)
    assert len(tensors) == 4
    shared = copy_graph_module(gm, share_tensors=True)
    copied = copy_graph_module(gm)
    for name, t in tensors.items():
        assert getattr(shared, name) is t
        assert getattr(copied, name) is not t and torch.equal(getattr(copied, name), t)
    assert [n.name for n in shared.graph.nodes] == [n.name for n in gm.graph.nodes]


def test_no_race_while_tracing_with_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    _, _, ep = _block_ep()
    clock = FakeClock(100.0, {"silu": 50.0, "residual": 50.0})
    p = NvGemmPass(race=_race(clock))
    gm = ep.graph_module
    with FakeTensorMode(allow_non_fake_inputs=True):
        assert p.run(gm)
    assert clock.timed == [] and p.report.stats["race"] == (
        "not raced: called while tracing with fake tensors (nothing real to time)")


class StatefulBlock(Block):
    """A block with the state real models keep: an int64 call counter, a KV cache row written
    through a view, and an example input it writes in place (a caller's scratch buffer)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("cache", torch.zeros(4, 16))

    def forward(self, x, scratch):
        self.calls.add_(1)
        self.cache[1].copy_(x[0])
        scratch.add_(1.0)
        return super().forward(x) + self.cache.sum() + scratch


def test_a_race_runs_the_program_on_copies_of_what_it_writes():
    from branchyard.fx.mutation import written_roots

    torch.manual_seed(0)
    block = StatefulBlock().eval()
    x, scratch = torch.randn(4, 16), torch.zeros(4, 16)
    ep = torch.export.export(block, (x, scratch))
    assert [n.name for n in written_roots(ep.graph)] == ["b_calls", "b_cache", "scratch"]
    clock = FakeClock(10.0, {"silu": -1.0, "residual": -1.0})
    out = nvgemm(ep, race=_race(clock))
    assert len(clock.timed) > 3 and len(_fused_specs(out)) == 2  # it ran the program many times
    assert int(block.calls) == 0 and not block.cache.any() and not scratch.any()
    assert ep.example_inputs[0][1] is scratch


def test_a_race_on_no_device_type_fuses_everything_and_says_so():
    _, _, ep = _block_ep()
    p = NvGemmPass("graph", race=ProgramRace(devices=())).bind_inputs(ep)
    out = Pipeline([p])(ep).program
    assert len(_fused_specs(out)) == 2
    assert p.report.stats["race"] == ("not raced: the program runs on cpu, where the fused op runs the original "
                                      "ATen ops (races run on no device)")


class Projections(nn.Module):
    """Attention's projections: a plain q projection, a k projection with only
    its own bias (addmm), and ``x + o(h)`` (a residual chain)."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, d)
        self.o = nn.Linear(d, d, bias=False)

    def forward(self, x, h):
        return self.q(x), self.k(x), x + self.o(h)


def _projections_ep():
    torch.manual_seed(0)
    block = Projections().eval()
    args = (torch.randn(4, 16), torch.randn(4, 16))
    return block, args, torch.export.export(block, args)


@pytest.mark.parametrize("plain_delta, kept", [(-5.0, 2), (5.0, 0)])
def test_graph_race_offers_plain_gemms_and_keeps_the_ones_that_win(plain_delta, kept):
    block, args, ep = _projections_ep()
    # "w=nk;out" is the plain q GEMM, "w=nk;bias@0;out" the k projection with only its own bias
    clock = FakeClock(100.0, {"w=nk;out": plain_delta, "w=nk;bias@0;out": plain_delta, "residual": -5.0})
    p = NvGemmPass("graph", race=_race(clock, capture=FakeCapture())).bind_inputs(ep)
    out = Pipeline([p])(ep).program
    plain = ["w=nk;bias@0;out=float32", "w=nk;out=float32"]
    assert _fused_specs(out) == sorted(["w=nk;residual@0;out=float32"] + plain[:kept])
    assert p.report.stats["plain_fused"] == kept and p.report.stats["fused"] == 1 + kept
    assert {g for f in clock.timed for g in f} >= {"w=nk;out=float32 [4x16 @ 16x16]"}  # the plain GEMM was raced
    declined = {s.where.split("'")[1]: s.reason for s in p.report.skips if not s.reason.startswith("left")}
    if kept:
        assert "linear" not in declined and "linear_1" not in declined
    else:  # a plain GEMM that loses is declined as without a race
        assert declined["linear"].startswith("nothing to fuse after the matmul")
        assert declined["linear_1"].startswith("only the matmul's own bias")
    for got, want in zip(out.module()(*args), block(*args), strict=True):
        torch.testing.assert_close(got, want)


def test_the_eager_race_and_an_unraced_graph_program_leave_plain_gemms_alone():
    _, args, ep = _projections_ep()
    clock = FakeClock(100.0, {"w=nk;out": -50.0, "w=nk;bias@0;out": -50.0, "residual": -5.0})
    out = nvgemm(ep, race=_race(clock, capture=FakeCapture()))
    assert _fused_specs(out) == ["w=nk;residual@0;out=float32"]
    assert all(len(f) <= 1 for f in clock.timed) and {g for f in clock.timed for g in f} == {
        "w=nk;residual@0;out=float32 [4x16 @ 16x16, 4x16]"}
    unraced = nvgemm(ep, calling="graph", race=ProgramRace(devices=()))
    assert _fused_specs(unraced) == ["w=nk;residual@0;out=float32"]


def test_work_off_the_program_device_is_not_capturable():
    from branchyard.lowering.nvgemm.fuse import _why_not_capturable

    _, _, ep = _block_ep()
    first = next(n.name for n in ep.graph_module.graph.nodes if n.op == "call_function")
    assert _why_not_capturable(ep.graph_module, "cpu") is None
    # the same graph as part of a CUDA program: its CPU work would run once, at capture, never again
    assert _why_not_capturable(ep.graph_module, "cuda") == (
        f"calling='graph' and '{first}' computes on the cpu, which a CUDA graph does not replay")


def test_the_race_keeps_at_most_three_programs_alive():
    import gc
    import weakref

    class Replay:  # stands for a captured graph and its memory pool
        def __init__(self, gm, inputs):
            self.gm, self.inputs = gm, inputs

        def __call__(self):
            return self.gm(*self.inputs)

    block = nn.Sequential(Block(), nn.Linear(16, 16), nn.GELU()).eval()  # three groups
    x = torch.randn(4, 16)
    ep = torch.export.export(block, (x,))
    alive: list[weakref.ref] = []
    most = 0

    def capture(gm, inputs):
        nonlocal most
        replay = Replay(gm, inputs)
        alive.append(weakref.ref(replay))
        gc.collect()
        most = max(most, sum(r() is not None for r in alive))
        return replay

    clock = FakeClock(100.0, {"silu": -5.0, "residual": 5.0, "gelu": -5.0})
    out = nvgemm(ep, calling="graph", race=_race(clock, capture=capture))
    assert len(alive) == 5 and most == 3, (len(alive), most)  # every program captured, three at most alive
    assert _fused_specs(out) == ["w=nk;bias@0;gelu_erf;out=float32", "w=nk;bias@0;silu;out=float32"]
    torch.testing.assert_close(out.module()(x), block(x))


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_block_that_did_not_time_wins_nothing(bad):
    samples = iter([90.0, 100.0, bad, 100.0, 90.0, 100.0])
    result = ProgramRace(timer=lambda v: next(samples) / 1e3, blocks=3).run(
        ["g"], lambda fused: Variant(fused, lambda: None, calling="graph"))
    assert result.fused == frozenset() and result.decisions[-1].needed == math.inf
