"""The ``out=`` overload of ``branchyard::fused_gemm_epilogue`` (issue 11):
``out.copy_(op(a, b, operands, spec))``, computed straight into ``out`` where
it is an aligned row-major buffer no input overlaps; ATen's out= rules for
shape, dtype, device and autograd; fake/meta tensors, make_fx, functionalization,
export, save/load and torch.compile; and the CUDA-graph lowering's ``out_form``
finding it. tests/gpu/test_nvgemm_out_gpu.py captures it for real."""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from branchyard.errors import LoweringError
from branchyard.lowering.cuda_graph import patterns
from branchyard.lowering.nvgemm import NvGemmFallbackWarning
from branchyard.lowering.nvgemm import op as op_mod
from branchyard.lowering.nvgemm import tuner as tuner_mod
from branchyard.lowering.nvgemm.candidates import Candidate
from branchyard.lowering.nvgemm.epilogue import EpilogueSpec, reference_fused_gemm
from branchyard.lowering.nvgemm.tuner import Autotuner
from branchyard.lowering.nvgemm.winners import WinnerDB
from branchyard.serialization import load, save

FUSED = torch.ops.branchyard.fused_gemm_epilogue.default
OUT = torch.ops.branchyard.fused_gemm_epilogue.out
SPEC = "w=nk;bias@0;gelu_tanh;residual@1;out=float32"


@pytest.fixture(autouse=True)
def _quiet_fallback():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NvGemmFallbackWarning)
        yield


class Probe:
    """A tuned implementation that, like a kernel storing tiles as it goes,
    scribbles over its output before it has read all of its inputs (so an
    ``out`` aliasing an input gives a wrong result unless the op protects it),
    and records the buffer it was handed. ``returns_own``: it leaves ``out``
    alone and returns a tensor of its own (as some candidates do)."""

    def __init__(self, returns_own: bool = False):
        self.buffers: list[torch.Tensor] = []
        self.returns_own = returns_own

    def build(self, problem):
        spec = problem.spec

        def impl(a2d, b_kn, ops, out):
            self.buffers.append(out)
            if self.returns_own:
                return reference_fused_gemm(a2d, b_kn, list(ops), spec)
            out.fill_(float("nan"))
            out.copy_(reference_fused_gemm(a2d, b_kn, list(ops), spec))
            return None

        return impl


@pytest.fixture(params=["tuned", "unfused"])
def path(request, monkeypatch, tmp_path):
    """Run each case on the tuned path (a :class:`Probe` chosen by the tuner) and
    on the unfused one (CPU tensors: not eligible)."""
    if request.param == "unfused":
        yield None
        return
    probe = Probe()
    monkeypatch.setattr(op_mod, "fused_kernel_ineligibility", lambda *args: None)
    tuner_mod.set_autotuner(Autotuner([Candidate("probe", probe.build)], timer=lambda n, f: 1.0,
                                      db=WinnerDB(tmp_path), env={"gpu": "t"}, progress=False))
    yield probe
    tuner_mod.set_autotuner(None)


