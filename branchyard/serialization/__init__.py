"""Save and load exported programs, switches included, as ``.pt2`` files.

* :func:`save` writes every switch as a tagged balanced cond tree
  (:mod:`~branchyard.serialization.switch_codec`), records how many it wrote
  in an extra file of the archive, and writes the file atomically: a failed
  save leaves an existing file as it was.
* :func:`load` reads the archive without running code from it
  (:mod:`~branchyard.serialization.archive`) unless ``trusted=True``, then
  turns every tagged tree back into its switch.

Programs without a switch are written and read like ``torch.export.save`` /
``torch.export.load`` do::

    >>> import torch, tempfile, os, branchyard
    >>> class AddOne(torch.nn.Module):
    ...     def forward(self, x):
    ...         return x + 1
    >>> ep = torch.export.export(AddOne(), (torch.zeros(2),))
    >>> path = os.path.join(tempfile.mkdtemp(), "add_one.pt2")
    >>> branchyard.save(ep, path)
    >>> branchyard.load(path).module()(torch.zeros(2))
    tensor([1., 1.])
"""

from __future__ import annotations

import io
import json
import logging
import time
import os
import threading
from typing import Union

import torch
from torch.export import ExportedProgram

from branchyard._compat import TORCH_VERSION
from branchyard.errors import BranchyardError, SerializationError
from branchyard.serialization.archive import CODE_PATHS, TRUST_HINT, read_program, special_file_kind, write_atomically
from branchyard.serialization.switch_codec import (
    FORMAT,
    MARKER_KEY,
    VERSION,
    decode_switches,
    encode_switches,
)

__all__ = ["save", "load", "lower_switches_for_save", "restore_switches", "MARKER_FILE", "MARKER_KEY",
           "CODE_PATHS", "TRUST_HINT"]

#: Name of the extra file in the ``.pt2`` archive that records the encoding.
MARKER_FILE = "branchyard_switch.json"

#: Old names of the codec's two directions.
lower_switches_for_save = encode_switches
restore_switches = decode_switches

PathLike = Union[str, "os.PathLike[str]"]
logger = logging.getLogger("branchyard")
# torch.export.save swaps a process-global pickle reducer while it writes;
# two threads saving at once make it raise ("Refusing to stomp on existing
# FakeTensor reducer").
_TORCH_SAVE_LOCK = threading.Lock()


def _where(file: object) -> str:
    return f"file {os.fspath(file)!r}" if isinstance(file, (str, os.PathLike)) else f"file object {file!r}"


def _utf8_name(path: PathLike) -> bool:
    try:
        os.fspath(path).encode("utf-8")
    except UnicodeEncodeError:  # bytes of a file name that are not UTF-8, as surrogate escapes
        return False
    return True


def save(program: ExportedProgram, path: PathLike | io.BytesIO) -> None:
    """Write ``program`` to a ``.pt2`` file (or a binary buffer), switches included.

    The file is written to a temporary file in the same folder and moved onto
    ``path`` only when complete, so a failed save leaves an existing file as
    it was. Raises :class:`~branchyard.errors.SerializationError` naming the
    file (and the node, for a switch that cannot be written: no branches, a
    constant index) when ``program`` is not an ExportedProgram, ``path`` is a
    folder, or the file cannot be written.
    """
    where = _where(path)
    start = time.perf_counter()
    if not isinstance(program, ExportedProgram):
        raise SerializationError(
            f"can only save a torch.export.ExportedProgram, got {type(program).__name__}",
            where=where,
            hint="export the model with torch.export.export first",
        )
    if isinstance(path, (str, os.PathLike)):
        if os.path.isdir(path):
            raise SerializationError("is a directory", where=where, hint="give a file name, e.g. out.pt2")
        if os.fspath(path).endswith((os.sep, "/")):
            raise SerializationError("names a folder (it ends with a path separator), not a file", where=where,
                                     hint="give a file name, e.g. out.pt2")
        folder = os.path.dirname(os.path.abspath(os.fspath(path)))
        if not os.path.isdir(folder):
            raise SerializationError("could not write the program: its folder does not exist", where=where,
                                     hint=f"create {folder} first")
    try:
        encoded, count = encode_switches(program)
    except BranchyardError as exc:
        raise SerializationError(exc.message, where=f"{where}, {exc.where}" if exc.where else where,
                                 hint=exc.hint) from exc
    marker = json.dumps({"format": FORMAT, "version": VERSION, "switches": count,
                         "torch": ".".join(map(str, TORCH_VERSION))})
    logger.debug("saving %s: %d switch(es) encoded as cond trees", where, count)

    def write(target: str | io.BytesIO) -> None:
        # A file is built in memory first: torch's archive writer aborts the whole
        # process when the file system fails it (a full disk); Python's own write raises.
        buffer = target if isinstance(target, io.BytesIO) else io.BytesIO()
        with _TORCH_SAVE_LOCK:
            torch.export.save(encoded, buffer, extra_files={MARKER_FILE: marker})
        if buffer is not target:
            with open(target, "wb") as fh:
                fh.write(buffer.getbuffer())

    try:
        if isinstance(path, (str, os.PathLike)):
            write_atomically(path, write)
        else:
            write(path)
    except SerializationError:
        raise
    except Exception as exc:  # whatever torch's writer or the file system raised: the old file is intact
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SerializationError(f"could not write the program: {first}", where=where) from exc
    logger.info("saved %s (%d switch(es)) in %.2f s", where, count, time.perf_counter() - start)


