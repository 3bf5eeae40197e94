"""cond_to_switch preserves exceptions both ways: a rewritten program raises
exactly where the original raised (same exception type) and returns exactly
where it returned (same values).

The switch evaluates every hoisted predicate on every call, so a predicate
is hoisted only when every op it needs is on the raise-free allow-list
(:mod:`branchyard.passes.raise_free`); anything else keeps its cond nested,
with the reason in the pass report. Unit cases first, then a hypothesis
property test over random nested programs whose guarded predicates use ops
that can raise (embedding, index_select, gather, nll_loss, integer floor
division / remainder / power by a tensor) next to ones that cannot.
"""

from __future__ import annotations

import copy
import itertools
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Union

import pytest
import torch
import torch.nn.functional as F

from branchyard._compat import HAS_SWITCH

if not HAS_SWITCH:
    pytest.skip("needs torch.ops.higher_order.switch (torch >= 2.14)", allow_module_level=True)

from torch.fx.experimental.proxy_tensor import make_fx

from branchyard.passes import CondToSwitch, cond_to_switch
from branchyard.fx.control_flow import is_cond, is_switch
from branchyard.fx.raise_free import RAISE_FREE, raise_reason

cond = torch.cond
aten = torch.ops.aten


def all_nodes(gm):
    for m in gm.modules():
        if isinstance(m, torch.fx.GraphModule):
            yield from m.graph.nodes


def outcome(fn: Callable, *args: Any) -> Any:
    """What a call does: ('ok', outputs) or ('raise', exception type)."""
    try:
        out = fn(*args)
    except Exception as exc:  # the exception type is the observable behaviour
        return ("raise", type(exc))
    return ("ok", tuple(out) if isinstance(out, (tuple, list)) else (out,))


def check_same(a: Any, b: Any, args: tuple) -> str:
    """Two outcomes agree: the same values, or the same exception type."""
    assert a[0] == b[0], f"expected {a}, got {b} on inputs {args}"
    if a[0] == "raise":
        assert a[1] is b[1], f"expected {a[1].__name__}, got {b[1].__name__} on inputs {args}"
    else:
        assert len(a[1]) == len(b[1])
        for u, v in zip(a[1], b[1]):
            torch.testing.assert_close(v, u, msg=lambda m: f"{m}\ninputs {args}")
    return a[0]


def assert_same_outcome(before: Callable, after: Callable, args: tuple) -> str:
    return check_same(outcome(before, *args), outcome(after, *args), args)


def rewrite(gm, flatten: str = "all"):
    """The pass object on a copy. ``flatten="all"`` by default: exceptions are
    preserved whatever the cost model decides, so test the most hoisting."""
    gm = copy.deepcopy(gm)
    p = CondToSwitch(flatten)
    res = p(gm)
    return res.graph_module, res.modified, p.report


TABLE = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
X = torch.tensor([0.5, -1.0, 2.0])


# --------------------------------------------------------------------------- the example


def guarded_embedding(x, idx, table):
    def guarded(x, idx, table):
        return cond(F.embedding(idx, table).sum() > 0, lambda x, idx, t: x + 1, lambda x, idx, t: x - 1, (x, idx, table))

    return cond((idx < 0) | (idx >= 5), lambda x, idx, t: x * 0, guarded, (x, idx, table))


def test_guarded_embedding_predicate_is_not_hoisted_and_out_of_range_still_returns():
    gm = make_fx(guarded_embedding)(X, torch.tensor(1), TABLE)
    after, modified, report = rewrite(gm)
    # The only nested predicate may raise: nothing to flatten, the tree stays nested.
    assert not modified
    assert sum(is_cond(n) for n in all_nodes(after)) == 2
    assert any("embedding" in s.reason and "may raise" in s.reason for s in report.skips)
    for i in range(-3, 9):
        args = (X, torch.tensor(i), TABLE)
        assert assert_same_outcome(gm, after, args) == "ok"


