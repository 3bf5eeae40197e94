"""An on-disk cache of compiled kernels, safe against crashes, races and damage.

Layout: ``<cache_dir>/kernels/<digest>/`` holds the artifact files a build
wrote plus ``manifest.json``::

    {"schema": 2, "build": "<uuid>", "key": {...}, "env": {...}, "files": {"kernel.o": "<sha256>", ...}}

``digest`` hashes the key and the environment (GPU, driver, CUDA, torch,
CuTeDSL versions), so a different environment never even looks at another's
entry. An entry is used only if its manifest parses, has this schema, names
the same key and environment, lists plain file names only, and every file's
sha256 matches; a failing ``load`` counts as damage too. Anything else (a
truncated or garbage file, a directory where a file should be, a file where
the entry directory should be) is logged and rebuilt, never raised.

Concurrency: any number of threads and processes may read, build and replace
the same key at once. Reading takes no lock; a reader that finds the entry
absent or damaged takes the key's inter-process lock, looks again (another
process may have published it meanwhile: the loser of a race uses the
winner's entry) and only then builds. A build happens in a private
temporary directory and is renamed into place under that lock, the old
entry first renamed into a private trash directory, so a reader sees a whole
entry or none. Something other than a folder where ``kernels/`` or
``.locks/`` should be is removed, with a warning. A cache folder that cannot
be written is no error either: the kernel is built into the process's
private temporary folder (removed at exit, or by the next process if this
one is killed) and kept in memory, with one warning.

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

import atexit
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

from branchyard._owned_tempdirs import make_owned_tempdir
from branchyard.errors import LoweringError
from branchyard.lowering.nvgemm.environment import environment
from branchyard.lowering.nvgemm.store import (
    JsonDamage,
    atomic_write_text,
    cache_dir,
    ensure_folder,
    file_lock,
    read_json,
    remove_path,
)

__all__ = ["KernelCache", "MANIFEST", "KERNEL_CACHE_SCHEMA", "default_kernel_cache"]

logger = logging.getLogger("branchyard")

T = TypeVar("T")

KERNEL_CACHE_SCHEMA = 2
MANIFEST = "manifest.json"
#: Name prefix of the private folder (in the system's temporary folder) of a
#: process whose cache folder cannot be written.
PRIVATE_PREFIX = "branchyard-kernels-"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def _plain_name(name: Any) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..", MANIFEST) and "/" not in name and "\\" not in name


class KernelCache:
    """``get_or_build(key, build, load)``: the loaded kernel for ``key``,
    from disk when an intact entry exists, else built into a fresh entry.

    ``build(directory)`` writes the artifact files into ``directory``;
    ``load(directory)`` turns them into the callable. Loaded kernels are also
    kept in memory for the life of the process. ``stats`` counts hits, builds
    and rebuilds (builds that replaced a damaged or stale entry).
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None, *, env: Mapping[str, str] | None = None) -> None:
        base = Path(directory) if directory is not None else cache_dir()
        self.root = base / "kernels"
        self.locks = base / ".locks"
        self._env = dict(env) if env is not None else None
        self._memory: dict[str, Any] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self.stats = {"hits": 0, "builds": 0, "rebuilt": 0}
        #: Why the disk is not used (``None`` while it is).
        self.disk_error: str | None = None
        self._private: Path | None = None

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

    def _manifest(self, entry: Path) -> dict[str, Any] | str:
        if not entry.exists() and not entry.is_symlink():
            return "absent"
        if not entry.is_dir():
            return "a file stands where the entry directory should be"
        manifest = read_json(entry / MANIFEST)
        if manifest is None:
            return "unreadable manifest (absent)"
        if isinstance(manifest, JsonDamage):
            return f"unreadable manifest ({manifest.reason})"
        if not isinstance(manifest, dict):
            return "unreadable manifest (not an object)"
        return manifest

    def check(self, key: Mapping[str, Any]) -> str | None:
        """``None`` if ``key``'s entry is intact, else what is wrong with it."""
        manifest = self._manifest(self.path(key))
        return manifest if isinstance(manifest, str) else self._verify(key, self.path(key), manifest)

    def _verify(self, key: Mapping[str, Any], entry: Path, manifest: dict[str, Any]) -> str | None:
        if manifest.get("schema") != KERNEL_CACHE_SCHEMA:
            return f"schema {manifest.get('schema')!r}, expected {KERNEL_CACHE_SCHEMA}"
        if _canonical(manifest.get("key")) != _canonical(key) or _canonical(manifest.get("env")) != _canonical(self.env):
            return "stale (the manifest names another key or environment)"
        files = manifest.get("files")
        if not isinstance(files, dict) or not files:
            return "the manifest lists no files"
        for name, digest in files.items():
            if not _plain_name(name):
                return f"the manifest names {name!r}, not a file of the entry"
            f = entry / name
            try:
                if not f.is_file():
                    return f"missing file {name!r}"
                if _sha256(f) != digest:
                    return f"file {name!r} fails its checksum"
            except OSError as exc:  # replaced or removed while we read it
                return f"file {name!r} unreadable ({type(exc).__name__})"
        return None

    def _try_load(
        self, key: Mapping[str, Any], entry: Path, load: Callable[[Path], T], skip_build: Any = None,
    ) -> tuple[T | None, str | None, Any]:
        """(kernel, None, build id) from an intact entry, or (None, what is wrong,
        build id). An entry whose build id is ``skip_build`` (one that already
        failed to load) is not loaded again."""
        manifest = self._manifest(entry)
        if isinstance(manifest, str):
            return None, manifest, None
        build_id = manifest.get("build")
        problem = self._verify(key, entry, manifest)
        if problem is not None:
            return None, problem, build_id
        if skip_build is not None and build_id == skip_build:
            return None, "load failed (before)", build_id
        try:
            return load(entry), None, build_id
        except Exception as exc:  # the files are intact but do not load (or vanished meanwhile)
            exc = exc.error if isinstance(exc, _CallerError) else exc
            return None, f"load failed ({type(exc).__name__}: {exc})", build_id

    def get_or_build(self, key: Mapping[str, Any], build: Callable[[Path], None], load: Callable[[Path], T]) -> T:
        """The kernel for ``key`` (see the module docstring). What ``build`` or
        ``load`` raise reaches the caller as it was raised."""
        digest = self.digest(key)
        if digest in self._memory:
            return self._memory[digest]
        with self._lock(digest):
            if digest in self._memory:
                return self._memory[digest]
            try:
                kernel = self._get_or_build(digest, key, _Guarded(build), _Guarded(load))
            except _CallerError as exc:
                raise exc.error from exc.error.__cause__
            self._memory[digest] = kernel
            return kernel

    def _get_or_build(self, digest: str, key: Mapping[str, Any], build: Callable[[Path], None],
                      load: Callable[[Path], T]) -> T:
        entry = self.root / digest
        if self.disk_error is None:
            kernel, problem, failed_build = self._try_load(key, entry, load)
            if problem is None:
                self.stats["hits"] += 1
                return kernel  # type: ignore[return-value]
            try:
                self._own_folder(self.locks)
                with file_lock(self.locks / f"{digest}.lock"):
                    return self._locked_get_or_build(key, entry, build, load, problem, failed_build)
            except OSError as exc:
                self.disk_error = f"{type(exc).__name__}: {exc}"
                logger.warning("nvgemm: cannot write the kernel cache in %s (%s); this process keeps its "
                               "kernels in memory", self.root, self.disk_error)
        return self._build_private(key, build, load)

    def _locked_get_or_build(self, key, entry, build, load, problem, failed_build):
        # Under the key's lock: another process may have published the entry meanwhile.
        skip = failed_build if problem.startswith("load failed") else None
        kernel, now, _ = self._try_load(key, entry, load, skip_build=skip)
        if now is None:
            self.stats["hits"] += 1
            return kernel
        if now != "load failed (before)":
            problem = now
        if problem != "absent":
            logger.warning("nvgemm: kernel cache entry %s is bad: %s; rebuilding", entry, problem)
            self.stats["rebuilt"] += 1
        self._publish(key, entry, build)
        self.stats["builds"] += 1
        return load(entry)

    def _staged(self, key: Mapping[str, Any], build: Callable[[Path], None], parent: Path) -> Path:
        """Build into a fresh directory under ``parent``, with its manifest; return it."""
        tmp = Path(make_owned_tempdir(parent, ".build-"))
        try:
            build(tmp)
            files = {p.name: _sha256(p) for p in sorted(tmp.iterdir()) if p.is_file() and p.name != MANIFEST}
            if not files:
                raise LoweringError("the kernel build wrote no files", where=f"kernel cache {tmp.name}")
            manifest = {"schema": KERNEL_CACHE_SCHEMA, "build": uuid.uuid4().hex, "key": key, "env": self.env,
                        "files": files}
            atomic_write_text(tmp / MANIFEST, _canonical(manifest))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return tmp

    def _publish(self, key: Mapping[str, Any], entry: Path, build: Callable[[Path], None]) -> None:
        """Build and rename into place (the caller holds the key's lock)."""
        self._own_folder(self.root)
        tmp = self._staged(key, build, self.root)
        try:
            if entry.exists() or entry.is_symlink():
                trash = Path(make_owned_tempdir(self.root, ".trash-"))
                os.rename(entry, trash / "old")
                remove_path(trash)
            os.rename(tmp, entry)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    def _own_folder(self, folder: Path) -> None:
        if ensure_folder(folder):
            logger.warning("nvgemm: something other than a folder stood at %s; removed it", folder)

    def _build_private(self, key: Mapping[str, Any], build: Callable[[Path], None], load: Callable[[Path], T]) -> T:
        """Build into this process's private folder (the cache folder is not writable)."""
        if self._private is None:
            self._private = Path(make_owned_tempdir(tempfile.gettempdir(), PRIVATE_PREFIX))
            atexit.register(shutil.rmtree, self._private, ignore_errors=True)
        tmp = self._staged(key, build, self._private)
        self.stats["builds"] += 1
        return load(tmp)


class _CallerError(Exception):
    """An OSError raised by the caller's ``build`` or ``load``, carried past the
    cache's own ``except OSError`` (which means: the cache folder is not
    writable) so that a missing ``ptxas`` or a failed ``dlopen`` is not taken
    for a disk problem that turns the disk cache off."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


class _Guarded:
    """``fn`` with its OSErrors raised as :class:`_CallerError`."""

    def __init__(self, fn: Callable[[Path], Any]) -> None:
        self.fn = fn

    def __call__(self, path: Path) -> Any:
        try:
            return self.fn(path)
        except OSError as exc:
            raise _CallerError(exc) from exc


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
