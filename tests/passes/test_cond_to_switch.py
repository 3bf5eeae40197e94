"""cond_to_switch: structure, semantics on every branch, index forms, skips, errors."""

from __future__ import annotations

import copy
import itertools
import operator

import pytest
import torch

from branchyard._compat import HAS_SWITCH

if not HAS_SWITCH:  # torch < 2.14 (e.g. the GPU machine): nothing to rewrite to
    pytest.skip("needs torch.ops.higher_order.switch (torch >= 2.14)", allow_module_level=True)

from torch.fx.experimental.proxy_tensor import make_fx

from branchyard.errors import MalformedGraphError
from branchyard.fx.control_flow import AttrSink, inline_graph, is_cond, is_switch, returns_sequence
from branchyard.passes import CondToSwitch, cond_to_switch, find_cond_trees
from branchyard.registry import get_pass
from branchyard.testing import assert_equivalent

aten = torch.ops.aten
cond = torch.cond


# --------------------------------------------------------------------------- helpers


def all_nodes(gm):
    for m in gm.modules():
        if isinstance(m, torch.fx.GraphModule):
            yield from m.graph.nodes


def n_conds(gm) -> int:
    return sum(is_cond(n) for n in all_nodes(gm))


def switch_nodes(gm) -> list:
    return [n for n in all_nodes(gm) if is_switch(n)]


def targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def gm_of(p):
    return p.graph_module if isinstance(p, torch.export.ExportedProgram) else p


def run(p, *args):
    fn = p.module() if isinstance(p, torch.export.ExportedProgram) else p
    return fn(*args)


def assert_same(before, after, inputs):
    for args in inputs:
        torch.testing.assert_close(run(after, *args), run(before, *args), msg=lambda m: f"{m}\ninputs {args}")


def rewrite(p):
    """Run the pass object once and return (program, pass) so tests can read the report."""
    gm = copy.deepcopy(gm_of(p))
    cts = CondToSwitch()
    res = cts(gm)
    return res, cts


X = torch.tensor([0.5, -1.0, 2.0])
Y = torch.tensor([1.5, 0.25, -0.75])


# --------------------------------------------------------------------------- a two-sided tree


class TwoSided(torch.nn.Module):
    """p ? (q ? x + y : x - y) : (x.sum() > 0 ? x * y : x + y); the inner predicate lives in a branch."""

    def forward(self, p, q, x, y):
        def t(x, y, q):
            return cond(q, lambda x, y: x + y, lambda x, y: x - y, (x, y))

        def f(x, y, q):
            return cond(x.sum() > 0, lambda x, y: x * y, lambda x, y: x + y, (x, y))

        return cond(p, t, f, (x, y, q))


def two_sided_inputs():
    for p, q, s in itertools.product((True, False), (True, False), (1.0, -1.0)):
        yield torch.tensor(p), torch.tensor(q), X.abs() * s, Y


@pytest.fixture(scope="module")
def two_sided_ep():
    return torch.export.export(TwoSided(), (torch.tensor(True), torch.tensor(False), X, Y))


def test_two_sided_tree_becomes_one_switch_with_deduplicated_leaves(two_sided_ep):
    after = cond_to_switch(two_sided_ep)
    gm = after.graph_module
    assert n_conds(gm) == 0
    (sw,) = switch_nodes(gm)
    index, branches, operands = sw.args
    assert len(branches) == 3  # 4 leaves; x + y appears twice
    assert [o.name for o in operands] == ["x", "y"]  # q dropped: no leaf reads it
    # the inner predicate was hoisted next to the switch
    assert aten.sum.default in targets(gm) and aten.gt.Scalar in targets(gm)
    assert_same(two_sided_ep, after, two_sided_inputs())


def test_report_stats_and_modified_flag(two_sided_ep):
    res, p = rewrite(two_sided_ep)
    assert res.modified
    assert p.report.stats["cond_trees"] == 1
    assert p.report.stats["conds_removed"] == 3
    assert p.report.stats["switches_created"] == 1
    assert p.report.stats["leaves"] == 4
    assert p.report.stats["branches_after_dedup"] == 3
    assert p.report.stats["operands_before"] == 3 + 2 + 2
    assert p.report.stats["operands_after"] == 2


