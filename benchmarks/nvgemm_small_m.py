"""Small-M GEMMs against the memory roofline: our small-M CuTeDSL kernel, cuBLAS,
the unfused chain and the tuner's choice, in GB/s and as a share of the measured
device-to-device copy bandwidth (issue 12, part 3).

Usage (on the H200; see docs/gpu.md for the environment)::

    python benchmarks/nvgemm_small_m.py --markdown --json small_m.json
    python benchmarks/nvgemm_small_m.py --m 16 --weights 4096x14336 --chain "bias@0;silu"
    python benchmarks/nvgemm_small_m.py --m 1 --weights 4096x14336 --chain "silu;mul_mm@0"  # a GLU's gate + up
    python benchmarks/nvgemm_small_m.py --dry-run      # CPU smoke at toy sizes (the CPU test runs it)

At M <= 64 a GEMM reads its weight once, so its floor is the weight's bytes
over HBM bandwidth. The roofline is measured, not quoted: ``copy`` is
``dst.copy_(src)`` of a 1 GiB buffer (read + write bytes over time). Each row
is one M and one ``nn.Linear`` weight given as ``KxN`` (in_features x
out_features, bfloat16, stored [N, K]) with the chain ``--chain`` (default
bias + gelu_tanh) after it. Columns (microseconds, median of ``--reps``
replays of a CUDA graph holding one call, each after a 256 MiB L2 flush, so
the weight comes from HBM as it does in a decode step):

* ``small_m``  our small-M kernel, the fastest of its configs (named in ``config``;
               every config's time and any compile error are in the JSON, and
               each config's time is printed under the table, fastest first)
* ``base``     the fastest config of the kernel's first form (one K step at a
               time, 16 weight rows per CTA: ``gemv_m<rows>_w<warps>``);
               ``base/small_m`` > 1 is what the ``unroll`` / ``rows`` variants gained
* ``cublas``   ``F.linear`` (cuBLAS, the bias in its epilogue when the chain starts
               with one), the rest of the chain as ATen ops
* ``unfused``  ``mm`` then one ATen op per step (the program as written)
* ``tuned``    ``torch.ops.branchyard.fused_gemm_epilogue`` after its tuner raced
               every candidate in device-timing mode (named in ``picked``)

The flush (``--flush``) is a 256 MiB *read* by default: L2 is left full of
clean lines, as the previous layers of a decode step leave it (they read
weights and write small activations). ``--flush write`` zeroes 256 MiB
instead (the figures before this option): up to L2's 50 MB of dirty lines are
then written back while the timed call runs, which every column pays, and at
117 MB (4096x14336) that alone caps the share of the copy rate near 70%.

GB/s counts every byte a column must move at least once (weight, input,
epilogue operands, output); ``%copy`` is that over the copy bandwidth. A column
that fails (the kernel does not compile, numerics off) is reported as its
error in the row, and the run goes on.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any, Callable

import torch
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_graph_replay import graph_replay  # noqa: E402

M_VALUES = (1, 16, 64)
#: K x N (in_features x out_features) of the weights the issue names.
WEIGHTS = ("4096x14336", "14336x4096", "1024x4096", "4096x1024", "8192x28672")
COLUMNS = ("small_m", "base", "cublas", "unfused", "tuned")
#: The issue's target: at M <= 16 with a 4096 x 14336 weight, >= 75% of the copy bandwidth.
TARGET = {"m_max": 16, "weight": "4096x14336", "pct_copy": 75.0}


def _parse_weight(text: str) -> tuple[int, int]:
    k, _, n = text.lower().partition("x")
    return int(k), int(n)


# --- timing ---------------------------------------------------------------------


#: How the timer evicts L2 before each timed replay (see the module doc).
FLUSHES = ("read", "write", "none")


class Timer:
    """Median microseconds of ``fn``: on CUDA, graph replays between events after an
    L2 flush (``flush``: a 256 MiB read or write, or none); on CPU, ``perf_counter``
    around calls."""

    def __init__(self, device: torch.device, reps: int, flush: str) -> None:
        if flush not in FLUSHES:
            raise ValueError(f"flush={flush!r}: one of {FLUSHES}")
        self.device, self.reps, self.flush = device, reps, flush
        self.scrub = None
        if flush != "none" and device.type == "cuda":
            self.scrub = torch.zeros(256 << 20, dtype=torch.uint8, device=device)

    def _evict(self) -> None:
        if self.flush == "write":
            self.scrub.zero_()
        else:  # reads every byte, writes one scalar: L2 ends up holding clean lines
            self.scrub.view(torch.int64).sum()

    def graph(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        """``fn`` captured in a CUDA graph after two warm-up calls (``fn`` itself on CPU)."""
        return graph_replay(fn) if self.device.type == "cuda" else fn

    def us(self, fn: Callable[[], Any]) -> float:
        if self.device.type != "cuda":
            samples = []
            for _ in range(self.reps):
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e6)
            return statistics.median(samples)
        events = []
        for _ in range(self.reps):
            if self.scrub is not None:
                self._evict()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) * 1e3 for s, e in events)


def copy_bandwidth(device: torch.device, nbytes: int, reps: int) -> float:
    """Device-to-device copy bandwidth in GB/s: ``2 * nbytes`` (read + write) over the median copy time."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    timer = Timer(device, reps, flush="none")
    dst.copy_(src)
    us = timer.us(lambda: dst.copy_(src))
    return 2 * nbytes / (us * 1e-6) / 1e9


