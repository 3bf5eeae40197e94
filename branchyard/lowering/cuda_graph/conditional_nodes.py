"""CUDA graph conditional nodes built with NVIDIA's ``cuda-bindings``.

torch 2.11 has no conditional-node support, so this module talks to the CUDA
driver directly (``cuda.bindings.driver`` and ``cuda.bindings.nvrtc``) while
torch's own ``torch.cuda.graph`` capture is in progress:

1. A *set kernel*, compiled once with NVRTC, reads a predicate (or evaluates a
   0-d comparison) or an index from device memory and calls
   ``cudaGraphSetConditional`` on a conditional handle. It is launched on the
   capturing torch stream, so it is captured as an ordinary kernel node.
2. :meth:`ConditionalBuilder.add_node` creates the handle on the graph being
   captured (``cuStreamGetCaptureInfo``), adds an IF / WHILE / SWITCH node after
   the set kernel, and makes the capturing stream depend on that node.
3. :meth:`ConditionalBuilder.capture_into` fills one body graph of the node by
   capturing torch ops issued on a side stream (``cuStreamBeginCaptureToGraph``).
   Bodies can hold conditional nodes themselves: the side stream is what
   ``cuStreamGetCaptureInfo`` sees at the next level, so nesting is recursion.

Semantics of the kernels, as Python (``n`` = number of SWITCH bodies)::

    step(h, pred, copies, counter, increment):   # one node: what a loop trip needs after its body
        for dst, src in copies: dst[:] = src[:]          # up to four dense loop carries
        if increment: t, k = increment; t += k           # a counter carry's `i + k`
        v = pred.lhs <op> pred.rhs if pred is a Comparison else bool(pred)
        if counter:                                       # max_iterations
            counter.count = 0 if reset else counter.count + 1
            if v and counter.count >= counter.limit: counter.exhausted, v = True, False
        h = v; h_else = not v                             # h_else: the IF + IF lowering of if/else
    set_program(h, p, n):    i = argmax(p.source) if p.argmax else p.source; i = p.steps(i)  # IndexProgram
                             h = min(max(i, 0), n - 1)          # switch clamps (branchyard.fx.control_flow)
    set_router(h, p, n):     the same with p.source = mean(x, 0) @ w computed by the kernel's one block  # RouterLogits
    step_router(h, pred, copies, counter, increment, hr, p, n):   # a loop step and its NEXT trip's router:
                             step(h, pred, copies, counter, increment); set_router(hr, p, n)  # p reads no copy's dst
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
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch

from branchyard.errors import LoweringError

if TYPE_CHECKING:  # pragma: no cover
    from branchyard.lowering.cuda_graph.patterns import Comparison, IndexProgram

#: Conditional nodes nest at most this deep (one dedicated side stream per level).
MAX_NESTING = 16

__all__ = [
    "MAX_NESTING",
    "CondKind",
    "SET_KERNEL_SOURCE",
    "compile_set_kernels",
    "cuda_bindings_available",
    "ConditionalBuilder",
    "TripCounter",
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

// dtype codes (DTYPE_CODES in Python): 1 int64, 2 int32, 3 float32, 4 float64, 5 int16, 6 int8, 7 uint8.
// comparison codes (COMPARE_CODES): 0 flag (a bool read from a), 1 lt, 2 le, 3 gt, 4 ge, 5 eq, 6 ne.
template <typename T> __device__ __forceinline__ bool by_compare(int op, T a, T b) {
    switch (op) {
        case 1: return a < b;   case 2: return a <= b;  case 3: return a > b;
        case 4: return a >= b;  case 5: return a == b;  default: return a != b;
    }
}
__device__ __forceinline__ long long by_load_int(const void* p, int dtype) {
    switch (dtype) {
        case 1: return *(const long long*)p;  case 2: return *(const int*)p;
        case 5: return *(const short*)p;      case 6: return *(const signed char*)p;
        default: return *(const unsigned char*)p;
    }
}

// The predicate of a conditional node, evaluated by one thread: `a <op> b` in the operands'
// dtype (integers widened to int64, which is exact), each operand read from device memory
// when its pointer is non-null, else from the immediates ia/ib (integers) or fa/fb (floats).
__device__ bool by_predicate(int op, int dtype, const void* a, const void* b,
                             long long ia, long long ib, double fa, double fb) {
    if (op == 0) return *(const bool*)a;
    if (dtype == 3) return by_compare<float>(op, a ? *(const float*)a : (float)fa, b ? *(const float*)b : (float)fb);
    if (dtype == 4) return by_compare<double>(op, a ? *(const double*)a : fa, b ? *(const double*)b : fb);
    return by_compare<long long>(op, a ? by_load_int(a, dtype) : ia, b ? by_load_int(b, dtype) : ib);
}

struct alignas(16) branchyard_v16 { unsigned long long a, b; };
__device__ __forceinline__ void by_copy(char* d, const char* s, unsigned long long bytes,
                                        unsigned long long tid, unsigned long long stride) {
    if ((((unsigned long long)d | (unsigned long long)s | bytes) & 15ull) == 0) {
        branchyard_v16* dv = (branchyard_v16*)d;
        const branchyard_v16* sv = (const branchyard_v16*)s;
        for (unsigned long long i = tid; i < bytes / 16; i += stride) dv[i] = sv[i];
    } else {
        for (unsigned long long i = tid; i < bytes; i += stride) d[i] = s[i];
    }
}

// Up to four (dst, src, bytes) copies, as kernel parameters and as one grid-stride pass.
#define BY_COPY4_PARAMS char* d0, const char* s0, unsigned long long b0, \
                        char* d1, const char* s1, unsigned long long b1, \
                        char* d2, const char* s2, unsigned long long b2, \
                        char* d3, const char* s3, unsigned long long b3
// Declares tid and stride (the step kernel's set-up thread is tid 0); the copies use `blocks` blocks.
#define BY_COPY4_ON(count, blocks)                                                       \
    unsigned long long tid = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;  \
    unsigned long long stride = (blocks) * (unsigned long long)blockDim.x;               \
    if ((count) > 0) by_copy(d0, s0, b0, tid, stride);                                   \
    if ((count) > 1) by_copy(d1, s1, b1, tid, stride);                                   \
    if ((count) > 2) by_copy(d2, s2, b2, tid, stride);                                   \
    if ((count) > 3) by_copy(d3, s3, b3, tid, stride)
#define BY_COPY4(count) BY_COPY4_ON(count, gridDim.x)

// Everything a conditional node needs after its body, in ONE kernel node:
//   copy up to four dense loop carries (new value -> carry buffer), then one thread
//   adds inc_by to a 0-d integer counter carry (the body's `i + 1`, left to this kernel),
//   evaluates the predicate (on the new values, which the copies do not touch),
//   counts the trip against max_iterations and sets the handle(s).
// count: null, or the trip counter (reset != 0: set it to 0 -- the set before a WHILE node).
// A predicate that holds while the counter has reached `limit` stops the loop and sets *exhausted.
#define BY_STEP_PARAMS cudaGraphConditionalHandle h, cudaGraphConditionalHandle h_else,          \
                       int has_else, int op, int dtype, const void* a, const void* b,             \
                       long long ia, long long ib, double fa, double fb,                          \
                       long long* count, long long limit, int reset, bool* exhausted,             \
                       void* inc, long long inc_by, int inc_dtype
#define BY_STEP_ARGS h, h_else, has_else, op, dtype, a, b, ia, ib, fa, fb, count, limit, reset, exhausted, \
                     inc, inc_by, inc_dtype
// The step's one-thread part, after the copies.
__device__ void by_step_set(BY_STEP_PARAMS) {
    if (inc) {  // unsigned arithmetic: wraps like torch's integer add, without C++'s overflow UB
        if (inc_dtype == 1) *(unsigned long long*)inc += (unsigned long long)inc_by;
        else *(unsigned int*)inc += (unsigned int)inc_by;
    }
    bool v = by_predicate(op, dtype, a, b, ia, ib, fa, fb);
    if (count) {
        long long c = reset ? 0 : *count + 1;
        *count = c;
        if (v && c >= limit) { *exhausted = true; v = false; }
    }
    cudaGraphSetConditional(h, v ? 1u : 0u);
    if (has_else) cudaGraphSetConditional(h_else, v ? 0u : 1u);
}
extern "C" __global__ void branchyard_step(BY_STEP_PARAMS, int ncopy, BY_COPY4_PARAMS) {
    BY_COPY4(ncopy);
    if (tid != 0) return;
    by_step_set(BY_STEP_ARGS);
}

// The float a 16-bit pattern holds: dtype 8 bfloat16, else (9) float16.
__device__ __forceinline__ float by_half_to_float(unsigned short b, int dtype) {
    if (dtype == 8) return __uint_as_float(((unsigned int)b) << 16);
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(b));
    return f;
}
// Reals an argmax reads, by dtype code: 3 float32, 4 float64, 8 bfloat16, 9 float16.
__device__ __forceinline__ double by_load_real(const void* p, long long i, int dtype) {
    if (dtype == 3) return ((const float*)p)[i];
    if (dtype == 4) return ((const double*)p)[i];
    return by_half_to_float(((const unsigned short*)p)[i], dtype);
}
__device__ __forceinline__ int by_int_size(int dtype) {
    return dtype == 1 ? 8 : dtype == 2 ? 4 : dtype == 5 ? 2 : 1;
}

// torch.argmax of len elements: the first maximum; a NaN counts as the maximum (the first NaN wins).
__device__ long long by_argmax(const void* p, int dtype, long long len) {
    long long best = 0;
    if (dtype == 3 || dtype == 4 || dtype == 8 || dtype == 9) {
        double m = by_load_real(p, 0, dtype);
        if (m != m) return 0;
        for (long long i = 1; i < len; ++i) {
            double v = by_load_real(p, i, dtype);
            if (v != v) return i;
            if (v > m) { m = v; best = i; }
        }
        return best;
    }
    int size = by_int_size(dtype);
    long long m = by_load_int(p, dtype);
    for (long long i = 1; i < len; ++i) {
        long long v = by_load_int((const char*)p + i * size, dtype);
        if (v > m) { m = v; best = i; }
    }
    return best;
}

// Index steps on int64 (IndexProgram.steps): 1 max(i, a) (clamp's min), 2 min(i, a) (clamp's max),
// 3 Python's i % a (the sign of a); then clamp(i, 0, n - 1) into the handle.
__device__ void by_steps_and_set(cudaGraphConditionalHandle h, long long i, int nsteps, const int* ops,
                                 const long long* as, long long n) {
    for (int k = 0; k < nsteps && k < 4; ++k) {
        long long a = as[k];
        if (ops[k] == 1) {
            i = i < a ? a : i;
        } else if (ops[k] == 2) {
            i = i > a ? a : i;
        } else {
            long long r = a == -1 ? 0 : i % a;  // -1: no LLONG_MIN % -1 overflow; always 0
            if (r != 0 && ((r < 0) != (a < 0))) r += a;
            i = r;
        }
    }
    i = i < 0 ? 0 : (i >= n ? n - 1 : i);
    cudaGraphSetConditional(h, (unsigned int)i);
}

// A switch index computed here instead of by torch kernels (IndexProgram in Python):
// i = argmax(src[0:len]) or the integer *src, then up to four steps (no argmax, no steps:
// a switch's plain index).
extern "C" __global__ void branchyard_set_program(cudaGraphConditionalHandle h, const void* src, int dtype,
                                                  long long len, int argmax, int nsteps,
                                                  int op0, long long a0, int op1, long long a1,
                                                  int op2, long long a2, int op3, long long a3, long long n) {
    long long i = argmax ? by_argmax(src, dtype, len) : by_load_int(src, dtype);
    const int ops[4] = {op0, op1, op2, op3};
    const long long as[4] = {a0, a1, a2, a3};
    by_steps_and_set(h, i, nsteps, ops, as, n);
}

// A float of dtype 3 float32, 8 bfloat16, 9 float16, and a float32 rounded to that dtype
// (round to nearest even: what torch's kernels store).
__device__ __forceinline__ float by_load_f(const void* p, long long i, int dtype) {
    if (dtype == 3) return ((const float*)p)[i];
    return by_half_to_float(((const unsigned short*)p)[i], dtype);
}
__device__ __forceinline__ float by_round(float f, int dtype) {
    if (dtype == 8) {
        unsigned int u = __float_as_uint(f);
        if ((u & 0x7fffffffu) > 0x7f800000u) return f;  // NaN stays NaN
        u += 0x7fffu + ((u >> 16) & 1u);
        return __uint_as_float(u & 0xffff0000u);
    }
    if (dtype == 9) {
        unsigned short b;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(b) : "f"(f));
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(b));
    }
    return f;
}

// BY_ROUTER_MAX_K, BY_ROUTER_VEC_MAX_K, BY_ROUTER_MAX_E, BY_ROUTER_THREADS, BY_ROUTER_W_AHEAD: from the
// Python bounds the host checks (_router_defines), so kernel and checks cannot disagree.
struct alignas(16) by_vec16 { unsigned int w[4]; };
// Element j of a 16-byte vector of dtype (3: 4 float32; 8, 9: 8 bfloat16 / float16).
__device__ __forceinline__ float by_vec_at(const by_vec16& q, int j, int dtype) {
    if (dtype == 3) return __uint_as_float(q.w[j]);
    return by_half_to_float((unsigned short)(q.w[j >> 1] >> ((j & 1) * 16)), dtype);
}

// The vector path of the router kernel (NV elements per 16-byte vector; the host checked that x and
// w are 16-byte aligned, k <= BY_ROUTER_VEC_MAX_K and k, e multiples of NV, e / NV a power of two
// <= 32): every load is a 16-byte vector and a thread's loads are independent of each other, so
// the block waits about one memory latency per phase. smem: v[0:k), part[4096:8192), logits after.
template <int NV>
__device__ void by_router_vec(float* smem, const void* x, const void* w, int dtype, long long rows, long long k,
                              long long e, int mean, float inv_rows) {
    float* v = smem;
    float* part = smem + BY_ROUTER_VEC_MAX_K;
    float* logits = smem + 2 * BY_ROUTER_VEC_MAX_K;
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5, warps = BY_ROUTER_THREADS / 32;
    // w does not depend on x: a thread's first BY_ROUTER_W_AHEAD vectors of w are loaded before
    // the mean, so the two phases wait for memory once, not twice
    const long long total = k * e / NV;
    const by_vec16* wv = (const by_vec16*)w;
    by_vec16 ahead[BY_ROUTER_W_AHEAD];
#pragma unroll
    for (int p = 0; p < BY_ROUTER_W_AHEAD; ++p) {
        const long long q = t + (long long)p * BY_ROUTER_THREADS;
        if (q < total) ahead[p] = wv[q];
    }
    // mean: thread (cg, rg) sums rows rg, rg + R, ... of column group cg; part[rg * k + c]
    const long long groups = k / NV;
    const long long cgs = groups < BY_ROUTER_THREADS ? groups : BY_ROUTER_THREADS;
    const long long R = BY_ROUTER_THREADS / cgs, rg = t / cgs;  // R * k <= BY_ROUTER_VEC_MAX_K
    const by_vec16* xv = (const by_vec16*)x;
    if (rg < R) {
        for (long long cg = t % cgs; cg < groups; cg += cgs) {
            float acc[NV];
#pragma unroll
            for (int j = 0; j < NV; ++j) acc[j] = 0.f;
#pragma unroll 4
            for (long long r = rg; r < rows; r += R) {
                by_vec16 q = xv[r * groups + cg];
#pragma unroll
                for (int j = 0; j < NV; ++j) acc[j] += by_vec_at(q, j, dtype);
            }
#pragma unroll
            for (int j = 0; j < NV; ++j) part[rg * k + cg * NV + j] = acc[j];
        }
    }
    __syncthreads();
    for (long long c = t; c < k; c += BY_ROUTER_THREADS) {
        float s = 0.f;
        for (long long r = 0; r < R; ++r) s += part[r * k + c];
        v[c] = mean ? by_round(s * inv_rows, dtype) : s;
    }
    __syncthreads();
    // matvec: vector q of w is row (q * NV) / e, columns (q * NV) % e + [0, NV): the same columns
    // for every q a thread takes, (lane % m) * NV with m = e / NV
    float acc[NV];
#pragma unroll
    for (int j = 0; j < NV; ++j) acc[j] = 0.f;
#pragma unroll
    for (int p = 0; p < BY_ROUTER_W_AHEAD; ++p) {
        const long long q = t + (long long)p * BY_ROUTER_THREADS;
        if (q < total) {
            float vk = v[(q * NV) / e];
#pragma unroll
            for (int j = 0; j < NV; ++j) acc[j] += vk * by_vec_at(ahead[p], j, dtype);
        }
    }
#pragma unroll 4
    for (long long q = t + (long long)BY_ROUTER_W_AHEAD * BY_ROUTER_THREADS; q < total; q += BY_ROUTER_THREADS) {
        by_vec16 b = wv[q];
        float vk = v[(q * NV) / e];
#pragma unroll
        for (int j = 0; j < NV; ++j) acc[j] += vk * by_vec_at(b, j, dtype);
    }
    const int m = (int)(e / NV);
    for (int off = 16; off >= m; off >>= 1) {
#pragma unroll
        for (int j = 0; j < NV; ++j) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], off);
    }
    __syncthreads();  // part is reused
    if (lane < m) {
#pragma unroll
        for (int j = 0; j < NV; ++j) part[warp * e + lane * NV + j] = acc[j];
    }
    __syncthreads();
    for (long long j = t; j < e; j += BY_ROUTER_THREADS) {
        float s = 0.f;
        for (int wp = 0; wp < warps; ++wp) s += part[wp * e + j];
        logits[j] = by_round(s, dtype);
    }
}

// A router's switch index in ONE node (RouterLogits in Python), one block of BY_ROUTER_THREADS:
//   v = mean(x[0:rows, 0:k], 0) (mean) else x[0:k]           -- rounded to dtype
//   logits[j] = sum_c v[c] * w[c, j]  (w row-major k x e)     -- rounded to dtype
//   i = argmax(logits) (the first maximum; the first NaN wins), then the index steps.
// vec: the host checked the vector path's conditions (by_router_vec); else one element per load.
#define BY_ROUTER_PARAMS cudaGraphConditionalHandle hr, const void* x, const void* w, int rdtype, long long rows,   \
                         long long k, long long e, int mean, float inv_rows, int vec, int nsteps,                 \
                         int op0, long long a0, int op1, long long a1, int op2, long long a2, int op3,            \
                         long long a3, long long n
#define BY_ROUTER_ARGS hr, x, w, rdtype, rows, k, e, mean, inv_rows, vec, nsteps, op0, a0, op1, a1, op2, a2, op3, a3, n
__device__ void by_router_set(BY_ROUTER_PARAMS) {
    const cudaGraphConditionalHandle h = hr;
    const int dtype = rdtype;
    __shared__ float smem[BY_ROUTER_MAX_K + BY_ROUTER_MAX_E];
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5, warps = BY_ROUTER_THREADS / 32;
    float* logits;
    if (vec) {
        logits = smem + 2 * BY_ROUTER_VEC_MAX_K;
        if (dtype == 3) by_router_vec<4>(smem, x, w, dtype, rows, k, e, mean, inv_rows);
        else by_router_vec<8>(smem, x, w, dtype, rows, k, e, mean, inv_rows);
    } else {
        float* v = smem;
        logits = smem + BY_ROUTER_MAX_K;
        for (long long c = t; c < k; c += BY_ROUTER_THREADS) {
            float acc = 0.f;
#pragma unroll 8
            for (long long r = 0; r < rows; ++r) acc += by_load_f(x, r * k + c, dtype);
            v[c] = mean ? by_round(acc * inv_rows, dtype) : acc;
        }
        __syncthreads();
        for (long long j = warp; j < e; j += warps) {
            float acc = 0.f;
#pragma unroll 4
            for (long long c = lane; c < k; c += 32) acc += v[c] * by_load_f(w, c * e + j, dtype);
            for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
            if (lane == 0) logits[j] = by_round(acc, dtype);
        }
    }
    __syncthreads();
    if (t != 0) return;
    long long best = 0;
    float mx = logits[0];
    if (mx == mx) {
        for (long long j = 1; j < e; ++j) {
            float l = logits[j];
            if (l != l) { best = j; break; }
            if (l > mx) { mx = l; best = j; }
        }
    }
    const int ops[4] = {op0, op1, op2, op3};
    const long long as[4] = {a0, a1, a2, a3};
    by_steps_and_set(h, best, nsteps, ops, as, n);
}
extern "C" __global__ void branchyard_set_router(BY_ROUTER_PARAMS) {
    by_router_set(BY_ROUTER_ARGS);
}

// A loop trip's step AND the next trip's router index in ONE node (a switch index computed only
// from loop carries and loop invariants is known as soon as a trip's new carries are): the last
// block is branchyard_set_router's on the new carry (a copy's source, so it needs no copy to land
// first), the blocks before it are branchyard_step's. Blocks of BY_ROUTER_THREADS threads.
extern "C" __global__ void branchyard_step_router(BY_STEP_PARAMS, int ncopy, BY_COPY4_PARAMS, BY_ROUTER_PARAMS) {
    if (blockIdx.x == gridDim.x - 1) {
        by_router_set(BY_ROUTER_ARGS);
        return;
    }
    BY_COPY4_ON(ncopy, gridDim.x - 1);
    if (tid != 0) return;
    by_step_set(BY_STEP_ARGS);
}

// Switch as a chain of IF nodes: handle k of this launch is set to (clamp(index) == base + k).
extern "C" __global__ void branchyard_set_onehot(const void* index, int dtype, long long n, long long base, int count,
                                                 cudaGraphConditionalHandle h0, cudaGraphConditionalHandle h1,
                                                 cudaGraphConditionalHandle h2, cudaGraphConditionalHandle h3,
                                                 cudaGraphConditionalHandle h4, cudaGraphConditionalHandle h5,
                                                 cudaGraphConditionalHandle h6, cudaGraphConditionalHandle h7) {
    cudaGraphConditionalHandle h[8] = {h0, h1, h2, h3, h4, h5, h6, h7};
    long long i = by_load_int(index, dtype);
    i = i < 0 ? 0 : (i >= n ? n - 1 : i);
    for (int k = 0; k < count; ++k) cudaGraphSetConditional(h[k], i == base + k ? 1u : 0u);
}

// Up to four dense byte copies in ONE kernel node (cond/switch outputs no op could write in place).
extern "C" __global__ void branchyard_copy4(int count, BY_COPY4_PARAMS) {
    BY_COPY4(count);
}
"""

