"""branchyard.compile on CPU: stages, reports, shape checks, caches, the torch.compile backend, bad input.

CUDA-graph captures themselves are tested in tests/gpu/test_pipeline_gpu.py.
"""

import warnings

import pytest
import torch

import branchyard
from branchyard._compat import HAS_SWITCH
from branchyard.errors import BranchyardError, ShapeSpecError, SpecViolationError, UnsupportedGraphError
from branchyard.examples.decode_loop import DecodeLoop
from branchyard.fx.graph_walk import iter_graph_modules
from branchyard.shapes import ShapeVar, dynamic_spec


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return DecodeLoop(dim=16, hidden=32, num_experts=4).eval()


def _fn(model):
    batch = ShapeVar("batch", min=1, max=64)

    @dynamic_spec({"x": (batch, 16)})
    def decode(x, steps):
        return model(x, steps)

    return decode


def test_full_pipeline_matches_eager_for_every_trip_count(model):
    x = torch.randn(4, 16)
    fast = branchyard.compile(model, (x, torch.tensor(5)))
    names = [s.name for s in fast.report.stages]
    assert names == ["export", "cond_to_switch", "nvgemm", "cuda_graph"]
    if HAS_SWITCH:
        assert fast.report.stage("cond_to_switch").status == "ran"
        assert not any(n.target is torch.ops.higher_order.cond for n in _all_nodes(fast.program.graph_module))
        assert sum(n.target is torch.ops.higher_order.switch for n in _all_nodes(fast.program.graph_module)) == 1
    # 4 experts x (up+gelu, down+residual)
    assert len(fast.report.fused_chains) == 8
    for trips in (0, 1, 5, 40):
        steps, y = fast(x, torch.tensor(trips))
        ref_steps, ref_y = model(x, torch.tensor(trips))
        assert int(steps) == trips == int(ref_steps)
        torch.testing.assert_close(y, ref_y)


def _all_nodes(gm):
    from branchyard.fx.graph_walk import iter_graph_modules

    for g in iter_graph_modules(gm):
        yield from g.graph.nodes


def test_report_reads_out_every_stage(model):
    fast = branchyard.compile(model, (torch.randn(2, 16), torch.tensor(1)), passes=("nvgemm",))
    text = str(fast.report)
    assert "export" in text and "nvgemm" in text and "fused GEMM chains: 8" in text
    assert "cuda_graph" in text
    if not torch.cuda.is_available():
        assert fast.report.stage("cuda_graph").status == "skipped"
        assert "no CUDA device" in fast.report.stage("cuda_graph").detail


@pytest.mark.skipif(HAS_SWITCH, reason="torch has switch")
def test_cond_to_switch_is_skipped_with_its_reason_without_switch(model):
    fast = branchyard.compile(model, (torch.randn(2, 16), torch.tensor(1)))
    assert fast.report.stage("cond_to_switch").status == "skipped"
    assert "no torch.ops.higher_order.switch" in fast.report.stage("cond_to_switch").detail


def test_spec_violation_names_the_shapevar_before_anything_runs(model):
    fast = branchyard.compile(_fn(model), (torch.randn(4, 16), torch.tensor(2)))
    y = fast(torch.randn(7, 16), torch.tensor(2))[1]
    assert y.shape == (7, 16)
    with pytest.raises(SpecViolationError, match="ShapeVar 'batch'.*1 <= batch <= 64"):
        fast(torch.randn(65, 16), torch.tensor(2))
    with pytest.raises(SpecViolationError, match="dim 1"):
        fast(torch.randn(4, 17), torch.tensor(2))


def test_static_program_rejects_other_shapes_naming_the_input(model):
    fast = branchyard.compile(model, (torch.randn(4, 16), torch.tensor(2)), passes=())
    with pytest.raises(SpecViolationError, match=r"input 'x'.*dim 0 has size 5.*static dim"):
        fast(torch.randn(5, 16), torch.tensor(2))


