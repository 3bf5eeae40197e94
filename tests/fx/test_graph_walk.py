"""branchyard.fx.graph_walk: the one walk over nested graph modules, and
linting, copying and realizing them."""

from __future__ import annotations

import pytest
import torch
from torch.fx._lazy_graph_module import _LazyGraphModule

from branchyard.errors import MalformedGraphError
from branchyard.fx.graph_walk import (
    copy_graph_module,
    graph_path,
    iter_graph_modules,
    lint_graph_module,
    realize_graph_modules,
    rewrite_graphs,
)


def _module(children: dict | None = None) -> torch.fx.GraphModule:
    """``x -> child_k(...child_1(x)) + 1``, each child called as a submodule."""
    root = torch.nn.Module()
    g = torch.fx.Graph()
    y = g.placeholder("x")
    for name, child in (children or {}).items():
        root.add_module(name, child)
        y = g.call_module(name, (y,))
    g.output(g.call_function(torch.add, (y, 1)))
    return torch.fx.GraphModule(root, g)


def tree():
    """root -> a -> (a1, shared), root -> b -> shared: ``shared`` has two parents."""
    shared, a1 = _module(), _module()
    a = _module({"a1": a1, "shared": shared})
    b = _module({"shared": shared})
    root = _module({"a": a, "b": b})
    return root, {"root": root, "a": a, "b": b, "a1": a1, "shared": shared}


def test_each_module_once_parents_first_or_children_first():
    root, m = tree()
    name = {id(v): k for k, v in m.items()}
    pre = [name[id(g)] for g in iter_graph_modules(root)]
    post = [name[id(g)] for g in iter_graph_modules(root, children_first=True)]
    assert sorted(pre) == sorted(post) == sorted(m), "every module exactly once, shared included"
    parents = {"a": ["root"], "b": ["root"], "a1": ["a"], "shared": ["a", "b"]}
    for child, ps in parents.items():
        assert any(pre.index(p) < pre.index(child) for p in ps), "reached through a parent already seen"
        assert all(post.index(child) < post.index(p) for p in ps), "after every module above it"


def test_rewrite_graphs_visits_each_graph_once_and_drops_freed_attrs():
    root, m = tree()
    m["b"].spare = _module()  # an attribute b's graph does not use
    seen = []

    def rewrite(owner, node, dead):
        if node.op == "placeholder":
            seen.append(id(owner))
            if owner is m["b"]:
                dead.update({"shared", "spare"})
        return False

    assert rewrite_graphs(root, rewrite) is False
    assert sorted(seen) == sorted(id(v) for v in m.values()), "the dropped one is not visited"
    assert hasattr(m["b"], "shared"), "b's graph still calls it: not dropped"
    assert not hasattr(m["b"], "spare")


def test_copy_keeps_names_that_shadow_builtins_and_shares_shared_modules():
    ep = torch.export.export(torch.nn.Sequential(torch.nn.Linear(4, 4)), (torch.randn(2, 4),))
    twin = copy_graph_module(ep.graph_module)
    assert [n.name for n in twin.graph.nodes] == [n.name for n in ep.graph_module.graph.nodes]
    root, m = tree()
    copied = copy_graph_module(root)
    assert copied.a.shared is copied.b.shared and copied.a.shared is not m["shared"]
    x = torch.randn(3)
    torch.testing.assert_close(copied(x), root(x))


def test_lazy_copy_is_realized_into_eager_modules():
    root, _ = tree()
    lazy = copy_graph_module(root, lazy=True)
    assert all(isinstance(g, _LazyGraphModule) for g in iter_graph_modules(lazy))
    eager = realize_graph_modules(lazy)
    assert not any(isinstance(g, _LazyGraphModule) for g in iter_graph_modules(eager))
    assert eager.a.shared is eager.b.shared
    assert len(list(iter_graph_modules(eager))) == 5


def test_lint_names_the_failing_subgraph():
    root, m = tree()
    g = m["a1"].graph
    nodes = list(g.nodes)
    nodes[1].args = (nodes[2], 1)  # uses the output node's value before it exists
    with pytest.raises(MalformedGraphError, match="graph module 'GraphModule'.*|fails torch.fx lint"):
        lint_graph_module(root)


def _nested_cond_program() -> torch.fx.GraphModule:
    """A cond in each branch of a cond: three nodes named 'cond'."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(p, q, x):
        def t(x):
            return torch.cond(q, lambda x: x + 1, lambda x: x - 1, (x,))

        def e(x):
            return torch.cond(q, lambda x: x * 2, lambda x: x * 3, (x,))

        return torch.cond(p, t, e, (x,))

    return make_fx(f)(torch.tensor(True), torch.tensor(False), torch.randn(3))


def test_graph_path_names_where_each_subgraph_sits_below_the_root():
    gm = _nested_cond_program()
    paths = [graph_path(m) for m in iter_graph_modules(gm)]
    assert paths == ["", "true_graph_0", "true_graph_0.true_graph_0", "true_graph_0.false_graph_0",
                     "false_graph_0", "false_graph_0.true_graph_0", "false_graph_0.false_graph_0"]
    assert graph_path(torch.fx.symbolic_trace(lambda x: x + 1)) == "", "no walk reached it"


@pytest.mark.parametrize("branch", ["true_graph_0", "false_graph_0"])
def test_an_error_in_a_nested_cond_names_the_graph_it_is_in(branch):
    """Every branch names its nodes afresh: 'cond' alone would not say which cond."""
    from branchyard.passes import cond_to_switch

    gm = _nested_cond_program()
    inner = getattr(getattr(gm, branch), "false_graph_0")
    out = next(n for n in inner.graph.nodes if n.op == "output")
    x = out.args[0][0]
    with inner.graph.inserting_before(out):
        y = inner.graph.call_function(torch.ops.aten.to.dtype, (x, torch.float64))
    y.meta["val"] = x.meta["val"].to(torch.float64)
    out.args = ((y,),)
    inner.recompile()
    with pytest.raises(MalformedGraphError, match=rf"^node 'cond' in graph '{branch}': output 0 is torch.float32 "
                                                  r"in true branch but torch.float64 in false branch"):
        cond_to_switch(gm)
