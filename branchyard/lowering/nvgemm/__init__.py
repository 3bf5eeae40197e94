"""NVGEMM epilogue fusion: a matmul and the elementwise chain after it run as
one GPU kernel, the output tile stored once (see ``docs/nvgemm.md``).

Public entry points:

* :func:`nvgemm` / :class:`NvGemmPass` -- the FX pass (registered as ``nvgemm``);
* :func:`find_epilogue_chains` -- what the pass would fuse or decline, and why;
* :data:`EPILOGUE_TABLE` -- the epilogue vocabulary, one row per op;
* ``torch.ops.branchyard.fused_gemm_epilogue`` -- the fused op (autotuned on
  CUDA, the unfused ATen ops where it cannot run fused);
* :func:`timing_mode` -- tell the op how it is run (``"host"``: eager calls,
  ``"device"``: replayed in a CUDA graph), which decides what "fastest" means.

The files, by concern (each imports only those above it in its group, and
no import cycle exists between them -- ``tests/lowering/test_nvgemm_layout.py``
checks):

========================  ==============================================================
**the pass**
``epilogue.py``           the epilogue table (match, formula, kernel formula, cuBLAS
                          coverage, eager op per row), ``EpilogueSpec``, reference semantics
``matcher.py``            matmul roots and the chain walk (match or reason)
``siblings.py``           sibling GEMMs (one input, concatenated outputs) merged into one
``program_race.py``       the program race: rewritten vs unrewritten program, called eagerly
                          (host time included) or replayed from a CUDA graph
``fuse.py``               ``NvGemmPass``: rewrite each fusable chain into the fused op
**the op**
``op.py``                 ``branchyard::fused_gemm_epilogue``: argument checks, the call
                          path, fallbacks (said once), capture safety
**the kernel**
``kernel_config.py``      the kernel's tuning space and every eligibility rule
``kernel_math.py``        the spec planned into kernel steps; the in-kernel math namespace
``cutedsl_gemm.py``       compile, cache and launch our CuTeDSL kernel
``_cutedsl_common.py``    shared kernel building blocks (wgmma, TMA rings, stores)
``_cutedsl_kernel.py``    the one-tile-per-CTA kernel
``_cutedsl_persistent.py`` the persistent ping-pong kernel
``_cutedsl_gemv.py``      the small-M kernel (M <= 64: weight rows streamed into warp MMAs)
``_cutedsl_epilogue.py``  the epilogue code every kernel traces
``cutlass_operators.py``  cutlass-operators' plain GEMM (a comparison candidate)
**tuning**
``problem.py``            what a decision is about (``Problem``) and the ``Impl`` signature
``timing.py``             timers, ``timing_mode``, round-robin and paired comparisons
``candidates.py``         every way to run a problem, the unfused chain included
``tuner.py``              ``Autotuner``: build, check, time, pick, record
``progress.py``           the tuning progress bar
**storage**
``store.py``              cache folder, atomic writes, inter-process lock, damage detection
``environment.py``        what cached results are valid for (GPU, driver, versions)
``winners.py``            ``WinnerDB``: tuned winners on disk
``kernel_cache.py``       ``KernelCache``: compiled kernels on disk
========================  ==============================================================

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
from branchyard.lowering.nvgemm.siblings import MergeResult, MergeSiblingGemms, merge_sibling_gemms
from branchyard.lowering.nvgemm.timing import current_timing_mode, timing_mode

__all__ = [
    "ACTIVATIONS",
    "EPILOGUE_OPS",
    "EPILOGUE_TABLE",
    "TORCH_MATH",
    "EpilogueChain",
    "EpilogueOp",
    "EpilogueSpec",
    "EpilogueStep",
    "MergeResult",
    "MergeSiblingGemms",
    "NvGemmFallbackWarning",
    "NvGemmPass",
    "find_epilogue_chains",
    "fused_gemm_epilogue",
    "merge_sibling_gemms",
    "nvgemm",
    "reference_fused_gemm",
    "current_timing_mode",
    "timing_mode",
]


make_package_callable(__name__, nvgemm)
