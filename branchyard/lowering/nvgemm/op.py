"""The fused op: ``branchyard::fused_gemm_epilogue``.

    fused_gemm_epilogue(Tensor a, Tensor b, Tensor[] operands, str spec) -> Tensor

Semantics (``spec`` parsed by :meth:`EpilogueSpec.parse`)::

    b_kn = b.t() if spec.weight_layout == "nk" else b           # [K, N]
    acc  = a.reshape(-1, K).float() @ b_kn.float()              # fp32 accumulate
    for step in spec.steps: acc = step(acc, operands)           # fp32 epilogue
    return acc.to(spec.out_dtype).reshape(*a.shape[:-1], N)     # one store

``col`` operands hold ``N`` elements (any shape ``[..., 1, N]``), ``matrix``
operands ``M * N`` elements in row-major order of the output, ``weight``
operands are a second ``[N, K]`` weight (``mul_mm``: ``acc * (a @ w.T)``).

Its ``out=`` overload writes the result into a given tensor (what the CUDA-graph
lowering uses to land a branch's last op in the conditional node's output
buffer without a copy node)::

    fused_gemm_epilogue.out(Tensor a, Tensor b, Tensor[] operands, str spec, *, Tensor(a!) out) -> Tensor(a!)
    # == out.copy_(fused_gemm_epilogue(a, b, operands, spec)); return out

computed straight into ``out`` where it is a 16-byte aligned row-major buffer
of the output's shape that no input overlaps (else into a temporary, then
copied). As with ATen's out= ops: an ``out`` of another shape is resized (with
a warning, as ATen warns, unless it is empty), one of another dtype or device
is an error, and no argument may require grad while grad mode is on. The op is
defined with ``torch.library`` (a backend kernel, a fake implementation and an
Autograd kernel), so programs that contain it still export, save/load
(importing branchyard registers it) and trace with ``make_fx``. It is made for inference; its backward (so that
training and ``torch.compile`` with parameters that require grad still work)
recomputes the chain on the reference path and differentiates that: correct,
not fused.

Where it runs (decided once per call signature -- spec, shapes, strides,
dtypes, devices, timing mode -- so a later call is a lookup and a launch):

* where :func:`~.kernel_config.fused_kernel_ineligibility` finds nothing
  wrong: the tuned choice (:mod:`branchyard.lowering.nvgemm.tuner`), the
  unfused chain among the candidates;
* otherwise, and where tuning found nothing that works: the unfused path
  (:func:`run_unfused`: the original ATen ops), with a
  :class:`NvGemmFallbackWarning` saying why, once per reason;
* while a CUDA graph is being captured: the choice made for this signature
  before the capture, else the unfused path -- never tuning, compiling,
  loading or synchronising inside a capture.

A call of a known signature that a guard proves would reach this module's
kernel directly skips the dispatcher (the functional overload; see "the
dispatcher bypass" at the end of the module); modes, tracing, the profiler
and gradients still see the op as any dispatcher op.

    >>> import torch
    >>> a, w, bias = torch.randn(4, 16), torch.randn(8, 16), torch.randn(8)
    >>> out = fused_gemm_epilogue(a, w, [bias], "w=nk;bias@0;relu;out=float32")
    >>> torch.allclose(out, torch.relu(a @ w.t() + bias), atol=1e-5)
    True
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from branchyard.errors import LoweringError
from branchyard.lowering.nvgemm import tuner as tuner_mod
from branchyard.lowering.nvgemm.epilogue import (
    TENSOR_OPERANDS,
    EpilogueSpec,
    reference_fused_gemm,
    unfused_aten_epilogue,
)
from branchyard.lowering.nvgemm.kernel_config import ALIGN_BYTES, fused_kernel_ineligibility
from branchyard.lowering.nvgemm.problem import Impl, TimingMode, bound_launch, needs_out
from branchyard.lowering.nvgemm.timing import current_timing_mode
from branchyard.lowering.nvgemm.tuner import Autotuner, TuneResult

__all__ = [
    "OP_NAME",
    "fused_gemm_epilogue",
    "fused_gemm_epilogue_out",
    "NvGemmFallbackWarning",
    "parse_spec",
    "check_arguments",
    "reset_fallback_warnings",
    "fallback_reasons",
    "run_unfused",
    "CallPlan",
    "tuned_result",
]

logger = logging.getLogger("branchyard")

OP_NAME = "branchyard::fused_gemm_epilogue"
#: The ``out=`` overload, as error messages name it.
OUT_NAME = f"{OP_NAME}.out"


class NvGemmFallbackWarning(UserWarning):
    """The fused op ran the unfused path; the message says why."""


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
    for name, t in [("weight", b)] + [(f"operand {i}", t) for i, t in enumerate(operands)]:
        if t.device != a.device:
            raise LoweringError(f"the {name} is on {t.device}, the input on {a.device}", where=OP_NAME,
                                hint="move every argument to one device")
    if len(operands) != spec.num_operands:
        raise LoweringError(
            f"spec {str(spec)!r} takes {spec.num_operands} operand tensors, got {len(operands)}",
            where=OP_NAME,
        )
    for step in spec.steps:
        kind = step.op.operand
        if kind not in TENSOR_OPERANDS:
            continue
        t = operands[step.operand]  # type: ignore[index]
        if kind == "weight":
            if tuple(t.shape) != (n, k):
                raise LoweringError(
                    f"operand {step.operand} of step '{step.op.name}' has shape {list(t.shape)}; expected the "
                    f"second weight [N, K] = [{n}, {k}]", where=OP_NAME)
            continue
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
    logger.info("nvgemm: unfused path: %s", reason)
    warnings.warn(f"branchyard nvgemm runs the unfused path: {reason}", NvGemmFallbackWarning, stacklevel=3)


def reset_fallback_warnings() -> None:
    """Forget which fallback reasons were already reported (tests use this)."""
    with _warned_lock:
        _warned.clear()


def fallback_reasons() -> frozenset[str]:
    """The reasons reported so far in this process."""
    with _warned_lock:
        return frozenset(_warned)


# --- the call path --------------------------------------------------------------


@dataclass(frozen=True)
class _SpecPlan:
    """What the op needs from a spec string, parsed once per string."""

    spec: EpilogueSpec
    nk: bool
    #: ``True`` per tensor operand that is a per-column vector (else ``[M, N]``, or a weight).
    col: tuple[bool, ...]
    #: ``True`` per tensor operand that is a second weight (passed as it is).
    weight: tuple[bool, ...]


_SPEC_PLANS: dict[str, _SpecPlan] = {}


def _spec_plan(text: str) -> _SpecPlan:
    plan = _SPEC_PLANS.get(text)
    if plan is None:
        spec = parse_spec(text)
        kinds = [st.op.operand for st in spec.steps if st.op.operand in TENSOR_OPERANDS]
        plan = _SPEC_PLANS[text] = _SpecPlan(spec, spec.weight_layout == "nk", tuple(k == "col" for k in kinds),
                                             tuple(k == "weight" for k in kinds))
    return plan


@dataclass
class CallPlan:
    """The op's decision for one call signature (spec, every shape, stride,
    dtype and device, the timing mode), made on its first call: ``impl`` is
    the tuned choice, or ``None`` when the call runs unfused for ``reason``.
    The other fields are what a later call needs to launch ``impl`` without
    parsing or measuring anything again."""

    m: int
    n: int
    k: int
    out_shape: tuple[int, ...]
    impl: Impl | None = None
    reason: str | None = None
    #: Reshape ``a`` to ``[M, K]`` / the operands to ``[N]`` or ``[M, N]`` first.
    reshape_a: bool = False
    reshape_ops: tuple[bool, ...] = ()
    spec: EpilogueSpec | None = None
    #: The weight is ``[N, K]``: the impl gets its transpose.
    nk: bool = False
    #: What a call runs: ``launch(a2d, weight, ops2d, out)``, ``impl`` itself or, where
    #: the impl has a ``bind`` (the fused kernels), the launch alone that it returned
    #: for this signature, which takes the weight ``[N, K]`` (``b_kn.t()``).
    launch: Callable[..., object] | None = None
    #: ``launch`` gets the weight's transpose (see :func:`_weight_t`), else the weight as given.
    weight_t: bool = False
    #: Per operand the shape it is reshaped to, ``None`` where it is passed as is;
    #: ``None`` for the whole tuple when no operand is reshaped.
    op_shapes: tuple[tuple[int, ...] | None, ...] | None = None
    out_dtype: torch.dtype | None = None
    device: torch.device | None = None
    #: The weight's ``(shape, stride)`` (what a remembered transposed view must have
    #: been made from, see :func:`_weight_t`).
    b_meta: tuple | None = None
    #: The output's row-major strides (what an ``out=`` buffer must have to be written directly).
    out_stride: tuple[int, ...] = ()
    #: Passes an ``out=`` buffer of the output's shape, dtype, device and row-major
    #: strides (:func:`_guard`): made from the first such buffer, it spares later
    #: ones :func:`_check_out` and the stride test.
    out_guard: object | None = None
    #: Bytes ``a``, ``b`` and each operand reach from their data pointers (see :func:`_overlaps`).
    spans: tuple[int, ...] = ()
    #: Bytes of the output.
    out_bytes: int = 0
    #: Makes a fresh ``[M, N]`` row-major output buffer (see :func:`_allocator`).
    alloc: Callable[[], torch.Tensor] | None = None
    #: ``launch`` writes an output buffer; else it returns a tensor of its own and
    #: a functional call allocates none (:func:`~.problem.own_output`).
    needs_out: bool = True
    #: The tuner's key of the problem ``impl`` was chosen for (see :func:`tuned_result`).
    tuned: str | None = None


#: Call signatures remembered before the table starts over (serving with many M).
_PLANS_LIMIT = 4096


def _signature(a: torch.Tensor, b: torch.Tensor, operands: list[torch.Tensor], spec: str, mode: str) -> tuple:
    """The key of a call's :class:`CallPlan`: everything a plan depends on --
    ``(spec, mode)``, then ``(shape, stride, dtype, device)`` of ``a``, ``b`` and
    each operand, flat -- built from attributes that cost no dispatcher call."""
    key = [spec, mode, a.shape, a.stride(), a.dtype, a.device, b.shape, b.stride(), b.dtype, b.device]
    for t in operands:
        key += (t.shape, t.stride(), t.dtype, t.device)
    return tuple(key)


def _tensor_guards() -> type | None:
    """Dynamo's tensor guard (one C++ call checks what :func:`_signature` reads with
    four Python calls a tensor), where this torch has one that tells the tensors
    below apart by size, stride, dtype and device; else ``None`` (every call then
    takes the full key). A private class: checked once, so that a torch whose
    guard checks less never hands a call another signature's plan."""
    try:
        from torch._C._dynamo.guards import TensorGuards

        like = torch.empty(2, 3)
        guard = TensorGuards(like, dynamic_dims_sizes=None, dynamic_dims_strides=None)
        others = (torch.empty(3, 2).t(), torch.empty(2, 3, dtype=torch.float64), torch.empty(2, 4),
                  torch.empty(6), torch.empty(2, 3, device="meta"))
        if guard.check(torch.empty(2, 3)) and not any(guard.check(t) for t in others):
            return TensorGuards
    except (ImportError, TypeError, RuntimeError):  # a torch without it, or another one
        pass
    return None


