"""The fused op: ``branchyard::fused_gemm_epilogue``.

    fused_gemm_epilogue(Tensor a, Tensor b, Tensor[] operands, str spec) -> Tensor

Semantics (``spec`` parsed by :meth:`EpilogueSpec.parse`)::

    b_kn = b.t() if spec.weight_layout == "nk" else b           # [K, N]
    acc  = a.reshape(-1, K).float() @ b_kn.float()              # fp32 accumulate
    for step in spec.steps: acc = step(acc, operands)           # fp32 epilogue
    return acc.to(spec.out_dtype).reshape(*a.shape[:-1], N)     # one store

``col`` operands hold ``N`` elements (any shape ``[..., 1, N]``), ``matrix``
operands ``M * N`` elements in row-major order of the output. The op is a
``torch.library.custom_op`` with a fake implementation, so programs that
contain it still export, save/load (importing branchyard registers it) and
trace with ``make_fx``. It is made for inference; its backward (so that
training and ``torch.compile`` with parameters that require grad still work)
recomputes the chain on the reference path and differentiates that: correct,
not fused.

Where it runs:

* CUDA, ``nvidia-cutlass-dsl`` importable, 16-bit inputs, ``K`` and ``N``
  multiples of 8 and 16-byte aligned pointers: the autotuned implementation
  (:mod:`branchyard.lowering.nvgemm.tuner`);
* otherwise the reference path (the semantics above), with a
  :class:`NvGemmFallbackWarning` saying why, once per reason.

    >>> import torch
    >>> a, w, bias = torch.randn(4, 16), torch.randn(8, 16), torch.randn(8)
    >>> out = fused_gemm_epilogue(a, w, [bias], "w=nk;bias@0;relu;out=float32")
    >>> torch.allclose(out, torch.relu(a @ w.t() + bias), atol=1e-5)
    True
"""

from __future__ import annotations

import functools
import logging
import threading
import warnings
from typing import Callable

import torch

from branchyard.errors import LoweringError
from branchyard.lowering.nvgemm.epilogue import EpilogueSpec, reference_fused_gemm
from branchyard.lowering.nvgemm.kernel_config import fused_kernel_ineligibility

__all__ = [
    "OP_NAME",
    "fused_gemm_epilogue",
    "NvGemmFallbackWarning",
    "parse_spec",
    "check_arguments",
    "reset_fallback_warnings",
    "fallback_reasons",
]

logger = logging.getLogger("branchyard")

OP_NAME = "branchyard::fused_gemm_epilogue"


class NvGemmFallbackWarning(UserWarning):
    """The fused op ran its reference path; the message says why."""


@functools.lru_cache(maxsize=1024)
def parse_spec(spec: str) -> EpilogueSpec:
    """:meth:`EpilogueSpec.parse`, memoised (the op parses its spec on every call)."""
    return EpilogueSpec.parse(spec)


def _dims(a: torch.Tensor, b: torch.Tensor, spec: EpilogueSpec) -> tuple[int, int, int]:
    if b.dim() != 2:
        raise LoweringError(f"weight has shape {list(b.shape)}, expected 2-D", where=OP_NAME)
    k, n = (b.shape[0], b.shape[1]) if spec.weight_layout == "kn" else (b.shape[1], b.shape[0])
    if a.dim() < 2 or a.shape[-1] != k:
        raise LoweringError(
            f"input has shape {list(a.shape)}; expected [..., {k}] to match the weight "
            f"{list(b.shape)} (layout {spec.weight_layout})",
            where=OP_NAME,
        )
    m = 1
    for d in a.shape[:-1]:
        m *= d
    return m, n, k


def check_arguments(
    a: torch.Tensor, b: torch.Tensor, operands: list[torch.Tensor], spec: EpilogueSpec
) -> tuple[int, int, int]:
    """Validate the op's arguments against ``spec``; return ``(M, N, K)``.

    Raises :class:`LoweringError` naming the argument that does not fit.
    """
    m, n, k = _dims(a, b, spec)
    if len(operands) != spec.num_operands:
        raise LoweringError(
            f"spec {str(spec)!r} takes {spec.num_operands} operand tensors, got {len(operands)}",
            where=OP_NAME,
        )
    for step in spec.steps:
        kind = step.op.operand
        if kind not in ("col", "matrix"):
            continue
        t = operands[step.operand]  # type: ignore[index]
        want = n if kind == "col" else m * n
        if t.numel() != want or (t.dim() and t.shape[-1] != n):
            raise LoweringError(
                f"operand {step.operand} of step '{step.op.name}' has shape {list(t.shape)}; "
                f"expected {'[N]' if kind == 'col' else '[M, N]'} with M={m}, N={n}",
                where=OP_NAME,
            )
    return m, n, k


