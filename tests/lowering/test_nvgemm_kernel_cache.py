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


@pytest.mark.parametrize("where", ["build", "load"])
def test_an_os_error_of_the_build_or_load_is_the_callers_not_the_disks(tmp_path, where):
    """A missing ptxas or a failed dlopen raises an OSError from the caller's
    build or load: it reaches the caller once, and the disk cache stays on."""
    cache = KernelCache(tmp_path, env=ENV)
    calls = []

    def build(d):
        calls.append("build")
        if where == "build":
            raise FileNotFoundError(2, "No such file or directory", "ptxas")
        (d / "kernel.o").write_bytes(b"x")

    def load(d):
        calls.append("load")
        raise OSError("kernel.o: undefined symbol: cuTensorMapEncodeTiled")

    error = FileNotFoundError if where == "build" else OSError
    with pytest.raises(error, match="ptxas" if where == "build" else "undefined symbol"):
        cache.get_or_build(KEY, build, load)
    assert cache.disk_error is None
    assert calls.count("build") == 1
    good = Builder()
    other = {**KEY, "config": "t64x64_c1x1_o1"}
    assert cache.get_or_build(other, good.build, good.load) == b"cubin-bytes"
    assert cache.check(other) is None and good.builds == 1, "the good kernel is on disk"


# --- compiled CuTeDSL kernels in the cache (cutedsl_gemm), with a fake compiler ---------

import torch  # noqa: E402

from branchyard.lowering.nvgemm import candidates as cands_mod  # noqa: E402
from branchyard.lowering.nvgemm import cutedsl_gemm as cg  # noqa: E402
from branchyard.lowering.nvgemm import kernel_cache as kc  # noqa: E402
from branchyard.lowering.nvgemm.epilogue import EpilogueSpec  # noqa: E402
from branchyard.lowering.nvgemm.kernel_math import plan_steps  # noqa: E402
from branchyard.lowering.nvgemm.problem import Problem  # noqa: E402

BF16_SPEC = EpilogueSpec.parse("w=nk;bias@0;relu;out=bfloat16")


class FakeCompiler:
    """Stands in for CuTeDSL: ``compile`` counts compiles and returns an object
    with ``export_to_c`` (writes the 'object file') and the kernel's call
    signature ``(a, b_nk, out, operands)``; ``load`` rebuilds it from disk."""

    def __init__(self):
        self.compiles = 0
        self.loads = 0

    class Kernel:
        def __init__(self, tag):
            self.tag = tag

        def export_to_c(self, path, function_name):
            open(path, "wb").write(f"ELF|{self.tag}|{function_name}".encode())

        def __call__(self, a, b_nk, out, operands):
            *tensors, pad = operands
            assert pad == 0.0, "the trailing scalar of today's call is kept"
            out.copy_(torch.relu(a.float() @ b_nk.float().t() + tensors[0].float()))

    def compile(self, steps, dtype, out_dtype, operand_dtypes, b_layout, config):
        self.compiles += 1
        return self.Kernel(f"{[s.name for s in steps]}|{config.name}|{b_layout}")

    def load(self, directory):
        self.loads += 1
        meta = json.loads((directory / "kernel.json").read_text())
        tag, function = (directory / "kernel.o").read_bytes().decode().split("|", 1)[1].rsplit("|", 1)
        assert function == meta["function"]
        return self.Kernel(tag)


@pytest.fixture
def fake_cutedsl(tmp_path, monkeypatch):
    compiler = FakeCompiler()
    monkeypatch.setenv("BRANCHYARD_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("BRANCHYARD_NVGEMM_KERNEL_CACHE", raising=False)
    monkeypatch.setattr(cg, "cutedsl_available", lambda: (True, ""))
    monkeypatch.setattr(cands_mod, "cutedsl_available", lambda: (True, ""))
    monkeypatch.setattr(cg, "_compile", compiler.compile)
    monkeypatch.setattr(cg, "_load", compiler.load)
    monkeypatch.setattr(cg, "_target_arch", lambda: "sm_90a")
    fresh_process(monkeypatch)
    return compiler


def fresh_process(monkeypatch):
    """Forget what this process compiled or loaded (memory caches), keep the disk."""
    monkeypatch.setattr(cg, "_CACHE", {})
    monkeypatch.setattr(kc, "_DEFAULTS", {})


def _bf16_inputs(m=8, n=16, k=32):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16(),
            [torch.randn(n, generator=g).bfloat16()])


