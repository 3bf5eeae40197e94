"""Fixtures shared by the lowering tests."""

from __future__ import annotations

import warnings
from typing import Iterator

import pytest

from branchyard.lowering.nvgemm import NvGemmFallbackWarning
from branchyard.lowering.nvgemm import op as op_mod
from branchyard.lowering.nvgemm import tuner as tuner_mod
from branchyard.lowering.nvgemm.candidates import Candidate
from branchyard.lowering.nvgemm.epilogue import reference_fused_gemm
from branchyard.lowering.nvgemm.tuner import Autotuner
from branchyard.lowering.nvgemm.winners import WinnerDB


@pytest.fixture
def probe_tuner(monkeypatch, tmp_path) -> Iterator[Autotuner]:
    """The op's tuner while the test runs: one candidate, which computes the
    reference of the call's spec into the op's output buffer, and every call
    eligible for it (on CPU too), so the op plans, keeps and runs a "fused"
    choice without a GPU. Fallback warnings are silenced."""
    monkeypatch.setattr(op_mod, "fused_kernel_ineligibility", lambda *args: None)

    def build(problem):
        nk = problem.spec.weight_layout == "nk"  # the impl gets [K, N]; the spec may say [N, K]

        def impl(a2d, b_kn, ops, out):
            out.copy_(reference_fused_gemm(a2d, b_kn.t() if nk else b_kn, list(ops), problem.spec))

        return impl

    t = Autotuner([Candidate("probe", build)], timer=lambda n, f: 1.0, db=WinnerDB(tmp_path),
                  env={"gpu": "t"}, progress=False)
    tuner_mod.set_autotuner(t)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NvGemmFallbackWarning)
        yield t
    tuner_mod.set_autotuner(None)
