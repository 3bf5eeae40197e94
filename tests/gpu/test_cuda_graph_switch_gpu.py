"""GPU tests of the cuda_graph lowering: switch as a SWITCH node (out-of-range indices clamped on the device), and switch_to_cond's tree."""

from __future__ import annotations

import pytest
import torch

from branchyard._compat import HAS_SWITCH
from branchyard.lowering.cuda_graph.fx_builders import cond_tree_module, switch_module, trace, while_loop_module

from cuda_graph_gpu_support import DEV, no_host_sync, lower, check, export, scalar

pytestmark = pytest.mark.gpu


def _switch_loop(branches):
    class Body(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sw = switch_module(branches, num_operands=1)

        def forward(self, i, x, ks):
            return i + 1, self.sw(torch.index_select(ks, 0, i.view(1)), x)[0]

    return while_loop_module(lambda i, x, ks: i < ks.shape[0], trace(Body()), num_carried=2, num_additional=1)


EVERY_INDEX = [0, 1, 2, 3, 4, 5, 6, 7, -1, 8, 99, -99]  # every branch, then clamped from both sides


def test_switch_inside_while_clamps_out_of_range_indices_on_the_device():
    branches = [(lambda k: lambda x: x * (0.5 + 0.125 * k) + k)(k) for k in range(8)]
    program = _switch_loop(branches)
    ks = torch.randint(0, 8, (100,), device=DEV)
    x = torch.randn(1 << 16, device=DEV)
    m = lower(program, (scalar(0), x, ks))
    assert m.conditional_nodes == {"IF": 0, "WHILE": 1, "SWITCH": 1}
    # a step: index_select, set_index (clamps), SWITCH, step (i += 1); a branch: mul, add into the output
    body = m.graph_nodes.bodies[0]
    assert body.by_type == {"KERNEL": 3, "CONDITIONAL": 1}, m.graph_nodes.summary()
    assert len(body.bodies) == 8 and all(b.by_type == {"KERNEL": 2} for b in body.bodies), m.graph_nodes.summary()
    chain = lower(program, (scalar(0), x, ks), switch="if_chain")
    assert chain.conditional_nodes == {"IF": 8, "WHILE": 1, "SWITCH": 0}
    assert chain.graph_nodes.bodies[0].by_type == {"KERNEL": 3, "CONDITIONAL": 8}, chain.graph_nodes.summary()
    each = lower(program, (scalar(0), x, ks), switch="if_chain_each")
    assert each.graph_nodes.bodies[0].by_type == {"KERNEL": 10, "CONDITIONAL": 8}, each.graph_nodes.summary()
    cases = [
        ks,
        torch.tensor(EVERY_INDEX * 8 + EVERY_INDEX[:4], device=DEV),
        torch.randint(-20, 30, (100,), device=DEV),
        torch.full((100,), 99, device=DEV),
    ]
    for ks_new in cases:
        ref = x.clone()
        for k in ks_new.clamp(0, 7).tolist():
            ref = branches[k](ref)
        zero = scalar(0)  # made before the no-sync block: a host->device copy counts as a sync
        for lowered in (m, chain, each):
            with no_host_sync():
                i, y = lowered(zero, x, ks_new)
            assert i.item() == 100
            assert torch.equal(y, ref)


def test_nested_cond_tree_of_a_switch_writes_one_buffer_without_copies():
    branches = [(lambda k: lambda x: x * (0.5 + 0.125 * k) + k)(k) for k in range(8)]
    tree = cond_tree_module(branches, num_operands=1)  # switch_to_cond's structure
    x = torch.randn(4096, device=DEV)
    m = lower(tree, (scalar(3), x))
    assert m.conditional_nodes["IF"] == 7

    def walk(count, depth=0):
        if depth == 3:  # a leaf branch: mul and add, the add writing the tree's output buffer
            assert count.by_type == {"KERNEL": 2}, m.graph_nodes.summary()
            return
        # each level: one set kernel (comparing index <= mid - 1 itself) and the IF/ELSE node;
        # the top clamps the index first
        want = {"KERNEL": 2 if depth == 0 else 1, "CONDITIONAL": 1}
        assert count.by_type == want, m.graph_nodes.summary()
        for b in count.bodies:
            walk(b, depth + 1)

    walk(m.graph_nodes)
    indices = [scalar(k) for k in EVERY_INDEX]
    for k in indices:
        with no_host_sync():
            (y,) = m(k, x)
        assert torch.equal(y, branches[min(max(int(k.item()), 0), 7)](x))



@pytest.mark.skipif(not HAS_SWITCH, reason="torch.ops.higher_order.switch needs torch >= 2.14")
def test_switch_operator_from_export():
    from torch._higher_order_ops.switch import switch as torch_switch

    class S(torch.nn.Module):
        def forward(self, k, x):
            return torch_switch(k, [lambda t: t + 1, lambda t: t * 3, lambda t: t.sin()], (x,))

    x = torch.randn(8, device=DEV)
    ep = export(S(), (scalar(1), x))
    m = lower(ep, (scalar(1), x))
    check(m, ep.module(), [(scalar(k), x) for k in (0, 1, 2)])