def test_compiled_kernel_is_exported_once_and_loaded_by_the_next_process(fake_cutedsl, tmp_path, monkeypatch):
    a, w, ops = _bf16_inputs()
    want = torch.relu(a.float() @ w.float().t() + ops[0].float()).bfloat16()
    config = cg.GemmConfig(128, 256)
    for process in range(3):
        fresh_process(monkeypatch)
        fn = cg.compile_fused_gemm(BF16_SPEC, torch.bfloat16, config)
        out = torch.empty(8, 16, dtype=torch.bfloat16)
        fn(a, w.t(), ops, out)
        torch.testing.assert_close(out, want)
        stats = kc.default_kernel_cache().stats
        assert stats == ({"hits": 0, "builds": 1, "rebuilt": 0} if process == 0 else
                         {"hits": 1, "builds": 0, "rebuilt": 0}), (process, stats)
    assert fake_cutedsl.compiles == 1 and fake_cutedsl.loads == 3  # the builder loads what it exported too
    (entry,) = (tmp_path / "nvgemm" / "kernels").iterdir()
    manifest = json.loads((entry / MANIFEST).read_text())
    assert sorted(manifest["files"]) == ["kernel.json", "kernel.o"]
    assert manifest["key"]["config"]["tile_n"] == 256 and manifest["key"]["arch"] == "sm_90a"
    assert manifest["key"]["source"] == cg._source_digest()


def test_truncated_object_file_is_detected_and_recompiled(fake_cutedsl, tmp_path, monkeypatch, caplog):
    config = cg.GemmConfig(128, 128)
    cg.compile_fused_gemm(BF16_SPEC, torch.bfloat16, config)
    (entry,) = (tmp_path / "nvgemm" / "kernels").iterdir()
    obj = entry / "kernel.o"
    obj.write_bytes(obj.read_bytes()[:5])
    fresh_process(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="branchyard"):
        cg.compile_fused_gemm(BF16_SPEC, torch.bfloat16, config)
    assert kc.default_kernel_cache().stats == {"hits": 0, "builds": 1, "rebuilt": 1}
    assert fake_cutedsl.compiles == 2
    assert "kernel.o" in caplog.text and "checksum" in caplog.text
    fresh_process(monkeypatch)
    cg.compile_fused_gemm(BF16_SPEC, torch.bfloat16, config)
    assert kc.default_kernel_cache().stats["hits"] == 1 and fake_cutedsl.compiles == 2


def test_an_entry_that_does_not_load_is_recompiled(fake_cutedsl, tmp_path, monkeypatch):
    config = cg.GemmConfig(128, 128)
    cg.compile_fused_gemm(BF16_SPEC, torch.bfloat16, config)
    fresh_process(monkeypatch)
    calls = []

    def load_once_broken(directory):
        calls.append(directory)
        if len(calls) == 1:
            raise RuntimeError("JITLink: unresolved symbol")  # e.g. another runtime library
        return fake_cutedsl.load(directory)

    monkeypatch.setattr(cg, "_load", load_once_broken)
    cg.compile_fused_gemm(BF16_SPEC, torch.bfloat16, config)
    assert kc.default_kernel_cache().stats == {"hits": 0, "builds": 1, "rebuilt": 1}
    assert fake_cutedsl.compiles == 2


@pytest.mark.parametrize(
    "change",
    [
        {"config": cg.GemmConfig(128, 256, raster_group=4)},  # same config name, other code
        {"config": cg.GemmConfig(128, 256, residual_tma=True)},
        {"operand_dtypes": ["float32"]},
        {"b_layout": "kn"},
        {"steps": plan_steps(EpilogueSpec.parse("w=nk;bias@0;gelu_tanh;out=bfloat16"))},
        {"steps": plan_steps(EpilogueSpec.parse("w=nk;bias@0;gelu_erf;out=bfloat16"))},
    ],
)
def test_everything_the_code_depends_on_is_in_the_key(change):
    base = dict(steps=plan_steps(EpilogueSpec.parse("w=nk;bias@0;gelu_erf;out=bfloat16")), dtype="bfloat16", out_dtype="bfloat16",
                operand_dtypes=["bfloat16"], b_layout="nk", config=cg.GemmConfig(128, 256))
    cache = KernelCache("/nonexistent", env=ENV)
    same = cache.digest(cg.kernel_cache_key(**base)) == cache.digest(cg.kernel_cache_key(**{**base, **change}))
    assert same == ("gelu_erf" in str(change)), change


