"""The winner database: which candidate won for each tuned problem, on disk
so that later processes skip tuning.

One JSON file per schema version, ``<cache_dir>/winners-v<SCHEMA_VERSION>.json``::

    {"schema": 2, "entries": {key: {"winner", "timings", "excluded", "checksum", ...}}}

so processes of different library versions sharing a cache folder keep
their own entries instead of wiping each other's. Writes are atomic (temp
file + ``os.replace``) under an inter-process lock, so concurrent writers
lose no entries. Damage (an unreadable, truncated or garbage file, a
directory in its place, an entry failing its checksum) is logged and treated
as absent; the next :meth:`WinnerDB.put` rewrites the file. A folder that
cannot be written is not an error either: the database warns once and keeps
this process's winners in memory.

    >>> import tempfile
    >>> db = WinnerDB(tempfile.mkdtemp())
    >>> db.put("k", {"winner": "aten:unfused"})
    >>> db.get("k")["winner"]
    'aten:unfused'
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any, Mapping, Sequence

from branchyard.lowering.nvgemm.store import JsonDamage, atomic_write_text, cache_dir, file_lock, read_json

__all__ = ["SCHEMA_VERSION", "WinnerDB"]

logger = logging.getLogger("branchyard")

#: Version of the entries' layout; each version has its own file.
SCHEMA_VERSION = 2


def _checksum(payload: Mapping[str, Any]) -> str:
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class WinnerDB:
    """Winners by key, on disk in ``directory``, in memory where the disk
    cannot be written. Without ``directory``, :func:`cache_dir` at each use,
    so a changed ``BRANCHYARD_CACHE_DIR`` takes effect (as for the kernel
    cache): new winners go there, and a folder that could not be written
    before is tried again there."""

    FILE = f"winners-v{SCHEMA_VERSION}.json"
    LOCK = f".winners-v{SCHEMA_VERSION}.lock"

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self._fixed = Path(directory) if directory is not None else None
        self._memory: dict[str, dict[str, Any]] = {}
        self._guard = threading.Lock()
        self._errors: dict[Path, str] = {}

    @property
    def directory(self) -> Path:
        """The folder of the database file."""
        return self._fixed if self._fixed is not None else cache_dir()

    @property
    def path(self) -> Path:
        """The database file."""
        return self.directory / self.FILE

    @property
    def disk_error(self) -> str | None:
        """Why the disk is not used (``None`` while it is)."""
        return self._errors.get(self.directory)

    def _read(self, path: Path) -> dict[str, Any]:
        data = read_json(path)
        if data is None:
            return {}
        if isinstance(data, JsonDamage):
            logger.warning("nvgemm: winner database %s is damaged (%s); rebuilding it", path, data.reason)
            return {}
        if not isinstance(data, dict) or data.get("schema") != SCHEMA_VERSION or not isinstance(data.get("entries"), dict):
            logger.warning(
                "nvgemm: winner database %s is not a schema-%d file; rebuilding it", path, SCHEMA_VERSION
            )
            return {}
        return data["entries"]

    @staticmethod
    def _intact(entry: Any) -> bool:
        if not isinstance(entry, dict) or not isinstance(entry.get("winner"), str):
            return False
        if not all(isinstance(entry.get(field) or {}, dict) for field in ("timings", "excluded")):
            return False  # what the race saw is read below: it must be a name -> figure/reason map
        unavailable = entry.get("unavailable") or []
        if not isinstance(unavailable, list) or not all(isinstance(n, str) for n in unavailable):
            return False
        body = {k: v for k, v in entry.items() if k != "checksum"}
        return entry.get("checksum") == _checksum(body)

    def get(self, key: str, known: Sequence[str] | None = None) -> dict[str, Any] | None:
        """The entry for ``key`` if present and intact; with ``known`` (the
        candidate names offered now), only if its winner is still one of them
        and its race saw every one of them (timed, or excluded for a reason of
        the problem's: not one its process named ``unavailable``). A winner
        picked while a candidate was off (``BRANCHYARD_NVGEMM_INDUCTOR=0``, a
        per-process cap, an older version) says nothing about that
        candidate, so the problem is tuned again."""
        where = self.directory
        entry = self._read(where / self.FILE).get(key) if where not in self._errors else None
        if entry is not None and not self._intact(entry):
            logger.warning("nvgemm: winner entry for %s is damaged; retuning", key)
            entry = None
        if entry is None:
            with self._guard:
                entry = self._memory.get(key)
        if entry is None:
            return None
        if known is not None and entry.get("winner") not in known:
            logger.info("nvgemm: stale winner %r for %s (not a candidate this process can build); retuning",
                        entry.get("winner"), key)
            return None
        raced = set(entry.get("timings") or ()) | set(entry.get("excluded") or ())
        raced -= set(entry.get("unavailable") or ())
        unraced = [name for name in known or () if raced and name not in raced]
        if unraced:
            logger.info("nvgemm: winner %r for %s was picked without %s; retuning", entry.get("winner"), key,
                        ", ".join(unraced))
            return None
        return entry

    def put(self, key: str, entry: Mapping[str, Any]) -> None:
        """Store ``entry`` under ``key`` (atomically, with its checksum); never
        raises for an unwritable folder (see the module docstring)."""
        body = dict(entry)
        body.pop("checksum", None)
        body["checksum"] = _checksum(body)
        with self._guard:
            self._memory[key] = body
        where = self.directory
        if where in self._errors:
            return
        try:
            with file_lock(where / self.LOCK):
                entries = self._read(where / self.FILE)
                entries[key] = body
                atomic_write_text(where / self.FILE, json.dumps({"schema": SCHEMA_VERSION, "entries": entries},
                                                        indent=1, sort_keys=True))
        except OSError as exc:
            self._errors[where] = f"{type(exc).__name__}: {exc}"
            logger.warning("nvgemm: cannot write the winner database in %s (%s); this process keeps its "
                           "winners in memory", where, self._errors[where])

    def entries(self) -> dict[str, Any]:
        """Every stored entry (on disk, then this process's in-memory ones), keyed."""
        where = self.directory
        out = self._read(where / self.FILE) if where not in self._errors else {}
        with self._guard:
            return {**self._memory, **out}
