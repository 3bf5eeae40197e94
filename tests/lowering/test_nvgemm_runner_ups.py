"""A chain whose tuned kernel loses inside the program is offered the tuner's
runner-ups before it is left unfused: the spec's ``impl=`` pin, the tuner
building the pinned candidate (or, where it cannot run, its own choice), the
runner-ups of a tuning, and the race trying them. On CPU, with injected
candidates, timings and race clocks."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from branchyard.errors import LoweringError
from branchyard.fx.pass_infra import Pipeline
from branchyard.lowering.nvgemm import op as op_mod
from branchyard.lowering.nvgemm import tuner as tuner_mod
from branchyard.lowering.nvgemm.candidates import Candidate, candidate_kind
from branchyard.lowering.nvgemm.epilogue import EpilogueSpec, unfused_aten_epilogue
from branchyard.lowering.nvgemm.fuse import NvGemmPass
from branchyard.lowering.nvgemm.problem import Problem
from branchyard.lowering.nvgemm.program_race import ProgramRace, Variant
from nvgemm_race_blocks import AttnProj, Block
from branchyard.lowering.nvgemm.tuner import Autotuner, TuneResult
from branchyard.lowering.nvgemm.winners import WinnerDB

FUSED = torch.ops.branchyard.fused_gemm_epilogue.default
ENV = {"gpu": "FakeGPU sm90", "driver": "13.0", "cuda": "13.0", "torch": "2.14", "cutedsl": "4.8"}

pytestmark = pytest.mark.filterwarnings("ignore::branchyard.lowering.nvgemm.op.NvGemmFallbackWarning")


# --- the pin in the spec -------------------------------------------------------


def test_a_spec_carries_its_pinned_implementation_last_and_round_trips():
    spec = EpilogueSpec.parse("w=nk;bias@0;residual@1;out=bfloat16;impl=triton:inductor[default]")
    assert spec.impl == "triton:inductor[default]" and spec.names == ("bias", "residual")
    assert str(spec) == "w=nk;bias@0;residual@1;out=bfloat16;impl=triton:inductor[default]"
    assert EpilogueSpec.parse(str(spec)) == spec
    assert EpilogueSpec.parse("w=nk;bias@0;out=bfloat16").impl is None
    assert spec != EpilogueSpec.parse("w=nk;bias@0;residual@1;out=bfloat16")


def test_a_problem_leaves_the_pin_out():
    pinned = EpilogueSpec.parse("w=kn;relu;out=float32;impl=cublas:addmm")
    plain = EpilogueSpec.parse("w=kn;relu;out=float32")
    a, b = torch.randn(4, 8), torch.randn(8, 16)
    assert Problem.of(a, b, [], pinned) == Problem.of(a, b, [], plain)
    assert Problem.of(a, b, [], pinned).key(ENV) == Problem.of(a, b, [], plain).key(ENV)


@pytest.mark.parametrize("text, message", [
    ("w=kn;relu;out=float32;impl=", "'impl=' names no implementation"),
    ("w=kn;relu;out=float32;impl= x", "names no implementation"),
    ("w=kn;relu;impl=x;out=float32", "'impl=x' must come last, not before 'out=float32'"),
])
def test_a_malformed_pin_is_an_error_naming_it(text, message):
    with pytest.raises(LoweringError, match=message) as err:
        EpilogueSpec.parse(text)
    assert text in str(err.value)


# --- the tuner running a pinned candidate --------------------------------------


class Candidates:
    """Named candidates computing the chain (``wrong`` ones off by one); builds, runs and timings recorded."""

    def __init__(self, times: dict[str, float], wrong=()):
        self.times, self.wrong = times, set(wrong)
        self.builds: list[str] = []
        self.timed: list[str] = []

    def candidate(self, name: str) -> Candidate:
        def build(problem: Problem):
            self.builds.append(name)

            def impl(a, b_kn, ops, out):
                y = unfused_aten_epilogue(a @ b_kn, problem.spec, list(ops))
                out.copy_(y + 1.0 if name in self.wrong else y)
                return out

            return impl

        return Candidate(name, build)

    def tuner(self, tmp_path) -> Autotuner:
        return Autotuner([self.candidate(n) for n in self.times], timer=self.timer, db=WinnerDB(tmp_path),
                         env=ENV, progress=False)

    def timer(self, name, fn):
        fn()
        self.timed.append(name)
        return self.times[name]


TIMES = {"cutedsl:t64x64": 1.0, "cutedsl:t64x128": 1.01, "cutedsl:gemv_m64_w16": 1.05,
         "triton:inductor": 1.1, "cublas:addmm+aten": 1.4, "aten:unfused": 1.2}


def _problem_args(m=8, n=16, k=32):
    g = torch.Generator().manual_seed(0)
    return torch.randn(m, k, generator=g), torch.randn(k, n, generator=g), [torch.randn(n, generator=g)]


def test_a_pinned_spec_runs_its_candidate_without_tuning(tmp_path):
    cands = Candidates(TIMES)
    tuner = cands.tuner(tmp_path)
    a, b, ops = _problem_args()
    spec = EpilogueSpec.parse("w=kn;bias@0;relu;out=float32;impl=triton:inductor")
    impl = tuner.select(a, b, ops, spec)
    assert cands.builds == ["triton:inductor"] and cands.timed == [], "built and checked, nothing timed"
    out = torch.empty(8, 16)
    torch.testing.assert_close(impl(a, b, ops, out), torch.relu(a @ b + ops[0]))
    assert tuner.results == {} and not (tmp_path / WinnerDB.FILE).exists(), "a pin records no winner"
    # the unpinned spec is another problem of the same key: tuned as always
    tuner.select(a, b, ops, EpilogueSpec.parse("w=kn;bias@0;relu;out=float32"))
    assert set(cands.timed) == set(TIMES)


@pytest.mark.parametrize("pin, why", [
    ("cutedsl:t256", "no candidate named 'cutedsl:t256' here"),
    ("triton:inductor", "numerics off at ["),
])
def test_a_pin_that_cannot_run_here_falls_back_to_the_tuned_choice_and_says_why(tmp_path, caplog, pin, why):
    cands = Candidates(TIMES, wrong={"triton:inductor"})
    tuner = cands.tuner(tmp_path)
    a, b, ops = _problem_args()
    with caplog.at_level(logging.WARNING, logger="branchyard"):
        impl = tuner.select(a, b, ops, EpilogueSpec.parse(f"w=kn;bias@0;relu;out=float32;impl={pin}"))
    (line,) = [r.getMessage() for r in caplog.records if "pinned implementation" in r.getMessage()]
    assert f"the pinned implementation {pin} cannot run it ({why}" in line and "M=8 N=16 K=32" in line
    (result,) = tuner.results.values()
    assert result.winner == "cutedsl:t64x64"
    torch.testing.assert_close(impl(a, b, ops, torch.empty(8, 16)), torch.relu(a @ b + ops[0]))


# --- the runner-ups of a tuning --------------------------------------------------


def test_runner_ups_are_the_fastest_of_each_other_kind_within_the_margin():
    result = TuneResult("k", "cutedsl:t64x64", {n: t * 1e-3 for n, t in TIMES.items()})
    assert result.runner_ups(3) == ["cutedsl:gemv_m64_w16", "triton:inductor"]  # cuBLAS's is 1.4x: too slow
    assert result.runner_ups(1) == ["cutedsl:gemv_m64_w16"]
    assert result.runner_ups(0) == []
    assert result.runner_ups(5, within=1.5) == ["cutedsl:gemv_m64_w16", "triton:inductor", "cublas:addmm+aten"]
    assert TuneResult("k", "").runner_ups(3) == [], "no winner timed: nothing to offer"
    unfused_won = TuneResult("k", "aten:unfused", {"aten:unfused": 1.0, "cublas:addmm+aten": 1.1})
    assert unfused_won.runner_ups(3) == ["cublas:addmm+aten"]
    assert {candidate_kind(n) for n in TIMES} == {"cutedsl:tiled", "cutedsl:gemv", "triton", "cublas", "aten"}


def test_tuned_result_finds_the_tuning_behind_the_ops_plan(tmp_path, monkeypatch):
    cands = Candidates(TIMES)
    monkeypatch.setattr(op_mod, "fused_kernel_ineligibility", lambda *args: None)
    tuner_mod.set_autotuner(cands.tuner(tmp_path))
    try:
        a, w, bias = torch.randn(2, 3, 32), torch.randn(16, 32), torch.randn(16)
        spec = "w=nk;bias@0;relu;out=float32"
        op_mod.fused_gemm_epilogue(a, w, [bias], spec)
        result = op_mod.tuned_result(spec, "host", (2, 3, 32), (16, 32))
        assert result is not None and result.winner == "cutedsl:t64x64" and set(result.timings) == set(TIMES)
        assert op_mod.tuned_result(spec, "device", (2, 3, 32), (16, 32)) is None, "not tuned for replays"
        assert op_mod.tuned_result(spec, "host", (6, 32), (16, 32)) is None, "no call of that shape"
        assert op_mod.tuned_result(spec + ";impl=x", "host", (2, 3, 32), (16, 32)) is None
    finally:
        tuner_mod.set_autotuner(None)


# --- the race trying them ---------------------------------------------------------


def _fake_race(us: dict[str, float], base: float = 100.0, **kw) -> tuple[ProgramRace, list[frozenset[str]]]:
    timed: list[frozenset[str]] = []

    def timer(variant: Variant) -> float:
        timed.append(variant.fused)
        return (base + sum(us[label] for label in variant.fused)) / 1e3

    return ProgramRace(timer=timer, blocks=3, **kw), timed


def _build(fused: frozenset[str]) -> Variant:
    return Variant(fused, lambda: None)


def test_a_group_whose_tuned_kernel_loses_is_kept_fused_by_a_runner_up_that_wins():
    race, timed = _fake_race({"a": -5.0, "b": 2.0, "b/gemv": 1.0, "b/triton": -6.0, "b/cublas": -9.0})
    offered = []
    result = race.run(["a", "b"], _build, lambda g: offered.append(g) or [f"{g}/gemv", f"{g}/triton", f"{g}/cublas"])
    assert result.fused == {"a", "b/triton"}, "the first runner-up that wins is kept; the rest are not tried"
    assert offered == ["b"] and frozenset({"a", "b/cublas"}) not in timed
    assert [(d.chains, d.kept_fused) for d in result.decisions] == [
        ("a", True), ("b", False), ("b/gemv", False), ("b/triton", True)]
    assert result.decision("b").kept_fused is False, "the group's own verdict stands in the report"
    assert (result.unrewritten_us, result.result_us) == (100.0, 89.0)


def test_a_single_group_losing_the_final_comparison_tries_its_runner_ups():
    race, _ = _fake_race({"g": 1.0, "g/x": 0.5, "g/y": -4.0})
    result = race.run(["g"], _build, lambda g: ["g/x", "g/y"])
    assert result.fused == {"g/y"} and (result.unrewritten_us, result.result_us) == (100.0, 96.0)
    assert [(d.chains, d.kept_fused) for d in result.decisions] == [("g", False), ("g/x", False), ("g/y", True)]


def test_runner_ups_that_all_lose_leave_the_group_unfused():
    race, _ = _fake_race({"g": 1.0, "g/x": 0.5, "g/y": -1.0})  # -1%: within the 3% margin
    result = race.run(["g"], _build, lambda g: ["g/x", "g/y"])
    assert result.fused == frozenset() and result.result_us == result.unrewritten_us == 100.0
    assert [d.chains for d in result.decisions] == ["g", "g/x", "g/y"]


def test_runner_ups_are_tried_at_most_as_many_as_the_race_allows():
    race, timed = _fake_race({"g": 1.0, "g/x": 0.5, "g/y": -9.0}, runner_ups=1)
    assert race.run(["g"], _build, lambda g: ["g/x", "g/y"]).fused == frozenset()
    assert frozenset({"g/y"}) not in timed
    none, timed = _fake_race({"g": 1.0, "g/x": -9.0}, runner_ups=0)
    assert none.run(["g"], _build, lambda g: ["g/x"]).fused == frozenset()
    assert frozenset({"g/x"}) not in timed


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_a_bad_runner_up_count_is_an_error_naming_it(bad):
    with pytest.raises(LoweringError, match=rf"runner_ups={bad!r}: a count of other ways to fuse a group"):
        ProgramRace(runner_ups=bad)


def _clock(deltas: dict[str, float]):
    def timer(variant: Variant) -> float:
        variant.run()
        return (100.0 + sum(d for label in variant.fused for word, d in deltas.items() if word in label)) / 1e3
    return timer


@pytest.fixture
def tuned_on_cpu(tmp_path, monkeypatch):
    """The op tuning on CPU among :data:`TIMES`'s candidates (the process autotuner for the test)."""
    cands = Candidates(TIMES)
    monkeypatch.setattr(op_mod, "fused_kernel_ineligibility", lambda *args: None)
    tuner_mod.set_autotuner(cands.tuner(tmp_path))
    yield cands
    tuner_mod.set_autotuner(None)


