"""Sweep our CuTeDSL fused-GEMM kernel's configs against torch on the GPU.

For each shape and epilogue chain: compile every candidate config, check it
against the fp32 reference (poisoned output), time it, and time ``torch.mm``
(``F.linear``), the unfused ATen chain and, where it applies,
``torch._addmm_activation``. Timing is Triton's ``do_bench`` (L2 flushed
before every launch, median of repeats) when Triton is importable, else CUDA
events around launches that rotate over enough weight copies to miss L2.

    python benchmarks/nvgemm_kernel_sweep.py --quick      # a few shapes
    python benchmarks/nvgemm_kernel_sweep.py --json out.json
    python benchmarks/nvgemm_kernel_sweep.py --configs t128x128_c1x1_o1_rtma_pp,t128x256_c1x1_o1_rtma

Prints one row per (shape, chain, candidate) and a summary per (shape, chain).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from branchyard.lowering.nvgemm import cutedsl_gemm as cg
from branchyard.lowering.nvgemm import kernel_config
from branchyard.lowering.nvgemm.epilogue import EpilogueSpec, reference_fused_gemm, unfused_aten_epilogue

CHAINS = {
    "plain": "",
    "bias+gelu_erf": "bias@0;gelu_erf",
    "bias+silu": "bias@0;silu",
    "bias+gelu_tanh+res": "bias@0;gelu_tanh;residual@1",
    "scale+res": "scale:0.5;residual@0",
}


def bench(fn, rep_ms: int = 60) -> float:
    """Median µs of ``fn`` with a cold L2."""
    try:
        from triton.testing import do_bench

        return do_bench(fn, warmup=15, rep=rep_ms, return_mode="median") * 1e3
    except ImportError:
        pass
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    times = []
    for _ in range(30):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    times.sort()
    return times[len(times) // 2]


def bench_round_robin(fns: dict, rounds: int = 5, rep_ms: int = 25) -> dict:
    """Median over ``rounds`` of each function's :func:`bench`, taking the functions in
    turn every round, so that a clock that drifts during the run biases no column."""
    times: dict = {name: [] for name in fns}
    order = list(fns)
    for r in range(rounds):
        # Each round starts one further along: no column always follows the same one
        # (a kernel timed right after a cooler, memory-bound one ran up to 5% faster).
        for name in order[r % len(order):] + order[: r % len(order)]:
            times[name].append(bench(fns[name], rep_ms))
    return {name: statistics.median(values) for name, values in times.items()}


def config_from_name(name: str) -> cg.GemmConfig:
    """The GemmConfig whose ``.name`` is ``name`` (t{M}x{N}_c{CM}x{CN}_o{O}[_rtma][_pp][_g{raster}])."""
    found = re.fullmatch(r"t(\d+)x(\d+)_c(\d)x(\d)_o(\d)(_rtma)?(_pp)?(?:_g(\d+))?", name)
    if not found:
        raise SystemExit(f"--configs: {name!r} is not a config name like t128x128_c1x1_o1_rtma_pp")
    tm, tn, cm, cn, occ = (int(v) for v in found.groups()[:5])
    group = int(found.group(8) or 8)
    return cg.GemmConfig(
        tm, tn, cm, cn, occ, raster_group=group, residual_tma=bool(found.group(6)), persistent=bool(found.group(7))
    )


def operands_for(spec: EpilogueSpec, m: int, n: int, dtype: torch.dtype) -> list[torch.Tensor]:
    ops: list[torch.Tensor] = []
    for step in spec.steps:
        if step.op.operand == "col":
            ops.append(torch.randn(n, device="cuda", dtype=dtype))
        elif step.op.operand == "matrix":
            ops.append(torch.randn(m, n, device="cuda", dtype=dtype))
    return ops


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few shapes and chains only")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--json", help="write all rows here")
    parser.add_argument("--shapes", help="M,N,K;M,N,K;... (overrides the defaults)")
    parser.add_argument("--chains", help="comma-separated names from CHAINS")
    parser.add_argument("--rounds", type=int, default=5, help="round-robin timing rounds per (shape, chain)")
    parser.add_argument("--configs", help="comma-separated config names (default: candidate_configs per shape)")
    args = parser.parse_args()
    ok, why = cg.cutedsl_available()
    if not ok:
        print(f"CuTeDSL kernel unavailable: {why}")
        return 2
    dtype = getattr(torch, args.dtype)
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";")]
    elif args.quick:
        shapes = [(8192, 14336, 4096), (4096, 4096, 4096), (16, 4096, 4096)]
    else:
        shapes = [(m, n, k) for m in (1, 16, 128, 2048, 8192) for n, k in ((4096, 4096), (14336, 4096), (4096, 14336))]
    chains = args.chains.split(",") if args.chains else list(CHAINS)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, dtype {args.dtype}")
    rows, summary = [], []
    # Heat the GPU to its steady clock first: the first seconds of a run are faster.
    warm = torch.randn(8192, 8192, device="cuda", dtype=dtype)
    t_end = time.time() + 3.0
    while time.time() < t_end:
        for _ in range(20):
            warm @ warm
        torch.cuda.synchronize()
    del warm
    for m, n, k in shapes:
        a = torch.randn(m, k, device="cuda", dtype=dtype) / k**0.25
        w = torch.randn(n, k, device="cuda", dtype=dtype) / k**0.25
        for chain in chains:
            text = ";".join(p for p in ("w=nk", CHAINS[chain], f"out={args.dtype}") if p)
            spec = EpilogueSpec.parse(text)
            ops = operands_for(spec, m, n, dtype)
            ref = reference_fused_gemm(a, w, ops, spec)
            best = (math.inf, "")
            configs = (
                [config_from_name(c) for c in args.configs.split(",")]
                if args.configs
                else kernel_config.candidate_configs(m, n, k, dtype)
            )
            runnable, checked = {}, {}
            for config in configs:
                t0 = time.time()
                try:
                    fn = cg.compile_fused_gemm(spec, dtype, config)
                except Exception as exc:  # report and go on: one broken config must not end the sweep
                    print(f"  {chain:20s} {config.name:24s} COMPILE FAILED {str(exc)[:300]}")
                    continue
                compile_s = time.time() - t0
                out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
                fn(a, w.t(), ops, out)
                torch.cuda.synchronize()
                err = (out.float() - ref.float()).abs().max().item()
                scale = max(1.0, ref.float().abs().max().item())
                good = not out.isnan().any().item() and err <= 3e-2 * scale
                checked[config.name] = (err, good, compile_s)
                if good:
                    runnable[config.name] = functools.partial(fn, a, w.t(), ops, out)
            # One round-robin: clock drift (the H200 slows as it heats) hits every column alike.
            fns = {"mm": lambda: F.linear(a, w), "unfused": lambda: unfused_aten_epilogue(F.linear(a, w), spec, ops)}
            if chain == "bias+gelu_tanh+res":
                fns["addmm_act"] = lambda: torch._addmm_activation(ops[0], a, w.t(), use_gelu=True) + ops[1]
            times = bench_round_robin({**fns, **runnable}, rounds=args.rounds)
            t_mm, t_unfused = times["mm"], times["unfused"]
            t_addmm = times.get("addmm_act", float("nan"))
            for name, (err, good, compile_s) in checked.items():
                t = times.get(name, float("nan"))
                row = dict(m=m, n=n, k=k, chain=chain, config=name, us=t, err=err, ok=good,
                           compile_s=compile_s, mm_us=t_mm, unfused_us=t_unfused, addmm_act_us=t_addmm)
                rows.append(row)
                print(f"  {m:5d}x{n:5d}x{k:5d} {chain:20s} {name:24s} {t:9.1f} us  x{t / t_mm:.3f} mm  "
                      f"err {err:.2e} {'ok ' if good else 'BAD'} compile {compile_s:.1f}s  mm {t_mm:.1f} "
                      f"unfused {t_unfused:.1f}", flush=True)
                if good and t < best[0]:
                    best = (t, name)
            summary.append((m, n, k, chain, t_mm, t_unfused, t_addmm, best[0], best[1]))
            if args.json:  # after every chain, so that a run cut short keeps what it measured
                with open(args.json, "w") as fh:
                    json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(), "rows": rows}, fh)
    print("\nM     N     K     chain                 mm_us  unfused_us  addmm_act_us  fused_us  fused/mm  unfused/fused  best")
    for m, n, k, chain, t_mm, t_un, t_ad, t_f, name in summary:
        print(f"{m:<5d} {n:<5d} {k:<5d} {chain:20s} {t_mm:7.1f} {t_un:11.1f} {t_ad:13.1f} {t_f:9.1f} "
              f"{t_f / t_mm:9.3f} {t_un / t_f:14.3f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
