"""Programs and checks shared by the cuda_graph GPU tests (test_cuda_graph_*_gpu.py).

Every case checks outputs against eager execution of the same program on the
same device, across calls whose trip counts / branches change without
recapture, and with host syncs turned into errors
(torch.cuda.set_sync_debug_mode("error")) during replay.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch._higher_order_ops.while_loop import while_loop

from branchyard.lowering.cuda_graph import CudaGraphFallbackWarning, cuda_graph

DEV = "cuda"

@contextlib.contextmanager
def no_host_sync():
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)


def lower(program, args, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("error", CudaGraphFallbackWarning)  # a fallback fails the test
        m = cuda_graph(program, args, **options)
    assert m.lowered, m.fallback_reason
    return m


def check(m, reference, cases):
    for args in cases:
        with no_host_sync():
            got = m(*args)
        want = reference(*args)
        for g, w in zip(got, want):
            assert torch.equal(g, w), (args, g, w)


# --------------------------------------------------------------------------- programs
class Countdown(torch.nn.Module):
    def forward(self, x, c, n):
        def cond_fn(i, y):
            return i < n

        def body_fn(i, y):
            return i + 1, torch.lerp(y, c, 0.5)

        return while_loop(cond_fn, body_fn, (torch.zeros((), dtype=torch.int64, device=x.device), x))


class CondInWhile(torch.nn.Module):
    def forward(self, x, n):
        def body_fn(i, y):
            return i + 1, torch.cond(y.sum() > 0, lambda t: t * 0.5 - 3.0, lambda t: t * -1.5 + 1.0, (y,))

        return while_loop(lambda i, y: i < n, body_fn, (torch.zeros((), dtype=torch.int64, device=x.device), x))


class WhileInWhile(torch.nn.Module):
    def forward(self, x, n, m):
        def outer_body(i, y):
            def inner_body(j, z):
                return j + 1, z * 1.01 + i.to(z.dtype)

            _, y2 = while_loop(lambda j, z: j < m + i, inner_body, (torch.zeros_like(i), y))
            return i + 1, y2

        return while_loop(lambda i, y: i < n, outer_body, (torch.zeros((), dtype=torch.int64, device=x.device), x))


class WhileInBranch(torch.nn.Module):
    def forward(self, x, w, limit):
        def grow(t):
            # a matmul in a branch the example inputs never take: warm-up must still initialise cuBLAS
            return while_loop(lambda y: y.abs().sum() < limit, lambda y: (y @ w + 1.0,), (t,))[0]

        return torch.cond(x.sum() > 0, grow, lambda t: t - 1.0, (x,))


def export(module, args):
    return torch.export.export(module, args)


def scalar(v, dtype=torch.int64):
    return torch.tensor(v, dtype=dtype, device=DEV)

