"""One spec, three consumers: export, compile and make_fx (ours and torch's own).

Graph structure is asserted by counting: unbacked symbols in the inputs,
``_assert_scalar`` nodes, frames compiled.
"""

from __future__ import annotations

import re
import shutil
import warnings

import pytest
import sympy
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.fx.experimental.proxy_tensor import make_fx as torch_make_fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

import branchyard.shapes as shapes
from branchyard._compat import TORCH_VERSION
from branchyard.errors import DataDependentShapeError, ShapeSpecError, SpecViolationError
from branchyard.shapes import ShapesSpec, ShapeVar, dynamic_spec

ASSERT = torch.ops.aten._assert_scalar.default


def input_symbols(gm: torch.fx.GraphModule, names: list[str] | None = None) -> set:
    """Unbacked symbols in the sizes of the graph's (user) inputs, as the compiler
    sees them (after the ShapeEnv's replacements)."""
    out: set = set()
    for node in gm.graph.find_nodes(op="placeholder"):
        if names is not None and node.name not in names:
            continue
        val = node.meta.get("val", node.meta.get("example_value"))  # export/make_fx, Dynamo
        if isinstance(val, torch.Tensor):
            for d in val.shape:
                out |= free_unbacked_symbols(d)
        elif isinstance(val, torch.SymInt):
            out |= free_unbacked_symbols(val)
    return out


def n_asserts(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is ASSERT)


def assert_messages(gm: torch.fx.GraphModule) -> list[str]:
    return [n.args[1] for n in gm.graph.nodes if n.target is ASSERT]


# -- the issue's example, verbatim -----------------------------------------------------------

model = torch.nn.Linear(768, 10)
batch = ShapeVar("batch", min=2, max=128)


@dynamic_spec({"x": (batch, 768)})
def forward(x):
    return model(x)


def test_issue_example_through_our_entry_points():
    x = torch.randn(4, 768)
    ep = shapes.export(forward, (x,))
    assert [str(r) for r in ep.range_constraints.values()] == ["VR[2, 128]"]
    assert list(ep.graph_signature.parameters) == ["model.weight", "model.bias"]  # weights stay parameters
    for n in (2, 7, 128):
        xn = torch.randn(n, 768)
        torch.testing.assert_close(ep.module()(xn), model(xn))

    gm = shapes.make_fx(forward)(x)
    assert len(input_symbols(gm)) == 1 and n_asserts(gm) == 2  # u0 >= 2, u0 <= 128
    x9 = torch.randn(9, 768)
    torch.testing.assert_close(gm(x9), model(x9))

    counter = CompileCounterWithBackend("eager")
    compiled = shapes.compile(forward, backend=counter)
    for n in (2, 3, 17, 128):  # 0/1 never specialise; no recompile inside the range
        xn = torch.randn(n, 768)
        torch.testing.assert_close(compiled(xn), model(xn))
    assert counter.frame_count == 1


def test_issue_example_through_torchs_own_entry_points():
    x = torch.randn(4, 768)
    gm = torch_make_fx(forward, tracing_mode="fake", _allow_non_fake_inputs=True)(x)
    assert len(input_symbols(gm)) == 1
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(forward, backend=counter)
    for n in (2, 5, 100):
        compiled(torch.randn(n, 768))
    assert counter.frame_count == 1

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        @dynamic_spec({"x": (batch, 768)})
        def forward(self, x):
            return self.model(x)

    ep = torch.export.export(Head(), (x,))
    assert [str(r) for r in ep.range_constraints.values()] == ["VR[2, 128]"]


def test_native_decorator_tuple_form_is_what_we_fix():
    """torch 2.14.1's own decorator takes the tuple, then fails at trace time."""
    from torch.fx.experimental import dynamic_spec as native

    @native.dynamic_spec({"x": (native.ShapeVar("b", min=2, max=8), 768)})
    def f(x):
        return x * 2

    with pytest.raises(Exception, match="unexpected leaf spec type tuple"):
        torch_make_fx(f, tracing_mode="fake")(torch.randn(4, 768))


# -- modules: class, forward in the class body, instance -----------------------------------------


@dynamic_spec({"x": (batch, 8)})
class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.lin(x)


def test_decorated_module_class_in_all_entry_points():
    m = Tiny()
    x = torch.randn(3, 8)
    ep = shapes.export(m, (x,))
    assert list(ep.graph_signature.parameters) == ["lin.weight", "lin.bias"]
    assert len(input_symbols(ep.graph_module, ep.graph_signature.user_inputs)) == 1
    assert len(input_symbols(shapes.make_fx(m)(x))) == 1
    counter = CompileCounterWithBackend("eager")
    compiled = shapes.compile(m, backend=counter)
    for n in (2, 9):
        torch.testing.assert_close(compiled(torch.ones(n, 8)), m(torch.ones(n, 8)))
    assert counter.frame_count == 1
    # torch's own export reads the spec attached to forward
    assert [str(r) for r in torch.export.export(m, (x,)).range_constraints.values()] == ["VR[2, 128]"]


def test_decorated_module_instance():
    lin = dynamic_spec({"input": (batch, 8)})(torch.nn.Linear(8, 3))
    ep = shapes.export(lin, (torch.randn(4, 8),))
    assert list(ep.graph_signature.parameters) == ["weight", "bias"]
    assert len(input_symbols(shapes.make_fx(lin)(torch.randn(4, 8)))) == 1


def test_spec_twice_is_an_error():
    with pytest.raises(ShapeSpecError, match="attached with @dynamic_spec and another was passed"):
        shapes.export(forward, (torch.randn(4, 768),), spec={"x": (batch, 768)})
    with pytest.raises(ShapeSpecError, match="no dynamic spec"):
        shapes.make_fx(lambda x: x)


# -- a var shared across inputs stays one symbol ----------------------------------------------------


def add3(x, y, z):
    return x + y * z


SHARED = ShapesSpec({"x": (batch, 4), "y": (batch, 4), "z": (batch, 4)})
ARGS3 = (torch.randn(4, 4), torch.randn(4, 4), torch.randn(4, 4))


