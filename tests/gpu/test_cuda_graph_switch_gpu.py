"""GPU tests of the cuda_graph lowering: switch as a SWITCH node (out-of-range indices clamped on the device), and switch_to_cond's tree."""

from __future__ import annotations

import operator

import pytest
import torch

from branchyard._compat import HAS_SWITCH
from branchyard.lowering.cuda_graph.fx_builders import cond_tree_module, switch_module, trace, while_loop_module

from cuda_graph_gpu_support import DEV, no_host_sync, lower, check, export, scalar

pytestmark = pytest.mark.gpu


def _loop_over(sw, row=lambda r: r):
    """``for k in ks: x = sw(row(k), x)[0]`` as one while_loop (``sw`` a switch GraphModule)."""

    class Body(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sw = sw

        def forward(self, i, x, ks):
            return i + 1, self.sw(row(torch.index_select(ks, 0, i.view(1))), x)[0]

    return while_loop_module(lambda i, x, ks: i < ks.shape[0], trace(Body()), num_carried=2, num_additional=1)


def _switch_loop(branches):
    return _loop_over(switch_module(branches, num_operands=1))


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


# --------------------------------------------------------------------------- index programs
aten = torch.ops.aten


def _indexed_switch(branches, steps):
    """switch_module whose index is ``steps`` applied to its first input (FX targets and extra args)."""
    from branchyard.fx.control_flow import switch as by_switch

    gm = switch_module(branches, num_operands=1)
    node = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is by_switch)
    value = node.args[0]
    with gm.graph.inserting_before(node):
        for target, args, kwargs in steps:
            value = gm.graph.call_function(target, (value, *args), kwargs)
    node.args = (value, *node.args[1:])
    gm.recompile()
    return gm


def _index_loop(branches, steps, row=lambda r: r.reshape(-1)):
    """``for v in vs: x = branches[clamp(steps(row(v)))](x)`` as one while_loop."""
    return _loop_over(_indexed_switch(branches, steps), row)


def _reference(branches, steps, x, vs, row=lambda r: r.reshape(-1)):
    for v in vs:
        k = row(v[None])
        for target, args, kwargs in steps:
            k = target(k, *args, **kwargs)
        x = branches[min(max(int(k), 0), len(branches) - 1)](x)
    return x


ROUTER = [(aten.argmax.default, (), {}), (aten.clamp.default, (-1, 6), {}), (aten.remainder.Scalar, (7,), {})]
STEP_FORMS = {
    "export": ROUTER,  # what cond_to_switch makes of an idx == k chain
    "torch": [(torch.argmax, (), {}), (torch.clamp, (), {"min": -3, "max": 9}), (torch.remainder, (-5,), {})],
    "operator": [(torch.argmax, (0,), {}), (operator.mod, (6,), {}), (torch.clamp, (), {"max": 4})],
    "no_argmax": [(aten.clamp.default, (-2, 10), {}), (aten.remainder.Scalar, (3,), {})],
}


def _rows(dtype, steps, t=96, length=24):
    """Rows with ties, NaNs and infinities (floats) or repeated maxima (ints) that hit every branch."""
    g = torch.Generator().manual_seed(7)
    if steps is STEP_FORMS["no_argmax"]:
        return torch.randint(-30, 40, (t, 1), generator=g).to(device=DEV, dtype=dtype)
    if dtype.is_floating_point:
        v = torch.randint(-4, 5, (t, length), generator=g).to(dtype) * 0.5  # many ties
        v[5, 3] = v[5, 17] = float("nan")
        v[9, 0] = float("nan")
        v[11, :] = float("-inf")
        v[12, 20] = float("inf")
        v[13, :] = 1.0
    else:
        v = torch.randint(-3, 4, (t, length), generator=g).to(dtype)
        v[13, :] = 2
    return v.to(DEV)


