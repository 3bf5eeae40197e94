"""Sibling GEMMs merged on CUDA (``nvgemm.siblings``): attention's q, k, v
projections through ``nvgemm`` called eagerly and replayed from a CUDA graph
compute what the block computes, the merge is raced against the program as it
was, and the result is not slower than that program. The CPU tests are
tests/lowering/test_nvgemm_siblings.py.

Skipped without CUDA (tests/gpu/conftest.py)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from branchyard.lowering.nvgemm import merge_sibling_gemms, nvgemm
from branchyard.lowering.nvgemm import tuner as nv_tuner
from branchyard.lowering.nvgemm import winners as nv_winners
from branchyard.lowering.nvgemm.program_race import capture_replay
from branchyard.lowering.nvgemm.timing import timing_mode
from nvgemm_gpu_support import replay_ratio, skip_timing_if_shared

aten = torch.ops.aten
#: How much slower than the unrewritten program the result may measure (timing noise).
TOLERANCE = 1.05


class QKV(nn.Module):
    def __init__(self, d: int = 1024, kv: int = 256):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(d, n, bias=False) for n in (d, kv, kv))
        self.o = nn.Linear(d, d, bias=False)

    def forward(self, x, h):
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1), x + self.o(h)


@pytest.fixture
def fresh_tuner(tmp_path):
    nv_tuner.set_autotuner(nv_tuner.Autotuner(db=nv_winners.WinnerDB(tmp_path), progress=False))
    yield
    nv_tuner.set_autotuner(None)


def _cats(program) -> int:
    return sum(n.target is aten.cat.default for n in program.graph.nodes)


def test_the_merged_weight_lives_where_the_weights_did():
    block = QKV().cuda().to(torch.bfloat16).eval()
    x = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16)
    merged = merge_sibling_gemms(torch.export.export(block, (x, x))).program
    (weight,) = [t for t in merged.constants.values() if isinstance(t, torch.Tensor)]
    assert weight.shape == (1536, 1024) and weight.is_cuda and weight.dtype == torch.bfloat16
    assert merged.state_dict["k.weight"].data_ptr() == weight[1024:].data_ptr()
    with torch.no_grad():
        torch.testing.assert_close(merged.module()(x, x), block(x, x), rtol=2e-2, atol=2e-2)


@pytest.mark.timing
@pytest.mark.parametrize("calling", ["eager", "graph"])
@pytest.mark.parametrize("m", [1, 64])
def test_nvgemm_races_the_merge_and_matches_the_block(fresh_tuner, caplog, calling, m):
    torch.manual_seed(0)
    block = QKV().cuda().to(torch.bfloat16).eval()
    x, h = (torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    with torch.no_grad():
        want = block(x, h)
        ep = torch.export.export(block, (x, h))
        with caplog.at_level(logging.INFO, logger="branchyard"):
            out = nvgemm(ep, calling=calling)
        said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("nvgemm: merged 3 GEMMs")]
        assert len(said) == 1 and (": kept (" in said[0] or ": not kept (" in said[0]), said
        assert _cats(out) == (0 if ": kept (" in said[0] else 1)
        if calling == "eager":
            for got, ref in zip(out.module()(x, h), want):
                torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
            return
        with timing_mode("device"):
            replays = {"unrewritten": capture_replay(ep.module(), (x, h)),
                       "rewritten": capture_replay(out.module(), (x, h))}
        for name, replay in replays.items():
            for got, ref in zip(replay(), want):
                torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2, msg=name)
        ratio, windows = replay_ratio(replays["unrewritten"], replays["rewritten"])
    print(f"M={m}: rewritten / unrewritten {ratio:.3f} {windows} | {said[0]}")
    skip_timing_if_shared("device timing")
    assert ratio <= TOLERANCE, (ratio, windows, said)
