"""Dynamic shapes declared once: ``ShapeVar`` / ``dynamic_spec`` -> unbacked symbolic sizes.

Declare which dims are dynamic, once, and the same declaration drives
``torch.export``, ``torch.compile`` and ``make_fx``::

    >>> import torch
    >>> from branchyard.shapes import ShapeVar, dynamic_spec
    >>> import branchyard.shapes as shapes
    >>> model = torch.nn.Linear(768, 10)
    >>> batch = ShapeVar("batch", min=2, max=128)
    >>> @dynamic_spec({"x": (batch, 768)})
    ... def forward(x):
    ...     return model(x)
    >>> ep = shapes.export(forward, (torch.randn(4, 768),))
    >>> ep.range_constraints
    {u0: VR[2, 128]}

Modules: :mod:`~branchyard.shapes.shape_var` (ShapeVar, derived dims),
:mod:`~branchyard.shapes.spec` (ShapesSpec, printing, JSON),
:mod:`~branchyard.shapes.decorator` (``@dynamic_spec``),
:mod:`~branchyard.shapes.validation` (inputs vs spec),
:mod:`~branchyard.shapes.symbolic` (one unbacked symbol per var),
:mod:`~branchyard.shapes.graph_checks` (runtime checks for shared symbols),
:mod:`~branchyard.shapes.entry_points` (export / compile / make_fx),
:mod:`~branchyard.shapes.interop` (torch ``ShapesSpec`` and ``Dim``),
:mod:`~branchyard.shapes.diagnostics` (data-dependent branches),
:mod:`~branchyard.shapes.suggest` (a spec from example inputs).
"""

from branchyard.shapes.decorator import dynamic_spec, get_spec
from branchyard.shapes.entry_points import ShapesFallbackWarning, SpecCompiled, checked_module, compile, export, make_fx
from branchyard.shapes.shape_var import DimExpr, ShapeVar
from branchyard.shapes.spec import ShapesSpec
from branchyard.shapes.suggest import suggest

__all__ = [
    "ShapeVar",
    "DimExpr",
    "ShapesSpec",
    "dynamic_spec",
    "get_spec",
    "export",
    "checked_module",
    "compile",
    "make_fx",
    "SpecCompiled",
    "ShapesFallbackWarning",
    "suggest",
]
