"""Sibling GEMMs merged into one (``nvgemm.siblings``): graph structure,
outputs against the unmerged program, the reasons a run does not form, the
merged weight's aliasing, and the race that guards the merge in ``nvgemm``."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from torch import nn
from torch.export.graph_signature import InputKind

from branchyard.errors import LoweringError
from branchyard.lowering.nvgemm import MergeSiblingGemms, merge_sibling_gemms, nvgemm
from branchyard.lowering.nvgemm.program_race import ProgramRace

aten = torch.ops.aten


class QKV(nn.Module):
    """``cat([q(x), k(x), v(x)], -1)`` and ``x + o(h)``: attention's projections."""

    def __init__(self, d: int = 16, kv: int = 8, bias: bool = True):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(d, n, bias=bias) for n in (d, kv, kv))
        self.o = nn.Linear(d, d, bias=bias)

    def forward(self, x, h):
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1), x + self.o(h)


def _count(program, target) -> int:
    return sum(n.op == "call_function" and n.target is target for n in program.graph.nodes)


def _close(got, want) -> None:
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(5,), (2, 3)])
def test_qkv_becomes_one_linear_with_the_same_outputs(bias, lead):
    m = QKV(bias=bias).eval()
    args = (torch.randn(*lead, 16), torch.randn(*lead, 16))
    ep = torch.export.export(m, args)
    merged = merge_sibling_gemms(ep)
    assert merged.changed and merged.groups == ["3 GEMMs of x (linear, linear_1, linear_2) as one: 16 x 32"]
    assert _count(ep, aten.linear.default) == 4 and _count(ep, aten.cat.default) == 1
    assert _count(merged.program, aten.linear.default) == 2 and _count(merged.program, aten.cat.default) == 0
    constants = [s for s in merged.program.graph_signature.input_specs if s.kind == InputKind.CONSTANT_TENSOR]
    assert len(constants) == (2 if bias else 1)
    assert merged.program.constants[constants[0].target].shape == (32, 16)
    with torch.no_grad():
        _close(merged.program.module()(*args), m(*args))
    # the input program is untouched
    assert _count(ep, aten.cat.default) == 1 and not any(
        s.kind == InputKind.CONSTANT_TENSOR for s in ep.graph_signature.input_specs)


def test_the_programs_own_weights_become_views_of_the_merged_weight():
    m = QKV().eval()
    args = (torch.randn(4, 16), torch.randn(4, 16))
    ep = torch.export.export(m, args)
    fast = merge_sibling_gemms(ep).program.module()
    with torch.no_grad():
        fast.k.weight.fill_(0.25)
        fast.v.bias.zero_()
        m.k.weight.fill_(0.25)
        m.v.bias.zero_()
        _close(fast(*args), m(*args))
    assert isinstance(fast.k.weight, nn.Parameter)
    # the original program keeps the module's weights; the rewritten one has its own
    assert ep.state_dict["k.weight"].data_ptr() == m.k.weight.data_ptr() != fast.k.weight.data_ptr()


def test_a_run_is_the_consecutive_siblings_only():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(8, 4), nn.Linear(8, 6), nn.Linear(8, 2)
            self.other = nn.Linear(3, 5)

        def forward(self, x, y):
            return torch.cat([self.a(x), self.b(x), self.other(y), self.c(x)], dim=-1)

    m = Mixed()
    args = (torch.randn(2, 8), torch.randn(2, 3))
    ep = torch.export.export(m, args)
    merged = merge_sibling_gemms(ep)
    assert merged.groups == ["2 GEMMs of x (linear, linear_1) as one: 8 x 10"]
    cat = next(n for n in merged.program.graph.nodes if n.target is aten.cat.default)
    assert len(cat.args[0]) == 3
    _close([merged.program.module()(*args)], [m(*args)])


class _Decline(nn.Module):
    def __init__(self, case: str):
        super().__init__()
        self.case = case
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 4, bias=case != "bias mix")
        self.k2 = nn.Linear(6, 4)

    def forward(self, x, z):
        if self.case == "used twice":
            q = self.q(x)
            return torch.cat([q, self.k(x)], dim=-1), q
        if self.case == "other input":
            return torch.cat([self.q(x), self.k(x + 1)], dim=-1)
        if self.case == "other K":
            return torch.cat([self.q(x), self.k2(z)], dim=-1)
        if self.case == "dim 0":
            return torch.cat([self.q(x), self.q(x) * 2], dim=0)
        return torch.cat([self.q(x), self.k(x)], dim=-1)


