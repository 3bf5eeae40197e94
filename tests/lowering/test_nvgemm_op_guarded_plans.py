"""The fused op's shortcut to a known signature's plan (``op._guarded_entry``):
a coarse key, then a C++ tensor guard per plan kept under it. What it finds
must be exactly the plan the full signature finds: calls that share the
coarse key but differ in strides, dtypes or dispatch state keep their own
plans; a guard passes only tensors of its signature; a re-tune, the plan
limit and a wrong operand count behave as without the shortcut."""

from __future__ import annotations

import gc
import random
import weakref

import pytest
import torch

from branchyard.errors import LoweringError
from branchyard.lowering.nvgemm import op as op_mod
from branchyard.lowering.nvgemm.epilogue import EpilogueSpec, reference_fused_gemm

FUSED = torch.ops.branchyard.fused_gemm_epilogue.default
TEXT = "w=nk;bias@0;relu;residual@1;out=float32"
SPEC = EpilogueSpec.parse(TEXT)

pytestmark = pytest.mark.skipif(op_mod._TensorGuards is None, reason="this torch has no TensorGuards")


@pytest.fixture
def tuner(probe_tuner):
    """A tuner whose one candidate computes the reference, every call eligible."""
    return probe_tuner


def _found_plans(monkeypatch) -> list:
    """Record, per call, what the shortcut returned and the signature it was asked for."""
    found = []
    real = op_mod._guarded_entry

    def spy(tuner, coarse, a, b, operands):
        entry = real(tuner, coarse, a, b, operands)
        found.append((entry and entry.plan, op_mod._signature(a, b, operands, coarse[0], coarse[1])))
        return entry

    monkeypatch.setattr(op_mod, "_guarded_entry", spy)
    return found