_TensorGuards = _tensor_guards()

#: Plans kept under one coarse key (:func:`_coarse_key`): signatures that differ only in
#: strides, dtypes, device type or dispatch state (inference mode or not, say).
_GUARDED_PER_KEY = 8


def _coarse_key(spec: str, mode: str, a: torch.Tensor, b: torch.Tensor, operands: list[torch.Tensor]) -> tuple:
    """Where :func:`_guarded_entry` looks: the spec, the mode, the operand count (a
    guard takes that many tensors), the input's device index (one replica per GPU)
    and the two shapes that tell a model's matmuls apart (M, N, K)."""
    return (spec, mode, len(operands), a.get_device(), a.shape, b.shape)


def _guard(tensors: tuple[torch.Tensor, ...]) -> object | None:
    """A check that later tensors have these sizes, strides, dtypes, devices,
    Python types, ``requires_grad`` and dispatch keys (under the thread's
    dispatch state then): all :func:`_signature` keys on and more, so a tensor
    it passes has this signature. ``None`` where this torch cannot make one."""
    if _TensorGuards is None:
        return None
    try:  # None: every size and stride static, as the tensors have them (both keywords required)
        return _TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)
    except RuntimeError:  # pragma: no cover - a tensor it cannot describe (no strides)
        return None


