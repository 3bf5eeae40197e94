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
"""

U64, PTR, I32 = ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_int


def _ok(result):
    status, *values = result if isinstance(result, tuple) else (result,)
    if int(status) != 0:
        raise RuntimeError(f"CUDA call failed: {status}")
    return values[0] if len(values) == 1 else (tuple(values) or None)


def _edge(fn) -> bool:
    return "dependencyData" in (fn.__doc__ or "").split("\n", 1)[0]


class ReferenceLoop:
    """``while i < n: i += 1; x = lerp(x, c, 0.5)`` as one hand-built CUDA graph."""

    def __init__(self, x: torch.Tensor, c: torch.Tensor, n: torch.Tensor, body: str = "minimal"):
        torch.cuda.synchronize()
        major, minor = torch.cuda.get_device_capability()
        prog = _ok(nvrtc.nvrtcCreateProgram(SOURCE.encode(), b"ref.cu", 0, [], []))
        opts = [b"-default-device", f"--gpu-architecture=sm_{major}{minor}".encode()]
        _ok(nvrtc.nvrtcCompileProgram(prog, len(opts), opts))
        size = _ok(nvrtc.nvrtcGetCUBINSize(prog))
        cubin = b" " * size
        _ok(nvrtc.nvrtcGetCUBIN(prog, cubin))
        self.ctx = _ok(cu.cuCtxGetCurrent())
        self.module = _ok(cu.cuModuleLoadData(cubin))
        k = {name: _ok(cu.cuModuleGetFunction(self.module, name.encode())) for name in
             ("lerp_half", "lerp_half_inplace", "copy_inc_set", "start", "step_and_set")}
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
        mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        _ok(cu.cuStreamBeginCaptureToGraph(s, graph, None, None, 0, mode))
        h = _ok(cu.cuGraphConditionalHandleCreate(graph, self.ctx, 0, 0))
        launch(s, k["start"], 1, 1, (int(h), self.i.data_ptr(), n.data_ptr()), (U64, PTR, PTR))
        info = _ok(cu.cuStreamGetCaptureInfo(s))
        deps = list(info[3])
        params = cu.CUgraphNodeParams()
        params.type = cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
        params.conditional.handle = h
        params.conditional.type = cu.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE
        params.conditional.size = 1
        params.conditional.ctx = self.ctx
        if _edge(cu.cuGraphAddNode):
            node = _ok(cu.cuGraphAddNode(graph, deps, None, len(deps), params))
        else:
            node = _ok(cu.cuGraphAddNode(graph, deps, len(deps), params))
        body_graph = params.conditional.phGraph_out[0]
        _ok(cu.cuStreamBeginCaptureToGraph(b, body_graph, None, None, 0, mode))
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
        flags = cu.CUstreamUpdateCaptureDependencies_flags.CU_STREAM_SET_CAPTURE_DEPENDENCIES
        if _edge(cu.cuStreamUpdateCaptureDependencies):
            _ok(cu.cuStreamUpdateCaptureDependencies(s, [node], None, 1, flags))
        else:
            _ok(cu.cuStreamUpdateCaptureDependencies(s, [node], 1, flags))
        _ok(cu.cuStreamEndCapture(s))
        self.graph = graph
        self.body_nodes = _ok(cu.cuGraphGetNodes(body_graph, 0))[1]
        self.exec = _ok(cu.cuGraphInstantiate(graph, 0))
        self._side = side

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


if __name__ == "__main__":
    x, c = torch.randn(1 << 16, device="cuda"), torch.randn(1 << 16, device="cuda")
    for body in ("minimal", "same", "torch"):
        for trips in (1000, 10000):
            loop = ReferenceLoop(x.clone(), c, torch.tensor(trips, device="cuda"), body)
            print(f"{body:8s} n={trips:6d}: {loop.time_ms() * 1e3 / trips:6.2f} us/iter, {loop.body_nodes} body nodes")
