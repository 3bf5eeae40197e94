"""The fused op on CPU: reference numerics for every epilogue, the table's
formulas against torch's own ops, export / save / load / make_fx of rewritten
programs, argument errors, and the "says once why" fallback warning."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from branchyard.errors import LoweringError
from branchyard.lowering.nvgemm import (
    EPILOGUE_TABLE,
    EPILOGUE_OPS,
    TORCH_MATH,
    EpilogueSpec,
    NvGemmFallbackWarning,
    fused_gemm_epilogue,
    nvgemm,
)
from branchyard.lowering.nvgemm import op as op_mod
from branchyard.lowering.nvgemm.kernel_config import layout_ineligibility
from branchyard.lowering.nvgemm.epilogue import reference_fused_gemm, unfused_aten_epilogue

FUSED = torch.ops.branchyard.fused_gemm_epilogue.default

NATIVE = {
    "relu": torch.relu,
    "gelu_erf": lambda x: F.gelu(x),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
}

TOL = {torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2), torch.float16: dict(rtol=2e-3, atol=2e-3)}


@pytest.fixture(autouse=True)
def _quiet_fallback():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NvGemmFallbackWarning)
        yield


@pytest.mark.parametrize("name", sorted(NATIVE))
def test_table_formula_matches_torch_in_fp32(name):
    x = torch.linspace(-12, 12, 4001)
    torch.testing.assert_close(EPILOGUE_OPS[name].apply(x, None, TORCH_MATH), NATIVE[name](x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("row", EPILOGUE_TABLE, ids=lambda r: r.name)
def test_kernel_formula_is_the_table_formula_in_fp32(row):
    """Each row's kernel form (division-free) computes its formula: checked on
    CPU through the torch math namespace, which provides the kernel's extra
    functions (sigmoid, rcp, exp2, norm_cdf)."""
    x = torch.linspace(-12, 12, 4001, dtype=torch.float64)
    operand = {"scalar": 0.37, "col": torch.linspace(-2, 2, 4001, dtype=torch.float64),
               "matrix": torch.linspace(3, -3, 4001, dtype=torch.float64),
               "weight": torch.linspace(3, -3, 4001, dtype=torch.float64)}.get(row.operand)  # the product
    torch.testing.assert_close(row.apply_kernel(x, operand, TORCH_MATH), row.apply(x, operand, TORCH_MATH),
                               rtol=1e-12, atol=1e-12)


def test_cublas_coverage_is_read_from_the_table():
    """addmm takes an alpha row then a C row; cuBLASLt a per-column C row then its activation."""
    from branchyard.lowering.nvgemm.epilogue import addmm_prefix, cublaslt_prefix

    for row in EPILOGUE_TABLE:
        spec = EpilogueSpec.parse(f"w=kn;bias@0;{row.name}{'@1' if row.operand in ('col', 'matrix', 'weight') else ''}"
                                  f"{':0.5' if row.operand == 'scalar' else ''}"
                                  f"{':float32' if row.operand == 'dtype' else ''};out=float16")
        lt = cublaslt_prefix(spec.steps)
        assert (lt is not None) == (row.cublaslt is not None), row.name
        assert lt is None or lt.use_gelu == (row.name == "gelu_tanh")
    assert [r.name for r in EPILOGUE_TABLE if r.addmm == "c"] == ["bias", "residual"]
    assert addmm_prefix(EpilogueSpec.parse("w=kn;scale_col@0;out=float16").steps) is None


def test_gelu_variants_differ():
    x = torch.linspace(-4, 4, 801)
    erf = EPILOGUE_OPS["gelu_erf"].apply(x, None, TORCH_MATH)
    tanh = EPILOGUE_OPS["gelu_tanh"].apply(x, None, TORCH_MATH)
    assert (erf - tanh).abs().max() > 1e-4, "a swapped GELU would go unnoticed"
    assert (erf - F.gelu(x, approximate="tanh")).abs().max() > 1e-4


def _case(spec_text, dtype, m=33, n=48, k=40, layout="kn", seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g).to(dtype)
    b = (torch.randn(k, n, generator=g) / k**0.5).to(dtype)
    if layout == "nk":
        b = b.t().contiguous()
    spec = EpilogueSpec.parse(f"w={layout};{spec_text}")
    ops = []
    for st in spec.steps:
        if st.op.operand == "col":
            ops.append(torch.randn(n, generator=g).to(dtype))
        elif st.op.operand == "matrix":
            ops.append(torch.randn(m, n, generator=g).to(dtype))
    return a, b, ops, spec


EPILOGUES = [
    "bias@0;out={d}",
    "scale:0.125;out={d}",
    "scale_col@0;out={d}",
    "residual@0;out={d}",
    "bias@0;relu;out={d}",
    "bias@0;gelu_erf;out={d}",
    "bias@0;gelu_tanh;out={d}",
    "bias@0;silu;out={d}",
    "sigmoid;out={d}",
    "tanh;out={d}",
    "bias@0;gelu_tanh;residual@1;out={d}",
    "scale:0.5;residual@0;out={d}",
    "bias@0;gelu_erf;cast:float32;out=float32",
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("text", EPILOGUES)
@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_reference_matches_independent_fp32_and_unfused_chain(text, dtype, layout):
    d = str(dtype).removeprefix("torch.")
    a, b, ops, spec = _case(text.format(d=d), dtype, layout=layout)
    got = fused_gemm_epilogue(a, b, ops, str(spec))
    assert got.dtype == spec.out_dtype and got.shape == (33, 48)
    # Independent fp32 computation with torch's own ops (not the table formulas).
    b_kn = b.t() if layout == "nk" else b
    y = a.double() @ b_kn.double()
    for st in spec.steps:
        name = st.op.name
        if name in NATIVE:
            y = NATIVE[name](y)
        elif name in ("bias", "residual"):
            y = y + ops[st.operand].double()
        elif name == "scale":
            y = y * st.operand
        elif name == "scale_col":
            y = y * ops[st.operand].double()
    torch.testing.assert_close(got.float(), y.to(spec.out_dtype).float(), **TOL[dtype])
    # The unfused ATen chain (rounded per op) agrees within 16-bit tolerance too.
    unfused = unfused_aten_epilogue(a @ b_kn, spec, ops)
    torch.testing.assert_close(got.float(), unfused.float(), **{k: 2 * v for k, v in TOL[dtype].items()})


def test_3d_input_and_broadcast_shaped_operands():
    a = torch.randn(2, 3, 16)
    w = torch.randn(8, 16)
    bias, res = torch.randn(1, 1, 8), torch.randn(2, 3, 8)
    out = fused_gemm_epilogue(a, w, [bias, res], "w=nk;bias@0;silu;residual@1;out=float32")
    assert out.shape == (2, 3, 8)
    torch.testing.assert_close(out, F.silu(a @ w.t() + bias) + res, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "a, b, ops, spec, match",
    [
        (torch.randn(4, 8), torch.randn(8, 16), [], "bias@0;out=float32", "takes 1 operand tensors, got 0"),
        (torch.randn(4, 8), torch.randn(8, 16), [torch.randn(8)], "bias@0;out=float32",
         r"operand 0 of step 'bias' has shape \[8\]; expected \[N\] with M=4, N=16"),
        (torch.randn(4, 8), torch.randn(8, 16), [torch.randn(16)], "residual@0;out=float32",
         r"expected \[M, N\]"),
        (torch.randn(4, 9), torch.randn(8, 16), [], "relu;out=float32", r"expected \[\.\.\., 8\]"),
        (torch.randn(4, 8), torch.randn(8, 16), [], "gelu;out=float32", "unknown epilogue step 'gelu'"),
        (torch.randn(4, 8), torch.randn(8, 16), [], "relu", "missing 'out=<dtype>'"),
        (torch.randn(4, 8), torch.randn(8, 16), [], "relu;out=float8", "unknown dtype 'float8'"),
        (torch.randn(4, 8), torch.randn(8, 16), [], "scale:abc;out=float32", "malformed operand"),
    ],
)
def test_bad_arguments_raise_lowering_error(a, b, ops, spec, match):
    with pytest.raises(LoweringError, match=match):
        fused_gemm_epilogue(a, b, ops, f"w=kn;{spec}")


def test_arguments_on_several_devices_are_a_lowering_error():
    # Through the dispatcher a meta operand would select the fake kernel; the check itself names it.
    spec = EpilogueSpec.parse("w=kn;bias@0;out=float32")
    with pytest.raises(LoweringError, match="the operand 0 is on meta, the input on cpu"):
        op_mod.check_arguments(torch.randn(4, 8), torch.randn(8, 16), [torch.randn(16, device="meta")], spec)


def test_fallback_warns_once_per_reason(monkeypatch):
    op_mod.reset_fallback_warnings()
    a, b, ops, spec = _case("bias@0;relu;out=float32", torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fused_gemm_epilogue(a, b, ops, str(spec))
        fused_gemm_epilogue(a, b, ops, str(spec))
    mine = [w for w in caught if issubclass(w.category, NvGemmFallbackWarning)]
    assert len(mine) == 1 and "tensors are on cpu, not CUDA" in str(mine[0].message)
    assert "tensors are on cpu, not CUDA" in op_mod.fallback_reasons()


def test_layout_ineligibility_reasons():
    h = torch.float16
    assert "float32" in layout_ineligibility(torch.randn(4, 8), torch.randn(8, 16), [], 8, 16)
    assert "K=12 is not a multiple of 8" in layout_ineligibility(
        torch.randn(4, 12, dtype=h), torch.randn(12, 16, dtype=h), [], 12, 16)
    assert "N=20 is not a multiple of 8" in layout_ineligibility(
        torch.randn(4, 8, dtype=h), torch.randn(8, 20, dtype=h), [], 8, 20)
    base = torch.randn(4 * 8 + 1, dtype=h)
    shifted = base[1:].view(4, 8)  # 2 bytes off a 16-byte boundary
    assert "input pointer is not 16-byte aligned" in layout_ineligibility(
        shifted, torch.randn(8, 16, dtype=h), [], 8, 16)
    bias = torch.randn(17, dtype=h)[1:]
    assert "operand 0 pointer" in layout_ineligibility(
        torch.randn(4, 8, dtype=h), torch.randn(8, 16, dtype=h), [bias], 8, 16)
    assert layout_ineligibility(torch.randn(4, 8, dtype=h), torch.randn(8, 16, dtype=h), [], 8, 16) is None


def test_without_cutedsl_a_cuda_call_is_still_tuned_among_the_other_candidates(monkeypatch):
    """No CuTeDSL (or a GPU other than sm_90): the call is still handed to the
    tuner, which races cuBLAS(Lt), Inductor and the unfused chain; only the
    CuTeDSL candidates drop out."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from branchyard.lowering.nvgemm import candidates as cands_mod
    from branchyard.lowering.nvgemm import kernel_config
    from branchyard.lowering.nvgemm.problem import Problem

    missing = (False, "CuTeDSL (nvidia-cutlass-dsl) is not importable: test")
    monkeypatch.setattr(kernel_config, "cutedsl_available", lambda: missing)
    monkeypatch.setattr(cands_mod, "cutedsl_available", lambda: missing)
    spec = EpilogueSpec.parse("w=kn;bias@0;relu;out=bfloat16")
    with FakeTensorMode(), warnings.catch_warnings():  # CUDA tensors without a GPU (no storage: pointers read 0)
        warnings.simplefilter("ignore", UserWarning)
        a, b = torch.empty(16, 64, device="cuda", dtype=torch.bfloat16), torch.empty(64, 32, device="cuda",
                                                                                   dtype=torch.bfloat16)
        bias = torch.empty(32, device="cuda", dtype=torch.bfloat16)
        assert kernel_config.fused_kernel_ineligibility(a, b, [bias], 64, 32) is None
        assert "K=60 is not a multiple of 8" in kernel_config.fused_kernel_ineligibility(
            a[:, :60], b[:60], [bias], 60, 32)
        names = [c.name for c in cands_mod.default_candidates(Problem.of(a, b, [bias], spec), inductor=False)]
    assert not [n for n in names if n.startswith("cutedsl:")]
    assert {"cublaslt:_addmm_activation", "cublas:addmm", "aten:unfused"} <= set(names)


