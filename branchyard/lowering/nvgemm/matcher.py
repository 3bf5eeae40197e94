"""Find matmuls and the single-use elementwise chain after them (the epilogue).

A candidate starts at a matmul root -- ``aten.mm``, ``aten.matmul`` with a
2-D weight, ``aten.addmm`` or ``aten.linear`` (2-D, or N-D input flattened to
``[M, K]``) -- and walks
forward while the running value has exactly one user and that user is a row
of the epilogue table (:data:`~branchyard.lowering.nvgemm.epilogue.EPILOGUE_TABLE`)
whose operand checks pass::

    mm = aten.mm(a, b)                  # or addmm(bias, a, b) / linear(a, w, bias)
    t1 = aten.add(mm, bias)             # bias   [N]
    t2 = aten.gelu(t1)                  # gelu_erf
    t3 = aten.add(t2, residual)         # residual [M, N]
    t4 = aten._to_copy(t3, dtype=bf16)  # cast

Views that only regroup the leading (row) dims are transparent, so the
``view -> addmm -> view`` that ``run_decompositions`` makes of a 3-D
``linear`` still matches; the decomposed SiLU ``x * sigmoid(x)`` is one
``silu`` step; ``_assert_tensor_metadata`` checks on intermediates (export
puts them before a ``.to``) go with the chain. A ``mul`` by the product of
the same input with a second weight -- a GLU's ``silu(gate(x)) * up(x)`` --
takes that matmul into the chain as one ``mul_mm`` step (its operand is the
second weight, ``[N, K]``), so one kernel can read both weights::

    g  = aten.linear(x, w_gate)          # the root
    s  = aten.silu(g)                    # silu
    u  = aten.linear(x, w_up)            # one user (the mul), no bias, same x, same [N, K]
    y  = aten.mul(s, u)                  # mul_mm@0, operand w_up

In the other graph order (``u`` before ``g``) up's bare matmul stops before the
``mul`` and leaves it to gate's chain, which takes up in the same way. One
matmul on stacked gate and up weights, halved by ``chunk`` / ``split`` along
the output dim (Phi-3's ``gate_up_proj``), is the same product on the two row
halves of its weight: the fused op gets ``w[:h]`` and ``w[h:]``
(:class:`WeightRows`, sliced when the chain is rewritten)::

    gu   = aten.linear(x, w)             # w: [2h, K]
    g, u = aten.chunk(gu, 2, -1)         # getitem 0 and 1
    y    = aten.mul(aten.silu(g), u)     # silu; mul_mm@0 on w[:h], operand w[h:]

Every matcher here is a run of guard clauses returning a match or a reason
string; :func:`find_epilogue_chains` returns one :class:`EpilogueChain` per
matmul root, fusable or not (``chain.reason`` says why not).

    >>> import torch
    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> def f(x, w, b):
    ...     return torch.relu(x @ w + b)
    >>> gm = make_fx(f)(torch.randn(8, 16), torch.randn(16, 32), torch.randn(32))
    >>> [str(c.spec) for c in find_epilogue_chains(gm)]
    ['w=kn;bias@0;relu;out=float32']
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Iterable, Union

import torch
from torch.fx import GraphModule, Node

from branchyard.lowering.nvgemm.epilogue import (
    EPILOGUE_OPS,
    EPILOGUE_TABLE,
    SUPPORTED_DTYPES,
    TENSOR_OPERANDS,
    EpilogueOp,
    EpilogueSpec,
    EpilogueStep,
    is_col_vector,
    known_eq,
    same_shape,
)

__all__ = ["EpilogueChain", "find_epilogue_chains", "match_matmul", "MatmulRoot", "WeightRows", "input_source",
           "is_transpose", "VIEW_TARGETS", "TRANSPOSE_TARGETS"]

aten = torch.ops.aten

VIEW_TARGETS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
TRANSPOSE_TARGETS = (aten.t.default, aten.permute.default)

#: target -> the table rows matched from it, in table order (first match wins).
_ROWS_BY_TARGET: dict[Any, list[EpilogueOp]] = {}
for _row in EPILOGUE_TABLE:
    for _t in _row.targets:
        _ROWS_BY_TARGET.setdefault(_t, []).append(_row)

#: Users that only check a value (export inserts them before casts). They do
#: not keep a chain value alive: the pass drops them with the chain.
_CHECK_ONLY_USERS = (aten._assert_tensor_metadata.default,)

#: The most steps one fused op carries (keeps specs, and kernels, bounded).
MAX_STEPS = 8

@dataclass(frozen=True)
class WeightRows:
    """Rows ``start:stop`` of the ``[N, K]`` weight ``source``: a half of a stacked
    gate/up weight, made a graph value (``aten.slice``) when the chain is rewritten."""

    source: Node
    start: int
    stop: int

    @property
    def name(self) -> str:
        return f"{self.source.name}[{self.start}:{self.stop}]"

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.stop - self.start, *tuple(self.source.meta["val"].shape)[1:])


Operand = Union[Node, WeightRows, float, torch.dtype, None]


@dataclass
class MatmulRoot:
    """A matched matmul: ``a`` ``[..., K]`` times ``b`` (layout ``kn``/``nk``),
    plus the steps the root itself implies (addmm/linear bias, addmm alpha)."""

    node: Node
    a: Node
    b: Node
    weight_layout: str
    steps: list[tuple[EpilogueOp, Operand]]


@dataclass
class EpilogueChain:
    """One matmul root and the chain after it.

    ``nodes`` are the graph nodes the fused op replaces (root first, ``end``
    last); ``steps`` the table rows with their operands (graph nodes for
    tensors, floats for scalars, dtypes for casts). ``reason`` is ``None`` for
    a fusable chain and says why otherwise; ``stop`` says why the chain ends
    where it does, and ``stop_node`` is the user it stopped at (``None`` when
    it simply ran out of epilogue ops). ``plain`` marks a chain declined only
    because nothing follows the matmul to fuse (a plain GEMM, or ``addmm``
    with its own bias): the op can still run it, with other kernels than
    cuBLAS's, where a race shows that pays (see ``NvGemmPass``); ``deferred`` marks
    a bare matmul left for a sibling's chain to take in as its product (not plain).
    """

    root: Node
    a: Node | None = None
    b: Node | WeightRows | None = None
    weight_layout: str = "kn"
    steps: list[tuple[EpilogueOp, Operand]] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    checks: list[Node] = field(default_factory=list)
    out_view: Node | None = None
    reason: str | None = None
    stop: str = ""
    stop_node: Node | None = None
    near_miss: bool = False
    plain: bool = False
    #: Stopped before a ``mul`` that a sibling's chain takes with this matmul as its product.
    deferred: bool = False
    #: While walking one half of a halved matmul: the other half's value (its ``getitem``)
    #: and its weight rows, the product a ``mul`` by it takes in.
    other_half: tuple[Node, WeightRows] | None = None
    #: The fused op that replaced ``nodes`` once the chain is rewritten (``None`` before).
    replaced_by: Node | None = None

    @property
    def fusable(self) -> bool:
        """Whether the pass replaces this chain with one fused op."""
        return self.reason is None

    @property
    def end(self) -> Node:
        """The last node replaced; its users get the fused result."""
        return self.nodes[-1]

    @property
    def operands(self) -> list[Node]:
        """The tensor operands of the steps, in step order."""
        return [v for op, v in self.steps if op.operand in TENSOR_OPERANDS]  # type: ignore[misc]

    @property
    def spec(self) -> EpilogueSpec:
        """The chain as an :class:`EpilogueSpec` (operands numbered in order)."""
        steps: list[EpilogueStep] = []
        k = 0
        for op, v in self.steps:
            if op.operand in TENSOR_OPERANDS:
                steps.append(EpilogueStep(op, k))
                k += 1
            else:
                steps.append(EpilogueStep(op, v))  # type: ignore[arg-type]
        out = self.end.meta["val"].dtype
        return EpilogueSpec(tuple(steps), out, self.weight_layout)  # type: ignore[arg-type]

    def __str__(self) -> str:
        head = f"{self.root.name}: "
        if self.reason is not None:
            return head + f"declined: {self.reason}"
        return head + " -> ".join(op.name for op, _ in self.steps) + f" [{self.spec}]"


# --- matmul roots ------------------------------------------------------------


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, Node) else None


def _check_operands(node: Node, a: Any, b: Any, b_layout: str) -> str | None:
    for name, x in (("input", a), ("weight", b)):
        if not isinstance(x, Node):
            return f"the matmul {name} is not a graph value"
        if not isinstance(_val(x), torch.Tensor):
            return (
                f"the matmul {name} '{x.name}' has no tensor metadata (node.meta['val']); "
                "lower an exported (torch.export) or make_fx-traced ATen graph"
            )
    ta, tb = _val(a), _val(b)
    if tb.dim() != 2:
        return f"the weight is {tb.dim()}-D, not 2-D"
    if ta.dim() < 2:
        return f"the input is {ta.dim()}-D; a matmul root needs [M, K] or [..., M, K]"
    if ta.dtype != tb.dtype:
        return f"input dtype {ta.dtype} differs from weight dtype {tb.dtype}"
    if str(ta.dtype).removeprefix("torch.") not in SUPPORTED_DTYPES:
        return f"dtype {ta.dtype} is not fused (float16, bfloat16, float32 only)"
    k, n = (tb.shape[0], tb.shape[1]) if b_layout == "kn" else (tb.shape[1], tb.shape[0])
    for dim, size in (("K", k), ("N", n)):
        if not isinstance(size, int):
            return f"{dim}={size} is symbolic; the kernel is compiled for a static {dim}"
    return None


def _bias_step(bias: Node, out: Node) -> tuple[EpilogueOp, Operand] | str:
    t = _val(bias)
    if not isinstance(t, torch.Tensor):
        return f"bias '{getattr(bias, 'name', bias)}' has no tensor metadata"
    shape_out = tuple(_val(out).shape)
    if is_col_vector(t, shape_out):
        return (EPILOGUE_OPS["bias"], bias)
    if same_shape(t.shape, shape_out):
        return (EPILOGUE_OPS["residual"], bias)
    return f"addmm input has shape {list(t.shape)}: neither a per-column bias nor an [M, N] residual"


def _match_mm(node: Node) -> MatmulRoot | str:
    a, b = node.args[:2]
    if (why := _check_operands(node, a, b, "kn")) is not None:
        return why
    return MatmulRoot(node, a, b, "kn", [])


def _match_matmul(node: Node) -> MatmulRoot | str:
    a, b = node.args[:2]
    if isinstance(b, Node) and isinstance(_val(b), torch.Tensor) and _val(b).dim() != 2:
        return f"matmul with a {_val(b).dim()}-D right operand (only a 2-D weight is fused; bmm is not)"
    if (why := _check_operands(node, a, b, "kn")) is not None:
        return why
    return MatmulRoot(node, a, b, "kn", [])


def _match_addmm(node: Node) -> MatmulRoot | str:
    bias, a, b = node.args[:3]
    beta = node.kwargs.get("beta", node.args[3] if len(node.args) > 3 else 1)
    alpha = node.kwargs.get("alpha", node.args[4] if len(node.args) > 4 else 1)
    if beta != 1:
        return f"addmm beta={beta} (the bias would need its own scale)"
    if (why := _check_operands(node, a, b, "kn")) is not None:
        return why
    steps: list[tuple[EpilogueOp, Operand]] = []
    if alpha != 1:
        steps.append((EPILOGUE_OPS["scale"], float(alpha)))
    step = _bias_step(bias, node)
    if isinstance(step, str):
        return step
    return MatmulRoot(node, a, b, "kn", steps + [step])


def _match_linear(node: Node) -> MatmulRoot | str:
    a, w = node.args[:2]
    bias = node.kwargs.get("bias", node.args[2] if len(node.args) > 2 else None)
    if (why := _check_operands(node, a, w, "nk")) is not None:
        return why
    steps: list[tuple[EpilogueOp, Operand]] = []
    if bias is not None:
        step = _bias_step(bias, node)
        if isinstance(step, str):
            return step
        steps.append(step)
    return MatmulRoot(node, a, w, "nk", steps)


#: The matmul roots, as data: ATen target -> guard-clause matcher.
MATMUL_ROOTS = {
    aten.mm.default: _match_mm,
    aten.matmul.default: _match_matmul,
    aten.addmm.default: _match_addmm,
    aten.linear.default: _match_linear,
}


def match_matmul(node: Node) -> MatmulRoot | str:
    """Match ``node`` as a matmul root, or say why it is not one."""
    matcher = MATMUL_ROOTS.get(node.target)
    if matcher is None:
        return f"{node.target} is not mm, matmul, addmm or linear"
    if not isinstance(_val(node), torch.Tensor):
        return "no tensor metadata (node.meta['val']); lower an exported or make_fx-traced ATen graph"
    return matcher(node)


# --- the chain walk ----------------------------------------------------------


def _row_view(node: Node, x: Node) -> bool:
    """``node`` is a view of ``x`` that only regroups the leading (row) dims."""
    if node.target not in VIEW_TARGETS or node.args[0] is not x:
        return False
    tin, tout = _val(x), _val(node)
    if not isinstance(tout, torch.Tensor) or tout.dim() < 1:
        return False
    return known_eq(tout.shape[-1], tin.shape[-1])


def _users(x: Node) -> tuple[list[Node], list[Node]]:
    """``x``'s users, split into real ones and check-only ones."""
    real, checks = [], []
    for u in x.users:
        (checks if u.target in _CHECK_ONLY_USERS else real).append(u)
    return real, checks