# --- one row ----------------------------------------------------------------------


def make_inputs(m: int, k: int, n: int, chain: str, dtype: torch.dtype, device: torch.device, seed: int = 0):
    from branchyard.lowering.nvgemm.epilogue import EpilogueSpec

    spec = EpilogueSpec.parse(";".join(filter(None, ["w=nk", chain, f"out={str(dtype).removeprefix('torch.')}"])))
    gen = torch.Generator(device=device).manual_seed(seed)
    a = (torch.randn(m, k, generator=gen, device=device) / k**0.25).to(dtype)
    w = (torch.randn(n, k, generator=gen, device=device) / k**0.25).to(dtype)
    ops = []
    for step in spec.steps:
        if step.op.operand == "col":
            ops.append(torch.randn(n, generator=gen, device=device).to(dtype))
        elif step.op.operand == "matrix":
            ops.append(torch.randn(m, n, generator=gen, device=device).to(dtype))
        elif step.op.operand == "weight":  # a second [N, K] weight (its bytes count too)
            ops.append((torch.randn(n, k, generator=gen, device=device) / k**0.25).to(dtype))
    return spec, a, w, ops


def _dual(spec) -> bool:
    return any(step.op.operand == "weight" for step in spec.steps)


def min_bytes(a, w, ops, out_dtype: torch.dtype) -> int:
    m, n = a.shape[0], w.shape[0]
    return sum(t.numel() * t.element_size() for t in (a, w, *ops)) + m * n * torch.empty((), dtype=out_dtype).element_size()


def _error(exc: BaseException) -> str:
    """The whole message (the JSON keeps it; the printed report shortens it)."""
    return f"{type(exc).__name__}: {str(exc).strip()[:8000]}"


