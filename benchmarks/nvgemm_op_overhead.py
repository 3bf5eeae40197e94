"""Host cost of one call of ``branchyard::fused_gemm_epilogue`` once its shape
is tuned, measured on CPU with a no-op implementation (issue 12 item 2).

The op's work is swapped for a candidate that returns its output buffer, and
eligibility is forced, so what is timed is everything the op does around the
launch: dispatch, argument checks, the choice lookup, the output allocation.
Columns (microseconds per call: the median over ``--repeats`` rounds, each
round timing one block of ``--calls`` calls of every column in turn, so load
from other processes on a shared machine falls on all columns alike; each
column also as a ratio to ``aten_noop`` of the same rounds):

* ``aten_noop``    ``torch.ops.aten.alias`` through the dispatcher: the floor any op pays;
* ``op``           ``torch.ops.branchyard.fused_gemm_epilogue.default`` (what an exported
                   program calls), no tensor requiring grad;
* ``op_out``       its ``out=`` overload writing a row-major buffer made beforehand (what a
                   CUDA-graph branch's last op calls), where the op has one;
* ``op_in_graph``  the same inside a ``torch.fx`` GraphModule (``ep.module()``'s path);
* ``op_body``      the op's kernel (``op._fused_gemm_epilogue``), called directly (the op's
                   share of ``op``; the rest is the dispatcher's trip into Python);
* ``op_kernel``    ``op`` where the tuned choice is our fused kernel's candidate
                   (``cutedsl_gemm._FusedGemm``, its compiled variant a no-op): the op plus
                   the kernel's own Python around its launch (N = 256, a plan of its own);
* ``impl``         the no-op implementation called directly on views made beforehand
                   (the launch stand-in).

    python benchmarks/nvgemm_op_overhead.py [--calls 2000] [--repeats 15] [--device cpu|cuda] [--markdown]

``--against OLD [--rounds 8]`` compares this checkout with another one (a
worktree of an older commit, say) side by side: each round runs the
measurement once per checkout, each in a fresh process importing that
checkout's ``branchyard`` and this script, the order alternating between
rounds; per column the median (range) over rounds, the median multiple of
``aten_noop`` and the median of the per-round ratios new / old.

Figures go to docs/benchmarks.md (machine, versions, date).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch


def _setup():
    from branchyard.lowering.nvgemm import op as op_mod
    from branchyard.lowering.nvgemm import tuner as nv_tuner
    from branchyard.lowering.nvgemm.candidates import Candidate
    from branchyard.lowering.nvgemm.winners import WinnerDB

    from branchyard.lowering.nvgemm.epilogue import reference_fused_gemm

    calls = []

    def noop(a, b_kn, ops, out):
        if not calls:  # the tuner's numerics check: the one call that computes
            calls.append(1)
            out.copy_(reference_fused_gemm(a, b_kn, list(ops), spec_kn))
        return out

    spec_kn = None

    def build(problem):
        nonlocal spec_kn
        spec_kn = problem.spec
        return noop if problem.n != 256 else _kernel_candidate(problem)

    tuner = nv_tuner.Autotuner([Candidate("noop", build)], timer=lambda name, fn: 1.0,
                               db=WinnerDB(tempfile.mkdtemp()), env={"gpu": "overhead"}, progress=False)
    nv_tuner.set_autotuner(tuner)
    from branchyard.lowering.nvgemm.kernel_config import layout_ineligibility

    # Every call takes the tuned path after the checks a GPU call pays: the CPU
    # device is let through, the layout rules run as they do on the GPU.
    op_mod.fused_kernel_ineligibility = layout_ineligibility
    return noop


def _kernel_candidate(problem):
    """The fused kernel's candidate as the tuner builds it, the kernel's compiled
    variant swapped for a no-op (the tuner's numerics check gets the reference)."""
    from branchyard.lowering.nvgemm import candidates, cutedsl_gemm
    from branchyard.lowering.nvgemm.epilogue import reference_fused_gemm
    from branchyard.lowering.nvgemm.kernel_math import plan_steps

    spec = problem.spec
    kernel = cutedsl_gemm._FusedGemm(plan_steps(spec), "bfloat16", "bfloat16", problem.b_layout,
                                     cutedsl_gemm.GemmConfig(128, 128), len(problem.operand_dtypes),
                                     kernel_cache=None)
    checked = []

    def compiled(a, b_nk, out, operands):
        if not checked:  # the tuner's numerics check: the one call that computes
            checked.append(1)
            out.copy_(reference_fused_gemm(a, b_nk.t(), list(operands[:-1]), spec))

    kernel.variant = lambda operand_dtypes: compiled
    real, cutedsl_gemm.compile_fused_gemm = cutedsl_gemm.compile_fused_gemm, lambda *args, **kw: kernel
    try:
        return candidates._cutedsl_build(problem, kernel.config)
    finally:
        cutedsl_gemm.compile_fused_gemm = real


def _block_us(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def _interleaved(fns: dict, calls: int, repeats: int) -> dict[str, float]:
    """Per column the median microseconds per call and the median ratio to
    ``aten_noop`` (as ``<name>/noop``), over rounds that time every column in turn."""
    for fn in fns.values():
        for _ in range(100):
            fn()
    rounds = []
    for _ in range(repeats):
        rounds.append({name: _block_us(fn, calls) for name, fn in fns.items()})
    got = {name: statistics.median(r[name] for r in rounds) for name in fns}
    got.update({f"{name}/noop": statistics.median(r[name] / r["aten_noop"] for r in rounds)
                for name in fns if name != "aten_noop"})
    return got


def measure(calls: int = 2000, repeats: int = 15, m: int = 16, k: int = 64, n: int = 128,
            device: str = "cpu") -> dict[str, float]:
    """Microseconds per call of each column and its ratio to ``aten_noop`` (see the module docstring)."""
    noop = _setup()
    warnings.simplefilter("ignore")
    dtype = torch.bfloat16
    a = torch.randn(m, k, dtype=dtype, device=device)
    w = torch.randn(n, k, dtype=dtype, device=device)
    bias, res = torch.randn(n, dtype=dtype, device=device), torch.randn(m, n, dtype=dtype, device=device)
    spec = "w=nk;bias@0;gelu_tanh;residual@1;out=bfloat16"
    op = torch.ops.branchyard.fused_gemm_epilogue.default
    from branchyard.lowering.nvgemm import op as op_mod

    body = getattr(op_mod, "_fused_gemm_epilogue", None)  # the op's kernel
    if body is None:  # before the op was registered by hand it was a torch.library.custom_op
        body = op_mod.fused_gemm_epilogue._init_fn
    ops = [bias, res]
    w_wide = torch.randn(256, k, dtype=dtype, device=device)
    ops_wide = [torch.randn(256, dtype=dtype, device=device), torch.randn(m, 256, dtype=dtype, device=device)]

    class Block(torch.nn.Module):
        def forward(self, x, w, bias, res):
            return op(x, w, [bias, res], spec)

    gm = torch.fx.symbolic_trace(Block())
    out = torch.empty(m, n, dtype=dtype, device=device)
    w_kn = w.t()
    with torch.inference_mode(False), torch.no_grad():
        op(a, w, ops, spec)  # tunes (the no-op candidate) once
        op(a, w_wide, ops_wide, spec)  # and the kernel's
        columns = {
            "aten_noop": lambda: torch.ops.aten.alias.default(a),
            "op": lambda: op(a, w, ops, spec),
            "op_in_graph": lambda: gm(a, w, bias, res),
            "op_body": lambda: body(a, w, ops, spec),
            "op_kernel": lambda: op(a, w_wide, ops_wide, spec),
            "impl": lambda: noop(a, w_kn, ops, out),
        }
        op_out = getattr(torch.ops.branchyard.fused_gemm_epilogue, "out", None)
        if op_out is not None:
            buf = torch.empty(m, n, dtype=dtype, device=device)
            columns["op_out"] = lambda: op_out(a, w, ops, spec, out=buf)
        return _interleaved(columns, calls, repeats)


def _measure_in(checkout: str, calls: int, repeats: int, device: str) -> dict[str, float]:
    """:func:`measure` in a fresh process that imports ``checkout``'s ``branchyard`` and this script."""
    code = ("import json, sys, torch; sys.path.insert(1, sys.argv[1]); torch.set_num_threads(1); "
            "import branchyard, nvgemm_op_overhead as bench; "
            "print(json.dumps([branchyard.__file__, bench.measure(int(sys.argv[2]), int(sys.argv[3]), "
            "device=sys.argv[4])]))")
    here = os.path.dirname(os.path.abspath(__file__))
    checkout = os.path.abspath(checkout)  # also the working directory: ``python -c`` imports from there first
    path = os.pathsep.join(filter(None, [checkout, os.environ.get("PYTHONPATH")]))  # first, before the rest (torch's)
    done = subprocess.run([sys.executable, "-c", code, here, str(calls), str(repeats), device], cwd=checkout,
                          env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True, check=True)
    where, got = json.loads(done.stdout.strip().splitlines()[-1])
    if not where.startswith(checkout + os.sep):
        raise RuntimeError(f"the run for {checkout} imported {where}")
    return got


def compare(old: str, new: str, rounds: int = 8, calls: int = 2000, repeats: int = 11,
            device: str = "cpu") -> dict[str, dict[str, float]]:
    """Per column of :func:`measure`: ``old``/``new`` medians over ``rounds`` (and
    ``*_min``/``*_max``), ``old_x``/``new_x`` the median multiple of ``aten_noop``, and
    ``ratio`` the median of the per-round ratios new / old. Each round measures
    both checkouts, the order alternating."""
    runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    for r in range(rounds):
        for side in (("old", "new") if r % 2 == 0 else ("new", "old")):
            runs[side].append(_measure_in(old if side == "old" else new, calls, repeats, device))
    got = {}
    for name in (n for n in runs["old"][0] if "/" not in n):
        row = {"ratio": statistics.median(n[name] / o[name] for o, n in zip(runs["old"], runs["new"]))}
        for side, got_side in runs.items():
            values = [run[name] for run in got_side]
            row.update({side: statistics.median(values), f"{side}_min": min(values), f"{side}_max": max(values),
                        f"{side}_x": statistics.median(run.get(f"{name}/noop", 1.0) for run in got_side)})
        got[name] = row
    return got


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--markdown", action="store_true", help="print a markdown table row set")
    parser.add_argument("--device", default="cpu",
                        help="where the tensors live: cuda adds the CUDA allocator and device handling "
                             "(the no-op implementation launches nothing)")
    parser.add_argument("--against", metavar="OLD", help="another checkout to compare with, side by side")
    parser.add_argument("--rounds", type=int, default=8, help="with --against: rounds of one run per checkout")
    args = parser.parse_args(argv)
    if args.against:
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        table = compare(args.against, here, args.rounds, args.calls, args.repeats, args.device)
        print(f"{args.rounds} rounds, {args.calls} calls x {args.repeats} blocks; old: {args.against}, new: {here}")
        print("| column | old us | x noop | new us | x noop | new / old |\n|---|---|---|---|---|---|")
        for name, r in table.items():
            print(f"| {name} | {r['old']:.2f} ({r['old_min']:.2f}-{r['old_max']:.2f}) | {r['old_x']:.2f} "
                  f"| {r['new']:.2f} ({r['new_min']:.2f}-{r['new_max']:.2f}) | {r['new_x']:.2f} | {r['ratio']:.2f} |")
        return table
    torch.set_num_threads(1)
    got = measure(args.calls, args.repeats, device=args.device)
    header = (f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, "
              f"torch {torch.__version__}, tensors on {args.device}")
    names = [n for n in got if "/" not in n]
    ratio = lambda name: got.get(f"{name}/noop", 1.0)  # noqa: E731
    if args.markdown:
        print(f"| column | us / call | x aten_noop |  ({header})\n|---|---|---|")
        for name in names:
            print(f"| {name} | {got[name]:.2f} | {ratio(name):.2f} |")
    else:
        print(header)
        for name in names:
            print(f"{name:12s} {got[name]:8.2f} us/call  {ratio(name):6.2f} x aten_noop")
        print(f"op host cost over its impl: {got['op'] - got['impl']:.2f} us/call "
              f"({ratio('op') - ratio('impl'):.2f} x aten_noop)")
    return got


if __name__ == "__main__":
    main()
