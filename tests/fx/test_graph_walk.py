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


def _break_dtype(branch: torch.fx.GraphModule) -> None:
    """Make ``branch`` return float64 where its sibling returns float32."""
    out = next(n for n in branch.graph.nodes if n.op == "output")
    x = out.args[0][0]
    with branch.graph.inserting_before(out):
        y = branch.graph.call_function(torch.ops.aten.to.dtype, (x, torch.float64))
    y.meta["val"] = x.meta["val"].to(torch.float64)
    out.args = ((y,),)
    branch.recompile()


def _resolves(message: str, root: torch.fx.GraphModule) -> bool:
    """Every ``node 'n' in graph 'p'`` of ``message`` names a node of graph ``p`` of ``root``."""
    import re

    found = re.findall(r"node '([^']+)'(?: in graph '([^']+)')?", message)
    assert found, message
    for name, path in found:
        g = root
        for part in filter(None, path.split(".")):
            g = getattr(g, part, None)
        if g is None or not any(n.name == name for n in g.graph.nodes):
            return False
    return True


def test_graph_path_names_where_each_subgraph_sits_below_the_root():
    gm = _nested_cond_program()
    lint_graph_module(gm)
    paths = [graph_path(m) for m in iter_graph_modules(gm)]
    assert paths == ["", "true_graph_0", "true_graph_0.true_graph_0", "true_graph_0.false_graph_0",
                     "false_graph_0", "false_graph_0.true_graph_0", "false_graph_0.false_graph_0"]
    assert graph_path(torch.fx.symbolic_trace(lambda x: x + 1)) == "", "no walk reached it"


@pytest.mark.parametrize("branch", ["true_graph_0", "false_graph_0"])
def test_an_error_in_a_nested_cond_names_the_graph_it_is_in(branch):
    """Every branch names its nodes afresh: 'cond' alone would not say which cond."""
    from branchyard.passes import cond_to_switch

    gm = _nested_cond_program()
    _break_dtype(getattr(getattr(gm, branch), "false_graph_0"))
    with pytest.raises(MalformedGraphError, match=rf"^node 'cond' in graph '{branch}': output 0 is torch.float32 "
                                                  r"in true branch but torch.float64 in false branch"):
        cond_to_switch(gm)


def _leaf_with_a_loop_program() -> torch.fx.GraphModule:
    """A cond tree whose true leaf runs a while_loop with a cond in its body."""
    from torch._higher_order_ops.while_loop import while_loop
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(p, q, x):
        def t(x):
            def body(i, x):
                return i + 1, torch.cond(q, lambda x: x + 1, lambda x: x - 1, (x,))
            return while_loop(lambda i, x: i < 3, body, (torch.tensor(0), x))[1]

        def e(x):
            return torch.cond(q, lambda x: x * 2, lambda x: x * 3, (x,))

        return torch.cond(p, t, e, (x,))

    return make_fx(f)(torch.tensor(True), torch.tensor(False), torch.randn(3))


@pytest.mark.parametrize("form", ["function", "pass object"])
def test_an_error_below_a_rewritten_tree_names_the_graph_of_the_program_as_given(form):
    """The pass rewrites parents before children; the bad cond sits below a
    leaf the rewrite moves. The error still names the input's graph, and
    before anything was rewritten."""
    from branchyard.passes.cond_to_switch import CondToSwitch, cond_to_switch

    gm = _leaf_with_a_loop_program()
    _break_dtype(gm.true_graph_0.while_loop_body_graph_0.false_graph_0)
    before = gm.code
    with pytest.raises(MalformedGraphError) as exc:
        (cond_to_switch if form == "function" else CondToSwitch())(gm)
    assert str(exc.value).startswith("node 'cond' in graph 'true_graph_0.while_loop_body_graph_0': output 0")
    assert _resolves(str(exc.value), gm) and gm.code == before, "reported before any rewrite"