def test_find_cond_trees_reports_without_mutating(two_sided_ep):
    gm = two_sided_ep.graph_module
    code = gm.code
    (tree,) = find_cond_trees(gm)
    assert gm.code == code and n_conds(gm) == 3
    assert (tree.depth, tree.num_leaves, tree.num_unique_leaves) == (2, 4, 3)
    assert (tree.operands_before, tree.operands_after) == (7, 2)
    assert tree.duplicated_operands == ["x", "y"]  # each passed to all three conds
    assert not tree.is_dispatch_chain and tree.index_form == "general"
    assert tree.root.name == "cond" and tree.owner is gm


def test_idempotent_and_second_run_unmodified(two_sided_ep):
    once = cond_to_switch(two_sided_ep)
    res, _ = rewrite(once)
    assert not res.modified
    assert res.graph_module.code == once.graph_module.code


def test_registered_for_the_cli():
    assert isinstance(get_pass("cond_to_switch"), CondToSwitch)
    assert CondToSwitch.name == "cond_to_switch"


# --------------------------------------------------------------------------- dispatch chains


def chain_fn(constants, op="eq", reflected=False, leaves=None):
    """idx == k0 ? L0 : (idx == k1 ? L1 : ... : Lfall), built with make_fx.

    op="ne" writes each test as ``idx != k`` with the leaf on the false side.
    """
    n = len(constants)
    leaves = leaves or [(lambda j: (lambda x: x * (j + 2) + j))(j) for j in range(n + 1)]

    def build(j, idx, x):
        if j == n:
            return leaves[n](x)
        k = constants[j]
        hit = (lambda j: lambda x, idx: leaves[j](x))(j)
        rest = (lambda j: lambda x, idx: build(j + 1, idx, x))(j)
        if op == "eq":
            pred = (k == idx) if reflected else (idx == k)
            return cond(pred, hit, rest, (x, idx))
        pred = (k != idx) if reflected else (idx != k)
        return cond(pred, rest, hit, (x, idx))

    def reference(idx, x):
        for j, k in enumerate(constants):
            if idx == k:
                return leaves[j](x)
        return leaves[n](x)

    return (lambda idx, x: build(0, idx, x)), reference


def check_chain(fn, reference, idx_values, dtype=torch.int64):
    gm = make_fx(fn)(torch.tensor(0, dtype=dtype), X)
    (tree,) = find_cond_trees(gm)
    after = cond_to_switch(gm)
    assert n_conds(after) == 0 and len(switch_nodes(after)) == 1
    for i in idx_values:
        idx = torch.tensor(i, dtype=dtype)
        torch.testing.assert_close(after(idx, X), reference(idx, X), msg=f"idx={i}")
        torch.testing.assert_close(after(idx, X), gm(idx, X), msg=f"idx={i}")
    return tree, after


@pytest.mark.parametrize(
    "constants, op, reflected",
    [
        ([0, 1, 2], "eq", False),
        ([0, 1, 2], "eq", True),  # k == idx
        ([0, 1, 2], "ne", False),  # idx != k ? rest : leaf
        ([2, 0, 1], "eq", False),  # unordered
        ([3, 4, 5], "eq", False),  # offset
        ([-1, 0, 1], "eq", False),  # negative constants
    ],
)
def test_dispatch_chain_uses_integer_index_with_range_fix(constants, op, reflected):
    fn, ref = chain_fn(constants, op, reflected)
    tree, after = check_chain(fn, ref, range(-4, 9))
    assert tree.is_dispatch_chain and tree.index_form == "dispatch", tree.index_note
    ts = targets(after)
    # no n comparisons: just clamp + remainder (+ a subtraction for an offset)
    assert aten.eq.Scalar not in ts and aten.ne.Scalar not in ts and aten.where.Scalar not in ts
    assert ts.count(aten.clamp.default) == 1 and ts.count(aten.remainder.Scalar) == 1
    assert (aten.sub.Scalar in ts) == (min(constants) != 0)
    (sw,) = switch_nodes(after)
    assert len(sw.args[1]) == len(constants) + 1


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.uint8])
def test_dispatch_chain_on_narrow_int_dtypes_is_exhaustively_correct(dtype):
    fn, ref = chain_fn([0, 1, 2])
    info = torch.iinfo(dtype)
    values = range(info.min, info.max + 1) if info.bits == 8 else [info.min, info.min + 1, -1, 0, 1, 2, 3, info.max]
    tree, after = check_chain(fn, ref, values, dtype)
    assert tree.index_form == "dispatch"
    assert aten._to_copy.default in targets(after)  # widened before the range fix