@dataclass(slots=True)
class _GuardedPlan:
    """A plan kept under a coarse key (:func:`_keep_guarded`) with a guard of
    the tensors of its signature."""

    guard: object
    plan: CallPlan
    #: Kept by a call that came straight from the op's Autograd kernel, so every call
    #: passing the guard would (the guard pins each tensor's dispatch keys under the
    #: thread's dispatch state): such calls may skip the dispatcher (:func:`_bypass_plan`).
    direct: bool
    #: A tensor requires grad (pinned by the guard too): with grad mode on the call
    #: needs autograd, so it takes the dispatcher.
    grad: bool


def _guarded_entry(tuner: Autotuner, coarse: tuple, a, b, operands) -> _GuardedPlan | None:
    """The entry of a signature met before, found without its key: the first one
    kept under ``coarse`` whose guard the tensors pass."""
    for entry in tuner.guarded_plans.get(coarse, ()):
        if entry.guard.check(a, b, *operands):
            return entry
    return None


def _keep_guarded(tuner: Autotuner, coarse: tuple, a, b, operands, call: CallPlan, direct: bool) -> None:
    """Keep ``call`` (found in ``tuner.call_plans`` for these tensors' signature) under
    ``coarse`` with a guard of the tensors, newest first (a :class:`_GuardedPlan`;
    ``direct``: this call came straight from the op's Autograd kernel)."""
    guard = _guard((a, b, *operands))
    if guard is None:
        return
    plans = tuner.guarded_plans
    if len(plans) >= _PLANS_LIMIT:
        plans.clear()
    entry = _GuardedPlan(guard, call, direct, _needs_grad(a, b, operands))
    plans[coarse] = (entry, *plans.get(coarse, ())[:_GUARDED_PER_KEY - 1])


def _as_2d(plan: _SpecPlan, call: CallPlan, a, b, operands):
    a2d = a.reshape(call.m, call.k) if call.reshape_a else a
    b_kn = b.t() if plan.nk else b
    ops2d = [
        (t.reshape(call.n) if col else t.reshape(call.m, call.n)) if again else t
        for t, col, again in zip(operands, plan.col, call.reshape_ops)
    ]
    return a2d, b_kn, ops2d


