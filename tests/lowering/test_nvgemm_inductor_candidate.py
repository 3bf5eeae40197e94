"""The ``triton:inductor`` candidate without Dynamo (CPU: Inductor's C++
backend): the chain is traced with make_fx and compiled by Inductor for each
exact shape and stride; many chains compile in one process without Dynamo's
recompile limit (no Dynamo frame at all), a call never enters Dynamo, a new
shape of a built implementation compiles its own function, and where
compiling is not allowed (a CUDA-graph capture, past the process cap) or
fails, the chain runs eagerly and says why once."""

from __future__ import annotations

import logging
import re
import warnings

import pytest
import torch
from torch._dynamo.utils import counters

from branchyard.lowering.nvgemm import NvGemmFallbackWarning
from branchyard.lowering.nvgemm import candidates as cands_mod
from branchyard.lowering.nvgemm import op as op_mod
from branchyard.lowering.nvgemm import tuner as tuner_mod
from branchyard.lowering.nvgemm.epilogue import EpilogueSpec, reference_fused_gemm
from branchyard.lowering.nvgemm.problem import Problem
from branchyard.lowering.nvgemm.tuner import Autotuner
from branchyard.lowering.nvgemm.winners import WinnerDB


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch):
    monkeypatch.setattr(cands_mod, "_INDUCTOR_FNS", {})
    monkeypatch.setattr(cands_mod, "_INDUCTOR_SAID", set())
    monkeypatch.delenv("BRANCHYARD_NVGEMM_INDUCTOR_MAX", raising=False)


def _dynamo_state() -> dict:
    return {k: dict(counters[k]) for k in ("frames", "stats", "recompiles", "graph_break")}


def _case(text: str, m: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    spec = EpilogueSpec.parse(f"w=kn;{text};out=float32")
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g) / k**0.5
    ops = [torch.randn(n, generator=g) if st.op.operand == "col" else torch.randn(m, n, generator=g)
           for st in spec.steps if st.op.operand in ("col", "matrix")]
    return a, b, ops, spec


CHAINS = [
    ("bias@0;relu", 8, 16, 32),
    ("bias@0;gelu_tanh", 8, 16, 32),
    ("bias@0;gelu_erf;residual@1", 4, 24, 16),
    ("bias@0;silu", 12, 8, 16),
    ("scale:0.5;residual@0", 8, 16, 8),
    ("sigmoid", 5, 16, 16),
    ("tanh", 8, 32, 16),
    ("scale_col@0;relu", 16, 16, 16),
    ("bias@0;gelu_tanh;residual@1", 3, 8, 24),
    ("bias@0;relu", 6, 16, 32),
]


def test_more_than_eight_chains_compile_without_dynamo_and_match_the_reference():
    before = _dynamo_state()
    impls = []
    for i, (text, m, n, k) in enumerate(CHAINS):
        a, b, ops, spec = _case(text, m, n, k, seed=i)
        impl = cands_mod._inductor_build(Problem.of(a, b, ops, spec), "default")
        got = impl(a, b, ops, None)
        torch.testing.assert_close(got, reference_fused_gemm(a, b, ops, spec), rtol=1e-4, atol=1e-4)
        impls.append((impl, a, b, ops, got))
    assert len(cands_mod._INDUCTOR_FNS) == len(CHAINS), "one compile per chain and shape"
    for fn in cands_mod._INDUCTOR_FNS.values():
        assert not hasattr(fn, "eager_reason"), fn.eager_reason
        assert not isinstance(fn, torch._dynamo.eval_frame.OptimizedModule)
    assert _dynamo_state() == before, "no Dynamo frame was compiled"
    calls_before = {k: dict(v) for k, v in counters.items()}
    for impl, a, b, ops, first in impls:
        for _ in range(3):
            torch.testing.assert_close(impl(a, b, ops, None), first)
    assert {k: dict(v) for k, v in counters.items()} == calls_before, "a call touches neither Dynamo nor Inductor"


