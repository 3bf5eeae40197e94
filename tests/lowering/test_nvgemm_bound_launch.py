"""The fused kernels' bound launch: a tuned call plan keeps the launch alone
(``_FusedGemm.bind``), so a later call neither re-checks its arguments, nor
looks its compiled variant up, nor makes a view of the weight. Run on CPU with
the compiled variant replaced by a Python function that computes the reference
(what the GPU tests check with the real kernel: tests/gpu/test_nvgemm_op_gpu.py,
tests/gpu/test_nvgemm_out_gpu.py, tests/gpu/test_nvgemm_cheap_call_gpu.py)."""

from __future__ import annotations

import warnings

import pytest
import torch

from branchyard.errors import LoweringError
from branchyard.lowering.nvgemm import NvGemmFallbackWarning
from branchyard.lowering.nvgemm import candidates as nv_candidates
from branchyard.lowering.nvgemm import cutedsl_gemm as cg
from branchyard.lowering.nvgemm import op as op_mod
from branchyard.lowering.nvgemm import tuner as tuner_mod
from branchyard.lowering.nvgemm.candidates import Candidate
from branchyard.lowering.nvgemm.epilogue import EpilogueSpec, reference_fused_gemm
from branchyard.lowering.nvgemm.kernel_math import plan_steps
from branchyard.lowering.nvgemm.tuner import Autotuner
from branchyard.lowering.nvgemm.winners import WinnerDB

FUSED = torch.ops.branchyard.fused_gemm_epilogue.default
OUT = torch.ops.branchyard.fused_gemm_epilogue.out


@pytest.fixture(autouse=True)
def _quiet_fallback():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NvGemmFallbackWarning)
        yield


class _Recorder:
    """A kernel's compiled variant on CPU: records each launch's tensors, writes the reference."""

    def __init__(self, spec_text: str):
        self.spec = EpilogueSpec.parse(spec_text)
        self.launches: list[tuple] = []

    def __call__(self, a, b_nk, out, operands):
        assert operands[-1] == 0.0  # the trailing scalar the DSL needs
        ops = list(operands[:-1])
        self.launches.append((a, b_nk, out, ops))
        kn = EpilogueSpec.parse(str(self.spec).replace("w=nk", "w=kn"))
        out.copy_(reference_fused_gemm(a, b_nk.t(), ops, kn))


def _kernel(monkeypatch, spec_text: str, b_layout: str):
    """A ``_FusedGemm`` for ``spec_text`` whose compiled variant is a :class:`_Recorder`."""
    spec = EpilogueSpec.parse(spec_text)
    steps = plan_steps(spec)
    count = cg._num_tensor_operands(steps)
    kernel = cg._FusedGemm(steps, "bfloat16", "bfloat16", b_layout, cg.GemmConfig(128, 128), count,
                           kernel_cache=None)
    rec = _Recorder(spec_text)
    dtypes = ("float32",) * count
    key = (tuple(s.key for s in steps), "bfloat16", "bfloat16", dtypes, b_layout, kernel.config)
    monkeypatch.setitem(cg._CACHE, key, rec)
    checked = []
    real = kernel._checked
    monkeypatch.setattr(kernel, "_checked", lambda *args: checked.append(1) or real(*args))
    return kernel, rec, checked


def _tune_with(monkeypatch, tmp_path, impl):
    monkeypatch.setattr(op_mod, "fused_kernel_ineligibility", lambda *args: None)
    tuner = Autotuner([Candidate("cutedsl:fake", lambda p: impl)], timer=lambda n, f: 1.0,
                      db=WinnerDB(tmp_path), env={"gpu": "t"}, progress=False)
    tuner_mod.set_autotuner(tuner)
    return tuner