def test_eligible_path_hands_2d_views_to_the_selected_impl(probe_tuner_of):
    """With eligibility forced, the op flattens a to [M, K], hands b as [K, N],
    col operands as [N], matrix operands as [M, N], and an out of the spec dtype."""
    seen = []

    def impl(a2d, b_kn, ops, out):
        seen.append(dict(a=a2d.shape, b=b_kn.shape, ops=[t.shape for t in ops], out=(out.shape, out.dtype)))
        out.copy_(reference_fused_gemm(a2d, b_kn, ops, EpilogueSpec.parse("w=kn;bias@0;residual@1;out=bfloat16")))

    probe_tuner_of(build=lambda problem: impl)
    a, w = torch.randn(2, 3, 16), torch.randn(8, 16)
    bias, res = torch.randn(1, 8), torch.randn(2, 3, 8)
    for _ in range(3):  # tuned on the first call, a plan lookup after
        out = fused_gemm_epilogue(a, w, [bias, res], "w=nk;bias@0;residual@1;out=bfloat16")
    want = dict(a=(6, 16), b=(16, 8), ops=[(8,), (6, 8)], out=((6, 8), torch.bfloat16))
    assert seen == [want] * 4  # the tuner's numerics check, then three calls
    assert out.shape == (2, 3, 8) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), (a @ w.t() + bias + res), rtol=1.6e-2, atol=1.6e-2)