def test_exported_program_input_keeps_its_spec(model):
    import branchyard.shapes as shapes

    ep = shapes.export(_fn(model), (torch.randn(4, 16), torch.tensor(2)))
    fast = branchyard.compile(ep, (torch.randn(4, 16), torch.tensor(2)), passes=("nvgemm",))
    assert fast.report.stage("export").detail == "given"
    with pytest.raises(SpecViolationError, match="ShapeVar 'batch'"):
        fast(torch.randn(65, 16), torch.tensor(2))


def test_inductor_regions_leave_the_given_program_as_it_was(model):
    ep = torch.export.export(model, (torch.randn(4, 16), torch.tensor(2)))

    def calls(gm):
        return sorted(f"{n.op}:{n.target}" for g in iter_graph_modules(gm) for n in g.graph.nodes
                      if n.op in ("call_function", "call_module"))

    before = calls(ep.graph_module)
    fast = branchyard.compile(ep, (torch.randn(4, 16), torch.tensor(2)), passes=(), inductor=True)
    assert fast.inductor_regions >= 1
    assert any(op.startswith("call_module:inductor_region_") for op in calls(fast._gm))
    assert calls(ep.graph_module) == before and calls(fast.program.graph_module) == before
    x, steps = torch.randn(4, 16), torch.tensor(3)
    torch.testing.assert_close(ep.module()(x, steps), model(x, steps))
    torch.testing.assert_close(fast(x, steps), model(x, steps))


def test_capture_cache_is_bounded_and_counts_hits(model, monkeypatch):
    from branchyard import compiler

    made = []

    class FakeLowered:
        lowered, fallback_reason, conditional_nodes = True, None, {"WHILE": 1, "SWITCH": 1}

        def __init__(self, gm, flat, **options):
            made.append((tuple(flat[0].shape), options["pool"]))
            self.gm = gm

        def __call__(self, *flat):
            return self.gm(*flat)

    import branchyard.lowering.cuda_graph.capture as capture

    monkeypatch.setattr(capture, "CudaGraphModule", FakeLowered)
    monkeypatch.setattr(compiler, "_cuda_available", lambda: True)
    monkeypatch.setattr(compiler, "_new_pool", lambda: ("pool",))
    fast = branchyard.compile(_fn(model), (torch.randn(4, 16), torch.tensor(2)), max_captures=2, capture_sizes=[1, 2])
    assert [m[0] for m in made] == [(4, 16), (1, 16), (2, 16)]
    assert {m[1] for m in made} == {("pool",)}  # one shared pool
    assert len(fast.captures) == 2 and fast.report.cache_evictions == 1
    fast(torch.randn(2, 16), torch.tensor(1))
    fast(torch.randn(2, 16), torch.tensor(3))
    assert fast.report.cache_hits == 2 and len(made) == 3
    fast(torch.randn(3, 16), torch.tensor(1))
    assert len(made) == 4 and fast.report.cache_evictions == 2
    assert "cache hits 2, evictions 2" in str(fast.report)
    assert "WHILE 1, SWITCH 1" in str(fast.report)


def test_capture_sizes_need_a_spec(model, monkeypatch):
    from branchyard import compiler

    monkeypatch.setattr(compiler, "_cuda_available", lambda: True)
    import branchyard.lowering.cuda_graph.capture as capture

    class FakeLowered:
        lowered, fallback_reason, conditional_nodes = True, None, {}

        def __init__(self, gm, flat, **options):
            pass

    monkeypatch.setattr(capture, "CudaGraphModule", FakeLowered)
    monkeypatch.setattr(compiler, "_new_pool", lambda: None)
    with pytest.raises(ShapeSpecError, match="capture_sizes needs a dynamic_spec"):
        branchyard.compile(model, (torch.randn(4, 16), torch.tensor(2)), passes=(), capture_sizes=[1, 2])
    with pytest.raises(SpecViolationError, match="ShapeVar 'batch'"):
        branchyard.compile(_fn(model), (torch.randn(4, 16), torch.tensor(2)), passes=(), capture_sizes=[100])


def test_torch_compile_backend_by_name(model):
    x = torch.randn(3, 16)
    compiled = torch.compile(model, backend="branchyard", fullgraph=True)
    torch.testing.assert_close(compiled(x, torch.tensor(4))[1], model(x, torch.tensor(4))[1])
    torch.testing.assert_close(compiled(x, torch.tensor(0))[1], x)


