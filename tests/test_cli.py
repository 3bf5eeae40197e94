"""``python -m branchyard``: commands, output, exit codes and error lines.

Most cases call :func:`branchyard.cli.main` in-process (a fresh Python with
torch costs seconds); two run the real ``python -m branchyard``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import branchyard.serialization as bs
from branchyard.cli import main
from branchyard.examples import example_inputs, ExpertDispatch
from branchyard.inspection import graph_stats


@pytest.fixture(scope="module")
def dispatch_pt2(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "dispatch.pt2"
    assert main(["example", "expert-dispatch", "-o", str(path), "--size", "4", "--dim", "8"]) == 0
    return path


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("branchyard: error: ")
    assert "Traceback" not in err
    return lines[0]


def test_passes_lists_registered_passes(capsys):
    assert main(["passes"]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert {"cond_to_switch", "switch_to_cond"} <= set(names)


def test_example_writes_a_loadable_program(dispatch_pt2, capsys):
    program = bs.load(dispatch_pt2)
    assert graph_stats(program).control_flow["cond"] == 3
    module = ExpertDispatch(4, dim=8)
    x, _ = example_inputs(module)
    with torch.no_grad():
        for i in range(4):
            torch.testing.assert_close(program.module()(x, torch.tensor(i)), module.experts[i](x))


def test_example_cond_tree_size_is_depth(tmp_path, capsys):
    out = tmp_path / "tree.pt2"
    assert main(["example", "cond-tree", "-o", str(out), "--size", "2", "--dim", "4"]) == 0
    assert "cond-tree (depth=2, dim=4)" in capsys.readouterr().out
    assert graph_stats(bs.load(out)).control_flow["cond"] == 3


def test_inspect_text(dispatch_pt2, capsys):
    assert main(["inspect", str(dispatch_pt2)]) == 0
    out = capsys.readouterr().out
    assert "control flow: 3 cond, 0 switch, 0 while_loop" in out
    assert "depth 3, 3 conds, 4 leaves (4 distinct), idx == k dispatch chain" in out
    assert "-> cond_to_switch: 3 conds -> 1 switch over 4 branches" in out
    assert "matmul+epilogue chains (4):" in out


def test_inspect_json(dispatch_pt2, capsys):
    assert main(["inspect", str(dispatch_pt2), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["program"] == str(dispatch_pt2)
    assert data["stats"]["control_flow"]["cond"] == 3
    (tree,) = data["cond_trees"]
    assert (tree["depth"], tree["leaves"], tree["dispatch_chain"]) == (3, 4, True)
    assert "x" in tree["duplicated_operands"]


def test_rewrite_cond_to_switch(dispatch_pt2, tmp_path, capsys):
    out = tmp_path / "switch.pt2"
    assert main(["rewrite", str(dispatch_pt2), "-o", str(out), "--passes", "cond_to_switch"]) == 0
    text = capsys.readouterr().out
    assert "(cond_to_switch: modified)" in text
    rows = {line[:22].strip(): line[22:].split() for line in text.splitlines()[2:10]}
    assert rows["cond"] == ["3", "0"] and rows["switch"] == ["0", "1"]
    assert rows["subgraphs"] == ["6", "4"]
    assert "conds_removed: 3" in text
    rewritten = bs.load(out)
    assert graph_stats(rewritten).control_flow == {"cond": 0, "switch": 1, "while_loop": 0}
    before = bs.load(dispatch_pt2)
    x, _ = example_inputs(ExpertDispatch(4, dim=8))
    with torch.no_grad():
        for i in range(-1, 6):
            idx = torch.tensor(i)
            torch.testing.assert_close(rewritten.module()(x, idx), before.module()(x, idx))


def test_rewrite_round_trip_through_two_passes(dispatch_pt2, tmp_path, capsys):
    out = tmp_path / "round.pt2"
    assert main(["rewrite", str(dispatch_pt2), "-o", str(out), "--passes", "cond_to_switch, switch_to_cond"]) == 0
    stats = graph_stats(bs.load(out))
    assert stats.control_flow["switch"] == 0 and stats.control_flow["cond"] == 3


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["rewrite", "{missing}", "-o", "{out}", "--passes", "cond_to_switch"], "missing.pt2': no such file"),
        (["inspect", "{missing}"], "missing.pt2': no such file"),
        (["inspect", "{text}"], "not a readable .pt2 archive"),
        (["rewrite", "{good}", "-o", "{out}", "--passes", "cond_to_swich"],
         "unknown pass 'cond_to_swich'; known passes: cond_to_switch"),
        (["rewrite", "{good}", "-o", "{out}", "--passes", " , "], "--passes is empty"),
        (["rewrite", "{good}", "-o", "{nodir}", "--passes", "cond_to_switch"], "output folder does not exist"),
        (["example", "expert-dispatch", "-o", "{out}", "--size", "1"], "needs experts >= 2, got 1"),
    ],
)
def test_bad_input_is_one_line_and_exit_1(argv, message, dispatch_pt2, tmp_path, capsys):
    (tmp_path / "notes.pt2").write_text("not a zip")
    paths = {
        "missing": str(tmp_path / "missing.pt2"),
        "out": str(tmp_path / "out.pt2"),
        "text": str(tmp_path / "notes.pt2"),
        "good": str(dispatch_pt2),
        "nodir": str(tmp_path / "no" / "such" / "out.pt2"),
    }
    assert main([a.format(**paths) for a in argv]) == 1
    captured = capsys.readouterr()
    assert message in _one_error_line(captured.err)
    assert captured.out == ""
    assert not (tmp_path / "out.pt2").exists()


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["rewrite", "in.pt2", "--passes", "cond_to_switch"])  # no -o
    assert exc.value.code == 2
    assert "the following arguments are required: -o/--output" in capsys.readouterr().err


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "branchyard", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_python_m_branchyard_example_then_rewrite(tmp_path):
    """The README's command, as a real process."""
    done = _run("example", "expert-dispatch", "-o", "dispatch.pt2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    done = _run("rewrite", "dispatch.pt2", "-o", "dispatch-switch.pt2", "--passes", "cond_to_switch", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "(cond_to_switch: modified)" in done.stdout
    assert graph_stats(bs.load(tmp_path / "dispatch-switch.pt2")).control_flow["switch"] == 1


def test_python_m_branchyard_bad_path_has_no_traceback(tmp_path):
    done = _run("rewrite", "nope.pt2", "-o", "out.pt2", "--passes", "cond_to_switch", cwd=tmp_path)
    assert done.returncode == 1
    assert "nope.pt2': no such file" in _one_error_line(done.stderr)