def _checked(name: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    from branchyard.lowering.nvgemm.tuner import numerics_error

    why = numerics_error(got, ref, ref.dtype)
    if why is not None:
        raise AssertionError(f"{name}: {why}")


def small_m_column(spec, a, w, ops, ref, timer: Timer) -> tuple[float | None, str | None, dict, dict]:
    """(best us, its config, every config's us, every config's error)."""
    from branchyard.lowering.nvgemm import cutedsl_gemm as cg
    from branchyard.lowering.nvgemm.kernel_config import small_m_configs

    m, k, n = a.shape[0], a.shape[1], w.shape[0]
    times, errors = {}, {}
    for config in small_m_configs(m, n, k, _dual(spec)):
        try:
            fn = cg.compile_fused_gemm(spec, a.dtype, config, operand_dtypes=[o.dtype for o in ops])
            out = torch.full((m, n), float("nan"), dtype=spec.out_dtype, device=a.device)
            fn(a, w.t(), ops, out)
            _checked(config.name, out, ref)
            times[config.name] = timer.us(timer.graph(lambda fn=fn, out=out: fn(a, w.t(), ops, out)))
        except Exception as exc:  # a compile or launch failure is a result to report, not a crash
            errors[config.name] = _error(exc)
    if not times:
        return None, None, times, errors
    best = min(times, key=times.get)
    return times[best], best, times, errors


def best_of(times: dict[str, float], configs: list[str]) -> tuple[float | None, str | None]:
    """The fastest of ``configs`` that has a time, (us, name), or (None, None)."""
    timed = [c for c in configs if c in times]
    if not timed:
        return None, None
    best = min(timed, key=times.get)
    return times[best], best


def cublas_call(spec, a, w, ops) -> Callable[[], torch.Tensor]:
    """``F.linear`` (the bias in cuBLAS's epilogue when the chain starts with one), the rest as ATen ops."""
    import dataclasses

    from branchyard.lowering.nvgemm.epilogue import unfused_aten_epilogue

    steps = spec.steps
    if steps and steps[0].op.name == "bias":
        bias, rest = ops[steps[0].operand], dataclasses.replace(spec, steps=steps[1:])
        return lambda: unfused_aten_epilogue(F.linear(a, w, bias), rest, ops, a)
    return lambda: unfused_aten_epilogue(F.linear(a, w), spec, ops, a)


def tuned_call(spec, a, w, ops, db_dir: str, inductor: bool) -> tuple[Callable[[], torch.Tensor], str]:
    """The op after a fresh tuner raced every candidate for device timing; (call, picked)."""
    from branchyard.lowering import nvgemm
    from branchyard.lowering.nvgemm import candidates, tuner, winners

    t = tuner.Autotuner(lambda p: candidates.default_candidates(p, inductor=inductor),
                        db=winners.WinnerDB(db_dir), progress=False)
    tuner.set_autotuner(t)
    text = str(spec)

    def call():
        with nvgemm.timing_mode("device"):
            return torch.ops.branchyard.fused_gemm_epilogue(a, w, ops, text)

    call()  # tunes (or, for ineligible inputs, takes the unfused path)
    picked = next(iter(t.results.values())).winner if t.results else "unfused path (not tuned)"
    return call, picked


def run_row(m: int, weight: str, chain: str, *, dtype: torch.dtype, device: torch.device, timer: Timer,
            copy_gbps: float, inductor: bool) -> dict[str, Any]:
    from branchyard.lowering.nvgemm.epilogue import reference_fused_gemm
    from branchyard.lowering.nvgemm.candidates import unfused_impl

    k, n = _parse_weight(weight)
    spec, a, w, ops = make_inputs(m, k, n, chain, dtype, device)
    ref = reference_fused_gemm(a, w, ops, spec)
    nbytes = min_bytes(a, w, ops, spec.out_dtype)
    row: dict[str, Any] = {"m": m, "weight": weight, "k": k, "n": n, "chain": chain, "bytes": nbytes, "errors": {}}
    row["small_m"], row["config"], row["configs"], config_errors = small_m_column(spec, a, w, ops, ref, timer)
    if config_errors:
        row["errors"]["small_m"] = config_errors
    from branchyard.lowering.nvgemm.kernel_config import small_m_configs

    first_form = [c.name for c in small_m_configs(m, n, k, _dual(spec)) if (c.unroll, c.rows) == (1, 16)]
    row["base"], row["config_base"] = best_of(row["configs"], first_form)
    unfused = unfused_impl(spec)
    calls: dict[str, Callable[[], Any]] = {
        "cublas": cublas_call(spec, a, w, ops),
        "unfused": lambda: unfused(a, w.t(), ops, None),
    }
    with tempfile.TemporaryDirectory() as db_dir:
        try:
            calls["tuned"], row["picked"] = tuned_call(spec, a, w, ops, db_dir, inductor)
        except Exception as exc:
            row["errors"]["tuned"] = _error(exc)
        for name, call in calls.items():
            try:
                _checked(name, call(), ref)
                row[name] = timer.us(timer.graph(call))
            except Exception as exc:
                row["errors"][name] = _error(exc)
    for name in COLUMNS:
        us = row.get(name)
        row[f"{name}_GBps"] = nbytes / (us * 1e-6) / 1e9 if us else None
        row[f"{name}_pct_copy"] = 100 * row[f"{name}_GBps"] / copy_gbps if us else None
    for name in ("base", "cublas", "unfused", "tuned"):  # > 1: the small-M kernel is faster
        row[f"{name}_over_small_m"] = row[name] / row["small_m"] if row.get(name) and row["small_m"] else None
    row["configs_pct_copy"] = {c: 100 * nbytes / (us * 1e-6) / 1e9 / copy_gbps for c, us in row["configs"].items()}
    return row


# --- report ---------------------------------------------------------------------------


def _f(x: float | None, spec: str = "{:.1f}") -> str:
    return "-" if x is None else spec.format(x)


def report(rows: list[dict], copy_gbps: float, markdown: bool) -> str:
    head = ["M", "KxN", "small_m us", "GB/s", "%copy", "config", "base us", "%copy", "base/small_m", "cublas us",
            "%copy", "unfused us", "tuned us", "%copy", "picked", "cublas/small_m", "tuned/small_m"]
    lines = []
    for r in rows:
        lines.append([str(r["m"]), r["weight"], _f(r.get("small_m")), _f(r.get("small_m_GBps"), "{:.0f}"),
                      _f(r.get("small_m_pct_copy")), r.get("config") or "-", _f(r.get("base")),
                      _f(r.get("base_pct_copy")), _f(r.get("base_over_small_m"), "{:.2f}x"), _f(r.get("cublas")),
                      _f(r.get("cublas_pct_copy")), _f(r.get("unfused")), _f(r.get("tuned")),
                      _f(r.get("tuned_pct_copy")), r.get("picked", "-"), _f(r.get("cublas_over_small_m"), "{:.2f}x"),
                      _f(r.get("tuned_over_small_m"), "{:.2f}x")])
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(cells) + " |" for cells in lines]
    else:
        widths = [max(len(h), *(len(c[i]) for c in lines)) if lines else len(h) for i, h in enumerate(head)]
        out = ["  ".join(h.ljust(wd) for h, wd in zip(head, widths))]
        out += ["  ".join(c.ljust(wd) for c, wd in zip(cells, widths)) for cells in lines]
    out.append("")
    out.append(f"copy bandwidth (read + write): {copy_gbps:.0f} GB/s")
    out.extend(variant_lines(rows))
    for r in rows:
        for column, err in r["errors"].items():
            for what, text in (err.items() if isinstance(err, dict) else [(column, err)]):
                out.append(f"error M={r['m']} {r['weight']} {what}: {' '.join(text.split())[:400]}")
    out.extend(target_lines(rows))
    return "\n".join(out)


