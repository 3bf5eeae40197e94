"""Every ```python block in docs/*.md runs, top to bottom, one namespace per
file. A block preceded by ``<!-- skip-test: reason -->`` is skipped (e.g. GPU
only); a block preceded by ``<!-- gpu -->`` runs only with CUDA."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
import torch

DOCS = Path(__file__).resolve().parent.parent / "docs"
BLOCK = re.compile(r"(<!--\s*(?P<tag>[\w-]+)(?::[^>]*)?\s*-->\s*\n)?```python\n(?P<code>.*?)```", re.S)


def _doc_files():
    return sorted(DOCS.glob("*.md")) + [DOCS.parent / "README.md"]


@pytest.mark.parametrize("path", _doc_files(), ids=lambda p: p.name)
def test_doc_examples_run(path: Path, tmp_path, monkeypatch):
    blocks = list(BLOCK.finditer(path.read_text()))
    runnable = [b for b in blocks if b.group("tag") not in ("skip-test",)]
    monkeypatch.chdir(tmp_path)
    # A real module in sys.modules: Dynamo imports the module named by a
    # compiled function's __name__ global.
    module = types.ModuleType(f"docs_{path.stem}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    ns = module.__dict__
    ran = 0
    for b in runnable:
        if b.group("tag") == "gpu" and not torch.cuda.is_available():
            continue
        code = b.group("code")
        line = path.read_text()[: b.start("code")].count("\n") + 1
        exec(compile(code, f"{path}:{line}", "exec"), ns)
        ran += 1
    if ran == 0:
        pytest.skip(f"{path.name}: no python example runs here (none, GPU-only, or marked skip-test)")