def test_shared_var_has_one_range_check_and_a_tied_symbol_per_input_in_export():
    ep = shapes.export(add3, ARGS3, spec=SHARED)
    # y and z own their sizes' symbols (u1, u2), tied to x's u0 by the named checks:
    # 2 range checks for the var + one equality per extra input, as in make_fx's graph,
    # and Eq(u1, u2) for y * z (the trace cannot chain the two ties)
    assert len(input_symbols(ep.graph_module)) == 3
    assert len(ep.range_constraints) == 3
    assert n_asserts(ep.graph_module) == 5
    assert sorted(m for m in assert_messages(ep.graph_module) if "branchyard" in m) == [
        "branchyard.shapes: input y dim 0 must equal batch",
        "branchyard.shapes: input z dim 0 must equal batch",
    ]
    with pytest.raises(Exception, match=r"y.size\(\)\[0\] == x.size\(\)\[0\]|input y dim 0 must equal batch"):
        ep.module()(torch.ones(4, 4), torch.ones(5, 4), torch.ones(4, 4))


def test_torch_native_makes_a_symbol_per_occurrence():
    """The baseline we improve on: 3 symbols, 8 asserts for the same spec."""
    ep = torch.export.export(_Add3(), ARGS3, dynamic_shapes=SHARED.to_torch())
    assert len(ep.range_constraints) == 3  # u0, u1, u2, tied by Eq(u1, u0), Eq(u2, u0)
    assert n_asserts(ep.graph_module) == 8


class _Add3(torch.nn.Module):
    def forward(self, x, y, z):
        return add3(x, y, z)


def test_shared_var_is_one_symbol_in_make_fx_and_checks_run():
    gm = shapes.make_fx(add3, spec=SHARED)(*ARGS3)
    assert len(input_symbols(gm)) == 1 and n_asserts(gm) == 4
    torch.testing.assert_close(gm(*ARGS3), add3(*ARGS3))
    # calling the graph checks the inputs against the spec first...
    with pytest.raises(SpecViolationError, match="z dim 0 has size 6, but ShapeVar 'batch' is 4 from x dim 0"):
        gm(torch.ones(4, 4), torch.ones(4, 4), torch.ones(6, 4))
    # ...and the graph's own asserts stay, for whoever runs its forward without the hook
    with pytest.raises(RuntimeError, match="input z_1 dim 0 must equal batch"):
        gm.forward(torch.ones(4, 4), torch.ones(4, 4), torch.ones(6, 4))
    with pytest.raises(RuntimeError, match="u0 <= 128"):
        gm.forward(torch.ones(200, 4), torch.ones(200, 4), torch.ones(200, 4))


def test_shared_var_compiles_once():
    counter = CompileCounterWithBackend("eager")
    compiled = shapes.compile(add3, spec=SHARED, backend=counter)
    for n in (2, 4, 33):
        a = (torch.randn(n, 4), torch.randn(n, 4), torch.randn(n, 4))
        torch.testing.assert_close(compiled(*a), add3(*a))
    assert counter.frame_count == 1


# -- derived dims, tensor and int --------------------------------------------------------------------

heads = ShapeVar("heads", min=1, max=8)
seq = ShapeVar("seq", min=8, max=64, multiple_of=8)
DERIVED = ShapesSpec({"x": (batch, 4), "y": (2 * batch, 4), "w": (batch * heads, heads), "s": (seq,), "n": seq - 1})


def derived_fn(x, y, w, s, n):
    return torch.cat([x, x], 0) + y, w.sum(0), s[:n]


def derived_args(b=4, h=3, sq=16):
    return (torch.randn(b, 4), torch.randn(2 * b, 4), torch.randn(b * h, h), torch.randn(sq), sq - 1)


def check_outputs(got, args):
    for g, e in zip(got, derived_fn(*args)):
        torch.testing.assert_close(g, e)


def test_derived_dims_in_export():
    ep = shapes.export(derived_fn, derived_args(), spec=DERIVED)
    # one symbol per var where it binds (batch u0, heads u1 in w, seq u2) and one per other
    # dim, tied by a named check: 2*batch (u3), batch*heads (u4); the int input n (u5, seq - 1)
    assert len(input_symbols(ep.graph_module, ["x", "y", "w", "s"])) == 5
    assert len(input_symbols(ep.graph_module)) == 6
    assert len(ep.range_constraints) == 6
    msgs = assert_messages(ep.graph_module)
    assert "branchyard.shapes: input y dim 0 must equal 2*batch" in msgs
    assert "branchyard.shapes: input w dim 0 must equal batch*heads" in msgs
    assert not any(re.search(r"u[34]", m) for m in msgs if "branchyard" not in m), "torch's copies of the named ties are dropped"
    assert any("Eq(u5 + 1, u2)" in m for m in msgs)  # n == seq - 1
    for b, h, sq in [(2, 1, 8), (5, 2, 24), (128, 8, 64)]:
        a = derived_args(b, h, sq)
        check_outputs(ep.module()(*a), a)
    with pytest.raises(RuntimeError, match="input y dim 0 must equal 2\\*batch"):
        ep.module()(torch.randn(5, 4), torch.randn(11, 4), torch.randn(10, 2), torch.randn(24), 23)


# Every kind of dim that does not bind its var: a second bare slot, an int times a var (torch
# would bind the var from it by a division it never checks), an offset, a product, a square.
DERIVED_KINDS = {"batch": batch, "2*batch": 2 * batch, "batch - 1": batch - 1, "2*batch + 1": 2 * batch + 1,
                 "batch*heads": batch * heads, "batch**2": batch * batch}


def _derived_kind(kind: str):
    dim = DERIVED_KINDS[kind]

    def f(x, y):
        return x.sum(0), y * 2

    def inputs(b, h, extra=0):
        return torch.randn(b, h), torch.randn(dim.evaluate({"batch": b, "heads": h}) + extra, 4)

    return {"x": (batch, heads), "y": (dim, 4)}, f, inputs


