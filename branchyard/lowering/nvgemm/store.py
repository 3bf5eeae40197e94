"""The on-disk store the caches share: where it lives, how a file is
replaced, how processes take turns, and what counts as damage.

* :func:`cache_dir` -- ``$BRANCHYARD_CACHE_DIR/nvgemm`` (default
  ``~/.cache/branchyard/nvgemm``);
* :func:`atomic_write_text` -- readers see the old file or the new one, never
  half of one;
* :func:`file_lock` -- an inter-process lock (the ``filelock`` package; the
  lock is released by the OS if its holder dies);
* :func:`read_json` -- a JSON file, or why it is damaged: unreadable,
  truncated, garbage, nested too deep, a directory where the file should be.
  Damage is a value, never an exception, so every caller rebuilds;
* :func:`remove_path` -- take a file or a directory tree out of the way.

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> atomic_write_text(d / "x.json", '{"a": 1}')
    >>> read_json(d / "x.json")
    {'a': 1}
    >>> (d / "y.json").write_text("[" * 100_000)
    100000
    >>> read_json(d / "y.json")
    JsonDamage('nested deeper than the parser allows')
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import filelock

__all__ = [
    "JsonDamage",
    "atomic_write_text",
    "cache_dir",
    "ensure_folder",
    "file_lock",
    "read_json",
    "remove_path",
]

#: Seconds a process waits for another to release a cache lock before it
#: gives up on the disk for that operation (a live holder takes milliseconds).
LOCK_TIMEOUT_S = 120.0


def cache_dir() -> Path:
    """``$BRANCHYARD_CACHE_DIR/nvgemm`` (default ``~/.cache/branchyard/nvgemm``)."""
    root = os.environ.get("BRANCHYARD_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "branchyard")
    return Path(root) / "nvgemm"


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so readers see the old or the new file, never half.

    A directory standing where the file should be is removed first (damage).
    Raises ``OSError`` when the folder cannot be written.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if path.is_dir() and not path.is_symlink():
            remove_path(path)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def ensure_folder(path: Path) -> bool:
    """Make the folder ``path`` (and its parents). A file, FIFO, device or
    socket standing at ``path`` itself is removed first; a link is left alone
    (it may point to a disk not mounted now). Only for folders the cache owns
    by name, never one the user named. ``True`` when something was removed.
    Raises ``OSError`` when the folder cannot be made."""
    removed = False
    if os.path.lexists(path) and not path.is_symlink() and not path.is_dir():
        try:  # unlink, never rmtree: another process may have made the folder meanwhile
            path.unlink()
            removed = True
        except (FileNotFoundError, IsADirectoryError):
            pass
    path.mkdir(parents=True, exist_ok=True)
    return removed


@contextlib.contextmanager
def file_lock(path: Path, timeout: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold the inter-process lock ``path`` (created if absent).

    Raises ``OSError`` when the lock file cannot be created (an unwritable
    folder) and ``filelock.Timeout`` (an ``OSError`` too, via ``TimeoutError``)
    when another process holds it for longer than ``timeout`` seconds.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink() or path.is_dir():
        # filelock refuses a link (ELOOP) and cannot lock a folder: left there, either
        # would keep every process off the disk for good. Unlinking never touches its target.
        remove_path(path)
    with filelock.FileLock(str(path), timeout=timeout):
        yield


@dataclass(frozen=True)
class JsonDamage:
    """Why a JSON file could not be read (``read_json``'s answer for damage)."""

    reason: str

    def __repr__(self) -> str:
        return f"JsonDamage({self.reason!r})"


def read_json(path: Path) -> Any:
    """The parsed content of ``path``; ``None`` if it does not exist; a
    :class:`JsonDamage` if it exists but is not a readable JSON document."""
    try:
        kind = os.stat(path).st_mode
        if not (stat.S_ISREG(kind) or stat.S_ISDIR(kind)):  # a FIFO would block the read forever
            return JsonDamage("a FIFO, device or socket stands where the file should be")
        text = path.read_text()
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        return JsonDamage("a directory stands where the file should be")
    except (OSError, UnicodeDecodeError) as exc:
        return JsonDamage(f"unreadable ({type(exc).__name__}: {exc})")
    try:
        return json.loads(text)
    except RecursionError:
        return JsonDamage("nested deeper than the parser allows")
    except ValueError as exc:
        return JsonDamage(f"not JSON ({exc})")


def remove_path(path: Path) -> None:
    """Remove a file, link or directory tree at ``path``; absent is fine."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink()
    except FileNotFoundError:
        pass
