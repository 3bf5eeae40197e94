"""Fixtures shared by the lowering tests."""

from __future__ import annotations

import warnings
from typing import Callable, Iterator

import pytest

from branchyard.lowering.nvgemm import NvGemmFallbackWarning
from branchyard.lowering.nvgemm import op as op_mod
from branchyard.lowering.nvgemm import tuner as tuner_mod
from branchyard.lowering.nvgemm.candidates import Candidate
from branchyard.lowering.nvgemm.epilogue import reference_fused_gemm
from branchyard.lowering.nvgemm.problem import own_output
from branchyard.lowering.nvgemm.tuner import Autotuner
from branchyard.lowering.nvgemm.winners import WinnerDB


def _probe_build(own: bool):
    """The probe candidate's build: the reference of the call's spec, written into
    the op's output buffer, or (``own``) returned as a tensor of its own."""

    def build(problem):
        nk = problem.spec.weight_layout == "nk"  # the impl gets [K, N]; the spec may say [N, K]

        def reference(a2d, b_kn, ops):
            return reference_fused_gemm(a2d, b_kn.t() if nk else b_kn, list(ops), problem.spec)

        if own:
            return own_output(lambda a2d, b_kn, ops, out: reference(a2d, b_kn, ops))

        def impl(a2d, b_kn, ops, out):
            out.copy_(reference(a2d, b_kn, ops))

        return impl

    return build


@pytest.fixture
def probe_tuner_of(monkeypatch, tmp_path) -> Iterator[Callable[..., Autotuner]]:
    """``make(own=False, build=None, eligible=True)``: the op's tuner while the test
    runs, one candidate that computes the reference of the call's spec (into the op's
    output buffer, or with ``own`` as an :func:`~branchyard.lowering.nvgemm.problem.own_output`
    impl) or, given ``build``, the candidate ``build(problem)`` makes; with ``eligible``
    every call is eligible for it (on CPU too), so the op plans, keeps and runs a
    "fused" choice without a GPU. Fallback warnings are silenced."""

    def make(own: bool = False, build: Callable | None = None, eligible: bool = True) -> Autotuner:
        if eligible:
            monkeypatch.setattr(op_mod, "fused_kernel_ineligibility", lambda *args: None)
        kind = "built" if build is not None else "own" if own else "writes"
        t = Autotuner([Candidate("probe", build or _probe_build(own))], timer=lambda n, f: 1.0,
                      db=WinnerDB(tmp_path / kind), env={"gpu": "t"}, progress=False)
        tuner_mod.set_autotuner(t)
        return t

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NvGemmFallbackWarning)
        yield make
    tuner_mod.set_autotuner(None)


@pytest.fixture
def probe_tuner(probe_tuner_of) -> Autotuner:
    """The tuner of :func:`probe_tuner_of` whose candidate writes the op's output buffer."""
    return probe_tuner_of()
