"""branchyard.testing.assert_equivalent: drives every branch, names the path
of a disagreement, refuses to pass on incomplete coverage."""

from __future__ import annotations

import re

import pytest
import torch

from branchyard._compat import HAS_SWITCH
from branchyard.errors import BranchyardError, EquivalenceError
from branchyard.testing import (
    Decision,
    IncompleteCoverageError,
    assert_equivalent,
    find_control_sites,
    run_recording,
)

needs_switch = pytest.mark.skipif(not HAS_SWITCH, reason="needs torch.ops.higher_order.switch (torch >= 2.14)")
if HAS_SWITCH:
    from torch._higher_order_ops import switch

X = torch.tensor([0.5, -1.0, 2.0, 3.0])


def _export(mod: torch.nn.Module, *args):
    return torch.export.export(mod, args)


# --- programs -----------------------------------------------------------------


class CondChain(torch.nn.Module):
    """b0 if idx <= 0 else b1 if idx == 1 else b2: a 3-way switch written as conds."""

    def forward(self, idx, x):
        def rest(i, a):
            return torch.cond(i == 1, lambda j, t: t * 2, lambda j, t: t - 3, (i, a))

        return torch.cond(idx <= 0, lambda i, a: a + 1, rest, (idx, x))


def _branches():
    return [lambda a: a + 1, lambda a: a * 2, lambda a: a - 3]


class Switch3(torch.nn.Module):
    def __init__(self, order=(0, 1, 2), wrap_negative=False):
        super().__init__()
        self.order, self.wrap_negative = order, wrap_negative

    def forward(self, idx, x):
        if self.wrap_negative:  # a wrong "clamp": -1 goes to the last branch
            idx = torch.where(idx < 0, idx + 3, idx)
        b = _branches()
        return switch(idx, [b[k] for k in self.order], (x,))


class Nested(torch.nn.Module):
    """flag ? (x.sum() > 0 ? x + w : x - w) : (idx == 2 ? x * 2 : x / 2), w a parameter."""

    def __init__(self, inner_false=lambda t, w: t - w):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        self.inner_false = inner_false

    def forward(self, flag, idx, x):
        def on(i, a, w):
            return torch.cond(a.sum() > 0, lambda t, v: t + v, self.inner_false, (a, w))

        def off(i, a, w):
            return torch.cond(i == 2, lambda t: t * 2, lambda t: t / 2, (a,))

        return torch.cond(flag, on, off, (idx, x, self.w))


def nested_reference(flag, idx, x):
    w = torch.tensor([1.0, 2.0, 3.0, 4.0])
    if bool(flag):
        return x + w if x.sum() > 0 else x - w
    return x * 2 if int(idx) == 2 else x / 2


# --- equivalent programs pass, with full coverage -------------------------------


def test_nested_conds_match_python_reference_on_every_path():
    ep = _export(Nested(), torch.tensor(True), torch.tensor(0), X)
    report = assert_equivalent(ep, nested_reference, (torch.tensor(True), torch.tensor(0), X))
    assert report.required == {
        ("cond", "true"), ("cond", "false"),
        ("cond[true]/cond", "true"), ("cond[true]/cond", "false"),
        ("cond[false]/cond", "true"), ("cond[false]/cond", "false"),
    }
    assert report.covered == report.required
    assert len(report.paths_before) == 4  # flag x inner decision
    assert report.paths_after == {}  # the reference is an opaque callable


@needs_switch
def test_switch_and_cond_chain_are_equivalent_both_ways():
    args = (torch.tensor(1), X)
    chain, sw = _export(CondChain(), *args), _export(Switch3(), *args)
    forward = assert_equivalent(chain, sw, args)
    backward = assert_equivalent(sw, chain, args)
    assert forward.covered == forward.required
    # The switch's clamp makes "below range" and "above range" required too.
    assert backward.required == {("switch", "0"), ("switch", "1"), ("switch", "2"),
                                 ("switch", "below range"), ("switch", "above range")}
    assert backward.covered == backward.required
    assert len(backward.paths_after) == 3


