"""GPU tests of our CuTeDSL sm_90a GEMM with the epilogue fused in registers.

Every epilogue of the shared table, in bfloat16 and float16, on shapes with
M = 1, M not a multiple of any tile, and N = 14336, against the fp32
reference of ``epilogue.reference_fused_gemm``; outputs are poisoned (NaN)
before each launch so that an element the kernel fails to write shows up.
Skipped where there is no CUDA device or no CuTeDSL (tests/gpu/conftest.py
and the ``requires_cutedsl`` mark below).
"""

from __future__ import annotations

import pytest
import torch

from branchyard.errors import LoweringError
from branchyard.lowering.nvgemm import cutedsl_gemm as cg
from branchyard.lowering.nvgemm import kernel_config
from branchyard.lowering.nvgemm.epilogue import EpilogueSpec, reference_fused_gemm

_OK, _WHY = cg.cutedsl_available() if torch.cuda.is_available() else (False, "no CUDA device")
pytestmark = pytest.mark.skipif(not _OK, reason=f"CuTeDSL kernel unavailable: {_WHY}")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# One chain per table row, with the benchmark chains among them.
CHAINS = [
    "bias@0",
    "bias@0;relu",
    "bias@0;gelu_erf",
    "bias@0;gelu_tanh",
    "bias@0;silu",
    "bias@0;sigmoid",
    "bias@0;tanh",
    "scale:0.5;residual@0",
    "bias@0;gelu_tanh;residual@1",
    "scale_col@0;cast:float16;residual@1",
    "bias@0;silu;mul@1",
]
# (M, N, K): M=1, M off every tile (100, 333), N=14336, a multi-tile square.
SHAPES = [(1, 4096, 512), (100, 14336, 256), (333, 1000, 136), (512, 512, 1024)]
CONFIG = cg.GemmConfig(128, 128)
# The same tile with the residual brought in by TMA instead of gathered.
CONFIG_RTMA = cg.GemmConfig(128, 128, residual_tma=True)
# The persistent ping-pong kernel (each consumer warpgroup a 128x128 tile).
CONFIG_PP = cg.GemmConfig(128, 128, residual_tma=True, persistent=True)


def _operands(spec: EpilogueSpec, m: int, n: int, dtype: torch.dtype, gen: torch.Generator) -> list[torch.Tensor]:
    ops: list[torch.Tensor | None] = [None] * spec.num_operands
    for step in spec.steps:
        if step.op.operand == "col":
            ops[step.operand] = torch.randn(n, generator=gen, device="cuda").to(dtype)  # type: ignore[index]
        elif step.op.operand == "matrix":
            ops[step.operand] = torch.randn(m, n, generator=gen, device="cuda").to(dtype)  # type: ignore[index]
    return ops  # type: ignore[return-value]


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, layout: str, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a = (torch.randn(m, k, generator=gen, device="cuda") / k**0.25).to(dtype)
    w = (torch.randn(n, k, generator=gen, device="cuda") / k**0.25).to(dtype)
    b = w if layout == "nk" else w.t().contiguous()
    return a, b, gen


def _run(spec: EpilogueSpec, a, b, operands, config=CONFIG) -> torch.Tensor:
    m, n = a.shape[0], (b.shape[0] if spec.weight_layout == "nk" else b.shape[1])
    fn = cg.compile_fused_gemm(spec, a.dtype, config)
    out = torch.full((m, n), float("nan"), dtype=spec.out_dtype, device="cuda")  # poison
    b_kn = b.t() if spec.weight_layout == "nk" else b
    fn(a, b_kn, operands, out)
    torch.cuda.synchronize()
    return out


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any(), f"{int(out.isnan().sum())} output elements were never written"
    tol = {torch.bfloat16: 2e-2, torch.float16: 4e-3}[out.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol * max(1.0, ref.abs().max().item()) / 4, rtol=tol)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("chain", CHAINS)
@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_every_epilogue_matches_fp32_reference(chain: str, dtype: str, layout: str) -> None:
    if layout == "kn" and chain not in ("bias@0;gelu_erf", "scale:0.5;residual@0"):
        pytest.skip("the [K, N] weight layout is covered by two chains")
    spec = EpilogueSpec.parse(f"w={layout};{chain};out={dtype}")
    matrix = "residual" in chain or "mul@" in chain  # a [M, N] operand: also through the TMA read
    configs = [CONFIG, CONFIG_PP, CONFIG_RTMA] if matrix else [CONFIG, CONFIG_PP]
    for m, n, k in SHAPES:
        a, b, gen = _inputs(m, n, k, DTYPES[dtype], layout)
        ops = _operands(spec, m, n, DTYPES[dtype], gen)
        ref = reference_fused_gemm(a, b, ops, spec)
        for config in configs:
            _check(_run(spec, a, b, ops, config), ref, DTYPES[dtype])


def test_plain_gemm_matches_torch_mm() -> None:
    spec = EpilogueSpec.parse("w=nk;out=bfloat16")
    a, b, _ = _inputs(1000, 14336, 4096, torch.bfloat16, "nk")
    out = _run(spec, a, b, [], cg.GemmConfig(128, 256))
    _check(out, (a.float() @ b.float().t()), torch.bfloat16)