@pytest.mark.parametrize("kind", list(DERIVED_KINDS))
def test_exported_derived_dims_survive_run_decompositions_and_save(kind, tmp_path):
    """Each derived dim has a symbol of its own, tied by an Eq assert. With the
    expression as its size, torch's re-trace (run_decompositions) raised on
    ``batch - 1`` and the like, and dropped the check of ``2*batch``."""
    spec, f, inputs = _derived_kind(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # non-strict: nothing to warn about
        ep = shapes.export(f, inputs(3, 2), spec=spec)
    assert len(ep.range_constraints) == 3  # batch, heads and the dim's own
    torch.export.save(ep, tmp_path / "p.pt2")
    for program in (ep, ep.run_decompositions(), torch.export.load(tmp_path / "p.pt2").run_decompositions()):
        for b, h in [(2, 1), (5, 3), (9, 8)]:
            a = inputs(b, h)
            for got, want in zip(program.module()(*a), f(*a)):
                torch.testing.assert_close(got, want)
        with pytest.raises(RuntimeError, match="Runtime assertion failed|must equal"):
            program.module()(*inputs(5, 3, extra=1))
    with pytest.raises(RuntimeError, match=re.escape(f"branchyard.shapes: input y dim 0 must equal {DERIVED_KINDS[kind]}")):
        ep.module()(*inputs(5, 3, extra=1))


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("clang++") is None, reason="AOTInductor needs a C++ compiler")
@pytest.mark.parametrize("kind", ["batch", "2*batch", "batch - 1"])
def test_aot_inductor_package_checks_derived_dims(kind, tmp_path):
    """AOTInductor decomposes the program first: with y's size written in x's symbol,
    the compiled package ran inputs that break the spec (and read y with x's size)."""
    spec, f, inputs = _derived_kind(kind)
    ep = shapes.export(f, inputs(3, 2), spec=spec)
    package = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "p.pt2"))
    runner = torch._inductor.aoti_load_package(package)
    a = inputs(7, 4)
    for got, want in zip(runner(*a), f(*a)):
        torch.testing.assert_close(got, want)
    with pytest.raises(RuntimeError):
        runner(*inputs(7, 4, extra=1))


@pytest.mark.parametrize("kind", list(DERIVED_KINDS))
def test_strict_export_ties_derived_dims_in_any_argument_order(kind):
    """Dynamo copies the fakes' symbols into a ShapeEnv of its own; the ties are
    stated again inside the trace, so a derived dim may come before its vars."""
    spec, f, inputs = _derived_kind(kind)

    def backwards(y, x):
        return f(x, y)

    ep = shapes.export(backwards, inputs(3, 2)[::-1], spec=spec, strict=True)
    for b, h in [(2, 1), (5, 3), (9, 8)]:
        a = inputs(b, h)
        for got, want in zip(ep.module()(*a[::-1]), f(*a)):
            torch.testing.assert_close(got, want)
    # a bare batch in y, which comes first, binds it: x's size is then the one checked
    with pytest.raises((RuntimeError, AssertionError), match="must equal|Guard failed"):
        ep.module()(*inputs(5, 3, extra=1)[::-1])


def test_derived_dims_in_make_fx():
    gm = shapes.make_fx(derived_fn, spec=DERIVED)(*derived_args())
    assert len(input_symbols(gm)) == 3  # n is the SymInt seq - 1, no symbol of its own
    assert "branchyard.shapes: input n_1 must equal seq - 1" in assert_messages(gm)
    a = derived_args(6, 2, 32)
    check_outputs(gm(*a), a)
    with pytest.raises(SpecViolationError, match=r"n has size 30, but the spec says seq - 1 = 31"):
        gm(*derived_args(6, 2, 32)[:4], 30)
    with pytest.raises(RuntimeError, match="input n_1 must equal seq - 1"):
        gm.forward(*derived_args(6, 2, 32)[:4], 30)  # the graph's own assert, without the input check


def test_derived_dims_compile_once_across_sizes():
    counter = CompileCounterWithBackend("eager")
    compiled = shapes.compile(derived_fn, spec=DERIVED, backend=counter)
    for b, h, sq in [(2, 1, 8), (5, 2, 24), (9, 4, 40)]:
        a = derived_args(b, h, sq)
        check_outputs(compiled(*a), a)
    assert counter.frame_count == 1


def test_int_bound_only_by_an_int_argument_in_export():
    steps = ShapeVar("steps", min=1, max=32)

    def f(x, k, k2):
        return x[:k] * 2, k2

    spec = {"x": (batch, 4), "k": steps, "k2": 2 * steps}
    ep = shapes.export(f, (torch.randn(40, 4), 3, 6), spec=spec)
    out, k2 = ep.module()(torch.randn(40, 4), 5, 10)
    assert out.shape == (5, 4) and k2 == 10
    with pytest.raises(RuntimeError, match="Eq"):
        ep.module()(torch.randn(40, 4), 5, 11)


# -- divisibility is a fact the compiler uses ------------------------------------------------------


