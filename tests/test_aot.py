"""The ahead-of-time compile matrix: every configuration of every registered op compiles for each NVIDIA and AMD
target, on a machine without a GPU; a kernel that a target cannot compile fails with that target named.

Compiles run in a subprocess: the suite itself runs with TRITON_INTERPRET=1 on a CPU, under which Triton hands out
interpreted functions instead of compilable ones."""

from __future__ import annotations

import os
import re
import textwrap

import pytest
import triton
from conftest import assert_in_order, needs_tilelang
from subprocesses import run_python

from tile_kernels.core import REGISTRY, aot, backends
from tile_kernels.core.flash_attention_tilelang import BWD_CONFIGS, CONFIGS


def _python(*args: str):
    return run_python(*args, TRITON_INTERPRET=None)


# flash_attention's 200 configurations a target take 1-6 s each to compile on one CPU core with triton 3.9 (~10 min a
# target, an hour for the six): CI compiles each of its four kernels in one configuration for every target below;
# `tile-kernels aot --op flash_attention` does them all.
SLOW_TO_COMPILE = {"flash_attention", "flash_attention_varlen"}  # the same kernels, VARLEN or not
FLASH_ATTENTION_KERNELS = ("flash_fwd_kernel", "flash_bwd_preprocess_kernel", "flash_bwd_dkdv_kernel",
                           "flash_bwd_dq_kernel")  # fmt: skip


# Configurations that spill registers (`tile-kernels aot --report`, SPILLS_TRITON, 2026-11-29; the AMD targets spill
# none), with the targets where they do: a list to shrink, grown only for a configuration measured faster than every
# non-spilling one (mla_decode's). No other is in the H200 benchmark's shapes (bf16 rows of 4096, 65536, 262144:
# aligned builds).
_CUDA = ("cuda:80", "cuda:90", "cuda:100")
_HIP = ("hip:gfx90a", "hip:gfx942", "hip:gfx950")
# The spills are those of one compiler: another Triton (a GPU machine's, the oldest allowed) allocates registers
# differently, and there the tests check that every kernel compiles, not which spill.
SPILLS_TRITON = "3.9"  # the CPU suite's (the newest)
SPILLS_APPLY = triton.__version__.startswith(SPILLS_TRITON + ".")
spills_of_that_triton = pytest.mark.skipif(
    not SPILLS_APPLY, reason=f"KNOWN_SPILLS are Triton {SPILLS_TRITON}'s, not {triton.__version__}'s"
)
KNOWN_SPILLS = {
    # 4097-8192-wide rows held in registers by 16 warps (128 registers a thread at most): 8-864 bytes a thread
    r"(rms|layer)_norm/norm_bwd_kernel\[BLOCK_N=8192,": _CUDA,
    # layer_norm forward with bias and residual at 8192 / 16384: 8-40
    r"layer_norm/norm_fwd_kernel\[BLOCK_N=(8192|16384), HAS_BIAS=True, HAS_RESIDUAL=True,": _CUDA,
    # the element-wise (unaligned) build of the cross-entropy forward, tiles of 8-4096 rows of <= 512 classes: 8-72;
    # its streamed rows' build (BLOCK_V 32768, 16 AMD waves): 12-300 on AMD
    r"(fused_linear_)?cross_entropy/cross_entropy_fwd_kernel\[.*UNIT=1,": _CUDA + _HIP,
    # the streamed rows' 32-warp build (64 registers a thread) with per-row losses and a validity mask: 40-72, kept for
    # its speed (benchmarks/sweep_ce_wide.py: 240 us against 244 at 16 warps, whose unaligned build spills more)
    r"cross_entropy_fwd_kernel\[BLOCK_M=1, BLOCK_ONLINE=True, BLOCK_V=32768, HAS_VALID=True,.*REDUCE=0,": _CUDA,
    # rotary at head dim 4, element-wise build: 16
    r"apply_rotary/rotary_kernel\[BLOCK=2,": ("cuda:90",),
    # MLA decode's 64-head tiles at Dc 512 (a 64 x 512 fp32 accumulator and the queries in registers): 368-384 on
    # sm_90, kept because they measured 1.2-2.4x the non-spilling 32-head tiles (benchmarks/sweep_mla_decode.py)
    r"mla_decode/mla_split_kernel\[BLOCK_C=512, BLOCK_H=64,": _CUDA,
}


