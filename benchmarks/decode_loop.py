"""Benchmark: a whole decode loop (expert dispatch in a while_loop) through ``branchyard.compile``.

The model is :class:`branchyard.examples.decode_loop.DecodeLoop` (bf16): a
``while_loop`` over steps whose body routes the batch through one of 8 expert
MLPs via an ``idx == k`` chain of 7 nested ``torch.cond``, then RMS-normalises.
Columns, per (dim, hidden, batch), microseconds per decode step over ``--steps``
steps (CUDA events around whole calls, median of ``--reps`` calls):

* ``eager``              the nn.Module
* ``compile``            ``torch.compile`` (default mode)
* ``reduce_overhead``    ``torch.compile(mode="reduce-overhead")`` (a failure is a row)
* ``torch_cond_nodes``   torch's own conditional-node capture (torch >= 2.14's private
                         ``ControlFlowOpWarmupDispatchMode`` / ``CUDAGraphCaptureControlFlowOpDispatchMode``
                         around ``torch.cuda.graph``), of the exported nested-cond program
* ``by_graph``           ``branchyard.compile(..., passes=())``: CUDA graph only
* ``by_switch``          ``passes=("cond_to_switch",)`` (torch >= 2.14)
* ``by_full``            ``passes=("cond_to_switch", "nvgemm")``: the full pipeline
* ``by_full_inductor``   the same with ``inductor=True`` (the bodies' plain ATen runs as Inductor kernels);
                         ``by_switch_inductor``: switch and Inductor regions, no NVGEMM
* ``floor``              weight bytes read per step / measured copy bandwidth, plus the per-step
                         cost of our WHILE + SWITCH graph with empty branches

Also the first-call cost of each branchyard column (export, passes, tuning,
capture) and whether outputs agree with eager for 0/1/5/40 trips.

``--ablate-router`` adds two columns, ``router_kernel`` and ``router_ops``:
the full pipeline with Inductor regions, with the router (mean, GEMV, argmax)
computed by the router set kernel at any size and never, timed in interleaved
rounds in one process (so the two differ by the router path alone).
``--ablate-rotation`` adds ``router_in_step`` and ``router_in_body``, the same
pipeline with the next trip's router computed by the loop's step kernel (the
default) and by its own kernel at the top of each trip, timed the same way.
``--profile`` prints, per branchyard column, the kernels one call runs and
their device time per step (``torch.profiler``): what the step's time is
made of, and how much of it is between kernels.

    python benchmarks/decode_loop.py --shapes 1024x4096 --batches 16 --json rows.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
import warnings

import torch

import branchyard
import branchyard.lowering

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_graph_control_flow import time_median_ms  # noqa: E402
from branchyard._compat import HAS_SWITCH
from branchyard.examples.decode_loop import DecodeLoop

DEV = "cuda"


def time_call_ms(fn, reps: int) -> float:
    """Median of ``reps`` CUDA-event-timed calls (the control-flow benchmark's timer)."""
    return time_median_ms(fn, reps, warmup=2)


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy bandwidth, bytes read + written per second (GB/s)."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    ms = time_call_ms(lambda: b.copy_(a), reps=10)
    return 2 * a.numel() / (ms * 1e-3) / 1e9


def agree(out, ref, dtype) -> tuple[bool, float]:
    tol = 5e-2 if dtype == torch.bfloat16 else 1e-4
    steps_ok = int(out[0]) == int(ref[0])
    diff = (out[1].float() - ref[1].float()).abs().max().item() if out[1].numel() else 0.0
    return steps_ok and diff <= tol * max(1.0, ref[1].float().abs().max().item()), diff


def agreement(fn, model, x, dtype) -> dict:
    """Per trip count (0, 1, 5, 40): True where ``fn`` agrees with ``model``, else the max difference.
    Where one differs, ``"divergence"`` says why (see :func:`divergence`)."""
    checks: dict = {}
    for trips in (0, 1, 5, 40):
        t = torch.tensor(trips, device=DEV)
        ok, diff = agree(fn(x, t), model(x, t), dtype)
        checks[trips] = ok if ok else f"max diff {diff:.3g}"
    if not all(v is True for v in checks.values()):
        checks["divergence"] = divergence(fn, model, x, dtype)
    return checks


def divergence(fn, model, x, dtype, max_trips: int = 40) -> dict:
    """The first trip count at which ``fn`` differs from eager, and eager's router at that step:
    the gap between its two largest logits. A gap of a bfloat16 ulp or less is a near tie that any
    other rounding of the logits (another GEMV kernel, another summation order) may break the
    other way; from that step on the loop runs another expert, so the outputs part."""
    trips = (torch.tensor(k, device=DEV) for k in range(1, max_trips + 1))
    first = next((int(t) for t in trips if not agree(fn(x, t), model(x, t), dtype)[0]), None)
    if first is None:
        return {"first_trip": None}
    y = x
    for _ in range(first - 1):
        y = model.step(y)
    logits = (y.mean(0) @ model.router).float()
    top = torch.topk(logits, 2).values
    return {"first_trip": first, "eager_top2_logit_gap": float(top[0] - top[1]),
            "bf16_ulp_at_top": float(torch.finfo(torch.bfloat16).eps * top[0].abs())}


def torch_cond_nodes(ep, args):
    """torch's own conditional-node capture of the exported program (torch >= 2.14)."""
    from torch._higher_order_ops.cudagraph_conditional_nodes import (
        ControlFlowOpWarmupDispatchMode,
        CUDAGraphCaptureControlFlowOpDispatchMode,
    )

    f = ep.module()
    static = [a.clone() for a in args]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), ControlFlowOpWarmupDispatchMode():
        f(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), CUDAGraphCaptureControlFlowOpDispatchMode():
        out = f(*static)

    def run(*call_args):
        for s, a in zip(static, call_args):
            s.copy_(a)
        graph.replay()
        return tuple(t.clone() for t in out)

    return run


