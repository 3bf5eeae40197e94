"""branchyard.inspection and the shipped example programs (branchyard.examples)."""

from __future__ import annotations

import json

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from branchyard.errors import BranchyardError
from branchyard.examples import CondTree, ExpertDispatch, example_inputs, example_program, export_example
from branchyard.examples.builder import build_dispatch_program
from branchyard.inspection import graph_stats, inspect_program
from branchyard.passes import cond_to_switch


def _targets(gm: torch.fx.GraphModule) -> list[list[str]]:
    """Per graph (root, then submodules by name): op and target of every node."""
    mods = [gm] + [m for _, m in sorted(gm.named_modules()) if isinstance(m, torch.fx.GraphModule) and m is not gm]
    return [[f"{n.op}:{getattr(n.target, '__name__', n.target)}" for n in m.graph.nodes] for m in mods]


@pytest.mark.parametrize(("name", "size", "experts"), [("expert-dispatch", 3, 3), ("cond-tree", 2, 4)])
def test_built_program_is_the_exported_graph(name, size, experts):
    traced = export_example(name, size, dim=4)
    built = example_program(name, size, dim=4)
    assert graph_stats(built) == graph_stats(traced)
    assert _targets(built.graph_module) == _targets(traced.graph_module)
    assert [s.arg.name for s in built.graph_signature.input_specs] == [
        s.arg.name for s in traced.graph_signature.input_specs
    ]
    x, _ = example_inputs(ExpertDispatch(2, dim=4))
    with torch.no_grad():
        for i in range(-1, experts + 1):
            idx = torch.tensor(i)
            torch.testing.assert_close(built.module()(x, idx), traced.module()(x, idx))


@pytest.mark.parametrize(
    ("module", "split", "n"), [(ExpertDispatch(5, dim=8), "chain", 5), (CondTree(3, dim=8), "tree", 8)]
)
def test_built_program_matches_eager_module_on_every_path(module, split, n):
    program = build_dispatch_program(n, dim=8, split=split)
    x, _ = example_inputs(module)
    with torch.no_grad():
        for i in range(-2, n + 2):
            idx = torch.tensor(i)
            expected = module(x, idx)
            torch.testing.assert_close(program.module()(x, idx), expected)
            # and the selected expert is the documented one
            k = (i if 0 <= i < n else n - 1) if split == "chain" else min(max(i, 0), n - 1)
            torch.testing.assert_close(expected, module.experts[k](x))


def test_stacked_layers_share_idx_and_count_conds():
    program = build_dispatch_program(3, dim=4, split="chain", layers=4)
    stats = graph_stats(program)
    assert stats.control_flow == {"cond": 8, "switch": 0, "while_loop": 0}
    assert len(program.state_dict) == 4 * 3 * 2
    assert "layers.3.experts.2.bias" in program.state_dict


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"num_experts": 1}, "num_experts >= 2"), ({"num_experts": 4, "split": "ring"}, "unknown split 'ring'")],
)
def test_builder_rejects_bad_arguments(kwargs, match):
    with pytest.raises(BranchyardError, match=match):
        build_dispatch_program(**kwargs)


def test_inspect_dispatch_chain():
    summary = inspect_program(build_dispatch_program(4, dim=8, split="chain"))
    s = summary.stats
    # root + a true/false pair per cond
    assert (s.subgraphs, s.control_flow["cond"]) == (6, 3)
    # cond k passes x, idx and the (weight, bias) of experts k..3
    assert s.control_flow_operands == (2 + 8) + (2 + 6) + (2 + 4)
    (tree,) = summary.cond_trees
    assert (tree.graph, tree.depth, tree.conds, tree.leaves, tree.unique_leaves) == ("<root>", 3, 3, 4, 4)
    assert tree.dispatch_chain
    assert {"x", "idx", "p_experts_3_weight"} <= set(tree.duplicated_operands)
    assert tree.operands_before == 24
    assert tree.rewrite.startswith("cond_to_switch: 3 conds -> 1 switch over 4 branches")
    assert summary.switches == [] and summary.while_loops == []
    # every expert is a linear with only its own bias: found, and declined
    assert len(summary.epilogue_chains) == 4
    assert not any(c.fusable for c in summary.epilogue_chains)
    assert all(c.rewrite.startswith("nvgemm declines:") for c in summary.epilogue_chains)
    text = summary.format()
    assert "cond trees (1):" in text and "idx == k dispatch chain" in text and "operands 24 ->" in text


