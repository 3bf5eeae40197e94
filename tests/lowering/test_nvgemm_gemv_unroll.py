"""The small-M kernel's ``unroll`` knob on CPU: which (m_block, warps, unroll)
configs are valid and why not, their names, the K-step schedule of the
unrolled loop (every step of a warp once, every group inside K), which
configs the tuner races, their cache keys, and that an unrolled config that
fails to build leaves the tuner with the others. The kernels themselves run in
tests/gpu/test_nvgemm_small_m_gpu.py."""

from __future__ import annotations

import itertools

import pytest
import torch

from branchyard.errors import LoweringError
from branchyard.lowering.nvgemm import candidates as cands_mod
from branchyard.lowering.nvgemm import cutedsl_gemm as cg
from branchyard.lowering.nvgemm._cutedsl_gemv import unrolled_bounds
from branchyard.lowering.nvgemm.epilogue import EpilogueSpec, reference_epilogue
from branchyard.lowering.nvgemm.kernel_cache import KernelCache
from branchyard.lowering.nvgemm.kernel_config import GemvConfig, small_m_configs
from branchyard.lowering.nvgemm.kernel_math import plan_steps
from branchyard.lowering.nvgemm.problem import Problem
from branchyard.lowering.nvgemm.tuner import Autotuner
from branchyard.lowering.nvgemm.winners import WinnerDB

M_BLOCKS, WARPS, UNROLLS = (8, 16, 32, 64), (4, 8, 16), (1, 2, 4)

# --- the K-step schedule ------------------------------------------------------------


def _schedule(warp: int, k_steps: int, warps: int, unroll: int) -> tuple[list[list[int]], list[int]]:
    """The kernel's two loops for one warp, run in Python: (groups, single steps)."""
    group_stop, rest_start = unrolled_bounds(warp, k_steps, warps, unroll)
    groups = [[s + u * warps for u in range(unroll)] for s in range(warp, group_stop, unroll * warps)]
    return groups, list(range(rest_start, k_steps, warps))


@pytest.mark.parametrize("warps,unroll", list(itertools.product(WARPS, (2, 4))))
def test_unrolled_loops_take_each_step_of_the_warp_once(warps, unroll):
    for k_steps in range(1, 3 * unroll * warps + 2):
        for warp in range(warps):
            groups, rest = _schedule(warp, k_steps, warps, unroll)
            steps = [s for g in groups for s in g] + rest
            assert steps == list(range(warp, k_steps, warps)), (warps, unroll, k_steps, warp, groups, rest)
            assert all(max(g) < k_steps for g in groups)
            assert len(rest) < unroll, "a whole group is left to the single-step loop"


def test_the_schedule_at_the_issue_shapes():
    """K = 4096 (64 steps) with 8 warps and U = 4: two groups, nothing left over;
    K = 14336 (224 steps): seven groups; K = 64: one step for warp 0 only."""
    assert _schedule(3, 64, 8, 4) == ([[3, 11, 19, 27], [35, 43, 51, 59]], [])
    assert len(_schedule(7, 224, 8, 4)[0]) == 7 and _schedule(7, 224, 8, 4)[1] == []
    assert _schedule(0, 1, 8, 4) == ([], [0])
    assert _schedule(1, 1, 8, 4) == ([], [])
    assert _schedule(2, 21, 8, 2) == ([[2, 10]], [18])


def test_bounds_work_with_the_kernels_integer_ops():
    """The kernel passes its own max: any callable with max's meaning gives the same bounds."""
    calls = []

    def fake_max(a, b):
        calls.append((a, b))
        return a if a > b else b

    assert unrolled_bounds(5, 3, 8, 4, fake_max) == unrolled_bounds(5, 3, 8, 4)
    assert calls == [(3 - 24 - 5, 0)]


# --- configs ------------------------------------------------------------------------


def test_unroll_one_keeps_every_config_and_its_name():
    for b, w in itertools.product(M_BLOCKS, WARPS):
        assert GemvConfig(b, w) == GemvConfig(b, w, 1)
        assert GemvConfig(b, w).name == f"gemv_m{b}_w{w}"