def test_the_pass_pins_the_runner_up_that_won_in_the_program(tuned_on_cpu, tmp_path):
    torch.manual_seed(0)
    block, x = Block().eval(), torch.randn(4, 16)
    ep = torch.export.export(block, (x,))
    # fc1's chain wins tuned; fc2's loses tuned and with the gemv kernel, and wins with Inductor's
    clock = _clock({"silu": -5.0, "residual": 2.0, "impl=cutedsl:gemv": 0.0, "impl=triton": -6.0})
    p = NvGemmPass(race=ProgramRace(timer=clock, devices=("cpu",), blocks=3)).bind_inputs(ep)
    out = Pipeline([p])(ep).program
    specs = sorted(n.args[3] for n in out.graph.nodes if n.target is FUSED)
    assert specs == ["w=nk;bias@0;residual@1;out=float32;impl=triton:inductor", "w=nk;bias@0;silu;out=float32"]
    assert sorted(p.report.stats["specs"]) == specs and p.report.stats["fused"] == 2
    assert p.race_pins == {"w=nk;bias@0;residual@1;out=float32 [4x32 @ 16x32, 16, 4x16]": "triton:inductor"}
    tried = [d.split(": ")[0] for d in p.report.stats["race_decisions"]]
    assert tried[2:] == [f"w=nk;bias@0;residual@1;out=float32 [4x32 @ 16x32, 16, 4x16] impl={n}"
                         for n in ("cutedsl:gemv_m64_w16", "triton:inductor")]
    assert not [s for s in p.report.skips if "left unfused" in s.reason]
    torch.testing.assert_close(out.module()(x), block(x))
    # the pin is the program's: saved and loaded, it runs the pinned candidate
    path = tmp_path / "pinned.pt2"
    torch.export.save(out, path)
    tuned_on_cpu.builds.clear()
    tuner_mod.set_autotuner(tuned_on_cpu.tuner(tmp_path / "fresh"))
    torch.testing.assert_close(torch.export.load(path).module()(x), block(x))
    assert "triton:inductor" in tuned_on_cpu.builds