def _match_decomposed_silu(x: Node) -> tuple[list[Node], Node] | None:
    """``x * sigmoid(x)`` (what decompositions make of ``silu``): x has exactly
    these two users. Returns the nodes consumed and the new chain value."""
    users, _ = _users(x)
    if len(users) != 2:
        return None
    sig = next((u for u in users if u.target is aten.sigmoid.default and u.args[0] is x), None)
    if sig is None or len(_users(sig)[0]) != 1 or _users(sig)[1]:
        return None
    mul = _users(sig)[0][0]
    if mul.target is not aten.mul.Tensor or set(mul.args[:2]) != {x, sig} or mul not in users:
        return None
    return [sig, mul], mul


def is_transpose(node: Any) -> bool:
    """``node`` is ``t(w)`` or a 2-D ``permute(w, [1, 0])``."""
    return (isinstance(node, Node) and node.target in TRANSPOSE_TARGETS
            and (node.target is aten.t.default or list(node.args[1]) in ([1, 0], [-1, -2], [1, -2], [-1, 0])))


def input_source(a: Node) -> tuple[Any, ...]:
    """What a matmul input is, for comparing inputs: a view's source and shape, else the node
    (decompositions give each ``linear`` its own ``view`` of a shared N-D input)."""
    if a.target in VIEW_TARGETS and isinstance(a.args[0], Node):
        return (a.args[0], tuple(_val(a).shape) if isinstance(_val(a), torch.Tensor) else id(a))
    return (a,)


