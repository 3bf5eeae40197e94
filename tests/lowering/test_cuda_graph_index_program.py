"""Switch indices the set kernel computes (patterns.IndexProgram): which FX nodes qualify,
that the Python form equals torch's ops, and that the router's argmax stays out of Inductor regions."""

from __future__ import annotations

import operator

import pytest
import torch

from branchyard.fx.control_flow import switch
from branchyard.lowering.cuda_graph.fx_builders import switch_module
from branchyard.lowering.cuda_graph.patterns import (
    MAX_ARGMAX_ELEMENTS,
    IndexProgram,
    feeds_only_switch_index,
    match_index_step,
)

aten = torch.ops.aten


def _chain(steps, v):
    x = v
    for target, args, kwargs in steps:
        x = target(x, *args, **kwargs)
    return x


def _program(steps, v):
    p = v
    for target, args, kwargs in steps:
        p = match_index_step(target, (p, *args), kwargs)
        assert p is not None, target
    return p


CHAINS = {
    "export": [(aten.argmax.default, (), {}), (aten.clamp.default, (-1, 6), {}), (aten.remainder.Scalar, (7,), {})],
    "kwargs": [(torch.argmax, (), {}), (torch.clamp, (), {"min": -3, "max": 9}), (torch.remainder, (-5,), {})],
    "dim0": [(torch.argmax, (0,), {"keepdim": False}), (operator.mod, (6,), {}), (torch.clamp, (), {"max": 4})],
    "min_only": [(aten.argmax.default, (), {}), (aten.clamp.default, (2,), {})],
    "mod_neg": [(aten.argmax.default, (), {}), (aten.remainder.Scalar, (-3,), {}), (aten.remainder.Scalar, (-1,), {})],
}


@pytest.mark.parametrize("name", sorted(CHAINS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64])
def test_program_evaluates_like_the_torch_ops(name, dtype):
    steps = CHAINS[name]
    g = torch.Generator().manual_seed(3)
    for trial in range(20):
        v = torch.randint(-4, 5, (17,), generator=g).to(dtype)
        if dtype.is_floating_point and trial % 5 == 1:
            v[trial % 17] = float("nan")
        program = _program(steps, v)
        assert program.argmax and program.source is v
        assert len(program.steps) == sum(2 if t in (aten.clamp.default, torch.clamp) and len(a) + len(k) == 2 else 1
                                         for t, a, k in steps[1:])
        assert torch.equal(program.evaluate(), _chain(steps, v)), (name, v)


def test_program_from_a_0d_integer_index():
    i = torch.tensor(-7, dtype=torch.int32)
    p = _program([(aten.clamp.default, (-2, 10), {}), (aten.remainder.Scalar, (3,), {})], i)
    assert not p.argmax and p.steps == (("max", -2), ("min", 10), ("mod", 3))
    assert torch.equal(p.evaluate(), torch.remainder(torch.clamp(i, -2, 10), 3))


@pytest.mark.parametrize(
    "target, args, kwargs, why",
    [
        (aten.clamp.default, (torch.tensor(1.5), -1, 6), {}, "a float index"),
        (aten.clamp.default, (torch.tensor(3), -1.0, 6), {}, "a float bound promotes"),
        (aten.clamp.default, (torch.tensor(3), None, None), {}, "no bound"),
        (aten.clamp.default, (torch.tensor(3, dtype=torch.int8), -1, 300), {}, "a bound int8 cannot hold"),
        (aten.remainder.Scalar, (torch.tensor(3), 0), {}, "a zero divisor"),
        (aten.remainder.Scalar, (torch.tensor(3), True), {}, "a bool divisor"),
        (aten.remainder.Scalar, (torch.tensor([3, 4]), 2), {}, "not 0-d"),
        (aten.argmax.default, (torch.randn(4, 5), 1), {}, "an argmax over one dim of a matrix"),
        (aten.argmax.default, (torch.randn(MAX_ARGMAX_ELEMENTS + 1),), {}, "too many elements"),
        (aten.argmax.default, (torch.randn(6, 4).t(),), {}, "not contiguous"),
        (aten.argmax.default, (torch.tensor([True, False]),), {}, "bool"),
        (aten.argmax.default, (torch.randn(0),), {}, "empty"),
        (aten.add.Tensor, (torch.tensor(3), 1), {}, "not an index step"),
    ],
)
def test_what_the_set_kernel_does_not_compute(target, args, kwargs, why):
    assert match_index_step(target, args, kwargs) is None, why


def test_the_kernel_applies_at_most_four_steps():
    p = _program([(aten.argmax.default, (), {}), (aten.clamp.default, (-5, 50), {}), (aten.clamp.default, (0, 9), {})],
                 torch.randn(8))
    assert len(p.steps) == 4
    assert match_index_step(aten.remainder.Scalar, (p, 3), {}) is None


