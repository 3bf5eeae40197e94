"""Reading a ``.pt2`` without running code from it; writing one atomically.

``torch.export.load`` can run code that an archive carries, in every place
listed in :data:`CODE_PATHS`: it unpickles payloads with
``torch.load(weights_only=False)`` (after a failed ``weights_only=True``
attempt, silently) or plain ``pickle``, evaluates symbolic-shape strings with
``sympy.sympify`` (which calls ``eval``), ``exec``-s the program's guard code
when ``.module()`` is called, and opens AOTInductor shared libraries.
:func:`read_program` reads the same archive layout with torch's own building
blocks but, unless ``trusted=True``:

* unpickles only through ``torch.load(weights_only=True)``; a payload that
  needs more is refused, naming the payload;
* checks every symbolic expression and guard against a small grammar (sympy
  constructors, arithmetic, comparisons, identifier strings) before torch
  parses it;
* never opens ``data/aotinductor/`` (the ExportedProgram does not need it);
* checks every entry against the zip's CRC, which torch's reader skips.

An archive that needs more raises :class:`~branchyard.errors.SerializationError`
that says which entry and why, and how to opt in: ``trusted=True`` (CLI
``--trust``) hands the file to ``torch.export.load`` unchanged.

:func:`write_atomically` writes through a temporary file in the target's
folder and replaces the target only when the write succeeded, so a failed
save never leaves a half-written file where a good one was.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import re
import shutil
import stat
import zipfile
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Iterator, Union

import torch
from torch.export import ExportedProgram

from branchyard._owned_tempdirs import make_owned_tempdir
from branchyard.errors import SerializationError

__all__ = ["CODE_PATHS", "CodePath", "read_program", "special_file_kind", "write_atomically", "TRUST_HINT"]

PathLike = Union[str, "os.PathLike[str]"]
FileLike = Union[PathLike, BinaryIO]

TRUST_HINT = ("load it with trusted=True (CLI: --trust) only if you trust where the file came from; "
              "loading runs code the file carries")


@dataclass(frozen=True)
class CodePath:
    """One place where ``torch.export.load`` may run code from an archive."""

    name: str
    entry: str
    torch_does: str
    we_do: str


#: Every place torch 2.14's ``torch.export.load`` may run code from the file,
#: and what :func:`read_program` does there by default. The crafted-archive
#: tests build one malicious file per row.
CODE_PATHS: tuple[CodePath, ...] = (
    CodePath("sample_inputs", "data/sample_inputs/<model>.pt",
             "torch.load(weights_only=True), on failure weights_only=False", "weights_only=True or refuse"),
    CodePath("weight_pickle", "data/weights/<file> with use_pickle in the weights config",
             "torch.load(weights_only=False)", "weights_only=True or refuse"),
    CodePath("weights_legacy", "data/weights/<model>.pt (legacy layout)",
             "torch.load(weights_only=True), on failure weights_only=False", "weights_only=True or refuse"),
    CodePath("constant_pickle", "data/constants/tensor_<n> with use_pickle in the constants config",
             "torch.load(weights_only=False)", "weights_only=True or refuse"),
    CodePath("constants_legacy", "data/constants/<model>.pt (legacy layout)",
             "torch.load(weights_only=True), on failure weights_only=False", "weights_only=True or refuse"),
    CodePath("custom_object", "data/constants/custom_obj_<n> (torchbind object)",
             "torch._C._pickle_load_obj", "refuse"),
    CodePath("opaque_object", "data/constants/opaque_obj_<n>", "pickle.loads", "refuse"),
    CodePath("sym_expr", "models/<model>.json: SymExpr.expr_str",
             "sympy.sympify (eval)", "check against the expression grammar or refuse"),
    CodePath("guards_code", "models/<model>.json: guards_code",
             "exec when ExportedProgram.module() is called", "check against the guard grammar or refuse"),
    CodePath("aoti", "data/aotinductor/<model>/ (compiled shared library)",
             "AOTIModelPackageLoader opens it", "not read"),
    CodePath("legacy_archive", "serialized_*.pt of the pre-2.7 zip layout",
             "torch.load(weights_only=True), on failure weights_only=False", "refuse"),
)


def _where(file: Any) -> str:
    return f"file {os.fspath(file)!r}" if isinstance(file, (str, os.PathLike)) else f"file object {file!r}"


class _Untrusted(SerializationError):
    """The archive needs code to run to be loaded."""


def _refuse(where: str, what: str, why: str) -> _Untrusted:
    return _Untrusted(f"refusing to load {what}: {why}", where=where, hint=TRUST_HINT)


# --- checking strings torch would evaluate -------------------------------------------

_IDENT_STR = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_OPS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.BitAnd, ast.BitOr, ast.BitXor,
        ast.LShift, ast.RShift, ast.USub, ast.UAdd, ast.Not, ast.Invert, ast.And, ast.Or,
        ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE)
_PLAIN = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.Tuple, ast.Load, *_OPS)


def _sympy_names() -> tuple[frozenset[str], frozenset[str]]:
    """(sympy classes an expression may call, names it may not mention).

    sympy's parser evaluates the text with sympy's namespace and Python's
    builtins in scope; an unknown name becomes a Symbol. So a name is fine if
    it is unknown there or a sympy object; a call only of a sympy class."""
    import builtins

    import sympy

    from torch.utils._sympy import functions as torch_sympy

    calls, banned = set(), set(vars(builtins))
    for mod in (sympy, torch_sympy):
        for k, v in vars(mod).items():
            if isinstance(v, type) and issubclass(v, sympy.Basic):
                calls.add(k)
            elif not isinstance(v, sympy.Basic):
                banned.add(k)
    return frozenset(calls), frozenset(banned - calls)


_SYMPY_NAMES: tuple[frozenset[str], frozenset[str]] | None = None


def _check_constant(node: ast.Constant) -> bool:
    v = node.value
    if isinstance(v, str):
        return bool(_IDENT_STR.match(v)) and not v.startswith("__")
    return v is None or isinstance(v, (bool, int, float))


def check_sym_expr(text: Any) -> str | None:
    """None if ``text`` is a symbolic expression as torch writes them
    (``Mul(Integer(3), Symbol('s0', positive=True, integer=True))``, ``s0 + 1``):
    sympy constructors, arithmetic and comparisons over names, numbers and
    identifier strings. Otherwise the reason it is not."""
    global _SYMPY_NAMES
    if _SYMPY_NAMES is None:
        _SYMPY_NAMES = _sympy_names()
    calls, banned = _SYMPY_NAMES
    if not isinstance(text, str) or len(text) > 100_000:
        return "not a string" if not isinstance(text, str) else "longer than 100000 characters"
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return "not a Python expression"
    for node in ast.walk(tree):
        if isinstance(node, _PLAIN):
            continue
        if isinstance(node, ast.Constant) and _check_constant(node):
            continue
        if isinstance(node, ast.Name) and not node.id.startswith("_") and node.id not in banned:
            continue
        if isinstance(node, ast.keyword) and node.arg is not None and not node.arg.startswith("_"):
            continue
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in calls:
            continue
        return f"{type(node).__name__} {ast.unparse(node)[:60]!r} is not part of a symbolic expression"
    return None


_GUARD_NAMES = frozenset({"L", "math", "inf", "IsNonOverlappingAndDenseIndicator",
                          "cast_symbool_to_symint_guardless"})
_TENSOR_ATTRS = frozenset({"size", "stride", "storage_offset", "dim", "numel", "shape"})


def check_guard(text: Any) -> str | None:
    """None if ``text`` is an input guard as torch writes them
    (``L['x'].size()[0] <= 64``); otherwise the reason it is not."""
    if not isinstance(text, str) or any(c in text for c in "\"\\\n\r"):
        return "not a one-line string without double quotes or backslashes"
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return "not a Python expression"
    import math

    for node in ast.walk(tree):
        if isinstance(node, (*_PLAIN, ast.Subscript, ast.Slice)):
            continue
        if isinstance(node, ast.Constant) and _check_constant(node):
            continue
        if isinstance(node, ast.Name) and node.id in _GUARD_NAMES:
            continue
        if isinstance(node, ast.Attribute) and not node.attr.startswith("_"):
            on_math = isinstance(node.value, ast.Name) and node.value.id == "math"
            if (on_math and hasattr(math, node.attr)) or (not on_math and node.attr in _TENSOR_ATTRS):
                continue
        if isinstance(node, ast.Call) and not node.keywords and isinstance(node.func, (ast.Name, ast.Attribute)):
            continue  # what is called is an allowed Name or Attribute, checked on its own
        return f"{type(node).__name__} {ast.unparse(node)[:60]!r} is not part of an input guard"
    return None


def _audit_program_json(doc: Any, where: str, what: str) -> None:
    """Refuse ``doc`` (a models/*.json) if torch would evaluate a string of it
    that is not a plain symbolic expression or guard."""
    if not isinstance(doc, dict):
        raise SerializationError(f"{what} is not a JSON object", where=where)
    guards = doc.get("guards_code") or []
    if not isinstance(guards, list):
        raise _refuse(where, f"{what}: guards_code", "it is not a list of guard strings")
    for g in guards:
        if (why := check_guard(g)) is not None:
            raise _refuse(where, f"{what}: guard {str(g)[:80]!r}", f"{why}; torch exec-s guards on .module()")
    stack = [doc]
    while stack:
        obj = stack.pop()
        if isinstance(obj, dict):
            if "expr_str" in obj and (why := check_sym_expr(obj["expr_str"])) is not None:
                raise _refuse(where, f"{what}: symbolic expression {str(obj['expr_str'])[:80]!r}",
                              f"{why}; torch evaluates it with sympy.sympify (eval)")
            stack.extend(obj.values())
        elif isinstance(obj, list):
            stack.extend(obj)


# --- unpickling ----------------------------------------------------------------------


def _unpickle(data: bytes, where: str, what: str) -> Any:
    """``torch.load(weights_only=True)`` of ``data``; refuse what needs more."""
    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location=None)
    except Exception as exc:
        reason = str(exc).strip().splitlines()
        short = next((line for line in reason if "Unsupported global" in line or "GLOBAL" in line),
                     reason[0] if reason else type(exc).__name__)
        raise _refuse(where, what, f"it is not plain tensor data (torch.load(weights_only=True): {short.strip()})") from exc


def _payloads(reader: Any, config_file: str, base_dir: str, where: str, kind: str) -> dict[str, Any]:
    """The weights or constants of one model: raw tensor records as torch's
    loader builds them, pickled ones through :func:`_unpickle`, objects refused."""
    from torch.export.pt2_archive import constants as C
    from torch.export.pt2_archive._package import _build_file_map, _load_payload_config
    from torch._export.serde.serialize import deserialize_size, deserialize_storage_offset, deserialize_stride

    config = _load_payload_config(reader, config_file)
    file_map = _build_file_map(reader, config, base_dir)  # raw bytes -> tensors; skips use_pickle entries
    out: dict[str, Any] = {}
    for fqn, meta in config.config.items():
        path = meta.path_name
        entry = os.path.join(base_dir, path)
        if kind == "constant" and path.startswith(C.CUSTOM_OBJ_FILENAME_PREFIX):
            raise _refuse(where, f"constant {fqn!r} ({entry})", "it is a torchbind object, which only an unpickler can build")
        if kind == "constant" and path.startswith(C.OPAQUE_OBJ_FILENAME_PREFIX):
            raise _refuse(where, f"constant {fqn!r} ({entry})", "it is a pickled Python object")
        if kind == "constant" and not path.startswith(C.TENSOR_CONSTANT_FILENAME_PREFIX):
            raise SerializationError(f"constant {fqn!r} has an unknown payload {entry!r}", where=where)
        if meta.use_pickle:
            value = _unpickle(reader.read_bytes(entry), where, f"{kind} {fqn!r} ({entry}, marked use_pickle)")
            if not isinstance(value, torch.Tensor):
                raise SerializationError(f"{kind} {fqn!r} ({entry}) is a {type(value).__name__}, not a tensor",
                                         where=where)
            out[fqn] = value
            continue
        tm = meta.tensor_meta
        if tm is None or path not in file_map:
            raise SerializationError(f"{kind} {fqn!r} has no tensor data ({entry})", where=where)
        t = torch.as_strided(file_map[path], deserialize_size(tm.sizes), deserialize_stride(tm.strides),
                             deserialize_storage_offset(tm.storage_offset))
        out[fqn] = torch.nn.Parameter(t, requires_grad=tm.requires_grad) if meta.is_param else t
    return out


# --- reading ---------------------------------------------------------------------------


def _open(file: FileLike, where: str) -> Any:
    from torch.export.pt2_archive._package import PT2ArchiveReader

    try:
        return PT2ArchiveReader(file if not isinstance(file, os.PathLike) else os.fspath(file))
    except Exception as exc:
        if hasattr(file, "seek"):
            file.seek(0)
        try:
            is_zip = zipfile.is_zipfile(file)  # type: ignore[arg-type]
            names = zipfile.ZipFile(file).namelist() if is_zip else []  # type: ignore[arg-type]
        except Exception:
            is_zip, names = False, []
        if hasattr(file, "seek"):
            file.seek(0)
        if any(n.split("/")[-1] == "serialized_exported_program.json" for n in names):
            raise _refuse(where, "a .pt2 in the pre-2.7 layout",
                          "torch reads its serialized_*.pt payloads with full unpickling") from exc
        if is_zip:
            shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
            raise SerializationError(
                f"a zip archive but not a .pt2 (no archive_format record; entries: {shown or 'none'})",
                where=where, hint="pass a file written by branchyard.save or torch.export.save",
            ) from exc
        raise SerializationError(
            f"not a readable .pt2 archive (not a zip file: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__})",
            where=where, hint="pass a file written by branchyard.save or torch.export.save",
        ) from exc


def _read_untrusted(file: FileLike, where: str, model: str) -> tuple[ExportedProgram, dict[str, str]]:
    from torch._export.serde import schema
    from torch._export.serde.serialize import ExportedProgramDeserializer, _dict_to_dataclass
    from torch.export.pt2_archive import constants as C

    reader = _open(file, where)
    _check_crcs(file, where)
    version = reader.read_string(C.ARCHIVE_VERSION_PATH) if C.ARCHIVE_VERSION_PATH in reader.get_file_names() else None
    if version != C.ARCHIVE_VERSION_VALUE:
        raise SerializationError(
            f"archive version {version!r}, this torch reads {C.ARCHIVE_VERSION_VALUE!r}", where=where)
    names = reader.get_file_names()
    program_file = C.MODELS_FILENAME_FORMAT.format(model)
    if program_file not in names:
        models = [n for n in names if n.startswith(C.MODELS_DIR)]
        raise SerializationError(f"the archive holds no program {program_file!r} (programs: {models or 'none'})",
                                 where=where)
    try:
        doc = json.loads(reader.read_bytes(program_file).decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise SerializationError(f"{program_file} is not valid JSON ({type(exc).__name__})", where=where) from exc
    _audit_program_json(doc, where, program_file)
    serialized = _dict_to_dataclass(schema.ExportedProgram, doc)

    legacy_w = f"{C.WEIGHTS_DIR}{model}.pt"
    if legacy_w in names:
        state_dict = _unpickle(reader.read_bytes(legacy_w), where, f"weights ({legacy_w})")
    else:
        state_dict = _payloads(reader, C.WEIGHTS_CONFIG_FILENAME_FORMAT.format(model), C.WEIGHTS_DIR, where, "weight")
    legacy_c = f"{C.CONSTANTS_DIR}{model}.pt"
    if legacy_c in names:
        constants = _unpickle(reader.read_bytes(legacy_c), where, f"constants ({legacy_c})")
    else:
        constants = _payloads(reader, C.CONSTANTS_CONFIG_FILENAME_FORMAT.format(model), C.CONSTANTS_DIR, where,
                              "constant")
    for what, value in (("weights", state_dict), ("constants", constants)):
        if not isinstance(value, dict):
            raise SerializationError(f"the {what} are a {type(value).__name__}, not a dict", where=where)
    sample_file = C.SAMPLE_INPUTS_FILENAME_FORMAT.format(model)
    raw = reader.read_bytes(sample_file) if sample_file in names else b""
    samples = _unpickle(raw, where, f"sample inputs ({sample_file})") if raw else None
    if samples is not None and not isinstance(samples, tuple):
        raise SerializationError(f"sample inputs ({sample_file}) are a {type(samples).__name__}, not a tuple",
                                 where=where)
    # torch's deserializer passes dicts and tuples through as they are: it
    # unpickles nothing itself.
    program = ExportedProgramDeserializer(None).deserialize(serialized, state_dict, constants, samples)
    extra = {n[len(C.EXTRA_DIR):]: reader.read_string(n) for n in names if n.startswith(C.EXTRA_DIR)}
    return program, extra


class _ExtraFiles(dict):
    """The dict ``torch.export.load`` fills with the archive's extra files. It
    is true even when empty: torch replaces a false ``extra_files`` with a new
    dict of its own (``extra_files or {}``), and then nothing comes back."""

    def __bool__(self) -> bool:
        return True


def _check_crcs(file: FileLike, where: str) -> None:
    """Every member's bytes match the CRC the zip records for them: torch's
    reader does not check, and a flipped bit in a weight would load as a
    different number."""
    try:
        with zipfile.ZipFile(file) as archive:  # type: ignore[arg-type]
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise SerializationError(f"not a readable .pt2 archive ({type(exc).__name__}: {exc})", where=where) from exc
    finally:
        if hasattr(file, "seek"):
            file.seek(0)
    if bad is not None:
        raise SerializationError(f"entry {bad!r} is damaged (its bytes do not match the zip's CRC)", where=where,
                                 hint="the file was corrupted after it was written; use an intact copy")


def read_program(file: FileLike, *, trusted: bool = False, model: str = "model") -> tuple[ExportedProgram, dict[str, str]]:
    """The ExportedProgram named ``model`` in the ``.pt2`` ``file`` and the
    archive's extra files. See the module docstring for what ``trusted``
    changes. Raises SerializationError naming the file."""
    where = _where(file)
    if trusted:
        extra: dict[str, Any] = _ExtraFiles()
        if isinstance(file, (str, os.PathLike)) or hasattr(file, "seek"):
            _check_crcs(file, where)
        try:
            with _quiet_torch_export():
                program = torch.export.load(file, extra_files=extra)  # type: ignore[arg-type]
        except Exception as exc:
            raise SerializationError(
                f"not a readable .pt2 archive ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})",
                where=where,
            ) from exc
        return program, extra
    try:
        with _quiet_torch_export():
            return _read_untrusted(file, where, model)
    except SerializationError:
        raise
    except Exception as exc:  # zip, JSON schema or torch deserializer errors: a damaged archive
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise SerializationError(f"not a readable .pt2 archive ({type(exc).__name__}: {first[:300]})",
                                 where=where) from exc


@contextlib.contextmanager
def _quiet_torch_export() -> Iterator[None]:
    """torch's loader logs whole tracebacks at WARNING for archives it cannot
    read; the SerializationError says it in one line."""
    import logging

    logs = [logging.getLogger(n) for n in ("torch.export", "torch._export.serde.serialize",
                                           "torch.export.pt2_archive._package")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)


# --- writing ---------------------------------------------------------------------------

_FILE_KINDS = {stat.S_IFDIR: "a folder", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
               stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket"}


def special_file_kind(path: PathLike) -> str | None:
    """What stands at ``path`` (links followed) when it is not a regular file
    (``"a FIFO"``, ...); ``None`` for a regular file or nothing at all."""
    try:
        kind = os.stat(path).st_mode
    except FileNotFoundError:
        return None
    return None if stat.S_ISREG(kind) else _FILE_KINDS.get(stat.S_IFMT(kind), "a special file")


def write_atomically(path: PathLike, write: Callable[[str], None]) -> None:
    """Call ``write(tmp)`` on a fresh path in ``path``'s folder, then move it
    onto ``path``; if ``write`` raises, ``path`` is untouched and the temporary
    file is gone. The file keeps an existing target's permission bits.
    The temporary file has ``path``'s name (in a hidden folder next to it), so
    the archive's root folder is the one a direct write would give.

    A symbolic link is written through (the link stays, its target is
    replaced), as a direct write would; anything else that is not a regular
    file (a device, a FIFO, a socket) is refused, since replacing it with a
    file is not what writing to it means, and so is a file the caller may not
    write, which a direct write would refuse too."""
    target = os.path.realpath(os.fspath(path))
    if (kind := special_file_kind(target)) is not None:
        raise SerializationError(f"is not a regular file ({kind}); refusing to replace it", where=_where(path),
                                 hint="give the path of a file to write")
    if os.path.exists(target) and not os.access(target, os.W_OK):
        raise SerializationError("is write-protected; refusing to replace it", where=_where(path),
                                 hint="make it writable, or write to another file")
    folder = os.path.dirname(target)
    tmpdir = make_owned_tempdir(folder, ".by-")  # short: the target's name goes inside
    tmp = os.path.join(tmpdir, os.path.basename(target))
    try:
        write(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        try:
            mode = stat.S_IMODE(os.stat(target).st_mode)
        except FileNotFoundError:
            mode = None
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, target)
        with contextlib.suppress(OSError):
            fd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
