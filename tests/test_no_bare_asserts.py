"""branchyard's own code states its invariants with errors, not ``assert``: an
``AssertionError`` names neither what was wrong nor where, and ``python -O``
drops the check altogether (a silently wrong graph). Bad input raises a
:class:`~branchyard.errors.BranchyardError`; a broken invariant raises
:class:`~branchyard.errors.InternalError` through :func:`~branchyard.errors.checked`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from branchyard.errors import BranchyardError, InternalError, checked

PACKAGE = Path(__file__).resolve().parent.parent / "branchyard"


def test_no_module_of_the_package_uses_assert():
    found = [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
             for path in sorted(PACKAGE.rglob("*.py"))
             for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
             if isinstance(node, ast.Assert)]
    assert found == [], f"assert statements in branchyard: {found}"


def test_the_walk_sees_the_package():
    assert len(list(PACKAGE.rglob("*.py"))) > 50


def test_checked_returns_a_set_value_and_names_a_missing_one():
    assert checked(0, "a count", where="here") == 0  # falsy but set
    with pytest.raises(InternalError, match=r"^cond_tree: a nested cond's home is not set \(a branchyard bug"):
        checked(None, "a nested cond's home", where="cond_tree")
    assert issubclass(InternalError, BranchyardError)