@pytest.mark.parametrize("form", sorted(STEP_FORMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64])
def test_switch_index_argmax_clamp_remainder_run_in_the_set_kernel(form, dtype):
    steps = STEP_FORMS[form]
    if form == "no_argmax" and dtype.is_floating_point:
        pytest.skip("clamp and remainder of a float index promote: torch kernels (see the CPU tests)")
    row = (lambda r: r.reshape(())) if form == "no_argmax" else (lambda r: r.reshape(-1))
    branches = [(lambda k: lambda x: x * (0.5 + 0.125 * k) + k)(k) for k in range(8)]
    vs = _rows(dtype, steps)
    x = torch.randn(4096, device=DEV)
    m = lower(_index_loop(branches, steps, row), (scalar(0), x, vs))
    # a step: index_select, ONE set kernel (argmax, clamp, remainder, clamp), SWITCH, the step kernel
    body = m.graph_nodes.bodies[0]
    assert body.by_type == {"KERNEL": 3, "CONDITIONAL": 1}, m.graph_nodes.summary()
    assert len(body.bodies) == 8 and all(b.by_type == {"KERNEL": 2} for b in body.bodies), m.graph_nodes.summary()
    ref = _reference(branches, steps, x, vs, row)
    zero = scalar(0)
    with no_host_sync():
        i, y = m(zero, x, vs)
    assert i.item() == vs.shape[0]
    assert torch.equal(y, ref)
    for trial in range(3):  # new rows: the kernel reads them each replay
        vs2 = _rows(dtype, steps)[torch.randperm(vs.shape[0], generator=torch.Generator().manual_seed(trial))]
        with no_host_sync():
            i, y = m(zero, x, vs2)
        assert torch.equal(y, _reference(branches, steps, x, vs2, row))


def test_index_steps_past_the_set_kernel_limit_run_as_torch_kernels():
    # five steps after the argmax: the fifth does not fit the kernel, so the program runs as torch
    # kernels and the last clamp starts a new set-kernel program on their result; same output.
    steps = [(aten.argmax.default, (), {}), (aten.clamp.default, (-5, 50), {}), (aten.remainder.Scalar, (9,), {}),
             (aten.clamp.default, (1, 6), {})]
    branches = [(lambda k: lambda x: x - k)(k) for k in range(8)]
    vs = _rows(torch.float32, steps)
    x = torch.randn(256, device=DEV)
    m = lower(_index_loop(branches, steps), (scalar(0), x, vs))
    assert m.graph_nodes.bodies[0].by_type["KERNEL"] > 3, m.graph_nodes.summary()
    zero = scalar(0)  # made before the no-sync block: a host->device copy counts as a sync
    with no_host_sync():
        _, y = m(zero, x, vs)
    assert torch.equal(y, _reference(branches, steps, x, vs))


def test_index_of_a_strided_row_takes_torch_argmax_then_the_set_kernel_steps():
    # a transposed row is not contiguous: argmax stays a torch kernel, clamp and remainder do not
    row = lambda r: r.reshape(4, -1).t()  # noqa: E731
    branches = [(lambda k: lambda x: x * 2 - k)(k) for k in range(8)]
    vs = _rows(torch.float32, ROUTER, t=40, length=24)
    x = torch.randn(512, device=DEV)
    m = lower(_index_loop(branches, ROUTER, row), (scalar(0), x, vs))
    # index_select, the copy that flattens the transposed row, argmax, the set kernel
    # (clamp, remainder, clamp), SWITCH, the step kernel: clamp and remainder are no kernels
    assert m.graph_nodes.bodies[0].by_type == {"KERNEL": 5, "CONDITIONAL": 1}, m.graph_nodes.summary()
    zero = scalar(0)
    with no_host_sync():
        _, y = m(zero, x, vs)
    assert torch.equal(y, _reference(branches, ROUTER, x, vs, row))


def test_index_source_written_in_place_before_the_switch_is_read_before_the_write():
    # argmax(v), then v.mul_(-1), then the switch: eager picks by the row before the write, so
    # the set kernel (which would read v at the switch) must not take the argmax over
    from branchyard.fx.control_flow import switch as by_switch

    branches = [(lambda k: lambda x: x * 2 - k)(k) for k in range(8)]

    def negating_switch():
        gm = _indexed_switch(branches, ROUTER)
        sw = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is by_switch)
        row = next(n for n in gm.graph.nodes if n.op == "placeholder")
        with gm.graph.inserting_before(sw):
            gm.graph.call_method("mul_", (row, -1))
        gm.recompile()
        return gm

    program = _loop_over(negating_switch(), lambda r: r.reshape(-1))
    vs = _rows(torch.float32, ROUTER)
    x = torch.randn(512, device=DEV)
    m = lower(program, (scalar(0), x, vs))
    assert m.graph_nodes.bodies[0].by_type["KERNEL"] > 3, m.graph_nodes.summary()
    zero = scalar(0)
    with no_host_sync():
        _, y = m(zero, x, vs)
    assert torch.equal(y, _reference(branches, ROUTER, x, vs))


