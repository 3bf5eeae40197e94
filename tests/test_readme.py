"""The README: every ```python snippet runs on its own, its links resolve, and
the files a package declares (LICENSE, py.typed) are there."""

from __future__ import annotations

import re
import sys
import tomllib
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BLOCK = re.compile(r"```python\n(?P<code>.*?)```", re.S)


def _snippets() -> list[tuple[int, str]]:
    text = README.read_text()
    return [(text[: m.start("code")].count("\n") + 1, m.group("code")) for m in BLOCK.finditer(text)]


def test_readme_has_python_snippets():
    assert len(_snippets()) >= 2


@pytest.mark.parametrize("line, code", _snippets(), ids=lambda v: f"line{v}" if isinstance(v, int) else "")
def test_each_readme_snippet_runs_alone(line, code, tmp_path, monkeypatch):
    """A reader copies one snippet: it must not need names from another."""
    monkeypatch.chdir(tmp_path)
    module = types.ModuleType(f"readme_line{line}")  # Dynamo imports a compiled function's module
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(code, f"{README}:{line}", "exec"), module.__dict__)


def test_readme_links_every_docs_page_and_the_links_resolve():
    text = README.read_text()
    targets = re.findall(r"\]\(([^)#]+)\)", text)
    for target in targets:
        assert (ROOT / target).exists(), target
    linked = {Path(t).name for t in targets if t.startswith("docs/")}
    assert {p.name for p in (ROOT / "docs").glob("*.md")} <= linked


def test_license_matches_what_pyproject_declares():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "BSD-3-Clause"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License")
    assert "Copyright (c) 2026, the branchyard authors" in text
    assert "Neither the name of the copyright holder" in text  # clause 3


def test_py_typed_ships_with_the_package():
    assert (ROOT / "branchyard" / "py.typed").is_file()
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "py.typed" in setuptools["package-data"]["branchyard"]
