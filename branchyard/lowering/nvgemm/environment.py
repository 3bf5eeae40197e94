"""What a cached result is only valid for: the GPU, its driver, the CUDA,
torch and CuTeDSL versions. Both caches (winners and compiled kernels) key
their entries on :func:`environment`, so a changed driver or upgraded package
never reuses another setup's entry.

    >>> sorted(environment("cpu"))
    ['cuda', 'cutedsl', 'driver', 'gpu', 'torch']
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata

import torch

__all__ = ["environment", "package_version"]


def _driver_version() -> str:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int()
        if lib.cuDriverGetVersion(ctypes.byref(v)) == 0:
            return f"{v.value // 1000}.{(v.value % 1000) // 10}"
    except OSError:
        pass
    return "none"


def package_version(name: str) -> str:
    """The installed version of distribution ``name``, or ``"none"``."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "none"


@functools.lru_cache(maxsize=None)
def environment(device: str = "cuda") -> dict[str, str]:
    """GPU name and arch, driver, CUDA, torch and CuTeDSL versions (cached per device)."""
    gpu = "cpu"
    if device.startswith("cuda") and torch.cuda.is_available():
        index = torch.device(device).index or 0
        props = torch.cuda.get_device_properties(index)
        gpu = f"{props.name} sm{props.major}{props.minor}"
    return {
        "gpu": gpu,
        "driver": _driver_version(),
        "cuda": str(torch.version.cuda),
        "torch": torch.__version__,
        "cutedsl": package_version("nvidia-cutlass-dsl"),
    }
