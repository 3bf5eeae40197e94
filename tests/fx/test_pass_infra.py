import logging

import pytest
import torch
from torch.fx import GraphModule

from branchyard.errors import BranchyardError, MalformedGraphError
from branchyard.fx.graph_walk import lint_graph_module
from branchyard.fx.pass_infra import BranchyardPass, Pipeline, apply_pass


class AddToMul(BranchyardPass):
    """x + y  ->  x * y, declining adds with a constant operand."""

    name = "add_to_mul"
    source, replacement = torch.add, torch.mul

    def run(self, gm: GraphModule) -> bool:
        changed = False
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target is self.source:
                if not all(isinstance(a, torch.fx.Node) for a in node.args):
                    self.skip(node, "constant operand")
                    continue
                node.target = self.replacement
                changed = True
        return changed


def _gm():
    def f(x, y):
        return torch.add(torch.add(x, y), 1.0)

    return torch.fx.symbolic_trace(f)


def test_pass_reports_modified_both_ways():
    gm = _gm()
    res = AddToMul()(gm)
    assert res.modified is True
    res2 = AddToMul()(res.graph_module)
    assert res2.modified is False


def test_function_form_copies_graph_module():
    gm = _gm()
    out = apply_pass(gm, AddToMul())
    assert out is not gm
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == [torch.add, torch.add], "input must not be mutated"
    x, y = torch.randn(3), torch.randn(3)
    torch.testing.assert_close(out(x, y), torch.add(x * y, 1.0))


def test_function_form_on_exported_program_verifies_and_keeps_kind():
    class M(torch.nn.Module):
        def forward(self, x, y):
            return torch.add(x, y)

    ep = torch.export.export(M(), (torch.randn(2), torch.randn(2)))

    class AtenAddToMul(BranchyardPass):
        name = "aten_add_to_mul"

        def run(self, gm):
            n = 0
            for node in gm.graph.nodes:
                if node.target is torch.ops.aten.add.Tensor:
                    node.target = torch.ops.aten.mul.Tensor
                    n += 1
            return n > 0

    out = apply_pass(ep, AtenAddToMul())
    assert isinstance(out, torch.export.ExportedProgram)
    x, y = torch.randn(2), torch.randn(2)
    torch.testing.assert_close(out.module()(x, y), x * y)
    torch.testing.assert_close(ep.module()(x, y), x + y)


def test_skip_reasons_are_reported_and_logged(caplog):
    p = AddToMul()
    with caplog.at_level(logging.DEBUG, logger="branchyard"):
        result = Pipeline([p])(_gm())
    assert result.modified
    [skip] = result.reports[0].skips
    assert "constant operand" in skip.reason and "add_1" in skip.where
    assert "constant operand" in caplog.text
    assert "skipped node 'add_1'" in result.report()


def test_lint_failure_names_the_graph():
    gm = _gm()
    # Break the graph: use a node before it is defined.
    nodes = list(gm.graph.nodes)
    nodes[2].args = (nodes[3], nodes[1])
    with pytest.raises(MalformedGraphError, match="fails torch.fx lint"):
        lint_graph_module(gm)


def test_pipeline_rejects_non_programs_and_non_passes():
    with pytest.raises(BranchyardError, match="expected a torch.export.ExportedProgram"):
        Pipeline([AddToMul()])(lambda x: x)
    with pytest.raises(BranchyardError, match="not a torch.fx PassBase"):
        Pipeline([object()])


def test_function_form_keeps_placeholder_names_that_shadow_builtins():
    # nn.Sequential's input is named `input`; a copy must not rename it to
    # `input_1`, or the ExportedProgram's signature no longer matches.
    class Noop(BranchyardPass):
        name = "noop"

        def run(self, gm):
            return False

    ep = torch.export.export(torch.nn.Sequential(torch.nn.Linear(4, 4)), (torch.randn(2, 4),))
    out = apply_pass(ep, Noop())
    assert [n.name for n in out.graph.nodes if n.op == "placeholder"] == [
        n.name for n in ep.graph.nodes if n.op == "placeholder"
    ]
    x = torch.randn(2, 4)
    torch.testing.assert_close(out.module()(x), ep.module()(x))


# --------------------------------------------------------------------------- checking once

import copy  # noqa: E402

from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from branchyard._compat import HAS_SWITCH  # noqa: E402
from branchyard.fx.graph_walk import iter_graph_modules  # noqa: E402
from branchyard.passes import cond_to_switch, switch_to_cond  # noqa: E402

X = torch.tensor([0.5, -1.0, 2.0])