def _switch_graph(steps, extra_use=None):
    """switch_module(index, x) with ``steps`` between its index input and the switch node."""
    gm = switch_module([lambda x: x + 1, lambda x: x * 2, lambda x: -x], num_operands=1)
    node = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is switch)
    value, made = node.args[0], []
    with gm.graph.inserting_before(node):
        for target, args, kwargs in steps:
            value = gm.graph.call_function(target, (value, *args), kwargs)
            made.append(value)
    node.args = (value, *node.args[1:])
    if extra_use is not None:
        out = next(n for n in gm.graph.nodes if n.op == "output")
        out.args = ((*out.args[0], made[extra_use]),)
    gm.recompile()
    return gm, made


def _is_switch(n):
    return n.op == "call_function" and n.target is switch


def test_feeds_only_switch_index_follows_the_chain_to_the_switch():
    gm, made = _switch_graph(CHAINS["export"])
    assert [feeds_only_switch_index(n, _is_switch) for n in made] == [True, True, True]
    # the clamped value is also an output: it and what feeds it stay torch kernels; the remainder may go
    gm, made = _switch_graph(CHAINS["export"], extra_use=1)
    assert [feeds_only_switch_index(n, _is_switch) for n in made] == [False, False, True]
    # the index used as a branch operand too
    gm = switch_module([lambda i: i + 1, lambda i: i * 2], num_operands=1)
    (idx,) = [n for n in gm.graph.nodes if n.op == "placeholder"][:1]
    sw = next(n for n in gm.graph.nodes if _is_switch(n))
    sw.args = (idx, sw.args[1], (idx,))
    assert not feeds_only_switch_index(idx, _is_switch)


def test_router_argmax_leaves_the_inductor_region_for_the_set_kernel():
    from branchyard.examples.decode_loop import DecodeLoop
    from branchyard.fx.graph_walk import iter_graph_modules
    from branchyard.lowering.cuda_graph.inductor_regions import InductorRegion, fuse_regions
    from branchyard.passes import cond_to_switch

    torch.manual_seed(0)
    model = DecodeLoop(dim=16, hidden=32, num_experts=4).eval()
    args = (torch.randn(4, 16), torch.tensor(3))
    ep = cond_to_switch(torch.export.export(model, args))
    gm = ep.module()
    fuse_regions(gm)
    region_ops = {n.target for g in iter_graph_modules(gm) for m in g.children() if isinstance(m, InductorRegion)
                  for n in m.ops.graph.nodes if n.op == "call_function"}
    assert aten.argmax.default not in region_ops and aten.mean.dim in region_ops
    argmax = [n for g in iter_graph_modules(gm) for n in g.graph.nodes if n.target is aten.argmax.default]
    assert len(argmax) == 1
    assert feeds_only_switch_index(argmax[0], lambda n: n.op == "call_function" and "switch" in str(n.target))
    for trips in (0, 1, 5):
        torch.testing.assert_close(gm(args[0], torch.tensor(trips))[1], model(args[0], torch.tensor(trips))[1])


def test_a_write_in_place_between_the_index_and_the_switch_keeps_torch_kernels():
    """A set kernel reads the index's source at the switch: a write between (``v.mul_``,
    ``x += 1``, an ``out=``) would change what it reads, so such chains are not deferred."""
    from branchyard.fx.mutation import may_write, nothing_written_between

    def build(mutate):
        gm, made = _switch_graph(CHAINS["export"])
        sw = next(n for n in gm.graph.nodes if _is_switch(n))
        v = next(n for n in gm.graph.nodes if n.op == "placeholder")
        if mutate is not None:
            with gm.graph.inserting_before(sw):
                mutate(gm.graph, v)
        gm.recompile()
        return gm, made, sw

    forms = {
        "method": lambda g, v: g.call_method("mul_", (v, -1)),
        "aten": lambda g, v: g.call_function(aten.mul_.Tensor, (v, v)),
        "operator": lambda g, v: g.call_function(operator.iadd, (v, 1)),
        "out": lambda g, v: g.call_function(torch.neg, (v,), {"out": v}),
        "setitem": lambda g, v: g.call_function(operator.setitem, (v, 0, 1.0)),
    }
    for name, mutate in forms.items():
        gm, made, sw = build(mutate)
        writer = sw.prev
        assert may_write(writer), name
        assert not nothing_written_between(made[0], sw), name
        assert [feeds_only_switch_index(n, _is_switch) for n in made] == [False] * 3, name
    # pure ops in between are fine
    gm, made, sw = build(lambda g, v: g.call_function(aten.mul.Tensor, (v, v)))
    assert not may_write(sw.prev) and [feeds_only_switch_index(n, _is_switch) for n in made] == [True] * 3
    gm, made, sw = build(lambda g, v: g.call_method("reshape", (v, -1)))
    assert not may_write(sw.prev) and nothing_written_between(made[0], sw)


