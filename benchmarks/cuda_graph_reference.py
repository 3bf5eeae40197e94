"""Hand-built CUDA graphs with a WHILE node: the yardstick for benchmarks/cuda_graph_control_flow.py.

Written directly against the CUDA driver through cuda-bindings (NVRTC kernels,
raw cuLaunchKernel, a conditional node added by hand). No branchyard code runs
inside these graphs, and no torch op except in the ``torch`` body; torch
provides the device buffers and the timing events.

Three loop bodies, all computing ``while i < n: i += 1; x = lerp(x, c, 0.5)`` over
64K floats:

``minimal``  2 kernels: ``x = x + 0.5 (c - x)`` in place, then one thread does
             ``i += 1; set(h, i < n)`` -- the issue's reference body.
``same``     the 2 kernel nodes our lowering emits for that program, one for one:
             ``y = lerp(x, c)`` into a second buffer, and one step kernel that copies
             ``x <- y``, does ``i += 1`` and sets ``h = i < n`` (NVRTC kernels here).
``torch``    the same 2 nodes, but ``y = lerp(x, c)`` is torch's own kernel (captured
             from ``torch.lerp(out=)``) -- what separates ours from ``same`` when the
             node layout is equal: torch's kernel.

And an 8-way switch in a loop (``ReferenceSwitchLoop``), ``while i < n: k = clamp(ks[i]);
x = x * a_k + b_k; i += 1``, built two ways -- one SWITCH node, or 8 IF nodes whose
handles one kernel sets (XLA's layout of an n-way case) -- in two body layouts:

``minimal``  the issue's reference: one thread reads ``ks[i]`` and sets the handle(s),
             each branch one in-place kernel, then ``step_and_set``.
``same``     the nodes our lowering emits for the benchmark's program, one for one: a
             gather kernel (``index_select``), the set kernel, a branch of two kernels
             (``mul`` then ``add`` into a second buffer), and the step kernel that copies it back.

Run: ``python benchmarks/cuda_graph_reference.py`` (prints per-iteration times).
"""

from __future__ import annotations

import ctypes

import torch
from cuda.bindings import driver as cu
from cuda.bindings import nvrtc

SOURCE = r"""
typedef unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ void cudaGraphSetConditional(cudaGraphConditionalHandle handle, unsigned int value);

extern "C" __global__ void lerp_half(const float* x, const float* c, float* y, int n) {
    int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k < n) y[k] = c[k] - (c[k] - x[k]) * 0.5f;
}
extern "C" __global__ void lerp_half_inplace(float* x, const float* c, int n) {
    int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k < n) x[k] = c[k] - (c[k] - x[k]) * 0.5f;
}
// copy x <- y; one thread does i += 1 and sets h = (i < n): the step node of our lowering
extern "C" __global__ void copy_inc_set(cudaGraphConditionalHandle h, long long* i, const long long* n,
                                        float* x, const float* y, int numel) {
    int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k == 0) { long long v = *i + 1; *i = v; cudaGraphSetConditional(h, v < *n ? 1u : 0u); }
    for (; k < numel; k += gridDim.x * blockDim.x) x[k] = y[k];
}
extern "C" __global__ void start(cudaGraphConditionalHandle h, long long* i, const long long* n) {
    *i = 0; cudaGraphSetConditional(h, 0 < *n ? 1u : 0u);
}
extern "C" __global__ void step_and_set(cudaGraphConditionalHandle h, long long* i, const long long* n) {
    long long v = *i + 1; *i = v; cudaGraphSetConditional(h, v < *n ? 1u : 0u);
}

// --- the switch loop ---------------------------------------------------------------------
__device__ __forceinline__ long long clamp_index(long long k, int n) { return k < 0 ? 0 : (k >= n ? n - 1 : k); }
extern "C" __global__ void gather_at(const long long* ks, const long long* i, long long* out) { *out = ks[*i]; }
// k = clamp(idx[at ? *at : 0]): the minimal layout reads ks[i] itself (at = i), the same layout a gathered idx.
extern "C" __global__ void set_switch(cudaGraphConditionalHandle h, const long long* idx, const long long* at, int n) {
    cudaGraphSetConditional(h, (unsigned int)clamp_index(idx[at ? *at : 0], n));
}
extern "C" __global__ void set_chain(const unsigned long long* hs, const long long* idx, const long long* at, int n) {
    long long k = clamp_index(idx[at ? *at : 0], n);
    for (int j = 0; j < n; ++j) cudaGraphSetConditional(hs[j], j == k ? 1u : 0u);
}
extern "C" __global__ void axpb_inplace(float* x, float a, float b, int n) {
    int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k < n) x[k] = x[k] * a + b;
}
extern "C" __global__ void scale_to(const float* x, float a, float* y, int n) {
    int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k < n) y[k] = x[k] * a;
}
extern "C" __global__ void shift_inplace(float* y, float b, int n) {
    int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k < n) y[k] = y[k] + b;
}
"""

