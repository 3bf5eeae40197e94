"""branchyard.fx.control_flow: the operator table, taking nodes apart and
rebuilding them, and the semantics written as Python against torch's ops."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._higher_order_ops.while_loop import while_loop as torch_while_loop

from branchyard._compat import HAS_SWITCH
from branchyard.errors import MalformedGraphError
from branchyard.fx import control_flow as cf

X = torch.tensor([0.5, -1.0, 2.0])


class CondInLoop(torch.nn.Module):
    """A while_loop whose body holds a cond: the three kinds a walk must see."""

    def forward(self, i, x):
        def body(i, x):
            y = torch.cond(x.sum() > 0, lambda x: x - 1.0, lambda x: x + 2.0, (x,))
            return i + 1, y

        return torch_while_loop(lambda i, x: i < 3, body, (i, x))


@pytest.fixture
def loop_ep():
    return torch.export.export(CondInLoop(), (torch.tensor(0), X))


def test_table_has_one_row_per_operator_and_recognises_nodes(loop_ep):
    assert sorted(cf.TABLE) == ["cond", "switch", "while_loop"]
    gm = loop_ep.graph_module
    (loop,) = [n for n in gm.graph.nodes if cf.control_flow_op(n) is not None]
    assert cf.control_flow_op(loop) is cf.TABLE["while_loop"] and cf.is_while_loop(loop)
    assert isinstance(cf.TABLE["while_loop"].parts(gm, loop), cf.WhileLoopParts)
    assert [cf.TABLE[k].semantics for k in ("cond", "switch", "while_loop")] == [cf.cond, cf.switch, cf.while_loop]
    assert not cf.is_cond(loop) and not cf.is_switch(loop)
    assert cf.TABLE["while_loop"].operands(loop) == tuple(loop.args[2]) + tuple(loop.args[3])
    assert [label for label, _ in cf.TABLE["while_loop"].branches(gm, loop)] == ["cond_fn", "body_fn"]
    assert all(cf.control_flow_op(n) is None for n in gm.graph.nodes if n is not loop)


def test_walk_control_flow_enters_bodies_of_the_kinds_asked_for(loop_ep):
    gm = loop_ep.graph_module
    every = list(cf.walk_control_flow(gm))
    assert [(n.op.name, n.site) for n in every] == [
        ("while_loop", "while_loop"),
        ("cond", "while_loop[body_fn]/cond"),
    ]
    assert every[1].path == ((every[0].node, "body_fn"),) and every[1].owner is gm.while_loop_body_graph_0
    # Not entering while_loop bodies: the cond inside is not reached.
    assert list(cf.walk_control_flow(gm, kinds=("cond", "switch"))) == []


def test_while_loop_parts_take_apart_and_rebuild(loop_ep):
    gm = loop_ep.graph_module
    (loop,) = [n for n in gm.graph.nodes if cf.is_while_loop(n)]
    parts = cf.while_loop_parts(gm, loop)
    assert parts.cond_gm is gm.while_loop_cond_graph_0 and parts.body_gm is gm.while_loop_body_graph_0
    assert parts.carried == tuple(loop.args[2]) and parts.operands == parts.carried + parts.additional
    with gm.graph.inserting_before(loop):
        twin = parts.rebuild(gm.graph)
    assert twin.target is loop.target and twin.args == loop.args and twin.meta["val"] is loop.meta["val"]
    loop.replace_all_uses_with(twin)
    gm.graph.erase_node(loop)
    gm.recompile()
    out = loop_ep.module()(torch.tensor(0), X)
    torch.testing.assert_close(out[1], CondInLoop()(torch.tensor(0), X)[1])


def test_while_loop_body_returning_too_few_carries_is_rejected(loop_ep):
    gm = loop_ep.graph_module
    (loop,) = [n for n in gm.graph.nodes if cf.is_while_loop(n)]
    body = torch.fx.symbolic_trace(lambda i, x: (i + 1,))
    gm.while_loop_body_graph_0 = body
    with pytest.raises(MalformedGraphError, match=r"node 'while_loop'.*body_fn returns 1 values for 2 loop carries"):
        cf.while_loop_parts(gm, loop)


def test_cond_parts_rebuild_with_a_replaced_part():
    gm = torch.fx.experimental.proxy_tensor.make_fx(
        lambda p, x: torch.cond(p, lambda x: x + 1, lambda x: x - 1, (x,))
    )(torch.tensor(True), X)
    (node,) = [n for n in gm.graph.nodes if cf.is_cond(n)]
    parts = cf.cond_parts(gm, node)
    assert parts.branch(True) is parts.true_gm and parts.args() == node.args
    swapped = dataclasses.replace(parts, true_attr=parts.false_attr, false_attr=parts.true_attr)
    with gm.graph.inserting_before(node):
        new = swapped.rebuild(gm.graph)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    gm.recompile()
    torch.testing.assert_close(gm(torch.tensor(True), X), X - 1)


# --------------------------------------------------------------------------- semantics


def test_cond_semantics_match_torch_cond():
    for p in (True, False):
        got = cf.cond(torch.tensor(p), lambda x: x + 1, lambda x: x * 3, (X,))
        torch.testing.assert_close(got, torch.cond(torch.tensor(p), lambda x: x + 1, lambda x: x * 3, (X,)))


def test_while_loop_semantics_match_torch_while_loop():
    def c(i, x):
        return i < 4

    def b(i, x):
        return i + 1, x * 2

    want = torch_while_loop(c, b, (torch.tensor(0), X))
    got = cf.while_loop(c, b, (torch.tensor(0), X))
    assert len(got) == 2 and all(torch.equal(a, w) for a, w in zip(got, want))


@pytest.mark.skipif(not HAS_SWITCH, reason="torch.switch needs torch >= 2.14")
def test_switch_semantics_clamp_like_torch_switch():
    from torch._higher_order_ops.switch import switch as torch_switch

    branches = [lambda x: (x + 1,), lambda x: (x * 10,), lambda x: (-x,)]
    for i in range(-5, 8):
        want = torch_switch(torch.tensor(i), branches, (X,))
        got = cf.switch(torch.tensor(i), branches, (X,))
        torch.testing.assert_close(got, tuple(want), msg=f"index {i}")


def test_switch_semantics_reject_no_branches_and_wrap_bare_outputs():
    assert cf.switch(1, [lambda x: x + 1, lambda x: x + 2], (X,))[0].tolist() == (X + 2).tolist()
    with pytest.raises(MalformedGraphError, match="at least one branch"):
        cf.switch(0, [], (X,))
