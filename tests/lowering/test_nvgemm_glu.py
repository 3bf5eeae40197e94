"""A GLU's two matmuls as one fused op: the ``mul`` and ``mul_mm`` epilogue rows.

``silu(gate(x)) * up(x)``: the chain from ``gate`` takes ``up``'s matmul in as a
``mul_mm`` step whose operand is ``up``'s ``[N, K]`` weight. Checked here on CPU:
the spec and its semantics, the op's argument checks, what the matcher takes
and what it refuses (each refusal still fuses the ``mul``, as ``mul@i``), the
rewritten programs against the originals (random programs too), gradients,
save/load, and how the candidates run such a chain (the small-M kernel's dual
configs natively, every other kernel expanded). The dual kernel itself runs in
``tests/gpu/test_nvgemm_glu_gpu.py``.
"""

from __future__ import annotations

import io
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from branchyard.errors import LoweringError
from branchyard.lowering.nvgemm import candidates as cand
from branchyard.lowering.nvgemm import fused_gemm_epilogue, nvgemm
from branchyard.lowering.nvgemm.epilogue import (
    EpilogueSpec,
    expand_weight_steps,
    reference_fused_gemm,
    unfused_aten_epilogue,
    weight_products,
)
from branchyard.lowering.nvgemm.kernel_config import GemvConfig, small_m_configs
from branchyard.lowering.nvgemm.kernel_math import plan_steps
from branchyard.lowering.nvgemm.matcher import find_epilogue_chains
from branchyard.lowering.nvgemm.problem import Problem

aten = torch.ops.aten
FUSED = torch.ops.branchyard.fused_gemm_epilogue.default

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _specs(program) -> list[str]:
    gm = getattr(program, "graph_module", program)
    return [n.args[3] for n in gm.graph.nodes if n.target is FUSED]


def _count(program, target) -> int:
    gm = getattr(program, "graph_module", program)
    return sum(n.target is target for n in gm.graph.nodes)


class GLU(nn.Module):
    """``act(gate(x)) * up(x)`` then ``down``, with the knobs the tests turn."""

    def __init__(self, d=32, h=48, act=F.silu, up_bias=False, swap=False, residual=False):
        super().__init__()
        self.gate = nn.Linear(d, h, bias=False)
        self.up = nn.Linear(d, h, bias=up_bias)
        self.down = nn.Linear(h, d, bias=False)
        self.act, self.swap, self.residual = act, swap, residual

    def forward(self, x):
        if self.swap:  # up's matmul first in the graph
            u = self.up(x)
            g = self.act(self.gate(x))
        else:
            g, u = self.act(self.gate(x)), self.up(x)
        y = self.down(g * u)
        return x + y if self.residual else y


# --- the spec and its semantics -------------------------------------------------


def test_spec_round_trips_and_expands():
    spec = EpilogueSpec.parse("w=nk;bias@0;silu;mul_mm@1;scale:0.5;out=bfloat16")
    assert EpilogueSpec.parse(str(spec)) == spec and spec.num_operands == 2
    assert str(expand_weight_steps(spec)) == "w=nk;bias@0;silu;mul@1;scale:0.5;out=bfloat16"
    assert [(s.name, s.operand, s.index) for s in plan_steps(spec)][2] == ("mul_mm", "weight", 1)
    with pytest.raises(LoweringError, match="malformed operand"):
        EpilogueSpec.parse("w=nk;mul_mm;out=float32")
    with pytest.raises(LoweringError, match="numbered 0, 1"):
        EpilogueSpec.parse("w=nk;mul_mm@1;out=float32")


@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_op_computes_act_of_one_product_times_the_other(layout):
    g = torch.Generator().manual_seed(0)
    x, wg, wu = (torch.randn(*s, generator=g) for s in ((2, 3, 16), (24, 16), (24, 16)))
    b = wg if layout == "nk" else wg.t().contiguous()
    out = fused_gemm_epilogue(x, b, [wu], f"w={layout};silu;mul_mm@0;out=float32")
    torch.testing.assert_close(out, F.silu(x @ wg.t()) * (x @ wu.t()), rtol=1e-5, atol=1e-5)
    assert out.shape == (2, 3, 24)


