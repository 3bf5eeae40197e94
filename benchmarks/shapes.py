"""Dynamic shapes: one ShapesSpec vs torch's alternatives (a script, not a test).

Part 1 -- compile once, call across N batch sizes in range (default 20):
recompiles and total time of those calls (compilation dominates it) for

* ``branchyard.shapes.compile`` with ``batch = ShapeVar(min=2, max=128)``;
* ``torch.compile(dynamic=True)`` (backed symbols, guards);
* ``torch.compile`` with no spec (static first, then automatic dynamic);

plus the steady-state time of one call once everything is compiled.

Part 2 -- export of a block whose three inputs share ``batch`` and one is
``2 * batch``: export time, graph nodes, runtime asserts and symbols for

* ``branchyard.shapes.export`` with the ShapesSpec;
* ``torch.export.export`` with ``Dim``-based ``dynamic_shapes``
  (``spec.to_dynamic_shapes()``);
* ``torch.export.export`` with torch's native ``ShapesSpec`` (``spec.to_torch()``).

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

import torch
from torch._dynamo.utils import counters

import branchyard.shapes as shapes
from branchyard.shapes import ShapesSpec, ShapeVar

BATCH = ShapeVar("batch", min=2, max=128)


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


def run_compile(variant: str, backend: str, sizes: list[int], d: int) -> dict:
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = MLP(d).eval()
    if variant == "shapes.compile (spec)":
        fn = shapes.compile(model, spec={"x": (BATCH, d)}, backend=backend)
    elif variant == "torch.compile(dynamic=True)":
        fn = torch.compile(model, backend=backend, dynamic=True)
    else:
        fn = torch.compile(model, backend=backend)
    inputs = [torch.randn(n, d) for n in sizes]
    with torch.no_grad():
        t0 = time.perf_counter()
        for x in inputs:
            fn(x)
        total = time.perf_counter() - t0
        steady = []
        for _ in range(3):
            t1 = time.perf_counter()
            for x in inputs:
                fn(x)
            steady.append((time.perf_counter() - t1) / len(inputs))
        for x in inputs[:3]:
            torch.testing.assert_close(fn(x), model(x), rtol=1e-4, atol=1e-4)
    frames = counters["stats"]["unique_graphs"]
    return {
        "variant": variant,
        "graphs_compiled": frames,
        "recompiles": max(frames - 1, 0),
        "first_pass_s": total,
        "steady_call_s": statistics.median(steady),
    }


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--sizes", type=int, default=20)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--export-repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)

    sizes = sizes_in_range(a.sizes)
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpus": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date": time.strftime("%Y-%m-%d"),
        "backend": a.backend,
        "sizes": sizes,
    }
    print(json.dumps(env))
    compile_rows = [run_compile(v, a.backend, sizes, a.dim) for v in ("shapes.compile (spec)", "torch.compile(dynamic=True)", "torch.compile (no spec)")]
    base = compile_rows[0]
    print(f"\n== compile once, call {len(sizes)} sizes in [2, 128], backend={a.backend}")
    print(f"{'variant':32} {'graphs':>6} {'recompiles':>10} {'first pass':>11} {'vs spec':>8} {'steady call':>12} {'vs spec':>8}")
    for r in compile_rows:
        print(
            f"{r['variant']:32} {r['graphs_compiled']:>6} {r['recompiles']:>10} {r['first_pass_s']:>10.2f}s "
            f"{r['first_pass_s'] / base['first_pass_s']:>7.2f}x {r['steady_call_s'] * 1e6:>10.0f}us "
            f"{r['steady_call_s'] / base['steady_call_s']:>7.2f}x"
        )
    export_rows = run_export(64, a.export_repeats)
    eb = export_rows[0]
    print("\n== export: 3 inputs share batch, 1 input is 2*batch")
    print(f"{'variant':34} {'export':>9} {'vs spec':>8} {'nodes':>6} {'asserts':>8} {'symbols':>8}")
    for r in export_rows:
        print(
            f"{r['variant']:34} {r['export_s']:>8.3f}s {r['export_s'] / eb['export_s']:>7.2f}x "
            f"{r['nodes']:>6} {r['asserts']:>8} {r['symbols']:>8}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"env": env, "compile": compile_rows, "export": export_rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
