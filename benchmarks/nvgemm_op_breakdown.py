"""Where the fused op's host time goes: each piece of a tuned call timed alone.

Companion of ``nvgemm_op_overhead.py`` (same no-op implementation, so nothing
launches): the whole call through the dispatcher (``op``), the op's own
Python (``body``), and the pieces of the body -- the timing-mode lookup, the
coarse key and the guarded lookup a known signature takes (beside them the
full key and its lookup, which only a signature's first calls take), the
output allocation (the plan's allocator, and ``torch.empty_strided`` beside
it), the weight view, pointer reads -- each in a loop of its own. Also says
whether the Autograd kernel takes its direct path for these tensors.
Microseconds per call, median of 7 blocks::

    python benchmarks/nvgemm_op_breakdown.py [--device cuda|cpu] [--calls 5000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import warnings
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nvgemm_op_overhead  # noqa: E402


def _us(fn: Callable[[], Any], calls: int) -> float:
    for _ in range(200):
        fn()
    return statistics.median(nvgemm_op_overhead._block_us(fn, calls) for _ in range(7))


def measure(device: str = "cpu", calls: int = 5000) -> dict[str, Any]:
    """Microseconds per call of each piece, and ``direct``: the Autograd kernel's path."""
    nvgemm_op_overhead._setup()
    from branchyard.lowering.nvgemm import op as op_mod
    from branchyard.lowering.nvgemm.timing import current_timing_mode

    warnings.simplefilter("ignore")
    dtype = torch.bfloat16
    a = torch.randn(16, 64, dtype=dtype, device=device)
    w = torch.randn(128, 64, dtype=dtype, device=device)
    bias, res = torch.randn(128, dtype=dtype, device=device), torch.randn(16, 128, dtype=dtype, device=device)
    spec, ops = "w=nk;bias@0;gelu_tanh;residual@1;out=bfloat16", [bias, res]
    op = torch.ops.branchyard.fused_gemm_epilogue.default
    with torch.no_grad():
        op(a, w, ops, spec)  # tunes the no-op candidate
        tuner = op_mod.tuner_mod._default
        key = op_mod._signature(a, w, ops, spec, current_timing_mode())
        call = tuner.call_plans[key]
        op(a, w, ops, spec)  # a second call keeps the plan with a guard
        coarse = op_mod._coarse_key(spec, current_timing_mode(), a, w, ops)
        assert op_mod._guarded_entry(tuner, coarse, a, w, ops).plan is call
        pieces = {
            "aten_noop": lambda: torch.ops.aten.alias.default(a),
            "op": lambda: op(a, w, ops, spec),
            "body": lambda: op_mod._fused_gemm_epilogue(a, w, ops, spec),
            "timing_mode": current_timing_mode,
            "coarse_key": lambda: op_mod._coarse_key(spec, "host", a, w, ops),
            "guarded_plan": lambda: op_mod._guarded_entry(tuner, coarse, a, w, ops),
            "signature": lambda: op_mod._signature(a, w, ops, spec, "host"),
            "plan_lookup": lambda: tuner.call_plans.get(key),
            "empty_strided": lambda: torch.empty_strided((16, 128), (128, 1), dtype=dtype, device=call.device),
            "plan_alloc": call.alloc,  # what the op allocates its output with
            "weight_view": lambda: op_mod._weight_t(call, w, w.data_ptr()),
            "data_ptr_x3": lambda: (a.data_ptr(), w.data_ptr(), bias.data_ptr()),
        }
        got: dict[str, Any] = {name: _us(fn, calls) for name, fn in pieces.items()}
    got["direct"] = dict(op_mod._DIRECT)
    return got


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--calls", type=int, default=5000)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    got = measure(args.device, args.calls)
    print(f"torch {torch.__version__}, tensors on {args.device}; Autograd kernel direct path: {got['direct']}")
    for name, us in got.items():
        if name != "direct":
            print(f"{name:16s} {us:7.2f} us")
    return got


if __name__ == "__main__":
    main()