def _only_user(node: Node, user: Node) -> bool:
    real, checks = _users(node)
    return real == [user] and not checks


def _single_use_path(path: list[Node]) -> bool:
    """Each value of ``path`` is read only by the next (no check-only users either)."""
    return all(_only_user(x, nxt) for x, nxt in zip(path, path[1:]))


def _peel_row_views(node: Node) -> tuple[Node, list[Node]]:
    """``node`` back through the row views that make it: ``(their source, the views,
    outermost first)``."""
    views = []
    while node.target in VIEW_TARGETS and isinstance(node.args[0], Node) and _row_view(node, node.args[0]):
        views.append(node)
        node = node.args[0]
    return node, views


def _weight_nk(b: Node, layout: str) -> Node | None:
    """The ``[N, K]`` weight node behind a matmul's weight operand ``b``: an ``nn.Linear``
    weight (``nk``) as it is, or the source of a transposed ``kn`` one; ``None`` for a
    true ``[K, N]`` weight."""
    if layout == "nk":
        return b
    if is_transpose(b) and isinstance(b.args[0], Node):
        return b.args[0]
    return None


def _match_product(chain: EpilogueChain, mul: Node, other: Node) -> tuple[Node, list[Node]] | str:
    """``other`` (the ``mul``'s other operand) as ``a @ w2.T`` on the chain's own input:
    the second weight ``w2`` ``[N, K]`` and the nodes that compute ``other`` from it
    (consumed with the chain), or why not."""
    node, views = _peel_row_views(other)
    if node.target not in MATMUL_ROOTS:
        return "not a matmul"
    if not _single_use_path([node, *views[::-1], mul]):
        return f"the matmul '{node.name}' or a view of it has other users"
    root = match_matmul(node)
    if isinstance(root, str):
        return root
    if root.steps:
        return f"the matmul '{node.name}' has its own {' and '.join(op.name for op, _ in root.steps)}"
    w2, w1 = _weight_nk(root.b, root.weight_layout), _weight_nk(chain.b, chain.weight_layout)  # type: ignore[arg-type]
    if w2 is None or w1 is None:
        return "a weight is not an [N, K] (nn.Linear) weight"
    t1, t2 = _val(w1), _val(w2)
    if not isinstance(t2, torch.Tensor) or tuple(t1.shape) != tuple(t2.shape) or t1.dtype != t2.dtype:
        return f"the weights' shapes or dtypes differ ({list(t1.shape)} {t1.dtype}, {list(getattr(t2, 'shape', []))})"
    if input_source(root.a) != input_source(chain.a):  # type: ignore[arg-type]
        return "the matmuls have different inputs"
    own = [n for n in (root.a, root.b) if n is not chain.a and n is not w2 and isinstance(n, Node)
           and n.target in (*VIEW_TARGETS, *TRANSPOSE_TARGETS) and _only_user(n, node)]
    return w2, own + [node] + views[::-1]