def test_dispatch_chain_int64_extremes():
    fn, ref = chain_fn([5, 6, 7])
    info = torch.iinfo(torch.int64)
    check_chain(fn, ref, [info.min, info.min + 1, info.min + 5, -1, 4, 5, 6, 7, 8, info.max - 1, info.max])


@pytest.mark.parametrize(
    "constants, why",
    [([0, 2, 5], "not contiguous"), ([0, 0, 1], "repeats")],
)
def test_dispatch_chain_falls_back_to_general_index_and_says_why(constants, why):
    fn, ref = chain_fn(constants)
    tree, _ = check_chain(fn, ref, range(-3, 8))
    assert tree.is_dispatch_chain and tree.index_form == "general"
    assert why in tree.index_note
    _, p = rewrite(make_fx(fn)(torch.tensor(0), X))
    assert any(why in s.reason for s in p.report.skips)
    assert p.report.stats["general_index"] == 1 and p.report.stats["dispatch_index"] == 0


def test_dispatch_chain_on_bool_index_uses_general_form():
    fn, ref = chain_fn([0, 1])
    tree, _ = check_chain(fn, ref, [False, True], torch.bool)
    assert tree.index_form == "general" and "bool" in tree.index_note


def test_dispatch_chain_on_float_index_uses_general_form():
    fn, ref = chain_fn([0, 1, 2])
    gm = make_fx(fn)(torch.tensor(0.0), X)
    (tree,) = find_cond_trees(gm)
    assert tree.index_form == "general" and "float" in tree.index_note
    after = cond_to_switch(gm)
    for v in [-1.0, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, float("nan"), float("inf")]:
        idx = torch.tensor(v)
        torch.testing.assert_close(after(idx, X), ref(idx, X), msg=f"idx={v}")


def test_dispatch_chain_with_merged_leaves_remaps_index():
    same = lambda x: x + 100.0  # noqa: E731
    leaves = [lambda x: x * 2, same, lambda x: x - 3, same]  # leaf 1 == fall-through
    fn, ref = chain_fn([0, 1, 2], leaves=leaves)
    tree, after = check_chain(fn, ref, range(-3, 6))
    assert tree.index_form == "general" and "merged" in tree.index_note
    (sw,) = switch_nodes(after)
    assert len(sw.args[1]) == 3


def test_tree_that_is_not_a_chain_uses_general_form():
    # idx == 0 ? (idx == 1 ? a : b) : c  -- the nested cond sits on the matching side
    def f(idx, x):
        inner = lambda x, idx: cond(idx == 1, lambda x: x + 1, lambda x: x * 3, (x,))  # noqa: E731
        return cond(idx == 0, inner, lambda x, idx: x - 5, (x, idx))

    gm = make_fx(f)(torch.tensor(0), X)
    (tree,) = find_cond_trees(gm)
    assert not tree.is_dispatch_chain
    after = cond_to_switch(gm)
    assert_same(gm, after, [(torch.tensor(i), X) for i in range(-2, 4)])


# --------------------------------------------------------------------------- operand dedup, inlining


def test_duplicate_and_unused_operands():
    def f(p, q, x, y, z):
        t = lambda a, b, c, q: cond(q, lambda a, b: a + b, lambda a, b: a * b, (a, b))  # noqa: E731
        e = lambda a, b, c, q: a - 1  # noqa: E731
        return cond(p, t, e, (x, x, z, q))  # x twice, z never read

    gm = make_fx(f)(torch.tensor(True), torch.tensor(True), X, Y, Y)
    (tree,) = find_cond_trees(gm)
    assert tree.duplicated_operands == ["x_1"]
    after = cond_to_switch(gm)
    (sw,) = switch_nodes(after)
    assert [o.name for o in sw.args[2]] == ["x_1"]
    assert_same(gm, after, [(torch.tensor(p), torch.tensor(q), X, Y, Y) for p in (True, False) for q in (True, False)])


