"""``@dynamic_spec`` through torch's own doors: ``torch.compile``, ``torch.export`` and ``make_fx``.

Nothing here goes through branchyard.shapes' own entry points: a user decorates
and then calls torch. Compiles are counted with Dynamo's counting backend.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.fx.experimental.proxy_tensor import make_fx as torch_make_fx

from branchyard.errors import SpecViolationError
from branchyard.shapes import ShapeVar, dynamic_spec

batch = ShapeVar("batch", min=2, max=512)


class TwoInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 3)

    def forward(self, x, y):
        return self.lin(x) + self.lin(y)


def decorated_linear_instance():
    return dynamic_spec({"input": (batch, 8)})(torch.nn.Linear(8, 3))


def decorated_two_input_instance():
    return dynamic_spec({"x": (batch, 8), "y": (batch, 8)})(TwoInputs())


def decorated_subclass_instance():
    @dynamic_spec({"input": (batch, 8)})
    class InheritsLinear(torch.nn.Linear):
        pass

    return InheritsLinear(8, 3)


def decorated_function():
    lin = torch.nn.Linear(8, 3)

    @dynamic_spec({"x": (batch, 8)})
    def f(x):
        return lin(x).relu()

    return f


MODELS = {
    "linear instance": decorated_linear_instance,
    "two-input instance": decorated_two_input_instance,
    "subclass inheriting forward": decorated_subclass_instance,
    "function": decorated_function,
}


def inputs(model, n):
    return (torch.randn(n, 8), torch.randn(n, 8)) if isinstance(model, TwoInputs) else (torch.randn(n, 8),)


@pytest.mark.parametrize("make", MODELS.values(), ids=list(MODELS))
def test_torch_compile_of_a_decorated_model_compiles_once_for_every_batch_size(make):
    model = make()
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(model, backend=counter)
    for n in (2, 4, 7, 300):
        args = inputs(model, n)
        torch.testing.assert_close(compiled(*args), model(*args))
    assert counter.frame_count == 1


@pytest.mark.parametrize("make", MODELS.values(), ids=list(MODELS))
def test_out_of_spec_input_is_a_spec_violation_on_the_first_and_any_later_compiled_call(make):
    model = make()
    counter = CompileCounterWithBackend("eager")
    first = torch.compile(model, backend=counter, fullgraph=True)  # the check is no graph break
    with pytest.raises(SpecViolationError, match=r"dim 0 has size 1, outside ShapeVar 'batch' \(2 <= batch <= 512\)"):
        first(*inputs(model, 1))
    assert counter.frame_count == 0  # refused before Dynamo saw the frame
    first(*inputs(model, 4))
    with pytest.raises(SpecViolationError, match=r"dim 0 has size 600, outside ShapeVar 'batch'"):
        first(*inputs(model, 600))
    assert counter.frame_count == 1
    with pytest.raises(SpecViolationError, match="size 600, outside ShapeVar 'batch'"):
        model(*inputs(model, 600))  # eager calls check too


def test_decorated_instance_called_inside_a_bigger_compiled_function_is_inlined():
    lin = decorated_linear_instance()
    counter = CompileCounterWithBackend("eager")

    @torch.compile(backend=counter, fullgraph=True)
    def outer(x):
        return lin(x) * 2

    x = torch.randn(5, 8)
    torch.testing.assert_close(outer(x), lin(x) * 2)
    assert counter.frame_count == 1


@pytest.mark.parametrize("strict", [False, True])
def test_torch_export_of_a_decorated_instance_reads_the_spec(strict):
    lin = decorated_linear_instance()
    ep = torch.export.export(lin, (torch.randn(4, 8),), strict=strict)
    assert [str(r) for r in ep.range_constraints.values()] == ["VR[2, 512]"]
    assert list(ep.graph_signature.parameters) == ["weight", "bias"]


def test_torch_make_fx_of_a_decorated_instance_traces_one_symbol():
    lin = decorated_linear_instance()
    gm = torch_make_fx(lin, tracing_mode="fake", _allow_non_fake_inputs=True)(torch.randn(4, 8))
    (x,) = gm.graph.find_nodes(op="placeholder")
    assert isinstance(x.meta["val"].shape[0], torch.SymInt) and x.meta["val"].shape[1] == 8


def test_plain_torch_compile_of_a_derived_dim_logs_nothing():
    """torch's compile-metrics logger JSON-encodes the spec; a derived dim used to
    make it print a 22-line ERROR traceback on every compile."""
    script = textwrap.dedent(
        """
        import torch
        from branchyard.shapes import ShapeVar, dynamic_spec
        S = ShapeVar("S", min=2, max=512)
        H = ShapeVar("H", min=1, max=8)

        @dynamic_spec({"x": (S, H), "y": (S + 1, 4), "z": (S * H,)})
        def f(x, y, z):
            return x.sum() + y.sum() + z.sum()

        out = torch.compile(f, backend="eager")(torch.ones(4, 2), torch.ones(5, 4), torch.ones(8))
        print(int(out))
        """
    )
    root = pathlib.Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "36"
    assert "ERROR" not in done.stderr and "Traceback" not in done.stderr and "E1" not in done.stderr, done.stderr


def test_decorated_instance_whose_forward_has_defaults_keyword_only_and_varargs():
    """The frame Dynamo compiles carries forward's own parameters, whatever their kinds."""

    class Mixed(torch.nn.Module):
        def forward(self, x, bias=1.0, *extra, scale, **named):
            out = x * scale + bias
            for e in extra:
                out = out + e
            return out + named.get("shift", 0.0)

    model = dynamic_spec({"x": (batch, 4), "extra": [(batch, 4)]})(Mixed())
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(model, backend=counter)
    for n in (2, 5, 9):
        x, e = torch.randn(n, 4), torch.randn(n, 4)
        torch.testing.assert_close(compiled(x, 0.5, e, scale=3.0, shift=1.0), x * 3.0 + 0.5 + e + 1.0)
    assert counter.frame_count == 1
    with pytest.raises(SpecViolationError, match=r"extra\[0\] dim 0 has size 3, but ShapeVar 'batch' is 4"):
        compiled(torch.randn(4, 4), 0.5, torch.randn(3, 4), scale=3.0)


def test_importing_shapes_does_not_import_dynamo():
    """The decorator's Dynamo hooks are made on first use: importing the package stays cheap."""
    root = pathlib.Path(__file__).resolve().parents[2]
    code = "import sys, branchyard.shapes; print('torch._dynamo' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(root)}, cwd=root)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