class Nested(torch.nn.Module):
    """idx == 0 ? x * 2 : (idx == 1 ? x + 1 : x - 1): a cond tree cond_to_switch rewrites."""

    def forward(self, idx, x):
        def inner(x, idx):
            return torch.cond(idx == 1, lambda x: x + 1, lambda x: x - 1, (x,))

        return torch.cond(idx == 0, lambda x, idx: x * 2, inner, (x, idx))


def _count_lints(monkeypatch) -> list[int]:
    """Graphs linted by our checks (torch's own -- its DCE, the ExportedProgram
    verifier -- lint too, and are not counted)."""
    import sys

    calls: list[int] = []
    real = torch.fx.Graph.lint

    def counting(self):
        if sys._getframe(1).f_code.co_name == "lint_graph_module":
            calls.append(id(self))
        return real(self)

    monkeypatch.setattr(torch.fx.Graph, "lint", counting)
    return calls


def _graphs(program) -> int:
    gm = program.graph_module if isinstance(program, torch.export.ExportedProgram) else program
    return len(list(iter_graph_modules(gm)))


@pytest.mark.parametrize("kind", ["exported", "graph_module"])
def test_function_form_lints_input_once_and_result_once(monkeypatch, kind):
    ep = torch.export.export(Nested(), (torch.tensor(0), X))
    program = ep if kind == "exported" else copy.deepcopy(ep.graph_module)
    calls = _count_lints(monkeypatch)
    out = cond_to_switch(program)
    # Every graph of the input once (before copying), every graph of the result
    # once (after the one modifying pass). The pass itself, the pipeline's
    # PassManager and the function form used to lint again: up to six times.
    assert len(calls) == _graphs(program) + _graphs(out), len(calls)
    calls.clear()
    again = cond_to_switch(out)  # nothing left to rewrite: the input lint only
    assert len(calls) == _graphs(out) and _graphs(again) == _graphs(out)


def test_pass_called_on_its_own_checks_its_input_and_its_output(monkeypatch):
    gm = _gm()
    calls = _count_lints(monkeypatch)
    assert AddToMul()(gm).modified
    assert len(calls) == 2  # requires() before, ensures() after a modifying run
    calls.clear()
    assert not AddToMul()(gm).modified
    assert len(calls) == 1


def test_result_is_realized_once_and_eager(monkeypatch):
    from torch.fx._lazy_graph_module import _LazyGraphModule

    import branchyard.fx.pass_infra as pass_infra

    ep = torch.export.export(Nested(), (torch.tensor(0), X))
    realized: list[int] = []
    real = pass_infra.realize_graph_modules
    monkeypatch.setattr(pass_infra, "realize_graph_modules", lambda gm: realized.append(1) or real(gm))
    out = cond_to_switch(ep)
    assert realized == [1]
    assert not any(isinstance(m, _LazyGraphModule) for m in iter_graph_modules(out.graph_module))


# --------------------------------------------------------------------------- malformed graphs, both entry points


def _cond_ep():
    return torch.export.export(Nested(), (torch.tensor(0), X))


def _outer_cond(gm):
    return next(n for n in gm.graph.nodes if n.target is torch.ops.higher_order.cond)


def _cond_dtype_mismatch(gm):
    gm.true_graph_0 = make_fx(lambda x, idx: (x.double(),))(X, torch.tensor(0))


def _cond_shape_mismatch(gm):
    gm.true_graph_0 = make_fx(lambda x, idx: (x.repeat(2),))(X, torch.tensor(0))


def _cond_wrong_arity(gm):
    gm.true_graph_0 = make_fx(lambda x: (x * 2,))(X)


COND_DEFECTS = {
    "dtype": (_cond_dtype_mismatch, r"node 'cond'.*output 0 is torch.float64 in true branch but torch.float32"),
    "shape": (_cond_shape_mismatch, r"node 'cond'.*output 0 has shape \(6,\) in true branch but \(3,\)"),
    "arity": (_cond_wrong_arity, r"node 'cond'.*true branch takes 1 inputs but the node passes 2 operands"),
}


def _entry(ep, entry):
    return ep if entry == "exported" else copy.deepcopy(ep.graph_module)


@pytest.mark.parametrize("entry", ["exported", "graph_module"])
@pytest.mark.parametrize("defect", sorted(COND_DEFECTS))
def test_malformed_cond_raises_our_error_through_both_entry_points(defect, entry):
    ep = _cond_ep()
    break_it, message = COND_DEFECTS[defect]
    break_it(ep.graph_module)
    ep.graph_module.recompile()
    with pytest.raises(MalformedGraphError, match=message):
        cond_to_switch(_entry(ep, entry))


