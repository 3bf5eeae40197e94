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
  capture still running on our streams, ends allocation to the pool, releases
  the pool once, clears the runtime's last error and synchronizes, then
  re-raises the original error.

Semantics, as Python::

    with guarded_capture(graph, pool=pool, device=dev) as stream:
        ...                       # torch ops on `stream` are captured into `graph`
    # on success: graph.capture_end() ran, graph can be instantiated and replayed
    # on failure: no stream of ours is capturing, the allocator routes nothing to
    #             `pool`, the original exception propagates
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch

from branchyard.errors import LoweringError

__all__ = ["dedicated_streams", "guarded_capture", "stream_is_capturing", "end_stray_capture"]

logger = logging.getLogger("branchyard")

#: device index -> streams created by :func:`dedicated_streams` (index 0 is the capture stream).
_STREAMS: dict[int, list[torch.cuda.ExternalStream]] = {}


def dedicated_streams(device: torch.device, count: int) -> list[torch.cuda.ExternalStream]:
    """``count`` non-blocking streams on ``device`` that belong to branchyard alone.

    Made with ``cuStreamCreate`` (never from torch's stream pool) and kept for the
    life of the process; call outside a capture (creating a stream may sync).
    Index 0 is the main capture stream, 1.. the conditional-node body streams.
    """
    from cuda.bindings import driver

    index = device.index if device.index is not None else torch.cuda.current_device()
    streams = _STREAMS.setdefault(index, [])
    with torch.cuda.device(index):
        torch.cuda.current_stream().synchronize()  # makes torch's primary context current for the driver
        while len(streams) < count:
            status, raw = driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING.value)
            if int(status) != 0:
                raise LoweringError(f"cuStreamCreate failed with {getattr(status, 'name', status)}", where="cuda-bindings")
            streams.append(torch.cuda.ExternalStream(int(raw), device=torch.device("cuda", index)))
    return streams[:count]


def stream_is_capturing(stream: torch.cuda.Stream) -> bool:
    """Whether ``stream`` is in an active or invalidated capture."""
    from cuda.bindings import driver

    status, capturing = driver.cuStreamIsCapturing(driver.CUstream(stream.cuda_stream))
    if int(status) != 0:  # the query itself fails on an invalidated capture of some drivers
        return True
    return capturing != driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE


def end_stray_capture(stream: torch.cuda.Stream) -> bool:
    """End a capture left running on ``stream``; True if there was one."""
    from cuda.bindings import driver

    if not stream_is_capturing(stream):
        return False
    status, graph = driver.cuStreamEndCapture(driver.CUstream(stream.cuda_stream))
    if int(status) == 0 and graph is not None and int(graph) != 0:
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


def _restore(graph: torch.cuda.CUDAGraph, streams: list[torch.cuda.ExternalStream], pool: Any, index: int) -> None:
    """Undo a capture that failed at any point (see the module docstring)."""
    for side in reversed(streams[1:]):
        if end_stray_capture(side):
            logger.debug("guarded_capture: ended a body capture left running on a side stream")
    main = streams[0]
    ended_cleanly = False
    if stream_is_capturing(main):
        try:
            with torch.cuda.stream(main):
                graph.capture_end()  # a valid capture ends the torch way: allocator and pool included
            ended_cleanly = True
        except Exception as exc:  # invalidated: the stream's capture is over, torch's bookkeeping is not
            logger.debug("guarded_capture: capture_end after failure raised %s", exc)
            end_stray_capture(main)
    if not ended_cleanly:
        pool_id = _pool_id(pool)
        with contextlib.suppress(Exception):  # raises when the allocator is not routing to the pool
            torch._C._cuda_endAllocateToPool(index, pool_id)
        with contextlib.suppress(Exception):
            torch._C._cuda_releasePool(index, pool_id)
    _clear_last_error()
    with contextlib.suppress(Exception):
        torch.cuda.synchronize(index)
    _clear_last_error()


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
    for s in streams:
        if end_stray_capture(s):  # only a process that bypassed this guard can leave one
            logger.warning("branchyard: a CUDA graph capture was left running on a branchyard stream; ended it")
    main = streams[0]
    torch.cuda.synchronize(index)
    main.wait_stream(torch.cuda.current_stream(index))
    began = False
    try:
        with torch.cuda.device(index), torch.cuda.stream(main):
            graph.capture_begin(pool=pool)
            began = True
            yield streams
            graph.capture_end()
    except BaseException:
        if began:
            _restore(graph, streams, pool, index)
        raise
    torch.cuda.current_stream(index).wait_stream(main)
