"""GPU tests of the small-M CuTeDSL kernel (``_cutedsl_gemv.py``, ``GemvConfig``).

The kernel against a float64 reference for every epilogue table row, bfloat16
and float16, M in {1, 2, 7, 16, 64} (and M past one CTA's rows), several
(N, K) including the 4096 x 14336 weight; every valid config (``unroll`` 1, 2
and 4, ``rows`` 16 and 32 among them), the variants at every M block boundary,
at K step counts that leave each warp 0 .. U-1 single steps after its groups
and at one CTA of weight rows; every epilogue row again through the deepest
unroll and a 32-row config; the op's tuner racing them all; and bad inputs (non-contiguous or [K, N] weights, fp32
or mixed dtypes, M = 0, K / N off the alignment, CPU tensors) going to the
unfused path or to another kernel, never to a wrong number. Outputs are
poisoned (NaN) before each launch so that an element the kernel fails to
write shows up. Each case is its own test, so one compile failure hides
nothing else. Skipped without CUDA (tests/gpu/conftest.py) or CuTeDSL.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from branchyard.errors import LoweringError
from branchyard.lowering.nvgemm import NvGemmFallbackWarning, fused_gemm_epilogue
from branchyard.lowering.nvgemm import candidates as nv_candidates
from branchyard.lowering.nvgemm import op as op_mod
from branchyard.lowering.nvgemm import tuner as nv_tuner
from branchyard.lowering.nvgemm import winners as nv_winners
from branchyard.lowering.nvgemm.epilogue import EPILOGUE_TABLE, EpilogueSpec
from branchyard.lowering.nvgemm.kernel_config import GemvConfig, small_m_configs

from nvgemm_gpu_support import check_against_reference as _check
from nvgemm_gpu_support import check_small_m_shapes as _check_shapes
from nvgemm_gpu_support import float64_reference as _reference
from nvgemm_gpu_support import launch_small_m as _launch
from nvgemm_gpu_support import small_m_inputs as _inputs
from nvgemm_gpu_support import needs_cutedsl

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Every table row at least once; the multi-step chains of the benchmarks among them.
CHAINS = [
    "",
    "bias@0",
    "scale:0.5",
    "scale_col@0",
    "residual@0",
    "bias@0;relu",
    "bias@0;gelu_erf",
    "bias@0;gelu_tanh",
    "bias@0;silu",
    "bias@0;sigmoid",
    "bias@0;tanh",
    "bias@0;gelu_tanh;residual@1",
    "scale_col@0;cast:float16;residual@1",
    "scale:0.125;bias@0;silu;residual@1",
    "bias@0;silu;mul@1",
]
# (N, K): the 4096 x 14336 weight (N = 14336 outputs of K = 4096) and its
# transpose's shape, one MMA row group (N = 16), one K step per warp or fewer (K = 64, 192).
NK = [(14336, 4096), (4096, 14336), (16, 64), (1024, 192)]
MS = [1, 2, 7, 16, 64]


def test_chains_cover_every_table_row():
    used = {part.partition("@")[0].partition(":")[0] for chain in CHAINS for part in chain.split(";") if part}
    # mul_mm (a second weight) runs on the dual configs: tests/gpu/test_nvgemm_glu_gpu.py
    assert used | {"mul_mm"} == {row.name for row in EPILOGUE_TABLE}


def _spec(chain: str, out: str) -> EpilogueSpec:
    return EpilogueSpec.parse(";".join(filter(None, ["w=nk", chain, f"out={out}"])))


@needs_cutedsl
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("chain", CHAINS, ids=lambda c: c or "plain")
def test_every_epilogue_matches_float64_reference(chain: str, dtype: str, m: int) -> None:
    torch_dtype = DTYPES[dtype]
    spec = _spec(chain, str(torch_dtype).removeprefix("torch."))
    config = small_m_configs(m, 4096, 4096)[0]
    failures = []
    for n, k in NK:
        a, w, ops = _inputs(spec, m, n, k, torch_dtype, seed=n + k + m)
        try:
            _check(_launch(spec, config, a, w, ops), _reference(a, w, ops, spec), f"M={m} N={n} K={k} {config.name}")
        except AssertionError as exc:
            failures.append(str(exc))
    assert not failures, "\n".join(failures)


@needs_cutedsl
@pytest.mark.parametrize("out", ["float32", "float16"])
def test_other_output_dtypes(out: str) -> None:
    spec = _spec("bias@0;gelu_erf;residual@1", out)
    a, w, ops = _inputs(spec, 16, 4096, 1024, torch.bfloat16)
    _check(_launch(spec, GemvConfig(16, 8), a, w, ops), _reference(a, w, ops, spec), f"out={out}")


def _valid_configs() -> list[GemvConfig]:
    out = []
    for r in (16, 32):
        for b in (8, 16, 32, 64):
            for u in (1, 2, 4):
                for w in (4, 8, 16):
                    try:
                        out.append(GemvConfig(b, w, u, r))
                    except LoweringError:  # more registers than fit
                        pass
    return out


ALL_CONFIGS = _valid_configs()
VARIANTS = [c for c in ALL_CONFIGS if (c.unroll, c.rows) != (1, 16)]


def test_every_listed_config_is_among_the_tested():
    listed = {c for m in range(1, 65) for c in small_m_configs(m, 4096, 4096)}
    assert listed <= set(ALL_CONFIGS) and {c.unroll for c in ALL_CONFIGS} == {1, 2, 4}
    assert {c.rows for c in listed} == {16, 32} and len(VARIANTS) == 25


@needs_cutedsl
@pytest.mark.parametrize("config", ALL_CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("m", [1, 13, 64, 100])
def test_every_config_at_ragged_m(config: GemvConfig, m: int) -> None:
    """Every config, M below, at and past its block (M = 100: several CTA rows, the last ragged)."""
    spec = _spec("bias@0;silu;residual@1", "bfloat16")
    a, w, ops = _inputs(spec, m, 2048, 1024, torch.bfloat16, seed=m)
    _check(_launch(spec, config, a, w, ops), _reference(a, w, ops, spec), f"M={m} {config.name}")


# (N, K): one CTA of the config's rows and one K step (only warp 0 works, in the
# single-step loop); 3 steps; 21 and 67 steps (groups, then 1 .. U-1 single steps for
# some warps); the weight.
def _variant_nk(config: GemvConfig) -> list[tuple[int, int]]:
    return [(config.rows, 64), (3 * config.rows, 192), (2048, 1344), (1024, 4288), (14336, 4096)]


@needs_cutedsl
@pytest.mark.parametrize("config", VARIANTS, ids=lambda c: c.name)
@pytest.mark.parametrize("m", [1, 8, 9, 16, 17, 64])
def test_variants_at_every_k_remainder(config: GemvConfig, m: int) -> None:
    _check_shapes(_spec("bias@0;silu;residual@1", "bfloat16"), config, m, _variant_nk(config))


def _variant(kind: str, m: int) -> GemvConfig:
    """The deepest unroll the tuner lists for this M, or its unrolled 32-row config."""
    listed = small_m_configs(m, 4096, 4096)
    if kind == "u4":
        return max(listed, key=lambda c: c.unroll)
    return next(c for c in listed if c.rows == 32 and c.unroll == 2)


@needs_cutedsl
@pytest.mark.parametrize("kind", ["u4", "u2_r32"])
@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("chain", CHAINS, ids=lambda c: c or "plain")
def test_every_epilogue_through_a_variant(chain: str, m: int, kind: str) -> None:
    spec = _spec(chain, "bfloat16")
    config = _variant(kind, m)
    assert config.name.endswith(kind)
    _check_shapes(spec, config, m, [(n, k) for n, k in NK if n % config.rows == 0])


@needs_cutedsl
def test_strided_rows_of_input_and_weight() -> None:
    """Row strides larger than K (views into wider buffers), as the op passes them."""
    spec = _spec("bias@0;relu", "bfloat16")
    a_full, w_full, ops = _inputs(spec, 16, 4096, 1024 + 64, torch.bfloat16)
    a, w = a_full[:, :1024], w_full[:, 64:]
    _check(_launch(spec, GemvConfig(16, 8), a, w, ops), _reference(a, w, ops, spec), "strided rows")


# --- the op and its tuner --------------------------------------------------------------


def _small_m_and_unfused(problem):
    """The small-M candidates (when they apply) and the unfused chain, nothing else."""
    return [c for c in nv_candidates.default_candidates(problem, inductor=False)
            if c.name.startswith("cutedsl:gemv") or c.name == nv_candidates.UNFUSED]


@pytest.fixture
def tuner(tmp_path):
    def make(candidates=None):
        t = nv_tuner.Autotuner(candidates or nv_candidates.default_candidates, db=nv_winners.WinnerDB(tmp_path),
                               progress=False)
        nv_tuner.set_autotuner(t)
        return t

    op_mod.reset_fallback_warnings()
    yield make
    nv_tuner.set_autotuner(None)


@needs_cutedsl
@pytest.mark.parametrize("m", [1, 16, 64])
def test_tuner_races_the_small_m_kernel(tuner, m: int, monkeypatch) -> None:
    monkeypatch.setenv("BRANCHYARD_NVGEMM_INDUCTOR", "0")
    t = tuner()
    spec = _spec("bias@0;gelu_tanh", "bfloat16")
    a, w, ops = _inputs(spec, m, 14336, 4096, torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NvGemmFallbackWarning)
        got = fused_gemm_epilogue(a, w, ops, str(spec))
    _check(got, _reference(a, w, ops, spec), f"op M={m}")
    (res,) = t.results.values()
    mine = [f"cutedsl:{c.name}" for c in small_m_configs(m, 14336, 4096)]
    excluded = {n: res.excluded[n] for n in mine if n in res.excluded}
    assert not excluded, f"small-M candidates excluded: {excluded}"
    assert set(mine) <= set(res.timings), res.table()
    assert "cublas:addmm+aten" in res.timings or "cublaslt:_addmm_activation" in res.timings, res.table()


def _bad_inputs():
    """(name, a, b, operands, spec text, what must happen): 'fallback' = the unfused
    path with a warning naming the reason; 'other' = no small-M candidate, the result correct."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s, dtype=torch.bfloat16, device="cuda": torch.randn(*s, generator=gen, device="cuda").to(  # noqa: E731
        device=device, dtype=dtype)
    w = r(256, 128)
    return [
        ("weight with a column stride", r(16, 128), r(256, 256)[:, ::2], [r(256)], "w=nk;bias@0;relu;out=bfloat16",
         "fallback", "the weight"),
        ("[K, N] weight", r(16, 128), w.t().contiguous(), [r(256)], "w=kn;bias@0;relu;out=bfloat16", "other", None),
        ("fp32 inputs", r(16, 128, dtype=torch.float32), r(256, 128, dtype=torch.float32),
         [r(256, dtype=torch.float32)], "w=nk;bias@0;relu;out=float32", "fallback", "input dtype torch.float32"),
        ("mixed dtypes", r(16, 128), r(256, 128, dtype=torch.float16), [r(256)], "w=nk;bias@0;relu;out=bfloat16",
         "fallback", "weight dtype torch.float16"),
        ("M = 0", r(0, 128), w, [r(256)], "w=nk;bias@0;relu;out=bfloat16", "fallback", "M = 0"),
        ("K = 100", r(16, 100), r(256, 100), [r(256)], "w=nk;bias@0;relu;out=bfloat16", "fallback", "K=100"),
        ("K = 136 (off the 64 step)", r(16, 136), r(256, 136), [r(256)], "w=nk;bias@0;relu;out=bfloat16", "other",
         None),
        ("N = 1000", r(16, 128), r(1000, 128), [r(1000)], "w=nk;bias@0;relu;out=bfloat16", "other", None),
        ("CPU tensors", r(16, 128, device="cpu"), r(256, 128, device="cpu"), [r(256, device="cpu")],
         "w=nk;bias@0;relu;out=bfloat16", "fallback", "tensors are on cpu"),
    ]


_BAD_IDS = ["strided_weight", "kn_weight", "fp32", "mixed", "m0", "k100", "k136", "n1000", "cpu"]


@needs_cutedsl
@pytest.mark.parametrize("case", range(len(_BAD_IDS)), ids=lambda i: _BAD_IDS[i])
def test_bad_inputs_never_reach_the_small_m_kernel(tuner, case: int) -> None:
    name, a, b, ops, text, outcome, reason = _bad_inputs()[case]
    t = tuner(_small_m_and_unfused)
    spec = EpilogueSpec.parse(text)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = fused_gemm_epilogue(a, b, ops, text)
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, NvGemmFallbackWarning)]
    b_nk = b if spec.weight_layout == "nk" else b.t()
    _check(got, _reference(a, b_nk, ops, spec), name)
    if outcome == "fallback":
        assert len(fallbacks) == 1 and reason in fallbacks[0], (name, fallbacks)
        assert t.results == {}, f"{name}: the unfused path must not tune"
    else:
        (res,) = t.results.values()
        assert not any(n.startswith("cutedsl:gemv") for n in res.timings), (name, res.table())
        assert res.winner == nv_candidates.UNFUSED