SET_KERNEL_NAMES = (
    "branchyard_step",
    "branchyard_set_program",
    "branchyard_set_router",
    "branchyard_step_router",
    "branchyard_set_onehot",
    "branchyard_copy4",
)


#: Largest ``K`` the router kernel's vector path takes (its shared memory holds 2 x this many floats).
ROUTER_VECTOR_MAX_K = 4096
#: Threads of the router set kernel's one block.
ROUTER_THREADS = 512
#: 16-byte vectors of ``w`` each thread of the vector path loads before the mean (registers).
ROUTER_W_AHEAD = 4


def _router_defines() -> str:
    """The router kernel's ``#define``s, from the bounds the host checks."""
    from branchyard.lowering.cuda_graph.patterns import MAX_ARGMAX_ELEMENTS, MAX_ROUTER_K

    return "".join(f"#define {name} {value}\n" for name, value in (
        ("BY_ROUTER_MAX_K", MAX_ROUTER_K), ("BY_ROUTER_VEC_MAX_K", ROUTER_VECTOR_MAX_K),
        ("BY_ROUTER_MAX_E", MAX_ARGMAX_ELEMENTS), ("BY_ROUTER_THREADS", ROUTER_THREADS),
        ("BY_ROUTER_W_AHEAD", ROUTER_W_AHEAD),
    ))


