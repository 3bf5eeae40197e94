"""Temporary folders next to what they will become, named after the process
that made them, so that a later process can remove those a killed process
left behind (a SIGKILL runs no cleanup).

A folder is ``<prefix><host>-<pid>-<random>.tmp``: ``host`` a short hash of
the host name, so a process never judges another machine's process on a
shared file system. :func:`sweep` removes a folder only when its host is
this one and its process is gone; a process that is alive, or that belongs
to another user (which ``kill(pid, 0)`` cannot see), keeps its folder.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import tempfile

__all__ = ["make_owned_tempdir", "sweep"]

_HOST = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # another user's process, or not a pid: leave it
    return True


def sweep(parent: str | os.PathLike[str], prefix: str) -> list[str]:
    """Remove the ``prefix`` folders in ``parent`` whose process on this host
    is gone; return their names."""
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        if not (entry.name.startswith(prefix) and entry.name.endswith(".tmp")):
            continue
        host, _, rest = entry.name[len(prefix):].partition("-")
        pid = rest.partition("-")[0]
        if host != _HOST or not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.name)
        except OSError:
            continue
    return removed


def make_owned_tempdir(parent: str | os.PathLike[str], prefix: str) -> str:
    """A new ``prefix`` folder in ``parent``, after sweeping the ones dead
    processes left there."""
    sweep(parent, prefix)
    return tempfile.mkdtemp(prefix=f"{prefix}{_HOST}-{os.getpid()}-", suffix=".tmp", dir=parent)
