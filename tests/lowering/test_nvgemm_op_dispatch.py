"""How ``branchyard::fused_gemm_epilogue`` is registered and what its fast
path may skip: the schema and name that exported programs and saved files
refer to, a file saved when the op was a ``torch.library.custom_op`` still
loads and runs, autograd through every tensor argument, fake tensors under
export with a dynamic dim, the redispatch path for fake/meta tensors, and the
per-plan transposed-weight views (a moved or freed weight is never used)."""

from __future__ import annotations

import gc
import io
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from branchyard.lowering.nvgemm import NvGemmFallbackWarning, nvgemm
from branchyard.lowering.nvgemm import op as op_mod
from branchyard.lowering.nvgemm import tuner as tuner_mod
from branchyard.lowering.nvgemm.candidates import Candidate
from branchyard.lowering.nvgemm.epilogue import EpilogueSpec, reference_fused_gemm
from branchyard.lowering.nvgemm.tuner import Autotuner
from branchyard.lowering.nvgemm.winners import WinnerDB
from branchyard.serialization import load, save

FUSED = torch.ops.branchyard.fused_gemm_epilogue.default
DATA = os.path.join(os.path.dirname(__file__), "data")


@pytest.fixture(autouse=True)
def _quiet_fallback():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NvGemmFallbackWarning)
        yield


def _count(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is FUSED)


def test_schema_name_and_kernels():
    assert str(FUSED._schema) == (
        "branchyard::fused_gemm_epilogue(Tensor a, Tensor b, Tensor[] operands, str spec) -> Tensor")
    assert torch.Tag.pt2_compliant_tag in FUSED.tags
    assert op_mod.fused_gemm_epilogue is FUSED
    for key in ("Autograd", "CompositeExplicitAutograd", "Meta"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op_mod.OP_NAME, key), key


def test_a_file_saved_when_the_op_was_a_custom_op_loads_and_runs():
    """tests/lowering/data/nvgemm_custom_op_block.pt2 was written by
    ``branchyard.serialization.save`` with the op registered by
    ``torch.library.custom_op`` (main at 75c8201): ``Linear(16, 32)`` fused into
    ``w=nk;bias@0;gelu_tanh;out=float32``, then ``+ 1``, batch dim dynamic."""
    ep = load(os.path.join(DATA, "nvgemm_custom_op_block.pt2"))
    assert _count(ep.graph_module) == 1
    w, b = ep.state_dict["fc.weight"], ep.state_dict["fc.bias"]
    for batch in (1, 5):
        x = torch.randn(batch, 3, 16)
        torch.testing.assert_close(ep.module()(x), F.gelu(x @ w.t() + b, approximate="tanh") + 1,
                                   rtol=1e-5, atol=1e-5)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 32)

    def forward(self, x):
        return torch.relu(self.fc(x))


def test_exported_program_with_a_dynamic_dim_round_trips_through_branchyard_serialization():
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(2, 5, 16)
    batch = torch.export.Dim("batch", min=1, max=64)
    fused = nvgemm(torch.export.export(model, (x,), dynamic_shapes=({0: batch},)))
    node = next(n for n in fused.graph.nodes if n.target is FUSED)
    assert not isinstance(node.meta["val"].shape[0], int), "the fake kernel keeps the batch dim symbolic"
    buf = io.BytesIO()
    save(fused, buf)
    buf.seek(0)
    loaded = load(buf)
    assert _count(loaded.graph_module) == 1
    for n in (1, 7):
        xn = torch.randn(n, 5, 16)
        torch.testing.assert_close(loaded.module()(xn), model(xn), rtol=1e-5, atol=1e-5)
    again = torch.export.export(loaded.module(), (torch.randn(3, 5, 16),),
                                dynamic_shapes=({0: torch.export.Dim("b2", min=1, max=64)},))
    assert _count(again.graph_module) == 1, "a loaded program exports again with the op in it"