def variant_lines(rows: list[dict]) -> list[str]:
    """One line per row: every small-M config's time and share of the copy rate, fastest first."""
    out = []
    for r in rows:
        times, pct = r.get("configs") or {}, r.get("configs_pct_copy") or {}
        if times:
            cells = [f"{c} {times[c]:.1f} us {pct.get(c, 0):.1f}%" for c in sorted(times, key=times.get)]
            out.append(f"variants M={r['m']} {r['weight']}: " + ", ".join(cells))
    return out


def target_lines(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        if r["m"] <= TARGET["m_max"] and r["weight"] == TARGET["weight"]:
            pct = r.get("small_m_pct_copy")
            verdict = "unmeasured" if pct is None else ("met" if pct >= TARGET["pct_copy"] else "MISSED")
            out.append(f"target M={r['m']} {r['weight']}: small_m >= {TARGET['pct_copy']:.0f}% of copy bandwidth: "
                       f"{_f(pct)}% ({verdict})")
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", nargs="*", type=int, default=None, help=f"M values (default {M_VALUES})")
    parser.add_argument("--weights", nargs="*", default=None, help=f"KxN weights (default {' '.join(WEIGHTS)})")
    parser.add_argument("--chain", default="bias@0;gelu_tanh", help="epilogue chain ('' for a plain GEMM)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--reps", type=int, default=50, help="timed replays per column (median kept)")
    parser.add_argument("--flush", choices=FLUSHES, default="read",
                        help="L2 eviction before each timed replay: a 256 MiB read (default), write, or none")
    parser.add_argument("--no-flush", action="store_true", help="the same as --flush none")
    parser.add_argument("--inductor", action="store_true", help="let the tuner race Inductor too (compiles for minutes)")
    parser.add_argument("--json", help="write the rows and the environment here")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, toy weights, M in {1, 16}: every column runs or reports its error")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")  # fallback notes (CPU tensors in --dry-run) are not results
    dtype = getattr(torch, args.dtype)
    if args.dry_run:
        device, ms, weights, reps, copy_bytes = torch.device("cpu"), args.m or [1, 16], args.weights or [
            "128x256", "256x128"], 3, 1 << 20
    else:
        if not torch.cuda.is_available():
            parser.error("needs a CUDA device (use --dry-run for the CPU smoke mode)")
        device, ms, weights, reps, copy_bytes = (torch.device("cuda"), args.m or list(M_VALUES),
                                                 args.weights or list(WEIGHTS), args.reps, 1 << 30)
    env = {
        "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.machine(),
        "torch": torch.__version__, "python": platform.python_version(), "argv": " ".join(sys.argv[1:]),
    }
    flush = "none" if args.no_flush else args.flush
    env["flush"] = flush
    print(f"# nvgemm_small_m {env['date']}, {env['device']}, torch {env['torch']}, L2 flush: {flush}, "
          f"argv {env['argv']}", flush=True)
    timer = Timer(device, reps, flush=flush)
    copy_gbps = copy_bandwidth(device, copy_bytes, reps)
    rows = []
    for weight in weights:
        for m in ms:
            rows.append(run_row(m, weight, args.chain, dtype=dtype, device=device, timer=timer,
                                copy_gbps=copy_gbps, inductor=args.inductor))
            print(report(rows[-1:], copy_gbps, markdown=False).splitlines()[1], flush=True)
    print()
    print(report(rows, copy_gbps, markdown=args.markdown))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "copy_GBps": copy_gbps, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    os.environ.setdefault("BRANCHYARD_NVGEMM_PROGRESS", "0")
    main()
