"""cond_to_switch / switch_to_cond through every entry point: export (strict and
non-strict), make_fx, a torch.compile backend, Inductor's pre-grad hook; then
run_decompositions, re-export, training, and the round trip."""

from __future__ import annotations

import pytest
import torch

from branchyard._compat import HAS_SWITCH

if not HAS_SWITCH:  # torch < 2.14 (e.g. the GPU machine): nothing to rewrite to
    pytest.skip("needs torch.ops.higher_order.switch (torch >= 2.14)", allow_module_level=True)

import torch._inductor.config as inductor_config
from torch.fx.experimental.proxy_tensor import make_fx

from branchyard.passes import CondToSwitch, cond_to_switch, find_cond_trees, switch_to_cond
from branchyard.passes.cond_to_switch import inductor_pre_grad_pass
from branchyard.fx.control_flow import is_cond, is_switch
from branchyard.testing import assert_equivalent

aten = torch.ops.aten
cond = torch.cond
X = torch.tensor([[0.5, -1.0, 2.0], [1.0, 0.25, -0.5]])
INDICES = range(-3, 7)


def all_nodes(gm):
    for m in gm.modules():
        if isinstance(m, torch.fx.GraphModule):
            yield from m.graph.nodes


def counts(gm):
    nodes = list(all_nodes(gm))
    return sum(map(is_cond, nodes)), sum(map(is_switch, nodes))


