"""fuse_regions: which ATen ops become Inductor regions, and that the program still computes the same."""

import warnings

import torch

import branchyard
from branchyard.examples.decode_loop import DecodeLoop
from branchyard.lowering.cuda_graph.inductor_regions import InductorRegion, fuse_regions
from branchyard.fx.graph_walk import iter_graph_modules


def _regions(gm):
    return [m for g in iter_graph_modules(gm) for m in g.children() if isinstance(m, InductorRegion)]


def test_rms_norm_and_router_become_regions_and_control_flow_stays():
    torch.manual_seed(0)
    model = DecodeLoop(dim=16, hidden=32, num_experts=3).eval()
    args = (torch.randn(4, 16), torch.tensor(3))
    gm = torch.export.export(model, args).module()
    before = {id(g): sum(n.op == "call_function" for n in g.graph.nodes) for g in iter_graph_modules(gm)}
    made = fuse_regions(gm)
    regions = _regions(gm)
    # the router (mean, mm), the RMS-norm, and each of the 3 experts' addmm/gelu/addmm/add
    assert made == len(regions) == 5
    for region in regions:
        ops = [n for n in region.ops.graph.nodes if n.op == "call_function"]
        assert len(ops) >= 2
        for n in ops:  # no control flow, no custom op, no scalar counter/predicate arithmetic inside a region
            assert isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "aten"
            val = n.meta.get("val")
            if isinstance(val, torch.Tensor) and val.dim() == 0 and not val.dtype.is_floating_point:
                assert n.target is torch.ops.aten.argmax.default
    hops = [n for g in iter_graph_modules(gm) for n in g.graph.nodes if isinstance(n.target, torch._ops.HigherOrderOperator)]
    assert {n.target for n in hops} == {torch.ops.higher_order.while_loop, torch.ops.higher_order.cond}
    after = {id(g): sum(n.op == "call_function" for n in g.graph.nodes) for g in iter_graph_modules(gm)}
    assert sum(after.values()) < sum(before.values())
    for trips in (0, 1, 4):
        torch.testing.assert_close(gm(args[0], torch.tensor(trips))[1], model(args[0], torch.tensor(trips))[1])


def test_compile_reports_the_regions_and_keeps_outputs():
    # after nvgemm fused the experts' GEMM chains, the router (mean, matmul: left to the switch's
    # router set kernel) and the RMS-norm (the one region) are left
    torch.manual_seed(1)
    model = DecodeLoop(dim=16, hidden=32, num_experts=3).eval()
    x = torch.randn(2, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = branchyard.compile(model, (x, torch.tensor(2)), inductor=True)
    stage = fast.report.stage("inductor")
    assert stage.status == "ran" and stage.detail.startswith("1 region(s)")
    torch.testing.assert_close(fast(x, torch.tensor(6))[1], model(x, torch.tensor(6))[1])


def test_a_program_without_fusable_runs_is_unchanged():
    gm = torch.export.export(torch.nn.Linear(4, 4), (torch.randn(2, 4),)).module()
    assert fuse_regions(gm) == 0


def test_a_region_inductor_cannot_compile_runs_its_ops(monkeypatch, caplog):
    gm = torch.fx.symbolic_trace(lambda x: torch.relu(x) * 2)
    region = InductorRegion(gm)
    x = torch.randn(4)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    def broken(*args, **kwargs):
        def run(*a):
            raise RuntimeError("inductor failed")

        return run

    monkeypatch.setattr(torch, "compile", broken)
    with caplog.at_level("WARNING", logger="branchyard"):
        torch.testing.assert_close(region(x), torch.relu(x) * 2)
        torch.testing.assert_close(region(x), torch.relu(x) * 2)
    assert sum("runs its ATen ops instead" in r.message for r in caplog.records) == 1
