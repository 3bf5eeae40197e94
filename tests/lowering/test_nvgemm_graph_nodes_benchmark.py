"""benchmarks/nvgemm_graph_nodes.py's program building, on CPU: every fusable
chain of a block becomes one fused op with the asked-for candidate pinned in
its spec, and the pinned program still computes the block. The capture and
the node walk need a GPU (the lead's run)."""

from __future__ import annotations

import warnings

import pytest
import torch


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("nvgemm_graph_nodes")


@pytest.mark.parametrize("block", ["gpt2_mlp", "gpt2_attn_proj", "llama3_8b_mlp"])
def test_every_fused_op_gets_the_pin_and_the_block_still_computes(bench, block):
    spec = bench.blocks(tiny=True)[block]
    torch.manual_seed(0)
    module = spec.make().eval()
    inputs = (torch.randn(4, spec.d), torch.randn(4, spec.d)) if spec.two_inputs else (torch.randn(4, spec.d),)
    with torch.no_grad():
        ep = torch.export.export(module, inputs)
        fused = bench.fused_without_race(ep)
        pinned = bench.pin_every_op(fused, "cublas:addmm+aten")
        packet = torch.ops.branchyard.fused_gemm_epilogue
        specs = [n.args[3] for n in fused.graph.nodes if n.op == "call_function" and n.target is packet.default]
        assert pinned == len(specs) == {"gpt2_mlp": 2, "gpt2_attn_proj": 1, "llama3_8b_mlp": 2}[block]
        assert all(s.endswith(";impl=cublas:addmm+aten") and s.count("impl=") == 1 for s in specs), specs
        with warnings.catch_warnings():  # on CPU the op runs the unfused path and says so once
            warnings.simplefilter("ignore")
            got = fused.module()(*inputs)
        want = module(*inputs)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(g, w)


def test_pinning_twice_replaces_the_pin(bench):
    spec = bench.blocks(tiny=True)["gpt2_mlp"]
    ep = torch.export.export(spec.make().eval(), (torch.randn(2, spec.d),))
    fused = bench.fused_without_race(ep)
    bench.pin_every_op(fused, "cublas:addmm+aten")
    bench.pin_every_op(fused, "aten:unfused")
    specs = [n.args[3] for n in fused.graph.nodes if n.op == "call_function" and "fused_gemm" in str(n.target)]
    assert len(specs) == 2 and all(s.endswith(";impl=aten:unfused") and s.count("impl=") == 1 for s in specs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")
def test_without_cuda_it_says_so(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--m", "1"])
    assert "needs a CUDA device" in capsys.readouterr().err
