"""branchyard.save / branchyard.load: switch programs round-trip through .pt2."""

from __future__ import annotations

import io
import json
import zipfile

import pytest
import torch
from torch.export import ExportedProgram

import branchyard
from branchyard._compat import HAS_SWITCH
from branchyard.errors import SerializationError
from branchyard.fx.graph_walk import iter_graph_modules
from branchyard.serialization import MARKER_FILE, load, lower_switches_for_save, save

pytestmark = pytest.mark.skipif(not HAS_SWITCH, reason="needs torch.ops.higher_order.switch (torch >= 2.14)")

if HAS_SWITCH:
    from torch._higher_order_ops import switch

COND = torch.ops.higher_order.cond
INDICES = [-7, -1, 0, 1, 2, 3, 4, 99]


class ThreeWay(torch.nn.Module):
    """switch over three branches, one closing over a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4))

    def forward(self, idx, x, y):
        return switch(idx, [lambda a, b: a + b, lambda a, b: a * b + self.w, lambda a, b: a - b], (x, y))


class Nested(torch.nn.Module):
    """A switch inside a switch branch, a switch inside a cond branch, two outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("bias", torch.arange(4.0))

    def forward(self, idx, jdx, flag, x):
        def inner(j, a):
            return switch(j, [lambda t: (t.sin(), t + 1), lambda t: (t.cos(), t * 2)], (a,))

        def outer_mid(j, a):
            s, t = inner(j, a)
            return s + self.bias, t

        out = switch(idx, [lambda j, a: (a.clone(), -a), outer_mid, lambda j, a: (a * 3, a.exp())], (jdx, x))
        gated = torch.cond(
            flag,
            lambda j, a: switch(j, [lambda t: t + 10, lambda t: t - 10, lambda t: t * 10, lambda t: t / 10], (a,)),
            lambda j, a: a.abs(),
            (jdx, x),
        )
        return out[0] + gated, out[1]


def _export(mod: torch.nn.Module, *args) -> ExportedProgram:
    return torch.export.export(mod, args)


def _hops(ep: ExportedProgram, target) -> list[torch.fx.Node]:
    return [n for gm in iter_graph_modules(ep.graph_module) for n in gm.graph.nodes if n.target is target]


def _structure(ep: ExportedProgram) -> list[tuple[int, int]]:
    """(branches, operands) of every switch, in a stable order."""
    return sorted((len(n.args[1]), len(n.args[2])) for n in _hops(ep, torch.ops.higher_order.switch))


def _norm(arg, names):
    if isinstance(arg, torch.fx.Node):
        return names.get(arg, arg.name)
    if isinstance(arg, (list, tuple)):  # torch's own deserializer turns cond's operand tuple into a list
        return [_norm(a, names) for a in arg]
    return repr(arg)


def _code(ep: ExportedProgram) -> list:
    """Every graph as (op, target, name, args) rows: equal lists mean the
    same program, node for node. A placeholder's target (the Python argument
    name, which torch's deserializer resets to the node name) is left out,
    and a subgraph's inputs are numbered (a restored branch names them after
    the switch's operands)."""
    rows = []
    for gm in iter_graph_modules(ep.graph_module):
        phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        names = {} if gm is ep.graph_module else {n: f"input{k}" for k, n in enumerate(phs)}
        rows.append([(n.op, n.op == "placeholder" or str(n.target), names.get(n, n.name),
                      _norm(n.args, names), _norm(dict(n.kwargs), names)) for n in gm.graph.nodes])
    return sorted(rows)


@pytest.fixture()
def three_way() -> ExportedProgram:
    return _export(ThreeWay(), torch.tensor(1), torch.randn(4), torch.randn(4))


@pytest.fixture()
def nested() -> ExportedProgram:
    return _export(Nested(), torch.tensor(1), torch.tensor(0), torch.tensor(True), torch.randn(4))


def test_torch_export_save_still_rejects_switch(three_way, tmp_path):
    # The reason this module exists; if torch learns to save switch, revisit.
    from torch._export.serde.serialize import SerializeError

    with pytest.raises(SerializeError, match="switch"):
        torch.export.save(three_way, tmp_path / "plain.pt2")


