"""benchmarks/nvgemm_small_m.py in its CPU smoke mode: every row runs every
column or reports why not (here the small-M kernel, without CuTeDSL, is an
error row, not a crash), the JSON holds the rows, and the report names the
issue's target. The GPU run is the lead's; this keeps the script correct."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("nvgemm_small_m")


def test_dry_run_reports_a_failing_kernel_as_a_row(bench, tmp_path, capsys):
    out = tmp_path / "rows.json"
    rows = bench.main(["--dry-run", "--markdown", "--json", str(out)])
    assert [(r["m"], r["weight"]) for r in rows] == [(m, w) for w in ("128x256", "256x128") for m in (1, 16)]
    for r in rows:
        assert r["small_m"] is None and r["config"] is None
        assert set(r["errors"]["small_m"]) == {f"gemv_m{8 if r['m'] == 1 else 16}_w{w}" for w in (8, 4, 16)}
        assert all("cannot compile the CuTeDSL GEMM" in e for e in r["errors"]["small_m"].values())
        for column in ("cublas", "unfused", "tuned"):
            assert r[column] > 0 and r[f"{column}_pct_copy"] > 0, (column, r)
        assert r["picked"] == "unfused path (not tuned)"  # CPU tensors: the op's fallback
        assert r["bytes"] == 2 * (r["m"] * r["k"] + r["n"] * r["k"] + r["n"] + r["m"] * r["n"])
    saved = json.loads(out.read_text())
    assert saved["copy_GBps"] > 0 and len(saved["rows"]) == 4
    text = capsys.readouterr().out
    assert "| 16 | 256x128 | - |" in text and "error M=1 128x256 gemv_m8_w8: LoweringError" in text


def test_the_target_line(bench):
    rows = [{"m": 16, "weight": "4096x14336", "small_m_pct_copy": 80.0},
            {"m": 1, "weight": "4096x14336", "small_m_pct_copy": 60.0},
            {"m": 64, "weight": "4096x14336", "small_m_pct_copy": 10.0},
            {"m": 16, "weight": "1024x4096", "small_m_pct_copy": 10.0}]
    assert bench.target_lines(rows) == [
        "target M=16 4096x14336: small_m >= 75% of copy bandwidth: 80.0% (met)",
        "target M=1 4096x14336: small_m >= 75% of copy bandwidth: 60.0% (MISSED)",
    ]
