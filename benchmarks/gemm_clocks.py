"""What the GPU's clock and power do while GEMMs run: cuBLAS's ``mm`` on random
and on zero data, our plain CuTeDSL GEMM and our fused chains.

Each phase replays a CUDA graph of ``--calls`` GEMMs without pause for
``--seconds`` (no L2 flush: steady state) while ``nvidia-smi`` samples the SM
clock, the power draw and the active clock-event reasons every ``--sample-ms``.
The first ``--settle-s`` of a phase are dropped. Per phase it prints µs per
GEMM, TFLOP/s, the median SM clock and power, the energy per GEMM (power x time), how often the software power cap
was the active clock-event reason, and the dense 16-bit tensor throughput
reached *at the measured clock* (132 SMs x 4096 FLOP per SM per clock on
Hopper: the H200's datasheet 989 TFLOP/s at 1830 MHz). The phases run in
order, then again in reverse, so neither pass's heating favours one of them.

    python benchmarks/gemm_clocks.py --shape 8192,14336,4096 --json $OUT/clocks.json
    python benchmarks/gemm_clocks.py --configs t128x128_c2x1_o1_rtma_pp,t128x256_c2x1_o1_rtma --chains plain

It reads the clocks; it never sets them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import threading
import time

import torch

from branchyard.lowering.nvgemm import cutedsl_gemm as cg
from branchyard.lowering.nvgemm.epilogue import EpilogueSpec

from nvgemm_kernel_sweep import CHAINS, config_from_name, operands_for

#: Dense 16-bit wgmma FLOP per SM per clock on Hopper (989.4e12 / (132 * 1.83e9)).
FLOP_PER_SM_CLOCK = 4096

#: nvidia-smi fields; drivers before the "clocks_event_reasons" rename spell them "clocks_throttle_reasons".
FIELDS = ["clocks.sm", "power.draw.instant", "temperature.gpu", "{r}.sw_power_cap", "{r}.hw_slowdown",
          "{r}.sw_thermal_slowdown", "power.limit"]


class ClockSampler:
    """``nvidia-smi`` in a loop; every line stamped with the host's monotonic clock."""

    def __init__(self, sample_ms: int) -> None:
        self.samples: list[tuple[float, list[str]]] = []
        for reasons, power in (("clocks_event_reasons", "power.draw.instant"),
                               ("clocks_throttle_reasons", "power.draw")):
            fields = [f.format(r=reasons).replace("power.draw.instant", power) for f in FIELDS]
            probe = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                                   capture_output=True, text=True)
            if probe.returncode == 0:
                break
        else:
            raise SystemExit(f"nvidia-smi refused the query: {probe.stdout.strip()} {probe.stderr.strip()}")
        self.fields = fields
        self.proc = subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits", f"-lms={sample_ms}"],
            stdout=subprocess.PIPE, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.samples.append((time.monotonic(), [v.strip() for v in line.split(",")]))

    def between(self, t0: float, t1: float) -> dict:
        rows = [vals for t, vals in self.samples if t0 <= t <= t1]

        def num(i):
            got = []
            for vals in rows:
                try:
                    got.append(float(vals[i]))
                except (ValueError, IndexError):
                    pass
            return got

        def active(i):
            return sum(1 for vals in rows if len(vals) > i and vals[i].lower() == "active")

        clock, power, temp = num(0), num(1), num(2)
        return {
            "samples": len(rows),
            "sm_mhz": statistics.median(clock) if clock else None,
            "sm_mhz_min": min(clock) if clock else None,
            "power_w": statistics.median(power) if power else None,
            "temp_c": max(temp) if temp else None,
            "power_cap_frac": active(3) / len(rows) if rows else None,
            "hw_slowdown_frac": active(4) / len(rows) if rows else None,
            "thermal_frac": active(5) / len(rows) if rows else None,
            "power_limit_w": (num(6) or [None])[0],
        }

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait()


