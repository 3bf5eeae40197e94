"""The persistent, warp-specialised ("ping-pong") variant of our CuTeDSL GEMM.

Chosen by ``GemmConfig(persistent=True)``; same contract and epilogue as
the one-tile-per-CTA kernel of :mod:`._cutedsl_kernel` (whose class is defined on
first use for the same reason: the class body needs ``cutlass``), and built on
the same :mod:`._cutedsl_common` base. Design notes and figures:
``docs/nvgemm_kernel.md``.

One CTA per SM (a grid of #SMs CTAs, in clusters of ``cluster_m``) walks the
output tiles ``cta, cta + #CTAs, cta + 2 #CTAs, ...`` (grouped raster), with
three warpgroups::

    WG 0 (40 regs)    warp 0: TMA A/B k-tiles of every tile of this CTA, in tile order,
                      into one ring of S stages (full/empty mbarriers)
    WG 1 (232 regs)   tiles 0, 2, 4, ...:  mainloop (wgmma) | epilogue + TMA store
    WG 2 (232 regs)   tiles 1, 3, 5, ...:              mainloop | epilogue + TMA store

An order barrier hands the tensor cores from one consumer warpgroup to the
other when its last k-tile is issued, so one warpgroup's epilogue (the
activation math, the residual read, the store) runs while the other
multiplies. Each consumer brings its tile's residual into its own shared
buffer by TMA when its mainloop starts, long before the epilogue reads it.
"""

import functools
from typing import Any

# Registers per thread after setmaxnreg: the producer warpgroup gives its
# registers to the two consumer warpgroups (40 + 2 x 232 <= 512 per lane slot).
_PRODUCER_REGS = 40
_CONSUMER_REGS = 232
# Named barriers (0 is __syncthreads): the two order barriers, then one per consumer's epilogue.
_ORDER_BAR = 1
_EPI_BAR = 3


