"""The small-M kernel's CPU-side logic: its fragment placement against the PTX
definition of ``mma.m16n8k16`` (emulated on CPU), its eligibility rules, when
the tuner is offered it, and that its compiled kernels are cached apart from
the tiled kernel's. The kernel itself runs in tests/gpu/test_nvgemm_small_m_gpu.py."""

from __future__ import annotations

import pytest
import torch

from branchyard.errors import LoweringError
from branchyard.lowering.nvgemm import candidates as cands_mod
from branchyard.lowering.nvgemm import cutedsl_gemm as cg
from branchyard.lowering.nvgemm._cutedsl_gemv import CHUNK, accumulator_coords, placements
from branchyard.lowering.nvgemm.epilogue import EpilogueSpec
from branchyard.lowering.nvgemm.kernel_cache import KernelCache
from branchyard.lowering.nvgemm.kernel_config import (
    GEMV_K_STEP,
    GemmConfig,
    GemvConfig,
    small_m_configs,
    small_m_ineligibility,
)
from branchyard.lowering.nvgemm.kernel_math import plan_steps
from branchyard.lowering.nvgemm.problem import Problem

# --- the fragment placement, against the PTX fragment layouts -----------------


def _ptx_a(lane: int, i: int) -> tuple[int, int]:
    """(row, k) of A register ``i`` of ``lane`` (PTX ISA, mma.m16n8k16 .bf16/.f16, A row-major)."""
    g, t = divmod(lane, 4)
    return g + 8 * ((i >> 1) & 1), 2 * t + (i & 1) + 8 * (i >> 2)


def _ptx_b(lane: int, i: int) -> tuple[int, int]:
    """(k, col) of B register ``i`` (B column-major)."""
    g, t = divmod(lane, 4)
    return 2 * t + (i & 1) + 8 * (i >> 1), g


def _ptx_c(lane: int, i: int) -> tuple[int, int]:
    """(row, col) of accumulator ``i``."""
    g, t = divmod(lane, 4)
    return g + 8 * (i >> 1), 2 * t + (i & 1)


def _emulate_step(w: torch.Tensor, x: torch.Tensor) -> list[list[float]]:
    """One warp's 64-wide K step as the kernel does it: each lane's 16-byte chunks
    placed by ``placements()``, four MMAs evaluated by their PTX definition.
    ``w`` is [16, 64] (weight rows), ``x`` [8, 64] (input rows); returns each lane's 4 accumulators."""
    places = placements()
    a = [[[0.0] * 8 for _ in range(4)] for _ in range(32)]  # lane, kk, register
    b = [[[0.0] * 4 for _ in range(4)] for _ in range(32)]
    for lane in range(32):
        g, t = divmod(lane, 4)
        chunk = lambda row, c: row[CHUNK * t + 32 * c: CHUNK * t + 32 * c + CHUNK]  # noqa: E731
        w_buf = [chunk(w[g], 0), chunk(w[g], 1), chunk(w[g + 8], 0), chunk(w[g + 8], 1)]
        x_buf = [chunk(x[g], 0), chunk(x[g], 1)]
        for p in places:
            a[lane][p.kk][p.a_lo] = float(w_buf[p.c][p.off])
            a[lane][p.kk][p.a_hi] = float(w_buf[2 + p.c][p.off])
            b[lane][p.kk][p.s] = float(x_buf[p.c][p.off])
    acc = torch.zeros(16, 8, dtype=torch.float64)
    for kk in range(4):
        A = torch.zeros(16, 16, dtype=torch.float64)
        B = torch.zeros(16, 8, dtype=torch.float64)
        for lane in range(32):
            for i in range(8):
                A[_ptx_a(lane, i)] = a[lane][kk][i]
            for i in range(4):
                B[_ptx_b(lane, i)] = b[lane][kk][i]
        acc += A @ B
    return [[float(acc[_ptx_c(lane, i)]) for i in range(4)] for lane in range(32)]