def _index_step_args(program: "IndexProgram") -> tuple[tuple[int, ...], tuple[Any, ...]]:
    """The set kernels' trailing ``nsteps, op0, a0, ..., op3, a3`` arguments for ``program``'s
    index steps (unused slots zero), and their ctypes.

        >>> from branchyard.lowering.cuda_graph.patterns import IndexProgram
        >>> _index_step_args(IndexProgram(torch.zeros((), dtype=torch.int64), True, (("max", -1), ("mod", 7))))[0]
        (2, 1, -1, 3, 7, 0, 0, 0, 0)
    """
    from branchyard.lowering.cuda_graph.patterns import INDEX_STEP_CODES, MAX_INDEX_STEPS

    values = [len(program.steps)]
    for op, a in program.steps:
        values += [INDEX_STEP_CODES[op], int(a)]
    values += [0, 0] * (MAX_INDEX_STEPS - len(program.steps))
    return tuple(values), (ctypes.c_int, *((ctypes.c_int, ctypes.c_longlong) * MAX_INDEX_STEPS))


def router_vector_path(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the router set kernel reads ``x`` (``(rows, K)`` or ``(K,)``) and ``w`` (``(K, E)``)
    as 16-byte vectors: both 16-byte aligned, ``K`` and ``E`` multiples of the vector's length
    ``n``, ``E / n`` a power of two up to 32 and ``K <= ROUTER_VECTOR_MAX_K`` (else one element a load).

        >>> import torch
        >>> router_vector_path(torch.empty(16, 1024, dtype=torch.bfloat16), torch.empty(1024, 8, dtype=torch.bfloat16))
        True
        >>> router_vector_path(torch.empty(16, 1024), torch.empty(1024, 6))
        False
    """
    n = 16 // x.element_size()
    k, e = w.shape
    m = e // n
    return (x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0 and k % n == 0 and e % n == 0
            and 0 < m <= 32 and m & (m - 1) == 0 and k <= ROUTER_VECTOR_MAX_K)


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
    """Compile :data:`SET_KERNEL_SOURCE`, after the router bounds' ``#define``s, with NVRTC
    for ``arch`` (e.g. ``"sm_90"``); returns a CUBIN.

    Needs only NVRTC, not a GPU, so it is testable on any machine with
    ``cuda-bindings`` and an NVRTC library.
    """
    from cuda.bindings import nvrtc

    source = _router_defines() + SET_KERNEL_SOURCE
    prog = _check(nvrtc.nvrtcCreateProgram(source.encode(), b"branchyard_set.cu", 0, [], []), "nvrtcCreateProgram")
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


@dataclass(frozen=True)
class TripCounter:
    """A loop's trip counter for ``max_iterations``: ``count`` (int64, 0-d) and the 0-d bool
    ``exhausted`` flag the step kernel sets when it stops a loop whose predicate still held."""

    count: torch.Tensor
    limit: int
    exhausted: torch.Tensor


class ConditionalBuilder:
    """Adds conditional nodes to whatever graph the current torch stream is capturing.

    One builder serves one capture. It keeps every side stream and every
    kernel argument alive until it is dropped, and records each conditional
    node's body graphs (for :func:`count_graph_nodes`).
    """

    def __init__(self, device: torch.device, side_streams: Sequence[torch.cuda.Stream] | None = None):
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
        # One side stream per nesting depth, made now (creating streams during a capture is unsafe),
        # and never from torch's stream pool, which hands the capture stream out again (guarded_capture).
        if side_streams is None:
            from branchyard.lowering.cuda_graph.guarded_capture import dedicated_streams

            side_streams = dedicated_streams(device, 1 + MAX_NESTING)[1:]
        self._streams: list[torch.cuda.Stream] = list(side_streams)
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

    def set_predicate(
        self,
        handles: tuple[Any, ...],
        pred: "torch.Tensor | Comparison",
        *,
        copies: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
        counter: "TripCounter | None" = None,
        reset: bool = False,
        increment: tuple[torch.Tensor, int] | None = None,
        next_index: "tuple[Any, IndexProgram, int] | None" = None,
    ) -> None:
        """Capture ONE step kernel: ``dst.copy_(src)`` for ``copies``, then ``handles[0] = pred``
        (and ``handles[1] = not pred`` for an IF pair).

        ``next_index=(h, program, n)``, ``program`` a router (:class:`~.patterns.RouterLogits`
        source) on tensors no copy writes: the same node also sets ``h`` as
        :meth:`set_from_program` would, in its own block (the loop's next switch index).

        ``pred`` is a 0-d bool tensor or a :class:`~.patterns.Comparison` the kernel
        evaluates itself. With a ``counter`` the trip is counted (``reset``: set to 0,
        the set before a WHILE node) and a predicate that holds at the limit stops the
        loop and sets the counter's ``exhausted`` flag. ``increment=(t, k)`` adds ``k``
        to the 0-d int64/int32 tensor ``t`` before the predicate is read. Copies that
        are not dense and same-layout, and all but the last four dense ones, go before it.
        """
        from branchyard.lowering.cuda_graph.patterns import COMPARE_CODES, DTYPE_CODES, Comparison

        dense = self._copy_rest(list(copies), keep_last=4)
        a = b = ia = ib = 0
        fa = fb = 0.0
        if isinstance(pred, Comparison):
            op, dtype = COMPARE_CODES[pred.op], DTYPE_CODES[pred.dtype]
            a = pred.lhs.data_ptr()
            if isinstance(pred.rhs, torch.Tensor):
                b = pred.rhs.data_ptr()
            elif pred.dtype.is_floating_point:
                fb = float(pred.rhs)
            else:
                ib = int(pred.rhs)
        else:
            self._check_scalar(pred, torch.bool)
            op, dtype, a = 0, 0, pred.data_ptr()
        count_ptr, limit, exhausted = 0, 0, 0
        if counter is not None:
            count_ptr, limit, exhausted = counter.count.data_ptr(), counter.limit, counter.exhausted.data_ptr()
        inc, inc_by, inc_dtype = 0, 0, 0
        if increment is not None:
            t, inc_by = increment
            if t.dtype not in (torch.int64, torch.int32) or t.dim() != 0 or not t.is_cuda:
                raise LoweringError(
                    f"the step kernel increments a 0-d int64/int32 CUDA tensor, got {t.dtype} of shape {tuple(t.shape)}",
                    where="loop counter",
                )
            inc, inc_dtype = t.data_ptr(), DTYPE_CODES[t.dtype]
        h_else = int(handles[1]) if len(handles) > 1 else 0
        args = (int(handles[0]), h_else, int(len(handles) > 1), op, dtype, a, b, ia, ib, fa, fb,
                count_ptr, limit, int(reset), exhausted, inc, int(inc_by), inc_dtype, *self._copy_args(dense))
        types = (ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                 ctypes.c_void_p, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_double, ctypes.c_double,
                 ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_void_p,
                 ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int) + self._COPY_TYPES
        if next_index is not None:
            r_args, r_types = self._router_args(*next_index)
            self._launch("branchyard_step_router", args + r_args, types + r_types,
                         grid=self._copy_blocks(dense, ROUTER_THREADS) + 1, block=ROUTER_THREADS)
        else:
            self._launch("branchyard_step", args, types, grid=self._copy_blocks(dense), block=256 if dense else 1)
        self._keepalive.append((pred, dense, counter, increment, next_index))

    def set_from_index(self, handle: Any, index: torch.Tensor, n: int) -> None:
        """Capture a set kernel: ``handle = clamp(index, 0, n - 1)`` (any integer dtype)."""
        from branchyard.lowering.cuda_graph.patterns import IndexProgram

        self.set_from_program(handle, IndexProgram(index), n)

    def set_from_program(self, handle: Any, program: "IndexProgram", n: int) -> None:
        """Capture ONE set kernel: ``handle = clamp(program, 0, n - 1)``, the program's
        argmax and steps computed by the kernel (see :class:`~.patterns.IndexProgram`)."""
        from branchyard.lowering.cuda_graph.patterns import (
            ARGMAX_DTYPE_CODES, MAX_ARGMAX_ELEMENTS, MAX_INDEX_STEPS, RouterLogits,
        )

        src = program.source
        if isinstance(src, RouterLogits):
            return self._set_from_router(handle, program, n)
        if program.argmax:
            code = ARGMAX_DTYPE_CODES.get(src.dtype)
            if code is None or not src.is_cuda or not src.is_contiguous() or not 0 < src.numel() <= MAX_ARGMAX_ELEMENTS:
                raise LoweringError(
                    f"the set kernel takes the argmax of a contiguous CUDA tensor of 1 to {MAX_ARGMAX_ELEMENTS} "
                    f"elements of {', '.join(str(d).removeprefix('torch.') for d in ARGMAX_DTYPE_CODES)}; got "
                    f"{src.dtype} of shape {tuple(src.shape)} on {src.device}",
                    where="switch index",
                )
        else:
            code = self._check_index(src)
        if len(program.steps) > MAX_INDEX_STEPS:
            raise LoweringError(f"the set kernel applies at most {MAX_INDEX_STEPS} index steps, got {len(program.steps)}",
                                where="switch index")
        step_args, step_types = _index_step_args(program)
        args = (int(handle), src.data_ptr(), code, src.numel(), int(program.argmax), *step_args, n)
        types = (ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_int,
                 *step_types, ctypes.c_longlong)
        self._launch("branchyard_set_program", args, types)
        self._keepalive.append(program)

    def _set_from_router(self, handle: Any, program: "IndexProgram", n: int) -> None:
        """Capture ONE router set kernel: ``handle = clamp(steps(argmax(logits)), 0, n - 1)``
        with the logits of ``program.source`` (a :class:`~.patterns.RouterLogits`)."""
        args, types = self._router_args(handle, program, n)
        self._launch("branchyard_set_router", args, types, block=ROUTER_THREADS)
        self._keepalive.append(program)

    def _router_args(self, handle: Any, program: "IndexProgram", n: int) -> tuple[tuple, tuple]:
        """The router kernels' trailing arguments and their ctypes; a LoweringError when
        ``program`` is not a router the kernel computes."""
        from branchyard.lowering.cuda_graph.patterns import (
            MAX_ARGMAX_ELEMENTS, MAX_INDEX_STEPS, MAX_ROUTER_ELEMENTS, MAX_ROUTER_K, ROUTER_DTYPE_CODES, RowMean,
        )

        r = program.source
        x, w = r.x, r.w
        k, e = (w.shape[0], w.shape[1]) if w.dim() == 2 else (0, 0)
        fits = (
            program.argmax and x.dtype in ROUTER_DTYPE_CODES and w.dtype == x.dtype and x.is_cuda and w.device == x.device
            and x.is_contiguous() and w.is_contiguous() and x.numel() == r.rows * k and 0 < k <= MAX_ROUTER_K
            and 0 < e <= MAX_ARGMAX_ELEMENTS and x.numel() + w.numel() <= MAX_ROUTER_ELEMENTS
            and len(program.steps) <= MAX_INDEX_STEPS
        )
        if not fits:
            raise LoweringError(
                f"the router set kernel takes argmax(mean(x, 0) @ w) of contiguous CUDA float tensors, w of shape (K, E) "
                f"with K <= {MAX_ROUTER_K}, E <= {MAX_ARGMAX_ELEMENTS} and at most {MAX_ROUTER_ELEMENTS} elements in all; "
                f"got x {x.dtype} {tuple(x.shape)} on {x.device}, w {w.dtype} {tuple(w.shape)}",
                where="switch index",
            )
        mean = isinstance(r.a, RowMean)
        step_args, step_types = _index_step_args(program)
        args = (int(handle), x.data_ptr(), w.data_ptr(), ROUTER_DTYPE_CODES[x.dtype], r.rows, k, e, int(mean),
                1.0 / r.rows, int(router_vector_path(x, w)), *step_args, n)
        types = (ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong,
                 ctypes.c_longlong, ctypes.c_longlong, ctypes.c_int, ctypes.c_float, ctypes.c_int,
                 *step_types, ctypes.c_longlong)
        return args, types

    def set_onehot(self, handles: list[Any], index: torch.Tensor, per_kernel: int = 8) -> None:
        """Capture set kernels: ``handles[k] = (clamp(index, 0, n - 1) == k)`` (switch as n IF nodes),
        ``per_kernel`` (1..8) handles to a kernel."""
        code = self._check_index(index)
        n = len(handles)
        types = (ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_int) + (ctypes.c_ulonglong,) * 8
        for base in range(0, n, per_kernel):
            chunk = [int(h) for h in handles[base : base + per_kernel]]
            args = (index.data_ptr(), code, n, base, len(chunk), *chunk, *([0] * (8 - len(chunk))))
            self._launch("branchyard_set_onehot", args, types)
        self._keepalive.append(index)

    _COPY_TYPES = (ctypes.c_int,) + (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_ulonglong) * 4

    def copy_many(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """``dst.copy_(src)`` for every pair, dense same-layout pairs four to a kernel node."""
        self._copy_rest(pairs, keep_last=0)

    def _copy_rest(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], keep_last: int) -> list:
        """Capture the copies of ``pairs`` except the last ``keep_last`` dense ones, which are returned."""
        dense, other = [], []
        for dst, src in pairs:
            same_layout = dst.dtype == src.dtype and dst.shape == src.shape and dst.stride() == src.stride()
            (dense if same_layout and dst.is_contiguous() and dst.is_cuda and src.is_cuda else other).append((dst, src))
        for dst, src in other:
            dst.copy_(src)
        split = len(dense) - min(keep_last, len(dense))
        for base in range(0, split, 4):
            chunk = dense[base : min(base + 4, split)]
            self._launch("branchyard_copy4", self._copy_args(chunk), self._COPY_TYPES, grid=self._copy_blocks(chunk), block=256)
            self._keepalive.append(chunk)
        return dense[split:]

    @staticmethod
    def _copy_args(chunk: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple:
        flat: list[int] = [len(chunk)]
        for dst, src in chunk:
            flat += [dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size()]
        return (*flat, *([0, 0, 0] * (4 - len(chunk))))

    @staticmethod
    def _copy_blocks(chunk: list[tuple[torch.Tensor, torch.Tensor]], threads: int = 256) -> int:
        largest = max((dst.numel() * dst.element_size() for dst, _ in chunk), default=0)
        return max(1, min(1024, (largest // 16 + threads - 1) // threads))  # one 16-byte vector per thread

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
            raise LoweringError(
                f"control flow nested deeper than {len(self._streams)} levels",
                where="conditional node body",
                hint="flatten nested conds with branchyard.passes.cond_to_switch",
            )
        side = self._streams[self._depth]
        stream = d.CUstream(side.cuda_stream)
        # Relaxed: the main capture (global mode) already forbids unsafe calls while it runs, and a
        # body capture left invalidated on a retired stream must not forbid them in this thread forever.
        mode = d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        if _takes_edge_data(d.cuStreamBeginCaptureToGraph):
            _check(d.cuStreamBeginCaptureToGraph(stream, body, None, None, 0, mode), "cuStreamBeginCaptureToGraph")
        else:
            _check(d.cuStreamBeginCaptureToGraph(stream, body, None, 0, mode), "cuStreamBeginCaptureToGraph")
        self._depth += 1
        try:
            with torch.cuda.stream(side):
                yield
        except BaseException:
            self._depth -= 1
            # End an active body capture so the stream is usable again; leave an invalidated one
            # to guarded_capture, which retires the stream (ending it can crash the driver).
            from branchyard.lowering.cuda_graph.guarded_capture import end_stray_capture

            end_stray_capture(side)
            raise
        self._depth -= 1
        _check(d.cuStreamEndCapture(stream), "cuStreamEndCapture (body graph)")

    def keep(self, value: Any) -> None:
        """Keep ``value`` (a tensor made inside a body) alive as long as the builder."""
        self._keepalive.append(value)

    @staticmethod
    def _check_index(t: torch.Tensor) -> int:
        from branchyard.lowering.cuda_graph.patterns import DTYPE_CODES

        code = DTYPE_CODES.get(t.dtype)
        if code is None or t.dtype.is_floating_point or t.numel() != 1 or not t.is_cuda:
            raise LoweringError(
                f"set kernel needs a one-element integer CUDA tensor, got {t.dtype} of shape {tuple(t.shape)} on {t.device}",
                where="switch index",
            )
        return code

    @staticmethod
    def _check_scalar(t: torch.Tensor, dtype: torch.dtype) -> None:
        if t.dtype != dtype or t.numel() != 1 or not t.is_cuda:
            raise LoweringError(
                f"set kernel needs a one-element {dtype} CUDA tensor, got {t.dtype} of shape {tuple(t.shape)} on {t.device}",
                where="conditional node",
            )
