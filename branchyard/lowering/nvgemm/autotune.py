"""Choose the fastest implementation of a fused GEMM by timing it on the real shape.

For one problem (epilogue spec, ``M``, ``N``, ``K``, dtypes, layouts) the
autotuner:

1. lists the candidates that apply (:func:`default_candidates`): our CuTeDSL
   sm_90a kernel with the epilogue in registers (one per tile config), the
   cutlass-operators plain GEMM + separate epilogue, cuBLASLt
   (``torch._addmm_activation``, only for exactly bias+relu / bias+gelu_tanh),
   Triton (the unfused chain compiled by Inductor, max-autotune) and the
   unfused ATen chain;
2. builds each one; a build failure excludes it, with the reason logged;
3. runs each once against the fp32 reference (wrong numerics exclude it);
4. times the survivors (median of CUDA-event timings with the L2 flushed
   before every run) and keeps the fastest;
5. records the winner in the on-disk :class:`WinnerDB`, keyed by GPU, driver,
   CUDA, torch and CuTeDSL versions, dtypes, layouts, spec, ``N``, ``K`` and
   an ``M`` bucket (the next power of two), so later processes skip 2-4.

Everything the decision depends on is injectable (candidates, timer, database,
environment), so the logic is tested on CPU with fake timings::

    >>> import torch, tempfile
    >>> from branchyard.lowering.nvgemm.epilogue import EpilogueSpec, unfused_aten_epilogue
    >>> spec = EpilogueSpec.parse("w=kn;relu;out=float32")
    >>> def aten(p):
    ...     return lambda a, b, ops, out: unfused_aten_epilogue(a @ b, p.spec, ops)
    >>> fake_ms = {"slow": 2.0, "fast": 1.0}
    >>> tuner = Autotuner([Candidate("slow", aten), Candidate("fast", aten)],
    ...                   timer=lambda name, fn: fake_ms[name], progress=False,
    ...                   db=WinnerDB(tempfile.mkdtemp()), env={"gpu": "test"})
    >>> a, b = torch.randn(8, 16), torch.randn(16, 32)
    >>> tuner.tune(a, b, [], spec).winner
    'fast'
"""

from __future__ import annotations

import contextlib
import dataclasses
import ctypes
import fcntl
import functools
import hashlib
import importlib.metadata
import itertools
import json
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from branchyard.errors import LoweringError
from branchyard.lowering.nvgemm.epilogue import (
    EpilogueSpec,
    reference_fused_gemm,
    unfused_aten_epilogue,
)

__all__ = [
    "Problem",
    "Candidate",
    "Impl",
    "TuneResult",
    "Autotuner",
    "WinnerDB",
    "ProgressBar",
    "default_candidates",
    "cuda_event_timer",
    "environment",
    "cache_dir",
    "m_bucket",
    "select",
    "get_autotuner",
    "set_autotuner",
    "SCHEMA_VERSION",
]

logger = logging.getLogger("branchyard")

#: Version of the winner database's JSON layout; a file with another version is rebuilt.
SCHEMA_VERSION = 1

#: ``impl(a [M, K], b_kn [K, N], operands, out [M, N]) -> result``. The result
#: is ``out`` (written in place) or a tensor of the same shape and dtype.
Impl = Callable[[torch.Tensor, torch.Tensor, Sequence[torch.Tensor], torch.Tensor], Any]


