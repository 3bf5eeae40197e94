"""GPU tests of branchyard.lowering.cuda_graph: one capture, control flow as conditional nodes.

Run on the GPU machine (docs/gpu.md). Every case checks outputs against eager
execution of the same program on the same device, across calls whose trip
counts / branches change without recapture, and with host syncs turned into
errors (torch.cuda.set_sync_debug_mode("error")) during replay.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch._higher_order_ops.while_loop import while_loop

import branchyard.lowering
from branchyard._compat import HAS_SWITCH
from branchyard.errors import LoweringError
from branchyard.lowering.cuda_graph import CudaGraphFallbackWarning, cuda_graph, cuda_graph_backend
from branchyard.lowering.cuda_graph.fx_builders import cond_tree_module, switch_module, trace, while_loop_module

pytestmark = pytest.mark.gpu
DEV = "cuda"


@contextlib.contextmanager
def no_host_sync():
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)


def lower(program, args, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("error", CudaGraphFallbackWarning)  # a fallback fails the test
        m = cuda_graph(program, args, **options)
    assert m.lowered, m.fallback_reason
    return m


def check(m, reference, cases):
    for args in cases:
        with no_host_sync():
            got = m(*args)
        want = reference(*args)
        for g, w in zip(got, want):
            assert torch.equal(g, w), (args, g, w)


# --------------------------------------------------------------------------- programs
class Countdown(torch.nn.Module):
    def forward(self, x, c, n):
        def cond_fn(i, y):
            return i < n

        def body_fn(i, y):
            return i + 1, torch.lerp(y, c, 0.5)

        return while_loop(cond_fn, body_fn, (torch.zeros((), dtype=torch.int64, device=x.device), x))


class CondInWhile(torch.nn.Module):
    def forward(self, x, n):
        def body_fn(i, y):
            return i + 1, torch.cond(y.sum() > 0, lambda t: t * 0.5 - 3.0, lambda t: t * -1.5 + 1.0, (y,))

        return while_loop(lambda i, y: i < n, body_fn, (torch.zeros((), dtype=torch.int64, device=x.device), x))


class WhileInWhile(torch.nn.Module):
    def forward(self, x, n, m):
        def outer_body(i, y):
            def inner_body(j, z):
                return j + 1, z * 1.01 + i.to(z.dtype)

            _, y2 = while_loop(lambda j, z: j < m + i, inner_body, (torch.zeros_like(i), y))
            return i + 1, y2

        return while_loop(lambda i, y: i < n, outer_body, (torch.zeros((), dtype=torch.int64, device=x.device), x))


class WhileInBranch(torch.nn.Module):
    def forward(self, x, w, limit):
        def grow(t):
            # a matmul in a branch the example inputs never take: warm-up must still initialise cuBLAS
            return while_loop(lambda y: y.abs().sum() < limit, lambda y: (y @ w + 1.0,), (t,))[0]

        return torch.cond(x.sum() > 0, grow, lambda t: t - 1.0, (x,))


def export(module, args):
    return torch.export.export(module, args)


def scalar(v, dtype=torch.int64):
    return torch.tensor(v, dtype=dtype, device=DEV)


# --------------------------------------------------------------------------- cases
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


def test_outputs_are_fresh_tensors_unless_asked():
    x, c = torch.randn(256, device=DEV), torch.randn(256, device=DEV)
    ep = export(Countdown(), (x, c, scalar(3)))
    m = lower(ep, (x, c, scalar(3)))
    a = m(x, c, scalar(1))[1]
    b = m(x, c, scalar(2))[1]
    assert not torch.equal(a, b)
    shared = lower(ep, (x, c, scalar(3)), clone_outputs=False)
    assert shared(x, c, scalar(1))[1].data_ptr() == shared(x, c, scalar(2))[1].data_ptr()


def test_wrong_shapes_at_call_time_are_a_clear_error():
    x, c = torch.randn(256, device=DEV), torch.randn(256, device=DEV)
    m = lower(export(Countdown(), (x, c, scalar(3))), (x, c, scalar(3)))
    with pytest.raises(LoweringError, match=r"input 0 is \(128,\).*captured for \(256,\)"):
        m(x[:128], c, scalar(3))


def test_cpu_tensor_inside_the_program_is_a_lowering_error():
    class CpuCounter(torch.nn.Module):
        def forward(self, x, n):
            return while_loop(lambda i, y: i < n, lambda i, y: (i + 1, y * 2), (torch.zeros((), dtype=torch.int64), x))

    x = torch.randn(4, device=DEV)
    ep = export(CpuCounter(), (x, scalar(3)))
    with pytest.raises(LoweringError, match=r"node 'zeros': produces a tensor on cpu"):
        cuda_graph(ep, (x, scalar(3)))


def test_predicate_on_the_host_is_a_lowering_error():
    from branchyard.lowering.cuda_graph.fx_builders import cond_module

    program = cond_module(lambda x: x + 1, lambda x: x - 1, num_operands=1)
    with pytest.raises(LoweringError, match=r"input 0 is on cpu and is the predicate of cond '\w+'; the program is lowered for cuda:0"):
        cuda_graph(program, (torch.tensor(True), torch.ones(3, device=DEV)))


def test_torch_compile_backend():
    seen = []

    def backend(gm, example_inputs):
        fn = cuda_graph_backend(gm, example_inputs)
        seen.append(fn)
        return fn

    @torch.compile(backend=backend, fullgraph=True)
    def f(x, n):
        def body_fn(i, y):
            return i + 1, torch.cond(y.sum() > 0, lambda t: t * 0.5 - 3.0, lambda t: t * -1.5 + 1.0, (y,))

        return while_loop(lambda i, y: i < n, body_fn, (torch.zeros((), dtype=torch.int64, device=x.device), x))

    x = torch.randn(1024, device=DEV)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CudaGraphFallbackWarning)
        for n in (4, 0, 33):
            i, y = f(x, scalar(n))
            ref_i, ref_y = CondInWhile()(x, scalar(n))
            assert i.item() == n and torch.equal(y, ref_y)
    assert len(seen) == 1 and seen[0].lowered[0].lowered


def test_package_is_callable():
    x, c = torch.randn(256, device=DEV), torch.randn(256, device=DEV)
    ep = export(Countdown(), (x, c, scalar(3)))
    m = branchyard.lowering.cuda_graph(ep, (x, c, scalar(3)))
    assert m.lowered and torch.equal(m(x, c, scalar(7))[1], ep.module()(x, c, scalar(7))[1])
