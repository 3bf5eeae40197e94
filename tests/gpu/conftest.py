"""GPU tests: run on the GPU machine (docs/gpu.md says how); skipped, never
passed, where there is no CUDA device."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "tests/gpu" in str(item.fspath):
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line on the run's kernel cache: a one-process run on the cache an
    earlier run filled should load its kernels, not compile them."""
    if not torch.cuda.is_available():
        return
    from branchyard.lowering.nvgemm.kernel_cache import default_kernel_cache

    cache = default_kernel_cache()
    if cache is not None and any(cache.stats.values()):
        stats = ", ".join(f"{k} {v}" for k, v in cache.stats.items())
        terminalreporter.write_line(f"branchyard kernel cache {cache.root}: {stats}")
