"""The fused op inside CUDA-graph captures (issue 12, capture safety; needed
by the pipeline's CUDA-graph lowering): while a stream captures, the op never
tunes, compiles, loads a module or synchronises; it replays the choice made
at warm-up, and a shape first seen during capture runs the unfused ATen ops
(capturable) with the reason said once. Also: the unfused chain is always a
candidate, and each timing mode gets its own choice."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

from branchyard.lowering.nvgemm import NvGemmFallbackWarning, fused_gemm_epilogue, nvgemm, timing_mode
from branchyard.lowering.nvgemm import candidates as nv_candidates
from branchyard.lowering.nvgemm import op as op_mod
from branchyard.lowering.nvgemm import tuner as nv_tuner
from branchyard.lowering.nvgemm import winners as nv_winners
from branchyard.lowering.nvgemm.epilogue import EpilogueSpec, reference_fused_gemm

from nvgemm_gpu_support import CUTEDSL_OK, GemmConfig, needs_cutedsl
TOL = dict(rtol=2e-2, atol=2e-2)
SPEC = "w=nk;bias@0;gelu_tanh;residual@1;out=bfloat16"


class CountingCandidates:
    """The default candidates (one CuTeDSL config, no Inductor), counting builds."""

    def __init__(self):
        self.builds: list[str] = []

    def __call__(self, problem):
        cands = [c for c in nv_candidates.default_candidates(problem, inductor=False)
                 if not c.name.startswith(("cutedsl:", "cutlass_plain"))]
        if CUTEDSL_OK:
            cands.insert(0, nv_candidates.Candidate(
                "cutedsl:t128x128_c1x1_o1",
                functools.partial(nv_candidates._cutedsl_build, config=GemmConfig(128, 128))))
        return [nv_candidates.Candidate(c.name, self._counted(c), c.applies) for c in cands]

    def _counted(self, cand):
        def build(problem):
            self.builds.append(cand.name)
            return cand.build(problem)

        return build


@pytest.fixture
def counted(tmp_path):
    cands = CountingCandidates()
    tuner = nv_tuner.Autotuner(cands, db=nv_winners.WinnerDB(tmp_path), progress=False)
    nv_tuner.set_autotuner(tuner)
    op_mod.reset_fallback_warnings()
    yield tuner, cands
    nv_tuner.set_autotuner(None)


def _inputs(m, n=512, k=256, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = (torch.randn(m, k, generator=g, device="cuda") / k**0.25).bfloat16()
    w = (torch.randn(n, k, generator=g, device="cuda") / k**0.25).bfloat16()
    ops = [torch.randn(n, generator=g, device="cuda").bfloat16(), torch.randn(m, n, generator=g, device="cuda").bfloat16()]
    return a, w, ops


def _capture(fn):
    """Capture ``fn()`` into a CUDA graph (on a side stream, as torch.cuda.graph does); return (graph, output)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.parametrize("warm_mode", ["device", "host"])
def test_warmed_up_shape_replays_its_choice_without_tuning(counted, warm_mode):
    tuner, cands = counted
    a, w, ops = _inputs(64)
    with timing_mode(warm_mode):
        eager = fused_gemm_epilogue(a, w, ops, SPEC)  # warm-up: tunes, builds, loads
    torch.cuda.synchronize()
    builds, results = list(cands.builds), dict(tuner.results)
    with timing_mode("device"), warnings.catch_warnings():
        warnings.simplefilter("error", NvGemmFallbackWarning)  # the warm shape needs no fallback
        graph, out = _capture(lambda: fused_gemm_epilogue(a, w, ops, SPEC))
    assert cands.builds == builds and tuner.results == results, "nothing built or tuned while capturing"
    a.copy_(_inputs(64, seed=1)[0])  # the graph reads the new input
    graph.replay()
    torch.cuda.synchronize()
    spec = EpilogueSpec.parse(SPEC)
    torch.testing.assert_close(out.float(), reference_fused_gemm(a, w, ops, spec).float(), **TOL)
    assert not torch.equal(out, eager)


def test_shape_first_seen_in_capture_runs_unfused_and_says_why_once(counted):
    tuner, cands = counted
    a, w, ops = _inputs(48)
    # cuBLAS makes its handle on a thread's first GEMM, which no capture may do: a process warms it
    # up before capturing (torch's rule; the lowering's warm-up does). Here only our op is first.
    torch.mm(a[:1], w[:1].t())
    torch.cuda.synchronize()
    with timing_mode("device"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph, out = _capture(lambda: (fused_gemm_epilogue(a, w, ops, SPEC), fused_gemm_epilogue(a, w, ops, SPEC))[1])
    assert cands.builds == [] and tuner.results == {} and tuner.call_plans == {}
    mine = [str(x.message) for x in caught if issubclass(x.category, NvGemmFallbackWarning)]
    assert len(mine) == 1 and "shape first seen inside a CUDA-graph capture" in mine[0]
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), reference_fused_gemm(a, w, ops, EpilogueSpec.parse(SPEC)).float(), **TOL)
    # After the capture, the same shape tunes normally.
    fused_gemm_epilogue(a, w, ops, SPEC)
    assert cands.builds and len(tuner.results) == 1


def test_bad_input_inside_a_capture_is_capturable(counted):
    a, w, ops = _inputs(16)
    wt = w.t().contiguous().t()  # [N, K] view of a [K, N] tensor: the kn layout, eligible
    bad = w[:, :250]  # K = 250: not a multiple of 8
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NvGemmFallbackWarning)
        fused_gemm_epilogue(a[:, :250], bad, ops, SPEC)  # warm-up of the bad shape: unfused, remembered
        graph, out = _capture(lambda: fused_gemm_epilogue(a[:, :250], bad, ops, SPEC))
        graph.replay()
        torch.cuda.synchronize()
        spec = EpilogueSpec.parse(SPEC)
        torch.testing.assert_close(out.float(), reference_fused_gemm(a[:, :250], bad, ops, spec).float(), **TOL)
        got = fused_gemm_epilogue(a, wt, ops, SPEC)
        torch.testing.assert_close(got.float(), reference_fused_gemm(a, w, ops, spec).float(), **TOL)


def test_unfused_is_always_a_candidate_and_modes_are_tuned_apart(counted):
    tuner, cands = counted
    a, w, ops = _inputs(16, n=4096, k=4096)
    for mode in ("host", "device"):
        with timing_mode(mode):
            fused_gemm_epilogue(a, w, ops, SPEC)
    assert sorted(k.split("|timing=")[1] for k in tuner.results) == ["device", "host"]
    for result in tuner.results.values():
        assert "aten:unfused" in result.timings, result.table()
        # never slower than the unfused chain, as the tuner measured it
        assert result.timings[result.winner] <= result.timings["aten:unfused"] * 1.0 + 1e-9 or result.playoff


@needs_cutedsl
def test_rewritten_program_captured_by_the_pipeline_matches_eager():
    """An exported block rewritten by nvgemm, warmed up then captured in a CUDA
    graph through torch.cuda.graph: the replay matches the eager module."""

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(512, 2048)
            self.down = torch.nn.Linear(2048, 512)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(x), approximate="tanh"))

    model = MLP().cuda().bfloat16().eval()
    x = torch.randn(32, 512, device="cuda", dtype=torch.bfloat16)
    fused = nvgemm(torch.export.export(model, (x,))).module()
    with timing_mode("device"):
        fused(x)  # warm-up
        torch.cuda.synchronize()
        graph, out = _capture(lambda: fused(x))
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    with torch.no_grad():
        torch.testing.assert_close(out.float(), model(x).float(), rtol=5e-2, atol=5e-2)
