"""The on-disk caches under concurrency and damage (issue 14 item 4).

Several processes hammer the same kernel-cache keys while entries are
damaged or stale between rounds: every call returns the right kernel, each
damaged entry is rebuilt by exactly one process (the others use the
winner's), and no temporary is left behind. The winner database keeps
every process's entries. Pathological files are rebuilt, never raised; an
unwritable cache folder leaves the library running in memory."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import random
import time
from pathlib import Path

import pytest
import torch

from branchyard.lowering.nvgemm.candidates import Candidate
from branchyard.lowering.nvgemm.epilogue import EpilogueSpec, unfused_aten_epilogue
from branchyard.lowering.nvgemm.kernel_cache import MANIFEST, KernelCache
from branchyard.lowering.nvgemm.tuner import Autotuner
from branchyard.lowering.nvgemm.winners import SCHEMA_VERSION, WinnerDB

ENV = {"gpu": "FakeGPU sm90", "torch": "2.14", "cutedsl": "4.6"}
KEYS = [{"spec": f"chain{i}", "config": "t128x128"} for i in range(3)]
WORKERS = 6
ROUNDS = 6


def _payload(key) -> bytes:
    return f"cubin:{key['spec']}".encode() * 64


def _build(key):
    def build(d: Path) -> None:
        (d / "kernel.o").write_bytes(_payload(key))
        time.sleep(random.uniform(0, 0.004))  # widen the race windows
        (d / "kernel.json").write_text(json.dumps({"function": key["spec"]}))

    return build


def _load(d: Path) -> bytes:
    return (d / "kernel.o").read_bytes()


def _deep_json(path: Path) -> None:
    path.write_text("[" * 100_000 + "]" * 100_000)


#: Damage done between rounds (never during one: a cache cannot defend against
#: a file changed after it verified it).
DAMAGES = {
    "truncated-object": lambda e: (e / "kernel.o").write_bytes((e / "kernel.o").read_bytes()[:7]),
    "garbage-manifest": lambda e: (e / MANIFEST).write_bytes(os.urandom(64)),
    "deep-manifest": lambda e: _deep_json(e / MANIFEST),
    "manifest-is-a-directory": lambda e: ((e / MANIFEST).unlink(), (e / MANIFEST).mkdir()),
    "entry-is-a-file": lambda e: (__import__("shutil").rmtree(e), e.write_bytes(b"junk")),
    "stale-environment": lambda e: (e / MANIFEST).write_text(
        json.dumps({**json.loads((e / MANIFEST).read_text()), "env": {**ENV, "torch": "2.11"}})),
    "manifest-escapes-the-entry": lambda e: (e / MANIFEST).write_text(
        json.dumps({**json.loads((e / MANIFEST).read_text()), "files": {"../../x": "0" * 64}})),
    "removed": lambda e: __import__("shutil").rmtree(e),
}


def _worker(root: str, worker: int, barrier, results) -> None:
    try:
        _hammer(root, worker, barrier, results)
    except __import__("threading").BrokenBarrierError:  # the parent gave up; it reports why
        pass


def _hammer(root: str, worker: int, barrier, results) -> None:
    errors, stats, puts = [], {"hits": 0, "builds": 0, "rebuilt": 0}, []
    db = WinnerDB(Path(root) / "db")
    for rnd in range(ROUNDS):
        barrier.wait(timeout=30)  # the damage of this round is done
        for key in random.Random(worker * 100 + rnd).sample(KEYS, len(KEYS)):
            cache = KernelCache(root, env=ENV)  # this process's view, no memory of earlier rounds
            try:
                got = cache.get_or_build(key, _build(key), _load)
                if got != _payload(key):
                    errors.append(f"round {rnd} {key['spec']}: wrong kernel {got[:20]!r}")
            except Exception as exc:  # noqa: BLE001 -- every failure is the finding
                errors.append(f"round {rnd} {key['spec']}: {type(exc).__name__}: {exc}")
            for k, v in cache.stats.items():
                stats[k] += v
        name = f"w{worker}r{rnd}"
        try:
            db.put(name, {"winner": name})
            puts.append(name)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"winner db put {name}: {type(exc).__name__}: {exc}")
        barrier.wait(timeout=30)  # round done; the parent damages the next one
    results.put((worker, errors, stats, puts))


def test_processes_hammering_the_same_keys_through_damage_and_staleness(tmp_path):
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(WORKERS + 1)
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(str(tmp_path), w, barrier, results)) for w in range(WORKERS)]
    for p in procs:
        p.start()
    damaged_total = 0
    names = sorted(DAMAGES)
    try:
        for rnd in range(ROUNDS):
            if rnd:  # round 0 builds from nothing
                for i, key in enumerate(KEYS):
                    cache = KernelCache(tmp_path, env=ENV)
                    assert cache.check(key) is None, f"round {rnd - 1} left {key} damaged: {cache.check(key)}"
                    DAMAGES[names[(rnd * len(KEYS) + i) % len(names)]](cache.path(key))
                    damaged_total += 1
            barrier.wait(timeout=30)
            barrier.wait(timeout=30)
        found = [results.get(timeout=30) for _ in procs]
    except BaseException:
        barrier.abort()  # the workers stop waiting
        raise
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    errors = [e for _, errs, _, _ in found for e in errs]
    assert errors == []
    builds = sum(s["builds"] for _, _, s, _ in found)
    hits = sum(s["hits"] for _, _, s, _ in found)
    # One build per key from nothing, one per damaged entry: every loser of a race used the winner's entry.
    assert builds == len(KEYS) + damaged_total, (builds, damaged_total)
    assert hits == WORKERS * ROUNDS * len(KEYS) - builds
    leftovers = [p.name for p in (tmp_path / "kernels").iterdir() if p.name.startswith(".")]
    assert leftovers == []
    cache = KernelCache(tmp_path, env=ENV)
    assert all(cache.check(k) is None for k in KEYS)
    puts = sorted(n for _, _, _, ps in found for n in ps)
    assert sorted(WinnerDB(tmp_path / "db").entries()) == puts and len(puts) == WORKERS * ROUNDS


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_kernel_entry_is_rebuilt_not_raised(tmp_path, damage, caplog):
    key = KEYS[0]
    KernelCache(tmp_path, env=ENV).get_or_build(key, _build(key), _load)
    cache = KernelCache(tmp_path, env=ENV)
    DAMAGES[damage](cache.path(key))
    assert cache.check(key) is not None
    with caplog.at_level(logging.WARNING, logger="branchyard"):
        assert cache.get_or_build(key, _build(key), _load) == _payload(key)
    assert cache.stats["builds"] == 1 and cache.check(key) is None
    assert (cache.stats["rebuilt"] == 1) == (damage != "removed")


def _winner_db_damages(path: Path) -> dict:
    return {
        "deep-json": lambda: _deep_json(path),
        "directory": lambda: (path.unlink(), path.mkdir(), (path / "x").write_text("1")),
        "truncated": lambda: path.write_text(path.read_text()[: len(path.read_text()) // 2]),
        "binary-garbage": lambda: path.write_bytes(os.urandom(256)),
        "not-an-object": lambda: path.write_text("[1, 2, 3]"),
        "entries-not-an-object": lambda: path.write_text(json.dumps({"schema": SCHEMA_VERSION, "entries": [1]})),
        "winner-not-a-string": lambda: path.write_text(json.dumps(
            {"schema": SCHEMA_VERSION, "entries": {k: {**e, "winner": 7} for k, e in
                                                    json.loads(path.read_text())["entries"].items()}})),
    }


SPEC = EpilogueSpec.parse("w=kn;bias@0;relu;out=float32")


def _tuner(directory: Path, timed: list) -> Autotuner:
    def aten(p):
        return lambda a, b, ops, out: unfused_aten_epilogue(a @ b, p.spec, list(ops))

    def timer(name, fn):
        timed.append(name)
        return {"fast": 1.0, "slow": 2.0}[name]

    return Autotuner([Candidate("fast", aten), Candidate("slow", aten)], timer=timer,
                     db=WinnerDB(directory), env=ENV, progress=False)


def _args():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 32, generator=g), torch.randn(32, 16, generator=g), [torch.randn(16, generator=g)]


@pytest.mark.parametrize("damage", ["deep-json", "directory", "truncated", "binary-garbage", "not-an-object",
                                    "entries-not-an-object", "winner-not-a-string"])
def test_a_damaged_winner_database_is_rebuilt_not_raised(tmp_path, damage, caplog):
    _tuner(tmp_path, []).select(*_args(), SPEC)
    db_file = tmp_path / WinnerDB.FILE
    _winner_db_damages(db_file)[damage]()
    timed: list = []
    with caplog.at_level(logging.WARNING, logger="branchyard"):
        impl = _tuner(tmp_path, timed).select(*_args(), SPEC)
    assert timed == ["fast", "slow"], "the damaged entry was retuned"
    assert "damaged" in caplog.text or "not a schema" in caplog.text
    a, b, ops = _args()
    torch.testing.assert_close(impl(a, b, ops, torch.empty(8, 16)), torch.relu(a @ b + ops[0]))
    entries = json.loads(db_file.read_text())["entries"]
    assert [e["winner"] for e in entries.values()] == ["fast"]


def test_schema_versions_keep_their_own_files(tmp_path):
    old = tmp_path / "winners.json"  # schema 1's file
    old.write_text(json.dumps({"schema": 1, "entries": {"k1": {"winner": "x"}}}))
    newer = tmp_path / f"winners-v{SCHEMA_VERSION + 1}.json"
    newer.write_text(json.dumps({"schema": SCHEMA_VERSION + 1, "entries": {"k3": {}}}))
    before = (old.read_text(), newer.read_text())
    db = WinnerDB(tmp_path)
    db.put("k2", {"winner": "ours"})
    assert db.get("k2")["winner"] == "ours" and db.get("k1") is None
    assert (old.read_text(), newer.read_text()) == before


def test_an_unwritable_cache_folder_runs_in_memory_with_one_warning(tmp_path, caplog):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    timed: list = []
    tuner = _tuner(blocker / "nvgemm", timed)
    with caplog.at_level(logging.WARNING, logger="branchyard"):
        tuner.select(*_args(), SPEC)
        tuner.select(*_args(), SPEC)
        a, b, ops = _args()
        tuner.select(a[:3], b, ops, SPEC)  # another bucket: tuned, stored in memory, no second warning
    assert timed == ["fast", "slow", "fast", "slow"]
    warned = [r for r in caplog.records if "cannot write the winner database" in r.getMessage()]
    assert len(warned) == 1
    assert len(tuner.db.entries()) == 2
    cache = KernelCache(blocker / "nvgemm", env=ENV)
    with caplog.at_level(logging.WARNING, logger="branchyard"):
        for key in KEYS:
            assert cache.get_or_build(key, _build(key), _load) == _payload(key)
    assert sum("cannot write the kernel cache" in r.getMessage() for r in caplog.records) == 1
    assert cache.stats["builds"] == len(KEYS)


def test_the_default_winner_db_follows_a_changed_cache_dir(tmp_path, monkeypatch, caplog):
    """Without a folder of its own, the database is where BRANCHYARD_CACHE_DIR
    says at each use, and a folder that could not be written does not keep a
    later, writable one off the disk."""
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv("BRANCHYARD_CACHE_DIR", str(blocker))
    db = WinnerDB()
    with caplog.at_level(logging.WARNING, logger="branchyard"):
        db.put("k1", {"winner": "ours"})
    assert db.disk_error is not None and "cannot write the winner database" in caplog.text
    monkeypatch.setenv("BRANCHYARD_CACHE_DIR", str(tmp_path / "second"))
    assert db.disk_error is None and db.directory == tmp_path / "second" / "nvgemm"
    db.put("k2", {"winner": "cublas"})
    on_disk = json.loads((tmp_path / "second" / "nvgemm" / WinnerDB.FILE).read_text())["entries"]
    assert sorted(on_disk) == ["k2"]
    assert WinnerDB(tmp_path / "second" / "nvgemm").get("k2")["winner"] == "cublas"
    assert db.get("k1")["winner"] == "ours", "what this process tuned stays known"


def _stray_race_worker(root: str, worker: int, barrier, results) -> None:
    barrier.wait(timeout=30)
    cache = KernelCache(root, env=ENV)
    keys = [{"spec": f"w{worker}k{i}", "config": "t128x128"} for i in range(4)]
    got = [cache.get_or_build(key, _build(key), _load) == _payload(key) for key in keys]
    results.put((worker, all(got), cache.disk_error))


@pytest.mark.parametrize("stray", ["kernels", ".locks"])
def test_processes_that_find_a_stray_file_at_once_all_keep_the_disk(tmp_path, stray):
    """Several processes find a file where a cache folder should be, at once:
    whoever removes it, every process writes its kernels to disk, and none
    removes a folder another made in its place (the repair unlinks, never
    removes a tree)."""
    ctx = multiprocessing.get_context("fork")
    (tmp_path / stray).write_text("stray")
    barrier, results = ctx.Barrier(WORKERS), ctx.Queue()
    procs = [ctx.Process(target=_stray_race_worker, args=(str(tmp_path), w, barrier, results)) for w in range(WORKERS)]
    for p in procs:
        p.start()
    outcome = sorted(results.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert outcome == [(w, True, None) for w in range(WORKERS)]
    cache = KernelCache(tmp_path, env=ENV)
    for w in range(WORKERS):
        for i in range(4):
            assert cache.check({"spec": f"w{w}k{i}", "config": "t128x128"}) is None, (w, i)


@pytest.mark.parametrize("link", ["to-a-file", "dangling", "to-a-folder"])
def test_a_link_at_the_lock_path_is_replaced_and_its_target_left_alone(tmp_path, link, caplog):
    """A symlink where the winner database's lock file goes used to keep the
    disk off for every process (filelock refuses links); it is now unlinked,
    and what it pointed at is never opened, truncated or removed."""
    where = tmp_path / "nvgemm"
    where.mkdir()
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    folder = tmp_path / "folder"
    (folder / "inside").mkdir(parents=True)
    target = {"to-a-file": precious, "dangling": tmp_path / "nowhere", "to-a-folder": folder}[link]
    (where / WinnerDB.LOCK).symlink_to(target)
    db = WinnerDB(where)
    with caplog.at_level(logging.WARNING, logger="branchyard"):
        db.put("k", {"winner": "ours"})
    assert db.disk_error is None
    assert not caplog.records
    assert not (where / WinnerDB.LOCK).is_symlink()
    assert WinnerDB(where).get("k")["winner"] == "ours", "the entry is on disk for the next process"
    assert precious.read_text() == "keep me"
    assert (folder / "inside").is_dir()
