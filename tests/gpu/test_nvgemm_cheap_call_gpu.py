"""The op's cheap tuned call and the Dynamo-free Inductor candidate on CUDA
(issue 12 part 2; the CPU tests are tests/lowering/test_nvgemm_op_dispatch.py
and tests/lowering/test_nvgemm_inductor_candidate.py): a tuned signature
neither plans nor queries the capture state again and replays correctly from
a CUDA graph with its remembered weight view, and finds its plan through
its guard per device; the ``triton:inductor``
candidate compiles more than eight chains in one process with no Dynamo frame,
its calls leave Dynamo's counters alone, a compiled shape captures into a CUDA
graph, and a shape first seen inside a capture runs the eager chain
(capturable) instead of compiling; the plan's output allocator on every
device and in a capture; our kernel's bound launch (both weight layouts, the
small-M kernel) eagerly, into ``out`` and replayed.

Skipped without CUDA (tests/gpu/conftest.py). Inductor runs in its default
mode here (max-autotune takes minutes per shape)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._dynamo.utils import counters

from branchyard.lowering.nvgemm import NvGemmFallbackWarning
from branchyard.lowering.nvgemm import candidates as nv_candidates
from branchyard.lowering.nvgemm import op as op_mod
from branchyard.lowering.nvgemm import tuner as nv_tuner
from branchyard.lowering.nvgemm import winners as nv_winners
from branchyard.lowering.nvgemm.epilogue import EpilogueSpec, reference_fused_gemm
from branchyard.lowering.nvgemm.kernel_config import GemmConfig, GemvConfig
from branchyard.lowering.nvgemm.problem import Problem
from nvgemm_gpu_support import capture_after_warmup, needs_cutedsl

TOL = dict(rtol=2e-2, atol=2e-2)
FUSED = torch.ops.branchyard.fused_gemm_epilogue.default


def _dynamo_state() -> dict:
    return {k: dict(counters[k]) for k in ("frames", "stats", "recompiles", "graph_break")}


def _case(text: str, m: int, n: int, k: int, seed: int, dtype=torch.bfloat16, layout="kn"):
    g = torch.Generator(device="cuda").manual_seed(seed)
    spec = EpilogueSpec.parse(f"w={layout};{text};out={str(dtype).removeprefix('torch.')}")
    a = (torch.randn(m, k, generator=g, device="cuda") / k**0.25).to(dtype)
    b = (torch.randn(k, n, generator=g, device="cuda") / k**0.25).to(dtype)
    if layout == "nk":
        b = b.t().contiguous()
    ops = [torch.randn(n, generator=g, device="cuda").to(dtype) if st.op.operand == "col"
           else torch.randn(m, n, generator=g, device="cuda").to(dtype)
           for st in spec.steps if st.op.operand in ("col", "matrix")]
    return a, b, ops, spec


def _refill(t: torch.Tensor, seed: int) -> None:
    """New values for ``t`` before a replay, seeded and of the scale :func:`_case`
    gives an input (``randn / K**0.25``), so the tolerances mean what they mean there."""
    g = torch.Generator(device=t.device).manual_seed(seed)
    t.copy_(torch.randn(t.shape, generator=g, device=t.device) / t.shape[-1] ** 0.25)


@pytest.fixture
def fresh_inductor(monkeypatch):
    monkeypatch.setattr(nv_candidates, "_INDUCTOR_FNS", {})
    monkeypatch.setattr(nv_candidates, "_INDUCTOR_SAID", set())
    monkeypatch.setenv("BRANCHYARD_NVGEMM_INDUCTOR_MAX", "64")


CHAINS = [
    ("bias@0;relu", 64, 256, 128),
    ("bias@0;gelu_tanh", 64, 256, 128),
    ("bias@0;gelu_erf;residual@1", 32, 128, 256),
    ("bias@0;silu", 128, 128, 128),
    ("scale:0.5;residual@0", 64, 128, 64),
    ("sigmoid", 16, 256, 128),
    ("tanh", 64, 512, 128),
    ("scale_col@0;relu", 128, 256, 64),
    ("bias@0;gelu_tanh;residual@1", 8, 128, 256),
    ("bias@0;relu", 48, 256, 128),
]


def test_inductor_candidate_compiles_ten_chains_without_dynamo(fresh_inductor):
    before = _dynamo_state()
    built = []
    for i, (text, m, n, k) in enumerate(CHAINS):
        a, b, ops, spec = _case(text, m, n, k, seed=i)
        impl = nv_candidates._inductor_build(Problem.of(a, b, ops, spec), "default")
        got = impl(a, b, ops, None)
        torch.testing.assert_close(got.float(), reference_fused_gemm(a, b, ops, spec).float(), **TOL)
        built.append((impl, a, b, ops, got))
    assert len(nv_candidates._INDUCTOR_FNS) == len(CHAINS)
    assert not any(hasattr(fn, "eager_reason") for fn in nv_candidates._INDUCTOR_FNS.values())
    assert _dynamo_state() == before, "no Dynamo frame, no recompile"
    calls_before = {k: dict(v) for k, v in counters.items()}
    for impl, a, b, ops, first in built:
        torch.testing.assert_close(impl(a, b, ops, None), first)
    assert {k: dict(v) for k, v in counters.items()} == calls_before


def test_inductor_candidate_captures_and_never_compiles_inside_a_capture(fresh_inductor):
    a, b, ops, spec = _case("bias@0;gelu_tanh;residual@1", 64, 256, 128, seed=11)
    impl = nv_candidates._inductor_build(Problem.of(a, b, ops, spec), "default")
    impl(a, b, ops, None)  # compiles, outside the capture
    a2 = a[:40].clone()
    ops2 = [ops[0], ops[1][:40].clone()]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        impl(a, b, ops, None)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        warm = impl(a, b, ops, None)
        cold = impl(a2, b, ops2, None)  # first seen while capturing: the eager chain
    assert len(nv_candidates._INDUCTOR_FNS) == 1, "nothing compiled while capturing"
    _refill(a, 111)
    _refill(a2, 112)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(warm.float(), reference_fused_gemm(a, b, ops, spec).float(), **TOL)
    # the eager chain rounds to bf16 after every step (as the original program did), so it is
    # compared with that chain run outside the capture, not with the fp32-epilogue reference
    eager = nv_candidates.unfused_impl(spec)(a2, b, ops2, None)
    torch.testing.assert_close(cold.float(), eager.float(), **TOL)


def test_tuned_signature_skips_the_capture_query_and_replays_with_the_weight_view(tmp_path, monkeypatch):
    cands = lambda p: [c for c in nv_candidates.default_candidates(p, inductor=False)  # noqa: E731
                       if c.name in ("cublas:addmm+aten", "aten:unfused")]
    tuner = nv_tuner.Autotuner(cands, db=nv_winners.WinnerDB(tmp_path), progress=False)
    nv_tuner.set_autotuner(tuner)
    asked = []
    real = op_mod._capturing
    monkeypatch.setattr(op_mod, "_capturing", lambda a: asked.append(1) or real(a))
    try:
        a, w, ops, spec = _case("bias@0;gelu_tanh;residual@1", 64, 256, 128, seed=5, layout="nk")
        text = str(spec)
        with warnings.catch_warnings():
            warnings.simplefilter("error", NvGemmFallbackWarning)
            first = FUSED(a, w, ops, text)
            graph, captured = capture_after_warmup(lambda: FUSED(a, w, ops, text))
        assert asked == [1], "only the signature's first call asks whether a capture is on"
        assert len(tuner.call_plans) == 1
        w.mul_(0.5)  # in place: the remembered view sees it
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(captured.float(), reference_fused_gemm(a, w, ops, spec).float(), **TOL)
        torch.testing.assert_close(FUSED(a, w, ops, text), captured)  # eager, same plan and view
        assert first.shape == captured.shape
    finally:
        nv_tuner.set_autotuner(None)



def test_guarded_plans_on_cuda_keep_one_plan_per_device_and_replay_from_a_capture(tmp_path):
    """A tuned signature is found through its coarse key and C++ guard on CUDA
    tensors: each device (the first two) keeps its own plan and output device,
    a weight of other strides on one device gets its own plan, and a call
    found through its guard replays from a CUDA graph after the input changed."""
    cands = lambda p: [c for c in nv_candidates.default_candidates(p, inductor=False)  # noqa: E731
                       if c.name in ("cublas:addmm+aten", "aten:unfused")]
    tuner = nv_tuner.Autotuner(cands, db=nv_winners.WinnerDB(tmp_path), progress=False)
    nv_tuner.set_autotuner(tuner)
    try:
        cases = []
        for index in range(min(torch.cuda.device_count(), 2)):
            with torch.cuda.device(index):
                cases.append(_case("bias@0;gelu_tanh;residual@1", 64, 256, 128, seed=7 + index, layout="nk"))
        a, w, ops, spec = cases[0]
        cases.append((a, w.t().contiguous().t(), ops, spec))  # [N, K] with other strides, same device
        with warnings.catch_warnings():
            warnings.simplefilter("error", NvGemmFallbackWarning)
            for _ in range(3):
                for a, w, ops, spec in cases:
                    with torch.cuda.device(a.device):
                        got = FUSED(a, w, ops, str(spec))
                    assert got.device == a.device
                    torch.testing.assert_close(got.float(), reference_fused_gemm(a, w, ops, spec).float(), **TOL)
            assert len(tuner.call_plans) == len(cases)
            for a, w, ops, spec in cases:
                coarse = op_mod._coarse_key(str(spec), "host", a, w, ops)
                call = op_mod._guarded_entry(tuner, coarse, a, w, ops).plan
                assert call is tuner.call_plans[op_mod._signature(a, w, ops, str(spec), "host")]
                assert call.device == a.device and call.b_meta == (w.shape, w.stride())
            a, w, ops, spec = cases[0]
            with torch.cuda.device(a.device):
                graph, captured = capture_after_warmup(lambda: FUSED(a, w, ops, str(spec)))
                _refill(a, 113)
                graph.replay()
                torch.cuda.synchronize()
        torch.testing.assert_close(captured.float(), reference_fused_gemm(a, w, ops, spec).float(), **TOL)
    finally:
        nv_tuner.set_autotuner(None)

def test_plan_allocator_on_cuda_matches_torch_empty_on_every_device():
    """The tuned call's output buffer on CUDA: what ``torch.empty`` makes on the
    plan's device, also when another device is current (the fast allocator
    only serves the current device), and inside a CUDA-graph capture (from the
    graph's pool, like any allocation there)."""
    for index in range(torch.cuda.device_count()):
        device = torch.device("cuda", index)
        alloc = op_mod._allocator((16, 128), torch.bfloat16, device)
        for current in range(torch.cuda.device_count()):
            with torch.cuda.device(current):
                got = alloc()
            assert (got.device, got.shape, got.stride(), got.dtype) == (device, (16, 128), (128, 1), torch.bfloat16)
            assert torch._C._dispatch_keys(got) == torch._C._dispatch_keys(torch.empty(1, device=device))
    alloc = op_mod._allocator((8, 64), torch.float32, torch.device("cuda", torch.cuda.current_device()))
    g = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(g, stream=stream):
            buf = alloc()
            buf.fill_(3.0)
    torch.cuda.current_stream().wait_stream(stream)
    buf.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert bool((buf == 3.0).all())


@needs_cutedsl
@pytest.mark.parametrize("config,layout,m", [(GemmConfig(128, 128), "nk", 64), (GemmConfig(128, 128), "kn", 64),
                                              (GemvConfig(16, 8), "nk", 16)], ids=["tiled-nk", "tiled-kn", "gemv"])
def test_fused_kernel_plan_launches_bound_eagerly_into_out_and_replayed(tmp_path, config, layout, m):
    """Our kernel as the only candidate: the plan keeps its bound launch (an
    ``[N, K]`` weight passed as it is, a ``[K, N]`` one through its remembered
    view), and eager calls, a 3-D input, the ``out=`` overload and a CUDA-graph
    replay after the weight changed in place all match the reference."""
    import functools

    ours = nv_candidates.Candidate(f"cutedsl:{config.name}",
                                   functools.partial(nv_candidates._cutedsl_build, config=config))
    tuner = nv_tuner.Autotuner([ours], db=nv_winners.WinnerDB(tmp_path), progress=False)
    nv_tuner.set_autotuner(tuner)
    try:
        a, w, ops, spec = _case("bias@0;gelu_tanh;residual@1", m, 256, 128, seed=11, layout=layout)
        text = str(spec)
        with warnings.catch_warnings():
            warnings.simplefilter("error", NvGemmFallbackWarning)
            for x in (a, a * 0.5, a * 2):
                torch.testing.assert_close(FUSED(x, w, ops, text).float(),
                                           reference_fused_gemm(x, w, ops, spec).float(), **TOL)
            (call,) = tuner.call_plans.values()
            assert call.launch is not call.impl and call.weight_t == (layout == "kn")
            a3, res3 = a.reshape(2, m // 2, 128), ops[1].reshape(2, m // 2, 256)
            got3 = FUSED(a3, w, [ops[0], res3], text)
            torch.testing.assert_close(got3.reshape(m, 256).float(), reference_fused_gemm(a, w, ops, spec).float(), **TOL)
            buf = torch.empty(m, 256, dtype=a.dtype, device="cuda")
            assert torch.ops.branchyard.fused_gemm_epilogue.out(a, w, ops, text, out=buf) is buf
            torch.testing.assert_close(buf.float(), reference_fused_gemm(a, w, ops, spec).float(), **TOL)
            graph, captured = capture_after_warmup(lambda: FUSED(a, w, ops, text))
        w.mul_(0.5)  # in place: the launch reads the weight's storage, not a copy
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(captured.float(), reference_fused_gemm(a, w, ops, spec).float(), **TOL)
    finally:
        nv_tuner.set_autotuner(None)
