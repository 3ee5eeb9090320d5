"""Prototype, measured and not adopted: fp8_matmul's 128 x 256 tile (core.fp8_matmul_tilelang, n256) with b's tile
multicast by TMA to both CTAs of a 2-CTA cluster, so a cluster step reads 64 KiB from L2 instead of 96, written as a
hand-written warp-specialized pipeline (TileLang 0.1.15's T.Pipelined releases a stage on the local CTA's consumers
only: a multicast into the peer's stage would race, and it has no cluster sync after the barriers' init or at exit).

Grid: x = M tiles rounded up to whole clusters (TileLang's cluster raster takes clusters along x), y = N tiles of 256;
cluster_dims (2, 1, 1): a cluster's CTAs are M tiles 2c, 2c + 1 of one 256-column block. 384 threads: consumer warp
groups 0, 1 (64 rows each, m64n128k32 wgmma, the two halves into one product tile as core's kernel) and a producer
warp group (TMA, 24 registers). Barriers a stage (3 stages):
  full[s]      count 1 a CTA: the producer's expect_tx of a's 16 KiB and b's 32 KiB, then one arrive; completed by
               a's load (local) and b's multicast (issued by rank 0: T.tma_copy lets only the mask's lowest rank issue).
  empty_mc[s]  cluster barrier, count 4, used on rank 0: one thread of each consumer group of both CTAs arrives (rank
               1's remotely) once its wgmmas on stage s are waited for; rank 0's producer waits on it before it
               overwrites its a and both CTAs' b.
  empty_loc[s] count 2, used on rank 1: its consumer groups' releases; its producer waits on it before its own a load.
Allocating a cluster barrier makes TileLang follow the barriers' init by a cluster sync; T.cluster_sync() at the end
keeps rank 0 alive while rank 1 can still arrive on it. The roles are one `if / else` (two `T.ws` frames get a
__syncthreads() between them: a deadlock). multicast=False: the same pipeline without a cluster (the baseline).
Built for sm_90a without spills (highest register R223 of 240). On an H100 (2026-12-07) it ran exact at every shape
of SHAPES (the padding CTA of an odd M-tile count and one cluster included) and slower than core's kernel at each:
0.72-0.97x with the multicast, 0.89-1.05x without the cluster (benchmarks/results/h200/notes.md).

    python benchmarks/proto_fp8_multicast.py [--shape M,K,N ...]      # on an sm_90 GPU: check and time
    python benchmarks/proto_fp8_multicast.py --lower DIR               # anywhere: the generated CUDA of each variant

Each line: us (CUDA-graph replays), TFLOP/s, the ratio to core's n256 kernel, max |out - ref| / max |ref| against the
Triton kernel's output, as benchmarks/sweep_fp8_matmul.py (the output filled with NaN first: an unwritten tile shows).
"""

import argparse
import os

import torch
import triton.testing

import tile_kernels.torch as tk
from tile_kernels.core import fp8_matmul_tilelang as core_kernel
from tile_kernels.core.backends import tilelang_build, tilelang_function, tilelang_lower, tilelang_target

BLOCK = core_kernel.BLOCK  # K step, BLOCK_M, a half of the output tile's columns
BN = 256  # output tile columns (two 128-column halves)
STAGES = 3
CLUSTER = 2  # CTAs per cluster, along M
SWIZZLE = 8  # M tiles per raster panel (4 clusters), as the existing kernel's 8
CONSUMER_THREADS = 256
PRODUCER_REGS = 24
CONSUMER_REGS = 240


