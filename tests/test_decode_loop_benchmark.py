"""benchmarks/decode_loop.py's CPU parts: the floor and the table made from recorded rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROWS = ROOT / "benchmarks" / "results" / "2026-12-01-1430" / "decode_loop.jsonl"


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("decode_loop")


def test_the_floor_is_one_read_of_the_weights_at_the_copy_rate(bench):
    # 16.8 MB at 4200 GB/s (bytes read + written per second) is 4 us, plus the empty step
    floor = bench.floor_us(16_800_000, 4200.0, 14.0)
    assert floor == {"hbm_floor_us": 4.0, "floor_us": 18.0}


def test_table_of_recorded_rows_recomputes_the_floor_and_names_the_speedups(bench):
    rows = [json.loads(line) for line in ROWS.read_text().splitlines()]
    table = bench.markdown(rows)
    lines = [line for line in table.splitlines() if line.startswith("| 2.14.1 | 1024x4096 | 16 |")]
    assert len(lines) == 1
    cells = [c.strip() for c in lines[0].strip("|").split("|")]
    assert cells[-1] == "18.9"  # 16.8 MB / 4211 GB/s = 4.0 us, + 14.86 us: not the rows' stored 22.8
    assert cells[cells.index("fails: RuntimeError")] and "38.0" in cells
    assert "best branchyard column by_full_inductor 38.0 us/step" in table
    assert "(differs)" in table  # batch 1 at 40 trips: recorded, not hidden


def test_the_rotation_race_columns_come_after_the_pipelines(bench):
    rows_file = ROOT / "benchmarks" / "results" / "2026-12-02-0000" / "decode_loop_1024.jsonl"
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    head, _, *body = bench.markdown(rows).splitlines()
    columns = [c.strip() for c in head.strip("|").split("|")]
    assert columns[columns.index("by_full_inductor") + 1 :] == ["router_in_step", "router_in_body", "floor"]
    row16 = next(line for line in body if line.startswith("| 2.14.1 | 1024x4096 | 16 |"))
    cells = [c.strip() for c in row16.strip("|").split("|")]
    assert cells[columns.index("router_in_step")] == "28.4" and cells[columns.index("router_in_body")] == "30.1"
