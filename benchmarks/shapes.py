"""Dynamic shapes: one ShapesSpec vs torch's alternatives (a script, not a test).

Part 1 -- compile once, call across N batch sizes in range (default 20):
recompiles and total time of those calls (compilation dominates it) for

* ``branchyard.shapes.compile`` with ``batch = ShapeVar(min=2, max=128)``;
* ``torch.compile(dynamic=True)`` (backed symbols, guards);
* ``torch.compile`` with no spec (static first, then automatic dynamic);

plus the steady-state time of one call once everything is compiled
(all variants stay compiled and are timed round-robin, eager alongside).

Part 2 -- export of a block whose three inputs share ``batch`` and one is
``2 * batch``: export time, graph nodes, runtime asserts and symbols for

* ``branchyard.shapes.export`` with the ShapesSpec;
* ``torch.export.export`` with ``Dim``-based ``dynamic_shapes``
  (``spec.to_dynamic_shapes()``);
* ``torch.export.export`` with torch's native ``ShapesSpec`` (``spec.to_torch()``);
* ``branchyard.shapes.export(..., strict=True)``.

Part 3 -- the same block under ``torch.compile``, called across the N sizes:
what the backend receives (a counting backend keeps Dynamo's graph) --
frames compiled, unbacked symbols (after the ShapeEnv's replacements, and as
Dynamo allocated them), ``_assert_scalar`` and ``sym_constrain_range*`` nodes,
and the time of the N first calls -- for

* ``branchyard.shapes.compile`` with the ShapesSpec;
* ``torch.compile(dynamic_shapes=spec.to_torch())`` (torch's native spec, as
  ``torch.compile`` of a ``@dynamic_spec``-decorated callable gets it);
* ``torch.compile`` with ``torch._dynamo.decorators.mark_unbacked(t, 0, shape_id="batch",
  min=2, max=128)`` on each call's inputs (``pair``, ``2*batch``, cannot be
  tied by a shape_id: it gets its own range).

Run: ``python benchmarks/shapes.py [--backend inductor] [--sizes 20] [--json out.json]``.
On a shared machine compare within one run; the script prints ratios.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import types
from typing import Any

import torch
import torch._inductor.config
from torch._dynamo.utils import counters

import branchyard.shapes as shapes
from branchyard.shapes import ShapesSpec, ShapeVar

BATCH = ShapeVar("batch", min=2, max=128)
VARIANTS = ("shapes.compile (spec)", "torch.compile(dynamic=True)", "torch.compile (no spec)")


class MLP(torch.nn.Module):
    def __init__(self, d: int = 256):
        super().__init__()
        self.up = torch.nn.Linear(d, 2 * d)
        self.down = torch.nn.Linear(2 * d, d)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x))) + x


def sizes_in_range(n: int) -> list[int]:
    # spread over [2, 128], odd and even, never repeating
    out = sorted({round(2 + i * (126 / (n - 1))) for i in range(n)})
    return out


def warm_up(backend: str) -> None:
    """One throwaway compile, so the first measured variant does not pay for
    the compiler's own start-up (imports, C++ toolchain probes)."""
    torch._dynamo.reset()
    f = torch.compile(lambda t: torch.nn.functional.gelu(t @ t.T).sum(0), backend=backend)
    f(torch.randn(5, 7))
    f(torch.randn(6, 7))


def fresh_model(tag: str, d: int) -> MLP:
    """An MLP whose forward is its own code object, so variants never share
    Dynamo cache entries and all can stay compiled side by side."""
    code = MLP.forward.__code__.replace(co_name=f"forward_{tag}")
    forward = types.FunctionType(code, MLP.forward.__globals__, f"forward_{tag}")
    cls = type(f"MLP_{tag}", (MLP,), {"forward": forward})
    torch.manual_seed(0)
    return cls(d).eval()


def compile_variant(variant: str, backend: str, sizes: list[int], d: int) -> tuple[dict, Any, MLP]:
    tag = str(abs(hash(variant)))
    model = fresh_model(tag, d)
    if variant == "shapes.compile (spec)":
        fn = shapes.compile(model, spec={"x": (BATCH, d)}, backend=backend)
    elif variant == "torch.compile(dynamic=True)":
        fn = torch.compile(model, backend=backend, dynamic=True)
    else:
        fn = torch.compile(model, backend=backend)
    inputs = [torch.randn(n, d) for n in sizes]
    before = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        t0 = time.perf_counter()
        for x in inputs:
            fn(x)
        total = time.perf_counter() - t0
        for x in inputs[:3]:
            torch.testing.assert_close(fn(x), model(x), rtol=1e-4, atol=1e-4)
    graphs = counters["stats"]["unique_graphs"] - before
    row = {"variant": variant, "graphs_compiled": graphs, "recompiles": max(graphs - 1, 0), "first_pass_s": total}
    return row, fn, model


