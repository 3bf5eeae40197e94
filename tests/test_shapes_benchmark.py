"""benchmarks/shapes.py runs end to end at toy sizes and reports what the docs' tables show."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("shapes")


def test_toy_run_writes_every_table(bench, tmp_path, capsys):
    out = tmp_path / "shapes.json"
    assert bench.main(["--backend", "eager", "--sizes", "3", "--dim", "8", "--export-repeats", "1",
                       "--rounds", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["variant"] for r in data["compile"]][0] == "shapes.compile (spec)"
    export = {r["variant"]: r for r in data["export"]}
    # a symbol per input, tied to batch by named checks: one pair of range checks and
    # an equality per other input (strict: 5 asserts, as the docs' table says)
    assert export["shapes.export (spec)"]["symbols"] == 4
    assert export["shapes.export (spec, strict=True)"]["asserts"] == 5
    assert export["torch.export + native ShapesSpec"]["symbols"] == 4
    assert {r["variant"]: r["frames"] for r in data["compile_graphs"]}["shapes.compile (spec)"] == 1
    assert "== export: 3 inputs share batch, 1 input is 2*batch" in capsys.readouterr().out