KERNELS = ("lerp_half", "lerp_half_inplace", "copy_inc_set", "start", "step_and_set", "gather_at", "set_switch",
           "set_chain", "axpb_inplace", "scale_to", "shift_inplace")

U64, PTR, I32 = ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_int


def _ok(result):
    status, *values = result if isinstance(result, tuple) else (result,)
    if int(status) != 0:
        raise RuntimeError(f"CUDA call failed: {status}")
    return values[0] if len(values) == 1 else (tuple(values) or None)


def _edge(fn) -> bool:
    return "dependencyData" in (fn.__doc__ or "").split("\n", 1)[0]


_MODULE: dict = {}


def _kernels() -> dict:
    """The NVRTC-compiled kernels of SOURCE, loaded once per process."""
    if not _MODULE:
        major, minor = torch.cuda.get_device_capability()
        prog = _ok(nvrtc.nvrtcCreateProgram(SOURCE.encode(), b"ref.cu", 0, [], []))
        opts = [b"-default-device", f"--gpu-architecture=sm_{major}{minor}".encode()]
        _ok(nvrtc.nvrtcCompileProgram(prog, len(opts), opts))
        size = _ok(nvrtc.nvrtcGetCUBINSize(prog))
        cubin = b" " * size
        _ok(nvrtc.nvrtcGetCUBIN(prog, cubin))
        module = _ok(cu.cuModuleLoadData(cubin))
        _MODULE["module"] = module
        _MODULE.update({name: _ok(cu.cuModuleGetFunction(module, name.encode())) for name in KERNELS})
    return _MODULE


def _begin_capture(stream, graph) -> None:
    """Capture what ``stream`` launches into the existing ``graph``."""
    mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
    if _edge(cu.cuStreamBeginCaptureToGraph):
        _ok(cu.cuStreamBeginCaptureToGraph(stream, graph, None, None, 0, mode))
    else:
        _ok(cu.cuStreamBeginCaptureToGraph(stream, graph, None, 0, mode))


def _add_conditional(graph, stream, ctx, handle, kind, size: int) -> list:
    """Add a conditional node after what ``stream`` (capturing into ``graph``) has so far,
    make it the stream's only dependency, and return its body graphs."""
    info = _ok(cu.cuStreamGetCaptureInfo(stream))
    deps = list(info[3])
    params = cu.CUgraphNodeParams()
    params.type = cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
    params.conditional.handle = handle
    params.conditional.type = kind
    params.conditional.size = size
    params.conditional.ctx = ctx
    if _edge(cu.cuGraphAddNode):
        node = _ok(cu.cuGraphAddNode(graph, deps, None, len(deps), params))
    else:
        node = _ok(cu.cuGraphAddNode(graph, deps, len(deps), params))
    flags = cu.CUstreamUpdateCaptureDependencies_flags.CU_STREAM_SET_CAPTURE_DEPENDENCIES
    if _edge(cu.cuStreamUpdateCaptureDependencies):
        _ok(cu.cuStreamUpdateCaptureDependencies(stream, [node], None, 1, flags))
    else:
        _ok(cu.cuStreamUpdateCaptureDependencies(stream, [node], 1, flags))
    return list(params.conditional.phGraph_out)[:size]


class _Timed:
    def launch(self) -> None:
        _ok(cu.cuGraphLaunch(self.exec, cu.CUstream(self.stream.cuda_stream)))

    def time_ms(self, reps: int = 5) -> float:
        """Mean milliseconds of one graph launch (after one warm-up)."""
        self.launch()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record()
            for _ in range(reps):
                self.launch()
            end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps


