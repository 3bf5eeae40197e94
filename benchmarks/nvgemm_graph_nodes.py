"""What a model block's CUDA graph runs before and after the fused op: every
captured node (kernels by name and launch shape) and the replays' time,
interleaved, against the unrewritten program.

The graph race compares programs that differ in one fused op. Where a variant
runs the same kernels as the unrewritten program (``impl=cublas:addmm+aten``:
the program's own ``addmm`` and ``add`` through the op) and still replays
slower, the nodes show whether the op adds work to the graph (a copy, a
memset, another kernel) or only moves the same kernels' buffers::

    python benchmarks/nvgemm_graph_nodes.py --block gpt2_attn_proj --m 64 \\
        --impl cublas:addmm+aten aten:unfused triton:inductor cutedsl:t64x64

Programs: ``unrewritten`` (``ep.module()``), twice, captured apart (the
noise floor of a ratio); one per ``--impl``, every
fusable chain as the fused op with that candidate pinned (``;impl=`` in its
spec, no race, so each variant holds the same ops); with ``--compile``,
``torch.compile(block, mode="max-autotune-no-cudagraphs")``. Each is captured
in a CUDA graph of one call (its own memory pool) after its warm-up under
``nvgemm.timing_mode("device")``, its output checked against the eager
block, and all are timed side by side (:func:`device_interleaved_timer`,
``--repeats`` rounds); the ratio column is the median round ratio
``unrewritten / program`` (above 1: faster than the unrewritten program).
A CUDA device and cuda-bindings are needed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import warnings
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_nodes import walk  # noqa: E402
from nvgemm_blocks import _check, blocks  # noqa: E402


def pin_every_op(program: Any, impl: str) -> int:
    """Pin ``impl`` on every fused op call of ``program``'s graph (in place);
    returns how many calls were pinned."""
    from branchyard.lowering.nvgemm.epilogue import EpilogueSpec

    packet = torch.ops.branchyard.fused_gemm_epilogue
    gm = program.graph_module
    pinned = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in (packet.default, packet.out):
            spec = dataclasses.replace(EpilogueSpec.parse(node.args[3]), impl=impl)
            node.args = (*node.args[:3], str(spec), *node.args[4:])
            pinned += 1
    gm.recompile()
    return pinned


def fused_without_race(ep: Any) -> Any:
    """``ep`` with every fusable chain as the fused op (the race off: ``devices=()``)."""
    from branchyard.lowering.nvgemm.fuse import nvgemm
    from branchyard.lowering.nvgemm.program_race import ProgramRace

    return nvgemm(ep, calling="graph", race=ProgramRace(devices=()), merge_siblings=False)


def captured(fn: Callable[[], object]) -> tuple[Callable[[], None], list[str]]:
    """``fn`` captured in a CUDA graph of one call: its replay and one line per node."""
    from cuda.bindings import driver

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle()):
        fn()
    lines = walk(driver.CUgraph(graph.raw_cuda_graph()), {})
    graph.instantiate()
    return graph.replay, lines


def main(argv: list[str] | None = None) -> None:
    import branchyard.lowering.nvgemm as nvgemm
    from branchyard.lowering.nvgemm.timing import device_interleaved_timer, round_order

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block", default="gpt2_attn_proj")
    parser.add_argument("--m", type=int, default=64)
    parser.add_argument("--impl", nargs="*", default=["cublas:addmm+aten", "aten:unfused"],
                        help="candidates to pin on every fused op, one program each")
    parser.add_argument("--compile", action="store_true", help="add torch.compile max-autotune's program")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--reps", type=int, default=50, help="turns of each round")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    table = blocks()
    if args.block not in table:
        parser.error(f"unknown block {args.block!r}; known: {sorted(table)}")
    warnings.simplefilter("ignore")
    spec, device, dtype = table[args.block], torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    block = spec.make().to(device=device, dtype=dtype).eval()
    x = torch.randn(args.m, spec.d, device=device, dtype=dtype)
    inputs = (x, torch.randn(args.m, spec.d, device=device, dtype=dtype)) if spec.two_inputs else (x,)
    print(f"# nvgemm_graph_nodes {args.block} M={args.m}, {torch.cuda.get_device_name()}, torch {torch.__version__}",
          flush=True)
    with torch.no_grad():
        want = block(*inputs)
        ep = torch.export.export(block, inputs)
        # the unrewritten program twice, captured apart: the ratio two captures of one program show
        programs: dict[str, Callable[..., Any]] = {"unrewritten": ep.module(), "unrewritten again": ep.module()}
        for impl in args.impl:
            fused = fused_without_race(ep)
            count = pin_every_op(fused, impl)
            programs[f"impl={impl} ({count} ops)"] = fused.module()
        if args.compile:
            programs["compile"] = torch.compile(block, mode="max-autotune-no-cudagraphs", dynamic=False)
        replays = {}
        for name, program in programs.items():
            call = (lambda p=program: p(*inputs))
            with nvgemm.timing_mode("device"):
                _check(name, call(), want, dtype)
                replays[name], lines = captured(call)
            kernels = sum(line.startswith("KERNEL") for line in lines)
            print(f"\n## {name}: {len(lines)} nodes, {kernels} kernels", flush=True)
            print("\n".join(lines), flush=True)
        names = list(replays)
        samples: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.repeats):
            order = round_order(names, r)
            ms = device_interleaved_timer([replays[n] for n in order], warmup=2, reps=args.reps, max_ms=1e9)
            for n, t in zip(order, ms):
                samples[n].append(t * 1e3)
    print("\n| program | µs per replay (median) | unrewritten / program (median of rounds) |\n|---|---|---|")
    base = samples["unrewritten"]
    for n in names:
        ratio = statistics.median(b / s for b, s in zip(base, samples[n]))
        print(f"| {n} | {statistics.median(samples[n]):.2f} | {ratio:.3f}x |")


if __name__ == "__main__":
    os.environ.setdefault("BRANCHYARD_NVGEMM_PROGRESS", "0")
    main()