def run_unfused(a: torch.Tensor, b: torch.Tensor, operands: list[torch.Tensor], spec: EpilogueSpec) -> torch.Tensor:
    """The chain as the original program ran it: ``mm`` in the inputs' dtype,
    then one ATen op per step (capturable in a CUDA graph). Mixed input dtypes,
    which no original program could multiply, run the reference semantics."""
    if a.dtype != b.dtype or any(operands[i].dtype != a.dtype for i in spec.weight_operands):
        return reference_fused_gemm(a, b, operands, spec)
    b_kn = b.t() if spec.weight_layout == "nk" else b
    k, n = b_kn.shape
    a2d = a.reshape(math.prod(a.shape[:-1]), k)
    return unfused_aten_epilogue(torch.mm(a2d, b_kn), spec, list(operands), a2d).reshape(*a.shape[:-1], n)


def _row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (as ``torch.empty`` makes them)."""
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(stride))


try:  # the allocators Inductor's generated code calls: empty_strided without the dispatcher
    from torch._C._dynamo.guards import _empty_strided_cpu, _empty_strided_cuda
except ImportError:  # pragma: no cover - a torch without them
    _empty_strided_cpu = _empty_strided_cuda = None
_cuda_current_device = getattr(torch._C, "_cuda_getDevice", None)


def _allocator(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Callable[[], torch.Tensor]:
    """A function making what ``torch.empty(shape, dtype=dtype, device=device)``
    makes (row-major, uninitialised), without the dispatcher and the factory's
    argument parsing on CPU and CUDA. The CUDA one allocates on the current
    device, so it serves calls while that is ``device``; others, and other
    devices, get ``torch.empty_strided``."""
    stride = _row_major(shape)
    slow = functools.partial(torch.empty_strided, shape, stride, dtype=dtype, device=device)
    if device.type == "cpu" and _empty_strided_cpu is not None:
        return functools.partial(_empty_strided_cpu, shape, stride, dtype)
    if device.type == "cuda" and _empty_strided_cuda is not None and _cuda_current_device is not None:
        fast = functools.partial(_empty_strided_cuda, shape, stride, dtype)
        index = device.index

        def alloc() -> torch.Tensor:
            return fast() if _cuda_current_device() == index else slow()

        return alloc
    return slow


def _span(t: torch.Tensor) -> int:
    """How many bytes from ``t.data_ptr()`` the elements of ``t`` reach (0 for an empty tensor)."""
    if t.numel() == 0:
        return 0
    return (sum((d - 1) * st for d, st in zip(t.shape, t.stride())) + 1) * t.element_size()


def _plan_call(a, b, operands, plan: _SpecPlan, spec_text: str, mode: TimingMode, tuner: Autotuner) -> CallPlan:
    """Check the arguments, decide fused or unfused, tune if fused (first call of a signature)."""
    s = plan.spec
    m, n, k = check_arguments(a, b, operands, s)
    reshape_ops = tuple(False if weight else (t.dim() != 1) if col else (t.dim() != 2)
                        for t, col, weight in zip(operands, plan.col, plan.weight))
    op_shapes = tuple(((n,) if col else (m, n)) if again else None for col, again in zip(plan.col, reshape_ops))
    out_shape = (*a.shape[:-1], n)
    call = CallPlan(m, n, k, out_shape, reshape_a=a.dim() != 2, reshape_ops=reshape_ops, spec=s,
                    nk=plan.nk, op_shapes=op_shapes if any(reshape_ops) else None, out_dtype=s.out_dtype,
                    device=a.device, b_meta=(b.shape, b.stride()), out_stride=_row_major(out_shape),
                    spans=tuple(_span(t) for t in (a, b, *operands)),
                    out_bytes=m * n * s.out_dtype.itemsize, alloc=_allocator((m, n), s.out_dtype, a.device))
    if m == 0:
        call.reason = "M = 0: nothing to compute"
        return call
    a2d, b_kn, ops2d = _as_2d(plan, call, a, b, operands)
    why = next((f"the second weight (operand {i}) has dtype {t.dtype}, the input {a.dtype}"
                for i, (t, weight) in enumerate(zip(operands, plan.weight)) if weight and t.dtype != a.dtype), None)
    why = why or fused_kernel_ineligibility(a2d, b_kn, ops2d, k, n)
    if why is not None:
        call.reason = why
        return call
    try:
        call.impl = tuner.select(a2d, b_kn, ops2d, s, spec_text, mode)
    except LoweringError as exc:  # every candidate failed to build or to match the reference
        call.reason = f"autotuning found no working implementation: {exc}"
        return call
    call.launch, takes_nk = bound_launch(call.impl, a2d, b_kn, ops2d, call.alloc())
    call.needs_out = needs_out(call.launch)
    call.weight_t = plan.nk != takes_nk  # transposed where the launch takes the other layout than given ([N, K] if plan.nk)
    call.tuned = tuner.problem_key(a2d, b_kn, ops2d, s, mode)
    return call


def tuned_result(spec: str, mode: TimingMode, a_shape: Sequence[int], b_shape: Sequence[int],
                 tuner: Autotuner | None = None) -> TuneResult | None:
    """The tuning behind the op's plan for calls of ``spec`` with an input of
    ``a_shape`` and a weight of ``b_shape``, timed ``mode``'s way (``None``: no
    such call has been planned, or it runs unfused without tuning): the
    candidates' times, which the program race reads for a chain's runner-ups."""
    tuner = tuner or tuner_mod.get_autotuner()
    a_shape, b_shape = tuple(a_shape), tuple(b_shape)
    for key, call in list(tuner.call_plans.items()):
        # the signature's layout (_signature): spec, mode, then a's shape ... b's shape at 6
        if key[:2] == (spec, mode) and tuple(key[2]) == a_shape and tuple(key[6]) == b_shape and call.tuned:
            result = tuner.results.get(call.tuned)
            if result is not None:
                return result
    return None


def _capturing(a: torch.Tensor) -> bool:
    """Whether this call is being captured into a CUDA graph."""
    return a.is_cuda and torch.cuda.is_current_stream_capturing()


def _first_sight(a, b, operands, spec: str, mode: TimingMode, key: tuple, tuner: Autotuner) -> CallPlan | None:
    """The plan for a signature without one: made now (checks, tuning), or --
    inside a CUDA-graph capture, where nothing may be tuned, compiled or loaded --
    the one made for the other timing mode before the capture, else ``None``
    (the caller runs unfused). Only this path asks whether a capture is on: a
    known signature runs its plan either way."""
    if _capturing(a):
        # tuned for the other mode (an eager warm-up before a user's own capture)?
        call = tuner.call_plans.get(_signature(a, b, operands, spec, "device" if mode == "host" else "host"))
        if call is None:
            _say_once("shape first seen inside a CUDA-graph capture (no tuning, compiling or loading "
                      "while capturing; run the shape once before capture)")
        return call
    call = _plan_call(a, b, operands, _spec_plan(spec), spec, mode, tuner)
    if len(tuner.call_plans) >= _PLANS_LIMIT:
        tuner.clear_call_plans()
    tuner.call_plans[key] = call
    return call


#: ``id(weight) -> (weakref, data_ptr, (shape, stride), transposed view)`` for the
#: weights the op has run whose plan launches their transpose (see :func:`_weight_t`).
_WEIGHT_VIEWS: dict[int, tuple] = {}
#: Weights remembered before the table starts over.
_WEIGHTS_LIMIT = 4096


def _weight_t(call: CallPlan, b: torch.Tensor, b_ptr: int) -> torch.Tensor:
    """``b.t()``, made once per weight (the ``[K, N]`` view of an ``[N, K]``
    weight for an impl, the ``[N, K]`` view of a ``[K, N]`` one for a bound
    kernel launch): a weight is the same tensor call after call, and a view
    costs a dispatcher call.

    The view is of ``b.detach()``, so it does not keep ``b`` alive, and a
    weakref callback drops it with ``b``. It is used while ``b`` is the same
    tensor at the same address with the shape and strides it was made from
    (``.data =``, ``set_`` or ``resize_`` make a new one on ``b``'s next call,
    which also lets the old storage go)."""
    key = id(b)
    hit = _WEIGHT_VIEWS.get(key)
    if hit is not None and hit[1] == b_ptr and hit[0]() is b and hit[2] == call.b_meta:
        return hit[3]
    if len(_WEIGHT_VIEWS) >= _WEIGHTS_LIMIT:
        _WEIGHT_VIEWS.clear()

    def forget(ref, key=key):
        entry = _WEIGHT_VIEWS.get(key)
        if entry is not None and entry[0] is ref:
            del _WEIGHT_VIEWS[key]

    view = b.detach().t()
    _WEIGHT_VIEWS[key] = (weakref.ref(b, forget), b_ptr, call.b_meta, view)
    return view


def _fused_gemm_epilogue(
    a: torch.Tensor, b: torch.Tensor, operands: list[torch.Tensor], spec: str, out: torch.Tensor | None = None,
    direct: bool = False,
) -> torch.Tensor:
    """The kernel of both overloads on every backend (see the module docstring
    for semantics): ``out=None`` is the functional op, else the ``out=`` one.

    A known signature costs a coarse key and a guard check (its full key and
    lookup once more, until it is kept with a guard), the views the impl takes
    (the weight's is remembered), a pointer-alignment check, the output
    allocation (or ``out``'s guard, else its checks, and its overlap test) and
    the plan's launch (for our fused kernels, the launch alone: their checks
    ran when the plan was made).
    """
    mode = current_timing_mode()
    tuner = tuner_mod._default or tuner_mod.get_autotuner()
    coarse = _coarse_key(spec, mode, a, b, operands)
    entry = _guarded_entry(tuner, coarse, a, b, operands)
    if entry is not None:
        call = entry.plan
        if direct and not entry.direct:  # kept by another path (the kernel called as a function)
            entry.direct = True
    else:
        key = _signature(a, b, operands, spec, mode)
        call = tuner.call_plans.get(key)
        if call is not None:
            _keep_guarded(tuner, coarse, a, b, operands, call, direct)
        else:
            call = _first_sight(a, b, operands, spec, mode, key, tuner)
            if call is None:
                s = _spec_plan(spec).spec
                if out is not None:
                    _check_out(out, (*a.shape[:-1], _dims(a, b, s)[1]), s.out_dtype, a.device)
                return _unfused(a, b, operands, s, out)
    return _run_plan(call, a, b, operands, out)


def _run_plan(call: CallPlan, a, b, operands, out: torch.Tensor | None) -> torch.Tensor:
    """What a call does once it has its plan: the unfused path with the plan's
    reason, or the views, the alignment check, the output and the launch."""
    fits = out is not None and call.out_guard is not None and call.out_guard.check(out)
    if out is not None and not fits:
        _check_out(out, call.out_shape, call.out_dtype, call.device)
    impl = call.impl
    if impl is None:
        _say_once(call.reason)  # type: ignore[arg-type]
        return _unfused(a, b, operands, call.spec, out)  # type: ignore[arg-type]
    a2d = a.reshape(call.m, call.k) if call.reshape_a else a
    b_ptr = b.data_ptr()
    weight = _weight_t(call, b, b_ptr) if call.weight_t else b
    shapes = call.op_shapes
    ops2d = operands if shapes is None else [t if s is None else t.reshape(s) for t, s in zip(operands, shapes)]
    ptrs = a2d.data_ptr() | b_ptr
    for t in ops2d:
        ptrs |= t.data_ptr()
    if ptrs % ALIGN_BYTES:  # same shapes and strides, another storage offset
        _say_once("a pointer is not 16-byte aligned")
        return _unfused(a, b, operands, call.spec, out)  # type: ignore[arg-type]
    if out is not None:
        return _launch_into(out, call, a2d, weight, ops2d, (a, b, *operands), fits)
    out = call.alloc() if call.needs_out else None  # type: ignore[misc]
    res = call.launch(a2d, weight, ops2d, out)
    res = out if res is None else res
    return res.reshape(call.out_shape) if call.reshape_a else res


def _unfused(a, b, operands, spec: EpilogueSpec, out: torch.Tensor | None) -> torch.Tensor:
    """:func:`run_unfused`, its result copied into ``out`` (already checked) when there is one."""
    res = run_unfused(a, b, operands, spec)
    if out is None:
        return res
    out.copy_(res)
    return out


# --- the out= overload -----------------------------------------------------------


def _check_out(out: torch.Tensor, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse an ``out`` of another dtype or device; resize one of another shape
    as ATen's out= ops do (silently when it is empty, else with a warning)."""
    if out.dtype != dtype:
        raise LoweringError(f"out has dtype {out.dtype}; expected {dtype} (the spec's out dtype)", where=OUT_NAME,
                            hint="pass an out tensor of the result's dtype, or call the functional op")
    if out.device != device:
        raise LoweringError(f"out is on {out.device}; expected {device}, where the input is", where=OUT_NAME,
                            hint="pass an out tensor on the inputs' device")
    if out.shape != shape:
        _resize_out(out, shape)


def _resize_out(out: torch.Tensor, shape: tuple) -> None:
    """What ATen's ``resize_output`` does: resize, warning when ``out`` had elements (deprecated
    there). Written here rather than called, so fake tensors (``torch.compile``) run it too."""
    if out.numel():
        warnings.warn(
            f"{OUT_NAME}: an output with one or more elements was resized since it had shape "
            f"{list(out.shape)}, which does not match the required output shape {list(shape)} "
            "(ATen's out= ops do the same and deprecate it; pass an empty out or one of the right shape)",
            UserWarning, stacklevel=3,
        )
    try:
        out.resize_(shape)
    except RuntimeError as exc:
        raise LoweringError(
            f"out has shape {list(out.shape)}; expected {list(shape)}, and it cannot be resized: "
            f"{str(exc).splitlines()[0]}", where=OUT_NAME, hint=f"pass an out tensor of shape {list(shape)}",
        ) from exc


def _overlaps(start: int, end: int, spans: tuple[int, ...], inputs: tuple[torch.Tensor, ...]) -> bool:
    """Whether the bytes ``[start, end)`` meet any input's range (conservative: ranges, not elements)."""
    for t, span in zip(inputs, spans):
        p = t.data_ptr()
        if p < end and start < p + span:
            return True
    return False


def _launch_into(out: torch.Tensor, call: CallPlan, a2d, weight, ops2d, inputs: tuple, fits: bool) -> torch.Tensor:
    """Run the plan's launch so that its result lands in ``out`` (shape, dtype and
    device checked; ``fits``: it passed the plan's ``out_guard``): straight into it
    where it is an aligned row-major buffer no input overlaps, else into a fresh
    buffer that is then copied (as when the impl returns a tensor of its own)."""
    ptr = out.data_ptr()
    row_major = fits or out.stride() == call.out_stride
    if row_major and call.out_guard is None:
        call.out_guard = _guard((out,))
    direct = row_major and not ptr % ALIGN_BYTES and not _overlaps(ptr, ptr + call.out_bytes, call.spans, inputs)
    if direct:
        buf = out.view(call.m, call.n) if call.reshape_a else out
    else:
        buf = call.alloc() if call.needs_out else None  # type: ignore[misc]
    res = call.launch(a2d, weight, ops2d, buf)  # type: ignore[misc]
    if res is None or res is buf:
        if direct:
            torch._C._increment_version((out,))  # written through a pointer: autograd's in-place bookkeeping
            return out
        res = buf
    out.copy_(res.reshape(call.out_shape) if call.reshape_a else res)
    return out


# --- registration ----------------------------------------------------------------
#
# One Python kernel per call on the common path. ``torch.library.custom_op``
# would put two Python kernels and a wrapper in every call (its Autograd
# kernel redispatching to a CompositeExplicitAutograd wrapper that checks
# aliasing, then the function): about four ATen no-ops of host time. Here the
# Autograd kernel runs the op's kernel itself when no input needs a gradient
# and nothing sits between autograd and a CPU/CUDA backend (no fake or
# functional tensors, no dispatch mode); everything else -- gradients, Meta and
# fake tensors, export and compile tracing -- goes the ordinary dispatcher way.

_LIB = torch.library.Library("branchyard", "FRAGMENT")
_LIB.define("fused_gemm_epilogue(Tensor a, Tensor b, Tensor[] operands, str spec) -> Tensor",
            tags=(torch.Tag.pt2_compliant_tag,))
_LIB.define("fused_gemm_epilogue.out(Tensor a, Tensor b, Tensor[] operands, str spec, *, Tensor(a!) out) "
            "-> Tensor(a!)", tags=(torch.Tag.pt2_compliant_tag,))
for _name in ("fused_gemm_epilogue", "fused_gemm_epilogue.out"):
    _LIB.impl(_name, _fused_gemm_epilogue, "CompositeExplicitAutograd")

#: The op as the dispatcher sees it (what fused graphs and exported programs call).
fused_gemm_epilogue = torch.ops.branchyard.fused_gemm_epilogue.default
#: Its ``out=`` overload (what the CUDA-graph lowering calls to write a conditional node's output).
fused_gemm_epilogue_out = torch.ops.branchyard.fused_gemm_epilogue.out


def _out_shape(a, b, spec: str) -> tuple[EpilogueSpec, tuple]:
    s = parse_spec(spec)
    n = b.shape[1] if s.weight_layout == "kn" else b.shape[0]
    return s, (*a.shape[:-1], n)


def _fused_gemm_epilogue_fake(a, b, operands, spec):
    s, shape = _out_shape(a, b, spec)
    return a.new_empty(shape, dtype=s.out_dtype)


def _fused_gemm_epilogue_out_fake(a, b, operands, spec, *, out):
    s, shape = _out_shape(a, b, spec)
    _check_out(out, shape, s.out_dtype, a.device)
    return out


torch.library.register_fake(OP_NAME, _fused_gemm_epilogue_fake, lib=_LIB)
torch.library.register_fake(OUT_NAME, _fused_gemm_epilogue_out_fake, lib=_LIB)


def _fused_gemm_epilogue_out_functional(a, b, operands, spec, *, out):
    """The ``out=`` overload under functionalization (``torch.func.functionalize``,
    ``torch.export``'s ``run_decompositions``, AOT compilation): the functional op,
    then ``out.copy_`` -- which functionalization records as a mutation of
    ``out``, so a functional graph holds only the functional op."""
    res = fused_gemm_epilogue(a, b, operands, spec)
    s, shape = _out_shape(a, b, spec)
    _check_out(out, shape, s.out_dtype, a.device)
    out.copy_(res)
    return out


_LIB.impl("fused_gemm_epilogue.out", _fused_gemm_epilogue_out_functional, "Functionalize")


class _Differentiable(torch.autograd.Function):
    """The op where an input needs a gradient. Its backward recomputes the
    chain on the reference path and differentiates that: the backward is rare
    (this is an inference lowering) and must not diverge from the forward's
    semantics."""

    @staticmethod
    def forward(ctx, keyset, spec, a, b, *operands):  # type: ignore[override]
        with torch._C._AutoDispatchBelowAutograd():
            out = fused_gemm_epilogue.redispatch(keyset & _AFTER_AUTOGRAD, a, b, list(operands), spec)
        ctx.save_for_backward(a, b, *operands)
        ctx.spec = spec
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        a, b, *operands = ctx.saved_tensors
        spec = parse_spec(ctx.spec)
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(t.dtype.is_floating_point) for t in (a, b, *operands)]
            out = reference_fused_gemm(leaves[0], leaves[1], leaves[2:], spec)
            wanted = [t for t in leaves if t.requires_grad]
            got = iter(torch.autograd.grad(out, wanted, grad.to(out.dtype), allow_unused=True))
            grads = [next(got) if t.requires_grad else None for t in leaves]
        return None, None, *grads