def test_unfused_path_is_the_original_ops_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    x, wg, wu = (torch.randn(*s, generator=g).bfloat16() for s in ((5, 64), (32, 64), (32, 64)))
    spec = EpilogueSpec.parse("w=nk;silu;mul_mm@0;out=bfloat16")
    got = unfused_aten_epilogue(torch.mm(x, wg.t()), spec, [wu], x)
    assert torch.equal(got, F.silu(F.linear(x, wg)) * F.linear(x, wu))
    assert torch.equal(fused_gemm_epilogue(x, wg, [wu], str(spec)), got)  # CPU: the unfused path
    with pytest.raises(LoweringError, match="needs the matmul's input"):
        unfused_aten_epilogue(torch.mm(x, wg.t()), spec, [wu])


def test_bad_second_weight_is_named():
    x, wg = torch.randn(4, 16), torch.randn(8, 16)
    for bad in (torch.randn(16, 8), torch.randn(8, 32), torch.randn(8)):
        with pytest.raises(LoweringError, match=r"second weight \[N, K\] = \[8, 16\]"):
            fused_gemm_epilogue(x, wg, [bad], "w=nk;mul_mm@0;out=float32")


def test_second_weight_of_another_dtype_runs_the_reference_semantics():
    x, wg, wu = torch.randn(4, 16), torch.randn(8, 16), torch.randn(8, 16).double()
    out = fused_gemm_epilogue(x, wg, [wu], "w=nk;silu;mul_mm@0;out=float32")
    torch.testing.assert_close(out, (F.silu(x @ wg.t()).double() * (x.double() @ wu.t())).float())


def test_two_second_weights_run_expanded():
    """A crafted spec with two products: no kernel reads three weights, so every
    candidate runs it expanded; the op's answer is the semantics."""
    g = torch.Generator().manual_seed(5)
    x, w1, w2, w3 = (torch.randn(*s, generator=g) for s in ((3, 16), (8, 16), (8, 16), (8, 16)))
    out = fused_gemm_epilogue(x, w1, [w2, w3], "w=nk;mul_mm@0;silu;mul_mm@1;out=float32")
    torch.testing.assert_close(out, F.silu((x @ w1.t()) * (x @ w2.t())) * (x @ w3.t()), rtol=1e-5, atol=1e-5)
    p, *_ = _problem(spec="w=nk;mul_mm@0;mul_mm@1;out=bfloat16", w2=torch.randn(64, 128, dtype=torch.bfloat16))
    assert "2 second weights" in (cand._small_m_applies(p) or "")


def test_weight_products_replace_only_the_weights():
    spec = EpilogueSpec.parse("w=nk;bias@0;mul_mm@1;out=float32")
    a, bias, w2 = torch.randn(3, 8), torch.randn(4), torch.randn(4, 8)
    ops = weight_products(a, spec, [bias, w2])
    assert ops[0] is bias and torch.allclose(ops[1], a @ w2.t())


# --- what the matcher takes, and what it refuses -------------------------------------