def _sm_count() -> int:
    """SMs of the current CUDA device (the grid of the persistent kernel); 132 (H100/H200) without one."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    except Exception:  # noqa: BLE001 -- a CPU-only compile check still needs a number
        pass
    return 132


@functools.lru_cache(maxsize=1)
def build_persistent_class() -> type:
    """Import CuTeDSL and define :class:`PersistentGemmKernel` (cached)."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    import cutlass.utils as utils
    import cutlass.utils.hopper_helpers as sm90

    from branchyard.lowering.nvgemm._cutedsl_common import build_base_class
    from branchyard.lowering.nvgemm._cutedsl_epilogue import apply_steps, apply_tail
    from branchyard.lowering.nvgemm.kernel_config import PP_EPI_BUFFERS as _EPI_BUFFERS
    from branchyard.lowering.nvgemm.kernel_config import persistent_stages

    class PersistentGemmKernel(build_base_class()):
        """``out = epilogue(A @ B^T)``, persistent ping-pong; see the module doc."""

        def __init__(self, steps: tuple, config: Any, types: dict) -> None:
            # Each consumer warpgroup owns a whole tile_m x tile_n output tile.
            super().__init__(steps, config, types)
            self.cluster_mn = (config.cluster_m, 1)
            self.epi_tile = (64, min(32, config.tile_n))
            self.n_sub = (config.tile_m // 64) * (config.tile_n // self.epi_tile[1])
            self.sm_count = _sm_count()
            self._split(config.residual_tma)

        def _split(self, residual_tma: bool) -> None:
            """``head`` steps run on the whole fragment after the main loop; ``tail`` steps
            (from the TMA residual on) run per epilogue sub-tile, with the residual read
            from shared memory by ``ldmatrix`` in the very layout ``stmatrix`` writes the
            output in (conflict-free, no per-element addresses). That needs every step
            after the residual to be operand-free; otherwise all matrix operands are
            gathered from global memory in ``head``."""
            first = next((i for i, s in enumerate(self.steps) if s.operand == "matrix"), None)
            tail_free = first is not None and all(
                s.operand in ("none", "scalar", "dtype") for s in self.steps[first + 1 :]
            )
            if residual_tma and tail_free:
                self.tma_mat = self.steps[first].index
                self.head, self.tail = self.steps[:first], self.steps[first:]
            else:
                self.tma_mat = None
                self.head, self.tail = self.steps, ()

        # ------------------------------------------------------------------ host
        @cute.jit
        def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, operands: tuple, stream):
            ab_dtype = mA.element_type
            c_dtype = mC.element_type
            c_layout = utils.LayoutEnum.from_tensor(mC)
            tiled_mma = self._tiled_mma(mA, mB, (1, 1, 1))
            tm, tn = self.tile_mnk[0], self.tile_mnk[1]
            # A residual of more than 16 bits would take two 64 KiB buffers: gather it instead.
            if cutlass.const_expr(self.tma_mat is not None):
                if cutlass.const_expr(operands[self.tma_mat].element_type.width != 16):
                    self._split(False)
            tma_mat = self.tma_mat
            res_bytes = tm * tn * 2 if tma_mat is not None else 0
            stages = persistent_stages(tm, tn, res_bytes)
            sA_layout, sB_layout = self._ab_smem_layouts(mA, mB, stages)
            # Epilogue buffers: _EPI_BUFFERS per consumer warpgroup.
            sC_layout = sm90.make_smem_layout_epi(c_dtype, c_layout, self.epi_tile, 2 * _EPI_BUFFERS)

            # A is not multicast (clusters run along M); B is, across the cluster's CTAs.
            tma_a, gA = self._tma_load(mA, sA_layout, (tm, self.tile_mnk[2]), 1)
            tma_b, gB = self._tma_load(mB, sB_layout, (tn, self.tile_mnk[2]), self.cluster_mn[0])
            tma_c, gC = self._tma_store(mC, sC_layout, self.epi_tile)
            tma_r, gR, sR_layout = tma_c, gC, sC_layout  # placeholders without a TMA residual
            r_dtype = c_dtype
            if cutlass.const_expr(tma_mat is not None):
                mR = operands[tma_mat]
                r_dtype = mR.element_type
                # The residual tile as the output's epilogue sub-tiles (same swizzled layout). One
                # tile buffer serves both consumers: their epilogues never overlap (see kernel).
                self.r_layout = utils.LayoutEnum.from_tensor(mR)
                sR_layout = sm90.make_smem_layout_epi(r_dtype, self.r_layout, self.epi_tile, self.n_sub)
                tma_r, gR = self._tma_load(mR, sR_layout, self.epi_tile, 1)
                self.r_bytes = self.n_sub * cute.size_in_bytes(r_dtype, cute.slice_(sR_layout, (None, None, 0)))

            cm = self.cluster_mn[0]
            tiles_m = (mC.shape[0] + tm - 1) // tm
            tiles_n = (mC.shape[1] + tn - 1) // tn
            cluster_tiles = (tiles_m + cm - 1) // cm * tiles_n
            grid_x = cutlass.min(cluster_tiles, self.sm_count // cm) * cm

            @cute.struct
            class Storage:
                full_empty: cute.struct.MemRange[cutlass.Int64, stages * 2]
                res_full: cute.struct.MemRange[cutlass.Int64, 2]
                sA: cute.struct.Align[cute.struct.MemRange[ab_dtype, cute.cosize(sA_layout)], 1024]
                sB: cute.struct.Align[cute.struct.MemRange[ab_dtype, cute.cosize(sB_layout)], 1024]
                sC: cute.struct.Align[cute.struct.MemRange[c_dtype, cute.cosize(sC_layout)], 1024]
                sR: cute.struct.Align[
                    cute.struct.MemRange[r_dtype, cute.cosize(sR_layout) if tma_mat is not None else 8], 1024
                ]

            self._keep_for_kernel(Storage, ab_dtype, stages, c_layout)
            self.kernel(
                tma_a, gA, tma_b, gB, tma_c, gC, mC, operands, tiled_mma, sA_layout, sB_layout, sC_layout,
                tma_r, gR, sR_layout, tiles_m, tiles_n, cluster_tiles,
            ).launch(
                grid=(grid_x, 1, 1),
                block=[384, 1, 1],
                cluster=(cm, 1, 1),
                min_blocks_per_mp=1,
                stream=stream,
            )

        # ---------------------------------------------------------------- device
        @cute.jit
        def _tile_of(self, t, tiles_m, tiles_n, rank):
            """Tile (m, n) of linear cluster-tile ``t``: grouped raster, ``raster_group`` cluster rows at a time."""
            cm = self.cluster_mn[0]
            cl_rows = (tiles_m + cm - 1) // cm
            group = self.config.raster_group
            per_group = group * tiles_n
            first = (t // per_group) * group
            rows = cutlass.min(group, cl_rows - first)
            within = t % per_group
            return (first + within % rows) * cm + rank, within // rows

        def _load_residual(self, tma_r, gR_tiles, sR, t, bar, tiles_m, tiles_n, rank):
            """TMA the residual of cluster-tile ``t`` into ``sR``, one copy per epilogue sub-tile,
            completing on mbarrier ``bar`` (called by one warp)."""
            tile_m, tile_n = self._tile_of(t, tiles_m, tiles_n, rank)
            gR_epi = cute.zipped_divide(gR_tiles[(None, None, tile_m, tile_n)], self.epi_tile)
            tRsR, tRgR = cute.nvgpu.cpasync.tma_partition(
                tma_r, 0, cute.make_layout(1), cute.group_modes(sR, 0, 2), gR_epi
            )
            # The buffer was last read by ldmatrix (generic proxy); TMA writes through the async proxy.
            cute.arch.fence_proxy("async.shared", space="cta")
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(bar, self.r_bytes)
            n_sub_n = self.tile_mnk[1] // self.epi_tile[1]
            for sm in range(self.tile_mnk[0] // self.epi_tile[0]):
                for sn in range(n_sub_n):
                    cute.copy(tma_r, tRgR[(None, (sm, sn))], tRsR[(None, sm * n_sub_n + sn)], tma_bar_ptr=bar)

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
            tiles_m: cutlass.Int32,
            tiles_n: cutlass.Int32,
            cluster_tiles: cutlass.Int32,
        ):
            tidx, _, _ = cute.arch.thread_idx()
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            wg = warp_idx // 4
            cm = self.cluster_mn[0]
            tm, tn = self.tile_mnk[0], self.tile_mnk[1]
            if warp_idx == 0:
                cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
                cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
                if cutlass.const_expr(self.tma_mat is not None):
                    cute.nvgpu.cpasync.prefetch_descriptor(tma_r)

            bidx, _, _ = cute.arch.block_idx()
            gdim, _, _ = cute.arch.grid_dim()
            first_tile = bidx // cm
            num_clusters = gdim // cm
            cta_layout = cute.make_layout((cm, 1, 1))
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            cta_coord = cta_layout.get_flat_coord(rank)
            mask_b = cute.make_layout_image_mask(cta_layout, cta_coord, mode=0)
            if cutlass.const_expr(cm == 1):
                mask_b = 0

            storage, sA, sB, sC = self._allocate_smem(sA_layout, sB_layout, sC_layout)
            # A stage is read by one consumer warpgroup (4 warps) in each CTA its B half went to.
            ring = self._ab_ring(storage, sA_layout, sB_layout, cta_layout, cm * 4, tidx=tidx)
            res_bar = storage.res_full.data_ptr()
            if cutlass.const_expr(self.tma_mat is not None):
                if warp_idx == 0:
                    with cute.arch.elect_one():
                        cute.arch.mbarrier_init(res_bar, 1)
                        cute.arch.mbarrier_init(res_bar + 1, 1)
            pipeline.pipeline_init_arrive(cluster_shape_mn=self.cluster_mn, is_relaxed=True)

            # (bM, bK, RestM, RestK) / (bN, bK, RestN, RestK): every tile's k-tiles.
            gA = cute.local_tile(gA_full, self.tile_mnk, (None, None, None), proj=(1, None, 1))
            gB = cute.local_tile(gB_full, self.tile_mnk, (None, None, None), proj=(None, 1, 1))
            tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
                tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
            )
            tBsB, tBgB = self._tma_partition_multicast(tma_b, sB, gB, cta_layout, cta_coord, 0)
            k_tiles = cute.size(gA, mode=[3])

            pipeline.pipeline_init_wait(cluster_shape_mn=self.cluster_mn)

            # ---------------- producer: warp 0 loads every tile's k-tiles, in tile order
            if wg == 0:
                cute.arch.setmaxregister_decrease(_PRODUCER_REGS)
                if warp_idx == 0:
                    produce = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                    t = first_tile
                    while t < cluster_tiles:
                        tile_m, tile_n = self._tile_of(t, tiles_m, tiles_n, rank)
                        for kt in cutlass.range(k_tiles, unroll=1):
                            ring.producer_acquire(produce)
                            bar = ring.producer_get_barrier(produce)
                            cute.copy(tma_a, tAgA[(None, tile_m, kt)], tAsA[(None, produce.index)], tma_bar_ptr=bar)
                            cute.copy(
                                tma_b,
                                tBgB[(None, tile_n, kt)],
                                tBsB[(None, produce.index)],
                                tma_bar_ptr=bar,
                                mcast_mask=mask_b,
                            )
                            ring.producer_commit(produce)
                            produce.advance()
                        t += num_clusters

            # ---------------- consumers: warpgroup c takes this CTA's tiles c, c + 2, ...
            if wg > 0:
                cute.arch.setmaxregister_increase(_CONSUMER_REGS)
                c = wg - 1
                ltid = tidx - 128 * wg
                first_warp = warp_idx % 4 == 0
                thr_mma = tiled_mma.get_slice(0)
                tCrA, tCrB = self._mma_fragments(tiled_mma, thr_mma, sA, sB)
                acc_shape = thr_mma.partition_shape_C((tm, tn))
                acc = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
                thr_c = tiled_mma.get_slice(ltid)
                local = thr_c.partition_C(cute.make_identity_tensor((tm, tn)))

                # Epilogue store path: registers -> stmatrix -> this warpgroup's smem buffers -> TMA.
                c_dtype = mC.element_type
                stmatrix_atom, r2s, tRS_sC, tRS_acc, sub_layout, sub, sub_size = self._stmatrix_store(
                    tiled_mma, sC, acc, c_dtype, ltid
                )
                n_sub_m = tm // self.epi_tile[0]
                n_sub_n = tn // self.epi_tile[1]
                store_ring = pipeline.PipelineTmaStore.create(
                    num_stages=_EPI_BUFFERS, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128)
                )
                gC_tiles = cute.local_tile(gC_full, (tm, tn), (None, None))  # (tm, tn, RestM, RestN)
                coord_tiles = cute.local_tile(cute.make_identity_tensor(mC.shape), (tm, tn), (None, None))

                my_res_bar = res_bar + c
                sR, tSR_sR, s2r, gR_tiles = None, None, None, None
                if cutlass.const_expr(self.tma_mat is not None):
                    sR = storage.sR.get_tensor(sR_layout.outer, swizzle=sR_layout.inner)
                    gR_tiles = cute.local_tile(gR_full, (tm, tn), (None, None))
                    # ldmatrix, partitioned like the stmatrix store: its registers line up with `sub`.
                    ldmatrix_atom = cute.make_copy_atom(
                        cute.nvgpu.warp.LdMatrix8x8x16bOp(self.r_layout.is_m_major_c(), 4), sR.element_type
                    )
                    s2r = cute.make_tiled_copy_S(ldmatrix_atom, cute.make_tiled_copy_C_atom(stmatrix_atom, tiled_mma))
                    tSR_sR = s2r.get_slice(ltid).partition_S(sR)

                # The pipeline position of this warpgroup's first k-tile: after the other's tile if c == 1.
                read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
                read.advance(c * k_tiles)
                release = read.clone()
                t = first_tile + c * num_clusters
                done = cutlass.Int32(0)
                # The residual buffer: warpgroup 0 loads its first tile's; after that, each
                # warpgroup loads the other's current tile once its own epilogue has read the
                # buffer (during the other's main loop, ~a tile's time before it is needed).
                if cutlass.const_expr(self.tma_mat is not None):
                    if c == 0 and first_warp and t < cluster_tiles:
                        self._load_residual(tma_r, gR_tiles, sR, t, res_bar, tiles_m, tiles_n, rank)
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                while t < cluster_tiles:
                    tile_m, tile_n = self._tile_of(t, tiles_m, tiles_n, rank)
                    # Wait for the other warpgroup to issue its last k-tile (not for this CTA's first tile):
                    # then this warpgroup's first k-tile is at most one ring phase ahead of the producer.
                    if t >= first_tile + num_clusters:
                        cute.arch.barrier(barrier_id=_ORDER_BAR + c, number_of_threads=256)
                    acc.fill(0.0)
                    for kt in cutlass.range(k_tiles, unroll=1):
                        release, read = self._mma_k_tile(tiled_mma, acc, tCrA, tCrB, ring, read, release, kt)
                    # Hand the tensor cores to the other warpgroup, if it has a next tile.
                    if t + num_clusters < cluster_tiles:
                        cute.arch.barrier_arrive(barrier_id=_ORDER_BAR + 1 - c, number_of_threads=256)
                    cute.nvgpu.warpgroup.wait_group(0)
                    ring.consumer_release(release)
                    release.advance()
                    # Skip the other warpgroup's tile in the ring.
                    read.advance(k_tiles)
                    release.advance(k_tiles)

                    # ---- epilogue in registers
                    if cutlass.const_expr(len(self.head) > 0):
                        coords = thr_c.partition_C(coord_tiles[(None, None, tile_m, tile_n)])
                        apply_steps(
                            self.head, None, acc, coords, local, None, operands, mC.shape[0] - 1, mC.shape[1] - 1
                        )
                    if cutlass.const_expr(self.tma_mat is not None):
                        cute.arch.mbarrier_wait(my_res_bar, done % 2)

                    # ---- cast -> stmatrix -> TMA store, one epi sub-tile at a time
                    gC_epi = cute.zipped_divide(gC_tiles[(None, None, tile_m, tile_n)], self.epi_tile)
                    bSG_sC, bSG_gC = cute.nvgpu.cpasync.tma_partition(
                        tma_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), gC_epi
                    )
                    for sm in cutlass.range_constexpr(n_sub_m):
                        for sn in cutlass.range_constexpr(n_sub_n):
                            # The retiled fragment is (values along N, M blocks of 64 rows): sub-tile
                            # (sm, sn) is its flat range [s * sub_size, (s + 1) * sub_size).
                            s = sm * n_sub_n + sn
                            for v in cutlass.range_constexpr(sub_size):
                                sub[v] = tRS_acc[s * sub_size + v]
                            if cutlass.const_expr(self.tma_mat is not None):
                                res = cute.make_rmem_tensor_like(sub_layout, sR.element_type)
                                cute.copy(s2r, tSR_sR[(None, None, None, s)], res)
                                sub.store(apply_tail(self.tail, sub.load(), res.load().to(self.acc_dtype)))
                            self._store_sub_tile(
                                sub, sub_layout, c_dtype, r2s, tRS_sC, c * _EPI_BUFFERS + s % _EPI_BUFFERS, tma_c,
                                bSG_sC, bSG_gC, (sm, sn), store_ring, leader=first_warp, barrier_id=_EPI_BAR + c,
                                barrier_threads=128,
                            )
                    if cutlass.const_expr(self.tma_mat is not None):
                        if first_warp and t + num_clusters < cluster_tiles:
                            self._load_residual(
                                tma_r, gR_tiles, sR, t + num_clusters, res_bar + 1 - c, tiles_m, tiles_n, rank
                            )
                    t += 2 * num_clusters
                    done += 1
                if first_warp:
                    store_ring.producer_tail()

            self._cluster_exit_sync(cm)

    return PersistentGemmKernel
