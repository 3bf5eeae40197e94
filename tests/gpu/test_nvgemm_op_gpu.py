"""GPU tests of the fused op end to end: the autotuned implementation of
``branchyard::fused_gemm_epilogue`` for every epilogue x (bf16, fp16) x a few
shapes against the fp32 reference; the nvgemm pass on a GPT-2 block on CUDA;
the winner database; the reference-path fallback for ineligible shapes; and
the cuBLASLt / cuBLAS / Inductor candidates' numerics; a compiled kernel
loaded from the on-disk kernel cache by a second process without compiling.

Skipped without CUDA (tests/gpu/conftest.py). Tests that need our CuTeDSL
kernel skip without it. To keep compile time bounded, the autotuner here
offers one CuTeDSL config (128x128, the one tests/gpu/test_nvgemm_kernel_gpu.py
compiles, so the in-process compile cache is shared), no Inductor and no
cutlass-operators GEMM, except in their own tests.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from branchyard.lowering.nvgemm import NvGemmFallbackWarning, fused_gemm_epilogue, nvgemm
from branchyard.lowering.nvgemm import candidates as nv_candidates
from branchyard.lowering.nvgemm import problem as nv_problem
from branchyard.lowering.nvgemm import timing as nv_timing
from branchyard.lowering.nvgemm import tuner as nv_tuner
from branchyard.lowering.nvgemm import winners as nv_winners
from branchyard.lowering.nvgemm import op as op_mod
from branchyard.lowering.nvgemm.epilogue import EpilogueSpec, reference_fused_gemm
from branchyard.lowering.nvgemm.program_race import ProgramRace

from nvgemm_gpu_support import CUTEDSL_OK, GemmConfig, needs_cutedsl, skip_timing_if_shared

OURS = "cutedsl:t128x128_c1x1_o1"
TOL = {torch.bfloat16: dict(rtol=2e-2, atol=2e-2), torch.float16: dict(rtol=3e-3, atol=3e-3)}

CHAINS = [
    "bias@0",
    "bias@0;relu",
    "bias@0;gelu_erf",
    "bias@0;gelu_tanh",
    "bias@0;silu",
    "bias@0;sigmoid",
    "bias@0;tanh",
    "scale:0.5;residual@0",
    "scale_col@0;residual@1",
    "bias@0;gelu_tanh;residual@1",
    "scale:0.125;bias@0;silu;residual@1",
]
# (M, N, K): a single row, M off every tile with a ragged N tile, a multi-tile square.
SHAPES = [(1, 4096, 512), (333, 1000, 136), (512, 512, 1024)]


def _candidates(problem: nv_problem.Problem) -> list[nv_candidates.Candidate]:
    """Default candidates, CuTeDSL limited to one config, no Inductor and no
    cutlass-operators GEMM (both compile per shape; each has its own test)."""
    rest = [c for c in nv_candidates.default_candidates(problem, inductor=False)
            if not c.name.startswith(("cutedsl:", "cutlass_plain"))]
    if not CUTEDSL_OK:
        return rest
    ours = nv_candidates.Candidate(OURS, functools.partial(nv_candidates._cutedsl_build, config=GemmConfig(128, 128)))
    return [ours] + rest


@pytest.fixture
def tuner(tmp_path):
    t = nv_tuner.Autotuner(_candidates, db=nv_winners.WinnerDB(tmp_path), progress=False)
    nv_tuner.set_autotuner(t)
    op_mod.reset_fallback_warnings()
    yield t
    nv_tuner.set_autotuner(None)


def _inputs(text, dtype, m, n, k, layout="nk", seed=0):
    spec = EpilogueSpec.parse(f"w={layout};{text};out={str(dtype).removeprefix('torch.')}")
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = (torch.randn(m, k, generator=g, device="cuda") / k**0.25).to(dtype)
    w = (torch.randn(n, k, generator=g, device="cuda") / k**0.25).to(dtype)
    b = w if layout == "nk" else w.t().contiguous()
    ops = []
    for st in spec.steps:
        if st.op.operand == "col":
            ops.append(torch.randn(n, generator=g, device="cuda").to(dtype))
        elif st.op.operand == "matrix":
            ops.append(torch.randn(m, n, generator=g, device="cuda").to(dtype))
    return a, b, ops, spec


@needs_cutedsl
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("text", CHAINS)
def test_every_epilogue_autotuned_matches_reference(tuner, text, dtype, shape):
    m, n, k = shape
    a, b, ops, spec = _inputs(text, dtype, m, n, k)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NvGemmFallbackWarning)  # must take the GPU path
        got = fused_gemm_epilogue(a, b, ops, str(spec))
    torch.cuda.synchronize()
    ref = reference_fused_gemm(a, b, ops, spec)
    assert got.dtype == dtype and got.shape == (m, n)
    torch.testing.assert_close(got.float(), ref.float(), **TOL[dtype])
    (res,) = tuner.results.values()
    assert OURS in res.timings, f"our kernel was excluded: {res.excluded.get(OURS)}"
    assert res.winner in res.timings


@needs_cutedsl
@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_both_weight_layouts(tuner, layout):
    a, b, ops, spec = _inputs("bias@0;gelu_erf;residual@1", torch.bfloat16, 256, 512, 256, layout=layout)
    got = fused_gemm_epilogue(a, b, ops, str(spec))
    torch.testing.assert_close(got.float(), reference_fused_gemm(a, b, ops, spec).float(), **TOL[torch.bfloat16])
    (res,) = tuner.results.values()
    assert f"b:{layout}" in res.key and OURS in res.timings


class Block(nn.Module):
    def __init__(self, d=256, h=1024):
        super().__init__()
        self.fc = nn.Linear(d, h)
        self.proj = nn.Linear(h, d)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(x), approximate="tanh"))


@needs_cutedsl
def test_pass_on_a_cuda_gpt2_block(tuner):
    model = Block().cuda().to(torch.bfloat16).eval()
    x = torch.randn(4, 64, 256, device="cuda", dtype=torch.bfloat16)
    ep = torch.export.export(model, (x,))
    # no race (it runs on no device type): every fusable chain fused, whatever the timings
    fused = nvgemm(ep, race=ProgramRace(devices=()))
    specs = [n.args[3] for n in fused.graph.nodes if n.op == "call_function" and "fused_gemm" in str(n.target)]
    assert specs == ["w=nk;bias@0;gelu_tanh;out=bfloat16", "w=nk;bias@0;residual@1;out=bfloat16"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", NvGemmFallbackWarning)
        got = fused.module()(x)
    with torch.no_grad():
        want = model.float()(x.float())
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)
    assert len(tuner.results) == 2


def test_ineligible_shape_runs_unfused_and_says_why_once(tuner):
    a, b, ops, spec = _inputs("bias@0;relu", torch.bfloat16, 64, 64, 12)  # K=12: not a multiple of 8
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got1 = fused_gemm_epilogue(a, b, ops, str(spec))
        fused_gemm_epilogue(a, b, ops, str(spec))
    mine = [w for w in caught if issubclass(w.category, NvGemmFallbackWarning)]
    assert len(mine) == 1
    reason = str(mine[0].message)
    assert "K=12 is not a multiple of 8" in reason or "nvidia-cutlass-dsl is unavailable" in reason
    torch.testing.assert_close(got1.float(), reference_fused_gemm(a, b, ops, spec).float(), **TOL[torch.bfloat16])
    # the unfused path: the original program's ops, bit for bit
    torch.testing.assert_close(got1, torch.relu(a @ b.t() + ops[0]), rtol=0, atol=0)
    assert tuner.results == {}, "the unfused path must not autotune"


@needs_cutedsl
def test_misaligned_pointer_falls_back(tuner):
    a, b, ops, spec = _inputs("bias@0;silu", torch.float16, 64, 64, 64)
    bias = torch.empty(65, dtype=torch.float16, device="cuda")[1:]
    bias.copy_(ops[0])
    with pytest.warns(NvGemmFallbackWarning, match="operand 0 pointer is not 16-byte aligned"):
        got = fused_gemm_epilogue(a, b, [bias], str(spec))
    torch.testing.assert_close(got.float(), reference_fused_gemm(a, b, ops, spec).float(), **TOL[torch.float16])


@needs_cutedsl
def test_winner_database_is_reused_by_a_new_process(tmp_path):
    a, b, ops, spec = _inputs("bias@0;gelu_erf", torch.bfloat16, 128, 256, 256)
    first = nv_tuner.Autotuner(_candidates, db=nv_winners.WinnerDB(tmp_path), progress=False)
    first.select(a, b.t(), ops, spec)

    def no_timing(name, fn):
        raise AssertionError(f"{name} was timed again")

    second = nv_tuner.Autotuner(_candidates, db=nv_winners.WinnerDB(tmp_path), progress=False, timer=no_timing)
    impl = second.select(a, b.t(), ops, spec)
    out = torch.empty(128, 256, dtype=torch.bfloat16, device="cuda")
    got = impl(a, b.t(), ops, out)
    torch.testing.assert_close(got.float(), reference_fused_gemm(a, b, ops, spec).float(), **TOL[torch.bfloat16])
    (res,) = second.results.values()
    assert res.from_cache and f"gpu={torch.cuda.get_device_name()}" in res.key


@pytest.mark.parametrize("text", ["bias@0;relu", "bias@0;gelu_tanh"])
def test_cublaslt_candidate_is_exact_for_its_chains(tmp_path, text):
    """cuBLASLt's GELU epilogue is the tanh form: it must pass the numerics
    check for gelu_tanh (and would fail a swapped gelu_erf at fp32)."""
    a, b, ops, spec = _inputs(text, torch.bfloat16, 256, 512, 256)
    tuner = nv_tuner.Autotuner(
        lambda p: [c for c in nv_candidates.default_candidates(p, inductor=False) if c.name == "cublaslt:_addmm_activation"],
        db=nv_winners.WinnerDB(tmp_path), progress=False)
    if "gelu" in text and nv_candidates._addmm_gelu_form("cuda", torch.bfloat16) != "tanh":
        with pytest.raises(Exception, match="erf GELU"):
            tuner.tune(a, b.t(), ops, spec)
        return
    res = tuner.tune(a, b.t(), ops, spec)
    assert res.winner == "cublaslt:_addmm_activation", res.excluded


def test_cublaslt_gelu_is_the_tanh_form_not_erf():
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(64, 128, generator=g, device="cuda")
    b = torch.randn(128, 256, generator=g, device="cuda")
    bias = torch.randn(256, generator=g, device="cuda")
    got = torch._addmm_activation(bias, a, b, use_gelu=True)
    y = a.double() @ b.double() + bias.double()
    err_tanh = (got.double() - F.gelu(y, approximate="tanh")).abs().max().item()
    err_erf = (got.double() - F.gelu(y)).abs().max().item()
    assert err_tanh < err_erf, (err_tanh, err_erf)
    assert [nv_candidates._addmm_gelu_form("cuda", d) for d in (torch.float32, torch.bfloat16, torch.float16)] == ["tanh"] * 3


def test_addmm_candidate_for_scale_residual(tmp_path):
    a, b, ops, spec = _inputs("scale:0.5;residual@0", torch.float16, 256, 512, 256)
    tuner = nv_tuner.Autotuner(
        lambda p: [c for c in nv_candidates.default_candidates(p, inductor=False) if c.name == "cublas:addmm"],
        db=nv_winners.WinnerDB(tmp_path), progress=False)
    assert tuner.tune(a, b.t(), ops, spec).winner == "cublas:addmm"


def test_inductor_candidate_compiles_and_is_checked(tmp_path, monkeypatch):
    monkeypatch.setenv("BRANCHYARD_NVGEMM_INDUCTOR_MODE", "default")  # max-autotune takes minutes
    a, b, ops, spec = _inputs("bias@0;gelu_erf;residual@1", torch.bfloat16, 128, 256, 256)
    name = nv_candidates.inductor_candidate_name("default")
    tuner = nv_tuner.Autotuner(
        lambda p: [c for c in nv_candidates.default_candidates(p, inductor=True) if c.name == name],
        db=nv_winners.WinnerDB(tmp_path), progress=False)
    res = tuner.tune(a, b.t(), ops, spec)
    assert res.winner == name, res.excluded


def test_cutlass_plain_candidate_when_available(tmp_path):
    from branchyard.lowering.nvgemm.cutlass_operators import plain_gemm_available

    ok, why = plain_gemm_available()
    if not ok:
        pytest.skip(f"cutlass-operators unavailable: {why}")
    a, b, ops, spec = _inputs("bias@0;gelu_erf;residual@1", torch.bfloat16, 256, 512, 256)
    tuner = nv_tuner.Autotuner(
        lambda p: [c for c in nv_candidates.default_candidates(p, inductor=False) if c.name == "cutlass_plain+epilogue"],
        db=nv_winners.WinnerDB(tmp_path), progress=False)
    res = tuner.tune(a, b.t(), ops, spec)
    assert res.winner == "cutlass_plain+epilogue", res.excluded


# The child process of the kernel-cache test: compile_fused_gemm through the
# default on-disk cache ($BRANCHYARD_CACHE_DIR), counting real CuTeDSL compiles.
_CACHE_CHILD = """
import json, sys, time, torch
from branchyard.lowering.nvgemm import cutedsl_gemm as cg
from branchyard.lowering.nvgemm.epilogue import EpilogueSpec, reference_fused_gemm
from branchyard.lowering.nvgemm.kernel_cache import default_kernel_cache
assert cg.cutedsl_available()[0]  # imports CuTeDSL before the clock starts
compiles = []
real = cg._compile
cg._compile = lambda *args: compiles.append(1) or real(*args)
spec = EpilogueSpec.parse("w=nk;bias@0;gelu_erf;residual@1;out=bfloat16")
g = torch.Generator(device="cuda").manual_seed(0)
m, n, k = 300, 512, 512
a = (torch.randn(m, k, generator=g, device="cuda") / k**0.25).bfloat16()
w = (torch.randn(n, k, generator=g, device="cuda") / k**0.25).bfloat16()
ops = [torch.randn(n, generator=g, device="cuda").bfloat16(), torch.randn(m, n, generator=g, device="cuda").bfloat16()]
t0 = time.perf_counter()
fn = cg.compile_fused_gemm(spec, torch.bfloat16, cg.GemmConfig(128, 128))
seconds = time.perf_counter() - t0
out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
fn(a, w.t(), ops, out)
torch.cuda.synchronize()
err = (out.float() - reference_fused_gemm(a, w, ops, spec).float()).abs().max().item()
torch.save(out.cpu(), sys.argv[1])
print("RESULT " + json.dumps({"stats": default_kernel_cache().stats, "compiles": len(compiles),
                               "seconds": seconds, "max_err": err}))