def test_graph_module_and_module_arguments():
    args = (torch.tensor(True), torch.tensor(2), X)
    ep = _export(Nested(), *args)
    class PyNested(torch.nn.Module):  # eager Python control flow: an opaque module
        def forward(self, flag, idx, x):
            return nested_reference(flag, idx, x)

    report = assert_equivalent(ep.module(), PyNested(), args)
    assert report.covered == report.required
    # With an opaque `before`, control flow is found in `after` instead.
    flipped = assert_equivalent(PyNested(), ep.module(), args)
    assert flipped.reference == "after" and flipped.covered == flipped.required


class Counter(torch.nn.Module):
    """Counts its calls in a buffer; the output depends on the count and the path."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cnt", torch.zeros(()))

    def forward(self, i, x):
        self.cnt.add_(1)

        def rest(x, i, c):
            return torch.cond(i == 1, lambda x, c: x + c, lambda x, c: x - c, (x, c))

        return torch.cond(i == 0, lambda x, i, c: x * c, rest, (x, i, self.cnt))


@needs_switch
def test_programs_sharing_a_buffer_they_update_run_from_the_same_state():
    # cond_to_switch's result shares the buffer with its input: each run
    # advanced the one counter, and the two programs were compared at different counts.
    from branchyard.passes import cond_to_switch

    args = (torch.tensor(0), torch.ones(3))
    ep = _export(Counter(), *args)
    after = cond_to_switch(ep)
    assert after.state_dict["cnt"] is ep.state_dict["cnt"]
    report = assert_equivalent(ep, after, args)
    assert report.covered == report.required and report.input_sets > 2
    assert ep.state_dict["cnt"].item() == 0, "the state is left as it was found"


def test_the_same_stateful_module_as_both_programs_is_equivalent_to_itself():
    m = Counter()
    m.cnt.fill_(5)
    assert_equivalent(m, m, (torch.tensor(1), torch.ones(3)), check_coverage=False)
    assert m.cnt.item() == 5


def test_an_input_updated_in_place_is_restored_before_each_run():
    def bump(x):
        x.add_(1)
        return x * 2  # a fresh tensor

    x = torch.ones(2)
    assert_equivalent(bump, bump, (x,))
    assert x.tolist() == [1.0, 1.0]
    # A real difference is still caught, and the state is restored on the way out.
    m = Counter()
    with pytest.raises(EquivalenceError, match="programs disagree"):
        assert_equivalent(m, lambda i, x: x * 0, (torch.tensor(0), torch.ones(3)), check_coverage=False)
    assert m.cnt.item() == 0


# --- a wrong rewrite on one path is caught and the path named -------------------


@needs_switch
def test_swapped_switch_leaves_are_caught_on_that_path():
    args = (torch.tensor(0), X)
    good, bad = _export(Switch3(), *args), _export(Switch3(order=(0, 2, 1)), *args)
    with pytest.raises(EquivalenceError, match=r"(?s)inputs: idx = 1\n.*before took: switch -> 1.*max abs diff") as info:
        assert_equivalent(good, bad, args)
    assert info.value.path_before == (Decision("switch", "switch", "1"),)
    assert info.value.path_after == (Decision("switch", "switch", "1"),)
    assert "output 0" in info.value.difference


@needs_switch
def test_wrong_out_of_range_clamp_is_caught_and_named():
    args = (torch.tensor(0), X)
    good, bad = _export(Switch3(), *args), _export(Switch3(wrap_negative=True), *args)
    with pytest.raises(EquivalenceError, match=r"(?s)inputs: idx = -1\n.*switch -> 0 \(index -1 clamped\).*switch -> 2") as info:
        assert_equivalent(good, bad, args)
    assert info.value.path_before == (Decision("switch", "switch", "0", raw_index=-1),)


class EqChain(torch.nn.Module):
    """idx == 0 -> x + 1, idx == 1 -> x * 2, anything else -> x - 3."""

    def forward(self, idx, x):
        def rest(i, a):
            return torch.cond(i == 1, lambda j, t: t * 2, lambda j, t: t - 3, (i, a))

        return torch.cond(idx == 0, lambda i, a: a + 1, rest, (idx, x))


@needs_switch
def test_index_wrapped_by_modulus_instead_of_clamped_is_caught():
    class Wrapped(torch.nn.Module):  # right for -1 .. 2 only: wraps -2, -3, 3, ... into range
        def forward(self, idx, x):
            return switch(torch.remainder(idx, 3), _branches(), (x,))

    args = (torch.tensor(0), X)
    chain = _export(EqChain(), *args)
    with pytest.raises(EquivalenceError, match=r"(?s)inputs: idx = -3\n.*cond -> false, cond\[false\]/cond -> false"):
        assert_equivalent(chain, _export(Wrapped(), *args), args)


def test_wrong_leaf_in_one_nested_branch_is_named():
    args = (torch.tensor(True), torch.tensor(0), X)
    good = _export(Nested(), *args)
    bad = _export(Nested(inner_false=lambda t, w: t - 2 * w), *args)
    with pytest.raises(EquivalenceError, match=r"cond -> true, cond\[true\]/cond -> false") as info:
        assert_equivalent(good, bad, args)
    assert [d.branch for d in info.value.path_before] == ["true", "false"]


def test_tolerances_are_configurable():
    args = (torch.tensor(True), torch.tensor(0), X)
    ep = _export(Nested(), *args)

    def noisy(*a):
        return nested_reference(*a) + 1e-4

    with pytest.raises(EquivalenceError, match="max abs diff 0.0001"):
        assert_equivalent(ep, noisy, args)
    assert_equivalent(ep, noisy, args, atol=1e-3)


def test_after_raising_is_an_equivalence_error():
    args = (torch.tensor(True), torch.tensor(0), X)
    ep = _export(Nested(), *args)

    def fragile(flag, idx, x):
        if not bool(flag):
            raise ValueError("cannot do the off branch")
        return nested_reference(flag, idx, x)

    with pytest.raises(EquivalenceError, match=r"(?s)after raised ValueError: cannot do the off branch.*cond -> false"):
        assert_equivalent(ep, fragile, args)


def test_output_structure_mismatch_is_named():
    args = (torch.tensor(True), torch.tensor(0), X)
    ep = _export(Nested(), *args)
    with pytest.raises(EquivalenceError, match=r"shape \[4\] in before, \[2\] in after"):
        assert_equivalent(ep, lambda *a: nested_reference(*a)[:2], args)
    with pytest.raises(EquivalenceError, match="before returned 1 outputs, after returned 2"):
        assert_equivalent(ep, lambda *a: (nested_reference(*a), a[2]), args)


# --- coverage -------------------------------------------------------------------


class Unreachable(torch.nn.Module):
    def forward(self, flag, x):
        def on(a):
            # |a| summed is never negative: the true side is dead code
            return torch.cond(a.abs().sum() < -1, lambda t: t * 0, lambda t: t + 1, (a,))

        return torch.cond(flag, on, lambda a: a - 1, (x,))


def test_undriven_branch_is_reported_by_name():
    args = (torch.tensor(True), X)
    ep = _export(Unreachable(), *args)
    with pytest.raises(IncompleteCoverageError, match=r"1 branch\(es\) of before never driven: cond\[true\]/cond -> true"):
        assert_equivalent(ep, ep, args)
    report = assert_equivalent(ep, ep, args, check_coverage=False)
    assert report.required - report.covered == {("cond[true]/cond", "true")}


def test_parameter_only_predicate_cannot_be_driven():
    class ByWeight(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(4))

        def forward(self, x):
            return torch.cond(self.w.sum() > 0, lambda t: t + 1, lambda t: t - 1, (x,))

    ep = _export(ByWeight(), X)
    (site,) = find_control_sites(ep.module())
    assert site.inputs == set()
    with pytest.raises(IncompleteCoverageError, match=r"cond -> false"):
        assert_equivalent(ep, ep, (X,))


class Staircase(torch.nn.Module):
    """cond(x0 > 0.3, cond(x1 > 0.3, ... cond(x7 > 0.3, t + 1, t - 7) ..., t - 1), t - 0),
    each decision reading an input of its own: the deepest true branch needs
    all eight decisions right at once."""

    def forward(self, *xs):
        def step(k, t):
            if k == len(xs):
                return t + 1
            return torch.cond(xs[k].sum() > 0.3, lambda u: step(k + 1, u), lambda u: u - k, (t,))

        return step(0, xs[0] * 2)


def test_a_deep_branch_is_driven_from_inputs_that_reach_its_cond():
    args = tuple(torch.tensor([-1.0, 0.5]) * (k + 1) for k in range(8))
    ep = _export(Staircase(), *args)
    # Random combinations would find the deepest branch about once in a few
    # thousand tries; starting from input sets that reach each cond and
    # varying only the input its decision reads takes a few per level.
    report = assert_equivalent(ep, Staircase(), args, max_input_sets=16, max_search=2000)
    assert report.covered == report.required and len(report.required) == 16
    assert report.input_sets <= 16 + 8 * 10  # at most every variant of one input per level


def test_explicit_input_sets_are_compared_too():
    args = (torch.tensor(True), torch.tensor(0), X)
    ep = _export(Nested(), *args)

    def wrong_for_big_x(flag, idx, x):
        return nested_reference(flag, idx, x) + (x.abs().max() > 50).float()

    # Driving never scales x past 50, so this passes ...
    assert_equivalent(ep, wrong_for_big_x, args)
    # ... until an explicit input set reaches the bad region.
    with pytest.raises(EquivalenceError, match=r"inputs: input_sets\[0\]: flag = False; idx = 2; x = \["):
        assert_equivalent(ep, wrong_for_big_x, args, input_sets=[(torch.tensor(False), torch.tensor(2), X * 100)])


# --- the pieces -----------------------------------------------------------------


def test_control_sites_and_their_inputs():
    ep = _export(Nested(), torch.tensor(True), torch.tensor(0), X)
    sites = {s.site: s for s in find_control_sites(ep.module())}
    assert sorted(sites) == ["cond", "cond[false]/cond", "cond[true]/cond"]
    # placeholders of ep.module(): flag=0, idx=1, x=2; slices follow operands outwards
    assert sites["cond"].inputs == {0}
    assert sites["cond[true]/cond"].inputs == {2}
    assert sites["cond[false]/cond"].inputs == {1}
    assert 2 in sites["cond[false]/cond"].constants


@needs_switch
def test_run_recording_reports_clamped_index():
    ep = _export(Switch3(), torch.tensor(0), X)
    out, path = run_recording(ep.module(), torch.tensor(7), X)
    torch.testing.assert_close(out, X - 3)
    assert path == (Decision("switch", "switch", "2", raw_index=7),)
    assert str(path[0]) == "switch -> 2 (index 7 clamped)"


def test_before_that_never_runs_is_not_a_pass():
    def broken(x):
        raise RuntimeError("shape mismatch somewhere")

    with pytest.raises(EquivalenceError, match="before raised on every input set.*shape mismatch somewhere"):
        assert_equivalent(broken, lambda x: x, (X,))


def test_bad_arguments():
    ep = _export(Nested(), torch.tensor(True), torch.tensor(0), X)
    with pytest.raises(BranchyardError, match="before takes 3 flat inputs but example_inputs flatten to 2"):
        assert_equivalent(ep, nested_reference, (torch.tensor(True), X))
    with pytest.raises(BranchyardError, match="`after` must be an ExportedProgram.*got int"):
        assert_equivalent(ep, 3, (torch.tensor(True), torch.tensor(0), X))


# --- the checker's power on random programs ----------------------------------------

import hypothesis  # noqa: E402  (a test dependency: missing, it fails here rather than skipping this file)
from hypothesis import HealthCheck, given, settings  # noqa: E402

from branchyard.testing.strategies import cond_tree_specs  # noqa: E402


@needs_switch
@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(spec=cond_tree_specs(max_depth=4, max_conds=5))
def test_swapping_two_switch_branches_is_always_caught(spec):
    """Mutation test: in cond_to_switch's output, exchange the first and last
    branch of the switch. Distinct leaves compute different values, and
    driving reaches both slots, so the checker must report a disagreement
    (not a coverage gap) on a path through one of the swapped slots."""
    from branchyard.passes.cond_to_switch import cond_to_switch

    hypothesis.assume(spec.depth >= 2)
    ep, args = spec.export()
    mutant = cond_to_switch(ep)
    sw = next(n for n in mutant.graph.nodes if n.target is torch.ops.higher_order.switch)
    branches = list(sw.args[1])
    last = len(branches) - 1
    branches[0], branches[last] = branches[last], branches[0]
    sw.args = (sw.args[0], branches, sw.args[2])
    mutant.graph_module.recompile()
    with pytest.raises(EquivalenceError, match="programs disagree") as info:
        assert_equivalent(ep, mutant, args, max_input_sets=128)
    assert not isinstance(info.value, IncompleteCoverageError)
    taken = [d for d in info.value.path_after if d.site == sw.name]
    assert taken and taken[0].branch in {"0", str(last)}


# --- readable inputs, and both programs' boundaries probed ------------------------------------------


class Threshold(torch.nn.Module):
    def __init__(self, at: float = 0.0):
        super().__init__()
        self.at = at

    def forward(self, x):
        return torch.cond(x.max() > self.at, lambda t: t * 2, lambda t: t - 1, (x,))


def test_a_shifted_predicate_threshold_is_caught():
    """The reference compares with 0, the rewrite with 0.1: probing only the
    reference's boundary (values at -0.5, 0, 0.5) covers both branches of both
    and agrees everywhere; the rewrite's own boundary (0.1) is where they differ."""
    x = torch.tensor([0.3, -0.7])
    before, after = _export(Threshold(0.0), x), _export(Threshold(0.1), x)
    with pytest.raises(EquivalenceError, match=r"(?s)inputs: x = \[0\.1, 0\.1\] \(every element 0\.1\)\n"
                                               r"  before took: cond -> true\n  after took:  cond -> false"):
        assert_equivalent(before, after, (x,))
    with pytest.raises(EquivalenceError, match="cond -> false"):
        assert_equivalent(after, before, (x,))  # either way round
    assert_equivalent(before, _export(Threshold(0.0), x), (x,))  # and the same threshold still passes