def test_branch_with_prefix_and_postfix_is_inlined_into_leaves():
    def f(p, q, x):
        def t(x, q):
            y = x * 2  # prefix feeding the nested cond's operand
            out = cond(q, lambda y: y.sin(), lambda y: y.cos(), (y,))
            return out + 1  # postfix on its result

        return cond(p, t, lambda x, q: x.exp(), (x, q))

    gm = make_fx(f)(torch.tensor(True), torch.tensor(True), X)
    after = cond_to_switch(gm)
    assert n_conds(after) == 0
    (sw,) = switch_nodes(after)
    assert len(sw.args[1]) == 3
    assert_same(gm, after, [(torch.tensor(p), torch.tensor(q), X) for p in (True, False) for q in (True, False)])


def test_predicates_computed_from_a_prefix_are_hoisted_through_inlined_levels():
    # Every level computes a new value, tests a predicate on it, and post-processes the result.
    def level(d):
        if d == 0:
            return lambda x: x.exp()

        def body(x):
            y = x + 1  # operand and predicate both come from the prefix
            out = cond(y.mean() > d, lambda y: y.sin(), level(d - 1), (y,))
            return out + d

        return body

    gm = make_fx(lambda x: level(3)(x))(X)
    (tree,) = find_cond_trees(gm)
    assert (tree.depth, tree.num_leaves) == (3, 4)
    after = cond_to_switch(gm)
    assert n_conds(after) == 0 and len(switch_nodes(after)) == 1
    inputs = [(X * s + c,) for s in (1.0, -1.0) for c in (-5.0, -3.0, -1.0, 0.0, 1.0, 3.0)]
    assert_same(gm, after, inputs)
    report = assert_equivalent(gm, after, (X,), input_sets=inputs)  # also proves every leaf was reached
    assert report.covered == report.required


def test_integer_predicate_is_converted_for_the_index():
    def f(p, q, x):
        return cond(p, lambda x, q: cond(q, lambda x: x + 1, lambda x: x - 1, (x,)), lambda x, q: x * 2, (x, q))

    gm = make_fx(f)(torch.tensor(1), torch.tensor(0), X)  # int predicates: cond takes them by truthiness
    after = cond_to_switch(gm)
    assert aten.ne.Scalar in targets(after)
    assert_same(gm, after, [(torch.tensor(a), torch.tensor(b), X) for a in (0, 1, 7) for b in (0, -2)])


def test_deep_tree_with_multiple_outputs():
    def leaf(k):
        return lambda x, y, p: (x + k, y * k)

    def level(d):
        if d == 0:
            return leaf(0)
        return lambda x, y, p: cond(p[d] > 0, leaf(d), level(d - 1), (x, y, p))

    gm = make_fx(lambda p, x, y: level(4)(x, y, p))(torch.ones(5), X, Y)
    (tree,) = find_cond_trees(gm)
    assert (tree.depth, tree.num_leaves) == (4, 5)
    after = cond_to_switch(gm)
    assert n_conds(after) == 0 and len(switch_nodes(after)) == 1
    inputs = [(torch.tensor(bits, dtype=torch.float32) * 2 - 1, X, Y) for bits in itertools.product((0, 1), repeat=5)]
    assert_same(gm, after, inputs)


def test_identical_leaves_everywhere_leave_no_switch():
    def f(p, q, x):
        return cond(p, lambda x, q: cond(q, lambda x: x + 1, lambda x: x + 1, (x,)), lambda x, q: x + 1, (x, q))

    gm = make_fx(f)(torch.tensor(True), torch.tensor(True), X)
    res, p = rewrite(gm)
    assert res.modified and n_conds(res.graph_module) == 0 and not switch_nodes(res.graph_module)
    assert p.report.stats["switches_created"] == 0
    assert_same(gm, res.graph_module, [(torch.tensor(a), torch.tensor(b), X) for a in (True, False) for b in (True, False)])


# --------------------------------------------------------------------------- what is left alone, and why


def test_graph_without_cond_is_unchanged():
    gm = make_fx(lambda x: x.sin() + 1)(X)
    res, p = rewrite(gm)
    assert not res.modified and res.graph_module.code == gm.code and p.report.skips == []


def test_lone_cond_is_left_with_reason():
    gm = make_fx(lambda p, x: cond(p, lambda x: x + 1, lambda x: x - 1, (x,)))(torch.tensor(True), X)
    res, p = rewrite(gm)
    assert not res.modified and n_conds(res.graph_module) == 1
    assert any("lone cond" in s.reason and "cond" in s.where for s in p.report.skips)