def cache_dir() -> Path:
    """``$BRANCHYARD_CACHE_DIR/nvgemm`` (default ``~/.cache/branchyard/nvgemm``)."""
    root = os.environ.get("BRANCHYARD_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "branchyard")
    return Path(root) / "nvgemm"


def m_bucket(m: int) -> int:
    """The ``M`` bucket a winner is shared across: the next power of two.

    >>> [m_bucket(m) for m in (1, 2, 3, 16, 17, 2048, 3000)]
    [1, 2, 4, 16, 32, 2048, 4096]
    """
    return 1 if m <= 1 else 1 << (m - 1).bit_length()


def _dt(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _layout(t: torch.Tensor) -> str:
    """``row`` (last dim contiguous), ``col`` (first dim contiguous) or the strides."""
    if t.dim() == 1:
        return "vec" if t.stride(0) == 1 else f"s{t.stride(0)}"
    if t.stride(-1) == 1:
        return "row"
    if t.dim() == 2 and t.stride(0) == 1:
        return "col"
    return "s" + "x".join(map(str, t.stride()))


@dataclass(frozen=True)
class Problem:
    """What the winner depends on: one fused GEMM on one device."""

    spec: EpilogueSpec
    m: int
    n: int
    k: int
    dtype: torch.dtype
    operand_dtypes: tuple[torch.dtype, ...]
    a_layout: str
    b_layout: str  # "nk": b_kn is the .t() of a row-major [N, K] weight; "kn": row-major [K, N]
    operand_layouts: tuple[str, ...]
    device: str

    @staticmethod
    def of(a: torch.Tensor, b_kn: torch.Tensor, operands: Sequence[torch.Tensor], spec: EpilogueSpec) -> "Problem":
        """The problem an op call poses (``a`` ``[M, K]``, ``b_kn`` ``[K, N]``).

        Candidates always see ``b`` as ``[K, N]``, so the spec is normalised to
        ``weight_layout="kn"``; the memory layout is ``b_layout``.
        """
        spec = dataclasses.replace(spec, weight_layout="kn")
        m, k = a.shape
        n = b_kn.shape[1]
        b_layout = "kn" if b_kn.stride(1) == 1 else "nk" if b_kn.stride(0) == 1 else _layout(b_kn)
        return Problem(
            spec, int(m), int(n), int(k), a.dtype, tuple(t.dtype for t in operands),
            _layout(a), b_layout, tuple(_layout(t) for t in operands), str(a.device),
        )

    def key(self, env: Mapping[str, str]) -> str:
        """The database key: environment, spec, dtypes, layouts, N, K, M bucket."""
        fields = dict(env)
        fields.update(
            spec=str(self.spec),
            dtype=_dt(self.dtype),
            operand_dtypes=",".join(map(_dt, self.operand_dtypes)),
            layouts=f"a:{self.a_layout};b:{self.b_layout};ops:{','.join(self.operand_layouts)}",
            n=str(self.n),
            k=str(self.k),
            m_bucket=str(m_bucket(self.m)),
        )
        return "|".join(f"{k}={v}" for k, v in fields.items())

    def __str__(self) -> str:
        return f"M={self.m} N={self.n} K={self.k} {_dt(self.dtype)} [{self.spec}]"


@dataclass(frozen=True)
class Candidate:
    """One way to run a problem. ``build(problem)`` returns an :data:`Impl` or
    raises (the candidate is then excluded with the error as reason);
    ``applies(problem)`` returns ``None`` or why the candidate does not apply."""

    name: str
    build: Callable[[Problem], Impl]
    applies: Callable[[Problem], str | None] = lambda problem: None


@dataclass
class TuneResult:
    """What one tuning run found: the winner, every survivor's median time in
    ms, and every excluded candidate with its reason."""

    key: str
    winner: str
    timings: dict[str, float] = field(default_factory=dict)
    excluded: dict[str, str] = field(default_factory=dict)
    from_cache: bool = False
    #: How many timings each re-timed contender's median is over (empty: one pass decided).
    rounds: dict[str, int] = field(default_factory=dict)
    #: The paired playoff, in order: each candidate's time over the then leader's (< 1: it took the lead).
    playoff: list[dict[str, Any]] = field(default_factory=list)
    impl: Impl | None = field(default=None, repr=False, compare=False)

    def table(self) -> str:
        """A readable summary (fastest first)."""
        rows = [f"{name:<28} {ms * 1e3:10.1f} us" for name, ms in sorted(self.timings.items(), key=lambda kv: kv[1])]
        rows += [f"{name:<28} excluded: {why}" for name, why in self.excluded.items()]
        return "\n".join(rows)


# --- environment -------------------------------------------------------------


def _driver_version() -> str:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int()
        if lib.cuDriverGetVersion(ctypes.byref(v)) == 0:
            return f"{v.value // 1000}.{(v.value % 1000) // 10}"
    except OSError:
        pass
    return "none"


def _package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "none"


@functools.lru_cache(maxsize=None)
def environment(device: str = "cuda") -> dict[str, str]:
    """What a winner is only valid for: GPU, driver, CUDA, torch, CuTeDSL."""
    gpu = "cpu"
    if device.startswith("cuda") and torch.cuda.is_available():
        index = torch.device(device).index or 0
        props = torch.cuda.get_device_properties(index)
        gpu = f"{props.name} sm{props.major}{props.minor}"
    return {
        "gpu": gpu,
        "driver": _driver_version(),
        "cuda": str(torch.version.cuda),
        "torch": torch.__version__,
        "cutedsl": _package_version("nvidia-cutlass-dsl"),
    }


# --- the winner database -------------------------------------------------------


def _checksum(payload: Mapping[str, Any]) -> str:
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so readers see the old or the new file, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class WinnerDB:
    """The on-disk record of autotuning winners: one JSON file,
    ``{"schema": 1, "entries": {key: {"winner", "timings", "excluded", "checksum", ...}}}``.

    Writes are atomic (temp file + ``os.replace``) under an advisory lock, so
    concurrent processes do not lose each other's entries. An unreadable file,
    another schema version, or an entry whose checksum does not match its
    content is reported (``logger.warning``) and treated as absent; the next
    :meth:`put` rewrites it.
    """

    FILE = "winners.json"

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self.directory = Path(directory) if directory is not None else cache_dir()
        self.path = self.directory / self.FILE

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / ".winners.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            logger.warning("nvgemm: winner database %s is corrupt (%s); rebuilding it", self.path, exc)
            return {}
        if not isinstance(data, dict) or data.get("schema") != SCHEMA_VERSION or not isinstance(data.get("entries"), dict):
            logger.warning(
                "nvgemm: winner database %s has schema %r, expected %d; rebuilding it",
                self.path, data.get("schema") if isinstance(data, dict) else None, SCHEMA_VERSION,
            )
            return {}
        return data["entries"]

    def get(self, key: str, known: Sequence[str] | None = None) -> dict[str, Any] | None:
        """The entry for ``key`` if present and intact (and, with ``known``, if
        its winner is still one of the candidate names ``known``)."""
        entry = self._read().get(key)
        if entry is None:
            return None
        body = {k: v for k, v in entry.items() if k != "checksum"} if isinstance(entry, dict) else None
        if body is None or entry.get("checksum") != _checksum(body):
            logger.warning("nvgemm: winner entry for %s fails its checksum; retuning", key)
            return None
        if known is not None and entry.get("winner") not in known:
            logger.info("nvgemm: stale winner %r for %s (no longer a candidate); retuning", entry.get("winner"), key)
            return None
        return entry

    def put(self, key: str, entry: Mapping[str, Any]) -> None:
        """Store ``entry`` under ``key`` (atomically, with its checksum)."""
        body = dict(entry)
        body.pop("checksum", None)
        body["checksum"] = _checksum(body)
        with self._locked():
            entries = self._read()
            entries[key] = body
            atomic_write_text(self.path, json.dumps({"schema": SCHEMA_VERSION, "entries": entries}, indent=1, sort_keys=True))

    def entries(self) -> dict[str, Any]:
        """Every stored entry (intact or not), keyed."""
        return self._read()


# --- progress --------------------------------------------------------------------


class ProgressBar:
    """A one-line stderr progress bar (no dependency). On a terminal it redraws
    in place; elsewhere it prints one line per step, so logs stay readable."""

    def __init__(self, total: int, label: str, *, stream: Any = None, enabled: bool = True, width: int = 24) -> None:
        self.total = max(total, 1)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.width = width
        self.done = 0
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def step(self, note: str) -> None:
        """Advance by one and show ``note`` (the candidate just handled)."""
        self.done += 1
        if not self.enabled:
            return
        filled = self.width * self.done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        line = f"nvgemm autotune {self.label} [{bar}] {self.done}/{self.total} {note}"
        if self.tty:
            self.stream.write("\r\x1b[2K" + line + ("\n" if self.done >= self.total else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


# --- timing ------------------------------------------------------------------------


class _L2Flush:
    """A buffer larger than any L2 (H200: 50 MiB), zeroed before each timed run."""

    def __init__(self, device: torch.device, nbytes: int = 256 << 20) -> None:
        self.buf = torch.empty(nbytes // 4, dtype=torch.int32, device=device)

    def __call__(self) -> None:
        self.buf.zero_()


#: Assumed GPU clock for ``torch.cuda._sleep`` (cycles): the H200 boosts to 1.98 GHz; a
#: slower clock only makes the hold longer.
_SLEEP_HZ = 2.0e9


def _hold_gpu(seconds: float) -> None:
    """Keep the current stream busy for about ``seconds`` with a spinning kernel, so
    that the host can enqueue the timed launches before the GPU reaches them."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None and seconds > 0:
        sleep(int(min(seconds, 0.5) * _SLEEP_HZ))


def cuda_event_timer(
    fn: Callable[[], Any], *, warmup: int = 3, reps: int = 20, max_ms: float = 400.0, device_only: bool = True,
) -> float:
    """Median milliseconds of ``fn`` between CUDA events, L2 flushed before each run.

    ``device_only`` (the default): device time, not host time. A spinning
    kernel holds the GPU while the host enqueues every run, so a candidate's
    Python and launch overhead (a compiled function's guards, one launch per
    kernel of an unfused chain) does not count. Under CUDA graphs or a
    compiled program that overhead is not paid, and at small M it is larger
    than the kernels themselves (20 us): timed with it, a one-kernel
    candidate would win over faster multi-kernel ones. ``device_only=False``
    times what an eager caller waits for, host overhead included wherever
    it exceeds the GPU's work. ``reps`` shrinks for slow functions so one
    candidate takes about ``max_ms``.
    """
    hold = _hold_gpu if device_only else (lambda seconds: None)
    device = torch.device("cuda", torch.cuda.current_device())
    flush = _L2Flush(device)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    host = time.perf_counter()
    fn()
    flush()
    host = time.perf_counter() - host  # enqueue time of one timed run
    torch.cuda.synchronize()
    probe_start, probe_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    hold(2 * host + 1e-3)
    probe_start.record()
    fn()
    probe_end.record()
    torch.cuda.synchronize()
    once = max(probe_start.elapsed_time(probe_end), 1e-3)
    reps = max(5, min(reps, int(max_ms / once)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    hold(2 * reps * host + 1e-3)
    for s, e in zip(starts, ends):
        flush()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def paired_order(pairs: int) -> list[tuple[int, int]]:
    """Run order of :func:`paired_ratio`: pair ``i`` runs (0, 1) when ``i`` is
    even and (1, 0) when odd, so neither function always runs first."""
    return [(0, 1) if i % 2 == 0 else (1, 0) for i in range(pairs)]


def ratio_summary(first_ms: Sequence[float], second_ms: Sequence[float]) -> tuple[float, float]:
    """Median and half the interquartile range of the per-pair ratios ``first / second``."""
    if len(first_ms) != len(second_ms) or not first_ms:
        raise LoweringError(f"paired_ratio: paired timings need two equal, non-empty lists "
                            f"(got {len(first_ms)} and {len(second_ms)} timings)")
    ratios = sorted(a / b for a, b in zip(first_ms, second_ms))
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return statistics.median(ratios), (q[2] - q[0]) / 2


def paired_ratio(
    first: Callable[[], Any], second: Callable[[], Any], *, pairs: int = 40, warmup: int = 2,
) -> tuple[float, float]:
    """Device time of ``first`` over ``second``, measured in adjacent pairs.

    Each pair runs both functions back to back (L2 flushed before each, the
    order alternating between pairs, see :func:`paired_order`) and gives one
    ratio; returns the median ratio and half its interquartile range. Two
    functions timed in separate blocks (as :func:`cuda_event_timer` does)
    see the clock at different moments, and the H200's clock moves by up to
    15% as it heats; within a pair both see the same clock. It is also a
    fresh measurement: the best of several columns, chosen by their times,
    is biased low by that choice, and re-timing it in pairs is not.
    """
    device = torch.device("cuda", torch.cuda.current_device())
    flush = _L2Flush(device)
    fns = (first, second)
    for _ in range(warmup):
        first()
        second()
    torch.cuda.synchronize()
    host = time.perf_counter()
    for fn in fns:
        flush()
        fn()
    host = time.perf_counter() - host  # enqueue time of one pair
    torch.cuda.synchronize()
    events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(pairs)]
              for _ in fns]
    _hold_gpu(2 * pairs * host + 1e-3)
    for i, order in enumerate(paired_order(pairs)):
        for which in order:
            start, end = events[which][i]
            flush()
            start.record()
            fns[which]()
            end.record()
    torch.cuda.synchronize()
    first_ms, second_ms = ([s.elapsed_time(e) for s, e in evs] for evs in events)
    return ratio_summary(first_ms, second_ms)


# --- candidates ----------------------------------------------------------------------


def _aten_build(problem: Problem) -> Impl:
    spec = problem.spec

    def impl(a, b_kn, operands, out):
        return unfused_aten_epilogue(torch.mm(a, b_kn), spec, list(operands))

    return impl


_CUBLASLT_CHAINS = {("bias", "relu"): False, ("bias", "gelu_tanh"): True}


def _cublaslt_applies(problem: Problem) -> str | None:
    names = tuple(n for n in problem.spec.names if not (n == "cast"))
    if names not in _CUBLASLT_CHAINS:
        return f"_addmm_activation fuses only bias+relu and bias+gelu_tanh, not {'+'.join(problem.spec.names)}"
    if problem.spec.out_dtype != problem.dtype or any(d != problem.dtype for d in problem.operand_dtypes):
        return "_addmm_activation needs the bias and output in the input dtype"
    if not problem.device.startswith("cuda"):
        return "cuBLASLt runs on CUDA only (the CPU kernel's GELU is the erf form)"
    return None


@functools.lru_cache(maxsize=None)
def _addmm_gelu_form(device: str, dtype: torch.dtype) -> str:
    """Which GELU ``_addmm_activation(use_gelu=True)`` computes here: "tanh"
    or "erf" (torch's CPU kernel uses erf; cuBLASLt's epilogue is tanh).

    Probed once per device and dtype on x in [-4, -2.8] (through ``x @ I``,
    which is exact), where the two forms differ by 10-40% of the value: far
    above 16-bit rounding, unlike the 1e-3-ish difference near 0 that the
    tolerance check alone cannot see.
    """
    x = torch.linspace(-4.0, -2.8, 64, device=device).reshape(8, 8).to(dtype)
    eye = torch.eye(8, device=device, dtype=dtype)
    got = torch._addmm_activation(torch.zeros(8, device=device, dtype=dtype), x, eye, use_gelu=True).double()
    xd = x.double()
    tanh, erf = torch.nn.functional.gelu(xd, approximate="tanh"), torch.nn.functional.gelu(xd)
    rel = lambda ref: ((got - ref).abs() / ref.abs()).mean().item()  # noqa: E731
    return "tanh" if rel(tanh) <= rel(erf) else "erf"


def _cublaslt_build(problem: Problem) -> Impl:
    use_gelu = _CUBLASLT_CHAINS[tuple(n for n in problem.spec.names if n != "cast")]
    if use_gelu and _addmm_gelu_form(problem.device, problem.dtype) != "tanh":
        raise LoweringError(
            f"_addmm_activation on {problem.device} computes the erf GELU, not the tanh form this chain needs",
            where="cublaslt candidate",
        )

    def impl(a, b_kn, operands, out):
        return torch._addmm_activation(operands[0], a, b_kn, use_gelu=use_gelu, out=out)

    return impl


#: (spec, mode, shapes, dtypes, strides) -> the compiled chain. Shared by the
#: op's autotuner and the benchmark, so each shape compiles once per process.
_INDUCTOR_FNS: dict[tuple, Callable[..., torch.Tensor]] = {}


def _fresh_chain(spec: EpilogueSpec) -> Callable[..., torch.Tensor]:
    """The unfused chain as a function with its OWN code object: Dynamo keeps
    its compile cache (and recompile limit) per code object, so one shared
    function would fall back to eager after a handful of shapes."""
    # A unique name and file too: some of Dynamo's per-function state is keyed
    # by (file, line, name) rather than by the code object.
    name = f"nvgemm_chain_{next(_CHAIN_IDS)}"
    ns: dict[str, Any] = {"_chain": unfused_aten_epilogue, "_spec": spec, "torch": torch}
    src = f"def {name}(a, b_kn, *ops):\n    return _chain(torch.mm(a, b_kn), _spec, list(ops))\n"
    exec(compile(src, f"<branchyard {name}>", "exec"), ns)
    return ns[name]


_CHAIN_IDS = itertools.count()


def _inductor_build(problem: Problem, mode: str) -> Impl:
    key = (str(problem.spec), mode, problem.m, problem.n, problem.k, problem.dtype, problem.operand_dtypes,
           problem.a_layout, problem.b_layout, problem.operand_layouts, problem.device)
    compiled = _INDUCTOR_FNS.get(key)
    if compiled is None:
        cap = int(os.environ.get("BRANCHYARD_NVGEMM_INDUCTOR_MAX", "32"))
        if len(_INDUCTOR_FNS) >= cap:
            raise LoweringError(
                f"{cap} Inductor compiles already made in this process (each takes minutes in max-autotune)",
                where="triton:inductor candidate", hint="raise BRANCHYARD_NVGEMM_INDUCTOR_MAX to allow more",
            )
        compiled = torch.compile(_fresh_chain(problem.spec), mode=mode, dynamic=False, fullgraph=True)
        _INDUCTOR_FNS[key] = compiled

    def impl(a, b_kn, operands, out):
        # Always below autograd, as inside our custom op: Dynamo guards on the
        # inputs' dispatch keys, and a call from each side would compile (and
        # max-autotune) the chain twice, into possibly different kernels.
        with torch._C._AutoDispatchBelowAutograd():
            return compiled(a, b_kn, *operands)

    return impl


#: Chains cuBLAS applies inside the GEMM through addmm's C input (beta=1):
#: names -> (index of the scale step or None).
_ADDMM_CHAINS = {("bias",), ("residual",), ("scale", "bias"), ("scale", "residual")}


def _addmm_applies(problem: Problem) -> str | None:
    if problem.spec.names not in _ADDMM_CHAINS:
        return f"addmm fuses only [scale +] bias or residual, not {'+'.join(problem.spec.names)}"
    if problem.spec.out_dtype != problem.dtype or any(d != problem.dtype for d in problem.operand_dtypes):
        return "addmm needs its input and output in the matmul dtype"
    return None


def _addmm_build(problem: Problem) -> Impl:
    steps = problem.spec.steps
    alpha = float(steps[0].operand) if steps[0].op.name == "scale" else 1.0  # type: ignore[arg-type]

    def impl(a, b_kn, operands, out):
        return torch.addmm(operands[0], a, b_kn, alpha=alpha, out=out)

    return impl


def _rest_spec(spec: EpilogueSpec, start: int) -> EpilogueSpec:
    """The steps from ``start`` on (operand indices still index the full list)."""
    return dataclasses.replace(spec, steps=spec.steps[start:])


def _operand_dtype_of(problem: Problem, step_index: int) -> torch.dtype:
    return problem.operand_dtypes[problem.spec.steps[step_index].operand]  # type: ignore[index]


def _lt_prefix_applies(problem: Problem) -> str | None:
    names = problem.spec.names
    if names[:2] not in _CUBLASLT_CHAINS or len(names) == 2:
        return "the chain does not start with bias+relu or bias+gelu_tanh followed by more steps"
    if _operand_dtype_of(problem, 0) != problem.dtype:
        return "_addmm_activation needs the bias in the input dtype"
    if not problem.device.startswith("cuda"):
        return "cuBLASLt runs on CUDA only (the CPU kernel's GELU is the erf form)"
    return None


def _lt_prefix_build(problem: Problem) -> Impl:
    use_gelu = _CUBLASLT_CHAINS[problem.spec.names[:2]]
    if use_gelu and _addmm_gelu_form(problem.device, problem.dtype) != "tanh":
        raise LoweringError(
            f"_addmm_activation on {problem.device} computes the erf GELU, not the tanh form this chain needs",
            where="cublaslt prefix candidate",
        )
    bias = problem.spec.steps[0].operand
    rest = _rest_spec(problem.spec, 2)

    def impl(a, b_kn, operands, out):
        y = torch._addmm_activation(operands[bias], a, b_kn, use_gelu=use_gelu)
        return unfused_aten_epilogue(y, rest, list(operands))

    return impl


def _addmm_prefix(problem: Problem) -> int:
    """Length of the [scale] + bias|residual prefix addmm can take (0: none)."""
    names = problem.spec.names
    start = 1 if names[:1] == ("scale",) else 0
    return start + 1 if names[start:start + 1] in (("bias",), ("residual",)) else 0


def _addmm_prefix_applies(problem: Problem) -> str | None:
    n = _addmm_prefix(problem)
    if n == 0 or n == len(problem.spec.names):
        return "the chain does not start with [scale +] bias or residual followed by more steps"
    if _operand_dtype_of(problem, n - 1) != problem.dtype:
        return "addmm needs its C input in the matmul dtype"
    return None


def _addmm_prefix_build(problem: Problem) -> Impl:
    n = _addmm_prefix(problem)
    steps = problem.spec.steps
    alpha = float(steps[0].operand) if n == 2 else 1.0  # type: ignore[arg-type]
    c = steps[n - 1].operand
    rest = _rest_spec(problem.spec, n)

    def impl(a, b_kn, operands, out):
        return unfused_aten_epilogue(torch.addmm(operands[c], a, b_kn, alpha=alpha), rest, list(operands))

    return impl


def _cutedsl_build(problem: Problem, config: Any) -> Impl:
    from branchyard.lowering.nvgemm import cutedsl_gemm

    # compile_fused_gemm keeps compiled kernels in the on-disk KernelCache, so
    # a later process loads them in milliseconds instead of recompiling.
    fn = cutedsl_gemm.compile_fused_gemm(
        problem.spec, problem.dtype, config, b_layout=problem.b_layout, out_dtype=problem.spec.out_dtype,
        operand_dtypes=list(problem.operand_dtypes),
    )

    def impl(a, b_kn, operands, out):
        fn(a, b_kn, list(operands), out)
        return out

    return impl


def _cutedsl_candidates(problem: Problem) -> list[Candidate]:
    try:
        from branchyard.lowering.nvgemm.cutedsl_gemm import candidate_configs, cutedsl_available
    except Exception as exc:
        logger.info("nvgemm: no CuTeDSL candidates: %s", exc)
        return []
    ok, why = cutedsl_available()
    if not ok:
        logger.info("nvgemm: no CuTeDSL candidates: %s", why)
        return []
    configs = candidate_configs(problem.m, problem.n, problem.k, _dt(problem.dtype))
    limit = os.environ.get("BRANCHYARD_NVGEMM_MAX_CONFIGS")
    if limit:
        configs = configs[: max(1, int(limit))]
    return [
        Candidate(f"cutedsl:{c.name}", functools.partial(_cutedsl_build, config=c)) for c in configs
    ]


def _cutlass_plain_candidates(problem: Problem) -> list[Candidate]:
    """The cutlass-operators plain GEMM followed by the chain as ATen ops.

    Uses ``branchyard.lowering.nvgemm.cutlass_operators`` when present:
    ``plain_gemm_available() -> (ok, reason)`` and
    ``compile_plain_gemm(dtype, b_layout) -> fn(a, b_kn, out)`` (out in the
    input dtype), raising :class:`LoweringError` when it cannot.
    """
    try:
        from branchyard.lowering.nvgemm import cutlass_operators
    except Exception as exc:  # module absent or its package missing
        logger.info("nvgemm: no cutlass-operators candidate: %s", exc)
        return []
    available = getattr(cutlass_operators, "plain_gemm_available", None)
    compile_plain = getattr(cutlass_operators, "compile_plain_gemm", None)
    if available is None or compile_plain is None:
        logger.info("nvgemm: cutlass_operators has no plain_gemm_available/compile_plain_gemm")
        return []
    ok, why = available()
    if not ok:
        logger.info("nvgemm: no cutlass-operators candidate: %s", why)
        return []
    return [Candidate("cutlass_plain+epilogue", functools.partial(_cutlass_plain_build, compile_plain=compile_plain))]


def _cutlass_plain_build(problem: Problem, compile_plain: Callable[..., Any]) -> Impl:
    gemm = compile_plain(problem.dtype, problem.b_layout)
    spec = problem.spec

    def impl(a, b_kn, operands, out):
        y = torch.empty((a.shape[0], b_kn.shape[1]), dtype=a.dtype, device=a.device)
        gemm(a, b_kn, y)
        return unfused_aten_epilogue(y, spec, list(operands))

    return impl


def default_candidates(problem: Problem, *, inductor: bool | None = None) -> list[Candidate]:
    """The candidates for ``problem``, ours first.

    ``BRANCHYARD_NVGEMM_MAX_CONFIGS=n`` keeps only the first ``n`` CuTeDSL tile
    configs (each is a separate compile). ``inductor`` (default: env ``BRANCHYARD_NVGEMM_INDUCTOR`` != ``0``) adds
    the Inductor max-autotune candidate, which compiles for minutes; at most
    ``BRANCHYARD_NVGEMM_INDUCTOR_MAX`` (default 32) shapes per process.
    """
    if inductor is None:
        inductor = os.environ.get("BRANCHYARD_NVGEMM_INDUCTOR", "1") != "0"
    out = _cutedsl_candidates(problem) + _cutlass_plain_candidates(problem)
    out.append(Candidate("cublaslt:_addmm_activation", _cublaslt_build, _cublaslt_applies))
    out.append(Candidate("cublas:addmm", _addmm_build, _addmm_applies))
    # The same cuBLAS epilogues on a prefix of the chain, the rest as ATen ops.
    out.append(Candidate("cublaslt:_addmm_activation+aten", _lt_prefix_build, _lt_prefix_applies))
    out.append(Candidate("cublas:addmm+aten", _addmm_prefix_build, _addmm_prefix_applies))
    if inductor:
        mode = os.environ.get("BRANCHYARD_NVGEMM_INDUCTOR_MODE", "max-autotune-no-cudagraphs")
        out.append(Candidate("triton:inductor", functools.partial(_inductor_build, mode=mode)))
    out.append(Candidate("aten:unfused", _aten_build))
    return out


# --- the autotuner ------------------------------------------------------------------------

_TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float32: 1e-3}


def numerics_error(got: torch.Tensor, ref: torch.Tensor, out_dtype: torch.dtype) -> str | None:
    """``None`` if ``got`` is within ``out_dtype`` tolerance of the fp32 ``ref``,
    else what is wrong (shape, dtype, NaNs, or the worst element)."""
    if tuple(got.shape) != tuple(ref.shape):
        return f"result shape {list(got.shape)}, expected {list(ref.shape)}"
    if got.dtype != out_dtype:
        return f"result dtype {got.dtype}, expected {out_dtype}"
    g, r = got.float(), ref.float()
    if torch.isnan(g).any() and not torch.isnan(r).any():
        return "result has NaNs"
    tol = _TOLERANCE.get(out_dtype, 1e-3)
    scale = r.abs().mean().clamp_min(1e-6)
    err = (g - r).abs() - tol * r.abs() - tol * scale
    worst = float(err.max()) if err.numel() else 0.0
    if worst > 0:
        idx = int(err.argmax())
        row, col = divmod(idx, r.shape[-1]) if r.dim() > 1 else (0, idx)
        return f"numerics off at [{row}, {col}]: got {float(g.flatten()[idx]):.6g}, reference {float(r.flatten()[idx]):.6g}"
    return None


def time_round_robin(
    fns: Mapping[str, Callable[[], Any]], rounds: int, timer: Callable[[str, Callable[[], Any]], float],
) -> dict[str, list[float]]:
    """``timer(name, fn)`` of every function, ``rounds`` times, round ``r`` in
    the order rotated by ``r`` and, on odd rounds (of three or more functions), reversed.

    The H200's clock drifts as it heats and may drop after a power-hungry
    kernel: a fixed order would favour whichever function always ran first,
    and a rotation alone keeps every function after the same neighbour (in a
    rotation-only sweep the same kernel measured up to 8% apart in two
    columns). Reversing every other round gives each function both neighbours.
    """
    names = list(fns)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        shift = r % len(names) if names else 0
        order = names[shift:] + names[:shift]
        for name in reversed(order) if r % 2 and len(names) > 2 else order:  # two: rotating alternates them
            samples[name].append(timer(name, fns[name]))
    return samples


#: Candidates whose first timing is within this factor of the fastest are timed again.
CONTENDER_MARGIN = 1.10

#: After the rounds, candidates whose median is within this factor of the leader's meet it
#: in a paired comparison (:func:`paired_ratio`), which decides the winner.
PLAYOFF_MARGIN = 1.05


class Autotuner:
    """Pick, build and cache the fastest candidate per problem.

    ``candidates``: a list, or a function ``problem -> list`` (default
    :func:`default_candidates`); ``timer(name, fn) -> ms`` (default
    :func:`cuda_event_timer`); ``db`` (default :class:`WinnerDB` in
    :func:`cache_dir`); ``env`` (default :func:`environment`); ``progress``
    (default: env ``BRANCHYARD_NVGEMM_PROGRESS`` != ``0``); ``rounds``
    (default: env ``BRANCHYARD_NVGEMM_TUNE_ROUNDS``, else 3); ``pair(fn_a,
    fn_b) -> time_a / time_b`` for the playoff (default: :func:`paired_ratio`
    with env ``BRANCHYARD_NVGEMM_TUNE_PAIRS`` pairs, else 40, where the
    default timer is used; no playoff with a custom ``timer`` and no ``pair``).

    Every candidate is timed once; those within :data:`CONTENDER_MARGIN` of
    the fastest are then timed again in ``rounds`` round-robin rounds, each
    in a rotated order, and ranked by the median of all their timings. A
    GPU's clock drifts as it heats (15% on the H200 within a minute of
    GEMMs), so one pass in a fixed order favours whichever ran on a cooler
    chip; the rounds cost time only where the call is close. Last, a
    playoff: the leader meets every candidate within :data:`PLAYOFF_MARGIN`
    of it in adjacent pairs, and the faster of each pair leads on: on the
    H200 one kernel paired with itself stays within ~1%, where medians of
    separate blocks differed by up to 3% (docs/benchmarks.md). Where two
    different kernels' paired ratio itself drifts by a few percent within a
    minute (seen at 8192x4096x14336), no one-time pick settles it.
    """

    def __init__(
        self,
        candidates: Sequence[Candidate] | Callable[[Problem], Sequence[Candidate]] | None = None,
        *,
        timer: Callable[[str, Callable[[], Any]], float] | None = None,
        db: WinnerDB | None = None,
        env: Mapping[str, str] | None = None,
        progress: bool | None = None,
        stream: Any = None,
        rounds: int | None = None,
        pair: Callable[[Callable[[], Any], Callable[[], Any]], float] | None = None,
    ) -> None:
        self._candidates = candidates if candidates is not None else default_candidates
        if pair is None and timer is None:
            pairs = int(os.environ.get("BRANCHYARD_NVGEMM_TUNE_PAIRS", "40"))
            pair = (lambda f, g: paired_ratio(f, g, pairs=pairs)[0]) if pairs > 0 else None
        self.pair = pair
        self.timer = timer if timer is not None else (lambda name, fn: cuda_event_timer(fn))
        self.db = db if db is not None else WinnerDB()
        self.env = dict(env) if env is not None else None
        self.progress = progress if progress is not None else os.environ.get("BRANCHYARD_NVGEMM_PROGRESS", "1") != "0"
        self.stream = stream
        self.rounds = rounds if rounds is not None else int(os.environ.get("BRANCHYARD_NVGEMM_TUNE_ROUNDS", "3"))
        self._impls: dict[tuple, Impl] = {}
        self._exact: dict[tuple, Impl] = {}
        self._lock = threading.RLock()
        #: Every tuning result of this process, by key (the benchmark reads it).
        self.results: dict[str, TuneResult] = {}

    def candidates(self, problem: Problem) -> list[Candidate]:
        """The candidates for ``problem`` (before applicability checks)."""
        c = self._candidates
        return list(c(problem) if callable(c) else c)

    def _env(self, problem: Problem) -> Mapping[str, str]:
        return self.env if self.env is not None else environment(problem.device)

    def _fast_key(self, a, b_kn, operands, spec) -> tuple:
        return (
            str(spec), a.shape[1], b_kn.shape[1], m_bucket(a.shape[0]), a.dtype, a.stride(1) == 1,
            b_kn.stride(0) == 1, tuple((t.dtype, t.dim(), t.stride(-1) == 1) for t in operands), a.device,
        )

    def select(
        self, a: torch.Tensor, b_kn: torch.Tensor, operands: Sequence[torch.Tensor], spec: EpilogueSpec,
        spec_text: str | None = None,
    ) -> Impl:
        """The implementation to run for this call (tuning it on first sight).

        Two in-memory levels keep the per-call cost low: the exact shapes and
        strides of this call (a few tuple compares), then the problem's
        bucket key; only a miss on both consults the database or tunes.
        """
        exact = (spec_text or str(spec), a.shape, a.stride(), b_kn.shape, b_kn.stride(), a.dtype, a.device,
                 *[(t.dtype, t.shape, t.stride()) for t in operands])
        impl = self._exact.get(exact)
        if impl is not None:
            return impl
        fast = self._fast_key(a, b_kn, operands, spec)
        impl = self._impls.get(fast)
        if impl is None:
            with self._lock:
                impl = self._impls.get(fast)
                if impl is None:
                    impl = self._select_slow(a, b_kn, operands, spec)
                    self._impls[fast] = impl
        if len(self._exact) > 4096:  # many distinct M (serving): start over, the bucket level remains
            self._exact.clear()
        self._exact[exact] = impl
        return impl

    def _select_slow(self, a, b_kn, operands, spec) -> Impl:
        problem = Problem.of(a, b_kn, operands, spec)
        cands = {c.name: c for c in self.candidates(problem)}
        key = problem.key(self._env(problem))
        entry = self.db.get(key, known=list(cands))
        if entry is not None:
            try:
                impl = cands[entry["winner"]].build(problem)
                self.results[key] = TuneResult(key, entry["winner"], dict(entry.get("timings", {})),
                                               dict(entry.get("excluded", {})), from_cache=True)
                logger.info("nvgemm: %s -> %s (from %s)", problem, entry["winner"], self.db.path)
                return impl
            except Exception as exc:  # the recorded winner no longer builds: retune
                logger.warning("nvgemm: cached winner %s fails to build (%s); retuning", entry["winner"], exc)
        return self._tune(problem, key, list(cands.values()), a, b_kn, operands).impl  # type: ignore[return-value]

    def tune(self, a: torch.Tensor, b_kn: torch.Tensor, operands: Sequence[torch.Tensor], spec: EpilogueSpec) -> TuneResult:
        """Tune this problem now (ignoring the database's entry) and record the winner."""
        problem = Problem.of(a, b_kn, operands, spec)
        key = problem.key(self._env(problem))
        with self._lock:
            result = self._tune(problem, key, self.candidates(problem), a, b_kn, operands)
            self._impls[self._fast_key(a, b_kn, operands, spec)] = result.impl  # type: ignore[assignment]
            self._exact.clear()
        return result

    def _tune(self, problem, key, cands, a, b_kn, operands) -> TuneResult:
        result = TuneResult(key, winner="")
        bar = ProgressBar(len(cands), str(problem), stream=self.stream, enabled=self.progress)
        ref = reference_fused_gemm(a, b_kn, list(operands), problem.spec)
        built: dict[str, Impl] = {}
        for cand in cands:
            why = cand.applies(problem)
            if why is None:
                why = self._try(cand, problem, a, b_kn, operands, ref, result, built)
            if why is not None:
                result.excluded[cand.name] = why
                logger.info("nvgemm: %s excluded for %s: %s", cand.name, problem, why)
                bar.step(f"{cand.name}: excluded")
            else:
                bar.step(f"{cand.name}: {result.timings[cand.name] * 1e3:.1f} us")
        if not result.timings:
            raise LoweringError(
                f"no candidate can run {problem}: "
                + "; ".join(f"{n}: {w}" for n, w in result.excluded.items()),
                where="nvgemm autotune",
                hint="the reference path still runs it; check the exclusion reasons",
            )
        self._rerun_contenders(problem, a, b_kn, operands, result, built)
        result.winner = self._playoff(problem, a, b_kn, operands, result, built)
        result.impl = built[result.winner]
        self.results[key] = result
        self.db.put(key, {
            "winner": result.winner, "timings": result.timings, "excluded": result.excluded,
            "playoff": result.playoff,
            "problem": str(problem), "tuned_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        })
        logger.info("nvgemm: %s -> %s\n%s", problem, result.winner, result.table())
        return result

    def _rerun_contenders(self, problem, a, b_kn, operands, result, built) -> None:
        best = min(result.timings.values())
        close = [n for n, t in result.timings.items() if t <= best * CONTENDER_MARGIN]
        if len(close) < 2 or self.rounds < 1:
            return
        samples = time_round_robin(
            self._callers(problem, a, b_kn, operands, built, close),
            self.rounds, lambda name, fn: float(self.timer(name, fn)),
        )
        for name in close:
            samples[name].insert(0, result.timings[name])
            result.timings[name] = statistics.median(samples[name])
        result.rounds = {n: len(v) for n, v in samples.items()}

    @staticmethod
    def _callers(problem, a, b_kn, operands, built, names) -> dict[str, Callable[[], Any]]:
        """A no-argument call of each named built candidate, all writing one output buffer."""
        out = torch.empty((problem.m, problem.n), dtype=problem.spec.out_dtype, device=a.device)
        ops = list(operands)
        return {n: (lambda impl=built[n]: impl(a, b_kn, ops, out)) for n in names}

    def _playoff(self, problem, a, b_kn, operands, result, built) -> str:
        leader = min(result.timings, key=result.timings.__getitem__)
        close = sorted((n for n, t in result.timings.items()
                        if n != leader and t <= result.timings[leader] * PLAYOFF_MARGIN), key=result.timings.get)
        if self.pair is None or not close:
            return leader
        run = self._callers(problem, a, b_kn, operands, built, [leader, *close])
        for name in close:
            ratio = float(self.pair(run[name], run[leader]))
            result.playoff.append({"candidate": name, "leader": leader, "ratio": ratio})
            if ratio < 1.0:
                leader = name
        return leader

    def _try(self, cand, problem, a, b_kn, operands, ref, result, built) -> str | None:
        try:
            impl = cand.build(problem)
        except Exception as exc:
            return f"build failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        out = torch.empty((problem.m, problem.n), dtype=problem.spec.out_dtype, device=a.device)
        ops = list(operands)
        try:
            got = impl(a, b_kn, ops, out)
        except Exception as exc:
            return f"run failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        got = out if got is None else got
        bad = numerics_error(got, ref, problem.spec.out_dtype)
        if bad is not None:
            return bad
        try:
            result.timings[cand.name] = float(self.timer(cand.name, lambda: impl(a, b_kn, ops, out)))
        except Exception as exc:
            return f"timing failed: {type(exc).__name__}: {exc}"
        built[cand.name] = impl
        return None


_default: Autotuner | None = None
_default_lock = threading.Lock()


def get_autotuner() -> Autotuner:
    """The process-wide autotuner the fused op uses."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Autotuner()
        return _default


def set_autotuner(tuner: Autotuner | None) -> None:
    """Replace the process-wide autotuner (``None``: a fresh default one next time)."""
    global _default
    with _default_lock:
        _default = tuner


def select(
    a: torch.Tensor, b_kn: torch.Tensor, operands: Sequence[torch.Tensor], spec: EpilogueSpec,
    spec_text: str | None = None,
) -> Impl:
    """The implementation the process-wide autotuner picks for this call."""
    tuner = _default if _default is not None else get_autotuner()
    return tuner.select(a, b_kn, operands, spec, spec_text)