def test_unknown_pass_and_bad_arguments_are_our_errors(model):
    args = (torch.randn(2, 16), torch.tensor(1))
    with pytest.raises(BranchyardError, match="unknown pass 'fuse_everything'"):
        branchyard.compile(model, args, passes=("fuse_everything",))
    with pytest.raises(BranchyardError, match="max_captures must be a positive int"):
        branchyard.compile(model, args, max_captures=0)
    with pytest.raises(BranchyardError, match="expected an nn.Module, a function or an ExportedProgram"):
        branchyard.compile(42, args)


def test_a_failing_pass_is_skipped_and_reported(model, monkeypatch):
    from branchyard.lowering.nvgemm.fuse import NvGemmPass

    def boom(self, gm):
        raise RuntimeError("pass bug")

    monkeypatch.setattr(NvGemmPass, "run", boom)
    x = torch.randn(2, 16)
    fast = branchyard.compile(model, (x, torch.tensor(3)), passes=("nvgemm",))
    assert fast.report.stage("nvgemm").status == "failed"
    assert any("pass nvgemm skipped: RuntimeError: pass bug" in f for f in fast.report.fallbacks)
    torch.testing.assert_close(fast(x, torch.tensor(3))[1], model(x, torch.tensor(3))[1])


class _GrowingCarry(torch.nn.Module):
    def forward(self, x, n):
        return torch._higher_order_ops.while_loop(
            lambda i, y: i < n, lambda i, y: (i + 1, torch.cat([y, y])), (torch.zeros((), dtype=torch.int64), x)
        )


class _HostRead(torch.nn.Module):
    def forward(self, x, n):
        return torch._higher_order_ops.while_loop(
            lambda i, y: i < n, lambda i, y: (i + 1, y * y.sum().item()), (torch.zeros((), dtype=torch.int64), x)
        )


class _DataDependentBranch(torch.nn.Module):
    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda t: t[t > 0].sum().reshape(1), lambda t: t[:1], (x,))


@pytest.mark.parametrize(
    "module, args, where",
    [
        (_GrowingCarry(), (torch.ones(2), torch.tensor(3)), "_GrowingCarry"),
        (_HostRead(), (torch.ones(2), torch.tensor(3)), "_HostRead"),
    ],
)
def test_bad_programs_are_clear_errors_at_compile_time(module, args, where):
    with pytest.raises(BranchyardError) as info:
        branchyard.compile(module, args)
    assert where in str(info.value) or "node" in str(info.value)


def test_data_dependent_branch_output_is_refused_or_right():
    x = torch.tensor([1.0, -2.0, 3.0])
    try:
        fast = branchyard.compile(_DataDependentBranch(), (x,))
    except BranchyardError as err:
        assert "export" in str(err) or "node" in str(err)
        return
    torch.testing.assert_close(fast(x), _DataDependentBranch()(x))


def test_torch_compile_backend_with_sizes_dynamo_passes_as_ints(model):
    # dynamic=True: Dynamo's graph takes the batch size as an int input besides the tensors
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="branchyard", dynamic=True)
    for batch in (3, 5):
        x = torch.randn(batch, 16)
        torch.testing.assert_close(compiled(x, torch.tensor(2))[1], model(x, torch.tensor(2))[1])
    torch._dynamo.reset()


def test_capture_sizes_leave_the_callers_example_containers_as_they_were(monkeypatch):
    # a dict (a KV cache, say) and a tuple argument: their tensors are resized in copies
    from branchyard import compiler
    import branchyard.lowering.cuda_graph.capture as capture

    made = []

    class FakeLowered:
        lowered, fallback_reason, conditional_nodes = True, None, {}

        def __init__(self, gm, flat, **options):
            made.append([tuple(t.shape) for t in flat])

    monkeypatch.setattr(capture, "CudaGraphModule", FakeLowered)
    monkeypatch.setattr(compiler, "_cuda_available", lambda: True)
    monkeypatch.setattr(compiler, "_new_pool", lambda: None)
    batch = ShapeVar("batch", min=1, max=64)

    @dynamic_spec({"cache": {"k": (batch, 8)}})
    def f(cache):
        return cache["k"] * 2

    k = torch.randn(4, 8)
    cache = {"k": k}
    branchyard.compile(f, (cache,), passes=(), capture_sizes=[1, 3])
    assert cache["k"] is k
    assert made == [[(4, 8)], [(1, 8)], [(3, 8)]]

    @dynamic_spec({"pair": ((batch,), (batch, 2))})
    def g(pair):
        return pair[0] + pair[1].sum(1)

    a, b = torch.randn(4), torch.randn(4, 2)
    pair = (a, b)
    made.clear()
    fast = branchyard.compile(g, (pair,), passes=(), capture_sizes=[2])
    assert pair[0] is a and pair[1] is b
    assert made == [[(4,), (4, 2)], [(2,), (2, 2)]] and len(fast.captures) == 2


