"""CUDA graph conditional nodes built with NVIDIA's ``cuda-bindings``.

torch 2.11 has no conditional-node support, so this module talks to the CUDA
driver directly (``cuda.bindings.driver`` and ``cuda.bindings.nvrtc``) while
torch's own ``torch.cuda.graph`` capture is in progress:

1. A one-thread *set kernel*, compiled once with NVRTC, reads a predicate or
   index from device memory and calls ``cudaGraphSetConditional`` on a
   conditional handle. It is launched on the capturing torch stream, so it is
   captured as an ordinary kernel node.
2. :meth:`ConditionalBuilder.add_node` creates the handle on the graph being
   captured (``cuStreamGetCaptureInfo``), adds an IF / WHILE / SWITCH node after
   the set kernel, and makes the capturing stream depend on that node.
3. :meth:`ConditionalBuilder.capture_into` fills one body graph of the node by
   capturing torch ops issued on a side stream (``cuStreamBeginCaptureToGraph``).
   Bodies can hold conditional nodes themselves: the side stream is what
   ``cuStreamGetCaptureInfo`` sees at the next level, so nesting is recursion.

Semantics of the set kernels, as Python (``n`` = number of SWITCH bodies)::

    set_bool(h, p):          h = 1 if p else 0
    set_if_pair(h1, h2, p):  h1, h2 = (1, 0) if p else (0, 1)   # IF + IF lowering of if/else
    set_index(h, i, n):      h = min(max(i, 0), n - 1)          # torch.ops.higher_order.switch clamps
    set_onehot(hs, i, n):    hs[k] = 1 if min(max(i, 0), n - 1) == k else 0   # switch as n IF nodes
    copy4(pairs):            dst[:] = src[:] for up to 4 dense (dst, src) pairs, one kernel node

Nothing here is imported before it is needed: ``branchyard.lowering`` must
import on a machine without CUDA or ``cuda-bindings``.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from branchyard.errors import LoweringError

__all__ = [
    "CondKind",
    "SET_KERNEL_SOURCE",
    "compile_set_kernels",
    "cuda_bindings_available",
    "ConditionalBuilder",
    "GraphNodeCount",
    "count_graph_nodes",
]


class CondKind(enum.IntEnum):
    """The three conditional node types (values are CUDA's)."""

    IF = 0
    WHILE = 1
    SWITCH = 2


# No headers: NVRTC without the CUDA include path must compile this. The device
# runtime function is resolved by the driver when the module is loaded.
SET_KERNEL_SOURCE = r"""
typedef unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ void cudaGraphSetConditional(cudaGraphConditionalHandle handle, unsigned int value);

extern "C" __global__ void branchyard_set_bool(cudaGraphConditionalHandle h, const bool* flag) {
    cudaGraphSetConditional(h, *flag ? 1u : 0u);
}

extern "C" __global__ void branchyard_set_if_pair(cudaGraphConditionalHandle h_then,
                                                   cudaGraphConditionalHandle h_else,
                                                   const bool* flag) {
    unsigned int v = *flag ? 1u : 0u;
    cudaGraphSetConditional(h_then, v);
    cudaGraphSetConditional(h_else, 1u - v);
}

extern "C" __global__ void branchyard_set_index(cudaGraphConditionalHandle h, const long long* index,
                                                long long n) {
    long long i = *index;
    i = i < 0 ? 0 : (i >= n ? n - 1 : i);
    cudaGraphSetConditional(h, (unsigned int)i);
}

// Switch as a chain of IF nodes: handle k of this launch is set to (clamp(index) == base + k).
extern "C" __global__ void branchyard_set_onehot(const long long* index, long long n, long long base, int count,
                                                 cudaGraphConditionalHandle h0, cudaGraphConditionalHandle h1,
                                                 cudaGraphConditionalHandle h2, cudaGraphConditionalHandle h3,
                                                 cudaGraphConditionalHandle h4, cudaGraphConditionalHandle h5,
                                                 cudaGraphConditionalHandle h6, cudaGraphConditionalHandle h7) {
    cudaGraphConditionalHandle h[8] = {h0, h1, h2, h3, h4, h5, h6, h7};
    long long i = *index;
    i = i < 0 ? 0 : (i >= n ? n - 1 : i);
    for (int k = 0; k < count; ++k) cudaGraphSetConditional(h[k], i == base + k ? 1u : 0u);
}

// Up to four dense byte copies in ONE kernel node: the loop-carry write-back costs one
// node per trip instead of one memcpy node per carry.
struct alignas(16) branchyard_v16 { unsigned long long a, b; };
extern "C" __global__ void branchyard_copy4(int count,
                                            char* d0, const char* s0, unsigned long long b0,
                                            char* d1, const char* s1, unsigned long long b1,
                                            char* d2, const char* s2, unsigned long long b2,
                                            char* d3, const char* s3, unsigned long long b3) {
    char* d[4] = {d0, d1, d2, d3};
    const char* s[4] = {s0, s1, s2, s3};
    unsigned long long b[4] = {b0, b1, b2, b3};
    unsigned long long tid = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    unsigned long long stride = gridDim.x * (unsigned long long)blockDim.x;
    for (int k = 0; k < count; ++k) {
        if ((((unsigned long long)d[k] | (unsigned long long)s[k] | b[k]) & 15ull) == 0) {
            branchyard_v16* dv = (branchyard_v16*)d[k];
            const branchyard_v16* sv = (const branchyard_v16*)s[k];
            for (unsigned long long i = tid; i < b[k] / 16; i += stride) dv[i] = sv[i];
        } else {
            for (unsigned long long i = tid; i < b[k]; i += stride) d[k][i] = s[k][i];
        }
    }
}
"""

SET_KERNEL_NAMES = (
    "branchyard_set_bool",
    "branchyard_set_if_pair",
    "branchyard_set_index",
    "branchyard_set_onehot",
    "branchyard_copy4",
)


def cuda_bindings_available() -> str | None:
    """``None`` when ``cuda.bindings`` (driver + nvrtc) imports, else the reason it does not."""
    try:
        from cuda.bindings import driver, nvrtc  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install raising anything
        return f"cuda-bindings is not importable ({type(exc).__name__}: {exc}); pip install 'cuda-bindings>=12.8'"
    return None


def _check(result: Any, what: str) -> Any:
    """Unpack a cuda-bindings ``(status, *values)`` tuple, raising LoweringError on failure."""
    status, *values = result if isinstance(result, tuple) else (result,)
    if int(status) != 0:
        name = getattr(status, "name", str(status))
        raise LoweringError(f"{what} failed with {name}", where="cuda-bindings")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def compile_set_kernels(arch: str) -> bytes:
    """Compile :data:`SET_KERNEL_SOURCE` with NVRTC for ``arch`` (e.g. ``"sm_90"``); returns a CUBIN.

    Needs only NVRTC, not a GPU, so it is testable on any machine with
    ``cuda-bindings`` and an NVRTC library.
    """
    from cuda.bindings import nvrtc

    prog = _check(nvrtc.nvrtcCreateProgram(SET_KERNEL_SOURCE.encode(), b"branchyard_set.cu", 0, [], []), "nvrtcCreateProgram")
    opts = [b"-default-device", f"--gpu-architecture={arch}".encode()]
    try:
        status = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if int(status[0]) != 0:
            size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise LoweringError(f"NVRTC could not compile the set kernels: {log.decode(errors='replace').strip()}", where=arch)
        size = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _takes_edge_data(fn: Callable) -> bool:
    # cuda-bindings 13 added edge-data arguments to several graph calls; 12.x lacks them.
    return "dependencyData" in (fn.__doc__ or "").split("\n", 1)[0]


@dataclass
class GraphNodeCount:
    """Node counts of one CUDA graph and, recursively, of its conditional bodies."""

    by_type: dict[str, int] = field(default_factory=dict)
    bodies: list["GraphNodeCount"] = field(default_factory=list)

    @property
    def own(self) -> int:
        """Nodes of this graph alone."""
        return sum(self.by_type.values())

    @property
    def total(self) -> int:
        """Nodes of this graph and of every body below it."""
        return self.own + sum(b.total for b in self.bodies)

    def summary(self) -> str:
        """``"7 nodes (KERNEL 4, CONDITIONAL 1, ...), 2 bodies"`` -- for logs and docs."""
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(self.by_type.items()))
        return f"{self.total} nodes ({kinds}; {len(self.bodies)} direct bodies)"


