"""An on-disk cache of compiled kernels, safe against crashes, races and rot.

Layout: ``<cache_dir>/kernels/<digest>/`` holds the artifact files a build
wrote plus ``manifest.json``::

    {"schema": 1, "key": {...}, "env": {...}, "files": {"kernel.o": "<sha256>", ...}}

``digest`` hashes the key and the environment (GPU, driver, CUDA, torch,
CuTeDSL versions), so a different environment never even looks at another's
entry. An entry is used only if its manifest parses, has this schema, names
the same key and environment, and every file's sha256 matches; a failing
``load`` counts as corrupt too. Anything else is logged and rebuilt.

Builds happen in a private temporary directory which is renamed into place
(``os.rename`` of a directory is atomic), so a reader sees a complete entry or
none; when two processes race, the first rename wins and the loser uses it.

    >>> import tempfile, pathlib
    >>> cache = KernelCache(tempfile.mkdtemp(), env={"gpu": "doc"})
    >>> def build(d):
    ...     (d / "kernel.bin").write_bytes(b"\\x7fELF...")
    >>> load = lambda d: (d / "kernel.bin").read_bytes()
    >>> cache.get_or_build({"spec": "relu", "tile": "128x256"}, build, load)
    b'\\x7fELF...'
    >>> cache.stats
    {'hits': 0, 'builds': 1, 'rebuilt': 0}
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

from branchyard.lowering.nvgemm.environment import environment
from branchyard.lowering.nvgemm.store import atomic_write_text, cache_dir

__all__ = ["KernelCache", "MANIFEST", "KERNEL_CACHE_SCHEMA", "default_kernel_cache"]

logger = logging.getLogger("branchyard")

T = TypeVar("T")

KERNEL_CACHE_SCHEMA = 1
MANIFEST = "manifest.json"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


class KernelCache:
    """``get_or_build(key, build, load)``: the loaded kernel for ``key``,
    from disk when an intact entry exists, else built into a fresh entry.

    ``build(directory)`` writes the artifact files into ``directory``;
    ``load(directory)`` turns them into the callable. Loaded kernels are also
    kept in memory for the life of the process. ``stats`` counts hits, builds
    and rebuilds (builds that replaced a corrupt or stale entry).
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None, *, env: Mapping[str, str] | None = None) -> None:
        self.root = (Path(directory) if directory is not None else cache_dir()) / "kernels"
        self._env = dict(env) if env is not None else None
        self._memory: dict[str, Any] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self.stats = {"hits": 0, "builds": 0, "rebuilt": 0}

    @property
    def env(self) -> dict[str, str]:
        """The environment entries are valid for (default: :func:`environment`)."""
        return self._env if self._env is not None else environment()

    def digest(self, key: Mapping[str, Any]) -> str:
        """The entry directory name for ``key`` in this environment."""
        text = _canonical({"schema": KERNEL_CACHE_SCHEMA, "key": key, "env": self.env})
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def path(self, key: Mapping[str, Any]) -> Path:
        """The entry directory for ``key``."""
        return self.root / self.digest(key)

    def _lock(self, digest: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(digest, threading.Lock())

    def check(self, key: Mapping[str, Any]) -> str | None:
        """``None`` if ``key``'s entry is intact, else what is wrong with it."""
        entry = self.path(key)
        if not entry.is_dir():
            return "absent"
        try:
            manifest = json.loads((entry / MANIFEST).read_text())
        except (OSError, ValueError) as exc:
            return f"unreadable manifest ({exc})"
        if not isinstance(manifest, dict) or manifest.get("schema") != KERNEL_CACHE_SCHEMA:
            return f"schema {manifest.get('schema') if isinstance(manifest, dict) else None!r}, expected {KERNEL_CACHE_SCHEMA}"
        if _canonical(manifest.get("key")) != _canonical(key) or _canonical(manifest.get("env")) != _canonical(self.env):
            return "stale (the manifest names another key or environment)"
        files = manifest.get("files")
        if not isinstance(files, dict) or not files:
            return "the manifest lists no files"
        for name, digest in files.items():
            f = entry / name
            if not f.is_file():
                return f"missing file {name!r}"
            if _sha256(f) != digest:
                return f"file {name!r} fails its checksum"
        return None

    def get_or_build(self, key: Mapping[str, Any], build: Callable[[Path], None], load: Callable[[Path], T]) -> T:
        """The kernel for ``key`` (see the class docstring)."""
        digest = self.digest(key)
        if digest in self._memory:
            return self._memory[digest]
        with self._lock(digest):
            if digest in self._memory:
                return self._memory[digest]
            entry = self.root / digest
            problem = self.check(key)
            if problem is None:
                try:
                    kernel = load(entry)
                    self.stats["hits"] += 1
                    self._memory[digest] = kernel
                    return kernel
                except Exception as exc:  # the files are intact but do not load: rebuild
                    problem = f"load failed ({type(exc).__name__}: {exc})"
            if problem != "absent":
                logger.warning("nvgemm: kernel cache entry %s is bad: %s; rebuilding", entry, problem)
                self.stats["rebuilt"] += 1
            self._build(key, entry, build, replace=problem != "absent")
            self.stats["builds"] += 1
            kernel = load(entry)
            self._memory[digest] = kernel
            return kernel

    def _build(self, key: Mapping[str, Any], entry: Path, build: Callable[[Path], None], *, replace: bool) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=self.root))
        try:
            build(tmp)
            files = {
                p.name: _sha256(p) for p in sorted(tmp.iterdir()) if p.is_file() and p.name != MANIFEST
            }
            if not files:
                from branchyard.errors import LoweringError

                raise LoweringError("the kernel build wrote no files", where=f"kernel cache {entry.name}")
            manifest = {"schema": KERNEL_CACHE_SCHEMA, "key": key, "env": self.env, "files": files}
            atomic_write_text(tmp / MANIFEST, _canonical(manifest))
            if replace and entry.exists():
                trash = Path(tempfile.mkdtemp(prefix=".trash-", dir=self.root))
                os.rename(entry, trash / "old")
                shutil.rmtree(trash, ignore_errors=True)
            try:
                os.rename(tmp, entry)
            except OSError:
                # Another process published this entry first; theirs is as good as ours.
                if self.check(key) is not None:
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)


_DEFAULTS: dict[Path, KernelCache] = {}
_DEFAULTS_LOCK = threading.Lock()


def default_kernel_cache() -> KernelCache | None:
    """The process's cache under :func:`cache_dir` (one per directory, so a
    changed ``BRANCHYARD_CACHE_DIR`` takes effect), or ``None`` when
    ``BRANCHYARD_NVGEMM_KERNEL_CACHE=0`` turns on-disk kernels off.

        >>> import os
        >>> os.environ["BRANCHYARD_NVGEMM_KERNEL_CACHE"] = "0"
        >>> default_kernel_cache() is None
        True
        >>> del os.environ["BRANCHYARD_NVGEMM_KERNEL_CACHE"]
    """
    if os.environ.get("BRANCHYARD_NVGEMM_KERNEL_CACHE", "1") == "0":
        return None
    root = cache_dir()
    with _DEFAULTS_LOCK:
        cache = _DEFAULTS.get(root)
        if cache is None:
            cache = _DEFAULTS[root] = KernelCache(root)
        return cache