def test_failure_names_each_input_with_its_value_and_how_it_was_made():
    x = torch.tensor([0.5, -1.25, 2.0])

    def negated_wrong(x):
        return x * 2 if x.max() > 0 else x - 2  # the reference subtracts 1

    with pytest.raises(EquivalenceError) as info:
        assert_equivalent(_export(Threshold(0.0), x), negated_wrong, (x,))
    text = str(info.value)
    line = next(l for l in text.splitlines() if l.startswith("  inputs: "))
    assert "-x" not in line and "x=" not in line
    assert re.fullmatch(r"  inputs: x = \[[-\d., ]+\]( \(.+\))?", line), line


def test_show_value_reads_like_a_person_writes_values():
    from branchyard.testing.equivalence import show_value

    assert show_value(torch.tensor(3)) == "3"
    assert show_value(torch.tensor(True)) == "True"
    assert show_value(torch.tensor([0.5, -1.0])) == "[0.5, -1]"
    assert show_value(torch.ones(2, 2)) == "[1, 1, 1, 1] shape [2, 2]"
    assert show_value(torch.arange(20.0).reshape(4, 5)) == "float32 tensor of shape [4, 5] (min 0, max 19)"
    assert show_value(torch.zeros(0, 3)) == "[] shape [0, 3]"