def test_a_source_edit_changes_the_key(monkeypatch, tmp_path):
    import pathlib

    for name in ("a.py", "b.py"):
        (tmp_path / name).write_text("x = 1\n")
    monkeypatch.setattr(cg, "__file__", str(tmp_path / "cutedsl_gemm.py"))
    cg._source_digest.cache_clear()
    try:
        before = cg._source_digest()
        cg._source_digest.cache_clear()
        pathlib.Path(tmp_path / "b.py").write_text("x = 2\n")
        assert cg._source_digest() != before
    finally:
        monkeypatch.undo()
        cg._source_digest.cache_clear()


def test_kernel_cache_off_compiles_in_memory_only(fake_cutedsl, tmp_path, monkeypatch):
    monkeypatch.setenv("BRANCHYARD_NVGEMM_KERNEL_CACHE", "0")
    cg.compile_fused_gemm(BF16_SPEC, torch.bfloat16, cg.GemmConfig(128, 128))
    assert fake_cutedsl.compiles == 1 and not (tmp_path / "nvgemm" / "kernels").exists()


def test_autotuner_cutedsl_candidates_build_through_the_disk_cache(fake_cutedsl, tmp_path, monkeypatch):
    a, w, ops = _bf16_inputs()
    problem = Problem.of(a, w.t(), ops, BF16_SPEC)
    cands = cands_mod._cutedsl_candidates(problem)
    assert cands and all(c.name.startswith("cutedsl:t64x") for c in cands), [c.name for c in cands]
    for _ in range(2):
        fresh_process(monkeypatch)
        out = torch.empty(8, 16, dtype=torch.bfloat16)
        got = cands[0].build(problem)(a, w.t(), ops, out)
        torch.testing.assert_close(got, torch.relu(a.float() @ w.float().t() + ops[0].float()).bfloat16())
    assert fake_cutedsl.compiles == 1


# --- the real CuTeDSL export (runs only where nvidia-cutlass-dsl and apache-tvm-ffi are installed) ---


def _real_cutedsl_reason() -> str | None:
    import importlib.util
    import os

    for module in ("cutlass", "tvm_ffi"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (CI has no CuTeDSL)"
    if not torch.cuda.is_available() and not os.environ.get("CUTE_DSL_ARCH"):
        return "no GPU: set CUTE_DSL_ARCH=sm_90a to compile for the H200 on CPU"
    return None


@pytest.mark.skipif(_real_cutedsl_reason() is not None, reason=str(_real_cutedsl_reason()))
def test_real_cutedsl_kernel_exports_and_loads_without_compiling(tmp_path, monkeypatch):
    """Compile + export needs no GPU; the loaded function is CuTeDSL's tvm-ffi
    function, the same object type the JIT path calls."""
    import tvm_ffi

    fresh_process(monkeypatch)
    steps = plan_steps(BF16_SPEC)
    compiled = []
    real_compile = cg._compile
    monkeypatch.setattr(cg, "_compile", lambda *a: compiled.append(1) or real_compile(*a))

    def kernel(cache):
        return cg._FusedGemm(steps, "bfloat16", "bfloat16", "nk", cg.GemmConfig(128, 128), 1, kernel_cache=cache)

    first = KernelCache(tmp_path)
    fn = kernel(first).variant(("bfloat16",))
    assert first.stats["builds"] == 1 and isinstance(fn, tvm_ffi.Function)
    (entry,) = first.root.iterdir()
    assert (entry / "kernel.o").read_bytes()[:4] == b"\x7fELF"
    fresh_process(monkeypatch)
    second = KernelCache(tmp_path)
    assert isinstance(kernel(second).variant(("bfloat16",)), tvm_ffi.Function)
    assert second.stats == {"hits": 1, "builds": 0, "rebuilt": 0} and len(compiled) == 1
    (entry / "kernel.o").write_bytes(b"\x7fELF truncated")
    fresh_process(monkeypatch)
    third = KernelCache(tmp_path)
    kernel(third).variant(("bfloat16",))
    assert third.stats == {"hits": 0, "builds": 1, "rebuilt": 1} and len(compiled) == 2


@pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="needs FIFOs")
def test_a_fifo_in_place_of_the_winner_database_is_damage_not_a_hang(tmp_path, caplog):
    """Reading a FIFO blocks until a writer comes: the store treats anything
    but a regular file as damage, as it does a directory there."""
    import os

    from branchyard.lowering.nvgemm.store import JsonDamage, read_json
    from branchyard.lowering.nvgemm.winners import WinnerDB

    db = WinnerDB(tmp_path)
    os.mkfifo(db.path)
    got = {}
    reader = threading.Thread(target=lambda: got.update(damage=read_json(db.path), entry=db.get("k")), daemon=True)
    with caplog.at_level(logging.WARNING, logger="branchyard"):
        reader.start()
        reader.join(20)
    assert not reader.is_alive(), "reading the FIFO blocked"
    assert isinstance(got["damage"], JsonDamage) and "FIFO" in got["damage"].reason
    assert got["entry"] is None and any("damaged" in r.getMessage() for r in caplog.records)


