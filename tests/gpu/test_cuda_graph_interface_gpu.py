"""GPU tests of the cuda_graph lowering's interface: outputs, call-time checks, lowering errors, the torch.compile backend."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._higher_order_ops.while_loop import while_loop

import branchyard.lowering
from branchyard.errors import LoweringError
from branchyard.lowering.cuda_graph import CudaGraphFallbackWarning, cuda_graph, cuda_graph_backend

from cuda_graph_gpu_support import DEV, lower, Countdown, CondInWhile, export, scalar

pytestmark = pytest.mark.gpu


def test_outputs_are_fresh_tensors_unless_asked():
    x, c = torch.randn(256, device=DEV), torch.randn(256, device=DEV)
    ep = export(Countdown(), (x, c, scalar(3)))
    m = lower(ep, (x, c, scalar(3)))
    a = m(x, c, scalar(1))[1]
    b = m(x, c, scalar(2))[1]
    assert not torch.equal(a, b)
    shared = lower(ep, (x, c, scalar(3)), clone_outputs=False)
    assert shared(x, c, scalar(1))[1].data_ptr() == shared(x, c, scalar(2))[1].data_ptr()


def test_wrong_shapes_at_call_time_are_a_clear_error():
    x, c = torch.randn(256, device=DEV), torch.randn(256, device=DEV)
    m = lower(export(Countdown(), (x, c, scalar(3))), (x, c, scalar(3)))
    with pytest.raises(LoweringError, match=r"input 0 is \(128,\).*captured for \(256,\)"):
        m(x[:128], c, scalar(3))


def test_cpu_tensor_inside_the_program_is_a_lowering_error():
    class CpuCounter(torch.nn.Module):
        def forward(self, x, n):
            return while_loop(lambda i, y: i < n, lambda i, y: (i + 1, y * 2), (torch.zeros((), dtype=torch.int64), x))

    x = torch.randn(4, device=DEV)
    ep = export(CpuCounter(), (x, scalar(3)))
    with pytest.raises(LoweringError, match=r"node 'zeros': produces a tensor on cpu"):
        cuda_graph(ep, (x, scalar(3)))


def test_predicate_on_the_host_is_a_lowering_error():
    from branchyard.lowering.cuda_graph.fx_builders import cond_module

    program = cond_module(lambda x: x + 1, lambda x: x - 1, num_operands=1)
    with pytest.raises(LoweringError, match=r"input 0 is on cpu and is the predicate of cond '\w+'; the program is lowered for cuda:0"):
        cuda_graph(program, (torch.tensor(True), torch.ones(3, device=DEV)))


def test_torch_compile_backend():
    seen = []

    def backend(gm, example_inputs):
        fn = cuda_graph_backend(gm, example_inputs)
        seen.append(fn)
        return fn

    @torch.compile(backend=backend, fullgraph=True)
    def f(x, n):
        def body_fn(i, y):
            return i + 1, torch.cond(y.sum() > 0, lambda t: t * 0.5 - 3.0, lambda t: t * -1.5 + 1.0, (y,))

        return while_loop(lambda i, y: i < n, body_fn, (torch.zeros((), dtype=torch.int64, device=x.device), x))

    x = torch.randn(1024, device=DEV)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CudaGraphFallbackWarning)
        for n in (4, 0, 33):
            i, y = f(x, scalar(n))
            ref_i, ref_y = CondInWhile()(x, scalar(n))
            assert i.item() == n and torch.equal(y, ref_y)
    assert len(seen) == 1 and seen[0].lowered[0].lowered


def test_package_is_callable():
    x, c = torch.randn(256, device=DEV), torch.randn(256, device=DEV)
    ep = export(Countdown(), (x, c, scalar(3)))
    m = branchyard.lowering.cuda_graph(ep, (x, c, scalar(3)))
    assert m.lowered and torch.equal(m(x, c, scalar(7))[1], ep.module()(x, c, scalar(7))[1])