def test_compile_leaves_a_models_step_counter_as_it_was():
    # the compile-time check of the program runs on fake tensors: the model's buffers keep their values
    class Counting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

        def forward(self, x):
            self.calls.add_(1)
            return torch.cond(x.sum() > 0, lambda t: t * 2, lambda t: -t, (x,))

    model = Counting()
    fast = branchyard.compile(model, (torch.ones(3),), passes=())
    assert int(model.calls) == 0
    torch.testing.assert_close(fast(torch.ones(3)), torch.full((3,), 2.0))
    fast(torch.ones(3))
    assert int(model.calls) == 2


def test_a_python_int_the_program_specialised_on_is_checked_on_every_call():
    # torch.export makes a Python int argument a constant; another value is a SpecViolationError
    # naming it, not torch's bare "Guard failed" assert
    class Scale(torch.nn.Module):
        def forward(self, x, n: int, flag: bool):
            return torch.cond(x.sum() > 0, lambda t: t * n, lambda t: -t, (x,))

    fast = branchyard.compile(Scale(), (torch.ones(3), 2, True), passes=())
    torch.testing.assert_close(fast(torch.ones(3), 2, True), torch.full((3,), 2.0))
    with pytest.raises(SpecViolationError, match=r"input 'n'.*got 5; the program was exported with 2"):
        fast(torch.ones(3), 5, True)
    with pytest.raises(SpecViolationError, match=r"input 'n'.*got 2.0"):
        fast(torch.ones(3), 2.0, True)
    with pytest.raises(SpecViolationError, match=r"input 'flag'.*a Python bool argument is a constant"):
        fast(torch.ones(3), 2, False)


class _NoCheckDecode(DecodeLoop):
    """DecodeLoop without the torch._check that ties the cond's output size to the carry's."""

    def step(self, x):
        idx = torch.argmax(x.mean(0) @ self.router)
        y = self._dispatch(0, idx, x)
        return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)


class _GrowingCarry(torch.nn.Module):
    def forward(self, x, steps):
        from torch._higher_order_ops.while_loop import while_loop

        return while_loop(lambda i, y: i < steps, lambda i, y: (i + 1, torch.cat([y, y])), (torch.zeros((), dtype=torch.int64), x))


@pytest.mark.skipif(not HAS_SWITCH, reason="torch 2.11's cond cannot trace an operand of unbacked size at all")
def test_a_carry_given_a_fresh_unbacked_size_by_a_cond_says_how_to_tie_it():
    torch.manual_seed(0)
    decode = _fn(_NoCheckDecode(dim=16, hidden=32, num_experts=3).eval())
    with pytest.raises(UnsupportedGraphError) as info:
        branchyard.compile(decode, (torch.randn(4, 16), torch.tensor(2)), cuda_graph=False)
    text = str(info.value)
    # torch's own line saying which carry and which sizes, then the way out
    assert "pair[1] differ in 'shape: torch.Size([u" in text
    assert "new unbacked size" in text and "torch._check(y.shape[0] == x.shape[0])" in text


def test_a_carry_that_really_changes_shape_gets_the_general_hint():
    with pytest.raises(UnsupportedGraphError) as info:
        branchyard.compile(_GrowingCarry(), (torch.randn(2, 4), torch.tensor(2)), cuda_graph=False)
    text = str(info.value)
    assert "loop carries must keep their shapes and dtypes" in text
    assert "torch._check" not in text and "the full torch error is chained below" in text