def _sibling_taking(chain: EpilogueChain, mul: Node, other: Node) -> Node | None:
    """The root of another matmul whose chain reaches ``mul`` as ``other`` and takes
    ``chain``'s bare matmul in as its product (``up(x) * silu(gate(x))``, up first in
    graph order: gate's chain, which reads both weights in one kernel), else ``None``."""
    seen, frontier = {other}, [other]
    for _ in range(2 * MAX_STEPS):  # back from ``other`` through the sibling chain's nodes
        nxt = []
        for node in frontier:
            if node.op != "call_function" or node is chain.root:
                continue
            if node.target in MATMUL_ROOTS:
                sibling = match_chain(node, defer=False)
                if sibling.fusable and mul in sibling.nodes and chain.root in sibling.nodes:
                    return node
                continue
            nxt += [arg for arg in node.all_input_nodes if arg not in seen]
            seen.update(node.all_input_nodes)
        frontier = nxt
    return None


_SPLIT_TARGETS = (aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default)


def _halves(split: Node, x: Node) -> tuple[Node, Node, int] | str:
    """``split`` cuts ``x`` into two equal halves along the last dim, each read once
    through a ``getitem``: ``(half 0, half 1, h)``, or why not."""
    t = _val(x)
    n, dim = t.shape[-1], split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if dim not in (-1, t.dim() - 1):
        return f"it splits dim {dim}, not the output's last"
    sizes = {aten.chunk.default: lambda k: [n // 2] * 2 if k == 2 and n % 2 == 0 else None,
             aten.split.Tensor: lambda k: [k, k] if 2 * k == n else None,
             aten.split_with_sizes.default: lambda k: list(k) if len(k) == 2 and k[0] == k[1] else None}
    if sizes[split.target](split.args[1]) is None:
        return "not into two equal halves"
    users, checks = _users(split)
    index = {u.args[1]: u for u in users if u.target is operator.getitem}
    if checks or len(users) != 2 or sorted(index) != [0, 1]:
        return "its halves are not each read once"
    return index[0], index[1], n // 2


def _take_halves(chain: EpilogueChain, split: Node, x: Node, views: list[Node], checks: list[Node]) -> str | None:
    """A bare matmul on a stacked ``[2h, K]`` weight, halved by ``split``: walk one half
    to a ``mul`` by the other (taken in as ``mul_mm`` on the other rows of the weight);
    on success ``chain`` is that walk (the weight is then its first half's rows)."""
    halves = _halves(split, x)
    if isinstance(halves, str):
        return halves
    g0, g1, h = halves
    w = _weight_nk(chain.b, chain.weight_layout)  # type: ignore[arg-type]
    if w is None:
        return "its weight is not an [N, K] (nn.Linear) weight"
    for first, second, lo in ((g0, g1, 0), (g1, g0, h)):
        trial = EpilogueChain(root=chain.root, a=chain.a, b=WeightRows(w, lo, lo + h), weight_layout="nk",
                              nodes=chain.nodes + views + [split, first], checks=chain.checks + checks,
                              other_half=(second, WeightRows(w, h - lo, 2 * h - lo)))
        _walk(trial, defer=False, start=first)
        if any(op.name == "mul_mm" and isinstance(v, WeightRows) for op, v in trial.steps):
            trial.other_half = None
            chain.__dict__.update(trial.__dict__)
            return None
    return "neither half reaches a mul by the other"


def _other_half(chain: EpilogueChain, mul: Node, other: Node) -> tuple[WeightRows, list[Node]] | None:
    """``other`` as the other half of a halved matmul (through row views), read only by
    ``mul``: its weight rows and the nodes that compute it from the split."""
    if chain.other_half is None:
        return None
    node, views = _peel_row_views(other)
    half, rows = chain.other_half
    if node is not half or not _single_use_path([node, *views[::-1], mul]):
        return None
    return rows, [node, *views[::-1]]


def _narrowing(dtype: torch.dtype) -> bool:
    return dtype.itemsize < 4


def writes_in_place(node: Node) -> bool:
    """``node`` calls an op that writes one of its arguments (``mul_``, ``copy_``, ...)."""
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and schema.is_mutable


def first_write_within(last: Node, first: Iterable[Node]) -> Node | None:
    """The earliest in-place write strictly between the earliest of ``first`` and
    ``last`` in graph order. A rewrite that moves reads of values to ``last``
    (or to the earliest of ``first``) changes what they read if one exists."""
    remaining, found, node = set(first) - {last}, None, last.prev
    while remaining and node.op != "root":
        remaining.discard(node)
        if remaining and writes_in_place(node):
            found = node
        node = node.prev
    return found


def _walk(chain: EpilogueChain, defer: bool = True, start: Node | None = None) -> None:
    """Extend ``chain`` forward from its root (or from ``start``, a half of it); fills
    ``steps``, ``nodes``, ``stop``. With ``defer``, a bare matmul stops before a ``mul``
    that a sibling chain would take with this matmul as its product (see
    :func:`_sibling_taking`); a bare matmul halved along N walks one half to the ``mul``
    by the other (see :func:`_take_halves`)."""
    x = chain.root if start is None else start
    pending_views: list[Node] = []
    pending_checks: list[Node] = []
    while True:
        if len(chain.steps) >= MAX_STEPS:
            chain.stop = f"the chain reached the {MAX_STEPS}-step limit"
            break
        users, checks = _users(x)
        if len(users) > 1:
            silu = _match_decomposed_silu(x)
            if silu is not None:
                consumed, x = silu
                chain.nodes += pending_views + consumed
                chain.checks += pending_checks + checks
                pending_views, pending_checks = [], []
                chain.steps.append((EPILOGUE_OPS["silu"], None))
                continue
            chain.stop = f"'{x.name}' has {len(users)} users; fusing past it would lose the value they need"
            chain.stop_node = x
            break
        if not users:
            chain.stop = f"'{x.name}' has no users"
            break
        (u,) = users
        if u.op == "output":
            chain.stop = "the chain reaches the graph output"
            break
        if _row_view(u, x):
            pending_views.append(u)
            pending_checks += checks
            x = u
            continue
        if u.target in _SPLIT_TARGETS and not chain.steps and chain.other_half is None:
            why = _take_halves(chain, u, x, pending_views, pending_checks + checks)
            if why is None:
                return  # the half's walk finished the chain
            chain.stop = f"'{u.name}' halves the matmul, but {why}"
            break
        rows = _ROWS_BY_TARGET.get(u.target)
        if rows is None:
            chain.stop = f"'{u.name}' ({getattr(u.target, '__name__', u.target)}) is not an epilogue op"
            break
        tried = []
        for row in rows:
            got = row.match(u, x)
            if isinstance(got, str):
                tried.append(f"{row.name}: {got}")
                continue
            break
        else:
            chain.stop = f"'{u.name}' does not match an epilogue op ({'; '.join(tried)})"
            chain.stop_node = u
            chain.near_miss = True
            break
        consumed: list[Node] = []
        half = _other_half(chain, u, got) if row.product is not None and isinstance(got, Node) else None
        if half is not None:
            got, consumed = half
            row = EPILOGUE_OPS[row.product]  # type: ignore[index]
        elif row.product is not None and isinstance(got, Node):
            product = _match_product(chain, u, got)
            if not isinstance(product, str):
                got, consumed = product
                row = EPILOGUE_OPS[row.product]
            elif defer and not chain.steps and (taker := _sibling_taking(chain, u, got)) is not None:
                chain.stop = (f"'{u.name}' goes with the chain of '{taker.name}', which takes this matmul "
                              "in as its second product")
                chain.stop_node = u
                chain.deferred = True
                break
        made = _val(u)
        if isinstance(made, torch.Tensor) and str(made.dtype).removeprefix("torch.") not in SUPPORTED_DTYPES:
            chain.stop = (f"'{u.name}' makes {made.dtype} (its operand promotes the chain); only float16, "
                          "bfloat16 and float32 results are fused")
            chain.stop_node = u
            break
        chain.nodes += pending_views + consumed + [u]
        chain.checks += pending_checks + checks
        pending_views, pending_checks = [], []
        chain.steps.append((row, got))
        x = u
        if row.name == "cast" and _narrowing(got):
            chain.stop = "a narrowing cast ends the chain (the epilogue rounds only once, at the store)"
            break
    if chain.nodes and chain.nodes[-1] is not chain.root:
        # A view inside the chain changes the output shape: the fused op makes
        # [M, N] (or a's leading dims) and a view restores the chain's shape.
        views = [n for n in chain.nodes if n.target in VIEW_TARGETS]
        chain.out_view = views[-1] if views else None


def _is_only_root_bias(chain: EpilogueChain) -> bool:
    return chain.nodes == [chain.root] and [op.name for op, _ in chain.steps] == ["bias"]


def match_chain(node: Node, *, defer: bool = True) -> EpilogueChain:
    """The chain rooted at matmul ``node`` (``chain.reason`` set if declined); ``defer``:
    see :func:`_walk`."""
    chain = EpilogueChain(root=node)
    root = match_matmul(node)
    if isinstance(root, str):
        chain.reason = root
        return chain
    chain.a, chain.b, chain.weight_layout = root.a, root.b, root.weight_layout
    chain.steps = list(root.steps)
    chain.nodes = [node]
    _walk(chain, defer)
    write = first_write_within(chain.end, chain.nodes) if chain.nodes[-1] is not node else None
    if write is not None:
        chain.reason = (f"'{write.name}' ({write.target}) writes in place between the matmul and the chain's "
                        f"end '{chain.end.name}'; the fused op, placed at the end, would read what it wrote")
        return chain
    if chain.nodes == [node] and not chain.steps:
        chain.reason = f"nothing to fuse after the matmul: {chain.stop}"
        chain.plain = not chain.deferred  # a deferred matmul is left for its sibling's chain
    elif _is_only_root_bias(chain):
        chain.reason = (
            f"only the matmul's own bias, which its addmm or linear already applies; {chain.stop}"
        )
        chain.plain = True
    return chain


def find_epilogue_chains(gm: GraphModule, *, recursive: bool = False) -> list[EpilogueChain]:
    """Every matmul root in ``gm``'s graph (and, with ``recursive``, in every
    subgraph such as ``cond`` branches) and its chain, fusable or declined
    (``chain.reason``), in graph order.

    When two chains would claim the same node (a residual that is itself a
    matmul), the later one is reported as overlapping, as the pass, which
    rewrites one chain at a time, would see it.
    """
    if recursive:
        from branchyard.fx.graph_walk import iter_graph_modules

        return [c for sub in iter_graph_modules(gm) for c in find_epilogue_chains(sub)]
    chains = []
    claimed: dict[Node, Node] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in MATMUL_ROOTS:
            chain = match_chain(node)
            if chain.fusable:
                other = next((claimed[n] for n in chain.nodes if n in claimed), None)
                if other is not None:
                    chain.reason = f"its chain overlaps the chain of '{other.name}', which is fused first"
                else:
                    claimed.update((n, node) for n in chain.nodes)
            chains.append(chain)
    return chains
