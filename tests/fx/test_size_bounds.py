"""upper_bound: the largest value a (possibly symbolic) size takes."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from branchyard.fx.size_bounds import upper_bound


def _symbol(lo: int | None = None, hi: int | None = None) -> torch.SymInt:
    u = ShapeEnv().create_unbacked_symint()
    if lo is not None:
        torch._check(u >= lo)
    if hi is not None:
        torch._check(u <= hi)
    return u


def test_an_int_is_its_own_bound():
    assert upper_bound(0) == 0 and upper_bound(9216) == 9216


def test_a_symbolic_size_takes_the_largest_value_of_its_range():
    u = _symbol(1, 64)
    assert upper_bound(u) == 64
    assert upper_bound(u * 1024 + 8192) == 64 * 1024 + 8192
    assert upper_bound(u * u) == 64 * 64


def test_an_unbounded_symbol_has_no_bound():
    assert upper_bound(_symbol()) is None
    assert upper_bound(_symbol(lo=1) * 8) is None


@pytest.mark.parametrize("value", [True, 2.0, "8", None, torch.tensor(3)])
def test_what_is_not_a_size_has_no_bound(value):
    assert upper_bound(value) is None
