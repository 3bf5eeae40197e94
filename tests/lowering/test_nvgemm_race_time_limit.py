"""The program race's time limit (``ProgramRace.time_limit_s``): read before each
comparison; past it the race stops and the program stays as it was, the
result's ``failure`` and the pass's report saying why. On CPU with injected
timers and clocks; the GPU's own races are tests/gpu/test_nvgemm_*_gpu.py."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from branchyard.errors import LoweringError
from branchyard.fx.pass_infra import Pipeline
from branchyard.lowering.nvgemm.fuse import NvGemmPass
from branchyard.lowering.nvgemm.program_race import ProgramRace, Variant
from nvgemm_race_blocks import AttnProj, Block

FUSED = torch.ops.branchyard.fused_gemm_epilogue.default


def _race(us: dict[str, float], seconds_per_call: float, **kw):
    """A race whose timer charges each timed call ``seconds_per_call`` on its clock."""
    now = [0.0]
    timed: list[frozenset[str]] = []

    def timer(variant: Variant) -> float:
        timed.append(variant.fused)
        now[0] += seconds_per_call
        return (100.0 + sum(us[g] for g in variant.fused)) / 1e3

    return ProgramRace(timer=timer, blocks=3, clock=lambda: now[0], **kw), timed


def _build(fused: frozenset[str]) -> Variant:
    return Variant(fused, lambda: None)


def test_past_the_limit_the_race_stops_and_keeps_the_program_as_it_was():
    # one comparison is 3 rounds of 2 timed calls: 6 s; the limit is read before each comparison
    race, timed = _race({"a": -9.0, "b": -9.0, "c": -9.0}, seconds_per_call=1.0, time_limit_s=10.0)
    result = race.run(["a", "b", "c"], _build)
    assert result.fused == frozenset(), "nothing fused: the program as it was"
    assert "the race ran past its time limit of 10 s" in result.failure
    assert "ProgramRace.time_limit_s" in result.failure
    assert [d.chains for d in result.decisions] == ["a", "b"], "two comparisons started within the limit"
    assert len(timed) == 12 and math.isnan(result.result_us)


def test_within_the_limit_or_without_one_the_race_runs_to_its_end():
    for limit in (1000.0, None):
        race, timed = _race({"a": -9.0, "b": -9.0, "c": -9.0}, seconds_per_call=1.0, time_limit_s=limit)
        result = race.run(["a", "b", "c"], _build)
        assert result.fused == {"a", "b", "c"} and not result.failure
        assert len(timed) == 4 * 6, "three groups and the final comparison"


def test_the_default_limit_is_ten_minutes():
    assert ProgramRace().time_limit_s == 600.0


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan, True, "60"])
def test_a_bad_time_limit_is_an_error_naming_it(bad):
    with pytest.raises(LoweringError, match=rf"time_limit_s={bad!r}: seconds a race may take"):
        ProgramRace(time_limit_s=bad)


def _slow_race(limit: float = 5.0) -> ProgramRace:
    """Every clock reading is a minute after the last: each race is out of time
    before its first comparison."""
    ticks = itertools.count(step=60.0)

    def timer(variant: Variant) -> float:
        variant.run()
        return 0.05 if variant.fused else 0.1  # fused would win by half, if it were timed

    return ProgramRace(timer=timer, devices=("cpu",), blocks=3, time_limit_s=limit, clock=lambda: next(ticks))


def test_the_pass_leaves_every_chain_unfused_and_says_why():
    torch.manual_seed(0)
    block, x = Block().eval(), torch.randn(4, 16)
    ep = torch.export.export(block, (x,))
    p = NvGemmPass(race=_slow_race(), merge_siblings=False).bind_inputs(ep)
    out = Pipeline([p])(ep).program
    assert not [n for n in out.graph.nodes if n.target is FUSED]
    left = [s.reason for s in p.report.skips if "left unfused" in s.reason]
    assert len(left) == 2 and all("the race ran past its time limit of 5 s" in r for r in left), left
    assert "the race ran past its time limit" in p.report.stats["race"]
    assert p.race_pins == {}
    torch.testing.assert_close(out.module()(x), block(x))


def test_a_merge_raced_past_the_limit_is_not_kept_and_says_why():
    torch.manual_seed(0)
    block, x, h = AttnProj().eval(), torch.randn(4, 16), torch.randn(4, 16)
    ep = torch.export.export(block, (x, h))
    p = NvGemmPass(race=_slow_race()).bind_inputs(ep)
    out = Pipeline([p])(ep).program
    merge = p.report.stats["merge"]
    assert merge.startswith("not kept (the race ran past its time limit of 5 s"), merge
    assert sum(n.target is torch.ops.aten.cat.default for n in out.graph.nodes) == 1
    for got, want in zip(out.module()(x, h), block(x, h)):
        torch.testing.assert_close(got, want)
