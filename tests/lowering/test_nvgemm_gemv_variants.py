"""The small-M kernel's ``unroll`` and ``rows`` knobs on CPU: which
(m_block, warps, unroll, rows) configs are valid and why not, their names,
the K-step schedule of the unrolled loop (every step of a warp once, every
group inside K), which configs the tuner races and for which N, their cache
keys, the launcher refusing an N or K the config cannot cover, and that a
variant that fails to build leaves the tuner with the others. The kernels
themselves run in tests/gpu/test_nvgemm_small_m_gpu.py."""

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

M_BLOCKS, WARPS, UNROLLS, ROWS = (8, 16, 32, 64), (4, 8, 16), (1, 2, 4), (16, 32)

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


def test_the_first_form_keeps_every_config_and_its_name():
    for b, w in itertools.product(M_BLOCKS, WARPS):
        assert GemvConfig(b, w) == GemvConfig(b, w, 1, 16)
        assert GemvConfig(b, w).name == f"gemv_m{b}_w{w}"


def test_valid_variants_are_those_whose_registers_fit():
    valid = set()
    for b, w, u, r in itertools.product(M_BLOCKS, WARPS, UNROLLS, ROWS):
        if (u, r) == (1, 16):
            continue
        try:
            c = GemvConfig(b, w, u, r)
        except LoweringError as exc:
            assert f"unroll={u}, rows={r} with m_block={b}, warps={w} needs about" in str(exc)
            continue
        assert c.registers <= min(255, 65536 // (32 * w))
        assert c.name == f"gemv_m{b}_w{w}" + (f"_u{u}" if u > 1 else "") + (f"_r{r}" if r > 16 else "")
        valid.add((b, w, u, r))
    assert {v[:3] for v in valid if v[3] == 16} == {
        (8, 4, 2), (8, 8, 2), (8, 16, 2), (8, 4, 4), (8, 8, 4),
        (16, 4, 2), (16, 8, 2), (16, 16, 2), (16, 4, 4), (16, 8, 4),
        (32, 4, 2), (32, 8, 2),
    }
    assert {v[:3] for v in valid if v[3] == 32} == {
        (8, 4, 1), (8, 8, 1), (8, 16, 1), (8, 4, 2), (8, 8, 2), (8, 4, 4), (8, 8, 4),
        (16, 4, 1), (16, 8, 1), (16, 4, 2), (16, 8, 2),
        (32, 4, 1), (32, 8, 1),
    }


@pytest.mark.parametrize("kwargs,why", [
    ({"unroll": 3}, "unroll=3 (must be one of (1, 2, 4))"),
    ({"unroll": 0}, "unroll=0 (must be one of (1, 2, 4))"),
    ({"rows": 64}, "rows=64 (must be one of (16, 32))"),
    ({"m_block": 64, "unroll": 2}, "unroll=2, rows=16 with m_block=64, warps=8 needs about 312 registers per "
                                   "thread; at most 255 fit"),
    ({"m_block": 16, "warps": 16, "unroll": 4}, "unroll=4, rows=16 with m_block=16, warps=16 needs about 184 "
                                                "registers per thread; at most 128 fit"),
    ({"m_block": 64, "rows": 32}, "unroll=1, rows=32 with m_block=64, warps=8 needs about 376 registers"),
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
    assert [(c.warps, c.unroll, c.rows) for c in configs[:3]] == [(8, 1, 16), (4, 1, 16), (16, 1, 16)]
    assert len({c.name for c in configs}) == len(configs)
    assert all((c.unroll, c.rows) != (1, 16) for c in configs[3:])
    assert all(c.registers <= c.register_cap for c in configs[3:])


def test_which_variants_each_block_lists():
    def variants(m, n=4096):
        return [(c.warps, c.unroll, c.rows) for c in small_m_configs(m, n, 4096)][3:]

    unrolled = [(8, 2, 16), (8, 4, 16), (4, 4, 16), (4, 2, 16), (16, 2, 16)]
    assert variants(1) == variants(16) == unrolled + [(8, 1, 32), (8, 2, 32), (4, 2, 32)]
    assert variants(17) == [(8, 2, 16), (4, 2, 16), (8, 1, 32)]
    assert variants(33) == []
    assert variants(1, n=4112) == unrolled  # N = 257 x 16: no 32-row config


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
    for m, n in itertools.product((1, 8, 9, 16, 17, 64), (48, 64)):
        problem = _problem(m, n)[0]
        names = [c.name for c in cands_mod._cutedsl_candidates(problem) if c.name.startswith("cutedsl:gemv")]
        assert names == [f"cutedsl:{c.name}" for c in small_m_configs(m, n, 128)]
        assert any(name.endswith("_r32") for name in names) == (n == 64 and m <= 32)


def test_a_32_row_candidate_says_why_it_does_not_apply_to_an_odd_tile_count(cutedsl_here):
    """The tuner asks ``applies`` again when it reuses a recorded winner for another problem."""
    (cand,) = [c for c in cands_mod._cutedsl_candidates(_problem(1, 64)[0]) if c.name == "cutedsl:gemv_m8_w8_r32"]
    assert cand.applies(_problem(1, 64)[0]) is None
    assert cand.applies(_problem(1, 48)[0]) == "N=48 is not a multiple of 32 (this config's weight rows per CTA)"
    (plain,) = [c for c in cands_mod._cutedsl_candidates(_problem(1, 64)[0]) if c.name == "cutedsl:gemv_m8_w8"]
    assert plain.applies(_problem(1, 48)[0]) is None


def test_cache_keys_tell_unroll_and_rows_apart():
    env = {"gpu": "FakeGPU sm90", "driver": "13.0", "cuda": "13.0", "torch": "2.14", "cutedsl": "4.8"}
    steps = plan_steps(EpilogueSpec.parse("w=nk;bias@0;silu;out=bfloat16"))
    keys = {KernelCache("/nonexistent", env=env).digest(
        cg.kernel_cache_key(steps, "bfloat16", "bfloat16", ["bfloat16"], "nk", GemvConfig(8, 8, u, r)))
        for u in UNROLLS for r in ROWS}
    assert len(keys) == 6


@pytest.fixture
def fake_compile(monkeypatch):
    """CuTeDSL stubbed: ``_compile`` returns a launcher computing the reference
    (variants other than the first form fail to compile when ``fail`` holds True)."""
    monkeypatch.setattr(cg, "cutedsl_available", lambda: (True, ""))
    monkeypatch.setattr(cg, "_CACHE", {})
    monkeypatch.setattr(cg, "default_kernel_cache", lambda: None)
    fail, specs = [False], []

    def compile_(steps, dtype, out_dtype, operand_dtypes, b_layout, config):
        if fail[0] and (config.unroll, config.rows) != (1, 16):
            raise RuntimeError(f"ptxas: too many resources for {config.name}")

        def launch(a, b_nk, out, ops):
            out.copy_(reference_epilogue(a.float() @ b_nk.float().t(), specs[0], list(ops[:-1])))

        return launch

    monkeypatch.setattr(cg, "_compile", compile_)
    return fail, specs


def test_the_launcher_refuses_n_or_k_the_config_cannot_cover(fake_compile):
    fail, specs = fake_compile
    spec = EpilogueSpec.parse("w=nk;out=bfloat16")
    specs.append(spec)
    fn = cg.compile_fused_gemm(spec, torch.bfloat16, GemvConfig(8, 8, 2, rows=32), kernel_cache=None)
    a, w = torch.randn(3, 128).bfloat16(), torch.randn(64, 128).bfloat16()
    out = torch.empty(3, 64, dtype=torch.bfloat16)
    fn(a, w.t(), [], out)
    torch.testing.assert_close(out, (a.float() @ w.float().t()).bfloat16())
    with pytest.raises(LoweringError, match=r"N=48, K=128: the small-M kernel gemv_m8_w8_u2_r32 needs N a "
                                            r"multiple of 32 and K of 64"):
        fn(a, torch.randn(48, 128).bfloat16().t(), [], torch.empty(3, 48, dtype=torch.bfloat16))
    plain = cg.compile_fused_gemm(spec, torch.bfloat16, GemvConfig(8, 8), kernel_cache=None)
    plain(a, torch.randn(48, 128).bfloat16().t(), [], torch.empty(3, 48, dtype=torch.bfloat16))
    with pytest.raises(LoweringError, match="N=48, K=136: the small-M kernel gemv_m8_w8 needs N a multiple of 16 "
                                            "and K of 64"):
        plain(torch.randn(3, 136).bfloat16(), torch.randn(48, 136).bfloat16().t(), [],
              torch.empty(3, 48, dtype=torch.bfloat16))


def test_a_variant_that_fails_to_build_leaves_the_others(cutedsl_here, fake_compile, tmp_path):
    """Every variant fails to compile, the first form's configs compute the reference;
    the tuner excludes the failures with their reason and picks among the rest."""
    fail, specs = fake_compile
    fail[0] = True
    problem, a, w = _problem(4)
    specs.append(problem.spec)

    times = {"cutedsl:gemv_m8_w8": 3.0, "cutedsl:gemv_m8_w4": 2.0, "cutedsl:gemv_m8_w16": 4.0}
    tuner = Autotuner(lambda p: [c for c in cands_mod._cutedsl_candidates(p) if c.name.startswith("cutedsl:gemv")],
                      timer=lambda name, fn: (fn(), times[name])[1], db=WinnerDB(tmp_path), progress=False)
    bias = torch.randn(64).bfloat16()
    res = tuner.tune(a, w.t(), [bias], problem.spec)
    assert res.winner == "cutedsl:gemv_m8_w4"
    variants = [f"cutedsl:{c.name}" for c in small_m_configs(4, 64, 128)][3:]
    assert sorted(res.excluded) == sorted(variants) and len(variants) == 8
    for name in variants:
        assert res.excluded[name].startswith("build failed: LoweringError: compile_fused_gemm: CuTeDSL failed to "
                                             f"compile config {name.removeprefix('cutedsl:')} ")
        assert res.excluded[name].endswith(f"RuntimeError: ptxas: too many resources for {name.removeprefix('cutedsl:')}")
