"""Begin and end a CUDA graph capture so that a failure anywhere leaves the process whole.

Two things break a process after a failed capture, and this module owns both:

* **Streams.** ``torch.cuda.Stream()`` hands out streams from a pool of 32 per
  device and priority, round robin, and ``torch.cuda.graph`` captures on one
  of them. A lowering that takes side streams from the same pool for its
  conditional-node bodies eventually gets the stream the main capture runs
  on (``cuStreamBeginCaptureToGraph`` then fails with ``ILLEGAL_STATE``), or a
  stream a failed capture left capturing. :func:`dedicated_streams` creates
  streams of our own with the driver, once per process and device, that no
  other code is handed.
* **Capture state.** When ``cudaStreamEndCapture`` fails (an invalidated
  capture), torch's ``CUDAGraph.capture_end`` raises before it tells the
  caching allocator to stop routing the stream's allocations to the graph's
  pool, and the pool is never released. :func:`guarded_capture` ends every
  active capture left on our streams (a body stream left in an *invalidated*
  capture is retired instead: ending it can crash the driver once its parent
  graph is gone), ends allocation to the pool, releases the pool once, drops
  the graph's RNG registrations, clears the runtime's last error and
  synchronizes, then re-raises the original error. Where it retired a stream,
  the failed capture's tensors are never freed (:func:`keep_forever`).
* **Host synchronization.** A sync during a capture (``torch.cuda.synchronize()``,
  a stream or event sync, ``.item()``, a device-to-host copy) invalidates every
  capture on the device, and the driver does not always survive cleaning that
  up. :func:`host_sync_forbidden` turns such a call, made on the capturing
  thread, into a :class:`~branchyard.errors.LoweringError` before it reaches CUDA.

Semantics, as Python::

    with guarded_capture(graph, pool=pool, device=dev) as stream:
        ...                       # torch ops on `stream` are captured into `graph`
    # on success: graph.capture_end() ran, graph can be instantiated and replayed
    # on failure: no stream of ours is capturing, the allocator routes nothing to
    #             `pool`, the original exception propagates
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from typing import Any, Iterator

import torch

from branchyard.errors import LoweringError

__all__ = [
    "dedicated_streams",
    "guarded_capture",
    "host_sync_forbidden",
    "keep_forever",
    "capture_status",
    "retire_stream",
    "stream_is_capturing",
    "end_stray_capture",
]

logger = logging.getLogger("branchyard")

#: device index -> streams created by :func:`dedicated_streams` (index 0 is the capture stream);
#: None where a stream was retired (left in an invalidated capture) and waits to be replaced.
_STREAMS: dict[int, list[torch.cuda.ExternalStream | None]] = {}


def dedicated_streams(device: torch.device, count: int) -> list[torch.cuda.ExternalStream]:
    """``count`` non-blocking streams on ``device`` that belong to branchyard alone.

    Made with ``cuStreamCreate`` (never from torch's stream pool) and kept for the
    life of the process; call outside a capture (creating a stream may sync).
    Index 0 is the main capture stream, 1.. the conditional-node body streams.
    """
    from cuda.bindings import driver

    index = device.index if device.index is not None else torch.cuda.current_device()
    streams = _STREAMS.setdefault(index, [])
    if len(streams) >= count and all(s is not None for s in streams[:count]):
        return list(streams[:count])  # type: ignore[arg-type]

    def create() -> torch.cuda.ExternalStream:
        status, raw = driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING.value)
        if int(status) != 0:
            raise LoweringError(f"cuStreamCreate failed with {getattr(status, 'name', status)}", where="cuda-bindings")
        return torch.cuda.ExternalStream(int(raw), device=torch.device("cuda", index))

    with torch.cuda.device(index):
        torch.cuda.current_stream().synchronize()  # makes torch's primary context current for the driver
        streams[:] = [s if s is not None else create() for s in streams]
        while len(streams) < count:
            streams.append(create())
    return list(streams[:count])  # type: ignore[arg-type]


def capture_status(stream: torch.cuda.Stream) -> str:
    """``"none"``, ``"active"`` or ``"invalidated"``: the capture state of ``stream``."""
    from cuda.bindings import driver

    status, capturing = driver.cuStreamIsCapturing(driver.CUstream(stream.cuda_stream))
    if int(status) != 0:
        return "invalidated"
    return {
        driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE: "none",
        driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE: "active",
    }.get(capturing, "invalidated")


def retire_stream(stream: torch.cuda.Stream) -> None:
    """Never use ``stream`` again: it is left in an invalidated capture into a graph that may be gone.

    Ending such a capture-to-graph (``cuStreamEndCapture``) can crash the driver once the
    parent capture was invalidated, so the stream is abandoned and replaced on next use.
    Body captures run in relaxed mode, so an abandoned one restricts no later API call.
    """
    for streams in _STREAMS.values():
        for i, s in enumerate(streams):
            if s is not None and s.cuda_stream == stream.cuda_stream:
                streams[i] = None


def stream_is_capturing(stream: torch.cuda.Stream) -> bool:
    """Whether ``stream`` is in an active or invalidated capture."""
    return capture_status(stream) != "none"


def end_stray_capture(stream: torch.cuda.Stream, *, owns_graph: bool = False) -> bool:
    """End an active capture left on ``stream`` (retire the stream if it is invalidated); True if there was one.

    ``owns_graph``: the capture made its own graph (``cuStreamBeginCapture``), destroy it;
    a body capture (``cuStreamBeginCaptureToGraph``) fills a graph its conditional node owns.
    """
    from cuda.bindings import driver

    state = capture_status(stream)
    if state == "none":
        return False
    if state == "invalidated":
        retire_stream(stream)
        return True
    status, graph = driver.cuStreamEndCapture(driver.CUstream(stream.cuda_stream))
    if owns_graph and int(status) == 0 and graph is not None and int(graph) != 0:
        driver.cuGraphDestroy(graph)
    return True


def _clear_last_error() -> None:
    try:
        from cuda.bindings import runtime

        runtime.cudaGetLastError()
    except Exception:  # pragma: no cover - best effort
        pass


def _pool_id(pool: Any) -> Any:
    return getattr(pool, "id", pool)  # a torch.cuda.MemPool or a graph_pool_handle() tuple


#: What failed captures that left a stream retired must never free (see :func:`keep_forever`).
_GRAVEYARD: list[Any] = []


def keep_forever(*objects: Any) -> None:
    """Never free ``objects``: tensors a failed capture used on a stream it left retired.

    Freeing such a tensor can make the caching allocator record an event on that
    stream, which fails inside a destructor and aborts the process. The list is
    pinned with an extra reference so that not even interpreter shutdown frees it.
    """
    if not _GRAVEYARD:
        import ctypes

        ctypes.pythonapi.Py_IncRef(ctypes.py_object(_GRAVEYARD))
    _GRAVEYARD.append(objects)


def _restore(graph: torch.cuda.CUDAGraph, streams: list[torch.cuda.ExternalStream], pool: Any, index: int) -> bool:
    """Undo a capture that failed at any point (see the module docstring); True if a stream was retired."""
    retired = False
    for side in reversed(streams[1:]):
        if capture_status(side) == "invalidated":
            retired = True
        if end_stray_capture(side):
            logger.debug("guarded_capture: ended or retired a body capture left on a side stream")
    main = streams[0]
    ended_cleanly = False
    if capture_status(main) != "none":  # active or invalidated: torch's capture_end ends either
        try:
            with torch.cuda.stream(main):
                graph.capture_end()  # a valid capture ends the torch way: allocator and pool included
            ended_cleanly = True
        except Exception as exc:  # invalidated: the stream's capture is over, torch's bookkeeping is not
            logger.debug("guarded_capture: capture_end after failure raised %s", exc)
            if capture_status(main) != "none":
                retire_stream(main)
                retired = True
    if not ended_cleanly:
        pool_id = _pool_id(pool)
        with contextlib.suppress(Exception):  # raises when the allocator is not routing to the pool
            torch._C._cuda_endAllocateToPool(index, pool_id)
        with contextlib.suppress(Exception):
            torch._C._cuda_releasePool(index, pool_id)
    with contextlib.suppress(Exception):
        # Drops the graph's registrations with torch's RNG generators: left in place they make every
        # later random op outside a capture fail ("Offset increment outside graph capture").
        graph.reset()
    _clear_last_error()
    with contextlib.suppress(Exception):
        torch.cuda.synchronize(index)
    _clear_last_error()
    return retired


#: The Python entry points that synchronize with the host: (owner, attribute name).
_SYNC_ENTRY_POINTS: tuple[tuple[Any, str], ...] = (
    (torch.cuda, "synchronize"),
    (torch.cuda.Stream, "synchronize"),
    (torch.cuda.Event, "synchronize"),
)


#: Threads inside :func:`host_sync_forbidden` (ident -> nesting depth), and what it replaced.
_FORBIDDING: dict[int, int] = {}
_SAVED: list[tuple[Any, str, Any]] = []
_SAVED_DEBUG_MODE: list[int] = []
_FORBID_LOCK = threading.Lock()


def _refusing(real: Any, name: str) -> Any:
    @functools.wraps(real)
    def refuse(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() not in _FORBIDDING:
            return real(*args, **kwargs)
        raise LoweringError(
            f"{name}() was called during a CUDA graph capture",
            where="CUDA graph capture",
            hint="a host synchronization cannot be captured: remove it from the program or run it eagerly",
        )

    return refuse


@contextlib.contextmanager
def host_sync_forbidden() -> Iterator[None]:
    """Make host synchronizations on this thread raise instead of invalidating the capture.

    Python-level syncs (``torch.cuda.synchronize``, ``Stream.synchronize``,
    ``Event.synchronize``) raise :class:`LoweringError` on a thread inside this
    context (other threads pass through); syncs inside ATen ops (``.item()``,
    device-to-host copies, ``nonzero``) raise through torch's sync debug mode,
    set to ``"error"`` while any thread is inside (a process-wide setting,
    restored when the last one leaves). Either way nothing reaches CUDA, so the
    capture fails like any Python error. Threads may enter and leave in any
    order and nest: the functions are replaced once, restored once.
    """
    me = threading.get_ident()
    with _FORBID_LOCK:
        if not _FORBIDDING:
            _SAVED[:] = [(o, n, o.__dict__[n]) for o, n in _SYNC_ENTRY_POINTS if n in o.__dict__]
            _SAVED_DEBUG_MODE[:] = [torch._C._cuda_get_sync_debug_mode()]  # needs no CUDA initialization
            for owner, name, real in _SAVED:
                label = "torch.cuda.synchronize" if owner is torch.cuda else f"torch.cuda.{owner.__name__}.{name}"
                setattr(owner, name, _refusing(real, label))
            _set_sync_debug_mode(2)  # "error"
        _FORBIDDING[me] = _FORBIDDING.get(me, 0) + 1
    try:
        yield
    finally:
        with _FORBID_LOCK:
            _FORBIDDING[me] -= 1
            if not _FORBIDDING[me]:
                del _FORBIDDING[me]
            if not _FORBIDDING:
                _set_sync_debug_mode(_SAVED_DEBUG_MODE[0])
                for owner, name, real in _SAVED:
                    setattr(owner, name, real)
                _SAVED.clear()


def _set_sync_debug_mode(mode: int) -> None:
    import warnings

    with warnings.catch_warnings():  # torch warns once that the mode is a prototype
        warnings.simplefilter("ignore")
        torch._C._cuda_set_sync_debug_mode(mode)


@contextlib.contextmanager
def guarded_capture(
    graph: torch.cuda.CUDAGraph, *, pool: Any, device: torch.device, side_streams: int = 8
) -> Iterator[list[torch.cuda.ExternalStream]]:
    """Capture into ``graph`` on a dedicated stream; undo everything if anything fails.

    Yields the dedicated streams: ``[capture stream, *side streams]``. ``pool`` is a
    ``torch.cuda.graph_pool_handle()`` (it may be shared by several graphs).
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    streams = dedicated_streams(torch.device("cuda", index), 1 + side_streams)
    if any(capture_status(s) != "none" for s in streams):  # only code that bypassed this guard leaves one
        logger.warning("branchyard: a CUDA graph capture was left on a branchyard stream; replacing the stream")
        for s in streams:
            if capture_status(s) != "none":
                retire_stream(s)
        streams = dedicated_streams(torch.device("cuda", index), 1 + side_streams)
    main = streams[0]
    torch.cuda.synchronize(index)
    main.wait_stream(torch.cuda.current_stream(index))
    began = False
    try:
        with torch.cuda.device(index), torch.cuda.stream(main):
            graph.capture_begin(pool=pool)
            began = True
            with host_sync_forbidden():
                yield streams
            graph.capture_end()
    except BaseException as exc:
        if began and _restore(graph, streams, pool, index):
            # The traceback holds every frame of the failed capture and so every tensor it made.
            keep_forever(exc.__traceback__)
            with contextlib.suppress(Exception):
                exc.branchyard_retired_stream = True  # type: ignore[attr-defined]  # callers keep their tensors too
        raise
    torch.cuda.current_stream(index).wait_stream(main)