def count_graph_nodes(graph: Any, bodies_of: dict[int, list[Any]]) -> GraphNodeCount:
    """Count the nodes of a ``CUgraph`` by type, descending into the conditional
    bodies listed in ``bodies_of`` (conditional node handle value -> body graphs)."""
    from cuda.bindings import driver

    _, n = _check(driver.cuGraphGetNodes(graph, 0), "cuGraphGetNodes")
    nodes, _ = _check(driver.cuGraphGetNodes(graph, n), "cuGraphGetNodes") if n else ([], 0)
    count = GraphNodeCount()
    for node in nodes:
        kind = _check(driver.cuGraphNodeGetType(node), "cuGraphNodeGetType")
        name = kind.name.removeprefix("CU_GRAPH_NODE_TYPE_")
        count.by_type[name] = count.by_type.get(name, 0) + 1
        for body in bodies_of.get(int(node), []):
            count.bodies.append(count_graph_nodes(body, bodies_of))
    return count


class ConditionalBuilder:
    """Adds conditional nodes to whatever graph the current torch stream is capturing.

    One builder serves one capture. It keeps every side stream and every
    kernel argument alive until it is dropped, and records each conditional
    node's body graphs (for :func:`count_graph_nodes`).
    """

    def __init__(self, device: torch.device):
        from cuda.bindings import driver

        self._driver = driver
        self.device = device
        torch.cuda.init()
        with torch.cuda.device(device):
            torch.cuda.current_stream(device).synchronize()  # makes torch's primary context current
            self._ctx = _check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
            major, minor = torch.cuda.get_device_capability(device)
            self._module = _check(driver.cuModuleLoadData(compile_set_kernels(f"sm_{major}{minor}")), "cuModuleLoadData")
        self._kernels = {
            name: _check(driver.cuModuleGetFunction(self._module, name.encode()), f"cuModuleGetFunction({name})")
            for name in SET_KERNEL_NAMES
        }
        self.driver_version: int = _check(driver.cuDriverGetVersion(), "cuDriverGetVersion")
        # One side stream per nesting depth, made now: creating streams during a capture is unsafe.
        self._streams: list[torch.cuda.Stream] = [torch.cuda.Stream(device) for _ in range(8)]
        self._depth = 0
        self.bodies_of: dict[int, list[Any]] = {}
        self.nodes_added: dict[str, int] = {k.name: 0 for k in CondKind}
        self._keepalive: list[Any] = []

    # -- what the driver supports ------------------------------------------------
    @property
    def if_else_in_one_node(self) -> bool:
        """IF nodes with two bodies (if/else) need driver and bindings >= 12.8."""
        return self.driver_version >= 12080

    # -- stream plumbing ---------------------------------------------------------
    def _current_stream(self) -> Any:
        return self._driver.CUstream(torch.cuda.current_stream(self.device).cuda_stream)

    def _capture_state(self, stream: Any) -> tuple[Any, list[Any], list[Any] | None]:
        info = _check(self._driver.cuStreamGetCaptureInfo(stream), "cuStreamGetCaptureInfo")
        # 13.x: (status, id, graph, deps, edge_data, n); 12.x: (status, id, graph, deps, n)
        status, graph, deps = info[0], info[2], list(info[3] or [])
        edges = list(info[4] or []) if len(info) == 6 else None
        if status != self._driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE:
            raise LoweringError(
                "conditional nodes can only be added while a CUDA graph capture is running",
                where=f"stream {int(stream)}",
            )
        return graph, deps, edges

    def _launch(self, kernel: str, args: tuple, types: tuple, grid: int = 1, block: int = 1) -> None:
        self._keepalive.append(args)
        _check(
            self._driver.cuLaunchKernel(
                self._kernels[kernel], grid, 1, 1, block, 1, 1, 0, self._current_stream(), (args, types), 0
            ),
            f"cuLaunchKernel({kernel})",
        )

    # -- the two public steps ----------------------------------------------------
    def new_handle(self) -> Any:
        """A conditional handle on the graph the current stream captures into."""
        graph, _, _ = self._capture_state(self._current_stream())
        return _check(self._driver.cuGraphConditionalHandleCreate(graph, self._ctx, 0, 0), "cuGraphConditionalHandleCreate")

    def set_from_bool(self, handles: tuple[Any, ...], flag: torch.Tensor) -> None:
        """Capture a set kernel: ``handles[0] = flag`` (and ``handles[1] = not flag`` for a pair)."""
        self._check_scalar(flag, torch.bool)
        if len(handles) == 1:
            self._launch("branchyard_set_bool", (int(handles[0]), flag.data_ptr()), (ctypes.c_ulonglong, ctypes.c_void_p))
        else:
            self._launch(
                "branchyard_set_if_pair",
                (int(handles[0]), int(handles[1]), flag.data_ptr()),
                (ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_void_p),
            )
        self._keepalive.append(flag)

    def set_from_index(self, handle: Any, index: torch.Tensor, n: int) -> None:
        """Capture a set kernel: ``handle = clamp(index, 0, n - 1)``."""
        self._check_scalar(index, torch.int64)
        self._launch(
            "branchyard_set_index",
            (int(handle), index.data_ptr(), n),
            (ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_longlong),
        )
        self._keepalive.append(index)

    def set_onehot(self, handles: list[Any], index: torch.Tensor) -> None:
        """Capture set kernels: ``handles[k] = (clamp(index, 0, n - 1) == k)`` (switch as n IF nodes)."""
        self._check_scalar(index, torch.int64)
        n = len(handles)
        types = (ctypes.c_void_p, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_int) + (ctypes.c_ulonglong,) * 8
        for base in range(0, n, 8):
            chunk = [int(h) for h in handles[base : base + 8]]
            args = (index.data_ptr(), n, base, len(chunk), *chunk, *([0] * (8 - len(chunk))))
            self._launch("branchyard_set_onehot", args, types)
        self._keepalive.append(index)

    def copy_many(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """``dst.copy_(src)`` for every pair, dense same-layout pairs four to a kernel node."""
        dense, other = [], []
        for dst, src in pairs:
            same_layout = dst.dtype == src.dtype and dst.shape == src.shape and dst.stride() == src.stride()
            (dense if same_layout and dst.is_contiguous() and dst.is_cuda and src.is_cuda else other).append((dst, src))
        for dst, src in other:
            dst.copy_(src)
        types = (ctypes.c_int,) + (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_ulonglong) * 4
        for base in range(0, len(dense), 4):
            chunk = dense[base : base + 4]
            flat: list[int] = []
            for dst, src in chunk:
                flat += [dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size()]
            flat += [0, 0, 0] * (4 - len(chunk))
            largest = max(dst.numel() * dst.element_size() for dst, _ in chunk)
            blocks = max(1, min(1024, (largest // 16 + 255) // 256))
            self._launch("branchyard_copy4", (len(chunk), *flat), types, grid=blocks, block=256)
            self._keepalive.append(chunk)

    def add_node(self, kind: CondKind, handle: Any, size: int) -> list[Any]:
        """Append a conditional node after everything captured so far; return its body graphs."""
        d = self._driver
        stream = self._current_stream()
        graph, deps, edges = self._capture_state(stream)
        params = d.CUgraphNodeParams()
        params.type = d.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
        params.conditional.handle = handle
        params.conditional.type = d.CUgraphConditionalNodeType(int(kind))
        params.conditional.size = size
        params.conditional.ctx = self._ctx
        if _takes_edge_data(d.cuGraphAddNode):
            node = _check(d.cuGraphAddNode(graph, deps, edges or None, len(deps), params), f"cuGraphAddNode({kind.name})")
        else:
            node = _check(d.cuGraphAddNode(graph, deps, len(deps), params), f"cuGraphAddNode({kind.name})")
        bodies = list(params.conditional.phGraph_out)[:size]
        flags = d.CUstreamUpdateCaptureDependencies_flags.CU_STREAM_SET_CAPTURE_DEPENDENCIES
        if _takes_edge_data(d.cuStreamUpdateCaptureDependencies):
            _check(d.cuStreamUpdateCaptureDependencies(stream, [node], None, 1, flags), "cuStreamUpdateCaptureDependencies")
        else:
            _check(d.cuStreamUpdateCaptureDependencies(stream, [node], 1, flags), "cuStreamUpdateCaptureDependencies")
        self.bodies_of[int(node)] = bodies
        self.nodes_added[kind.name] += 1
        return bodies

    @contextlib.contextmanager
    def capture_into(self, body: Any) -> Iterator[None]:
        """Torch ops issued inside the ``with`` are captured into ``body``."""
        d = self._driver
        if len(self._streams) <= self._depth:
            self._streams.append(torch.cuda.Stream(self.device))
        side = self._streams[self._depth]
        stream = d.CUstream(side.cuda_stream)
        mode = d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        if _takes_edge_data(d.cuStreamBeginCaptureToGraph):
            _check(d.cuStreamBeginCaptureToGraph(stream, body, None, None, 0, mode), "cuStreamBeginCaptureToGraph")
        else:
            _check(d.cuStreamBeginCaptureToGraph(stream, body, None, 0, mode), "cuStreamBeginCaptureToGraph")
        self._depth += 1
        try:
            with torch.cuda.stream(side):
                yield
        finally:
            self._depth -= 1
            # End the capture even when the body failed, so the stream is usable again.
            _check(d.cuStreamEndCapture(stream), "cuStreamEndCapture (body graph)")

    def keep(self, value: Any) -> None:
        """Keep ``value`` (a tensor made inside a body) alive as long as the builder."""
        self._keepalive.append(value)

    @staticmethod
    def _check_scalar(t: torch.Tensor, dtype: torch.dtype) -> None:
        if t.dtype != dtype or t.numel() != 1 or not t.is_cuda:
            raise LoweringError(
                f"set kernel needs a one-element {dtype} CUDA tensor, got {t.dtype} of shape {tuple(t.shape)} on {t.device}",
                where="conditional node",
            )