# The whole matrix (~3200 configurations a target, 20-30 min a target on one core) runs with TILE_KERNELS_AOT=full,
# e.g. `TILE_KERNELS_AOT=full nox -s tests -- tests/test_aot.py`; the default suite compiles PER_KERNEL
# configurations of each kernel, its first and last.
FULL_MATRIX = os.environ.get("TILE_KERNELS_AOT") == "full"
PER_KERNEL = 2


@pytest.mark.parametrize("target", list(aot.TARGETS))
def test_every_registered_kernel_compiles_for(target):
    """...and spills no registers but the KNOWN_SPILLS of that target (the compiler's report of each configuration);
    over the full matrix, each of the known ones still spills."""
    ops = [arg for op in sorted(set(REGISTRY) - SLOW_TO_COMPILE) for arg in ("--op", op)]
    sample = [] if FULL_MATRIX else ["--per-kernel", str(PER_KERNEL)]
    run = _python("-m", "tile_kernels.cli", "aot", "--target", target, *ops, *sample, "--jobs", "1", "--quiet",
                  "--report")  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"{target}: all compiled" in run.stdout
    reports = [line for line in run.stdout.splitlines() if line.startswith(f"{target}  ")]
    kernels = {line.split()[1].split("[")[0] for line in reports}
    assert len(kernels) >= 20 and all(" registers, " in line for line in reports), run.stdout[-2000:]
    assert FULL_MATRIX or len(reports) <= PER_KERNEL * len(kernels)
    spilling = [line for line in reports if " 0 B spilled" not in line]
    known = [pattern for pattern, targets in KNOWN_SPILLS.items() if target in targets]
    unknown = [line for line in spilling if not any(re.search(pattern, line) for pattern in known)]
    fixed = [pattern for pattern in known if not any(re.search(pattern, line) for line in spilling)]
    if SPILLS_APPLY:
        assert not unknown, "new register spills:\n" + "\n".join(unknown)
        assert not (FULL_MATRIX and fixed), f"no longer spilling on {target} (take them out of KNOWN_SPILLS): {fixed}"


def test_per_kernel_keeps_every_kernel_first_and_last():
    """The sample the default suite compiles: each op's kernel in `per_kernel` configurations, its first and last."""
    target = aot.TARGETS["cuda:90"]
    full, sample = aot.configs(target, ["softmax", "swiglu"]), aot.configs(target, ["softmax", "swiglu"], 2)
    names = [(c.op, c.kernel_name) for c in full]
    assert sorted({(c.op, c.kernel_name) for c in sample}) == sorted(set(names)) and len(sample) == 2 * len(set(names))
    for key in set(names):
        group = [c for c in full if (c.op, c.kernel_name) == key]
        assert [c for c in sample if (c.op, c.kernel_name) == key] == [group[0], group[-1]]


@spills_of_that_triton
def test_no_spills_fails_a_spilling_kernel_naming_it():
    run = _python("-m", "tile_kernels.cli", "aot", "--target", "cuda:90", "--op", "apply_rotary", "--jobs", "1",
                  "--quiet", "--no-spills")  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr
    assert re.search(r"FAILED cuda:90: apply_rotary/rotary_kernel\[BLOCK=2, .* spills \d+ bytes a thread", run.stderr)
    assert "cuda:90: 2 failed" in run.stdout, run.stdout


