"""benchmarks/nvgemm_blocks.py in its CPU smoke mode: every block at toy widths
goes through every CPU column (eager module, unrewritten and rewritten
``ep.module()``), each output checked against the eager block, and the report
prints every target. The GPU run (the real widths, CUDA graphs, torch.compile)
is the lead's; this keeps the script correct by construction."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("nvgemm_blocks")


def test_dry_run_times_every_block_and_checks_its_outputs(bench, capsys):
    rows = bench.main(["--dry-run", "--markdown"])
    assert [(r["block"], r["m"]) for r in rows] == [(b, m) for b in bench.blocks() for m in (1, 4)]
    for r in rows:
        assert all(isinstance(r[f"{c}_eager"], float) for c in ("module", "unrewritten", "rewritten")), r
    out = capsys.readouterr().out
    assert "| llama3_70b_attn_proj | 4 |" in out and "target rewritten >= 1.00x unrewritten (eager)" in out
    # on CPU nothing is raced, so both rewritten programs keep every fused op the block offers,
    # and Llama's separate q, k, v projections are merged into one GEMM (m)
    offered = {"gpt2_mlp": "2", "llama3_8b_mlp": "2", "llama3_70b_mlp": "2",
               "gpt2_attn_proj": "1", "llama3_8b_attn_proj": "1m", "llama3_70b_attn_proj": "1m"}
    assert {r["block"]: r["fused"] for r in rows} == {b: f"{n}/{n}" for b, n in offered.items()}
    assert "| llama3_70b_attn_proj | 4 | 1m/1m |" in out


def test_json_keeps_the_rounds_behind_each_median_and_ratio(bench, tmp_path):
    import json
    import statistics

    path = tmp_path / "rows.json"
    rows = bench.main(["--dry-run", "--blocks", "gpt2_attn_proj", "--m", "4", "--json", str(path)])
    saved = json.loads(path.read_text())
    assert saved["argv"][-2:] == ["--json", str(path)] and len(saved["rows"]) == len(rows) == 1
    (row,) = saved["rows"]
    assert (row["block"], row["m"], row["fused"]) == ("gpt2_attn_proj", 4, "1/1")
    for column in ("module_eager", "unrewritten_eager", "rewritten_eager"):
        assert row[column] == statistics.median(row["rounds"][column])
    (name,) = [t[0] for t in bench.TARGETS if t[1] == "unrewritten_eager"]
    per_round = row["round_ratios"][name]
    assert len(per_round) == len(row["rounds"]["rewritten_eager"])
    assert row["ratios"][name] == statistics.median(per_round)
    assert "eager rewrite:" in row["explain"]


def test_no_merge_keeps_the_qkv_gemms_apart(bench):
    rows = bench.main(["--dry-run", "--blocks", "llama3_8b_attn_proj", "--m", "4", "--no-merge"])
    assert [r["fused"] for r in rows] == ["1/1"]


def test_the_rewrite_fuses_what_the_blocks_offer(bench):
    """The blocks are the shapes the issue names, and the pass fuses their chains:
    GPT-2's MLP twice (bias+gelu_tanh, bias+residual), Llama's gate+silu and the
    down projection's residual, each attention block's output projection."""
    import torch

    import branchyard.lowering.nvgemm as nvgemm

    full = bench.blocks()
    assert {n: b.d for n, b in full.items()} == {
        "gpt2_mlp": 768, "gpt2_attn_proj": 768, "llama3_8b_mlp": 4096, "llama3_8b_attn_proj": 4096,
        "llama3_70b_mlp": 8192, "llama3_70b_attn_proj": 8192}
    fused = {}
    for name, spec in bench.blocks(tiny=True).items():
        block = spec.make().eval()
        args = tuple(torch.randn(4, spec.d) for _ in range(2 if spec.two_inputs else 1))
        gm = nvgemm(torch.export.export(block, args)).graph
        fused[name] = sorted(n.args[3].split(";", 1)[1] for n in gm.nodes
                             if n.target is torch.ops.branchyard.fused_gemm_epilogue.default)
    assert fused["gpt2_mlp"] == ["bias@0;gelu_tanh;out=float32", "bias@0;residual@1;out=float32"]
    assert fused["llama3_8b_mlp"] == ["residual@0;out=float32", "silu;mul_mm@0;out=float32"]
    assert fused["llama3_8b_attn_proj"] == ["residual@0;out=float32"]
    assert fused["gpt2_attn_proj"] == ["bias@0;residual@1;out=float32"]


def test_targets_are_judged_from_time_ratios(bench):
    row = {"block": "b", "m": 1, "unrewritten_eager": 10.0, "rewritten_eager": 8.0,
           "unrewritten_graph": 5.0, "rewritten_graph": 5.5, "compile_graph": 5.0}
    got = bench.ratios(row)
    assert got["rewritten >= 1.00x unrewritten (eager)"] == pytest.approx(1.25)
    assert got["rewritten >= 1.00x unrewritten (graph)"] == pytest.approx(5 / 5.5)
    text = bench.report([row], markdown=False)
    assert "1.25x PASS" in text and "0.91x FAIL" in text
    assert "target rewritten >= 0.98x compile (graph): 0/1 rows pass" in text


def test_a_ratio_that_rounds_onto_its_floor_shows_a_third_decimal(bench):
    row = {"block": "b", "m": 64, "unrewritten_eager": 10.0, "rewritten_eager": 10.0,
           "unrewritten_graph": 10.0, "rewritten_graph": 10.0, "compile_graph": 9.77}
    text = bench.report([row], markdown=True)
    assert "| 1.00x PASS | 1.00x PASS | 0.977x FAIL |" in text
    assert "target rewritten >= 0.98x compile (graph): 0/1 rows pass (0 the same program), worst 0.977x" in text
    assert bench.ratio_text(0.9849, 0.98) == "0.985x"  # rounds onto the floor: passes, shown as such
    assert bench.ratio_text(0.98, 0.98) == "0.98x" and bench.ratio_text(1.034, 1.0) == "1.03x"


def test_a_row_whose_race_kept_the_program_is_judged_the_same_program(bench):
    row = {"block": "b", "m": 1, "unrewritten_eager": 10.0, "rewritten_eager": 10.6,
           "unrewritten_graph": 5.0, "rewritten_graph": 5.5, "same": {"eager"}}
    text = bench.report([row], markdown=True)
    assert "| 0.94x SAME | 0.91x FAIL |" in text
    assert "target rewritten >= 1.00x unrewritten (eager): 1/1 rows pass (1 the same program) -> PASS" in text
    assert "target rewritten >= 1.00x unrewritten (graph): 0/1 rows pass (0 the same program), worst 0.91x" in text


def test_the_same_program_is_recognised_from_the_graphs(bench, monkeypatch):
    from branchyard.lowering.nvgemm import fuse
    from branchyard.lowering.nvgemm.program_race import ProgramRace

    # on CPU no race runs: every rewritten program differs from its unrewritten one
    rows = bench.main(["--dry-run", "--blocks", "gpt2_mlp", "--m", "1"])
    assert rows[0]["same"] == set() and rows[0]["fused"] == "2/2"
    # a race (on CPU, by a timer under which every fused op loses) keeps both programs as they were
    monkeypatch.setattr(fuse, "ProgramRace", lambda: ProgramRace(
        timer=lambda v: 1.0 + len(v.fused), devices=("cpu",), blocks=1,
        capture=lambda gm, inputs: (lambda: gm(*inputs))))
    rows = bench.main(["--dry-run", "--blocks", "gpt2_mlp", "--m", "1"])
    assert rows[0]["same"] == {"eager", "graph"} and rows[0]["fused"] == "0/0"


def test_columns_are_timed_side_by_side(bench):
    import torch

    order: list[str] = []
    time_us = bench._timer(torch.device("cpu"), iters=2, repeats=3)
    result = time_us({"a": lambda: order.append("a"), "b": lambda: order.append("b")})
    # a's block and b's block in each repeat, the first of them alternating between repeats
    assert order == ["a", "a", "b", "b", "b", "b", "a", "a", "a", "a", "b", "b"]
    assert set(result) == {"a", "b"} and all(len(v) == 3 and min(v) >= 0 for v in result.values())


def test_graph_columns_are_timed_interleaved_call_by_call_with_the_order_rotating(bench, monkeypatch):
    import torch

    windows: list[list[str]] = []
    fns = {name: (lambda: None) for name in "abc"}
    names = {id(f): n for n, f in fns.items()}

    def interleaved(run, warmup, reps, max_ms):
        windows.append([names[id(f)] for f in run])
        assert reps == 4  # --iters calls of each per round
        return [{"a": 0.001, "b": 0.002, "c": 0.004}[names[id(f)]] for f in run]

    monkeypatch.setattr(bench, "device_interleaved_timer", interleaved)
    result = bench._timer(torch.device("cuda"), iters=4, repeats=3)(fns, interleave=True)
    assert windows == [["a", "b", "c"], ["a", "c", "b"], ["c", "a", "b"]]  # timing.round_order
    assert result == {"a": [1.0] * 3, "b": [2.0] * 3, "c": [4.0] * 3}


def test_a_targets_ratio_is_the_median_of_its_round_by_round_ratios(bench):
    # rounds 2x, 2x, 1x: the median round says 2x; the columns' medians (3.0 over 2.0) would say 1.5x
    rounds = {"unrewritten_eager": [2.0, 4.0, 3.0], "rewritten_eager": [1.0, 2.0, 3.0]}
    row = {"unrewritten_eager": 3.0, "rewritten_eager": 2.0, "rounds": rounds}
    assert bench.ratios(row)["rewritten >= 1.00x unrewritten (eager)"] == 2.0
    assert bench.ratios({"unrewritten_eager": 3.0, "rewritten_eager": 2.0})[
        "rewritten >= 1.00x unrewritten (eager)"] == 1.5


def test_a_flush_runs_before_every_call_and_is_not_timed(bench):
    import time

    import torch

    order: list[str] = []

    def flush():
        order.append("flush")
        time.sleep(0.002)

    time_us = bench._timer(torch.device("cpu"), iters=3, repeats=2)
    result = time_us({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, flush=flush)
    assert order == ["flush", "a"] * 3 + ["flush", "b"] * 3 + ["flush", "b"] * 3 + ["flush", "a"] * 3
    assert all(max(v) < 1000 for v in result.values()), result  # 2 ms of flush per call would be 2000 us


def test_cold_l2_is_an_option_of_the_run(bench):
    rows = bench.main(["--dry-run", "--cold-l2", "--blocks", "gpt2_mlp", "--m", "1"])
    assert [(r["block"], r["m"]) for r in rows] == [("gpt2_mlp", 1)]


def test_explain_prints_each_rewrites_report_under_its_row(bench, capsys):
    rows = bench.main(["--dry-run", "--blocks", "llama3_8b_mlp", "--m", "1", "--explain"])
    out = capsys.readouterr().out
    (row,) = rows
    head = next(line for line in out.splitlines() if line.startswith("llama3_8b_mlp "))
    after = out.split(head, 1)[1]
    assert after.lstrip("\n").startswith("eager rewrite: nvgemm: modified")
    assert "graph rewrite: nvgemm: modified" in after
    # on CPU the race does not run, and the reports say so; the op tunes nothing there
    assert after.count("race: not raced: the program runs on cpu") == 2, after
    # at M = 1 the residual x is [1, N]: a row added to every row, read as a bias
    assert "specs: ['w=nk;silu;mul_mm@0;out=float32', 'w=nk;bias@0;out=float32']" in after
    assert "tuned" not in row["explain"]