@pytest.mark.parametrize("shape", [(2, 5, 32), (1, 32), (1, 1, 32)])
def test_exported_glu_is_one_op_and_down(shape):
    """At M = 1 the product ``[1, N]`` reads as a per-column vector (``scale_col``): it
    is taken in all the same (and the residual ``x`` reads as a bias)."""
    m, x = GLU(residual=True), torch.randn(*shape)
    ep = torch.export.export(m, (x,))
    out = nvgemm(ep)
    down = "w=nk;residual@0;out=float32" if shape[-2] > 1 else "w=nk;bias@0;out=float32"
    assert _specs(out) == ["w=nk;silu;mul_mm@0;out=float32", down]
    assert _count(out, aten.linear.default) == 0 and _count(out, aten.mul.Tensor) == 0
    torch.testing.assert_close(out.module()(x), m(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case, spec, why", [
    ("up_bias", "w=kn;silu;mul@0;out=float32", "has its own bias"),
    ("up_scaled", "w=kn;silu;mul@0;out=float32", "has its own scale and bias"),
    ("up_twice", "w=kn;silu;mul@0;out=float32", "other users"),
    ("other_input", "w=kn;silu;mul@0;out=float32", "different inputs"),
    ("not_a_matmul", "w=kn;silu;mul@0;out=float32", None),
    ("kn_weight", "w=kn;silu;mul@0;out=float32", "not an [N, K]"),
])
def test_refusals_still_fuse_the_mul(case, spec, why):
    wg, wu, wk = torch.randn(48, 32), torch.randn(48, 32), torch.randn(32, 48)
    bu = torch.randn(48)

    def f(x, y, z):
        g = F.silu(F.linear(x, wg)) if case != "kn_weight" else F.silu(x @ wk)
        if case == "up_bias":
            return g * F.linear(x, wu, bu)
        if case == "up_scaled":
            return g * torch.addmm(bu, x, wu.t(), alpha=0.5)
        if case == "up_twice":
            u = F.linear(x, wu)
            return g * u, u
        if case == "other_input":
            return g * F.linear(y, wu)
        if case == "not_a_matmul":
            return g * z
        return g * (x @ wk)

    args = (torch.randn(4, 32), torch.randn(4, 32), torch.randn(4, 48))
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(f)(*args)
    chains = find_epilogue_chains(gm)
    assert str(chains[0].spec) == spec
    out = nvgemm(gm)
    assert spec in _specs(out) and _count(out, aten.mul.Tensor) == 0
    want, got = f(*args), out(*args)
    for w, o in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)):
        torch.testing.assert_close(o, w, rtol=1e-5, atol=1e-5)
    if why is not None:  # the refusal is the reason the matcher gives for the product
        from branchyard.lowering.nvgemm.matcher import _match_product

        mul = next(n for n in gm.graph.nodes if n.target is aten.mul.Tensor)
        res = _match_product(chains[0], mul, next(a for a in mul.args if a is not chains[0].nodes[-2]))
        assert isinstance(res, str) and why in res, res


def test_up_first_in_the_graph_still_gives_one_op():
    """``up(x)`` computed before ``silu(gate(x))``: up's bare matmul leaves the mul to
    gate's chain, which takes it in as the product (one op, not two)."""
    m, x = GLU(swap=True), torch.randn(6, 32)
    ep = torch.export.export(m, (x,))
    chains = {c.root.name: c for c in find_epilogue_chains(ep.graph_module)}
    assert chains["linear"].deferred and not chains["linear"].plain  # up: never raced as a plain GEMM
    assert "goes with the chain of 'linear_1'" in chains["linear"].reason
    out = nvgemm(ep)
    assert _specs(out) == ["w=nk;silu;mul_mm@0;out=float32"]
    assert _count(out, aten.linear.default) == 1  # down
    torch.testing.assert_close(out.module()(x), m(x), rtol=1e-5, atol=1e-5)


def test_a_biased_up_takes_a_bare_gate_in():
    """No activation on gate and a bias on up: gate's bare matmul defers to up's chain,
    which takes gate in after its bias (``(a @ wu.T + b) * (a @ wg.T)``)."""
    m, x = GLU(act=lambda t: t, up_bias=True), torch.randn(6, 32)
    out = nvgemm(torch.export.export(m, (x,)))
    assert _specs(out) == ["w=nk;bias@0;mul_mm@1;out=float32"]
    torch.testing.assert_close(out.module()(x), m(x), rtol=1e-5, atol=1e-5)


