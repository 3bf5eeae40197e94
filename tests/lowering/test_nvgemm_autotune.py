"""The autotuner's decisions on CPU, with injected candidates and fake
timings: winner choice, exclusions with reasons, the on-disk winner database
(atomic, checksummed, rebuilt when corrupt or stale), M buckets, the progress
bar, and the op using the process-wide autotuner."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import threading
import warnings

import pytest
import torch

from branchyard.errors import LoweringError
from branchyard.lowering.nvgemm import candidates as cands_mod
from branchyard.lowering.nvgemm import op as op_mod
from branchyard.lowering.nvgemm import store, timing
from branchyard.lowering.nvgemm import tuner as tuner_mod
from branchyard.lowering.nvgemm.candidates import Candidate
from branchyard.lowering.nvgemm.epilogue import EpilogueSpec, reference_fused_gemm, unfused_aten_epilogue
from branchyard.lowering.nvgemm.problem import Problem, m_bucket
from branchyard.lowering.nvgemm.progress import ProgressBar
from branchyard.lowering.nvgemm.tuner import Autotuner
from branchyard.lowering.nvgemm import winners as winners_mod
from branchyard.lowering.nvgemm.winners import SCHEMA_VERSION, WinnerDB

DB_FILE = WinnerDB.FILE

SPEC = EpilogueSpec.parse("w=kn;bias@0;relu;out=float32")
ENV = {"gpu": "FakeGPU sm90", "driver": "13.0", "cuda": "13.0", "torch": "2.14", "cutedsl": "4.6"}


def _inputs(m=8, n=16, k=32):
    g = torch.Generator().manual_seed(0)
    return torch.randn(m, k, generator=g), torch.randn(k, n, generator=g), [torch.randn(n, generator=g)]


class Recorder:
    """Candidates whose builds, runs and timings are counted."""

    def __init__(self, times: dict[str, float], *, wrong=(), broken=()):
        self.times, self.wrong, self.broken = times, set(wrong), set(broken)
        self.builds: list[str] = []
        self.timed: list[str] = []

    def candidate(self, name: str) -> Candidate:
        def build(problem: Problem):
            self.builds.append(name)
            if name in self.broken:
                raise LoweringError("no kernel for this shape")

            def impl(a, b_kn, ops, out):
                y = unfused_aten_epilogue(a @ b_kn, problem.spec, list(ops))
                if name in self.wrong:
                    y = y + 1.0
                out.copy_(y)
                return out

            return impl

        return Candidate(name, build)

    def candidates(self) -> list[Candidate]:
        return [self.candidate(n) for n in self.times]

    def timer(self, name, fn):
        fn()
        self.timed.append(name)
        return self.times[name]


def _tuner(rec: Recorder, tmp_path, **kw) -> Autotuner:
    kw.setdefault("progress", False)
    return Autotuner(rec.candidates(), timer=rec.timer, db=WinnerDB(tmp_path), env=ENV, **kw)


def test_fastest_candidate_wins_and_is_recorded(tmp_path):
    rec = Recorder({"ours": 1.0, "cublas": 1.5, "aten": 3.0})
    tuner = _tuner(rec, tmp_path)
    a, b, ops = _inputs()
    res = tuner.tune(a, b, ops, SPEC)
    assert res.winner == "ours" and res.timings == {"ours": 1.0, "cublas": 1.5, "aten": 3.0}
    data = json.loads((tmp_path / DB_FILE).read_text())
    assert data["schema"] == SCHEMA_VERSION
    (entry,) = data["entries"].values()
    assert entry["winner"] == "ours" and len(entry["checksum"]) == 16


def test_excluded_candidates_say_why(tmp_path):
    rec = Recorder({"broken": 0.1, "wrong": 0.2, "ok": 1.0}, wrong={"wrong"}, broken={"broken"})
    na = Candidate("not-applicable", lambda p: pytest.fail("must not build"), lambda p: "only bias+relu chains")
    tuner = Autotuner(rec.candidates() + [na], timer=rec.timer, db=WinnerDB(tmp_path), env=ENV, progress=False)
    res = tuner.tune(*_inputs(), SPEC)
    assert res.winner == "ok"
    assert res.excluded["broken"].startswith("build failed: LoweringError: no kernel for this shape")
    assert res.excluded["wrong"].startswith("numerics off at [")
    assert res.excluded["not-applicable"] == "only bias+relu chains"
    assert rec.timed == ["ok"], "candidates with wrong numerics are never timed"


def test_no_surviving_candidate_is_a_lowering_error(tmp_path):
    rec = Recorder({"a": 1.0, "b": 2.0}, broken={"a", "b"})
    with pytest.raises(LoweringError, match=r"no candidate can run M=8 N=16 K=32 .*a: build failed.*b: build failed"):
        _tuner(rec, tmp_path).tune(*_inputs(), SPEC)


def test_winner_is_reused_from_disk_without_timing(tmp_path):
    rec = Recorder({"ours": 1.0, "aten": 2.0})
    _tuner(rec, tmp_path).select(*_inputs(), SPEC)
    rec2 = Recorder({"ours": 1.0, "aten": 2.0})
    tuner2 = _tuner(rec2, tmp_path)
    impl = tuner2.select(*_inputs(), SPEC)
    assert rec2.timed == [] and rec2.builds == ["ours"], "only the recorded winner is built"
    (res,) = tuner2.results.values()
    assert res.from_cache and res.winner == "ours"
    a, b, ops = _inputs()
    out = torch.empty(8, 16)
    torch.testing.assert_close(impl(a, b, ops, out), torch.relu(a @ b + ops[0]))


def test_select_caches_per_bucket_in_process(tmp_path):
    rec = Recorder({"ours": 1.0, "aten": 2.0})
    tuner = _tuner(rec, tmp_path)
    tuner.select(*_inputs(m=100), SPEC)
    tuner.select(*_inputs(m=128), SPEC)  # same bucket: no new tuning
    assert rec.timed == ["ours", "aten"]
    tuner.select(*_inputs(m=129), SPEC)  # next bucket: tuned again
    assert rec.timed == ["ours", "aten", "ours", "aten"]
    assert len(json.loads((tmp_path / DB_FILE).read_text())["entries"]) == 2


def test_key_names_everything_the_winner_depends_on():
    a, b, ops = _inputs(m=100, n=16, k=32)
    key = Problem.of(a, b, ops, SPEC).key(ENV)
    for part in ("gpu=FakeGPU sm90", "driver=13.0", "cuda=13.0", "torch=2.14", "cutedsl=4.6",
                 "spec=w=kn;bias@0;relu;out=float32", "dtype=float32", "operand_dtypes=float32",
                 "layouts=a:row;b:kn;ops:vec", "n=16", "k=32", "m_bucket=128"):
        assert part in key, part
    wt = torch.randn(16, 32)
    assert "b:nk" in Problem.of(a, wt.t(), ops, SPEC).key(ENV)
    assert Problem.of(a.half(), b.half(), [o.half() for o in ops], SPEC).key(ENV) != key
    assert m_bucket(8193) == 16384 and m_bucket(1) == 1


def _rewrite_entries(path, **fields) -> None:
    """Set ``fields`` in every entry and re-checksum it: a crafted file, not a damaged one."""
    data = json.loads(path.read_text())
    for key, entry in data["entries"].items():
        body = {k: v for k, v in entry.items() if k != "checksum"} | fields
        data["entries"][key] = body | {"checksum": winners_mod._checksum(body)}
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: p.write_text("{not json"), "is damaged (not JSON"),
        (lambda p: p.write_text(json.dumps({"schema": SCHEMA_VERSION + 1, "entries": {}})), "is not a schema-"),
        (lambda p: p.write_text(p.read_text().replace('"winner": "ours"', '"winner": "aten"')), "entry for"),
        (lambda p: p.write_text(json.dumps({"schema": SCHEMA_VERSION,
                                            "entries": {k: ["junk"] for k in json.loads(p.read_text())["entries"]}})),
         "entry for"),
        (lambda p: _rewrite_entries(p, timings=5), "entry for"),
        (lambda p: _rewrite_entries(p, excluded=["aten"]), "entry for"),
    ],
    ids=["corrupt-file", "other-schema", "tampered-entry", "entry-not-an-object", "timings-not-a-map",
         "excluded-not-a-map"],
)
def test_damaged_database_is_detected_and_rebuilt(tmp_path, caplog, damage, message):
    rec = Recorder({"ours": 1.0, "aten": 2.0})
    _tuner(rec, tmp_path).select(*_inputs(), SPEC)
    damage(tmp_path / DB_FILE)
    rec2 = Recorder({"ours": 1.0, "aten": 2.0})
    with caplog.at_level(logging.WARNING, logger="branchyard"):
        _tuner(rec2, tmp_path).select(*_inputs(), SPEC)
    assert message in caplog.text
    assert rec2.timed == ["ours", "aten"], "a damaged entry is retuned, not trusted"
    data = json.loads((tmp_path / DB_FILE).read_text())
    assert data["schema"] == SCHEMA_VERSION
    assert [e["winner"] for e in data["entries"].values()] == ["ours"]
    assert WinnerDB(tmp_path).get(next(iter(data["entries"]))) is not None


def test_stale_winner_no_longer_offered_is_retuned(tmp_path):
    _tuner(Recorder({"gone": 0.5, "aten": 2.0}), tmp_path).select(*_inputs(), SPEC)
    rec = Recorder({"ours": 1.0, "aten": 2.0})
    _tuner(rec, tmp_path).select(*_inputs(), SPEC)
    assert rec.timed == ["ours", "aten"]
    (entry,) = WinnerDB(tmp_path).entries().values()
    assert entry["winner"] == "ours"


def test_a_winner_picked_without_a_candidate_offered_now_is_retuned(tmp_path, caplog):
    # e.g. tuned with BRANCHYARD_NVGEMM_INDUCTOR=0 into a shared cache, then read with it on
    _tuner(Recorder({"ours": 1.0, "aten": 2.0}), tmp_path).select(*_inputs(), SPEC)
    rec = Recorder({"ours": 1.0, "triton": 0.5, "aten": 2.0})
    with caplog.at_level(logging.INFO, logger="branchyard"):
        tuner = _tuner(rec, tmp_path)
        tuner.select(*_inputs(), SPEC)
    assert rec.timed == ["ours", "triton", "aten"]
    (res,) = tuner.results.values()
    assert res.winner == "triton" and not res.from_cache
    assert "was picked without triton; retuning" in caplog.text
    # fewer candidates than were raced (BRANCHYARD_NVGEMM_MAX_CONFIGS, one switched off): the entry stands
    rec3 = Recorder({"triton": 0.5, "aten": 2.0})
    _tuner(rec3, tmp_path).select(*_inputs(), SPEC)
    assert rec3.timed == [] and rec3.builds == ["triton"]


def test_concurrent_writers_keep_every_entry_and_leave_no_temp_files(tmp_path):
    db = WinnerDB(tmp_path)
    threads = [threading.Thread(target=db.put, args=(f"k{i}", {"winner": f"w{i}"})) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(db.entries()) == sorted(f"k{i}" for i in range(16))
    assert all(db.get(f"k{i}")["winner"] == f"w{i}" for i in range(16))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([WinnerDB.LOCK, DB_FILE])


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("BRANCHYARD_CACHE_DIR", str(tmp_path))
    assert store.cache_dir() == tmp_path / "nvgemm"
    assert WinnerDB().path == tmp_path / "nvgemm" / DB_FILE


def test_progress_bar_reports_each_candidate(tmp_path):
    stream = io.StringIO()
    rec = Recorder({"ours": 1.0, "aten": 2.0})
    Autotuner(rec.candidates(), timer=rec.timer, db=WinnerDB(tmp_path), env=ENV, progress=True,
              stream=stream).tune(*_inputs(), SPEC)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("nvgemm autotune M=8 N=16 K=32 float32")
    assert "1/2 ours: 1000.0 us" in lines[0] and "[########################] 2/2 aten" in lines[1]


def test_progress_bar_redraws_in_place_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    s = Tty()
    bar = ProgressBar(2, "x", stream=s)
    bar.step("a")
    bar.step("b")
    assert s.getvalue().count("\r") == 2 and s.getvalue().endswith("\n") and s.getvalue().count("\n") == 1


def test_default_candidates_and_applicability(monkeypatch):
    a, b, ops = _inputs()
    half = Problem.of(a.half(), b.half(), [o.half() for o in ops], EpilogueSpec.parse("w=kn;bias@0;relu;out=float16"))
    names = [c.name for c in cands_mod.default_candidates(half, inductor=True)]
    assert names[-7:] == ["cublaslt:_addmm_activation", "cublas:addmm", "cublaslt:_addmm_activation+aten",
                          "cublas:addmm+aten", "triton:inductor", "triton:inductor[default]", "aten:unfused"]
    assert not [n for n in (c.name for c in cands_mod.default_candidates(half, inductor=False)) if "inductor" in n]
    monkeypatch.setenv("BRANCHYARD_NVGEMM_INDUCTOR", "0")
    assert not [n for n in (c.name for c in cands_mod.default_candidates(half)) if "inductor" in n]
    cublas = next(c for c in cands_mod.default_candidates(half) if c.name.startswith("cublaslt"))
    assert "CUDA only" in cublas.applies(half)
    cuda_half = Problem(**{**half.__dict__, "device": "cuda:0"})
    assert cublas.applies(cuda_half) is None
    gelu_erf = Problem(**{**cuda_half.__dict__, "spec": EpilogueSpec.parse("w=kn;bias@0;gelu_erf;out=float16")})
    assert "not bias+gelu_erf" in cublas.applies(gelu_erf)
    promoted = Problem(**{**cuda_half.__dict__, "spec": EpilogueSpec.parse("w=kn;bias@0;relu;out=float32")})
    assert "input dtype" in cublas.applies(promoted)


def test_aten_candidate_builds_and_passes_numerics(tmp_path):
    a, b, ops = _inputs()
    tuner = Autotuner(lambda p: [c for c in cands_mod.default_candidates(p, inductor=False) if c.name == "aten:unfused"],
                      timer=lambda name, fn: 1.0, db=WinnerDB(tmp_path), env=ENV, progress=False)
    assert tuner.tune(a, b, ops, SPEC).winner == "aten:unfused"


def test_numerics_error_reports_shape_dtype_and_worst_element():
    ref = torch.ones(4, 8)
    assert "shape [4, 7]" in tuner_mod.numerics_error(torch.ones(4, 7), ref, torch.float32)
    assert "dtype torch.float16" in tuner_mod.numerics_error(torch.ones(4, 8, dtype=torch.float16), ref, torch.float32)
    bad = ref.clone()
    bad[2, 5] = 1.5
    assert tuner_mod.numerics_error(bad, ref, torch.float32).startswith("numerics off at [2, 5]: got 1.5")
    assert tuner_mod.numerics_error(ref.bfloat16(), ref * 1.004, torch.bfloat16) is None


def test_op_runs_the_process_autotuner_when_eligible(tmp_path, monkeypatch):
    rec = Recorder({"ours": 1.0, "aten": 2.0})
    tuner_mod.set_autotuner(_tuner(rec, tmp_path))
    monkeypatch.setattr(op_mod, "fused_kernel_ineligibility", lambda *args: None)
    try:
        a, w, bias = torch.randn(2, 3, 32), torch.randn(16, 32), torch.randn(16)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the eligible path must not warn
            out = op_mod.fused_gemm_epilogue(a, w, [bias], "w=nk;bias@0;relu;out=float32")
        torch.testing.assert_close(out, torch.relu(a @ w.t() + bias))
        assert rec.timed == ["ours", "aten"] and rec.builds == ["ours", "aten"]
        (res,) = tuner_mod.get_autotuner().results.values()
        assert "layouts=a:row;b:nk;ops:vec" in res.key and "m_bucket=8" in res.key
    finally:
        tuner_mod.set_autotuner(None)


@pytest.mark.parametrize(
    "text, applies",
    [("scale:0.5;residual@0", True), ("bias@0", True), ("residual@0", True), ("bias@0;relu", False),
     ("residual@0;scale:0.5", False)],
)
def test_addmm_candidate_fuses_scale_and_residual_exactly(text, applies, tmp_path):
    a, b = torch.randn(8, 32), torch.randn(32, 16)
    spec = EpilogueSpec.parse(f"w=kn;{text};out=float32")
    ops = [torch.randn(16) if s.op.operand == "col" else torch.randn(8, 16) for s in spec.steps
           if s.op.operand in ("col", "matrix")]
    problem = Problem.of(a, b, ops, spec)
    cand = next(c for c in cands_mod.default_candidates(problem, inductor=False) if c.name == "cublas:addmm")
    assert (cand.applies(problem) is None) is applies
    if applies:
        got = cand.build(problem)(a, b, ops, torch.empty(8, 16))
        assert tuner_mod.numerics_error(got, reference_fused_gemm(a, b, ops, spec), torch.float32) is None


def test_max_configs_env_limits_cutedsl_candidates(monkeypatch):
    from branchyard.lowering.nvgemm import kernel_config

    monkeypatch.setattr(cands_mod, "cutedsl_available", lambda: (True, ""))
    a, b, ops = _inputs(m=4096)
    problem = Problem.of(a.half(), b.half(), [o.half() for o in ops], SPEC)
    assert len(cands_mod._cutedsl_candidates(problem)) > 1
    monkeypatch.setenv("BRANCHYARD_NVGEMM_MAX_CONFIGS", "1")
    first = kernel_config.candidate_configs(4096, 16, 32, "float16")[0].name
    assert [c.name for c in cands_mod._cutedsl_candidates(problem)] == [f"cutedsl:{first}"]


def test_cutlass_plain_candidate_adds_the_epilogue_after_the_plain_gemm(monkeypatch):
    import sys
    import types

    calls = []
    fake = types.ModuleType("branchyard.lowering.nvgemm.cutlass_operators")
    fake.plain_gemm_available = lambda: (True, "")

    def compile_plain(dtype, b_layout):
        calls.append((dtype, b_layout))
        return lambda a, b_kn, out: torch.mm(a, b_kn, out=out)

    fake.compile_plain_gemm = compile_plain
    monkeypatch.setitem(sys.modules, "branchyard.lowering.nvgemm.cutlass_operators", fake)
    monkeypatch.setattr(sys.modules["branchyard.lowering.nvgemm"], "cutlass_operators", fake, raising=False)
    a, w, ops = torch.randn(8, 32), torch.randn(16, 32), [torch.randn(16)]
    problem = Problem.of(a, w.t(), ops, SPEC)
    (cand,) = cands_mod._cutlass_plain_candidates(problem)
    got = cand.build(problem)(a, w.t(), ops, torch.empty(8, 16))
    torch.testing.assert_close(got, torch.relu(a @ w.t() + ops[0]))
    assert calls == [(torch.float32, "nk")]
    fake.plain_gemm_available = lambda: (False, "no sm90")
    assert cands_mod._cutlass_plain_candidates(problem) == []


def test_cublaslt_gelu_candidate_refuses_a_device_whose_gelu_is_the_erf_form():
    """On CPU, torch's _addmm_activation GELU is the erf form: the probe sees
    it and the gelu_tanh candidate refuses to build (GELUs are never swapped)."""
    assert [cands_mod._addmm_gelu_form("cpu", d) for d in (torch.float32, torch.bfloat16, torch.float16)] == ["erf"] * 3
    a, b, ops = _inputs()
    problem = Problem.of(a, b, ops, EpilogueSpec.parse("w=kn;bias@0;gelu_tanh;out=float32"))
    with pytest.raises(LoweringError, match="computes the erf GELU, not the tanh form"):
        cands_mod._cublaslt_build(problem)
    relu = Problem.of(a, b, ops, SPEC)
    torch.testing.assert_close(cands_mod._cublaslt_build(relu)(a, b, ops, torch.empty(8, 16)), torch.relu(a @ b + ops[0]))


def test_inductor_compiles_are_capped_per_process(monkeypatch):
    monkeypatch.setattr(cands_mod, "_INDUCTOR_FNS", {("already",): None})
    monkeypatch.setenv("BRANCHYARD_NVGEMM_INDUCTOR_MAX", "1")
    problem = Problem.of(*_inputs(), SPEC)
    with pytest.raises(LoweringError, match="1 Inductor compiles already made.*BRANCHYARD_NVGEMM_INDUCTOR_MAX"):
        cands_mod._inductor_build(problem, "default")
    # the cap is a limit of this process, not of the problem: the tuner is told before it builds
    inductors = [c for c in cands_mod.default_candidates(problem, inductor=True) if c.name.startswith("triton:")]
    assert [c.name for c in inductors] == ["triton:inductor", "triton:inductor[default]"]
    for inductor in inductors:  # one cap for every mode's compiles
        assert inductor.available(problem).startswith("1 Inductor compiles already made")
    monkeypatch.setenv("BRANCHYARD_NVGEMM_INDUCTOR_MAX", "2")
    assert [c.available(problem) for c in inductors] == [None, None]


def test_the_inductor_candidate_is_named_by_its_mode(monkeypatch):
    problem = Problem.of(*_inputs(), SPEC)
    names = lambda: [c.name for c in cands_mod.default_candidates(problem, inductor=True)]  # noqa: E731
    assert [n for n in names() if "inductor" in n] == ["triton:inductor", "triton:inductor[default]"]
    monkeypatch.setenv("BRANCHYARD_NVGEMM_INDUCTOR_MODE", "default")
    assert [n for n in names() if "inductor" in n] == ["triton:inductor[default]"]
    monkeypatch.setenv("BRANCHYARD_NVGEMM_INDUCTOR_MODE", " reduce-overhead, default,default ")
    assert [n for n in names() if "inductor" in n] == ["triton:inductor[reduce-overhead]", "triton:inductor[default]"]


def test_a_candidate_unavailable_in_one_process_is_raced_where_it_is_available(tmp_path):
    capped = {"now": True}

    def tuner(rec: Recorder) -> Autotuner:
        cands = [dataclasses.replace(c, available=lambda p: "cap reached" if capped["now"] else None)
                 if c.name == "triton" else c for c in rec.candidates()]
        return Autotuner(cands, timer=rec.timer, db=WinnerDB(tmp_path), env=ENV, progress=False)

    rec = Recorder({"ours": 1.0, "triton": 0.5, "aten": 2.0})
    first = tuner(rec)
    first.select(*_inputs(), SPEC)
    (res,) = first.results.values()
    assert res.winner == "ours" and res.unavailable == ["triton"] and "triton" not in rec.builds
    assert res.excluded["triton"] == "not available in this process: cap reached"
    rec2 = Recorder({"ours": 1.0, "triton": 0.5, "aten": 2.0})
    tuner(rec2).select(*_inputs(), SPEC)  # another process at its cap: the entry stands
    assert rec2.timed == [] and rec2.builds == ["ours"]
    capped["now"] = False
    rec3 = Recorder({"ours": 1.0, "triton": 0.5, "aten": 2.0})
    third = tuner(rec3)
    third.select(*_inputs(), SPEC)  # a process that can build it races it
    (res3,) = third.results.values()
    assert rec3.timed == ["ours", "triton", "aten"] and res3.winner == "triton" and not res3.unavailable
    (entry,) = WinnerDB(tmp_path).entries().values()
    assert entry["winner"] == "triton" and entry["unavailable"] == []



@pytest.mark.parametrize(
    "text, lt, addmm",
    [
        ("bias@0;gelu_tanh;residual@1", True, True),
        ("bias@0;relu;cast:float32", True, True),
        ("bias@0;relu", False, True),            # exact for cuBLASLt: the plain candidate covers it
        ("scale:0.5;residual@0;tanh", False, True),
        ("bias@0;gelu_erf;residual@1", False, True),
        ("silu;residual@0", False, False),
    ],
)
def test_prefix_candidates_fuse_what_cublas_can_and_run_the_rest_unfused(text, lt, addmm, monkeypatch):
    a, b = torch.randn(8, 32), torch.randn(32, 16)
    spec = EpilogueSpec.parse(f"w=kn;{text};out=float32")
    ops = [torch.randn(16) if s.op.operand == "col" else torch.randn(8, 16) for s in spec.steps
           if s.op.operand in ("col", "matrix")]
    problem = Problem.of(a, b, ops, spec)
    cuda = Problem(**{**problem.__dict__, "device": "cuda:0"})
    cands = {c.name: c for c in cands_mod.default_candidates(problem, inductor=False)}
    assert (cands["cublaslt:_addmm_activation+aten"].applies(cuda) is None) is lt
    assert (cands["cublas:addmm+aten"].applies(problem) is None) is addmm
    ref = reference_fused_gemm(a, b, ops, spec)
    if addmm:
        got = cands["cublas:addmm+aten"].build(problem)(a, b, ops, torch.empty(8, 16))
        assert tuner_mod.numerics_error(got, ref, torch.float32) is None
    if lt and "gelu" not in text:  # on CPU the relu prefix runs; the GELU one refuses (erf form)
        got = cands["cublaslt:_addmm_activation+aten"].build(problem)(a, b, ops, torch.empty(8, 16))
        assert tuner_mod.numerics_error(got, ref, torch.float32) is None
    elif lt:
        with pytest.raises(LoweringError, match="erf GELU"):
            cands["cublaslt:_addmm_activation+aten"].build(problem)


class DriftingRecorder(Recorder):
    """Each candidate's timings come from a list, one per call (a warming GPU)."""

    def __init__(self, series: dict[str, list[float]]):
        super().__init__({n: s[0] for n, s in series.items()})
        self.series = {n: list(s) for n, s in series.items()}

    def timer(self, name, fn):
        fn()
        self.timed.append(name)
        return self.series[name].pop(0)


