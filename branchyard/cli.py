"""``python -m branchyard``: inspect and rewrite exported programs (``.pt2``).

Commands::

    python -m branchyard inspect PROGRAM.pt2 [--json]
    python -m branchyard rewrite IN.pt2 -o OUT.pt2 --passes cond_to_switch[,...]
    python -m branchyard example {expert-dispatch,cond-tree} -o OUT.pt2 [--size N] [--dim D]
    python -m branchyard passes

``inspect`` lists cond trees, switches, while loops and matmul+epilogue
chains, with the rewrite each pass would make. ``rewrite`` runs the named
passes (see ``passes``) in order and prints the graph size before and after.
``example`` writes one of the programs in :mod:`branchyard.examples`.

Every error a user can cause (a missing file, an unknown pass, a program a
pass rejects) prints one line ``branchyard: error: ...`` to stderr and exits
with status 1; usage errors exit with status 2 (argparse's convention).
:func:`main` takes ``argv`` and returns the exit status, so it can be called
in-process::

    >>> main(["passes"])  # doctest: +ELLIPSIS
    cond_to_switch ...
    0
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from branchyard.errors import BranchyardError

__all__ = ["main", "build_parser", "load_program", "save_program", "parse_pass_names"]

PROG = "branchyard"


def load_program(path: str | os.PathLike) -> Any:
    """Read a ``.pt2`` (switches included) with :func:`branchyard.serialization.load`."""
    from branchyard.serialization import load

    # torch.export.load logs the whole traceback of an unreadable archive at
    # WARNING before load() turns it into one SerializationError line.
    torch_log = logging.getLogger("torch.export")
    level = torch_log.level
    torch_log.setLevel(logging.ERROR)
    try:
        return load(str(path))
    finally:
        torch_log.setLevel(level)


def save_program(program: Any, path: str | os.PathLike) -> None:
    """Write ``program`` to a ``.pt2`` with :func:`branchyard.serialization.save`;
    a missing output folder is an error naming it, not a traceback."""
    from branchyard.errors import SerializationError
    from branchyard.serialization import save

    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise SerializationError("output folder does not exist", where=str(parent), hint="create it first")
    save(program, str(path))


def parse_pass_names(text: str) -> list[str]:
    """``"a,b"`` -> ``["a", "b"]``, each checked against the pass registry
    before any file is read (an unknown name fails fast, listing the known ones)."""
    from branchyard.registry import PASSES, pass_class

    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise BranchyardError("--passes is empty", hint="name at least one pass, e.g. --passes cond_to_switch")
    for name in names:
        if name not in PASSES:
            pass_class(name)  # raises the "unknown pass ...; known passes: ..." error
    return names


# --- commands -------------------------------------------------------------------


def _cmd_inspect(args: argparse.Namespace) -> int:
    from branchyard.inspection import inspect_program

    summary = inspect_program(load_program(args.program))
    if args.json:
        print(json.dumps({"program": str(args.program), **summary.to_dict()}, indent=2))
    else:
        print(f"{args.program}")
        print(summary.format())
    return 0


_SIZE_ROWS: tuple[tuple[str, Callable[[Any], Any]], ...] = (
    ("subgraphs", lambda s: s.subgraphs),
    ("placeholders", lambda s: s.placeholders),
    ("nodes", lambda s: s.nodes),
    ("control-flow nodes", lambda s: s.control_flow_nodes),
    ("  cond", lambda s: s.control_flow["cond"]),
    ("  switch", lambda s: s.control_flow["switch"]),
    ("  while_loop", lambda s: s.control_flow["while_loop"]),
    ("control-flow operands", lambda s: s.control_flow_operands),
)


def format_before_after(before: Any, after: Any) -> str:
    """Two :class:`~branchyard.inspection.GraphStats` side by side."""
    width = max(len(label) for label, _ in _SIZE_ROWS)
    lines = [f"{'':{width}}  {'before':>8}  {'after':>8}"]
    lines += [f"{label:{width}}  {get(before):>8}  {get(after):>8}" for label, get in _SIZE_ROWS]
    return "\n".join(lines)


def _cmd_rewrite(args: argparse.Namespace) -> int:
    from branchyard.inspection import graph_stats
    from branchyard.fx.pass_infra import Pipeline
    from branchyard.registry import get_pass

    names = parse_pass_names(args.passes)
    out = Path(args.output)
    if not out.resolve().parent.is_dir():
        raise BranchyardError("output folder does not exist", where=str(out.resolve().parent), hint="create it first")
    program = load_program(args.input)
    result = Pipeline([get_pass(n) for n in names])(program)
    save_program(result.program, out)
    print(f"{args.input} -> {out} ({', '.join(names)}: {'modified' if result.modified else 'unchanged'})")
    print(format_before_after(graph_stats(program), graph_stats(result.program)))
    print(result.report())
    return 0


def _cmd_example(args: argparse.Namespace) -> int:
    from branchyard.examples.expert_dispatch import EXAMPLES, save_example

    spec = EXAMPLES[args.name]
    size = spec.default_size if args.size is None else args.size
    save_program_path = Path(args.output)
    if not save_program_path.resolve().parent.is_dir():
        raise BranchyardError(
            "output folder does not exist", where=str(save_program_path.resolve().parent), hint="create it first"
        )
    save_example(args.name, save_program_path, size=size, dim=args.dim)
    print(f"wrote {save_program_path}: {args.name} ({spec.size_name}={size}, dim={args.dim}) -- {spec.summary}")
    return 0


def _cmd_passes(args: argparse.Namespace) -> int:
    from branchyard.registry import pass_class, pass_names

    for name in pass_names():
        try:
            doc = (pass_class(name).__doc__ or "").strip().splitlines()
        except BranchyardError as exc:  # e.g. an optional dependency missing here
            doc = [str(exc)]
        print(f"{name:16} {doc[0] if doc else ''}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of ``python -m branchyard``."""
    from branchyard.examples.expert_dispatch import EXAMPLES

    parser = argparse.ArgumentParser(prog=PROG, description="Inspect and rewrite exported programs (.pt2).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("inspect", help="list cond trees, switches, while loops, matmul+epilogue chains")
    p.add_argument("program", help="an exported program (.pt2)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(run=_cmd_inspect)

    p = sub.add_parser("rewrite", help="run passes on a program and write the result")
    p.add_argument("input", help="the exported program to read (.pt2)")
    p.add_argument("-o", "--output", required=True, help="where to write the rewritten program (.pt2)")
    p.add_argument("--passes", required=True, help="comma-separated pass names, run in order (see `passes`)")
    p.set_defaults(run=_cmd_rewrite)

    p = sub.add_parser("example", help="write a shipped example program")
    p.add_argument("name", choices=sorted(EXAMPLES), help="which example")
    p.add_argument("-o", "--output", required=True, help="where to write it (.pt2)")
    p.add_argument("--size", type=int, default=None,
                   help="; ".join(f"{s.name}: {s.size_name} (default {s.default_size})" for s in EXAMPLES.values()))
    p.add_argument("--dim", type=int, default=16, help="feature size of x and of each expert (default 16)")
    p.set_defaults(run=_cmd_example)

    p = sub.add_parser("passes", help="list the passes --passes accepts")
    p.set_defaults(run=_cmd_passes)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)  # usage errors: argparse prints usage and exits 2
    try:
        return int(args.run(args))
    except BranchyardError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # e.g. a path that is a folder, a permission problem
        print(f"{PROG}: error: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), file=sys.stderr)
        return 1
