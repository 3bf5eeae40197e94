"""The eager race on CUDA (issue 12: "never slower than what they had"): a
small host-bound block rewritten by ``nvgemm(ep)`` and called eagerly through
``.module()`` is not slower than ``ep.module()``, and computes the same.
The CPU tests of the race's logic are tests/lowering/test_nvgemm_eager_race.py.

Skipped without CUDA (tests/gpu/conftest.py). Tuning results go to a fresh
winner database, so an earlier run's choices do not decide this one."""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch
from torch import nn

from branchyard.fx.pass_infra import Pipeline
from branchyard.lowering.nvgemm import tuner as nv_tuner
from branchyard.lowering.nvgemm import winners as nv_winners
from branchyard.lowering.nvgemm.fuse import NvGemmPass, nvgemm

FUSED = torch.ops.branchyard.fused_gemm_epilogue.default
#: How much slower than the unrewritten program the result may measure (timing noise).
TOLERANCE = 1.05


class HostBound(nn.Module):
    """``x + fc2(silu(fc1(x)))`` at d=256: at M=1 each op's GPU work is a few
    microseconds, so the program's time is its host work."""

    def __init__(self, d: int = 256):
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.silu(self.fc1(x)))


@pytest.fixture
def fresh_tuner(tmp_path):
    nv_tuner.set_autotuner(nv_tuner.Autotuner(db=nv_winners.WinnerDB(tmp_path), progress=False))
    yield
    nv_tuner.set_autotuner(None)


def _us_per_call(fns: dict[str, object], x: torch.Tensor, blocks: int = 15, calls: int = 200) -> dict[str, float]:
    """Median us per call of each, in interleaved blocks of back-to-back calls."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for i in range(blocks):
        for name in names if i % 2 == 0 else reversed(names):
            fn = fns[name]
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn(x)
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    return {k: statistics.median(v) for k, v in times.items()}


@pytest.mark.parametrize("m", [1, 16])
def test_rewritten_module_is_not_slower_eagerly_and_matches(fresh_tuner, m):
    torch.manual_seed(0)
    block = HostBound().cuda().to(torch.bfloat16).eval()
    x = torch.randn(m, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ep = torch.export.export(block, (x,))
        p = NvGemmPass().bind_inputs(ep)
        rewritten = Pipeline([p])(ep).program
        report = p.report
        assert report.stats["race"].startswith("raced eagerly: "), report
        before, after, default = ep.module(), rewritten.module(), nvgemm(ep).module()
        for fn in (after, default):
            torch.testing.assert_close(fn(x), before(x), rtol=3e-2, atol=3e-2)
        for _ in range(20):  # warm-up
            before(x), after(x), default(x)
        us = _us_per_call({"unrewritten": before, "rewritten": after, "nvgemm(ep)": default}, x)
    print(f"M={m}: {us} | {report.stats['race']} | {report.stats.get('race_decisions')}")
    # the report's figures describe what the result does
    fused = sum(n.target is FUSED for n in rewritten.graph.nodes)
    assert fused == report.stats["fused"]
    left = [s for s in report.skips if s.reason.startswith("left unfused")]
    assert fused + len(left) == 2
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Other workers share the GPU and the host: the race and the timing above measure
        # their load (the H200 run with -n 6 saw 1-1.5 ms per call of this ~0.2 ms block).
        pytest.skip("host-inclusive timing needs the GPU to itself: run serially (outputs and report checked)")
    assert us["rewritten"] <= us["unrewritten"] * TOLERANCE, (us, str(report))
    assert us["nvgemm(ep)"] <= us["unrewritten"] * TOLERANCE, us


def test_default_nvgemm_races_a_cuda_program_and_graph_calling_does_not(fresh_tuner):
    torch.manual_seed(0)
    block = HostBound().cuda().to(torch.bfloat16).eval()
    x = torch.randn(1, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ep = torch.export.export(block, (x,))
        graph = nvgemm(ep, calling="graph")
        assert sum(n.target is FUSED for n in graph.graph.nodes) == 2  # nothing raced: everything fused
        eager = nvgemm(ep)
        torch.testing.assert_close(eager.module()(x), block(x), rtol=3e-2, atol=3e-2)
        torch.testing.assert_close(graph.module()(x), block(x), rtol=3e-2, atol=3e-2)