def load(path: PathLike | io.BytesIO, *, trusted: bool = False) -> ExportedProgram:
    """Read a ``.pt2`` written by :func:`save` (or by ``torch.export.save``)
    and return the ExportedProgram with its switches restored.

    By default nothing in the file is unpickled except through
    ``torch.load(weights_only=True)``, and no string from it is evaluated
    unless it is a plain symbolic expression or input guard; a file that
    needs more is refused with a SerializationError saying which entry and
    why. ``trusted=True`` loads it with ``torch.export.load`` as is -- which
    runs any code the file carries: use it only for files you trust.

    Raises :class:`~branchyard.errors.SerializationError` naming the file when
    it is missing, is a folder, is not a ``.pt2`` archive, needs trust, or
    holds a malformed switch encoding.
    """
    where = _where(path)
    start = time.perf_counter()
    if isinstance(path, (str, os.PathLike)):
        if os.path.isdir(path):
            raise SerializationError("is a directory, not a .pt2 file", where=where, hint="give the path of a .pt2 file")
        if not os.path.exists(path):
            raise SerializationError("no such file", where=where, hint="check the path")
        if (kind := special_file_kind(path)) is not None:
            raise SerializationError(f"is not a regular file ({kind})", where=where, hint="give the path of a .pt2 file")
        if not os.access(path, os.R_OK):
            raise SerializationError("cannot be read (permission denied)", where=where,
                                     hint="check the file's permissions")
    if isinstance(path, (str, os.PathLike)) and not _utf8_name(path):
        # torch takes such a name (surrogate escapes) for a file object; Python opens it
        with open(path, "rb") as fh:
            path = io.BytesIO(fh.read())
    program, extra = read_program(path, trusted=trusted)
    raw = extra.get(MARKER_FILE) or ""
    try:
        marker = json.loads(raw) if raw else {"format": FORMAT, "switches": 0}
        if not isinstance(marker, dict):
            raise ValueError("not a JSON object")
        if marker.get("format") != FORMAT:
            raise ValueError(f"unknown format {marker.get('format')!r}")
        expected = marker.get("switches")
        if not isinstance(expected, int) or isinstance(expected, bool) or expected < 0:
            raise ValueError(f"'switches' is {expected!r}, expected a count")
    except (ValueError, RecursionError) as exc:
        raise SerializationError(f"malformed {MARKER_FILE}: {exc}", where=where,
                                 hint="the archive was edited after it was written; re-save the original program") from exc
    try:
        restored, count = decode_switches(program)
    except SerializationError as exc:
        raise SerializationError(exc.message, where=f"{where}, {exc.where}" if exc.where else where,
                                 hint=exc.hint) from exc
    if count != expected:
        raise SerializationError(
            f"{MARKER_FILE} records {expected} switch(es) but {count} were found", where=where,
            hint="the archive was edited after it was written; re-save the original program",
        )
    logger.info(
        "loaded %s (%s; %d switch(es) restored) in %.2f s",
        where, "trusted" if trusted else "safe reader", count, time.perf_counter() - start,
    )
    return restored
