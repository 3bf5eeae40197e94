"""The ground floor: what control flow looks like in an FX graph, walking
nested graphs, and the pass infrastructure. Everything else builds on it;
it imports nothing of branchyard above it.

* :mod:`branchyard.fx.control_flow` -- the table of control-flow operators
  (cond, switch, while_loop): recognise a node, take it apart into a
  validated dataclass, rebuild it; each operator's semantics as Python;
  walking control-flow nodes at any depth; helpers that copy graph bodies
  and emit nodes with fake-value meta.
* :mod:`branchyard.fx.graph_walk` -- iterate, rewrite, lint, copy and
  realize a GraphModule and every subgraph below it.
* :mod:`branchyard.fx.pass_infra` -- :class:`BranchyardPass`,
  :class:`PassReport`, :class:`Skip`, :class:`Pipeline` and
  :func:`apply_pass`: a pass reports whether it changed the graph and why it
  skipped what it skipped; the pipeline copies and lints once.
* :mod:`branchyard.fx.mutation` -- the one answer to "may this call write
  memory, and which of its arguments?" (schema marks, ``out=``, ``inplace=``,
  the batch-norm family's unmarked running-statistics updates, unknown code),
  and which placeholders and attributes a graph writes in place (a model's
  step counter, KV cache, batch-norm statistics), through views too.
* :mod:`branchyard.fx.call_arguments` -- the arguments one call binds, by
  name, for ATen overloads, op packets, torch builtins, Tensor methods and
  Python functions.
* :mod:`branchyard.fx.switch_lowering` -- one switch node lowered to a
  balanced tree of conds, each cond passing on only the operands its
  sides read (used by ``switch_to_cond``, the CUDA-graph builders and
  serialization).

The registry of passes by name is :mod:`branchyard.registry`, one floor up
(it names passes of every floor).
"""