def test_skip_reason_reaches_the_branchyard_logger(caplog):
    gm = make_fx(guarded_embedding)(X, torch.tensor(1), TABLE)
    with caplog.at_level(logging.DEBUG, logger="branchyard"):
        rewrite(gm)
    assert any("embedding" in r.getMessage() and "may raise" in r.getMessage() for r in caplog.records)


def test_exported_program_with_guarded_embedding():
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.nn.Parameter(TABLE.clone())

        def forward(self, x, idx):
            return guarded_embedding(x, idx, self.table)

    ep = torch.export.export(M(), (X, torch.tensor(1)))
    out = cond_to_switch(ep)
    for i in range(-3, 9):
        assert assert_same_outcome(ep.module(), out.module(), (X, torch.tensor(i))) == "ok"


# --------------------------------------------------------------------------- other members of the class


def guarded_view(a, x):
    def inner(x):
        return cond(x.view(-1).sum() > 0, lambda x: x + 1, lambda x: x - 1, (x,))

    return cond(a, lambda x: x * 2, inner, (x,))


@pytest.mark.parametrize("trace", ["make_fx", "export"])
def test_a_view_predicate_is_not_hoisted_for_inputs_of_other_strides(trace):
    """export and make_fx guard shapes, not strides: a transposed input of the
    traced shape reaches the outer cond's branch that does not view it, and a
    hoisted view would raise there."""
    example = (torch.tensor(True), torch.randn(3, 4))
    if trace == "make_fx":
        before = make_fx(guarded_view)(*example)
        after, modified, report = rewrite(before)
    else:
        class M(torch.nn.Module):
            def forward(self, a, x):
                return guarded_view(a, x)

        ep = torch.export.export(M(), example)
        before, after = ep.module(), cond_to_switch(ep).module()
        (_, _, report) = rewrite(ep.graph_module)
    assert any("view" in s.reason and "may raise" in s.reason for s in report.skips), report.skips
    transposed = torch.randn(4, 3).t()
    for args in [(torch.tensor(True), transposed), (torch.tensor(False), transposed),
                 (torch.tensor(True), torch.randn(3, 4)), (torch.tensor(False), torch.randn(3, 4))]:
        assert_same_outcome(before, after, args)
    assert outcome(after, torch.tensor(True), transposed)[0] == "ok"
    assert outcome(after, torch.tensor(False), transposed) == ("raise", RuntimeError)


@pytest.mark.parametrize("op", [aten.view.default, aten.view_as.default, aten._unsafe_view.default])
def test_views_that_depend_on_strides_are_not_raise_free(op):
    assert all(op not in rule.targets for rule in RAISE_FREE)


def _guarded(guard: Callable, pred: Callable) -> Callable:
    """p ? x * 0 : (guard ? (pred ? x + 1 : x - 1) : x * 3): a three-level
    tree whose middle predicate is safe and whose innermost may raise."""

    def f(p, x, i, d, table):
        def inner(x, i, d, table):
            return cond(pred(x, i, d, table), lambda x, i, d, t: x + 1, lambda x, i, d, t: x - 1, (x, i, d, table))

        def mid(x, i, d, table):
            return cond(guard(x, i, d, table), inner, lambda x, i, d, t: x * 3, (x, i, d, table))

        return cond(p, lambda x, i, d, t: x * 0, mid, (x, i, d, table))

    return f


IN_RANGE = lambda x, i, d, t: (i >= 0) & (i < 5)  # noqa: E731
NONZERO = lambda x, i, d, t: d != 0  # noqa: E731