def test_random_glu_programs_match_the_originals():
    """Forms (linear / matmul / mm, 2-D / 3-D, decomposed or not), activations, the
    up bias, which matmul comes first in the graph and steps after the mul: each
    rewritten program equals its original, and takes the product in exactly when
    the rules allow it."""
    rng = random.Random(7)
    acts = {"silu": F.silu, "gelu": F.gelu, "relu": torch.relu, "none": lambda t: t}
    taken = 0
    for trial in range(24):
        d, h = rng.choice([16, 32]), rng.choice([24, 48])
        act, form = rng.choice(list(acts)), rng.choice(["linear", "matmul"])
        up_bias, swap, after = rng.random() < 0.25, rng.random() < 0.25, rng.choice(["", "scale", "residual"])
        three_d, decompose = rng.random() < 0.5, rng.random() < 0.5
        wg, wu, bu = torch.randn(h, d), torch.randn(h, d), torch.randn(h) if up_bias else None

        def mm(x, w, b=None):
            if form == "linear":
                return F.linear(x, w, b)
            return x @ w.t() if b is None else x @ w.t() + b

        class M(nn.Module):
            def forward(self, x, r):
                if swap:  # up's matmul first in the graph: it takes the mul
                    u = mm(x, wu, bu)
                    g = acts[act](mm(x, wg))
                else:
                    g, u = acts[act](mm(x, wg)), mm(x, wu, bu)
                y = g * u
                return y * 0.5 if after == "scale" else y + r if after == "residual" else y

        shape = (2, 3, d) if three_d else (6, d)
        args = (torch.randn(*shape), torch.randn(*shape[:-1], h))
        ep = torch.export.export(M(), args)
        if decompose:
            ep = ep.run_decompositions()
        out = nvgemm(ep)
        torch.testing.assert_close(out.module()(*args), M()(*args), rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"trial {trial}: {m}")
        specs = _specs(out)
        has = any("mul_mm" in s for s in specs)
        taken += has
        # a bare matmul leaves the mul to its sibling's chain, in either graph order; a biased
        # up is never a product, but takes a bare gate in (no activation) as its own
        expect = not up_bias or act == "none"
        assert has == expect, (trial, specs, act, form, decompose)
    assert taken >= 8


def test_gradients_flow_through_both_weights():
    g = torch.Generator().manual_seed(3)
    x, wg, wu = (torch.randn(*s, generator=g, requires_grad=True) for s in ((4, 16), (8, 16), (8, 16)))
    out = fused_gemm_epilogue(x, wg, [wu], "w=nk;silu;mul_mm@0;out=float32")
    grads = torch.autograd.grad(out.sum(), (x, wg, wu))
    ref = torch.autograd.grad((F.silu(x @ wg.t()) * (x @ wu.t())).sum(), (x, wg, wu))
    for got, want in zip(grads, ref):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block", ["glu", "stacked"])
def test_rewritten_program_saves_and_loads(block):
    """Separate gate/up weights, and a stacked one whose halves are slices in the graph."""
    m, x = (GLU() if block == "glu" else StackedGLU()), torch.randn(4, 32)
    out = nvgemm(torch.export.export(m, (x,)))
    assert any("mul_mm" in s for s in _specs(out))
    buf = io.BytesIO()
    torch.export.save(out, buf)
    buf.seek(0)
    loaded = torch.export.load(buf)
    assert _specs(loaded) == _specs(out)
    torch.testing.assert_close(loaded.module()(x), m(x), rtol=1e-5, atol=1e-5)


# --- how the candidates run it ---------------------------------------------------------


def _problem(m=1, n=64, k=128, dtype=torch.bfloat16, w2=None, spec="w=nk;silu;mul_mm@0;out=bfloat16"):
    s = EpilogueSpec.parse(spec)
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    w2 = torch.randn(n, k, dtype=dtype) if w2 is None else w2
    return Problem.of(a, b.t(), [w2], s), a, b, w2


def test_unfused_candidate_runs_the_chain():
    p, a, b, w2 = _problem(m=3, dtype=torch.float32, spec="w=nk;silu;mul_mm@0;out=float32")
    names = [c.name for c in cand.default_candidates(p, inductor=False)]
    assert names[-1] == cand.UNFUSED and not any("gemv" in n for n in names)  # no CuTeDSL on CPU
    impl = cand._aten_build(p)
    out = impl(a, b.t(), [w2], torch.empty(3, 64))
    torch.testing.assert_close(out, reference_fused_gemm(a, b, [w2], EpilogueSpec.parse("w=nk;silu;mul_mm@0;out=float32")))


