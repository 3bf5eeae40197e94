"""branchyard.fx.switch_lowering: one switch -> a balanced cond tree whose
conds pass on only the operands their sides read."""

from __future__ import annotations

import operator

import pytest
import torch

from branchyard._compat import HAS_SWITCH
from branchyard.fx import control_flow as cf
from branchyard.fx.graph_walk import iter_graph_modules
from branchyard.fx.switch_lowering import lower_switch

X = torch.tensor([0.5, -1.0, 2.0])
W = torch.tensor([2.0, 3.0, 4.0])
B = torch.tensor([-1.0, 1.0, 0.5])


def python_switch_module(branches, n_operands):
    """A GraphModule with one switch node whose target is fx's Python switch."""
    root = torch.nn.Module()
    g = torch.fx.Graph()
    index = g.placeholder("index")
    ops = [g.placeholder(f"op{i}") for i in range(n_operands)]
    attrs = []
    for k, fn in enumerate(branches):
        setattr(root, f"branch{k}", torch.fx.symbolic_trace(fn))
        attrs.append(g.get_attr(f"branch{k}"))
    sw = g.call_function(cf.switch, (index, attrs, tuple(ops)))
    g.output((g.call_function(operator.getitem, (sw, 0)),))
    return torch.fx.GraphModule(root, g), sw


#: Branch k reads a different subset of (x, w, b).
BRANCHES = [
    lambda x, w, b: x * w,
    lambda x, w, b: x + b,
    lambda x, w, b: x - 1.0,
    lambda x, w, b: w * b,
    lambda x, w, b: x.sin(),
]


def conds(gm):
    return [(m, n) for m in iter_graph_modules(gm) for n in m.graph.nodes if cf.is_cond(n)]


def operand_names(node):
    return [a.name for a in node.args[3]]


def test_each_cond_passes_only_what_its_sides_read():
    gm, sw = python_switch_module(BRANCHES, 3)
    lowered = lower_switch(gm, sw)
    gm.recompile()
    assert lowered.conds_created == 4 and lowered.root is not None and cf.is_cond(lowered.root)
    assert lowered.freed_attrs == [f"branch{k}" for k in range(5)]
    assert not any(hasattr(gm, f"branch{k}") for k in range(5)), "freed branch graphs are deleted"
    by_owner = {(m is gm, tuple(operand_names(n))) for m, n in conds(gm)}
    # root [0, 5): every operand is read somewhere, and its sides [0, 2) / [2, 5) still choose
    assert (True, ("index", "op0", "op1", "op2")) in by_owner
    shapes = sorted(len(n.args[3]) for _, n in conds(gm))
    # [0, 2): x*w | x+b -> (x, w, b); [2, 5) -> (index, x, w, b); [3, 5): w*b | sin x -> (x, w, b)
    assert shapes == [3, 3, 4, 4]
    for m, n in conds(gm):
        for label, body in cf.TABLE["cond"].branches(m, n):
            phs = cf.placeholders(body)
            assert len(phs) == len(n.args[3]), f"{n.name}[{label}] takes what the cond passes"
    for i in range(-3, 9):
        want = BRANCHES[min(max(i, 0), 4)](X, W, B)
        torch.testing.assert_close(gm(torch.tensor(i), X, W, B)[0], want, msg=f"index {i}")


def test_an_operand_no_branch_reads_is_not_passed_at_all():
    gm, sw = python_switch_module([lambda x, w: x + 1, lambda x, w: x * 2, lambda x, w: x - 3], 2)
    lower_switch(gm, sw)
    gm.recompile()
    assert all("op1" not in operand_names(n) for _, n in conds(gm))
    assert [gm(torch.tensor(i), X, W)[0].tolist() for i in (0, 1, 2)] == [(X + 1).tolist(), (X * 2).tolist(), (X - 3).tolist()]


def test_dead_attrs_are_left_to_the_caller_when_collected():
    gm, sw = python_switch_module(BRANCHES[:2], 3)
    dead: set[str] = set()
    lowered = lower_switch(gm, sw, dead_attrs=dead)
    assert dead == {"branch0", "branch1"} == set(lowered.freed_attrs)
    assert hasattr(gm, "branch0"), "the caller deletes them once for the whole graph"


def test_literal_index_splices_the_chosen_body():
    gm, sw = python_switch_module(BRANCHES, 3)
    sw.args = (7, *sw.args[1:])  # clamps to the last branch
    lowered = lower_switch(gm, sw)
    gm.recompile()
    assert lowered.root is None and lowered.conds_created == 0 and conds(gm) == []
    torch.testing.assert_close(gm(torch.tensor(0), X, W, B)[0], X.sin())


