"""What a traced graph or exported program takes: static non-tensor arguments,
defaulted parameters left out, keyword calls.

A value the graph holds as a constant must not change silently at call time;
a call form the trace accepted must be accepted by the result.
"""

from __future__ import annotations

import pytest
import torch

import branchyard.shapes as shapes
from branchyard.errors import SpecViolationError
from branchyard.shapes import ShapeVar

b = ShapeVar("b", min=2, max=64)


def scale(x, n):
    return x * n


# -- make_fx: static non-tensor arguments ---------------------------------------------


@pytest.mark.parametrize(
    "traced, changed, hint",
    [
        (5, 6, "declare it in the spec as an int size"),
        (5, 5.0, "declare it in the spec as an int size"),  # 5.0 traces to another graph (float result for ints)
        (2.5, 3.5, "trace again with this value"),
        (True, False, "trace again with this value"),
    ],
)
def test_make_fx_graph_rejects_a_changed_static_scalar(traced, changed, hint):
    gm = shapes.make_fx(scale, spec={"x": (b, 4)})(torch.ones(3, 4), traced)
    x = torch.ones(4, 4)
    torch.testing.assert_close(gm(x, traced), scale(x, traced))
    with pytest.raises(SpecViolationError) as e:
        gm(x, changed)
    msg = str(e.value)
    assert f"argument 'n': n is {changed!r}" in msg
    assert f"traced with the static value {traced!r}" in msg and hint in msg


def test_make_fx_graph_rejects_a_changed_static_value_in_a_container():
    def f(x, cfg):
        return x * cfg["k"] + cfg["bias"][0]

    gm = shapes.make_fx(f, spec={"x": (b, 4)})(torch.ones(3, 4), {"k": 2, "bias": [1.0]})
    x = torch.ones(5, 4)
    torch.testing.assert_close(gm(x, {"k": 2, "bias": [1.0]}), f(x, {"k": 2, "bias": [1.0]}))
    with pytest.raises(SpecViolationError, match=r"argument \"cfg\['bias'\]\[0\]\": .*is 2.0 .*static value 1.0"):
        gm(x, {"k": 2, "bias": [2.0]})
    with pytest.raises(SpecViolationError, match="argument 'cfg': cfg has the structure"):
        gm(x, {"k": 2, "bias": [1.0, 2.0]})


def test_make_fx_graph_takes_a_declared_int_at_any_value():
    gm = shapes.make_fx(lambda x, n: x[:n], spec={"x": (b, 4), "n": b - 1})(torch.ones(3, 4), 2)
    assert gm(torch.ones(6, 4), 5).shape == (5, 4)


# -- make_fx: defaulted parameters -----------------------------------------------------


def test_make_fx_traces_a_call_that_leaves_out_defaults():
    def f(x, factor=2, *, bias=1.0):
        return x * factor + bias

    gm = shapes.make_fx(f, spec={"x": (b, 4)})(torch.randn(3, 4))
    x = torch.randn(7, 4)
    torch.testing.assert_close(gm(x), f(x))  # the input check fills the defaults in
    torch.testing.assert_close(gm(x, 2, 1.0), f(x))
    with pytest.raises(SpecViolationError, match="argument 'factor': factor is 3 .*static value 2"):
        gm(x, 3)


def test_make_fx_traces_a_declared_default():
    def f(x, n=3):
        return x[:n]

    gm = shapes.make_fx(f, spec={"x": (b, 4), "n": b - 1})(torch.randn(4, 4))
    torch.testing.assert_close(gm(torch.ones(6, 4), 5), torch.ones(5, 4))
    with pytest.raises(SpecViolationError, match="n has size 3, but the spec says b - 1 = 5"):
        gm(torch.ones(6, 4))  # the default 3 fits b = 4 only


# -- export / checked_module: call forms and static values -------------------------------


def test_export_keeps_keyword_arguments_keywords():
    def f(x, y):
        return x - y

    x, y = torch.randn(3, 4), torch.randn(3, 4)
    ep = shapes.export(f, (), {"x": x, "y": y}, spec={"x": (b, 4), "y": (b, 4)})
    run = shapes.checked_module(ep)
    x5, y5 = torch.randn(5, 4), torch.randn(5, 4)
    torch.testing.assert_close(run(x=x5, y=y5), x5 - y5)
    torch.testing.assert_close(ep.module()(x=x5, y=y5), x5 - y5)  # like plain torch.export
    torch.testing.assert_close(run(x5, y5), x5 - y5)  # checked_module accepts either form
    torch.testing.assert_close(run(x5, y=y5), x5 - y5)
    with pytest.raises(SpecViolationError, match="y dim 0 has size 4, but ShapeVar 'b' is 5"):
        run(x=x5, y=torch.randn(4, 4))


