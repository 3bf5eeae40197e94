"""NVGEMM epilogue fusion on the GPU: our fused CuTeDSL kernel and the
autotuned op against every alternative, per shape and epilogue chain.

Shapes: M in {1, 16, 128, 2048, 8192} x (N, K) in {(4096, 4096),
(14336, 4096), (4096, 14336)}, weights laid out like ``nn.Linear`` ([N, K]).
Chains: bias+gelu(erf), bias+silu, bias+gelu(tanh)+residual, scale+residual.

Columns (median microseconds, L2 flushed before every timed run):

* ``mm``       -- plain ``torch.mm`` (no epilogue: the floor a fused kernel aims at)
* ``aten``     -- the unfused ATen chain (``mm`` then one kernel per op)
* ``cublas``   -- cuBLAS(Lt) doing what it can of the chain in its epilogue
                  (``_addmm_activation`` for bias+gelu_tanh, then the residual
                  add; ``addmm(res, a, b, alpha=s)`` for scale+residual); ``-``
                  where no cuBLAS epilogue applies
* ``inductor`` -- the unfused chain compiled by Inductor (max-autotune)
* ``ours``     -- our CuTeDSL kernel, best tile config (named in ``config``)
* ``op``       -- ``torch.ops.branchyard.fused_gemm_epilogue`` end to end,
                  with the autotuner's pick (named in ``picked``)

Targets checked at the end: at M >= 2048 ``ours`` within 1.05x of ``mm``;
geomean over M >= 2048 of (best alternative not ours) / ours >= 1.10; the
autotuned pick within 2% of the best candidate.

    python benchmarks/nvgemm_epilogue.py --quick                 # 24 rows, one 10-minute run
    python benchmarks/nvgemm_epilogue.py --json a.json --nk 4096x4096
    python benchmarks/nvgemm_epilogue.py --merge a.json b.json --markdown t.md --plot p.png

``--nk`` / ``--m`` split the full sweep over several runs; ``--merge``
combines their JSON files into one table, markdown and plot. The compact
table is printed last.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import platform
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

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


def cublas_fn(name, a, b_kn, ops):
    """cuBLAS doing as much of the chain as its epilogues can, or None."""
    if name == "bias+gelu_tanh+res":
        return lambda: torch._addmm_activation(ops[0], a, b_kn, use_gelu=True).add_(ops[1])
    if name == "scale+res":
        return lambda: torch.addmm(ops[0], a, b_kn, alpha=0.5)
    return None


class Budget:
    """Wall-clock budget for Inductor compiles (max-autotune takes minutes)."""

    def __init__(self, seconds: float | None):
        self.left = seconds

    def allows(self) -> bool:
        return self.left is None or self.left > 0

    def spend(self, seconds: float) -> None:
        if self.left is not None:
            self.left -= seconds


def run_row(m, n, k, chain, dtype, args, budget, db_dir) -> dict:
    from branchyard.lowering.nvgemm import autotune as at
    from branchyard.lowering.nvgemm import fused_gemm_epilogue
    from branchyard.lowering.nvgemm.epilogue import reference_fused_gemm, unfused_aten_epilogue

    a, w, ops, spec = make_inputs(m, n, k, CHAINS[chain], dtype)
    b_kn = w.t()
    problem = at.Problem.of(a, b_kn, ops, spec)
    ref = reference_fused_gemm(a, w, ops, spec)
    row: dict = {"m": m, "n": n, "k": k, "chain": chain, "notes": []}
    time_us = lambda fn: at.cuda_event_timer(fn, reps=args.reps) * 1e3  # noqa: E731

    row["mm"] = time_us(lambda: torch.mm(a, b_kn))
    row["aten"] = time_us(lambda: unfused_aten_epilogue(torch.mm(a, b_kn), problem.spec, ops))
    fn = cublas_fn(chain, a, b_kn, ops)
    row["cublas"] = time_us(fn) if fn is not None else None

    row["inductor"] = None
    if args.inductor_mode != "off" and (m >= args.inductor_min_m) and budget.allows():
        t0 = time.time()
        try:
            impl = at._inductor_build(problem, args.inductor_mode)
            got = impl(a, b_kn, ops, None)
            torch.cuda.synchronize()
            budget.spend(time.time() - t0)
            bad = at.numerics_error(got, ref, dtype)
            if bad:
                row["notes"].append(f"inductor wrong: {bad}")
            else:
                row["inductor"] = time_us(lambda: impl(a, b_kn, ops, None))
        except Exception as exc:  # report, keep benchmarking
            budget.spend(time.time() - t0)
            row["notes"].append(f"inductor failed: {type(exc).__name__}: {str(exc)[:120]}")
    elif args.inductor_mode != "off" and m >= args.inductor_min_m:
        row["notes"].append("inductor skipped: compile budget spent")

    row["ours"], row["config"] = None, None
    out = torch.empty(m, n, dtype=spec.out_dtype, device="cuda")
    for cand in at._cutedsl_candidates(problem)[: args.max_configs]:
        try:
            impl = cand.build(problem)
            out.fill_(float("nan"))
            got = impl(a, b_kn, ops, out)
            torch.cuda.synchronize()
        except Exception as exc:
            row["notes"].append(f"{cand.name} failed: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        bad = at.numerics_error(got, ref, dtype)
        if bad:
            row["notes"].append(f"{cand.name} wrong: {bad}")
            continue
        t = time_us(lambda: impl(a, b_kn, ops, out))
        if row["ours"] is None or t < row["ours"]:
            row["ours"], row["config"] = t, cand.name.removeprefix("cutedsl:")

    # The op end to end with the process autotuner (fresh database: it really tunes).
    def candidates(p):
        cands = at.default_candidates(p, inductor=args.inductor_mode != "off" and m >= args.inductor_min_m
                                      and row["inductor"] is not None)
        cut = [c for c in cands if c.name.startswith("cutedsl:")][: args.max_configs]
        rest = [c for c in cands if not c.name.startswith("cutedsl:")]
        if not args.cutlass_plain:  # compiles per shape: left out of --quick runs
            rest = [c for c in rest if not c.name.startswith("cutlass_plain")]
        return cut + rest

    tuner = at.Autotuner(candidates, db=at.WinnerDB(db_dir), progress=not args.no_progress)
    at.set_autotuner(tuner)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fused_gemm_epilogue(a, w, ops, str(spec))
        fallback = [str(x.message) for x in caught if "reference path" in str(x.message)]
        if fallback:
            row["notes"].append(fallback[0])
            row["op"], row["picked"] = None, "reference"
        else:
            row["op"] = time_us(lambda: fused_gemm_epilogue(a, w, ops, str(spec)))
            (res,) = tuner.results.values()
            row["picked"] = res.winner
            row["picked_tuned_us"] = res.timings[res.winner] * 1e3
            row["excluded"] = res.excluded
    finally:
        at.set_autotuner(None)
    return row


# --- summary -------------------------------------------------------------------------


def derived(row: dict) -> dict:
    alts = [row[c] for c in ("aten", "cublas", "inductor") if row.get(c) is not None]
    best_alt = min(alts) if alts else None
    every = [row[c] for c in ("aten", "cublas", "inductor", "ours") if row.get(c) is not None]
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
            + f" {'ours/mm':>8} {'speedup':>8} {'op/best':>8}  {'config':<17} picked")
    lines = [head, "-" * len(head)]
    for r in rows:
        d = derived(r)
        lines.append(
            f"{r['m']:>5} {r['n']:>6} {r['k']:>6} {r['chain']:<19}"
            + "".join(f"{fmt(r.get(c)):>9}" for c in COLUMNS)
            + f" {fmt(d['ours_vs_mm'], '{:.3f}'):>8} {fmt(d['speedup'], '{:.2f}x'):>8}"
            + f" {fmt(d['op_vs_best'], '{:.3f}'):>8}  {r.get('config') or '-':<17} {r.get('picked', '-')}"
        )
    return lines


def targets(rows: list[dict]) -> list[str]:
    large = [r for r in rows if r["m"] >= LARGE_M]
    out = []
    near = [derived(r)["ours_vs_mm"] for r in large if derived(r)["ours_vs_mm"] is not None]
    ok = sum(1 for x in near if x <= 1.05)
    out.append(f"ours within 1.05x of plain mm at M>={LARGE_M}: {ok}/{len(near)} rows"
               + (f" (worst {max(near):.3f}x)" if near else ""))
    sp = [derived(r)["speedup"] for r in large if derived(r)["speedup"] is not None]
    if sp:
        geo = math.exp(sum(math.log(x) for x in sp) / len(sp))
        out.append(f"geomean speedup over the best non-ours alternative at M>={LARGE_M}: {geo:.3f}x "
                   f"(target >= 1.10x) over {len(sp)} rows")
    ob = [derived(r)["op_vs_best"] for r in rows if derived(r)["op_vs_best"] is not None]
    if ob:
        bad = sum(1 for x in ob if x > 1.02)
        out.append(f"autotuned op (end to end) within 2% of the best candidate: {len(ob) - bad}/{len(ob)} rows "
                   f"(worst {max(ob):.3f}x)")
    picked = [r for r in rows if r.get("picked_tuned_us") is not None]
    if picked:
        ratios = []
        for r in picked:
            best = min(r[c] for c in ("aten", "cublas", "inductor", "ours") if r.get(c) is not None)
            ratios.append(r["picked_tuned_us"] / best)
        out.append(f"autotuner's pick (its own timing) vs best column: worst {max(ratios):.3f}x")
    return out


def markdown(rows: list[dict], env: dict) -> str:
    lines = [
        f"Machine: {env['gpu']}; torch {env['torch']} (CUDA {env['cuda']}), Python {env['python']}, "
        f"CuTeDSL {env['cutedsl']}, Triton {env['triton']}; {env['date']}. Median µs, L2 flushed before "
        "every run; bfloat16, weights [N, K] (nn.Linear layout).",
        "",
        "| M | N | K | chain | mm | aten | cublas | inductor | ours | op | ours/mm | speedup | op/best | picked |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        d = derived(r)
        lines.append(
            f"| {r['m']} | {r['n']} | {r['k']} | {r['chain']} | "
            + " | ".join(fmt(r.get(c)) for c in COLUMNS)
            + f" | {fmt(d['ours_vs_mm'], '{:.3f}')} | {fmt(d['speedup'], '{:.2f}x')} | "
            f"{fmt(d['op_vs_best'], '{:.3f}')} | {r.get('picked', '-')} |"
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
        ax.set_xticks(range(len(sub)))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylabel("time / plain mm")
        ax.set_title(chain)
        ax.legend(fontsize=7, ncol=5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def emit(rows, env, args) -> None:
    if args.json:
        Path(args.json).write_text(json.dumps({"env": env, "rows": rows}, indent=1))
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
          f"cutedsl {env['cutedsl']} | {env['date']}")
    print("\n".join(table_lines(rows)))
    print("\n".join(targets(rows)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="M in {16, 2048, 8192}, (N, K) in the first two pairs")
    p.add_argument("--m", type=int, nargs="*", help="M values (default: all five)")
    p.add_argument("--nk", nargs="*", help="N x K pairs, e.g. 4096x14336")
    p.add_argument("--chains", nargs="*", choices=list(CHAINS), help="chains (default: all four)")
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--max-configs", type=int, default=None, help="CuTeDSL configs per shape (default: all; quick: 2)")
    p.add_argument("--inductor-mode", default="max-autotune-no-cudagraphs",
                   help="torch.compile mode for the Inductor column, or 'off'")
    p.add_argument("--inductor-budget-s", type=float, default=None,
                   help="stop compiling Inductor candidates after this many seconds (quick: 180)")
    p.add_argument("--inductor-min-m", type=int, default=None,
                   help=f"only compile Inductor for M >= this (default 1; quick: {LARGE_M})")
    p.add_argument("--cutlass-plain", action=argparse.BooleanOptionalAction, default=None,
                   help="offer the cutlass-operators plain GEMM to the autotuner (default on; quick: off)")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json"), p.add_argument("--markdown"), p.add_argument("--plot")
    p.add_argument("--merge", nargs="*", help="combine JSON files from earlier runs; no GPU work")
    args = p.parse_args(argv)

    if args.merge:
        rows, env = [], None
        for f in args.merge:
            data = json.loads(Path(f).read_text())
            rows += data["rows"]
            env = env or data["env"]
        rows.sort(key=lambda r: (list(CHAINS).index(r["chain"]), r["n"], r["k"], r["m"]))
        emit(rows, env, args)
        return 0

    if not torch.cuda.is_available():
        print("needs a CUDA device (NVIDIA H200 for the reported figures)", file=sys.stderr)
        return 2
    ms = args.m or ([16, 2048, 8192] if args.quick else M_ALL)
    nks = [tuple(int(x) for x in s.split("x")) for s in args.nk] if args.nk else (NK_ALL[:2] if args.quick else NK_ALL)
    chains = args.chains or list(CHAINS)
    if args.quick:  # fits one 10-minute run: fewer tile configs, Inductor only where the targets are
        args.max_configs = args.max_configs or 2
        args.inductor_budget_s = args.inductor_budget_s if args.inductor_budget_s is not None else 180.0
        args.inductor_min_m = args.inductor_min_m if args.inductor_min_m is not None else LARGE_M
        args.cutlass_plain = bool(args.cutlass_plain)
    args.inductor_min_m = args.inductor_min_m if args.inductor_min_m is not None else 1
    args.cutlass_plain = True if args.cutlass_plain is None else args.cutlass_plain
    args.max_configs = args.max_configs or 99
    dtype = getattr(torch, args.dtype)
    env = versions()
    budget = Budget(args.inductor_budget_s)
    rows = []
    with tempfile.TemporaryDirectory() as db_dir:
        for chain in chains:
            for n, k in nks:
                for m in ms:
                    t0 = time.time()
                    row = run_row(m, n, k, chain, dtype, args, budget, db_dir)
                    rows.append(row)
                    print(table_lines([row])[-1] + f"   ({time.time() - t0:.0f}s)", flush=True)
                    if args.json:  # a run cut short by a time limit still leaves its rows
                        Path(args.json).write_text(json.dumps({"env": env, "rows": rows}, indent=1))
                    torch.cuda.empty_cache()
    emit(rows, env, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
