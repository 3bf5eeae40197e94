"""The pass registry: one name per pass, loaded lazily, no import side effects,
and no floor importing a floor above it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from branchyard.errors import BranchyardError
from branchyard.registry import PASSES, get_pass, pass_class, pass_names

ROOT = Path(__file__).resolve().parents[1] / "branchyard"


@pytest.mark.parametrize("name", sorted(PASSES))
def test_each_pass_has_one_name(name):
    # The registry key, the class's name, reports and the CLI all say the same.
    p = get_pass(name)
    assert p.name == name == type(p).name
    assert p.report.pass_name == name


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(BranchyardError, match="unknown pass 'cond-to-switch'; known passes: cond_to_switch, nvgemm, switch_to_cond"):
        pass_class("cond-to-switch")
    assert pass_names() == ["cond_to_switch", "nvgemm", "switch_to_cond"]


def test_unimportable_pass_module_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(PASSES, "ghost", "branchyard.no_such_module:Ghost")
    with pytest.raises(BranchyardError, match="pass 'ghost' is unavailable: importing branchyard.no_such_module failed"):
        get_pass("ghost")


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT.parent, check=True)
    return out.stdout.strip()


def test_passes_are_imported_only_when_asked_for():
    code = (
        "import sys, branchyard.registry, branchyard.passes, branchyard.fx.pass_infra\n"
        "print('branchyard.lowering' in sys.modules)\n"
        "branchyard.registry.get_pass('nvgemm')\n"
        "print('branchyard.lowering.nvgemm.fuse' in sys.modules)\n"
    )
    assert _run(code).split() == ["False", "True"]


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return {n for n in names if n.startswith("branchyard")}


#: floor -> the branchyard packages it must not import (anything above it).
_ABOVE = {
    "fx": ("branchyard.passes", "branchyard.shapes", "branchyard.lowering", "branchyard.registry",
           "branchyard.serialization", "branchyard.inspection", "branchyard.testing", "branchyard.cli"),
    "passes": ("branchyard.lowering", "branchyard.registry", "branchyard.serialization", "branchyard.inspection",
               "branchyard.cli"),
    "shapes": ("branchyard.lowering", "branchyard.passes", "branchyard.registry", "branchyard.cli"),
}


@pytest.mark.parametrize("floor", sorted(_ABOVE))
def test_no_floor_imports_a_floor_above_it(floor):
    bad = {
        f"{path.relative_to(ROOT.parent)}: {name}"
        for path in sorted((ROOT / floor).rglob("*.py"))
        for name in _imports(path)
        if name.startswith(_ABOVE[floor])
    }
    assert not bad, sorted(bad)


def test_every_branchyard_op_is_listed_with_its_module():
    """A program calling an op not in OPS could not be read by the CLI."""
    import importlib

    import torch

    from branchyard.registry import OPS, load_ops

    load_ops()
    for module in set(OPS.values()):
        importlib.import_module(module)
    defined = {f"branchyard::{name}" for name in dir(torch.ops.branchyard) if not name.startswith("_")
               and isinstance(getattr(torch.ops.branchyard, name), torch._ops.OpOverloadPacket)}
    assert defined and defined <= set(OPS), sorted(defined - set(OPS))
