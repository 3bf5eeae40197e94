"""tools/device/plan.sh and watch.sh, which run a GPU session's steps from one
detached script: run here on the CPU with small steps and temporary folders."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools" / "device"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("setsid") is None,
                                reason="needs bash and setsid")


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, PLAN_LOGS=str(tmp_path / "logs"), PLAN_TREE=str(tmp_path / "tree"),
               PLAN_CACHES=str(tmp_path / "caches"), OUT=str(tmp_path / "out"))
    env.update(extra)
    (tmp_path / "out").mkdir(exist_ok=True)
    return env


def _plan(tmp_path: Path, steps: str, **extra: str) -> subprocess.CompletedProcess:
    root = tmp_path / "checkout"
    (root / ".device" / "env").mkdir(parents=True, exist_ok=True)
    (root / ".device" / "env" / "commit.txt").write_text("abc1234\n")
    (root / "marker.txt").write_text("from the checkout")
    (tmp_path / "steps.txt").write_text(steps)
    return subprocess.run(["bash", str(TOOLS / "plan.sh"), str(tmp_path / "steps.txt")], cwd=root,
                          env=_env(tmp_path, **extra), capture_output=True, text=True, timeout=60)


def _wait_done(tmp_path: Path, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not (tmp_path / "logs" / "plan.done").exists():
        assert time.monotonic() < deadline, (tmp_path / "logs" / "progress.txt").read_text()
        time.sleep(0.2)


PY = sys.executable


def test_steps_run_in_the_copied_tree_in_order_with_their_env_and_limits(tmp_path):
    write = "import os, pathlib; pathlib.Path(os.environ['NAME'] + '.out').write_text(os.environ['BRANCHYARD_CACHE_DIR'])"
    steps = f"""# a comment, then a blank line

first 2.11 20 NAME=first -- {PY} -c "{write}"
&left 2.11 20 NAME=left -- {PY} -c "import time; time.sleep(0.5); {write}"
&right 2.14.1 20 NAME=right -- {PY} -c "{write}"
after 2.11 20 -- {PY} -c "import pathlib; assert pathlib.Path('left.out').exists() and pathlib.Path('right.out').exists()"
slow 2.11 1 -- sleep 5
"""
    done = _plan(tmp_path, steps)
    assert done.returncode == 0, done.stderr
    assert "plan started: 5 steps" in done.stdout
    _wait_done(tmp_path)
    tree, logs = tmp_path / "tree", tmp_path / "logs"
    assert (tree / "marker.txt").read_text() == "from the checkout"
    assert (logs / "versions.txt").read_text().splitlines()[0] == "abc1234", "the commit the runs are of"
    assert not (tree / ".device").exists(), "the staging is not copied"
    for name in ("first", "left", "right"):
        assert (tree / f"{name}.out").read_text() == str(tmp_path / "caches" / name)
    rcs = {name: (logs / f"{name}.rc").read_text().strip() for name in ("first", "left", "right", "after", "slow")}
    assert rcs == {"first": "0", "left": "0", "right": "0", "after": "0", "slow": "124"}, rcs
    started = [line.split()[1] for line in (logs / "progress.txt").read_text().splitlines()]
    assert started[0] == "first" and set(started[1:3]) == {"left", "right"} and started[3:] == ["after", "slow", "done"]
    script = (logs / "plan.sh").read_text()
    assert script.count(") &") == 2 and script.count("\nwait\n") == 1
    assert "PYTHONPATH=/opt/bydev/torch:" in script.split("mark right")[1].splitlines()[0]
    assert "/opt/bydev/torch" not in script.split("mark left")[1].splitlines()[0]

    report = subprocess.run(["bash", str(TOOLS / "watch.sh"), "1"], env=_env(tmp_path), capture_output=True,
                            text=True, timeout=60)
    assert report.returncode == 0, report.stderr
    assert "== slow rc=124" in report.stdout and "== first rc=0" in report.stdout
    with tarfile.open(tmp_path / "out" / "logs.tgz") as packed:
        assert {"./progress.txt", "./slow.rc", "./versions.txt", "./steps.txt"} <= set(packed.getnames())


@pytest.mark.parametrize("line, said", [
    ("bad 2.12 20 -- true", "step bad: torch must be 2.14.1 or 2.11, not '2.12'"),
    ("bad 2.11 20 X=1 true", "step bad: no '--' before the command"),
    ("&bad 2.12 20 -- true", "step bad: torch must be 2.14.1 or 2.11, not '2.12'"),
])
def test_a_bad_step_stops_the_plan_before_anything_runs(tmp_path, line, said):
    done = _plan(tmp_path, f"good 2.11 20 -- true\n{line}\n")
    assert done.returncode != 0 and said in done.stderr, (done.returncode, done.stderr)
    assert not (tmp_path / "logs" / "progress.txt").exists()


def test_watch_on_a_machine_without_the_plan_says_so(tmp_path):
    report = subprocess.run(["bash", str(TOOLS / "watch.sh"), "1"], env=_env(tmp_path), capture_output=True,
                            text=True, timeout=60)
    assert report.returncode == 3 and "NO PROGRESS FILE" in report.stdout


def test_a_wait_line_ends_one_group_before_the_next_and_a_step_var_wins(tmp_path):
    write = "import os, pathlib; pathlib.Path(os.environ['NAME'] + '.out').write_text(os.environ['BRANCHYARD_CACHE_DIR'])"
    later = "import pathlib; assert pathlib.Path('a.out').exists() and pathlib.Path('b.out').exists(); " + write
    steps = f"""&a 2.11 20 NAME=a -- {PY} -c "import time; time.sleep(0.5); {write}"
&b 2.11 20 NAME=b -- {PY} -c "{write}"
  wait
&c 2.11 20 NAME=c BRANCHYARD_CACHE_DIR={tmp_path}/caches/a -- {PY} -c "{later}"
&d 2.11 20 NAME=d -- {PY} -c "{later}"
"""
    done = _plan(tmp_path, steps)
    assert done.returncode == 0, done.stderr
    assert "plan started: 4 steps" in done.stdout
    _wait_done(tmp_path)
    tree, logs = tmp_path / "tree", tmp_path / "logs"
    rcs = {name: (logs / f"{name}.rc").read_text().strip() for name in "abcd"}
    assert rcs == dict.fromkeys("abcd", "0"), rcs
    assert (tree / "c.out").read_text() == str(tmp_path / "caches" / "a"), "the step's own cache folder wins"
    assert (tree / "d.out").read_text() == str(tmp_path / "caches" / "d")
    assert (logs / "plan.sh").read_text().count("\nwait\n") == 2


def test_watch_packs_the_logs_while_it_waits(tmp_path):
    done = _plan(tmp_path, "long 2.11 30 -- sleep 20\n")
    assert done.returncode == 0, done.stderr
    watch = subprocess.Popen(["bash", str(TOOLS / "watch.sh"), "25"], env=_env(tmp_path, WATCH_PACK_S="1"),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        packed = tmp_path / "out" / "logs.tgz"
        deadline = time.monotonic() + 15
        while not packed.exists():
            assert time.monotonic() < deadline, "no logs packed while the plan runs"
            time.sleep(0.2)
        with tarfile.open(packed) as tar:
            assert "./progress.txt" in tar.getnames()
        assert watch.poll() is None, "packed while waiting, not at the end"
    finally:
        os.killpg(watch.pid, 9)
        watch.wait()