def steady_calls(fns: dict[str, Any], sizes: list[int], d: int, rounds: int) -> dict[str, float]:
    """Best-of-``rounds`` time per call over all sizes, variants measured
    round-robin so the machine's load hits them alike (the minimum is the
    statistic least disturbed by other processes on a shared machine)."""
    inputs = [torch.randn(n, d) for n in sizes]
    times: dict[str, list[float]] = {k: [] for k in fns}
    with torch.no_grad():
        for _ in range(rounds):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                for x in inputs:
                    fn(x)
                times[name].append((time.perf_counter() - t0) / len(inputs))
    return {k: min(v) for k, v in times.items()}


class Block(torch.nn.Module):
    """Three inputs share ``batch``; ``pair`` has ``2 * batch`` rows."""

    def __init__(self, d: int = 64):
        super().__init__()
        self.q = torch.nn.Linear(d, d)
        self.k = torch.nn.Linear(d, d)

    def forward(self, x, bias, scale, pair):
        h = self.q(x) * scale + bias
        return self.k(h) + pair.reshape(2, -1, pair.shape[1]).sum(0)


def graph_stats(ep: torch.export.ExportedProgram) -> dict:
    nodes = list(ep.graph.nodes)
    return {
        "nodes": len(nodes),
        "asserts": sum(n.target is torch.ops.aten._assert_scalar.default for n in nodes),
        "symbols": len(ep.range_constraints),
    }


def run_export(d: int, repeats: int) -> list[dict]:
    spec = ShapesSpec({"x": (BATCH, d), "bias": (BATCH, d), "scale": (BATCH, 1), "pair": (2 * BATCH, d)})
    block = Block(d).eval()
    args = (torch.randn(8, d), torch.randn(8, d), torch.randn(8, 1), torch.randn(16, d))
    variants = {
        "shapes.export (spec)": lambda: shapes.export(block, args, spec=spec),
        "torch.export + Dim": lambda: torch.export.export(block, args, dynamic_shapes=spec.to_dynamic_shapes(block)),
        "torch.export + native ShapesSpec": lambda: torch.export.export(block, args, dynamic_shapes=spec.to_torch(block)),
        "shapes.export (spec, strict=True)": lambda: shapes.export(block, args, spec=spec, strict=True),
    }
    rows = []
    for name, make in variants.items():
        make()  # warm caches shared by all variants
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            ep = make()
            times.append(time.perf_counter() - t0)
        check = (torch.randn(5, d), torch.randn(5, d), torch.randn(5, 1), torch.randn(10, d))
        torch.testing.assert_close(ep.module()(*check), block(*check))
        rows.append({"variant": name, "export_s": statistics.median(times), **graph_stats(ep)})
    return rows