_AFTER_AUTOGRAD = torch._C._after_autograd_keyset
#: Backends whose kernel is :func:`_fused_gemm_epilogue` itself (CompositeExplicitAutograd).
_DIRECT_BACKENDS = frozenset({torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA})


#: Per dispatch key set (its raw bits): whether the call would next reach
#: :func:`_fused_gemm_epilogue` on a CPU/CUDA backend with nothing in between.
_DIRECT: dict[int, bool] = {}


def _needs_grad(a: torch.Tensor, b: torch.Tensor, operands: list[torch.Tensor]) -> bool:
    if a.requires_grad or b.requires_grad:
        return True
    for t in operands:
        if t.requires_grad:
            return True
    return False


def _autograd_kernel(keyset, a, b, operands, spec, out=None):
    """Both overloads' Autograd kernel (``out`` given: the ``out=`` one)."""
    if torch._C.is_grad_enabled() and (_needs_grad(a, b, operands) or (out is not None and out.requires_grad)):
        if out is None:
            return _Differentiable.apply(keyset, spec, a, b, *operands)
        raise LoweringError(
            "functions with out=... arguments don't support automatic differentiation, "
            "but one of the arguments requires grad", where=OUT_NAME,
            hint="call it under torch.no_grad() or torch.inference_mode(), or call the functional op",
        )
    raw = keyset.raw_repr()
    direct = _DIRECT.get(raw)
    if direct is None:
        direct = _DIRECT[raw] = (keyset & _AFTER_AUTOGRAD).highestPriorityTypeId() in _DIRECT_BACKENDS
    if direct:
        return _fused_gemm_epilogue(a, b, operands, spec, out, True)  # what the redispatch would reach, one trip fewer
    with torch._C._AutoDispatchBelowAutograd():
        if out is None:
            return fused_gemm_epilogue.redispatch(keyset & _AFTER_AUTOGRAD, a, b, operands, spec)
        return fused_gemm_epilogue_out.redispatch(keyset & _AFTER_AUTOGRAD, a, b, operands, spec, out=out)


