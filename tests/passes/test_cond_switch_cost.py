"""cond_to_switch never makes a program larger or slower: the cost model
flattens only the levels that pay, and the report names what it kept nested.

Structural checks (placeholders, control-flow calls on every path) on the
balanced trees and dispatch chains of ``benchmarks/cond_switch.py``; the
timing side is the benchmark's job (docs/benchmarks.md).
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from branchyard._compat import HAS_SWITCH

if not HAS_SWITCH:
    pytest.skip("needs torch.ops.higher_order.switch (torch >= 2.14)", allow_module_level=True)

from torch.fx.experimental.proxy_tensor import make_fx

from branchyard.errors import BranchyardError
from branchyard.examples.builder import build_dispatch_program
from branchyard.inspection import graph_stats
from branchyard.passes import CondToSwitch, cond_to_switch
from branchyard.fx.control_flow import is_cond, is_switch
from branchyard.passes.flatten_cost import FlattenCostModel

cond = torch.cond


def all_nodes(gm):
    for m in gm.modules():
        if isinstance(m, torch.fx.GraphModule):
            yield from m.graph.nodes


def control_flow_calls(program, *args) -> int:
    """cond/switch calls one eager run makes (host reads of a predicate or index)."""
    gm = program
    count = [0]
    real = torch.Tensor.__bool__, torch.Tensor.item

    def counted(fn):
        def wrapper(self, *a, **k):
            count[0] += 1
            return fn(self, *a, **k)
        return wrapper

    torch.Tensor.__bool__, torch.Tensor.item = counted(real[0]), counted(real[1])
    try:
        with torch.no_grad():  # with grad, eager cond traces its branches for backward on every call
            out = gm(*args)
    finally:
        torch.Tensor.__bool__, torch.Tensor.item = real
    return count[0], out


def run_pass(gm, flatten="cost"):
    p = CondToSwitch(flatten)
    res = p(copy.deepcopy(gm))
    return res.graph_module, res.modified, p.report


@pytest.mark.parametrize("depth", range(1, 8))
def test_balanced_tree_placeholders_never_grow(depth):
    ep = build_dispatch_program(2**depth, dim=4, batch=2, split="tree")
    out = cond_to_switch(ep)
    before, after = graph_stats(ep), graph_stats(out)
    assert after.placeholders <= before.placeholders
    assert after.control_flow_nodes <= before.control_flow_nodes
    if depth >= 2:
        assert after.control_flow["switch"] >= 1  # it still flattens what pays


@pytest.mark.parametrize("depth", [3, 4, 5])
def test_balanced_tree_report_names_what_was_kept_nested_and_why(depth):
    ep = build_dispatch_program(2**depth, dim=4, batch=2, split="tree")
    _, modified, report = run_pass(ep.graph_module)
    assert modified
    cut = [s for s in report.skips if s.reason.startswith("flattened 2 of")]
    assert cut, [s.reason for s in report.skips]
    assert f"flattened 2 of {depth} levels; 4 cond(s) below level 2 kept nested" in cut[0].reason
    assert "3 levels would give a switch of 8 branches" in cut[0].reason and "placeholders" in cut[0].reason
    assert report.stats["conds_kept_nested_by_cost"] >= 4


@pytest.mark.parametrize("depth", [2, 3, 4, 5])
def test_balanced_tree_same_outputs_and_no_more_host_reads_on_every_path(depth):
    ep = build_dispatch_program(2**depth, dim=4, batch=2, split="tree")
    before, after = ep.module(), cond_to_switch(ep).module()
    x = torch.randn(2, 4)
    for i in range(-2, 2**depth + 2):
        idx = torch.tensor(i)
        n_before, ref = control_flow_calls(before, x, idx)
        n_after, got = control_flow_calls(after, x, idx)
        torch.testing.assert_close(got, ref)
        assert n_after <= n_before
        if depth >= 2:
            assert n_after < n_before  # two levels per read at least at the top


@pytest.mark.parametrize("experts", [4, 8, 16])
def test_dispatch_chains_still_become_one_switch(experts):
    ep = build_dispatch_program(experts, dim=4, batch=2, split="chain")
    out = cond_to_switch(ep)
    st = graph_stats(out)
    assert st.control_flow == {"cond": 0, "switch": 1, "while_loop": 0}
    assert st.placeholders < graph_stats(ep).placeholders


def test_flatten_all_keeps_the_single_switch_and_its_cost():
    """flatten='all' is the old behaviour: one switch, more placeholders."""
    ep = build_dispatch_program(8, dim=4, batch=2, split="tree")
    out = cond_to_switch(ep, flatten="all")
    st = graph_stats(out)
    assert st.control_flow == {"cond": 0, "switch": 1, "while_loop": 0}
    assert st.placeholders > graph_stats(ep).placeholders


def test_flatten_policy_is_checked():
    with pytest.raises(BranchyardError, match="flatten='some'"):
        CondToSwitch("some")


def _heavy(x):
    for k in range(12):
        x = x * 1.01 + 0.1 * k
    return x.sum() > 0


def test_expensive_predicates_are_left_nested_by_the_time_estimate():
    """Leaves share one operand (placeholders are no issue), but each nested
    predicate costs a dozen ops: evaluating all of them on every call costs
    more than the conds it would save, so the tree stays nested."""

    def f(p, x):
        left = lambda x: cond(_heavy(x), lambda x: x + 1, lambda x: x - 1, (x,))  # noqa: E731
        right = lambda x: cond(_heavy(-x), lambda x: x * 2, lambda x: x * 3, (x,))  # noqa: E731
        return cond(p, left, right, (x,))

    x = torch.randn(4)
    gm = make_fx(f)(torch.tensor(True), x)
    after, modified, report = run_pass(gm)
    assert not modified
    assert report.stats["trees_left_nested_by_cost"] == 1
    (skip,) = [s for s in report.skips if "cost model" in s.reason]
    assert "2 levels would cost about" in skip.reason and "nested conds" in skip.reason
    flat, modified_all, _ = run_pass(gm, "all")
    assert modified_all and sum(is_switch(n) for n in all_nodes(flat)) == 1
    for p, s in itertools.product((True, False), (1.0, -1.0)):
        args = (torch.tensor(p), x * s)
        torch.testing.assert_close(flat(*args), gm(*args))


def test_cheap_predicates_with_shared_operands_are_flattened():
    def f(p, q, r, x):
        left = lambda q, r, x: cond(q, lambda x: x + 1, lambda x: x - 1, (x,))  # noqa: E731
        right = lambda q, r, x: cond(r, lambda x: x * 2, lambda x: x * 3, (x,))  # noqa: E731
        return cond(p, left, right, (q, r, x))

    x = torch.randn(4)
    gm = make_fx(f)(torch.tensor(True), torch.tensor(True), torch.tensor(True), x)
    after, modified, report = run_pass(gm)
    assert modified and not any(is_cond(n) for n in all_nodes(after))
    assert report.stats["conds_kept_nested_by_cost"] == 0 and report.skips == []
    for p, q, r in itertools.product((True, False), repeat=3):
        args = (torch.tensor(p), torch.tensor(q), torch.tensor(r), x)
        torch.testing.assert_close(after(*args), gm(*args))


def test_cost_model_arithmetic():
    m = FlattenCostModel(call=10, per_operand=1, per_branch=2, per_op=3)
    assert m.switch_cost(operands=5, branches=4, index_ops=2) == 10 + 5 + 8 + 6
    assert m.cond_cost(operands=5, pred_ops=2) == 10 + 5 + 4 + 6