def test_inspect_tree_is_not_a_dispatch_chain():
    (tree,) = inspect_program(build_dispatch_program(8, dim=4, split="tree")).cond_trees
    assert (tree.depth, tree.conds, tree.leaves, tree.dispatch_chain) == (3, 7, 8, False)


def test_inspect_after_cond_to_switch_lists_the_switch():
    summary = inspect_program(cond_to_switch(build_dispatch_program(4, dim=8)))
    assert summary.cond_trees == []
    assert summary.stats.control_flow == {"cond": 0, "switch": 1, "while_loop": 0}
    (sw,) = summary.switches
    assert sw.branches == 4 and sw.operands < 24
    assert sw.rewrite.startswith("switch_to_cond: -> 3 nested conds")
    assert "switches (1):" in summary.format()


def test_lone_cond_is_a_note_not_a_tree():
    summary = inspect_program(build_dispatch_program(2, dim=4))
    assert summary.cond_trees == []
    assert summary.stats.control_flow["cond"] == 1
    assert summary.notes == ["1 cond(s) outside any nested tree: cond_to_switch leaves a lone cond as it is"]


def test_inspect_while_loop_and_fusable_chain():
    from torch._higher_order_ops.while_loop import while_loop

    def f(i, x, w, b):
        n, y = while_loop(lambda i, x: i < 3, lambda i, x: (i + 1, x @ w), (i, x))
        return torch.relu(y @ w + b)

    gm = make_fx(f)(torch.tensor(0), torch.randn(4, 4), torch.randn(4, 4), torch.randn(4))
    summary = inspect_program(gm)
    (loop,) = summary.while_loops
    assert (loop.graph, loop.carried, loop.additional) == ("<root>", 2, 1)
    root_chains = [c for c in summary.epilogue_chains if c.graph == "<root>"]
    assert len(root_chains) == 1 and root_chains[0].fusable
    assert root_chains[0].steps[-1] == "relu"
    assert root_chains[0].rewrite.startswith("nvgemm: ")
    # the matmul inside the loop body is found too (and declined: nothing after it)
    assert any(c.graph.startswith("while_loop_body") and not c.fusable for c in summary.epilogue_chains)


def test_summary_is_json_serializable():
    data = inspect_program(build_dispatch_program(3, dim=4)).to_dict()
    again = json.loads(json.dumps(data))
    assert again["stats"]["control_flow_nodes"] == 2
    assert again["cond_trees"][0]["leaves"] == 3


def test_inspect_rejects_non_programs():
    with pytest.raises(BranchyardError, match="expected a torch.export.ExportedProgram or torch.fx.GraphModule, got str"):
        inspect_program("model.pt2")


@pytest.mark.parametrize(("split", "n"), [("chain", 4), ("tree", 4)])
def test_rewritten_example_computes_the_same(split, n):
    """The shipped example through cond_to_switch: same tensor on every path."""
    program = build_dispatch_program(n, dim=4, split=split)
    rewritten = cond_to_switch(program)
    assert graph_stats(rewritten).control_flow["switch"] == 1
    x = torch.randn(4, 4)
    with torch.no_grad():
        for i in range(-2, n + 2):
            idx = torch.tensor(i)
            out = rewritten.module()(x, idx)
            assert isinstance(out, torch.Tensor), f"idx={i}: {type(out).__name__}"
            torch.testing.assert_close(out, program.module()(x, idx))
