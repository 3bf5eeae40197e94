"""``python -m branchyard``: commands, output, exit codes and error lines.

Most cases call :func:`branchyard.cli.main` in-process (a fresh Python with
torch costs seconds); two run the real ``python -m branchyard``.
"""

from __future__ import annotations

import json
import re
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
    names = [line.split()[0] for line in capsys.readouterr().out.split("\n\n")[0].splitlines()]
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
    rows = {line[:25].strip(): line[25:].split() for line in text.splitlines()[2:12]}
    assert rows["cond"] == ["3", "0"] and rows["switch"] == ["0", "1"]
    assert rows["subgraphs"] == ["6", "4"]
    assert "conds removed: 3" in text
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
        (["example", "expert-dispatch", "-o", "{out}", "--size", "600"],
         "is built up to experts = 32 (32 experts), got 600"),
        (["example", "expert-dispatch", "-o", "{out}", "--size", "41"],
         "is built up to experts = 32 (32 experts), got 41"),
        (["example", "cond-tree", "-o", "{out}/"], "the output names a folder, not a file"),
        (["rewrite", "{good}", "-o", "{out}/", "--passes", "cond_to_switch"], "the output names a folder, not a file"),
        (["example", "cond-tree", "-o", "{loop}"], "cannot resolve the output path"),
        (["rewrite", "{good}", "-o", "{loop}", "--passes", "cond_to_switch"], "cannot resolve the output path"),
        (["example", "cond-tree", "-o", "{out}", "--size", "40"], "is built up to depth = 8 (256 experts), got 40"),
    ],
)
def test_bad_input_is_one_line_and_exit_1(argv, message, dispatch_pt2, tmp_path, capsys):
    (tmp_path / "notes.pt2").write_text("not a zip")
    (tmp_path / "loop_a").symlink_to(tmp_path / "loop_b")
    (tmp_path / "loop_b").symlink_to(tmp_path / "loop_a")
    paths = {
        "loop": str(tmp_path / "loop_a"),
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
    assert main(["rewrite", "in.pt2", "--passes", "cond_to_switch"]) == 2  # no -o
    assert "the following arguments are required: -o/--output" in capsys.readouterr().err


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    # The checkout under test, not whichever branchyard is installed.
    root = str(Path(bs.__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
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


# -- the first hour: version, pipes, sizes, words, logging ----------------------------------------


def test_help_returns_0_in_process(capsys):
    assert main(["--help"]) == 0
    assert main(["rewrite", "--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: branchyard" in out and "--passes" in out


def test_version(capsys):
    from branchyard import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"branchyard {__version__}"


class _ClosedPipe:
    """A stdout whose reader has gone away."""

    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        raise BrokenPipeError(32, "Broken pipe")

    def fileno(self):
        raise ValueError("no file")


def test_a_closed_pipe_ends_quietly_with_sigpipes_status(dispatch_pt2, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    assert main(["inspect", str(dispatch_pt2)]) == 141
    assert capsys.readouterr().err == ""


def test_python_m_branchyard_inspect_into_a_closed_pipe(dispatch_pt2, tmp_path):
    """`inspect FILE | head`: the reader is gone before the first line is written."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-m", "branchyard", "inspect", str(dispatch_pt2)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141
    assert "Broken pipe" not in err and "Traceback" not in err, err


@pytest.mark.parametrize("flag", ["--dim", "--size"])
@pytest.mark.parametrize("value", ["0", "-3"])
def test_example_refuses_an_empty_size(flag, value, tmp_path, capsys):
    out = tmp_path / "x.pt2"
    assert main(["example", "cond-tree", "-o", str(out), flag, value]) == 2
    assert f"argument {flag}: must be at least 1, got {value}" in capsys.readouterr().err
    assert not out.exists()


def test_rewrite_report_is_in_words_and_skips_are_counted_once(dispatch_pt2, tmp_path, capsys):
    out = tmp_path / "all.pt2"
    assert main(["rewrite", str(dispatch_pt2), "-o", str(out), "--passes", "cond_to_switch,nvgemm"]) == 0
    text = capsys.readouterr().out
    assert "switches indexed by the dispatch value itself (idx == k chains): 1" in text
    for raw in ("dispatch_index", "general_index", "specs: []", "conds_removed"):
        assert raw not in text
    assert "matmuls left as they are: 4" in text
    (skip,) = [line for line in text.splitlines() if "its addmm or linear already applies" in line]
    # one node name in four branches: four places (each branch names its nodes afresh)
    assert skip.startswith("  4 skips at 4 different places")
    assert "inputs of the program" in text and "placeholders, all graphs" in text


def test_inspect_says_which_placeholders_it_counts_and_groups_alike_chains(dispatch_pt2, capsys):
    assert main(["inspect", str(dispatch_pt2)]) == 0
    out = capsys.readouterr().out
    assert "program: 10 inputs (parameters and buffers included); 6 subgraphs; all graphs together:" in out
    assert "4 chains (linear_default in 4 graphs): bias" in out
    assert out.count("nvgemm declines") == 1


def test_passes_prints_plain_text(capsys):
    assert main(["passes"]) == 0
    out = capsys.readouterr().out
    assert "``" not in out and ":class:" not in out and "module docstring" not in out
    assert "Fuse matmul + epilogue chains into branchyard.fused_gemm_epilogue." in out


def test_verbose_shows_the_branchyard_logger_with_each_step(dispatch_pt2, tmp_path, capsys):
    out = tmp_path / "v.pt2"
    assert main(["-v", "rewrite", str(dispatch_pt2), "-o", str(out), "--passes", "cond_to_switch"]) == 0
    err = capsys.readouterr().err
    for step in ("load", "save"):
        assert re.search(rf"^branchyard: {step}: done in \d+\.\d s$", err, re.M), err
    assert re.search(r"^branchyard: cond_to_switch: modified in \d+\.\d\d s$", err, re.M), err
    assert main(["rewrite", str(dispatch_pt2), "-o", str(out), "--passes", "cond_to_switch"]) == 0
    assert capsys.readouterr().err == ""  # quiet without -v


def test_rewrite_gives_nvgemm_the_programs_own_values_to_race_with(dispatch_pt2, tmp_path, monkeypatch, capsys):
    from branchyard.cli import load_program
    from branchyard.lowering.nvgemm import NvGemmPass

    bound = []
    real = NvGemmPass.bind_inputs
    monkeypatch.setattr(NvGemmPass, "bind_inputs", lambda self, program: bound.append(program) or real(self, program))
    out = tmp_path / "out.pt2"
    assert main(["rewrite", str(dispatch_pt2), "-o", str(out), "--passes", "cond_to_switch,nvgemm"]) == 0
    (program,) = bound
    loaded = load_program(dispatch_pt2, trusted=True)
    assert [n.name for n in program.graph.nodes if n.op == "placeholder"] == [
        n.name for n in loaded.graph.nodes if n.op == "placeholder"]
    assert "race" in capsys.readouterr().out  # a CPU program: the report says why it was not raced


def test_rewrite_shows_a_progress_bar_on_a_terminal(dispatch_pt2, tmp_path, monkeypatch, capsys):
    import io

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    assert main(["rewrite", str(dispatch_pt2), "-o", str(tmp_path / "p.pt2"), "--passes", "cond_to_switch"]) == 0
    assert "3/3" in term.getvalue() and "step" in term.getvalue()


def test_inspect_logs_its_steps_with_v(dispatch_pt2, capsys):
    assert main(["-v", "inspect", str(dispatch_pt2)]) == 0
    err = capsys.readouterr().err
    assert re.search(r"^branchyard: load: done in \d+\.\d s$", err, re.M), err
    assert re.search(r"^branchyard: inspect: done in \d+\.\d s$", err, re.M), err


def test_the_largest_example_writes_and_flattens(tmp_path, capsys):
    out, flat = tmp_path / "e.pt2", tmp_path / "s.pt2"
    assert main(["example", "expert-dispatch", "-o", str(out), "--size", "32", "--dim", "4"]) == 0
    assert main(["rewrite", str(out), "-o", str(flat), "--passes", "cond_to_switch"]) == 0
    assert graph_stats(bs.load(flat)).control_flow == {"cond": 0, "switch": 1, "while_loop": 0}


def test_example_refuses_a_dim_that_would_make_gigabytes(tmp_path, capsys):
    assert main(["example", "expert-dispatch", "-o", str(tmp_path / "x.pt2"), "--dim", "100000000"]) == 2
    assert "argument --dim: must be at most 4096, got 100000000" in capsys.readouterr().err


def test_a_trailing_separator_never_replaces_the_file_it_would_name(dispatch_pt2, tmp_path, capsys):
    keep = tmp_path / "keep.pt2"
    keep.write_bytes(dispatch_pt2.read_bytes())
    assert main(["example", "cond-tree", "-o", str(keep) + "/"]) == 1
    assert keep.read_bytes() == dispatch_pt2.read_bytes()


def test_what_rewrite_nvgemm_writes_the_cli_reads_back(tmp_path):
    """A fresh process that never ran nvgemm reads a program that calls the fused op."""
    torch.export.save(torch.export.export(_Mlp(), (torch.randn(4, 8),)), tmp_path / "mlp.pt2")
    done = _run("rewrite", "mlp.pt2", "-o", "fused.pt2", "--passes", "nvgemm", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "(nvgemm: modified)" in done.stdout
    done = _run("inspect", "fused.pt2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    done = _run("rewrite", "fused.pt2", "-o", "again.pt2", "--passes", "cond_to_switch", cwd=tmp_path)
    assert done.returncode == 0, done.stderr


class _Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))
