"""Temporary folders a killed process left next to a saved program or a
kernel cache entry are removed by the next process that makes one there."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

import branchyard
from branchyard import _owned_tempdirs as owned


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _folder(parent, prefix: str, host: str, pid: int) -> str:
    path = parent / f"{prefix}{host}-{pid}-abc123.tmp"
    path.mkdir()
    (path / "half.pt2").write_bytes(b"PK half")
    return path.name


def test_sweep_removes_only_dead_processes_of_this_host(tmp_path):
    dead = _folder(tmp_path, ".by-", owned._HOST, _dead_pid())
    kept = {
        _folder(tmp_path, ".by-", owned._HOST, os.getppid()),       # alive
        _folder(tmp_path, ".by-", owned._HOST, os.getpid()),        # this process
        _folder(tmp_path, ".by-", "0123abcd", _dead_pid()),         # another host's
        _folder(tmp_path, ".build-", owned._HOST, _dead_pid()),     # another prefix
    }
    (tmp_path / f".by-{owned._HOST}-{_dead_pid()}-file.tmp").write_text("a file, not a folder")
    (tmp_path / "model.pt2").write_text("the user's")
    assert owned.sweep(tmp_path, ".by-") == [dead]
    assert kept <= {p.name for p in tmp_path.iterdir()} and not (tmp_path / dead).exists()
    assert (tmp_path / "model.pt2").read_text() == "the user's"


def test_a_save_removes_what_a_killed_save_left(tmp_path):
    left = _folder(tmp_path, ".by-", owned._HOST, _dead_pid())
    ep = torch.export.export(torch.nn.Linear(2, 2), (torch.zeros(1, 2),))
    branchyard.save(ep, tmp_path / "model.pt2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt2"], left


def test_a_kernel_build_removes_what_a_killed_build_left(tmp_path):
    from branchyard.lowering.nvgemm.kernel_cache import KernelCache

    cache = KernelCache(tmp_path, env={"gpu": "test"})
    cache.root.mkdir(parents=True, exist_ok=True)
    left = _folder(cache.root, ".build-", owned._HOST, _dead_pid())

    def build(d):
        (d / "kernel.o").write_bytes(b"x")

    assert cache.get_or_build({"k": 1}, build, lambda d: (d / "kernel.o").read_bytes()) == b"x"
    assert not (cache.root / left).exists()
    assert [p.name for p in cache.root.iterdir() if p.name.startswith(".")] == []
