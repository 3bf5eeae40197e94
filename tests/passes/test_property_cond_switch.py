"""Property tests: cond_to_switch and switch_to_cond (and their compositions)
preserve the program on every control-flow path of random nested cond trees.

Trees come from :func:`branchyard.testing.strategies.cond_tree_specs`: depth
<= 6, random shapes, one or two outputs, predicates from bool inputs, from
``idx == k`` chains and computed inside branches from float inputs, leaves
closing over a shared parameter, private parameters, a buffer and the outer
cond's intermediate value. Every branch is reachable, so assert_equivalent
must reach full coverage on each program.
"""

from __future__ import annotations

import pytest
import torch

from branchyard._compat import HAS_SWITCH

from hypothesis import HealthCheck, example, given, settings

from branchyard.fx.graph_walk import iter_graph_modules
from branchyard.testing import assert_equivalent
from branchyard.testing.strategies import Cond, CondTreeSpec, Leaf, Pred, cond_tree_specs, switch_specs

pytestmark = pytest.mark.skipif(not HAS_SWITCH, reason="needs torch.ops.higher_order.switch (torch >= 2.14)")

if HAS_SWITCH:
    from branchyard.passes.cond_to_switch import cond_to_switch
    from branchyard.passes.switch_to_cond import switch_to_cond

#: First-round input sets per comparison (more are searched only while a branch is undriven).
N = 128
COND = torch.ops.higher_order.cond
SWITCH = getattr(torch.ops.higher_order, "switch", None)