# --------------------------------------------------------------------------- router set kernel
def _router_loop(branches, w, *, mean=True):
    """``for v in vs: x = branches[clamp(argmax(mean(v, 0) @ w) ...)](x)`` as one while_loop
    (``argmax(v @ w)`` without ``mean``)."""
    from branchyard.fx.control_flow import switch as by_switch

    gm = switch_module(branches, num_operands=1)
    gm.register_buffer("router_w", w)
    node = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is by_switch)
    g = gm.graph
    with g.inserting_before(node):
        v = g.call_function(aten.mean.dim, (node.args[0], [0])) if mean else node.args[0]
        k = g.call_function(aten.argmax.default, (g.call_function(aten.matmul.default, (v, g.get_attr("router_w"))),))
        k = g.call_function(aten.remainder.Scalar, (g.call_function(aten.clamp.default, (k, -1, 6)), 7))
    node.args = (k, *node.args[1:])
    gm.recompile()
    return _loop_over(gm, lambda r: r.squeeze(0))


def _router_rows(dtype, mean, t=64, rows=4, k=64, seed=5):
    """Integer-valued rows (every sum exact in float32, so any summation order agrees), with
    ties, a NaN and an infinity."""
    g = torch.Generator().manual_seed(seed)
    vs = torch.randint(-3, 4, (t, rows, k) if mean else (t, k), generator=g).to(dtype)
    vs[3].view(-1)[5] = float("nan")
    vs[7].view(-1)[9] = float("inf")
    vs[11].zero_()  # every logit 0: the first wins
    return vs.to(DEV)


# (rows, K, E): the vector path with one and four (bf16; float32: two and eight) column groups per
# warp lane, fewer rows than row groups; E = 6 takes the element-wise path. Row counts are powers
# of two so that the mean is exact in float32 too (with integer data every sum is, in any order).
ROUTER_SHAPES = [(4, 64, 8), (2, 1024, 8), (2, 256, 32), (4, 64, 6)]