# --- the cache's own folders -------------------------------------------------

@pytest.mark.parametrize("folder", ["kernels", ".locks"])
def test_a_file_where_a_cache_folder_should_be_is_removed_and_the_disk_kept(tmp_path, folder, caplog):
    (tmp_path / folder).write_text("stray")
    cache = KernelCache(tmp_path, env=ENV)
    b = Builder()
    with caplog.at_level(logging.WARNING, logger="branchyard"):
        assert cache.get_or_build(KEY, b.build, b.load) == b"cubin-bytes"
    assert cache.disk_error is None and cache.check(KEY) is None
    assert (tmp_path / folder).is_dir()
    assert f"something other than a folder stood at {tmp_path / folder}" in caplog.text
    # the next process finds the kernel on disk
    again = Builder()
    assert KernelCache(tmp_path, env=ENV).get_or_build(KEY, again.build, again.load) == b"cubin-bytes"
    assert again.builds == 0


def test_a_link_where_a_cache_folder_should_be_is_left_alone(tmp_path, caplog):
    (tmp_path / "kernels").symlink_to(tmp_path / "unmounted-disk")
    cache = KernelCache(tmp_path, env=ENV)
    b = Builder()
    with caplog.at_level(logging.WARNING, logger="branchyard"):
        assert cache.get_or_build(KEY, b.build, b.load) == b"cubin-bytes"
    assert (tmp_path / "kernels").is_symlink() and not (tmp_path / "unmounted-disk").exists()
    assert cache.disk_error is not None and "cannot write the kernel cache" in caplog.text


def test_an_unwritable_cache_keeps_its_kernels_in_one_private_folder_removed_at_exit(tmp_path):
    """Kernels built while the cache folder cannot be written go to one folder
    of this process in the system's temporary folder, which goes at exit."""
    import subprocess
    import sys
    import textwrap

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the cache folder should be")
    script = textwrap.dedent(f"""
        import os, sys
        from branchyard.lowering.nvgemm.kernel_cache import KernelCache
        cache = KernelCache({str(blocker / "nvgemm")!r}, env={{"gpu": "x"}})
        def build(d):
            (d / "kernel.o").write_bytes(b"k")
        for i in range(3):
            assert cache.get_or_build({{"k": i}}, build, lambda d: (d / "kernel.o").read_bytes()) == b"k"
        print(sorted(os.listdir({str(tmp)!r})), cache.stats["builds"])
        sys.stdout.flush()
        if sys.argv[1] == "kill":
            os.kill(os.getpid(), 9)
    """)
    env = {**__import__("os").environ, "TMPDIR": str(tmp)}
    out = subprocess.run([sys.executable, "-c", script, "exit"], env=env, capture_output=True, text=True, check=True)
    during, builds = out.stdout.rsplit(" ", 1)
    assert len(eval(during)) == 1 and eval(during)[0].startswith(kc.PRIVATE_PREFIX) and builds.strip() == "3"
    assert list(tmp.iterdir()) == [], "removed at exit"
    killed = subprocess.run([sys.executable, "-c", script, "kill"], env=env, capture_output=True, text=True)
    assert killed.returncode == -9 and len(list(tmp.iterdir())) == 1, "a SIGKILL leaves its folder"
    subprocess.run([sys.executable, "-c", script, "exit"], env=env, capture_output=True, text=True, check=True)
    assert list(tmp.iterdir()) == [], "the next process removed the dead one's folder"
