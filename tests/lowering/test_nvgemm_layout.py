"""The layout of ``branchyard.lowering.nvgemm``: no import cycle between its
modules (function-local imports included), no private name imported from a
sibling, the storage floor below the tuner, GPU-only packages imported lazily."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

import branchyard.lowering.nvgemm as pkg

PACKAGE = "branchyard.lowering.nvgemm"
ROOT = Path(pkg.__file__).parent
MODULES = sorted(p.stem for p in ROOT.glob("*.py") if p.stem != "__init__")


def _imports(module: str) -> list[tuple[str, list[str]]]:
    """(sibling module, names imported from it) for every import statement in ``module``."""
    tree = ast.parse((ROOT / f"{module}.py").read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y / from . import x
                base = f"{PACKAGE}.{base}" if base else PACKAGE
            names = [a.name for a in node.names]
            if base == PACKAGE:
                out += [(n, []) for n in names if n in MODULES]
            elif base.startswith(PACKAGE + "."):
                out.append((base.removeprefix(PACKAGE + ".").split(".")[0], names))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith(PACKAGE + "."):
                    out.append((a.name.removeprefix(PACKAGE + ".").split(".")[0], []))
    return out


def _graph() -> nx.DiGraph:
    g = nx.DiGraph()
    g.add_nodes_from(MODULES)
    for m in MODULES:
        for target, _ in _imports(m):
            if target != m:
                g.add_edge(m, target)
    return g


def test_the_walk_sees_the_known_edges():
    g = _graph()
    # A module-level and a function-local import, so the walk is not vacuous.
    assert g.has_edge("tuner", "candidates") and g.has_edge("cutedsl_gemm", "_cutedsl_kernel")
    assert len(MODULES) >= 20 and g.number_of_edges() >= 30


def test_no_import_cycle_between_modules():
    cycles = list(nx.simple_cycles(_graph()))
    assert cycles == []


def test_no_private_name_is_imported_from_a_sibling():
    private = [(m, t, n) for m in MODULES for t, names in _imports(m) for n in names
               if n.startswith("_") and t != m]
    assert private == []


@pytest.mark.parametrize("storage", ["kernel_cache", "winners", "store", "environment"])
def test_storage_does_not_reach_the_tuner(storage):
    reach = nx.descendants(_graph(), storage)
    assert not reach & {"tuner", "candidates", "timing", "cutedsl_gemm", "op"}, reach


def test_modules_import_without_gpu_packages():
    """Every module imports in a fresh interpreter without CUDA, and none pulls
    in cutlass or tvm_ffi at import time (the kernels import them lazily)."""
    code = (
        "import importlib, sys\n"
        f"for m in {MODULES!r}: importlib.import_module('{PACKAGE}.' + m)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('cutlass', 'tvm_ffi'))\n"
        "sys.exit('imported ' + ','.join(bad) if bad else 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=ROOT.parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
