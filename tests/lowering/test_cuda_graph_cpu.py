"""CPU tests of the CUDA-graph lowering: analysis, validation errors, eager fallback.

The capture itself needs a GPU and is tested in tests/gpu/test_cuda_graph_*_gpu.py.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import random
import warnings

import pytest
import torch
from torch._higher_order_ops.while_loop import while_loop
from torch.fx import Graph, GraphModule

import branchyard.lowering
from branchyard._compat import HAS_SWITCH
from branchyard.errors import LoweringError, MalformedGraphError, UnsupportedGraphError
from branchyard.lowering.cuda_graph import (
    HANDLERS,
    CudaGraphFallbackWarning,
    analyze,
    cuda_graph,
    cuda_graph_backend,
    switch,
)
from branchyard.lowering.cuda_graph.handlers import handler_for

WHILE = torch.ops.higher_order.while_loop
COND = torch.ops.higher_order.cond


# --------------------------------------------------------------------------- program builders
def hand_built(n_inputs: int, subs: dict, build) -> GraphModule:
    """A GraphModule written node by node: ``build(g, inputs, attrs)`` returns the output value."""
    root = torch.nn.Module()
    for name, fn in subs.items():
        setattr(root, name, fn if isinstance(fn, torch.nn.Module) else torch.fx.symbolic_trace(fn))
    g = Graph()
    inputs = [g.placeholder(f"in{i}") for i in range(n_inputs)]
    attrs = {name: g.get_attr(name) for name in subs}
    g.output(build(g, inputs, attrs))
    return GraphModule(root, g)


def while_program(cond_fn, body_fn, n_carry: int, n_additional: int = 0) -> GraphModule:
    def build(g, ins, a):
        w = g.call_function(WHILE, (a["cond_fn"], a["body_fn"], tuple(ins[:n_carry]), tuple(ins[n_carry:])))
        return tuple(g.call_function(operator.getitem, (w, i)) for i in range(n_carry))

    return hand_built(n_carry + n_additional, {"cond_fn": cond_fn, "body_fn": body_fn}, build)


def cond_program(true_fn, false_fn, pred_fn) -> GraphModule:
    def build(g, ins, a):
        pred = g.call_function(pred_fn, (ins[0],))
        c = g.call_function(COND, (pred, a["true_fn"], a["false_fn"], (ins[0],)))
        return (g.call_function(operator.getitem, (c, 0)),)

    return hand_built(1, {"true_fn": true_fn, "false_fn": false_fn}, build)


class Countdown(torch.nn.Module):
    """while i < n: i += 1; x = lerp(x, c, 0.5) -- the benchmark's loop."""

    def forward(self, x, c, n):
        return while_loop(lambda i, y: i < n, lambda i, y: (i + 1, torch.lerp(y, c, 0.5)), (torch.zeros((), dtype=torch.int64), x))


class CountdownWithCond(torch.nn.Module):
    """while i < n: x = cond(sum(x) > 0, 2x, x - 1); i += 1."""

    def forward(self, x, n):
        def cond_fn(i, y):
            return i < n

        def body_fn(i, y):
            return i + 1, torch.cond(y.sum() > 0, lambda t: t * 2, lambda t: t - 1, (y,))

        return while_loop(cond_fn, body_fn, (torch.zeros((), dtype=torch.int64), x))


class LoopInBranch(torch.nn.Module):
    """cond(x.sum() > 0, while-doubling until > limit, identity)."""

    def forward(self, x, limit):
        def grow(t):
            return while_loop(lambda y: y.sum() < limit, lambda y: (y * 2,), (t,))[0]

        return torch.cond(x.sum() > 0, grow, lambda t: t.clone(), (x,))


def eager_countdown(x, n):
    i, y = 0, x.clone()
    while i < int(n):
        y = y * 2 if y.sum() > 0 else y - 1
        i += 1
    return torch.tensor(i), y


# --------------------------------------------------------------------------- the handler table
def test_handler_table_covers_the_three_operators():
    assert set(HANDLERS) == {"while_loop", "cond", "switch"}
    assert handler_for(WHILE) is HANDLERS["while_loop"]
    assert handler_for(COND) is HANDLERS["cond"]
    assert handler_for(switch) is HANDLERS["switch"]
    assert handler_for(torch.ops.aten.add.Tensor) is None
    assert handler_for(operator.getitem) is None
    if HAS_SWITCH:
        assert handler_for(torch.ops.higher_order.switch) is HANDLERS["switch"]


def test_switch_reference_clamps_like_the_operator():
    branches = [lambda x: x + 1, lambda x: x * 10, lambda x: -x]
    x = torch.tensor(3)
    assert [switch(torch.tensor(i), branches, (x,))[0].item() for i in (-5, 0, 1, 2, 9)] == [4, 4, 30, -3, -3]
    assert switch(1, branches, (x,))[0].item() == 30
    with pytest.raises(MalformedGraphError, match="at least one branch"):
        switch(0, [], (x,))


# --------------------------------------------------------------------------- analysis
def test_analyze_reports_nested_sites_and_depth():
    args = (torch.randn(4), torch.tensor(3))
    report = analyze(torch.export.export(CountdownWithCond(), args), args)
    assert report.counts == {"while_loop": 1, "cond": 1}
    assert report.max_depth == 2
    [outer] = [s for s in report.sites if s.kind == "while_loop"]
    [inner] = [s for s in report.sites if s.kind == "cond"]
    assert (outer.depth, inner.depth) == (0, 1)
    assert "body_fn" in inner.where and "node 'cond'" in inner.where
    assert report.conditional_nodes(if_else_one_node=True) == {"WHILE": 1, "IF": 1}
    assert report.conditional_nodes(if_else_one_node=False) == {"WHILE": 1, "IF": 2}


def test_analyze_finds_a_loop_inside_a_branch():
    args = (torch.ones(3), torch.tensor(100.0))
    report = analyze(torch.export.export(LoopInBranch(), args), args)
    assert [(s.kind, s.depth) for s in report.sites] == [("cond", 0), ("while_loop", 1)]


def test_analyze_of_a_program_without_control_flow_is_empty():
    gm = torch.fx.symbolic_trace(lambda x: x.sin() + 1)
    report = analyze(gm, (torch.ones(2),))
    assert report.sites == [] and report.max_depth == 0 and report.conditional_nodes() == {}


@pytest.mark.skipif(not HAS_SWITCH, reason="torch.ops.higher_order.switch needs torch >= 2.14")
def test_analyze_switch_inside_while_from_export():
    from torch._higher_order_ops.switch import switch as torch_switch

    class SwitchLoop(torch.nn.Module):
        def forward(self, x, ks):
            def body_fn(i, y):
                y2 = torch_switch((i + ks[0]) % 3, [lambda t: t + 1, lambda t: t * 3, lambda t: t.sin()], (y,))
                return i + 1, y2

            return while_loop(lambda i, y: i < ks.shape[0], body_fn, (torch.zeros((), dtype=torch.int64), x))

    args = (torch.randn(4), torch.tensor([0, 2, 1, 7]))
    report = analyze(torch.export.export(SwitchLoop(), args), args)
    assert report.counts == {"while_loop": 1, "switch": 1}
    assert report.conditional_nodes() == {"WHILE": 1, "SWITCH": 1}


def test_analyze_hand_built_switch_reference_three_deep():
    """while > cond > switch, built with the plain-Python switch (what torch 2.11 tests use)."""
    branches = {f"b{k}": (lambda k: lambda t: t + k)(k) for k in range(3)}

    def inner_build(g, ins, a):
        s = g.call_function(switch, (ins[1], [a[f"b{k}"] for k in range(3)], (ins[0],)))
        return (g.call_function(operator.getitem, (s, 0)),)

    switch_gm = hand_built(2, branches, inner_build)

    def body_build(g, ins, a):
        i, y, k = ins
        pred = g.call_function(torch.gt, (g.call_function(torch.sum, (y,)), 0))
        c = g.call_function(COND, (pred, a["sw"], a["sw"], (y, k)))
        return (g.call_function(torch.add, (i, 1)), g.call_function(operator.getitem, (c, 0)))

    body = hand_built(3, {"sw": switch_gm}, body_build)
    gm = while_program(lambda i, y, k: i < 3, body, n_carry=2, n_additional=1)
    args = (torch.tensor(0), torch.ones(2), torch.tensor(1))
    report = analyze(gm, args)
    assert [(s.kind, s.depth) for s in report.sites] == [("while_loop", 0), ("cond", 1), ("switch", 2), ("switch", 2)]


# --------------------------------------------------------------------------- validation errors
def test_predicate_must_be_bool():
    gm = cond_program(lambda t: t + 1, lambda t: t - 1, torch.sum)
    with pytest.raises(LoweringError, match=r"cond predicate must be a 0-d bool tensor.*torch.float32 tensor of shape \(\)"):
        analyze(gm, (torch.ones(3),))


def test_predicate_must_be_zero_dimensional():
    gm = cond_program(lambda t: t + 1, lambda t: t - 1, lambda t: t[:1] > 0)
    with pytest.raises(LoweringError, match=r"0-d bool tensor.*shape \(1,\)"):
        analyze(gm, (torch.ones(3),))


def test_while_predicate_that_is_a_python_bool_is_rejected():
    gm = while_program(lambda i: True, lambda i: (i + 1,), n_carry=1)
    with pytest.raises(LoweringError, match=r"while_loop cond_fn's result must be a 0-d bool tensor.*a bool \(True\)"):
        analyze(gm, (torch.tensor(0),))


def test_non_tensor_loop_carry_is_rejected():
    gm = while_program(lambda i, y: y.sum() < 10, lambda i, y: (i + 1, y * 2), n_carry=2)
    with pytest.raises(UnsupportedGraphError, match=r"loop carry 0 is a int \(0\).*carry a 0-d tensor"):
        analyze(gm, (0, torch.ones(2)))


def test_shape_changing_loop_carry_is_rejected():
    gm = while_program(lambda y: y.sum() < 10, lambda y: (torch.cat([y, y]),), n_carry=1)
    with pytest.raises(UnsupportedGraphError, match=r"loop carry 0 enters as .*shape \(2,\).*returns .*shape \(4,\)"):
        analyze(gm, (torch.ones(2),))


