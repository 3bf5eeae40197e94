"""What a tuning decision is about: one fused GEMM call's :class:`Problem`
(spec, sizes, dtypes, layouts, device, timing mode) and the :data:`Impl`
signature every candidate implementation has.

    >>> import torch
    >>> from branchyard.lowering.nvgemm.epilogue import EpilogueSpec
    >>> spec = EpilogueSpec.parse("w=nk;relu;out=float32")
    >>> p = Problem.of(torch.randn(5, 16), torch.randn(32, 16).t(), [], spec)
    >>> p.m, p.n, p.k, p.b_layout, p.spec.weight_layout
    (5, 32, 16, 'nk', 'kn')
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Sequence

import torch

from branchyard.errors import LoweringError
from branchyard.lowering.nvgemm.epilogue import EpilogueSpec

__all__ = ["Impl", "Problem", "TimingMode", "bound_launch", "m_bucket", "dtype_name", "layout_name", "needs_out",
           "own_output"]

#: ``impl(a [M, K], b_kn [K, N], operands, out [M, N]) -> result``. The result
#: is ``out`` (written in place) or a tensor of the same shape and dtype; an
#: impl marked by :func:`own_output` gets ``out=None`` from the op.
Impl = Callable[[torch.Tensor, torch.Tensor, Sequence[torch.Tensor], torch.Tensor], Any]


def own_output(impl: Impl) -> Impl:
    """``impl``, marked as one that returns a tensor of its own and never writes
    ``out`` (ATen ops, Inductor's compiled chains): the op allocates no output
    buffer for its calls, which would be a wasted allocation per call and, in a
    CUDA graph, an unused block of the graph's pool.

        >>> impl = own_output(lambda a, b_kn, operands, out: a @ b_kn)
        >>> needs_out(impl), needs_out(lambda a, b_kn, operands, out: out)
        (False, True)
    """
    impl.own_output = True  # type: ignore[attr-defined]
    return impl


def needs_out(launch: Callable[..., Any]) -> bool:
    """Whether ``launch`` (an impl or the launch its ``bind`` returned) writes an ``out`` buffer."""
    return not getattr(launch, "own_output", False)


def bound_launch(impl: Impl, a: torch.Tensor, b_kn: torch.Tensor, operands: Sequence[torch.Tensor],
                 out: torch.Tensor) -> tuple[Callable[..., Any], bool]:
    """What a tuned call of ``impl`` runs for tensors shaped like these, and whether it
    takes the weight ``[N, K]``: the launch ``impl.bind`` returns (our fused kernels: their
    checks and variant lookup done now, the weight given as ``b_kn.t()``) and True; else
    ``impl`` itself and False (no ``bind``, or ``bind`` refuses: a call then raises what
    ``impl`` raises).

        >>> impl = lambda a, b_kn, operands, out: out
        >>> bound_launch(impl, None, None, [], None) == (impl, False)
        True
    """
    bind = getattr(impl, "bind", None)
    if bind is not None:
        try:
            launch = bind(a, b_kn, operands, out)
        except LoweringError:
            launch = None
        if launch is not None:
            return launch, True
    return impl, False


#: How the caller runs the op, hence how candidates are timed (see :mod:`.timing`).
TimingMode = Literal["host", "device"]


def m_bucket(m: int) -> int:
    """The ``M`` bucket a winner is shared across: the next power of two.

    >>> [m_bucket(m) for m in (1, 2, 3, 16, 17, 2048, 3000)]
    [1, 2, 4, 16, 32, 2048, 4096]
    """
    return 1 if m <= 1 else 1 << (m - 1).bit_length()


def dtype_name(d: torch.dtype) -> str:
    """``"bfloat16"`` for ``torch.bfloat16``."""
    return str(d).removeprefix("torch.")


def layout_name(t: torch.Tensor) -> str:
    """``row`` (last dim contiguous), ``col`` (first dim contiguous) or the strides."""
    if t.dim() == 1:
        return "vec" if t.stride(0) == 1 else f"s{t.stride(0)}"
    if t.stride(-1) == 1:
        return "row"
    if t.dim() == 2 and t.stride(0) == 1:
        return "col"
    return "s" + "x".join(map(str, t.stride()))


@dataclass(frozen=True)
class Problem:
    """What the winner depends on: one fused GEMM on one device, timed one way."""

    spec: EpilogueSpec
    m: int
    n: int
    k: int
    dtype: torch.dtype
    operand_dtypes: tuple[torch.dtype, ...]
    a_layout: str
    b_layout: str  # "nk": b_kn is the .t() of a row-major [N, K] weight; "kn": row-major [K, N]
    operand_layouts: tuple[str, ...]
    device: str
    timing: TimingMode = "host"

    @staticmethod
    def of(
        a: torch.Tensor, b_kn: torch.Tensor, operands: Sequence[torch.Tensor], spec: EpilogueSpec,
        timing: TimingMode = "host",
    ) -> "Problem":
        """The problem an op call poses (``a`` ``[M, K]``, ``b_kn`` ``[K, N]``).

        Candidates always see ``b`` as ``[K, N]``, so the spec is normalised to
        ``weight_layout="kn"``; the memory layout is ``b_layout``. A spec's
        ``impl`` (how to run it, not what it computes) is left out.
        """
        spec = dataclasses.replace(spec, weight_layout="kn", impl=None)
        m, k = a.shape
        n = b_kn.shape[1]
        b_layout = "kn" if b_kn.stride(1) == 1 else "nk" if b_kn.stride(0) == 1 else layout_name(b_kn)
        return Problem(
            spec, int(m), int(n), int(k), a.dtype, tuple(t.dtype for t in operands),
            layout_name(a), b_layout, tuple(layout_name(t) for t in operands), str(a.device), timing,
        )

    def key(self, env: Mapping[str, str]) -> str:
        """The database key: environment, spec, dtypes, layouts, N, K, M bucket, timing mode."""
        fields = dict(env)
        fields.update(
            spec=str(self.spec),
            dtype=dtype_name(self.dtype),
            operand_dtypes=",".join(map(dtype_name, self.operand_dtypes)),
            layouts=f"a:{self.a_layout};b:{self.b_layout};ops:{','.join(self.operand_layouts)}",
            n=str(self.n),
            k=str(self.k),
            m_bucket=str(m_bucket(self.m)),
            timing=self.timing,
        )
        return "|".join(f"{k}={v}" for k, v in fields.items())

    def __str__(self) -> str:
        return f"M={self.m} N={self.n} K={self.k} {dtype_name(self.dtype)} [{self.spec}] ({self.timing} timing)"