class ReferenceLoop(_Timed):
    """``while i < n: i += 1; x = lerp(x, c, 0.5)`` as one hand-built CUDA graph."""

    def __init__(self, x: torch.Tensor, c: torch.Tensor, n: torch.Tensor, body: str = "minimal"):
        torch.cuda.synchronize()
        self.ctx = _ok(cu.cuCtxGetCurrent())
        k = _kernels()
        self.x, self.c, self.n = x, c, n
        self.i = torch.zeros((), dtype=torch.int64, device=x.device)
        self.y = torch.empty_like(x)
        numel = x.numel()
        blocks = (numel + 255) // 256
        self.stream = torch.cuda.Stream()
        side = torch.cuda.Stream()
        s, b = cu.CUstream(self.stream.cuda_stream), cu.CUstream(side.cuda_stream)
        self._args = []

        def launch(stream, fn, grid, block, args, types):
            self._args.append(args)
            _ok(cu.cuLaunchKernel(fn, grid, 1, 1, block, 1, 1, 0, stream, (args, types), 0))

        graph = _ok(cu.cuGraphCreate(0))
        _begin_capture(s, graph)
        h = _ok(cu.cuGraphConditionalHandleCreate(graph, self.ctx, 0, 0))
        launch(s, k["start"], 1, 1, (int(h), self.i.data_ptr(), n.data_ptr()), (U64, PTR, PTR))
        (body_graph,) = _add_conditional(graph, s, self.ctx, h, cu.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE, 1)
        _begin_capture(b, body_graph)
        if body == "minimal":
            launch(b, k["lerp_half_inplace"], blocks, 256, (x.data_ptr(), c.data_ptr(), numel), (PTR, PTR, I32))
            launch(b, k["step_and_set"], 1, 1, (int(h), self.i.data_ptr(), n.data_ptr()), (U64, PTR, PTR))
        elif body in ("same", "torch"):
            if body == "same":
                launch(b, k["lerp_half"], blocks, 256, (x.data_ptr(), c.data_ptr(), self.y.data_ptr(), numel),
                       (PTR, PTR, PTR, I32))
            else:
                with torch.cuda.stream(side):  # torch launches on `side`, which is capturing into the body
                    torch.lerp(x, c, 0.5, out=self.y)
            launch(b, k["copy_inc_set"], blocks, 256,
                   (int(h), self.i.data_ptr(), n.data_ptr(), x.data_ptr(), self.y.data_ptr(), numel),
                   (U64, PTR, PTR, PTR, PTR, I32))
        else:
            raise ValueError(body)
        _ok(cu.cuStreamEndCapture(b))
        _ok(cu.cuStreamEndCapture(s))
        self.graph = graph
        self.body_nodes = _ok(cu.cuGraphGetNodes(body_graph, 0))[1]
        self.exec = _ok(cu.cuGraphInstantiate(graph, 0))
        self._side = side


