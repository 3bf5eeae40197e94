"""The fused op's ``out=`` overload inside CUDA-graph conditional nodes (issue 11).

A decode-step program -- ``while_loop`` > ``switch`` > one
``branchyard::fused_gemm_epilogue`` per branch -- is captured twice: with the
op's out form (the branch's op writes the SWITCH node's output buffer) and
with it hidden from the lowering (the op writes a buffer of its own, then a
copy kernel node moves it). Where the tuned implementation writes its ``out``
argument (cuBLAS ``addmm``, cuBLASLt ``_addmm_activation``, our CuTeDSL
kernel), every branch body has exactly one kernel node fewer; where it
returns a tensor of its own (the unfused chain) or the branch needs the op's
result twice, the count does not grow. Every capture replays equal to eager
on every branch, without host syncs.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from branchyard.lowering.cuda_graph import patterns
from branchyard.lowering.cuda_graph.fx_builders import switch_module, trace, while_loop_module
from branchyard.lowering.nvgemm import NvGemmFallbackWarning
from branchyard.lowering.nvgemm import candidates as nv_candidates
from branchyard.lowering.nvgemm import tuner as nv_tuner
from branchyard.lowering.nvgemm import winners as nv_winners

from cuda_graph_gpu_support import lower, no_host_sync, scalar
from nvgemm_gpu_support import GemmConfig, needs_cutedsl

pytestmark = pytest.mark.gpu
DEV = "cuda"
FUSED = torch.ops.branchyard.fused_gemm_epilogue.default
OUT = torch.ops.branchyard.fused_gemm_epilogue.out
BRANCHES = 3
M, D = 64, 256  # x is [M, D]; every weight [D, D] (nk), so a step's result is the next step's x
TOL = dict(rtol=2e-2, atol=2e-2)


def _cutedsl(problem):
    return nv_candidates._cutedsl_build(problem, config=GemmConfig(128, 128))


#: impl name -> (candidate, spec of every branch, whether the impl writes its out argument)
IMPLS = {
    "cublas:addmm": (nv_candidates.Candidate("cublas:addmm", nv_candidates._addmm_build,
                                             nv_candidates._addmm_applies), "w=nk;bias@0;out=bfloat16", True),
    "cublaslt:_addmm_activation": (nv_candidates.Candidate("cublaslt:_addmm_activation", nv_candidates._cublaslt_build,
                                                           nv_candidates._cublaslt_applies),
                                   "w=nk;bias@0;relu;out=bfloat16", True),
    "cutedsl": (nv_candidates.Candidate("cutedsl:t128x128_c1x1_o1", _cutedsl),
                "w=nk;bias@0;gelu_tanh;out=bfloat16", True),
    "aten:unfused": (nv_candidates.Candidate(nv_candidates.UNFUSED, nv_candidates._aten_build),
                     "w=nk;bias@0;silu;out=bfloat16", False),
}


@pytest.fixture
def only(tmp_path):
    """Install a tuner whose only candidate is the named one; yield the tuner."""
    installed = []

    def install(name):
        cand = IMPLS[name][0]
        tuner = nv_tuner.Autotuner([cand], timer=lambda n, f: 1.0, db=nv_winners.WinnerDB(tmp_path),
                                   env={"gpu": "out-test"}, progress=False)
        nv_tuner.set_autotuner(tuner)
        installed.append(tuner)
        return tuner

    yield install
    nv_tuner.set_autotuner(None)


class Branch(torch.nn.Module):
    """Branch ``k``: the fused op on its own weight and bias; ``twice``: its result is
    both outputs (one can be written in place, the other needs a copy)."""

    def __init__(self, k: int, spec: str, twice: bool):
        super().__init__()
        self.k, self.spec, self.twice = k, spec, twice

    def forward(self, x, w0, b0, w1, b1, w2, b2):
        wb = (w0, b0, w1, b1, w2, b2)
        y = FUSED(x, wb[2 * self.k], [wb[2 * self.k + 1]], self.spec)
        return (y, y) if self.twice else (y,)


def _program(spec: str, twice: bool = False):
    """``while i < len(ks): x = switch(ks[i], branches, x, w0, b0, w1, b1, w2, b2)``
    (with ``twice``: also ``acc += `` the branch's second output)."""
    sw = switch_module([Branch(k, spec, twice) for k in range(BRANCHES)], num_operands=1 + 2 * BRANCHES,
                       num_outputs=2 if twice else 1)

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sw = sw

        def forward(self, i, x, acc, ks, w0, b0, w1, b1, w2, b2):
            outs = self.sw(torch.index_select(ks, 0, i.view(1)), x, w0, b0, w1, b1, w2, b2)
            return i + 1, outs[0], (acc + outs[1] if twice else acc)

    return while_loop_module(lambda i, x, acc, ks, w0, b0, w1, b1, w2, b2: i < ks.shape[0], trace(Step()),
                             num_carried=3, num_additional=1 + 2 * BRANCHES)


def _params(seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    wb = []
    for _ in range(BRANCHES):
        wb.append((torch.randn(D, D, generator=g, device=DEV) / D**0.5).bfloat16())
        wb.append((torch.randn(D, generator=g, device=DEV) * 0.1).bfloat16())
    x = torch.randn(M, D, generator=g, device=DEV).bfloat16()
    return x, wb


def _capture(program, args, *, out_form: bool, monkeypatch):
    with monkeypatch.context() as mp, warnings.catch_warnings():
        warnings.simplefilter("error", NvGemmFallbackWarning)  # warm-up tuned every branch: no fallback
        if not out_form:  # the lowering as it was before the op had an out= overload
            mp.setitem(patterns._OUT_CACHE, FUSED, None)
        return lower(program, args)


#: The branch of each step (as many steps as the captured ``ks`` has): every branch, each after each, clamped.
STEPS = [[0, 1, 2, 0, 1, 2], [2, 2, 2, 2, 2, 2], [1, 0, 1, 0, 2, 0], [2, 1, 0, -1, 5, 1]]


def _args(x, wb):
    return (scalar(0), x, torch.zeros_like(x), torch.tensor(STEPS[0], device=DEV), *wb)


def _check_every_branch(m, program, x, wb):
    for steps in STEPS:
        ks = torch.tensor(steps, device=DEV)
        args = (scalar(0), x, torch.zeros_like(x), ks, *wb)
        want = program(*args)  # eager: the same tuned op, functional
        with no_host_sync():
            got = m(*args)
        assert int(got[0]) == len(ks)
        for g, w in zip(got[1:], want[1:]):
            torch.testing.assert_close(g.float(), w.float(), **TOL)


def _branch_nodes(m) -> list[int]:
    """Nodes of every kind in each branch body (``copy_`` of one dense tensor to another
    is a MEMCPY node, the lowering's copy a KERNEL node: count both)."""
    (loop,) = m.graph_nodes.bodies  # the WHILE body: index_select, set, SWITCH, step
    assert len(loop.bodies) == BRANCHES, m.graph_nodes.summary()
    return [b.own for b in loop.bodies]


@pytest.mark.parametrize("impl", ["cublas:addmm", "cublaslt:_addmm_activation",
                                  pytest.param("cutedsl", marks=needs_cutedsl)])
def test_branch_writes_the_switch_output_without_a_copy_node(impl, only, monkeypatch):
    _, spec, writes_out = IMPLS[impl]
    assert writes_out
    x, wb = _params()
    program = _program(spec)
    args = _args(x, wb)
    tuner = only(impl)
    after = _capture(program, args, out_form=True, monkeypatch=monkeypatch)
    before = _capture(program, args, out_form=False, monkeypatch=monkeypatch)
    assert {r.winner for r in tuner.results.values()} == {IMPLS[impl][0].name}, "every branch runs the impl tested"
    assert after.conditional_nodes["SWITCH"] == 1 and after.conditional_nodes["WHILE"] == 1
    got, was = _branch_nodes(after), _branch_nodes(before)
    assert got == [k - 1 for k in was], (after.graph_nodes.summary(), before.graph_nodes.summary())
    assert after.graph_nodes.bodies[0].by_type == before.graph_nodes.bodies[0].by_type
    for m in (after, before):
        _check_every_branch(m, program, x, wb)


def test_an_impl_returning_its_own_tensor_still_lands_in_the_switch_output(only, monkeypatch):
    _, spec, writes_out = IMPLS["aten:unfused"]
    assert not writes_out
    x, wb = _params(1)
    program = _program(spec)
    args = _args(x, wb)
    only("aten:unfused")
    after = _capture(program, args, out_form=True, monkeypatch=monkeypatch)
    before = _capture(program, args, out_form=False, monkeypatch=monkeypatch)
    # the op's own copy_ (a MEMCPY node) replaces the lowering's copy kernel: as many nodes
    assert _branch_nodes(after) == _branch_nodes(before), (after.graph_nodes.summary(), before.graph_nodes.summary())
    _check_every_branch(after, program, x, wb)


@pytest.mark.parametrize("impl", ["cublas:addmm", pytest.param("cutedsl", marks=needs_cutedsl)])
def test_a_result_needed_twice_is_written_once_and_copied_once(impl, only, monkeypatch):
    _, spec, _ = IMPLS[impl]
    x, wb = _params(2)
    program = _program(spec, twice=True)
    args = _args(x, wb)
    only(impl)
    after = _capture(program, args, out_form=True, monkeypatch=monkeypatch)
    before = _capture(program, args, out_form=False, monkeypatch=monkeypatch)
    # the second output still needs one copy node (the copies of both outputs shared one before)
    assert _branch_nodes(after) == _branch_nodes(before), (after.graph_nodes.summary(),
                                                               before.graph_nodes.summary())
    for m in (after, before):
        _check_every_branch(m, program, x, wb)


def _captured_nodes(fn) -> tuple[int, torch.cuda.CUDAGraph]:
    """Capture ``fn()`` with torch.cuda.graph; its node count (all kinds) and the graph (instantiated)."""
    from cuda.bindings import driver

    from branchyard.lowering.cuda_graph.conditional_nodes import count_graph_nodes

    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        fn()
    count = count_graph_nodes(driver.CUgraph(graph.raw_cuda_graph()), {})
    graph.instantiate()
    return count.own, graph  # every kind: copy_ between dense tensors is captured as a MEMCPY node


@pytest.mark.parametrize("impl", ["cublas:addmm", "cublaslt:_addmm_activation",
                                  pytest.param("cutedsl", marks=needs_cutedsl)])
def test_out_overload_captured_by_torch_writes_the_buffer_with_no_copy(impl, only):
    """Outside the lowering: ``.out`` captured by torch.cuda.graph into a buffer made
    before the capture (a tuned shape) is one node fewer than the functional
    op followed by ``copy_``, and both replay what the functional op computes."""
    _, spec, _ = IMPLS[impl]
    only(impl)
    x, wb = _params(3)
    FUSED(x, wb[0], [wb[1]], spec)  # warm-up: tunes
    torch.cuda.synchronize()
    direct, copied = (torch.empty(M, D, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    n_direct, g_direct = _captured_nodes(lambda: OUT(x, wb[0], [wb[1]], spec, out=direct))
    n_copied, g_copied = _captured_nodes(lambda: copied.copy_(FUSED(x, wb[0], [wb[1]], spec)))
    assert n_direct == n_copied - 1, (n_direct, n_copied)
    x.copy_(_params(4)[0])
    g_direct.replay()
    g_copied.replay()
    torch.cuda.synchronize()
    want = FUSED(x, wb[0], [wb[1]], spec).float()
    for buf in (direct, copied):
        torch.testing.assert_close(buf.float(), want, **TOL)