def test_close_candidates_are_retimed_round_robin_and_ranked_by_median(tmp_path):
    # "cool" was lucky in the single pass (1.00 vs 1.04); over three more
    # rotated rounds "steady" is faster; "slow" is far off and timed once.
    rec = DriftingRecorder({"cool": [1.00, 1.10, 1.12, 1.09], "steady": [1.04, 1.00, 1.01, 0.99], "slow": [2.0]})
    res = _tuner(rec, tmp_path, rounds=3).tune(*_inputs(), SPEC)
    assert res.winner == "steady"
    assert res.timings == {"cool": pytest.approx(1.095), "steady": pytest.approx(1.005), "slow": 2.0}
    assert res.rounds == {"cool": 4, "steady": 4}
    # first pass in candidate order, then rounds whose first candidate rotates
    assert rec.timed == ["cool", "steady", "slow", "cool", "steady", "steady", "cool", "cool", "steady"]
    entry = json.loads((tmp_path / DB_FILE).read_text())["entries"]
    assert next(iter(entry.values()))["winner"] == "steady"


def test_a_clear_winner_or_zero_rounds_needs_one_pass(tmp_path):
    rec = DriftingRecorder({"fast": [1.0], "slow": [1.5]})
    res = _tuner(rec, tmp_path).tune(*_inputs(), SPEC)
    assert res.winner == "fast" and res.rounds == {} and rec.timed == ["fast", "slow"]
    rec = DriftingRecorder({"a": [1.00], "b": [1.01]})
    res = _tuner(rec, tmp_path / "zero", rounds=0).tune(*_inputs(), SPEC)
    assert res.winner == "a" and res.rounds == {} and rec.timed == ["a", "b"]