@pytest.mark.parametrize("case, reason", [
    ("used twice", "'linear' is used by more than the concatenation"),
    ("other input", None),
    ("other K", None),
    ("dim 0", None),
    ("bias mix", None),
])
def test_runs_that_do_not_form_leave_the_program_as_it_was(case, reason):
    m = _Decline(case)
    args = (torch.randn(2, 8), torch.randn(2, 6))
    ep = torch.export.export(m, args)
    merged = merge_sibling_gemms(ep)
    assert not merged.changed and merged.program is ep
    if reason is not None:
        assert any(reason in s.reason for s in merged.report.skips), merged.report


def _hand_graph(weights_as: str) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    """``cat([linear(x, w1, b1), linear(x, w2, b2)], -1)`` with the weights as ``get_attr``
    tensors of the module or as its inputs."""
    root = nn.Module()
    w1, w2, b1, b2 = torch.randn(4, 8), torch.randn(3, 8), torch.randn(4), torch.randn(3)
    g = torch.fx.Graph()
    x = g.placeholder("x")
    if weights_as == "attrs":
        for name, t in (("w1", w1), ("w2", w2), ("b1", b1), ("b2", b2)):
            root.register_parameter(name, nn.Parameter(t))
        nodes = [g.get_attr(n) for n in ("w1", "w2", "b1", "b2")]
        inputs = [torch.randn(2, 8)]
    else:
        nodes = [g.placeholder(n) for n in ("w1", "w2", "b1", "b2")]
        inputs = [torch.randn(2, 8), w1, w2, b1, b2]
    l1 = g.call_function(aten.linear.default, (x, nodes[0], nodes[2]))
    l2 = g.call_function(aten.linear.default, (x, nodes[1], nodes[3]))
    g.output(g.call_function(aten.cat.default, ([l1, l2], -1)))
    gm = torch.fx.GraphModule(root, g)
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(*inputs)
    return gm, inputs


def test_a_graph_module_merges_its_get_attr_weights():
    gm, inputs = _hand_graph("attrs")
    want = gm(*inputs)
    merged = merge_sibling_gemms(gm)
    assert merged.changed and _count(merged.program, aten.linear.default) == 1
    assert _count(merged.program, aten.cat.default) == 0
    torch.testing.assert_close(merged.program(*inputs), want)
    assert _count(gm, aten.cat.default) == 1  # the input is untouched
    # its own weights are views of the merged one
    with torch.no_grad():
        merged.program.w2.fill_(1.0)
    got = merged.program(*inputs)
    torch.testing.assert_close(got[:, 4:], inputs[0] @ torch.ones(3, 8).T + gm.b2)


def test_a_graph_module_with_weights_as_inputs_is_not_merged():
    gm, inputs = _hand_graph("inputs")
    merged = merge_sibling_gemms(gm)
    assert not merged.changed
    assert any("is not a constant of the program" in s.reason for s in merged.report.skips)


def test_the_pass_can_merge_selected_groups_only():
    gm, inputs = _hand_graph("attrs")
    p = MergeSiblingGemms(only=frozenset({"nothing"}))
    assert p.call(gm).modified is False


def test_merge_rejects_what_is_not_a_program():
    with pytest.raises(LoweringError, match="merge_sibling_gemms: expected a torch.export.ExportedProgram"):
        merge_sibling_gemms(nn.Linear(2, 2))  # type: ignore[arg-type]


