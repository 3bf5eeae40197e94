"""Impls that return a tensor of their own (ATen ops, Inductor's chains) are
marked ``own_output``: the op then allocates no output buffer for their calls
(a wasted allocation per call, and an unused block of a CUDA graph's pool),
while impls that write ``out`` (our kernels) still get one; both give the
reference, through the functional op and its ``out=`` overload."""

from __future__ import annotations

import pytest
import torch

from branchyard.lowering.nvgemm import candidates as cands_mod
from branchyard.lowering.nvgemm.candidates import default_candidates
from branchyard.lowering.nvgemm.epilogue import EpilogueSpec, reference_fused_gemm
from branchyard.lowering.nvgemm.problem import Problem, needs_out

FUSED = torch.ops.branchyard.fused_gemm_epilogue
TEXT = "w=nk;bias@0;relu;residual@1;out=float32"
SPEC = EpilogueSpec.parse(TEXT)


@pytest.mark.parametrize("own, allocs", [(False, 3), (True, 0)])
def test_a_functional_call_allocates_an_output_only_for_an_impl_that_writes_one(probe_tuner_of, own, allocs):
    tuner = probe_tuner_of(own)
    g = torch.Generator().manual_seed(3)
    a, w = torch.randn(4, 16, generator=g), torch.randn(8, 16, generator=g)
    ops = [torch.randn(8, generator=g), torch.randn(4, 8, generator=g)]
    want = reference_fused_gemm(a, w, ops, SPEC)
    with torch.no_grad():
        torch.testing.assert_close(FUSED(a, w, ops, TEXT), want)  # plans
        (call,) = tuner.call_plans.values()
        assert call.impl is not None and call.needs_out is not own
        made = []
        alloc = call.alloc
        call.alloc = lambda: made.append(1) or alloc()
        for _ in range(3):
            torch.testing.assert_close(FUSED(a, w, ops, TEXT), want)
        assert len(made) == allocs
        # out= overload: a row-major buffer is written directly, a transposed one through a copy
        for out in (torch.empty(4, 8), torch.empty(8, 4).t()):
            made.clear()
            got = FUSED.out(a, w, ops, TEXT, out=out)
            assert got is out
            torch.testing.assert_close(out, want)
            assert len(made) == (1 if not own and not out.is_contiguous() else 0)


def test_every_aten_and_inductor_candidate_is_marked_and_computes_without_an_out():
    """The candidates that return their own result are the ones marked: called
    with ``out=None`` they give the reference; the ones that write ``out``
    (``addmm``'s and ``_addmm_activation``'s ``out=``) are not marked."""
    g = torch.Generator().manual_seed(5)
    for text in ("w=kn;bias@0;relu;residual@1;out=float32", "w=kn;scale:0.5;residual@0;tanh;out=float32",
                 "w=kn;bias@0;out=float32"):
        spec = EpilogueSpec.parse(text)
        a, b = torch.randn(4, 16, generator=g), torch.randn(16, 8, generator=g)
        ops = [torch.randn(8, generator=g) if s.op.operand == "col" else torch.randn(4, 8, generator=g)
               for s in spec.steps if s.op.operand in ("col", "matrix")]
        problem = Problem.of(a, b, ops, spec)
        marked = {}
        for cand in default_candidates(problem, inductor=False):
            if cand.applies(problem) is not None or cand.name.startswith("cutedsl") or cand.name.startswith("cutlass"):
                continue
            impl = cand.build(problem)
            marked[cand.name] = not needs_out(impl)
            if not needs_out(impl):
                torch.testing.assert_close(impl(a, b, ops, None), reference_fused_gemm(a, b, ops, spec))
        assert marked.get(cands_mod.UNFUSED) is True, (text, marked)
        assert marked.get("cublas:addmm", False) is False, (text, marked)
        if text.startswith("w=kn;bias@0;relu"):
            assert marked["cublas:addmm+aten"] is True, marked
    inductor = cands_mod._inductor_build(problem, "default")  # built, not compiled until called
    assert not needs_out(inductor)