def test_round_robin_varies_position_and_neighbours():
    """Every function is timed once per round, at a different position each round,
    and after different functions (a rotation alone keeps the same predecessor)."""
    order: list[str] = []
    fns = {name: (lambda: None) for name in "abcd"}
    samples = timing.time_round_robin(fns, 4, lambda name, fn: order.append(name) or float(len(order)))
    assert {n: len(v) for n, v in samples.items()} == {n: 4 for n in "abcd"}
    rounds = [order[i : i + 4] for i in range(0, 16, 4)]
    assert all(sorted(r) == list("abcd") for r in rounds)
    for name in "abcd":
        assert len({r.index(name) for r in rounds}) > 1, name
        before = {r[r.index(name) - 1] for r in rounds if r.index(name) > 0}
        assert len(before) > 1, f"{name} always follows {before}"
    assert samples["a"] == [float(order_i + 1) for order_i, n in enumerate(order) if n == "a"]


def test_round_order_puts_each_name_in_every_position_and_after_both_neighbours():
    orders = [timing.round_order("abc", r) for r in range(6)]
    assert orders == [list("abc"), list("acb"), list("cab"), list("cba"), list("bca"), list("bac")]
    assert {o.index(n) for o in orders for n in "abc"} == {0, 1, 2}
    after = {(o[i], o[i + 1]) for o in orders for i in range(2)}
    assert after == {(x, y) for x in "abc" for y in "abc" if x != y}
    assert [timing.round_order("ab", r) for r in range(3)] == [list("ab"), list("ba"), list("ab")]
    assert timing.round_order([], 3) == []


