"""suggest(): a spec proposed from example input sets, and the spec it proposes works."""

from __future__ import annotations

import pytest
import torch

import branchyard.shapes as shapes
from branchyard.errors import ShapeSpecError
from branchyard.shapes import suggest


def attention(q, k, mask, heads):
    return q


def attention_sets(pairs):
    return [
        (torch.ones(b * h, s, 16), torch.ones(b * h, s, 16), torch.ones(b, s - 1), h)
        for b, h, s in pairs
    ]


def test_varying_dims_become_shared_vars_with_ranges_divisors_and_relations():
    spec = suggest(attention, *attention_sets([(2, 4, 64), (4, 2, 128), (3, 8, 256)]))
    assert str(spec).splitlines() == [
        "argument   shape",
        "---------  -----------------------------------",
        "q          (heads*mask_dim0, q_dim1, 16)",
        "k          (heads*mask_dim0, q_dim1, 16)",
        "mask       (mask_dim0, q_dim1 - 1)",
        "heads      int heads",
        "",
        "ShapeVar   range",
        "---------  -----------------------------------",
        "heads      2 <= heads <= 8, multiple of 2",
        "mask_dim0  2 <= mask_dim0 <= 4",
        "q_dim1     64 <= q_dim1 <= 256, multiple of 64",
    ]
    # the structure, checked piece by piece
    assert set(spec.vars) == {"q_dim1", "mask_dim0", "heads"}
    assert spec.vars["q_dim1"].multiple_of == 64 and (spec.vars["q_dim1"].min, spec.vars["q_dim1"].max) == (64, 256)
    assert str(spec.params["q"]) == str(spec.params["k"]) == "(heads*mask_dim0, q_dim1, 16)"
    assert str(spec.params["mask"]) == "(mask_dim0, q_dim1 - 1)"
    assert str(spec.params["heads"]) == "int heads"


def test_two_sets_only_group_equal_dims():
    def f(x, y):
        return x

    spec = suggest(f, (torch.ones(2, 4), torch.ones(2, 7)), (torch.ones(5, 4), torch.ones(5, 10)))
    assert str(spec.params["x"]) == "(x_dim0, 4)"
    assert str(spec.params["y"]) == "(x_dim0, y_dim1)"  # y_dim1 = x_dim0 + 5 fits any two points: not proposed


def test_suggested_spec_drives_export():
    def f(x, y):
        return torch.cat([x, x]) + y

    sets = [(torch.ones(b, 3), torch.ones(2 * b, 3)) for b in (2, 3, 5)]
    spec = suggest(f, *sets)
    assert str(spec.params["y"]) == "(2*x_dim0, 3)"
    ep = shapes.export(f, sets[0], spec=spec)
    assert len(ep.range_constraints) == 2  # x_dim0, and y's 2*x_dim0 tied to it
    assert ep.module()(torch.ones(4, 3), torch.ones(8, 3)).shape == (8, 3)


def test_suggest_needs_two_sets_of_the_same_structure():
    def f(x):
        return x

    with pytest.raises(ShapeSpecError, match="at least two are needed"):
        suggest(f, (torch.ones(2, 3),))
    with pytest.raises(ShapeSpecError, match="example set 1 has a different structure"):
        suggest(f, (torch.ones(2, 3),), (torch.ones(2, 3, 4),))
    with pytest.raises(ShapeSpecError, match="example set 0 does not match the signature"):
        suggest(f, (torch.ones(2), torch.ones(2)), (torch.ones(3),))