def test_tiled_kernels_get_the_expanded_chain_and_the_dual_config_the_chain(monkeypatch):
    from branchyard.lowering.nvgemm import cutedsl_gemm
    from branchyard.lowering.nvgemm.kernel_config import GemmConfig

    seen = []

    def fake_compile(spec, dtype, config, **kw):
        seen.append((str(spec), kw["operand_dtypes"]))

        def fn(a, b_kn, operands, out):
            out.copy_(unfused_aten_epilogue(torch.mm(a, b_kn), spec, list(operands), a))

        return fn

    monkeypatch.setattr(cutedsl_gemm, "compile_fused_gemm", fake_compile)
    p, a, b, w2 = _problem(m=2, dtype=torch.float32, spec="w=nk;silu;mul_mm@0;out=float32")
    impl = cand._cutedsl_build(p, GemmConfig(128, 128))
    out = impl(a, b.t(), [w2], torch.empty(2, 64))
    assert seen[-1] == ("w=kn;silu;mul@0;out=float32", [torch.float32])
    torch.testing.assert_close(out, F.silu(a @ b.t()) * (a @ w2.t()))
    cand._cutedsl_build(p, GemvConfig(8, 8, dual=True))
    assert seen[-1] == ("w=kn;silu;mul_mm@0;out=float32", [torch.float32])


def test_small_m_dual_configs_and_their_refusals():
    assert GemvConfig(8, 8, dual=True).name == "gemv_m8_w8_dual"
    assert GemvConfig(8, 8, dual=True).registers == GemvConfig(8, 8, rows=32).registers
    with pytest.raises(LoweringError, match="dual with rows=32"):
        GemvConfig(8, 8, rows=32, dual=True)
    configs = small_m_configs(16, 14336, 4096, dual=True)
    assert configs and all(c.dual and c.rows == 16 for c in configs)
    assert small_m_configs(64, 14336, 4096, dual=True) == []  # two tiles of 64 rows do not fit
    p, *_ = _problem()
    assert cand._small_m_applies(p) is None
    p, *_ = _problem(w2=torch.randn(64, 128, dtype=torch.float16))
    assert "dtype differs" in cand._small_m_applies(p)
    p, *_ = _problem(w2=torch.randn(128, 64, dtype=torch.bfloat16).t())
    assert "not row-major" in cand._small_m_applies(p)


# --- dynamic shapes and control flow ------------------------------------------------------


@pytest.mark.parametrize("decompose", [False, True])
@pytest.mark.parametrize("how", ["dim", "shapevar"])
def test_dynamic_batch_takes_the_product_in(how, decompose):
    """A backed ``Dim`` and an unbacked ``ShapeVar`` batch: the inputs compare by
    source node and shape without a guard, and the rewrite runs at other sizes."""
    m = GLU(residual=True)
    if how == "dim":
        from torch.export import Dim

        ep = torch.export.export(m, (torch.randn(2, 5, 32),),
                                 dynamic_shapes={"x": {0: Dim("b", min=2, max=8), 1: Dim("t", min=2, max=64)}})
        x = torch.randn(3, 9, 32)
    else:
        import branchyard.shapes as shapes
        from branchyard.shapes import ShapeVar, dynamic_spec

        batch = ShapeVar("batch", min=2, max=128)

        @dynamic_spec({"x": (batch, 32)})
        def forward(x):
            return m(x)

        ep = shapes.export(forward, (torch.randn(4, 32),))
        x = torch.randn(9, 32)
    if decompose:
        ep = ep.run_decompositions()
    out = nvgemm(ep)
    assert [s.split(";", 1)[1] for s in _specs(out)] == ["silu;mul_mm@0;out=float32", "residual@0;out=float32"]
    torch.testing.assert_close(out.module()(x), m(x), rtol=1e-5, atol=1e-5)


