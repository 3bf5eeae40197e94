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


def _with_meta(build, *buffers):
    """A GraphModule from ``build(g, x, *get_attrs)`` on a (4,) input, its nodes' fake values filled in."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    root = torch.nn.Module()
    for name, value in buffers:
        root.register_buffer(name, value.clone())
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output(build(g, x, *(g.get_attr(name) for name, _ in buffers)))
    gm = torch.fx.GraphModule(root, g)
    FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(torch.ones(4))
    for name, value in buffers:  # the propagation ran the in-place ops on them
        gm.register_buffer(name, value.clone())
    return gm


def _region_ops(gm):
    return [sorted(str(n.target) for n in r.ops.graph.nodes if n.op == "call_function") for r in _regions(gm)]


def test_a_region_does_not_move_a_read_past_a_write_between_its_ops():
    """``mul(x, counter)``, ``counter.add_(1)`` (a 0-d integer op: never in a region), then more
    fusable ops: one region of all of them would read ``counter`` after the increment."""
    aten = torch.ops.aten

    def build(g, x, counter):
        a = g.call_function(aten.mul.Tensor, (x, counter))
        g.call_function(aten.add_.Tensor, (counter, 1))
        d = g.call_function(aten.mul.Tensor, (x, counter))
        return (g.call_function(aten.add.Tensor, (g.call_function(aten.sin.default, (a,)), d)),)

    counter = ("counter", torch.tensor(3, dtype=torch.int64))
    x = torch.linspace(-1, 1, 4)
    (want,) = _with_meta(build, counter)(x)  # sin(3x) + 4x
    gm = _with_meta(build, counter)
    made = fuse_regions(gm)
    (got,) = gm(x)
    torch.testing.assert_close(got, want)
    assert made == 1 and _region_ops(gm) == [["aten.add.Tensor", "aten.mul.Tensor", "aten.sin.default"]]  # after add_
    assert int(gm.counter) == 4


def test_a_write_in_a_region_does_not_move_past_a_read_outside_it():
    """``buf.add_(1)`` may join a region, but not one that would run it after ``torch.sum(buf)``
    (a torch-level call: never in a region), which read ``buf`` after the write in eager."""
    aten = torch.ops.aten

    def build(g, x, buf):
        a = g.call_function(aten.mul.Tensor, (x, 2))
        g.call_function(aten.add_.Tensor, (buf, 1.0))
        read = g.call_function(torch.sum, (buf,))
        b = g.call_function(aten.cos.default, (g.call_function(aten.sin.default, (a,)),))
        return (b, read)

    buf = ("buf", torch.zeros(4))
    x = torch.linspace(-1, 1, 4)
    want = _with_meta(build, buf)(x)
    gm = _with_meta(build, buf)
    made = fuse_regions(gm)
    got = gm(x)
    torch.testing.assert_close(got, want)
    assert made == 2
    assert _region_ops(gm) == [["aten.add_.Tensor", "aten.mul.Tensor"], ["aten.cos.default", "aten.sin.default"]]
    assert float(got[1]) == 4.0  # the sum read buf after the write, as in eager


def test_a_train_mode_batch_norm_cuts_a_region_that_reads_its_statistics():
    """A batch norm in train mode writes its running mean though its schema marks nothing:
    a region holding a read of the mean before it and ops after it would read the new mean."""
    aten = torch.ops.aten

    def build(g, x, rm, rv, data):
        seen = g.call_function(aten.mul.Tensor, (rm, x))  # reads the running mean
        bn = g.call_function(torch.nn.functional.batch_norm, (data, rm, rv), {"training": True})
        after = g.call_function(aten.mul.Tensor, (g.call_function(aten.sin.default, (seen,)), 2.0))
        return (g.call_function(aten.add.Tensor, (after, x)), bn)

    stats = [("rm", torch.zeros(4)), ("rv", torch.ones(4)), ("data", torch.full((8, 4), 50.0))]
    x = torch.linspace(-1, 1, 4)
    want = _with_meta(build, *stats)(x)  # 2 sin(0 * x) + x
    gm = _with_meta(build, *stats)
    fuse_regions(gm)
    got = gm(x)
    torch.testing.assert_close(got, want)
    assert _region_ops(gm) == [["aten.add.Tensor", "aten.mul.Tensor", "aten.sin.default"]]  # after the batch norm
    torch.testing.assert_close(gm.rm, torch.full((4,), 5.0))


def test_a_view_read_outside_a_region_that_writes_is_not_moved_past_the_write():
    """``rm[-1] > 0.5`` before a train-mode batch norm of an exported model: the ``select`` (a view
    of ``rm``) may join the batch norm's region only if the comparison, outside it, is not moved
    after the region's update of ``rm`` -- eager compares 0 first, then 5 on the next call."""
    import copy

    from running_stats_models import GatedByRunningMean

    data = torch.zeros(8, 3)
    data[:, -1] = 50.0
    model = GatedByRunningMean()
    reference = copy.deepcopy(model)
    gm = torch.export.export(model, (data, torch.ones(4))).module()
    fuse_regions(gm)
    for _ in range(3):  # the false branch, then the true one as the running mean passes 0.5
        x = torch.randn(4)
        torch.testing.assert_close(gm(data, x), reference(data, x))
    torch.testing.assert_close(gm.rm, reference.rm)
