"""Run an FX program through the control-flow handlers: validate, warm up, capture.

:class:`ControlFlowInterpreter` is a ``torch.fx.Interpreter`` whose
``call_function`` sends ``while_loop``, ``cond`` and ``switch`` to the handler
table (:mod:`.handlers`) and runs every other node as torch would. The same
walk serves four phases (:class:`Phase`):

``VALIDATE``  on fake tensors: every body and branch runs once; predicates,
              loop carries, branch outputs, devices and RNG are checked.
``WARMUP``    on real tensors, on a side stream: every body and branch runs once
              (untaken branches included), so lazy initialisation (cuBLAS
              handles, Triton autotuning, allocator growth) happens before capture.
``CAPTURE``   inside ``torch.cuda.graph``: plain ops are captured as they run;
              control flow becomes conditional nodes whose bodies are captured
              by recursion on side streams. Patterns (:mod:`.patterns`) save
              nodes: a 0-d comparison feeding a conditional node is left to
              the set kernel, a loop counter's ``i + k`` to the loop's step
              kernel, and a branch output is written in place by an op's
              ``out=`` form.
``EAGER``     the fallback without CUDA when ``max_iterations`` is set: control
              flow runs on the host, loops stopped after ``max_iterations`` trips.

:class:`CudaGraphModule` drives the phases and replays the graph.
"""

from __future__ import annotations

import contextlib
import enum
import operator
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.fx
from torch.fx import GraphModule, Node
from torch.utils import _pytree as pytree

from branchyard.errors import BranchyardError, LoweringError, UnsupportedGraphError
from branchyard.fx.call_arguments import bind_call
from branchyard.fx.mutation import nothing_written_between
from branchyard.lowering.cuda_graph.handlers import HANDLERS, TensorMeta, handler_for, is_switch_node
from branchyard.lowering.cuda_graph.patterns import (
    COMPARISONS,
    IndexProgram,
    RouterLogits,
    RowMean,
    match_comparison,
    out_form,
    set_kernel_step,
)

__all__ = [
    "Phase",
    "LoweringContext",
    "ControlFlowInterpreter",
    "CudaGraphFallbackWarning",
    "CudaGraphModule",
    "RNG_FUNCTION_NAMES",
    "RNG_METHOD_NAMES",
]


class Phase(enum.Enum):
    VALIDATE = "validate"
    WARMUP = "warmup"
    CAPTURE = "capture"
    EAGER = "eager"


#: torch-level functions that draw random numbers (graphs from torch.compile are torch-level).
RNG_FUNCTION_NAMES = frozenset(
    "rand randn randint rand_like randn_like randint_like bernoulli multinomial normal randperm poisson "
    "dropout dropout1d dropout2d dropout3d alpha_dropout feature_alpha_dropout rrelu native_dropout".split()
)
#: Tensor methods that draw random numbers.
RNG_METHOD_NAMES = frozenset(
    "uniform_ normal_ bernoulli bernoulli_ random_ exponential_ geometric_ cauchy_ log_normal_".split()
)


def _in(target: Any, table: dict) -> bool:
    try:
        return target in table
    except TypeError:  # unhashable target
        return False


#: Arguments that make a random op draw nothing: name -> the value that does. A model in eval
#: mode calls dropout with ``train=False``; attention's dropout is ``dropout_p=0.0`` unless asked.
RNG_OFF_ARGUMENTS: dict[str, Any] = {"train": False, "training": False, "p": 0.0, "dropout_p": 0.0}


