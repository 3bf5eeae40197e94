"""GPU tests of the cuda_graph lowering: while_loop and cond as WHILE and IF nodes, nesting, the set kernel's comparisons, max_iterations."""

from __future__ import annotations

import pytest
import torch
from torch._higher_order_ops.while_loop import while_loop

from branchyard.lowering.cuda_graph.fx_builders import while_loop_module

from cuda_graph_gpu_support import DEV, no_host_sync, lower, check, Countdown, CondInWhile, WhileInWhile, WhileInBranch, export, scalar

pytestmark = pytest.mark.gpu


def test_while_loop_trip_counts_change_without_recapture():
    x, c = torch.randn(1 << 16, device=DEV), torch.randn(1 << 16, device=DEV)
    ep = export(Countdown(), (x, c, scalar(10)))
    m = lower(ep, (x, c, scalar(10)))
    assert m.conditional_nodes == {"IF": 0, "WHILE": 1, "SWITCH": 0}
    assert m.graph_nodes is not None and m.graph_nodes.by_type.get("CONDITIONAL") == 1
    # a trip is lerp and ONE step kernel (copy x back, i += 1, i < n, set the handle)
    assert m.graph_nodes.bodies[0].by_type == {"KERNEL": 2}, m.graph_nodes.summary()
    ref = ep.module()
    check(m, ref, [(x, c, scalar(n)) for n in (10, 0, 1, 1000, 3)])


def test_cond_inside_while_one_node_and_two_nodes_agree():
    x = torch.randn(4096, device=DEV)
    ep = export(CondInWhile(), (x, scalar(5)))
    cases = [(torch.randn(4096, device=DEV), scalar(n)) for n in (0, 1, 7, 64)]
    one = lower(ep, (x, scalar(5)), if_else="one_node")
    two = lower(ep, (x, scalar(5)), if_else="two_nodes")
    assert one.conditional_nodes["IF"] == 1 and two.conditional_nodes["IF"] == 2
    # the loop body holds one IF node with two bodies, or two IF nodes with one body each
    one_body, two_body = one.graph_nodes.bodies[0], two.graph_nodes.bodies[0]
    assert one_body.by_type["CONDITIONAL"] == 1 and two_body.by_type["CONDITIONAL"] == 2
    assert len(one_body.bodies) == len(two_body.bodies) == 2
    # loop body: sum, set (compares sum > 0 itself), IF, step (i += 1 too); each branch: mul and
    # add/sub writing the IF's output buffer in place (no copy node)
    assert one_body.by_type == {"KERNEL": 3, "CONDITIONAL": 1}, one.graph_nodes.summary()
    assert all(b.by_type == {"KERNEL": 2} for b in one_body.bodies), one.graph_nodes.summary()
    check(one, ep.module(), cases)
    check(two, ep.module(), cases)


def test_while_in_while_with_changing_inner_trip_counts():
    x = torch.randn(1000, device=DEV)
    ep = export(WhileInWhile(), (x, scalar(3), scalar(2)))
    m = lower(ep, (x, scalar(3), scalar(2)))
    assert m.conditional_nodes["WHILE"] == 2
    check(m, ep.module(), [(x, scalar(n), scalar(k)) for n, k in [(3, 2), (0, 5), (6, 0), (10, 4)]])


def test_while_in_a_branch_both_ways():
    # y -> 1.1 y + 1 grows geometrically, so the loop ends (~40 trips to 1e4); max_iterations guards anyway
    x = torch.rand(64, device=DEV)
    w = torch.eye(64, device=DEV) * 1.1 + torch.rand(64, 64, device=DEV) / 640
    ep = export(WhileInBranch(), (-x, w, scalar(1e4, torch.float32)))
    m = lower(ep, (-x, w, scalar(1e4, torch.float32)), max_iterations=10_000)  # example takes the false branch
    assert m.conditional_nodes["IF"] >= 1 and m.conditional_nodes["WHILE"] == 1
    cases = [(x, w, scalar(1e4, torch.float32)), (-x, w, scalar(1e4, torch.float32)), (x, w, scalar(10.0, torch.float32))]
    for args in cases:
        with no_host_sync():
            got = m(*args)
        torch.testing.assert_close(got[0], ep.module()(*args)[0])  # matmul: cuBLAS may pick another algorithm
    assert not m.iterations_exhausted()