@pytest.mark.parametrize("mode", ["default", "max-autotune-no-cudagraphs"])
def test_each_mode_compiles_a_glu_with_its_second_weight_and_matches_the_reference(mode):
    """A gated MLP's ``silu(a @ W1.T) * (a @ W2.T)``: the second weight is an
    operand of the compiled chain; each mode is its own compile."""
    g = torch.Generator().manual_seed(3)
    spec = EpilogueSpec.parse("w=nk;silu;mul_mm@0;out=float32")
    a, w1, w2 = torch.randn(6, 32, generator=g), torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)
    impl = cands_mod._inductor_build(Problem.of(a, w1.t(), [w2], spec), mode)
    got = impl(a, w1.t(), [w2], None)
    torch.testing.assert_close(got, torch.nn.functional.silu(a @ w1.t()) * (a @ w2.t()), rtol=1e-4, atol=1e-4)
    assert [key[0][1] for key in cands_mod._INDUCTOR_FNS] == [mode]


def test_a_new_shape_or_stride_of_a_built_impl_compiles_its_own_function():
    """The tuner shares an implementation across one M bucket: M=16 and M=13
    (and a weight with padded rows) each get a function compiled for them,
    never one compiled for another shape (whose size asserts would fail)."""
    a, b, ops, spec = _case("bias@0;relu", 16, 16, 32, seed=0)
    impl = cands_mod._inductor_build(Problem.of(a, b, ops, spec), "default")
    padded = torch.randn(32, 24)[:, :16]
    for x, w in ((a, b), (a[:13], b), (a, padded), (a, b)):
        torch.testing.assert_close(impl(x, w, ops, None), torch.relu(x @ w + ops[0]), rtol=1e-4, atol=1e-4)
    assert len(cands_mod._INDUCTOR_FNS) == 3


def test_inside_a_capture_past_the_cap_or_on_a_failed_compile_the_chain_runs_eagerly(monkeypatch, caplog):
    a, b, ops, spec = _case("bias@0;silu", 8, 16, 16, seed=3)
    want = torch.nn.functional.silu(a @ b + ops[0])
    impl = cands_mod._inductor_build(Problem.of(a, b, ops, spec), "default")
    compiles = []
    real = cands_mod.compile_chain
    monkeypatch.setattr(cands_mod, "compile_chain", lambda *args: compiles.append(1) or real(*args))
    with caplog.at_level(logging.WARNING, logger="branchyard"):
        monkeypatch.setattr(cands_mod, "_capturing", lambda a: True)
        for _ in range(2):
            torch.testing.assert_close(impl(a, b, ops, None), want, rtol=1e-5, atol=1e-5)
        assert compiles == [] and cands_mod._INDUCTOR_FNS == {}, "nothing compiled or remembered while capturing"
        monkeypatch.setattr(cands_mod, "_capturing", lambda a: False)
        torch.testing.assert_close(impl(a, b, ops, None), want, rtol=1e-4, atol=1e-4)
        assert compiles == [1], "after the capture, the shape compiles"

        monkeypatch.setenv("BRANCHYARD_NVGEMM_INDUCTOR_MAX", "1")
        a7 = a[:7]
        for _ in range(2):
            torch.testing.assert_close(impl(a7, b, ops, None), torch.nn.functional.silu(a7 @ b + ops[0]))
        assert compiles == [1]

        monkeypatch.setenv("BRANCHYARD_NVGEMM_INDUCTOR_MAX", "10")

        def broken(*args):
            raise RuntimeError("no kernel\nfor this")

        monkeypatch.setattr(cands_mod, "compile_chain", broken)
        a5 = a[:5]
        for _ in range(2):
            torch.testing.assert_close(impl(a5, b, ops, None), torch.nn.functional.silu(a5 @ b + ops[0]))
    said = [r.getMessage() for r in caplog.records if "triton:inductor runs its chain eagerly" in r.getMessage()]
    assert len(said) == 3, said
    assert "first seen inside a CUDA-graph capture" in said[0]
    assert "1 Inductor compiles already made" in said[1] and "BRANCHYARD_NVGEMM_INDUCTOR_MAX" in said[1]
    assert "the compile failed: RuntimeError: no kernel" in said[2]


