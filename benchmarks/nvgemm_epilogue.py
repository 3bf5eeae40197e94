"""NVGEMM epilogue fusion on the GPU: our fused CuTeDSL kernel and the
autotuned op against every alternative, per shape and epilogue chain.

Usage (on the H200; ``source .device/env/activate.sh`` first, see docs/gpu.md)::

    # The full sweep (60 rows, about 6 minutes): rows are appended to the JSONL
    # file as they finish; --budget-s stops cleanly before the run's time limit
    # and the same command run again resumes where it stopped (rows recorded
    # with other nvgemm source code are measured again).
    python benchmarks/nvgemm_epilogue.py --budget-s 540 --jsonl .cache/nvgemm_epilogue/rows.jsonl && cp .cache/nvgemm_epilogue/rows.jsonl $OUT/

    # Afterwards, anywhere (no GPU): table, targets, markdown and plot from one or more JSONL files.
    python benchmarks/nvgemm_epilogue.py --merge rows.jsonl --markdown table.md --plot docs/img/nvgemm_epilogue.png

    # A few rows: --m / --nk / --chains select; --inductor-mode off drops the slow column.
    python benchmarks/nvgemm_epilogue.py --m 2048 --nk 4096x4096 --jsonl /tmp/smoke.jsonl

Shapes: M in {1, 16, 128, 2048, 8192} x (N, K) in {(4096, 4096),
(14336, 4096), (4096, 14336)}, weights laid out like ``nn.Linear`` ([N, K]),
bfloat16. Chains: bias+gelu(erf), bias+silu, bias+gelu(tanh)+residual,
scale+residual.

Columns (median microseconds of CUDA-event timings, a 256 MiB buffer zeroed
before every timed run so L2 holds none of the operands; each callable is
captured in a CUDA graph and its replays are timed, so every column is device
time and none pays for host dispatch -- ``--timing eager`` times plain calls;
every column of a row is built and checked first, then all are timed together,
round-robin over ``--rounds`` rotated rounds after ``--heat-s`` of warm-up GEMMs,
because the H200's clock drifts by up to 15% as it heats):

* ``mm``       -- plain ``torch.mm`` (no epilogue: the floor a fused kernel aims at)
* ``aten``     -- the unfused ATen chain (``mm`` then one kernel per op)
* ``cublas``   -- cuBLAS(Lt) doing what it can of the chain in its epilogue,
                  the rest as ATen ops; the best of the variants that apply
                  (named in ``cublas_pick``): ``_addmm_activation`` for a
                  bias+gelu_tanh / bias+relu prefix (cuBLASLt's fused
                  epilogues), ``addmm``'s C input for a [scale +] bias or
                  residual prefix (e.g. bias+gelu_erf = addmm, then gelu)
* ``inductor`` -- the same unfused chain compiled by Inductor with the options of
                  ``mode="max-autotune-no-cudagraphs"``, for the exact shape, without
                  Dynamo (the op's ``triton:inductor`` candidate);
                  ``inductor_compile_s`` in the JSON is what that compile cost
* ``ours``     -- our CuTeDSL kernel, the best of its tile configs (named in ``config``)
* ``op``       -- ``torch.ops.branchyard.fused_gemm_epilogue`` end to end,
                  after the op's own autotuner picked (named in ``picked``)
                  among the candidates of docs/nvgemm.md, with a fresh winner
                  database (it really tunes); the JSON also has ``op_eager_host``,
                  the op called eagerly (its Python dispatch included)

How the sweep stays tractable without handicapping a column:

* Inductor runs its default max-autotune search (GEMM backends ``ATEN,TRITON``
  -- the default list minus ``CPP``, which is for CPU tensors --, the
  ``DEFAULT`` Triton config space, epilogue-fusion benchmarking on, compile
  threads = every core). Rows run chain-innermost, so the four chains of one
  shape share Inductor's GEMM autotuning through its own caches (in-process,
  the autotune/FX-graph/Triton caches under ``--cache-dir``, which also serve
  a resumed run). Each row records its compile seconds; the summary prints
  them.
* Our CuTeDSL kernels (one compile per chain and tile config, shapes are not
  baked in) are compiled up front by ``--prebuild-workers`` processes into the
  on-disk kernel cache (docs/nvgemm.md), which the timed rows then load in
  milliseconds.
* The cutlass-operators plain GEMM candidate compiles per shape, so it is
  offered to the op's autotuner only with ``--cutlass-plain``.

Targets checked at the end: at M >= 2048 ``ours`` within 1.05x of ``mm``;
geomean over M >= 2048 of (best alternative not ours) / ours >= 1.10; the
autotuned op end to end within 2% of the best column. Each is judged twice:
on the round-robin medians, and on ratios measured again in ``--pairs``
adjacent pairs against every column within 5% of the best
(:func:`paired_checks`; the ``paired`` object of a JSON row), which see one
clock per pair and are not biased by the choice of the best column.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import importlib.metadata
import json
import math
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_graph_replay import graph_replay  # noqa: E402

M_ALL = [1, 16, 128, 2048, 8192]
NK_ALL = [(4096, 4096), (14336, 4096), (4096, 14336)]
CHAINS = {
    "bias+gelu_erf": "bias@0;gelu_erf",
    "bias+silu": "bias@0;silu",
    "bias+gelu_tanh+res": "bias@0;gelu_tanh;residual@1",
    "scale+res": "scale:0.5;residual@0",
}
LARGE_M = 2048
COLUMNS = ["mm", "aten", "cublas", "inductor", "ours", "op"]
#: Columns a row's "best candidate" is taken over (the op picks among these kinds).
CANDIDATE_COLUMNS = ("aten", "cublas", "inductor", "ours")
DEFAULT_DIR = Path(".cache") / "nvgemm_epilogue"


def versions() -> dict[str, str]:
    def pkg(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "none"

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    return {
        "gpu": gpu,
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "python": platform.python_version(),
        "cutedsl": pkg("nvidia-cutlass-dsl"),
        "triton": pkg("triton"),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def row_id(row: dict) -> tuple:
    return (row["m"], row["n"], row["k"], row["chain"], row.get("dtype", "bfloat16"))


def make_inputs(m, n, k, text, dtype, seed=0):
    from branchyard.lowering.nvgemm.epilogue import EpilogueSpec

    spec = EpilogueSpec.parse(f"w=nk;{text};out={str(dtype).removeprefix('torch.')}")
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = (torch.randn(m, k, generator=g, device="cuda") / k**0.25).to(dtype)
    w = (torch.randn(n, k, generator=g, device="cuda") / k**0.25).to(dtype)
    ops = []
    for st in spec.steps:
        if st.op.operand == "col":
            ops.append(torch.randn(n, generator=g, device="cuda").to(dtype))
        elif st.op.operand == "matrix":
            ops.append(torch.randn(m, n, generator=g, device="cuda").to(dtype))
    return a, w, ops, spec


def cublas_variants(problem, a, b_kn, ops, ref, row) -> dict:
    """The cuBLAS(Lt) epilogue variants that apply and compute the chain right:
    ``_addmm_activation`` where the chain starts with bias+relu /
    bias+gelu_tanh, ``addmm``'s C input for a [scale +] bias / residual
    prefix, the rest of the chain as ATen ops (the op's ``cublas*``
    candidates). The ``cublas`` column is the fastest of them."""
    from branchyard.lowering.nvgemm import candidates as nv_candidates
    from branchyard.lowering.nvgemm import tuner as nv_tuner

    found = {}
    out = torch.empty(problem.m, problem.n, dtype=problem.spec.out_dtype, device="cuda")
    for cand in nv_candidates.default_candidates(problem, inductor=False):
        if not cand.name.startswith("cublas") or cand.applies(problem) is not None:
            continue
        try:
            impl = cand.build(problem)
            got = impl(a, b_kn, ops, out)
            bad = nv_tuner.numerics_error(out if got is None else got, ref, problem.spec.out_dtype)
        except Exception as exc:  # report, keep benchmarking
            row["notes"].append(f"{cand.name} failed: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        if bad:
            row["notes"].append(f"{cand.name} wrong: {bad}")
            continue
        found[cand.name] = lambda impl=impl: impl(a, b_kn, ops, out)
    return found


# --- setup: caches, Inductor settings, the CuTeDSL prebuild ----------------------------


def setup_caches(cache_dir: Path) -> None:
    """Point our kernel cache and Inductor's/Triton's caches into ``cache_dir``
    (unless the environment already chose), so a resumed run reuses them."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("BRANCHYARD_CACHE_DIR", str(cache_dir / "branchyard"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(cache_dir / "triton"))