def test_unhoistable_predicate_keeps_that_cond_as_a_leaf():
    def f(p, q, r, x, y):
        def deepest(x, y, r):
            # integer floor division raises on a zero divisor, so its predicate is not hoisted
            return cond(torch.div(x, y, rounding_mode="floor").sum() > 0, lambda x: x + 1, lambda x: x - 1, (x,))

        mid = lambda x, y, r: cond(r, lambda x, y, r: x * 2, deepest, (x, y, r))  # noqa: E731
        return cond(p, mid, lambda x, y, r: x * 3, (x, y, r))

    xi, yi = torch.tensor([3, -4, 5]), torch.tensor([2, 3, -1])
    gm = make_fx(f)(torch.tensor(True), torch.tensor(True), torch.tensor(True), xi, yi)
    res, p = rewrite(gm)
    assert res.modified
    assert len(switch_nodes(res.graph_module)) == 1 and n_conds(res.graph_module) == 1
    assert any("cannot be hoisted" in s.reason and "may raise" in s.reason and "zero divisor" in s.reason
               for s in p.report.skips)
    inputs = [(torch.tensor(a), torch.tensor(b), torch.tensor(c), xi * s, yi) for a, b, c in itertools.product((True, False), repeat=3) for s in (1, -1)]
    assert_same(gm, res.graph_module, inputs)


def test_branch_with_two_conds_is_a_leaf_and_its_conds_stay():
    def f(p, q, x):
        def two(x, q):
            a = cond(q, lambda x: x + 1, lambda x: x - 1, (x,))
            return cond(q, lambda a: a * 2, lambda a: a * 3, (a,))

        return cond(p, two, lambda x, q: x.exp(), (x, q))

    gm = make_fx(f)(torch.tensor(True), torch.tensor(True), X)
    res, p = rewrite(gm)
    assert not res.modified and n_conds(res.graph_module) == 3
    assert any("holds 2 conds" in s.reason for s in p.report.skips)


def test_nested_tree_inside_an_unabsorbed_leaf_is_rewritten():
    def f(p, q, r, x):
        def two(x, q, r):
            a = cond(q, lambda x, r: cond(r, lambda x: x + 1, lambda x: x - 1, (x,)), lambda x, r: x * 5, (x, r))
            return cond(q, lambda a: a * 2, lambda a: a * 3, (a,))

        return cond(p, two, lambda x, q, r: x.exp(), (x, q, r))

    gm = make_fx(f)(torch.tensor(True), torch.tensor(True), torch.tensor(True), X)
    after = cond_to_switch(gm)
    assert len(switch_nodes(after)) == 1 and n_conds(after) == 2  # outer cond + the two-cond branch's second cond
    assert_same(gm, after, [(torch.tensor(a), torch.tensor(b), torch.tensor(c), X) for a, b, c in itertools.product((True, False), repeat=3)])


# --------------------------------------------------------------------------- malformed input


def nested_gm():
    def f(p, q, x):
        return cond(p, lambda x, q: cond(q, lambda x: x + 1, lambda x: x - 1, (x,)), lambda x, q: x * 2, (x, q))

    return make_fx(f)(torch.tensor(True), torch.tensor(True), X)


def test_branch_outputs_differing_in_dtype_are_rejected():
    gm = nested_gm()
    gm.false_graph_0 = make_fx(lambda x, q: (x.double(),))(X, torch.tensor(True))
    with pytest.raises(MalformedGraphError, match=r"node 'cond'.*output 0 is torch.float32 in true branch but torch.float64"):
        cond_to_switch(gm)


def test_branch_output_structures_differing_are_rejected():
    gm = nested_gm()
    gm.false_graph_0 = make_fx(lambda x, q: x * 2)(X, torch.tensor(True))  # bare, the other returns a tuple
    with pytest.raises(MalformedGraphError, match=r"node 'cond'.*true branch returns a tuple but false branch returns a bare value"):
        cond_to_switch(gm)


def test_branch_outputs_differing_in_shape_are_rejected():
    gm = nested_gm()
    gm.true_graph_0.false_graph_0 = make_fx(lambda x: (x.repeat(2),))(X)
    with pytest.raises(MalformedGraphError, match=r"node 'cond'.*shape \(3,\) in true branch but \(6,\)"):
        cond_to_switch(gm)


