"""switch_to_cond: the reverse lowering, clamping reproduced, structure, errors."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from branchyard._compat import HAS_SWITCH

if not HAS_SWITCH:  # torch < 2.14 (e.g. the GPU machine): nothing to rewrite to
    pytest.skip("needs torch.ops.higher_order.switch (torch >= 2.14)", allow_module_level=True)

from torch._higher_order_ops import switch

from branchyard.errors import MalformedGraphError
from branchyard.fx.control_flow import is_cond, is_switch
from branchyard.passes import SwitchToCond, switch_to_cond
from branchyard.registry import get_pass

aten = torch.ops.aten
X = torch.tensor([0.5, -1.0, 2.0])


def all_nodes(gm):
    for m in gm.modules():
        if isinstance(m, torch.fx.GraphModule):
            yield from m.graph.nodes


def n_conds(gm):
    return sum(is_cond(n) for n in all_nodes(gm))


def n_switches(gm):
    return sum(is_switch(n) for n in all_nodes(gm))


def cond_depth(gm) -> int:
    best = 0
    for n in gm.graph.nodes:
        if is_cond(n):
            subs = [getattr(gm, a.target) for a in n.args[1:3]]
            best = max(best, 1 + max(cond_depth(s) for s in subs))
    return best


BRANCHES = [lambda x: x + 1, lambda x: x * 2, lambda x: x.sin(), lambda x: x - 7, lambda x: x.exp()]


class Switch(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.n = n

    def forward(self, i, x):
        return switch(i, BRANCHES[: self.n], (x,))


def raw_index_switch(n):
    """An exported switch whose index reaches the op unclamped (as a hand-built graph may)."""
    ep = torch.export.export(Switch(n), (torch.tensor(0), X))
    for node in ep.graph.nodes:
        if node.target is aten.clamp.default:
            node.replace_all_uses_with(node.args[0])
            ep.graph.erase_node(node)
            break
    ep.graph_module.recompile()
    return ep


def reference(n, i, x):
    return BRANCHES[min(max(i, 0), n - 1)](x)


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_switch_lowers_to_balanced_cond_tree_that_clamps(n):
    ep = raw_index_switch(n)
    after = switch_to_cond(ep)
    gm = after.graph_module
    assert n_switches(gm) == 0 and n_conds(gm) == n - 1
    assert cond_depth(gm) == math.ceil(math.log2(n))
    for i in range(-4, n + 4):
        torch.testing.assert_close(after.module()(torch.tensor(i), X), reference(n, i, X), msg=f"i={i}")


def test_lowered_program_decomposes_and_reexports():
    ep = switch_to_cond(torch.export.export(Switch(3), (torch.tensor(0), X)))
    dec = ep.run_decompositions()
    again = torch.export.export(ep.module(), (torch.tensor(0), X))
    assert n_switches(again.graph_module) == 0
    for i in range(-2, 5):
        for prog in (dec, again):
            torch.testing.assert_close(prog.module()(torch.tensor(i), X), reference(3, i, X))


def test_report_flag_and_idempotence():
    ep = torch.export.export(Switch(4), (torch.tensor(0), X))
    gm = copy.deepcopy(ep.graph_module)
    p = SwitchToCond()
    assert p(gm).modified
    assert p.report.stats == {"switches_lowered": 1, "conds_created": 3}
    code = gm.code
    q = SwitchToCond()
    assert not q(gm).modified and gm.code == code


def test_graph_without_switch_is_unchanged():
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    p = SwitchToCond()
    res = p(copy.deepcopy(gm))
    assert not res.modified and res.graph_module.code == gm.code


def test_registered_for_the_cli():
    assert isinstance(get_pass("switch_to_cond"), SwitchToCond) and SwitchToCond.name == "switch_to_cond"


def switch_node(gm):
    return next(n for n in gm.graph.nodes if is_switch(n))


def test_one_branch_switch_is_replaced_by_its_body():
    ep = torch.export.export(Switch(3), (torch.tensor(0), X))
    gm = copy.deepcopy(ep.graph_module)
    node = switch_node(gm)
    node.args = (node.args[0], node.args[1][2:], node.args[2])
    after = switch_to_cond(gm)
    assert n_switches(after) == 0 and n_conds(after) == 0
    assert aten.sin.default in [n.target for n in after.graph.nodes]
    torch.testing.assert_close(after(torch.tensor(0), X)[0], X.sin())


def test_switch_with_zero_branches_is_rejected():
    gm = copy.deepcopy(torch.export.export(Switch(3), (torch.tensor(0), X)).graph_module)
    node = switch_node(gm)
    node.args = (node.args[0], [], node.args[2])
    with pytest.raises(MalformedGraphError, match=r"node 'switch'.*zero branches"):
        switch_to_cond(gm)


def test_float_index_is_rejected():
    gm = copy.deepcopy(torch.export.export(Switch(3), (torch.tensor(0), X)).graph_module)
    node = switch_node(gm)
    x = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == "x")
    with gm.graph.inserting_before(node):
        f = gm.graph.call_function(aten.sum.default, (x,))
    f.meta["val"] = x.meta["val"].sum()
    node.args = (f, *node.args[1:])
    with pytest.raises(MalformedGraphError, match=r"node 'switch'.*index has dtype torch.float32"):
        switch_to_cond(gm)


def test_branch_outputs_differing_in_dtype_are_rejected():
    gm = copy.deepcopy(torch.export.export(Switch(3), (torch.tensor(0), X)).graph_module)
    node = switch_node(gm)
    from torch.fx.experimental.proxy_tensor import make_fx

    setattr(gm, node.args[1][1].target, make_fx(lambda x: (x.double(),))(X))
    with pytest.raises(MalformedGraphError, match=r"node 'switch'.*output 0 is torch.float32 in branch 0 but torch.float64 in branch 1"):
        switch_to_cond(gm)


def test_symint_index_from_a_dynamic_shape():
    class SizeSwitch(torch.nn.Module):
        def forward(self, x):
            return switch(x.shape[0] - 3, BRANCHES[:3], (x,))

    dim = torch.export.Dim("n", min=1, max=10)
    ep = torch.export.export(SizeSwitch(), (torch.randn(4, 2),), dynamic_shapes=({0: dim},))
    low = switch_to_cond(ep)
    assert n_switches(low.graph_module) == 0 and n_conds(low.graph_module) == 2
    for n in range(1, 9):
        x = torch.randn(n, 2)
        torch.testing.assert_close(low.module()(x), reference(3, n - 3, x), msg=f"n={n}")


def _switch_with_an_unread_operand_that_may_raise(n_branches: int):
    """``switch(i, branches, (x, embedding(t, j)))`` where no branch reads the
    embedding: built by hand, since make_fx and export drop unread operands."""
    import operator

    from torch.fx.experimental.proxy_tensor import make_fx

    root = torch.nn.Module()
    ex = (torch.ones(3), torch.randn(3))
    def branch(k):
        return lambda x, e: (x * (k + 1),)

    for k in range(n_branches):
        setattr(root, f"b{k}", make_fx(branch(k))(*ex))
    g = torch.fx.Graph()
    i, x, j, t = (g.placeholder(name) for name in ("i", "x", "j", "t"))
    e = g.call_function(torch.ops.aten.embedding.default, (t, j))
    sw = g.call_function(torch.ops.higher_order.switch,
                         (i, [g.get_attr(f"b{k}") for k in range(n_branches)], (x, e)))
    g.output(g.call_function(operator.getitem, (sw, 0)))
    return torch.fx.GraphModule(root, g)


@pytest.mark.parametrize("n_branches", [1, 2, 5])
def test_an_unread_operand_that_may_raise_still_raises_after_lowering(n_branches):
    """Lowering erases the switch's dead inputs only where they cannot raise:
    an out-of-range embedding no branch reads raises before and after."""
    gm = _switch_with_an_unread_operand_that_may_raise(n_branches)
    table = torch.randn(5, 3)
    lowered = switch_to_cond(copy.deepcopy(gm))
    assert sum(n.target is torch.ops.aten.embedding.default for n in lowered.graph.nodes) == 1
    for j, raises in ((torch.tensor(7), True), (torch.tensor(2), False)):
        for i in range(n_branches):  # in range: torch's switch itself raises outside it
            args = (torch.tensor(i), torch.ones(3), j, table)
            if raises:
                with pytest.raises(IndexError):
                    gm(*args)
                with pytest.raises(IndexError):
                    lowered(*args)
            else:
                torch.testing.assert_close(lowered(*args), gm(*args))


def _size(program) -> tuple[int, int]:
    """(placeholders, nodes) over the program's graph and every subgraph."""
    nodes = list(all_nodes(program.graph_module))
    return sum(n.op == "placeholder" for n in nodes), len(nodes)