@pytest.mark.parametrize("m", [1, 16, 128, 2048])
def test_every_candidate_config_is_correct(m: int) -> None:
    spec = EpilogueSpec.parse("w=nk;bias@0;gelu_tanh;residual@1;out=bfloat16")
    n, k = 4096, 1024
    a, b, gen = _inputs(m + 3, n, k, torch.bfloat16, "nk", seed=m)  # ragged M on purpose
    ops = _operands(spec, m + 3, n, torch.bfloat16, gen)
    ref = reference_fused_gemm(a, b, ops, spec)
    for config in kernel_config.candidate_configs(m, n, k, torch.bfloat16):
        out = _run(spec, a, b, ops, config)
        _check(out, ref, torch.bfloat16)


PERSISTENT = [
    CONFIG_PP,
    cg.GemmConfig(128, 128, residual_tma=False, persistent=True),
    cg.GemmConfig(128, 128, cluster_m=2, residual_tma=True, persistent=True),
    cg.GemmConfig(64, 256, residual_tma=True, persistent=True),
    cg.GemmConfig(128, 64, cluster_m=2, residual_tma=True, persistent=True),
    cg.GemmConfig(64, 128, cluster_m=2, residual_tma=True, persistent=True),
]


@pytest.mark.parametrize("config", PERSISTENT, ids=lambda c: c.name)
@pytest.mark.parametrize("m,n,k", [(2051, 4096, 1024), (4099, 1000, 64), (1500, 2056, 136)])
def test_persistent_kernel_many_tiles_per_cta(config: cg.GemmConfig, m: int, n: int, k: int) -> None:
    """Several tiles per CTA (both consumer warpgroups, the ring wrapping many times),
    ragged M and N, one k-tile (K=64, fewer than the ring's stages) and a ragged K."""
    spec = EpilogueSpec.parse("w=nk;bias@0;gelu_erf;residual@1;out=bfloat16")
    a, b, gen = _inputs(m, n, k, torch.bfloat16, "nk", seed=k)
    ops = _operands(spec, m, n, torch.bfloat16, gen)
    _check(_run(spec, a, b, ops, config), reference_fused_gemm(a, b, ops, spec), torch.bfloat16)


def _gelu_discriminating_inputs():
    """Inputs whose products land in [-3.0, -2.4], where erf-GELU and tanh-GELU
    differ by 3-5e-4 on outputs of about -0.01 (about 50 float16 ulps)."""
    m, n, k = 256, 2048, 64
    gen = torch.Generator(device="cuda").manual_seed(7)
    a = torch.full((m, k), 1.0 / 32, device="cuda", dtype=torch.float16)
    w = (torch.rand(n, k, generator=gen, device="cuda") * 0.3 - 1.5).to(torch.float16)
    return a, w


def gelu_swap_errors(out: torch.Tensor, a: torch.Tensor, w: torch.Tensor, mine: str, other: str) -> tuple[float, float]:
    """Max distance of ``out`` to the exact ``mine`` formula, and the least gap between the two formulas."""
    from branchyard.lowering.nvgemm.epilogue import EPILOGUE_OPS, TORCH_MATH

    acc = a.float() @ w.float().t()
    f_mine = EPILOGUE_OPS[mine].formula(acc, TORCH_MATH)
    f_other = EPILOGUE_OPS[other].formula(acc, TORCH_MATH)
    return (out.float() - f_mine).abs().max().item(), (f_mine - f_other).abs().min().item()


@pytest.mark.parametrize("config", [CONFIG, CONFIG_PP], ids=lambda c: c.name)
def test_gelu_variants_are_not_swapped(config: cg.GemmConfig) -> None:
    a, w = _gelu_discriminating_inputs()
    for mine, other in (("gelu_erf", "gelu_tanh"), ("gelu_tanh", "gelu_erf")):
        out = _run(EpilogueSpec.parse(f"w=nk;{mine};out=float16"), a, w, [], config)
        err, gap = gelu_swap_errors(out, a, w, mine, other)
        assert err * 4 < gap, f"{mine}: output is {err:.2e} from its own formula; the two GELUs differ by >= {gap:.2e}"


def test_ineligible_shapes_are_reported() -> None:
    assert kernel_config.check_eligible(64, 4096, 100, "bfloat16") == (
        "K=100 is not a multiple of 8 (TMA needs 16-byte rows of 16-bit elements)"
    )
    assert "not supported" in kernel_config.check_eligible(64, 4096, 4096, torch.float32)


def test_wrong_operand_count_raises() -> None:
    spec = EpilogueSpec.parse("w=nk;bias@0;out=bfloat16")
    fn = cg.compile_fused_gemm(spec, torch.bfloat16, CONFIG)
    a, b, _ = _inputs(64, 256, 64, torch.bfloat16, "nk")
    out = torch.empty(64, 256, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(LoweringError, match="0 operand tensors for a kernel built for 1"):
        fn(a, b.t(), [], out)


def test_float32_output_is_refused_clearly() -> None:
    spec = EpilogueSpec.parse("w=nk;bias@0;out=float32")
    with pytest.raises(LoweringError, match="output dtype float32"):
        cg.compile_fused_gemm(spec, torch.bfloat16, CONFIG)