def test_non_tensor_operand_is_rejected():
    gm = nested_gm()
    node = next(n for n in gm.graph.nodes if is_cond(n))
    node.args = (*node.args[:3], (node.args[3][0], 1.5))
    with pytest.raises(MalformedGraphError, match=r"node 'cond'.*operand 1 is a float"):
        cond_to_switch(gm)


def test_graph_failing_lint_is_rejected():
    gm = nested_gm()
    g = gm.graph
    first = next(iter(g.nodes))
    out = next(n for n in g.nodes if n.op == "output")
    with g.inserting_after(first):
        early = g.call_function(aten.sin.default, (out.args[0],))  # uses a value defined later
    out.args = (early,)
    with pytest.raises(MalformedGraphError, match="fails torch.fx lint"):
        cond_to_switch(gm)


def test_branch_without_output_node_is_rejected_naming_the_graph():
    # It was a bare StopIteration with an empty message (returns_sequence).
    gm = nested_gm()
    leaf = gm.false_graph_0
    leaf.graph.erase_node(next(n for n in leaf.graph.nodes if n.op == "output"))
    with pytest.raises(MalformedGraphError, match=r"^graph module 'false_graph_0': graph has no output node"):
        cond_to_switch(gm)
    with pytest.raises(MalformedGraphError, match=r"graph module 'false_graph_0': graph has no output node"):
        inline_graph(torch.fx.Graph(), leaf, [None, None], AttrSink())


def test_inlining_a_graph_with_the_wrong_number_of_values_is_rejected():
    gm = nested_gm()
    with pytest.raises(MalformedGraphError, match=r"graph takes 2 inputs but is inlined with 1 values"):
        inline_graph(torch.fx.Graph(), gm.false_graph_0, [None], AttrSink())


class SizeMerging(torch.nn.Module):
    """idx == 0 ? x[:1] + 5 : (idx == 1 ? x[:2] * 2 : x[:3] - 1): torch.export merges
    the branches' sizes into unbacked symbols (u0 inside, u2 at the root)."""

    def forward(self, i, x):
        def rest(x, i):
            return cond(i == 1, lambda x: x[:2] * 2, lambda x: x[:3] - 1, (x,))

        return cond(i == 0, lambda x, i: x[:1] + 5, rest, (x, i))


class SizeMergingInside(torch.nn.Module):
    """The root's branches agree (a sum); only the nested cond merges sizes."""

    def forward(self, i, x):
        def rest(x, i):
            return cond(i == 1, lambda x: x[:2] * 2, lambda x: x[:3] - 1, (x,)).sum()

        return cond(i == 0, lambda x, i: x.sum(), rest, (x, i))


@pytest.mark.parametrize("model, as_leaf", [(SizeMerging, 1), (SizeMergingInside, 1)])
def test_cond_whose_branches_return_different_sizes_is_kept_with_reason(model, as_leaf):
    # Valid export output; both passes rejected it as malformed.
    args = (torch.tensor(0), torch.arange(6.0))
    ep = torch.export.export(model(), args)
    res, cts = rewrite(ep)
    assert not res.modified and n_conds(res.graph_module) == 2 and not switch_nodes(res.graph_module)
    merged = [s for s in cts.report.skips if "branches return different sizes" in s.reason]
    # The nested cond, whose branches return 2 and 3, is declined as a root
    # and as a leaf of the root's tree; the root (1 against the nested one's
    # merged u0, a symbol like a dynamic batch's) is then a lone cond.
    assert len(merged) == 2 and sum(s.reason.startswith("kept as a leaf") for s in merged) == as_leaf
    assert any("output 0 dim 0 is 2 in true branch but 3 in false branch (merged into u" in s.reason for s in merged)
    after = cond_to_switch(ep)
    for k in range(-1, 4):
        i = torch.tensor(k)
        torch.testing.assert_close(run(after, i, args[1]), model()(i, args[1]))


def test_differing_concrete_sizes_without_a_merged_size_on_the_node_are_still_rejected():
    ep = torch.export.export(SizeMerging(), (torch.tensor(0), torch.arange(6.0)))
    gm = copy.deepcopy(ep.graph_module)
    inner = next(n for n in gm.false_graph_0.graph.nodes if is_cond(n))
    inner.meta["val"] = (torch.empty(2),)  # the node claims one concrete size: its branches contradict it
    with pytest.raises(MalformedGraphError, match=r"node 'cond' in graph 'false_graph_0'.*shape \(2,\) in true branch but \(3,\)"):
        cond_to_switch(gm)