def test_placement_computes_the_dot_products_the_epilogue_stores():
    """Every lane's accumulator v, at the (input row, weight row) accumulator_coords
    names, is the dot product over the step's 64 K -- though no MMA k-slot holds the
    K the loads read it from."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randint(-8, 8, (16, GEMV_K_STEP), generator=gen).double()
    x = torch.randint(-8, 8, (8, GEMV_K_STEP), generator=gen).double()
    want = x @ w.t()  # [input row, weight row]
    got = _emulate_step(w, x)
    seen = set()
    for lane in range(32):
        g, t = divmod(lane, 4)
        for v in range(4):
            row, col = accumulator_coords(v, g, t)
            assert got[lane][v] == want[row, col], (lane, v, row, col)
            seen.add((row, col))
    assert len(seen) == 8 * 16  # every output of the MMA tile, once


def test_placement_uses_each_loaded_element_once():
    places = placements()
    assert sorted((p.c, p.off) for p in places) == [(c, o) for c in range(2) for o in range(CHUNK)]
    assert sorted((p.kk, p.s) for p in places) == [(kk, s) for kk in range(4) for s in range(4)]
    for kk in range(4):
        regs = sorted(r for p in places if p.kk == kk for r in (p.a_lo, p.a_hi))
        assert regs == list(range(8))


# --- configs and eligibility ----------------------------------------------------


@pytest.mark.parametrize("m,block", [(1, 8), (7, 8), (8, 8), (9, 16), (16, 16), (17, 32), (33, 64), (64, 64)])
def test_the_smallest_block_that_holds_m(m, block):
    configs = small_m_configs(m, 14336, 4096)
    assert {c.m_block for c in configs} == {block}
    assert len({c.name for c in configs}) == len(configs) >= 3


@pytest.mark.parametrize("kwargs,why", [
    ({"m_block": 12}, "m_block=12"),
    ({"warps": 3}, "warps=3"),
    ({"m_block": 128, "warps": 32}, "m_block=128 (must be one of (8, 16, 32, 64)); warps=32"),
])
def test_invalid_gemv_config_names_every_problem(kwargs, why):
    with pytest.raises(LoweringError, match=r"invalid GemvConfig: .*" + why.replace("(", r"\(").replace(")", r"\)")):
        GemvConfig(**kwargs)


@pytest.mark.parametrize("m,n,k,dtype,layout,out,why", [
    (16, 14336, 4096, torch.bfloat16, "nk", torch.bfloat16, None),
    (1, 16, 64, torch.float16, "nk", torch.float32, None),
    (64, 1024, 4096, torch.bfloat16, "nk", torch.float16, None),
    (0, 4096, 4096, torch.bfloat16, "nk", None, "M=0: nothing to compute"),
    (65, 4096, 4096, torch.bfloat16, "nk", None, "M=65 is above 64"),
    (16, 4096, 4096, torch.bfloat16, "kn", None, "the weight layout is 'kn'"),
    (16, 4096, 4096, torch.bfloat16, "s4096x2", None, "the weight layout is 's4096x2'"),
    (16, 1000, 4096, torch.bfloat16, "nk", None, "N=1000 is not a multiple of 16"),
    (16, 4096, 4104, torch.bfloat16, "nk", None, "K=4104 is not a multiple of 64"),
    (16, 4096, 4096, torch.float32, "nk", None, "dtype float32 is not supported"),
])
def test_small_m_eligibility(m, n, k, dtype, layout, out, why):
    got = small_m_ineligibility(m, n, k, dtype, layout, out)
    if why is None:
        assert got is None
    else:
        assert got is not None and got.startswith(why), got


# --- the tuner's candidates -------------------------------------------------------


def _problem(m, n, k, dtype=torch.bfloat16, layout="nk", chain="bias@0;gelu_tanh", out="bfloat16"):
    spec = EpilogueSpec.parse(f"w={layout};{chain};out={out}")
    a = torch.randn(m, k).to(dtype)
    w = torch.randn(n, k).to(dtype)
    b_kn = w.t() if layout == "nk" else w.t().contiguous()
    return Problem.of(a, b_kn, [torch.randn(n).to(dtype)], spec)


def _names(problem):
    return [c.name for c in cands_mod._cutedsl_candidates(problem)]


@pytest.fixture
def cutedsl_here(monkeypatch):
    monkeypatch.setattr(cands_mod, "cutedsl_available", lambda: (True, ""))
    monkeypatch.delenv("BRANCHYARD_NVGEMM_MAX_CONFIGS", raising=False)


def test_small_m_candidates_come_first_and_only_where_they_apply(cutedsl_here):
    names = _names(_problem(16, 64, 128))
    small = [f"cutedsl:{c.name}" for c in small_m_configs(16, 64, 128)]
    assert names[:3] == ["cutedsl:gemv_m16_w8", "cutedsl:gemv_m16_w4", "cutedsl:gemv_m16_w16"]
    assert names[:len(small)] == small
    assert all(not n.startswith("cutedsl:gemv") for n in names[len(small):]) and len(names) > len(small)
    default = [c.name for c in cands_mod.default_candidates(_problem(1, 64, 128), inductor=False)]
    assert default[0] == "cutedsl:gemv_m8_w8" and default[-1] == "aten:unfused"


@pytest.mark.parametrize("problem_args", [
    dict(m=128, n=64, k=128),                       # M above 64
    dict(m=16, n=64, k=128, layout="kn"),           # [K, N] weight
    dict(m=16, n=40, k=128),                        # N off the 16-row MMA
    dict(m=16, n=64, k=200),                        # K off the 64-wide step
    dict(m=16, n=64, k=128, dtype=torch.float32),   # fp32 inputs
])
def test_small_m_candidates_are_not_offered(cutedsl_here, problem_args):
    assert not any(n.startswith("cutedsl:gemv") for n in _names(_problem(**problem_args)))


def test_small_m_candidate_says_why_it_does_not_apply(cutedsl_here):
    """The tuner asks ``applies`` again for a recorded winner on another problem."""
    (cand, *_) = cands_mod._cutedsl_candidates(_problem(16, 64, 128))
    assert cand.applies(_problem(16, 64, 128)) is None
    assert cand.applies(_problem(16, 64, 128, layout="kn")).startswith("the weight layout is 'kn'")


def test_max_configs_limits_the_small_m_list_too(cutedsl_here, monkeypatch):
    monkeypatch.setenv("BRANCHYARD_NVGEMM_MAX_CONFIGS", "1")
    names = _names(_problem(4, 64, 128))
    assert names[0] == "cutedsl:gemv_m8_w8" and len(names) == 2


def test_no_candidates_without_cutedsl(monkeypatch):
    monkeypatch.setattr(cands_mod, "cutedsl_available", lambda: (False, "no CUDA device"))
    assert _names(_problem(16, 64, 128)) == []


# --- compile and cache ------------------------------------------------------------

ENV = {"gpu": "FakeGPU sm90", "driver": "13.0", "cuda": "13.0", "torch": "2.14", "cutedsl": "4.8"}


def _key(config, **kw):
    base = dict(steps=plan_steps(EpilogueSpec.parse("w=nk;bias@0;silu;out=bfloat16")), dtype="bfloat16",
                out_dtype="bfloat16", operand_dtypes=["bfloat16"], b_layout="nk", config=config)
    return KernelCache("/nonexistent", env=ENV).digest(cg.kernel_cache_key(**{**base, **kw}))


def test_cache_keys_tell_the_kernels_and_configs_apart():
    keys = [_key(GemvConfig(16, 8)), _key(GemvConfig(16, 4)), _key(GemvConfig(8, 8)), _key(GemmConfig(64, 64)),
            _key(GemvConfig(16, 8), out_dtype="float32")]
    assert len(set(keys)) == len(keys)
    assert _key(GemvConfig(16, 8)) == _key(GemvConfig(16, 8))
    assert cg.kernel_cache_key(plan_steps(EpilogueSpec.parse("w=nk;out=bfloat16")), "bfloat16", "bfloat16", [],
                               "nk", GemvConfig())["kernel"] == "gemv"


@pytest.fixture
def fake_compile(monkeypatch):
    """compile_fused_gemm with CuTeDSL stubbed: ``_compile`` returns a launcher that
    computes the reference, and records what it was asked for."""
    from branchyard.lowering.nvgemm.epilogue import reference_epilogue

    calls = []
    monkeypatch.setattr(cg, "cutedsl_available", lambda: (True, ""))
    monkeypatch.setattr(cg, "_CACHE", {})

    def compile_(steps, dtype, out_dtype, operand_dtypes, b_layout, config):
        calls.append((dtype, out_dtype, tuple(operand_dtypes), b_layout, config))

        def launch(a, b_nk, out, ops):
            launched.append(a.shape[0])
            acc = a.float() @ b_nk.float().t()
            out.copy_(reference_epilogue(acc, spec_of[0], list(ops[:-1])))

        return launch

    launched: list[int] = []
    spec_of: list[EpilogueSpec] = []
    monkeypatch.setattr(cg, "_compile", compile_)
    return calls, launched, spec_of


def test_gemv_compiles_float32_outputs_and_refuses_a_kn_weight(fake_compile):
    calls, launched, spec_of = fake_compile
    spec = EpilogueSpec.parse("w=nk;bias@0;relu;out=float32")
    spec_of.append(spec)
    fn = cg.compile_fused_gemm(spec, torch.bfloat16, GemvConfig(16, 4), kernel_cache=None)
    assert calls == [("bfloat16", "float32", ("bfloat16",), "nk", GemvConfig(16, 4))]
    a, w, bias = torch.randn(3, 64).bfloat16(), torch.randn(32, 64).bfloat16(), torch.randn(32).bfloat16()
    out = torch.empty(3, 32)
    fn(a, w.t(), [bias], out)
    torch.testing.assert_close(out, torch.relu(a.float() @ w.float().t() + bias.float()))
    fn(a[:0], w.t(), [bias], torch.empty(0, 32))  # M = 0: nothing launched
    assert launched == [3]
    with pytest.raises(LoweringError, match="b_layout='kn': the small-M kernel streams"):
        cg.compile_fused_gemm(EpilogueSpec.parse("w=kn;out=bfloat16"), torch.bfloat16, GemvConfig(), kernel_cache=None)
    with pytest.raises(LoweringError, match="output dtype float32"):
        cg.compile_fused_gemm(spec, torch.bfloat16, GemmConfig(64, 64), kernel_cache=None)


def test_compile_rejects_other_config_types(fake_compile):
    with pytest.raises(LoweringError, match="config must be a GemmConfig or GemvConfig, got str"):
        cg.compile_fused_gemm(EpilogueSpec.parse("w=nk;out=bfloat16"), torch.bfloat16, "gemv_m16_w8")