@pytest.mark.parametrize("shape", ROUTER_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mean", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_small_router_runs_in_one_set_kernel_and_picks_as_torch(dtype, mean, shape):
    from branchyard.lowering.cuda_graph import patterns
    from branchyard.lowering.cuda_graph.conditional_nodes import router_vector_path

    rows, k, e = shape
    assert rows * k + k * e <= patterns.MAX_ROUTER_ELEMENTS
    branches = [(lambda j: lambda x: x * (0.5 + 0.125 * j) + j)(j) for j in range(8)]
    w = torch.randint(-2, 3, (k, e), generator=torch.Generator().manual_seed(1)).to(DEV, dtype)
    vs = _router_rows(dtype, mean, rows=rows, k=k)
    assert router_vector_path(vs[0], w) == (e != 6)
    x = torch.randn(2048, device=DEV)
    m = lower(_router_loop(branches, w, mean=mean), (scalar(0), x, vs))
    # a step: index_select, ONE router set kernel (mean, matmul, argmax, clamp, remainder), SWITCH, step
    body = m.graph_nodes.bodies[0]
    assert body.by_type == {"KERNEL": 3, "CONDITIONAL": 1}, m.graph_nodes.summary()

    def reference(vs):
        y = x
        for v in vs:
            logits = (v.mean(0) if mean else v) @ w
            j = int(torch.remainder(torch.clamp(torch.argmax(logits), -1, 6), 7))
            y = branches[min(max(j, 0), 7)](y)
        return y

    zero = scalar(0)
    for trial in range(3):  # new rows each replay: the kernel reads them
        rows_now = vs if trial == 0 else vs[torch.randperm(vs.shape[0], generator=torch.Generator().manual_seed(trial)).to(DEV)]
        with no_host_sync():
            i, y = m(zero, x, rows_now)
        assert i.item() == vs.shape[0]
        assert torch.equal(y, reference(rows_now))


def test_a_router_over_the_kernel_bound_runs_as_torch_kernels_with_the_same_picks():
    from branchyard.lowering.cuda_graph import patterns

    branches = [(lambda k: lambda x: x * 2 - k)(k) for k in range(8)]
    k, rows = 4096, 64  # 64 rows x 4096 + 4096 x 8 elements: over MAX_ROUTER_ELEMENTS
    assert rows * k + k * 8 > patterns.MAX_ROUTER_ELEMENTS
    w = torch.randint(-2, 3, (k, 8), generator=torch.Generator().manual_seed(2)).to(DEV, torch.float32)
    vs = _router_rows(torch.float32, True, t=12, rows=rows, k=k)
    x = torch.randn(512, device=DEV)
    m = lower(_router_loop(branches, w), (scalar(0), x, vs))
    assert m.graph_nodes.bodies[0].by_type["KERNEL"] > 3, m.graph_nodes.summary()
    y = x
    for v in vs:
        y = branches[min(max(int(torch.remainder(torch.clamp(torch.argmax(v.mean(0) @ w), -1, 6), 7)), 0), 7)](y)
    zero = scalar(0)
    with no_host_sync():
        _, out = m(zero, x, vs)
    assert torch.equal(out, y)


@pytest.mark.skipif(not HAS_SWITCH, reason="cond_to_switch needs torch >= 2.14")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_loops_router_is_set_for_the_next_trip_by_the_step_kernel(dtype, monkeypatch):
    from branchyard.examples.decode_loop import DecodeLoop
    from branchyard.lowering.cuda_graph import handlers
    from branchyard.passes import cond_to_switch

    torch.manual_seed(6)
    model = DecodeLoop(dim=64, hidden=128, num_experts=4).to(DEV, dtype).eval()
    x = torch.randn(8, 64, device=DEV, dtype=dtype)
    ep = cond_to_switch(torch.export.export(model, (x, scalar(5))))
    rotated = lower(ep, (x, scalar(5)))
    monkeypatch.setattr(handlers, "ROTATE_ROUTER", False)
    in_body = lower(ep, (x, scalar(5)))
    # one kernel node fewer per trip (the step kernel sets the next trip's index), one more before the loop
    r, b = rotated.graph_nodes, in_body.graph_nodes
    assert r.bodies[0].by_type["KERNEL"] == b.bodies[0].by_type["KERNEL"] - 1, (r.summary(), b.summary())
    assert r.by_type["KERNEL"] == b.by_type["KERNEL"] + 1, (r.summary(), b.summary())
    # the experts eager picks: the loop must follow them trip by trip, not one trip late
    with torch.no_grad():
        y, picks = x, []
        for _ in range(12):
            picks.append(int(torch.argmax(y.mean(0) @ model.router)))
            y = model.step(y)
    assert len(set(picks)) > 1, picks
    for trips in (0, 1, 2, 5, 12):
        t = scalar(trips)
        with no_host_sync():
            got = rotated(x, t)
        want = in_body(x, t)
        assert int(got[0]) == trips
        assert torch.equal(got[1], want[1])  # the same kernels, the same order of sums
        if dtype == torch.float32:
            with torch.no_grad():
                torch.testing.assert_close(got[1], model(x, t)[1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_hand_built_router_loop_follows_eager_trip_by_trip(dtype, monkeypatch):
    # torch 2.11 too: the switch is fx_builders', the router reads the carry x
    from branchyard.lowering.cuda_graph import handlers
    from branchyard.lowering.cuda_graph.fx_builders import router_loop_module

    g = torch.Generator().manual_seed(7)
    branches = [(lambda j: lambda x: x.roll(j + 1, 1) - j)(j) for j in range(4)]
    w = torch.randint(-2, 3, (64, 4), generator=g).to(DEV, dtype)
    x = torch.randint(-3, 4, (4, 64), generator=g).to(DEV, dtype)  # integers: every sum exact, any order
    program = router_loop_module(branches, w, trips_until=12)
    rotated = lower(program, (scalar(0), x))
    monkeypatch.setattr(handlers, "ROTATE_ROUTER", False)
    in_body = lower(program, (scalar(0), x))
    r, b = rotated.graph_nodes, in_body.graph_nodes
    assert r.bodies[0].by_type["KERNEL"] == b.bodies[0].by_type["KERNEL"] - 1, (r.summary(), b.summary())

    def reference(start):
        y, picks = x, []
        for _ in range(start, 12):
            picks.append(int(torch.argmax(y.mean(0) @ w)))
            y = branches[picks[-1]](y)
        return y, picks

    assert len(set(reference(0)[1])) > 1, reference(0)[1]
    for start in (12, 11, 9, 0):  # 0, 1, 3 and 12 trips
        i0 = scalar(start)
        with no_host_sync():
            got = rotated(i0, x)
        assert int(got[0]) == 12 and torch.equal(got[1], in_body(i0, x)[1])
        assert torch.equal(got[1], reference(start)[0])
