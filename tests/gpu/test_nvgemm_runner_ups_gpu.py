"""Runner-ups on CUDA: a spec's ``impl=`` pin runs the named candidate (or,
where it cannot, the tuned choice, with the reason logged), eagerly and in a
CUDA graph; and the graph race on an attention block's projections (GPT-2's
shapes at M = 64, the issue-12 row where a tuned kernel lost inside the
program) tries only the tuning's runner-ups and keeps a program that computes
the block. The CPU tests of the logic are tests/lowering/test_nvgemm_runner_ups.py.

Skipped without CUDA (tests/gpu/conftest.py)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from branchyard.fx.pass_infra import Pipeline
from branchyard.lowering.nvgemm import op as nv_op
from branchyard.lowering.nvgemm import tuner as nv_tuner
from branchyard.lowering.nvgemm import winners as nv_winners
from branchyard.lowering.nvgemm.fuse import NvGemmPass
from branchyard.lowering.nvgemm.program_race import capture_replay
from branchyard.lowering.nvgemm.timing import timing_mode
from nvgemm_gpu_support import capture_after_warmup

FUSED = torch.ops.branchyard.fused_gemm_epilogue.default
SPEC = "w=nk;bias@0;residual@1;out=bfloat16"


@pytest.fixture
def fresh_tuner(tmp_path):
    nv_tuner.set_autotuner(nv_tuner.Autotuner(db=nv_winners.WinnerDB(tmp_path), progress=False))
    yield nv_tuner.get_autotuner()
    nv_tuner.set_autotuner(None)


def _args(m: int = 64, d: int = 768):
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(m, d, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(d, d, device="cuda", dtype=torch.bfloat16, generator=g) / d ** 0.5
    bias = torch.randn(d, device="cuda", dtype=torch.bfloat16, generator=g)
    res = torch.randn(m, d, device="cuda", dtype=torch.bfloat16, generator=g)
    return a, w, [bias, res], (a.float() @ w.float().t() + bias.float() + res.float()).to(torch.bfloat16)


@pytest.mark.parametrize("mode", ["host", "device"])
def test_a_pinned_spec_runs_the_named_candidate_eagerly_and_in_a_graph(fresh_tuner, caplog, mode):
    a, w, ops, want = _args()
    with caplog.at_level(logging.INFO, logger="branchyard"), timing_mode(mode):
        got = nv_op.fused_gemm_epilogue(a, w, ops, SPEC + ";impl=cublas:addmm+aten")
        graph, out = capture_after_warmup(lambda: nv_op.fused_gemm_epilogue(a, w, ops, SPEC + ";impl=cublas:addmm+aten"))
    torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)
    out.zero_()
    graph.replay()
    torch.testing.assert_close(out, want, rtol=3e-2, atol=3e-2)
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.endswith("-> cublas:addmm+aten (pinned by the spec)") for line in lines), lines
    assert not fresh_tuner.results, "a pinned call tunes nothing"


def test_a_pin_that_does_not_apply_runs_the_tuned_choice_and_says_why(fresh_tuner, caplog):
    a, w, ops, want = _args()
    with caplog.at_level(logging.WARNING, logger="branchyard"):
        got = nv_op.fused_gemm_epilogue(a, w, ops, SPEC + ";impl=cublas:addmm")  # addmm takes no bias+residual
    torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)
    (line,) = [r.getMessage() for r in caplog.records if "pinned implementation" in r.getMessage()]
    assert "the pinned implementation cublas:addmm cannot run it (addmm fuses only" in line
    assert len(fresh_tuner.results) == 1


class AttnProj(nn.Module):
    """GPT-2's attention projections around the attention (``h`` stands for its output)."""

    def __init__(self, d: int = 768):
        super().__init__()
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x, h):
        return self.qkv(x), x + self.o(h)


def test_the_graph_race_tries_only_tuned_runner_ups_and_keeps_a_correct_program(fresh_tuner):
    torch.manual_seed(0)
    block = AttnProj().cuda().to(torch.bfloat16).eval()
    x, h = (torch.randn(64, 768, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    with torch.no_grad():
        want = block(x, h)
        ep = torch.export.export(block, (x, h))
        p = NvGemmPass("graph", merge_siblings=False).bind_inputs(ep)
        out = Pipeline([p])(ep).program
        decisions = p.race_result.decisions
        print("\n".join(p.report.stats["race_decisions"]))
        offered = {}
        for spec, a_shape, b_shape in {("w=nk;bias@0;out=bfloat16", (64, 768), (2304, 768)),
                                       (SPEC, (64, 768), (768, 768))}:
            result = nv_op.tuned_result(spec, "device", a_shape, b_shape)
            assert result is not None, spec
            offered[spec] = result.runner_ups(3)
        tried = [d.chains.rsplit(" impl=", 1) for d in decisions if " impl=" in d.chains]
        for group, name in tried:
            assert name in offered[group.split(" [")[0]], (group, name, offered)
        specs = [n.args[3] for n in out.graph.nodes if n.target is FUSED]
        assert len(specs) == p.report.stats["fused"]
        for group, name in p.race_pins.items():
            assert f"{group.split(' [')[0]};impl={name}" in specs
        with timing_mode("device"):
            replay = capture_replay(out.module(), (x, h))
        for got, ref in zip(replay(), want):
            torch.testing.assert_close(got, ref, rtol=3e-2, atol=3e-2)