def prim_func(out_dtype: str = "bfloat16", multicast: bool = True):
    """The prim_func. multicast=False: the same hand-written pipeline without a cluster (B loaded by each CTA, one
    `empty` barrier of count 2 per stage, no cluster syncs): the baseline that isolates the multicast's effect."""
    import tilelang.language as T

    fp8, f32 = "float8_e4m3", "float32"
    M, N, K, KB, NB = T.dynamic("M N K KB NB")  # noqa: N806
    cluster = CLUSTER if multicast else 1
    consumer_wgs = CONSUMER_THREADS // 128

    load_scales, promote = core_kernel.scale_macros(M, NB)

    @T.prim_func
    def fp8_matmul_mc(
        A: T.Tensor((M, K), fp8),  # noqa: N803
        AS: T.Tensor((M, KB), f32),  # noqa: N803
        B: T.Tensor((N, K), fp8),  # noqa: N803
        BS: T.Tensor((NB, KB), f32),  # noqa: N803
        OUT: T.Tensor((M, N), out_dtype),  # noqa: N803
    ):
        # M tiles on x, rounded up to whole clusters (a padding CTA's A loads are all out of bounds: TMA zero fill,
        # its scales are 0, its stores are clipped by the TMA store)
        with T.Kernel(T.ceildiv(M, BLOCK * cluster) * cluster, T.ceildiv(N, BN), threads=CONSUMER_THREADS + 128,
                      cluster_dims=(cluster, 1, 1) if multicast else None) as (bm, bn):  # fmt: skip
            a_tile = T.alloc_shared((STAGES, BLOCK, BLOCK), fp8)
            b_tile = T.alloc_shared((STAGES, BN, BLOCK), fp8)
            out_tile = T.alloc_shared((BLOCK, BLOCK), out_dtype)
            acc = T.alloc_fragment((BLOCK, BLOCK), f32)
            acc_right = T.alloc_fragment((BLOCK, BLOCK), f32)
            step = T.alloc_fragment((BLOCK, BLOCK), f32)
            row_scale = T.alloc_fragment((BLOCK,), f32)
            scale_right = T.alloc_fragment((BLOCK,), f32)
            # full[s]: count 1 (the elected producer thread's arrive, after its expect_tx of A's and B's bytes)
            full = T.alloc_barrier([1] * STAGES)
            # empty_loc[s]: count 2 (one thread of each local consumer warp group); with multicast only rank 1's
            # producer waits on it
            empty_loc = T.alloc_barrier([consumer_wgs] * STAGES)
            if multicast:
                # empty_mc[s]: count 4 (one thread of each consumer warp group of both CTAs); only rank 0's is used.
                # A shared.cluster_barrier allocation also makes TileLang follow the barrier init with
                # fence.mbarrier_init.release.cluster + barrier.cluster arrive/wait instead of __syncthreads.
                empty_mc = T.alloc_cluster_barrier([consumer_wgs * cluster] * STAGES)
            # cluster-granular raster (tl::rasterization2DColumnWithCluster<SWIZZLE / 2, 2>): consecutive clusters
            # walk down M inside a panel of SWIZZLE M tiles, so panels share B as the existing kernel's row swizzle
            T.use_swizzle(SWIZZLE, order="column")
            tx = T.get_thread_binding()
            kt = T.ceildiv(K, BLOCK)

            # ONE if / else: two `with T.ws(...)` blocks in sequence get a __syncthreads() between them from
            # TileLang's storage-sync pass (a deadlock: the producer blocks on `empty` after STAGES steps)
            if tx >= CONSUMER_THREADS:  # producer warp group (warps 8-11)
                T.set_max_nreg(PRODUCER_REGS, 0)
                for k in T.serial(kt):
                    s = k % STAGES
                    phase = (k // STAGES) % 2
                    if multicast:
                        # rank 0 multicasts B into both CTAs: it waits for all 4 consumer warp groups of the
                        # cluster; rank 1 only overwrites its own A: it waits for its own 2
                        if T.block_rank_in_cluster() == 0:
                            T.mbarrier_wait_parity(empty_mc[s], phase ^ 1)
                        else:
                            T.mbarrier_wait_parity(empty_loc[s], phase ^ 1)
                    else:
                        T.mbarrier_wait_parity(empty_loc[s], phase ^ 1)
                    T.tma_copy(A[bm * BLOCK:bm * BLOCK + BLOCK, k * BLOCK:k * BLOCK + BLOCK], a_tile[s, :, :],
                               barrier=full[s])  # fmt: skip
                    # multicast: rank 0 expect_tx + one multicast to ranks 0 and 1; rank 1 expect_tx only. The
                    # arrive on full[s] is emitted in the same elected-thread block, after both expect_tx
                    # (annotation emit_arrive).
                    if multicast:
                        T.tma_copy(B[bn * BN:bn * BN + BN, k * BLOCK:k * BLOCK + BLOCK], b_tile[s, :, :],
                                   barrier=full[s], cluster_mask=0b11, annotations={"emit_arrive": 1})  # fmt: skip
                    else:
                        T.tma_copy(B[bn * BN:bn * BN + BN, k * BLOCK:k * BLOCK + BLOCK], b_tile[s, :, :],
                                   barrier=full[s], annotations={"emit_arrive": 1})  # fmt: skip
            else:  # consumer warp groups 0, 1 (rows 0-63, 64-127)
                T.set_max_nreg(CONSUMER_REGS, 1)
                T.clear(acc)
                T.clear(acc_right)
                for k in T.serial(kt):
                    s = k % STAGES
                    phase = (k // STAGES) % 2
                    # the scales before the wait: their latency hides behind it
                    load_scales(row_scale, AS, BS, bn * 2, bm, k, scale_right)
                    T.mbarrier_wait_parity(full[s], phase)
                    T.gemm(a_tile[s, :, :], b_tile[s, 0:BLOCK, :], step, transpose_B=True,
                           policy=T.GemmWarpPolicy.FullRow, clear_accum=True)  # fmt: skip
                    promote(acc, step, row_scale)
                    T.gemm(a_tile[s, :, :], b_tile[s, BLOCK:BN, :], step, transpose_B=True,
                           policy=T.GemmWarpPolicy.FullRow, clear_accum=True)  # fmt: skip
                    # this warp group's wgmma reads of stage s are complete (wait_group 0): one thread of it
                    # releases the stage
                    if tx % 128 == 0:
                        if multicast:
                            if T.block_rank_in_cluster() == 0:
                                T.mbarrier_arrive(empty_mc[s])  # own barrier: a plain local arrive
                            else:
                                T.mbarrier_arrive(empty_loc[s])
                                T.ptx_arrive_cluster_barrier(empty_mc[s], 0)  # remote: rank 0's barrier
                        else:
                            T.mbarrier_arrive(empty_loc[s])
                    promote(acc_right, step, scale_right)
                T.copy(acc, out_tile)
                T.copy(out_tile, OUT[bm * BLOCK, bn * BN])
                T.copy(acc_right, out_tile)
                T.copy(out_tile, OUT[bm * BLOCK, bn * BN + BLOCK])

            if multicast:
                # no CTA may exit while its peer can still arrive on its barriers (rank 1 -> rank 0's empty_mc)
                T.cluster_sync()

    return fp8_matmul_mc


# the last three: an odd M-tile count (a padding CTA), N % 256 == 128, one cluster
SHAPES = ((8192, 8192, 8192), (4096, 4096, 14336), (4096, 14336, 4096), (2048, 4096, 4096),
          (4224, 4096, 4096), (4096, 4096, 4224), (128, 1024, 256))  # fmt: skip


def variants(target):
    """(label, prim_func maker) of core's n256 kernel and the prototype without and with the cluster."""
    return {
        "core n256": lambda: core_kernel.prim_func("fp8_matmul", "float8_e4m3fn", "bfloat16", target),
        "manual, no cluster": lambda: prim_func("bfloat16", multicast=False),
        "manual, 2-CTA b multicast": lambda: prim_func("bfloat16", multicast=True),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", help="M,K,N (repeatable; default: SHAPES)")
    parser.add_argument("--lower", metavar="DIR", help="write each variant's generated CUDA under DIR and stop")
    args = parser.parse_args(argv)
    target = tilelang_target(90)
    if args.lower:
        os.makedirs(args.lower, exist_ok=True)
        for label, make in variants(target).items():
            path = os.path.join(args.lower, label.replace(" ", "_").replace(",", "") + ".cu")
            with open(path, "w") as f:
                f.write(tilelang_lower(make, target).kernel_source)
            print(path)
        return

    fns = {label: tilelang_function(tilelang_build(make, target)) for label, make in variants(target).items()}
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    g = torch.Generator("cuda").manual_seed(0)
    shapes = [tuple(int(d) for d in s.split(",")) for s in args.shape] if args.shape else SHAPES
    for m, k, n in shapes:
        a, a_scales = tk.fp8_quantize(torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16))
        b, b_scales = tk.fp8_quantize(torch.randn(n, k, generator=g, device="cuda").to(torch.bfloat16), block_rows=128)
        want = tk.fp8_matmul(a, a_scales, b, b_scales, backend="triton").float()
        scale = want.abs().max().item()
        flops, base = 2 * m * n * k, None
        for label, fn in fns.items():
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")

            def call(fn=fn, out=out, operands=(a, a_scales, b, b_scales)):
                return fn(*operands, out)

            call()
            torch.cuda.synchronize()
            err = (out.float() - want).abs().max().item() / scale
            ms = triton.testing.do_bench_cudagraph(call)
            base = base or ms
            print(f"{m}x{k}x{n} {label}: {ms * 1e3:.1f} us {flops / ms / 1e9:.0f} TFLOP/s {base / ms:.2f}x "
                  f"err {err:.2g}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
