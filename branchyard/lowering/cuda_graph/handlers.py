"""The control-flow handlers of the CUDA-graph lowering, as one table.

Each higher-order operator the lowering understands has one
:class:`ControlFlowHandler`: how its FX arguments unpack, how it is *evaluated*
(checked and run once per body, on fake tensors while validating and on real
ones while warming up) and how it is *captured* into a conditional node::

    while_loop(cond_fn, body_fn, carried, additional)
        evaluate: check carries and predicate; run cond_fn, body_fn, cond_fn once
        capture:  bufs <- carried; step(h, cond_fn(*bufs))
                  WHILE(h) { new = body_fn(*bufs); step(h, cond_fn(*new), bufs <- new) }
                  (a counter carry's `i + k` becomes the step kernel's `i += k`; a switch index
                  that is a router of one carry and loop invariants is set before the loop and,
                  for the next trip, by the step kernel: see _next_trip_router)
        run:      (eager fallback) a host loop, stopped after max_iterations trips
    cond(pred, true_fn, false_fn, operands)
        evaluate: check predicate; run both branches; branch outputs must agree
        capture:  step(h, pred); IF/ELSE(h) { outs = true_fn(...) } { outs = false_fn(...) }
                  (or two IF nodes on drivers older than CUDA 12.8)
    switch(index, branches, operands)
        evaluate: check index; run every branch; branch outputs must agree
        capture:  set(h, clamp(index, 0, n - 1)); SWITCH(h) { outs = branches[0](...) } ... { branches[n-1] }

``step`` is one kernel node: it copies the new loop carries into their buffers
and sets the handle from the predicate, which it evaluates itself when the
predicate is a 0-d comparison (:mod:`.patterns`) -- so a loop trip costs the
body's kernels plus one node. Branch outputs are written in place by the op
that makes them where it has an ``out=`` form, else copied by one kernel.

Semantics, as Python, that the capture reproduces on the device::

    def while_loop(cond_fn, body_fn, carried, additional):
        while cond_fn(*carried, *additional):          # at most max_iterations times
            carried = body_fn(*carried, *additional)
        return carried

    def switch(index, branches, operands):
        return branches[min(max(int(index), 0), len(branches) - 1)](*operands)   # clamp

(:mod:`branchyard.fx.control_flow` states these once for the library.)
:func:`switch` is :func:`branchyard.fx.control_flow.switch`, that reference,
usable as an FX ``call_function`` target on torch versions without
``torch.ops.higher_order.switch`` (torch < 2.14): the table maps both to the
same handler.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch

from branchyard.errors import LoweringError, MalformedGraphError, UnsupportedGraphError
from branchyard.fx.control_flow import switch
from branchyard.lowering.cuda_graph.patterns import IndexProgram

if TYPE_CHECKING:  # pragma: no cover
    from branchyard.lowering.cuda_graph.capture import ControlFlowInterpreter

__all__ = ["ControlFlowHandler", "HANDLERS", "handler_for", "is_switch_node", "switch", "TensorMeta"]


@dataclass(frozen=True)
class TensorMeta:
    """What a static output buffer needs: shape, strides, dtype."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @staticmethod
    def of(t: torch.Tensor) -> "TensorMeta":
        return TensorMeta(tuple(int(s) for s in t.shape), tuple(int(s) for s in t.stride()), t.dtype)

    def empty(self, device: torch.device) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=device)


# --------------------------------------------------------------------------- checks
def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}"
    return f"a {type(value).__name__} ({value!r})"


def check_predicate(interp: "ControlFlowInterpreter", value: Any, what: str) -> torch.Tensor:
    """A predicate must be a 0-d bool tensor on the lowering's device."""
    if isinstance(value, (tuple, list)) and len(value) == 1:
        value = value[0]
    device = interp.ctx.device
    ok = isinstance(value, torch.Tensor) and value.dtype == torch.bool and value.dim() == 0
    if ok and device is not None and value.device != device:
        ok = False
    if not ok:
        raise LoweringError(
            f"{what} must be a 0-d bool tensor on {device or 'the device'}, got {_describe(value)}",
            where=interp.where(),
            hint="compute the predicate with tensor ops (e.g. (x.sum() > 0)) so the device can read it at replay",
        )
    return value