@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("lead", [(6,), (2, 3)])
def test_a_tuned_call_launches_without_checks_lookups_or_views(monkeypatch, tmp_path, layout, lead):
    text = f"w={layout};bias@0;relu;residual@1;out=float32"
    kernel, rec, checked = _kernel(monkeypatch, text, layout)
    _tune_with(monkeypatch, tmp_path, nv_candidates._KernelImpl(kernel))
    monkeypatch.setattr(op_mod, "_WEIGHT_VIEWS", {})
    try:
        w = torch.randn(16, 32) if layout == "nk" else torch.randn(32, 16)  # N = 16, K = 32
        bias = torch.randn(16)
        xs = [torch.randn(*lead, 32) for _ in range(4)]
        res = [torch.randn(*lead, 16) for _ in range(4)]
        want = lambda x, r: torch.relu(x @ (w.t() if layout == "nk" else w) + bias) + r  # noqa: E731
        torch.testing.assert_close(FUSED(xs[0], w, [bias, res[0]], text), want(xs[0], res[0]))  # plans, tunes
        checked.clear()
        rec.launches.clear()
        with torch.no_grad():
            got = [FUSED(x, w, [bias, r], text) for x, r in zip(xs[1:], res[1:])]
    finally:
        tuner_mod.set_autotuner(None)
    assert checked == [], "a tuned call neither checks its arguments again nor looks its variant up"
    for g, x, r in zip(got, xs[1:], res[1:]):
        torch.testing.assert_close(g, want(x, r))
    assert len(rec.launches) == 3
    b_nk = w if layout == "nk" else w.t()
    for (a2d, b_seen, out, ops), x, r in zip(rec.launches, xs[1:], res[1:]):
        # the kernel reads exactly what __call__ would give it: b_kn.t(), [M, K] input, [M, N] row-major out
        assert (b_seen.data_ptr(), b_seen.shape, b_seen.stride()) == (b_nk.data_ptr(), b_nk.shape, b_nk.stride())
        assert a2d.shape == (x.numel() // 32, 32) and a2d.data_ptr() == x.data_ptr()
        assert out.shape == (x.numel() // 32, 16) and out.stride() == (16, 1)
        assert ops[0] is bias and ops[1].data_ptr() == r.data_ptr() and ops[1].shape == (x.numel() // 32, 16)
    if layout == "nk":
        assert rec.launches[0][1] is w, "an [N, K] weight is launched as it is"
    else:
        assert rec.launches[0][1] is rec.launches[-1][1], "a [K, N] weight's [N, K] view is made once"


@pytest.mark.parametrize("direct", [True, False])
def test_the_out_overload_takes_the_bound_launch(monkeypatch, tmp_path, direct):
    text = "w=nk;bias@0;gelu_tanh;out=float32"
    kernel, rec, checked = _kernel(monkeypatch, text, "nk")
    _tune_with(monkeypatch, tmp_path, nv_candidates._KernelImpl(kernel))
    try:
        x, w, bias = torch.randn(8, 32), torch.randn(16, 32), torch.randn(16)
        want = torch.nn.functional.gelu(x @ w.t() + bias, approximate="tanh")
        FUSED(x, w, [bias], text)
        checked.clear()
        out = torch.empty(8, 16) if direct else torch.empty(16, 8).t()  # row-major, or not: a temporary first
        with torch.no_grad():
            assert OUT(x, w, [bias], text, out=out) is out
    finally:
        tuner_mod.set_autotuner(None)
    assert checked == []
    torch.testing.assert_close(out, want)
    assert (rec.launches[-1][2].data_ptr() == out.data_ptr()) is direct


def test_bind_checks_what_a_call_checks_and_an_empty_problem_launches_nothing(monkeypatch):
    text = "w=nk;bias@0;relu;out=float32"
    kernel, rec, _ = _kernel(monkeypatch, text, "nk")
    w, bias = torch.randn(16, 32), torch.randn(16)
    for bad in ([], [bias, bias]):
        with pytest.raises(LoweringError, match=f"{len(bad)} operand tensors for a kernel built for 1"):
            kernel.bind(torch.randn(4, 32), w.t(), bad, torch.empty(4, 16))
        with pytest.raises(LoweringError, match=f"{len(bad)} operand tensors"):
            kernel(torch.randn(4, 32), w.t(), bad, torch.empty(4, 16))
    column_major = torch.randn(32, 4).t()
    for call in (kernel.bind, kernel):
        with pytest.raises(LoweringError, match="do not match a row-major a/out"):
            call(column_major, w.t(), [bias], torch.empty(4, 16))
    launch = kernel.bind(torch.randn(0, 32), w.t(), [bias], torch.empty(0, 16))
    launch(torch.randn(0, 32), w, [bias], torch.empty(0, 16))
    assert rec.launches == [], "M = 0: nothing launched, as by a call"
    launch = kernel.bind(torch.randn(4, 32), w.t(), [bias], torch.empty(4, 16))
    x, out = torch.randn(4, 32), torch.empty(4, 16)
    assert launch(x, w, [bias], out) is None
    torch.testing.assert_close(out, torch.relu(x @ w.t() + bias))


def test_an_impl_whose_bind_refuses_runs_unbound(monkeypatch, tmp_path):
    """A bind that raises leaves the plan on the impl itself (which then raises or runs as before)."""
    text = "w=kn;bias@0;relu;out=float32"
    calls = []

    class Refusing:
        def __call__(self, a, b_kn, ops, out):
            calls.append(b_kn)
            return torch.relu(a @ b_kn + ops[0])

        def bind(self, *args):
            raise LoweringError("not this one", where="test")

    _tune_with(monkeypatch, tmp_path, Refusing())
    try:
        x, w, bias = torch.randn(4, 8), torch.randn(8, 16), torch.randn(16)
        for _ in range(2):
            torch.testing.assert_close(FUSED(x, w, [bias], text), torch.relu(x @ w + bias))
    finally:
        tuner_mod.set_autotuner(None)
    assert calls[-1] is w, "the unbound impl gets b_kn, the weight as given for w=kn"


@pytest.mark.parametrize("refuse", [False, True])
def test_the_tuner_times_a_kernel_as_the_op_calls_it(tmp_path, refuse):
    """A candidate with a ``bind`` is checked against the reference through its
    call, then timed through the launch its bind returns -- what the op's plan
    runs -- with the weight ``[N, K]``; where bind refuses, through its call."""
    calls = []

    class Kernel:
        def __call__(self, a, b_kn, ops, out):
            calls.append("call")
            out.copy_(torch.relu(a @ b_kn + ops[0]))
            return out

        def bind(self, a, b_kn, ops, out):
            if refuse:
                raise LoweringError("no", where="test")

            def launch(a2, b_nk, ops2, out2):
                calls.append("launch")
                assert (b_nk.data_ptr(), b_nk.shape, b_nk.stride()) == (
                    b_kn.data_ptr(), b_kn.t().shape, b_kn.t().stride())
                out2.copy_(torch.relu(a2 @ b_nk.t() + ops2[0]))

            return launch

    def timer(name, fn):
        fn()
        fn()
        return 1.0

    tuner = Autotuner([Candidate("k", lambda p: Kernel())], timer=timer, db=WinnerDB(tmp_path),
                      env={"gpu": "t"}, progress=False)
    spec = EpilogueSpec.parse("w=kn;bias@0;relu;out=float32")
    res = tuner.tune(torch.randn(4, 8), torch.randn(16, 8).t(), [torch.randn(16)], spec, mode="host")
    assert res.winner == "k"
    assert calls == ["call"] + (["call", "call"] if refuse else ["launch", "launch"])
