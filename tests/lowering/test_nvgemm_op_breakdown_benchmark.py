"""benchmarks/nvgemm_op_breakdown.py runs on CPU and times every piece it names."""

from __future__ import annotations


def test_breakdown_times_every_piece_and_reports_the_direct_path(load_benchmark, monkeypatch, capsys):
    from branchyard.lowering.nvgemm import op as op_mod
    from branchyard.lowering.nvgemm import tuner as tuner_mod

    # the script installs a no-op tuner and lets CPU tensors through: undo both afterwards
    monkeypatch.setattr(tuner_mod, "_default", tuner_mod._default)
    monkeypatch.setattr(op_mod, "fused_kernel_ineligibility", op_mod.fused_kernel_ineligibility)
    monkeypatch.setattr(op_mod, "_DIRECT", {})  # only the keysets this run sees (others' tests add their own)
    bench = load_benchmark("nvgemm_op_breakdown")
    got = bench.main(["--calls", "50"])
    pieces = {"aten_noop", "op", "body", "timing_mode", "coarse_key", "guarded_plan", "signature", "plan_lookup", "empty_strided",
              "plan_alloc", "weight_view", "data_ptr_x3"}
    assert pieces <= set(got) and all(got[p] > 0 for p in pieces)
    # the whole call costs more than the no-op floor; CPU tensors take the Autograd kernel's direct path
    assert got["op"] > got["aten_noop"]
    assert got["direct"] and all(got["direct"].values()), got["direct"]
    out = capsys.readouterr().out
    assert "direct path" in out and all(p in out for p in pieces)
