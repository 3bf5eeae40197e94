"""Graph -> kernels and CUDA graphs. Importable on torch >= 2.11 without a GPU."""
from branchyard.lowering.cuda_graph import cuda_graph_backend  # noqa: E402,F401  (binds the callable cuda_graph package)
