"""The fused op's dispatcher bypass (``op._bypass_call``): a call whose tensors
pass a guard kept for a direct call runs its plan without the dispatcher; every
call the dispatcher would treat otherwise -- modes, the profiler, the Python
dispatcher, gradients, fake tensors, keywords, wrong argument types -- still
goes through it, and sees the same results and errors as before."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from branchyard.lowering.nvgemm import NvGemmFallbackWarning
from branchyard.lowering.nvgemm import op as op_mod
from branchyard.lowering.nvgemm import tuner as tuner_mod
from branchyard.lowering.nvgemm.epilogue import EpilogueSpec, reference_fused_gemm
from branchyard.lowering.nvgemm.timing import timing_mode
from branchyard.lowering.nvgemm.tuner import Autotuner
from branchyard.lowering.nvgemm.winners import WinnerDB

FUSED = torch.ops.branchyard.fused_gemm_epilogue.default
TEXT = "w=nk;bias@0;relu;residual@1;out=float32"
SPEC = EpilogueSpec.parse(TEXT)
#: The dispatcher's own entry, as torch made it.
DISPATCHER = op_mod._DISPATCH

pytestmark = pytest.mark.skipif(op_mod._TensorGuards is None, reason="this torch has no TensorGuards")


@pytest.fixture
def tuner(probe_tuner):
    """A tuner whose one candidate computes the reference, every call eligible."""
    return probe_tuner


@pytest.fixture
def dispatched(monkeypatch) -> list:
    """Record every call that went to the dispatcher (the bypass's fallback)."""
    calls = []
    real = op_mod._DISPATCH

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(op_mod, "_DISPATCH", spy)
    return calls


def _args(seed: int = 0, weight_grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    a, w = torch.randn(4, 16, generator=g), torch.randn(8, 16, generator=g)
    ops = [torch.randn(8, generator=g), torch.randn(4, 8, generator=g)]
    return a, torch.nn.Parameter(w) if weight_grad else w, ops


def _want(a, w, ops):
    return reference_fused_gemm(a.detach(), w.detach(), [t.detach() for t in ops], SPEC)


def _warm(a, w, ops, times: int = 2):
    """A first call makes the plan, a second keeps it with a guard."""
    for _ in range(times):
        FUSED(a, w, ops, TEXT)


def test_the_op_entry_is_the_bypass_and_torch_still_sees_an_op_overload():
    assert FUSED._op is op_mod._bypass_call
    assert type(FUSED) is torch._ops.OpOverload and FUSED is op_mod.fused_gemm_epilogue
    assert FUSED.name() == "branchyard::fused_gemm_epilogue"


def test_a_kept_signature_skips_the_dispatcher(tuner, dispatched):
    a, w, ops = _args()
    with torch.no_grad():
        _warm(a, w, ops)
        assert len(dispatched) == 2, "the first call plans, the second keeps a guard"
        for _ in range(5):
            torch.testing.assert_close(FUSED(a, w, ops, TEXT), _want(a, w, ops))
    assert len(dispatched) == 2, "five tuned calls, none through the dispatcher"
    a2 = torch.randn_like(a)  # another tensor of the signature: its own values
    with torch.no_grad():
        torch.testing.assert_close(FUSED(a2, w, ops, TEXT), _want(a2, w, ops))
    assert len(dispatched) == 2


def test_a_parameter_weight_skips_it_under_no_grad_only(tuner, dispatched):
    """Inference with a model's parameters (which require grad): bypassed under
    ``no_grad``/``inference_mode``; with grad mode on the call goes through autograd
    and its gradients are the reference's."""
    a, w, ops = _args(1, weight_grad=True)
    with torch.no_grad():
        _warm(a, w, ops)
        n = len(dispatched)
        out = FUSED(a, w, ops, TEXT)
        assert len(dispatched) == n and out.grad_fn is None
    out = FUSED(a, w, ops, TEXT)
    assert len(dispatched) == n + 1 and out.grad_fn is not None, "grad mode on: the dispatcher and autograd"
    out.sum().backward()
    ref_w = w.detach().clone().requires_grad_()
    reference_fused_gemm(a, ref_w, ops, SPEC).sum().backward()
    torch.testing.assert_close(w.grad, ref_w.grad)
    for _ in range(3):  # and it stays so, however often it is called
        assert FUSED(a, w, ops, TEXT).grad_fn is not None
    assert len(dispatched) == n + 4


def test_a_guard_kept_by_a_differentiable_call_is_not_bypassed(tuner, dispatched):
    """A call needing a gradient keeps its guard below autograd (not a direct call):
    later calls of that dispatch state never bypass."""
    a, w, ops = _args(2, weight_grad=True)
    for _ in range(4):
        assert FUSED(a, w, ops, TEXT).grad_fn is not None
    assert len(dispatched) == 4
    entries = [e for es in tuner.guarded_plans.values() for e in es]
    assert entries and not any(e.direct for e in entries), "kept below autograd: not direct"


def test_a_guard_kept_by_calling_the_kernel_is_used_once_a_direct_call_finds_it(tuner, dispatched):
    a, w, ops = _args(3)
    with torch.no_grad():
        for _ in range(2):
            op_mod._fused_gemm_epilogue(a, w, ops, TEXT)  # the kernel as a function: not direct
        ((entry,),) = tuner.guarded_plans.values()
        assert entry.direct is False
        FUSED(a, w, ops, TEXT)
        assert len(dispatched) == 1 and entry.direct is True, "a direct call found the entry: now bypassable"
        torch.testing.assert_close(FUSED(a, w, ops, TEXT), _want(a, w, ops))
    assert len(dispatched) == 1


class _SeenFunctions(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


class _SeenOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def test_modes_and_the_profiler_see_the_op(tuner, dispatched):
    a, w, ops = _args(4)
    with torch.no_grad():
        _warm(a, w, ops)
        n = len(dispatched)
        with _SeenFunctions() as fmode:
            torch.testing.assert_close(FUSED(a, w, ops, TEXT), _want(a, w, ops))
        assert FUSED in fmode.seen
        with _SeenOps() as dmode:
            torch.testing.assert_close(FUSED(a, w, ops, TEXT), _want(a, w, ops))
        assert FUSED in dmode.seen
        with FakeTensorMode(allow_non_fake_inputs=True):  # real tensors pass the guard here (no Python keys)
            got = FUSED(a, w, ops, TEXT)
        assert isinstance(got, FakeTensor) and got.shape == (4, 8), "the mode ran the op, not the plan"
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            FUSED(a, w, ops, TEXT)
        assert any(e.name == "branchyard::fused_gemm_epilogue" for e in prof.events())
        with torch._C._EnablePythonDispatcher():
            torch.testing.assert_close(FUSED(a, w, ops, TEXT), _want(a, w, ops))
        assert len(dispatched) >= n + 5, "each of the five went through the dispatcher"
        n = len(dispatched)
        FUSED(a, w, ops, TEXT)
        assert len(dispatched) == n, "and the next plain call bypasses again"


def test_keywords_and_wrong_argument_types_get_the_dispatchers_answers(tuner, dispatched):
    a, w, ops = _args(5)
    with torch.no_grad():
        _warm(a, w, ops)
        torch.testing.assert_close(FUSED(a, w, ops, spec=TEXT), _want(a, w, ops))
        wrong = [("not a tensor", w, ops, TEXT), (a, w, ops[0], TEXT), (a, w, ops, 3),
                 (a, w, [ops[0], "x"], TEXT), (a, w, ops, [TEXT])]
        for args in wrong:
            with pytest.raises((TypeError, RuntimeError)) as got:
                FUSED(*args)
            with pytest.raises(type(got.value)) as want:
                DISPATCHER(*args)
            assert str(got.value) == str(want.value)
        with pytest.raises(RuntimeError, match="missing value for argument 'spec'"):
            FUSED(a, w, ops)
    assert len(dispatched) == 2 + 1 + len(wrong) + 1


def test_fake_tensors_and_tracing_record_the_op(tuner):
    """After real calls kept their guards, tracing still records the op (fake and
    proxy tensors fail the guards)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    a, w, ops = _args(6)

    def f(a, w, b, r):
        return FUSED(a, w, [b, r], TEXT)

    with torch.no_grad():
        _warm(a, w, ops)
        for mode in ("real", "fake", "symbolic"):
            gm = make_fx(f, tracing_mode=mode)(a, w, *ops)
            targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
            assert targets == [FUSED], mode
            torch.testing.assert_close(gm(a, w, *ops), _want(a, w, ops))


def test_a_timing_mode_keeps_plans_of_its_own(tuner, dispatched):
    a, w, ops = _args(7)
    with torch.no_grad():
        _warm(a, w, ops)
        with timing_mode("device"):
            _warm(a, w, ops)
            assert len(dispatched) == 4
            torch.testing.assert_close(FUSED(a, w, ops, TEXT), _want(a, w, ops))
        FUSED(a, w, ops, TEXT)
    assert len(dispatched) == 4
    assert len(tuner.call_plans) == 2


def test_an_unfused_plan_is_bypassed_too(monkeypatch, tmp_path, dispatched):
    """Where the plan is the unfused path (CPU tensors here), a known call skips
    the dispatcher as well and computes what the original ops compute."""
    tuner_mod.set_autotuner(Autotuner([], db=WinnerDB(tmp_path), env={"gpu": "t"}, progress=False))
    try:
        a, w, ops = _args(8)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", NvGemmFallbackWarning)
            _warm(a, w, ops)
            (call,) = tuner_mod._default.call_plans.values()
            assert call.impl is None and call.reason
            got = FUSED(a, w, ops, TEXT)
        assert len(dispatched) == 2
        want = torch.relu(torch.mm(a, w.t()) + ops[0]) + ops[1]
        torch.testing.assert_close(got, want)
    finally:
        tuner_mod.set_autotuner(None)


def test_threads_calling_kept_signatures_get_their_own_results(tuner):
    sigs = [_args(10 + i) for i in range(4)] + [(torch.randn(16, 4).t(), *_args(20)[1:])]
    with torch.no_grad():
        for a, w, ops in sigs:
            _warm(a, w, ops)
    errors = []

    def caller(i):
        try:
            with torch.no_grad():
                for j in range(60):
                    a, w, ops = sigs[(i + j) % len(sigs)]
                    torch.testing.assert_close(FUSED(a, w, ops, TEXT), _want(a, w, ops))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_jit_trace_records_the_op(tuner, dispatched):
    a, w, ops = _args(9)

    def f(a, w, b, r):
        return FUSED(a, w, [b, r], TEXT)

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.trace is deprecated; still used
        _warm(a, w, ops)
        traced = torch.jit.trace(f, (a, w, *ops), check_trace=False)
    assert [n.kind() for n in traced.graph.nodes()].count("branchyard::fused_gemm_epilogue") == 1
    assert len(dispatched) == 3
    torch.testing.assert_close(traced(a, w, *ops), _want(a, w, ops))
