"""The small-M CuTeDSL kernel: ``out = epilogue(A @ W^T)`` for M <= 64, where
the time is the weight's bytes over HBM bandwidth (chosen by
:class:`~.kernel_config.GemvConfig`; compiled and launched by :mod:`.cutedsl_gemm`).

No TMA, no shared-memory ring: every warp streams weight rows straight from
global memory into registers with 16-byte loads and multiplies them on the
tensor cores with warp-level ``mma.sync`` m16n8k16, the weight as the MMA's
16-row operand and the input's rows as its 8 columns ("swap AB": the MMA's M is
our N, so M = 1..8 wastes nothing on the weight side). Per CTA::

    rows = 16 weight rows (output columns n0 .. n0+15),  m rows m0 .. m0+m_block-1 of A
    warp w:   for step in w, w + warps, ... < K / 64:          # the warps split K
                  lane (g, t) = (lane // 4, lane % 4) loads 2 x 16 bytes of weight rows
                  g and g+8 and of input rows m0+g (+8, ...): K chunks 8t and 32+8t of the step
                  4 MMAs (k16 each) per 8 input rows into fp32 accumulators
    all warps: accumulators -> shared memory; warp 0 sums them, runs the epilogue
               steps (``_cutedsl_epilogue.apply_steps``, every table row) and stores

With ``GemvConfig.unroll = U > 1`` a warp takes its steps U at a time: the
loads of steps ``s, s + warps, .., s + (U-1) warps`` into U register buffers
first, then their MMAs, so U x 2 KiB of weight per warp are in flight instead
of 2 KiB (a memory-bound kernel's rate is its bytes in flight over the DRAM
latency, and the 16-byte loads land in registers, so only more buffers raise
it). The steps left over when a warp's count is not a multiple of U run one
at a time, as with U = 1::

    for s in range(w, K/64 - (U-1) warps, U warps):   loads of U steps; MMAs of U steps
    for s in range(rest, K/64, warps):               one step (U = 1's loop)

With ``GemvConfig.rows = 32`` a CTA owns two 16-row weight tiles (output
columns n0 .. n0+31): a lane loads rows g, g+8, g+16, g+24, and each input
fragment it loads feeds both tiles' MMAs, so the input bytes per weight byte
halve (at M = 16 they equal the weight's otherwise).

With ``GemvConfig.dual`` (a chain with a ``mul_mm`` step, ``act(a @ B^T) *
(a @ W^T)``, a GLU's gate and up) the two tiles are rows n0 .. n0+15 of B and
of the second weight W (the step's operand): the CTA owns 16 output columns,
each input fragment feeds both weights' MMAs, and warp 0's reduction hands the
W tile's sums to the step as its operand::

    acc_b, acc_w = a @ B[n0:n0+16]^T, a @ W[n0:n0+16]^T      # one pass over K
    out = epilogue(acc_b)  with  mul_mm's operand = acc_w   # steps as the table says

Which K a lane's register holds need not be the K the MMA "thinks" it is: a
dot product is the same in any order of K, as long as both operands use the
same order. The MMA pairs A's and B's k-slots 2t, 2t+1, 2t+8, 2t+9 inside lane
group t, so each lane puts the 16 weight elements it loaded for a row and the
16 input elements it loaded for a row in the same slots (element ``e`` of the
lane's two chunks goes to k-slot ``s = e % 4`` of MMA ``e // 4``); the loads
stay 16 bytes wide and 64 bytes contiguous per row and instruction.

Fragment value order (PTX ``mma.m16n8k16``, CuTe's SM80 layouts): A value
``v0 + 2 v1 + 4 v2`` is row ``g + 8 v1``, k-slot ``2t + v0 + 8 v2``; B value
``w0 + 2 w1`` is column ``g``, k-slot ``2t + w0 + 8 w1``; C value ``c0 + 2 c1``
is row ``g + 8 c1``, column ``2t + c0``.

Rows of A past M are read clamped to the last row (in bounds) and never
stored. Built on first use (its class body needs ``cutlass``), so this module
imports without CuTeDSL.
"""

import functools
from typing import Any, NamedTuple

#: Elements per 16-byte chunk; a lane loads chunks ``t`` and ``t + 4`` of each 64-wide K step.
CHUNK = 8


class Placement(NamedTuple):
    """Where one loaded element goes: MMA ``kk`` (of the step's four k16 MMAs), its
    k-slot ``s`` (0..3 within the lane: k-slots 2t, 2t+1, 2t+8, 2t+9), taken from
    chunk ``c`` at offset ``off``; ``a_lo`` / ``a_hi`` are the A-fragment indices of
    weight rows g and g + 8, ``s`` itself the B-fragment index."""

    kk: int
    s: int
    c: int
    off: int
    a_lo: int
    a_hi: int


