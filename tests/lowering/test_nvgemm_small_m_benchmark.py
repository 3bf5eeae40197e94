"""benchmarks/nvgemm_small_m.py in its CPU smoke mode: every row runs every
column or reports why not (here the small-M kernel, without CuTeDSL, is an
error row, not a crash), the JSON holds the rows, and the report names the
issue's target. The GPU run is the lead's; this keeps the script correct."""

from __future__ import annotations

import json

import pytest
import torch

from branchyard.lowering.nvgemm.kernel_config import small_m_configs


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("nvgemm_small_m")


def test_dry_run_reports_a_failing_kernel_as_a_row(bench, tmp_path, capsys):
    out = tmp_path / "rows.json"
    rows = bench.main(["--dry-run", "--markdown", "--json", str(out)])
    assert [(r["m"], r["weight"]) for r in rows] == [(m, w) for w in ("128x256", "256x128") for m in (1, 16)]
    for r in rows:
        assert r["small_m"] is None and r["config"] is None
        assert set(r["errors"]["small_m"]) == {c.name for c in small_m_configs(r["m"], r["n"], r["k"])}
        assert {f"gemv_m{8 if r['m'] == 1 else 16}_w8", f"gemv_m{8 if r['m'] == 1 else 16}_w8_u4"} <= set(
            r["errors"]["small_m"])
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


def test_each_variant_and_the_first_forms_best_are_reported(bench):
    times = {"gemv_m8_w8": 40.0, "gemv_m8_w4": 44.0, "gemv_m8_w8_u4": 32.0, "gemv_m8_w4_u2": 36.0}
    assert bench.best_of(times, ["gemv_m8_w8", "gemv_m8_w4", "gemv_m8_w16"]) == (40.0, "gemv_m8_w8")
    assert bench.best_of(times, ["gemv_m8_w16"]) == (None, None)
    row = {"m": 1, "weight": "4096x14336", "configs": times,
           "configs_pct_copy": {c: 2000 / t for c, t in times.items()}}
    assert bench.variant_lines([row, {"m": 16, "weight": "4096x14336", "configs": {}}]) == [
        "variants M=1 4096x14336: gemv_m8_w8_u4 32.0 us 62.5%, gemv_m8_w4_u2 36.0 us 55.6%, "
        "gemv_m8_w8 40.0 us 50.0%, gemv_m8_w4 44.0 us 45.5%"
    ]


def test_flush_kinds(bench, capsys):
    with pytest.raises(ValueError, match="flush='sometimes'"):
        bench.Timer(torch.device("cpu"), 3, "sometimes")
    assert bench.Timer(torch.device("cpu"), 3, "read").scrub is None  # no L2 to flush on CPU
    bench.main(["--dry-run", "--m", "1", "--weights", "128x256", "--flush", "write"])
    assert "L2 flush: write" in capsys.readouterr().out
    bench.main(["--dry-run", "--m", "1", "--weights", "128x256", "--no-flush"])
    assert "L2 flush: none" in capsys.readouterr().out