def _variants() -> dict[str, tuple]:
    """Arguments of one coarse key (spec, mode, operand count, device, a.shape, b.shape)
    whose signatures differ: strides of each tensor, dtypes."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s, dtype=torch.float32: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return {
        "contiguous": (r(4, 16), r(8, 16), [r(8), r(4, 8)]),
        "weight_view": (r(4, 16), r(16, 8).t(), [r(8), r(4, 8)]),  # [8, 16] with strides (1, 8)
        "input_view": (r(16, 4).t(), r(8, 16), [r(8), r(4, 8)]),
        "residual_view": (r(4, 16), r(8, 16), [r(8), r(8, 4).t()]),
        "strided_bias": (r(4, 16), r(8, 16), [r(16)[::2], r(4, 8)]),
        "float64": (r(4, 16, dtype=torch.float64), r(8, 16, dtype=torch.float64),
                    [r(8, dtype=torch.float64), r(4, 8, dtype=torch.float64)]),
        "bfloat16_operands": (r(4, 16), r(8, 16), [r(8, dtype=torch.bfloat16), r(4, 8, dtype=torch.bfloat16)]),
    }


def _want(a, w, ops):
    return reference_fused_gemm(a, w, ops, SPEC)


def test_calls_sharing_a_coarse_key_keep_their_own_plans(tuner, monkeypatch):
    found = _found_plans(monkeypatch)
    variants = _variants()
    coarse = {op_mod._coarse_key(TEXT, "host", a, w, ops) for a, w, ops in variants.values()}
    assert len(coarse) == 1, "the variants share one coarse key"
    with torch.no_grad():
        for _ in range(3):  # interleaved, as layers of a model would call them
            for a, w, ops in variants.values():
                torch.testing.assert_close(FUSED(a, w, ops, TEXT), _want(a, w, ops))
    plans = tuner.call_plans
    assert len(plans) == len(variants), "one plan per signature"
    (entries,) = tuner.guarded_plans.values()
    assert len(entries) == len(variants) and len({id(entry.plan) for entry in entries}) == len(variants)
    hits = [(call, sig) for call, sig in found if call is not None]
    assert len(hits) == len(variants), "the third round finds every plan through its guard"
    for call, sig in hits:
        assert call is plans[sig], "the shortcut finds the plan of the call's own signature"
    for (a, w, ops), (_, sig) in zip(variants.values(), hits):
        call = plans[sig]  # by content: what the plan was made from is this call's
        assert call.b_meta == (w.shape, w.stride())
        assert call.spans == tuple(op_mod._span(t) for t in (a, w, *ops))


def test_each_dispatch_state_keeps_a_guard_of_the_one_plan(tuner, monkeypatch):
    """The guard compares dispatch keys under the thread's dispatch state: grad
    mode, no_grad and inference mode each get a guard; all find the same plan."""
    found = _found_plans(monkeypatch)
    a, w, ops = _variants()["contiguous"]
    for _ in range(3):
        torch.testing.assert_close(FUSED(a, w, ops, TEXT), _want(a, w, ops))
        with torch.no_grad():
            torch.testing.assert_close(FUSED(a, w, ops, TEXT), _want(a, w, ops))
        with torch.inference_mode():
            torch.testing.assert_close(FUSED(a, w, ops, TEXT), _want(a, w, ops))
    (call,) = tuner.call_plans.values()
    (entries,) = tuner.guarded_plans.values()
    assert 1 <= len(entries) <= 3 and all(entry.plan is call for entry in entries)
    assert [c for c, _ in found[-3:]] == [call] * 3, "every state finds the plan through a guard"


@pytest.mark.parametrize("seed", range(3))
def test_random_calls_find_the_plan_of_their_signature(tuner, monkeypatch, seed):
    """Random calls over shapes, strides, dtypes, 3-D inputs and dispatch states:
    every result is right and every plan the shortcut finds is the one keyed by
    the call's signature."""
    found = _found_plans(monkeypatch)
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)

    def tensor(shape, dtype, transposed):
        if transposed and len(shape) == 2:
            return torch.randn(shape[::-1], generator=g).to(dtype).t()
        return torch.randn(shape, generator=g).to(dtype)

    def arguments():
        m, n, k = rng.choice([1, 4]), rng.choice([8, 12]), rng.choice([16, 24])
        dtype = rng.choice([torch.float32, torch.float64])
        lead = rng.choice([(m,), (2, m)])
        a = tensor((*lead, k), dtype, rng.random() < 0.3)
        w = tensor((n, k), dtype, rng.random() < 0.3)
        return a, w, [tensor((n,), dtype, False), tensor((*lead, n), dtype, rng.random() < 0.3)]

    pool = [arguments() for _ in range(16)]  # signatures that repeat, many sharing a coarse key
    for _ in range(150):
        a, w, ops = rng.choice(pool)
        a = a.clone() if a.is_contiguous() and rng.random() < 0.5 else a  # new tensors of one signature
        state = rng.choice([torch.no_grad, torch.inference_mode, torch.enable_grad])
        with state():
            torch.testing.assert_close(FUSED(a, w, ops, TEXT), _want(a, w, ops))
    hits = [(call, sig) for call, sig in found if call is not None]
    assert len(hits) > 30, "most calls repeat a signature"
    for call, sig in hits:
        assert call is tuner.call_plans[sig]


def test_guard_passes_only_tensors_of_its_signature():
    a, w, ops = _variants()["contiguous"]
    base = (a, w, *ops)
    guard = op_mod._guard(base)
    same = tuple(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype) for t in base)
    assert guard.check(*base) and guard.check(*same)

    class Sub(torch.Tensor):
        pass

    others = {
        "stride": (a, w.t().contiguous().t(), *ops),
        "dtype": (a.double(), w, *ops),
        "size": (a[:3], w, *ops),
        "ndim": (a, w, ops[0].view(1, 8), ops[1]),
        "device": (a.to("meta"), w, *ops),
        "requires_grad": (a, w.detach().requires_grad_(), *ops),
        "subclass": (a, w.as_subclass(Sub), *ops),
    }
    for name, tensors in others.items():
        assert not guard.check(*tensors), name
    with torch.inference_mode():
        assert not guard.check(*base), "another dispatch state: another guard"
    big = torch.randn(256, 256)
    alive = weakref.ref(big)
    kept = op_mod._guard((big,))
    del big
    gc.collect()
    assert alive() is None and kept.check(torch.empty(256, 256)), "a guard keeps metadata, not tensors"