def placements() -> tuple[Placement, ...]:
    """Element ``e = 4 kk + s`` of the lane's 16 (two chunks) -> MMA ``kk``, slot ``s``.

    A value ``v0 + 2 v1 + 4 v2`` holds k-slot ``2t + v0 + 8 v2`` of row ``g + 8 v1``;
    B value ``w0 + 2 w1`` holds k-slot ``2t + w0 + 8 w1``: slot ``s = v0 + 2 v2 = w0 + 2 w1``.

        >>> placements()[5]
        Placement(kk=1, s=1, c=0, off=5, a_lo=1, a_hi=3)
    """
    out = []
    for kk in range(4):
        for s in range(4):
            e = 4 * kk + s
            v0, v2 = s % 2, s // 2
            out.append(Placement(kk, s, e // CHUNK, e % CHUNK, v0 + 4 * v2, v0 + 2 + 4 * v2))
    return tuple(out)


def accumulator_coords(v: int, g: Any, t: Any) -> tuple[Any, Any]:
    """(input row within the MMA's 8, weight row within the 16) of accumulator value ``v``
    of lane ``(g, t)``: C value ``c0 + 2 c1`` is MMA row ``g + 8 c1`` (a weight row, i.e.
    an output column) and MMA column ``2t + c0`` (an input row).

        >>> [accumulator_coords(v, 1, 2) for v in range(4)]
        [(4, 1), (5, 1), (4, 9), (5, 9)]
    """
    return 2 * t + v % 2, g + 8 * (v // 2)


def unrolled_bounds(warp: Any, k_steps: Any, warps: int, unroll: int, max_: Any = max) -> tuple[Any, Any]:
    """``(group_stop, rest_start)`` of warp ``warp``'s two K loops at ``unroll > 1``:
    groups ``s, s + warps, .., s + (unroll-1) warps`` for ``s`` in
    ``range(warp, group_stop, unroll * warps)`` (each group wholly below ``k_steps``),
    then single steps ``range(rest_start, k_steps, warps)``. Together they are the
    steps ``warp, warp + warps, ..`` below ``k_steps``, each once. The kernel passes
    DSL integers and ``cutlass.max``.

        >>> unrolled_bounds(3, 21, 4, 2)   # groups at 3, 11; then step 19
        (17, 19)
    """
    group = unroll * warps
    group_stop = k_steps - (unroll - 1) * warps
    groups = (max_(group_stop - warp, 0) + group - 1) // group
    return group_stop, warp + groups * group


@functools.lru_cache(maxsize=1)
def build_gemv_class() -> type:
    """Import CuTeDSL and define :class:`SmallMGemvKernel` (cached)."""
    import cutlass
    import cutlass.cute as cute

    from branchyard.lowering.nvgemm._cutedsl_epilogue import apply_steps
    from branchyard.lowering.nvgemm.kernel_config import GEMV_K_STEP, GEMV_ROWS

    chunk = CHUNK
    chunks_per_step = GEMV_K_STEP // chunk
    places = placements()

    class SmallMGemvKernel:
        """``out = epilogue(A @ B^T)`` with A (M, K), B (N, K) row-major, out (M, N); see module doc."""

        def __init__(self, steps: tuple, config: Any, types: dict) -> None:
            self.steps = steps
            self.config = config
            self.types = types
            self.warps = config.warps
            self.m_block = config.m_block
            self.unroll = config.unroll
            self.n_mma = config.m_block // 8  # MMAs (8 input rows each) per k16 step
            self.tiles = config.tiles  # 16-row weight tiles per CTA (MMAs per input block)
            self.n_acc = self.tiles * self.n_mma  # accumulator fragments: acc[tile * n_mma + j]
            # dual: tile 1 is rows of the second weight, operands[second], at tile 0's output columns.
            self.dual = config.dual
            self.second = next((s.index for s in steps if s.operand == "weight"), None)
            self.cta_rows = GEMV_ROWS if self.dual else GEMV_ROWS * self.tiles  # output columns per CTA

        # ------------------------------------------------------------------ host
        @cute.jit
        def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, operands: tuple, stream):
            op = cute.nvgpu.warp.MmaF16BF16Op(mA.element_type, cutlass.Float32, (16, 8, 16))
            tiled_mma = cute.make_tiled_mma(op)
            row_groups = mB.shape[0] // self.cta_rows
            m_groups = (mC.shape[0] + self.m_block - 1) // self.m_block
            # U > 1: ``.minnctapersm 1`` -- without it ptxas, aiming at a higher occupancy, sinks
            # the later steps' loads below the first step's MMAs, and one step is in flight again.
            self.kernel(mA, mB, mC, operands, tiled_mma).launch(
                grid=(row_groups, m_groups, 1),
                block=[32 * self.warps, 1, 1],
                stream=stream,
                min_blocks_per_mp=1 if self.unroll > 1 else 0,
            )

        # ---------------------------------------------------------------- device
        @cute.kernel
        def kernel(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, operands: tuple, tiled_mma: cute.TiledMma):
            # Loop bodies and branches live in helper methods: the tracer carries loop and
            # branch state through the kernel's own locals only, and these helpers' Python
            # lists and ints must not become that state.
            bidx, bidy, _ = cute.arch.block_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            lane = cute.arch.lane_idx()
            g = lane // 4
            t = lane % 4
            m_last = mC.shape[0] - 1
            row0 = bidx * self.cta_rows
            m0 = bidy * self.m_block

            smem = cutlass.utils.SmemAllocator()
            # One slot per (lane, accumulator, warp): lane fastest, so the writes do not conflict.
            partial = smem.allocate_tensor(cutlass.Float32, cute.make_layout((32, 4 * self.n_acc, self.warps)), 16)

            ab = mA.element_type
            # Register fragments as plain compact tensors of the MMA's partition shapes
            # (((2, 2, 2), 1, 1) for A, ((2, 2), 1, 1) for B and C): flat index = PTX register order.
            acc_shape = tiled_mma.partition_shape_C((16, 8))
            a_shape = tiled_mma.partition_shape_A((16, 16))
            b_shape = tiled_mma.partition_shape_B((8, 16))
            acc = [cute.make_rmem_tensor(acc_shape, cutlass.Float32) for _ in range(self.n_acc)]
            a_frag = [[cute.make_rmem_tensor(a_shape, ab) for _ in range(4)] for _ in range(self.tiles)]
            b_frag = [[cute.make_rmem_tensor(b_shape, ab) for _ in range(4)] for _ in range(self.n_mma)]
            # w_bufs[u][4 * tile + 2 * half + c]: weight row 16 tile + g + 8 half, chunk c (0: 8t,
            # 1: 32 + 8t) of the u-th step in flight; x_bufs[u][j][c]: input rows m0 + 8 j + g, chunk c.
            w_bufs = [[cute.make_rmem_tensor((1, chunk), ab) for _ in range(4 * self.tiles)]
                      for _ in range(self.unroll)]
            x_bufs = [[[cute.make_rmem_tensor((1, chunk), ab) for _ in range(2)] for _ in range(self.n_mma)]
                      for _ in range(self.unroll)]
            tile_step = 0 if self.dual else GEMV_ROWS  # dual: both tiles at the same rows of their weights
            w_rows = [row0 + tile_step * i + g + 8 * half for i in range(self.tiles) for half in range(2)]
            srcs = [mB, operands[self.second]] if self.dual else [mB] * self.tiles
            x_rows = [cutlass.min(m0 + 8 * i + g, m_last) for i in range(self.n_mma)]
            self._zero(acc)

            k_steps = mA.shape[1] // GEMV_K_STEP
            if cutlass.const_expr(self.unroll == 1):
                for step in cutlass.range(warp, k_steps, self.warps, unroll=2):
                    self._k_step(mA, srcs, tiled_mma, acc, a_frag, b_frag, w_bufs[0], x_bufs[0], w_rows, x_rows,
                                 step, t)
            else:
                group_stop, rest_start = unrolled_bounds(warp, k_steps, self.warps, self.unroll, cutlass.max)
                for step in cutlass.range(warp, group_stop, self.unroll * self.warps, unroll=1):
                    self._k_group(mA, srcs, tiled_mma, acc, a_frag, b_frag, w_bufs, x_bufs, w_rows, x_rows, step, t)
                for step in cutlass.range(rest_start, k_steps, self.warps, unroll=1):
                    self._k_step(mA, srcs, tiled_mma, acc, a_frag, b_frag, w_bufs[0], x_bufs[0], w_rows, x_rows,
                                 step, t)

            self._stash(partial, acc, lane, warp)
            cute.arch.sync_threads()
            if warp == 0:
                self._reduce_and_store(partial, mC, operands, lane, g, t, row0, m0)

        def _zero(self, acc):
            for frag in acc:
                frag.fill(0.0)

        def _k_step(self, mA, srcs, tiled_mma, acc, a_frag, b_frag, w_buf, x_buf, w_rows, x_rows, step, t):
            """One 64-wide K step of this warp: 16-byte loads of two weight rows and the
            input rows, placed into the MMA fragments (see the module doc), 4 x n_mma MMAs."""
            self._load(mA, srcs, w_buf, x_buf, w_rows, x_rows, step, t)
            self._mma(tiled_mma, acc, a_frag, b_frag, w_buf, x_buf)

        def _k_group(self, mA, srcs, tiled_mma, acc, a_frag, b_frag, w_bufs, x_bufs, w_rows, x_rows, step, t):
            """Steps ``step + u * warps`` for u < unroll: every step's loads first (all in
            flight together), then every step's MMAs."""
            for u in range(self.unroll):
                self._load(mA, srcs, w_bufs[u], x_bufs[u], w_rows, x_rows, step + u * self.warps, t)
            for u in range(self.unroll):
                self._mma(tiled_mma, acc, a_frag, b_frag, w_bufs[u], x_bufs[u])

        def _load(self, mA, srcs, w_buf, x_buf, w_rows, x_rows, step, t):
            """The 16-byte loads of one K step: chunks 8t and 32 + 8t of weight rows g, g + 8
            (of tile i's weight, ``srcs[i]``) and of the input rows."""
            first = step * chunks_per_step + t
            for c in range(2):
                col = first + 4 * c
                for i in range(self.tiles):
                    for half in range(2):
                        cute.autovec_copy(cute.local_tile(srcs[i], (1, chunk), (w_rows[2 * i + half], col)),
                                          w_buf[4 * i + 2 * half + c])
                for j in range(self.n_mma):
                    cute.autovec_copy(cute.local_tile(mA, (1, chunk), (x_rows[j], col)), x_buf[j][c])

        def _mma(self, tiled_mma, acc, a_frag, b_frag, w_buf, x_buf):
            """One loaded step into the fragments (see the module doc) and its 4 x n_mma MMAs."""
            for p in places:
                for i in range(self.tiles):
                    a_frag[i][p.kk][p.a_lo] = w_buf[4 * i + p.c][p.off]  # weight row 16 i + g
                    a_frag[i][p.kk][p.a_hi] = w_buf[4 * i + 2 + p.c][p.off]  # weight row 16 i + g + 8
                for j in range(self.n_mma):
                    b_frag[j][p.kk][p.s] = x_buf[j][p.c][p.off]
            for kk in range(4):
                for i in range(self.tiles):
                    for j in range(self.n_mma):
                        a = i * self.n_mma + j
                        cute.gemm(tiled_mma, acc[a], a_frag[i][kk][None, None, 0], b_frag[j][kk][None, None, 0],
                                  acc[a])

        def _stash(self, partial, acc, lane, warp):
            for a in range(self.n_acc):
                for v in range(4):
                    partial[lane, 4 * a + v, warp] = acc[a][v]

        def _reduce_and_store(self, partial, mC, operands, lane, g, t, row0, m0):
            """Warp 0: sum the warps' partial accumulators, run the epilogue, store the rows below M.
            Dual: tile 1's sums are the ``mul_mm`` step's operand (same coordinates as tile 0's)."""
            m_last = mC.shape[0] - 1
            n_last = mC.shape[1] - 1
            out_tiles = 1 if self.dual else self.tiles
            size = 4 * out_tiles * self.n_mma
            vals = cute.make_rmem_tensor((size,), cutlass.Float32)
            prod = cute.make_rmem_tensor((size,), cutlass.Float32) if self.dual else None
            coords = []
            for a in range(self.n_acc):
                tile, j = divmod(a, self.n_mma)
                dest, base = (prod, 4 * (a - self.n_mma)) if tile >= out_tiles else (vals, 4 * a)
                for v in range(4):
                    total = partial[lane, 4 * a + v, 0]
                    for w in range(1, self.warps):
                        total = total + partial[lane, 4 * a + v, w]
                    dest[base + v] = total
                    if tile < out_tiles:
                        row, col = accumulator_coords(v, g, t)
                        coords.append((m0 + 8 * j + row, row0 + GEMV_ROWS * tile + col))
            if len(self.steps) > 0:
                products = {self.second: prod} if self.dual else None
                apply_steps(self.steps, None, vals, coords, None, None, operands, m_last, n_last, products)
            for i in range(size):
                row, col = coords[i]
                self._store(mC, vals[i], row, col, m_last)

        @cute.jit
        def _store(self, mC: Any, value: Any, row: Any, col: Any, m_last: Any):
            if row <= m_last:
                mC[row, col] = value.to(mC.element_type)

    return SmallMGemvKernel