"""


@needs_cutedsl
def test_second_process_loads_the_compiled_kernel_from_disk(tmp_path):
    env = {**os.environ, "BRANCHYARD_CACHE_DIR": str(tmp_path / "cache"), "BRANCHYARD_NVGEMM_KERNEL_CACHE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    runs = []
    for i in range(2):
        proc = subprocess.run([sys.executable, "-c", _CACHE_CHILD, str(tmp_path / f"out{i}.pt")], env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        runs.append(json.loads(line.removeprefix("RESULT ")))
    first, second = runs
    assert first["stats"] == {"hits": 0, "builds": 1, "rebuilt": 0} and first["compiles"] == 1, first
    assert second["stats"] == {"hits": 1, "builds": 0, "rebuilt": 0} and second["compiles"] == 0, second
    # Loading an exported kernel takes milliseconds; the compile took seconds.
    assert second["seconds"] < 0.25 * first["seconds"], (first["seconds"], second["seconds"])
    assert first["max_err"] < 0.1 and second["max_err"] < 0.1, runs
    assert torch.equal(torch.load(tmp_path / "out0.pt"), torch.load(tmp_path / "out1.pt"))
    (entry,) = (tmp_path / "cache" / "nvgemm" / "kernels").iterdir()
    assert json.loads((entry / "kernel.json").read_text())["compile_s"] > 0


@pytest.mark.timing
def test_event_timer_counts_device_time_not_host_time() -> None:
    """A candidate with host overhead (guards, several launches) is ranked by its
    kernels' device time, as it runs under CUDA graphs; real device time still counts;
    timed for an eager caller, the host's time shows."""
    import time

    x = torch.randn(1 << 20, device="cuda")

    # 3 ms of host work per call: more than the GPU's work per call (the L2 flush and the kernel)
    # even when other processes share the GPU (-n 5 on the H200 hid a 0.4 ms sleep behind their work).
    def host_heavy():
        time.sleep(3e-3)  # Python/dispatch overhead: no GPU work
        x.mul_(1.0)  # one ~5 us kernel

    def device_heavy():
        torch.cuda._sleep(2_000_000)  # ~1 ms of GPU spinning at <= 2 GHz

    assert nv_timing.cuda_event_timer(host_heavy, reps=10) < 0.1  # ms: the kernel, not the 3 ms on the host
    assert nv_timing.cuda_event_timer(device_heavy, reps=5) > 0.5
    # Another process's work on the GPU delays our start event until the host's sleep is
    # over (-n 5 with two more runs on the H200 read 6 us), so this one needs the GPU alone.
    skip_timing_if_shared("host-inclusive event timing")
    # What an eager caller waits for: the host's 3 ms per call is the time.
    assert nv_timing.cuda_event_timer(host_heavy, reps=10, device_only=False) > 2.5


def test_paired_ratio_measures_device_time_side_by_side() -> None:
    """One function against itself is 1 within noise; twice the work is about 2;
    host overhead in one of them does not count."""
    import time

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def once():
        torch.mm(a, a)

    def twice():
        torch.mm(a, a)
        torch.mm(a, a)

    def host_heavy():
        time.sleep(300e-6)
        torch.mm(a, a)

    same, spread = nv_timing.paired_ratio(once, once, pairs=30)
    assert abs(same - 1.0) < 0.03 and spread < 0.05, (same, spread)
    double, _ = nv_timing.paired_ratio(twice, once, pairs=30)
    assert 1.8 < double < 2.2, double
    hidden, _ = nv_timing.paired_ratio(host_heavy, once, pairs=30)
    assert abs(hidden - 1.0) < 0.05, hidden
