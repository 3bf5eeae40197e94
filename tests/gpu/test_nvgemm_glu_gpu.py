"""GPU tests of a GLU's two matmuls as one op (``mul_mm``): the small-M kernel's dual
configs reading both weights in one pass, the expanded chain on the other kernels,
and the rewrite of a gated MLP block, eagerly and in a CUDA graph.

Every dual config the tuner can list, at M inside one CTA's rows and past them,
at one CTA of weight rows and one K step, at K step counts that leave a warp its
single steps after the unrolled groups, and at Llama-3-8B's 14336 x 4096; chains
with steps before and after the product and other output dtypes. Outputs are
poisoned (NaN) so an element never written shows up. Skipped without CUDA or
CuTeDSL.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from branchyard.lowering.nvgemm import nvgemm
from branchyard.lowering.nvgemm import tuner as nv_tuner
from branchyard.lowering.nvgemm.epilogue import EpilogueSpec
from branchyard.lowering.nvgemm.kernel_config import small_m_configs
from branchyard.lowering.nvgemm.matcher import find_epilogue_chains
from branchyard.lowering.nvgemm.winners import WinnerDB

from nvgemm_gpu_support import (
    capture_after_warmup,
    check_small_m_shapes,
    float64_reference,
    needs_cutedsl,
    small_m_inputs,
)
from nvgemm_gpu_support import check_against_reference as check

FUSED = torch.ops.branchyard.fused_gemm_epilogue.default
DUAL = sorted({c for m in range(1, 65) for c in small_m_configs(m, 4096, 4096, dual=True)}, key=lambda c: c.name)


def test_dual_configs_are_listed_up_to_m_32():
    assert {c.m_block for c in DUAL} == {8, 16, 32} and all(c.dual for c in DUAL)
    assert {c.unroll for c in DUAL} == {1, 2, 4}


# (N, K): one CTA and one K step; 3 steps; 21 and 67 steps (groups, then single steps); Llama-3-8B's gate/up
SHAPES = [(16, 64), (48, 192), (2048, 1344), (1024, 4288), (14336, 4096)]


@needs_cutedsl
@pytest.mark.parametrize("config", DUAL, ids=lambda c: c.name)
def test_every_dual_config_matches_float64(config) -> None:
    spec = EpilogueSpec.parse("w=nk;silu;mul_mm@0;out=bfloat16")
    for m in sorted({1, 5, config.m_block, config.m_block + 3}):
        check_small_m_shapes(spec, config, m, SHAPES)


@needs_cutedsl
@pytest.mark.parametrize("chain, out", [
    ("silu;mul_mm@0", "float16"),
    ("bias@0;silu;mul_mm@1;scale_col@2", "float32"),
    ("mul_mm@0;residual@1", "bfloat16"),
    ("scale:0.5;gelu_tanh;mul_mm@0;bias@1;cast:float16", "float16"),
])
@pytest.mark.parametrize("m", [1, 16, 29])
def test_steps_around_the_product(chain: str, out: str, m: int) -> None:
    dtype = torch.float16 if out == "float16" else torch.bfloat16
    spec = EpilogueSpec.parse(f"w=nk;{chain};out={out}")
    config = small_m_configs(m, 4096, 4096, dual=True)[0]
    check_small_m_shapes(spec, config, m, [(4096, 1024)], dtype)


class GatedMLP(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.gate = nn.Linear(d, h, bias=False)
        self.up = nn.Linear(d, h, bias=False)
        self.down = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return x + self.down(F.silu(self.gate(x)) * self.up(x))


@needs_cutedsl
@pytest.mark.parametrize("calling", ["eager", "graph"])
@pytest.mark.parametrize("m", [1, 16, 200])
def test_gated_mlp_block_rewrite(calling: str, m: int, monkeypatch) -> None:
    """The block's rewrite takes gate, silu, up and the mul into one op; whatever the
    race keeps, the program's output matches the block's, eagerly and replayed."""
    monkeypatch.setenv("BRANCHYARD_NVGEMM_INDUCTOR", "0")  # max-autotune compiles for minutes
    torch.manual_seed(m)
    block = GatedMLP(512, 1536).cuda().to(torch.bfloat16).eval()
    x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
    ep = torch.export.export(block, (x,))
    chain = find_epilogue_chains(ep.graph_module)[0]  # at M = 1 too, where up(x) is [1, N]
    assert str(chain.spec) == "w=nk;silu;mul_mm@0;out=bfloat16", chain
    fused = nvgemm(ep, calling=calling)
    specs = [n.args[3] for n in fused.graph_module.graph.nodes if n.target is FUSED]
    assert not any("silu" in s and "mul_mm" not in s for s in specs), specs  # the race keeps it whole or leaves it
    run = fused.module()
    with torch.no_grad():
        want = block(x)
        if calling == "eager":
            got = run(x)
        else:
            graph, got = capture_after_warmup(lambda: run(x))
            graph.replay()
        torch.cuda.synchronize()
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2 * max(1.0, want.abs().max().item()), rtol=2e-2)


@needs_cutedsl
def test_the_tuner_races_the_dual_kernel_against_the_expanded_ones(monkeypatch, tmp_path) -> None:
    """At M = 1 on Llama-3-8B's gate/up the dual configs are among the timed candidates,
    and the winner (whatever it is) matches the reference."""
    spec = EpilogueSpec.parse("w=nk;silu;mul_mm@0;out=bfloat16")
    monkeypatch.setenv("BRANCHYARD_NVGEMM_INDUCTOR", "0")
    a, w, ops = small_m_inputs(spec, 1, 14336, 4096, torch.bfloat16, seed=11)
    # its own winner database: a winner raced without Inductor must not land in the user's cache
    result = nv_tuner.Autotuner(progress=False, db=WinnerDB(tmp_path)).tune(a, w.t(), ops, spec, "device")
    assert any(name.endswith("_dual") for name in result.timings), (result.timings, result.excluded)
    out = torch.full((1, 14336), float("nan"), dtype=torch.bfloat16, device="cuda")
    res = result.impl(a, w.t(), ops, out)
    torch.cuda.synchronize()
    check(out if res is None else res, float64_reference(a, w, ops, spec), f"tuned: {result.winner}")
