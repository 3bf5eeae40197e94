"""``python -m branchyard``: inspect and rewrite exported programs (``.pt2``).

Commands::

    python -m branchyard [-v] [--version] COMMAND ...
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
with status 1; usage errors exit with status 2 (argparse's convention). A
reader that closes the pipe early (``inspect X | head``) ends the output
quietly, with the status of a process ended by SIGPIPE (141), as ``cat``
does. ``-v`` shows the ``branchyard`` logger's INFO messages on stderr
(``-vv``: DEBUG); ``rewrite`` and ``inspect`` show a progress bar on a terminal.
:func:`main` takes ``argv`` and returns the exit status, so it can be called
in-process::

    >>> main(["passes"])  # doctest: +ELLIPSIS
    cond_to_switch ...
    0
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from branchyard.errors import BranchyardError

__all__ = ["main", "build_parser", "load_program", "save_program", "parse_pass_names"]

PROG = "branchyard"

logger = logging.getLogger("branchyard")


def load_program(path: str | os.PathLike, *, trusted: bool = False) -> Any:
    """Read a ``.pt2`` (switches included) with :func:`branchyard.serialization.load`;
    ``trusted`` (``--trust``) allows a file whose loading runs code it carries."""
    from branchyard.registry import load_ops
    from branchyard.serialization import load

    load_ops()  # a program a pass rewrote may call branchyard's own ops
    return load(str(path), trusted=trusted)


def save_program(program: Any, path: str | os.PathLike) -> None:
    """Write ``program`` to a ``.pt2`` with :func:`branchyard.serialization.save`
    (atomically: a failed save leaves an existing file as it was); a missing
    output folder or a folder given as the output is an error naming it."""
    from branchyard.serialization import save

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

    with _Progress(2, args.program) as progress:
        program = progress.step("load", lambda: load_program(args.program, trusted=args.trust))
        summary = progress.step("inspect", lambda: inspect_program(program))
    if args.json:
        print(json.dumps({"program": str(args.program), **summary.to_dict()}, indent=2))
    else:
        print(f"{args.program}")
        print(summary.format())
    return 0


_SIZE_ROWS: tuple[tuple[str, Callable[[Any], Any]], ...] = (
    ("subgraphs", lambda s: s.subgraphs),
    ("inputs of the program", lambda s: s.root_placeholders),
    ("placeholders, all graphs", lambda s: s.placeholders),
    ("nodes, all graphs", lambda s: s.nodes),
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


def _output_path(output: str) -> Path:
    """``-o``'s path, checked before any work: not a folder name (a trailing
    separator, which ``Path`` would drop), in a folder that exists."""
    if not output or output.endswith((os.sep, "/")):
        raise BranchyardError("the output names a folder, not a file", where=repr(output),
                              hint="give a file name, e.g. -o out.pt2")
    out = Path(output)
    try:
        folder = out.resolve().parent
    except (OSError, RuntimeError) as exc:  # a symbolic link loop (RuntimeError before Python 3.13)
        raise BranchyardError(f"cannot resolve the output path: {exc}", where=output) from exc
    if not folder.is_dir():
        raise BranchyardError("output folder does not exist", where=str(folder), hint="create it first")
    return out


def _cmd_rewrite(args: argparse.Namespace) -> int:
    from branchyard.inspection import graph_stats
    from branchyard.fx.pass_infra import Pipeline
    from branchyard.registry import get_pass

    names = parse_pass_names(args.passes)
    out = _output_path(args.output)
    if out.is_dir():
        raise BranchyardError("the output is a directory", where=str(out), hint="give a file name, e.g. -o out.pt2")
    passes = [get_pass(n) for n in names]
    with _Progress(len(passes) + 2, args.input) as progress:
        program = progress.step("load", lambda: load_program(args.input, trusted=args.trust))
        for p in passes:
            if hasattr(p, "bind_inputs"):  # a pass that times the program (nvgemm's eager race) uses its values
                p.bind_inputs(program)
        for name, p in zip(names, passes):
            progress.around(name, p)
        result = Pipeline(passes)(program)
        progress.step("save", lambda: save_program(result.program, args.output))
    print(f"{args.input} -> {out} ({', '.join(names)}: {'modified' if result.modified else 'unchanged'})")
    print(format_before_after(graph_stats(program), graph_stats(result.program)))
    print(format_reports(result.reports))
    return 0


class _Progress:
    """A tqdm bar over a command's steps (on a terminal only: tqdm turns itself
    off when stderr is not one), and an INFO log line per step with its time."""

    def __init__(self, total: int, what: Any):
        from tqdm import tqdm

        # mininterval=0: a few long steps, each worth a redraw (the default skips updates within 0.1 s)
        self.bar = tqdm(
            total=total, desc=str(what), unit="step", file=sys.stderr, disable=None, leave=False, mininterval=0
        )

    def __enter__(self) -> "_Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.close()

    def step(self, label: str, work: Callable[[], Any]) -> Any:
        self.bar.set_postfix_str(label)
        logger.info("%s ...", label)
        start = time.perf_counter()
        out = work()
        logger.info("%s: done in %.1f s", label, time.perf_counter() - start)
        self.bar.update(1)
        return out

    def around(self, label: str, pass_: Any) -> None:
        """Count ``pass_`` as one step when the pipeline runs it (the pass logs its own time)."""
        call = pass_.call

        def counted(graph_module: Any) -> Any:
            self.bar.set_postfix_str(label)
            out = call(graph_module)
            self.bar.update(1)
            return out

        pass_.call = counted


#: How ``rewrite`` says each pass counter; counters a pass adds later print as
#: "name with spaces: value". Zero counts of ``*`` keys are left out.
REPORT_WORDS: dict[str, str] = {
    "cond_trees": "nested-cond trees found: {}",
    "conds_removed": "conds removed: {}",
    "switches_created": "switches created: {}",
    "leaves": "leaves in those trees: {}",
    "branches_after_dedup": "distinct branches after merging identical leaves: {}",
    "operands_before": "control-flow operands before: {}",
    "operands_after": "control-flow operands after: {}",
    "*dispatch_index": "switches indexed by the dispatch value itself (idx == k chains): {}",
    "*general_index": "switches whose index is computed from the predicates: {}",
    "switches_lowered": "switches lowered: {}",
    "conds_created": "conds created: {}",
    "fused": "matmul chains fused: {}",
    "declined": "matmuls left as they are: {}",
    "*specs": "fused kernels: {}",
}


def _stat_line(key: str, value: Any) -> str | None:
    for pattern in (key, "*" + key):
        if pattern in REPORT_WORDS:
            if pattern.startswith("*") and not value:
                return None
            text = ", ".join(map(str, value)) if isinstance(value, (list, tuple)) else value
            return REPORT_WORDS[pattern].format(text)
    return f"{key.replace('_', ' ')}: {value}"


def format_reports(reports: Sequence[Any]) -> str:
    """Pass reports in words: counters by :data:`REPORT_WORDS`, and each skip
    reason once with how many places it applied to."""
    lines = []
    for r in reports:
        lines.append(f"{r.pass_name}: {'modified' if r.modified else 'unchanged'}")
        lines += [f"  {line}" for k, v in r.stats.items() if (line := _stat_line(k, v)) is not None]
        by_reason = Counter(s.reason for s in r.skips)
        wheres: dict[str, list[str]] = {}
        for s in r.skips:
            wheres.setdefault(s.reason, []).append(s.where)
        for reason, n in by_reason.items():
            places = sorted(set(wheres[reason]))
            where = places[0] if len(places) == 1 else f"{len(places)} different places"
            lines.append((f"  {n} skips at {where}" if n > 1 else f"  skipped {where}") + f": {reason}")
    return "\n".join(lines)


def _cmd_example(args: argparse.Namespace) -> int:
    from branchyard.examples.expert_dispatch import EXAMPLES, save_example

    spec = EXAMPLES[args.name]
    size = spec.default_size if args.size is None else args.size
    save_program_path = _output_path(args.output)
    save_example(args.name, args.output, size=size, dim=args.dim)
    print(f"wrote {save_program_path}: {args.name} ({spec.size_name}={size}, dim={args.dim}) -- {spec.summary}")
    return 0


#: reST inline markup -> plain text, in order: ``code``; :role:`~a.b.name` (reST shows
#: "name"); :role:`text <target>` and :role:`a.b.name`; a docstring's pointer to itself.
_REST: tuple[tuple[re.Pattern[str], Any], ...] = (
    (re.compile(r"``(.+?)``"), r"\1"),
    (re.compile(r":\w+:`~[\w.]*?(\w+)`"), r"\1"),
    (re.compile(r":\w+:`(?:([^`<]*?)\s*<[^`>]*>|([^`]*))`"), lambda m: m.group(1) or m.group(2)),
    (re.compile(r"\s*\(see the module docstring\)"), ""),
)


def plain_text(rest: str) -> str:
    """``rest`` (one docstring line) as plain text, without reST markup."""
    for pattern, repl in _REST:
        rest = pattern.sub(repl, rest)
    return rest


def _cmd_passes(args: argparse.Namespace) -> int:
    from branchyard.registry import pass_class, pass_names

    for name in pass_names():
        try:
            doc = (pass_class(name).__doc__ or "").strip().splitlines()
        except BranchyardError as exc:  # e.g. an optional dependency missing here
            doc = [str(exc)]
        print(f"{name:16} {plain_text(doc[0]) if doc else ''}")
    print("\nrun them with: branchyard rewrite IN.pt2 -o OUT.pt2 --passes NAME[,NAME...]")
    return 0


_TRUST_HELP = ("load a file that needs full unpickling or evaluates code (refused by default); "
               "loading it runs code the file carries, so only for files you trust")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of ``python -m branchyard``."""
    from branchyard.examples.expert_dispatch import EXAMPLES

    parser = argparse.ArgumentParser(prog=PROG, description="Inspect and rewrite exported programs (.pt2).")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="show what branchyard does on stderr (-v: steps, -vv: every decision)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("inspect", help="list cond trees, switches, while loops, matmul+epilogue chains")
    p.add_argument("program", help="an exported program (.pt2)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--trust", action="store_true", help=_TRUST_HELP)
    p.set_defaults(run=_cmd_inspect)

    p = sub.add_parser("rewrite", help="run passes on a program and write the result")
    p.add_argument("input", help="the exported program to read (.pt2)")
    p.add_argument("-o", "--output", required=True, help="where to write the rewritten program (.pt2)")
    p.add_argument("--passes", required=True, help="comma-separated pass names, run in order (see `passes`)")
    p.add_argument("--trust", action="store_true", help=_TRUST_HELP)
    p.set_defaults(run=_cmd_rewrite)

    p = sub.add_parser("example", help="write a shipped example program")
    p.add_argument("name", choices=sorted(EXAMPLES), help="which example")
    p.add_argument("-o", "--output", required=True, help="where to write it (.pt2)")
    p.add_argument("--size", type=_positive_int, default=None,
                   help="; ".join(f"{s.name}: {s.size_name} (default {s.default_size})" for s in EXAMPLES.values()))
    p.add_argument("--dim", type=_bounded_int(MAX_EXAMPLE_DIM), default=16,
                   help=f"feature size of x and of each expert (default 16, at most {MAX_EXAMPLE_DIM})")
    p.set_defaults(run=_cmd_example)

    p = sub.add_parser("passes", help="list the passes --passes accepts")
    p.set_defaults(run=_cmd_passes)
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value} (a size of {value} makes an empty program)")
    return value