#: name -> (guard that makes it safe, predicate that may raise without it, what the skip names)
RAISING = {
    "embedding": (IN_RANGE, lambda x, i, d, t: F.embedding(i, t).sum() > 0, "embedding"),
    "index_select": (IN_RANGE, lambda x, i, d, t: t.index_select(0, i.view(1)).sum() > 0, "index_select"),
    "gather": (IN_RANGE, lambda x, i, d, t: t.gather(0, i.view(1, 1).expand(1, 3)).sum() > 0, "gather"),
    "nll_loss": (IN_RANGE, lambda x, i, d, t: F.nll_loss(t.t()[:1], i.view(1)) > 0, "nll_loss"),
    "floor_divide": (NONZERO, lambda x, i, d, t: i // d > 0, "zero divisor"),
    "remainder": (NONZERO, lambda x, i, d, t: i % d == 0, "zero divisor"),
    "linalg_inv": (NONZERO, lambda x, i, d, t: torch.linalg.inv(t[:3] * d).sum() > 0, "linalg_inv"),
}

IDX = [-2, -1, 0, 1, 3, 4, 5, 7]
DIV = [-2, 0, 1, 3]


@pytest.mark.parametrize("name", sorted(RAISING))
def test_raising_predicate_under_its_guard_keeps_its_cond_nested(name):
    guard, pred, why = RAISING[name]
    f = _guarded(guard, pred)
    gm = make_fx(f)(torch.tensor(False), X, torch.tensor(1), torch.tensor(1), TABLE)
    after, modified, report = rewrite(gm)
    # The two safe levels still become one switch; the raising one stays a cond inside a branch.
    assert modified
    assert sum(is_switch(n) for n in all_nodes(after)) == 1
    assert sum(is_cond(n) for n in all_nodes(after)) == 1
    assert any(why in s.reason and "may raise" in s.reason for s in report.skips), [s.reason for s in report.skips]
    kinds = set()
    for p, i, d, s in itertools.product((True, False), IDX, DIV, (1.0, -1.0)):
        kinds.add(assert_same_outcome(gm, after, (torch.tensor(p), X * s, torch.tensor(i), torch.tensor(d), TABLE)))
    assert kinds == {"ok"}  # the guard keeps every path from raising, before and after


@pytest.mark.parametrize("name", sorted(RAISING))
def test_unguarded_raising_predicate_still_raises_after_the_rewrite(name):
    """The reverse direction: where the original raises, so does the rewrite."""
    _, pred, _ = RAISING[name]
    always = lambda x, i, d, t: x.sum() > -100  # noqa: E731  (safe, always true)
    f = _guarded(always, pred)
    gm = make_fx(f)(torch.tensor(False), X, torch.tensor(1), torch.tensor(1), TABLE)
    after, _, _ = rewrite(gm)
    kinds = set()
    for p, i, d in itertools.product((True, False), IDX, DIV):
        kinds.add(assert_same_outcome(gm, after, (torch.tensor(p), X, torch.tensor(i), torch.tensor(d), TABLE)))
    assert kinds == {"ok", "raise"}


def test_raising_predicate_over_identical_leaves_is_not_dropped():
    """A nested cond whose two leaves are identical chooses nothing, but its
    predicate still raises; before the allow-list the pass folded it away."""

    def f(p, x, i, table):
        same = lambda x, i, t: x + 1  # noqa: E731
        inner = lambda x, i, t: cond(F.embedding(i, t).sum() > 0, same, same, (x, i, t))  # noqa: E731
        return cond(p, lambda x, i, t: x * 2, inner, (x, i, table))

    gm = make_fx(f)(torch.tensor(False), X, torch.tensor(1), TABLE)
    after, _, _ = rewrite(gm)
    seen = set()
    for p, i in itertools.product((True, False), IDX):
        seen.add(assert_same_outcome(gm, after, (torch.tensor(p), X, torch.tensor(i), TABLE)))
    assert seen == {"ok", "raise"}


def test_raising_root_predicate_over_identical_leaves_is_kept():
    """Every leaf identical: the switch disappears and the leaf is inlined,
    but a root predicate that may raise is still computed."""

    def f(x, i, table):
        same = lambda x, i, t: x + 1  # noqa: E731
        inner = lambda x, i, t: cond(i > 2, same, same, (x, i, t))  # noqa: E731
        return cond(F.embedding(i, table).sum() > 0, inner, same, (x, i, table))

    gm = make_fx(f)(X, torch.tensor(1), TABLE)
    after, modified, _ = rewrite(gm)
    assert modified and not any(is_cond(n) or is_switch(n) for n in all_nodes(after))
    assert aten.embedding.default in [n.target for n in after.graph.nodes]
    seen = {assert_same_outcome(gm, after, (X, torch.tensor(i), TABLE)) for i in IDX}
    assert seen == {"ok", "raise"}



def _outcomes_over_guards(gm, after) -> set[str]:
    """Run both programs on (guard, x, index, table) for every guard, index and sign of x; the outcomes seen."""
    return {
        assert_same_outcome(gm, after, (torch.tensor(p), X * s, torch.tensor(i), TABLE))
        for p, i, s in itertools.product((True, False), IDX, (1.0, -1.0))
    }

def test_unused_raising_node_in_an_inlined_branch_still_runs():
    """A branch computes something that may raise and never uses it, then
    branches again: materializing the leaves keeps that computation."""

    def f(p, x, i, table):
        def mid(x, i, table):
            F.embedding(i, table)  # unused, but raises for i out of range
            y = x * 2
            return cond(x.sum() > 0, lambda y: y + 1, lambda y: y - 1, (y,))

        return cond(p, lambda x, i, t: x * 0, mid, (x, i, table))

    gm = make_fx(f)(torch.tensor(False), X, torch.tensor(1), TABLE)
    assert aten.embedding.default in [n.target for n in all_nodes(gm)]
    after, modified, _ = rewrite(gm)
    assert modified and sum(is_switch(n) for n in all_nodes(after)) == 1
    assert _outcomes_over_guards(gm, after) == {"ok", "raise"}


def test_unused_raising_node_beside_a_nested_cond_still_runs():
    """The same with nothing else in the branch: the nested cond's operands
    are the branch's inputs and its outputs the branch's, which used to let
    the pass take the nested branches as leaves and drop the rest."""

    def f(p, x, i, table):
        def mid(x, i, table):
            F.embedding(i, table)
            return cond(x.sum() > 0, lambda x, i, t: x + 1, lambda x, i, t: x - 1, (x, i, table))

        return cond(p, lambda x, i, t: x * 0, mid, (x, i, table))

    gm = make_fx(f)(torch.tensor(False), X, torch.tensor(1), TABLE)
    after, modified, _ = rewrite(gm)
    assert modified and sum(is_switch(n) for n in all_nodes(after)) == 1
    assert _outcomes_over_guards(gm, after) == {"ok", "raise"}


def test_safe_predicates_are_still_hoisted():
    """The allow-list keeps the pass useful: float division by a tensor,
    max over a static non-empty shape, casts and comparisons are hoisted."""

    def f(p, x, d):
        inner = lambda x, d: cond((x / d.float()).amax() > 0, lambda x, d: x + 1, lambda x, d: x - 1, (x, d))  # noqa: E731
        return cond(p, lambda x, d: x * 2, inner, (x, d))

    gm = make_fx(f)(torch.tensor(True), X, torch.tensor(1))
    after, modified, report = rewrite(gm)
    assert modified and not any(is_cond(n) for n in all_nodes(after))
    assert report.skips == []
    for p, d, s in itertools.product((True, False), DIV, (1.0, -1.0)):
        assert assert_same_outcome(gm, after, (torch.tensor(p), X * s, torch.tensor(d))) == "ok"


# --------------------------------------------------------------------------- the allow-list itself


def test_every_allow_listed_row_names_real_targets():
    assert all(rule.targets for rule in RAISE_FREE)


@pytest.mark.parametrize(
    "fn, args, safe",
    [
        (lambda i, d: i // d, (torch.tensor(3), torch.tensor(2)), False),
        (lambda i, d: i // 2, (torch.tensor(3), torch.tensor(2)), True),
        (lambda i, d: i % d, (torch.tensor(3), torch.tensor(2)), False),
        (lambda i, d: i % 3, (torch.tensor(3), torch.tensor(2)), True),
        (lambda i, d: i.float() / d, (torch.tensor(3), torch.tensor(2)), True),
        (lambda i, d: torch.div(i.float(), d, rounding_mode="floor"), (torch.tensor(3), torch.tensor(2)), True),
        (lambda i, d: i ** 2, (torch.tensor(3), torch.tensor(2)), True),
        (lambda i, d: i.float() ** d, (torch.tensor(3), torch.tensor(2)), True),
        (lambda i, d: torch.ones(3, 4)[:, : int(2)].amax(), (torch.tensor(3), torch.tensor(2)), True),
        (lambda i, d: torch.arange(5)[i.view(1)], (torch.tensor(3), torch.tensor(2)), False),
    ],
)
def test_raise_reason_by_dtype_and_constant(fn, args, safe):
    gm = make_fx(fn)(*args)
    last = [n for n in gm.graph.nodes if n.op == "call_function"][-1]
    assert (raise_reason(last) is None) == safe, raise_reason(last)
    if not safe:  # the op really raises for some value of its inputs
        bad = {"floor_divide": (torch.tensor(3), torch.tensor(0)), "pow": (torch.tensor(-1), torch.tensor(2)),
               "index": (torch.tensor(9), torch.tensor(2)), "remainder": (torch.tensor(3), torch.tensor(0))}
        key = next(k for k in bad if k in str(last.target))
        with pytest.raises(Exception):
            fn(*bad[key])


# --------------------------------------------------------------------------- property test

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

#: Predicates over (x: f32[3], i: i64[], d: i64[], table: f32[5, 3]). The
#: first group may raise for some inputs; the second never does.
PREDS: dict[str, Callable] = {
    "embedding": RAISING["embedding"][1],
    "index_select": RAISING["index_select"][1],
    "gather": RAISING["gather"][1],
    "floor_divide": RAISING["floor_divide"][1],
    "remainder": RAISING["remainder"][1],
    "linalg_inv": RAISING["linalg_inv"][1],
    "in_range": IN_RANGE,
    "out_of_range": lambda x, i, d, t: (i < 0) | (i >= 5),
    "d_nonzero": NONZERO,
    "d_zero": lambda x, i, d, t: d == 0,
    "i_nonneg": lambda x, i, d, t: i >= 0,
    "i_lt_3": lambda x, i, d, t: i < 3,
    "x_pos": lambda x, i, d, t: x.sum() > 0,
    "float_div": lambda x, i, d, t: (x / d.float()).amax() > 0,
    "cast": lambda x, i, d, t: (i.float() * 0.5 + d).to(torch.int32) > 1,
}
RAISING_PREDS = {"embedding", "index_select", "gather", "floor_divide", "remainder", "linalg_inv"}

#: Leaves: a few distinct bodies, one repeated on purpose (identical leaves
#: are merged), and one that itself may raise.
LEAVES: dict[str, Callable] = {
    "a": lambda x, i, d, t: x + 1,
    "b": lambda x, i, d, t: x * 2 - 1,
    "c": lambda x, i, d, t: x.flip(0) * 3,
    "emb": lambda x, i, d, t: x + F.embedding(i, t),
}


@dataclass(frozen=True)
class PLeaf:
    kind: str


@dataclass(frozen=True)
class PCond:
    pred: str
    true: "PNode"
    false: "PNode"


PNode = Union[PLeaf, PCond]


def depth(n: PNode) -> int:
    return 0 if isinstance(n, PLeaf) else 1 + max(depth(n.true), depth(n.false))


def n_paths(n: PNode) -> int:
    return 1 if isinstance(n, PLeaf) else n_paths(n.true) + n_paths(n.false)


def as_cond(n: PNode) -> Callable:
    if isinstance(n, PLeaf):
        return LEAVES[n.kind]
    pred, t, f = PREDS[n.pred], as_cond(n.true), as_cond(n.false)
    return lambda x, i, d, tb: cond(pred(x, i, d, tb), t, f, (x, i, d, tb))


def as_python(n: PNode, x, i, d, t, path: list[str]) -> torch.Tensor:
    """The same program with Python ``if``: the reference, and the path taken."""
    while isinstance(n, PCond):
        taken = bool(PREDS[n.pred](x, i, d, t))
        path.append(f"{n.pred}={taken}")
        n = n.true if taken else n.false
    path.append(n.kind)
    return LEAVES[n.kind](x, i, d, t)


@st.composite
def programs(draw, max_depth: int = 4) -> PNode:
    def node(level: int) -> PNode:
        if level > 0 and (level >= max_depth or draw(st.integers(0, 3)) == 0):
            return PLeaf(draw(st.sampled_from(sorted(LEAVES))))
        if level == 0:  # the root decides without raising; the rest is free
            pred = draw(st.sampled_from(sorted(set(PREDS) - RAISING_PREDS)))
        else:
            pred = draw(st.sampled_from(sorted(PREDS)))
        return PCond(pred, node(level + 1), node(level + 1))

    return node(0)


PROPERTY_EXAMPLES = int(os.environ.get("BRANCHYARD_PROPERTY_EXAMPLES", "40"))
INPUTS = [
    (X * s, torch.tensor(i), torch.tensor(d), TABLE)
    for s, i, d in itertools.product((1.0, -1.0), IDX, DIV)
]
#: Totals over the run, printed at the end (pytest -s) for the report.
COUNTS = {"programs": 0, "paths": 0, "raising_paths": 0, "input_sets": 0, "comparisons": 0,
          "raised_both": 0, "hoisted_switches": 0, "kept_nested": 0}


@settings(max_examples=PROPERTY_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(tree=programs(), flatten=st.sampled_from(["all", "cost"]))
def test_random_guarded_programs_raise_and_return_as_before(tree: PNode, flatten: str) -> None:
    fn = as_cond(tree)
    gm = make_fx(fn)(X, torch.tensor(1), torch.tensor(1), TABLE)  # values on which nothing raises
    after, modified, report = rewrite(gm, flatten)
    paths: set[tuple[str, ...]] = set()
    for args in INPUTS:
        path: list[str] = []
        ref = outcome(lambda *a: as_python(tree, *a, path=path), *args)
        paths.add(tuple(path) + ((ref[1].__name__,) if ref[0] == "raise" else ()))
        orig = outcome(gm, *args)
        check_same(ref, orig, args)  # the generator's own contract: cond == Python if
        got = check_same(orig, outcome(after, *args), args)  # the pass's contract
        COUNTS["input_sets"] += 1
        COUNTS["comparisons"] += 2
        COUNTS["raised_both"] += got == "raise"
    # Every remaining cond nested in a switch branch or a cond branch was kept for a reason.
    for s in report.skips:
        assert "may raise" in s.reason or "lone cond" in s.reason or "not a tensor" in s.reason or \
            "holds" in s.reason or "index" in s.reason or "nested" in s.reason, s.reason
    COUNTS["programs"] += 1
    COUNTS["paths"] += len(paths)
    COUNTS["raising_paths"] += sum(1 for p in paths if p[-1].endswith("Error"))
    COUNTS["hoisted_switches"] += sum(is_switch(n) for n in all_nodes(after))
    COUNTS["kept_nested"] += sum(is_cond(n) for n in all_nodes(after))


def test_zz_property_test_drove_raising_and_returning_paths(capsys):
    """Runs after the property test (file order): it drove paths that raise
    and paths that return, and the pass both flattened and kept nested.
    Prints the totals for the report (visible with -s)."""
    if COUNTS["programs"] == 0:
        pytest.skip("the property test did not run")
    with capsys.disabled():
        print(f"\nproperty counts: {COUNTS}")
    assert COUNTS["raising_paths"] > 0 and COUNTS["raised_both"] > 0
    assert COUNTS["paths"] > COUNTS["programs"]
    assert COUNTS["hoisted_switches"] > 0 and COUNTS["kept_nested"] > 0
