"""Graph -> kernels and CUDA graphs. Importable on torch >= 2.11 without a GPU."""