def test_cuda_occupancy_counts_as_the_occupancy_calculator():
    """Blocks an SM: registers from four 16K sub-partitions in 256-register warp units, shared memory in 128-byte
    units plus 1 KiB a block, 2048 threads, 32 blocks."""
    sm90, sm80 = aot.TARGETS["cuda:90"], aot.TARGETS["cuda:80"]
    assert aot._cuda_occupancy(255, 8, 229376, sm90) == 1  # the flash-attention forward: registers and shared memory
    assert aot._cuda_occupancy(128, 4, 0, sm90) == 4  # 16 warps of 4096 registers
    assert aot._cuda_occupancy(33, 2, 0, sm90) == 24  # 1280-register warps: 12 a sub-partition, 48 warps
    assert aot._cuda_occupancy(32, 16, 64, sm90) == 4  # 2048 threads
    assert aot._cuda_occupancy(16, 1, 0, sm90) == 32  # 32 blocks
    assert aot._cuda_occupancy(32, 4, 90 * 1024, sm80) == 1 and aot._cuda_occupancy(32, 4, 90 * 1024, sm90) == 2


@pytest.mark.parametrize("op", sorted(SLOW_TO_COMPILE))
@pytest.mark.parametrize("target", list(aot.TARGETS))
def test_a_representative_flash_attention_compiles_for(target, op):
    """bfloat16, head dim 128: each of its four kernels (forward, backward preprocess, dK/dV, dQ) in the first
    configuration the target's plans list (the one the heuristics pick by default), for fixed-length and packed
    (varlen) sequences."""
    script = f"""
        from tile_kernels.core import aot
        t = aot.TARGETS[{target!r}]
        picked = [c for c in aot.configs(t, [{op!r}]) if isinstance(c, aot.KernelConfig)
                  and "BLOCK_D=128," in c.describe() and "*bf16" in c.describe()]
        for name in KERNELS:
            cfg = next(c for c in picked if c.kernel_name == name)
            aot.compile_config(cfg, t)
            print("compiled", cfg.describe().split("[")[0])
    """.replace("KERNELS", repr(FLASH_ATTENTION_KERNELS))
    run = _python("-c", textwrap.dedent(script))
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(f"compiled {op}/") == 4, run.stdout + run.stderr


@pytest.mark.parametrize("target, wide_load", [("cuda:90", "ld.global.v4.b32"), ("hip:gfx942", "dwordx4")])
def test_the_matrix_compiles_the_vectorized_build(target, wide_load):
    """Pointers are compiled 16-byte aligned, as the launchers see the executors' buffers: rms_norm's forward at 4096
    (widths in units of 16) loads 16 bytes at a time, as it does on the GPU."""
    script = f"""
        from tile_kernels.core import aot
        t = aot.TARGETS[{target!r}]
        cfg = next(c for c in aot.configs(t, ["rms_norm"]) if isinstance(c, aot.KernelConfig)
                   and c.kernel_name == "norm_fwd_kernel" and "BLOCK_N=4096," in c.describe()
                   and "UNIT=16" in c.describe())
        asm = aot.compile_config(cfg, t).asm
        print(asm.get("ptx") or asm["amdgcn"])
    """
    run = _python("-c", textwrap.dedent(script))
    assert run.returncode == 0, run.stderr
    assert wide_load in run.stdout


def test_configs_follow_the_targets_warp_width():
    """The same op picks fewer warps on 64-wide wavefronts: configurations are derived per target."""
    cuda = {c.describe().split(";")[0]: c.num_warps for c in aot.configs(aot.TARGETS["cuda:90"], ["softmax"])}
    hip = {c.describe().split(";")[0]: c.num_warps for c in aot.configs(aot.TARGETS["hip:gfx942"], ["softmax"])}
    assert cuda.keys() == hip.keys()
    assert all(hip[k] <= cuda[k] for k in cuda) and any(hip[k] < cuda[k] for k in cuda)