class ReferenceSwitchLoop(_Timed):
    """``while i < len(ks): k = clamp(ks[i], 0, 7); x = x * scales[k] + shifts[k]; i += 1``
    as one hand-built CUDA graph; ``lowering`` "switch" (one SWITCH node) or "chain"
    (one IF node per branch, all handles set by one kernel), ``layout`` "minimal" or "same"
    (module docstring). ``x`` is updated in place by each launch."""

    def __init__(self, x: torch.Tensor, ks: torch.Tensor, scales: list[float], shifts: list[float],
                 lowering: str = "switch", layout: str = "minimal"):
        if lowering not in ("switch", "chain") or layout not in ("minimal", "same"):
            raise ValueError(f"lowering={lowering!r}, layout={layout!r}")
        torch.cuda.synchronize()
        k = _kernels()
        self.ctx = _ok(cu.cuCtxGetCurrent())
        nb, numel = len(scales), x.numel()
        blocks = (numel + 255) // 256
        self.x, self.ks = x, ks
        self.i = torch.zeros((), dtype=torch.int64, device=x.device)
        self.n = torch.tensor(ks.numel(), dtype=torch.int64, device=x.device)
        self.idx = torch.zeros(1, dtype=torch.int64, device=x.device)
        self.y = torch.empty_like(x)
        self.handles = torch.zeros(nb, dtype=torch.int64, device=x.device)  # filled after the capture
        self.stream = torch.cuda.Stream()
        self._side = [torch.cuda.Stream() for _ in range(2)]  # the loop body's and the branches' captures
        streams = [cu.CUstream(t.cuda_stream) for t in self._side]
        self._keep = []
        s = cu.CUstream(self.stream.cuda_stream)

        def launch(stream, fn, grid, block, args, types):
            self._keep.append(args)
            _ok(cu.cuLaunchKernel(k[fn], grid, 1, 1, block, 1, 1, 0, stream, (args, types), 0))

        def branch(stream, j):
            if layout == "minimal":
                launch(stream, "axpb_inplace", blocks, 256, (x.data_ptr(), scales[j], shifts[j], numel),
                       (PTR, ctypes.c_float, ctypes.c_float, I32))
            else:
                launch(stream, "scale_to", blocks, 256, (x.data_ptr(), scales[j], self.y.data_ptr(), numel),
                       (PTR, ctypes.c_float, PTR, I32))
                launch(stream, "shift_inplace", blocks, 256, (self.y.data_ptr(), shifts[j], numel),
                       (PTR, ctypes.c_float, I32))

        graph = _ok(cu.cuGraphCreate(0))
        _begin_capture(s, graph)
        try:
            body, bits = self._capture(graph, s, streams, launch, branch, lowering, layout, nb, blocks, numel)
        except BaseException:
            for stream in reversed([s, *streams]):  # leave no stream capturing (later work would fail)
                cu.cuStreamEndCapture(stream)
            raise
        if bits:  # the chain's handles, read by its set kernel (no host-to-device copy during a capture)
            self.handles.copy_(torch.tensor(bits, dtype=torch.int64))
        self.graph = graph
        #: kernel + conditional nodes that run in one trip: the loop body's and one branch's
        self.nodes_per_trip = _ok(cu.cuGraphGetNodes(body, 0))[1] + (1 if layout == "minimal" else 2)
        self.exec = _ok(cu.cuGraphInstantiate(graph, 0))

    def _capture(self, graph, s, streams, launch, branch, lowering, layout, nb, blocks, numel):
        ctx, x, ks, bits = self.ctx, self.x, self.ks, []
        h_while = _ok(cu.cuGraphConditionalHandleCreate(graph, ctx, 0, 0))
        launch(s, "start", 1, 1, (int(h_while), self.i.data_ptr(), self.n.data_ptr()), (U64, PTR, PTR))
        (body,) = _add_conditional(graph, s, ctx, h_while, cu.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE, 1)
        b = streams[0]
        _begin_capture(b, body)
        if layout == "minimal":  # the set kernel reads ks[i] itself
            idx, at = ks.data_ptr(), self.i.data_ptr()
        else:  # index_select first, then the set kernel reads its result
            launch(b, "gather_at", 1, 1, (ks.data_ptr(), self.i.data_ptr(), self.idx.data_ptr()), (PTR, PTR, PTR))
            idx, at = self.idx.data_ptr(), 0
        if lowering == "switch":
            h = _ok(cu.cuGraphConditionalHandleCreate(body, ctx, 0, 0))
            launch(b, "set_switch", 1, 1, (int(h), idx, at, nb), (U64, PTR, PTR, I32))
            bodies = _add_conditional(body, b, ctx, h, cu.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_SWITCH, nb)
        else:
            hs = [_ok(cu.cuGraphConditionalHandleCreate(body, ctx, 0, 0)) for _ in range(nb)]
            bits = [int(h) - (1 << 64) if int(h) >= 1 << 63 else int(h) for h in hs]  # u64 handles in int64 storage
            launch(b, "set_chain", 1, 1, (self.handles.data_ptr(), idx, at, nb), (PTR, PTR, PTR, I32))
            bodies = []
            for h in hs:
                bodies += _add_conditional(body, b, ctx, h, cu.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_IF, 1)
        for j, g in enumerate(bodies):
            _begin_capture(streams[1], g)
            branch(streams[1], j)
            _ok(cu.cuStreamEndCapture(streams[1]))
        if layout == "minimal":
            launch(b, "step_and_set", 1, 1, (int(h_while), self.i.data_ptr(), self.n.data_ptr()), (U64, PTR, PTR))
        else:
            launch(b, "copy_inc_set", blocks, 256,
                   (int(h_while), self.i.data_ptr(), self.n.data_ptr(), x.data_ptr(), self.y.data_ptr(), numel),
                   (U64, PTR, PTR, PTR, PTR, I32))
        _ok(cu.cuStreamEndCapture(b))
        _ok(cu.cuStreamEndCapture(s))
        return body, bits


def switch_reference(x: torch.Tensor, ks: torch.Tensor, scales: list[float], shifts: list[float]) -> torch.Tensor:
    """What ``ReferenceSwitchLoop`` computes, with torch ops on the host's schedule."""
    y = x.clone()
    for k in ks.clamp(0, len(scales) - 1).tolist():
        y = y * scales[k] + shifts[k]
    return y


if __name__ == "__main__":
    x, c = torch.randn(1 << 16, device="cuda"), torch.randn(1 << 16, device="cuda")
    for body in ("minimal", "same", "torch"):
        for trips in (1000, 10000):
            loop = ReferenceLoop(x.clone(), c, torch.tensor(trips, device="cuda"), body)
            print(f"{body:8s} n={trips:6d}: {loop.time_ms() * 1e3 / trips:6.2f} us/iter, {loop.body_nodes} body nodes")
    scales, shifts = [0.5 + 0.0625 * j for j in range(8)], [0.01 * j for j in range(8)]
    ks = torch.randint(-1, 9, (1000,), device="cuda")  # a few out of range: clamped
    for layout in ("minimal", "same"):
        for lowering in ("switch", "chain"):
            loop = ReferenceSwitchLoop(x.clone(), ks, scales, shifts, lowering, layout)
            loop.launch()
            torch.cuda.synchronize()
            ok = torch.allclose(loop.x, switch_reference(x, ks, scales, shifts), rtol=1e-5, atol=1e-5)
            print(f"{layout:8s} {lowering:6s}: {loop.time_ms() * 1e3 / ks.numel():6.2f} us/step, "
                  f"{loop.nodes_per_trip} nodes per trip, {'equal' if ok else 'WRONG'}")
