"""Fuse the straight-line ATen code of every body into Inductor kernels before capture.

Inside a conditional node each op is a graph node, and on Hopper a node costs
microseconds whatever it computes; a decode step's RMS-norm is four of them.
:func:`fuse_regions` finds maximal runs of plain ATen ops in the program and
in every branch and loop body (torch's ``CapabilityBasedPartitioner``) and
replaces each run of two or more ops by an :class:`InductorRegion`: on real
tensors it runs ``torch.compile(run, backend="inductor")`` (one compile per
input shape, made during the warm-up), on fake tensors the original ops (so
validation sees what the program does). Left out of regions, so the lowering
keeps its own node-saving patterns and fused kernels:

* control flow (cond, switch, while_loop) and custom ops (``branchyard.fused_gemm_epilogue``);
* arithmetic on 0-d integer and bool values (loop counters, predicates,
  ``idx == k``), which the set and step kernels evaluate themselves; a
  reduction of real data to an index (``argmax``) may join a region, except
  a small one feeding only a switch's index, which the switch's set kernel
  computes (:class:`~.patterns.IndexProgram`), and the mean and matmul of a
  small router (``argmax(mean(x, 0) @ w)``) whose argmax does, which the
  router set kernel computes (:class:`~.patterns.RouterLogits`);
* random ops (the lowering refuses them inside bodies with a clear error).

A region runs its ops where its last op was, so a run is cut where that would move a
read or a write across another write (:func:`branchyard.fx.mutation.may_write`: a
counter's ``add_``, a batch norm updating its running statistics, unknown code).

Before / after, in one body::

    %sq   = aten.pow(%y, 2)                  %fused_0 = call_module[InductorRegion](%y)
    %mean = aten.mean.dim(%sq, [-1], True)   ->   (one Triton kernel on the GPU)
    %add  = aten.add.Tensor(%mean, 1e-6)
    %rs   = aten.rsqrt(%add)
    %out  = aten.mul.Tensor(%y, %rs)
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

from branchyard.fx.mutation import may_write
from branchyard.fx.size_bounds import upper_bound

__all__ = ["InductorRegion", "fuse_regions"]

logger = logging.getLogger("branchyard")


def _is_fake(x: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(x, FakeTensor)


class InductorRegion(torch.nn.Module):
    """A run of ATen ops: Inductor kernels on real tensors, the ops themselves on fake ones."""

    def __init__(self, gm: GraphModule):
        super().__init__()
        self.ops = gm  # not a child the lowering walks into: it is called as a module
        self._compiled: Any = None

    @property
    def graph_module(self) -> GraphModule:
        """The ops a call runs (what :mod:`branchyard.fx.mutation` reads to see what it writes)."""
        return self.ops

    def forward(self, *args: Any) -> Any:
        if any(_is_fake(a) for a in args) or not any(isinstance(a, torch.Tensor) and a.is_cuda for a in args):
            return self.ops(*args)
        if self._compiled is None:
            self._compiled = torch.compile(self.ops.forward, backend="inductor", fullgraph=True, dynamic=False)
        if self._compiled is self.ops or torch.cuda.is_current_stream_capturing():
            return self._compiled(*args)  # inside a capture: only what the warm-up compiled
        try:
            return self._compiled(*args)
        except Exception as exc:  # Inductor could not compile this region: its ops still run
            logger.warning("branchyard: an Inductor region runs its ATen ops instead (%s: %s)", type(exc).__name__, exc)
            self._compiled = self.ops
            return self.ops(*args)


class _Fusable(OperatorSupportBase):
    def is_node_supported(self, submodules: Any, node: Node) -> bool:
        if node.op != "call_function":
            return False
        target = node.target
        val = node.meta.get("val")
        if target is operator.getitem:
            src = node.args[0]
            return isinstance(src, Node) and isinstance(src.target, torch._ops.OpOverload)
        if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
            return False  # control flow, custom ops, Python functions
        if torch.Tag.nondeterministic_seeded in target.tags:
            return False
        if not isinstance(val, torch.Tensor):
            return False
        if _set_kernel_router(node):
            return False
        if val.dim() == 0 and not val.dtype.is_floating_point:
            # Scalar arithmetic on counters, predicates and indices stays: the set and step
            # kernels evaluate it. A reduction of real data to an index (argmax) may join,
            # unless it is a small argmax feeding a switch index, which the set kernel takes.
            if _set_kernel_argmax(node):
                return False
            inputs = [a.meta.get("val") for a in node.all_input_nodes]
            return any(isinstance(v, torch.Tensor) and v.dim() > 0 for v in inputs)
        return True


def _set_kernel_argmax(node: Node) -> bool:
    """An ``argmax`` of at most :data:`~.patterns.MAX_ARGMAX_ELEMENTS` elements whose
    result feeds only switch indices: the switch's set kernel computes it."""
    from branchyard.lowering.cuda_graph.handlers import is_switch_node
    from branchyard.lowering.cuda_graph.patterns import INDEX_STEPS, MAX_ARGMAX_ELEMENTS, feeds_only_switch_index

    if INDEX_STEPS.get(node.target) != "argmax" or not node.args or not isinstance(node.args[0], Node):
        return False
    src = node.args[0].meta.get("val")
    most = upper_bound(src.numel()) if isinstance(src, torch.Tensor) else None
    if most is None or most > MAX_ARGMAX_ELEMENTS:
        return False  # large, or unbounded: Inductor's reduction is the better kernel
    return feeds_only_switch_index(node, is_switch_node)


