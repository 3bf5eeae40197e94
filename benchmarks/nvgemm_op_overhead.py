"""Host cost of one call of ``branchyard::fused_gemm_epilogue`` once its shape
is tuned, measured on CPU with a no-op implementation (issue 12 item 2).

The op's work is swapped for a candidate that returns its output buffer, and
eligibility is forced, so what is timed is everything the op does around the
launch: dispatch, argument checks, the choice lookup, the output allocation.
Columns (microseconds per call, the fastest of ``--repeats`` blocks of ``--calls``:
on a shared machine the minimum is the figure least disturbed by other load):

* ``aten_noop``    ``torch.ops.aten.alias`` through the dispatcher: the floor any op pays;
* ``op``           ``torch.ops.branchyard.fused_gemm_epilogue.default`` (what an exported
                   program calls), no tensor requiring grad;
* ``op_in_graph``  the same inside a ``torch.fx`` GraphModule (``ep.module()``'s path);
* ``op_body``      the op's own Python function, called directly (the op's share of ``op``;
                   the rest is ``torch.library``'s custom-op dispatch);
* ``impl``         the no-op implementation called directly (the launch stand-in).

    python benchmarks/nvgemm_op_overhead.py [--calls 2000] [--repeats 7] [--markdown]

Figures go to docs/benchmarks.md (machine, versions, date).
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
import warnings

import torch


def _setup():
    from branchyard.lowering.nvgemm import op as op_mod
    from branchyard.lowering.nvgemm import tuner as nv_tuner
    from branchyard.lowering.nvgemm.candidates import Candidate
    from branchyard.lowering.nvgemm.winners import WinnerDB

    from branchyard.lowering.nvgemm.epilogue import reference_fused_gemm

    calls = []

    def noop(a, b_kn, ops, out):
        if not calls:  # the tuner's numerics check: the one call that computes
            calls.append(1)
            out.copy_(reference_fused_gemm(a, b_kn, list(ops), spec_kn))
        return out

    spec_kn = None

    def build(problem):
        nonlocal spec_kn
        spec_kn = problem.spec
        return noop

    tuner = nv_tuner.Autotuner([Candidate("noop", build)], timer=lambda name, fn: 1.0,
                               db=WinnerDB(tempfile.mkdtemp()), env={"gpu": "overhead"}, progress=False)
    nv_tuner.set_autotuner(tuner)
    from branchyard.lowering.nvgemm.kernel_config import layout_ineligibility

    # Every call takes the tuned path after the checks a GPU call pays: the CPU
    # device is let through, the layout rules run as they do on the GPU.
    op_mod.fused_kernel_ineligibility = layout_ineligibility
    return noop


def _per_call_us(fn, calls: int, repeats: int) -> float:
    for _ in range(100):
        fn()
    blocks = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        blocks.append((time.perf_counter() - t0) / calls * 1e6)
    return min(blocks)


def measure(calls: int = 2000, repeats: int = 7, m: int = 16, k: int = 64, n: int = 128) -> dict[str, float]:
    """Microseconds per call of each column (see the module docstring)."""
    noop = _setup()
    warnings.simplefilter("ignore")
    dtype = torch.bfloat16
    a = torch.randn(m, k, dtype=dtype)
    w = torch.randn(n, k, dtype=dtype)
    bias, res = torch.randn(n, dtype=dtype), torch.randn(m, n, dtype=dtype)
    spec = "w=nk;bias@0;gelu_tanh;residual@1;out=bfloat16"
    op = torch.ops.branchyard.fused_gemm_epilogue.default
    from branchyard.lowering.nvgemm.op import fused_gemm_epilogue

    body = fused_gemm_epilogue._init_fn  # the function torch.library.custom_op wraps
    ops = [bias, res]

    class Block(torch.nn.Module):
        def forward(self, x, w, bias, res):
            return op(x, w, [bias, res], spec)

    gm = torch.fx.symbolic_trace(Block())
    out = torch.empty(m, n, dtype=dtype)
    with torch.inference_mode(False), torch.no_grad():
        op(a, w, ops, spec)  # tunes (the no-op candidate) once
        return {
            "aten_noop": _per_call_us(lambda: torch.ops.aten.alias.default(a), calls, repeats),
            "op": _per_call_us(lambda: op(a, w, ops, spec), calls, repeats),
            "op_in_graph": _per_call_us(lambda: gm(a, w, bias, res), calls, repeats),
            "op_body": _per_call_us(lambda: body(a, w, ops, spec), calls, repeats),
            "impl": _per_call_us(lambda: noop(a, w.t(), ops, out), calls, repeats),
        }


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--markdown", action="store_true", help="print a markdown table row set")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    got = measure(args.calls, args.repeats)
    header = f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, torch {torch.__version__}"
    if args.markdown:
        print(f"| column | us / call |  ({header})\n|---|---|")
        for name, us in got.items():
            print(f"| {name} | {us:.2f} |")
    else:
        print(header)
        for name, us in got.items():
            print(f"{name:12s} {us:8.2f} us/call")
        print(f"op host cost over the dispatcher floor: {got['op'] - got['aten_noop']:.2f} us/call")
    return got


if __name__ == "__main__":
    main()
