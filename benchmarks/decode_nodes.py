"""The nodes of the decode loop's captured CUDA graph, body by body, with kernel names.

What one decode step runs after ``branchyard.compile(model, args, inductor=True)``
(cond_to_switch, nvgemm, Inductor regions, the CUDA-graph lowering): every
node of the graph and of each conditional body, kernels with their names
(``cuFuncGetName`` / ``cuKernelGetName``) and launch shapes. A CUDA device
and cuda-bindings are needed::

    python benchmarks/decode_nodes.py [DIM HIDDEN BATCH]    # default 1024 4096 16
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import torch


def _name(node: Any, driver: Any) -> str:
    params = driver.cuGraphKernelNodeGetParams(node)[1]
    name = "?"
    for get, handle in ((driver.cuFuncGetName, params.func), (driver.cuKernelGetName, params.kern)):
        try:
            raw = get(handle)[1]
        except Exception:  # a launch through the runtime API carries a kernel, not a function, or neither
            continue
        name = raw.decode() if isinstance(raw, bytes) else str(raw)
        break
    grid = (params.gridDimX, params.gridDimY, params.gridDimZ)
    block = (params.blockDimX, params.blockDimY, params.blockDimZ)
    return f"{name[:120]} grid={grid} block={block}"


def walk(graph: Any, bodies_of: dict[int, list[Any]], depth: int = 0) -> list[str]:
    """One line per node of ``graph`` and, indented below its conditional nodes, their bodies."""
    from cuda.bindings import driver

    count = driver.cuGraphGetNodes(graph, 0)[-1]
    nodes = driver.cuGraphGetNodes(graph, count)[1] if count else []
    lines = []
    for node in nodes:
        kind = driver.cuGraphNodeGetType(node)[1].name.removeprefix("CU_GRAPH_NODE_TYPE_")
        lines.append("  " * depth + kind + (" " + _name(node, driver) if kind == "KERNEL" else ""))
        for body in bodies_of.get(int(node), []):
            lines += walk(body, bodies_of, depth + 1)
    return lines


def main(argv: list[str]) -> None:
    import branchyard
    from cuda.bindings import driver

    from branchyard.examples.decode_loop import DecodeLoop

    if not torch.cuda.is_available():
        sys.exit("decode_nodes.py needs a CUDA device")
    d, h, b = (int(v) for v in (argv or ["1024", "4096", "16"]))
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = DecodeLoop(d, h, 8).cuda().to(torch.bfloat16)
    x = torch.randn(b, d, device="cuda", dtype=torch.bfloat16)
    steps = torch.tensor(64, device="cuda")
    fast = branchyard.compile(model, (x, steps), inductor=True)
    fast(x, steps)
    print(fast.report)
    for lowered in fast.captures.values():
        if lowered.lowered:
            print("\n".join(walk(driver.CUgraph(lowered._graph.raw_cuda_graph()), lowered._builder.bodies_of)))


if __name__ == "__main__":
    main(sys.argv[1:])