def empty_switch_loop_us(num_experts: int, steps: int) -> float:
    """Per-step cost of our lowering of while_loop { switch(i % n, [identity] * n) }."""
    from branchyard.lowering.cuda_graph.fx_builders import switch_module, trace, while_loop_module

    class Body(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pick = switch_module([lambda y: y + 0 for _ in range(num_experts)], num_operands=1)

        def forward(self, i, y, n):
            return i + 1, self.pick(i % num_experts, y)[0]

    program = while_loop_module(lambda i, y, n: i < n, trace(Body()), num_carried=2, num_additional=1)
    args = (torch.zeros((), dtype=torch.int64, device=DEV), torch.zeros(16, device=DEV), torch.tensor(steps, device=DEV))
    lowered = branchyard.lowering.cuda_graph(program, args)
    return time_call_ms(lambda: lowered(*args), reps=20) * 1e3 / steps


def column(name, build, model, x, steps_t, steps, reps, dtype, row):
    """Build one column (timed as first-call cost), check it, time it; record into ``row``.
    Returns what ``build`` made (``None`` where it failed)."""
    fn = None
    try:
        start = time.perf_counter()
        fn = build()
        fn(x, steps_t)
        torch.cuda.synchronize()
        row[f"{name}_first_call_s"] = round(time.perf_counter() - start, 2)
        row[f"{name}_agrees"] = agreement(fn, model, x, dtype)
        row[f"{name}_us_per_step"] = round(time_call_ms(lambda: fn(x, steps_t), reps) * 1e3 / steps, 2)
        if hasattr(fn, "report"):
            row[f"{name}_report"] = str(fn.report)
    except Exception as exc:  # a failure is a row
        row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        traceback.print_exc(file=sys.stderr)
    print(json.dumps({k: v for k, v in row.items() if k.startswith(name)}), file=sys.stderr, flush=True)
    return fn


def kernel_profile(fn, steps: int, top: int = 12) -> str:
    """The kernels one call of ``fn`` runs: device microseconds per step by kernel name, and their sum.

    On the H200 with torch 2.14.1 the first column profiled in a process listed only a
    fraction of a step's kernels (0.2 per step), with or without a profiling session
    before it: compare the kernel count per step with the graph's."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            totals.setdefault(e.name, []).append(e.device_time)
    rows = sorted(((sum(v), len(v), k) for k, v in totals.items()), reverse=True)
    lines = [f"  {us / steps:8.2f} us/step  {n / steps:5.1f} x/step  {name[:100]}" for us, n, name in rows[:top]]
    lines.append(f"  {sum(r[0] for r in rows) / steps:8.2f} us/step in {sum(r[1] for r in rows) / steps:.1f} kernels")
    return "\n".join(lines)


def _patched_variants(model, x, steps_t, dtype, row, module, name: str, values: dict) -> dict:
    """The full pipeline (Inductor regions) compiled once per ``{column: value}`` of
    ``module.<name>`` (captured under that value, then the value restored)."""
    saved = getattr(module, name)
    fns = {}
    try:
        for column_name, value in values.items():
            setattr(module, name, value)
            fn = branchyard.compile(model, (x, steps_t), passes=("cond_to_switch", "nvgemm"), inductor=True)
            row[f"{column_name}_agrees"] = agreement(fn, model, x, dtype)  # captured here, under this value
            fns[column_name] = fn
    finally:
        setattr(module, name, saved)
    return fns


def race(fns: dict, x, steps_t, steps: int, reps: int, row: dict, rounds: int = 7) -> None:
    """``<column>_us_per_step`` for each of ``fns``, timed in interleaved rounds in one process."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(rounds):
        for name in fns if i % 2 == 0 else reversed(list(fns)):
            times[name].append(time_call_ms(lambda fn=fns[name]: fn(x, steps_t), max(3, reps // rounds)))
    for name, ts in times.items():
        row[f"{name}_us_per_step"] = round(sorted(ts)[len(ts) // 2] * 1e3 / steps, 2)
    print(json.dumps({k: v for k, v in row.items() if any(k.startswith(n) for n in fns)}), file=sys.stderr, flush=True)


def ablate_router(model, x, steps_t, steps: int, reps: int, dtype, row: dict) -> None:
    """``router_kernel`` / ``router_ops``: the full pipeline (Inductor regions) with the router set kernel
    taking every router and none."""
    from branchyard.lowering.cuda_graph import patterns

    fns = _patched_variants(model, x, steps_t, dtype, row, patterns, "MAX_ROUTER_ELEMENTS",
                            {"router_kernel": 1 << 30, "router_ops": 0})
    race(fns, x, steps_t, steps, reps, row)


def ablate_rotation(model, x, steps_t, steps: int, reps: int, dtype, row: dict) -> None:
    """``router_in_step`` / ``router_in_body``: the full pipeline (Inductor regions) with the next
    trip's router computed by the loop's step kernel, and by its own kernel at the top of the body."""
    from branchyard.lowering.cuda_graph import handlers

    fns = _patched_variants(model, x, steps_t, dtype, row, handlers, "ROTATE_ROUTER",
                            {"router_in_step": True, "router_in_body": False})
    race(fns, x, steps_t, steps, reps, row)


def floor_us(weight_bytes: float, copy_gbs: float, empty_us: float) -> dict:
    """The step's floor: one read of the weights at the measured DRAM rate, plus an empty WHILE+SWITCH step.

    ``copy_gbs`` counts the bytes a copy reads and writes, i.e. what DRAM moves per
    second, so reading ``weight_bytes`` once takes ``weight_bytes / copy_gbs``.
    """
    hbm = weight_bytes / (copy_gbs * 1e9) * 1e6
    return {"hbm_floor_us": round(hbm, 2), "floor_us": round(hbm + empty_us, 2)}


def bench(dim: int, hidden: int, batch: int, args) -> dict:
    torch.manual_seed(0)
    dtype = torch.bfloat16
    model = DecodeLoop(dim, hidden, num_experts=8).to(DEV, dtype).eval()
    x = torch.randn(batch, dim, device=DEV, dtype=dtype)
    steps_t = torch.tensor(args.steps, device=DEV)
    row: dict = {"dim": dim, "hidden": hidden, "batch": batch, "steps": args.steps}
    weights = sum(p.numel() * p.element_size() for e in model.experts[:1] for p in e.parameters())
    weights += model.router.numel() * model.router.element_size()
    row["weight_bytes_per_step"] = weights
    row["empty_loop_us"] = round(args.empty_us, 2)
    row.update(floor_us(weights, args.copy_gbs, args.empty_us))
    cols = set(args.columns)
    with torch.no_grad():
        ep = None
        if "eager" in cols:
            column("eager", lambda: model, model, x, steps_t, args.steps, args.reps, dtype, row)
        if "compile" in cols:
            column("compile", lambda: torch.compile(model), model, x, steps_t, args.steps, args.reps, dtype, row)
        if "reduce_overhead" in cols:
            column(
                "reduce_overhead", lambda: torch.compile(model, mode="reduce-overhead"), model, x, steps_t,
                args.steps, args.reps, dtype, row,
            )
        if "torch_cond_nodes" in cols:
            def build_torch():
                return torch_cond_nodes(torch.export.export(model, (x, steps_t)), (x, steps_t))

            column("torch_cond_nodes", build_torch, model, x, steps_t, args.steps, args.reps, dtype, row)
        variants = {
            "by_graph": ((), False),
            "by_switch": (("cond_to_switch",), False),
            "by_full": (("cond_to_switch", "nvgemm"), False),
            "by_full_inductor": (("cond_to_switch", "nvgemm"), True),
            "by_switch_inductor": (("cond_to_switch",), True),
        }
        for name, (passes, inductor) in variants.items():
            if name in cols:
                fn = column(
                    name,
                    lambda passes=passes, inductor=inductor: branchyard.compile(
                        model, (x, steps_t), passes=passes, inductor=inductor
                    ),
                    model, x, steps_t, args.steps, args.reps, dtype, row,
                )
                if args.profile and fn is not None:  # the column's own capture, not a second compile
                    print(f"# {name}, batch {batch}: kernels per step\n"
                          + kernel_profile(lambda: fn(x, steps_t), args.steps), flush=True)
        if args.ablate_router:
            ablate_router(model, x, steps_t, args.steps, args.reps, dtype, row)
        if args.ablate_rotation:
            ablate_rotation(model, x, steps_t, args.steps, args.reps, dtype, row)
        del ep
    torch._dynamo.reset()
    return row


COLUMNS = ["eager", "compile", "reduce_overhead", "torch_cond_nodes", "by_graph", "by_switch", "by_full",
           "by_full_inductor", "by_switch_inductor"]
#: Columns --ablate-router and --ablate-rotation add (not chosen with --columns).
ABLATION_COLUMNS = ["router_kernel", "router_ops", "router_in_step", "router_in_body"]


def markdown(rows: list[dict]) -> str:
    """A table of us/step per column, the floor, and the full pipeline's speedups (rows from --json files)."""
    cols = [c for c in COLUMNS + ABLATION_COLUMNS if any(f"{c}_us_per_step" in r or f"{c}_error" in r for r in rows)]
    head = ["torch", "shape", "batch", *cols, "floor"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "copy_gbs" in r:  # recomputed, so rows written by older versions of this script agree
            r = {**r, **floor_us(r["weight_bytes_per_step"], r["copy_gbs"], r["empty_loop_us"])}
        cells = [r.get("torch", "?").split("+")[0], f"{r['dim']}x{r['hidden']}", str(r["batch"])]
        for c in cols:
            if f"{c}_us_per_step" in r:
                ok = all(v is True for v in r.get(f"{c}_agrees", {}).values())
                cells.append(f"{r[f'{c}_us_per_step']:.1f}" + ("" if ok else " (differs)"))
            elif f"{c}_error" in r:
                cells.append("fails: " + r[f"{c}_error"].split(":")[0])
            else:
                cells.append("")
        cells.append(f"{r['floor_us']:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    for r in rows:
        for c in cols:
            d = r.get(f"{c}_agrees", {}).get("divergence")
            if d and d.get("first_trip"):
                lines.append(f"\n{c}, {r['dim']}x{r['hidden']} batch {r['batch']}: differs from eager from trip "
                             f"{d['first_trip']} on; eager's two largest router logits at that step are "
                             f"{d['eager_top2_logit_gap']:.3g} apart (a bfloat16 ulp there: {d['bf16_ulp_at_top']:.3g})")
    for r in rows:
        mine = [(r[f"{c}_us_per_step"], c) for c in cols if c.startswith(("by_", "router_")) and f"{c}_us_per_step" in r]
        if not mine:
            continue
        ours = min(mine)
        ratios = [f"{c} {r[f'{c}_us_per_step'] / ours[0]:.1f}x" for c in ("eager", "compile", "reduce_overhead",
                  "torch_cond_nodes") if f"{c}_us_per_step" in r]
        lines.append(f"\ntorch {r.get('torch', '?')}, {r['dim']}x{r['hidden']} batch {r['batch']}: best branchyard column {ours[1]} "
                     f"{ours[0]:.1f} us/step; speedup over " + ", ".join(ratios))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["1024x4096", "4096x14336"], help="DIMxHIDDEN")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument(
        "--columns", nargs="+",
        default=COLUMNS,
    )
    p.add_argument("--ablate-router", action="store_true",
                   help="add the router_kernel / router_ops columns (timed in interleaved rounds)")
    p.add_argument("--ablate-rotation", action="store_true",
                   help="add the router_in_step / router_in_body columns (timed in interleaved rounds)")
    p.add_argument("--profile", action="store_true", help="print each branchyard column's kernels per step")
    p.add_argument("--json", help="append one JSON row per (shape, batch) to this file")
    p.add_argument("--markdown", nargs="+", metavar="ROWS.jsonl", help="print a table of earlier --json rows and exit")
    args = p.parse_args()
    if args.markdown:
        rows = [json.loads(line) for path in args.markdown for line in open(path) if line.strip()]
        print(markdown(rows))
        return
    warnings.simplefilter("ignore")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, Python {platform.python_version()}, "
          f"switch {'yes' if HAS_SWITCH else 'no'}", flush=True)
    args.copy_gbs = copy_bandwidth_gbs()
    args.empty_us = empty_switch_loop_us(8, 1000)
    print(f"# copy bandwidth {args.copy_gbs:.0f} GB/s (read + write); empty WHILE+SWITCH step {args.empty_us:.2f} us",
          flush=True)
    for shape in args.shapes:
        dim, hidden = (int(v) for v in shape.split("x"))
        for batch in args.batches:
            row = bench(dim, hidden, batch, args)
            row.update(device=torch.cuda.get_device_name(), torch=torch.__version__, copy_gbs=round(args.copy_gbs))
            line = json.dumps(row)
            print(line, flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(line + "\n")


if __name__ == "__main__":
    main()