def test_the_op_tunes_to_the_inductor_candidate_and_its_calls_enter_no_dynamo(monkeypatch, tmp_path):
    monkeypatch.setattr(op_mod, "fused_kernel_ineligibility", lambda *args: None)
    monkeypatch.setenv("BRANCHYARD_NVGEMM_INDUCTOR_MODE", "default")
    inductor = cands_mod.inductor_candidate_name("default")  # the mode is in the name
    assert inductor == "triton:inductor[default]"
    wanted = (inductor, "aten:unfused")
    tuner = Autotuner(lambda p: [c for c in cands_mod.default_candidates(p, inductor=True) if c.name in wanted],
                      timer=lambda name, fn: (fn(), {inductor: 1.0}.get(name, 2.0))[1],
                      db=WinnerDB(tmp_path), env={"gpu": "t"}, progress=False)
    tuner_mod.set_autotuner(tuner)
    try:
        a, b, ops, spec = _case("bias@0;gelu_tanh;residual@1", 2 * 5, 16, 32, seed=4)
        x = a.reshape(2, 5, 32)
        res = ops[1].reshape(2, 5, 16)
        text = str(spec)
        before = _dynamo_state()
        with warnings.catch_warnings():
            warnings.simplefilter("error", NvGemmFallbackWarning)
            first = op_mod.fused_gemm_epilogue(x, b, [ops[0], res], text)
            (result,) = tuner.results.values()
            assert result.winner == inductor, result.table()
            calls_before = {k: dict(v) for k, v in counters.items()}
            for _ in range(3):
                torch.testing.assert_close(op_mod.fused_gemm_epilogue(x, b, [ops[0], res], text), first)
            assert {k: dict(v) for k, v in counters.items()} == calls_before
        assert _dynamo_state() == before
    finally:
        tuner_mod.set_autotuner(None)
    torch.testing.assert_close(first, reference_fused_gemm(x, b, [ops[0], res], spec), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("text, gemm, rest", [
    ("bias@0", "addmm", []),
    ("bias@0;residual@1", "addmm", ["add"]),
    ("scale:0.5;residual@0;relu", "addmm", ["relu"]),
    ("bias@0;gelu_tanh", "addmm", ["gelu"]),
    ("relu;bias@0", "mm", ["relu", "add"]),       # the bias comes after another step: not addmm's
    ("scale_col@0;relu", "mm", ["mul", "relu"]),  # a per-column scale is not addmm's alpha
])
def test_the_traced_chain_is_addmm_where_the_program_had_one(text, gemm, rest):
    """What Inductor is given to compile: ``addmm`` plus the rest where the chain
    starts with a bias or residual (as ``nn.Linear`` wrote it), so its GEMM
    templates are tuned with the bias in their epilogue as ``torch.compile`` of
    the model tunes them; else ``mm`` and every step. Both compute the chain."""
    from torch.fx.experimental.proxy_tensor import make_fx

    a, b, ops, spec = _case(text, 6, 16, 32, seed=7)
    gm = make_fx(cands_mod.chain_to_trace(spec, a, ops))(a, b, *ops)
    called = [n.target.__name__.split(".")[0] for n in gm.graph.nodes if n.op == "call_function"]
    called = [c for c in called if c != "view"]  # operands reshaped to [M, N] or [N]
    assert called[0] == gemm and called[1:] == rest, called
    torch.testing.assert_close(gm(a, b, *ops), reference_fused_gemm(a, b, ops, spec), rtol=1e-4, atol=1e-4)


def test_a_bias_in_another_dtype_is_traced_as_mm_and_adds():
    """``addmm`` takes its bias in the inputs' dtype only: a float32 bias on
    bfloat16 inputs stays a separate add, as the unfused program ran it."""
    from torch.fx.experimental.proxy_tensor import make_fx

    spec = EpilogueSpec.parse("w=kn;bias@0;out=bfloat16")
    a, b, bias = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(16)
    gm = make_fx(cands_mod.chain_to_trace(spec, a, [bias]))(a, b, bias)
    called = [n.target.__name__.split(".")[0] for n in gm.graph.nodes if n.op == "call_function"]
    assert called[0] == "mm" and "add" in called, called
    torch.testing.assert_close(gm(a, b, bias), reference_fused_gemm(a, b, [bias], spec), rtol=2e-2, atol=2e-2)


_STEP_NAMES = ["bias", "scale", "scale_col", "residual", "mul", "relu", "gelu_erf", "gelu_tanh", "silu",
               "sigmoid", "tanh"]


def _random_chain(rng) -> str:
    """A chain of 1-4 steps drawn from the epilogue table, operands numbered in order."""
    steps, index = [], 0
    for _ in range(rng.randint(1, 4)):
        name = rng.choice(_STEP_NAMES)
        if name == "scale":
            steps.append(f"scale:{rng.choice([0.5, 2.0, -1.25])}")
        elif name in ("bias", "scale_col", "residual", "mul"):
            steps.append(f"{name}@{index}")
            index += 1
        else:
            steps.append(name)
    return ";".join(steps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_chains_trace_addmm_exactly_when_it_applies_and_match_the_reference(dtype):
    """Seeded random chains of every step kind (before Inductor sees them): the
    traced graph starts with ``addmm`` exactly when :func:`addmm_prefix` says the
    chain starts with what addmm applies, and computes the chain."""
    import random

    from torch.fx.experimental.proxy_tensor import make_fx

    from branchyard.lowering.nvgemm.epilogue import addmm_prefix

    rng = random.Random(12)
    tol = 1e-4 if dtype == torch.float32 else 6e-2
    addmm_seen = mm_seen = 0
    for case in range(60):
        text = _random_chain(rng)
        a, b, ops, spec = _case(text, rng.randint(1, 9), 8 * rng.randint(1, 3), 8 * rng.randint(1, 3), seed=case)
        a, b, ops = a.to(dtype), b.to(dtype), [t.to(dtype) for t in ops]
        gm = make_fx(cands_mod.chain_to_trace(spec, a, ops))(a, b, *ops)
        first = next(n.target.__name__.split(".")[0] for n in gm.graph.nodes if n.op == "call_function")
        want_addmm = addmm_prefix(spec.steps) is not None
        assert first == ("addmm" if want_addmm else "mm"), (text, first)
        addmm_seen, mm_seen = addmm_seen + want_addmm, mm_seen + (not want_addmm)
        torch.testing.assert_close(gm(a, b, *ops).float(), reference_fused_gemm(a, b, ops, spec).float(),
                                   rtol=tol, atol=tol, msg=lambda m, text=text: f"{text}: {m}")
    assert addmm_seen >= 10 and mm_seen >= 10, (addmm_seen, mm_seen)  # both forms were drawn


@pytest.mark.parametrize("name, text, form", [
    ("cublas:addmm", "relu;bias@0", "[scale +] bias or residual"),
    ("cublas:addmm+aten", "scale_col@0;relu", "[scale +] bias or residual"),
    ("cublaslt:_addmm_activation", "bias@0;silu", "a bias and its ReLU or tanh-GELU"),
    ("cublaslt:_addmm_activation+aten", "residual@0;relu;tanh", "a bias and its ReLU or tanh-GELU"),
])
def test_a_cublas_candidate_built_for_a_chain_it_does_not_fit_is_excluded_by_name(name, text, form):
    """Built without asking ``applies`` first, a cuBLAS candidate raises a
    LoweringError naming the chain and what it needed (which the tuner records
    as the reason it is excluded), not an AssertionError."""
    from branchyard.errors import LoweringError

    a, b, ops, spec = _case(text, 4, 16, 8, seed=1)
    problem = Problem.of(a, b, ops, spec)
    (candidate,) = [c for c in cands_mod.default_candidates(problem, inductor=False) if c.name == name]
    assert candidate.applies(problem) is not None
    with pytest.raises(LoweringError, match=rf"candidate: the chain \[.*{text}.*\] does not start with {re.escape(form)}"):
        candidate.build(problem)