def test_may_write_looks_into_called_modules():
    from branchyard.fx.mutation import may_write

    class Pure(torch.nn.Module):
        def forward(self, x):
            return x * 2

    class Writes(torch.nn.Module):
        def forward(self, x):
            return x.add_(1)

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pure = torch.fx.symbolic_trace(Pure())
            self.writes = torch.fx.symbolic_trace(Writes())
            self.opaque = torch.nn.ReLU()

        def forward(self, x):
            return self.pure(x) + self.writes(x) + self.opaque(x)

    class Leaves(torch.fx.Tracer):
        def is_leaf_module(self, m, name):
            return True

    graph = Leaves().trace(Outer())
    gm = torch.fx.GraphModule(Outer(), graph)
    calls = {n.target: may_write(n) for n in gm.graph.nodes if n.op == "call_module"}
    assert calls == {"pure": False, "writes": True, "opaque": True}


def _as_the_kernel_computes(program: IndexProgram) -> int:
    """branchyard_set_program's arithmetic (int64, Python's %), before the final clamp to the branches."""
    i = int(torch.argmax(program.source)) if program.argmax else int(program.source)
    for op, a in program.steps:
        i = max(i, a) if op == "max" else min(i, a) if op == "min" else i % a
    return i


@pytest.mark.parametrize(
    "source, steps",
    [
        # torch computes remainder(int8, 1000) as mod -24 (the bound wraps to int8): 5 -> -19, not 5
        (torch.tensor(5, dtype=torch.int8), [(aten.clamp.default, (0, 100)), (aten.remainder.Scalar, (1000,))]),
        # uint8: -7 wraps to 249, so torch keeps 200 where Python's mod gives -3
        (torch.tensor(200, dtype=torch.uint8), [(aten.clamp.default, (0, 250)), (aten.remainder.Scalar, (-7,))]),
        (torch.tensor(-9, dtype=torch.int16), [(aten.remainder.Scalar, (7,)), (aten.remainder.Scalar, (40000,))]),
    ],
)
def test_a_later_step_with_a_bound_the_index_dtype_cannot_hold_is_not_deferred(source, steps):
    (t0, a0), (t1, a1) = steps
    p = match_index_step(t0, (source, *a0), {})
    assert p is not None
    assert match_index_step(t1, (p, *a1), {}) is None
    # and whatever is accepted computes what torch computes
    for bound in (3, -3, 100, -100, 127, -128):
        q = match_index_step(aten.remainder.Scalar, (p, bound), {})
        if q is not None:
            assert _as_the_kernel_computes(q) == int(q.evaluate()), bound


def test_an_argmax_index_takes_no_bound_beyond_int64():
    p = match_index_step(aten.argmax.default, (torch.randn(5),), {})
    assert match_index_step(aten.remainder.Scalar, (p, 2**64 + 3), {}) is None  # ctypes would pass it as 3
    assert match_index_step(aten.clamp.default, (p, None, 2**63), {}) is None


def _user_code_that_writes(x):  # what torch.fx.wrap leaves as a call_function target
    x.relu_()


def test_writes_by_an_argument_or_a_mutable_op_packet_stop_deferral():
    """``F.relu(v, inplace=True)`` between ``argmax(v)`` and the switch: eager's argmax read v
    before the write ([-3, -1, -2] -> 1), a set kernel would read it after ([0, 0, 0] -> 0)."""
    import torch.nn.functional as F

    from branchyard.fx.mutation import may_write

    torch.library.define("branchyard_review::write_into", "(Tensor(a!) x) -> ()")
    forms = {
        "inplace kwarg": lambda g, v: g.call_function(F.relu, (v,), {"inplace": True}),
        "inplace positional": lambda g, v: g.call_function(F.relu, (v, True)),
        "dropout inplace": lambda g, v: g.call_function(F.dropout, (v,), {"training": False, "inplace": True}),
        "batch_norm stats": lambda g, v: g.call_function(F.batch_norm, (v, v, v), {"training": True}),
        "builtin batch_norm": lambda g, v: g.call_function(torch.batch_norm, (v, None, None, v, v, True, 0.1, 1e-5, False)),
        "op packet": lambda g, v: g.call_function(torch.ops.branchyard_review.write_into, (v,)),
        "wrapped user function": lambda g, v: g.call_function(_user_code_that_writes, (v,)),
    }
    for name, mutate in forms.items():
        gm, made = _switch_graph(CHAINS["export"])
        sw = next(n for n in gm.graph.nodes if _is_switch(n))
        v = next(n for n in gm.graph.nodes if n.op == "placeholder")
        with gm.graph.inserting_before(sw):
            mutate(gm.graph, v)
        assert may_write(sw.prev), name
        assert [feeds_only_switch_index(n, _is_switch) for n in made] == [False] * 3, name
    g = torch.fx.Graph()
    v = g.placeholder("v")
    pure = [g.call_function(F.relu, (v,)), g.call_function(F.relu, (v,), {"inplace": False}),
            g.call_function(F.batch_norm, (v, None, None)), g.call_function(aten.add, (v, v)),
            g.call_function(aten.argmax, (v,))]
    assert [may_write(n) for n in pure] == [False] * 5
