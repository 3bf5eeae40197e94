"""docs/ is for users; dated run logs live in benchmarks/results/ (one file per run)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
RESULTS = sorted(p for p in (ROOT / "benchmarks" / "results").glob("*.md") if p.name != "README.md")

#: What a dated run narrative looks like: a heading naming a session or run with its date, or "this session".
LOG_MARKS = re.compile(r"(?im)^#+ .*\b(session|runs?)\b.*\d{4}-\d{2}-\d{2}|\bthis session\b|\bthe last session\b|^\*\*Run \d")


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_docs_hold_no_dated_run_logs(page):
    found = LOG_MARKS.findall(page.read_text())
    assert not found, f"{page.name}: a dated run log belongs in benchmarks/results/: {found[:3]}"


def test_gpu_page_is_a_short_how_to():
    text = (ROOT / "docs" / "gpu.md").read_text()
    assert len(text.splitlines()) <= 80
    for needed in ("../shared/device/stage-cutedsl.sh", "../shared/device/stage-torch.sh", "PYTHONPATH",
                   "python3 -m pytest -q", "-n 4 tests/gpu", "2.11", "2.14.1", "benchmarks/results/"):
        assert needed in text, needed


@pytest.mark.parametrize("record", RESULTS, ids=lambda p: p.name)
def test_each_run_record_has_its_date_command_and_versions(record):
    assert re.match(r"\d{4}-\d{2}-\d{2}-", record.name)
    text = record.read_text()
    assert re.search(r"\d{4}-\d{2}-\d{2}", text.splitlines()[0]), "the title names the date"
    assert "python3 " in text or "python " in text, "the command that ran"
    assert re.search(r"torch 2\.\d+", text), "the versions"
    assert record.name in (ROOT / "benchmarks" / "results" / "README.md").read_text()


def test_benchmarks_page_keeps_current_figures_with_machine_versions_and_date():
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    sections = re.split(r"(?m)^## ", text)[1:]
    assert len(sections) >= 4
    for section in sections:
        assert re.search(r"\b20\d\d-\d\d-\d\d\b", section), section.splitlines()[0]
        assert "torch 2." in section or "torch 2.14.1" in section, section.splitlines()[0]
