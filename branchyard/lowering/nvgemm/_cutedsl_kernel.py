"""The CuTeDSL kernel behind :mod:`branchyard.lowering.nvgemm.cutedsl_gemm`.

Kept apart because its class body needs ``cutlass`` at definition time; the
class is built on first use by :func:`build_kernel_class`, so this module (like
its caller) imports on machines without CuTeDSL. Written for this project
against the CuTeDSL 4.x API (TMA atoms, wgmma tiled MMA, ``PipelineTmaAsync``);
the design notes are in ``docs/nvgemm_kernel.md``. What it builds the same way as
the persistent kernel (wgmma, rings, TMA atoms, the k-tile step, the sub-tile
store) is on :mod:`._cutedsl_common`'s ``GemmKernelBase``.

Per CTA (one ``tile_m x tile_n`` output tile)::

    warp 0:            TMA A[tile_m, 64], B[tile_n, 64] -> smem stage s   (ring of S stages)
    every warpgroup:   wait stage s full -> wgmma (4 x k16) -> release stage s-1
    after the K loop:  acc (fp32 regs) -> epilogue steps in regs -> cast
                       -> stmatrix to smem -> TMA store (clips ragged M/N)
"""


import functools
from typing import Any


@functools.lru_cache(maxsize=1)
def build_tile_class() -> type:
    """Import CuTeDSL and define :class:`FusedGemmKernel` (cached)."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    import cutlass.utils as utils
    import cutlass.utils.hopper_helpers as sm90

    from branchyard.lowering.nvgemm._cutedsl_common import build_base_class
    from branchyard.lowering.nvgemm._cutedsl_epilogue import apply_steps
    from branchyard.lowering.nvgemm.kernel_config import TILE_K

    class FusedGemmKernel(build_base_class()):
        """``out = epilogue(A @ B^T)`` with A (M, K), B (N, K), out (M, N); see module doc."""

        def __init__(self, steps: tuple, config: Any, types: dict) -> None:
            super().__init__(steps, config, types)
            self.cluster_mn = (config.cluster_m, config.cluster_n)
            self.atom_layout = (config.warpgroups, 1, 1)
            self.threads = config.threads
            self.epi_tile = config.epi_tile
            # Index of the [M, N] operand brought in by TMA (the first one), if any.
            mats = [s.index for s in steps if s.operand == "matrix"]
            # It lands in the B ring: stages * tile_n * 64 elements must hold tile_m * tile_n.
            fits = config.ab_stages() * TILE_K >= config.tile_m
            self.tma_mat = mats[0] if config.residual_tma and mats and fits else None

        # ------------------------------------------------------------------ host
        @cute.jit
        def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, operands: tuple, stream):
            ab_dtype = mA.element_type
            c_dtype = mC.element_type
            c_layout = utils.LayoutEnum.from_tensor(mC)
            tiled_mma = self._tiled_mma(mA, mB, self.atom_layout)
            stages = self.config.ab_stages(ab_dtype.width // 8)
            sA_layout, sB_layout = self._ab_smem_layouts(mA, mB, stages)
            sC_layout = sm90.make_smem_layout_epi(c_dtype, c_layout, self.epi_tile, 4)

            # TMA loads: multicast A across the cluster's N extent, B across its M extent.
            mcast_a, mcast_b = self.cluster_mn[1], self.cluster_mn[0]
            tma_a, gA = self._tma_load(mA, sA_layout, (self.tile_mnk[0], self.tile_mnk[2]), mcast_a)
            tma_b, gB = self._tma_load(mB, sB_layout, (self.tile_mnk[1], self.tile_mnk[2]), mcast_b)
            tma_c, gC = self._tma_store(mC, sC_layout, self.epi_tile)

            # Residual by TMA: the first [M, N] operand is brought into shared memory
            # (aliasing the B ring, free once the K loop is done) with one bulk copy
            # instead of per-element global gathers.
            tma_r, gR, sR_layout = tma_c, gC, sC_layout  # placeholders when unused
            if cutlass.const_expr(self.tma_mat is not None):
                mR = operands[self.tma_mat]
                sR_layout = sm90.make_smem_layout_epi(
                    mR.element_type, utils.LayoutEnum.from_tensor(mR), (self.tile_mnk[0], self.tile_mnk[1]), 1
                )
                tma_r, gR = self._tma_load(mR, sR_layout, (self.tile_mnk[0], self.tile_mnk[1]), 1)
                self.r_dtype = mR.element_type
                self.r_bytes = cute.size_in_bytes(mR.element_type, cute.slice_(sR_layout, (None, None, 0)))

            tiles_m = (mC.shape[0] + self.tile_mnk[0] - 1) // self.tile_mnk[0]
            tiles_n = (mC.shape[1] + self.tile_mnk[1] - 1) // self.tile_mnk[1]
            cm, cn = self.cluster_mn
            grid = ((tiles_m + cm - 1) // cm * cm, (tiles_n + cn - 1) // cn * cn, 1)

            @cute.struct
            class Storage:
                full_empty: cute.struct.MemRange[cutlass.Int64, stages * 2]
                res_full: cute.struct.MemRange[cutlass.Int64, 1]
                sA: cute.struct.Align[cute.struct.MemRange[ab_dtype, cute.cosize(sA_layout)], 1024]
                sB: cute.struct.Align[cute.struct.MemRange[ab_dtype, cute.cosize(sB_layout)], 1024]
                sC: cute.struct.Align[cute.struct.MemRange[c_dtype, cute.cosize(sC_layout)], 1024]

            self._keep_for_kernel(Storage, ab_dtype, stages, c_layout)
            self.kernel(
                tma_a, gA, tma_b, gB, tma_c, gC, mC, operands, tiled_mma, sA_layout, sB_layout, sC_layout,
                tma_r, gR, sR_layout,
            ).launch(
                grid=grid,
                block=[self.threads, 1, 1],
                cluster=(*self.cluster_mn, 1),
                stream=stream,
            )

        # ---------------------------------------------------------------- device
        @cute.kernel
        def kernel(
            self,
            tma_a: cute.CopyAtom,
            gA_full: cute.Tensor,
            tma_b: cute.CopyAtom,
            gB_full: cute.Tensor,
            tma_c: cute.CopyAtom,
            gC_full: cute.Tensor,
            mC: cute.Tensor,
            operands: tuple,
            tiled_mma: cute.TiledMma,
            sA_layout: cute.ComposedLayout,
            sB_layout: cute.ComposedLayout,
            sC_layout: cute.ComposedLayout,
            tma_r: cute.CopyAtom,
            gR_full: cute.Tensor,
            sR_layout: cute.ComposedLayout,
        ):
            tidx, _, _ = cute.arch.thread_idx()
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            if warp_idx == 0:
                cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
                cute.nvgpu.cpasync.prefetch_descriptor(tma_b)

            # ---- which tile: grouped raster over clusters, so that the CTAs that
            # run together read the same B columns from L2.
            cidx, cidy, _ = cute.arch.cluster_idx()
            cdimx, cdimy, _ = cute.arch.cluster_dim()
            cluster_id = cidx + cdimx * cidy
            group = self.config.raster_group
            per_group = group * cdimy
            first_m = (cluster_id // per_group) * group
            group_rows = cutlass.min(group, cdimx - first_m)
            within = cluster_id % per_group
            cl_m = first_m + within % group_rows
            cl_n = within // group_rows
            in_cluster = cute.arch.block_in_cluster_idx()
            tile_m = cl_m * self.cluster_mn[0] + in_cluster[0]
            tile_n = cl_n * self.cluster_mn[1] + in_cluster[1]
            tile_coord = (tile_m, tile_n, None)

            cta_layout = cute.make_layout((*self.cluster_mn, 1))
            cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            cta_coord = cta_layout.get_flat_coord(cta_rank)
            mask_a = cute.make_layout_image_mask(cta_layout, cta_coord, mode=1)
            mask_b = cute.make_layout_image_mask(cta_layout, cta_coord, mode=0)
            if cutlass.const_expr(self.cluster_mn[1] == 1):
                mask_a = 0
            if cutlass.const_expr(self.cluster_mn[0] == 1):
                mask_b = 0

            # ---- shared memory and the full/empty mbarrier ring
            storage, sA, sB, sC = self._allocate_smem(sA_layout, sB_layout, sC_layout)
            # Each consumer warp releases a stage to every CTA that multicast into it.
            mcast_peers = self.cluster_mn[0] + self.cluster_mn[1] - 1
            ring = self._ab_ring(storage, sA_layout, sB_layout, cta_layout, mcast_peers * (self.threads // 32))
            res_bar = storage.res_full.data_ptr()
            if cutlass.const_expr(self.tma_mat is not None):
                if warp_idx == 0:
                    cute.nvgpu.cpasync.prefetch_descriptor(tma_r)
                    with cute.arch.elect_one():
                        cute.arch.mbarrier_init(res_bar, 1)
            pipeline.pipeline_init_arrive(cluster_shape_mn=self.cluster_mn, is_relaxed=True)

            # ---- global tiles and their TMA / MMA partitions
            gA = cute.local_tile(gA_full, self.tile_mnk, tile_coord, proj=(1, None, 1))  # (bM, bK, k)
            gB = cute.local_tile(gB_full, self.tile_mnk, tile_coord, proj=(None, 1, 1))  # (bN, bK, k)
            gC = cute.local_tile(gC_full, self.tile_mnk, tile_coord, proj=(1, 1, None))  # (bM, bN)
            tAsA, tAgA = self._tma_partition_multicast(tma_a, sA, gA, cta_layout, cta_coord, 1)
            tBsB, tBgB = self._tma_partition_multicast(tma_b, sB, gB, cta_layout, cta_coord, 0)
            wg = cute.arch.make_warp_uniform(tidx // 128)
            thr_mma = tiled_mma.get_slice(cute.make_layout(self.config.warpgroups, stride=128)(wg))
            tCrA, tCrB = self._mma_fragments(tiled_mma, thr_mma, sA, sB)
            tCgC = thr_mma.partition_C(gC)
            acc = cute.make_rmem_tensor(tCgC.shape, self.acc_dtype)

            pipeline.pipeline_init_wait(cluster_shape_mn=self.cluster_mn)

            # ---- main loop: warp 0 keeps the ring full, all warpgroups multiply.
            k_tiles = cute.size(gA, mode=[2])
            produce = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
            if warp_idx == 0:
                for _ in cutlass.range(cutlass.min(self.stages, k_tiles), unroll=1):
                    self._load_stage(ring, produce, tma_a, tAgA, tAsA, mask_a, tma_b, tBgB, tBsB, mask_b)
                    produce.advance()

            read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            # Zeroed accumulators + always-accumulate: the traced loop body is the
            # same for every k-tile (no peeled first iteration needed).
            acc.fill(0.0)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            for kt in cutlass.range(k_tiles, unroll=1):
                release, read = self._mma_k_tile(tiled_mma, acc, tCrA, tCrB, ring, read, release, kt)
                # Refill only the stage released just above: producing before the
                # first release would make warp 0 wait on an empty barrier that
                # needs its own (not yet sent) consumer arrival -- a deadlock.
                if warp_idx == 0 and kt > 0 and produce.count < k_tiles:
                    self._load_stage(ring, produce, tma_a, tAgA, tAsA, mask_a, tma_b, tBgB, tBsB, mask_b)
                    produce.advance()
            cute.nvgpu.warpgroup.wait_group(0)
            if k_tiles > 0:
                ring.consumer_release(release)

            self._cluster_exit_sync(self.cluster_mn[0] * self.cluster_mn[1])

            # ---- residual tile -> shared memory (one TMA copy; out-of-range rows read as 0)
            sR = None
            if cutlass.const_expr(self.tma_mat is not None):
                # Every warpgroup's last wgmma has read the ring before TMA overwrites it.
                cute.arch.sync_threads()
                sR_staged = cute.make_tensor(
                    cute.recast_ptr(sB.iterator, sR_layout.inner, dtype=self.r_dtype), sR_layout.outer
                )
                gR = cute.local_tile(gR_full, self.tile_mnk, tile_coord, proj=(1, 1, None))
                tRsR, tRgR = cute.nvgpu.cpasync.tma_partition(
                    tma_r,
                    0,
                    cute.make_layout(1),
                    cute.group_modes(sR_staged, 0, 2),
                    cute.zipped_divide(gR, (self.tile_mnk[0], self.tile_mnk[1])),
                )
                if warp_idx == 0:
                    with cute.arch.elect_one():
                        cute.arch.mbarrier_arrive_and_expect_tx(res_bar, self.r_bytes)
                    cute.copy(tma_r, tRgR[(None, 0)], tRsR[(None, 0)], tma_bar_ptr=res_bar)
                cute.arch.mbarrier_wait(res_bar, 0)
                sR = sR_staged[(None, None, 0)]

            # ---- epilogue in registers
            if cutlass.const_expr(len(self.steps) > 0):
                # Per-thread slice: thr_mma (sliced per warpgroup, as wgmma wants for A/B)
                # would give every thread the coordinates of its warpgroup's thread 0.
                thr_c = tiled_mma.get_slice(tidx)
                coords = thr_c.partition_C(
                    cute.local_tile(cute.make_identity_tensor(mC.shape), self.tile_mnk, tile_coord, proj=(1, 1, None))
                )
                local = thr_c.partition_C(cute.make_identity_tensor((self.tile_mnk[0], self.tile_mnk[1])))
                apply_steps(self.steps, self.tma_mat, acc, coords, local, sR, operands, mC.shape[0] - 1, mC.shape[1] - 1)

            # ---- cast, registers -> smem (stmatrix) -> global (TMA), one epi sub-tile at a time
            c_dtype = mC.element_type
            _, r2s, tRS_sC, tRS_acc, sub_layout, sub, sub_size = self._stmatrix_store(tiled_mma, sC, acc, c_dtype, tidx)
            gC_epi = cute.zipped_divide(gC, self.epi_tile)
            bSG_sC, bSG_gC = cute.nvgpu.cpasync.tma_partition(
                tma_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), gC_epi
            )
            n_sub = cute.size(gC_epi, mode=[1])
            sub_grid = gC_epi.shape[1]
            sub_order = cute.make_layout(sub_grid, stride=(sub_grid[1], 1))
            store_ring = pipeline.PipelineTmaStore.create(
                num_stages=4, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.threads)
            )
            for s in cutlass.range_constexpr(n_sub):
                for v in cutlass.range_constexpr(sub_size):
                    sub[v] = tRS_acc[s * sub_size + v]
                self._store_sub_tile(
                    sub, sub_layout, c_dtype, r2s, tRS_sC, s % 4, tma_c, bSG_sC, bSG_gC, sub_order.get_hier_coord(s),
                    store_ring, leader=warp_idx == 0, barrier_id=1, barrier_threads=None,
                )
            if warp_idx == 0:
                store_ring.producer_tail()

        def _load_stage(self, ring, state, tma_a, tAgA, tAsA, mask_a, tma_b, tBgB, tBsB, mask_b):
            ring.producer_acquire(state)
            bar = ring.producer_get_barrier(state)
            cute.copy(tma_a, tAgA[(None, state.count)], tAsA[(None, state.index)], tma_bar_ptr=bar, mcast_mask=mask_a)
            cute.copy(tma_b, tBgB[(None, state.count)], tBsB[(None, state.index)], tma_bar_ptr=bar, mcast_mask=mask_b)
            ring.producer_commit(state)

    return FusedGemmKernel
