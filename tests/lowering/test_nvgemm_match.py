"""nvgemm pattern matching: which chains are fused, into what spec, and why
the others are declined. CPU only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from branchyard.lowering.nvgemm import NvGemmPass, find_epilogue_chains, nvgemm
from branchyard.fx.pass_infra import apply_pass as apply
from branchyard.registry import get_pass

FUSED = torch.ops.branchyard.fused_gemm_epilogue.default
aten = torch.ops.aten


def fused_nodes(program):
    graph = program.graph if hasattr(program, "graph") else program.graph_module.graph
    return [n for n in graph.nodes if n.target is FUSED]


def targets(program):
    graph = program.graph
    return [n.target for n in graph.nodes if n.op == "call_function"]


class GPT2MLP(nn.Module):
    def __init__(self, d=32, h=64, approximate="tanh"):
        super().__init__()
        self.c_fc = nn.Linear(d, h)
        self.c_proj = nn.Linear(h, d)
        self.approximate = approximate

    def forward(self, x):
        h = F.gelu(self.c_fc(x), approximate=self.approximate)
        return x + self.c_proj(h)


class SwiGLU(nn.Module):
    def __init__(self, d=32, h=64):
        super().__init__()
        self.gate = nn.Linear(d, h, bias=False)
        self.up = nn.Linear(d, h, bias=False)
        self.down = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


def specs(program):
    return [n.args[3] for n in fused_nodes(program)]


# --- GPT-2 MLP: linear+gelu(tanh), linear+bias+residual ---------------------


@pytest.mark.parametrize("shape", [(8, 32), (2, 4, 32)], ids=["2d", "3d"])
def test_gpt2_mlp_exported_fuses_both_linears(shape):
    ep = torch.export.export(GPT2MLP(), (torch.randn(shape),))
    out = nvgemm(ep)
    assert specs(out) == ["w=nk;bias@0;gelu_tanh;out=float32", "w=nk;bias@0;residual@1;out=float32"]
    assert aten.linear.default not in targets(out)
    assert aten.gelu.default not in targets(out)
    x = torch.randn(shape)
    torch.testing.assert_close(out.module()(x), ep.module()(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(8, 32), (2, 4, 32)], ids=["2d", "3d"])
def test_gpt2_mlp_decomposed_addmm_and_views(shape):
    ep = torch.export.export(GPT2MLP(), (torch.randn(shape),)).run_decompositions()
    assert aten.addmm.default in targets(ep)
    out = nvgemm(ep)
    assert specs(out) == ["w=kn;bias@0;gelu_tanh;out=float32", "w=kn;bias@0;residual@1;out=float32"]
    remaining = targets(out)
    assert aten.addmm.default not in remaining and aten.gelu.default not in remaining
    assert aten.add.Tensor not in remaining
    x = torch.randn(shape)
    torch.testing.assert_close(out.module()(x), ep.module()(x), rtol=1e-5, atol=1e-5)
    if len(shape) == 3:
        # The fused op makes [M, N]; one view restores [B, S, N] for the residual chain.
        fused = fused_nodes(out)
        assert [u.target for u in fused[0].users] == [aten.view.default]
        assert list(fused[1].meta["val"].shape) == [8, 32]


def test_gelu_erf_and_tanh_are_distinct_steps():
    erf = specs(nvgemm(torch.export.export(GPT2MLP(approximate="none"), (torch.randn(4, 32),))))
    tanh = specs(nvgemm(torch.export.export(GPT2MLP(approximate="tanh"), (torch.randn(4, 32),))))
    assert "gelu_erf" in erf[0] and "gelu_tanh" not in erf[0]
    assert "gelu_tanh" in tanh[0] and "gelu_erf" not in tanh[0]


# --- Llama SwiGLU: gate+silu fused; the gating mul and the up/down linears are not ---


def test_swiglu_fuses_gate_silu_up_and_the_mul_into_one_op():
    ep = torch.export.export(SwiGLU(), (torch.randn(2, 4, 32),))
    p = NvGemmPass()
    res = p(ep.graph_module)
    assert p.report.stats == {"fused": 1, "declined": 1, "specs": ["w=nk;silu;mul_mm@0;out=float32"],
                              "plain_fused": 0,
                              "race": "not raced: the program runs on cpu, where the fused op runs "
                                      "the original ATen ops (races run on cuda)"}
    reasons = {s.where.split("'")[1]: s.reason for s in p.report.skips}
    assert list(reasons) == ["linear_2"] and "graph output" in reasons["linear_2"]
    assert aten.mul.Tensor not in targets(res.graph_module)
    assert sum(t is aten.linear.default for t in targets(res.graph_module)) == 1  # only down is left
    fused = next(n for n in res.graph_module.graph.nodes if n.target is FUSED)
    assert [a.name for a in fused.args[2]] == ["p_up_weight"]


def test_swiglu_decomposed_silu_is_recognised():
    ep = torch.export.export(SwiGLU(), (torch.randn(8, 32),)).run_decompositions()
    assert aten.sigmoid.default in targets(ep), "decompositions should expand silu"
    out = nvgemm(ep)
    assert specs(out) == ["w=kn;silu;mul_mm@0;out=float32"]
    assert aten.sigmoid.default not in targets(out)
    # up's mm and its transposed weight went with the chain; the fused op takes the [N, K] weight
    assert sum(t is aten.mm.default for t in targets(out)) == 1
    assert sum(t is aten.permute.default for t in targets(out)) == 2
    x = torch.randn(8, 32)
    torch.testing.assert_close(out.module()(x), ep.module()(x), rtol=1e-5, atol=1e-5)


# --- a chain with a second user is cut before it ----------------------------


def test_second_user_stops_the_chain():
    def f(x, w, b):
        y = x @ w + b
        z = torch.relu(y)
        return z, y  # y has two users: relu and the output

    gm = make_fx(f)(torch.randn(4, 8), torch.randn(8, 16), torch.randn(16))
    (chain,) = find_epilogue_chains(gm)
    assert chain.fusable and [op.name for op, _ in chain.steps] == ["bias"]
    assert "2 users" in chain.stop
    out = nvgemm(gm)
    assert specs(out) == ["w=kn;bias@0;out=float32"]
    assert aten.relu.default in targets(out), "relu needs the unfused value and must stay"
    args = (torch.randn(4, 8), torch.randn(8, 16), torch.randn(16))
    for got, want in zip(out(*args), gm(*args)):
        torch.testing.assert_close(got, want)


def test_matmul_with_two_users_is_declined():
    def f(x, w):
        y = x @ w
        return torch.relu(y), y.sum()

    gm = make_fx(f)(torch.randn(4, 8), torch.randn(8, 16))
    p = NvGemmPass()
    res = p(gm)
    assert res.modified is False
    (skip,) = p.report.skips
    assert "mm" in skip.where and "2 users" in skip.reason


# --- every epilogue op, in one chain and separately -------------------------


def test_long_chain_scale_bias_act_residual_cast():
    def f(x, w, s, b, r):
        y = torch.mm(x, w) * 0.5
        y = y * s
        y = torch.tanh(y + b)
        return (y + r).to(torch.float16)

    args = (torch.randn(4, 8), torch.randn(8, 16), torch.randn(16), torch.randn(1, 16), torch.randn(4, 16))
    gm = make_fx(f)(*args)
    out = nvgemm(gm)
    assert specs(out) == ["w=kn;scale:0.5;scale_col@0;bias@1;tanh;residual@2;cast:float16;out=float16"]
    (node,) = fused_nodes(out)
    assert [a.name for a in node.args[2]] == ["s_1", "b_1", "r_1"]
    assert len([n for n in out.graph.nodes if n.op == "call_function"]) == 1
    torch.testing.assert_close(out(*args), gm(*args), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize(
    "act, name",
    [
        (torch.relu, "relu"),
        (lambda y: F.gelu(y), "gelu_erf"),
        (lambda y: F.gelu(y, approximate="tanh"), "gelu_tanh"),
        (F.silu, "silu"),
        (torch.sigmoid, "sigmoid"),
        (torch.tanh, "tanh"),
    ],
)
def test_each_activation(act, name):
    gm = make_fx(lambda x, w: act(x @ w))(torch.randn(4, 8), torch.randn(8, 16))
    assert [str(c.spec) for c in find_epilogue_chains(gm)] == [f"w=kn;{name};out=float32"]


def test_addmm_alpha_becomes_a_scale_and_matrix_input_a_residual():
    def f(r, x, w):
        return torch.relu(torch.addmm(r, x, w, alpha=2.0))

    gm = make_fx(f)(torch.randn(4, 16), torch.randn(4, 8), torch.randn(8, 16))
    assert specs(nvgemm(gm)) == ["w=kn;scale:2.0;residual@0;relu;out=float32"]


def test_widening_cast_continues_and_bf16_mm_promotes():
    def f(x, w, b):
        y = (x @ w).float()
        return F.gelu(y + b)

    gm = make_fx(f)(torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(16))
    assert specs(nvgemm(gm)) == ["w=kn;cast:float32;bias@0;gelu_erf;out=float32"]


def test_narrowing_cast_ends_the_chain():
    def f(x, w):
        return torch.relu((x @ w).to(torch.bfloat16))

    gm = make_fx(f)(torch.randn(4, 8), torch.randn(8, 16))
    (chain,) = find_epilogue_chains(gm)
    assert [op.name for op, _ in chain.steps] == ["cast"] and "narrowing cast" in chain.stop
    assert specs(nvgemm(gm)) == ["w=kn;cast:bfloat16;out=bfloat16"]


# --- decline reasons ----------------------------------------------------------


def _decline(f, *args):
    gm = make_fx(f)(*args)
    p = NvGemmPass()
    res = p(gm)
    return res, p.report


@pytest.mark.parametrize(
    "f, args, where, reason",
    [
        (lambda x, w, b: torch.relu(x @ w + b), (torch.randn(4, 8), torch.randn(8, 16), torch.randn(4, 1)),
         "add", "not a per-column vector"),
        (lambda x, w, r: torch.relu(x @ w + r), (torch.randn(4, 8), torch.randn(8, 16), torch.randn(1, 4, 16)),
         "add", "residual must have the output's shape"),
        (lambda x, w: (x @ w) + 1.0, (torch.randn(4, 8), torch.randn(8, 16)), "add", "Python scalar"),
        (lambda x, w, s: (x @ w) * s, (torch.randn(4, 8), torch.randn(8, 16), torch.tensor(2.0)),
         "mul", "0-d tensor"),
        (lambda x, w, b: torch.add(x @ w, b, alpha=2), (torch.randn(4, 8), torch.randn(8, 16), torch.randn(16)),
         "add", "alpha=2"),
    ],
    ids=["per-row", "broadcast-residual", "scalar-add", "0d-scale", "alpha"],
)
def test_near_misses_are_declined_with_reason(f, args, where, reason):
    res, report = _decline(f, *args)
    assert res.modified is False
    (skip,) = report.skips
    assert "nothing to fuse" in skip.reason and reason in skip.reason, skip.reason


def test_declines_dtype_and_rank_and_integer():
    res, report = _decline(lambda x, w: torch.relu(x @ w), torch.randint(0, 4, (4, 8)), torch.randint(0, 4, (8, 16)))
    assert res.modified is False and "torch.int64 is not fused" in report.skips[0].reason
    res, report = _decline(lambda x, w: torch.relu(torch.mm(x, w)), torch.randn(4, 8, dtype=torch.float64),
                           torch.randn(8, 16, dtype=torch.float64))
    assert "float64 is not fused" in report.skips[0].reason


def test_linear_bias_only_is_declined():
    ep = torch.export.export(nn.Linear(8, 16), (torch.randn(4, 8),))
    p = NvGemmPass()
    p(ep.graph_module)
    assert p.report.stats["fused"] == 0
    assert "its addmm or linear already applies" in p.report.skips[0].reason


def test_graph_without_metadata_is_declined_not_guessed():
    gm = torch.fx.symbolic_trace(lambda x, w: torch.ops.aten.relu.default(torch.ops.aten.mm.default(x, w)))
    p = NvGemmPass()
    assert p(gm).modified is False
    assert "no tensor metadata" in p.report.skips[0].reason


def test_residual_from_another_matmul_is_claimed_once():
    def f(x, w1, w2):
        return torch.relu(x @ w1 + x @ w2)

    args = (torch.randn(4, 8), torch.randn(8, 16), torch.randn(8, 16))
    gm = make_fx(f)(*args)
    out = nvgemm(gm)
    assert specs(out) == ["w=kn;residual@0;relu;out=float32"]
    (node,) = fused_nodes(out)
    assert node.args[2][0].target is aten.mm.default, "the other matmul feeds the residual, unfused"
    torch.testing.assert_close(out(*args), gm(*args), rtol=1e-5, atol=1e-5)


def test_registered_as_nvgemm_and_no_op_reports_unchanged():
    assert get_pass("nvgemm").name == "nvgemm"
    gm = make_fx(lambda x: x.sin())(torch.randn(3))
    p = NvGemmPass()
    assert p(gm).modified is False and p.report.skips == []


class MatmulModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 32))
        self.b = nn.Parameter(torch.randn(32))

    def forward(self, x):
        return torch.relu(x @ self.w + self.b) * 2.0, torch.sigmoid(torch.matmul(x, self.w)).half()


@pytest.mark.parametrize("shape", [(8, 16), (2, 4, 16)], ids=["2d", "3d"])
def test_exported_matmul_and_assert_metadata_nodes(shape):
    """torch.export keeps ``@`` as aten.matmul and puts _assert_tensor_metadata
    before a ``.to``: both must match, and the check goes with the chain."""
    x = torch.randn(shape)
    ep = torch.export.export(MatmulModule(), (x,))
    assert aten._assert_tensor_metadata.default in targets(ep)
    out = nvgemm(ep)
    assert specs(out) == ["w=kn;bias@0;relu;scale:2.0;out=float32", "w=kn;sigmoid;cast:float16;out=float16"]
    remaining = targets(out)
    assert aten.matmul.default not in remaining and aten._assert_tensor_metadata.default not in remaining
    for got, want in zip(out.module()(x), ep.module()(x)):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=2e-3)


def test_batched_matmul_is_declined():
    class Bmm(nn.Module):
        def forward(self, x, w):
            return torch.relu(torch.matmul(x, w))

    ep = torch.export.export(Bmm(), (torch.randn(2, 4, 8), torch.randn(2, 8, 16)))
    (chain,) = find_epilogue_chains(ep.graph_module)
    assert chain.root.target is aten.matmul.default
    assert not chain.fusable and "3-D right operand" in chain.reason


def test_find_epilogue_chains_marks_overlapping_claims():
    def f(x, w1, w2):
        return torch.relu(x @ w1 + x @ w2)

    gm = make_fx(f)(torch.randn(4, 8), torch.randn(8, 16), torch.randn(8, 16))
    first, second = find_epilogue_chains(gm)
    assert first.fusable and not second.fusable
    assert "overlaps the chain of 'mm'" in second.reason


def test_division_by_a_scalar_is_a_scale_and_other_divisions_are_not():
    args = (torch.randn(4, 8), torch.randn(8, 16))
    gm = make_fx(lambda x, w: torch.tanh((x @ w) / 4.0))(*args)
    out = nvgemm(gm)
    assert specs(out) == ["w=kn;scale:0.25;tanh;out=float32"]
    torch.testing.assert_close(out(*args), gm(*args))
    class RDiv(nn.Module):
        def forward(self, x, w):
            return torch.tanh(torch.div(torch.full_like(x @ w, 2.0), x @ w))

    ep = torch.export.export(RDiv(), args)
    reasons = " ".join(c.reason or "" for c in find_epilogue_chains(ep.graph_module))
    assert "the chain value is the divisor" in reasons
    gm = make_fx(lambda x, w: torch.div(x @ w, 3.0, rounding_mode="floor"))(*args)
    (chain,) = find_epilogue_chains(gm)
    assert not chain.fusable


def test_dynamic_batch_3d_decomposed_chain_matches_without_guards():
    x = torch.randn(4, 8, 32)
    dims = ({0: torch.export.Dim("b", min=2, max=64), 1: torch.export.Dim("s", min=2, max=512)},)
    ep = torch.export.export(GPT2MLP(), (x,), dynamic_shapes=dims).run_decompositions()
    out = nvgemm(ep)
    assert specs(out) == ["w=kn;bias@0;gelu_tanh;out=float32", "w=kn;bias@0;residual@1;out=float32"]
    for shape in [(2, 3, 32), (5, 17, 32)]:
        xs = torch.randn(shape)
        torch.testing.assert_close(out.module()(xs), ep.module()(xs), rtol=1e-5, atol=1e-5)


class CondMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 64)

    def forward(self, x, flag):
        return torch.cond(
            flag,
            lambda t: F.gelu(self.fc(t)),
            lambda t: torch.sigmoid(self.fc(t) * 0.5),
            (x,),
        )


def test_chains_inside_cond_branches_are_fused():
    x = torch.randn(4, 32)
    ep = torch.export.export(CondMLP(), (x, torch.tensor(True)))
    p = NvGemmPass()
    out = apply(ep, p)
    assert sorted(p.report.stats["specs"]) == ["w=nk;bias@0;gelu_erf;out=float32",
                                              "w=nk;bias@0;scale:0.5;sigmoid;out=float32"]
    subgraphs = [m for m in out.graph_module.modules() if isinstance(m, torch.fx.GraphModule)][1:]
    assert sum(1 for g in subgraphs for n in g.graph.nodes if n.target is FUSED) == 2
    for flag in (True, False):
        torch.testing.assert_close(out.module()(x, torch.tensor(flag)), ep.module()(x, torch.tensor(flag)),
                                   rtol=1e-5, atol=1e-5)


def test_find_epilogue_chains_recursive_sees_cond_branches():
    ep = torch.export.export(CondMLP(), (torch.randn(4, 32), torch.tensor(True)))
    assert find_epilogue_chains(ep.graph_module) == []
    chains = find_epilogue_chains(ep.graph_module, recursive=True)
    assert sorted(str(c.spec) for c in chains) == ["w=nk;bias@0;gelu_erf;out=float32",
                                                   "w=nk;bias@0;scale:0.5;sigmoid;out=float32"]


# --- chains the fused op would compute differently -----------------------------


def _fused_against_program(module, args):
    ep = torch.export.export(module, args)
    fused = nvgemm(ep)
    with torch.no_grad():
        want, got = ep.module()(*[a.clone() for a in args]), fused.module()(*[a.clone() for a in args])
    return fused, want, got


class _Epilogue(nn.Module):
    def __init__(self, f, k=32, n=64):
        super().__init__()
        self.w = nn.Parameter(torch.randn(k, n))
        self.f = f

    def forward(self, x, *more):
        return self.f(x @ self.w, *more)


@pytest.mark.parametrize("f, extra", [
    (lambda y, b: torch.relu(y) + b, (1, 1, 64)),
    (lambda y, b: torch.relu(y) * b, (1, 1, 64)),
    (lambda y, b: y + b, (1, 1, 1, 64)),
], ids=["bias", "scale_col", "rank-4"])
def test_a_per_column_operand_of_higher_rank_than_the_output_is_declined(f, extra):
    """[1, 1, N] on an [M, N] product broadcasts the result to [1, M, N]: not a bias."""
    fused, want, got = _fused_against_program(_Epilogue(f), (torch.randn(8, 32), torch.randn(*extra)))
    assert got.shape == want.shape == (*[1] * (len(extra) - 2), 8, 64)
    torch.testing.assert_close(got, want)
    assert all("bias" not in s and "scale_col" not in s for s in specs(fused)), specs(fused)
    (chain,) = find_epilogue_chains(torch.export.export(_Epilogue(f), (torch.randn(8, 32), torch.randn(*extra)))
                                    .graph_module)
    assert "for the output [8, 64]" in chain.stop, chain.stop


def test_an_operand_that_promotes_the_chain_to_float64_ends_it():
    fused, want, got = _fused_against_program(_Epilogue(lambda y, b: torch.relu(y + b)),
                                              (torch.randn(8, 32), torch.randn(64, dtype=torch.float64)))
    assert got.dtype == want.dtype == torch.float64
    torch.testing.assert_close(got, want)
    assert specs(fused) == []
    gm = torch.export.export(_Epilogue(lambda y, b: torch.relu(y + b)),
                             (torch.randn(8, 32), torch.randn(64, dtype=torch.float64))).graph_module
    (chain,) = find_epilogue_chains(gm)
    assert "makes torch.float64" in chain.reason, chain.reason
    assert chain.stop_node is not None and chain.stop_node.target is aten.add.Tensor


@pytest.mark.parametrize("c", [1e-39, 1e39, 3e-45])
def test_a_division_whose_reciprocal_leaves_float32_is_not_a_scale(c):
    fused, want, got = _fused_against_program(_Epilogue(lambda y: torch.relu(y) / c), (torch.randn(8, 32),))
    torch.testing.assert_close(got, want, equal_nan=True)
    assert got.isnan().sum() == want.isnan().sum()
    assert all("scale:" not in s for s in specs(fused)), specs(fused)


def test_a_division_within_range_is_still_a_scale():
    fused, want, got = _fused_against_program(_Epilogue(lambda y: torch.relu(y) / 4.0), (torch.randn(8, 32),))
    torch.testing.assert_close(got, want)
    assert specs(fused) == ["w=kn;relu;scale:0.25;out=float32"], specs(fused)


class _WritesBetween(nn.Module):
    """``t = x @ w + r``, then ``which`` is written in place, then ``relu(t)``."""

    def __init__(self, which):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 16))
        self.which = which

    def forward(self, x, r):
        t = x @ self.w + r
        (r if self.which == "r" else x).mul_(10.0)
        return torch.relu(t), x, r


@pytest.mark.parametrize("which", ["r", "x"], ids=["residual", "input"])
@pytest.mark.parametrize("trace", ["export", "make_fx"])
def test_a_write_in_place_inside_the_chain_keeps_it_unfused(which, trace):
    """The fused op sits at the chain's end; an operand or input written before
    that would be read after its write."""
    args = (torch.randn(4, 8), torch.randn(4, 16))
    module = _WritesBetween(which)
    if trace == "export":
        fused, want, got = _fused_against_program(module, args)
        graph = fused.graph_module
    else:
        gm = make_fx(module)(*[a.clone() for a in args])
        want = gm(*[a.clone() for a in args])
        res = NvGemmPass()(gm)
        got, graph = res.graph_module(*[a.clone() for a in args]), res.graph_module
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert fused_nodes(graph) == []
    (chain,) = find_epilogue_chains(graph)
    assert "writes in place between the matmul and the chain's end" in chain.reason, chain.reason


def test_a_write_in_place_before_or_after_the_chain_does_not_stop_it():
    def f(x, w, r):
        r.add_(1.0)
        y = torch.relu(x @ w + r)
        x.mul_(2.0)
        return y
    args = (torch.randn(4, 8), torch.randn(8, 16), torch.randn(4, 16))
    gm = make_fx(f)(*[a.clone() for a in args])
    want = gm(*[a.clone() for a in args])
    res = NvGemmPass()(gm)
    assert len(fused_nodes(res.graph_module)) == 1
    torch.testing.assert_close(res.graph_module(*[a.clone() for a in args]), want)


def test_a_write_between_a_gated_chains_two_matmuls_keeps_it_unfused():
    """up(x) before gate(x): the fused op reads x for both at the chain's end."""
    def f(x, wg, wu):
        up = x @ wu.t()
        x.view(-1).mul_(2.0)
        return F.silu(x @ wg.t()) * up
    args = (torch.randn(4, 8), torch.randn(16, 8), torch.randn(16, 8))
    gm = make_fx(f)(*[a.clone() for a in args])
    want = gm(*[a.clone() for a in args])
    res = NvGemmPass()(gm)
    torch.testing.assert_close(res.graph_module(*[a.clone() for a in args]), want)
    assert not any("mul_mm" in n.args[3] for n in fused_nodes(res.graph_module))


def test_first_write_within_sees_only_the_window():
    from branchyard.lowering.nvgemm.matcher import first_write_within

    def f(x, w, r):
        r.add_(1.0)
        y = x @ w
        x.mul_(2.0)
        z = torch.relu(y)
        r.mul_(3.0)
        return z + r
    gm = make_fx(f)(torch.randn(4, 8), torch.randn(8, 16), torch.randn(4, 16))
    nodes = {n.name: n for n in gm.graph.nodes}
    assert first_write_within(nodes["relu"], [nodes["mm"], nodes["relu"]]) is nodes["mul_"]
    assert first_write_within(nodes["relu"], [nodes["mm"]]) is nodes["mul_"]
    assert first_write_within(nodes["mul_"], [nodes["mm"]]) is None
    assert first_write_within(nodes["mm"], [nodes["mm"]]) is None
    assert first_write_within(nodes["add"], [nodes["relu"]]) is nodes["mul__1"]