# --- the rewritten program exports, saves, loads and traces --------------------


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 32)
        self.proj = nn.Linear(32, 16)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(x)))


def _count(graph):
    return sum(1 for n in graph.nodes if n.target is FUSED)


def test_rewritten_program_saves_loads_and_reexports():
    x = torch.randn(2, 5, 16)
    ep = torch.export.export(Block(), (x,))
    fused = nvgemm(ep)
    assert _count(fused.graph) == 2
    buf = io.BytesIO()
    torch.export.save(fused, buf)
    buf.seek(0)
    loaded = torch.export.load(buf)
    assert _count(loaded.graph) == 2
    torch.testing.assert_close(loaded.module()(x), ep.module()(x), rtol=1e-5, atol=1e-5)
    again = torch.export.export(loaded.module(), (x,))
    assert _count(again.graph) == 2
    torch.testing.assert_close(again.module()(x), ep.module()(x), rtol=1e-5, atol=1e-5)


def test_rewritten_program_traces_with_make_fx_and_dynamic_batch():
    x = torch.randn(4, 16)
    batch = torch.export.Dim("batch", min=2, max=1024)
    ep = torch.export.export(Block(), (x,), dynamic_shapes=({0: batch},))
    fused = nvgemm(ep)
    node = next(n for n in fused.graph.nodes if n.target is FUSED)
    assert not isinstance(node.meta["val"].shape[0], int), "M stays symbolic"
    for m in (2, 7, 100):
        xm = torch.randn(m, 16)
        torch.testing.assert_close(fused.module()(xm), ep.module()(xm), rtol=1e-5, atol=1e-5)
    # make_fx with fake/symbolic tensors needs the parameters as inputs (as for
    # any exported module); real-mode tracing takes the module as is.
    module = fused.module()
    assert _count(make_fx(module)(torch.randn(4, 16)).graph) == 2
    params = dict(module.named_parameters())
    gm = make_fx(lambda p, x: torch.func.functional_call(module, p, (x,)), tracing_mode="symbolic")(
        params, torch.randn(3, 16))
    assert _count(gm.graph) == 2
    x6 = torch.randn(6, 16)
    torch.testing.assert_close(gm(params, x6), ep.module()(x6), rtol=1e-5, atol=1e-5)


