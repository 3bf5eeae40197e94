"""Graph -> kernels and CUDA graphs. Importable on torch >= 2.11 without a GPU.

* ``branchyard.lowering.cuda_graph(program, example_inputs)`` -- while_loop /
  cond / switch as CUDA graph conditional nodes (docs/cuda_graph.md)
* ``branchyard.lowering.nvgemm(program)`` -- matmul + epilogue chains as one
  fused op (docs/nvgemm.md)

Both subpackages are callable modules, so ``branchyard.lowering.nvgemm(ep)``
and ``from branchyard.lowering.nvgemm import find_epilogue_chains`` both work.
Importing them needs neither CUDA nor CuTeDSL.
"""

from branchyard.lowering import cuda_graph, nvgemm  # noqa: F401
from branchyard.lowering.cuda_graph import cuda_graph_backend  # noqa: F401