@pytest.mark.parametrize("decompose", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_random_concatenations_of_linears_match_the_program(seed, decompose):
    rng = random.Random(seed)
    k = rng.choice([4, 8, 12])

    class Random(nn.Module):
        def __init__(self):
            super().__init__()
            self.kinds = [rng.choice(["x", "x", "x", "y", "free"]) for _ in range(rng.randint(2, 6))]
            bias = rng.random() < 0.5
            self.lins = nn.ModuleList(nn.Linear(k, rng.randint(1, 9), bias=bias) for _ in self.kinds)

        def forward(self, x, y):
            parts = [lin(x if kind == "x" else y) if kind != "free" else y[..., :3] * 2
                     for kind, lin in zip(self.kinds, self.lins)]
            return torch.cat(parts, dim=-1)

    m = Random()
    args = (torch.randn(*rng.choice([(3,), (2, 3)]), k), torch.randn(3, k))
    args = (args[0], torch.randn(*args[0].shape))
    ep = torch.export.export(m, args)
    if decompose:
        ep = ep.run_decompositions()
    merged = merge_sibling_gemms(ep)
    with torch.no_grad():
        torch.testing.assert_close(merged.program.module()(*args), m(*args), rtol=1e-5, atol=1e-5)
    runs, current = 0, None
    length = 0
    for kind in m.kinds + ["end"]:
        if kind == current and kind in ("x", "y"):
            length += 1
            continue
        runs += length >= 2
        current, length = kind, 1
    assert len(merged.groups) == runs
    gemms = (aten.linear.default, aten.addmm.default, aten.mm.default)
    assert sum(_count(merged.program, g) for g in gemms) == sum(_count(ep, g) for g in gemms) - sum(
        int(g.split()[0]) - 1 for g in merged.groups)


def test_nvgemm_merges_and_fuses_on_cpu():
    m = QKV().eval()
    args = (torch.randn(4, 16), torch.randn(4, 16))
    ep = torch.export.export(m, args)
    out = nvgemm(ep)
    assert _count(out, aten.cat.default) == 0 and _count(out, aten.linear.default) == 1
    assert _count(out, torch.ops.branchyard.fused_gemm_epilogue.default) == 1
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the op's CPU fallback note
        _close(out.module()(*args), m(*args))
    plain = nvgemm(ep, merge_siblings=False)
    assert _count(plain, aten.cat.default) == 1 and _count(plain, aten.linear.default) == 3


@pytest.mark.parametrize("merged_faster", [True, False])
def test_the_merge_is_kept_only_where_it_wins_the_race(merged_faster):
    m = QKV().eval()
    args = (torch.randn(4, 16), torch.randn(4, 16))
    ep = torch.export.export(m, args)
    seen = []

    def timer(variant) -> float:
        merged = any(g.startswith("merged ") for g in variant.fused)
        seen.append(merged)
        if merged:
            return 0.5 if merged_faster else 2.0
        return 1.0

    out = nvgemm(ep, race=ProgramRace(timer=timer, devices=("cpu",), blocks=3))
    assert any(seen)  # the merged program was timed
    assert (_count(out, aten.cat.default) == 0) is merged_faster
    # the o projection's chain ties in the fake race, so it stays unfused either way
    assert _count(out, aten.linear.default) == (2 if merged_faster else 4)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the op's CPU fallback note
        _close(out.module()(*args), m(*args))


def test_a_merged_program_saves_and_loads(tmp_path):
    m = QKV().eval()
    args = (torch.randn(4, 16), torch.randn(4, 16))
    merged = merge_sibling_gemms(torch.export.export(m, args)).program
    path = tmp_path / "merged.pt2"
    torch.export.save(merged, path)
    loaded = torch.export.load(path)
    with torch.no_grad():
        _close(loaded.module()(*args), m(*args))


def test_a_program_with_a_dynamic_batch_merges_and_stays_dynamic():
    m = QKV().eval()
    args = (torch.randn(4, 16), torch.randn(4, 16))
    batch = torch.export.Dim("batch", min=2, max=64)
    ep = torch.export.export(m, args, dynamic_shapes=({0: batch}, {0: batch}))
    merged = merge_sibling_gemms(ep).program
    assert _count(merged, aten.cat.default) == 0
    assert merged.range_constraints == ep.range_constraints
    for n in (2, 7, 64):
        x = (torch.randn(n, 16), torch.randn(n, 16))
        with torch.no_grad():
            _close(merged.module()(*x), m(*x))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(5,), (2, 3)])
@pytest.mark.parametrize("form", ["run_decompositions", "make_fx"])
def test_decomposed_linears_merge_too(form, bias, lead):
    """``[view ->] addmm(b, x, permute(w)) [-> view]`` (and ``mm``, ``t``): the forms
    ``run_decompositions`` and ``make_fx`` give a linear."""
    from torch.fx.experimental.proxy_tensor import make_fx

    m = QKV(bias=bias).eval()
    args = (torch.randn(*lead, 16), torch.randn(*lead, 16))
    if form == "make_fx":
        program = make_fx(m)(*args)
        run = program
    else:
        program = torch.export.export(m, args).run_decompositions()
        run = program.module()
    gemm = aten.addmm.default if bias else aten.mm.default
    assert _count(program, gemm) == 4
    merged = merge_sibling_gemms(program)
    assert len(merged.groups) == 1 and merged.groups[0].startswith("3 GEMMs of ")
    assert _count(merged.program, gemm) == 2 and _count(merged.program, aten.cat.default) == 0
    # no view or transpose of the merged parts is left behind: four linears' worth before, two after
    views = (aten.view.default, aten._unsafe_view.default, aten.t.default, aten.permute.default)
    before = sum(n.target in views for n in program.graph.nodes)
    assert sum(n.target in views for n in merged.program.graph.nodes) * 2 == before > 0
    fast = merged.program if form == "make_fx" else merged.program.module()
    with torch.no_grad():
        _close(fast(*args), run(*args))


def test_a_transposed_weight_used_elsewhere_keeps_its_gemm_apart():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k = nn.Linear(8, 8, bias=False), nn.Linear(8, 4, bias=False)

        def forward(self, x):
            wt = self.k.weight.t()
            return torch.cat([x @ self.q.weight.t(), x @ wt], dim=-1), wt * 2

    m = Tied()
    args = (torch.randn(3, 8),)
    ep = torch.export.export(m, args).run_decompositions()
    merged = merge_sibling_gemms(ep)
    assert not merged.changed
    assert any("has other users" in s.reason for s in merged.report.skips), merged.report