def test_glus_inside_cond_branches():
    class Branches(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = GLU(residual=True), GLU(residual=True)

        def forward(self, x, p):
            return torch.cond(p.sum() > 0, lambda x: self.a(x), lambda x: self.b(x) * 2, (x,))

    from branchyard.fx.graph_walk import iter_graph_modules

    m, x = Branches(), torch.randn(4, 32)
    out = nvgemm(torch.export.export(m, (x, torch.tensor(1.0))))
    per_graph = [_specs(gm) for gm in iter_graph_modules(out.graph_module)]
    assert per_graph == [[], ["w=nk;silu;mul_mm@0;out=float32", "w=nk;residual@0;out=float32"],
                         ["w=nk;silu;mul_mm@0;out=float32", "w=nk;residual@0;scale:2.0;out=float32"]]
    for p in (1.0, -1.0):
        torch.testing.assert_close(out.module()(x, torch.tensor(p)), m(x, torch.tensor(p)), rtol=1e-5, atol=1e-5)


# --- one matmul on stacked gate and up weights, halved (Phi-3's gate_up_proj) -------------


class StackedGLU(nn.Module):
    def __init__(self, d=32, h=48, how="chunk", swap=False, bias=False):
        super().__init__()
        self.gate_up = nn.Linear(d, 2 * h, bias=bias)
        self.down = nn.Linear(h, d, bias=False)
        self.how, self.h, self.swap = how, h, swap

    def forward(self, x):
        gu = self.gate_up(x)
        if self.how == "chunk":
            g, u = gu.chunk(2, dim=-1)
        elif self.how == "split":
            g, u = gu.split(self.h, dim=-1)
        else:
            g, u = torch.split(gu, [self.h, self.h], dim=-1)
        if self.swap:
            g, u = u, g
        return x + self.down(F.silu(g) * u)


@pytest.mark.parametrize("decompose", [False, True])
@pytest.mark.parametrize("shape", [(2, 5, 32), (1, 32)])
@pytest.mark.parametrize("how, swap", [("chunk", False), ("split", True), ("sizes", False)])
def test_a_halved_stacked_weight_is_one_op_on_its_row_halves(how, swap, shape, decompose):
    m, x = StackedGLU(how=how, swap=swap), torch.randn(*shape)
    ep = torch.export.export(m, (x,))
    if decompose:
        ep = ep.run_decompositions()
    out = nvgemm(ep)
    assert _specs(out)[0] == "w=nk;silu;mul_mm@0;out=float32"
    slices = [n for n in out.graph_module.graph.nodes if n.target is aten.slice.Tensor]
    gate, up = (0, 48) if not swap else (48, 96)
    assert [(s.args[0].name, s.args[2], s.args[3]) for s in slices] == [
        ("p_gate_up_weight", gate, gate + 48), ("p_gate_up_weight", 48 - gate, 96 - gate)]
    left = {n.target for n in out.graph_module.graph.nodes}
    assert not left & {aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default, aten.mul.Tensor}
    torch.testing.assert_close(out.module()(x), m(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case, why", [
    ("bias", None),                                   # a bias on the stacked weight: not a bare matmul
    ("unequal", "not into two equal halves"),
    ("not_last", "not the output's last"),
    ("read_twice", "neither half reaches a mul by the other"),  # up is also returned
    ("added", "neither half reaches a mul by the other"),
])
def test_halved_matmuls_that_stay_as_they_are(case, why):
    w, b = torch.randn(96, 32), torch.randn(96)

    def f(x):
        gu = F.linear(x, w, b if case == "bias" else None)
        if case == "unequal":
            g, u = gu.split([40, 56], dim=-1)
            return F.silu(g).sum(-1, keepdim=True) * u
        if case == "not_last":
            g, u = gu.chunk(2, dim=0)
            return F.silu(g) * u
        g, u = gu.chunk(2, dim=-1)
        if case == "read_twice":
            return F.silu(g) * u, u
        if case == "added":
            return F.silu(g) + u
        return F.silu(g) * u

    x = torch.randn(4, 32)
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(f)(x)
    (chain,) = find_epilogue_chains(gm)
    assert not any(op.name == "mul_mm" for op, _ in chain.steps)
    if why is not None:
        assert why in chain.stop, chain.stop
    out = nvgemm(gm)
    want, got = f(x), out(x)
    for w_, g_ in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)):
        torch.testing.assert_close(g_, w_, rtol=1e-5, atol=1e-5)