def test_a_kernel_broken_for_one_target_fails_naming_it():
    script = """
        import triton, triton.language as tl
        from tile_kernels.core import aot

        @triton.jit
        def nvidia_only(X, Y):
            i = tl.arange(0, 64)
            y = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [tl.load(X + i)], dtype=tl.int32, is_pure=True,
                                          pack=1)  # PTX: no AMD equivalent
            tl.store(Y + i, y)

        cfg = aot.KernelConfig("demo", nvidia_only, (("X", "*i32"), ("Y", "*i32")), (), 4, 2)
        aot.compile_config(cfg, aot.TARGETS["cuda:90"])
        print("cuda:90 ok")
        try:
            aot.compile_config(cfg, aot.TARGETS["hip:gfx942"])
        except aot.AotError as e:
            print("ERR", e)
    """
    with open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"aot_broken_{os.getpid()}.py"), "w") as f:
        f.write(textwrap.dedent(script))  # triton.jit needs the source in a file
    run = _python(f.name)
    assert "cuda:90 ok" in run.stdout, run.stdout + run.stderr
    assert "ERR hip:gfx942: demo/nvidia_only[" in run.stdout and "failed to compile" in run.stdout, run.stdout


@pytest.mark.parametrize("target", ["cuda:90", "hip:gfx942"])
def test_the_resource_report_finds_spills(target, tmp_path):
    """aot.resources reads what the compiler allotted: a row kept live across its reduction, 32 values a thread, fits
    in registers; 512 values a thread (one warp), more than a CUDA thread's 255 registers or an AMD lane's 512 VGPRs
    with its addresses, spill to local / scratch memory, and the report says so."""
    script = f"""
        import triton, triton.language as tl
        from tile_kernels.core import aot

        @triton.jit
        def normalize(X, Y, BLOCK: tl.constexpr):
            i = tl.arange(0, BLOCK)
            x = tl.load(X + i)
            tl.store(Y + i, x / tl.sum(x * x, axis=0))  # x stays live across the reduction

        t = aot.TARGETS[{target!r}]
        for values in (32, 512):  # a thread's (lane's) share of the row, one warp (wavefront)
            cfg = aot.KernelConfig("demo", normalize, (("X", "*fp32"), ("Y", "*fp32"), ("BLOCK", "constexpr")),
                                   (("BLOCK", values * t.warp_size),), 1, 1)
            used = aot.resources(aot.compile_config(cfg, t), t)
            print(values, used.registers, used.spill_bytes, used.occupancy, used.describe())
    """
    path = tmp_path / "spill.py"
    path.write_text(textwrap.dedent(script))  # triton.jit needs the source in a file
    run = _python(str(path))
    assert run.returncode == 0, run.stdout + run.stderr
    small, large = ([int(v) for v in line.split()[1:4]] for line in run.stdout.strip().splitlines()[-2:])
    assert 0 < small[0] < 255 and small[1] == 0 and small[2] >= 1, run.stdout  # registers, spilled bytes, occupancy
    assert large[1] > 0, run.stdout


@needs_tilelang
def test_tilelang_kernels_join_the_matrix_for_their_targets():
    """rms_norm's TileLang kernels, every kernel in every dtype, for sm_80 / sm_90a (nvcc builds) and gfx942
    (source); the other targets have none."""
    for name in aot.TARGETS:
        tilelang = [c for c in aot.configs(aot.TARGETS[name], ["rms_norm"]) if isinstance(c, aot.TileLangConfig)]
        expected = 15 if name in aot.TILELANG_TARGETS else 0  # 4 kernels + the column sum, 3 dtypes
        assert len(tilelang) == expected, name
    names = {c.kernel_name for c in aot.tilelang_configs(aot.TARGETS["hip:gfx942"], ["rms_norm"])}
    assert names == {"rms_norm_fwd", "rms_norm_fwd_residual", "rms_norm_bwd", "rms_norm_bwd_dh", "rms_norm_colsum"}