def test_export_of_a_direct_call_with_a_dynamic_dim_uses_the_fake_kernel_only(tmp_path):
    calls = []
    tuner_mod.set_autotuner(Autotuner([Candidate("probe", lambda p: calls.append(p) or None)],
                                      timer=lambda n, f: 1.0, db=WinnerDB(tmp_path), env={"gpu": "t"},
                                      progress=False))
    try:
        class Direct(nn.Module):
            def forward(self, x, w, bias):
                return FUSED(x, w, [bias], "w=kn;bias@0;silu;out=float32")

        x, w, bias = torch.randn(4, 8), torch.randn(8, 24), torch.randn(24)
        ep = torch.export.export(Direct(), (x, w, bias), dynamic_shapes=({0: torch.export.Dim("m")}, None, None))
        assert calls == [] and tuner_mod.get_autotuner().call_plans == {}, "tracing never plans or tunes"
    finally:
        tuner_mod.set_autotuner(None)
    out = [n for n in ep.graph.nodes if n.target is FUSED][0].meta["val"]
    assert out.shape[1] == 24 and not isinstance(out.shape[0], int)
    x9 = torch.randn(9, 8)
    torch.testing.assert_close(ep.module()(x9, w, bias), F.silu(x9 @ w + bias), rtol=1e-5, atol=1e-5)


def test_fake_and_meta_tensors_take_the_fake_kernel():
    with FakeTensorMode():
        a, w, bias = torch.randn(2, 3, 8), torch.randn(16, 8, dtype=torch.float16), torch.randn(16)
        out = FUSED(a, w, [bias], "w=nk;bias@0;relu;out=float16")
        assert out.shape == (2, 3, 16) and out.dtype == torch.float16
    meta = FUSED(torch.empty(5, 8, device="meta"), torch.empty(8, 4, device="meta"), [],
                 "w=kn;relu;out=bfloat16")
    assert meta.device.type == "meta" and meta.shape == (5, 4) and meta.dtype == torch.bfloat16


