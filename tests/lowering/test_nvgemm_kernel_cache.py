"""The on-disk kernel cache: hits across instances (processes), corrupt and
stale entries detected and rebuilt, atomic publication, one build per key."""

from __future__ import annotations

import json
import logging
import threading

import pytest

from branchyard.errors import LoweringError
from branchyard.lowering.nvgemm.kernel_cache import MANIFEST, KernelCache

ENV = {"gpu": "FakeGPU sm90", "torch": "2.14", "cutedsl": "4.6"}
KEY = {"spec": "w=kn;bias@0;gelu_erf;out=bfloat16", "config": "t128x256_c1x1_o1", "dtype": "bfloat16"}


class Builder:
    def __init__(self, payload=b"cubin-bytes"):
        self.payload = payload
        self.builds = 0
        self.loads = 0

    def build(self, d):
        self.builds += 1
        (d / "kernel.o").write_bytes(self.payload)
        (d / "kernel.h").write_text("// header")

    def load(self, d):
        self.loads += 1
        return (d / "kernel.o").read_bytes()


def test_second_instance_loads_from_disk_without_building(tmp_path):
    b1 = Builder()
    assert KernelCache(tmp_path, env=ENV).get_or_build(KEY, b1.build, b1.load) == b"cubin-bytes"
    b2 = Builder()
    cache = KernelCache(tmp_path, env=ENV)
    assert cache.get_or_build(KEY, b2.build, b2.load) == b"cubin-bytes"
    assert (b1.builds, b2.builds, b2.loads) == (1, 0, 1)
    assert cache.stats == {"hits": 1, "builds": 0, "rebuilt": 0}
    manifest = json.loads((cache.path(KEY) / MANIFEST).read_text())
    assert manifest["key"] == KEY and sorted(manifest["files"]) == ["kernel.h", "kernel.o"]
    # In memory after the first load: no further disk reads.
    cache.get_or_build(KEY, b2.build, b2.load)
    assert b2.loads == 1


def _damage_file(entry):
    (entry / "kernel.o").write_bytes(b"cubin-bytez")


def _damage_manifest(entry):
    (entry / MANIFEST).write_text("{truncated")


def _drop_file(entry):
    (entry / "kernel.h").unlink()


def _other_schema(entry):
    m = json.loads((entry / MANIFEST).read_text())
    m["schema"] = 99
    (entry / MANIFEST).write_text(json.dumps(m))


@pytest.mark.parametrize(
    "damage, reason",
    [
        (_damage_file, "file 'kernel.o' fails its checksum"),
        (_damage_manifest, "unreadable manifest"),
        (_drop_file, "missing file 'kernel.h'"),
        (_other_schema, "schema 99"),
    ],
)
def test_damaged_entry_is_detected_and_rebuilt(tmp_path, caplog, damage, reason):
    KernelCache(tmp_path, env=ENV).get_or_build(KEY, Builder().build, Builder().load)
    cache = KernelCache(tmp_path, env=ENV)
    damage(cache.path(KEY))
    assert reason in cache.check(KEY)
    b = Builder()
    with caplog.at_level(logging.WARNING, logger="branchyard"):
        assert cache.get_or_build(KEY, b.build, b.load) == b"cubin-bytes"
    assert reason in caplog.text and b.builds == 1
    assert cache.stats == {"hits": 0, "builds": 1, "rebuilt": 1}
    assert cache.check(KEY) is None


def test_entry_that_fails_to_load_is_rebuilt(tmp_path):
    KernelCache(tmp_path, env=ENV).get_or_build(KEY, Builder().build, Builder().load)
    calls = []

    def flaky_load(d):
        calls.append(d)
        if len(calls) == 1:
            raise RuntimeError("undefined symbol")
        return "ok"

    b = Builder()
    cache = KernelCache(tmp_path, env=ENV)
    assert cache.get_or_build(KEY, b.build, flaky_load) == "ok"
    assert b.builds == 1 and cache.stats["rebuilt"] == 1


def test_other_environment_and_stale_manifest(tmp_path):
    KernelCache(tmp_path, env=ENV).get_or_build(KEY, Builder().build, Builder().load)
    other = KernelCache(tmp_path, env={**ENV, "cutedsl": "4.7"})
    assert other.path(KEY) != KernelCache(tmp_path, env=ENV).path(KEY)
    assert other.check(KEY) == "absent"
    # A manifest naming another environment at this digest (e.g. copied caches) is stale.
    cache = KernelCache(tmp_path, env=ENV)
    m = json.loads((cache.path(KEY) / MANIFEST).read_text())
    m["env"]["torch"] = "2.11"
    (cache.path(KEY) / MANIFEST).write_text(json.dumps(m))
    assert cache.check(KEY).startswith("stale")


def test_concurrent_requests_build_once_and_leave_no_temporaries(tmp_path):
    cache = KernelCache(tmp_path, env=ENV)
    b = Builder()
    results = []
    threads = [threading.Thread(target=lambda: results.append(cache.get_or_build(KEY, b.build, b.load))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [b"cubin-bytes"] * 8 and b.builds == 1
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [cache.digest(KEY)]


def test_a_build_that_writes_nothing_is_an_error(tmp_path):
    cache = KernelCache(tmp_path, env=ENV)
    with pytest.raises(LoweringError, match="the kernel build wrote no files"):
        cache.get_or_build(KEY, lambda d: None, lambda d: None)
    assert list((tmp_path / "kernels").iterdir()) == []


def test_a_build_that_raises_publishes_nothing(tmp_path):
    cache = KernelCache(tmp_path, env=ENV)

    def boom(d):
        (d / "kernel.o").write_bytes(b"half")
        raise RuntimeError("ptxas died")

    with pytest.raises(RuntimeError, match="ptxas died"):
        cache.get_or_build(KEY, boom, lambda d: None)
    assert list((tmp_path / "kernels").iterdir()) == []
    assert cache.check(KEY) == "absent"
