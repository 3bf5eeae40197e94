"""Benchmark: control flow as CUDA graph conditional nodes (branchyard.lowering.cuda_graph).

Needs a CUDA GPU and cuda-bindings. Prints Markdown tables (pasted into
docs/benchmarks.md) and, with ``--json PATH``, the raw figures.

1. while_loop, 10 / 100 / 1000 / 10000 trips of ``i += 1; x = lerp(x, c, 0.5)``
   over 64K floats: torch's eager ``while_loop`` and a host loop that syncs each
   trip (both the median of several timed calls: they are noisy), our one-graph
   lowering, and three hand-built graphs (benchmarks/cuda_graph_reference.py):
   the minimal 2-kernel body, one with the same 2 kernel nodes our lowering
   emits (NVRTC kernels), and that one with torch's own lerp kernel.
2. An 8-way switch inside a 1000-step loop, four lowerings of the same
   program: one SWITCH node (ours); 8 IF nodes whose handles one kernel sets
   (XLA's lowering of an n-way case); 8 IF nodes with a set kernel each; and
   the balanced tree of ``torch.cond`` that ``switch_to_cond`` makes (the index
   clamped, then 3 nested IF/ELSE levels), lowered by us. Plus a host loop calling an
   Inductor-compiled step with one ``.item()`` per step.
3. cond inside a 1000-step loop: one IF/ELSE node vs two IF nodes.
4. Nested loops (100 outer x 10 inner trips).

    python benchmarks/cuda_graph_control_flow.py [--json out.json] [--no-inductor]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings

import torch
from torch._higher_order_ops.while_loop import while_loop

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from branchyard.lowering.cuda_graph import CudaGraphFallbackWarning, cuda_graph  # noqa: E402
from branchyard.lowering.cuda_graph.fx_builders import cond_tree_module, switch_module, trace, while_loop_module  # noqa: E402

DEV = "cuda"
N = 1 << 16


def scalar(v, dtype=torch.int64):
    return torch.tensor(v, dtype=dtype, device=DEV)


def time_median_ms(fn, calls: int, warmup: int = 1) -> float:
    """Median milliseconds of ``calls`` separately timed calls (robust to the host's hiccups)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def path_nodes(count) -> int:
    """Graph nodes one trip runs: a body's own nodes plus, below each conditional, the costliest body."""
    return count.own + (max(path_nodes(b) for b in count.bodies) if count.bodies else 0)


def time_ms(fn, reps: int, warmup: int = 1) -> float:
    """Mean milliseconds per call, measured with CUDA events around ``reps`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def lower(program, args, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("error", CudaGraphFallbackWarning)
        m = cuda_graph(program, args, **options)
    return m


# --------------------------------------------------------------------------- 1. while_loop
class Countdown(torch.nn.Module):
    def forward(self, x, c, n):
        def body_fn(i, y):
            return i + 1, torch.lerp(y, c, 0.5)

        return while_loop(lambda i, y: i < n, body_fn, (torch.zeros((), dtype=torch.int64, device=x.device), x))


def host_loop(x, c, n):
    i, y = scalar(0), x
    while bool(i < n):  # one device->host sync per trip
        i, y = i + 1, torch.lerp(y, c, 0.5)
    return i, y


def bench_while(results: dict) -> list[str]:
    from cuda_graph_reference import ReferenceLoop

    x, c = torch.randn(N, device=DEV), torch.randn(N, device=DEV)
    ep = torch.export.export(Countdown(), (x, c, scalar(10)))
    eager = ep.module()
    ours = lower(ep, (x, c, scalar(10)))
    zero = time_ms(lambda: ours(x, c, scalar(0)), reps=50)
    rows = [
        "| trips | eager `while_loop` µs/iter (median) | host loop µs/iter (median) | **ours** µs/iter | hand-built, same 2 nodes | "
        "same 2 nodes, torch's lerp | hand-built, minimal 2 kernels | eager / ours | ours / same | ours / same-with-torch-kernels | equal |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for trips in (10, 100, 1000, 10000):
        n = scalar(trips)
        reps = max(3, 20000 // trips)
        t_ours = time_ms(lambda: ours(x, c, n), reps=reps)
        calls = 5 if trips >= 1000 else 11
        t_eager = time_median_ms(lambda: eager(x, c, n), calls=calls)
        t_host = time_median_ms(lambda: host_loop(x, c, n), calls=calls)
        got, want = ours(x, c, n), eager(x, c, n)
        equal = all(torch.equal(a, b) for a, b in zip(got, want))
        t_ref, refs = {}, {}
        for body in ("same", "torch", "minimal"):
            try:
                r = ReferenceLoop(x.clone(), c, n, body)
                r.launch()  # one launch from x must give eager's result (NVRTC may contract to FMA)
                torch.cuda.synchronize()
                if not torch.allclose(r.x, want[1], rtol=1e-5, atol=1e-6):
                    raise RuntimeError(f"hand-built '{body}' graph disagrees with eager at {trips} trips")
                refs[body], t_ref[body] = r, r.time_ms(reps)
            except Exception as exc:  # keep the other columns
                print(f"reference '{body}' failed: {type(exc).__name__}: {exc}", flush=True)
                t_ref[body] = float("nan")
        per = lambda t: t * 1e3 / trips  # noqa: E731
        results.setdefault("while", []).append(
            dict(trips=trips, eager=per(t_eager), host=per(t_host), ours=per(t_ours), ours_slope=(t_ours - zero) * 1e3 / trips,
                 same=per(t_ref["same"]), same_torch=per(t_ref["torch"]), minimal=per(t_ref["minimal"]), equal=equal,
                 ref_body_nodes={body: r.body_nodes for body, r in refs.items()})
        )
        rows.append(
            f"| {trips} | {per(t_eager):.1f} | {per(t_host):.1f} | {per(t_ours):.2f} | {per(t_ref['same']):.2f} | "
            f"{per(t_ref['torch']):.2f} | {per(t_ref['minimal']):.2f} | {t_eager / t_ours:.1f}× | {t_ours / t_ref['same']:.2f} | "
            f"{t_ours / t_ref['torch']:.2f} | {'yes' if equal else 'NO'} |"
        )
    results["while_nodes"] = ours.graph_nodes.summary() if ours.graph_nodes else None
    results["while_body_nodes"] = dict(ours.graph_nodes.bodies[0].by_type) if ours.graph_nodes else None
    results["while_call_overhead_us"] = zero * 1e3
    rows.append("")
    rows.append(f"Our graph: {results['while_nodes']}; loop body {results['while_body_nodes']}; a call with 0 trips (copy-in, replay, clone-out) takes {zero * 1e3:.1f} µs.")
    return rows


# --------------------------------------------------------------------------- 2. switch
BRANCH_SCALES = [(0.5 + 0.0625 * k, 0.01 * k) for k in range(8)]


def make_branch(k):
    a, b = BRANCH_SCALES[k]
    return lambda x: x * a + b


def switch_loop():
    branches = [make_branch(k) for k in range(8)]

    class Body(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sw = switch_module(branches, num_operands=1)

        def forward(self, i, x, ks):
            return i + 1, self.sw(torch.index_select(ks, 0, i.view(1)), x)[0]

    return branches, while_loop_module(lambda i, x, ks: i < ks.shape[0], trace(Body()), num_carried=2, num_additional=1)


def tree_loop(branches):
    """The switch loop after switch_to_cond: fx_builders.cond_tree_module builds the pass's
    structure by hand, since torch 2.11 has no switch op for the pass to rewrite."""

    class Body(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tree = cond_tree_module(branches, num_operands=1)

        def forward(self, i, x, ks):
            return i + 1, self.tree(torch.index_select(ks, 0, i.view(1)).reshape(()), x)[0]

    return while_loop_module(lambda i, x, ks: i < ks.shape[0], trace(Body()), num_carried=2, num_additional=1)


SWITCH_LOWERINGS = (
    ("one SWITCH node (**ours**)", "switch", dict()),
    ('8 IF nodes, one set kernel for all (XLA-style, `switch="if_chain"`)', "switch", dict(switch="if_chain")),
    ('8 IF nodes, a set kernel each (`switch="if_chain_each"`)', "switch", dict(switch="if_chain_each")),
    ("`switch_to_cond`'s tree (clamp, then 3 nested IF/ELSE levels)", "tree", dict()),
)


def bench_switch(results: dict, inductor: bool) -> list[str]:
    steps = 1000
    branches, program = switch_loop()
    programs = {"switch": program, "tree": tree_loop(branches)}
    x, ks = torch.randn(N, device=DEV), torch.randint(0, 8, (steps,), device=DEV)
    args = (scalar(0), x, ks)
    ref = x.clone()
    for k in ks.tolist():
        ref = branches[k](ref)
    rows = [
        "| lowering | µs/step | SWITCH's advantage | conditional nodes | nodes run per step | graph nodes (total) | equal |",
        "|---|---:|---:|---|---:|---:|:---:|",
    ]
    entries = []
    for name, which, options in SWITCH_LOWERINGS:
        m = lower(programs[which], args, **options)
        t = time_ms(lambda: m(*args), reps=5) * 1e3 / steps
        equal = torch.equal(m(*args)[1], ref)
        cn = {k: v for k, v in m.conditional_nodes.items() if v}
        per_step = path_nodes(m.graph_nodes.bodies[0]) if m.graph_nodes else None
        total = m.graph_nodes.total if m.graph_nodes else None
        entries.append((name, t))
        rows.append(f"| {name} | {t:.2f} | {t / entries[0][1]:.2f}× | {cn} | {per_step} | {total} | {'yes' if equal else 'NO'} |")
        results.setdefault("switch", []).append(
            dict(name=name, us_per_step=t, equal=equal, nodes=cn, per_step=per_step, total=total,
                 summary=m.graph_nodes.summary() if m.graph_nodes else None)
        )
    rows += hand_built_switch_rows(results, x, ks, entries[0][1], steps)
    if inductor:
        # One Inductor kernel for all 8 branches (x * a_k + b_k), the branch picked on the host.
        compiled = torch.compile(lambda y, a, b: y * a + b)
        scales = torch.tensor([a for a, _ in BRANCH_SCALES], device=DEV)
        shifts = torch.tensor([b for _, b in BRANCH_SCALES], device=DEV)
        t0 = time.perf_counter()
        compiled(x, scales[0], shifts[0])
        compile_s = time.perf_counter() - t0

        def host():
            y = x
            for t in range(steps):
                k = int(ks[t].clamp(0, 7).item())  # one host sync per step
                y = compiled(y, scales[k], shifts[k])
            return y

        t = time_ms(host, reps=2) * 1e3 / steps
        equal = torch.allclose(host(), ref, rtol=1e-4, atol=1e-4)
        rows.append(f"| Inductor-compiled step, host `.item()` per step | {t:.2f} | {t / entries[0][1]:.2f}× | none | – | – | {'close' if equal else 'NO'} |")
        results.setdefault("switch", []).append(dict(name="inductor+host", us_per_step=t, equal=bool(equal), compile_s=compile_s))
        entries.append(("inductor", t))
    rows.append("")
    rows.append("SWITCH is " + ", ".join(f"{t / entries[0][1]:.2f}× faster than {name}" for name, t in entries[1:]) + ".")
    return rows


def hand_built_switch_rows(results: dict, x, ks, t_ours: float, steps: int) -> list[str]:
    """The same switch loop as hand-built graphs (benchmarks/cuda_graph_reference.py):
    SWITCH vs the one-kernel 8-IF chain with no branchyard code, in the issue's minimal
    layout and in the node layout our lowering emits -- what ratio the hardware allows."""
    from cuda_graph_reference import ReferenceSwitchLoop, switch_reference

    scales, shifts = [a for a, _ in BRANCH_SCALES], [b for _, b in BRANCH_SCALES]
    want = switch_reference(x, ks, scales, shifts)
    rows, times = [], {}
    for layout in ("minimal", "same"):
        for lowering in ("switch", "chain"):
            name = f"hand-built, {layout} layout, " + ("one SWITCH node" if lowering == "switch" else "8 IF nodes, one set kernel")
            try:
                r = ReferenceSwitchLoop(x.clone(), ks, scales, shifts, lowering, layout)
                r.launch()
                torch.cuda.synchronize()
                equal = torch.allclose(r.x, want, rtol=1e-5, atol=1e-6)  # NVRTC may contract to FMA
                t = r.time_ms(reps=5) * 1e3 / steps
            except Exception as exc:  # keep the other rows
                print(f"hand-built switch ({layout}, {lowering}) failed: {type(exc).__name__}: {exc}", flush=True)
                continue
            times[(layout, lowering)] = t
            rows.append(f"| {name} | {t:.2f} | {t / t_ours:.2f}× | – | {r.nodes_per_trip} | – | {'close' if equal else 'NO'} |")
            results.setdefault("switch_hand_built", []).append(
                dict(layout=layout, lowering=lowering, us_per_step=t, nodes_per_trip=r.nodes_per_trip, equal=bool(equal)))
    for layout in ("minimal", "same"):
        if (layout, "switch") in times and (layout, "chain") in times:
            ratio = times[(layout, "chain")] / times[(layout, "switch")]
            results[f"switch_hand_built_ratio_{layout}"] = ratio
            rows.append(f"| hand-built {layout} layout: 8-IF chain / SWITCH | {ratio:.2f}× | | | | | |")
    return rows


# --------------------------------------------------------------------------- 3. cond in a loop
class CondInWhile(torch.nn.Module):
    def forward(self, x, n):
        def body_fn(i, y):
            return i + 1, torch.cond(y.sum() > 0, lambda t: t * 0.5 - 3.0, lambda t: t * -1.5 + 1.0, (y,))

        return while_loop(lambda i, y: i < n, body_fn, (torch.zeros((), dtype=torch.int64, device=x.device), x))


def bench_cond(results: dict) -> list[str]:
    steps = 1000
    x = torch.randn(N, device=DEV)
    ep = torch.export.export(CondInWhile(), (x, scalar(5)))
    want = ep.module()(x, scalar(steps))
    rows = ["| IF lowering | µs/iter | conditional nodes | graph nodes | equal |", "|---|---:|---|---|:---:|"]
    for mode in ("one_node", "two_nodes"):
        m = lower(ep, (x, scalar(5)), if_else=mode)
        t = time_ms(lambda: m(x, scalar(steps)), reps=5) * 1e3 / steps
        equal = all(torch.equal(a, b) for a, b in zip(m(x, scalar(steps)), want))
        cn = {k: v for k, v in m.conditional_nodes.items() if v}
        rows.append(f"| {mode.replace('_', ' ')} | {t:.2f} | {cn} | {m.graph_nodes.summary() if m.graph_nodes else '?'} | {'yes' if equal else 'NO'} |")
        results.setdefault("cond", []).append(dict(mode=mode, us_per_iter=t, equal=equal))
    return rows


# --------------------------------------------------------------------------- 4. nested loops
class Nested(torch.nn.Module):
    def forward(self, x, c, n, m):
        def outer_body(i, y):
            def inner_body(j, z):
                return j + 1, torch.lerp(z, c, 0.5)

            _, y2 = while_loop(lambda j, z: j < m, inner_body, (torch.zeros_like(i), y))
            return i + 1, y2 * 0.5

        return while_loop(lambda i, y: i < n, outer_body, (torch.zeros((), dtype=torch.int64, device=x.device), x))


def bench_nested(results: dict) -> list[str]:
    x, c = torch.randn(N, device=DEV), torch.randn(N, device=DEV)
    ep = torch.export.export(Nested(), (x, c, scalar(2), scalar(2)))
    m = lower(ep, (x, c, scalar(2), scalar(2)))
    args = (x, c, scalar(100), scalar(10))
    t_ours = time_ms(lambda: m(*args), reps=5)
    t_eager = time_ms(lambda: ep.module()(*args), reps=1)
    equal = all(torch.equal(a, b) for a, b in zip(m(*args), ep.module()(*args)))
    results["nested"] = dict(ours_ms=t_ours, eager_ms=t_eager, equal=equal)
    return [
        "| program | ours ms/call | µs per inner trip | eager ms/call | eager / ours | graph nodes | equal |",
        "|---|---:|---:|---:|---:|---|:---:|",
        f"| 100 outer × 10 inner trips | {t_ours:.2f} | {t_ours * 1e3 / 1000:.2f} | {t_eager:.1f} | {t_eager / t_ours:.0f}× | "
        f"{m.graph_nodes.summary() if m.graph_nodes else '?'} | {'yes' if equal else 'NO'} |",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--no-inductor", action="store_true")
    args = parser.parse_args()
    import cuda.bindings
    import cuda.bindings.driver

    results: dict = {}
    header = (
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Python {platform.python_version()}, "
        f"CUDA driver {cuda.bindings.driver.cuDriverGetVersion()[1]}, "
        f"cuda-bindings {cuda.bindings.__version__}, {time.strftime('%Y-%m-%d', time.gmtime())}"
    )
    print(header)
    results["machine"] = header
    for title, fn in (
        ("while_loop", bench_while),
        ("8-way switch in a 1000-step loop", lambda r: bench_switch(r, not args.no_inductor)),
        ("cond in a 1000-step loop", bench_cond),
        ("nested loops", bench_nested),
    ):
        print(f"\n### {title}\n", flush=True)
        try:
            print("\n".join(fn(results)), flush=True)
        except Exception as exc:  # keep the other sections' figures
            print(f"FAILED: {type(exc).__name__}: {exc}", flush=True)
            results[f"{title} error"] = repr(exc)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
