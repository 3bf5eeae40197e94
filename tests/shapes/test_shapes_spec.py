"""ShapeVar, ShapesSpec, printing, JSON and conversions to torch's spec types (no tracing)."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from branchyard.errors import ShapeSpecError, SpecViolationError
from branchyard.shapes import DimExpr, ShapesSpec, ShapeVar, dynamic_spec, get_spec
from branchyard.shapes.spec import TensorEntry


# -- ShapeVar and derived dims ----------------------------------------------------------


def test_arithmetic_builds_sympy_expressions_over_the_vars():
    batch, heads = ShapeVar("batch", min=2, max=128), ShapeVar("heads", min=1, max=16)
    cases = {2 * batch: ("2*batch", 10), batch - 1: ("batch - 1", 4), batch * heads: ("batch*heads", 15), 3 + batch * 2: ("2*batch + 3", 13)}
    for expr, (text, value) in cases.items():
        assert isinstance(expr, DimExpr) and not expr.is_var
        assert str(expr) == text
        assert expr.evaluate({"batch": 5, "heads": 3}) == value
    assert (batch * heads).vars == {"batch": batch, "heads": heads}
    assert (2 * batch).linear_root() == (batch, 2, 0)
    assert (batch * heads).linear_root() is None
    assert (batch - 1).bounds() == (1, 127)


def test_multiple_of_rounds_min_up_and_is_part_of_membership():
    seq = ShapeVar("seq", min=1, max=8192, multiple_of=8)
    assert (seq.min, seq.max) == (8, 8192)
    assert seq.contains(16) and not seq.contains(12) and not seq.contains(8200)
    assert seq.describe_range() == "8 <= seq <= 8192, multiple of 8"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(name="2x"), "identifier"),
        (dict(name="b", min=-1), "min=-1 < 0"),
        (dict(name="b", min=10, max=5), "empty range"),
        (dict(name="b", min=9, max=15, multiple_of=8), "empty range.*multiple of 8"),
        (dict(name="b", multiple_of=0), "multiple_of=0"),
        (dict(name="b", max=3.5), "max must be an int"),
    ],
)
def test_bad_shape_var_is_a_shape_spec_error(kwargs, match):
    name = kwargs.pop("name")
    with pytest.raises(ShapeSpecError, match=match):
        ShapeVar(name, **kwargs)


def test_two_vars_with_one_name_and_different_ranges_are_rejected():
    with pytest.raises(ShapeSpecError, match="two different ShapeVars are named 'b'"):
        ShapeVar("b", max=4) + ShapeVar("b", max=8)
    with pytest.raises(ShapeSpecError, match="two different ShapeVars are named 'b'"):
        ShapesSpec({"x": (ShapeVar("b", max=4),), "y": (ShapeVar("b", max=8),)})


# -- ShapesSpec construction -----------------------------------------------------------------


def test_entries_are_read_as_a_person_writes_them():
    b = ShapeVar("b", max=8)
    spec = ShapesSpec({"x": (b, 768), "n": b - 1, "cache": {"k": (b, None)}, "args": [(b,), None], "skip": None})
    assert str(spec.params["x"]) == "(b, 768)"
    assert str(spec.params["n"]) == "int b - 1"
    assert str(spec.params["cache"]) == "{'k': (b, _)}"
    assert str(spec.params["args"]) == "[(b,), _]"
    assert "skip" not in spec.params
    assert spec.symbolic_slots() == {"b": ["x dim 0", "cache['k'] dim 0", "args[0] dim 0"]}


def test_a_var_used_only_inside_derived_dims_is_rejected_with_a_way_out():
    b = ShapeVar("b", max=8)
    with pytest.raises(ShapeSpecError, match=r"x dim 0: ShapeVar 'b' appears only inside derived dims \(here 2\*b\).*slot of its own"):
        ShapesSpec({"x": (2 * b, 4)})


def test_unreadable_entry_is_rejected():
    with pytest.raises(ShapeSpecError, match="argument 'x': cannot read str"):
        ShapesSpec({"x": "batch"})


def test_spec_prints_as_a_table():
    batch = ShapeVar("batch", min=2, max=128)
    seq = ShapeVar("seq", min=8, max=8192, multiple_of=8)
    text = str(ShapesSpec({"x": (batch, seq, 768), "mask": (batch, seq - 1), "n": seq}))
    assert text.splitlines() == [
        "argument  shape",
        "--------  -------------------------------",
        "x         (batch, seq, 768)",
        "mask      (batch, seq - 1)",
        "n         int seq",
        "",
        "ShapeVar  range",
        "--------  -------------------------------",
        "batch     2 <= batch <= 128",
        "seq       8 <= seq <= 8192, multiple of 8",
    ]


# -- JSON ---------------------------------------------------------------------------------


def test_json_round_trip_keeps_vars_ranges_divisors_and_expressions():
    batch, heads = ShapeVar("batch", min=2, max=128), ShapeVar("heads", min=1, max=16)
    seq = ShapeVar("seq", max=8192, multiple_of=8)
    spec = ShapesSpec(
        {"x": (batch, seq, 768), "y": (batch * heads, seq - 1), "h": heads, "d": {"k": (2 * batch, None)}, "args": [(seq,)]}
    )
    back = ShapesSpec.from_json(spec.to_json())
    assert back == spec
    assert back.vars["seq"].multiple_of == 8
    assert str(back.params["y"]) == "(batch*heads, seq - 1)"


@pytest.mark.parametrize(
    "doc, match",
    [
        ("{", "not JSON"),
        ('{"format": "other"}', "not a branchyard.shapes/1 document"),
        ('{"format": "branchyard.shapes/1", "vars": [], "params": {"x": {"tensor": ["__import__(\'os\')"]}}}', "bad dim expression"),
        ('{"format": "branchyard.shapes/1", "vars": [], "params": {"x": {"tensor": ["b + 1"]}}}', r"undeclared ShapeVar\(s\) \['b'\]"),
    ],
)
def test_bad_json_is_rejected_without_evaluating_it(doc, match):
    with pytest.raises(ShapeSpecError, match=match):
        ShapesSpec.from_json(doc)


# -- torch's own spec types ---------------------------------------------------------------


def test_to_torch_produces_native_shapes_spec_with_divisibility_assumption():
    from torch.fx.experimental import dynamic_spec as native

    batch = ShapeVar("batch", min=2, max=128)
    seq = ShapeVar("seq", min=8, max=64, multiple_of=8)
    t = ShapesSpec({"x": (batch, 768), "y": (2 * batch, seq), "n": seq - 1}).to_torch()
    assert isinstance(t, native.ShapesSpec)
    x_spec = t._params._named_args["x"]
    assert isinstance(x_spec, native.TensorSpec) and isinstance(x_spec[0], native.ShapeVar) and x_spec[1] == 768
    assert (x_spec[0].min, x_spec[0].max) == (2, 128)
    assert str(t._params._named_args["y"][0].node.expr).startswith("2*batch")
    assert [str(a.node.expr) for a in t.assumptions] == [f"Eq(Mod({t._params._named_args['y'][1].sympy_sym}, 8), 0)"]


def test_dim_round_trip_including_divisibility_and_dim_dynamic():
    batch = ShapeVar("batch", min=2, max=128)
    seq = ShapeVar("seq", min=8, max=64, multiple_of=8)
    spec = ShapesSpec({"x": (batch, seq, 4), "y": (2 * batch, seq - 1)})
    ds = spec.to_dynamic_shapes()
    assert isinstance(ds["x"][0], Dim) and (ds["x"][0].min, ds["x"][0].max) == (2, 128)
    assert str(ds["x"][1]) == "8*seq_div8" and str(ds["y"][1]) == "8*seq_div8 - 1"
    examples = {"x": torch.ones(4, 16, 4), "y": torch.ones(8, 15)}
    assert ShapesSpec.from_dynamic_shapes(ds, example_inputs=examples) == spec

    hinted = ShapesSpec.from_dynamic_shapes({"x": [Dim.DYNAMIC(min=2, max=9), Dim.STATIC]})
    assert str(hinted) .splitlines()[2] == "x         (x_dim0, _)"
    assert (hinted.vars["x_dim0"].min, hinted.vars["x_dim0"].max) == (2, 9)


def test_dim_cannot_express_products_and_says_what_to_use_instead():
    b, h = ShapeVar("b", max=8), ShapeVar("h", max=8)
    with pytest.raises(ShapeSpecError, match=r"y dim 0: b\*h is not of the form a\*x \+ b.*branchyard.shapes.export"):
        ShapesSpec({"x": (b, h), "y": (b * h,)}).to_dynamic_shapes()


def test_dim_dict_form_needs_the_tensor_rank():
    with pytest.raises(ShapeSpecError, match="leaves the tensor's rank open"):
        ShapesSpec.from_dynamic_shapes({"x": {0: Dim("b")}})


def test_to_dynamic_shapes_works_with_torch_export():
    batch = ShapeVar("batch", min=2, max=64)

    class M(torch.nn.Module):
        def forward(self, x, y):
            return torch.cat([x, x]) + y

    spec = ShapesSpec({"x": (batch, 4), "y": (2 * batch, 4)})
    ep = torch.export.export(M(), (torch.ones(3, 4), torch.ones(6, 4)), dynamic_shapes=spec.to_dynamic_shapes(M()))
    assert "VR[2, 64]" in [str(r) for r in ep.range_constraints.values()]
    assert ep.module()(torch.ones(5, 4), torch.ones(10, 4)).shape == (10, 4)


# -- decorator ----------------------------------------------------------------------------------


def test_decorator_checks_keys_against_the_signature():
    b = ShapeVar("b", max=8)
    with pytest.raises(ShapeSpecError, match=r"spec names argument 'inptu'.*did you mean 'input'"):

        @dynamic_spec({"inptu": (b, 4)})
        def f(input):
            return input


def test_decorator_refuses_to_stack_and_attaches_torchs_own_spec():
    from torch.fx.experimental.dynamic_spec import ShapesSpec as NativeSpec

    b = ShapeVar("b", max=8)

    @dynamic_spec({"x": (b, 4)})
    def f(x):
        return x

    assert isinstance(f._dynamic_spec, NativeSpec) and get_spec(f).params["x"].dims[0] is b
    with pytest.raises(ShapeSpecError, match="already attached"):
        dynamic_spec({"x": (b, 4)})(f)


def test_decorating_a_module_class_instance_and_inherited_forward():
    b = ShapeVar("b", max=8)

    @dynamic_spec({"input": (b, 4)})
    class MyLinear(torch.nn.Linear):  # forward is inherited: the class gets its own
        pass

    assert get_spec(MyLinear(4, 2)) is not None
    assert get_spec(torch.nn.Linear(4, 2)) is None  # the parent class is untouched
    inst = dynamic_spec({"input": (b, 4)})(torch.nn.Linear(4, 3))
    assert get_spec(inst) is not None and get_spec(torch.nn.Linear(4, 3)) is None
    assert inst(torch.ones(2, 4)).shape == (2, 3)


def test_validate_names_argument_dim_var_range_and_value():
    batch = ShapeVar("batch", min=2, max=128)
    spec = ShapesSpec({"x": (batch, 768), "y": (batch, 768)})

    def f(x, y):
        return x

    with pytest.raises(SpecViolationError, match=r"argument 'x': x dim 0 has size 200, outside ShapeVar 'batch' \(2 <= batch <= 128\)"):
        spec.validate(f, torch.ones(200, 768), torch.ones(200, 768))
    with pytest.raises(SpecViolationError, match=r"argument 'y': y dim 0 has size 5, but ShapeVar 'batch' is 4 from x dim 0"):
        spec.validate(f, torch.ones(4, 768), torch.ones(5, 768))
    with pytest.raises(SpecViolationError, match=r"argument 'x': x dim 1 has size 767, the spec fixes it at 768"):
        spec.validate(f, torch.ones(4, 767), torch.ones(4, 768))
    with pytest.raises(SpecViolationError, match=r"argument 'x': spec declares 2 dims \(batch, 768\), got a tensor with 1 dims"):
        spec.validate(f, torch.ones(4), torch.ones(4, 768))


# -- spec edges: each decided, documented in docs/shapes.md ----------------------------------------


def test_shapevar_none_means_the_default_bound():
    assert ShapeVar("b", min=None) == ShapeVar("b", min=0)
    assert ShapeVar("b", multiple_of=None) == ShapeVar("b")
    assert ShapeVar("b", min=None, max=None, multiple_of=None).describe_range() == "0 <= b <= inf"


@pytest.mark.parametrize("dims", [(None, None), (), [None]])
def test_a_tuple_of_only_none_or_nothing_is_a_tensor_of_that_rank(dims):
    spec = ShapesSpec({"x": dims})
    assert spec.params["x"] == TensorEntry(tuple(dims))

    def f(x):
        return x

    assert spec.validate(f, torch.ones([3] * len(dims))) == {}
    with pytest.raises(SpecViolationError, match=rf"spec declares {len(dims)} dims"):
        spec.validate(f, torch.ones(2, 2, 2))
    assert ShapesSpec.from_json(spec.to_json()) == spec


@pytest.mark.parametrize(
    "dim, message",
    [
        (-8, r"x dim 1: size -8 is negative"),
        ("0*b", r"x dim 1: the derived dim is the constant 0: it depends on no ShapeVar \(write the int 0\)"),
        ("b - b", r"the derived dim is the constant 0"),
        ("20 - b", r"x dim 1: 20 - b shrinks as a ShapeVar grows"),
        ("b * (3 - h)", r"shrinks as a ShapeVar grows"),
    ],
)
def test_negative_constant_and_shrinking_dims_are_refused(dim, message):
    b = ShapeVar("b", min=2, max=16)
    h = ShapeVar("h", max=2)
    value = eval(dim, {"b": b, "h": h}) if isinstance(dim, str) else dim
    with pytest.raises(ShapeSpecError, match=message):
        ShapesSpec({"x": (b, value), "y": (h,)})


def test_a_subclass_or_an_instance_replaces_its_decorated_class_spec_but_one_object_takes_one_spec():
    a, b = ShapeVar("a", max=8), ShapeVar("b", min=3, max=16)

    @dynamic_spec({"input": (a, 4)})
    class Base(torch.nn.Linear):
        pass

    @dynamic_spec({"input": (b, 4)})
    class Sub(Base):
        pass

    assert get_spec(Base(4, 2)).vars == {"a": a} and get_spec(Sub(4, 2)).vars == {"b": b}
    with pytest.raises(SpecViolationError, match="outside ShapeVar 'b'"):
        Sub(4, 2)(torch.ones(2, 4))  # Sub checks its own spec, not Base's
    inst = dynamic_spec({"input": (b, 4)})(Base(4, 2))
    assert get_spec(inst).vars == {"b": b} and get_spec(Base(4, 2)).vars == {"a": a}
    assert inst(torch.ones(5, 4)).shape == (5, 2)
    with pytest.raises(ShapeSpecError, match="already attached"):
        dynamic_spec({"input": (a, 4)})(inst)


@pytest.mark.parametrize("name", ["lambda", "None", "True", "if", "ü", "E", "I", "oo", "Integer", "Symbol", "pi", "_x1"])
def test_json_round_trips_every_legal_var_name(name):
    v, h = ShapeVar(name, min=2, max=8), ShapeVar("h", min=1, max=4)
    spec = ShapesSpec({"x": (v, v + 1, 2 * v * h, v * v), "h": h, "n": v - 1})
    back = ShapesSpec.from_json(spec.to_json())
    assert back == spec
    assert str(back.params["x"]) == str(spec.params["x"])
    assert back.params["x"].dims[3].evaluate({name: 5}) == 25


_F = '{"format": "branchyard.shapes/1", '
_B = '{"name": "b", "min": 1, "max": 3, "multiple_of": 1}'


@pytest.mark.parametrize(
    "doc, match",
    [
        (_F + '"params": {}}', "the document: missing field 'vars'"),
        (_F + '"vars": [], "params": {}, "extra": 1}', "unknown field 'extra'"),
        (_F + '"vars": {}, "params": {}}', "JSON 'vars': 'vars' must be a list"),
        (_F + '"vars": [{"name": "b", "min": 1, "multiple_of": 1}], "params": {}}', "JSON vars\\[0\\]: missing field 'max'"),
        (_F + '"vars": [{"name": "b", "min": true, "max": 3, "multiple_of": 1}], "params": {}}', "'min' must be an integer"),
        (_F + '"vars": [{"name": "2b", "min": 1, "max": 3, "multiple_of": 1}], "params": {}}', "vars\\[0\\]: ShapeVar name"),
        (_F + '"vars": [5], "params": {}}', "JSON vars\\[0\\]: a ShapeVar is an object"),
        (_F + '"vars": [], "params": [1]}', "JSON 'params': 'params' must be an object"),
        (_F + '"vars": [' + _B + '], "params": {"x": {"tensor": ["b", "(b"]}}}', "'x' dim 1: bad dim expression '\\(b' in JSON: '\\(' was never closed"),
        (_F + '"vars": [' + _B + '], "params": {"x": {"tensor": ["b", "2 b"]}}}', "'x' dim 1: bad dim expression '2 b' in JSON: invalid syntax"),
        (_F + '"vars": [' + _B + '], "params": {"x": {"tensor": ["b", "b ** 200"]}}}', "a power must be an integer from 1 to 64"),
        (_F + '"vars": [' + _B + '], "params": {"x": {"tensor": ["b", "b / 2"]}}}', "bad dim expression 'b / 2' in JSON: unexpected '/ 2'"),
        (_F + '"vars": [' + _B + '], "params": {"x": {"tensor": ["b", "b(2)"]}}}', "'b\\(2\\)' in JSON: only \\+, -, \\*, integer powers"),
        (_F + '"vars": [' + _B + '], "params": {"x": {"tensor": ["b", ""]}}}', "'x' dim 1: bad dim expression '' in JSON: it is empty"),
        (_F + '"vars": [], "params": {"x": {"tensor": 5}}}', "argument 'x': a 'tensor' entry holds a list"),
        (_F + '"vars": [], "params": {"x": {"tensor": [true]}}}', "argument 'x' dim 0: bad dim true"),
        (_F + '"vars": [], "params": {"x": {"int": 2.5}}}', "argument 'x': bad dim 2.5"),
        (_F + '"vars": [], "params": {"x": {"dict": [1]}}}', "argument 'x' dict item 0: a 'dict' entry holds \\[key, entry\\] pairs"),
        (_F + '"vars": [], "params": {"x": {"dict": [["k", null], ["k", null]]}}}', "key 'k' appears twice"),
        (_F + '"vars": [], "params": {"x": {"tuple": []}}}', "unknown entry kind 'tuple'"),
        (_F + '"vars": [' + _B + ', {"name": "b", "min": 1, "max": 300, "multiple_of": 1}], "params": {"x": {"tensor": ["b"]}}}',
         "JSON vars\\[1\\]: ShapeVar 'b' is declared twice"),
        (_F + '"vars": [' + _B + '], "params": {"x": {"tensor": ["' + "(" * 3000 + "b" + ")" * 3000 + '"]}}}', "too many nested parentheses"),
        ("[" * 100000, "nested too deeply"),
    ],
)
def test_malformed_json_is_a_spec_error_naming_the_field(doc, match):
    with pytest.raises(ShapeSpecError, match=match):
        ShapesSpec.from_json(doc)


def test_from_dynamic_shapes_rejects_same_named_dims_with_different_ranges():
    # torch.export refuses this too; merging would let y take x's range
    with pytest.raises(ShapeSpecError, match=r"y dim 0: two different Dims are named 'a': 2 <= a <= 9 and 2 <= a <= 100"):
        ShapesSpec.from_dynamic_shapes({"x": [Dim("a", min=2, max=9)], "y": [Dim("a", min=2, max=100)]})
    with pytest.raises(ShapeSpecError, match="y dim 0: two different Dims are named 'a'"):
        ShapesSpec.from_dynamic_shapes({"x": [Dim("a", min=2, max=9)], "y": [2 * Dim("a", min=2, max=100)]})
    same = ShapesSpec.from_dynamic_shapes({"x": [Dim("a", min=2, max=9)], "y": [Dim("a", min=2, max=9)]})
    assert list(same.vars) == ["a"] and same.vars["a"].max == 9


def test_to_dynamic_shapes_refuses_an_int_argument_torch_export_cannot_take():
    b = ShapeVar("b", min=2, max=64)

    class M(torch.nn.Module):
        def forward(self, x, n):
            return x.sum(1) * n

    with pytest.raises(ShapeSpecError, match="n: int argument declared as b: torch.export's dynamic_shapes cannot"):
        ShapesSpec({"x": (b, 4), "n": b}).to_dynamic_shapes(M())
    ds = ShapesSpec({"x": (b, 4)}).to_dynamic_shapes(M())  # a static int stays None
    assert ds["n"] is None
    assert torch.export.export(M(), (torch.ones(5, 4), 5), dynamic_shapes=ds).module()(torch.ones(7, 4), 5).shape == (7,)