# CI-friendly: a few dozen trees, no per-example deadline (export takes ~0.3-3 s).
PROPERTY = settings(
    max_examples=24,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _nodes(ep, target) -> list[torch.fx.Node]:
    return [n for gm in iter_graph_modules(ep.graph_module) for n in gm.graph.nodes if n.target is target]


def _placeholders(ep) -> int:
    return sum(n.op == "placeholder" for gm in iter_graph_modules(ep.graph_module) for n in gm.graph.nodes)


def _nested_conds(ep) -> list[str]:
    """Conds with another cond directly inside one of their branches."""
    out = []
    for gm in iter_graph_modules(ep.graph_module):
        for n in gm.graph.nodes:
            if n.target is COND:
                for b in n.args[1:3]:
                    if any(m.target is COND for m in getattr(gm, b.target).graph.nodes):
                        out.append(n.name)
    return out


def _dispatch_chain(depth: int) -> CondTreeSpec:
    """idx == 0 ? a : idx == 1 ? b : ... : fall-through, every leaf capturing."""
    node: object = Leaf(-1.0, 2.0, ("shared", "outer"))
    for k in reversed(range(depth)):
        node = Cond(Pred("idx_eq", k), Leaf(1.5, float(k), ("private", "buffer")), node, 0.5)
    return CondTreeSpec(node, (2, 3), 2)


def _mixed_depth6() -> CondTreeSpec:
    """Depth 6 mixing all three predicate kinds."""
    leaf = Leaf(3.0, -0.5, ("outer",))
    inner = Cond(Pred("computed", 1, -1.0), Leaf(0.5, 1.0, ("shared",)), leaf)
    inner = Cond(Pred("flag", 2), inner, Leaf(-2.0, 0.0, ("private", "outer")))
    inner = Cond(Pred("idx_eq", 1), Leaf(1.0, 1.0, ("buffer",)), inner)
    inner = Cond(Pred("computed", 0), inner, Leaf(-0.5, 3.0, ("shared", "private")))
    inner = Cond(Pred("idx_eq", 0), Leaf(2.0, -1.0, ()), inner)
    root = Cond(Pred("flag", 0), inner, Leaf(1.0, 0.0, ("outer", "buffer")))
    return CondTreeSpec(root, (4,), 1)


def _alike_leaves() -> CondTreeSpec:
    """Every leaf the same function: the tree becomes that leaf, no switch."""
    leaf = Leaf(-2.0, -2.0, ())
    return CondTreeSpec(Cond(Pred("flag", 0), Cond(Pred("flag", 1), leaf, leaf, -2.0), leaf, -2.0), (1,), 1)


def _deep_computed_branch() -> CondTreeSpec:
    """A branch five decisions deep behind two computed predicates: compared
    with switch_to_cond's tree, whose decisions dilute a random search, it was
    never driven until the search started from inputs reaching its cond."""
    inner = Cond(Pred("flag", 1), Leaf(-0.5, 1.5, ("outer",)),
                 Cond(Pred("computed", 0, -1.0), Leaf(-2.0, 1.5, ()), Leaf(-2.0, 3.0, ()), 1.0), 1.5)
    other = Cond(Pred("flag", 1), Cond(Pred("computed", 0), Leaf(-1.0, 1.5, ()), Leaf(1.0, -0.5, ()), 3.0),
                 Leaf(-1.0, 1.0, ("buffer",)), -0.5)
    tree = Cond(Pred("flag", 2), Cond(Pred("computed", 1, -1.0), inner, other, 3.0), Leaf(-0.5, 3.0, ("shared",)), -2.0)
    tree = Cond(Pred("idx_eq", 1), tree, Cond(Pred("idx_eq", 2), Leaf(-1.0, 1.0, ()),
                                              Leaf(1.5, 3.0, ("private", "buffer", "outer")), -1.0), 0.5)
    return CondTreeSpec(Cond(Pred("flag", 0), tree, Leaf(-1.0, -1.0, ("private",)), 3.0), (1,), 2)


def _rare_switch_index() -> CondTreeSpec:
    """A switch index taken by one combination of six decisions: reached by
    changing two or three inputs of an input set that takes another index."""
    def flag0(on_true, on_false, mix):
        return Cond(Pred("flag", 0), on_true, on_false, mix)

    low = flag0(Leaf(-2.0, 3.0, ()), Cond(Pred("computed", 0), Leaf(1.0, 1.5, ("private", "buffer", "shared")),
                                          Leaf(-1.0, -1.0, ()), 3.0), -1.0)
    high = Cond(Pred("computed", 0, -1.0), flag0(Leaf(-1.0, 1.5, ()), Leaf(3.0, 1.5, ("private", "shared", "outer")), -0.5),
                flag0(Leaf(3.0, 1.5, ()), Leaf(3.0, 0.5, ()), -2.0), 3.0)
    tree = Cond(Pred("flag", 1), Leaf(-1.0, -1.0, ()), Cond(Pred("computed", 1), low, high, 3.0), 1.0)
    tree = Cond(Pred("flag", 2), tree, Leaf(-0.5, 1.0, ("private", "buffer", "outer")), -2.0)
    return CondTreeSpec(Cond(Pred("idx_eq", 1), tree, Leaf(1.0, 0.5, ()), -2.0), (2,), 2)


@PROPERTY
@given(spec=cond_tree_specs(max_depth=6, max_conds=8))
@example(spec=_dispatch_chain(4))
@example(spec=_mixed_depth6())
@example(spec=_alike_leaves())
@example(spec=_deep_computed_branch())
@example(spec=_rare_switch_index())
def test_cond_switch_rewrites_preserve_every_path(spec: CondTreeSpec) -> None:
    ep, args = spec.export()
    # The generator's own contract: export matches the Python-if reference
    # on every path, and every branch is reachable.
    base = assert_equivalent(ep, spec.reference_module(), args, max_input_sets=N)
    assert base.covered == base.required
    assert len(base.required) == 2 * spec.num_conds

    # The default flattens what its cost model finds profitable; it must
    # preserve every path too, and never add placeholders.
    costed = cond_to_switch(ep)
    assert _placeholders(costed) <= _placeholders(ep)
    assert_equivalent(ep, costed, args, max_input_sets=N)

    switched = cond_to_switch(ep, flatten="all")
    assert _nested_conds(switched) == [], "a cond tree of depth >= 2 survived cond_to_switch(flatten='all')"
    switches = _nodes(switched, SWITCH)
    if spec.depth >= 2:
        # A tree becomes a switch, unless leaves that compute the same function
        # merged it into fewer conds (all of them alike: the leaf itself).
        assert switches or len(_nodes(switched, COND)) < spec.num_conds, \
            "cond_to_switch left a nested cond tree without a switch"
    for sw in switches:
        ops = sw.args[2]
        assert len(set(ops)) == len(ops), f"switch {sw.name} passes an operand twice"
        assert len(sw.args[1]) <= spec.num_conds + 1
    assert_equivalent(ep, switched, args, max_input_sets=N)

    lowered = switch_to_cond(switched)
    assert _nodes(lowered, SWITCH) == []
    assert_equivalent(ep, lowered, args, max_input_sets=N)
    # The switch program as the reference: every switch branch driven.
    assert_equivalent(switched, lowered, args, max_input_sets=N)

    again = cond_to_switch(lowered, flatten="all")
    assert _nested_conds(again) == []
    assert_equivalent(ep, again, args, max_input_sets=N)


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(spec=switch_specs(max_branches=6))
def test_switch_to_cond_on_torch_switches_preserves_every_index(spec) -> None:
    """torch's own switch (index clamped by a preceding aten.clamp), possibly
    nested: switch_to_cond, and cond_to_switch after it, agree with it on
    every index, including out-of-range ones below and above."""
    ep, args = spec.export()
    lowered = switch_to_cond(ep)
    assert _nodes(lowered, SWITCH) == []
    report = assert_equivalent(ep, lowered, args, max_input_sets=N)
    # idx's switch is clamped: below/above range were driven, per switch.
    assert {label for _, label in report.covered} >= {"below range", "above range"}
    assert report.covered == report.required
    back = cond_to_switch(lowered)
    assert_equivalent(ep, back, args, max_input_sets=N)
