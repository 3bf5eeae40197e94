"""NVGEMM epilogue fusion: a matmul and the elementwise chain after it run as
one GPU kernel, the output tile stored once (see ``docs/nvgemm.md``).

* :func:`nvgemm` / :class:`NvGemmPass` -- the FX pass (registered as ``nvgemm``);
* :func:`find_epilogue_chains` -- what the pass would fuse or decline, and why;
* :data:`EPILOGUE_TABLE` -- the epilogue vocabulary, one row per op;
* ``torch.ops.branchyard.fused_gemm_epilogue`` -- the fused op (autotuned on
  CUDA, reference path elsewhere).

Importing this package registers the custom op; it needs neither CUDA nor
``nvidia-cutlass-dsl``. The package itself is callable, so
``branchyard.lowering.nvgemm(program)`` is :func:`nvgemm`:

    >>> import torch, branchyard.lowering.nvgemm as nvgemm_pkg
    >>> class Layer(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.fc = torch.nn.Linear(8, 16)
    ...     def forward(self, x):
    ...         return torch.relu(self.fc(x))
    >>> ep = torch.export.export(Layer(), (torch.randn(2, 8),))
    >>> fused = nvgemm_pkg(ep)
    >>> sum(n.target is torch.ops.branchyard.fused_gemm_epilogue.default for n in fused.graph.nodes)
    1
"""


from branchyard.lowering._callable_package import make_package_callable
from branchyard.lowering.nvgemm.epilogue import (
    ACTIVATIONS,
    EPILOGUE_OPS,
    EPILOGUE_TABLE,
    TORCH_MATH,
    EpilogueOp,
    EpilogueSpec,
    EpilogueStep,
    reference_fused_gemm,
)
from branchyard.lowering.nvgemm.fuse import NvGemmPass, nvgemm
from branchyard.lowering.nvgemm.matcher import EpilogueChain, find_epilogue_chains
from branchyard.lowering.nvgemm.op import NvGemmFallbackWarning, fused_gemm_epilogue

__all__ = [
    "ACTIVATIONS",
    "EPILOGUE_OPS",
    "EPILOGUE_TABLE",
    "TORCH_MATH",
    "EpilogueChain",
    "EpilogueOp",
    "EpilogueSpec",
    "EpilogueStep",
    "NvGemmFallbackWarning",
    "NvGemmPass",
    "find_epilogue_chains",
    "fused_gemm_epilogue",
    "nvgemm",
    "reference_fused_gemm",
]


make_package_callable(__name__, nvgemm)