def test_without_a_winning_runner_up_the_chain_is_left_unfused_and_says_why(tuned_on_cpu):
    torch.manual_seed(0)
    block, x = Block().eval(), torch.randn(4, 16)
    ep = torch.export.export(block, (x,))
    clock = _clock({"silu": -5.0, "residual": 2.0})  # no runner-up helps
    p = NvGemmPass(race=ProgramRace(timer=clock, devices=("cpu",), blocks=3)).bind_inputs(ep)
    out = Pipeline([p])(ep).program
    assert sorted(n.args[3] for n in out.graph.nodes if n.target is FUSED) == ["w=nk;bias@0;silu;out=float32"]
    assert p.race_pins == {} and len(p.report.stats["race_decisions"]) == 4  # 2 groups, 2 runner-ups
    (left,) = [s.reason for s in p.report.skips if "left unfused" in s.reason]
    assert "w=nk;bias@0;residual@1;out=float32 [4x32 @ 16x32, 16, 4x16]: left unfused" in left
    torch.testing.assert_close(out.module()(x), block(x))
    assert math.isfinite(p.race_result.result_us)


def test_a_kept_merge_keeps_the_pins_of_its_own_race(tuned_on_cpu):
    torch.manual_seed(0)
    block, x, h = AttnProj().eval(), torch.randn(4, 16), torch.randn(4, 16)
    ep = torch.export.export(block, (x, h))
    unmerged = _clock({"residual": 2.0})  # Inductor's kernel wins only beside the merged GEMM
    merged = _clock({"merged": -10.0, "residual": 2.0, "impl=triton": -6.0})

    def clock(variant: Variant) -> float:
        cats = sum(n.target is torch.ops.aten.cat.default for n in variant.program.graph.nodes)
        return (unmerged if cats else merged)(variant)

    p = NvGemmPass(race=ProgramRace(timer=clock, devices=("cpu",), blocks=3)).bind_inputs(ep)
    out = Pipeline([p])(ep).program
    assert p.report.stats["merge"].startswith("kept ("), p.report.stats["merge"]
    assert p.race_pins == {"w=nk;bias@0;residual@1;out=float32 [4x16 @ 16x16, 16, 4x16]": "triton:inductor"}
    assert "w=nk;bias@0;residual@1;out=float32;impl=triton:inductor" in [
        n.args[3] for n in out.graph.nodes if n.target is FUSED]
    for got, want in zip(out.module()(x, h), block(x, h)):
        torch.testing.assert_close(got, want)