class Switch3(torch.nn.Module):
    def forward(self, i, x):
        from torch._higher_order_ops.switch import switch

        return switch(i, [lambda x: x + 1, lambda x: x * 2, lambda x: x.sin()], (x,))


def _switch_node(gm):
    return next(n for n in gm.graph.nodes if n.target is torch.ops.higher_order.switch)


def _switch_float_index(gm):
    node = _switch_node(gm)
    x = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == "x")
    with gm.graph.inserting_before(node):
        f = gm.graph.call_function(torch.ops.aten.sum.default, (x,))
    f.meta["val"] = x.meta["val"].sum()
    node.args = (f, *node.args[1:])


def _switch_zero_branches(gm):
    node = _switch_node(gm)
    node.args = (node.args[0], [], node.args[2])


def _switch_dtype_mismatch(gm):
    node = _switch_node(gm)
    setattr(gm, node.args[1][1].target, make_fx(lambda x: (x.double(),))(X))


def _switch_shape_mismatch(gm):
    node = _switch_node(gm)
    setattr(gm, node.args[1][2].target, make_fx(lambda x: (x.repeat(2),))(X))


def _switch_wrong_arity(gm):
    node = _switch_node(gm)
    setattr(gm, node.args[1][0].target, make_fx(lambda x, y: (x + y,))(X, X))


SWITCH_DEFECTS = {
    "float_index": (_switch_float_index, r"node 'switch'.*index has dtype torch.float32"),
    "zero_branches": (_switch_zero_branches, r"node 'switch'.*zero branches"),
    "dtype": (_switch_dtype_mismatch, r"node 'switch'.*output 0 is torch.float32 in branch 0 but torch.float64 in branch 1"),
    "shape": (_switch_shape_mismatch, r"node 'switch'.*output 0 has shape \(3,\) in branch 0 but \(6,\) in branch 2"),
    "arity": (_switch_wrong_arity, r"node 'switch'.*branch 0 takes 2 inputs but the node passes 1 operands"),
}


@pytest.mark.skipif(not HAS_SWITCH, reason="torch.switch needs torch >= 2.14")
@pytest.mark.parametrize("entry", ["exported", "graph_module"])
@pytest.mark.parametrize("defect", sorted(SWITCH_DEFECTS))
def test_malformed_switch_raises_our_error_through_both_entry_points(defect, entry):
    ep = torch.export.export(Switch3(), (torch.tensor(0), X))
    break_it, message = SWITCH_DEFECTS[defect]
    break_it(ep.graph_module)
    ep.graph_module.recompile()
    with pytest.raises(MalformedGraphError, match=message):
        switch_to_cond(_entry(ep, entry))


def test_other_errors_of_a_pass_reach_the_caller_unwrapped():
    class Boom(BranchyardPass):
        name = "boom"

        def run(self, gm):
            raise ValueError("boom inside the pass")

    ep = torch.export.export(Nested(), (torch.tensor(0), X))
    for program in (ep, copy.deepcopy(ep.graph_module)):
        # The pass's own error, not torch's PassManager wrapper naming an internal step.
        with pytest.raises(ValueError, match="boom inside the pass"):
            apply_pass(program, Boom())


class MulToSub(AddToMul):
    """x * y  ->  x - y (a second graph pass, to see the order passes ran in)."""

    name = "mul_to_sub"
    source, replacement = torch.mul, torch.sub


class WholeProgram(BranchyardPass):
    """A pass that rewrites whole programs: it sees the program as the passes
    before it left it and hands back its own result."""

    name = "whole_program"

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list] = []

    def run(self, gm: GraphModule) -> bool:
        raise AssertionError("a program-level pass is not run as a graph pass")

    def rewrite_program(self, program):
        from branchyard.fx.pass_infra import PipelineResult

        self.seen.append([n.target for n in program.graph.nodes if n.op == "call_function"])
        self.report.stats["saw"] = len(self.seen)
        return PipelineResult(program, False, [self.report])


def test_a_program_level_pass_runs_between_the_graph_passes_around_it():
    gm = _gm()
    whole = WholeProgram()
    first, last = AddToMul(), MulToSub()
    result = Pipeline([first, whole, last])(gm)
    assert whole.seen == [[torch.mul, torch.add]]  # after add_to_mul, before mul_to_sub
    assert [n.target for n in result.program.graph.nodes if n.op == "call_function"] == [torch.sub, torch.add]
    assert result.modified is True
    assert result.reports == [first.report, whole.report, last.report]
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == [torch.add, torch.add], "input must not be mutated"
    # run_graph_passes does not delegate
    with pytest.raises(AssertionError, match="not run as a graph pass"):
        Pipeline([whole]).run_graph_passes(gm)