def test_checked_module_rejects_a_changed_static_value():
    def f(x, n, mode="a", **extra):
        return x * n

    ep = shapes.export(f, (torch.ones(3, 4), 5), {"z": 2}, spec={"x": (b, 4)})
    run = shapes.checked_module(ep)
    x = torch.ones(4, 4)
    torch.testing.assert_close(run(x, 5, z=2), x * 5)
    torch.testing.assert_close(run(x, 5, "a", z=2), x * 5)  # the baked default, passed explicitly
    with pytest.raises(SpecViolationError, match="argument 'n': n is 6 .*exported with the static value 5"):
        run(x, 6, z=2)
    with pytest.raises(SpecViolationError, match="argument 'z': z is 3 .*static value 2"):
        run(x, 5, z=3)
    with pytest.raises(SpecViolationError, match=r"argument 'mode': mode is 'b' \(str\), but the program was exported without it"):
        run(x, 5, "b", z=2)
    with pytest.raises(SpecViolationError, match="exported with keyword argument 'z'"):
        run(x, 5)


# -- export: example inputs ------------------------------------------------------------


@pytest.mark.parametrize("strict", [False, True])
def test_exported_program_carries_the_real_example_inputs_and_saves(tmp_path, strict):
    import branchyard

    def f(x, y, n):
        return x[:n] + y.sum()

    x, y = torch.randn(3, 4), torch.randn(6, 4)
    ep = shapes.export(f, (x, y), {"n": 2}, spec={"x": (b, 4), "y": (2 * b, 4), "n": b - 1}, strict=strict)
    args, kwargs = ep.example_inputs
    assert all(type(t) is torch.Tensor for t in args)
    assert args[0] is x and args[1] is y and kwargs == {"n": 2}
    torch.testing.assert_close(ep.module()(*args, **kwargs), f(x, y, 2))
    path = str(tmp_path / "f.pt2")
    branchyard.save(ep, path)
    loaded = branchyard.load(path)  # default: untrusted, plain tensor data only
    x5, y5 = torch.randn(5, 4), torch.randn(10, 4)
    torch.testing.assert_close(loaded.module()(x5, y5, n=4), f(x5, y5, 4))


# -- decorator and diagnostics ---------------------------------------------------------


def test_dynamic_spec_keeps_staticmethod_and_classmethod():
    from branchyard.shapes import dynamic_spec, get_spec

    class C:
        k = 3

        @dynamic_spec({"x": (b, 4)})
        @staticmethod
        def add(x):
            return x + 1

        @dynamic_spec({"x": (b, 4)})
        @classmethod
        def times(cls, x):
            return x * cls.k

    x = torch.ones(3, 4)
    for call in (C.add, C().add):
        torch.testing.assert_close(call(x), x + 1)
        with pytest.raises(SpecViolationError, match="x dim 0 has size 100, outside ShapeVar 'b'"):
            call(torch.ones(100, 4))
    for call in (C.times, C().times):
        torch.testing.assert_close(call(x), x * 3)
        with pytest.raises(SpecViolationError, match="x dim 0 has size 100, outside ShapeVar 'b'"):
            call(torch.ones(100, 4))
    assert get_spec(C.add) is not None and get_spec(C.times) is not None
    assert len(shapes.export(C.add, (x,)).range_constraints) == 1


def test_export_names_the_shapevar_an_int_argument_carries():
    from branchyard.errors import DataDependentShapeError

    h = ShapeVar("h", min=1, max=8)

    def f(x, n):
        if n > 5:
            return x * 2
        return x + 1

    spec = {"x": (b, 4), "n": h}
    args = (torch.randn(3, 4), 3)
    for trace in (lambda: shapes.export(f, args, spec=spec), lambda: shapes.make_fx(f, spec=spec)(*args)):
        with pytest.raises(DataDependentShapeError) as e:
            trace()
        assert "depends on ShapeVar 'h': the condition `h > 5`" in str(e.value)
        assert "not a declared ShapeVar" not in str(e.value)
        assert e.value.shape_vars == ["h"]


def test_a_tensor_where_the_trace_had_none_is_refused():
    # traced with y=None, the graph / program holds the None branch only
    s = ShapeVar("s", min=2, max=64)

    def f(x, y=None):
        return x.sum() if y is None else x.sum() + y.sum()

    spec = {"x": (b, 4), "y": (s, 4)}
    x, y = torch.ones(4, 4), torch.ones(5, 4)
    run = shapes.checked_module(shapes.export(f, (torch.ones(3, 4), None), spec=spec))
    gm = shapes.make_fx(f, spec=spec)(torch.ones(3, 4), None)
    for call in (run, gm):
        torch.testing.assert_close(call(x, None), f(x))
        with pytest.raises(SpecViolationError, match=r"argument 'y': y is a tensor of shape \(5, 4\), .* static value None"):
            call(x, y)


def test_checked_module_refuses_another_container_structure():
    def f(x, ws):
        return x * sum(ws)

    run = shapes.checked_module(shapes.export(f, (torch.ones(3, 4), [1, 2]), spec={"x": (b, 4)}))
    torch.testing.assert_close(run(torch.ones(4, 4), [1, 2]), torch.full((4, 4), 3.0))
    with pytest.raises(SpecViolationError, match=r"argument .ws.: ws has the structure \[\*, \*, \*\], but the program was exported with \[\*, \*\]"):
        run(torch.ones(4, 4), [1, 2, 3])