@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_gradients_of_every_tensor_argument_match_the_reference(layout):
    torch.manual_seed(1)
    spec = EpilogueSpec.parse(f"w={layout};bias@0;gelu_tanh;residual@1;out=float32")
    a = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(*((8, 12) if layout == "kn" else (12, 8)), dtype=torch.float64, requires_grad=True)
    bias = torch.randn(12, dtype=torch.float64, requires_grad=True)
    res = torch.randn(2, 3, 12, dtype=torch.float64, requires_grad=True)
    got = FUSED(a, w, [bias, res], str(spec))
    assert got.grad_fn is not None
    grads = torch.autograd.grad(got.square().sum(), (a, w, bias, res))
    w_kn = w if layout == "kn" else w.t()
    independent = F.gelu(a @ w_kn + bias, approximate="tanh") + res
    want = torch.autograd.grad(independent.square().sum(), (a, w, bias, res))
    for g, r in zip(grads, want):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)  # the forward stores float32
    # only some inputs need grad: the others get none
    w2 = w.detach().requires_grad_(True)
    out = FUSED(a.detach(), w2, [bias.detach(), res.detach()], str(spec))
    (gw,) = torch.autograd.grad(out.sum(), (w2,))
    assert gw.shape == w.shape
    # only a tensor inside the operand list needs grad: still seen
    b2 = bias.detach().requires_grad_(True)
    out = FUSED(a.detach(), w.detach(), [b2, res.detach()], str(spec))
    assert out.grad_fn is not None
    (gb,) = torch.autograd.grad(out.sum(), (b2,))
    torch.testing.assert_close(gb, torch.autograd.grad(
        (F.gelu(a.detach() @ w_kn.detach() + b2, approximate="tanh") + res.detach()).sum(), (b2,))[0],
        rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        assert FUSED(a, w, [bias, res], str(spec)).grad_fn is None


def _tuned(tmp_path, spec_text):
    spec = EpilogueSpec.parse(spec_text.replace("w=nk", "w=kn"))
    seen = []

    def impl(a2d, b_kn, ops, out):
        seen.append(b_kn)
        out.copy_(reference_fused_gemm(a2d, b_kn, list(ops), spec))

    tuner = Autotuner([Candidate("probe", lambda p: impl)], timer=lambda n, f: 1.0, db=WinnerDB(tmp_path),
                      env={"gpu": "t"}, progress=False)
    tuner_mod.set_autotuner(tuner)
    return tuner, seen


def test_known_signature_neither_plans_nor_asks_about_capture(monkeypatch, tmp_path):
    monkeypatch.setattr(op_mod, "fused_kernel_ineligibility", lambda *args: None)
    asked = []
    monkeypatch.setattr(op_mod, "_capturing", lambda a: asked.append(1) or False)
    tuner, seen = _tuned(tmp_path, "w=nk;bias@0;relu;out=float32")
    try:
        a, w, bias = torch.randn(4, 16), torch.randn(8, 16), torch.randn(8)
        for _ in range(4):
            FUSED(a, w, [bias], "w=nk;bias@0;relu;out=float32")
    finally:
        tuner_mod.set_autotuner(None)
    assert asked == [1], "only the first call of a signature asks whether a capture is on"
    assert len(tuner.call_plans) == 1 and len(seen) == 5  # the numerics check, then four calls


def test_transposed_weight_view_follows_the_weight(monkeypatch, tmp_path):
    """The remembered ``w.t()`` is reused for the same weight, never for
    another weight of the same signature, not after ``w.data = ...`` moved it
    (whose old storage it then lets go, whatever signature comes next) or
    ``resize_`` reshaped it at the same address, and it is dropped when the
    weight is freed."""
    monkeypatch.setattr(op_mod, "fused_kernel_ineligibility", lambda *args: None)
    monkeypatch.setattr(op_mod, "_WEIGHT_VIEWS", {})
    text = "w=nk;bias@0;relu;out=float32"
    tuner, seen = _tuned(tmp_path, text)
    try:
        a, bias = torch.randn(4, 16), torch.randn(8)
        w1, w2 = torch.randn(8, 16), torch.randn(8, 16)
        want = lambda w, x=a: torch.relu(x @ w.t() + bias)  # noqa: E731
        for _ in range(2):  # two weights of one signature, alternating (layers of a model)
            torch.testing.assert_close(FUSED(a, w1, [bias], text), want(w1))
            torch.testing.assert_close(FUSED(a, w2, [bias], text), want(w2))
        assert seen[-4] is seen[-2] and seen[-3] is seen[-1], "one view per weight, reused"
        assert len(op_mod._WEIGHT_VIEWS) == 2 and len(tuner.call_plans) == 1
        w1.mul_(2)  # in place: the view shares the storage
        torch.testing.assert_close(FUSED(a, w1, [bias], text), want(w1))
        old = w1.data_ptr()
        w1.data = torch.randn(8, 16)  # moved: the old view must not be used, nor kept
        a3 = a[:3]
        torch.testing.assert_close(FUSED(a3, w1, [bias], text), want(w1, a3))  # another signature
        assert old not in [entry[3].data_ptr() for entry in op_mod._WEIGHT_VIEWS.values()]
        torch.testing.assert_close(FUSED(a, w1, [bias], text), want(w1))
        w3 = torch.randn(8, 16)
        torch.testing.assert_close(FUSED(a, w3, [bias], text), want(w3))
        w3.resize_(8, 8)  # same address, another shape and strides
        a8 = a[:, :8].contiguous()
        torch.testing.assert_close(FUSED(a8, w3, [bias], text), want(w3, a8))
        del w2
        gc.collect()
        assert len(op_mod._WEIGHT_VIEWS) == 2, "a freed weight's view is dropped"
    finally:
        tuner_mod.set_autotuner(None)


def test_under_inference_mode_and_no_grad_the_tuned_path_runs(monkeypatch, tmp_path):
    monkeypatch.setattr(op_mod, "fused_kernel_ineligibility", lambda *args: None)
    text = "w=kn;bias@0;relu;out=float32"
    tuner, seen = _tuned(tmp_path, text)
    try:
        a, w, bias = torch.randn(3, 8), torch.randn(8, 16), torch.randn(16)
        with torch.inference_mode():
            torch.testing.assert_close(FUSED(a, w, [bias], text), torch.relu(a @ w + bias))
        with torch.no_grad():
            torch.testing.assert_close(FUSED(a, w, [bias], text), torch.relu(a @ w + bias))
        torch.testing.assert_close(FUSED(a, w, [bias], text), torch.relu(a @ w + bias))
    finally:
        tuner_mod.set_autotuner(None)
    assert len(seen) == 4 and len(tuner.call_plans) == 1


def test_threads_sharing_weights_and_plans_get_their_own_results(monkeypatch, tmp_path):
    """Several threads call the op at once with shared weights of one
    signature, while another keeps creating and freeing weights (weakref
    callbacks clearing remembered views concurrently): every result is right."""
    import threading

    monkeypatch.setattr(op_mod, "fused_kernel_ineligibility", lambda *args: None)
    monkeypatch.setattr(op_mod, "_WEIGHT_VIEWS", {})
    text = "w=nk;bias@0;relu;out=float32"
    tuner, _ = _tuned(tmp_path, text)
    weights = [torch.randn(8, 16) for _ in range(4)]
    bias = torch.randn(8)
    errors = []

    def caller(seed):
        g = torch.Generator().manual_seed(seed)
        try:
            for i in range(150):
                w = weights[(seed + i) % len(weights)]
                x = torch.randn(4, 16, generator=g)
                torch.testing.assert_close(FUSED(x, w, [bias], text), torch.relu(x @ w.t() + bias))
        except Exception as exc:  # reported below, with the thread's seed
            errors.append((seed, exc))

    def churn():
        try:
            for _ in range(150):
                w = torch.randn(8, 16)
                x = torch.randn(4, 16)
                torch.testing.assert_close(FUSED(x, w, [bias], text), torch.relu(x @ w.t() + bias))
                del w
        except Exception as exc:
            errors.append(("churn", exc))

    try:
        threads = [threading.Thread(target=caller, args=(s,)) for s in range(3)] + [threading.Thread(target=churn)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        tuner_mod.set_autotuner(None)
    assert errors == []
    gc.collect()
    assert len(op_mod._WEIGHT_VIEWS) <= len(weights), "the churned weights' views are gone"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_plan_allocator_makes_what_torch_empty_makes(dtype):
    """The tuned call's output buffer: row-major, of the plan's shape, dtype and
    device, a fresh tensor each call, an inference tensor under inference mode
    (as ``torch.empty`` there); devices without a fast allocator get ``torch.empty_strided``."""
    for shape in [(16, 128), (1, 8), (0, 4), (5, 1)]:
        alloc = op_mod._allocator(shape, dtype, torch.device("cpu"))
        want = torch.empty(shape, dtype=dtype)
        got, again = alloc(), alloc()
        assert (got.shape, got.stride(), got.dtype, got.device) == (want.shape, want.stride(), want.dtype, want.device)
        assert not got.requires_grad and (got.numel() == 0 or got.data_ptr() != again.data_ptr())
        assert torch._C._dispatch_keys(got) == torch._C._dispatch_keys(want)
        with torch.inference_mode():
            assert alloc().is_inference() and torch._C._dispatch_keys(alloc()) == torch._C._dispatch_keys(
                torch.empty(shape, dtype=dtype))
    meta = op_mod._allocator((3, 4), dtype, torch.device("meta"))()
    assert (meta.device.type, meta.shape, meta.stride(), meta.dtype) == ("meta", (3, 4), (4, 1), dtype)


def test_tuned_call_outputs_are_fresh_tensors(monkeypatch, tmp_path):
    """No output is reused across calls: an eager caller keeps each result."""
    monkeypatch.setattr(op_mod, "fused_kernel_ineligibility", lambda *args: None)
    text = "w=kn;bias@0;relu;out=float32"
    _tuned(tmp_path, text)
    try:
        w, bias = torch.randn(16, 8), torch.randn(8)
        xs = [torch.randn(4, 16) for _ in range(3)]
        outs = [FUSED(x, w, [bias], text) for x in xs]
    finally:
        tuner_mod.set_autotuner(None)
    assert len({o.data_ptr() for o in outs}) == 3
    for x, o in zip(xs, outs):
        torch.testing.assert_close(o, torch.relu(x @ w + bias))