# --------------------------------------------------------------------------- scale


def test_many_trees_in_one_graph():
    # 60 dispatch chains of 4 conds each, built by copying one traced chain.
    from branchyard.fx.control_flow import AttrSink, inline_graph

    fn, ref = chain_fn([0, 1, 2, 3])
    small = make_fx(fn)(torch.tensor(0), X)
    g = torch.fx.Graph()
    root = torch.nn.Module()

    class CopySink(AttrSink):
        def add(self, base, obj):
            return super().add(base, copy.deepcopy(obj))

    sink = CopySink(root)
    src_ph = [n for n in small.graph.nodes if n.op == "placeholder"]
    phs = [g.placeholder(n.name) for n in src_ph]
    for a, b in zip(phs, src_ph):
        a.meta = dict(b.meta)
    idx, acc = phs
    for _ in range(60):
        acc = inline_graph(g, small, [idx, acc], sink)
    g.output(acc)
    big = torch.fx.GraphModule(root, g)
    assert n_conds(big) == 240
    res, p = rewrite(big)
    assert p.report.stats["cond_trees"] == 60 and p.report.stats["dispatch_index"] == 60
    assert n_conds(res.graph_module) == 0 and len(switch_nodes(res.graph_module)) == 60
    for i in (-1, 0, 2, 3, 4, 9):
        expected = X
        for _ in range(60):
            expected = ref(torch.tensor(i), expected)
        torch.testing.assert_close(res.graph_module(torch.tensor(i), X), expected, rtol=1e-4, atol=1e-4)


def bare_output_chain(n: int) -> torch.fx.GraphModule:
    """idx == 0 ? x + 0 : idx == 1 ? x + 1 : ... built by hand with branches
    that return a bare tensor (no tuple, no getitem) -- legal for the cond op,
    and what some graph builders emit."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    with mode:
        xv, iv, bv = torch.empty(3), torch.empty((), dtype=torch.int64), torch.empty((), dtype=torch.bool)

    def graph_with_inputs():
        return _graph_with_inputs(xv, iv)

    def leaf(k):
        g, x, _ = graph_with_inputs()
        y = g.call_function(aten.add.Scalar, (x, float(k)))
        y.meta["val"] = xv
        g.output(y)
        return torch.fx.GraphModule({}, g)

    sub = leaf(n)
    for k in reversed(range(n)):
        g, x, i = graph_with_inputs()
        eq = g.call_function(aten.eq.Scalar, (i, k))
        eq.meta["val"] = bv
        t, f = g.get_attr("true_graph_0"), g.get_attr("false_graph_0")
        c = g.call_function(torch.ops.higher_order.cond, (eq, t, f, (x, i)))
        c.meta["val"] = xv
        g.output(c)
        sub = torch.fx.GraphModule({"true_graph_0": leaf(k), "false_graph_0": sub}, g)
    return sub


def _graph_with_inputs(xv, iv):
    """A graph with placeholders x and idx carrying fake values ``xv``, ``iv``."""
    g = torch.fx.Graph()
    x, i = g.placeholder("x"), g.placeholder("idx")
    x.meta["val"], i.meta["val"] = xv, iv
    return g, x, i


def test_branches_returning_bare_tensors():
    gm = bare_output_chain(3)
    after = cond_to_switch(gm)
    assert n_conds(after) == 0 and len(switch_nodes(after)) == 1
    for i in range(-2, 6):
        out = after(torch.zeros(3), torch.tensor(i))
        assert isinstance(out, torch.Tensor)
        torch.testing.assert_close(out, gm(torch.zeros(3), torch.tensor(i)))
        assert out[0].item() == (i if 0 <= i < 3 else 3)


def mixed_structure_tree() -> torch.fx.GraphModule:
    """idx == 0 ? x + 0 : sub(x, idx), the root's branches returning a bare
    tensor, where sub unwraps a nested cond whose branches return 1-tuples:
    ``c = cond(idx == 1, L1, L2, (x, idx)); return c[0]``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        xv, iv, bv = torch.empty(3), torch.empty((), dtype=torch.int64), torch.empty((), dtype=torch.bool)

    def graph_with_inputs():
        return _graph_with_inputs(xv, iv)

    def leaf(k, as_tuple):
        g, x, _ = graph_with_inputs()
        y = g.call_function(aten.add.Scalar, (x, float(k)))
        y.meta["val"] = xv
        g.output((y,) if as_tuple else y)
        return torch.fx.GraphModule({}, g)

    def cond_graph(k, true_gm, false_gm, unwrap):
        g, x, i = graph_with_inputs()
        eq = g.call_function(aten.eq.Scalar, (i, k))
        eq.meta["val"] = bv
        t, f = g.get_attr("true_graph_0"), g.get_attr("false_graph_0")
        c = g.call_function(torch.ops.higher_order.cond, (eq, t, f, (x, i)))
        c.meta["val"] = (xv,) if unwrap else xv
        if unwrap:
            c = g.call_function(operator.getitem, (c, 0))
            c.meta["val"] = xv
        g.output(c)
        return torch.fx.GraphModule({"true_graph_0": true_gm, "false_graph_0": false_gm}, g)

    sub = cond_graph(1, leaf(1, True), leaf(2, True), unwrap=True)
    return cond_graph(0, leaf(0, False), sub, unwrap=False)