def test_valid_unrolled_configs_are_those_whose_registers_fit():
    valid = set()
    for b, w, u in itertools.product(M_BLOCKS, WARPS, (2, 4)):
        try:
            c = GemvConfig(b, w, u)
        except LoweringError as exc:
            assert f"unroll={u} with m_block={b}, warps={w} needs about" in str(exc)
            continue
        assert c.registers <= min(255, 65536 // (32 * w)) and c.name == f"gemv_m{b}_w{w}_u{u}"
        valid.add((b, w, u))
    assert valid == {
        (8, 4, 2), (8, 8, 2), (8, 16, 2), (8, 4, 4), (8, 8, 4),
        (16, 4, 2), (16, 8, 2), (16, 16, 2), (16, 4, 4), (16, 8, 4),
        (32, 4, 2), (32, 8, 2),
    }


@pytest.mark.parametrize("kwargs,why", [
    ({"unroll": 3}, "unroll=3 (must be one of (1, 2, 4))"),
    ({"unroll": 0}, "unroll=0 (must be one of (1, 2, 4))"),
    ({"m_block": 64, "unroll": 2}, "unroll=2 with m_block=64, warps=8 needs about 312 registers per thread; "
                                   "at most 255 fit"),
    ({"m_block": 16, "warps": 16, "unroll": 4}, "unroll=4 with m_block=16, warps=16 needs about 184 registers "
                                                "per thread; at most 128 fit"),
    ({"m_block": 12, "unroll": 3}, "m_block=12 (must be one of (8, 16, 32, 64)); unroll=3"),
])
def test_invalid_unroll_names_the_problem(kwargs, why):
    with pytest.raises(LoweringError, match="invalid GemvConfig: ") as info:
        GemvConfig(**kwargs)
    assert why in str(info.value)


@pytest.mark.parametrize("m", range(1, 65))
def test_every_listed_config_is_valid_and_holds_m(m):
    configs = small_m_configs(m, 14336, 4096)
    block = next(b for b in M_BLOCKS if b >= m)
    assert {c.m_block for c in configs} == {block}
    assert [(c.warps, c.unroll) for c in configs[:3]] == [(8, 1), (4, 1), (16, 1)]
    assert len({c.name for c in configs}) == len(configs)
    assert all(c.unroll > 1 for c in configs[3:])
    assert all(c.registers <= c.register_cap for c in configs[3:])


def test_which_unrolled_configs_each_block_lists():
    def unrolled(m):
        return [(c.warps, c.unroll) for c in small_m_configs(m, 4096, 4096) if c.unroll > 1]

    assert unrolled(1) == unrolled(16) == [(8, 2), (8, 4), (4, 4), (4, 2), (16, 2)]
    assert unrolled(17) == [(8, 2), (4, 2)]
    assert unrolled(33) == []


# --- the tuner's candidates and the compile cache -----------------------------------


def _problem(m, n=64, k=128, chain="bias@0;gelu_tanh"):
    spec = EpilogueSpec.parse(f"w=nk;{chain};out=bfloat16")
    a, w = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
    return Problem.of(a, w.t(), [torch.randn(n).bfloat16()], spec), a, w


@pytest.fixture
def cutedsl_here(monkeypatch):
    monkeypatch.setattr(cands_mod, "cutedsl_available", lambda: (True, ""))
    monkeypatch.delenv("BRANCHYARD_NVGEMM_MAX_CONFIGS", raising=False)


def test_the_tuner_races_every_listed_config(cutedsl_here):
    for m in (1, 8, 9, 16, 17, 64):
        problem = _problem(m)[0]
        names = [c.name for c in cands_mod._cutedsl_candidates(problem) if c.name.startswith("cutedsl:gemv")]
        assert names == [f"cutedsl:{c.name}" for c in small_m_configs(m, 64, 128)]


def test_cache_keys_tell_unroll_apart():
    env = {"gpu": "FakeGPU sm90", "driver": "13.0", "cuda": "13.0", "torch": "2.14", "cutedsl": "4.8"}
    steps = plan_steps(EpilogueSpec.parse("w=nk;bias@0;silu;out=bfloat16"))
    keys = {KernelCache("/nonexistent", env=env).digest(
        cg.kernel_cache_key(steps, "bfloat16", "bfloat16", ["bfloat16"], "nk", GemvConfig(16, 8, u)))
        for u in UNROLLS}
    assert len(keys) == 3


def test_an_unrolled_config_that_fails_to_build_leaves_the_others(cutedsl_here, monkeypatch, tmp_path):
    """CuTeDSL stubbed: unrolled configs fail to compile, the others compute the
    reference; the tuner excludes the failures with their reason and picks among the rest."""
    monkeypatch.setattr(cg, "cutedsl_available", lambda: (True, ""))
    monkeypatch.setattr(cg, "_CACHE", {})
    problem, a, w = _problem(4)

    def compile_(steps, dtype, out_dtype, operand_dtypes, b_layout, config):
        if config.unroll > 1:
            raise RuntimeError(f"ptxas: too many resources for {config.name}")

        def launch(a, b_nk, out, ops):
            out.copy_(reference_epilogue(a.float() @ b_nk.float().t(), problem.spec, list(ops[:-1])))

        return launch

    monkeypatch.setattr(cg, "_compile", compile_)
    monkeypatch.setattr(cg, "default_kernel_cache", lambda: None)
    times = {"cutedsl:gemv_m8_w8": 3.0, "cutedsl:gemv_m8_w4": 2.0, "cutedsl:gemv_m8_w16": 4.0}
    tuner = Autotuner(lambda p: [c for c in cands_mod._cutedsl_candidates(p) if c.name.startswith("cutedsl:gemv")],
                      timer=lambda name, fn: (fn(), times[name])[1], db=WinnerDB(tmp_path), progress=False)
    bias = torch.randn(64).bfloat16()
    res = tuner.tune(a, w.t(), [bias], problem.spec)
    assert res.winner == "cutedsl:gemv_m8_w4"
    unrolled = [f"cutedsl:{c.name}" for c in small_m_configs(4, 64, 128) if c.unroll > 1]
    assert sorted(res.excluded) == sorted(unrolled) and len(unrolled) == 5
    for name in unrolled:
        assert res.excluded[name].startswith("build failed: LoweringError: compile_fused_gemm: CuTeDSL failed to "
                                             f"compile config {name.removeprefix('cutedsl:')} ")
        assert res.excluded[name].endswith(f"RuntimeError: ptxas: too many resources for {name.removeprefix('cutedsl:')}")