def _draws_nothing(target: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a random op called with these arguments draws no random numbers, however
    it binds (see :data:`RNG_OFF_ARGUMENTS`): ``aten.dropout(x, 0.1, False)`` does not, for one."""
    calls = bind_call(target, args, kwargs)
    return bool(calls) and all(_turned_off(call.arguments) for call in calls)


def _turned_off(bound: dict[str, Any]) -> bool:
    for name, off in RNG_OFF_ARGUMENTS.items():
        value = bound.get(name)
        if isinstance(value, (bool, int, float)) and type(value) is type(off) and value == off:
            return True
        if isinstance(off, float) and isinstance(value, int) and not isinstance(value, bool) and value == 0:
            return True
    return False


def _is_rng(op: str, target: Any) -> bool:
    if op == "call_method":
        return target in RNG_METHOD_NAMES
    if isinstance(target, torch._ops.OpOverloadPacket):
        target = target.default
    if isinstance(target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in target.tags
    return getattr(target, "__name__", None) in RNG_FUNCTION_NAMES


@dataclass
class LoweringContext:
    """State shared by every interpreter of one lowering (all nesting levels)."""

    phase: Phase
    device: torch.device | None
    max_iterations: int | None = None
    if_else_one_node: bool = True
    switch_as_ifs: bool = False
    builder: Any = None  # ConditionalBuilder during CAPTURE
    exhausted: torch.Tensor | None = None  # set by loops that hit max_iterations
    exhausted_eagerly: bool = False  # the same, in the EAGER phase
    if_chain_kernels: str = "one"  # switch as IF nodes: "one" set kernel for all, or "each" its own
    out_meta: dict[Node, list[TensorMeta]] = field(default_factory=dict)
    #: every tensor-valued node's (shape, dtype) seen while validating; None where runs disagreed
    node_meta: dict[Node, tuple | None] = field(default_factory=dict)
    keepalive: list[Any] = field(default_factory=list)
    #: control-flow sites seen while validating: (kind, path, depth)
    sites: list[tuple[str, str, int]] = field(default_factory=list)
    #: VALIDATE: the fake mode the program runs under (its parameters and buffers are faked too)
    fake_mode: Any = None
    #: CAPTURE: switch node -> (handle, index program) a loop sets before and after each trip,
    #: while the loop's body is captured; the switch removes its entry when it takes the handle
    preset_switches: dict[Node, tuple[Any, Any]] = field(default_factory=dict)


class ControlFlowInterpreter(torch.fx.Interpreter):
    """An FX interpreter that routes control flow through :data:`.handlers.HANDLERS`."""

    def __init__(
        self,
        gm: GraphModule,
        ctx: LoweringContext,
        path: tuple[str, ...] = (),
        depth: int = 0,
        *,
        targets: Sequence[torch.Tensor] | None = None,
        defer_predicate: bool = False,
        substitute: dict[Node, Any] | None = None,
    ):
        super().__init__(gm, garbage_collect_values=False)
        self.extra_traceback = False  # our errors already name the node; keep messages short
        self.ctx = ctx
        self.path = path
        self.depth = depth
        self._node: Node | None = None
        #: CAPTURE: node -> buffer its op writes with out= ; control-flow node -> {output index: buffer}
        self.targets: dict[Node, torch.Tensor] = {}
        self.hop_targets: dict[Node, dict[int, torch.Tensor]] = {}
        if targets is not None and ctx.phase is Phase.CAPTURE:
            self._plan_targets(list(targets))
        self.defer_predicate = defer_predicate and ctx.phase is Phase.CAPTURE
        #: CAPTURE: nodes not run at all, their value given (a counter the step kernel increments)
        self.substitute = (substitute or {}) if ctx.phase is Phase.CAPTURE else {}

    def _plan_targets(self, targets: list[torch.Tensor]) -> None:
        """Map each graph output to the buffer it should land in (used by conditional-node bodies).

        Only the op that produces an output writes its target, once; the target is fresh
        memory no operand aliases, so writing it early is safe. A control-flow node's
        outputs pass the targets down to its own bodies.
        """
        out_node = next(n for n in reversed(self.graph.nodes) if n.op == "output")
        outs = out_node.args[0]
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        for value, target in zip(outs, targets):
            if not isinstance(value, Node) or value.op != "call_function" or value in self.targets:
                continue
            if handler_for(value.target) is None and value.target is not operator.getitem:
                self.targets[value] = target
            elif value.target is operator.getitem and isinstance(value.args[0], Node):
                hop, i = value.args[0], value.args[1]
                if handler_for(hop.target) in (HANDLERS["cond"], HANDLERS["switch"]):
                    self.hop_targets.setdefault(hop, {}).setdefault(i, target)

    # -- helpers for handlers ----------------------------------------------------
    def where(self) -> str:
        """``"while_loop 'while_loop' > body_fn > node 'cond'"`` -- the place being processed."""
        parts = list(self.path)
        if self._node is not None:
            parts.append(f"node {self._node.name!r}")
        return " > ".join(parts) or "program"

    def keep(self, *values: Any) -> None:
        """Keep tensors made during capture alive until the capture ends (the pool must not reuse them)."""
        if self.ctx.phase is Phase.CAPTURE:
            self.ctx.keepalive.extend(values)

    def subgraph(
        self,
        fn: Any,
        args: tuple,
        label: str,
        *,
        targets: Sequence[torch.Tensor] | None = None,
        defer_predicate: bool = False,
        substitute: dict[Node, Any] | None = None,
    ) -> tuple:
        """Run a body/branch (a GraphModule, or any callable) one level down; outputs as a tuple.

        While capturing, ``targets`` are buffers the outputs should be written into
        where an op can do so in place (compare each output with its target before
        copying), ``defer_predicate`` lets a final 0-d comparison come back as a
        :class:`~.patterns.Comparison` for the set kernel instead of a bool tensor, and
        ``substitute`` maps nodes of ``fn`` to values used instead of running them.
        """
        path = (*self.path, f"node {self._node.name!r}" if self._node is not None else "?", label)
        if isinstance(fn, GraphModule):
            sub = ControlFlowInterpreter(
                fn, self.ctx, path, self.depth + 1, targets=targets, defer_predicate=defer_predicate, substitute=substitute
            )
            out = sub.run(*args)
        else:
            out = fn(*args)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    def _feeds_only_conditionals(self, n: Node) -> bool:
        """Whether every use of ``n`` is as a cond predicate or (when deferring) the graph's sole
        output, with nothing written in place in between (the set kernel compares at the use)."""
        for user in n.users:
            if user.op == "output":
                outs = user.args[0]
                if not (self.defer_predicate and (outs is n or (isinstance(outs, (tuple, list)) and list(outs) == [n]))):
                    return False
            elif not (handler_for(user.target) is HANDLERS["cond"] and user.args and user.args[0] is n):
                return False
            if not nothing_written_between(n, user):
                return False
        return bool(n.users)

    # -- Interpreter overrides ---------------------------------------------------
    def run_node(self, n: Node) -> Any:
        self._node = n
        if n in self.substitute:
            return self.substitute[n]
        if self.ctx.phase is Phase.CAPTURE and n.op == "call_function" and _in(n.target, COMPARISONS):
            if self._feeds_only_conditionals(n):
                args, kwargs = self.fetch_args_kwargs_from_env(n)
                deferred = match_comparison(n.target, args, kwargs)
                if deferred is not None:
                    self.ctx.keepalive.append(deferred)
                    return deferred
        if self.ctx.phase is Phase.CAPTURE and n.op == "call_function":
            step = set_kernel_step(n.target)
            if step is not None and step[0](n, is_switch_node):
                args, kwargs = self.fetch_args_kwargs_from_env(n)
                deferred = step[1](n.target, args, kwargs)
                if deferred is not None:
                    self.ctx.keepalive.append(deferred)
                    return deferred
            if not is_switch_node(n):
                self._materialize_index_programs(n)
        try:
            result = super().run_node(n)
        except BranchyardError:
            raise
        except Exception as exc:
            if self.ctx.phase is not Phase.VALIDATE:
                raise
            raise LoweringError(
                f"cannot be lowered: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                where=self.where(),
                hint="everything inside the program must run on the device without reading values on the host "
                "(no .item(), no data-dependent shapes)",
            ) from exc
        if self.ctx.phase is Phase.CAPTURE:
            self.ctx.keepalive.append(result)
        elif self.ctx.phase is Phase.VALIDATE:
            self._check_devices(n, result)
            self._record_meta(n, result)
        return result

    def _materialize_index_programs(self, n: Node) -> None:
        """Index steps (or router steps) deferred for a set kernel whose consumer turned out
        not to fit (a step the kernel cannot compute): run them as torch kernels after all."""
        for inp in n.all_input_nodes:
            value = self.env.get(inp)
            if isinstance(value, (IndexProgram, RouterLogits, RowMean)):
                self.env[inp] = value.evaluate()
                self.ctx.keepalive.append(self.env[inp])

    def _record_meta(self, n: Node, result: Any) -> None:
        meta = (tuple(result.shape), result.dtype) if isinstance(result, torch.Tensor) else None
        if n in self.ctx.node_meta and self.ctx.node_meta[n] != meta:
            meta = None  # the same graph ran on different shapes: never write it in place
        self.ctx.node_meta[n] = meta

    def _check_devices(self, n: Node, result: Any) -> None:
        device = self.ctx.device
        if device is None or n.op == "output":
            return
        for leaf in pytree.tree_leaves(result):
            if isinstance(leaf, torch.Tensor) and leaf.device != device:
                raise LoweringError(
                    f"produces a tensor on {leaf.device}; a CUDA graph only replays work on {device}",
                    where=self.where(),
                    hint="move inputs and parameters to the device and create tensors with device=<input>.device",
                )

    def get_attr(self, target: Any, args: tuple, kwargs: dict) -> Any:
        value = super().get_attr(target, args, kwargs)
        if self.ctx.phase is Phase.VALIDATE and self.ctx.fake_mode is not None and isinstance(value, torch.Tensor):
            # a buffer the program writes (a step counter, a KV cache) must not change because
            # the program was validated: fake tensors of small constants compute real values
            return self.ctx.fake_mode.from_tensor(value)
        return value

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        handler = handler_for(target)
        if handler is None:
            self._check_rng("call_function", target, args, kwargs)
            if self._node in self.targets:
                written = self._write_in_place(target, args, kwargs, self.targets[self._node])
                if written is not None:
                    return written
            return super().call_function(target, args, kwargs)
        unpacked = handler.unpack(args, kwargs)
        if self.ctx.phase is Phase.VALIDATE:
            self.ctx.sites.append((handler.name, self.where(), self.depth))
        if self.ctx.phase is Phase.CAPTURE:
            return handler.capture(self, self._node, *unpacked)
        if self.ctx.phase is Phase.EAGER:
            return handler.run(self, self._node, *unpacked)
        return handler.evaluate(self, self._node, *unpacked)

    def _write_in_place(self, target: Any, args: tuple, kwargs: dict, buffer: torch.Tensor) -> torch.Tensor | None:
        """``target(*args, out=buffer)`` when it has an out form and the validated result matches ``buffer``."""
        if "out" in kwargs or self.ctx.node_meta.get(self._node) != (tuple(buffer.shape), buffer.dtype):
            return None
        form = out_form(target, args, kwargs)
        if form is None:
            return None
        form(*args, **kwargs, out=buffer)
        return buffer

    def call_module(self, target: str, args: tuple, kwargs: dict) -> Any:
        sub = self.fetch_attr(target)
        if isinstance(sub, GraphModule) and not kwargs:
            # A hand-built or traced sub-program: walk it here so its control flow is lowered too.
            path = (*self.path, f"module {target!r}")
            return ControlFlowInterpreter(sub, self.ctx, path, self.depth).run(*args)
        return super().call_module(target, args, kwargs)

    def call_method(self, target: str, args: tuple, kwargs: dict) -> Any:
        self._check_rng("call_method", target)
        return super().call_method(target, args, kwargs)

    def _check_rng(self, op: str, target: Any, args: tuple = (), kwargs: dict | None = None) -> None:
        if self.depth == 0 or self.ctx.phase is not Phase.VALIDATE or not _is_rng(op, target):
            return
        if op == "call_function" and _draws_nothing(target, args, kwargs or {}):
            return  # eval-mode dropout, attention without dropout: deterministic
        name = getattr(target, "__name__", str(target))
        raise UnsupportedGraphError(
            f"random op {name} inside a loop body or branch: a CUDA graph replays its RNG offset unchanged, "
            "so every iteration would draw the same numbers",
            where=self.where(),
            hint="draw the random numbers outside the control flow and pass them in",
        )


# --------------------------------------------------------------------------- fallback warnings
class CudaGraphFallbackWarning(UserWarning):
    """The CUDA-graph lowering fell back to eager execution (the message says why)."""


_WARNED: set[str] = set()


def warn_fallback(reason: str) -> None:
    """Warn once per distinct reason that the lowering runs eagerly."""
    if reason in _WARNED:
        return
    _WARNED.add(reason)
    warnings.warn(f"branchyard.lowering.cuda_graph runs the program eagerly: {reason}", CudaGraphFallbackWarning, stacklevel=3)


# --------------------------------------------------------------------------- the module
def _graph_timing() -> Any:
    """Warm-up and capture: NVGEMM ops tune (warm-up) and look up (capture) their choice for device time."""
    try:
        from branchyard.lowering.nvgemm import timing_mode
    except ImportError:  # an nvgemm without timing modes: it tunes as it always does
        return contextlib.nullcontext()
    return timing_mode("device")


def _as_graph_module(program: Any) -> GraphModule:
    if isinstance(program, torch.export.ExportedProgram):
        return program.module()
    if isinstance(program, GraphModule):
        return program
    raise LoweringError(
        f"expected a torch.export.ExportedProgram or torch.fx.GraphModule, got {type(program).__name__}",
        where="cuda_graph(program)",
    )


def _fake_inputs(inputs: Sequence[Any]) -> tuple[Any, list[Any]]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    return mode, [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in inputs]


def validate(gm: GraphModule, inputs: Sequence[Any], ctx: LoweringContext) -> Any:
    """Run the VALIDATE phase on fake copies of ``inputs`` and of ``gm``'s tensors; returns the fake outputs."""
    ctx.phase = Phase.VALIDATE
    mode, fakes = _fake_inputs(inputs)
    for i, (node, x) in enumerate(zip([n for n in gm.graph.nodes if n.op == "placeholder"], inputs)):
        if isinstance(x, torch.Tensor) and ctx.device is not None and x.device != ctx.device:
            # A host predicate is the common way to get here: say so, since the
            # fix (compute the predicate on the device) differs from a plain copy.
            preds = [
                u.name
                for u in node.users
                if u.target is torch.ops.higher_order.cond and u.args and u.args[0] is node
            ]
            role = f" and is the predicate of cond {preds[0]!r}" if preds else ""
            raise LoweringError(
                f"input {i} is on {x.device}{role}; the program is lowered for {ctx.device}",
                where=f"placeholder {node.name!r}",
                hint="pass example inputs that live on the device; a cond predicate must be a 0-d bool tensor there",
            )
    ctx.fake_mode = mode
    try:
        with mode:
            return ControlFlowInterpreter(gm, ctx).run(*fakes)
    finally:
        ctx.fake_mode = None


def written_attributes(gm: GraphModule) -> list[torch.Tensor]:
    """The parameters and buffers of ``gm`` (bodies included) that an op of its graphs writes in
    place (:func:`branchyard.fx.mutation.written_roots`): a model's step counter, KV cache,
    batch-norm statistics in train mode."""
    from branchyard.fx.graph_walk import iter_graph_modules, resolve_attr
    from branchyard.fx.mutation import written_roots

    written: dict[int, torch.Tensor] = {}
    for sub in iter_graph_modules(gm):
        for node in written_roots(sub.graph):
            if node.op == "get_attr":
                t = resolve_attr(sub, node.target)
                if isinstance(t, torch.Tensor):
                    written.setdefault(id(t), t)
    return list(written.values())


def static_input(x: Any) -> Any:
    """The tensor a capture reads in place of the input ``x``, which each call copies ``x`` into
    unless they share memory: a copy of ``x``, except for a parameter (``torch.compile``
    passes a model's parameters as inputs), which the graph reads where it lives -- a call
    copies no weights, and a parameter updated in place is seen by the next replay."""
    if isinstance(x, torch.nn.Parameter):
        return x.detach()
    return x.detach().clone() if isinstance(x, torch.Tensor) else x


def inputs_written_by(run: Any, inputs: Sequence[Any]) -> list[int]:
    """``run()``, then the positions of the tensors in ``inputs`` it wrote in place (their
    version counters moved): a KV cache or scratch tensor the program updates, which a replay
    writes in its static copy and must copy back to the caller's tensor."""
    versions = [x._version if isinstance(x, torch.Tensor) else None for x in inputs]
    run()
    return [i for i, (x, v) in enumerate(zip(inputs, versions)) if isinstance(x, torch.Tensor) and x._version != v]


@contextlib.contextmanager
def restoring_written_attributes(gm: GraphModule):
    """Run the block, then put back every tensor :func:`written_attributes` names as it was before:
    a warm-up runs the program for real, and must not advance the model's step counter or
    KV cache (a replay does that, once per call)."""
    saved = [(t, t.detach().clone()) for t in written_attributes(gm)]
    try:
        yield [t for t, _ in saved]
    finally:
        with torch.no_grad():
            for t, copy in saved:
                t.copy_(copy)


#: ``switch=`` values: one SWITCH node, or n IF nodes set by one kernel / by one kernel each.
SWITCH_LOWERINGS = ("node", "if_chain", "if_chain_each")


class CudaGraphModule(torch.nn.Module):
    """A program captured as ONE CUDA graph, control flow included.

    Calling it copies the inputs into static buffers, replays the graph, copies
    the inputs the program writes in place (a KV cache) back into the caller's
    tensors, and returns the outputs (cloned unless ``clone_outputs=False``, in which case
    they are overwritten by the next call). Without CUDA, or where capture is
    impossible, it runs the program eagerly and says why once
    (:class:`CudaGraphFallbackWarning`); :attr:`lowered` tells which.
    """

    def __init__(
        self,
        program: Any,
        example_inputs: Sequence[Any],
        *,
        max_iterations: int | None = None,
        if_else: str = "auto",
        switch: str = "node",
        clone_outputs: bool = True,
        pool: Any = None,
    ):
        super().__init__()
        #: memory pool handle shared with other graphs (``torch.cuda.graph_pool_handle()``), or None for a new one
        self.pool = pool
        if switch not in SWITCH_LOWERINGS:
            raise LoweringError(
                f"switch must be one of {', '.join(map(repr, SWITCH_LOWERINGS))}, got {switch!r}", where="cuda_graph"
            )
        if if_else not in ("auto", "one_node", "two_nodes"):
            raise LoweringError(f"if_else must be 'auto', 'one_node' or 'two_nodes', got {if_else!r}", where="cuda_graph")
        if max_iterations is not None and (not isinstance(max_iterations, int) or max_iterations < 0):
            raise LoweringError(f"max_iterations must be a non-negative int, got {max_iterations!r}", where="cuda_graph")
        self.gm = _as_graph_module(program)
        inputs = list(pytree.tree_leaves(tuple(example_inputs)))
        self.clone_outputs = clone_outputs
        self.fallback_reason: str | None = None
        self.graph_nodes = None  # GraphNodeCount after capture, where the driver lets us read it
        #: positions of the inputs the program writes in place: copied back to the caller's after a replay
        self.written_inputs: list[int] = []
        self.conditional_nodes: dict[str, int] = {}
        self._example_meta = [(type(x), getattr(x, "shape", None), getattr(x, "dtype", None)) for x in inputs]

        device = self._target_device(inputs)
        self.ctx = LoweringContext(
            Phase.VALIDATE,
            device,
            max_iterations=max_iterations,
            switch_as_ifs=switch != "node",
            if_chain_kernels="each" if switch == "if_chain_each" else "one",
        )
        validate(self.gm, inputs, self.ctx)  # structural errors raise here, on any machine
        self.sites = list(self.ctx.sites)
        if device is None:
            return self._fall_back(self._why_no_device())
        from branchyard.lowering.cuda_graph.conditional_nodes import cuda_bindings_available

        reason = cuda_bindings_available()
        if reason:
            return self._fall_back(reason)
        try:
            with torch.no_grad():  # a graph replays inference: out= forms and buffers take no autograd
                self._capture(inputs, if_else)
        except Exception as exc:  # the environment refused; the program itself validated
            self._fall_back(f"capture failed: {type(exc).__name__}: {exc}")

    # -- setup ------------------------------------------------------------------------
    @staticmethod
    def _target_device(inputs: Sequence[Any]) -> torch.device | None:
        if not torch.cuda.is_available():
            return None
        devices = {x.device for x in inputs if isinstance(x, torch.Tensor)}
        cuda = sorted((d for d in devices if d.type == "cuda"), key=str)
        if cuda:
            return cuda[0]
        return torch.device("cuda", torch.cuda.current_device())

    @staticmethod
    def _why_no_device() -> str:
        return "torch.cuda.is_available() is False (no CUDA device)"

    def _fall_back(self, reason: str) -> None:
        self.fallback_reason = reason
        warn_fallback(reason)

    @property
    def lowered(self) -> bool:
        """True when calls replay a CUDA graph, False when they run eagerly."""
        return self.fallback_reason is None

    def _capture(self, inputs: list[Any], if_else: str) -> None:
        from branchyard.lowering.cuda_graph.conditional_nodes import MAX_NESTING, ConditionalBuilder, count_graph_nodes
        from branchyard.lowering.cuda_graph.guarded_capture import dedicated_streams, guarded_capture

        ctx, device = self.ctx, self.ctx.device
        self._static_inputs = [static_input(x) for x in inputs]
        streams = dedicated_streams(device, 1 + MAX_NESTING)
        # WARMUP: every body and branch once, on a side stream as torch recommends before capture.
        ctx.phase = Phase.WARMUP
        side = streams[1]
        with restoring_written_attributes(self.gm):  # the model's buffers are as before the warm-up
            side.wait_stream(torch.cuda.current_stream(device))  # after the copies of them
            with torch.cuda.stream(side), _graph_timing():
                self.written_inputs = inputs_written_by(
                    lambda: ControlFlowInterpreter(self.gm, ctx).run(*self._static_inputs), self._static_inputs
                )
            torch.cuda.current_stream(device).wait_stream(side)  # the buffers go back after the warm-up
        torch.cuda.synchronize(device)  # warm-up done and buffers back before the capture starts

        builder = ConditionalBuilder(device, side_streams=streams[1:])
        ctx.builder = builder
        ctx.if_else_one_node = {"auto": builder.if_else_in_one_node, "one_node": True, "two_nodes": False}[if_else]
        try:
            graph = torch.cuda.CUDAGraph(keep_graph=True)
            keep = True
        except TypeError:  # torch without keep_graph: no node counts
            graph, keep = torch.cuda.CUDAGraph(), False
        ctx.phase = Phase.CAPTURE
        ctx.keepalive = []
        pool = self.pool if self.pool is not None else torch.cuda.graph_pool_handle()
        try:
            with guarded_capture(graph, pool=pool, device=device), _graph_timing():
                if ctx.max_iterations is not None:
                    ctx.exhausted = torch.zeros((), dtype=torch.bool, device=device)
                outputs = ControlFlowInterpreter(self.gm, ctx).run(*self._static_inputs)
        except BaseException as exc:
            from branchyard.lowering.cuda_graph.guarded_capture import keep_forever

            if getattr(exc, "branchyard_retired_stream", False):
                keep_forever(ctx.keepalive, builder, self._static_inputs)  # a stream was retired: free nothing
            ctx.keepalive = []
            ctx.builder = None
            raise
        if keep:
            from cuda.bindings import driver

            self.graph_nodes = count_graph_nodes(driver.CUgraph(graph.raw_cuda_graph()), builder.bodies_of)
            graph.instantiate()
        self.conditional_nodes = dict(builder.nodes_added)
        self._graph, self._builder, self._outputs = graph, builder, outputs
        self._keepalive = ctx.keepalive  # body temporaries live in the pool as long as the graph
        ctx.keepalive = []

    # -- calls ----------------------------------------------------------------------------
    def forward(self, *args: Any) -> Any:
        if not self.lowered:
            return self._run_eagerly(args)
        flat = args if all(isinstance(a, torch.Tensor) for a in args) else list(pytree.tree_leaves(args))
        if len(flat) != len(self._static_inputs):
            raise LoweringError(f"expected {len(self._static_inputs)} inputs, got {len(flat)}", where="CudaGraphModule call")
        for i, (buf, x) in enumerate(zip(self._static_inputs, flat)):
            if isinstance(buf, torch.Tensor):
                if not isinstance(x, torch.Tensor) or x.shape != buf.shape or x.dtype != buf.dtype:
                    raise LoweringError(
                        f"input {i} is {tuple(getattr(x, 'shape', ()))} {getattr(x, 'dtype', type(x).__name__)}, "
                        f"the graph was captured for {tuple(buf.shape)} {buf.dtype}",
                        where="CudaGraphModule call",
                        hint="lower the program again for new shapes (a CUDA graph has static shapes)",
                    )
                if x.data_ptr() != buf.data_ptr():
                    buf.copy_(x)
            elif x != buf:
                raise LoweringError(
                    f"input {i} is {x!r}, the graph was captured for the constant {buf!r}", where="CudaGraphModule call"
                )
        self._graph.replay()
        for i in self.written_inputs:  # the program writes these: so must a replay, in the caller's tensors
            if flat[i].data_ptr() != self._static_inputs[i].data_ptr():
                flat[i].copy_(self._static_inputs[i])
        if not self.clone_outputs:
            return self._outputs
        if isinstance(self._outputs, tuple) and all(isinstance(t, torch.Tensor) for t in self._outputs):
            return tuple(t.clone() for t in self._outputs)
        return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, self._outputs)

    def _run_eagerly(self, args: tuple) -> Any:
        if self.ctx.max_iterations is None:
            return self.gm(*args)
        # Loops must stop at max_iterations here too: run the control flow on the host.
        self.ctx.phase, self.ctx.exhausted_eagerly = Phase.EAGER, False
        return ControlFlowInterpreter(self.gm, self.ctx).run(*pytree.tree_leaves(args))

    def iterations_exhausted(self) -> bool:
        """Whether the last call stopped some while_loop at ``max_iterations`` (reads the device: syncs)."""
        if not self.lowered:
            return self.ctx.exhausted_eagerly
        if self.ctx.exhausted is None:
            return False
        return bool(self.ctx.exhausted.item())