def test_round_trip_restores_switch_exactly(three_way, tmp_path):
    path = tmp_path / "three_way.pt2"
    save(three_way, path)
    back = load(path)
    assert _structure(back) == _structure(three_way) == [(3, 3)]
    assert _hops(back, COND) == []
    assert _code(back) == _code(three_way)
    assert [s.arg.name for s in back.graph_signature.input_specs] == [
        s.arg.name for s in three_way.graph_signature.input_specs
    ]
    x, y = torch.randn(4), torch.randn(4)
    for i in INDICES:
        idx = torch.tensor(i)
        torch.testing.assert_close(back.module()(idx, x, y), three_way.module()(idx, x, y), rtol=0, atol=0)


def test_plain_torch_load_gives_equivalent_cond_chain(three_way, tmp_path):
    path = tmp_path / "three_way.pt2"
    save(three_way, path)
    plain = torch.export.load(path)
    assert _hops(plain, torch.ops.higher_order.switch) == []
    assert len(_hops(plain, COND)) == 2  # n - 1 conds for n = 3 branches
    x, y = torch.randn(4), torch.randn(4)
    for i in INDICES:
        idx = torch.tensor(i)
        torch.testing.assert_close(plain.module()(idx, x, y), three_way.module()(idx, x, y), rtol=0, atol=0)


def test_round_trip_nested_switches_and_switch_under_cond(nested, tmp_path):
    path = tmp_path / "nested.pt2"
    save(nested, path)
    back = load(path)
    assert _structure(back) == _structure(nested) == [(2, 1), (3, 3), (4, 1)]  # the 3-way one also closes over the buffer
    assert len(_hops(back, COND)) == len(_hops(nested, COND)) == 1
    assert _code(back) == _code(nested)
    x = torch.randn(4)
    for i in INDICES:
        for j in (-1, 0, 1, 2, 5):
            for flag in (True, False):
                args = (torch.tensor(i), torch.tensor(j), torch.tensor(flag), x)
                torch.testing.assert_close(back.module()(*args), nested.module()(*args), rtol=0, atol=0)


def test_lowering_leaves_the_input_untouched(nested):
    before = _code(nested)
    lowered, count = lower_switches_for_save(nested)
    assert count == 3
    assert _code(nested) == before
    assert _hops(lowered, torch.ops.higher_order.switch) == []
    # 2-, 3- and 4-way switches need 1 + 2 + 3 conds; plus the original cond.
    assert len(_hops(lowered, COND)) == 1 + 2 + 3 + 1


def test_round_trip_through_a_buffer(three_way):
    buf = io.BytesIO()
    save(three_way, buf)
    buf.seek(0)
    back = load(buf)
    assert _structure(back) == [(3, 3)]


def test_program_without_switch_uses_torch_format(tmp_path):
    class Plain(torch.nn.Module):
        def forward(self, flag, x):
            return torch.cond(flag, lambda t: t + 1, lambda t: t - 1, (x,))

    ep = _export(Plain(), torch.tensor(True), torch.randn(3))
    path = tmp_path / "plain.pt2"
    save(ep, path)
    extra = {MARKER_FILE: ""}
    plain = torch.export.load(path, extra_files=extra)
    assert json.loads(extra[MARKER_FILE])["switches"] == 0
    back = load(path)
    assert _code(back) == _code(plain) == _code(ep)
    x = torch.randn(3)
    for flag in (True, False):
        torch.testing.assert_close(back.module()(torch.tensor(flag), x), ep.module()(torch.tensor(flag), x))


def test_load_reads_files_written_by_torch_export_save(tmp_path):
    class AddOne(torch.nn.Module):
        def forward(self, x):
            return x + 1

    ep = _export(AddOne(), torch.zeros(2))
    path = tmp_path / "torch.pt2"
    torch.export.save(ep, path)
    torch.testing.assert_close(load(path).module()(torch.zeros(2)), torch.ones(2))


def test_missing_file_is_named(tmp_path):
    path = tmp_path / "nope.pt2"
    with pytest.raises(SerializationError, match=r"nope\.pt2.*no such file"):
        load(path)