def test_branch_unwrapping_a_nested_conds_tuple_is_inlined_into_bare_leaves():
    # The unwrapping branch was absorbed as if it passed the tuple through:
    # the switch got a bare leaf and two 1-tuple leaves and was rejected as malformed.
    gm = mixed_structure_tree()
    after = cond_to_switch(gm)
    (sw,) = switch_nodes(after)
    assert n_conds(after) == 0 and len(sw.args[1]) == 3
    assert not any(returns_sequence(getattr(after, b.target)) for b in sw.args[1]), "every branch returns a bare tensor"
    for i in range(-2, 5):
        out = after(torch.zeros(3), torch.tensor(i))
        assert isinstance(out, torch.Tensor)
        torch.testing.assert_close(out, gm(torch.zeros(3), torch.tensor(i)))
        assert out[0].item() == (i if 0 <= i < 3 else 2)


def test_one_subgraph_on_both_sides_of_a_cond_is_rewritten_and_its_get_attr_erased_once():
    # Both sides read one get_attr node; the rewrite erased it twice (a torch warning, a broken graph).
    import warnings

    def f(i, j, x):
        inner = lambda x, j: cond(j, lambda x: x + 1, lambda x: x - 1, (x,))  # noqa: E731
        return cond(i, inner, inner, (x, j))

    gm = make_fx(f)(torch.tensor(True), torch.tensor(True), X)
    root = next(n for n in gm.graph.nodes if is_cond(n))
    t_attr, f_attr = root.args[1], root.args[2]
    root.args = (root.args[0], t_attr, t_attr, root.args[3])
    gm.graph.erase_node(f_attr)
    delattr(gm, f_attr.target)
    gm.recompile()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*already erased.*")
        after = cond_to_switch(gm)
    assert n_conds(after) == 0 and len(switch_nodes(after)) == 1
    assert not any(n.op == "get_attr" and not n.users for n in after.graph.nodes)
    for i, j in itertools.product((True, False), repeat=2):
        args = (torch.tensor(i), torch.tensor(j), X)
        out = after(*args)
        torch.testing.assert_close(out, gm(*args))
        torch.testing.assert_close(out, X + 1 if j else X - 1)  # both sides are the same subgraph


def test_branches_naming_a_dynamic_batch_afresh_are_still_flattened():
    """Each branch of an exported dynamic-batch program has its own unbacked
    batch symbol (u0, u4); that is no size merge, and the tree becomes a switch."""
    from branchyard.shapes import ShapeVar, dynamic_spec
    import branchyard.shapes as shapes
    from branchyard.examples import ExpertDispatch

    model = ExpertDispatch(num_experts=4, dim=8)
    batch = ShapeVar("batch", min=1, max=64)

    @dynamic_spec({"x": (batch, 8), "idx": ()})
    def forward(x, idx):
        return model(x, idx)

    ep = shapes.export(forward, (torch.randn(4, 8), torch.tensor(2)))
    res, cts = rewrite(ep)
    assert res.modified and n_conds(res.graph_module) == 0 and len(switch_nodes(res.graph_module)) == 1
    assert not [s for s in cts.report.skips if "different sizes" in s.reason]
    after = cond_to_switch(ep)
    for k in range(4):
        x = torch.randn(7, 8)
        torch.testing.assert_close(run(after, x, torch.tensor(k)), model(x, torch.tensor(k)))