def test_dtype_changing_loop_carry_is_rejected():
    gm = while_program(lambda y: y.sum() < 10, lambda y: (y.double(),), n_carry=1)
    with pytest.raises(UnsupportedGraphError, match="float64"):
        analyze(gm, (torch.ones(2),))


def test_rng_inside_a_body_is_rejected_and_outside_is_fine():
    gm = while_program(lambda y: y.sum() < 10, lambda y: (y + torch.rand_like(y),), n_carry=1)
    with pytest.raises(UnsupportedGraphError, match=r"body_fn > node 'rand_like': random op rand_like inside a loop body"):
        analyze(gm, (torch.ones(2),))
    outside = torch.fx.symbolic_trace(lambda y: y + torch.rand_like(y))
    assert analyze(outside, (torch.ones(2),)).sites == []


def test_rng_in_an_exported_branch_is_rejected():
    class Noisy(torch.nn.Module):
        def forward(self, x):
            return torch.cond(x.sum() > 0, lambda t: t + torch.randn_like(t), lambda t: t - 1, (x,))

    x = torch.ones(3)
    with pytest.raises(UnsupportedGraphError, match=r"true_fn > node 'randn_like': random op randn_like"):
        analyze(torch.export.export(Noisy(), (x,)), (x,))


class _AttentionBranch(torch.nn.Module):
    """A transformer's branch as real models write it: nn.Dropout layers and attention."""

    def __init__(self, p: float = 0.1, attn_p: float = 0.0):
        super().__init__()
        self.drop, self.attn_p = torch.nn.Dropout(p), attn_p

    def forward(self, x):
        def attend(t):
            q = t[None, None]
            return self.drop(torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=self.attn_p)[0, 0])

        return torch.cond(x.sum() > 0, attend, lambda t: self.drop(t) * 2, (x,))


def test_eval_mode_dropout_and_attention_without_dropout_in_a_branch_are_not_random():
    x = torch.randn(4, 8)
    model = _AttentionBranch().eval()  # aten.dropout(t, 0.1, False); sdpa with dropout_p=0.0
    ep = torch.export.export(model, (x,))
    assert [s.kind for s in analyze(ep, (x,)).sites] == ["cond"]
    torch.testing.assert_close(ep.module()(x), model(x))
    train = torch.export.export(_AttentionBranch().train(), (x,))  # dropout draws numbers
    with pytest.raises(UnsupportedGraphError, match=r"node 'dropout': random op dropout.default"):
        analyze(train, (x,))
    attn_dropout = torch.export.export(_AttentionBranch(p=0.0, attn_p=0.2).eval(), (x,))
    with pytest.raises(UnsupportedGraphError, match=r"random op scaled_dot_product_attention.default"):
        analyze(attn_dropout, (x,))


def test_which_arguments_turn_a_random_op_off():
    from branchyard.lowering.cuda_graph.capture import _draws_nothing

    aten, t = torch.ops.aten, torch.ones(2)
    assert _draws_nothing(aten.dropout.default, (t, 0.5, False), {})
    assert _draws_nothing(aten.dropout.default, (t, 0, True), {})  # p = 0 as an int
    assert not _draws_nothing(aten.dropout.default, (t, 0.5, True), {})
    assert _draws_nothing(aten.scaled_dot_product_attention.default, (t, t, t), {})  # dropout_p defaults to 0
    assert not _draws_nothing(aten.scaled_dot_product_attention.default, (t, t, t), {"dropout_p": 0.1})
    assert _draws_nothing(torch.nn.functional.dropout, (t,), {"training": False})
    assert not _draws_nothing(torch.nn.functional.dropout, (t,), {})  # training=True, p=0.5 by default
    assert not _draws_nothing(aten.rand_like.default, (t,), {})
    assert _draws_nothing(torch.dropout, (t, 0.5, False), {})  # a torch builtin binds by its ATen schema
    assert not _draws_nothing(torch.dropout, (t, 0.5, True), {})


def test_tensors_off_the_device_are_rejected():
    args = (torch.randn(4), torch.tensor(3))
    ep = torch.export.export(CountdownWithCond(), args)
    with pytest.raises(LoweringError, match=r"placeholder 'x'.*input 0 is on cpu.*lowered for cuda"):
        analyze(ep, args, device="cuda")
    # A constant of the program that lives elsewhere is named by node.
    gm = torch.fx.symbolic_trace(lambda x: x + torch.zeros(2, device="meta"))
    with pytest.raises(LoweringError, match=r"node '_tensor_constant0': produces a tensor on meta"):
        analyze(gm, (torch.ones(2),), device="cpu")


def test_host_reads_inside_a_body_are_rejected():
    gm = while_program(lambda y: y.sum() < 10, lambda y: (y * y.sum().item(),), n_carry=1)
    with pytest.raises(LoweringError, match=r"body_fn > node 'item': cannot be lowered: DataDependentOutputException.*no \.item\(\)"):
        analyze(gm, (torch.ones(2),))


def test_branches_that_disagree_are_rejected():
    gm = cond_program(lambda t: t + 1, lambda t: t[:1], lambda t: t.sum() > 0)
    with pytest.raises(MalformedGraphError, match=r"false_fn returns .*shape \(1,\).* but true_fn returns .*shape \(3,\)"):
        analyze(gm, (torch.ones(3),))


def test_bad_options_are_rejected():
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    with pytest.raises(LoweringError, match="max_iterations must be a non-negative int"):
        cuda_graph(gm, (torch.ones(1),), max_iterations=-1)
    with pytest.raises(LoweringError, match="if_else must be"):
        cuda_graph(gm, (torch.ones(1),), if_else="three_nodes")
    with pytest.raises(LoweringError, match="expected a torch.export.ExportedProgram or torch.fx.GraphModule"):
        cuda_graph(lambda x: x, (torch.ones(1),))


# --------------------------------------------------------------------------- eager fallback
@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback is what CPU-only machines get")
def test_falls_back_to_eager_without_cuda_and_warns_once():
    from branchyard.lowering.cuda_graph import capture

    capture._WARNED.clear()
    args = (torch.randn(4), torch.tensor(3))
    ep = torch.export.export(CountdownWithCond(), args)
    with pytest.warns(CudaGraphFallbackWarning, match="no CUDA device"):
        m = branchyard.lowering.cuda_graph(ep, args)
    assert not m.lowered and "no CUDA device" in m.fallback_reason
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same reason does not warn twice
        m2 = cuda_graph(ep, args)
    for x, n in [(torch.randn(4), torch.tensor(0)), (-torch.ones(4), torch.tensor(5)), (torch.rand(4), torch.tensor(3))]:
        i, y = m2(x, n)
        ref_i, ref_y = eager_countdown(x, n)
        assert i.item() == ref_i.item()
        torch.testing.assert_close(y, ref_y)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback is what CPU-only machines get")
def test_validation_errors_come_before_the_fallback():
    gm = while_program(lambda y: y.sum() < 10, lambda y: (torch.cat([y, y]),), n_carry=1)
    with pytest.raises(UnsupportedGraphError, match="loop carry 0"):
        cuda_graph(gm, (torch.ones(2),))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback is what CPU-only machines get")
def test_torch_compile_backend_falls_back_with_correct_results():
    @torch.compile(backend=cuda_graph_backend, fullgraph=True)
    def f(x, n):
        def cond_fn(i, y):
            return i < n

        def body_fn(i, y):
            return i + 1, torch.cond(y.sum() > 0, lambda t: t * 2, lambda t: t - 1, (y,))

        return while_loop(cond_fn, body_fn, (torch.zeros((), dtype=torch.int64), x))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CudaGraphFallbackWarning)
        for x, n in [(torch.randn(4), torch.tensor(4)), (-torch.ones(4), torch.tensor(2))]:
            i, y = f(x, n)
            ref_i, ref_y = eager_countdown(x, n)
            assert i.item() == ref_i.item()
            torch.testing.assert_close(y, ref_y)


# --------------------------------------------------------------------------- NVRTC (no GPU needed)
def test_set_kernels_compile_with_nvrtc():
    from branchyard.lowering.cuda_graph.conditional_nodes import SET_KERNEL_NAMES, compile_set_kernels, cuda_bindings_available

    reason = cuda_bindings_available()
    if reason:
        pytest.skip(reason)
    try:
        cubin = compile_set_kernels("sm_90")
    except (RuntimeError, OSError) as exc:  # no NVRTC shared library on this machine
        if "NVRTC could not compile" in str(exc):
            raise
        pytest.skip(f"NVRTC unavailable: {exc}")
    assert cubin[:4] == b"\x7fELF"
    for name in SET_KERNEL_NAMES:
        assert name.encode() in cubin


