"""Random nested ``torch.cond`` trees for property-based tests of your passes.

A :class:`CondTreeSpec` is plain data: a binary tree whose inner nodes are
``torch.cond`` calls and whose leaves are small tensor expressions.
:meth:`CondTreeSpec.build` turns it into an ``nn.Module`` plus example
inputs ready for ``torch.export.export``; :meth:`CondTreeSpec.reference`
runs the same tree with Python ``if`` in place of ``torch.cond``.

What the trees exercise:

* predicates from 0-d bool inputs (``flags[k]``), from an integer input in
  ``idx == k`` chains, and computed inside a branch from a float input
  (``(z[j] * s).sum() > 0``);
* lifted tensors: every leaf may close over a *shared* parameter, a
  *private* parameter of its own, a buffer, and the *outer* intermediate
  value its enclosing cond computed (``h = cur.sin() * mix``);
* one or two outputs (the second a 0-d reduction), random shapes.

Every branch of every generated tree is reachable: along one root-to-leaf
path a flag or a ``z`` input decides at most once, and an ``idx == k`` never
follows a taken ``idx == j`` nor repeats an excluded ``k``. So
:func:`~branchyard.testing.assert_equivalent` can drive all of them.

The hypothesis strategy is :func:`cond_tree_specs`; hypothesis is imported
only when it is called, so this module imports without it::

    >>> spec = CondTreeSpec(Cond(Pred("flag", 0), Leaf(1.0, 0.0), Leaf(-1.0, 0.0)), shape=(3,))
    >>> module, inputs = spec.build(seed=0)
    >>> torch.equal(module(*inputs)[0], spec.reference(*inputs)[0])
    True
    >>> spec.depth, spec.num_conds
    (1, 1)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Union

import torch

__all__ = [
    "Pred", "Leaf", "Cond", "CondTreeSpec", "cond_tree_specs",
    "SwitchSpec", "switch_specs", "MAX_FLAGS", "MAX_Z", "MAX_IDX",
]

#: How many bool inputs, float predicate inputs, and ``idx == k`` constants trees may use.
MAX_FLAGS, MAX_Z, MAX_IDX = 3, 2, 4
#: Lifted tensors a leaf can close over.
CAPTURES = ("shared", "private", "buffer", "outer")


@dataclass(frozen=True)
class Pred:
    """``flag``: ``flags[arg]``; ``idx_eq``: ``idx == arg``; ``computed``:
    ``(z[arg] * sign * 2).sum() > 0``, computed inside the current branch."""

    kind: str
    arg: int
    sign: float = 1.0


@dataclass(frozen=True)
class Leaf:
    """``cur * scale + offset`` plus the tensors named in ``captures``."""

    scale: float
    offset: float
    captures: tuple[str, ...] = ()


@dataclass(frozen=True)
class Cond:
    """``torch.cond(pred, on_true, on_false, (cur,))``; both sides may use
    ``h = cur.sin() * mix`` computed here as their ``outer`` value."""

    pred: Pred
    on_true: "Node"
    on_false: "Node"
    mix: float = 0.5


Node = Union[Leaf, Cond]


def _leaves(node: Node) -> list[Leaf]:
    return [node] if isinstance(node, Leaf) else _leaves(node.on_true) + _leaves(node.on_false)


@dataclass(frozen=True)
class CondTreeSpec:
    """A whole generated program: the tree, the data shape, how many outputs."""

    root: Node
    shape: tuple[int, ...] = (4,)
    num_outputs: int = 1
    num_flags: int = MAX_FLAGS
    num_z: int = MAX_Z

    @property
    def depth(self) -> int:
        def d(n: Node) -> int:
            return 0 if isinstance(n, Leaf) else 1 + max(d(n.on_true), d(n.on_false))

        return d(self.root)

    @property
    def num_conds(self) -> int:
        return len(_leaves(self.root)) - 1

    def input_names(self) -> list[str]:
        """Positional inputs of the built module, in order."""
        return [f"flag{k}" for k in range(self.num_flags)] + ["idx", "x"] + [f"z{j}" for j in range(self.num_z)]

    def example_inputs(self, seed: int = 0) -> tuple[torch.Tensor, ...]:
        """Deterministic example inputs for ``seed``."""
        g = torch.Generator().manual_seed(seed)
        flags = [torch.tensor(bool(torch.randint(0, 2, (), generator=g))) for _ in range(self.num_flags)]
        idx = torch.randint(0, MAX_IDX + 1, (), generator=g)
        x = torch.randn(self.shape, generator=g)
        zs = [torch.randn(3, generator=g) for _ in range(self.num_z)]
        return (*flags, idx, x, *zs)

    def build(self, seed: int = 0) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
        """The tree as a module using ``torch.cond``, and example inputs."""
        return CondTreeModule(self, torch.cond, seed), self.example_inputs(seed)

    def export(self, seed: int = 0) -> tuple[torch.export.ExportedProgram, tuple[torch.Tensor, ...]]:
        """:meth:`build`, then ``torch.export.export`` it.

        Dynamo's caches are reset first: every generated module runs the same
        Python code with different closures, and stale guards from an earlier
        tree otherwise make dynamo recompile (or fail) while tracing a cond.
        """
        module, inputs = self.build(seed)
        torch._dynamo.reset()
        return torch.export.export(module, inputs), inputs

    def reference_module(self, seed: int = 0) -> torch.nn.Module:
        """The tree with Python ``if`` in place of ``torch.cond`` (same
        parameters as :meth:`build` for the same ``seed``)."""
        return CondTreeModule(self, _python_cond, seed)

    def reference(self, *inputs: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, ...]:
        """Run :meth:`reference_module` once on ``inputs``."""
        return self.reference_module(seed)(*inputs)


def _python_cond(pred: Any, on_true: Callable, on_false: Callable, operands: tuple) -> Any:
    return on_true(*operands) if bool(pred) else on_false(*operands)


class CondTreeModule(torch.nn.Module):
    """A :class:`CondTreeSpec` as a module; ``cond`` is ``torch.cond`` or a
    Python stand-in. Parameters are drawn from ``seed``.

    Parameters do not require grad: with grad-requiring operands, tracing
    each ``cond`` re-materializes its branches (torch's autograd key checks
    the HOP schema for mutation), which is exponential in the nesting depth
    -- a depth-5 tree exports in ~1.5 s without grad, ~10 s with it."""

    def __init__(self, spec: CondTreeSpec, cond: Callable, seed: int = 0) -> None:
        super().__init__()
        self.spec, self._cond = spec, cond
        g = torch.Generator().manual_seed(10_000 + seed)
        self.shared = torch.nn.Parameter(torch.randn(spec.shape, generator=g), requires_grad=False)
        self.register_buffer("buf", torch.randn(spec.shape, generator=g))
        self._private: dict[int, str] = {}
        for k, leaf in enumerate(_leaves(spec.root)):
            if "private" in leaf.captures:
                name = f"private{k}"
                self.register_parameter(name, torch.nn.Parameter(torch.randn(spec.shape, generator=g), requires_grad=False))
                self._private[id(leaf)] = name

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        s = self.spec
        flags, idx, x, zs = inputs[: s.num_flags], inputs[s.num_flags], inputs[s.num_flags + 1], inputs[s.num_flags + 2:]
        env = {"flags": flags, "idx": idx, "zs": zs}
        return self._emit(s.root, x, x.cos(), env)

    def _pred(self, pred: Pred, env: dict) -> Any:
        if pred.kind == "flag":
            return env["flags"][pred.arg]
        if pred.kind == "idx_eq":
            return env["idx"] == pred.arg
        return (env["zs"][pred.arg] * (2.0 * pred.sign)).sum() > 0

    def _emit(self, node: Node, cur: torch.Tensor, outer: torch.Tensor, env: dict) -> tuple[torch.Tensor, ...]:
        if isinstance(node, Leaf):
            v = cur * node.scale + node.offset
            for cap in node.captures:
                if cap == "shared":
                    v = v + self.shared
                elif cap == "private":
                    v = v * getattr(self, self._private[id(node)])
                elif cap == "buffer":
                    v = v - self.buf
                else:
                    v = v + outer
            return (v,) if self.spec.num_outputs == 1 else (v, v.sum() * node.scale)
        h = cur.sin() * node.mix  # an intermediate both children close over
        pred = self._pred(node.pred, env)
        return tuple(self._cond(
            pred,
            lambda c: self._emit(node.on_true, c, h, env),
            lambda c: self._emit(node.on_false, c, h, env),
            (cur,),
        ))


# ---------------------------------------------------------------------------
# switch programs (torch's own switch, index clamped by torch)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SwitchSpec:
    """``switch(idx, [leaf_0 .. leaf_{n-1}], (x,))`` where branch ``inner_at``
    (if not None) is itself ``switch(jdx, inner, ...)``. Leaves are
    :class:`Leaf` expressions; their ``outer`` capture is ``x.cos()``
    computed before the switch. Needs torch >= 2.14 to build."""

    leaves: tuple[Leaf, ...]
    inner: tuple[Leaf, ...] = ()
    inner_at: int | None = None
    shape: tuple[int, ...] = (4,)

    def example_inputs(self, seed: int = 0) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        return (torch.randint(0, len(self.leaves), (), generator=g), torch.randint(0, 3, (), generator=g),
                torch.randn(self.shape, generator=g))

    def export(self, seed: int = 0) -> tuple[torch.export.ExportedProgram, tuple[torch.Tensor, ...]]:
        """The program exported, and example inputs ``(idx, jdx, x)``."""
        torch._dynamo.reset()
        inputs = self.example_inputs(seed)
        return torch.export.export(SwitchModule(self, seed), inputs), inputs


class SwitchModule(torch.nn.Module):
    """A :class:`SwitchSpec` as a module (parameters without grad, as in
    :class:`CondTreeModule`)."""

    def __init__(self, spec: SwitchSpec, seed: int = 0) -> None:
        super().__init__()
        from branchyard._compat import switch_op  # noqa: F401  (clear error on torch < 2.14)

        self.spec = spec
        g = torch.Generator().manual_seed(20_000 + seed)
        self.shared = torch.nn.Parameter(torch.randn(spec.shape, generator=g), requires_grad=False)
        self.register_buffer("buf", torch.randn(spec.shape, generator=g))
        self.private = torch.nn.Parameter(torch.randn(spec.shape, generator=g), requires_grad=False)

    def _leaf(self, leaf: Leaf, cur: torch.Tensor, outer: torch.Tensor) -> torch.Tensor:
        v = cur * leaf.scale + leaf.offset
        table = {"shared": lambda t: t + self.shared, "private": lambda t: t * self.private,
                 "buffer": lambda t: t - self.buf, "outer": lambda t: t + outer}
        for cap in leaf.captures:
            v = table[cap](v)
        return v

    def forward(self, idx: torch.Tensor, jdx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        from torch._higher_order_ops import switch

        outer = x.cos()
        s = self.spec

        def branch(k: int) -> Callable:
            if k == s.inner_at:
                return lambda t, j: switch(j, [lambda u, lf=lf: self._leaf(lf, u, outer) for lf in s.inner], (t,))
            return lambda t, j: self._leaf(s.leaves[k], t, outer)

        return switch(idx, [branch(k) for k in range(len(s.leaves))], (x, jdx))


# ---------------------------------------------------------------------------
# hypothesis
# ---------------------------------------------------------------------------


@dataclass
class _PathState:
    flags: frozenset = frozenset()
    zs: frozenset = frozenset()
    idx_fixed: bool = False
    idx_excluded: frozenset = frozenset()


def cond_tree_specs(max_depth: int = 6, max_conds: int = 8, max_outputs: int = 2):
    """Hypothesis strategy of :class:`CondTreeSpec` with depth <= ``max_depth``
    and at most ``max_conds`` conds; every branch reachable (see module doc)."""
    from hypothesis import strategies as st

    scalars = st.sampled_from([-2.0, -1.0, -0.5, 0.5, 1.0, 1.5, 3.0])

    @st.composite
    def specs(draw):
        budget = [draw(st.integers(1, max_conds))]

        def node(depth: int, state: _PathState) -> Node:
            options = []
            if len(state.flags) < MAX_FLAGS:
                options.append("flag")
            if not state.idx_fixed and len(state.idx_excluded) < MAX_IDX:
                options.append("idx_eq")
            if len(state.zs) < MAX_Z:
                options.append("computed")
            if depth >= max_depth or budget[0] <= 0 or not options or (depth > 0 and draw(st.integers(0, 3)) == 0):
                caps = draw(st.lists(st.sampled_from(CAPTURES), max_size=3, unique=True))
                return Leaf(draw(scalars), draw(scalars), tuple(caps))
            budget[0] -= 1
            kind = draw(st.sampled_from(options))
            if kind == "flag":
                arg = draw(st.sampled_from(sorted(set(range(MAX_FLAGS)) - state.flags)))
                t_state = f_state = _PathState(state.flags | {arg}, state.zs, state.idx_fixed, state.idx_excluded)
                pred = Pred("flag", arg)
            elif kind == "idx_eq":
                arg = draw(st.sampled_from(sorted(set(range(MAX_IDX)) - state.idx_excluded)))
                t_state = _PathState(state.flags, state.zs, True, state.idx_excluded)
                f_state = _PathState(state.flags, state.zs, False, state.idx_excluded | {arg})
                pred = Pred("idx_eq", arg)
            else:
                arg = draw(st.sampled_from(sorted(set(range(MAX_Z)) - state.zs)))
                t_state = f_state = _PathState(state.flags, state.zs | {arg}, state.idx_fixed, state.idx_excluded)
                pred = Pred("computed", arg, draw(st.sampled_from([-1.0, 1.0])))
            on_true = node(depth + 1, t_state)
            on_false = node(depth + 1, f_state)
            return Cond(pred, on_true, on_false, draw(scalars))

        root = node(0, _PathState())
        shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
        return CondTreeSpec(root, shape, draw(st.integers(1, max_outputs)))

    return specs()


def switch_specs(max_branches: int = 6):
    """Hypothesis strategy of :class:`SwitchSpec`: 2..``max_branches``
    branches, half of the programs with a nested 2..4-way switch in one
    branch."""
    from hypothesis import strategies as st

    scalars = st.sampled_from([-2.0, -1.0, 0.5, 1.0, 1.5, 3.0])
    leaves = st.builds(Leaf, scalars, scalars, st.lists(st.sampled_from(CAPTURES), max_size=3, unique=True).map(tuple))

    @st.composite
    def specs(draw):
        outer = tuple(draw(st.lists(leaves, min_size=2, max_size=max_branches)))
        if draw(st.booleans()):
            return SwitchSpec(outer, shape=tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=2))))
        inner = tuple(draw(st.lists(leaves, min_size=2, max_size=4)))
        at = draw(st.integers(0, len(outer) - 1))
        return SwitchSpec(outer, inner, at, tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=2))))

    return specs()