def _case(m=6, n=16, k=16, lead=(), dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(*lead, m, k, generator=g, dtype=dtype)
    w = torch.randn(n, k, generator=g, dtype=dtype)
    bias = torch.randn(n, generator=g, dtype=dtype)
    res = torch.randn(*lead, m, n, generator=g, dtype=dtype)
    return a, w, [bias, res]


def _want(a, w, ops, spec=SPEC):
    return reference_fused_gemm(a, w, ops, EpilogueSpec.parse(spec))


# --- registration and the lowering's out form ------------------------------------


def test_schema_kernels_and_the_lowerings_out_form():
    assert str(OUT._schema) == ("branchyard::fused_gemm_epilogue.out(Tensor a, Tensor b, Tensor[] operands, "
                                "str spec, *, Tensor(a!) out) -> Tensor(a!)")
    assert op_mod.fused_gemm_epilogue_out is OUT
    for key in ("Autograd", "CompositeExplicitAutograd", "Meta", "Functionalize"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op_mod.OUT_NAME, key), key
    a, w, ops = _case()
    form = patterns.out_form(FUSED, (a, w, ops, SPEC))
    assert form is OUT, "the capture writes a branch's last fused op into the node's output buffer"
    buf = torch.empty(6, 16)
    assert form(a, w, ops, SPEC, out=buf) is buf
    torch.testing.assert_close(buf, FUSED(a, w, ops, SPEC), rtol=0, atol=0)


# --- semantics ----------------------------------------------------------------------


@pytest.mark.parametrize("lead", [(), (2,)], ids=["2d", "3d"])
@pytest.mark.parametrize("text", [SPEC, "w=kn;relu;out=bfloat16", "w=nk;scale@0.5;silu;out=float32"])
def test_out_holds_what_the_functional_op_returns(path, lead, text):
    a, w, ops = _case(lead=lead)
    if "w=kn" in text:
        w = w.t().contiguous()
    ops = ops[: EpilogueSpec.parse(text).num_operands]
    want = FUSED(a, w, ops, text)
    for _ in range(2):  # the first call plans (and tunes), the second looks the plan up
        out = torch.empty(want.shape, dtype=want.dtype)
        before = out._version
        assert OUT(a, w, ops, text, out=out) is out
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        assert out._version > before, "out= counts as an in-place write for autograd's checks"
    if path is not None:
        assert path.buffers[-1].data_ptr() == out.data_ptr(), "the tuned impl wrote into out itself"


def _views_of_inputs(a, w, ops):
    """``(name, out)`` for outs that alias an input, each of the output's shape [M, N] (here M = N = K)."""
    m, n = a.shape[0], w.shape[0]
    big = torch.randn(3 * m * n)
    res_in_big = big[: m * n].view(m, n)
    return [
        ("a", lambda: (a, a, w, ops)),
        ("weight", lambda: (w, a, w, ops)),
        ("residual", lambda: (ops[1], a, w, ops)),
        ("half of the residual", lambda: (big[m * n // 2: m * n // 2 + m * n].view(m, n), a, w, [ops[0], res_in_big])),
    ]


@pytest.mark.parametrize("which", ["a", "weight", "residual", "half of the residual"])
def test_out_aliasing_an_input_gets_the_result_computed_from_the_inputs_before(path, which):
    a, w, ops = _case(m=16, n=16, k=16)
    out, a, w, ops = dict(_views_of_inputs(a, w, ops))[which]()
    want = _want(a.clone(), w.clone(), [t.clone() for t in ops])
    FUSED(a, w, ops, SPEC)  # plan (and tune) the signature with untouched inputs
    assert OUT(a, w, ops, SPEC, out=out) is out
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    if path is not None:
        assert path.buffers[-1].data_ptr() != out.data_ptr(), "computed into a temporary, then copied"


@pytest.mark.parametrize("kind", ["transposed", "misaligned", "row-strided"])
def test_out_that_is_not_an_aligned_row_major_buffer_is_copied_into(path, kind):
    a, w, ops = _case(m=8, n=16, k=16)
    out = {
        "transposed": lambda: torch.empty(16, 8).t(),
        "misaligned": lambda: torch.empty(8 * 16 + 1)[1:].view(8, 16),  # 4 bytes past a 16-byte boundary
        "row-strided": lambda: torch.empty(8, 32)[:, :16],
    }[kind]()
    assert OUT(a, w, ops, SPEC, out=out) is out
    torch.testing.assert_close(out, _want(a, w, ops), rtol=1e-5, atol=1e-5)
    if path is not None:
        assert path.buffers[-1].data_ptr() != out.data_ptr()



def test_after_the_plans_out_guard_every_other_out_still_gets_its_checks(path):
    """A row-major ``out`` gives the plan its ``out_guard``; later buffers that
    pass it skip only the shape, dtype, device and stride checks: one aliasing an
    input or misaligned is still copied into, and the others still get ATen's
    rules (an error, a resize), whatever came before."""
    a, w, ops = _case(m=16, n=16, k=16)
    want = _want(a, w, ops)
    first = torch.empty(16, 16)
    assert OUT(a, w, ops, SPEC, out=first) is first
    if path is not None:
        (call,) = tuner_mod.get_autotuner().call_plans.values()
        assert call.out_guard is not None and call.out_guard.check(torch.empty(16, 16))
    ptr_as_given = lambda out: path is None or path.buffers[-1].data_ptr() == out.data_ptr()  # noqa: E731
    for name, make in _views_of_inputs(a, w, ops)[:3] + [
        ("misaligned", lambda: (torch.empty(16 * 16 + 1)[1:].view(16, 16), a, w, ops)),
        ("transposed", lambda: (torch.empty(16, 16).t(), a, w, ops)),
    ]:
        out, a2, w2, ops2 = make()
        want2 = _want(a2.clone(), w2.clone(), [t.clone() for t in ops2])
        assert OUT(a2, w2, ops2, SPEC, out=out) is out, name
        torch.testing.assert_close(out, want2, rtol=1e-5, atol=1e-5, msg=name)
        assert path is None or not ptr_as_given(out), f"{name}: computed into a temporary, then copied"
    a, w, ops = _case(m=16, n=16, k=16)
    with pytest.raises(LoweringError, match=r"out has dtype torch\.float64; expected torch\.float32"):
        OUT(a, w, ops, SPEC, out=torch.empty(16, 16, dtype=torch.float64))
    with pytest.raises(LoweringError, match=r"out is on meta; expected cpu"):
        OUT(a, w, ops, SPEC, out=torch.empty(16, 16, device="meta"))
    with pytest.raises(LoweringError, match="out=.* don't support automatic differentiation"):
        OUT(a, w, ops, SPEC, out=torch.empty(16, 16, requires_grad=True))
    empty = torch.empty(0)
    assert OUT(a, w, ops, SPEC, out=empty) is empty and empty.shape == (16, 16)
    torch.testing.assert_close(empty, want, rtol=1e-5, atol=1e-5)
    again = torch.empty(16, 16)
    assert OUT(a, w, ops, SPEC, out=again) is again and ptr_as_given(again), "written directly again"
    torch.testing.assert_close(again, want, rtol=1e-5, atol=1e-5)

def test_an_impl_returning_its_own_tensor_is_copied_into_out(monkeypatch, tmp_path):
    probe = Probe(returns_own=True)
    monkeypatch.setattr(op_mod, "fused_kernel_ineligibility", lambda *args: None)
    tuner_mod.set_autotuner(Autotuner([Candidate("probe", probe.build)], timer=lambda n, f: 1.0,
                                      db=WinnerDB(tmp_path), env={"gpu": "t"}, progress=False))
    try:
        for lead in [(), (3,)]:
            a, w, ops = _case(lead=lead)
            out = torch.full((*lead, 6, 16), 7.0)
            assert OUT(a, w, ops, SPEC, out=out) is out
            torch.testing.assert_close(out, _want(a, w, ops), rtol=1e-5, atol=1e-5)
    finally:
        tuner_mod.set_autotuner(None)


def test_no_rows_gives_an_empty_out(path):
    a, w, ops = _case(m=0)
    out = torch.empty(0, 16)
    assert OUT(a, w, ops, SPEC, out=out) is out and out.shape == (0, 16)


def test_a_shape_first_seen_inside_a_capture_runs_unfused_into_out(monkeypatch, tmp_path):
    monkeypatch.setattr(op_mod, "_capturing", lambda a: True)
    tuner = Autotuner([Candidate("probe", Probe().build)], timer=lambda n, f: 1.0, db=WinnerDB(tmp_path),
                      env={"gpu": "t"}, progress=False)
    tuner_mod.set_autotuner(tuner)
    try:
        a, w, ops = _case(lead=(2,))
        out = torch.empty(2, 6, 16)
        assert OUT(a, w, ops, SPEC, out=out) is out
        torch.testing.assert_close(out, _want(a, w, ops), rtol=1e-5, atol=1e-5)
        with pytest.raises(LoweringError, match=r"expected torch\.float32"):
            OUT(a, w, ops, SPEC, out=torch.empty(2, 6, 16, dtype=torch.float64))
        assert tuner.call_plans == {} and tuner.results == {}, "nothing planned or tuned while capturing"
    finally:
        tuner_mod.set_autotuner(None)


# --- ATen's out= rules ---------------------------------------------------------------


def test_out_of_another_shape_is_resized_as_aten_resizes_it(path):
    a, w, ops = _case(lead=(2,))
    want = _want(a, w, ops)
    empty = torch.empty(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an empty out is resized silently
        assert OUT(a, w, ops, SPEC, out=empty) is empty
    assert empty.shape == (2, 6, 16)
    torch.testing.assert_close(empty, want, rtol=1e-5, atol=1e-5)
    # a non-empty out of another shape: ATen resizes it with a deprecation warning; so do we
    with pytest.warns(UserWarning, match="resized"):
        torch.mm(a[0], w.t(), out=torch.empty(3, 3))
    wrong = torch.empty(3, 3)
    with pytest.warns(UserWarning, match=r"had shape \[3, 3\].*required output shape \[2, 6, 16\]"):
        assert OUT(a, w, ops, SPEC, out=wrong) is wrong
    assert wrong.shape == (2, 6, 16)
    torch.testing.assert_close(wrong, want, rtol=1e-5, atol=1e-5)


def test_out_that_cannot_be_resized_is_an_error_naming_the_shape():
    a, w, ops = _case()
    fixed = torch.from_numpy(np.zeros(4, dtype=np.float32))  # numpy's memory: not resizable
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(LoweringError, match=r"fused_gemm_epilogue\.out.*expected \[6, 16\].*cannot be resized"):
            OUT(a, w, ops, SPEC, out=fixed)


def test_out_of_another_dtype_or_device_is_a_branchyard_error(path):
    a, w, ops = _case()
    with pytest.raises(LoweringError, match=r"out has dtype torch\.float64; expected torch\.float32"):
        OUT(a, w, ops, SPEC, out=torch.empty(6, 16, dtype=torch.float64))
    with pytest.raises(LoweringError, match=r"out has dtype torch\.float32; expected torch\.bfloat16"):
        OUT(a, w, ops, SPEC.replace("out=float32", "out=bfloat16"), out=torch.empty(6, 16))
    with pytest.raises(LoweringError, match=r"out is on meta; expected cpu"):
        OUT(a, w, ops, SPEC, out=torch.empty(6, 16, device="meta"))
    with pytest.raises(LoweringError, match=r"out is on cpu; expected meta"):
        OUT(*(t.to("meta") for t in (a, w)), [t.to("meta") for t in ops], SPEC, out=torch.empty(6, 16))


def test_out_refuses_autograd_as_aten_does(path):
    a, w, ops = _case()
    with pytest.raises(RuntimeError, match="don't support automatic differentiation"):
        torch.mm(a.requires_grad_(), w.t(), out=torch.empty(6, 16))  # ATen's rule ...
    for grad in ("a", "weight", "operand", "out"):
        a, w, ops = _case()
        out = torch.empty(6, 16)
        {"a": a, "weight": w, "operand": ops[1], "out": out}[grad].requires_grad_()
        with pytest.raises(LoweringError, match="out=.* don't support automatic differentiation") as info:
            OUT(a, w, ops, SPEC, out=out)  # ... and ours
        assert "torch.no_grad()" in str(info.value)
        with torch.no_grad():
            assert OUT(a, w, ops, SPEC, out=out) is out
        torch.testing.assert_close(out.detach(), _want(a.detach(), w.detach(), [t.detach() for t in ops]),
                                   rtol=1e-5, atol=1e-5)
    with torch.inference_mode():
        a, w, ops = _case()
        out = torch.empty(6, 16)
        assert OUT(a, w, ops, SPEC, out=out) is out
    torch.testing.assert_close(out, _want(a, w, ops), rtol=1e-5, atol=1e-5)


# --- tracing, functionalization, export, save/load, compile ---------------------------


def test_fake_and_meta_tensors_take_the_fake_kernel():
    with FakeTensorMode():
        a, w, ops = _case(lead=(2,))
        out = torch.empty(2, 6, 16)
        assert OUT(a, w, ops, SPEC, out=out) is out
        empty = torch.empty(0)
        OUT(a, w, ops, SPEC, out=empty)
        assert empty.shape == (2, 6, 16)
        with pytest.raises(LoweringError, match="expected torch.float32"):
            OUT(a, w, ops, SPEC, out=torch.empty(2, 6, 16, dtype=torch.float16))
    meta = torch.empty(5, 4, device="meta", dtype=torch.bfloat16)
    got = OUT(torch.empty(5, 8, device="meta"), torch.empty(8, 4, device="meta"), [], "w=kn;relu;out=bfloat16", out=meta)
    assert got is meta


def _writes_into(a, w, bias, res, out):
    OUT(a, w, [bias, res], SPEC, out=out)
    return out * 2


def test_make_fx_keeps_the_out_call_and_functionalization_makes_it_the_functional_op():
    a, w, (bias, res) = _case()
    want = _want(a, w, [bias, res])
    traced = make_fx(_writes_into)(a, w, bias, res, torch.empty(6, 16))
    assert [n.target for n in traced.graph.nodes].count(OUT) == 1
    functional = make_fx(torch.func.functionalize(_writes_into, remove="mutations_and_views"))(
        a, w, bias, res, torch.empty(6, 16))
    targets = [n.target for n in functional.graph.nodes if n.op == "call_function"]
    assert OUT not in targets and targets.count(FUSED) == 1, targets
    for gm in (traced, functional):
        out = torch.empty(6, 16)
        torch.testing.assert_close(gm(a, w, bias, res, out), want * 2, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)  # the caller's out is written


class WritesAFreshBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, res):
        out = torch.empty(x.shape[0], 16)
        OUT(x, self.fc.weight, [self.fc.bias, res], SPEC, out=out)
        return out + 1


class WritesItsArgument(nn.Module):
    def forward(self, x, w, bias, res, out):
        OUT(x, w, [bias, res], SPEC, out=out)
        return out * 2


def test_export_decompose_save_and_load_a_program_calling_the_out_overload():
    torch.manual_seed(0)
    model = WritesAFreshBuffer()
    x, res = torch.randn(5, 16), torch.randn(5, 16)
    batch = torch.export.Dim("batch", min=2, max=64)
    with pytest.raises(LoweringError, match="don't support automatic differentiation"):
        torch.export.export(model, (x, res))  # parameters that require grad: as torch.mm(..., out=) refuses
    model.requires_grad_(False)
    ep = torch.export.export(model, (x, res), dynamic_shapes=({0: batch}, {0: batch}))
    assert [n.target for n in ep.graph.nodes].count(OUT) == 1
    decomposed = ep.run_decompositions()
    targets = [n.target for n in decomposed.graph.nodes]
    assert OUT not in targets and targets.count(FUSED) == 1, "functional after decomposition"
    for program in (ep, decomposed):
        buf = io.BytesIO()
        save(program, buf)
        buf.seek(0)
        loaded = load(buf)
        for m in (3, 9):
            xm, rm = torch.randn(m, 16), torch.randn(m, 16)
            with torch.no_grad():
                want = _want(xm, model.fc.weight, [model.fc.bias, rm]) + 1
            torch.testing.assert_close(loaded.module()(xm, rm), want, rtol=1e-5, atol=1e-5)

    a, w, (bias, res) = _case()
    ep = torch.export.export(WritesItsArgument(), (a, w, bias, res, torch.empty(6, 16))).run_decompositions()
    assert OUT not in [n.target for n in ep.graph.nodes]
    out = torch.empty(6, 16)
    torch.testing.assert_close(ep.module()(a, w, bias, res, out), _want(a, w, [bias, res]) * 2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, _want(a, w, [bias, res]), rtol=1e-5, atol=1e-5)


def test_torch_compile_of_a_call_with_out():
    torch._dynamo.reset()
    compiled = torch.compile(_writes_into, backend="aot_eager", fullgraph=True)
    a, w, (bias, res) = _case()
    out = torch.empty(6, 16)
    torch.testing.assert_close(compiled(a, w, bias, res, out), _want(a, w, [bias, res]) * 2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, _want(a, w, [bias, res]), rtol=1e-5, atol=1e-5)