def test_a_guard_class_that_checks_less_is_not_used(monkeypatch):
    """The op uses torch's private TensorGuards only where it tells strides,
    dtypes, sizes and devices apart (checked once at import)."""
    import torch._C._dynamo.guards as guards

    assert op_mod._tensor_guards() is guards.TensorGuards

    class SizesOnly:
        def __init__(self, *tensors, dynamic_dims_sizes, dynamic_dims_strides):
            self.shapes = [t.shape for t in tensors]

        def check(self, *tensors):
            return [t.shape for t in tensors] == self.shapes

    monkeypatch.setattr(guards, "TensorGuards", SizesOnly)
    assert op_mod._tensor_guards() is None
    monkeypatch.delattr(guards, "TensorGuards")
    assert op_mod._tensor_guards() is None

def test_wrong_operand_count_after_a_guarded_plan_is_the_same_error(tuner):
    a, w, ops = _variants()["contiguous"]
    with torch.no_grad():
        for _ in range(3):
            FUSED(a, w, ops, TEXT)
        assert tuner.guarded_plans
        for wrong in ([ops[0]], [*ops, ops[1]]):
            with pytest.raises(LoweringError, match=rf"takes 2 operand tensors, got {len(wrong)}"):
                FUSED(a, w, wrong, TEXT)


def test_a_retune_and_the_plan_limit_forget_the_guarded_plans(tuner, monkeypatch):
    variants = list(_variants().values())
    with torch.no_grad():
        for a, w, ops in variants[:2] * 2:
            FUSED(a, w, ops, TEXT)
        assert sum(map(len, tuner.guarded_plans.values())) == 2
        a, w, ops = variants[0]
        tuner.tune(a, w.t(), ops, SPEC, "host")
        assert tuner.call_plans == {} and tuner.guarded_plans == {}
        monkeypatch.setattr(op_mod, "_PLANS_LIMIT", 2)
        for a, w, ops in variants[:2] * 2:
            FUSED(a, w, ops, TEXT)
        assert len(tuner.guarded_plans) == 1
        a, w, ops = variants[2]
        FUSED(a, w, ops, TEXT)  # a third signature: the plans start over, guarded ones with them
        assert len(tuner.call_plans) == 1 and tuner.guarded_plans == {}


def test_without_tensor_guards_every_call_takes_the_signature(tuner, monkeypatch):
    monkeypatch.setattr(op_mod, "_TensorGuards", None)
    a, w, ops = _variants()["weight_view"]
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(FUSED(a, w, ops, TEXT), _want(a, w, ops))
    assert len(tuner.call_plans) == 1 and tuner.guarded_plans == {}


def test_threads_on_signatures_of_one_coarse_key_get_their_own_results(tuner):
    """Threads call the op at once with signatures that share a coarse key (so
    they keep and scan one entry), while another thread re-tunes (clearing every
    plan) now and then: every result is right, whatever plan each call finds."""
    import threading

    variants = list(_variants().values())
    errors = []

    def caller(i):
        a, w, ops = variants[i % len(variants)]
        want = _want(a, w, ops)
        try:
            with torch.no_grad():
                for _ in range(120):
                    torch.testing.assert_close(FUSED(a, w, ops, TEXT), want)
        except Exception as exc:  # reported below, with the thread's variant
            errors.append((i, exc))

    def retune():
        a, w, ops = variants[0]
        try:
            for _ in range(5):
                tuner.tune(a, w.t(), ops, SPEC, "host")
        except Exception as exc:
            errors.append(("retune", exc))

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(len(variants))]
    threads.append(threading.Thread(target=retune))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for a, w, ops in variants:  # what the shortcut keeps afterwards is still each signature's own plan
        with torch.no_grad():
            FUSED(a, w, ops, TEXT)
            FUSED(a, w, ops, TEXT)
        call = op_mod._guarded_entry(tuner, op_mod._coarse_key(TEXT, "host", a, w, ops), a, w, ops).plan
        assert call is tuner.call_plans[op_mod._signature(a, w, ops, TEXT, "host")]