#: ``example --dim``'s bound: an expert-dispatch program holds size x dim x dim
#: weights per layer, and a larger dim only makes a file of many gigabytes.
MAX_EXAMPLE_DIM = 4096


def _bounded_int(most: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = _positive_int(text)
        if value > most:
            raise argparse.ArgumentTypeError(f"must be at most {most}, got {value}")
        return value

    return parse


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("branchyard")
    except PackageNotFoundError:  # run from a source tree that was never installed
        from branchyard import __version__

        return __version__


class _LogHandler(logging.StreamHandler):
    """``branchyard: message`` on the current stderr (pytest swaps it per test)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter(f"{PROG}: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


@contextlib.contextmanager
def _logging(verbosity: int) -> Iterator[None]:
    """Show the ``branchyard`` logger on stderr for one command: -v INFO, -vv DEBUG."""
    if verbosity <= 0:
        yield
        return
    handler = _LogHandler()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if verbosity == 1 else logging.DEBUG)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _closed_pipe() -> int:
    """The reader of stdout went away (``| head``): stop quietly, like ``cat``.

    Python would report the closed pipe again when it flushes stdout at exit;
    pointing stdout at /dev/null first keeps that quiet too.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is no real file (captured in-process)
        pass
    return 128 + 13  # 128 + SIGPIPE: what a shell reports for a process ended by it


def _exit_status(code: object) -> int:
    """The status ``sys.exit(code)`` would give the shell."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # usage errors (2), --help and --version (0): argparse has printed its text
        return _exit_status(exc.code)
    try:
        with _logging(args.verbose):
            status = int(args.run(args))
            sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
            return status
    except BrokenPipeError:
        return _closed_pipe()
    except BranchyardError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # e.g. a path that is a folder, a permission problem
        print(f"{PROG}: error: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), file=sys.stderr)
        return 1