class KeepGraphs:
    """A backend that keeps each Dynamo graph and runs it as is (eager)."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self.raw_symbols: set = set()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

        self.graphs.append(gm)
        for node in gm.graph.find_nodes(op="placeholder"):
            for d in getattr(node.meta.get("example_value"), "shape", ()):
                if isinstance(d, torch.SymInt):
                    self.raw_symbols |= free_unbacked_symbols(d.node._expr)
        return gm

    def stats(self) -> dict:
        from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

        symbols: set = set()
        nodes = [n for gm in self.graphs for n in gm.graph.nodes]
        for n in nodes:
            if n.op == "placeholder":
                for d in getattr(n.meta.get("example_value"), "shape", ()):
                    symbols |= free_unbacked_symbols(d)
        return {
            "frames": len(self.graphs),
            "symbols": len(symbols),
            "symbols_allocated": len(self.raw_symbols),
            "asserts": sum(n.target is torch.ops.aten._assert_scalar.default for n in nodes),
            "constrain_range": sum("constrain_range" in str(n.target) for n in nodes),
        }


def run_compile_graphs(d: int, sizes: list[int]) -> list[dict]:
    spec = ShapesSpec({"x": (BATCH, d), "bias": (BATCH, d), "scale": (BATCH, 1), "pair": (2 * BATCH, d)})
    block = Block(d).eval()

    def inputs(n: int) -> tuple:
        return torch.randn(n, d), torch.randn(n, d), torch.randn(n, 1), torch.randn(2 * n, d)

    def marked(n: int) -> tuple:
        a = inputs(n)
        for t in a[:3]:
            torch._dynamo.decorators.mark_unbacked(t, 0, shape_id="batch", min=BATCH.min, max=BATCH.max)
        torch._dynamo.decorators.mark_unbacked(a[3], 0, min=2 * BATCH.min, max=2 * BATCH.max)
        return a

    variants = {
        "shapes.compile (spec)": (lambda b: shapes.compile(block, spec=spec, backend=b), inputs),
        "torch.compile + native ShapesSpec": (
            lambda b: torch.compile(block, backend=b, fullgraph=True, dynamic_shapes=spec.to_torch(block)), inputs),
        "torch.compile + mark_unbacked(shape_id)": (lambda b: torch.compile(block, backend=b, fullgraph=True), marked),
    }
    rows = []
    with torch.no_grad():
        for name, (make, make_inputs) in variants.items():
            torch._dynamo.reset()
            keep = KeepGraphs()
            fn = make(keep)
            calls = [make_inputs(n) for n in sizes]
            t0 = time.perf_counter()
            for a in calls:
                fn(*a)
            total = time.perf_counter() - t0
            check = inputs(5)
            torch.testing.assert_close(fn(*check), block(*check))
            rows.append({"variant": name, "first_pass_s": total, **keep.stats()})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--sizes", type=int, default=20)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--export-repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=7, help="round-robin rounds for steady-state call time")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: least noise on a shared CPU)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)

    sizes = sizes_in_range(a.sizes)
    torch.set_num_threads(a.threads)
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "threads": torch.get_num_threads(),
        "cpus": __import__("os").cpu_count(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date": time.strftime("%Y-%m-%d"),
        "backend": a.backend,
        "sizes": sizes,
    }
    print(json.dumps(env))
    # no cross-variant cache hits: each variant compiles from scratch
    torch._inductor.config.fx_graph_cache = False
    torch._inductor.config.autotune_local_cache = False
    warm_up(a.backend)
    torch._dynamo.reset()
    counters.clear()
    compiled = [compile_variant(v, a.backend, sizes, a.dim) for v in VARIANTS]
    fns = {row["variant"]: fn for row, fn, _ in compiled}
    fns["eager (no compile)"] = compiled[0][2]
    steady = steady_calls(fns, sizes, a.dim, a.rounds)
    compile_rows = [row | {"steady_call_s": steady[row["variant"]]} for row, _, _ in compiled]
    eager = steady["eager (no compile)"]
    base = compile_rows[0]
    print(f"\n== compile once, call {len(sizes)} sizes in [2, 128], backend={a.backend}")
    print(f"{'variant':32} {'graphs':>6} {'recompiles':>10} {'first pass':>11} {'vs spec':>8} {'steady call':>12} {'vs spec':>8}")
    for r in compile_rows:
        print(
            f"{r['variant']:32} {r['graphs_compiled']:>6} {r['recompiles']:>10} {r['first_pass_s']:>10.2f}s "
            f"{r['first_pass_s'] / base['first_pass_s']:>7.2f}x {r['steady_call_s'] * 1e6:>10.0f}us "
            f"{r['steady_call_s'] / base['steady_call_s']:>7.2f}x"
        )
    print(f"{'eager (no compile)':32} {'':>6} {'':>10} {'':>11} {'':>8} {eager * 1e6:>10.0f}us {eager / base['steady_call_s']:>7.2f}x")
    export_rows = run_export(64, a.export_repeats)
    eb = export_rows[0]
    print("\n== export: 3 inputs share batch, 1 input is 2*batch")
    print(f"{'variant':34} {'export':>9} {'vs spec':>8} {'nodes':>6} {'asserts':>8} {'symbols':>8}")
    for r in export_rows:
        print(
            f"{r['variant']:34} {r['export_s']:>8.3f}s {r['export_s'] / eb['export_s']:>7.2f}x "
            f"{r['nodes']:>6} {r['asserts']:>8} {r['symbols']:>8}"
        )
    graph_rows = run_compile_graphs(64, sizes)
    gb = graph_rows[0]
    print(f"\n== torch.compile of the same block, {len(sizes)} sizes: the graph the backend receives")
    print(f"{'variant':40} {'frames':>6} {'symbols':>8} {'allocated':>9} {'asserts':>8} {'constrain':>9} {'first pass':>11} {'vs spec':>8}")
    for r in graph_rows:
        print(
            f"{r['variant']:40} {r['frames']:>6} {r['symbols']:>8} {r['symbols_allocated']:>9} {r['asserts']:>8} "
            f"{r['constrain_range']:>9} {r['first_pass_s']:>10.2f}s {r['first_pass_s'] / gb['first_pass_s']:>7.2f}x"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {"env": env, "eager_call_s": eager, "compile": compile_rows, "export": export_rows, "compile_graphs": graph_rows},
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