def configure_inductor(args) -> dict:
    """Apply the Inductor settings of this run; returns them for the JSON."""
    import torch._inductor.config as ic

    ic.max_autotune_gemm_backends = args.inductor_backends
    ic.max_autotune_gemm_search_space = args.inductor_search_space
    if args.compile_threads:
        ic.compile_threads = args.compile_threads
    # The op's Inductor candidate compiles with the same mode, so it reuses the column's compile.
    os.environ["BRANCHYARD_NVGEMM_INDUCTOR_MODE"] = args.inductor_mode
    return {
        "mode": args.inductor_mode,
        "gemm_backends": ic.max_autotune_gemm_backends,
        "search_space": getattr(ic, "max_autotune_gemm_search_space", "n/a"),
        "compile_threads": getattr(ic, "compile_threads", "n/a"),
        "benchmark_epilogue_fusion": getattr(ic, "benchmark_epilogue_fusion", "n/a"),
        "cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
    }


def _prebuild_worker(jobs: list) -> list:
    """Compile (spec, dtype, config, layout, operand dtypes) jobs into the disk kernel cache."""
    from branchyard.lowering.nvgemm import cutedsl_gemm as cg
    from branchyard.lowering.nvgemm.epilogue import EpilogueSpec

    done = []
    for spec_text, dtype, config, b_layout, out_dtype, operand_dtypes in jobs:
        t0 = time.perf_counter()
        try:
            cg.compile_fused_gemm(EpilogueSpec.parse(spec_text), dtype, config, b_layout=b_layout, out_dtype=out_dtype,
                                  operand_dtypes=operand_dtypes)
            done.append((spec_text, config.name, time.perf_counter() - t0, None))
        except Exception as exc:  # the timed row reports it again, with its reason
            done.append((spec_text, config.name, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}"[:300]))
    return done


def prebuild(plan: list[tuple], dtype, args) -> None:
    """Compile every CuTeDSL kernel the rows will time, in parallel processes,
    into the on-disk kernel cache (the rows then load them)."""
    from branchyard.lowering.nvgemm import candidates as nv_candidates
    from branchyard.lowering.nvgemm import problem as nv_problem

    jobs = {}
    for m, n, k, chain in plan:
        a = torch.empty(m, k, dtype=dtype, device="cuda")
        w = torch.empty(n, k, dtype=dtype, device="cuda")
        _, _, ops, spec = make_inputs(1, n, k, CHAINS[chain], dtype)
        ops = [t if t.dim() == 1 else torch.empty(m, n, dtype=dtype, device="cuda") for t in ops]
        problem = nv_problem.Problem.of(a, w.t(), ops, spec)
        for cand in nv_candidates._cutedsl_candidates(problem)[: args.max_configs]:
            config = getattr(cand.build, "keywords", {}).get("config")
            if config is None:  # not a plain config candidate: its row compiles it
                continue
            key = (str(problem.spec), config)
            jobs[key] = (str(problem.spec), str(dtype).removeprefix("torch."), config, problem.b_layout,
                         str(problem.spec.out_dtype).removeprefix("torch."),
                         [str(d).removeprefix("torch.") for d in problem.operand_dtypes])
    if not jobs:
        return
    workers = max(1, min(args.prebuild_workers, len(jobs)))
    t0 = time.time()
    batches = [list(jobs.values())[i::workers] for i in range(workers)]
    ctx = multiprocessing.get_context("spawn")  # CUDA-safe workers
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        results = [r for batch in pool.map(_prebuild_worker, batches) for r in batch]
    failed = [r for r in results if r[3]]
    print(f"prebuild: {len(jobs)} CuTeDSL kernels in {time.time() - t0:.1f}s with {workers} processes "
          f"(slowest {max(r[2] for r in results):.1f}s){'; failed: ' + str(failed[:3]) if failed else ''}",
          flush=True)


# --- one row --------------------------------------------------------------------------


#: H200 limits no timing of a whole GEMM can beat: dense 16-bit wgmma peak and HBM bandwidth.
_PEAK_FLOPS, _PEAK_BYTES_S = 0.99e15, 4.8e12


class ColumnTimer:
    """Times a row's columns side by side: median µs, L2 flushed before every run.

    Every callable is first *prepared*: captured once in a CUDA graph whose
    replays are timed (``--timing graph``, the default), so every column is
    the device time of its kernels and none pays for host dispatch (at M <= 128
    a GEMM takes ~20 µs, less than the Python and launch overhead of a
    multi-kernel chain, a compiled function's guards or a custom op). A
    callable that cannot be captured is timed eagerly and the row says so, as
    is one whose replay beats ``floor_us`` (the GEMM's FLOPs at peak or its
    weight read at full HBM bandwidth): work launched outside the capture
    would not be in the graph. Then :meth:`run` times all columns in
    ``--rounds`` rounds, each round in a rotated order, and keeps each
    column's median over the rounds: the H200's clock drifts by up to 15%
    as it heats, so timing columns one after another (or after an idle
    compile) would bias whichever came first.
    """

    def __init__(self, args, row, floor_us: float = 0.0) -> None:
        from branchyard.lowering.nvgemm import timing as nv_timing

        self.args, self.row, self.floor_us = args, row, floor_us
        self._timer = nv_timing.cuda_event_timer
        self._round_robin = nv_timing.time_round_robin
        self.replays: dict[str, Callable] = {}

    def eager(self, fn, device_only: bool = True) -> float:
        return self._timer(fn, reps=self.args.reps, device_only=device_only) * 1e3

    def add(self, name: str, fn: Callable) -> None:
        if self.args.timing == "eager":
            self.replays[name] = fn
            return
        try:
            replay = graph_replay(fn)
        except Exception as exc:
            torch.cuda.synchronize()
            self.row["notes"].append(f"{name}: CUDA-graph capture failed ({type(exc).__name__}: {str(exc)[:120]}); timed eagerly")
            self.replays[name] = fn
            return
        t = self._timer(replay, reps=5) * 1e3
        if t < 0.9 * self.floor_us:
            self.row["notes"].append(f"{name}: a graph replay took {t:.1f} us, below the {self.floor_us:.1f} us floor; timed eagerly")
            self.replays[name] = fn
            return
        self.replays[name] = replay

    def run(self) -> dict[str, float]:
        # Graph replays: device time. --timing eager: what an eager caller waits for.
        device_only = self.args.timing != "eager"
        samples = self._round_robin(self.replays, max(1, self.args.rounds),
                                    lambda name, fn: self.eager(fn, device_only=device_only))
        return {n: statistics.median(v) for n, v in samples.items()}


def heat_gpu(seconds: float) -> None:
    """Run large GEMMs for ``seconds`` so the rows start at the clock they keep."""
    a = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16)
    end = time.time() + seconds
    while time.time() < end:
        for _ in range(20):
            torch.mm(a, b)
        torch.cuda.synchronize()


