"""benchmarks/nvgemm_op_overhead.py runs on CPU: every column, the kernel column
through the fused kernel's candidate and its bound launch."""

from __future__ import annotations


def test_overhead_times_every_column_and_the_kernel_column_launches_bound(load_benchmark, monkeypatch, capsys):
    from branchyard.lowering.nvgemm import candidates as nv_candidates
    from branchyard.lowering.nvgemm import op as op_mod
    from branchyard.lowering.nvgemm import tuner as tuner_mod

    # the script installs a no-op tuner and lets CPU tensors through: undo both afterwards
    monkeypatch.setattr(tuner_mod, "_default", tuner_mod._default)
    monkeypatch.setattr(op_mod, "fused_kernel_ineligibility", op_mod.fused_kernel_ineligibility)
    bench = load_benchmark("nvgemm_op_overhead")
    got = bench.main(["--calls", "20", "--repeats", "2"])
    columns = {"aten_noop", "op", "op_in_graph", "op_body", "op_kernel", "impl", "op_out"}
    assert columns <= set(got) and all(got[c] > 0 for c in columns)
    plans = {c.n: c for c in tuner_mod._default.call_plans.values()}
    assert set(plans) == {128, 256}
    assert plans[128].launch is plans[128].impl, "the no-op candidate has no bind: it runs as it is"
    kernel = plans[256]
    assert isinstance(kernel.impl, nv_candidates._KernelImpl) and kernel.launch is not kernel.impl
    assert not kernel.weight_t, "an [N, K] weight goes to the bound launch as it is"
    out = capsys.readouterr().out
    assert all(f"{c} " in out for c in columns)


def test_against_compares_two_checkouts_each_in_its_own_process(load_benchmark, tmp_path):
    import os
    import subprocess

    import pytest

    bench = load_benchmark("nvgemm_op_overhead")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    table = bench.compare(root, root, rounds=1, calls=20, repeats=2)
    assert {"aten_noop", "op", "op_body", "op_out"} <= set(table)
    for row in table.values():
        assert row["old_min"] <= row["old"] <= row["old_max"] and row["new"] > 0 and row["ratio"] > 0
    # no branchyard there: the run would import an installed one (refused) or none
    with pytest.raises((RuntimeError, subprocess.CalledProcessError)):
        bench.compare(str(tmp_path), root, rounds=1, calls=20, repeats=2)