@pytest.mark.skipif(not HAS_SWITCH, reason="torch.switch needs torch >= 2.14")
def test_expert_dispatch_round_trip_is_no_bigger_than_the_original():
    # Issue 15: cond_to_switch then switch_to_cond grew operands and placeholders
    # (every cond of the tree passed every operand of the switch).
    from branchyard.examples import example_program
    from branchyard.inspection import graph_stats
    from branchyard.passes import cond_to_switch, switch_to_cond

    ep = example_program("expert-dispatch", 8)
    switched = cond_to_switch(ep)
    back = switch_to_cond(switched)
    before, mid, after = graph_stats(ep), graph_stats(switched), graph_stats(back)
    assert mid.control_flow == {"cond": 0, "switch": 1, "while_loop": 0}
    assert after.control_flow == before.control_flow == {"cond": 7, "switch": 0, "while_loop": 0}
    assert after.control_flow_operands <= before.control_flow_operands
    assert after.placeholders <= before.placeholders
    assert after.nodes <= before.nodes
    # Measured with this lowering: 84 -> 17 -> 58 operands, 186 -> 154 -> 134 placeholders.
    assert (before.control_flow_operands, mid.control_flow_operands, after.control_flow_operands) == (84, 17, 58)
    assert (before.placeholders, after.placeholders) == (186, 134)
    x = torch.randn(4, 16)
    for k in range(-1, 10):  # every expert and both out-of-range sides
        torch.testing.assert_close(back.module()(x, torch.tensor(k)), ep.module()(x, torch.tensor(k)))


def _branch_reading(k: int, used: list[int]):
    """A branch of three operands that reads exactly the operands in ``used``."""
    if not used:
        return lambda a, b, c: torch.full((3,), float(k))
    return lambda a, b, c: sum((a, b, c)[i] * (i + 1) for i in used) + float(k)


@pytest.mark.parametrize("seed", range(12))
def test_random_switches_lower_to_the_same_function_with_minimal_operands(seed):
    import random

    rng = random.Random(seed)
    n = rng.randint(2, 9)
    used = [sorted(rng.sample(range(3), rng.randint(0, 3))) for _ in range(n)]
    branches = [_branch_reading(k, u) for k, u in enumerate(used)]
    gm, sw = python_switch_module(branches, 3)
    lowered = lower_switch(gm, sw)
    gm.recompile()
    assert lowered.conds_created == n - 1
    read_anywhere = {f"op{i}" for u in used for i in u}
    assert set(operand_names(lowered.root)) - {"index"} == read_anywhere
    for owner, node in conds(gm):
        names = set(operand_names(node)) - {"index"}
        # a cond never passes an operand that no branch below it reads
        assert names <= read_anywhere, (names, read_anywhere)
    args = (X, W, B)
    for i in range(-2, n + 2):
        want = cf.switch(torch.tensor(i), branches, args)[0]
        torch.testing.assert_close(gm(torch.tensor(i), *args)[0], want, msg=f"seed {seed} index {i} used {used}")


def _hop_switch(n: int, dtype: torch.dtype):
    """A make_fx graph (example values in meta) with one n-way switch on an index of ``dtype``."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(i, x):
        return torch.ops.higher_order.switch(i, [(lambda k: lambda t: (t + k,))(k) for k in range(n)], (x,))

    return make_fx(f)(torch.tensor(0, dtype=dtype), torch.zeros(2))


def _widenings(gm):
    return [n for n in gm.graph.nodes if n.target is torch.ops.aten._to_copy.default]


@pytest.mark.skipif(not HAS_SWITCH, reason="torch.switch needs torch >= 2.14")
@pytest.mark.parametrize("dtype, n", [(torch.int8, 200), (torch.uint8, 260)])
def test_narrow_index_with_more_branches_than_its_dtype_holds_picks_the_right_branch(dtype, n):
    # aten.le.Scalar casts its constant to the index's dtype: index <= 199 on
    # an int8 index wrapped to index <= -57, and indices 100..127 ran branch 199.
    gm = _hop_switch(n, dtype)
    lowered = lower_switch(gm, next(x for x in gm.graph.nodes if cf.is_switch(x)))
    gm.recompile()
    (widen,) = _widenings(gm)
    assert widen.kwargs == {"dtype": torch.int64} and widen.meta["val"].dtype == torch.int64
    assert lowered.root.args[0].args[0] is widen, "the root predicate compares the widened index"
    subtree = getattr(gm, lowered.root.args[2].target)
    assert cf.placeholders(subtree)[0].meta["val"].dtype == torch.int64, "inner conds get the widened index"
    info = torch.iinfo(dtype)
    for i in range(info.min, info.max + 1):  # every value the index can hold
        want = min(max(i, 0), n - 1)
        got = gm(torch.tensor(i, dtype=dtype), torch.zeros(2))[0]
        assert got.tolist() == [float(want)] * 2, f"index {i}"


@pytest.mark.skipif(not HAS_SWITCH, reason="torch.switch needs torch >= 2.14")
def test_narrow_index_whose_dtype_holds_every_split_constant_is_compared_as_it_is():
    gm = _hop_switch(129, torch.int8)  # the largest constant, 127, fits int8
    lower_switch(gm, next(x for x in gm.graph.nodes if cf.is_switch(x)))
    gm.recompile()
    assert _widenings(gm) == []
    for i in (-128, 0, 64, 126, 127):
        assert gm(torch.tensor(i, dtype=torch.int8), torch.zeros(2))[0].tolist() == [float(max(i, 0))] * 2


def test_index_of_unknown_dtype_is_widened_once_constants_leave_int8():
    # A symbolic_trace graph has no example values: the index may be int8.
    branches = [(lambda k: lambda x: x + k)(k) for k in range(130)]
    gm, sw = python_switch_module(branches, 1)
    lower_switch(gm, sw)
    gm.recompile()
    assert len(_widenings(gm)) == 1
    for i in (-128, 0, 100, 127):
        assert gm(torch.tensor(i, dtype=torch.int8), torch.zeros(1))[0].item() == float(max(i, 0))