def test_a_weight_the_program_writes_is_not_a_constant():
    class Drifts(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k = nn.Linear(8, 8, bias=False), nn.Linear(8, 4, bias=False)
            self.register_buffer("wk", torch.randn(4, 8))

        def forward(self, x):
            out = torch.cat([self.q(x), torch.nn.functional.linear(x, self.wk)], dim=-1)
            self.wk.add_(1.0)  # the program updates its own weight
            return out

    m = Drifts()
    args = (torch.randn(3, 8),)
    ep = torch.export.export(m, args)
    merged = merge_sibling_gemms(ep)
    assert not merged.changed
    assert any("is not a constant of the program" in s.reason for s in merged.report.skips), merged.report


def test_nvgemm_goes_on_without_the_merge_when_it_fails(monkeypatch, caplog):
    import branchyard.lowering.nvgemm.fuse as fuse

    def broken(program):
        raise RuntimeError("CUDA out of memory while concatenating")

    monkeypatch.setattr(fuse, "merge_sibling_gemms", broken)
    m = QKV().eval()
    args = (torch.randn(4, 16), torch.randn(4, 16))
    ep = torch.export.export(m, args)
    with caplog.at_level("WARNING", logger="branchyard"):
        out = nvgemm(ep)
    assert "nvgemm: sibling GEMMs not merged: RuntimeError: CUDA out of memory" in caplog.text
    assert _count(out, aten.cat.default) == 1
    assert _count(out, torch.ops.branchyard.fused_gemm_epilogue.default) == 1


def test_the_pass_in_a_pipeline_merges_and_reports_it():
    from branchyard.fx.pass_infra import Pipeline
    from branchyard.lowering.nvgemm import NvGemmPass

    m = QKV().eval()
    args = (torch.randn(4, 16), torch.randn(4, 16))
    ep = torch.export.export(m, args)
    p = NvGemmPass().bind_inputs(ep)
    result = Pipeline([p])(ep)
    assert result.modified and result.reports == [p.report]
    assert p.report.stats["merged"] == ["3 GEMMs of x (linear, linear_1, linear_2) as one: 16 x 32"]
    assert p.report.stats["merge"].startswith("kept (not raced: the program runs on cpu")
    assert p.report.stats["fused"] == 1 and _count(result.program, aten.cat.default) == 0
    off = NvGemmPass(merge_siblings=False).bind_inputs(ep)
    assert _count(Pipeline([off])(ep).program, aten.cat.default) == 1 and "merged" not in off.report.stats


def test_a_merge_that_loses_is_a_skip_with_its_figures():
    from branchyard.fx.pass_infra import Pipeline
    from branchyard.lowering.nvgemm import NvGemmPass

    m = QKV().eval()
    args = (torch.randn(4, 16), torch.randn(4, 16))
    ep = torch.export.export(m, args)
    timer = lambda v: 2.0 if any(g.startswith("merged ") for g in v.fused) else 1.0  # noqa: E731
    p = NvGemmPass(race=ProgramRace(timer=timer, devices=("cpu",), blocks=3)).bind_inputs(ep)
    out = Pipeline([p])(ep).program
    assert _count(out, aten.cat.default) == 1
    assert p.report.stats["merged"] == [] and p.report.stats["merge"].startswith("not kept (2000.0 us with it")
    assert any(s.reason.startswith("not merged: the program called eagerly is no faster with it")
               for s in p.report.skips), p.report


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_branchyard_compile_merges_siblings(cuda_graph):
    import branchyard

    m = QKV().eval()
    args = (torch.randn(4, 16), torch.randn(4, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the op's CPU fallback note
        fast = branchyard.compile(m, args, passes=("nvgemm",), cuda_graph=cuda_graph)
        (report,) = fast.report.pass_reports
        assert report.stats["merged"] and report.stats["merge"].startswith("kept (")
        with torch.no_grad():
            _close(fast(*args), m(*args))


class _WritesBetweenSiblings(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.q, self.k = nn.Linear(d, d), nn.Linear(d, 4)

    def forward(self, x):
        q = self.q(x)
        x.view(-1).mul_(3.0)  # through an alias: k reads the same, written x node
        return torch.cat([q, self.k(x)], dim=-1), x


def test_siblings_with_a_write_in_place_between_them_are_not_merged():
    args = (torch.randn(2, 8),)
    ep = torch.export.export(_WritesBetweenSiblings(), tuple(a.clone() for a in args))
    merged = merge_sibling_gemms(ep)
    assert not merged.changed
    assert any("writes in place between the siblings" in s.reason for s in merged.report.skips), merged.report
    with torch.no_grad():
        _close(merged.program.module()(*[a.clone() for a in args]), ep.module()(*[a.clone() for a in args]))