def phases(m: int, n: int, k: int, dtype: torch.dtype, config_names: list[str], chains: list[str]) -> dict:
    """name -> a function running one GEMM, for every phase."""
    a = torch.randn(m, k, device="cuda", dtype=dtype) / k**0.25
    w = torch.randn(n, k, device="cuda", dtype=dtype) / k**0.25
    a0, w0 = torch.zeros_like(a), torch.zeros_like(w)
    out = torch.empty(m, n, device="cuda", dtype=dtype)
    got = {
        "mm (cuBLAS), random data": lambda: torch.mm(a, w.t(), out=out),
        "mm (cuBLAS), zeros": lambda: torch.mm(a0, w0.t(), out=out),
    }
    for config_name in config_names:
        config = config_from_name(config_name)
        tag = "ours" if len(config_names) == 1 else config_name
        for chain in chains:
            text = ";".join(p for p in ("w=nk", CHAINS[chain], f"out={str(dtype).removeprefix('torch.')}") if p)
            spec = EpilogueSpec.parse(text)
            ops = operands_for(spec, m, n, dtype)
            fn = cg.compile_fused_gemm(spec, dtype, config)
            got[f"{tag} {chain}"] = lambda fn=fn, ops=ops: fn(a, w.t(), ops, out)
            if chain == "plain":  # zeros through our kernel too: how much of its power is data toggling
                got[f"{tag} plain, zeros"] = lambda fn=fn: fn(a0, w0.t(), [], out)
    return got


def run_phase(fn, calls: int, seconds: float, settle_s: float, sampler: ClockSampler) -> dict:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    t_start = time.monotonic()
    while time.monotonic() - t_start < seconds:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append((time.monotonic(), s.elapsed_time(e) * 1e3 / calls))
    t_end = time.monotonic()
    steady = [us for t, us in times if t >= t_start + settle_s] or [us for _, us in times]
    return {"us": statistics.median(steady), **sampler.between(t_start + settle_s, t_end)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="8192,14336,4096", help="M,N,K")
    p.add_argument("--configs", default="t128x128_c2x1_o1_rtma_pp", help="our kernel's configs, comma-separated")
    p.add_argument("--chains", default="plain,bias+silu,bias+gelu_erf,bias+gelu_tanh+res,scale+res",
                   help=f"comma-separated, from {list(CHAINS)}")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--settle-s", type=float, default=1.0)
    p.add_argument("--calls", type=int, default=10, help="GEMMs per graph replay")
    p.add_argument("--sample-ms", type=int, default=50)
    p.add_argument("--json")
    args = p.parse_args()
    m, n, k = (int(v) for v in args.shape.split(","))
    dtype = torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    flop = 2.0 * m * n * k
    fns = phases(m, n, k, dtype, args.configs.split(","), args.chains.split(","))
    sampler = ClockSampler(args.sample_ms)
    results: dict[str, list[dict]] = {name: [] for name in fns}
    try:
        for order in (list(fns), list(reversed(fns))):
            for name in order:
                results[name].append(run_phase(fns[name], args.calls, args.seconds, args.settle_s, sampler))
    finally:
        sampler.stop()
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | {m}x{n}x{k} bf16 | configs {args.configs} "
          f"| nvidia-smi fields {sampler.fields}")
    head = (f"{'phase':<36} {'pass':>4} {'us':>8} {'TFLOP/s':>8} {'SM MHz':>7} {'min':>5} {'W':>6} "
            f"{'cap W':>6} {'pwr-cap':>7} {'degC':>4} {'util@clk':>8} {'mJ/GEMM':>8}")
    print(head + "\n" + "-" * len(head))
    for name, runs in results.items():
        for i, r in enumerate(runs):
            tflops = flop / r["us"] * 1e-6
            r["tflops"] = tflops
            r["mj_per_gemm"] = r["power_w"] * r["us"] * 1e-3 if r["power_w"] else None
            r["util_at_clock"] = tflops * 1e12 / (sms * FLOP_PER_SM_CLOCK * r["sm_mhz"] * 1e6) if r["sm_mhz"] else None
            fmt = lambda x, f: "-" if x is None else f.format(x)
            print(f"{name:<36} {i:>4} {r['us']:>8.1f} {tflops:>8.1f} {fmt(r['sm_mhz'], '{:.0f}'):>7} "
                  f"{fmt(r['sm_mhz_min'], '{:.0f}'):>5} {fmt(r['power_w'], '{:.0f}'):>6} "
                  f"{fmt(r['power_limit_w'], '{:.0f}'):>6} {fmt(r['power_cap_frac'], '{:.0%}'):>7} "
                  f"{fmt(r['temp_c'], '{:.0f}'):>4} {fmt(r['util_at_clock'], '{:.1%}'):>8} "
                  f"{fmt(r['mj_per_gemm'], '{:.1f}'):>8}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": [m, n, k], "configs": args.configs, "sms": sms, "fields": sampler.fields,
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
