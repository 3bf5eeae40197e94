"""GPU tests of the cuda_graph lowering: a set kernel never reads across a write no schema marks.

A train-mode batch norm updates its running statistics in place although its
ATen schema marks no argument written (``branchyard.fx.mutation.UNMARKED_WRITES``).
A predicate or switch index read from those statistics before the batch norm must
see them as eager does, before the update, on every replay.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from branchyard._compat import HAS_SWITCH
from branchyard.lowering.cuda_graph.inductor_regions import fuse_regions

from cuda_graph_gpu_support import DEV, export, lower, no_host_sync
from running_stats_models import GatedByRunningMean

pytestmark = pytest.mark.gpu


class _RoutedByRunningMean(torch.nn.Module):
    """A switch indexed by ``argmax(rm)`` (or a router ``argmax(rm @ w)``) read before a
    train-mode batch norm moves the largest running mean from the first column to the last."""

    def __init__(self, router: bool):
        super().__init__()
        self.router = router
        self.register_buffer("rm", torch.tensor([1.0, 0.0, 0.0]))
        self.register_buffer("rv", torch.ones(3))
        self.register_buffer("w", torch.eye(3))

    def forward(self, data, x):
        from torch._higher_order_ops.switch import switch

        source = self.rm @ self.w if self.router else self.rm
        k = torch.remainder(torch.clamp(torch.argmax(source), -1, 2), 3)
        h = F.batch_norm(data, self.rm, self.rv, training=True)
        branches = [lambda t: t + 1, lambda t: t * 3, lambda t: t - 2]
        return switch(k, branches, (x + h.mean(),))


def _data():
    data = torch.zeros(8, 3, device=DEV)
    data[:, -1] = 50.0  # the last running mean moves towards 50: 5, 9.5, ...
    return data


def _only(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _check_calls(module, *, inductor=False, calls=4):
    args = (_data(), torch.randn(4, device=DEV))
    module = module.to(DEV)
    reference = copy.deepcopy(module)
    gm = export(module, args).module()
    if inductor:
        fuse_regions(gm)
    lowered = lower(gm, args)
    for _ in range(calls):
        x = torch.randn(4, device=DEV)
        with no_host_sync():
            got = _only(lowered(args[0], x))
        want = _only(reference(args[0], x))
        assert torch.equal(got, want), (got, want)
        torch.testing.assert_close(gm.rm, reference.rm)  # a replay updates the statistics, as eager does


@pytest.mark.parametrize("inductor", [False, True])
def test_a_predicate_on_running_statistics_is_read_before_their_update(inductor):
    _check_calls(GatedByRunningMean(), inductor=inductor)


@pytest.mark.skipif(not HAS_SWITCH, reason="torch.ops.higher_order.switch needs torch >= 2.14")
@pytest.mark.parametrize("router", [False, True], ids=["argmax", "router"])
def test_a_switch_index_from_running_statistics_is_read_before_their_update(router):
    _check_calls(_RoutedByRunningMean(router))


def _body_writing_the_counter(i, y, n):
    j = i + 1
    i.add_(5)  # after the sum: j read i before this write
    return j, y * 2


def test_a_counter_written_in_place_after_its_sum_counts_as_eager_does():
    """The step kernel must not add to the value ``i.add_(5)`` left: eager runs 4 trips here
    (i = 1, 2, 3, 4), an increment after the write would stop after one (i = 6)."""
    from branchyard.lowering.cuda_graph.fx_builders import while_loop_module

    program = while_loop_module(lambda i, y, n: i < n, _body_writing_the_counter, num_carried=2, num_additional=1)
    args = (torch.tensor(0, device=DEV), torch.ones(3, device=DEV), torch.tensor(4, device=DEV))
    lowered = lower(program, args)

    def reference(i, y, n):
        i, y = i.clone(), y.clone()
        while bool(i < n):
            i, y = _body_writing_the_counter(i, y, n)
        return i, y

    for n in (4, 0, 7):
        call = (args[0], args[1], torch.tensor(n, device=DEV))
        want = reference(*call)
        with no_host_sync():
            got = lowered(*(c.clone() for c in call))  # the outputs only: eager also writes its first carry input
        for g, w in zip(got, want):
            assert torch.equal(g, w), (n, got, want)