def test_op_falls_back_once_and_never_retunes_when_no_candidate_works(probe_tuner_of):
    op_mod.reset_fallback_warnings()
    builds = []

    def broken(problem):
        builds.append(1)
        raise LoweringError("no kernel for this shape")

    probe_tuner_of(build=broken)
    a, b, ops, spec = _case("bias@0;relu;out=float32", torch.float32)
    with pytest.warns(NvGemmFallbackWarning, match="autotuning found no working implementation"):
        got = fused_gemm_epilogue(a, b, ops, str(spec))
    for _ in range(3):
        again = fused_gemm_epilogue(a, b, ops, str(spec))
    torch.testing.assert_close(got, torch.relu(a @ b + ops[0]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again, got)
    assert builds == [1], "a failed tuning is remembered for the signature, not repeated per call"


# --- bad input: a correct result through the unfused path, the reason said once ---


def _bad_cases():
    h = torch.float16
    g = torch.Generator().manual_seed(1)
    r = lambda *s, dtype=h: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    wide = r(32, 64)
    return {
        # name: (a, b, operands, spec, reason fragment)
        "cpu tensors": (r(4, 16), r(32, 16), [r(32)], "w=nk;bias@0;gelu_tanh;out=float16", "on cpu"),
        "fp32": (r(4, 16, dtype=torch.float32), r(32, 16, dtype=torch.float32), [r(32, dtype=torch.float32)],
                 "w=nk;bias@0;relu;out=float32", "input dtype torch.float32"),
        "mixed dtypes": (r(4, 16), r(32, 16, dtype=torch.bfloat16), [r(32)], "w=nk;bias@0;relu;out=float16",
                         "weight dtype torch.bfloat16 differs"),
        "M = 0": (r(0, 16), r(32, 16), [r(32)], "w=nk;bias@0;relu;out=float16", "M = 0"),
        "K not a multiple of 8": (r(4, 12), r(32, 12), [r(32)], "w=nk;bias@0;relu;out=float16", "K=12"),
        "N not a multiple of 8": (r(4, 16), r(20, 16), [r(20)], "w=nk;bias@0;relu;out=float16", "N=20"),
        "non-contiguous weight": (r(4, 32), wide[:, ::2].t(), [r(32)], "w=kn;bias@0;relu;out=float16",
                                  "neither row-major"),
        "transposed input": (r(16, 4).t(), r(32, 16), [r(32)], "w=nk;bias@0;relu;out=float16",
                             "the input [4, 16] has strides"),
        "strided bias": (r(4, 16), r(32, 16), [r(64)[::2]], "w=nk;bias@0;relu;out=float16", "stride 2"),
        "misaligned input": (r(4 * 16 + 1)[1:].view(4, 16), r(32, 16), [r(32)], "w=nk;bias@0;relu;out=float16",
                             "not 16-byte aligned"),
    }


@pytest.mark.parametrize("name", sorted(_bad_cases()))
def test_bad_input_runs_unfused_with_the_reason_said_once(name, monkeypatch, probe_tuner_of):
    """Every case reaches the unfused path for its own reason (the device check
    is passed on CPU so that each later rule is exercised), the result is the
    original chain's, and a second call says nothing new."""
    from branchyard.lowering.nvgemm import kernel_config

    a, b, ops, text, reason = _bad_cases()[name]
    if name != "cpu tensors":  # pretend the device and CuTeDSL are there: the layout rules decide
        monkeypatch.setattr(op_mod, "fused_kernel_ineligibility",
                            lambda a, b, o, k, n: kernel_config.layout_ineligibility(a, b, o, k, n))
    probe_tuner_of(build=lambda problem: pytest.fail("the fused path must not run"), eligible=False)
    op_mod.reset_fallback_warnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = fused_gemm_epilogue(a, b, ops, text)
        again = fused_gemm_epilogue(a, b, ops, text)
    mine = [str(w.message) for w in caught if issubclass(w.category, NvGemmFallbackWarning)]
    assert len(mine) == 1 and reason in mine[0], mine
    spec = EpilogueSpec.parse(text)
    want = reference_fused_gemm(a, b, ops, spec)
    assert got.shape == want.shape and got.dtype == spec.out_dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(again, got)
    if a.dtype == b.dtype and a.numel():  # the original program's ops, not the fp32 reference
        b_kn = b.t() if spec.weight_layout == "nk" else b
        torch.testing.assert_close(got, unfused_aten_epilogue(a.reshape(-1, a.shape[-1]) @ b_kn, spec, ops),
                                   rtol=0, atol=0)


def test_timing_mode_keys_the_choice_and_rejects_unknown_modes(probe_tuner_of):
    from branchyard.lowering.nvgemm import current_timing_mode, timing_mode

    calls = []

    def impl(a, b_kn, ops, out):
        calls.append(current_timing_mode())
        out.copy_(reference_fused_gemm(a, b_kn, ops, EpilogueSpec.parse("w=kn;bias@0;relu;out=float32")))

    tuner = probe_tuner_of(build=lambda problem: impl)
    a, b, ops, spec = _case("bias@0;relu;out=float32", torch.float32)
    fused_gemm_epilogue(a, b, ops, str(spec))
    with timing_mode("device"):
        fused_gemm_epilogue(a, b, ops, str(spec))
        fused_gemm_epilogue(a, b, ops, str(spec))
    fused_gemm_epilogue(a, b, ops, str(spec))
    timings = sorted(k.split("|timing=")[1] for k in tuner.results)
    assert timings == ["device", "host"], "one tuning per mode"
    assert calls == ["host", "host", "device", "device", "device", "host"]  # check+call, check+2 calls, call
    with pytest.raises(LoweringError, match="timing mode 'graph'"):
        with timing_mode("graph"):
            pass


def test_backward_matches_eager_and_compile_with_trainable_params():
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(2, 5, 16)
    fused = nvgemm(torch.export.export(model, (x,))).module()
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    fused(xa).square().sum().backward()
    model(xb).square().sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-4, atol=1e-4)
    for (name, p), q in zip(fused.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4, msg=name)
    compiled = torch.compile(fused, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)


class CondBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 32)

    def forward(self, x, flag):
        return torch.cond(flag, lambda t: F.gelu(self.fc(t)), lambda t: torch.tanh(self.fc(t) * 0.5), (x,))


def test_fused_ops_inside_cond_branches_survive_save_load_and_decompositions():
    x = torch.randn(4, 16)
    ep = torch.export.export(CondBlock(), (x, torch.tensor(True)))
    fused = nvgemm(ep)
    buf = io.BytesIO()
    torch.export.save(fused, buf)
    buf.seek(0)
    loaded = torch.export.load(buf)
    decomposed = loaded.run_decompositions()
    count = sum(1 for m in decomposed.graph_module.modules() if isinstance(m, torch.fx.GraphModule)
                for n in m.graph.nodes if n.target is FUSED)
    assert count == 2, "the fused op is not decomposed away"
    for flag in (True, False):
        f = torch.tensor(flag)
        torch.testing.assert_close(decomposed.module()(x, f), ep.module()(x, f), rtol=1e-5, atol=1e-5)


def test_inside_a_capture_the_op_never_tunes_and_uses_the_warm_up_choice(monkeypatch, probe_tuner_of):
    """CPU stand-in for a CUDA-graph capture (tests/gpu/test_nvgemm_capture_gpu.py
    captures for real): a signature run before the capture replays its choice,
    from either timing mode; a signature first seen while capturing runs the
    unfused ops, says why once, and is not tuned or remembered."""
    from branchyard.lowering.nvgemm import timing_mode

    ran = []

    def impl(a, b_kn, ops, out):
        ran.append(a.shape[0])
        out.copy_(reference_fused_gemm(a, b_kn, ops, EpilogueSpec.parse("w=kn;bias@0;relu;out=float32")))

    tuner = probe_tuner_of(build=lambda problem: impl)
    op_mod.reset_fallback_warnings()
    capturing = [False]
    monkeypatch.setattr(op_mod, "_capturing", lambda a: capturing[0])
    a, b, ops, spec = _case("bias@0;relu;out=float32", torch.float32)
    fused_gemm_epilogue(a, b, ops, str(spec))  # eager warm-up, host mode
    tuned, plans = dict(tuner.results), dict(tuner.call_plans)
    capturing[0] = True
    with timing_mode("device"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warm = fused_gemm_epilogue(a, b, ops, str(spec))
        fresh_a = torch.randn(3, a.shape[1])
        cold = fused_gemm_epilogue(fresh_a, b, ops, str(spec))
        fused_gemm_epilogue(fresh_a, b, ops, str(spec))
    assert tuner.results == tuned and tuner.call_plans == plans, "nothing tuned or planned while capturing"
    assert ran == [a.shape[0], a.shape[0], a.shape[0]]  # numerics check, warm-up, the captured call
    torch.testing.assert_close(warm, torch.relu(a @ b + ops[0]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cold, torch.relu(fresh_a @ b + ops[0]), rtol=1e-5, atol=1e-5)
    mine = [str(w.message) for w in caught if issubclass(w.category, NvGemmFallbackWarning)]
    assert len(mine) == 1 and "shape first seen inside a CUDA-graph capture" in mine[0]