@needs_tilelang
def test_a_broken_tilelang_kernel_fails_naming_kernel_config_and_target():
    broken = aot.TileLangConfig("rms_norm", "rms_norm_bwd", "not_a_dtype", "float32")
    for target in aot.TILELANG_TARGETS:
        with pytest.raises(aot.AotError, match=rf"{target}: rms_norm/rms_norm_bwd\[tilelang; x=not_a_dtype, "
                           r"weight=float32\] failed to lower"):  # fmt: skip
            aot.compile_config(broken, aot.TARGETS[target])


@needs_tilelang
def test_tilelang_flash_attention_joins_the_matrix_in_half_precision():
    """Its TileLang forward: 3 head-dim buckets x (padded or not) x softcap, plus the no-keys kernel, in float16 and
    bfloat16 (no float32 kernel: the backend refuses float32), for each TileLang target. (Its backward, sm_90a only,
    is not in the matrix of every target: sm90_variants.)"""
    for name in aot.TARGETS:
        cfgs = [c for c in aot.configs(aot.TARGETS[name], ["flash_attention"]) if isinstance(c, aot.TileLangConfig)]
        assert len(cfgs) == (26 if name in aot.TILELANG_TARGETS else 0), name
        assert {c.x_dtype for c in cfgs} <= {"float16", "bfloat16"}


# what each target's build of the bf16 head-dim-128 forward must (and must not) contain: Hopper's TMA loads / stores,
# wgmma and the producer / consumer register split of warp specialization on sm_90a only; cp.async + mma.sync on
# sm_80; MFMA on gfx942
_HOPPER = ("tl::tma_load(", "tl::tma_store(", "wgmma_ss<", "wgmma_rs<", "warpgroup_reg_alloc", "warpgroup_reg_dealloc")
_EXPECTED = {
    "cuda:90": (_HOPPER, ()),
    "cuda:80": (("cp_async_gs", "mma_sync"), _HOPPER),
    "hip:gfx942": (("mfma",), _HOPPER),
}


def _built(target: str) -> bool:
    """Whether the matrix builds (nvcc) rather than only lowers the target's TileLang kernels."""
    return aot.TILELANG_TARGETS[target][1]


@needs_tilelang
@pytest.mark.parametrize("target", list(aot.TILELANG_TARGETS))
def test_tilelang_flash_attention_builds_with_hopper_paths_only_on_sm90a(target):
    """The representative forward (bf16, head dim 128, no softcap) through the matrix's own step: lowered and built
    with nvcc for sm_90a / sm_80, lowered for gfx942; the padded-head-dim kernel (TMA off) lowers too."""
    cfg = aot.TileLangConfig("flash_attention", "flash_fwd_d128", "bfloat16", "bfloat16")
    if _built(target) and backends.find_cuda_home() is None:
        pytest.skip("no CUDA toolkit (nvcc)")
    compiled = aot.compile_config(cfg, aot.TARGETS[target])
    source = compiled.get_kernel_source() if _built(target) else compiled.kernel_source
    present, absent = _EXPECTED[target]
    assert [w for w in present if w not in source] == [], target
    assert [w for w in absent if w in source] == [], target
    lower = backends.module("flash_attention", "tilelang").lower
    source = lower("flash_fwd_d64_pad_softcap", "float16", "float16", aot.TILELANG_TARGETS[target][0]).kernel_source
    assert "tl::tma_load(" not in source and "tanh" not in source  # no TMA; the softcap's tanh from exp2


def _sm90a_source(kernel: str) -> str:
    """flash_attention's TileLang `kernel` (bf16) built for sm_90a through the matrix's step, or lowered where nvcc is
    missing: its CUDA source."""
    cfg = aot.TileLangConfig("flash_attention", kernel, "bfloat16", "bfloat16")
    if _built("cuda:90") and backends.find_cuda_home() is not None:
        return aot.compile_config(cfg, aot.TARGETS["cuda:90"]).get_kernel_source()
    lower = backends.module("flash_attention", "tilelang").lower
    return lower(kernel, "bfloat16", "bfloat16", aot.TILELANG_TARGETS["cuda:90"][0]).kernel_source