def test_paired_order_alternates_which_runs_first():
    assert timing.paired_order(4) == [(0, 1), (1, 0), (0, 1), (1, 0)]
    assert timing.paired_order(0) == []


def test_ratio_summary_is_the_median_of_per_pair_ratios():
    # A drifting clock: both functions slow down together; the per-pair ratio does not move,
    # while the ratio of the two medians would if the pairs' times were not adjacent.
    first = [1.0, 1.1, 1.2, 1.3, 1.4]
    second = [2.0, 2.2, 2.4, 2.6, 2.8]
    med, half_iqr = timing.ratio_summary(first, second)
    assert med == pytest.approx(0.5) and half_iqr == pytest.approx(0.0)
    med, half_iqr = timing.ratio_summary([1.0, 3.0, 2.0], [1.0, 1.0, 1.0])
    assert med == 2.0 and half_iqr > 0
    with pytest.raises(LoweringError, match="paired_ratio: .*2 and 3 timings"):
        timing.ratio_summary([1.0, 2.0], [1.0, 2.0, 3.0])
    with pytest.raises(LoweringError, match="0 and 0"):
        timing.ratio_summary([], [])


class RunRecorder(Recorder):
    """Also records which candidate each call of a built implementation ran."""

    def __init__(self, times):
        super().__init__(times)
        self.ran: list[str] = []

    def candidate(self, name: str) -> Candidate:
        inner = super().candidate(name)

        def build(problem):
            impl = inner.build(problem)
            return lambda *args: (self.ran.append(name), impl(*args))[1]

        return Candidate(name, build)