def check_index(interp: "ControlFlowInterpreter", value: Any) -> None:
    if isinstance(value, int):
        return
    device = interp.ctx.device
    ok = (
        isinstance(value, torch.Tensor)
        and value.numel() == 1
        and not value.dtype.is_floating_point
        and not value.dtype.is_complex
        and value.dtype != torch.bool
    )
    if ok and device is not None and value.device != device:
        ok = False
    if not ok:
        raise LoweringError(
            f"switch index must be an int or a one-element integer tensor on {device or 'the device'}, got {_describe(value)}",
            where=interp.where(),
        )


def check_same_outputs(interp: "ControlFlowInterpreter", outs: list[tuple], labels: list[str]) -> list[TensorMeta]:
    """Every branch must return the same number of tensors with equal shapes and dtypes."""
    first = outs[0]
    for out, label in zip(outs, labels):
        for i, o in enumerate(out):
            if not isinstance(o, torch.Tensor):
                raise UnsupportedGraphError(
                    f"{label} output {i} is {_describe(o)}; only tensor outputs can be written to static buffers",
                    where=interp.where(),
                )
        if len(out) != len(first) or any(
            a.shape != b.shape or a.dtype != b.dtype for a, b in zip(out, first)
        ):
            raise MalformedGraphError(
                f"{label} returns {[_describe(o) for o in out]} but {labels[0]} returns {[_describe(o) for o in first]}",
                where=interp.where(),
                hint="all branches must return tensors of the same shapes and dtypes",
            )
    return [TensorMeta.of(o) for o in first]


# --------------------------------------------------------------------------- while_loop
def _while_unpack(args: tuple, kwargs: dict) -> tuple:
    # torch >= 2.14 adds a keyword mutated_arg_indices; functional graphs leave it empty.
    if kwargs.get("mutated_arg_indices"):
        raise UnsupportedGraphError(
            f"while_loop mutates its inputs (mutated_arg_indices={kwargs['mutated_arg_indices']!r})",
            hint="lower a functionalized graph (torch.export output) instead",
        )
    cond_fn, body_fn, carried, additional = args
    return cond_fn, body_fn, tuple(carried), tuple(additional)


def _while_evaluate(interp: "ControlFlowInterpreter", node: Any, cond_fn, body_fn, carried, additional) -> tuple:
    for i, c in enumerate(carried):
        if not isinstance(c, torch.Tensor):
            raise UnsupportedGraphError(
                f"loop carry {i} is {_describe(c)}; only tensors can be carried through a WHILE node",
                where=interp.where(),
                hint="carry a 0-d tensor instead of a Python number",
            )
    check_predicate(interp, interp.subgraph(cond_fn, (*carried, *additional), "cond_fn"), "while_loop cond_fn's result")
    outs = interp.subgraph(body_fn, (*carried, *additional), "body_fn")
    if len(outs) != len(carried):
        raise MalformedGraphError(
            f"body_fn returns {len(outs)} values for {len(carried)} loop carries", where=interp.where()
        )
    for i, (o, c) in enumerate(zip(outs, carried)):
        if not isinstance(o, torch.Tensor) or o.shape != c.shape or o.dtype != c.dtype or o.device != c.device:
            raise UnsupportedGraphError(
                f"loop carry {i} enters as {_describe(c)} but body_fn returns {_describe(o)}",
                where=interp.where(),
                hint="a WHILE node reuses one buffer per carry, so carries must keep shape, dtype and device",
            )
    # One more predicate on the body's result warms the loop-exit path too.
    check_predicate(interp, interp.subgraph(cond_fn, (*outs, *additional), "cond_fn"), "while_loop cond_fn's result")
    return tuple(outs)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