class Experts(torch.nn.Module):
    """Expert dispatch written as nested conds: idx == 0, 1, 2, else the fall-through."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(3, 3))
        self.b = torch.nn.Parameter(torch.randn(3))

    def forward(self, idx, x):
        def e2(x, w, b, idx):
            return cond(idx == 2, lambda x, w, b: (x * b).sin(), lambda x, w, b: x - b, (x, w, b))

        def e1(x, w, b, idx):
            return cond(idx == 1, lambda x, w, b, idx: x + b, e2, (x, w, b, idx))

        return cond(idx == 0, lambda x, w, b, idx: x @ w, e1, (x, self.w, self.b, idx))


def eager_reference(m, idx, x):
    i = int(idx)
    return [x @ m.w, x + m.b, (x * m.b).sin()][i] if 0 <= i <= 2 else x - m.b


@pytest.fixture(scope="module")
def model():
    return Experts()


@pytest.fixture(scope="module", params=[False, True], ids=["non-strict", "strict"])
def exported(request, model):
    return torch.export.export(model, (torch.tensor(1), X), strict=request.param)


@pytest.fixture(scope="module")
def rewritten(exported):
    return cond_to_switch(exported)


@pytest.fixture(scope="module")
def nonstrict(model):
    """(before, after) for the tests that need one export flavour only."""
    ep = torch.export.export(model, (torch.tensor(1), X))
    return ep, cond_to_switch(ep)


def test_export_dispatch_chain_becomes_one_switch(exported, rewritten, model):
    assert counts(exported.graph_module) == (3, 0)
    assert counts(rewritten.graph_module) == (0, 1)
    (tree,) = find_cond_trees(exported.graph_module)
    operands_before = sum(len(n.args[3]) for n in all_nodes(exported.graph_module) if is_cond(n))
    (switch,) = [n for n in all_nodes(rewritten.graph_module) if is_switch(n)]
    assert tree.index_form == "dispatch"
    assert (tree.operands_before, tree.operands_after) == (operands_before, 3) and len(switch.args[2]) == 3
    for i in INDICES:
        torch.testing.assert_close(rewritten.module()(torch.tensor(i), X), eager_reference(model, i, X))


def test_run_decompositions_and_reexport(rewritten, model):
    decomposed = rewritten.run_decompositions()
    again = torch.export.export(rewritten.module(), (torch.tensor(1), X))
    assert counts(decomposed.graph_module) == (0, 1) and counts(again.graph_module) == (0, 1)
    for i in INDICES:
        for prog in (decomposed, again):
            torch.testing.assert_close(prog.module()(torch.tensor(i), X), eager_reference(model, i, X))


def test_gradients_match_the_nested_cond_model(nonstrict, model):
    for i in (-1, 0, 1, 2, 3):
        before, after = model, nonstrict[1].module()
        grads = []
        for m in (before, after):
            m.zero_grad()
            x = X.clone().requires_grad_()
            m(torch.tensor(i), x).pow(2).sum().backward()
            params = dict(m.named_parameters())
            grads.append([x.grad] + [params[k].grad for k in ("w", "b")])
        for g_before, g_after in zip(*grads):
            if g_before is None:
                assert g_after is None or not g_after.any()
            else:
                torch.testing.assert_close(g_after, g_before, msg=f"idx={i}")


def test_round_trip_through_switch_to_cond(nonstrict, model):
    back = switch_to_cond(nonstrict[1])
    assert counts(back.graph_module) == (3, 0)  # 4 branches -> balanced tree of 3 conds
    for i in INDICES:
        torch.testing.assert_close(back.module()(torch.tensor(i), X), eager_reference(model, i, X))


def test_assert_equivalent_drives_every_branch(nonstrict):
    report = assert_equivalent(*nonstrict, (torch.tensor(1), X))
    assert report.covered == report.required


def test_make_fx_graph():
    def f(p, q, x):
        inner = lambda x, q: cond(q, lambda x: x.sin(), lambda x: x.cos(), (x,))  # noqa: E731
        return cond(p, inner, lambda x, q: x * 3, (x, q))

    gm = make_fx(f, tracing_mode="fake")(torch.tensor(True), torch.tensor(True), X)
    after = cond_to_switch(gm)
    assert counts(after) == (0, 1)
    for p in (True, False):
        for q in (True, False):
            args = (torch.tensor(p), torch.tensor(q), X)
            torch.testing.assert_close(after(*args), gm(*args))


def dispatch_fn(idx, x):
    # `k == idx` order on purpose: Dynamo keeps it as operator.eq(k, idx)
    inner = lambda x, idx: cond(1 == idx, lambda x: x + 1, lambda x: x - 1, (x,))  # noqa: E731
    return cond(0 == idx, lambda x, idx: x * 2, inner, (x, idx))


def dispatch_reference(idx, x):
    return x * 2 if idx == 0 else (x + 1 if idx == 1 else x - 1)


def test_dynamo_custom_backend():
    seen = []

    def backend(gm, example_inputs):
        p = CondToSwitch()
        res = p(gm)
        seen.append((res.modified, counts(res.graph_module), p.report.stats["dispatch_index"]))
        return res.graph_module.forward

    torch._dynamo.reset()
    compiled = torch.compile(dispatch_fn, backend=backend, fullgraph=True)
    for i in INDICES:
        torch.testing.assert_close(compiled(torch.tensor(i), X), dispatch_reference(i, X))
    assert seen and seen[0] == (True, (0, 1), 1)


def test_inductor_pre_grad_pass():
    assert CondToSwitch.as_inductor_pre_grad_pass() is inductor_pre_grad_pass
    assert isinstance(inductor_pre_grad_pass.uuid(), str)
    torch._dynamo.reset()
    inductor_pre_grad_pass.last_report = None
    with inductor_config.patch(pre_grad_custom_pass=CondToSwitch.as_inductor_pre_grad_pass()):
        compiled = torch.compile(dispatch_fn, backend="inductor", fullgraph=True)
        for i in (-1, 0, 1, 2):
            torch.testing.assert_close(compiled(torch.tensor(i), X), dispatch_reference(i, X))
    report = inductor_pre_grad_pass.last_report
    assert report is not None and report.modified and report.stats["switches_created"] == 1
    torch._dynamo.reset()


def test_dynamo_graph_with_predicate_computed_in_a_branch():
    def f(p, x):
        inner = lambda x: torch.cond(x.sum() > 0, lambda x: x.sin(), lambda x: x.cos(), (x,))  # noqa: E731
        return torch.cond(p, inner, lambda x: x * 3, (x,))

    rewritten = []

    def backend(gm, example_inputs):
        res = CondToSwitch()(gm)
        rewritten.append(counts(res.graph_module))
        return res.graph_module.forward

    torch._dynamo.reset()
    compiled = torch.compile(f, backend=backend, fullgraph=True)
    for p in (True, False):
        for s in (1.0, -1.0):
            x = X.abs() * s
            torch.testing.assert_close(compiled(torch.tensor(p), x), f(torch.tensor(p), x))
    assert rewritten == [(0, 1)]


def test_torch_compile_of_the_rewritten_program_module(nonstrict, model):
    # Dynamo must be able to trace the switch branches of program.module().
    torch._dynamo.reset()
    back = switch_to_cond(nonstrict[1])
    for prog in (nonstrict[1], back):
        compiled = torch.compile(prog.module(), backend="eager", fullgraph=True)
        for i in (-1, 0, 2, 3):
            torch.testing.assert_close(compiled(torch.tensor(i), X), eager_reference(model, i, X))
    torch._dynamo.reset()