@pytest.mark.parametrize("name, size", [("expert-dispatch", 2), ("expert-dispatch", 5), ("expert-dispatch", 16),
                                        ("cond-tree", 1), ("cond-tree", 3), ("cond-tree", 5)])
def test_the_round_trip_size_is_what_docs_passes_says(name, size):
    """docs/passes.md: an idx == k chain comes back no bigger; a tree a little bigger
    (its depth-3 figures are quoted there)."""
    from branchyard.examples import example_program
    from branchyard.passes.cond_to_switch import cond_to_switch

    program = example_program(name, size)
    before, after = _size(program), _size(switch_to_cond(cond_to_switch(program)))
    if name == "expert-dispatch":
        assert after[0] <= before[0] and after[1] <= before[1], (before, after)
    else:
        assert after[0] <= before[0] * 1.02 and after[1] <= before[1] * 1.05, (before, after)
    if (name, size) == ("cond-tree", 3):
        assert (before, after) == ((142, 193), (144, 201))


def test_program_without_switch_whose_cond_merges_sizes_is_unchanged():
    # torch.export merges x[:2] / x[:3] into an unbacked size; this valid
    # program was rejected as malformed although there was nothing to lower.
    class Lone(torch.nn.Module):
        def forward(self, i, x):
            return torch.cond(i == 0, lambda x: x[:2] * 2, lambda x: x[:3] - 1, (x,))

    ep = torch.export.export(Lone(), (torch.tensor(0), torch.arange(6.0)))
    p = SwitchToCond()
    assert not p(copy.deepcopy(ep.graph_module)).modified
    lowered = switch_to_cond(ep)
    assert n_conds(lowered.graph_module) == 1
    for k, want in ((0, [0.0, 2.0]), (1, [-1.0, 0.0, 1.0])):
        assert lowered.module()(torch.tensor(k), torch.arange(6.0)).tolist() == want