# --------------------------------------------------------------------------- hand-built programs (torch 2.11 path)
def test_switch_in_while_from_fx_builders_analyzes_and_runs():
    from branchyard.lowering.cuda_graph.fx_builders import switch_module, trace, while_loop_module

    class Body(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sw = switch_module([(lambda k: lambda x: x * (k + 1) + k)(k) for k in range(8)], num_operands=1)

        def forward(self, i, x, ks):
            return i + 1, self.sw(torch.index_select(ks, 0, i.view(1)), x)[0]

    program = while_loop_module(lambda i, x, ks: i < ks.shape[0], trace(Body()), num_carried=2, num_additional=1)
    ks = torch.tensor([0, 7, 3, -4, 12, 5])  # -4 and 12 clamp to 0 and 7
    args = (torch.tensor(0), torch.ones(3), ks)
    report = analyze(program, args)
    assert report.counts == {"while_loop": 1, "switch": 1}
    assert report.sites[1].depth == 1 and "module 'sw'" in report.sites[1].where
    x = torch.ones(3)
    for k in ks.clamp(0, 7).tolist():
        x = x * (k + 1) + k
    i, y = program(*args)
    assert i.item() == 6
    torch.testing.assert_close(y, x)


# --------------------------------------------------------------------------- patterns (node savings)
from branchyard.lowering.cuda_graph.patterns import COMPARE_CODES, match_comparison, out_form  # noqa: E402

aten = torch.ops.aten


@pytest.mark.parametrize("name", sorted(COMPARE_CODES))
def test_every_spelling_of_a_comparison_is_matched(name):
    i, n = torch.tensor(3), torch.tensor(5)
    for target, args in [
        (getattr(operator, name), (i, n)),
        (getattr(torch, name), (i, n)),
        (getattr(aten, name).Tensor, (i, n)),
        (getattr(aten, name).Scalar, (i, 5)),
    ]:
        cmp = match_comparison(target, args, {}, require_cuda=False)
        assert cmp is not None and cmp.op == name, target
        assert torch.equal(cmp.evaluate(), target(*args))


def test_a_number_on_the_left_is_mirrored():
    i = torch.tensor(3)
    for name, mirrored in [("lt", "gt"), ("le", "ge"), ("gt", "lt"), ("ge", "le"), ("eq", "eq"), ("ne", "ne")]:
        cmp = match_comparison(getattr(operator, name), (4, i), {}, require_cuda=False)
        assert cmp.op == mirrored and cmp.lhs is i and cmp.rhs == 4
        assert cmp.evaluate().item() == getattr(operator, name)(4, 3)


@pytest.mark.parametrize(
    "args, why",
    [
        ((torch.tensor(3), torch.tensor(3.0)), "mixed dtypes: torch promotes"),
        ((torch.tensor([3]), 1), "not 0-d"),
        ((torch.tensor(3), 2.5), "an int tensor against a float: torch compares in float32"),
        ((torch.tensor(3, dtype=torch.int32), 2**40), "the number does not fit int32"),
        ((torch.tensor(True), True), "bool operands"),
        ((torch.tensor(3.0, dtype=torch.float16), 1.0), "float16 has no kernel code"),
        ((1, 2), "no tensor"),
    ],
)
def test_comparisons_the_set_kernel_cannot_do_exactly_stay_torch_kernels(args, why):
    assert match_comparison(operator.lt, args, {}, require_cuda=False) is None, why


def test_comparisons_on_the_host_are_not_matched_for_the_device():
    assert match_comparison(operator.lt, (torch.tensor(1), 2), {}) is None  # CPU tensor: the kernel can't read it
    assert match_comparison(operator.add, (torch.tensor(1), 2), {}, require_cuda=False) is None


def test_out_forms_of_aten_ops_python_operators_and_torch_functions():
    assert out_form(aten.add.Tensor, (torch.ones(2), torch.ones(2))) is aten.add.out
    assert out_form(aten.lerp.Scalar, (torch.ones(2), torch.ones(2), 0.5)) is aten.lerp.Scalar_out
    assert out_form(aten.mul.Scalar, (torch.ones(2), 2.0)) is aten.mul.Scalar_out
    assert out_form(operator.mul, (torch.ones(2), 2.0)) is torch.mul
    assert out_form(operator.add, (2.0, torch.ones(2))) is None  # torch.add(2.0, x, out=...) is not valid
    for no_out in (aten.t.default, aten.view.default, aten.add_.Tensor, aten.max.dim):
        assert out_form(no_out, (torch.ones(2, 2),)) is None, no_out
    assert out_form(print, (torch.ones(2),)) is None


@pytest.mark.parametrize(
    "target, args",
    [
        (aten.add.Tensor, (torch.randn(5), torch.randn(5))),
        (aten.lerp.Scalar, (torch.randn(5), torch.randn(5), 0.3)),
        (operator.mul, (torch.randn(5), 0.7)),
        (operator.truediv, (torch.arange(5), 3)),  # int / int -> float, like the functional op
        (operator.sub, (torch.randn(5), torch.randn(1))),  # broadcast
        (torch.where, (torch.tensor([True, False, True]), torch.randn(3), torch.randn(3))),
    ],
)
def test_out_forms_compute_exactly_what_the_op_computes(target, args):
    want = target(*args)
    buf = torch.empty_like(want)
    out_form(target, args)(*args, out=buf)
    assert torch.equal(buf, want)


# --------------------------------------------------------------------------- max_iterations without CUDA
class Forever(torch.nn.Module):
    def forward(self, x, n):
        return while_loop(lambda y: y.sum() > n, lambda y: (y + 1.0,), (x,))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback is what CPU-only machines get")
def test_eager_fallback_stops_loops_at_max_iterations():
    x = torch.ones(4)
    ep = torch.export.export(Forever(), (x, torch.tensor(0.0)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CudaGraphFallbackWarning)
        m = cuda_graph(ep, (x, torch.tensor(0.0)), max_iterations=50)
    assert not m.lowered
    (y,) = m(x, torch.tensor(0.0))
    assert torch.equal(y, x + 50) and m.iterations_exhausted()
    (y,) = m(x, torch.tensor(100.0))  # never enters the loop
    assert torch.equal(y, x) and not m.iterations_exhausted()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CudaGraphFallbackWarning)
        unlimited = cuda_graph(ep, (x, torch.tensor(0.0)))
    assert torch.equal(unlimited(x, torch.tensor(100.0))[0], x)  # without the option: the module's own forward


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback is what CPU-only machines get")
def test_eager_fallback_limits_loops_inside_branches_and_switches():
    from branchyard.lowering.cuda_graph.fx_builders import switch_module, trace, while_loop_module

    doubling = while_loop_module(lambda y: y.sum() > -1.0, lambda y: (y * 2,), num_carried=1)  # never ends on x > 0

    class Pick(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sw = switch_module([lambda y: y - 1.0, doubling], num_operands=1)

        def forward(self, k, y):
            return self.sw(k, y)

    program = trace(Pick())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CudaGraphFallbackWarning)
        m = cuda_graph(program, (torch.tensor(0), torch.ones(3)), max_iterations=7)
    (y,) = m(torch.tensor(5), torch.ones(3))  # 5 clamps to the looping branch
    assert torch.equal(y, torch.full((3,), 2.0**7)) and m.iterations_exhausted()
    (y,) = m(torch.tensor(-3), torch.ones(3))  # clamps to branch 0: no loop
    assert torch.equal(y, torch.zeros(3)) and not m.iterations_exhausted()
    ep_args = (torch.ones(4), torch.tensor(100.0))
    lb = torch.export.export(LoopInBranch(), ep_args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CudaGraphFallbackWarning)
        m = cuda_graph(lb, ep_args, max_iterations=3)
    y = m(*ep_args)  # sum 4 -> 8 -> 16 -> 32, stopped before 64 < 100 is reached
    assert torch.equal(y, torch.full((4,), 8.0)) and m.iterations_exhausted()
    y = m(torch.ones(4), torch.tensor(10.0))  # 4 -> 8 -> 16 ends by itself after 2 trips
    assert torch.equal(y, torch.full((4,), 4.0)) and not m.iterations_exhausted()


# --------------------------------------------------------------------------- what the capture emits (no GPU)
class RecordingBuilder:
    """Stands in for ConditionalBuilder: records each call per body, runs copies so values stay right."""

    def __init__(self):
        self.calls: dict[str, list[tuple]] = {"top": []}
        self.routers: list = []  # the IndexPrograms of set_router calls
        self.decisions: list = []  # what each set kernel reads at its node: a predicate's bool, an index
        self.set_handles: list = []  # the handle of each set_from_program call
        self.node_handles: list = []  # (kind, handle) of each conditional node
        self._handles = 0
        self._where = ["top"]

    def _log(self, *call):
        self.calls[self._where[-1]].append(call)

    def new_handle(self):
        self._handles += 1
        return self._handles  # numbered, so that two identical captures record equal calls

    def set_predicate(self, handles, pred, *, copies=(), counter=None, reset=False, increment=None, next_index=None):
        # the router of next_index reads no copy's destination: what it reads is the same before and after
        router = None if next_index is None else int(next_index[1].evaluate())
        for dst, src in copies:
            dst.copy_(src)
        if increment is not None:
            increment[0].add_(increment[1])
        by = None if increment is None else increment[1]
        self.decisions.append(bool(pred.evaluate() if hasattr(pred, "evaluate") else pred))
        call = ("step", getattr(pred, "op", "flag"), len(handles), len(copies), counter is not None, reset, by)
        if next_index is not None:  # the next trip's switch index, set by the same node
            _, program, n = next_index
            self.decisions.append(router)
            self.routers.append(program)
            r = program.source
            call += (("next_router", r.rows, tuple(r.w.shape), program.steps, n),)
        self._log(*call)

    def set_from_index(self, handle, index, n):
        self.decisions.append(int(index))
        self._log("set_index", n)

    def set_from_program(self, handle, program, n):
        from branchyard.lowering.cuda_graph.patterns import RouterLogits

        self.set_handles.append(handle)
        self.decisions.append(int(program.evaluate()))  # the kernel reads its sources here, at the switch
        if isinstance(program.source, RouterLogits):
            r = program.source
            self._log("set_router", r.rows, tuple(r.w.shape), program.steps, n)
            self.routers.append(program)
        else:
            self._log("set_program", program.argmax, program.steps, n)

    def set_onehot(self, handles, index, per_kernel=8):
        self.decisions.append(int(index))
        self._log("set_onehot", len(handles), per_kernel)

    def copy_many(self, pairs):
        for dst, src in pairs:
            dst.copy_(src)
        self._log("copy", len(pairs))

    def add_node(self, kind, handle, size):
        self.node_handles.append((kind.name, handle))
        self._log(kind.name, size)
        names = [f"{self._where[-1]}/{kind.name}{len(self.calls)}.{i}" for i in range(size)]
        for name in names:
            self.calls[name] = []
        return names

    @contextlib.contextmanager
    def capture_into(self, body):
        self._where.append(body)
        try:
            yield
        finally:
            self._where.pop()


def record_capture(monkeypatch, program, args, **options) -> dict[str, list[tuple]]:
    """Run the CAPTURE phase on CPU tensors with a RecordingBuilder; the calls, body by body."""
    from branchyard.lowering.cuda_graph import capture

    # the set kernel reads device memory; on CPU pretend it could
    monkeypatch.setattr(capture, "match_comparison", functools.partial(match_comparison, require_cuda=False))
    gm = capture._as_graph_module(program)
    ctx = capture.LoweringContext(
        capture.Phase.VALIDATE, None, max_iterations=options.get("max_iterations"), switch_as_ifs=options.get("switch", "node") != "node"
    )
    capture.validate(gm, list(args), ctx)
    ctx.phase, ctx.builder = capture.Phase.CAPTURE, RecordingBuilder()
    if ctx.max_iterations is not None:
        ctx.exhausted = torch.zeros((), dtype=torch.bool)
    out = capture.ControlFlowInterpreter(gm, ctx).run(*args)
    ctx.builder.calls["result"] = out
    ctx.builder.calls["routers"] = ctx.builder.routers
    ctx.builder.calls["decisions"] = ctx.builder.decisions
    ctx.builder.calls["set_handles"] = ctx.builder.set_handles
    ctx.builder.calls["node_handles"] = ctx.builder.node_handles
    return ctx.builder.calls


def test_a_loop_trip_ends_in_one_step_call_that_compares_and_copies(monkeypatch):
    args = (torch.randn(8), torch.randn(8), torch.tensor(5))
    ep = torch.export.export(Countdown(), args)
    calls = record_capture(monkeypatch, ep, args)
    # before the loop: the carries copied in, the predicate i < n evaluated by the set kernel itself
    assert calls["top"] == [("copy", 2), ("step", "lt", 1, 0, False, True, None), ("WHILE", 1)]
    # each trip: body ops, then ONE step: copy x back, i += 1 (the body's i + 1), compare with n, set
    (body,) = [k for k in calls if "WHILE" in k]
    assert calls[body] == [("step", "lt", 1, 1, False, False, 1)]
    i, y = calls["result"]
    assert i.item() == 1  # the body ran once during capture


def test_max_iterations_counts_in_the_step_kernel(monkeypatch):
    args = (torch.randn(8), torch.randn(8), torch.tensor(5))
    calls = record_capture(monkeypatch, torch.export.export(Countdown(), args), args, max_iterations=9)
    assert calls["top"][1] == ("step", "lt", 1, 0, True, True, None)  # resets the counter
    (body,) = [k for k in calls if "WHILE" in k]
    assert calls[body] == [("step", "lt", 1, 1, True, False, 1)]


def test_branch_outputs_are_written_in_place_and_predicates_compared_by_the_set_kernel(monkeypatch):
    args = (torch.randn(8), torch.tensor(5))
    calls = record_capture(monkeypatch, torch.export.export(CountdownWithCond(), args), args)
    (loop,) = [k for k in calls if k.count("/") == 1]
    # y.sum() > 0 feeds only the cond: no gt kernel, the set kernel compares the sum with 0
    assert calls[loop] == [("step", "gt", 1, 0, False, False, None), ("IF", 2), ("step", "lt", 1, 1, False, False, 1)]
    branches = [k for k in calls if k.count("/") == 2]
    assert len(branches) == 2 and all(calls[b] == [("copy", 0)] for b in branches)  # t * 2 / t - 1 wrote in place


def test_nested_conds_pass_their_output_buffers_down(monkeypatch):
    # switch_to_cond's tree for 4 branches: cond(k <= 1, cond(k <= 0, b0, b1), cond(k <= 2, b2, b3))
    def leaf(k):
        return torch.fx.symbolic_trace(lambda idx, x: (x * (k + 2),))

    def split(mid, left, right):
        def build(g, ins, a):
            pred = g.call_function(operator.le, (ins[0], mid))
            c = g.call_function(COND, (pred, a["true_fn"], a["false_fn"], (ins[0], ins[1])))
            return (g.call_function(operator.getitem, (c, 0)),)

        return hand_built(2, {"true_fn": left, "false_fn": right}, build)

    tree = split(1, split(0, leaf(0), leaf(1)), split(2, leaf(2), leaf(3)))
    for k in (-1, 0, 1, 2, 3, 9):
        calls = record_capture(monkeypatch, tree, (torch.tensor(k), torch.ones(3)))
        leaves = [k for k in calls if k.count("/") == 2]
        assert len(leaves) == 4 and all(calls[b] == [("copy", 0)] for b in leaves)  # no copy at any level
        inner = [k for k in calls if k.count("/") == 1]
        assert all(calls[b] == [("step", "le", 1, 0, False, False, None), ("IF", 2), ("copy", 0)] for b in inner)
        # capture runs every branch once: the outputs hold the last (else) branch's value
        assert torch.equal(calls["result"][0], torch.full((3,), 5.0))


def test_switch_index_is_read_as_is_and_if_chains_set_handles(monkeypatch):
    from branchyard.lowering.cuda_graph.fx_builders import switch_module

    sw = switch_module([lambda x: x + 1, lambda x: x * 3, lambda x: x - 2], num_operands=1)
    for index in (torch.tensor(1, dtype=torch.int32), torch.tensor([2])):
        calls = record_capture(monkeypatch, sw, (index, torch.ones(4)))
        assert calls["top"] == [("set_index", 3), ("SWITCH", 3)]
        assert all(calls[b] == [("copy", 0)] for b in calls if "SWITCH" in b)
    calls = record_capture(monkeypatch, sw, (torch.tensor(1), torch.ones(4)), switch="if_chain")
    assert calls["top"] == [("set_onehot", 3, 8), ("IF", 1), ("IF", 1), ("IF", 1)]


def _before(gm, node, build):
    """Insert ``build(graph)`` into ``gm`` just before ``node``; the last node it made."""
    with gm.graph.inserting_before(node):
        made = build(gm.graph)
    gm.recompile()
    return made


def _switch_indexed_by(index, **buffers):
    """A 3-way switch_module whose index is ``index(graph, x)``, made from its first input ``x``
    just before the switch (``buffers`` registered on the module, for ``get_attr``)."""
    from branchyard.lowering.cuda_graph.fx_builders import switch_module

    gm = switch_module([lambda x: x + 1, lambda x: x * 3, lambda x: x - 2], num_operands=1)
    for name, tensor in buffers.items():
        gm.register_buffer(name, tensor)
    sw = next(n for n in gm.graph.nodes if handler_for(n.target) is not None)
    x = sw.args[0]
    sw.args = (_before(gm, sw, lambda g: index(g, x)), *sw.args[1:])
    gm.recompile()
    return gm


def _routed_switch(steps, write=None):
    """A 3-way switch whose index is ``steps`` of its first input, with an optional
    in-place ``write`` of that input just before the switch."""

    def index(g, v):
        value = v
        for target, extra in steps:
            value = g.call_function(target, (value, *extra))
        if write is not None:
            g.call_method(write, (v, -1))
        return value

    return _switch_indexed_by(index)


ARGMAX_ROUTER = [(torch.ops.aten.argmax.default, ()), (torch.ops.aten.clamp.default, (-1, 1)),
                 (torch.ops.aten.remainder.Scalar, (3,))]


def test_a_router_index_is_one_set_program_call(monkeypatch):
    v = torch.tensor([0.5, 2.0, -1.0])
    calls = record_capture(monkeypatch, _routed_switch(ARGMAX_ROUTER), (v, torch.ones(4)))
    assert calls["top"] == [("set_program", True, (("max", -1), ("min", 1), ("mod", 3)), 3), ("SWITCH", 3)]


def test_a_router_index_written_in_place_before_the_switch_runs_as_torch_ops(monkeypatch):
    v = torch.tensor([0.5, 2.0, -1.0])
    calls = record_capture(monkeypatch, _routed_switch(ARGMAX_ROUTER, write="mul_"), (v, torch.ones(4)))
    assert calls["top"] == [("set_index", 3), ("SWITCH", 3)]  # argmax, clamp, remainder were torch ops


def test_index_steps_past_the_kernel_limit_are_materialised(monkeypatch):
    steps = [*ARGMAX_ROUTER, (torch.ops.aten.clamp.default, (0, 2)), (torch.ops.aten.clamp.default, (0, 1))]
    v = torch.tensor([0.5, 2.0, -1.0])
    calls = record_capture(monkeypatch, _routed_switch(steps), (v, torch.ones(4)))
    # five steps after the argmax: the first four run as torch ops (the program is evaluated),
    # and the last clamp starts a new program on their 0-d result
    assert calls["top"] == [("set_program", False, (("max", 0), ("min", 1)), 3), ("SWITCH", 3)]


def test_a_comparison_is_not_deferred_across_an_in_place_write(monkeypatch):
    from branchyard.lowering.cuda_graph.fx_builders import cond_module

    def program(write):
        gm = cond_module(lambda x: x + 1, lambda x: x - 1, num_operands=1)
        cond = next(n for n in gm.graph.nodes if n.target is COND)
        x = cond.args[3][0]

        def pred(g):
            gt = g.call_function(operator.gt, (g.call_method("sum", (x,)), 0))
            if write:
                g.call_method("mul_", (x, -1))
            return gt

        cond.args = (_before(gm, cond, pred), *cond.args[1:])
        gm.recompile()
        return gm

    args = (torch.tensor(True), torch.ones(4))
    assert record_capture(monkeypatch, program(False), args)["top"][0][:2] == ("step", "gt")
    assert record_capture(monkeypatch, program(True), args)["top"][0][:2] == ("step", "flag")


@pytest.mark.parametrize(
    "cond_fn, body_fn, fused",
    [
        (lambda i, y, n: i < n, lambda i, y, n: (i + 1, y * i), True),  # y * i reads the old i: still fine
        (lambda i, y, n: n > i, lambda i, y, n: (2 + i, y + 1), True),  # mirrored both ways
        (lambda i, y, n: i < n, lambda i, y, n: ((i + 1), y * (i + 1)), True),  # two separate adds: one is the carry
        (lambda i, y, n: (i < n) & (y.sum() < 100), lambda i, y, n: (i + 1, y + 1), False),  # i read by a kernel
        (lambda i, y, n: i * 2 < n, lambda i, y, n: (i + 1, y + 1), False),  # i read by a kernel
        (lambda i, y, n: i < n, lambda i, y, n: (i + 1.5, y + 1), False),  # not an integer step (carry check fails)
    ],
)
def test_a_counter_carry_is_incremented_by_the_step_kernel_only_when_nothing_else_needs_the_sum(
    monkeypatch, cond_fn, body_fn, fused
):
    program = while_program(cond_fn, body_fn, n_carry=2, n_additional=1)
    args = (torch.tensor(0), torch.ones(3), torch.tensor(4))
    try:
        calls = record_capture(monkeypatch, program, args)
    except UnsupportedGraphError:
        assert not fused  # i + 1.5 changes the carry's dtype: rejected before capture
        return
    (body,) = [k for k in calls if "WHILE" in k]
    step = calls[body][-1]
    assert step[0] == "step" and (step[-1] is not None) == fused, calls[body]
    i, y = calls["result"]  # the capture ran the body once: one trip's values either way
    want_i, want_y = body_fn(*args)
    assert torch.equal(i, want_i) and torch.equal(y, want_y)


def test_a_sum_used_twice_is_not_moved_into_the_step_kernel(monkeypatch):
    from torch.fx import symbolic_trace

    def body(i, y, n):
        j = i + 1
        return j, y * j

    program = while_program(lambda i, y, n: i < n, symbolic_trace(body), n_carry=2, n_additional=1)
    calls = record_capture(monkeypatch, program, (torch.tensor(0), torch.ones(3), torch.tensor(4)))
    (body_key,) = [k for k in calls if "WHILE" in k]
    assert calls[body_key] == [("step", "lt", 1, 2, False, False, None)]  # i and y copied, no increment


def _targets_in(gm: torch.nn.Module) -> dict[str, int]:
    """call_function targets, by name, across ``gm`` and every graph module inside it."""
    counts: dict[str, int] = {}
    for mod in gm.modules():
        if isinstance(mod, GraphModule):
            for n in mod.graph.nodes:
                if n.op == "call_function" and n.target is not operator.getitem:
                    name = str(getattr(n.target, "_name", None) or getattr(n.target, "__name__", n.target))
                    counts[name] = counts.get(name, 0) + 1
    return counts


@pytest.mark.skipif(not HAS_SWITCH, reason="switch_to_cond rewrites torch.ops.higher_order.switch (torch >= 2.14)")
def test_cond_tree_module_is_what_switch_to_cond_makes(monkeypatch):
    from torch._higher_order_ops.switch import switch as torch_switch

    from branchyard.lowering.cuda_graph.fx_builders import cond_tree_module
    from branchyard.passes.switch_to_cond import switch_to_cond

    branches = [(lambda k: lambda t: t * (0.5 + 0.125 * k) + k)(k) for k in range(8)]

    class S(torch.nn.Module):
        def forward(self, k, x):
            return torch_switch(k, branches, (x,))

    args = (torch.tensor(3), torch.randn(16))
    by_pass = switch_to_cond(torch.export.export(S(), args))
    by_hand = cond_tree_module(branches, num_operands=1)
    want = {"aten::clamp": 1, "aten::le.Scalar": 7, "cond": 7, "aten::mul.Tensor": 8, "aten::add.Tensor": 8}
    assert _targets_in(by_pass.graph_module) == want
    hand = _targets_in(by_hand)
    assert hand.pop("mul") == 8 and hand.pop("add") == 8  # the branches as traced (operator.mul / add)
    assert hand == {k: v for k, v in want.items() if k in ("aten::clamp", "aten::le.Scalar", "cond")}
    # and the lowering captures both the same way: clamp, then per level one set kernel and IF/ELSE
    recorded = [
        [calls for key, calls in record_capture(monkeypatch, program, args).items() if key != "result"]
        for program in (by_pass, by_hand)
    ]
    assert recorded[0] == recorded[1]
    for k in (-3, 0, 1, 2, 3, 4, 5, 6, 7, 12):
        x = torch.randn(16)
        (got,) = by_hand(torch.tensor(k), x)
        assert torch.equal(got, branches[min(max(k, 0), 7)](x))


# --------------------------------------------------------------------------- router set kernel (no GPU)
def _router_switch(w, *, mean=True, write=None, keepdim=False):
    """A 3-way switch whose index is ``argmax(mean(x, 0) @ w)`` (or ``argmax(x @ w)``),
    clamped and wrapped, with an optional in-place ``write`` of ``x`` just before the switch."""
    aten = torch.ops.aten

    def index(g, x):
        v = g.call_function(aten.mean.dim, (x, [0], keepdim)) if mean else x
        target = aten.mm.default if keepdim else aten.matmul.default
        k = g.call_function(aten.argmax.default, (g.call_function(target, (v, g.get_attr("router_w"))),))
        k = g.call_function(aten.remainder.Scalar, (g.call_function(aten.clamp.default, (k, -1, 2)), 3))
        if write:
            g.call_method("mul_", (x, -1))
        return k

    return _switch_indexed_by(index, router_w=w)


def _router_reference(x, w, mean=True):
    v = x.mean(0) if mean else x
    return int(torch.remainder(torch.clamp(torch.argmax(v @ w), -1, 2), 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mean", [True, False])
def test_a_mean_matmul_argmax_router_is_one_set_router_call(monkeypatch, dtype, mean):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 5, generator=g).to(dtype)
    x = (torch.randn(6, 16, generator=g) if mean else torch.randn(16, generator=g)).to(dtype)
    calls = record_capture(monkeypatch, _router_switch(w, mean=mean), (x, torch.ones(4)))
    # no mean, matmul or argmax kernel: ONE router set kernel (6 rows, or one vector), then the SWITCH
    assert calls["top"] == [("set_router", 6 if mean else 1, (16, 5), (("max", -1), ("min", 2), ("mod", 3)), 3),
                            ("SWITCH", 3)]
    (program,) = calls["routers"]
    assert int(program.evaluate()) == _router_reference(x, w, mean)


def test_a_keepdim_router_through_mm_is_one_set_router_call(monkeypatch):
    w = torch.randn(8, 3)
    x = torch.randn(4, 8)
    calls = record_capture(monkeypatch, _router_switch(w, keepdim=True), (x, torch.ones(4)))
    assert calls["top"][0][:3] == ("set_router", 4, (8, 3))


def test_a_router_over_the_kernel_bound_runs_mean_and_matmul_as_torch_kernels(monkeypatch):
    from branchyard.lowering.cuda_graph import patterns

    w, x = torch.randn(16, 5), torch.randn(6, 16)
    monkeypatch.setattr(patterns, "MAX_ROUTER_ELEMENTS", 6 * 16 + 16 * 5 - 1)
    calls = record_capture(monkeypatch, _router_switch(w), (x, torch.ones(4)))
    # the logits are a torch tensor again: the plain set-program kernel takes their argmax
    assert calls["top"] == [("set_program", True, (("max", -1), ("min", 2), ("mod", 3)), 3), ("SWITCH", 3)]


def test_a_router_input_written_in_place_before_the_switch_is_not_deferred(monkeypatch):
    w, x = torch.randn(16, 5), torch.randn(6, 16)
    calls = record_capture(monkeypatch, _router_switch(w, write=True), (x, torch.ones(4)))
    assert calls["top"][0][0] != "set_router" and calls["routers"] == []


@pytest.mark.parametrize("case", ["int", "dims", "noncontiguous_w", "dtype_mismatch", "wide_k", "many_experts",
                                  "mm_vector", "too_many_elements", "grad"])
def test_match_router_step_refuses_what_the_kernel_cannot_compute(monkeypatch, case):
    from branchyard.lowering.cuda_graph import patterns

    mean, matmul = torch.ops.aten.mean.dim, torch.ops.aten.matmul.default
    x, w = torch.randn(4, 8), torch.randn(8, 3)
    assert patterns.match_router_step(matmul, (patterns.match_router_step(mean, (x, [0]), {}), w), {}) is not None
    if case == "int":
        assert patterns.match_router_step(mean, (x.to(torch.int32), [0]), {}) is None
    elif case == "dims":
        assert patterns.match_router_step(mean, (x, [1]), {}) is None
    elif case == "noncontiguous_w":
        assert patterns.match_router_step(matmul, (patterns.RowMean(x), torch.randn(3, 8).t()), {}) is None
    elif case == "dtype_mismatch":
        assert patterns.match_router_step(matmul, (patterns.RowMean(x), w.double()), {}) is None
    elif case == "wide_k":
        assert patterns.match_router_step(mean, (torch.randn(1, patterns.MAX_ROUTER_K + 1), [0]), {}) is None
    elif case == "many_experts":
        big = torch.randn(8, patterns.MAX_ARGMAX_ELEMENTS + 1)
        assert patterns.match_router_step(matmul, (patterns.RowMean(x), big), {}) is None
    elif case == "mm_vector":  # mm takes matrices: a 1-D operand is not its form
        assert patterns.match_router_step(torch.ops.aten.mm.default, (x[0], w), {}) is None
    elif case == "too_many_elements":
        monkeypatch.setattr(patterns, "MAX_ROUTER_ELEMENTS", x.numel() + w.numel() - 1)
        assert patterns.match_router_step(matmul, (patterns.RowMean(x), w), {}) is None
    else:  # a tensor that would record autograd history; under no_grad (the capture's mode) it would not
        assert patterns.match_router_step(matmul, (patterns.RowMean(x), w.requires_grad_()), {}) is None
        with torch.no_grad():
            assert patterns.match_router_step(matmul, (patterns.RowMean(x), w), {}) is not None


@pytest.mark.skipif(not HAS_SWITCH, reason="cond_to_switch needs torch >= 2.14")
@pytest.mark.parametrize("batch", [1, 4])
def test_a_models_router_whose_weight_requires_grad_is_one_set_router_call(monkeypatch, batch):
    from branchyard.examples.decode_loop import DecodeLoop
    from branchyard.passes import cond_to_switch

    model = DecodeLoop(dim=32, hidden=64, num_experts=4).eval()
    assert model.router.requires_grad  # as in any nn.Module
    args = (torch.randn(batch, 32), torch.tensor(3))
    ep = cond_to_switch(torch.export.export(model, args))
    with torch.no_grad():  # as the capture runs
        calls = record_capture(monkeypatch, ep, args)
    (body,) = [k for k in calls if k.endswith("WHILE1.0")]
    # the router reads only the carry x and the weight: set before the loop, then by each trip's step
    assert [c[0] for c in calls["top"]] == ["copy", "step", "set_router", "WHILE"]
    assert calls["top"][2][1:3] == (batch, (32, 4))
    assert [c[0] for c in calls[body]] == ["SWITCH", "step"]
    assert calls[body][1][-1][:3] == ("next_router", batch, (32, 4))
    assert len(calls["routers"]) == 2 and all(p.source.w.requires_grad for p in calls["routers"])


@pytest.mark.skipif(not HAS_SWITCH, reason="cond_to_switch needs torch >= 2.14")
def test_a_loops_router_is_computed_in_the_body_when_rotation_is_off(monkeypatch):
    from branchyard.examples.decode_loop import DecodeLoop
    from branchyard.lowering.cuda_graph import handlers
    from branchyard.passes import cond_to_switch

    model = DecodeLoop(dim=32, hidden=64, num_experts=4).eval()
    args = (torch.randn(4, 32), torch.tensor(3))
    ep = cond_to_switch(torch.export.export(model, args))
    monkeypatch.setattr(handlers, "ROTATE_ROUTER", False)
    with torch.no_grad():
        calls = record_capture(monkeypatch, ep, args)
    (body,) = [k for k in calls if k.endswith("WHILE1.0")]
    assert [c[0] for c in calls["top"]] == ["copy", "step", "WHILE"]
    assert [c[0] for c in calls[body]] == ["set_router", "SWITCH", "step"]
    assert len(calls[body][2]) == 7  # a plain step: no next_router


def _decode_body_and_values():
    """The exported decode loop's body (after cond_to_switch) and CPU values for its inputs."""
    from branchyard.examples.decode_loop import DecodeLoop
    from branchyard.fx.graph_walk import copy_graph_module
    from branchyard.passes import cond_to_switch

    model = DecodeLoop(dim=16, hidden=32, num_experts=3).eval()
    ep = cond_to_switch(torch.export.export(model, (torch.randn(2, 16), torch.tensor(3))))
    body = copy_graph_module(ep.module().get_submodule("while_loop_body_graph_0"), share_tensors=True)
    values = [torch.randn(p.meta["val"].shape).to(p.meta["val"].dtype)
              for p in body.graph.nodes if p.op == "placeholder"]
    return body, values


@pytest.mark.skipif(not HAS_SWITCH, reason="cond_to_switch needs torch >= 2.14")
def test_only_a_router_of_one_carry_and_invariants_in_a_body_that_writes_nothing_is_rotated(monkeypatch):
    from types import SimpleNamespace

    from branchyard.lowering.cuda_graph import handlers, patterns

    body, values = _decode_body_and_values()
    interp = SimpleNamespace(ctx=SimpleNamespace(switch_as_ifs=False))
    switch = next(n for n in body.graph.nodes if handlers.is_switch_node(n))
    source, chain = patterns.index_chain(switch)
    assert source.op == "placeholder" and [n.target for n in chain][:3] == [
        torch.ops.aten.mean.dim, torch.ops.aten.matmul.default, torch.ops.aten.argmax.default]
    assert {n.target for n in chain[3:]} <= {torch.ops.aten.clamp.default, torch.ops.aten.remainder.Scalar}
    found = handlers._next_trip_router(interp, body, values[:2], tuple(values[2:]))
    assert found is not None
    node, k, program, n = found
    assert node is switch and k == 1 and n == 3 and program.source.x is values[1]
    logits = values[1].mean(0) @ program.source.w
    assert int(program.evaluate()) == min(max(int(torch.argmax(logits)), 0), 2)
    # the router's input is a loop input, not a carry: its value never changes, nothing to rotate
    assert handlers._next_trip_router(interp, body, values[:1], tuple(values[1:])) is None
    # switch as IF nodes, or rotation turned off
    assert handlers._next_trip_router(SimpleNamespace(ctx=SimpleNamespace(switch_as_ifs=True)), body, values[:2],
                                      tuple(values[2:])) is None
    monkeypatch.setattr(handlers, "ROTATE_ROUTER", False)
    assert handlers._next_trip_router(interp, body, values[:2], tuple(values[2:])) is None
    monkeypatch.setattr(handlers, "ROTATE_ROUTER", True)
    # the argmax used again: the index chain is not the switch's alone
    argmax = chain[2]
    with body.graph.inserting_after(argmax):
        again = body.graph.call_function(torch.ops.aten.add.Tensor, (argmax, 1))
    assert patterns.index_chain(switch) is None
    body.graph.erase_node(again)
    # anything in the body that writes memory in place: the router's inputs at a trip's end might not be the next's
    with body.graph.inserting_before(switch):
        body.graph.call_function(torch.ops.aten.add_.Tensor, (source, 1.0))
    assert patterns.index_chain(switch) is not None
    assert handlers._next_trip_router(interp, body, values[:2], tuple(values[2:])) is None


@functools.lru_cache(maxsize=None)
def _dynamic_decode_program(max_batch: int, dim: int = 256):
    """A decode loop (4 experts) exported with a dynamic batch of 1..max_batch (read-only: shared)."""
    from branchyard.examples.decode_loop import DecodeLoop
    from branchyard.passes import cond_to_switch
    from branchyard.shapes import ShapeVar, dynamic_spec, export

    model = DecodeLoop(dim=dim, hidden=64, num_experts=4).eval()

    @dynamic_spec({"x": (ShapeVar("batch", min=1, max=max_batch), dim)})
    def decode(x, steps):
        return model(x, steps)

    return cond_to_switch(export(decode, (torch.randn(4, dim), torch.tensor(3))))


@pytest.mark.skipif(not HAS_SWITCH, reason="cond_to_switch needs torch >= 2.14")
@pytest.mark.parametrize("max_batch, left_out", [(64, True), (1 << 20, False)])
def test_a_dynamic_batch_router_stays_out_of_inductor_regions_while_its_range_fits(max_batch, left_out):
    from branchyard.fx.graph_walk import copy_graph_module
    from branchyard.lowering.cuda_graph import patterns
    from branchyard.lowering.cuda_graph.inductor_regions import fuse_regions

    assert (max_batch * 256 + 256 * 4 <= patterns.MAX_ROUTER_ELEMENTS) is left_out
    gm = copy_graph_module(_dynamic_decode_program(max_batch).module(), share_tensors=True)  # the program is shared
    fuse_regions(gm)
    body = gm.get_submodule("while_loop_body_graph_0")
    left = [n.target for n in body.graph.nodes if n.op == "call_function"]
    assert (torch.ops.aten.mean.dim in left and torch.ops.aten.matmul.default in left) is left_out
    assert torch.ops.aten.argmax.default in left  # 4 logits: the set kernel's argmax either way


@pytest.mark.skipif(not HAS_SWITCH, reason="cond_to_switch needs torch >= 2.14")
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_each_capture_of_a_dynamic_batch_runs_the_router_in_the_set_kernel(monkeypatch, batch):
    ep = _dynamic_decode_program(64)
    args = (torch.randn(batch, 256), torch.tensor(3))
    with torch.no_grad():
        calls = record_capture(monkeypatch, ep, args)
    (body,) = [k for k in calls if k.endswith("WHILE1.0")]
    assert [c[0] for c in calls[body]] == ["SWITCH", "step"]  # set before the loop and by each step
    assert calls["top"][2][:3] == ("set_router", batch, (256, 4))
    assert calls[body][1][-1][:3] == ("next_router", batch, (256, 4))


@pytest.mark.skipif(not HAS_SWITCH, reason="cond_to_switch needs torch >= 2.14")
def test_the_router_steps_stay_out_of_inductor_regions():
    from branchyard.examples.decode_loop import DecodeLoop
    from branchyard.lowering.cuda_graph.inductor_regions import fuse_regions
    from branchyard.passes import cond_to_switch

    m = DecodeLoop(dim=32, hidden=64, num_experts=4)
    ep = cond_to_switch(torch.export.export(m, (torch.randn(4, 32), torch.tensor(3))))
    gm = ep.module()
    fuse_regions(gm)
    body = gm.get_submodule("while_loop_body_graph_0")
    left = [n.target for n in body.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.mean.dim in left and torch.ops.aten.matmul.default in left


class _StatefulStep(torch.nn.Module):
    """A step with the state real models keep in buffers: an int64 call counter, a KV cache written
    at a position, batch-norm statistics (train mode)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("cache", torch.zeros(6, 8))

    def forward(self, x, pos):
        self.calls.add_(1)
        self.cache.index_copy_(0, pos, x[:1])
        h = self.bn(x) + self.cache.sum()
        return torch.cond(h.sum() > 0, lambda t: self.lin(t), lambda t: -t, (h,))


def _stateful_program():
    torch.manual_seed(0)
    model = _StatefulStep().train()
    args = (torch.randn(4, 8), torch.tensor([2]))
    return model, args, torch.export.export(model, args).module()


def test_validating_a_program_leaves_the_models_buffers_as_they_were():
    from branchyard.lowering.cuda_graph import analyze

    model, args, gm = _stateful_program()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    analyze(gm, args)  # runs the VALIDATE phase: fake tensors only
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    gm(*args)  # the program itself does write them (it shares them with the model)
    assert int(model.calls) == 1 and int(model.bn.num_batches_tracked) == 1 and model.cache[2].abs().sum() > 0


def test_a_warm_up_puts_back_every_buffer_the_program_writes():
    from branchyard.lowering.cuda_graph.capture import restoring_written_attributes, written_attributes

    model, args, gm = _stateful_program()
    written = written_attributes(gm)
    expected = [model.calls, model.cache, model.bn.running_mean, model.bn.running_var, model.bn.num_batches_tracked]
    assert sorted(map(id, written)) == sorted(map(id, expected))  # buffers only: no parameter
    before = [t.clone() for t in expected]
    with restoring_written_attributes(gm) as restored:
        out = gm(*args)
        assert int(model.calls) == 1
    assert len(restored) == 5 and out.shape == (4, 8)
    for t, b in zip(expected, before):
        assert torch.equal(t, b)
    plain = torch.export.export(torch.nn.Linear(3, 3), (torch.randn(2, 3),)).module()
    assert written_attributes(plain) == []


def test_the_inputs_a_program_writes_are_found_by_running_it():
    # a replay writes the static copy of such an input; these positions are copied back to the caller
    from branchyard.lowering.cuda_graph.capture import inputs_written_by

    class Decode(torch.nn.Module):
        def forward(self, x, cache, pos, steps: int):
            cache.index_copy_(0, pos, x[:1])
            return torch.cond(x.sum() > 0, lambda t: t * 2, lambda t: -t, (x + cache.sum(),))

    args = (torch.randn(4, 8), torch.zeros(6, 8), torch.tensor([2]), 3)
    gm = torch.export.export(Decode(), args).module()
    copies = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    assert inputs_written_by(lambda: gm(*copies), copies) == [1]
    torch.testing.assert_close(copies[1][2], args[0][0])
    assert inputs_written_by(lambda: gm(*copies[:1], torch.zeros(6, 8), *copies[2:]), copies) == []


def test_a_capture_reads_a_parameter_input_where_it_lives():
    # torch.compile passes a model's parameters as graph inputs: a call must not copy the weights
    from branchyard.lowering.cuda_graph.capture import static_input

    w, x = torch.nn.Parameter(torch.randn(4, 4)), torch.randn(4)
    s = static_input(w)
    assert s.data_ptr() == w.data_ptr() and not s.requires_grad
    c = static_input(x)
    assert c.data_ptr() != x.data_ptr() and torch.equal(c, x)
    assert static_input(3) == 3


@functools.lru_cache(maxsize=None)
def _core_aten_decode_program():
    """A decode loop given as users often give it: ``torch.export(...).run_decompositions()``,
    where the router reads ``squeeze(mm(unsqueeze(mean(x, [0]), 0), w), [0])`` (read-only: shared)."""
    from branchyard.examples.decode_loop import DecodeLoop
    from branchyard.passes import cond_to_switch

    torch.manual_seed(0)
    model = DecodeLoop(dim=32, hidden=32, num_experts=3).eval()
    ep = torch.export.export(model, (torch.randn(4, 32), torch.tensor(3))).run_decompositions()
    return model, cond_to_switch(ep)


@pytest.mark.skipif(not HAS_SWITCH, reason="cond_to_switch needs torch >= 2.14")
def test_a_core_aten_router_is_one_set_router_call(monkeypatch):
    model, ep = _core_aten_decode_program()
    body = ep.graph_module.get_submodule("while_loop_body_graph_0")
    targets = [n.target for n in body.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.unsqueeze.default in targets and torch.ops.aten.squeeze.dims in targets
    x = torch.randn(4, 32)
    with torch.no_grad():
        calls = record_capture(monkeypatch, ep, (x, torch.tensor(3)))
    (body_calls,) = [k for k in calls if k.endswith("WHILE1.0")]
    assert [c[0] for c in calls[body_calls]] == ["SWITCH", "step"]
    assert calls["top"][2][:3] == ("set_router", 4, (32, 3))
    assert calls[body_calls][1][-1][:3] == ("next_router", 4, (32, 3))
    torch.testing.assert_close(calls["result"][1], model(x, torch.tensor(1))[1])  # one trip ran
    first, following = calls["routers"]  # before the loop on x's buffer; in the step on the trip's new x
    assert following.source.x.data_ptr() != first.source.x.data_ptr()
    assert torch.equal(following.source.x, calls["result"][1])
    with torch.no_grad():  # what the one before the loop read: x
        assert calls["decisions"][1] == int(torch.argmax(x.mean(0) @ model.router))
    for program in (first, following):
        logits = program.source.evaluate()
        assert logits.shape == (3,)
        torch.testing.assert_close(logits, program.source.x.mean(0) @ program.source.w)


def test_unsqueeze_and_squeeze_around_a_routers_mm_are_its_steps():
    from branchyard.lowering.cuda_graph import patterns

    aten = torch.ops.aten
    x, w = torch.randn(4, 8), torch.randn(8, 3)
    mean = patterns.match_router_step(aten.mean.dim, (x, [0]), {})
    row = patterns.match_router_step(aten.unsqueeze.default, (mean, 0), {})
    assert row == patterns.RowMean(x, True)
    logits = patterns.match_router_step(aten.mm.default, (row, w), {})
    assert logits.shape == (1, 3)
    flat = patterns.match_router_step(aten.squeeze.dims, (logits, [0]), {})
    assert flat.shape == (3,) and flat.rows == 4
    torch.testing.assert_close(flat.evaluate(), (x.mean(0, keepdim=True) @ w).squeeze(0))
    assert patterns.match_router_step(aten.squeeze.dim, (logits, -2), {}).shape == (3,)
    # not the kernel's form: left to torch
    assert patterns.match_router_step(aten.unsqueeze.default, (mean, 1), {}) is None
    assert patterns.match_router_step(aten.unsqueeze.default, (row, 0), {}) is None  # already (1, K)
    assert patterns.match_router_step(aten.unsqueeze.default, (x[0], 0), {}) is None  # a plain vector
    assert patterns.match_router_step(aten.squeeze.dims, (flat, [0]), {}) is None
    assert patterns.match_router_step(aten.squeeze.dims, (logits, [1]), {}) is None


@pytest.mark.skipif(not HAS_SWITCH, reason="cond_to_switch needs torch >= 2.14")
def test_a_core_aten_routers_steps_stay_out_of_inductor_regions():
    from branchyard.fx.graph_walk import copy_graph_module
    from branchyard.lowering.cuda_graph.inductor_regions import fuse_regions

    _, ep = _core_aten_decode_program()
    gm = copy_graph_module(ep.module(), share_tensors=True)  # the program is shared
    fuse_regions(gm)
    body = gm.get_submodule("while_loop_body_graph_0")
    left = [n.target for n in body.graph.nodes if n.op == "call_function"]
    aten = torch.ops.aten
    assert {aten.mean.dim, aten.unsqueeze.default, aten.mm.default, aten.squeeze.dims} <= set(left)


# --------------------------------------------------------------------------- writes no schema marks (no GPU)
def _bn_writer(target, training):
    """A batch norm of ``data`` with running statistics ``rm``/``rv``, as ``target`` spells it."""
    aten = torch.ops.aten

    def build(g, rm, rv, data):
        if target is torch.nn.functional.batch_norm:
            return g.call_function(target, (data, rm, rv), {"training": training})
        if target is aten.native_batch_norm.default:
            return g.call_function(target, (data, None, None, rm, rv, training, 0.1, 1e-5))
        return g.call_function(target, (data, None, None, rm, rv, training, 0.1, 1e-5, False))

    return build


#: ops between a deferred value and its node that update running statistics in place although
#: their schemas mark no argument written (branchyard.fx.mutation.UNMARKED_WRITES), and the same
#: ops in eval mode, which write nothing.
STAT_WRITERS = {
    "aten.batch_norm": _bn_writer(torch.ops.aten.batch_norm.default, True),
    "aten.native_batch_norm": _bn_writer(torch.ops.aten.native_batch_norm.default, True),
    "torch.batch_norm": _bn_writer(torch.batch_norm, True),
    "F.batch_norm": _bn_writer(torch.nn.functional.batch_norm, True),
}
STAT_READERS = {
    "aten.batch_norm eval": _bn_writer(torch.ops.aten.batch_norm.default, False),
    "F.batch_norm eval": _bn_writer(torch.nn.functional.batch_norm, False),
}


def _stats(n, first=0.0):
    """Running statistics whose first mean is ``first``, and a batch whose column means are 0 except
    the last, 50: a train-mode batch norm moves the last running mean to 5 (momentum 0.1)."""
    rm = torch.zeros(n)
    rm[0] = first
    data = torch.zeros(8, n)
    data[:, -1] = 50.0
    return {"rm": rm, "rv": torch.ones(n), "data": data}


def _with_buffers(gm, buffers):
    for name, tensor in buffers.items():
        gm.register_buffer(name, tensor.clone())
    return gm


def _gated_by_running_mean(writer):
    """``cond(rm[-1] > 0.5, x + 1, x - 1)`` with ``writer`` updating ``rm`` between the
    comparison and the cond: eager compares before the write (0 > 0.5: the false branch)."""
    from branchyard.lowering.cuda_graph.fx_builders import cond_module

    gm = _with_buffers(cond_module(lambda x: (x + 1,), lambda x: (x - 1,), num_operands=1), _stats(3))
    cond = next(n for n in gm.graph.nodes if n.target is COND)

    def pred(g):
        rm, rv, data = (g.get_attr(n) for n in ("rm", "rv", "data"))
        gt = g.call_function(torch.ops.aten.gt.Scalar, (g.call_function(torch.ops.aten.select.int, (rm, 0, -1)), 0.5))
        writer(g, rm, rv, data)
        return gt

    cond.args = (_before(gm, cond, pred), *cond.args[1:])
    gm.recompile()
    return gm


@pytest.mark.parametrize("name", [*STAT_WRITERS, *STAT_READERS])
def test_a_comparison_is_not_deferred_across_a_running_stats_update(monkeypatch, name):
    """A set kernel compares its operands at the IF node: after a train-mode batch norm moved
    ``rm[-1]`` from 0 to 5, it would take the true branch where eager takes the false one."""
    writes = name in STAT_WRITERS
    gm = _gated_by_running_mean({**STAT_WRITERS, **STAT_READERS}[name])
    args = (torch.tensor(True), torch.ones(4))
    (eager,) = copy_of(gm)(*args)
    assert torch.equal(eager, torch.zeros(4))  # the false branch: rm[-1] was 0 when compared
    with torch.no_grad():
        calls = record_capture(monkeypatch, gm, args)
    assert calls["decisions"] == [False]  # the branch the graph takes is eager's
    assert calls["top"][0][:2] == (("step", "flag") if writes else ("step", "gt"))
    assert (float(gm.rm[-1]) == pytest.approx(5.0)) is writes  # the capture ran the update once


def copy_of(gm):
    from branchyard.fx.graph_walk import copy_graph_module

    return copy_graph_module(gm)


def _indexed_by_running_mean(writer, *, router=False):
    """A 3-way switch whose index is ``argmax(rm)`` (or a router ``argmax(rm @ w)``) clamped and
    wrapped, with ``writer`` updating ``rm`` before the switch: eager's index is 0 (rm = [1, 0, 0]);
    read after a train-mode update (rm = [0.9, 0, 5]) it would be 2."""
    aten = torch.ops.aten
    w = torch.zeros(3, 3)
    w[range(3), range(3)] = 1.0  # rm @ w is rm

    def index(g, x):
        rm, rv, data = (g.get_attr(n) for n in ("rm", "rv", "data"))
        source = g.call_function(aten.matmul.default, (rm, g.get_attr("router_w"))) if router else rm
        k = g.call_function(aten.argmax.default, (source,))
        k = g.call_function(aten.remainder.Scalar, (g.call_function(aten.clamp.default, (k, -1, 2)), 3))
        writer(g, rm, rv, data)
        return k

    return _switch_indexed_by(index, router_w=w, **_stats(3, first=1.0))


@pytest.mark.parametrize("router", [False, True], ids=["argmax", "router"])
@pytest.mark.parametrize("name", [*STAT_WRITERS, *STAT_READERS])
def test_a_switch_index_is_not_deferred_across_a_running_stats_update(monkeypatch, name, router):
    writes = name in STAT_WRITERS
    gm = _indexed_by_running_mean({**STAT_WRITERS, **STAT_READERS}[name], router=router)
    args = (torch.randn(3), torch.ones(4))
    (eager,) = copy_of(gm)(*args)
    assert torch.equal(eager, args[1] + 1)  # branch 0
    with torch.no_grad():
        calls = record_capture(monkeypatch, gm, args)
    assert calls["decisions"] == [0]  # the branch the graph takes is eager's
    if writes:  # argmax, clamp and remainder (and the router's matmul) ran as torch ops before the write
        assert calls["top"] == [("set_index", 3), ("SWITCH", 3)] and calls["routers"] == []
    elif router:
        assert calls["top"][0][:3] == ("set_router", 1, (3, 3)) and len(calls["routers"]) == 1
    else:
        assert calls["top"] == [("set_program", True, (("max", -1), ("min", 2), ("mod", 3)), 3), ("SWITCH", 3)]


def _body_writing_after_the_sum(write_carry):
    def body_fn(i, y, n):
        j = i + 1
        if write_carry:
            i.add_(5)  # after the sum: eager's j read i before this write
        else:
            y.mul_(2)  # another carry's buffer: not the counter's
        return j, y + 1

    return body_fn


@pytest.mark.parametrize("write_carry", [True, False], ids=["writes the counter", "writes another carry"])
def test_a_counter_written_in_place_after_its_sum_is_not_incremented_by_the_step_kernel(monkeypatch, write_carry):
    """The step kernel adds ``k`` after the body: to the value ``i.add_(5)`` left, not the one
    eager's ``j = i + 1`` read before the write (6 after one trip instead of 1)."""
    body_fn = _body_writing_after_the_sum(write_carry)
    program = while_program(lambda i, y, n: i < n, body_fn, n_carry=2, n_additional=1)
    args = (torch.tensor(0), torch.ones(3), torch.tensor(4))
    calls = record_capture(monkeypatch, program, args)
    want_i, want_y = body_fn(*(a.clone() for a in args))  # one trip, as the capture ran
    i, y = calls["result"]
    assert int(i) == int(want_i) == 1 and torch.equal(y, want_y)
    (body,) = [k for k in calls if "WHILE" in k]
    assert calls[body][-1][-1] == (None if write_carry else 1)  # the step's increment


@pytest.mark.skipif(not HAS_SWITCH, reason="cond_to_switch needs torch >= 2.14")
def test_a_rotated_router_whose_new_carry_is_not_contiguous_is_set_after_the_step(monkeypatch):
    # torch.export keeps a carry's strides, but a hand-made graph may return a transposed carry:
    # the step kernel's router block could not read it, so a set kernel after the step reads the buffer
    from branchyard.examples.decode_loop import DecodeLoop
    from branchyard.fx.graph_walk import copy_graph_module
    from branchyard.passes import cond_to_switch

    model = DecodeLoop(dim=8, hidden=16, num_experts=3).eval()
    args = (torch.randn(8, 8), torch.tensor(3))
    gm = copy_graph_module(cond_to_switch(torch.export.export(model, args)).module(), share_tensors=True)
    body = gm.get_submodule("while_loop_body_graph_0")
    out = next(n for n in body.graph.nodes if n.op == "output")
    counter, x = out.args[0]
    with body.graph.inserting_before(out):
        xt = body.graph.call_function(torch.ops.aten.t.default, (x,))
    out.args = ((counter, xt),)
    body.recompile()
    with torch.no_grad():
        calls = record_capture(monkeypatch, gm, args)
    (body_calls,) = [k for k in calls if k.endswith("WHILE1.0")]
    assert [c[0] for c in calls["top"]] == ["copy", "step", "set_router", "WHILE"]
    assert [c[0] for c in calls[body_calls]] == ["SWITCH", "step", "set_router"]
    assert len(calls[body_calls][1]) == 7  # a plain step
    first, after = calls["routers"]
    assert after.source.x.data_ptr() == first.source.x.data_ptr()  # the carry's buffer, after the copy
    with torch.no_grad():  # what the set kernel after the step reads: the trip's new x, transposed
        y = model.step(args[0]).t()
        assert calls["decisions"][-1] == min(max(int(torch.argmax(y.mean(0) @ model.router)), 0), 2)


@pytest.mark.parametrize("seed", range(40))
def test_an_index_chain_evaluates_as_torch_runs_it(seed):
    """Random router / index chains: ``evaluate_index_chain`` either declines or computes
    the same index as running the chain's nodes with torch."""
    from branchyard.lowering.cuda_graph import patterns

    aten = torch.ops.aten
    rng = random.Random(seed)
    rows, k, e = rng.choice([1, 3, 8]), rng.choice([4, 16]), rng.choice([2, 5, 8])
    g = torch.fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    vector = rng.random() < 0.3
    if vector:
        v = x
        xv = torch.randn(k)
    else:
        dims = rng.choice([[0], [-2], [1]])  # [1]: not a router's mean, the chain must decline
        keepdim = rng.random() < 0.3
        v = g.call_function(aten.mean.dim, (x, dims, keepdim))
        if not keepdim and rng.random() < 0.5:
            v = g.call_function(aten.unsqueeze.default, (v, 0))
        xv = torch.randn(rows, k)
    target = rng.choice([aten.matmul.default, aten.mm.default])
    logits = g.call_function(target, (v, w))
    if rng.random() < 0.5:
        logits = g.call_function(aten.squeeze.dims, (logits, [0]))
    i = g.call_function(aten.argmax.default, (logits,))
    for _ in range(rng.randrange(4)):
        if rng.random() < 0.5:
            i = g.call_function(aten.clamp.default, (i, rng.randint(-2, 2), rng.randint(2, 9)))
        else:
            i = g.call_function(aten.remainder.Scalar, (i, rng.choice([-3, 2, 3, 7])))
    out = g.output(i)
    wv = torch.randn(k, e)
    try:
        want = torch.fx.GraphModule(torch.nn.Module(), g)(xv, wv)
    except RuntimeError:
        want = None  # torch refuses the shapes (mm of a vector, a mean over the wrong dim): so must we
    source, chain = patterns.index_chain(out)
    assert source is x and chain[-1] is i
    program = patterns.evaluate_index_chain(chain, {x: xv, w: wv})
    if program is None:
        return  # declined: the set kernel would not compute it, the capture runs torch's kernels
    assert want is not None and want.numel() == 1
    assert int(program.evaluate()) == int(want)


@pytest.mark.skipif(not HAS_SWITCH, reason="cond_to_switch needs torch >= 2.14")
def test_a_switch_whose_index_is_not_the_loops_router_sets_the_loops_handle_itself(monkeypatch):
    # should the switch see another index than the one set before the loop, it sets that same
    # handle in the body (a handle must belong to a conditional node) and the step sets nothing
    from branchyard.examples.decode_loop import DecodeLoop
    from branchyard.lowering.cuda_graph import handlers
    from branchyard.passes import cond_to_switch

    model = DecodeLoop(dim=16, hidden=32, num_experts=3).eval()
    args = (torch.randn(4, 16), torch.tensor(3))
    ep = cond_to_switch(torch.export.export(model, args))
    monkeypatch.setattr(handlers, "same_index_program", lambda a, b: False)
    with torch.no_grad():
        calls = record_capture(monkeypatch, ep, args)
    (body,) = [k for k in calls if k.endswith("WHILE1.0")]
    assert [c[0] for c in calls["top"]] == ["copy", "step", "set_router", "WHILE"]
    assert [c[0] for c in calls[body]] == ["set_router", "SWITCH", "step"]
    assert len(calls[body][2]) == 7  # a plain step: no next_router
    (switch_handle,) = [h for kind, h in calls["node_handles"] if kind == "SWITCH"]
    assert calls["set_handles"] == [switch_handle, switch_handle]


def test_a_hand_built_router_loop_is_rotated_on_any_torch(monkeypatch):
    # no export, no torch 2.14 switch: the shape torch 2.11 users build with fx_builders
    from branchyard.lowering.cuda_graph.fx_builders import router_loop_module

    branches = [(lambda j: lambda x: x.roll(j + 1, 1) - j)(j) for j in range(4)]
    w = torch.randint(-2, 3, (16, 4)).float()
    program = router_loop_module(branches, w, trips_until=5)
    args = (torch.tensor(0), torch.randint(-3, 4, (4, 16)).float())
    calls = record_capture(monkeypatch, program, args)
    (body,) = [k for k in calls if k.endswith("WHILE1.0")]
    assert [c[0] for c in calls["top"]] == ["copy", "step", "set_router", "WHILE"]
    assert [c[0] for c in calls[body]] == ["SWITCH", "step"]
    # the counter's `i + 1` and the next trip's router, both in the step kernel
    assert calls[body][1][6] == 1 and calls[body][1][-1][:3] == ("next_router", 4, (16, 4))