def run_row(m, n, k, chain, dtype, args, db_dir) -> dict:
    from branchyard.lowering.nvgemm import candidates as nv_candidates
    from branchyard.lowering.nvgemm import problem as nv_problem
    from branchyard.lowering.nvgemm import tuner as nv_tuner
    from branchyard.lowering.nvgemm import winners as nv_winners
    from branchyard.lowering.nvgemm import NvGemmFallbackWarning, fused_gemm_epilogue, timing_mode
    from branchyard.lowering.nvgemm.epilogue import reference_fused_gemm, unfused_aten_epilogue

    a, w, ops, spec = make_inputs(m, n, k, CHAINS[chain], dtype)
    b_kn = w.t()
    problem = nv_problem.Problem.of(a, b_kn, ops, spec)
    ref = reference_fused_gemm(a, w, ops, spec)
    row: dict = {"m": m, "n": n, "k": k, "chain": chain, "dtype": str(dtype).removeprefix("torch."), "notes": []}
    floor_us = max(2.0 * m * n * k / _PEAK_FLOPS, 2.0 * n * k / _PEAK_BYTES_S) * 1e6
    cols = ColumnTimer(args, row, floor_us)

    # Build (and check) every column first; time them together at the end.
    cols.add("mm", lambda: torch.mm(a, b_kn))
    cols.add("aten", lambda: unfused_aten_epilogue(torch.mm(a, b_kn), problem.spec, ops))
    for name, fn in cublas_variants(problem, a, b_kn, ops, ref, row).items():
        cols.add("cublas|" + name, fn)

    row["inductor"] = row["inductor_compile_s"] = None
    if args.inductor_mode != "off":
        t0 = time.perf_counter()
        try:
            impl = nv_candidates._inductor_build(problem, args.inductor_mode)
            before = set(nv_candidates._INDUCTOR_FNS)
            got = impl(a, b_kn, ops, None)  # the compile happens on this first call
            torch.cuda.synchronize()
            row["inductor_compile_s"] = round(time.perf_counter() - t0, 2)
            eager = [getattr(fn, "eager_reason", None) for key, fn in nv_candidates._INDUCTOR_FNS.items()
                     if key not in before]
            bad = nv_tuner.numerics_error(got, ref, dtype)
            if any(eager):
                row["notes"].append(f"inductor not compiled: {eager[0]}")
            elif bad:
                row["notes"].append(f"inductor wrong: {bad}")
            else:
                cols.add("inductor", lambda impl=impl: impl(a, b_kn, ops, None))
        except Exception as exc:  # report, keep benchmarking
            row["inductor_compile_s"] = round(time.perf_counter() - t0, 2)
            row["notes"].append(f"inductor failed: {type(exc).__name__}: {str(exc)[:200]}")

    out = torch.empty(m, n, dtype=spec.out_dtype, device="cuda")
    for cand in nv_candidates._cutedsl_candidates(problem)[: args.max_configs]:
        name = cand.name.removeprefix("cutedsl:")
        try:
            impl = cand.build(problem)
            out.fill_(float("nan"))
            got = impl(a, b_kn, ops, out)
            torch.cuda.synchronize()
        except Exception as exc:
            row["notes"].append(f"{name} failed: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        bad = nv_tuner.numerics_error(got, ref, dtype)
        if bad:
            row["notes"].append(f"{name} wrong: {bad}")
            continue
        cols.add("ours|" + name, lambda impl=impl: impl(a, b_kn, ops, out))

    # The op end to end with its own autotuner (a fresh database: it really tunes).
    def candidates(p):
        cands = nv_candidates.default_candidates(p, inductor="inductor" in cols.replays)
        cut = [c for c in cands if c.name.startswith("cutedsl:")][: args.max_configs]
        rest = [c for c in cands if not c.name.startswith("cutedsl:")]
        if not args.cutlass_plain:
            rest = [c for c in rest if not c.name.startswith("cutlass_plain")]
        return cut + rest

    tuner = nv_tuner.Autotuner(candidates, db=nv_winners.WinnerDB(db_dir), progress=not args.no_progress)
    nv_tuner.set_autotuner(tuner)
    text = str(spec)
    row["op"], row["picked"] = None, None
    # The op tunes for the way this row times it: device time for graph replays.
    with timing_mode("host" if args.timing == "eager" else "device"):
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                fused_gemm_epilogue(a, w, ops, text)  # tunes
            fallback = [str(x.message) for x in caught if issubclass(x.category, NvGemmFallbackWarning)]
            if fallback:
                row["notes"].append(fallback[0])
                row["picked"] = "unfused"
            else:
                cols.add("op", lambda: fused_gemm_epilogue(a, w, ops, text))
                (res,) = tuner.results.values()
                row["picked"] = res.winner
                row["picked_tuned_us"] = res.timings[res.winner] * 1e3
                row["tuned_us"] = {name: ms * 1e3 for name, ms in res.timings.items()}
                row["excluded"] = res.excluded
                row["playoff"] = res.playoff

            times = cols.run()
            if args.pairs > 0:
                row["paired"] = paired_checks(cols.replays, times, args.pairs)
            if "op" in times:
                # As an eager caller sees it: the op's Python dispatch is not hidden by a graph.
                row["op_eager_host"] = cols.eager(lambda: fused_gemm_epilogue(a, w, ops, text), device_only=False)
        finally:
            nv_tuner.set_autotuner(None)

    def best(prefix):
        got = {name.split("|", 1)[1]: t for name, t in times.items() if name.startswith(prefix + "|")}
        return (min(got.values()), min(got, key=got.get), got) if got else (None, None, {})

    row["mm"], row["aten"] = times.get("mm"), times.get("aten")
    row["cublas"], row["cublas_pick"], row["cublas_variants"] = best("cublas")
    row["inductor"] = times.get("inductor")
    row["ours"], row["config"], row["ours_configs"] = best("ours")
    row["op"] = times.get("op")
    return row


#: Columns re-timed in pairs: those whose round-robin median is within this factor of the best.
PAIRED_MARGIN = 1.05


def paired_checks(replays: dict[str, Callable], times: dict[str, float], pairs: int) -> dict:
    """Re-measure the three ratios the targets are judged on in adjacent pairs
    (``autotune.paired_ratio``: both of a pair at the same clock, a fresh
    measurement not biased by having chosen the best column from the same
    timings). Every column within :data:`PAIRED_MARGIN` of the best round-robin
    median is a contender:

    * ``ours_vs_mm``: the best of our contender configs against ``mm``;
    * ``speedup``: that config against each contending alternative not ours
      (aten, cublas variants, inductor); the smallest alt/ours ratio;
    * ``op_vs_best``: the op against each contending candidate column; the
      largest op/column ratio (the op against the truly fastest);
    * ``control``: the best column against itself, the method's noise floor.
    """
    from branchyard.lowering.nvgemm import timing as nv_timing

    def contenders(names):
        got = {n: times[n] for n in names if n in times}
        return [n for n, t in got.items() if t <= PAIRED_MARGIN * min(got.values())] if got else []

    def ratio(first, second):
        med, half_iqr = nv_timing.paired_ratio(replays[first], replays[second], pairs=pairs)
        return {"ratio": med, "half_iqr": half_iqr, "first": first, "second": second}

    kind = lambda name: name.split("|", 1)[0]
    candidates = [n for n in times if kind(n) in CANDIDATE_COLUMNS]
    ours = contenders(n for n in candidates if kind(n) == "ours")
    alts = contenders(n for n in candidates if kind(n) != "ours")
    out: dict = {"pairs": pairs}
    if ours and "mm" in times:
        out["ours_vs_mm"] = min((ratio(n, "mm") for n in ours), key=lambda r: r["ratio"])
        best_ours = out["ours_vs_mm"]["first"]
        if alts:
            out["speedup"] = min((ratio(n, best_ours) for n in alts), key=lambda r: r["ratio"])
    if "op" in times and candidates:
        out["op_vs_best"] = max((ratio("op", n) for n in contenders(candidates)), key=lambda r: r["ratio"])
    if candidates:
        best = min(candidates, key=times.get)
        out["control"] = ratio(best, best)
    return out


def paired(row: dict, key: str) -> float | None:
    got = (row.get("paired") or {}).get(key)
    return got["ratio"] if got else None


# --- summary -------------------------------------------------------------------------


def derived(row: dict) -> dict:
    alts = [row[c] for c in ("aten", "cublas", "inductor") if row.get(c) is not None]
    best_alt = min(alts) if alts else None
    every = [row[c] for c in CANDIDATE_COLUMNS if row.get(c) is not None]
    best = min(every) if every else None
    return {
        "ours_vs_mm": row["ours"] / row["mm"] if row.get("ours") else None,
        "speedup": best_alt / row["ours"] if row.get("ours") and best_alt else None,
        "op_vs_best": row["op"] / best if row.get("op") and best else None,
    }


def fmt(x, spec="{:.1f}"):
    return "-" if x is None else spec.format(x)


def table_lines(rows: list[dict]) -> list[str]:
    head = (f"{'M':>5} {'N':>6} {'K':>6} {'chain':<19}" + "".join(f"{c:>9}" for c in COLUMNS)
            + f" {'ours/mm':>8} {'speedup':>8} {'op/best':>8} {'p:o/mm':>7} {'p:spd':>6} {'p:op':>6}"
            + f" {'ind_s':>6}  {'config':<20} picked")
    lines = [head, "-" * len(head)]
    for r in rows:
        d = derived(r)
        lines.append(
            f"{r['m']:>5} {r['n']:>6} {r['k']:>6} {r['chain']:<19}"
            + "".join(f"{fmt(r.get(c)):>9}" for c in COLUMNS)
            + f" {fmt(d['ours_vs_mm'], '{:.3f}'):>8} {fmt(d['speedup'], '{:.2f}x'):>8}"
            + f" {fmt(d['op_vs_best'], '{:.3f}'):>8} {fmt(paired(r, 'ours_vs_mm'), '{:.3f}'):>7}"
            + f" {fmt(paired(r, 'speedup'), '{:.3f}'):>6} {fmt(paired(r, 'op_vs_best'), '{:.3f}'):>6}"
            + f" {fmt(r.get('inductor_compile_s'), '{:.0f}'):>6}"
            + f"  {r.get('config') or '-':<20} {r.get('picked', '-')}"
        )
    return lines


def picked_column_vs_best(row: dict) -> float | None:
    """The benchmark's own time of the implementation the op picked, over the
    best column's; ``None`` where the pick has no column of its own."""
    picked = row.get("picked") or ""
    kind, _, name = picked.partition(":")
    times = {
        "cutedsl": (row.get("ours_configs") or {}).get(name),
        "triton": row.get("inductor"),
        "aten": row.get("aten"),
    }
    t = (row.get("cublas_variants") or {}).get(picked) if kind.startswith("cublas") else times.get(kind)
    every = [row[c] for c in CANDIDATE_COLUMNS if row.get(c) is not None]
    return t / min(every) if t and every else None


def target_lines(rows: list[dict], ratio: Callable[[dict, str], float | None], label: str) -> list[str]:
    """The issue's three targets on one measure, each with PASS/FAIL and its
    numbers; ``ratio(row, key)`` gives a row's ``ours_vs_mm``, ``speedup`` and
    ``op_vs_best`` (``None`` where the row has none)."""
    large = [r for r in rows if r["m"] >= LARGE_M]
    where = lambda r: f"M={r['m']} N={r['n']} K={r['k']} {r['chain']}"
    out = []
    near = [(x, r) for r in large if (x := ratio(r, "ours_vs_mm")) is not None]
    if near:
        ok = sum(1 for x, _ in near if x <= 1.05)
        worst, wr = max(near, key=lambda t: t[0])
        out.append(f"[{'PASS' if ok == len(near) else 'FAIL'}] ({label}) ours within 1.05x of plain mm at "
                   f"M>={LARGE_M}: {ok}/{len(near)} rows (worst {worst:.3f}x: {where(wr)})")
    sp = [x for r in large if (x := ratio(r, "speedup")) is not None]
    if sp:
        geo = math.exp(sum(math.log(x) for x in sp) / len(sp))
        no_inductor = sum(1 for r in large if r.get("inductor") is None)
        out.append(f"[{'PASS' if geo >= 1.10 else 'FAIL'}] ({label}) geomean speedup of ours over the best non-ours "
                   f"alternative at M>={LARGE_M}: {geo:.3f}x (target >= 1.10x) over {len(sp)} rows"
                   + (f"; {no_inductor} of them without an Inductor time" if no_inductor else ""))
    ob = [(x, r) for r in rows if (x := ratio(r, "op_vs_best")) is not None]
    if ob:
        bad = [x for x, _ in ob if x > 1.02]
        worst, wr = max(ob, key=lambda t: t[0])
        out.append(f"[{'PASS' if not bad else 'FAIL'}] ({label}) autotuned op (end to end) within 2% of the best "
                   f"candidate column: {len(ob) - len(bad)}/{len(ob)} rows (worst {worst:.3f}x: {where(wr)}, "
                   f"picked {wr.get('picked')})")
    return out


def paired_control_line(rows: list[dict]) -> list[str]:
    ctl = [(x, r) for r in rows if (x := paired(r, "control")) is not None]
    if not ctl:
        return []
    dev, dr = max(ctl, key=lambda t: abs(t[0] - 1.0))
    spread = max(r["paired"]["control"]["half_iqr"] for _, r in ctl)
    return [f"(info) paired control, the best column against itself: worst {dev:.4f} "
            f"(M={dr['m']} N={dr['n']} K={dr['k']} {dr['chain']}); largest half-IQR of a pair ratio {spread:.4f}"]


def targets(rows: list[dict]) -> list[str]:
    """The issue's three targets, first on the round-robin medians of the
    table, then on the paired re-measurements, and the informative lines."""
    out = target_lines(rows, lambda r, key: derived(r)[key], "round-robin")
    # op_eager_host: host-inclusive (rows from before f39b209 call it op_eager; rows from f39b209
    # to this change have an op_eager timed as device time, which says nothing of the host)
    eager = [(r["op_eager_host"] / min(r[c] for c in CANDIDATE_COLUMNS if r.get(c) is not None), r) for r in rows
             if r.get("op_eager_host") is not None and any(r.get(c) is not None for c in CANDIDATE_COLUMNS)]
    if eager:
        worst, wr = max(eager, key=lambda t: t[0])
        out.append(f"(info) the op called eagerly (host dispatch included) vs the best column: "
                   f"{sum(1 for x, _ in eager if x <= 1.02)}/{len(eager)} rows within 2% (worst {worst:.3f}x at "
                   f"M={wr['m']} N={wr['n']} K={wr['k']} {wr['chain']})")
    pick_cols = [(x, r) for r in rows if (x := picked_column_vs_best(r)) is not None]
    if pick_cols:
        worst, wr = max(pick_cols, key=lambda t: t[0])
        out.append(f"(info) the column of the implementation the op picked vs the best column (the pick, "
                   f"without the op column's own timing noise): {sum(1 for x, _ in pick_cols if x <= 1.02)}/"
                   f"{len(pick_cols)} rows within 2% (worst {worst:.3f}x: M={wr['m']} N={wr['n']} K={wr['k']} "
                   f"{wr['chain']}, picked {wr.get('picked')})")
    picked = [r for r in rows if r.get("picked_tuned_us") is not None]
    if picked:
        ratios = [r["picked_tuned_us"] / min(r[c] for c in CANDIDATE_COLUMNS if r.get(c) is not None) for r in picked]
        out.append(f"(info) the pick's time as the op's autotuner measured it vs the best column: worst {max(ratios):.3f}x")
    compiles = [r["inductor_compile_s"] for r in rows if r.get("inductor_compile_s") is not None]
    if compiles:
        out.append(f"(info) Inductor compile: {sum(compiles):.0f}s over {len(compiles)} rows "
                   f"(mean {sum(compiles) / len(compiles):.1f}s, max {max(compiles):.1f}s)")
    return out + target_lines(rows, paired, "paired") + paired_control_line(rows)


def markdown(rows: list[dict], env: dict) -> str:
    ind = env.get("inductor") or {}
    lines = [
        f"Machine: {env['gpu']}; torch {env['torch']} (CUDA {env['cuda']}), Python {env['python']}, "
        f"CuTeDSL {env['cutedsl']}, Triton {env['triton']}; {env['date']}. Median µs, L2 flushed before "
        "every run; bfloat16, weights [N, K] (nn.Linear layout). Inductor: "
        f"mode {ind.get('mode', '?')}, GEMM backends {ind.get('gemm_backends', '?')}, search space "
        f"{ind.get('search_space', '?')}, {ind.get('compile_threads', '?')} compile threads; `ind s` is its compile "
        "time for the row (the chains of one shape share its GEMM autotuning).",
        "",
        "| M | N | K | chain | mm | aten | cublas | inductor | ours | op | ours/mm | speedup | op/best "
        "| paired ours/mm | paired speedup | paired op/best | ind s | picked |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        d = derived(r)
        lines.append(
            f"| {r['m']} | {r['n']} | {r['k']} | {r['chain']} | "
            + " | ".join(fmt(r.get(c)) for c in COLUMNS)
            + f" | {fmt(d['ours_vs_mm'], '{:.3f}')} | {fmt(d['speedup'], '{:.2f}x')} | "
            f"{fmt(d['op_vs_best'], '{:.3f}')} | {fmt(paired(r, 'ours_vs_mm'), '{:.3f}')} | "
            f"{fmt(paired(r, 'speedup'), '{:.2f}x')} | {fmt(paired(r, 'op_vs_best'), '{:.3f}')} | "
            f"{fmt(r.get('inductor_compile_s'), '{:.0f}')} | {r.get('picked', '-')} |"
        )
    lines += ["", *[f"- {t}" for t in targets(rows)]]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chains = list(dict.fromkeys(r["chain"] for r in rows))
    fig, axes = plt.subplots(len(chains), 1, figsize=(12, 3.2 * len(chains)), squeeze=False)
    for ax, chain in zip(axes[:, 0], chains):
        sub = [r for r in rows if r["chain"] == chain]
        labels = [f"{r['m']}\n{r['n']}x{r['k']}" for r in sub]
        width = 0.16
        for i, col in enumerate(["aten", "cublas", "inductor", "ours", "op"]):
            ys = [(r[col] / r["mm"]) if r.get(col) else 0 for r in sub]
            ax.bar([x + (i - 2) * width for x in range(len(sub))], ys, width, label=col)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.axhline(1.05, color="r", lw=0.6, ls=":")
        ax.set_xticks(range(len(sub)))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylabel("time / plain mm")
        ax.set_title(chain)
        ax.legend(fontsize=7, ncol=5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def sort_rows(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda r: (list(CHAINS).index(r["chain"]), r["n"], r["k"], r["m"]))


def emit(rows, env, args) -> None:
    rows = sort_rows(rows)
    if args.markdown:
        Path(args.markdown).write_text(markdown(rows, env))
    if args.plot:
        plot(rows, args.plot)
    notes = [(r, n) for r in rows for n in r.get("notes", [])]
    if notes:
        print("\nnotes:")
        for r, n in notes:
            print(f"  M={r['m']} N={r['n']} K={r['k']} {r['chain']}: {n}")
    print(f"\n{env['gpu']} | torch {env['torch']} | CUDA {env['cuda']} | python {env['python']} | "
          f"cutedsl {env['cutedsl']} | {env['date']} | inductor {env.get('inductor')}")
    print("\n".join(table_lines(rows)))
    print("\n".join(targets(rows)))


# --- the JSONL record ---------------------------------------------------------------------


def read_jsonl(path: Path) -> tuple[dict | None, dict[tuple, dict]]:
    """(first env, rows by id; a later line for the same row wins). A torn
    last line (a run killed mid-write) is skipped."""
    env, rows = None, {}
    if not path.exists():
        return env, rows
    text = path.read_text()
    if path.suffix == ".json":  # an earlier run's single JSON file
        data = json.loads(text)
        return data["env"], {row_id(r): r for r in data["rows"]}
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("kind") == "env":
            env = env or rec["env"]
        elif rec.get("kind") == "row":
            rows[row_id(rec["row"])] = rec["row"]
    return env, rows


def append_jsonl(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def code_version() -> str:
    """The nvgemm package's source hash (what the kernel cache keys on too)."""
    from branchyard.lowering.nvgemm.cutedsl_gemm import _source_digest

    return _source_digest()


def plan_rows(ms, nks, chains) -> list[tuple]:
    """Chain innermost: the chains of one shape share Inductor's GEMM autotuning."""
    return [(m, n, k, chain) for n, k in nks for m in ms for chain in chains]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", type=int, nargs="*", help="M values (default: all five)")
    p.add_argument("--nk", nargs="*", help="N x K pairs, e.g. 4096x14336 (default: all three)")
    p.add_argument("--chains", nargs="*", choices=list(CHAINS), help="chains (default: all four)")
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--max-configs", type=int, default=99, help="CuTeDSL tile configs per shape (default: all)")
    p.add_argument("--inductor-mode", default="max-autotune-no-cudagraphs",
                   help="torch.compile mode for the Inductor column, or 'off'")
    p.add_argument("--inductor-backends", default="ATEN,TRITON",
                   help="Inductor's max_autotune_gemm_backends (default: its default minus CPU-only CPP)")
    p.add_argument("--inductor-search-space", choices=["DEFAULT", "EXHAUSTIVE"], default="DEFAULT")
    p.add_argument("--compile-threads", type=int, default=None, help="Inductor compile threads (default: its own)")
    p.add_argument("--cutlass-plain", action="store_true",
                   help="offer the cutlass-operators plain GEMM to the op's autotuner (compiles per shape)")
    p.add_argument("--prebuild-workers", type=int, default=min(16, os.cpu_count() or 1),
                   help="processes compiling the CuTeDSL kernels up front (0: compile in the rows)")
    p.add_argument("--reps", type=int, default=15, help="timed runs per column per round")
    p.add_argument("--rounds", type=int, default=3, help="round-robin rounds over a row's columns (median kept)")
    p.add_argument("--pairs", type=int, default=40,
                   help="adjacent pairs per paired re-measurement of the targets' ratios (0: skip)")
    p.add_argument("--heat-s", type=float, default=5.0, help="seconds of large GEMMs before the first row")
    p.add_argument("--timing", choices=["graph", "eager"], default="graph",
                   help="time CUDA-graph replays of each callable (device time, default) or eager calls")
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop before a row that would end past this many seconds from the start")
    p.add_argument("--jsonl", default=str(DEFAULT_DIR / "rows.jsonl"),
                   help="append each finished row here; rows already in it (measured with the same nvgemm source) are skipped: resume")
    p.add_argument("--fresh", action="store_true", help="re-measure rows already in --jsonl")
    p.add_argument("--cache-dir", default=str(DEFAULT_DIR / "cache"),
                   help="our kernel cache and Inductor's/Triton's caches (kept for resumed runs)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--markdown"), p.add_argument("--plot")
    p.add_argument("--merge", nargs="*", help="combine JSONL (or JSON) files from earlier runs; no GPU work")
    args = p.parse_args(argv)

    if args.merge:
        rows, env = {}, None
        for f in args.merge:
            e, r = read_jsonl(Path(f))
            env = env or e
            rows.update(r)
        if not rows:
            print("no rows in " + ", ".join(args.merge), file=sys.stderr)
            return 2
        emit(list(rows.values()), env or {k: "?" for k in ("gpu", "torch", "cuda", "python", "cutedsl", "triton", "date")},
             args)
        return 0

    if not torch.cuda.is_available():
        print("needs a CUDA device (NVIDIA H200 for the reported figures)", file=sys.stderr)
        return 2
    start = time.time()
    setup_caches(Path(args.cache_dir))
    dtype = getattr(torch, args.dtype)
    ms = args.m or M_ALL
    nks = [tuple(int(x) for x in s.split("x")) for s in args.nk] if args.nk else NK_ALL
    plan = plan_rows(ms, nks, args.chains or list(CHAINS))
    jsonl = Path(args.jsonl)
    _, done = read_jsonl(jsonl)
    # Resume only rows measured with this very code (a warm machine keeps the file between runs).
    source = code_version()
    current = {key for key, r in done.items() if r.get("source") == source}
    todo = [t for t in plan if args.fresh or (*t, args.dtype) not in current]
    stale = sum(1 for t in plan if (*t, args.dtype) in done and (*t, args.dtype) not in current)
    print(f"{len(plan)} rows planned, {len(plan) - len(todo)} already in {jsonl}, {len(todo)} to run"
          + (f" ({stale} of them re-measured: recorded with other code)" if stale and not args.fresh else ""),
          flush=True)

    env = versions()
    if args.inductor_mode != "off":
        env["inductor"] = configure_inductor(args)
    append_jsonl(jsonl, {"kind": "env", "env": env})
    if args.prebuild_workers > 0 and todo:
        prebuild(todo, dtype, args)
    # Every row compiles its own Inductor functions; the op's cap on Inductor
    # compiles per process is for serving, not a sweep.
    os.environ.setdefault("BRANCHYARD_NVGEMM_INDUCTOR_MAX", "1000")
    if todo and args.heat_s > 0:
        heat_gpu(args.heat_s)

    rows, spent = [], {}
    with tempfile.TemporaryDirectory() as db_dir:
        for i, (m, n, k, chain) in enumerate(todo):
            first = i == 0 or todo[i - 1][:3] != (m, n, k)  # pays for Inductor's GEMM autotuning
            guess = spent.get((first, m), max(spent.values(), default=0.0))
            if args.budget_s is not None and time.time() - start + 1.25 * guess > args.budget_s:
                print(f"budget: stopping before M={m} N={n} K={k} {chain} ({time.time() - start:.0f}s spent, "
                      f"about {guess:.0f}s needed); {len(todo) - i} rows left -- the same command resumes",
                      flush=True)
                break
            t0 = time.time()
            try:
                row = run_row(m, n, k, chain, dtype, args, db_dir)
            except Exception as exc:  # record it and go on: one broken row must not end the sweep
                row = {"m": m, "n": n, "k": k, "chain": chain, "dtype": args.dtype, "mm": None,
                       "notes": [f"row failed: {type(exc).__name__}: {str(exc)[:300]}"]}
            row["row_s"] = round(time.time() - t0, 1)
            row["source"] = source
            spent[(first, m)] = max(spent.get((first, m), 0.0), row["row_s"])
            rows.append(row)
            append_jsonl(jsonl, {"kind": "row", "row": row})
            print(table_lines([row])[-1] + f"   ({row['row_s']:.0f}s)", flush=True)
            torch.cuda.empty_cache()
    print(f"\n{len(rows)} rows in {time.time() - start:.0f}s", flush=True)
    _, everything = read_jsonl(jsonl)
    emit(list(everything.values()), env, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