def test_a_branch_passed_alone_is_its_own_root():
    from branchyard.passes.cond_to_switch import CondToSwitch, find_cond_trees

    gm = _nested_cond_program()
    lint_graph_module(gm)  # names true_graph_0 below gm
    sub = gm.true_graph_0
    _break_dtype(sub.false_graph_0)
    for entry in (find_cond_trees, CondToSwitch()):
        with pytest.raises(MalformedGraphError, match=r"^node 'cond': output 0") as exc:
            entry(sub)
        assert _resolves(str(exc.value), sub)


def test_skips_name_graphs_of_the_program_as_given():
    """A leaf holding two conds is kept whole; the skips about it and about its
    conds name the input's branch, where those conds are."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from branchyard.fx.pass_infra import Pipeline
    from branchyard.passes.cond_to_switch import CondToSwitch

    def f(p, q, x):
        def t(x):
            a = torch.cond(q, lambda x: x + 1, lambda x: x - 1, (x,))
            return a + torch.cond(q, lambda x: x * 5, lambda x: x * 7, (x,))

        def e(x):
            return torch.cond(q, lambda x: x * 2, lambda x: x * 3, (x,))

        return torch.cond(p, t, e, (x,))

    gm = make_fx(f)(torch.tensor(True), torch.tensor(False), torch.randn(3))
    skips = Pipeline([CondToSwitch("all")])(gm).reports[0].skips
    assert len(skips) == 3
    assert {s.where.split(" (")[0] for s in skips} == {"node 'cond' in graph 'true_graph_0'",
                                                       "node 'cond_1' in graph 'true_graph_0'"}
    assert all(_resolves(s.where, gm) for s in skips)


def test_lint_names_the_graph_that_fails_by_its_place():
    gm = _nested_cond_program()
    bad = gm.false_graph_0.true_graph_0
    mul = next(n for n in bad.graph.nodes if n.op == "call_function")
    out = next(n for n in bad.graph.nodes if n.op == "output")
    mul.args = (out, 1)
    with pytest.raises(MalformedGraphError, match=r"^graph module 'false_graph_0.true_graph_0': graph fails"):
        lint_graph_module(gm)


@pytest.mark.skipif(not hasattr(torch.ops.higher_order, "switch"), reason="torch has no switch")
def test_switch_to_cond_names_the_nested_switch_where_the_input_has_it():
    from torch._higher_order_ops import switch
    from torch.fx.experimental.proxy_tensor import make_fx

    from branchyard.passes import switch_to_cond

    def f(i, j, x):
        def b1(x, j):
            return switch(j, [lambda x: x + 1, lambda x: x - 1, lambda x: x * 4], (x,))

        return switch(i, [lambda x, j: x * 2, b1, lambda x, j: x * 3], (x, j))

    gm = make_fx(f)(torch.tensor(1), torch.tensor(0), torch.randn(3))
    outer_branch = [name for name, _ in gm.named_children()][1]
    inner = getattr(gm, outer_branch)
    _break_dtype([m for _, m in inner.named_children()][2])
    with pytest.raises(MalformedGraphError, match=rf"^node 'switch' in graph '{outer_branch}': output 0"):
        switch_to_cond(gm)


def test_a_deep_place_is_shown_by_its_ends_and_kept_in_linear_memory():
    import tracemalloc

    from branchyard.examples.builder import build_dispatch_program

    def peak_naming(depth: int) -> tuple[int, torch.fx.GraphModule]:
        gm = build_dispatch_program(depth + 1, split="chain", dim=4).graph_module
        tracemalloc.start()
        lint_graph_module(gm)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return peak, gm

    small, _ = peak_naming(40)
    large, gm = peak_naming(160)
    import re

    def depth(m):
        more = re.search(r"\[(\d+) more\]", graph_path(m))
        return 6 + int(more.group(1)) if more else len(graph_path(m).split("."))

    shown = graph_path(max(iter_graph_modules(gm), key=depth)).split(".")
    assert len(shown) == 7 and shown[3] == "[154 more]", shown
    assert large < 8 * small, f"naming 4x the depth took {large / small:.1f}x the memory: places must share their parents'"