def split_heads(x):
    # The branch is decided at trace time by the divisibility fact; without it,
    # it is a data-dependent guard on an unbacked size.
    if x.shape[0] % 8 != 0:
        x = torch.nn.functional.pad(x, (0, 0, 0, 8 - x.shape[0] % 8))
    return x.reshape(x.shape[0] // 8, 8, x.shape[1]).sum(1)


DIVISIBLE = ShapesSpec({"x": (seq, 4)})


def test_multiple_of_reaches_the_compiler_in_all_entry_points():
    x = torch.randn(16, 4)
    ep = shapes.export(split_heads, (x,), spec=DIVISIBLE)
    assert any("Eq(Mod(u0, 8), 0)" in m for m in assert_messages(ep.graph_module))
    assert not any(n.target is torch.ops.aten.constant_pad_nd.default for n in ep.graph.nodes)
    torch.testing.assert_close(ep.module()(torch.ones(24, 4)), torch.full((3, 4), 8.0))
    gm = shapes.make_fx(split_heads, spec=DIVISIBLE)(x)
    torch.testing.assert_close(gm(torch.ones(40, 4)), torch.full((5, 4), 8.0))
    counter = CompileCounterWithBackend("eager")
    compiled = shapes.compile(split_heads, spec=DIVISIBLE, backend=counter)
    for n in (8, 16, 64):
        torch.testing.assert_close(compiled(torch.ones(n, 4)), torch.full((n // 8, 4), 8.0))
    assert counter.frame_count == 1


def test_without_multiple_of_the_same_reshape_is_data_dependent():
    plain = ShapesSpec({"x": (ShapeVar("seq", min=8, max=64), 4)})
    with pytest.raises(DataDependentShapeError, match=r"ShapeVar 'seq': the condition `\(seq % 8\) != 0`.*multiple_of=8\)"):
        shapes.make_fx(split_heads, spec=plain)(torch.randn(16, 4))


# -- input validation ---------------------------------------------------------------------------------


def test_violating_input_fails_before_tracing_or_running_in_each_entry_point():
    bad = (torch.randn(200, 768),)
    pattern = r"argument 'x': x dim 0 has size 200, outside ShapeVar 'batch' \(2 <= batch <= 128\)"
    with pytest.raises(SpecViolationError, match=pattern):
        shapes.export(forward, bad)
    with pytest.raises(SpecViolationError, match=pattern):
        shapes.make_fx(forward)(*bad)
    counter = CompileCounterWithBackend("eager")
    compiled = shapes.compile(forward, backend=counter)
    with pytest.raises(SpecViolationError, match=pattern):
        compiled(*bad)
    assert counter.frame_count == 0  # nothing was compiled for the bad input
    compiled(torch.randn(4, 768))
    with pytest.raises(SpecViolationError, match=r"x dim 1 has size 767, the spec fixes it at 768"):
        compiled(torch.randn(4, 767))
    assert counter.frame_count == 1


def test_divisibility_violation_names_the_divisor():
    with pytest.raises(SpecViolationError, match=r"x dim 0 has size 12, outside ShapeVar 'seq' \(8 <= seq <= 64, multiple of 8\)"):
        shapes.export(split_heads, (torch.randn(12, 4),), spec=DIVISIBLE)


# -- data-dependent branches -----------------------------------------------------------------------


def branchy(x):
    if x.shape[0] > 64:
        return x * 2
    return x + 1


BRANCH_LINE = "if x.shape[0] > 64:"
BRANCH_SPEC = ShapesSpec({"x": (batch, 4)})


@pytest.mark.parametrize("entry", ["export", "make_fx", "compile"])
def test_branch_on_declared_dim_names_var_condition_line_and_remedies(entry):
    x = torch.randn(4, 4)
    run = {
        "export": lambda: shapes.export(branchy, (x,), spec=BRANCH_SPEC),
        "make_fx": lambda: shapes.make_fx(branchy, spec=BRANCH_SPEC)(x),
        "compile": lambda: shapes.compile(branchy, spec=BRANCH_SPEC, backend="eager")(x),
    }[entry]
    with pytest.raises(DataDependentShapeError) as info:
        run()
    text = str(info.value)
    assert "test_shapes_entry_points.py:" in text
    assert "ShapeVar 'batch'" in text and "`batch > 64`" in text and BRANCH_LINE in text
    assert "torch.cond" in text
    assert "ShapeVar('batch', min=65, max=128) makes it always True" in text
    assert info.value.shape_vars == ["batch"]


def test_torch_cond_is_the_way_out():
    def with_cond(x):
        return torch.cond(x.shape[0] > 64, lambda t: t * 2, lambda t: t + 1, (x,))

    gm = shapes.make_fx(with_cond, spec=BRANCH_SPEC)(torch.randn(4, 4))
    torch.testing.assert_close(gm(torch.ones(100, 4)), torch.full((100, 4), 2.0))
    torch.testing.assert_close(gm(torch.ones(3, 4)), torch.full((3, 4), 2.0))


# -- containers and kwargs ---------------------------------------------------------------------------


def test_make_fx_accepts_kwargs_and_keyword_only_parameters():
    def f(x, *, scale, bias=None):
        return x * scale + bias

    spec = {"x": (batch, 4), "bias": (batch, 4)}
    x, b = torch.randn(3, 4), torch.randn(3, 4)
    gm = shapes.make_fx(f, spec=spec)(x, scale=2.0, bias=b)
    assert len(input_symbols(gm)) == 1
    torch.testing.assert_close(gm(x, 2.0, b), x * 2.0 + b)


def test_dict_and_varargs_entries_in_export_and_make_fx():
    def f(cache, *rest):
        return cache["k"] + rest[0]

    spec = {"cache": {"k": (batch, 4)}, "rest": [(batch, 4)]}
    args = ({"k": torch.randn(5, 4), "v": torch.randn(2)}, torch.randn(5, 4))
    ep = shapes.export(f, args, spec=spec)
    assert len(ep.range_constraints) == 2  # batch, and rest[0]'s own symbol tied to it
    assert "branchyard.shapes: input rest_0 dim 0 must equal batch" in assert_messages(ep.graph_module)
    gm = shapes.make_fx(f, spec=spec)(*args)
    assert len(input_symbols(gm)) == 1


def test_sizes_zero_and_one_do_not_specialise_or_recompile():
    n = ShapeVar("n", min=0, max=16)

    def f(x):
        return x.sum(0) + x.shape[0]

    counter = CompileCounterWithBackend("eager")
    compiled = shapes.compile(f, spec={"x": (n, 3)}, backend=counter)
    for size in (0, 1, 2, 7):
        torch.testing.assert_close(compiled(torch.ones(size, 3)), torch.full((3,), 2.0 * size))
    assert counter.frame_count == 1
    gm = shapes.make_fx(f, spec={"x": (n, 3)})(torch.ones(1, 3))  # traced at size 1, still symbolic
    assert len(input_symbols(gm)) == 1
    torch.testing.assert_close(gm(torch.ones(0, 3)), torch.zeros(3))


def test_checked_module_validates_before_torchs_guards():
    ep = shapes.export(derived_fn, derived_args(), spec=DERIVED)
    m = shapes.checked_module(ep)
    a = derived_args(7, 2, 16)
    check_outputs(m(*a), a)
    with pytest.raises(SpecViolationError, match=r"argument 'x': x dim 0 has size 200, outside ShapeVar 'batch' \(2 <= batch <= 128\)"):
        m(*derived_args(200, 1, 16))
    with pytest.raises(SpecViolationError, match=r"argument 'n': n has size 14, but the spec says seq - 1 = 15 \(seq = 16 from s dim 0\)"):
        m(*derived_args(4, 2, 16)[:4], 14)
    with pytest.raises(ShapeSpecError, match="not made by branchyard.shapes.export"):
        shapes.checked_module(torch.export.export(_Add3(), ARGS3))


@pytest.mark.parametrize("round_trip", ["json", "dim"])
def test_round_tripped_spec_drives_every_entry_point_the_same(round_trip):
    spec = ShapesSpec({"x": (batch, 4), "y": (2 * batch, 4), "s": (seq,)})

    def f(x, y, s):
        return torch.cat([x, x]) + y, s * 2

    args = (torch.randn(3, 4), torch.randn(6, 4), torch.randn(16))
    if round_trip == "json":
        back = ShapesSpec.from_json(spec.to_json())
    else:
        back = ShapesSpec.from_dynamic_shapes(spec.to_dynamic_shapes(), example_inputs=dict(zip("xys", args)))
    assert back == spec
    for s in (spec, back):
        ep = shapes.export(f, args, spec=s)
        gm = shapes.make_fx(f, spec=s)(*args)
        # y's own symbol, tied by the same named check as in make_fx's graph
        assert (len(ep.range_constraints), n_asserts(ep.graph_module)) == (3, 6)
        assert (len(input_symbols(gm)), n_asserts(gm)) == (2, 6)
    counter = CompileCounterWithBackend("eager")
    compiled = shapes.compile(f, spec=back, backend=counter)
    for b in (2, 9):
        compiled(torch.randn(b, 4), torch.randn(2 * b, 4), torch.randn(24))
    assert counter.frame_count == 1


class DynamoGraphs:
    """A counting backend that keeps each Dynamo graph as the backend receives it,
    with the per-input symbols Dynamo allocated (before ShapeEnv replacements)."""

    def __init__(self):
        self.graphs: list[torch.fx.GraphModule] = []
        self.raw_symbols: list[set] = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        raw = set()
        for node in gm.graph.find_nodes(op="placeholder"):
            val = node.meta.get("example_value")
            for d in getattr(val, "shape", ()):
                if isinstance(d, torch.SymInt):
                    raw |= free_unbacked_symbols(d.node._expr)
        self.raw_symbols.append(raw)
        return gm

    def constrain_range_nodes(self, i=0) -> int:
        return sum(1 for n in self.graphs[i].graph.nodes if "constrain_range" in str(n.target))


def run_graph(gm: torch.fx.GraphModule, **inputs):
    """Call a Dynamo graph with the user's inputs by name; the symbols Dynamo
    lifted to inputs (``u0``) are read from the first input whose size is that symbol."""
    args = []
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta["example_value"]
        name = node.target[2:-1] if node.target.startswith("L_") else node.target  # L_x_ -> x
        if name in inputs:
            args.append(inputs[name])
            continue
        assert isinstance(val, torch.SymInt), node.target
        args.append(next(
            int(inputs[p.target[2:-1]].shape[i])
            for p in gm.graph.find_nodes(op="placeholder")
            if p.target.startswith("L_") and isinstance(p.meta["example_value"], torch.Tensor)
            for i, d in enumerate(p.meta["example_value"].shape)
            if isinstance(d, torch.SymInt) and d.node._expr == val.node._expr
        ))
    return gm(*args)


def test_shared_var_is_one_symbol_with_one_set_of_range_checks_under_compile():
    """Dynamo allocates a symbol per input (u0, u1, u2) and ties the copies with
    Eq asserts, which make the ShapeEnv replace them by u0; shapes.compile drops
    the range checks Dynamo repeats for u1 and u2, implied by the Eq asserts."""
    graphs = DynamoGraphs()
    compiled = shapes.compile(add3, spec=SHARED, backend=graphs, validate=False)
    for n in range(2, 129, 6):  # 22 sizes in range: one frame
        a = (torch.randn(n, 4), torch.randn(n, 4), torch.randn(n, 4))
        torch.testing.assert_close(compiled(*a), add3(*a))
    (gm,) = graphs.graphs
    assert len(input_symbols(gm)) == 1
    assert len(graphs.raw_symbols[0]) == 3  # Dynamo's own allocation, replaced by the first
    assert graphs.constrain_range_nodes() == 0
    # 2 range checks for the var + one equality per extra input, as in export and make_fx
    assert n_asserts(gm) == 4
    msgs = assert_messages(gm)
    assert sum("Eq(" in m for m in msgs) == 2 and sum(">= 2" in m or "<= 128" in m for m in msgs) == 2
    # what was dropped is still checked, through the equality, in the graph itself
    # (called directly: Dynamo's guards would stop a bad call before the graph)
    with pytest.raises(RuntimeError, match=r"Eq\(u\d, u0\)"):
        run_graph(gm, x=torch.ones(4, 4), y=torch.ones(4, 4), z=torch.ones(5, 4))
    with pytest.raises(RuntimeError, match=r"Eq\(u\d, u0\)"):
        run_graph(gm, x=torch.ones(200, 4), y=torch.ones(4, 4), z=torch.ones(4, 4))
    with pytest.raises(RuntimeError, match="u0 <= 128"):
        run_graph(gm, x=torch.ones(200, 4), y=torch.ones(200, 4), z=torch.ones(200, 4))
    torch.testing.assert_close(run_graph(gm, x=torch.ones(7, 4), y=torch.ones(7, 4), z=torch.ones(7, 4))[0], torch.full((7, 4), 2.0))


def test_derived_dims_under_compile_keep_only_unimplied_range_checks():
    graphs = DynamoGraphs()
    compiled = shapes.compile(derived_fn, spec=DERIVED, backend=graphs, validate=False)
    a = derived_args()
    check_outputs(compiled(*a), a)
    (gm,) = graphs.graphs
    # batch, heads, seq, and the int n (tied to seq by Eq(n + 1, seq), as in export)
    assert len(input_symbols(gm)) == 4
    msgs = assert_messages(gm)
    # ranges of batch, heads, seq (2 each); Mod(seq, 8); Eq for y, w and n. Dynamo's
    # graph also checked y's, w's and n's own ranges (16 asserts): implied, dropped
    assert n_asserts(gm) == 10
    assert sum("Eq(" in m and "Mod" not in m for m in msgs) == 3
    x, y, w, s_, n = derived_args(5, 2, 24)
    torch.testing.assert_close(run_graph(gm, x=x, y=y, w=w, s=s_, n=n)[1], w.sum(0))
    with pytest.raises(RuntimeError, match=r"Eq\(u\d+, 2\*u0\)"):
        run_graph(gm, x=x, y=torch.randn(11, 4), w=w, s=s_, n=n)
    with pytest.raises(RuntimeError, match=r"Eq\(u\d+, u0\*u\d+\)"):
        run_graph(gm, x=x, y=y, w=torch.randn(11, 2), s=s_, n=n)
    with pytest.raises(RuntimeError, match=r"Eq\(u\d+ \+ 1, u\d+\)"):
        run_graph(gm, x=x, y=y, w=w, s=s_, n=22)


def test_dropping_range_checks_is_a_no_op_without_equalities():
    """make_fx graphs already have one symbol per var: nothing to drop."""
    from branchyard.shapes.graph_checks import drop_implied_range_checks

    gm = shapes.make_fx(forward)(torch.randn(4, 768))
    before = n_asserts(gm)
    assert drop_implied_range_checks(gm) == 0 and n_asserts(gm) == before == 2


def test_torchs_own_compile_of_a_decorated_function_keeps_dynamos_checks():
    """torch.compile(decorated) is torch's entry point: the decorator hands it the
    spec but cannot reach the backend, so the Dynamo graph is torch's own -- one
    symbol per input tied by Eq, and each input's range checked (8 asserts)."""

    @dynamic_spec({"x": (batch, 4), "y": (batch, 4), "z": (batch, 4)})
    def add3_decorated(x, y, z):
        return x + y * z

    graphs = DynamoGraphs()
    compiled = torch.compile(add3_decorated, backend=graphs, fullgraph=True)
    for n in (2, 9, 128):
        compiled(torch.ones(n, 4), torch.ones(n, 4), torch.ones(n, 4))
    (gm,) = graphs.graphs
    assert len(input_symbols(gm)) == 1 and len(graphs.raw_symbols[0]) == 3
    assert n_asserts(gm) == 8


def test_compile_keeps_the_users_backend_mode_and_options():
    """The backend, mode and options reach the backend torch.compile would build."""
    compiled = shapes.compile(add3, spec=SHARED, backend="inductor", mode="default")
    for n in (3, 17):
        a = (torch.randn(n, 4), torch.randn(n, 4), torch.randn(n, 4))
        torch.testing.assert_close(compiled(*a), add3(*a))
    with pytest.raises(Exception, match="Unexpected optimization option"):
        shapes.compile(add3, spec=SHARED, backend="inductor", options={"no_such_option": 1})(*ARGS3)


def test_compile_without_torchs_backend_wrappers_warns_once_and_keeps_dynamos_checks(monkeypatch):
    import branchyard.shapes.entry_points as entry_points

    monkeypatch.setattr(entry_points, "_warned", set())
    # as on a torch without the class (torch.compile itself still needs the real one)
    monkeypatch.setitem(entry_points.TORCH_BACKEND_CLASSES, "other", "_NoSuchCompileWrapper")
    graphs = DynamoGraphs()
    with pytest.warns(shapes.ShapesFallbackWarning, match="cannot wrap the backend"):
        compiled = shapes.compile(add3, spec=SHARED, backend=graphs)
    compiled(*ARGS3)
    assert n_asserts(graphs.graphs[0]) == 8  # torch's behaviour, still correct
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shapes.compile(add3, spec=SHARED, backend=graphs)  # once only


def test_torch_nn_transformer_layer_in_all_entry_points():
    """nn.TransformerEncoderLayer: Dynamo compiles it through a wrapper frame
    inner(*args, **kwargs), where spec keys by name would match nothing and every
    size would recompile; shapes.compile keys the spec by position there."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0).eval()
    seq_len = ShapeVar("seq", min=8, max=256, multiple_of=8)
    spec = {"src": (batch, seq_len, 16)}
    x = torch.randn(3, 16, 16)
    ep = shapes.export(layer, (x,), spec=spec)
    assert len(ep.range_constraints) == 2
    ep_strict = shapes.export(layer, (x,), spec=spec, strict=True)
    assert len(ep_strict.range_constraints) == 2
    gm = shapes.make_fx(layer, spec=spec)(x)
    assert len(input_symbols(gm)) == 2
    counter = CompileCounterWithBackend("eager")
    compiled = shapes.compile(layer, spec=spec, backend=counter)
    with torch.no_grad():
        for b, s in [(2, 8), (5, 24), (3, 40)]:
            xb = torch.randn(b, s, 16)
            expected = layer(xb)
            for got in (ep.module()(xb), ep_strict.module()(xb), gm(xb), compiled(xb)):
                torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert counter.frame_count == 1


# -- strict export ---------------------------------------------------------------------------------


def test_strict_export_shares_one_symbol_per_var():
    with pytest.warns(UserWarning, match="does not check that those inputs agree. Export non-strict"):
        ep = shapes.export(add3, ARGS3, spec=SHARED, strict=True)
    # Dynamo replaces the copies' symbols by the first: one symbol in the inputs
    assert len(ep.range_constraints) == 3 and len(input_symbols(ep.graph_module)) == 1
    assert n_asserts(ep.graph_module) == 4  # as non-strict: 2 range checks + 1 equality per extra input
    with pytest.raises(Exception, match=r"z.size\(\)\[0\] == x.size\(\)\[0\]|input z dim 0 must equal batch"):
        ep.module()(torch.ones(4, 4), torch.ones(4, 4), torch.ones(5, 4))


LINEAR = ShapesSpec({"x": (batch, 4), "y": (2 * batch, 4), "s": (seq,), "m": (batch, seq - 1)})


def linear_fn(x, y, s, m):
    return torch.cat([x, x]) + y, s * 2, m.sum(1)


def test_strict_export_keeps_linear_derived_dims_and_divisors():
    args = (torch.randn(3, 4), torch.randn(6, 4), torch.randn(16), torch.randn(3, 15))
    ep = shapes.export(linear_fn, args, spec=LINEAR, strict=True)
    # batch, seq, and the own symbols of 2*batch, m's batch and seq - 1, tied by Eq inside
    # Dynamo's trace (which then sizes y by 2*batch and m by batch: three symbols in the inputs)
    assert len(ep.range_constraints) == 5
    assert len(input_symbols(ep.graph_module)) == 3
    msgs = assert_messages(ep.graph_module)
    assert "branchyard.shapes: input y dim 0 must equal 2*batch" in msgs
    assert "branchyard.shapes: input m dim 1 must equal seq - 1" in msgs
    assert any("Eq(Mod(u2, 8), 0)" in m for m in msgs)  # restated inside Dynamo's trace (seq is u2)
    good = (torch.randn(5, 4), torch.randn(10, 4), torch.randn(24), torch.randn(5, 23))
    for got, want in zip(ep.module()(*good), linear_fn(*good)):
        torch.testing.assert_close(got, want)
    with pytest.raises(RuntimeError, match="input y dim 0 must equal 2\\*batch"):
        ep.module()(good[0], torch.randn(9, 4), *good[2:])
    # the divisor is a fact in strict export too: decided at trace time, no pad in the graph
    ep = shapes.export(split_heads, (torch.randn(16, 4),), spec=DIVISIBLE, strict=True)
    assert not any(n.target is torch.ops.aten.constant_pad_nd.default for n in ep.graph.nodes)
    torch.testing.assert_close(ep.module()(torch.ones(24, 4)), torch.full((3, 4), 8.0))


def test_strict_export_of_products_and_int_arguments():
    # heads comes bare before batch*heads: Dynamo meets the vars first (see below)
    spec = {"x": (batch, 4), "w": (heads, batch * heads), "s": (seq,), "n": seq - 1}

    def f(x, w, s, n):
        return x.sum(0), w.sum(0), s[:n]

    def inputs(b, h, sq, n=None):
        return torch.randn(b, 4), torch.randn(h, b * h), torch.randn(sq), sq - 1 if n is None else n

    ep = shapes.export(f, inputs(4, 3, 16), spec=spec, strict=True)
    assert len(input_symbols(ep.graph_module, ["x", "w", "s"])) == 3  # batch, heads, seq
    assert "branchyard.shapes: input w dim 1 must equal batch*heads" in assert_messages(ep.graph_module)
    a = inputs(5, 2, 24)
    for got, want in zip(ep.module()(*a), f(*a)):
        torch.testing.assert_close(got, want)
    with pytest.raises(RuntimeError, match=r"Eq\(u\d+ \+ 1, u\d+\)"):  # n == seq - 1
        ep.module()(*inputs(5, 2, 24, n=22))
    with pytest.raises(RuntimeError, match="input w dim 1 must equal batch\\*heads"):
        ep.module()(a[0], torch.randn(2, 11), *a[2:])


def test_strict_export_diagnoses_a_branch_on_a_declared_dim():
    with pytest.raises(DataDependentShapeError) as info:
        shapes.export(branchy, (torch.randn(4, 4),), spec=BRANCH_SPEC, strict=True)
    text = str(info.value)
    assert "test_shapes_entry_points.py:" in text and BRANCH_LINE in text and "`batch > 64`" in text


def test_strict_export_matches_symbols_by_position_when_an_int_comes_first():
    """Dynamo numbers its symbols in argument order: the int takes u0 here, so
    batch is u1 in the strict program; the dim checks must still name batch."""
    steps = ShapeVar("steps", min=1, max=32)

    def f(n, x, y):
        return torch.cat([x, x])[:n] + y[:n]

    spec = {"n": steps, "x": (batch, 4), "y": (2 * batch, 4)}
    ep = shapes.export(f, (3, torch.randn(4, 4), torch.randn(8, 4)), spec=spec, strict=True)
    assert "branchyard.shapes: input y dim 0 must equal 2*batch" in assert_messages(ep.graph_module)
    x, y = torch.randn(6, 4), torch.randn(12, 4)
    torch.testing.assert_close(ep.module()(5, x, y), f(5, x, y))
    with pytest.raises(Exception, match=r"input y dim 0 must equal 2\*batch|y.size\(\)\[0\]"):
        ep.module()(5, x, torch.randn(11, 4))


def test_compile_leaves_mode_with_options_to_torchs_own_error():
    with pytest.raises(RuntimeError, match="Either mode or options can be specified"):
        shapes.compile(add3, spec=SHARED, backend="inductor", mode="default", options={"max_autotune": False})


# -- products of vars, and the graph make_fx returns checks its inputs ------------------------------


def test_products_of_vars_including_a_square_are_dims_every_entry_point_checks():
    b = ShapeVar("b", min=2, max=16)
    h = ShapeVar("h", min=1, max=4)
    spec = {"x": (b, h), "y": (b * b,), "z": (b * h + 1,)}

    def f(x, y, z):
        return x.sum() + y.sum() + z.sum()

    args = (torch.ones(3, 2), torch.ones(9), torch.ones(7))
    ep = shapes.export(f, args, spec=spec)
    gm = shapes.make_fx(f, spec=spec)(*args)
    for n in (2, 5):
        good = (torch.ones(n, 2), torch.ones(n * n), torch.ones(2 * n + 1))
        torch.testing.assert_close(ep.module()(*good), f(*good))
        torch.testing.assert_close(gm(*good), f(*good))
    with pytest.raises(RuntimeError, match=r"input y dim 0 must equal b\*\*2"):
        ep.module()(torch.ones(3, 2), torch.ones(8), torch.ones(7))
    with pytest.raises(SpecViolationError, match=r"y dim 0 has size 8, but the spec says b\*\*2 = 9"):
        gm(torch.ones(3, 2), torch.ones(8), torch.ones(7))


def test_make_fx_graph_refuses_a_wrong_static_dim_instead_of_returning_a_wrong_shape():
    """Every tensor dim traced static -- an int in the spec, None in the spec, or a
    parameter the spec does not name -- is checked when the graph is called."""
    b = ShapeVar("b", min=2, max=16)

    def f(x, y, z):
        return x + 1, y * 2, z.sum(0)

    gm = shapes.make_fx(f, spec={"x": (b, 8), "y": (b, None)})(torch.ones(3, 8), torch.ones(3, 5), torch.ones(2, 4))
    out = gm(torch.ones(4, 8), torch.ones(4, 5), torch.ones(2, 4))
    assert [tuple(t.shape) for t in out] == [(4, 8), (4, 5), (4,)]
    cases = [
        ((torch.ones(4, 9), torch.ones(4, 5), torch.ones(2, 4)), r"argument 'x': x dim 1 has size 9, the spec fixes it at 8"),
        ((torch.ones(4, 8), torch.ones(4, 6), torch.ones(2, 4)), r"argument 'y': y dim 1 has size 6, but the graph was traced with the static size 5"),
        ((torch.ones(4, 8), torch.ones(4, 5), torch.ones(3, 4)), r"argument 'z': z dim 0 has size 3, but the graph was traced with the static size 2"),
        ((torch.ones(4, 8), torch.ones(4, 5), torch.ones(2, 4, 1)), r"argument 'z': got a tensor with 3 dims \(2, 4, 1\), the graph was traced with 2"),
        ((torch.ones(4, 8), torch.ones(4, 5)), r"the graph takes 3 inputs \(x, y, z\), got 2"),
    ]
    for args, message in cases:
        with pytest.raises(SpecViolationError, match=message):
            gm(*args)


def test_make_fx_graph_checks_varargs_keyword_only_and_kwargs_inputs():
    b = ShapeVar("b", min=2, max=16)

    def g(x, *rest, k, **kw):
        return x + rest[0] + k + kw["m"]

    spec = {"x": (b, 8), "rest": [(b, 8)], "kw": {"m": (b, 8)}}
    gm = shapes.make_fx(g, spec=spec)(torch.ones(3, 8), torch.ones(3, 8), k=torch.ones(8), m=torch.ones(3, 8))
    assert gm(torch.ones(5, 8), (torch.ones(5, 8),), torch.ones(8), {"m": torch.ones(5, 8)}).shape == (5, 8)
    with pytest.raises(SpecViolationError, match=r"argument 'k': k dim 0 has size 7, but the graph was traced with the static size 8"):
        gm(torch.ones(5, 8), (torch.ones(5, 8),), torch.ones(7), {"m": torch.ones(5, 8)})
    with pytest.raises(SpecViolationError, match=r"kw\['m'\] dim 0 has size 6, but ShapeVar 'b' is 5 from x dim 0"):
        gm(torch.ones(5, 8), (torch.ones(5, 8),), torch.ones(8), {"m": torch.ones(6, 8)})


def test_entry_points_log_what_they_did_through_the_branchyard_logger(caplog):
    b = ShapeVar("b", min=2, max=16)
    spec = {"x": (b, 4), "y": (b, 4)}
    args = (torch.ones(3, 4), torch.ones(3, 4))
    with caplog.at_level("DEBUG", logger="branchyard"):
        shapes.export(add3_two, args, spec=spec)
        shapes.make_fx(add3_two, spec=spec)(*args)
        shapes.compile(add3_two, spec=spec, backend="eager")(*args)
    messages = [r.getMessage() for r in caplog.records if r.name == "branchyard"]
    assert "shapes.export add3_two: 2 <= b <= 16; range constraints {u0: VR[2, 16], u1: VR[2, 16]}" in messages
    assert any(m.startswith("shapes.make_fx add3_two: 2 <= b <= 16; ") for m in messages)
    assert "shapes.compile add3_two: 2 <= b <= 16" in messages
    assert "shapes.compile: dropped 2 range checks implied by Eq ties" in messages


def add3_two(x, y):
    return x + y


def _raised_inside(filenames: list[str], exc: BaseException) -> BaseException:
    """``exc`` raised through frames of ``filenames``, outermost first (as torch's tracing raises it)."""
    scope: dict = {}
    inner = "raise e"
    for depth, filename in enumerate(reversed(filenames)):
        name = f"f{depth}"
        exec(compile(f"def {name}(e):\n    {inner}\n", filename, "exec"), scope)
        inner = f"{name}(e)"
    try:
        scope[f"f{len(filenames) - 1}"](exc)
    except BaseException as raised:  # noqa: BLE001 - the test wants the traceback
        return raised
    raise AssertionError("unreachable")


_HOP = "/site-packages/torch/_higher_order_ops/{}.py"
_FAKEIFY = "/site-packages/torch/_subclasses/meta_utils.py"


@pytest.mark.parametrize("op", ["cond", "while_loop"])
def test_a_size_asked_for_while_torch_fakes_a_control_flow_operand_names_the_op_and_torch(op):
    # torch before 2.14 asks for the value of an operand's unbacked size while making the fake
    # tensor of a control-flow op's operand: the error says so, not "Python control flow"
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    from branchyard.shapes.diagnostics import explain

    batch = ShapeVar("batch", min=1, max=8)
    u0 = sympy.Symbol("u0", integer=True)

    def explained(frames, cond):
        dde = _raised_inside(frames, GuardOnDataDependentSymNode(cond, "hint"))
        return explain(dde, dde, {u0: "batch"}, {"batch": batch})

    err = explained([_HOP.format(op), _FAKEIFY], u0)
    text = str(err)
    assert f"torch {torch.__version__.split('+')[0]}'s torch.{op} cannot trace an operand whose size is ShapeVar 'batch'" in text
    assert "torch >= 2.14" in text and "Python control flow" not in text
    assert err.shape_vars == ["batch"]
    # a comparison there is a user's `if` inside a branch: still the user's control flow
    text = str(explained([_HOP.format(op), _FAKEIFY], u0 > 4))
    assert "Python control flow depends on ShapeVar 'batch'" in text and "`batch > 4`" in text
    # a size asked for inside the op but not to fake an operand (the user's code in a branch),
    # in a helper module of torch's control-flow ops, or outside them: not blamed on the op
    for frames in ([_HOP.format(op)], [_HOP.format("utils"), _FAKEIFY], ["/home/user/model.py", _FAKEIFY]):
        assert "cannot trace an operand" not in str(explained(frames, u0))


@pytest.mark.skipif(TORCH_VERSION < (2, 14), reason="torch 2.11's cond cannot fake the unbacked operand at all")
def test_a_python_loop_over_a_declared_size_inside_a_branch_is_the_users_control_flow():
    spec_batch = ShapeVar("batch", min=1, max=8)

    @dynamic_spec({"x": (spec_batch, 16)})
    def f(x):
        def grow(u):
            for _ in range(u.shape[0]):
                u = u + 1
            return u

        return torch.cond(x.sum() > 0, grow, lambda u: -u, (x,))

    with pytest.raises(DataDependentShapeError) as info:
        shapes.export(f, (torch.randn(4, 16),))
    text = str(info.value)
    assert "Python control flow depends on ShapeVar 'batch'" in text and "cannot trace an operand" not in text
