"""branchyard.fx.mutation: what a call may write, checked against what the call does."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch.fx import Graph, GraphModule

from branchyard.fx.call_arguments import bind_call
from branchyard.fx.mutation import (
    UNMARKED_WRITES,
    call_writes,
    has_effects,
    may_write,
    method_writes,
    node_writes,
    nothing_written_between,
    written_operands,
    written_roots,
)

aten = torch.ops.aten


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "x": torch.randn(8, 3, generator=g) * 2 + 5,  # batch means far from the running means
        "rm": torch.zeros(3),
        "rv": torch.ones(3),
        "v": torch.tensor([-1.0, 2.0, -3.0]),
        "buf": torch.zeros(3),
        "cache": torch.zeros(4, 3),
        "pos": torch.tensor([1]),
        "k": torch.ones(1, 3),
    }


#: name -> (target, args, kwargs) over the names of _tensors(), and the arguments it writes.
CASES = {
    "add_": (aten.add_.Tensor, ("v", 1.0), {}, {"self"}),
    "add_ packet": (aten.add_, ("v", "v"), {}, {"self"}),
    "index_copy_": (aten.index_copy_.default, ("cache", 0, "pos", "k"), {}, {"self"}),
    "copy_": (aten.copy_.default, ("buf", "v"), {}, {"self"}),
    "add.out": (aten.add.out, ("v", "v"), {"out": "buf"}, {"out"}),
    "add packet out=": (aten.add, ("v", "v"), {"out": "buf"}, {"out"}),
    "torch.neg out=": (torch.neg, ("v",), {"out": "buf"}, {"out"}),
    "add": (aten.add.Tensor, ("v", "v"), {}, set()),
    "add packet": (aten.add, ("v", "v"), {}, set()),
    "torch.add": (torch.add, ("v", "v"), {}, set()),
    "mul operator": (operator.mul, ("v", 2.0), {}, set()),
    "iadd operator": (operator.iadd, ("v", 2.0), {}, {"a"}),
    "setitem": (operator.setitem, ("v", 0, 7.0), {}, {"a"}),
    "relu": (F.relu, ("v",), {}, set()),
    "relu inplace": (F.relu, ("v",), {"inplace": True}, {"input"}),
    "relu inplace positional": (F.relu, ("v", True), {}, {"input"}),
    "torch.relu_": (torch.relu_, ("v",), {}, {"self"}),
    "Tensor.add_ descriptor": (torch.Tensor.add_, ("v", 1.0), {}, {"self"}),
    "init.zeros_": (torch.nn.init.zeros_, ("v",), {}, {"self"}),
    "batch_norm train": (aten.batch_norm.default, ("x", None, None, "rm", "rv", True, 0.1, 1e-5, False), {},
                         {"running_mean", "running_var"}),
    "batch_norm eval": (aten.batch_norm.default, ("x", None, None, "rm", "rv", False, 0.1, 1e-5, False), {}, set()),
    "batch_norm train, no stats": (aten.batch_norm.default, ("x", None, None, None, None, True, 0.1, 1e-5, False),
                                   {}, set()),
    "native_batch_norm train": (aten.native_batch_norm.default, ("x", None, None, "rm", "rv", True, 0.1, 1e-5), {},
                                {"running_mean", "running_var"}),
    "native_batch_norm eval": (aten.native_batch_norm.default, ("x", None, None, "rm", "rv", False, 0.1, 1e-5), {},
                               set()),
    "_batch_norm_impl_index train": (aten._batch_norm_impl_index.default,
                                     ("x", None, None, "rm", "rv", True, 0.1, 1e-5, False), {},
                                     {"running_mean", "running_var"}),
    "_native_batch_norm_legit (marked)": (aten._native_batch_norm_legit.default,
                                          ("x", None, None, "rm", "rv", True, 0.1, 1e-5), {},
                                          {"running_mean", "running_var"}),
    "_native_batch_norm_legit_functional": (aten._native_batch_norm_legit_functional.default,
                                            ("x", None, None, "rm", "rv", True, 0.1, 1e-5), {}, set()),
    "_native_batch_norm_legit_no_training": (aten._native_batch_norm_legit_no_training.default,
                                             ("x", None, None, "rm", "rv", 0.1, 1e-5), {}, set()),
    "batch_norm_update_stats": (aten.batch_norm_update_stats.default, ("x", "rm", "rv", 0.1), {},
                                {"running_mean", "running_var"}),
    "torch.batch_norm train": (torch.batch_norm, ("x", None, None, "rm", "rv", True, 0.1, 1e-5, False), {},
                               {"running_mean", "running_var"}),
    "F.batch_norm default (eval)": (F.batch_norm, ("x", "rm", "rv"), {}, set()),
    "F.batch_norm training": (F.batch_norm, ("x", "rm", "rv"), {"training": True}, {"running_mean", "running_var"}),
    "F.instance_norm default (input stats)": (F.instance_norm, ("x3", "rm", "rv"), {},
                                              {"running_mean", "running_var"}),
    "F.instance_norm running stats": (F.instance_norm, ("x3", "rm", "rv"), {"use_input_stats": False}, set()),
    "instance_norm": (aten.instance_norm.default, ("x3", None, None, "rm", "rv", True, 0.1, 1e-5, False), {},
                      {"running_mean", "running_var"}),
    "instance_norm eval": (aten.instance_norm.default, ("x3", None, None, "rm", "rv", False, 0.1, 1e-5, False), {},
                           set()),
}


def _materialise(value, tensors):
    if isinstance(value, str):
        return tensors["x"].t().unsqueeze(0).contiguous() if value == "x3" else tensors[value]
    return value


@pytest.mark.parametrize("name", list(CASES))
def test_what_call_writes_names_is_what_the_call_writes(name):
    """Run each call on real tensors: the arguments whose contents changed are exactly those
    call_writes names (the schema's marks, out=, inplace=, and UNMARKED_WRITES in train mode)."""
    target, args, kwargs, expected = CASES[name]
    writes = call_writes(target, args, kwargs)
    assert set(writes.names) == expected and not writes.elsewhere, writes.arguments
    tensors = _tensors()
    real_args = tuple(_materialise(a, tensors) for a in args)
    real_kwargs = {k: _materialise(v, tensors) for k, v in kwargs.items()}
    before = {id(t): t.clone() for t in [*real_args, *real_kwargs.values()] if isinstance(t, torch.Tensor)}
    with torch.no_grad():
        target(*real_args, **real_kwargs)
    changed = {id(t) for t in [*real_args, *real_kwargs.values()]
               if isinstance(t, torch.Tensor) and not torch.equal(t, before[id(t)])}
    said = {id(_materialise(v, tensors)) for v in writes.values()}
    assert changed == said, name


def test_every_unmarked_write_names_arguments_of_its_op():
    for key, rule in UNMARKED_WRITES.items():
        if isinstance(key, torch._ops.OpOverloadPacket):
            for overload in key.overloads():
                names = {a.name for a in getattr(key, overload)._schema.arguments}
                assert set(rule.arguments) <= names and (rule.when is None or rule.when in names), (key, overload)
        else:
            call = bind_call(key, ("x", "rm", "rv"), {})[0]
            assert set(rule.arguments) <= set(call.arguments) and rule.when in call.arguments, key


def test_a_train_flag_known_only_at_run_time_may_write():
    g = Graph()
    x, rm, rv, training = (g.placeholder(n) for n in ("x", "rm", "rv", "training"))
    bn = g.call_function(aten.batch_norm.default, (x, None, None, rm, rv, training, 0.1, 1e-5, False))
    assert written_operands(bn) == [rm, rv]
    assert may_write(bn)


def test_methods_by_their_aten_schema_or_their_name():
    assert method_writes("index_copy_", ("cache", 0, "pos", "k"), {}).arguments == (("self", "cache"),)
    assert method_writes("resize_", ("v", 2, 3), {}).arguments == (("self", "v"),)  # varargs: by its name
    assert method_writes("__iadd__", ("v", 1), {}).arguments == (("self", "v"),)
    assert method_writes("__setitem__", ("v", 0, 1.0), {}).arguments == (("self", "v"),)
    for pure in ("reshape", "sum", "view", "float", "__getitem__", "size"):
        assert not method_writes(pure, ("v", 0), {}), pure
    unknown = method_writes("push", ("queue", "v"), {})  # not a Tensor method: some object's own code
    assert unknown.elsewhere and unknown.values() == ["queue", "v"]
    assert method_writes("add", ("v", "w"), {"out": "buf"}).arguments == (("out", "buf"),)


def _user_code(x):
    x.relu_()


class _Callable:
    def __call__(self, x):
        return x


def test_unknown_code_may_write_every_argument_and_beyond():
    for target in (_user_code, _Callable(), lambda x: x):
        writes = call_writes(target, ("v",), {"k": "w"})
        assert writes.elsewhere and writes.values() == ["v", "w"], target
    torch.library.define("branchyard_mutation_test::fill", "(Tensor(a!) x, Tensor y) -> ()")
    assert call_writes(torch.ops.branchyard_mutation_test.fill, ("v", "w"), {}).arguments == (("x", "v"),)
    assert call_writes(torch.ops.branchyard_mutation_test.fill.default, ("v", "w"), {}).arguments == (("x", "v"),)


def test_control_flow_and_getitem_write_nothing():
    assert not call_writes(torch.ops.higher_order.cond, ("p", "t", "f", ("v",)), {})
    assert not call_writes(torch.ops.higher_order.while_loop, ("c", "b", ("v",), ()), {})
    assert not call_writes(operator.getitem, ("v", 0), {})


def test_a_called_graph_module_writes_what_its_nodes_write_mapped_to_the_call():
    class Writes(torch.nn.Module):
        def forward(self, a, b):
            a.add_(1)
            return b * 2

    def own() -> GraphModule:  # writes a buffer of its own
        root = torch.nn.Module()
        root.register_buffer("s", torch.zeros(()))
        g = Graph()
        a = g.placeholder("a")
        g.call_method("add_", (g.get_attr("s"), 1))
        g.output(a)
        return GraphModule(root, g)

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.writes = torch.fx.symbolic_trace(Writes())
            self.own = own()
            self.pure = torch.fx.symbolic_trace(lambda a: a * 2)
            self.opaque = torch.nn.ReLU()

        def forward(self, x, y):
            return self.writes(y, x) + self.own(x) + self.pure(x) + self.opaque(x)

    class Leaves(torch.fx.Tracer):
        def is_leaf_module(self, m, name):
            return True

    gm = GraphModule(Outer(), Leaves().trace(Outer()))
    x, y = [n for n in gm.graph.nodes if n.op == "placeholder"]
    calls = {n.target: node_writes(n) for n in gm.graph.nodes if n.op == "call_module"}
    assert calls["writes"].arguments == (("a", y),) and not calls["writes"].elsewhere
    assert calls["own"].arguments == () and calls["own"].elsewhere  # its own buffer
    assert not calls["pure"]
    assert calls["opaque"].elsewhere and calls["opaque"].values() == [x]


def test_nothing_written_between_reads_every_node_in_between():
    g = Graph()
    rm, rv, x = (g.placeholder(n) for n in ("rm", "rv", "x"))
    first = g.call_function(aten.select.int, (rm, 0, 0))
    pure = g.call_function(aten.batch_norm.default, (x, None, None, rm, rv, False, 0.1, 1e-5, False))
    last = g.call_function(aten.gt.Scalar, (first, 0.5))
    g.output((last, pure))
    assert nothing_written_between(first, last)
    pure.update_arg(5, True)  # train mode: the running statistics move between the two
    assert not nothing_written_between(first, last)
    assert not nothing_written_between(last, first)  # not in order: the walk reaches the end


class _Norms(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(3)
        self.register_buffer("cache", torch.zeros(4, 3))

    def forward(self, x, pos):
        self.cache.index_copy_(0, pos, x[:1])
        return self.bn(x) + self.cache.sum()


@pytest.mark.parametrize("train", [True, False])
def test_written_roots_of_a_model_follow_its_mode(train):
    args = (torch.randn(4, 3), torch.tensor([1]))
    ep = torch.export.export(_Norms().train(train), args)
    roots = [n.name for n in written_roots(ep.graph)]
    stats = ["b_bn_running_mean", "b_bn_running_var", "b_bn_num_batches_tracked"] if train else []
    assert roots == ["b_cache", *stats]


def test_bind_call_binds_like_the_dispatcher():
    (call,) = bind_call(aten.add.Tensor, ("a", "b"), {"alpha": 2})
    assert call.arguments == {"self": "a", "other": "b", "alpha": 2}
    (call,) = bind_call(aten.add.Tensor, (), {"input": "a", "other": "b"})  # torch.add's name for self
    assert call.arguments["self"] == "a"
    assert bind_call(aten.add.Tensor, ("a", "b", "c"), {}) == []  # alpha is keyword-only
    assert bind_call(aten.add.Tensor, ("a",), {}) == []  # other has no default
    overloads = {c.schema.overload_name for c in bind_call(aten.add, ("a", "b"), {})}
    assert {"Tensor", "Scalar"} <= overloads and "out" not in overloads
    assert {c.schema.overload_name for c in bind_call(aten.add, ("a", "b"), {"out": "o"})} == {"out", "Scalar_out"}
    assert bind_call(F.dropout, ("x",), {"training": False})[0].arguments == {
        "input": "x", "p": 0.5, "training": False, "inplace": False}
    assert bind_call(torch.dropout, ("x", 0.5, False), {})[0].schema.name == "aten::dropout"
    assert bind_call("index_copy_", ("c", 0, "p", "k"), {}, method=True)[0].schema.name == "aten::index_copy_"
    assert bind_call("float", ("x",), {}, method=True) is None  # no ATen op of that name


def test_erase_dead_inputs_keeps_what_writes_memory():
    """The inputs of an erased predicate chain go with it only when nothing else needs them:
    a train-mode batch norm (its running statistics) and ``x.add_(1)`` as a method stay, and
    so does what might raise (the eval-mode batch norm is not on the raise-free list)."""
    from branchyard.fx.control_flow import erase_dead_inputs

    g = Graph()
    x, rm, rv = (g.placeholder(n) for n in ("x", "rm", "rv"))
    train = g.call_function(aten.batch_norm.default, (x, None, None, rm, rv, True, 0.1, 1e-5, False))
    evaluate = g.call_function(aten.batch_norm.default, (x, None, None, rm, rv, False, 0.1, 1e-5, False))
    bumped = g.call_method("add_", (x, 1))
    pure = g.call_function(aten.mul.Tensor, (x, 2))
    pred = g.call_function(aten.gt.Scalar, (g.call_function(aten.sum.default, (
        g.call_function(aten.add.Tensor, (g.call_function(aten.add.Tensor, (train, evaluate)),
                                          g.call_function(aten.add.Tensor, (bumped, pure)))),)), 0))
    g.output(x)
    erase_dead_inputs(g, [pred])
    left = [n for n in g.nodes if n.op in ("call_function", "call_method")]
    assert left == [train, evaluate, bumped]


def test_a_pass_that_eliminates_dead_code_keeps_a_dead_train_mode_batch_norm():
    """A pass with ``eliminate_dead_code`` removes results nobody uses, but not a batch norm whose
    only effect is updating its running statistics (torch's DCE alone would remove it)."""
    from branchyard.fx.pass_infra import BranchyardPass

    class Touch(BranchyardPass):
        name = "touch"
        eliminate_dead_code = True

        def run(self, graph_module):
            return True

    def program(training):
        root = torch.nn.Module()
        root.register_buffer("rm", torch.zeros(3))
        root.register_buffer("rv", torch.ones(3))
        g = Graph()
        x = g.placeholder("x")
        rm, rv = g.get_attr("rm"), g.get_attr("rv")
        g.call_function(aten.batch_norm.default, (x, None, None, rm, rv, training, 0.1, 1e-5, False))
        g.call_function(aten.mul.Tensor, (x, 2))
        g.output(x)
        return GraphModule(root, g)

    for training, kept in ((True, [aten.batch_norm.default]), (False, [])):
        gm = program(training)
        assert Touch()(gm).modified
        assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == kept
        x = torch.full((4, 3), 50.0)
        gm(x)
        assert float(gm.rm[0]) == (5.0 if training else 0.0)
    assert not has_effects(next(n for n in program(False).graph.nodes if n.op == "call_function"))