def test_corrupt_file_is_named(tmp_path):
    path = tmp_path / "garbage.pt2"
    path.write_bytes(b"this is not a zip archive" * 10)
    with pytest.raises(SerializationError, match=r"garbage\.pt2.*not a readable \.pt2"):
        load(path)


def test_save_rejects_graph_module(three_way, tmp_path):
    with pytest.raises(SerializationError, match=r"out\.pt2.*ExportedProgram, got GraphModule"):
        save(three_way.graph_module, tmp_path / "out.pt2")


def test_save_into_missing_directory_is_named(three_way, tmp_path):
    path = tmp_path / "no" / "such" / "dir" / "x.pt2"
    with pytest.raises(SerializationError, match=r"x\.pt2.*could not write"):
        save(three_way, path)


def test_marker_that_disagrees_with_graph_is_rejected(tmp_path):
    class AddOne(torch.nn.Module):
        def forward(self, x):
            return x + 1

    ep = _export(AddOne(), torch.zeros(2))
    path = tmp_path / "lying.pt2"
    marker = json.dumps({"format": "branchyard-switch-as-cond", "version": 1, "switches": 2})
    torch.export.save(ep, path, extra_files={MARKER_FILE: marker})
    with pytest.raises(SerializationError, match=r"lying\.pt2.*records 2 switch\(es\) but 0 were found"):
        load(path)


def test_malformed_marker_is_rejected(tmp_path):
    class AddOne(torch.nn.Module):
        def forward(self, x):
            return x + 1

    path = tmp_path / "badmarker.pt2"
    torch.export.save(_export(AddOne(), torch.zeros(2)), path, extra_files={MARKER_FILE: "{not json"})
    with pytest.raises(SerializationError, match=r"badmarker\.pt2.*malformed branchyard_switch\.json"):
        load(path)


def test_archive_is_a_zip_with_the_marker(three_way, tmp_path):
    path = tmp_path / "three_way.pt2"
    save(three_way, path)
    with zipfile.ZipFile(path) as zf:
        names = [n for n in zf.namelist() if n.endswith(MARKER_FILE)]
        assert len(names) == 1
        assert json.loads(zf.read(names[0]))["switches"] == 1


def test_round_trip_keeps_a_branch_shared_by_two_slots(three_way, tmp_path):
    # Hand-edit the switch to [b0, b1, b0]: index 2 now runs branch 0 again.
    gm = three_way.graph_module
    (sw,) = _hops(three_way, torch.ops.higher_order.switch)
    b0, b1, b2 = sw.args[1]
    sw.args = (sw.args[0], [b0, b1, b0], sw.args[2])
    gm.graph.erase_node(b2)
    delattr(gm, b2.target)
    gm.recompile()
    path = tmp_path / "shared.pt2"
    save(three_way, path)
    back = load(path)
    (restored,) = _hops(back, torch.ops.higher_order.switch)
    slots = restored.args[1]
    assert slots[0] is slots[2] and slots[0] is not slots[1]
    assert _code(back) == _code(three_way)
    x, y = torch.randn(4), torch.randn(4)
    for i in INDICES:
        idx = torch.tensor(i)
        torch.testing.assert_close(back.module()(idx, x, y), three_way.module()(idx, x, y), rtol=0, atol=0)


def test_round_trip_of_cond_to_switch_output(tmp_path):
    """The switches branchyard's own pass builds (computed index, deduplicated
    operands, an intermediate as operand) survive save/load exactly."""
    from branchyard.passes.cond_to_switch import cond_to_switch
    from branchyard.testing import assert_equivalent
    from branchyard.testing.strategies import Cond, CondTreeSpec, Leaf, Pred

    spec = CondTreeSpec(
        Cond(Pred("flag", 0),
             Cond(Pred("idx_eq", 1), Leaf(1.0, 1.0, ("buffer",)),
                  Cond(Pred("computed", 0), Leaf(0.5, 1.0, ("shared",)), Leaf(3.0, -0.5, ("outer",)))),
             Leaf(1.0, 0.0, ("outer", "private"))),
        shape=(2, 3), num_outputs=2,
    )
    ep, args = spec.export()
    switched = cond_to_switch(ep)
    assert _structure(switched)  # the pass built at least one switch
    path = tmp_path / "switched.pt2"
    save(switched, path)
    back = load(path)
    assert _structure(back) == _structure(switched)
    assert _code(back) == _code(switched)
    report = assert_equivalent(switched, back, args)
    assert report.covered == report.required
    assert_equivalent(switched, torch.export.load(path), args)


