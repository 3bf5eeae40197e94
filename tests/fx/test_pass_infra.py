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

    def run(self, gm: GraphModule) -> bool:
        changed = False
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target is torch.add:
                if not all(isinstance(a, torch.fx.Node) for a in node.args):
                    self.skip(node, "constant operand")
                    continue
                node.target = torch.mul
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