def _set_kernel_router(node: Node) -> bool:
    """A router step (``mean``, ``matmul``, a core-ATen ``unsqueeze``/``squeeze``) of a small ``argmax(mean(x, 0) @ w)`` that feeds
    only a switch index: the switch's router set kernel computes it (:class:`~.patterns.RouterLogits`)."""
    from branchyard.lowering.cuda_graph.handlers import is_switch_node
    from branchyard.lowering.cuda_graph.patterns import (
        MAX_ROUTER_ELEMENTS, ROUTER_DTYPE_CODES, ROUTER_STEPS, router_feeds_switch,
    )

    kind = ROUTER_STEPS.get(node.target)
    if kind is None or not router_feeds_switch(node, is_switch_node):
        return False
    matmul = node.args[0] if kind == "squeeze" else node
    while ROUTER_STEPS.get(matmul.target) != "matmul":  # mean, unsqueeze: the matmul is below
        matmul = next(iter(matmul.users))
    head = matmul.args[0]
    while isinstance(head, Node) and ROUTER_STEPS.get(head.target) in ("unsqueeze", "mean"):
        head = head.args[0]  # the mean's input is what the kernel reads
    vals = [a.meta.get("val") if isinstance(a, Node) else None for a in (head, matmul.args[1])]
    if not all(isinstance(v, torch.Tensor) and v.dtype in ROUTER_DTYPE_CODES for v in vals):
        return False
    # a dynamic batch: the largest its range allows (the capture checks each shape's own size)
    most = upper_bound(sum(v.numel() for v in vals))
    return most is not None and most <= MAX_ROUTER_ELEMENTS


def _runs_between_writes(gm: GraphModule, nodes: Any) -> list[list[Node]]:
    """A partition cut where one region would move memory traffic across a write.

    A region runs all its ops where its last op was (``fuse_by_partitions``), and the
    other nodes between its ops that use its results move after it: reads and writes
    move later. So a partition is cut at every other node between its ops that may write
    memory (a read would move past the write), and, when the partition writes memory
    itself, at every other node between its ops (its write would move past that node's
    read, or that node's read of a view past the write)::

        a = mul(x, counter)          region(a, b) would read counter here, after the add_
        add_(counter, 1)        ->   so: a alone (not a region), region(b, d)
        b = sin(a); d = mul(x, counter)
    """
    members = set(nodes)
    order = [n for n in gm.graph.nodes if n in members]
    writes = any(may_write(n) for n in order)
    runs: list[list[Node]] = [[]]
    node = order[0]
    while node is not order[-1]:
        if node in members:
            runs[-1].append(node)
        elif node.op not in ("placeholder", "get_attr") and runs[-1]:
            node_writes = may_write(node)
            if writes or node_writes:
                logger.debug("inductor region cut before %s: %s", node.name,
                             "it may write memory" if node_writes else "the region writes memory")
                runs.append([])
        node = node.next
    runs[-1].append(node)
    return [run for run in runs if len(run) >= 2]


def _fuse_one(gm: GraphModule) -> int:
    proposed = CapabilityBasedPartitioner(gm, _Fusable(), allows_single_node_partition=False).propose_partitions()
    partitions = [run for p in proposed for run in _runs_between_writes(gm, p.nodes)]
    if not partitions:
        return 0
    from torch.fx.passes.utils.fuser_utils import fuse_by_partitions

    fuse_by_partitions(gm, [dict.fromkeys(run) for run in partitions], prefix="inductor_region_")  # edits gm in place
    count = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target.startswith("inductor_region_"):
            sub = gm.get_submodule(node.target)
            if isinstance(sub, GraphModule):
                gm.add_submodule(node.target, InductorRegion(sub))
                count += 1
    gm.recompile()
    return count


def fuse_regions(gm: GraphModule) -> int:
    """Replace runs of plain ATen ops in ``gm`` and every nested body by :class:`InductorRegion` (in place).

    ``ExportedProgram.module()`` shares its control-flow bodies with the program: fuse a
    copy (``branchyard.fx.graph_walk.copy_graph_module(gm, share_tensors=True)``) to keep
    the program's graph. Returns the number of regions made.
    """
    from branchyard.fx.graph_walk import iter_graph_modules

    total = sum(_fuse_one(g) for g in list(iter_graph_modules(gm)))
    logger.debug("fuse_regions: %d Inductor region(s)", total)
    return total