for _name in ("fused_gemm_epilogue", "fused_gemm_epilogue.out"):
    _LIB.impl(_name, _autograd_kernel, "Autograd", with_keyset=True)


# --- the dispatcher bypass ---------------------------------------------------------
#
# A tuned call's trip through the dispatcher into the Python Autograd kernel
# costs more host time than the op's own work. The functional overload's entry
# (the callable ``OpOverload.__call__`` runs, as torch's own PyObject dispatch
# swaps it) first tries the plan a guard kept for a direct call: the guard pins
# each tensor's type, sizes, strides, dtype, device, ``requires_grad`` and
# dispatch keys under the thread's dispatch state, so such a call would reach
# this module's kernel with nothing in between. What a guard does not see is
# checked before: a torch-function mode, a dispatch mode (the guard leaves out
# the Python keys that a fake or proxy mode turns on), the profiler (which
# records the op), the Python dispatcher. Anything else -- keywords, other
# argument types, a signature not kept yet -- takes the dispatcher.

#: The dispatcher's entry for the functional overload (what the bypass falls back to).
_DISPATCH = fused_gemm_epilogue._op
_PYTHON_DISPATCHER = torch._C.DispatchKey.PythonDispatcher
_PYTHON = torch._C.DispatchKey.Python
_tls_includes = torch._C._dispatch_tls_is_dispatch_key_included
_torch_function_mode = torch._C._is_torch_function_mode_enabled
_profiling = torch._C._autograd._profiler_enabled


def _bypass_plan(a, b, operands, spec) -> CallPlan | None:
    """The plan a call may run without the dispatcher, else ``None``."""
    tuner = tuner_mod._default
    if tuner is None:
        return None
    try:
        entry = _guarded_entry(tuner, _coarse_key(spec, current_timing_mode(), a, b, operands), a, b, operands)
    except (AttributeError, TypeError):  # not the schema's argument types: the dispatcher says what is wrong
        return None
    if entry is None or not entry.direct or (entry.grad and torch._C.is_grad_enabled()):
        return None
    return entry.plan


def _bypass_call(*args, **kwargs):
    """``fused_gemm_epilogue(a, b, operands, spec)``: the kept plan's run where
    :func:`_bypass_plan` finds one, else the dispatcher."""
    if len(args) == 4 and not kwargs and not (_torch_function_mode() or _tls_includes(_PYTHON) or _profiling()
                                              or _tls_includes(_PYTHON_DISPATCHER)):
        call = _bypass_plan(*args)
        if call is not None:
            return _run_plan(call, args[0], args[1], args[2], None)
    return _DISPATCH(*args, **kwargs)


if _TensorGuards is not None:
    fused_gemm_epilogue._op = _bypass_call
