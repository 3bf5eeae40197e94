"""CPU tests of the CUDA-graph lowering: analysis, validation errors, eager fallback.

The capture itself needs a GPU and is tested in tests/gpu/test_cuda_graph_gpu.py.
"""

from __future__ import annotations

import operator
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
    from branchyard.lowering.cuda_graph.conditional_nodes import cuda_bindings_available, compile_set_kernels

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
    for name in (b"branchyard_set_bool", b"branchyard_set_if_pair", b"branchyard_set_index"):
        assert name in cubin


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