def test_round_trip_property_on_random_switch_programs(tmp_path):
    """Random torch switches (2-6 branches, half with a nested switch, random
    captures and shapes): the restore is node-for-node identical and both
    the restored and the plain-loaded program agree on every index."""
    from hypothesis import HealthCheck, given, settings

    from branchyard.testing import assert_equivalent
    from branchyard.testing.strategies import switch_specs

    counter = iter(range(1000))

    @settings(max_examples=8, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.function_scoped_fixture])
    @given(spec=switch_specs(max_branches=6))
    def check(spec):
        ep, args = spec.export()
        path = tmp_path / f"random{next(counter)}.pt2"
        save(ep, path)
        back = load(path)
        assert _structure(back) == _structure(ep)
        assert _code(back) == _code(ep)
        assert_equivalent(ep, back, args)
        assert_equivalent(ep, torch.export.load(path), args)

    check()


def test_round_trip_of_a_rewritten_program_whose_switch_is_the_graph_output(tmp_path):
    # Regression: the example's experts return bare tensors and the switch is
    # the graph output; saving renamed it (output spec mismatch) and the cond
    # chain unpacked the bare [4, 16] output as if it were a 4-tuple.
    from branchyard.examples import example_program
    from branchyard.passes.cond_to_switch import cond_to_switch

    program = cond_to_switch(example_program("expert-dispatch", 4, dim=8))
    path = tmp_path / "dispatch-switch.pt2"
    branchyard.save(program, path)
    loaded = branchyard.load(path)
    switches = [n for n in loaded.graph.nodes if n.target is torch.ops.higher_order.switch]
    assert len(switches) == 1 and len(switches[0].args[1]) == 4
    out = next(n for n in loaded.graph.nodes if n.op == "output")
    assert out.args[0][0] is switches[0]
    x = torch.randn(4, 8)
    for idx in (-3, 0, 1, 2, 3, 9):
        i = torch.tensor(idx)
        torch.testing.assert_close(loaded.module()(x, i), program.module()(x, i))


def test_round_trip_of_a_stack_of_switches_feeding_each_other(tmp_path):
    # Regression: torch's loader gives a one-output cond no getitem, so a
    # restored switch's user can be the next saved chain; the restore dropped
    # that chain's marker too and brought back only every other switch.
    from branchyard.examples.builder import build_dispatch_program
    from branchyard.passes.cond_to_switch import cond_to_switch

    layers = 5
    program = cond_to_switch(build_dispatch_program(num_experts=4, dim=8, split="chain", layers=layers))
    assert len(_hops(program, torch.ops.higher_order.switch)) == layers
    path = tmp_path / "stack.pt2"
    branchyard.save(program, path)
    loaded = branchyard.load(path)
    switches = [n for n in loaded.graph.nodes if n.target is torch.ops.higher_order.switch]
    assert len(switches) == layers and not _hops(loaded, COND)
    # Consecutive switches consume each other's output directly.
    assert sum(1 for a, b in zip(switches, switches[1:]) if a in b.all_input_nodes) == layers - 1
    assert [n.name for n in switches] == [n.name for n in _hops(program, torch.ops.higher_order.switch)]
    x = torch.randn(4, 8)
    for idx in (-2, 0, 1, 2, 3, 7):
        i = torch.tensor(idx)
        torch.testing.assert_close(loaded.module()(x, i), program.module()(x, i))


def test_children_first_order_visits_each_module_after_its_descendants(nested):
    order = list(iter_graph_modules(nested.graph_module, children_first=True))  # the walk save() uses
    position = {id(m): k for k, m in enumerate(order)}
    assert len(position) == len(list(iter_graph_modules(nested.graph_module)))
    assert order[-1] is nested.graph_module
    for m in order:
        for child in m.children():
            if isinstance(child, torch.fx.GraphModule):
                assert position[id(child)] < position[id(m)]
