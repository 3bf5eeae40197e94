"""Real model blocks before and after ``branchyard.lowering.nvgemm``, called the
way users call them (issue 12 item 4).

Usage (on the H200; see docs/gpu.md for the environment)::

    python benchmarks/nvgemm_blocks.py --markdown              # every block and M (long: Inductor compiles)
    python benchmarks/nvgemm_blocks.py --blocks llama3_8b_mlp --m 1 16 64 --no-compile
    python benchmarks/nvgemm_blocks.py --dry-run               # CPU smoke at tiny sizes (the CPU test runs it)
    python benchmarks/nvgemm_blocks.py --blocks llama3_8b_attn_proj --m 1 --no-merge   # q/k/v not merged
    python benchmarks/nvgemm_blocks.py --blocks llama3_70b_mlp --m 1 --explain   # why each op was kept

Blocks, built here with the widths of widely used models (bfloat16, random weights):

* ``gpt2_mlp``        ``x + c_proj(gelu_tanh(c_fc(x)))``, 768 -> 3072 -> 768, biases
* ``gpt2_attn_proj``  ``qkv = c_attn(x)``, ``x + c_proj(h)``: GPT-2's attention projections, 768 / 2304
* ``llama3_8b_mlp``   ``x + down(silu(gate(x)) * up(x))``, 4096 -> 14336 -> 4096, no biases
* ``llama3_8b_attn_proj``  ``q, k, v = wq(x), wk(x), wv(x)``, ``x + wo(h)``: 4096, GQA 8 KV heads (1024)
* ``llama3_70b_mlp``  as the 8B MLP, 8192 -> 28672 -> 8192
* ``llama3_70b_attn_proj`` as the 8B projections, 8192, KV 1024

at M (tokens) in {1, 16, 64, 512, 2048, 8192}.

Columns (microseconds per call, median of ``--repeats`` rounds of ``--iters``
calls between CUDA events, no L2 flush: a model calls its blocks back to back;
eager columns run a block each per round, in turn; graph columns' replays are
interleaved within a round (one replay, or about 1 ms of replays of a short
program, of each in turn), timed on the device alone; with
``--cold-l2`` each graph replay follows an L2 flush and is timed alone, as
in a model whose weights do not fit the L2, and as the tuner times):

* ``module``     the eager ``nn.Module``
* ``unrewritten``  ``torch.export.export(block).module()``
* ``rewritten``  ``branchyard.lowering.nvgemm(ep).module()`` eagerly (the default ``calling="eager"``:
  on CUDA the pass races the rewritten program against ``ep`` and leaves unfused what loses;
  the ops tune during that race), and ``nvgemm(ep, calling="graph").module()`` in the graph
  (raced as CUDA-graph replays: what its replays are faster without stays unfused)
* ``compile``    ``torch.compile(block, mode="max-autotune-no-cudagraphs", dynamic=False)``

each called eagerly (``*_eager``) and replayed from a CUDA graph of one call
(``*_graph``: ``torch.cuda.graph`` after warm-up; the rewritten program is
warmed up and captured under ``nvgemm.timing_mode("device")``, its eager
column under the default host timing). Before timing, every column's output
is checked against the eager block in fp32. ``fused`` gives how many fused
ops the two rewritten programs hold (eager/graph), ``m`` marking one whose
sibling GEMMs (q, k, v) were merged into one. Where the race kept the
program as it was (the rewritten graph's code is the unrewritten one's),
the target's verdict is ``SAME``, not PASS or FAIL: the two columns time one
program, so their ratio is timing noise; the summary counts such rows apart.
The columns' order rotates from repeat to repeat.

``--explain`` prints, under each row, both rewrites' pass reports (every
race decision: the program's time with and without each fused group, and
the win it needed) and the tuning table of every problem tuned for the row
(each candidate's time, each exclusion and its reason; "from the cache"
where a stored winner was used).

Targets printed per row and summarised: ``rewritten >= 1.00x unrewritten``
eager and in the graph, ``rewritten >= 0.98x compile`` in the graph (ratios
are time_other / time_rewritten, the median over the rounds of the two
columns' ratio within a round; >= 1 means the rewrite is at least as fast).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from branchyard.lowering.nvgemm.timing import device_interleaved_timer, round_order, time_round_robin

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_graph_replay import graph_replay  # noqa: E402

M_VALUES = (1, 16, 64, 512, 2048, 8192)
COLUMNS = ("module", "unrewritten", "rewritten", "compile")
TARGETS = (
    # (name, numerator column, denominator column, minimum ratio)
    ("rewritten >= 1.00x unrewritten (eager)", "unrewritten_eager", "rewritten_eager", 1.00),
    ("rewritten >= 1.00x unrewritten (graph)", "unrewritten_graph", "rewritten_graph", 1.00),
    ("rewritten >= 0.98x compile (graph)", "compile_graph", "rewritten_graph", 0.98),
)


class MLP(nn.Module):
    """GPT-2's MLP: ``x + c_proj(gelu_tanh(c_fc(x)))``."""

    def __init__(self, d: int, h: int):
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        return x + self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GatedMLP(nn.Module):
    """Llama's MLP: ``x + down(silu(gate(x)) * up(x))``."""

    def __init__(self, d: int, h: int):
        super().__init__()
        self.gate, self.up = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False)
        self.down = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return x + self.down(F.silu(self.gate(x)) * self.up(x))