def test_close_candidates_meet_the_leader_in_a_paired_playoff(tmp_path):
    # Medians: a leads b by 1% and c by 4%; d is outside the 5% playoff margin.
    rec = RunRecorder({"a": 1.00, "b": 1.01, "c": 1.04, "d": 1.20})
    truth = {"a": 1.00, "b": 0.97, "c": 0.99, "d": 0.90}  # what adjacent pairs measure
    met: list[tuple[str, str]] = []

    def pair(f, g):
        rec.ran.clear()
        f(), g()
        met.append(tuple(rec.ran))
        return truth[rec.ran[0]] / truth[rec.ran[1]]

    res = _tuner(rec, tmp_path, rounds=0, pair=pair).tune(*_inputs(), SPEC)
    assert met == [("b", "a"), ("c", "b")]  # b took the lead, then c met b, not a; d never played
    assert res.winner == "b"
    assert [(p["candidate"], p["leader"]) for p in res.playoff] == met
    assert res.playoff[0]["ratio"] == pytest.approx(0.97) and res.playoff[1]["ratio"] == pytest.approx(0.99 / 0.97)
    (entry,) = json.loads((tmp_path / DB_FILE).read_text())["entries"].values()
    assert entry["winner"] == "b" and len(entry["playoff"]) == 2


def test_no_playoff_without_a_pair_function_or_a_close_candidate(tmp_path):
    rec = RunRecorder({"a": 1.00, "b": 1.01})
    res = _tuner(rec, tmp_path / "none", rounds=0).tune(*_inputs(), SPEC)  # custom timer, no pair
    assert res.winner == "a" and res.playoff == []
    calls = []
    rec = RunRecorder({"a": 1.00, "b": 1.50})
    res = _tuner(rec, tmp_path / "far", rounds=0, pair=lambda f, g: calls.append(1) or 0.5).tune(*_inputs(), SPEC)
    assert res.winner == "a" and res.playoff == [] and calls == []