def _aliases(t: torch.Tensor, others: Sequence[torch.Tensor]) -> bool:
    ptr = t.untyped_storage().data_ptr()
    return any(ptr == o.untyped_storage().data_ptr() for o in others)


def _while_capture(interp: "ControlFlowInterpreter", node: Any, cond_fn, body_fn, carried, additional) -> tuple:
    from branchyard.lowering.cuda_graph.conditional_nodes import CondKind, TripCounter
    from branchyard.lowering.cuda_graph.patterns import Comparison

    ctx, b = interp.ctx, interp.ctx.builder
    # One static buffer per carry (never write the inputs), filled by one copy kernel.
    bufs = [torch.empty_like(c) for c in carried]
    b.copy_many(list(zip(bufs, carried)))
    counter = None
    if ctx.max_iterations is not None:
        # The step kernel resets it before the loop, counts trips and flags ctx.exhausted.
        counter = TripCounter(torch.empty((), dtype=torch.int64, device=ctx.device), ctx.max_iterations, ctx.exhausted)
    interp.keep(bufs, counter)

    def predicate(values: Sequence[torch.Tensor]) -> Any:
        p = interp.subgraph(cond_fn, (*values, *additional), "cond_fn", defer_predicate=True)[0]
        interp.keep(p)
        return p

    handle = b.new_handle()
    first = predicate(bufs)
    b.set_predicate((handle,), first, counter=counter, reset=True)
    counter_carry = _counter_carry(body_fn, cond_fn, bufs, first)
    skip, increment, read_by_predicate = {}, None, False
    if counter_carry is not None:  # the body's `i + k` becomes the step kernel's `i += k`
        k, node, by, read_by_predicate = counter_carry
        skip, increment = {node: bufs[k]}, (bufs[k], by)
    router = _next_trip_router(interp, body_fn, bufs, additional)
    if router is not None:  # trip 0's switch index, set before the loop
        switch_node, carry, program, n = router
        h_switch = b.new_handle()
        b.set_from_program(h_switch, program, n)  # what the switch's own set kernel would have run
        ctx.preset_switches[switch_node] = (h_switch, program)
    (body,) = b.add_node(CondKind.WHILE, handle, 1)
    with b.capture_into(body):
        try:
            outs = list(interp.subgraph(body_fn, (*bufs, *additional), "body_fn", substitute=skip))
        finally:
            # the switch takes its preset when it uses it (_switch_capture): still here, unused
            used = router is not None and ctx.preset_switches.pop(switch_node, None) is None
        # A carry returned unchanged needs no write-back. Anything else that shares memory with a
        # carry buffer (a swap, a transpose of itself) is read into a fresh tensor before any write.
        unchanged = [_same_view(o, buf) for o, buf in zip(outs, bufs)]
        for i, o in enumerate(outs):
            if not unchanged[i] and _aliases(o, bufs):
                outs[i] = o.clone()
        interp.keep(outs)
        # The predicate reads the new values, so the copies back can share its kernel node.
        pred = predicate(outs)
        if read_by_predicate and not isinstance(pred, Comparison):
            # A torch kernel reading the counter would run before the step kernel increments it.
            raise LoweringError(
                "internal: the loop predicate was evaluated by the set kernel before the loop but not inside it",
                where=interp.where(),
            )
        copies = [(buf, o) for buf, o, same in zip(bufs, outs, unchanged) if not same]
        next_index = after = None
        if used:
            # The switch read the handle set before the loop; the step sets it for the next trip,
            # reading the new carry where it was made (a contiguous copy source), else a kernel
            # after the step reads the carry buffer.
            if outs[carry].is_contiguous():
                next_index = (h_switch, with_router_input(program, outs[carry]), n)
            else:
                after = (h_switch, program, n)
        b.set_predicate((handle,), pred, counter=counter, copies=copies, increment=increment, next_index=next_index)
        if after is not None:
            b.set_from_program(*after)
    return tuple(bufs)