# --- "says once why" ---------------------------------------------------------

_warned: set[str] = set()
_warned_lock = threading.Lock()


def _say_once(reason: str) -> None:
    with _warned_lock:
        if reason in _warned:
            return
        _warned.add(reason)
    logger.info("nvgemm: reference path: %s", reason)
    warnings.warn(f"branchyard nvgemm runs the reference path: {reason}", NvGemmFallbackWarning, stacklevel=3)


def reset_fallback_warnings() -> None:
    """Forget which fallback reasons were already reported (tests use this)."""
    with _warned_lock:
        _warned.clear()


def fallback_reasons() -> frozenset[str]:
    """The reasons reported so far in this process."""
    with _warned_lock:
        return frozenset(_warned)


# --- the op -------------------------------------------------------------------

def _gpu_impl(a2d, b_kn, operands, spec, spec_text=None) -> Callable:
    from branchyard.lowering.nvgemm import tuner

    return tuner.select(a2d, b_kn, operands, spec, spec_text)


@torch.library.custom_op(OP_NAME, mutates_args=())
def fused_gemm_epilogue(
    a: torch.Tensor, b: torch.Tensor, operands: list[torch.Tensor], spec: str
) -> torch.Tensor:
    """Matmul + epilogue in one op (see the module docstring for semantics)."""
    s = parse_spec(spec)
    m, n, k = check_arguments(a, b, operands, s)
    b_kn = b.t() if s.weight_layout == "nk" else b
    if m == 0:
        return a.new_empty((*a.shape[:-1], n), dtype=s.out_dtype)
    why = fused_kernel_ineligibility(a, b_kn, operands, k, n)
    if why is not None:
        _say_once(why)
        return reference_fused_gemm(a, b, operands, s)
    a2d = a.reshape(m, k)
    ops2d = [
        operands[st.operand].reshape(n) if st.op.operand == "col" else operands[st.operand].reshape(m, n)  # type: ignore[index]
        for st in s.steps
        if st.op.operand in ("col", "matrix")
    ]
    try:
        impl = _gpu_impl(a2d, b_kn, ops2d, s, spec)
    except LoweringError as exc:  # every candidate failed to build or to match the reference
        _say_once(f"autotuning found no working implementation: {exc}")
        return reference_fused_gemm(a, b, operands, s)
    out = torch.empty((m, n), dtype=s.out_dtype, device=a.device)
    res = impl(a2d, b_kn, ops2d, out)
    return (out if res is None else res).reshape(*a.shape[:-1], n)


@fused_gemm_epilogue.register_fake
def _fused_gemm_epilogue_fake(a, b, operands, spec):
    s = parse_spec(spec)
    n = b.shape[1] if s.weight_layout == "kn" else b.shape[0]
    return a.new_empty((*a.shape[:-1], n), dtype=s.out_dtype)


def _setup_context(ctx, inputs, output) -> None:
    a, b, operands, spec = inputs
    ctx.save_for_backward(a, b, *operands)
    ctx.spec = spec


def _backward(ctx, grad):
    # Recompute the chain on the reference path and differentiate it: the
    # backward is rare (this is an inference lowering) and must not diverge
    # from the forward's semantics.
    a, b, *operands = ctx.saved_tensors
    spec = parse_spec(ctx.spec)
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(t.dtype.is_floating_point) for t in (a, b, *operands)]
        out = reference_fused_gemm(leaves[0], leaves[1], leaves[2:], spec)
        wanted = [t for t in leaves if t.requires_grad]
        got = iter(torch.autograd.grad(out, wanted, grad.to(out.dtype), allow_unused=True))
        grads = [next(got) if t.requires_grad else None for t in leaves]
    return grads[0], grads[1], list(grads[2:]), None


fused_gemm_epilogue.register_autograd(_backward, setup_context=_setup_context)