@needs_tilelang
def test_tilelang_flash_attention_overlap_schedule_issues_both_gemms_before_waiting():
    """The TileLang forward in an OVERLAP configuration (CONFIGS): in the steady-state loop S(t)'s and P(t-1) V(t-1)'s
    wgmmas are issued, then the wait for all but the last group, K(t)'s release after it, V(t-1)'s after the full wait;
    the producer / consumer register split; the output tile is q's."""
    config = next(i for i, c in enumerate(CONFIGS["sm90"][128]) if c[4] and c[2] == 2)  # OVERLAP in 2 stages
    source = _sm90a_source(f"flash_fwd_d128_c{config}" if config else "flash_fwd_d128")
    loop = source[source.index("for (int t = 1;") :]
    assert_in_order(loop, ("wgmma_ss<", "wgmma_rs<", "wait_wgmma<1>", "k_empty[", "wait_wgmma<0>", "v_empty["))
    assert "warpgroup_reg_alloc<240>" in source and "warpgroup_reg_dealloc<24>" in source
    assert "o_tile" not in source and "tl::tma_store(OUT_desc, (&(((bfloat16_t*)q_tile)" in source


@needs_tilelang
def test_tilelang_flash_attention_backward_ws_schedule_waits_once_for_three_gemms():
    """The TileLang backward's "ws" schedule (BWD_CONFIGS): per step S^T's and dP^T's wgmmas issued, P^T after the
    first wait, dV issued, dS^T after the second, dK and dQ issued, one full wait, then Q's and dO's release; the dQ
    tile fenced for the async proxy and handed to the TMA warp, whose reduce-add follows its wait; dK, dV leave through
    K's and V's tiles."""
    kernel = next(f"flash_bwd_d128_c{i}" for i, c in enumerate(BWD_CONFIGS["sm90"][128]) if c[4] == "ws")
    source = _sm90a_source(kernel)
    consumer = source[source.index("for (int step = 0;") : source.index("warpgroup_reg_dealloc<24>")]
    assert_in_order(consumer, ("wgmma_ss<", "wgmma_ss<", "wait_wgmma<1>", "wgmma_rs<", "wait_wgmma<1>", "wgmma_rs<",
                         "wgmma_ss<", "wait_wgmma<0>", "q_empty[", "do_empty[", "dq_empty[", "fence_proxy_async",
                         "dq_full["))  # fmt: skip
    assert consumer.count("wait_wgmma<") == 3 and "warpgroup_wait<" not in consumer
    producer = source[source.index("warpgroup_reg_dealloc<24>") :]
    assert_in_order(producer, ("dq_full[", "tma_store_add(DQ_ACC_desc", "tma_store_wait", "dq_empty["))
    assert "dk_tile" not in source and "tl::tma_store(DK_desc, (&(((bfloat16_t*)k_tile)" in source


@needs_tilelang
def test_tilelang_mla_decode_joins_the_matrix_for_sm90a_only():
    """Its TileLang split kernel (Hopper only: module AOT_TARGETS): contiguous / paged x whole / partial, in float16
    and bfloat16, for cuda:90 only; lowered for sm_90a it has TMA loads, wgmma, and the producer / consumer register
    split of warp specialization."""
    for name in aot.TARGETS:
        cfgs = [c for c in aot.configs(aot.TARGETS[name], ["mla_decode"]) if isinstance(c, aot.TileLangConfig)]
        assert len(cfgs) == (8 if name == "cuda:90" else 0), name
    lower = backends.module("mla_decode", "tilelang").lower
    source = lower("mla_decode_paged", "bfloat16", "bfloat16", aot.TILELANG_TARGETS["cuda:90"][0]).kernel_source
    for needed in ("tl::tma_load(", "tl::tma_store(", "wgmma_ss<", "warpgroup_reg_alloc", "warpgroup_reg_dealloc"):
        assert needed in source, needed