#: Whether a loop whose switch index is a router of one loop carry and loop invariants
#: (``argmax(mean(x, 0) @ w)``) computes the next trip's index in its step kernel, so a
#: trip runs one node fewer; benchmarks turn it off to compare.
ROTATE_ROUTER = True


def _next_trip_router(interp: "ControlFlowInterpreter", body_fn: Any, bufs: list[torch.Tensor],
                      additional: tuple) -> "tuple[Any, int, IndexProgram, int] | None":
    """``(switch, k, program, n)`` for a switch of ``n`` branches at the top of ``body_fn`` whose
    index is a router of carry ``k`` and loop invariants (``program``, on ``bufs[k]``), when
    the body writes no memory in place (so the router's inputs at a trip's end are the next
    trip's); else None. The loop then sets its handle before the loop and in each step kernel::

        before: WHILE { set_router(h, x, w); SWITCH(h) {...}; ...; step(x <- x') }
        after:  set_router(h, x, w); WHILE { SWITCH(h) {...}; ...; step_router(x <- x'; h = router(x', w)) }
    """
    from branchyard.fx.graph_walk import resolve_attr
    from branchyard.fx.mutation import may_write
    from branchyard.lowering.cuda_graph.patterns import RouterLogits, evaluate_index_chain, index_chain

    ctx = interp.ctx
    if not ROTATE_ROUTER or ctx.switch_as_ifs or not isinstance(body_fn, torch.fx.GraphModule):
        return None
    nodes = list(body_fn.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    values = [*bufs, *additional]
    if len(placeholders) != len(values) or any(may_write(n) for n in nodes):
        return None
    env: dict[Any, Any] = dict(zip(placeholders, values))
    for n in nodes:
        if n.op == "get_attr":
            env[n] = resolve_attr(body_fn, n.target)
    for switch_node in (n for n in nodes if is_switch_node(n)):
        found = index_chain(switch_node)
        if found is None or len(switch_node.args) < 2 or len(switch_node.args[1]) < 2:
            continue
        source, chain = found
        k = placeholders.index(source)
        program = evaluate_index_chain(chain, env) if k < len(bufs) else None
        if program is not None and isinstance(program.source, RouterLogits) and program.source.x is bufs[k]:
            return switch_node, k, program, len(switch_node.args[1])
    return None


def with_router_input(program: IndexProgram, x: torch.Tensor) -> IndexProgram:
    """``program`` (a router's) with ``x`` in place of the router's input."""
    from branchyard.lowering.cuda_graph.patterns import RowMean

    r = program.source
    a = replace(r.a, x=x) if isinstance(r.a, RowMean) else x
    return replace(program, source=replace(r, a=a))


def same_index_program(a: Any, b: IndexProgram) -> bool:
    """Whether ``a`` is the index program ``b``: the same steps on the same tensors (by memory and layout)."""
    from branchyard.lowering.cuda_graph.patterns import RouterLogits, RowMean

    def same(x: Any, y: Any) -> bool:
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            return _same_view(x, y) and x.device == y.device
        if isinstance(x, RowMean) and isinstance(y, RowMean):
            return x.keepdim == y.keepdim and same(x.x, y.x)
        if isinstance(x, RouterLogits) and isinstance(y, RouterLogits):
            return x.target is y.target and x.shape == y.shape and same(x.a, y.a) and same(x.w, y.w)
        return False

    return (isinstance(a, IndexProgram) and a.argmax == b.argmax and a.steps == b.steps
            and same(a.source, b.source))


def _counter_carry(body_fn: Any, cond_fn: Any, bufs: list[torch.Tensor], first_predicate: Any) -> tuple | None:
    """``(k, node, by, read)`` when carry ``k`` is a counter the step kernel can increment, else None
    (``read``: cond_fn reads it, so the predicate must stay a comparison for the set kernel).

    That is: body_fn returns ``bufs[k] + by`` (``by`` a Python int, ``bufs[k]`` a 0-d
    int64/int32 tensor) computed by ``node``, which nothing else reads and after which
    nothing may write carry ``k`` in place (:func:`_written_after`); and cond_fn
    reads carry ``k`` only as an operand of the comparison it returns, evaluated by
    the set kernel (so after the increment). Other readers of carry ``k`` in the body
    see the old value, as they should: the increment runs after the body.
    """
    from branchyard.lowering.cuda_graph.patterns import Comparison, match_increment

    if not isinstance(body_fn, torch.fx.GraphModule) or not isinstance(cond_fn, torch.fx.GraphModule):
        return None
    body_inputs = [n for n in body_fn.graph.nodes if n.op == "placeholder"]
    cond_inputs = [n for n in cond_fn.graph.nodes if n.op == "placeholder"]
    out_node = next(n for n in reversed(body_fn.graph.nodes) if n.op == "output")
    outs = list(out_node.args[0]) if isinstance(out_node.args[0], (tuple, list)) else [out_node.args[0]]
    cond_out = next(n for n in reversed(cond_fn.graph.nodes) if n.op == "output").args[0]
    cond_out = cond_out[0] if isinstance(cond_out, (tuple, list)) and len(cond_out) == 1 else cond_out
    for k, buf in enumerate(bufs):
        if buf.dim() != 0 or buf.dtype not in (torch.int64, torch.int32) or k >= min(len(outs), len(body_inputs)):
            continue
        node = outs[k]
        by = match_increment(node, body_inputs[k])
        if by is None or len(node.users) != 1 or outs.count(node) != 1 or _written_after(node, body_inputs[k]):
            continue
        info = torch.iinfo(buf.dtype)
        if not info.min <= by <= info.max:
            continue
        readers = set(cond_inputs[k].users) if k < len(cond_inputs) else set()
        if readers and not (readers == {cond_out} and isinstance(first_predicate, Comparison)):
            continue
        return k, node, by, bool(readers)
    return None


def _written_after(node: Any, carry: Any) -> bool:
    """Whether a node after ``node`` may write the carry buffer ``carry`` reads: directly,
    through a view, or through memory nobody can trace (the step kernel would add to the
    written value, eager's sum read the one before). Other inputs and attributes are other
    memory: the capture's carry buffers are fresh."""
    from branchyard.fx.mutation import node_writes, view_base

    for later in _nodes_after(node):
        writes = node_writes(later)
        if writes.elsewhere:
            return True
        for value in writes.values():
            base = view_base(value) if isinstance(value, torch.fx.Node) else None
            if base is None or base is carry or base.op not in ("placeholder", "get_attr"):
                return True
    return False


def _nodes_after(node: Any) -> Iterator[Any]:
    node = node.next
    while node.op != "root":
        yield node
        node = node.next


def _while_run(interp: "ControlFlowInterpreter", node: Any, cond_fn, body_fn, carried, additional) -> tuple:
    limit, trips = interp.ctx.max_iterations, 0
    while bool(interp.subgraph(cond_fn, (*carried, *additional), "cond_fn")[0]):
        if limit is not None and trips >= limit:
            interp.ctx.exhausted_eagerly = True
            break
        carried = interp.subgraph(body_fn, (*carried, *additional), "body_fn")
        trips += 1
    return tuple(carried)


# --------------------------------------------------------------------------- cond
def _cond_unpack(args: tuple, kwargs: dict) -> tuple:
    pred, true_fn, false_fn, operands = args
    return pred, true_fn, false_fn, tuple(operands)


def _cond_evaluate(interp: "ControlFlowInterpreter", node: Any, pred, true_fn, false_fn, operands) -> tuple:
    check_predicate(interp, pred, "cond predicate")
    outs = [interp.subgraph(true_fn, operands, "true_fn"), interp.subgraph(false_fn, operands, "false_fn")]
    interp.ctx.out_meta[node] = check_same_outputs(interp, outs, ["true_fn", "false_fn"])
    return outs[0]


def _fill(interp: "ControlFlowInterpreter", fn: Any, operands: tuple, outs: list[torch.Tensor], label: str) -> None:
    """Run a branch so that its results land in ``outs``: in place where an op can, else copied."""
    results = interp.subgraph(fn, operands, label, targets=outs)
    interp.ctx.builder.copy_many([(o, r) for o, r in zip(outs, results) if not _same_view(o, r)])


def _output_buffers(interp: "ControlFlowInterpreter", node: Any) -> list[torch.Tensor]:
    """The buffers a cond/switch writes: the enclosing branch's own outputs where it returns them, else fresh."""
    passed = interp.hop_targets.get(node, {})
    outs = []
    for i, m in enumerate(interp.ctx.out_meta[node]):
        t = passed.get(i)
        outs.append(t if t is not None and tuple(t.shape) == m.shape and t.dtype == m.dtype else m.empty(interp.ctx.device))
    interp.keep(outs)
    return outs


def _cond_capture(interp: "ControlFlowInterpreter", node: Any, pred, true_fn, false_fn, operands) -> tuple:
    from branchyard.lowering.cuda_graph.conditional_nodes import CondKind

    ctx, b = interp.ctx, interp.ctx.builder
    outs = _output_buffers(interp, node)
    if ctx.if_else_one_node:
        handle = b.new_handle()
        b.set_predicate((handle,), pred)
        then_body, else_body = b.add_node(CondKind.IF, handle, 2)
        with b.capture_into(then_body):
            _fill(interp, true_fn, operands, outs, "true_fn")
        with b.capture_into(else_body):
            _fill(interp, false_fn, operands, outs, "false_fn")
    else:
        h_then, h_else = b.new_handle(), b.new_handle()
        b.set_predicate((h_then, h_else), pred)
        for handle, fn, label in ((h_then, true_fn, "true_fn"), (h_else, false_fn, "false_fn")):
            (body,) = b.add_node(CondKind.IF, handle, 1)
            with b.capture_into(body):
                _fill(interp, fn, operands, outs, label)
    return tuple(outs)


def _cond_run(interp: "ControlFlowInterpreter", node: Any, pred, true_fn, false_fn, operands) -> tuple:
    return interp.subgraph(true_fn if bool(pred) else false_fn, operands, "true_fn" if bool(pred) else "false_fn")


# --------------------------------------------------------------------------- switch
def _switch_unpack(args: tuple, kwargs: dict) -> tuple:
    index, branches, operands = args
    return index, tuple(branches), tuple(operands)


def _switch_evaluate(interp: "ControlFlowInterpreter", node: Any, index, branches, operands) -> tuple:
    check_index(interp, index)
    if not branches:
        raise MalformedGraphError("switch needs at least one branch", where=interp.where())
    labels = [f"branch {i}" for i in range(len(branches))]
    outs = [interp.subgraph(fn, operands, label) for fn, label in zip(branches, labels)]
    interp.ctx.out_meta[node] = check_same_outputs(interp, outs, labels)
    return outs[0]


def _switch_capture(interp: "ControlFlowInterpreter", node: Any, index, branches, operands) -> tuple:
    from branchyard.lowering.cuda_graph.conditional_nodes import CondKind

    n = len(branches)
    if isinstance(index, int) or n == 1:
        # A constant index (or one branch) selects at lowering time: no node needed.
        i = min(max(int(index), 0), n - 1) if isinstance(index, int) else 0
        return interp.subgraph(branches[i], operands, f"branch {i}")
    ctx, b = interp.ctx, interp.ctx.builder
    outs = _output_buffers(interp, node)
    preset = ctx.preset_switches.get(node)
    if preset is not None and same_index_program(index, preset[1]):
        del ctx.preset_switches[node]  # taken: set before the loop and by each trip's step (_next_trip_router)
        return _fill_switch(interp, b, preset[0], branches, operands, outs)
    # A preset handle the index turned out not to match is set here like a new one: a handle
    # must belong to a conditional node, and this set kernel overrides the loop's.
    handle = preset[0] if preset is not None else None
    if isinstance(index, IndexProgram) and not ctx.switch_as_ifs:
        handle = handle if handle is not None else b.new_handle()
        b.set_from_program(handle, index, n)  # the index's argmax/clamp/remainder in the set kernel
        return _fill_switch(interp, b, handle, branches, operands, outs)
    if isinstance(index, IndexProgram):
        index = index.evaluate()
    idx = index.reshape(())  # the set kernels read any integer dtype: no conversion kernel
    interp.keep(idx)
    if ctx.switch_as_ifs:
        # How XLA lowers an n-way case: n IF nodes, each testing index == k (kept for comparison),
        # their handles set by one kernel or, with if_chain_kernels="each", one kernel per IF node.
        handles = [b.new_handle() for _ in branches]
        b.set_onehot(handles, idx, per_kernel=1 if ctx.if_chain_kernels == "each" else 8)
        for k, (h, fn) in enumerate(zip(handles, branches)):
            (body,) = b.add_node(CondKind.IF, h, 1)
            with b.capture_into(body):
                _fill(interp, fn, operands, outs, f"branch {k}")
        return tuple(outs)
    handle = handle if handle is not None else b.new_handle()
    b.set_from_index(handle, idx, n)
    return _fill_switch(interp, b, handle, branches, operands, outs)


def _fill_switch(interp: "ControlFlowInterpreter", b: Any, handle: Any, branches: tuple, operands: tuple, outs: list) -> tuple:
    """A SWITCH node on ``handle`` (already set), branch ``i`` captured into its body ``i``."""
    from branchyard.lowering.cuda_graph.conditional_nodes import CondKind

    bodies = b.add_node(CondKind.SWITCH, handle, len(branches))
    for i, (body, fn) in enumerate(zip(bodies, branches)):
        with b.capture_into(body):
            _fill(interp, fn, operands, outs, f"branch {i}")
    return tuple(outs)


def _switch_run(interp: "ControlFlowInterpreter", node: Any, index, branches, operands) -> tuple:
    i = int(index.reshape(()).item()) if isinstance(index, torch.Tensor) else int(index)
    k = min(max(i, 0), len(branches) - 1)
    return interp.subgraph(branches[k], operands, f"branch {k}")


# --------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class ControlFlowHandler:
    """How one control-flow operator is unpacked, evaluated, captured and run eagerly."""

    name: str
    unpack: Callable[[tuple, dict], tuple]
    evaluate: Callable[..., tuple]
    capture: Callable[..., tuple]
    run: Callable[..., tuple]
    #: conditional nodes one execution adds: (kind, count); cond's count depends on the driver
    node_kind: str


HANDLERS: dict[str, ControlFlowHandler] = {
    h.name: h
    for h in (
        ControlFlowHandler("while_loop", _while_unpack, _while_evaluate, _while_capture, _while_run, "WHILE"),
        ControlFlowHandler("cond", _cond_unpack, _cond_evaluate, _cond_capture, _cond_run, "IF"),
        ControlFlowHandler("switch", _switch_unpack, _switch_evaluate, _switch_capture, _switch_run, "SWITCH"),
    )
}

#: Plain Python callables that stand for a higher-order operator.
_ALIASES: dict[Callable, str] = {switch: "switch"}


def handler_for(target: Any) -> ControlFlowHandler | None:
    """The handler of an FX ``call_function`` target, or ``None`` for ordinary ops."""
    if isinstance(target, torch._ops.HigherOrderOperator):
        # Other HOPs (wrap_with_set_grad_enabled, invoke_subgraph, ...) run as ordinary ops.
        return HANDLERS.get(target.name())
    try:
        alias = _ALIASES.get(target)
    except TypeError:  # unhashable target
        return None
    return HANDLERS[alias] if alias else None


def is_switch_node(node: Any) -> bool:
    """Whether the FX ``node`` calls a switch (torch's operator or branchyard's stand-in)."""
    return node.op == "call_function" and handler_for(node.target) is HANDLERS["switch"]
