"""What the NVGEMM GPU tests share: whether CuTeDSL can run here, and the mark for tests that need it."""

import pytest
import torch

CUDA = torch.cuda.is_available()
if CUDA:
    from branchyard.lowering.nvgemm.kernel_config import GemmConfig, cutedsl_available

    CUTEDSL_OK, CUTEDSL_WHY = cutedsl_available()
else:
    GemmConfig = None
    CUTEDSL_OK, CUTEDSL_WHY = False, "no CUDA device"
needs_cutedsl = pytest.mark.skipif(not CUTEDSL_OK, reason=f"CuTeDSL unavailable: {CUTEDSL_WHY}")
