"""What the two CuTeDSL GEMM kernels share: :mod:`._cutedsl_kernel` (one tile per
CTA) and :mod:`._cutedsl_persistent` (persistent ping-pong).

Both build the same wgmma, A/B shared-memory rings, TMA atoms and stmatrix + TMA
store path; they differ in who loads, who multiplies and in what order. The
shared pieces live on :class:`GemmKernelBase`, built on first use like the
kernels (its methods need ``cutlass`` at class-body time), so this module
imports on machines without CuTeDSL. Every helper traces exactly the
operations its callers traced inline before, in the same order.
"""

import functools
from typing import Any, NamedTuple


class StmatrixStore(NamedTuple):
    """The epilogue's registers -> shared memory path for one thread (see
    :meth:`GemmKernelBase._stmatrix_store`)."""

    stmatrix_atom: Any  # also what an ldmatrix read of a same-layout tile is partitioned by
    r2s: Any  # tiled copy: accumulator-layout registers -> stmatrix
    tRS_sC: Any  # this thread's part of the staged epilogue buffers
    tRS_acc: Any  # the accumulators, retiled as r2s's source
    sub_layout: Any  # one epilogue sub-tile of this thread's registers
    sub: Any  # fp32 registers holding one sub-tile
    sub_size: int


@functools.lru_cache(maxsize=1)
def build_base_class() -> type:
    """Import CuTeDSL and define :class:`GemmKernelBase` (cached)."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    import cutlass.utils as utils
    import cutlass.utils.hopper_helpers as sm90

    from branchyard.lowering.nvgemm.kernel_config import TILE_K

    class GemmKernelBase:
        """``out = epilogue(A @ B^T)`` with A (M, K), B (N, K), out (M, N): the fields
        and trace-time helpers both kernel classes use."""

        def __init__(self, steps: tuple, config: Any, types: dict) -> None:
            self.steps = steps
            self.config = config
            self.types = types
            self.tile_mnk = (config.tile_m, config.tile_n, TILE_K)
            self.acc_dtype = cutlass.Float32

        # ------------------------------------------------------------------ host
        def _tiled_mma(self, mA: Any, mB: Any, atom_layout: tuple) -> Any:
            """wgmma of 64 x tile_n per warpgroup, ``atom_layout`` warpgroups, with A
            and B read in the major mode their tensors are laid out in."""
            ab_dtype = mA.element_type
            return sm90.make_trivial_tiled_mma(
                ab_dtype,
                ab_dtype,
                utils.LayoutEnum.from_tensor(mA).sm90_mma_major_mode(),
                utils.LayoutEnum.from_tensor(mB).sm90_mma_major_mode(),
                self.acc_dtype,
                atom_layout,
                tiler_mn=(64, self.tile_mnk[1]),
            )

        def _ab_smem_layouts(self, mA: Any, mB: Any, stages: int) -> tuple[Any, Any]:
            """The swizzled A and B ring layouts, ``stages`` k-tiles deep."""
            ab_dtype = mA.element_type
            sA_layout = sm90.make_smem_layout_a(utils.LayoutEnum.from_tensor(mA), self.tile_mnk, ab_dtype, stages)
            sB_layout = sm90.make_smem_layout_b(utils.LayoutEnum.from_tensor(mB), self.tile_mnk, ab_dtype, stages)
            return sA_layout, sB_layout

        @staticmethod
        def _tma_load(tensor: Any, smem_layout_staged: Any, tile: tuple, mcast: int) -> Any:
            """TMA load atom of one stage of ``smem_layout_staged``, multicast to
            ``mcast`` CTAs when that is more than one."""
            op = (
                cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
                if mcast == 1
                else cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp()
            )
            return cute.nvgpu.cpasync.make_tiled_tma_atom(
                op, tensor, cute.slice_(smem_layout_staged, (None, None, 0)), tile, num_multicast=mcast
            )

        @staticmethod
        def _tma_store(mC: Any, sC_layout: Any, epi_tile: tuple) -> Any:
            """TMA store atom of one ``epi_tile`` sub-tile of the epilogue buffers."""
            return cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(),
                mC,
                cute.slice_(sC_layout, (None, None, 0)),
                epi_tile,
            )

        def _keep_for_kernel(self, storage: type, ab_dtype: Any, stages: int, c_layout: Any) -> None:
            """What the host call decides and the kernel reads as trace-time constants."""
            self.storage = storage
            self.ab_dtype = ab_dtype
            self.stages = stages
            self.c_layout = c_layout

        # ---------------------------------------------------------------- device
        def _allocate_smem(self, sA_layout: Any, sB_layout: Any, sC_layout: Any) -> tuple[Any, Any, Any, Any]:
            """This CTA's shared memory (the host call's ``Storage``), with its A ring, B
            ring and epilogue buffers as swizzled tensors: ``storage, sA, sB, sC``."""
            smem = cutlass.utils.SmemAllocator()
            storage = smem.allocate(self.storage)
            sA = storage.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
            sB = storage.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
            sC = storage.sC.get_tensor(sC_layout.outer, swizzle=sC_layout.inner)
            return storage, sA, sB, sC

        def _ab_ring(
            self, storage: Any, sA_layout: Any, sB_layout: Any, cta_layout: Any, consumer_warps: int, tidx: Any = None
        ) -> Any:
            """The full/empty mbarrier ring over the A/B stages: one TMA producer thread,
            ``consumer_warps`` warp arrivals free a stage, a stage is full once both of
            its k-tiles have landed. Initialised without a sync (the caller's
            ``pipeline_init_arrive`` / ``pipeline_init_wait`` fence it)."""
            stage_bytes = cute.size_in_bytes(
                self.ab_dtype, cute.slice_(sA_layout, (None, None, 0))
            ) + cute.size_in_bytes(self.ab_dtype, cute.slice_(sB_layout, (None, None, 0)))
            return pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.full_empty.data_ptr(),
                num_stages=self.stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps),
                tx_count=stage_bytes,
                cta_layout_vmnk=cute.make_layout((1, *cta_layout.shape)),
                tidx=tidx,
                defer_sync=True,
            )

        @staticmethod
        def _tma_partition_multicast(
            tma: Any, smem: Any, gmem: Any, cta_layout: Any, cta_coord: Any, mode: int
        ) -> tuple[Any, Any]:
            """TMA partition of a ring and its global tiles for a load multicast along
            cluster mode ``mode`` (0: M, as B is; 1: N, as A is): this CTA's share among
            the peers it multicasts with. Returns ``(smem part, global part)``."""
            peers = (None, 0, 0) if mode == 0 else (0, None, 0)
            return cute.nvgpu.cpasync.tma_partition(
                tma,
                cta_coord[mode],
                cute.make_layout(cute.slice_(cta_layout, peers).shape),
                cute.group_modes(smem, 0, 2),
                cute.group_modes(gmem, 0, 2),
            )

        @staticmethod
        def _mma_fragments(tiled_mma: Any, thr_mma: Any, sA: Any, sB: Any) -> tuple[Any, Any]:
            """wgmma's A and B operands (shared-memory descriptors) over every ring stage."""
            tCsA = thr_mma.partition_A(sA)
            tCsB = thr_mma.partition_B(sB)
            return tiled_mma.make_fragment_A(tCsA), tiled_mma.make_fragment_B(tCsB)

        def _stmatrix_store(self, tiled_mma: Any, sC: Any, acc: Any, c_dtype: Any, thread: Any) -> StmatrixStore:
            """Thread ``thread``'s (index within its warpgroups) path from the fp32
            accumulators ``acc`` to the epilogue buffers ``sC`` by stmatrix."""
            r2s_atom = sm90.get_smem_store_op(self.c_layout, elem_ty_d=c_dtype, elem_ty_acc=self.acc_dtype)
            stmatrix_atom = cute.make_copy_atom(
                cute.nvgpu.warp.StMatrix8x8x16bOp(self.c_layout.is_m_major_c(), 4), c_dtype
            )
            r2s = cute.make_tiled_copy_S(r2s_atom, cute.make_tiled_copy_C_atom(stmatrix_atom, tiled_mma))
            thr_r2s = r2s.get_slice(thread)
            tRS_sC = thr_r2s.partition_D(sC)
            tRS_acc = r2s.retile(acc)
            sub_layout = cute.make_layout(cute.shape(thr_r2s.partition_S(sC))[:3])
            sub = cute.make_rmem_tensor_like(sub_layout, self.acc_dtype)
            return StmatrixStore(stmatrix_atom, r2s, tRS_sC, tRS_acc, sub_layout, sub, cute.size(sub))

        @cute.jit
        def _mma_k_tile(self, tiled_mma: Any, acc: Any, tCrA: Any, tCrB: Any, ring: Any, read: Any, release: Any, kt: Any):
            """Main-loop k-tile ``kt``: wait for stage ``read``, issue its wgmmas into ``acc``,
            keep that batch in flight and release the stage the batch before it read
            (``release``; none at the first k-tile). Returns ``release`` and ``read`` advanced:
            the caller rebinds them (the tracer carries loop state only through its own
            locals; in this order, the order the inline loop first wrote them in)."""
            ring.consumer_wait(read)
            cute.nvgpu.warpgroup.fence()
            for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
                coord = (None, None, kb, read.index)
                cute.gemm(tiled_mma, acc, tCrA[coord], tCrB[coord], acc)
            cute.nvgpu.warpgroup.commit_group()
            # Keep one wgmma batch in flight; the one before it has read its stage.
            cute.nvgpu.warpgroup.wait_group(1)
            if kt > 0:
                ring.consumer_release(release)
                release.advance()
            read.advance()
            return release, read

        @cute.jit
        def _store_sub_tile(
            self, sub: Any, sub_layout: Any, c_dtype: Any, r2s: Any, tRS_sC: Any, buf: Any, tma_c: Any, bSG_sC: Any,
            bSG_gC: Any, sub_coord: Any, store_ring: Any, leader: Any, barrier_id: Any, barrier_threads: Any,
        ):
            """Cast the fp32 sub-tile ``sub`` to ``c_dtype``, stmatrix it into epilogue buffer
            ``buf`` and let ``leader`` TMA-store that buffer to ``sub_coord`` of the tile. The
            named barrier ``barrier_id`` (over ``barrier_threads`` threads, None: the CTA) is
            passed before the store (every thread has written the buffer) and after it (the
            next write into the ring of buffers is free)."""
            out_frag = cute.make_rmem_tensor_like(sub_layout, c_dtype)
            out_frag.store(sub.load().to(c_dtype))
            cute.copy(r2s, out_frag, tRS_sC[(None, None, None, buf)])
            # stmatrix writes are generic-proxy; the TMA store reads through the async proxy.
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=barrier_id, number_of_threads=barrier_threads)
            if leader:
                cute.copy(tma_c, bSG_sC[(None, buf)], bSG_gC[(None, sub_coord)])
                store_ring.producer_commit()
                store_ring.producer_acquire()
            cute.arch.barrier(barrier_id=barrier_id, number_of_threads=barrier_threads)

        @staticmethod
        def _cluster_exit_sync(cluster_size: int) -> None:
            """No CTA may leave while a cluster peer can still multicast into it or
            signal its barriers (nothing to wait for without a cluster)."""
            if cluster_size > 1:
                cute.arch.cluster_arrive()
                cute.arch.cluster_wait()

    return GemmKernelBase