class Comparisons(torch.nn.Module):
    """Loop and branch predicates of every comparison and operand kind the set kernel evaluates."""

    def forward(self, x, n32, limit64, lo):
        def body_fn(i, y):
            y = torch.cond(y.sum() > lo, lambda t: t * 0.5, lambda t: t + 1.0, (y,))  # float32 tensor vs tensor
            y = torch.cond(y.max() >= 2.5, lambda t: t - 0.25, lambda t: t * 1.5, (y,))  # float32 vs Python float
            y = torch.cond(0 < i, lambda t: t + 0.125, lambda t: t.clone(), (y,))  # mirrored, int32 vs int
            y = torch.cond(y.double().mean() != limit64, lambda t: t * 2.0, lambda t: t * 0, (y,))  # float64 tensors
            y = torch.cond(i == 3, lambda t: t * -1.0, lambda t: t.clone(), (y,))  # eq
            return i + 1, y

        return while_loop(lambda i, y: i <= n32, body_fn, (torch.zeros((), dtype=torch.int32, device=x.device), x))


def test_every_comparison_kind_in_the_set_kernel_matches_eager():
    x = torch.randn(256, device=DEV)
    args = (x, scalar(4, torch.int32), scalar(1e9, torch.float64), scalar(0.0, torch.float32))
    ep = export(Comparisons(), args)
    m = lower(ep, args)
    body = m.graph_nodes.bodies[0]
    # no comparison kernel anywhere: only the sum/max/double/mean reductions feed set kernels
    assert body.by_type["CONDITIONAL"] == 5
    cases = [
        (torch.randn(256, device=DEV), scalar(n, torch.int32), scalar(v, torch.float64), scalar(lo, torch.float32))
        for n, v, lo in [(4, 1e9, 0.0), (0, 1e9, -5.0), (-1, 0.0, 3.0), (9, 1e9, 100.0)]
    ]
    check(m, ep.module(), cases)


def test_max_iterations_limits_every_inner_loop_run():
    x = torch.randn(1000, device=DEV)
    ep = export(WhileInWhile(), (x, scalar(3), scalar(2)))
    m = lower(ep, (x, scalar(3), scalar(2)), max_iterations=4)
    for n, k in [(3, 10), (3, 1), (6, 1)]:
        zero_n, zero_k = scalar(n), scalar(k)
        with no_host_sync():
            (i, y) = m(x, zero_n, zero_k)
        ref, outer, stopped = x.clone(), 0, False
        while outer < n:
            if outer >= 4:
                stopped = True
                break
            inner = 0
            while inner < k + outer:
                if inner >= 4:
                    stopped = True
                    break
                ref, inner = ref * 1.01 + outer, inner + 1
            outer += 1
        assert i.item() == outer and torch.equal(y, ref) and m.iterations_exhausted() == stopped, (n, k)



def test_swapped_and_self_viewing_carries_are_read_before_written():
    # torch.export refuses aliasing bodies, so this program is written by hand.
    program = while_loop_module(
        lambda i, x, y, z, n: i < n, lambda i, x, y, z, n: (i + 1, y, x + 1.0, z.t()), num_carried=4, num_additional=1
    )
    a, b, m = torch.randn(16, device=DEV), torch.randn(16, device=DEV), torch.randn(8, 8, device=DEV)
    lowered = lower(program, (scalar(0), a, b, m, scalar(3)))
    for n in (0, 1, 2, 5):
        zero, trips = scalar(0), scalar(n)  # host->device copies stay outside the no-sync block
        with no_host_sync():
            i, x, y, z = lowered(zero, a, b, m, trips)
        rx, ry, rz = a, b, m
        for _ in range(n):
            rx, ry, rz = ry, rx + 1.0, rz.t()
        assert i.item() == n and torch.equal(x, rx) and torch.equal(y, ry) and torch.equal(z, rz)


def test_max_iterations_stops_a_loop_that_would_not_end():
    class Forever(torch.nn.Module):
        def forward(self, x, n):
            return while_loop(lambda y: y.sum() > n, lambda y: (y + 1.0,), (x,))

    x = torch.ones(4, device=DEV)
    ep = export(Forever(), (x, scalar(0.0, torch.float32)))
    m = lower(ep, (x, scalar(0.0, torch.float32)), max_iterations=50)
    (y,) = m(x, scalar(0.0, torch.float32))
    assert torch.equal(y, x + 50) and m.iterations_exhausted()
    (y,) = m(x, scalar(100.0, torch.float32))  # never enters the loop
    assert torch.equal(y, x) and not m.iterations_exhausted()