class AttnProj(nn.Module):
    """An attention block's projections around the attention itself (``h`` stands
    for its output): ``q, k, v`` from ``x``, and ``x + o(h)``."""

    def __init__(self, d: int, kv: int, bias: bool, fused_qkv: bool):
        super().__init__()
        self.fused_qkv = fused_qkv
        if fused_qkv:
            self.qkv = nn.Linear(d, d + 2 * kv, bias=bias)
        else:
            self.q, self.k, self.v = (nn.Linear(d, n, bias=bias) for n in (d, kv, kv))
        self.o = nn.Linear(d, d, bias=bias)

    def forward(self, x, h):
        qkv = self.qkv(x) if self.fused_qkv else torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)
        return qkv, x + self.o(h)


@dataclass(frozen=True)
class BlockSpec:
    name: str
    make: Callable[[], nn.Module]
    d: int
    two_inputs: bool = False


def blocks(tiny: bool = False) -> dict[str, BlockSpec]:
    """The benchmark's blocks (``tiny``: the same structure at toy widths, for --dry-run)."""
    s = (lambda n: max(8, n // 256)) if tiny else (lambda n: n)
    return {b.name: b for b in (
        BlockSpec("gpt2_mlp", lambda: MLP(s(768), s(3072)), s(768)),
        BlockSpec("gpt2_attn_proj", lambda: AttnProj(s(768), s(768), True, True), s(768), True),
        BlockSpec("llama3_8b_mlp", lambda: GatedMLP(s(4096), s(14336)), s(4096)),
        BlockSpec("llama3_8b_attn_proj", lambda: AttnProj(s(4096), s(1024), False, False), s(4096), True),
        BlockSpec("llama3_70b_mlp", lambda: GatedMLP(s(8192), s(28672)), s(8192)),
        BlockSpec("llama3_70b_attn_proj", lambda: AttnProj(s(8192), s(1024), False, False), s(8192), True),
    )}


def _flat(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _check(name: str, got, want, dtype: torch.dtype) -> None:
    tol = 1e-4 if dtype == torch.float32 else 6e-2
    for g, w in zip(_flat(got), _flat(want), strict=True):
        err = ((g.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-6)).item()
        if not math.isfinite(err) or err > tol:
            raise AssertionError(f"{name}: output off the eager block by {err:.3g} (relative to its max)")


def _timer(device: torch.device, iters: int, repeats: int) -> Callable[..., dict[str, list[float]]]:
    """Time several callables side by side, ``repeats`` rounds: each round runs
    a block of ``iters`` calls of every one in turn (in an order that rotates
    between rounds: :func:`~branchyard.lowering.nvgemm.timing.time_round_robin`),
    so all see the same host and GPU conditions; the result is each one's
    microseconds per call, round by round.

    ``time_us(fns, interleave=True)`` (CUDA graph replays) runs each round's
    calls interleaved instead, one call (or about 1 ms of calls of a short
    program) of each in turn, device time only
    (:func:`~branchyard.lowering.nvgemm.timing.device_interleaved_timer`):
    a GPU at its power limit moves its clock within milliseconds, so even
    adjacent 100 ms blocks see different clocks, while adjacent turns see one.
    ``time_us(fns, flush=f)`` calls ``f`` before every call and times each
    call alone, so the flush is not counted (``--cold-l2``)."""
    def span_us(run: Callable[[], object]) -> float:
        """Microseconds ``run`` takes: on the GPU between CUDA events, else on the host clock."""
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) * 1e3
        t0 = time.perf_counter()
        run()
        return (time.perf_counter() - t0) * 1e6

    def block_us(fn, flush) -> float:
        if flush is None:
            return span_us(lambda: [fn() for _ in range(iters)]) / iters
        total = 0.0
        for _ in range(iters):
            flush()
            total += span_us(fn)
        return total / iters

    def time_us(fns: dict[str, Callable[[], object]], flush: Callable[[], object] | None = None,
                interleave: bool = False) -> dict[str, list[float]]:
        if interleave and flush is None and device.type == "cuda":
            names, samples = list(fns), {name: [] for name in fns}
            for r in range(repeats):  # as the eager columns' rounds: no column always first or after the same one
                order = round_order(names, r)
                ms = device_interleaved_timer([fns[n] for n in order], warmup=1, reps=iters, max_ms=1e9)
                for name, t in zip(order, ms):
                    samples[name].append(t * 1e3)
            return samples
        # the order rotates from repeat to repeat, so no column always runs first or after the same one
        return time_round_robin(fns, repeats, lambda _, fn: block_us(fn, flush))

    return time_us


def run_row(spec: BlockSpec, m: int, *, device: torch.device, dtype: torch.dtype, compile_mode: str | None,
            iters: int, repeats: int, cold_l2: bool = False, merge: bool = True) -> dict[str, float | str]:
    """Every column for one block at one M (None where a column does not apply)."""
    import branchyard.lowering.nvgemm as nvgemm
    from branchyard.lowering.nvgemm.tuner import get_autotuner

    tuned_before = set(get_autotuner().results)
    torch.manual_seed(0)
    block = spec.make().to(device=device, dtype=dtype).eval()
    x = torch.randn(m, spec.d, device=device, dtype=dtype)
    args = (x, torch.randn(m, spec.d, device=device, dtype=dtype)) if spec.two_inputs else (x,)
    with torch.no_grad():
        want = block(*args)
        ep = torch.export.export(block, args)
        # The rewritten program as each kind of caller gets it: the default (eager) and for CUDA graphs.
        (eager_prog, eager_report), (graph_prog, graph_report) = (_rewrite(ep, how, merge) for how in ("eager", "graph"))
        callers = {"module": (block, block), "unrewritten": (ep.module(),) * 2,
                   "rewritten": (eager_prog.module(), graph_prog.module())}
        if compile_mode is not None:
            compiled = torch.compile(block, mode=compile_mode, dynamic=False)
            callers["compile"] = (compiled, compiled)
        time_us = _timer(device, iters, repeats)
        # how many fused ops each rewritten program kept, and which ones the race left as they were
        row: dict[str, float | str] = {"block": spec.name, "m": m,
                                       "fused": f"{fused_ops(eager_prog, ep)}/{fused_ops(graph_prog, ep)}",
                                       "same": {how for how, prog in (("eager", eager_prog), ("graph", graph_prog))
                                                if prog.graph_module.code == ep.graph_module.code}}
        eager, graphs = {}, {}
        for name, (eager_fn, graph_fn) in callers.items():
            call = (lambda fn=eager_fn: fn(*args))
            _check(f"{spec.name} M={m} {name}", call(), want, dtype)  # also the host-timing warm-up / tuning
            eager[f"{name}_eager"] = call
            if device.type == "cuda":
                in_graph = (lambda fn=graph_fn: fn(*args))
                with nvgemm.timing_mode("device"):
                    _check(f"{spec.name} M={m} {name} (for the graph)", in_graph(), want, dtype)
                    graphs[f"{name}_graph"] = graph_replay(in_graph)
        rounds = time_us(eager)
        rounds.update(time_us(graphs, flush=nvgemm.timing.L2Flush(device) if cold_l2 and graphs else None,
                              interleave=True))
        row.update({name: statistics.median(v) for name, v in rounds.items()})
        row["rounds"] = rounds
    tuned = {k: r for k, r in get_autotuner().results.items() if k not in tuned_before}
    row["explain"] = "\n".join(
        [f"eager rewrite: {eager_report}", f"graph rewrite: {graph_report}"]
        + [f"tuned{' (from the cache)' if r.from_cache else ''} {k} -> {r.winner}\n{r.table()}" for k, r in tuned.items()])
    return row


def _rewrite(ep, calling: str, merge: bool):
    """``nvgemm(ep, calling=calling)`` and the pass's report."""
    from branchyard.fx.pass_infra import Pipeline
    from branchyard.lowering.nvgemm.fuse import NvGemmPass

    the_pass = NvGemmPass(calling, merge_siblings=merge).bind_inputs(ep)
    return Pipeline([the_pass], steps=1)(ep).program, the_pass.report


def fused_ops(program, unrewritten=None) -> str:
    """The fused op's calls in ``program``'s graph (both overloads), with ``m`` appended
    where sibling GEMMs were merged (fewer ``cat`` nodes than ``unrewritten``)."""
    packet = torch.ops.branchyard.fused_gemm_epilogue
    fused = sum(n.op == "call_function" and n.target in (packet.default, packet.out) for n in program.graph.nodes)
    cats = lambda p: sum(n.target is torch.ops.aten.cat.default for n in p.graph.nodes)  # noqa: E731
    return f"{fused}m" if unrewritten is not None and cats(program) < cats(unrewritten) else str(fused)


def ratios(row: dict) -> dict[str, float | None]:
    """Each target's ratio (``None`` when a column is missing): the median of
    its round-by-round ratios where the row has them (both columns of a round
    ran side by side, so a clock drifting between rounds cancels), else the
    ratio of the columns."""
    out = {}
    per_round = round_ratios(row)
    for name, num, den, _ in TARGETS:
        a, b = row.get(num), row.get(den)
        if name in per_round:
            out[name] = statistics.median(per_round[name])
        else:
            out[name] = (a / b) if isinstance(a, float) and isinstance(b, float) and b > 0 else None
    return out


def round_ratios(row: dict) -> dict[str, list[float]]:
    """Each target's round-by-round ratios, where both its columns have rounds."""
    rounds = row.get("rounds", {})
    return {name: [x / y for x, y in zip(rounds[num], rounds[den])]
            for name, num, den, _ in TARGETS if num in rounds and den in rounds}


def report(rows: list[dict], markdown: bool) -> str:
    cols = [f"{c}_{how}" for how in ("eager", "graph") for c in COLUMNS]
    cols = [c for c in cols if any(c in r for r in rows)]
    lines = []
    if markdown:
        lines.append("| block | M | fused (eager/graph) | " + " | ".join(cols) + " | "
                     + " | ".join(t[0] for t in TARGETS) + " |")
        lines.append("|" + "---|" * (3 + len(cols) + len(TARGETS)))
    for r in rows:
        cells = [f"{r[c]:.1f}" if isinstance(r.get(c), float) else "-" for c in cols]
        checks = []
        for target, value in zip(TARGETS, ratios(r).values()):
            checks.append("-" if value is None else f"{ratio_text(value, target[3])} {verdict(r, target, value)}")
        if markdown:
            lines.append(f"| {r['block']} | {r['m']} | {r.get('fused', '-')} | " + " | ".join(cells + checks) + " |")
        else:
            lines.append(f"{r['block']:22s} M={r['m']:<5d} fused={r.get('fused', '-')} "
                         + " ".join(f"{c}={v}" for c, v in zip(cols, cells))
                         + " | " + " ; ".join(checks))
    lines.append("")
    for target in TARGETS:
        name = target[0]
        verdicts = [(v, verdict(r, target, v)) for r in rows if (v := ratios(r)[name]) is not None]
        if not verdicts:
            continue
        failed = sum(x == "FAIL" for _, x in verdicts)
        same = sum(x == "SAME" for _, x in verdicts)
        measured = [v for v, x in verdicts if x != "SAME"]
        worst = f", worst {ratio_text(min(measured), target[3])}" if measured else ""
        lines.append(f"target {name}: {len(verdicts) - failed}/{len(verdicts)} rows pass ({same} the same program)"
                     f"{worst} -> {'PASS' if not failed else 'FAIL'}")
    return "\n".join(lines)


def ratio_text(value: float, floor: float) -> str:
    """``value`` as ``1.03x``, with a third decimal where two would round onto
    ``floor`` (a 0.977 against 0.98 reads 0.977x, not a failing 0.98x)."""
    text = f"{value:.2f}"
    return f"{value:.3f}x" if float(text) == floor and value != floor else f"{text}x"


def verdict(row: dict, target: tuple[str, str, str, float], value: float) -> str:
    """PASS / FAIL of ``value`` against the target's floor; SAME for a target
    against the unrewritten program where the race left the program as it was
    (``row["same"]`` names how it is called), so the two columns time one
    program and their ratio is timing noise."""
    _, numerator, _, floor = target
    column, _, how = numerator.rpartition("_")
    if column == "unrewritten" and how in row.get("same", ()):
        return "SAME"
    return "PASS" if value >= floor else "FAIL"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", nargs="*", default=None, help="block names (default: all)")
    parser.add_argument("--m", nargs="*", type=int, default=None, help=f"M values (default {M_VALUES})")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--compile-mode", default="max-autotune-no-cudagraphs")
    parser.add_argument("--no-compile", action="store_true", help="drop the torch.compile column")
    parser.add_argument("--cold-l2", action="store_true",
                        help="flush the L2 before each replay of the graph columns (as the tuner times), "
                             "each replay timed alone; the eager columns are timed as without it")
    parser.add_argument("--no-merge", action="store_true",
                        help="rewrite with nvgemm(..., merge_siblings=False): q/k/v stay separate GEMMs")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--explain", action="store_true",
                        help="print each row's race decisions and tuning tables under it")
    parser.add_argument("--json", metavar="PATH",
                        help="also write every row to PATH: each column's per-round times, the ratios and their "
                             "round-by-round values, the fused-op counts and the explanation")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, float32, toy widths, M in {1, 4}, no torch.compile: checks every column runs "
                             "and matches the eager block")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")  # fallback notes (e.g. CPU tensors in --dry-run) are not results
    if args.dry_run:
        device, dtype = torch.device("cpu"), torch.float32
        ms, compile_mode, iters, repeats = args.m or [1, 4], None, 2, 1
        table = blocks(tiny=True)
    else:
        if not torch.cuda.is_available():
            parser.error("needs a CUDA device (use --dry-run for the CPU smoke mode)")
        device, dtype = torch.device("cuda"), torch.bfloat16
        ms, iters, repeats = args.m or list(M_VALUES), args.iters, args.repeats
        compile_mode = None if args.no_compile else args.compile_mode
        table = blocks()
    names = args.blocks or list(table)
    unknown = sorted(set(names) - set(table))
    if unknown:
        parser.error(f"unknown blocks {unknown}; known: {sorted(table)}")
    print(f"# nvgemm_blocks {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"{torch.cuda.get_device_name() if device.type == 'cuda' else platform.machine()}, torch {torch.__version__}, "
          f"python {platform.python_version()}, argv {' '.join(sys.argv[1:])}", flush=True)
    rows = []
    for name in names:
        for m in ms:
            rows.append(run_row(table[name], m, device=device, dtype=dtype, compile_mode=compile_mode,
                                iters=iters, repeats=repeats, cold_l2=args.cold_l2, merge=not args.no_merge))
            print(report(rows[-1:], markdown=False).splitlines()[0], flush=True)
            if args.explain:
                print(rows[-1]["explain"], flush=True)
    print()
    print(report(rows, markdown=args.markdown))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv[1:] if argv is None else argv, "torch": torch.__version__,
                       "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.machine(),
                       "rows": [row_record(r) for r in rows]}, f, indent=1)
    return rows


def row_record(row: dict) -> dict:
    """``row`` as JSON data: the rounds behind each median, and for each target its
    ratio with the round-by-round ratios it is the median of (where both columns
    have rounds), so a ratio that disagrees with the columns' medians can be read."""
    record = {k: (sorted(v) if isinstance(v, set) else v) for k, v in row.items()}
    record["ratios"] = ratios(row)
    record["round_ratios"] = round_ratios(row)
    return record


if __name__ == "__main__":
    os.environ.setdefault("BRANCHYARD_NVGEMM_PROGRESS", "0")
    main()
