"""Sweep of decode_attention's split kernel (BLOCK_N, num_warps, num_stages) and of the split model's slots (split
programs an SM; --programs N sets PROGRAMS_PER_SM and PAGED_PROGRAMS_PER_SM both, the module's values otherwise) on
the current GPU: device time of CUDA-graph replays (triton.testing.do_bench_cudagraph) and % of the copy bandwidth
`tile-kernels bench` measures, for the KV bytes, Llama-3-8B's GQA (32 query heads over 8 KV heads, head dim 128,
bf16; --fp8: FP8 e4m3 caches with per-tensor scales), every sequence full, at the benchmark's batch x context sizes,
contiguous and paged (pages of 16 and 64 in a shuffled block table), each configuration checked against the default's
output. Prints one line per configuration, the best per case last.

    python benchmarks/sweep_decode_attention.py [--size B,S ...] [--layout contiguous|16|64 ...] [--programs N ...]
        [--fp8] [--default-tiles] [--pdl on|off ...] [--out FILE]

--pdl off: the combine launched after the split launch finishes, not programmatically dependent on it
(core.pdl_combine); both given: each configuration timed both ways.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton.testing
from sweep_log import SweepLog

import tile_kernels.torch as tk
from tile_kernels.core import decode_attention as core
from tile_kernels.core.bench import DECODE_SIZES
from tile_kernels.torch import _runtime
from tile_kernels.torch.bench import _copy_gbs

HQ, HK, D = 32, 8, 128
LAYOUTS = (None, 16, 64)  # contiguous, then the page sizes
# BLOCK_N, num_warps, num_stages. Triton 3.6 double-buffers a paged cache's K / V tiles from 5 stages on (the page
# lookup takes stages of its own; with 2-4 the next block's loads wait for the current block's dots), contiguous ones
# from 3 (sm_90 SASS: the loop's cp.async wait)
CONFIGS = list(itertools.product((32, 64, 128), (4, 8), (2, 3, 5)))


def inputs(batch, seqlen, page, g, fp8=False):
    """(args, kwargs) of decode_attention: FP8 caches hold 4 x standard normals with k_scale 0.25, v_scale 0.5."""

    def rnd(*shape, cache=False):
        x = torch.randn(*shape, generator=g, device="cuda")
        return (x * 4).to(torch.float8_e4m3fn) if cache and fp8 else x.to(torch.bfloat16)

    scales = {"k_scale": 0.25, "v_scale": 0.5} if fp8 else {}
    q, lengths = rnd(batch, HQ, D), torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    if page is None:
        return (q, rnd(batch, seqlen, HK, D, cache=True), rnd(batch, seqlen, HK, D, cache=True), lengths, None), scales
    pages = seqlen // page
    table = torch.randperm(batch * pages, generator=g, device="cuda").to(torch.int32).view(batch, pages)
    kv = (rnd(batch * pages, page, HK, D, cache=True) for _ in range(2))
    return (q, *kv, lengths, table), scales


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", action="append", help="batch,context (default: the benchmark's DECODE_SIZES)")
    parser.add_argument("--layout", action="append", help="contiguous or a page size (default: contiguous, 16, 64)")
    parser.add_argument("--programs", action="append", type=int, help="split programs an SM (default: the module's)")
    parser.add_argument("--fp8", action="store_true", help="FP8 e4m3 caches")
    parser.add_argument("--default-tiles", action="store_true", help="only the default tiles (the split heuristic)")
    parser.add_argument("--pdl", action="append", choices=("on", "off"), help="the combine's PDL (default: on)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    sizes = [tuple(map(int, s.split(","))) for s in args.size] if args.size else DECODE_SIZES
    layouts = [None if x == "contiguous" else int(x) for x in args.layout] if args.layout else LAYOUTS
    cache_bytes = 1 if args.fp8 else 2
    say = SweepLog(args.out)
    copy = _copy_gbs(torch.device("cuda"))  # the bench's copy ceiling
    say(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, copy {copy:.0f} "
        f"GB/s, {'FP8 e4m3' if args.fp8 else 'bf16'} caches")  # fmt: skip
    default_config, default_slots = core.config, (core.PROGRAMS_PER_SM, core.PAGED_PROGRAMS_PER_SM)
    default_pdl = core.pdl_combine

    def use(config, programs, pdl="on"):
        """The split kernel's tiles (config: core.config's function), the model's slots (None: the module's) and
        whether the combine follows programmatically (pdl "on": the module's choice)."""
        core.config = config
        core.PROGRAMS_PER_SM, core.PAGED_PROGRAMS_PER_SM = default_slots if programs is None else (programs,) * 2
        core.pdl_combine = default_pdl if pdl == "on" else lambda splits, target: False
        _runtime._cached_executor.cache_clear()

    g = torch.Generator("cuda").manual_seed(0)
    for (batch, seqlen), page in itertools.product(sizes, layouts):
        case = f"{batch}x{seqlen} {'contiguous' if page is None else f'page {page}'}"
        x, kw = inputs(batch, seqlen, page, g, args.fp8)
        kv_gb = 2 * batch * seqlen * HK * D * cache_bytes / 1e9
        use(default_config, None)
        want = tk.decode_attention(*x, **kw)
        results = []
        configs = [(None, None, None), *([] if args.default_tiles else CONFIGS)]  # None: the default tiles
        for (block_n, warps, stages), programs, pdl in itertools.product(configs, args.programs or [None],
                                                                          args.pdl or ["on"]):  # fmt: skip
            tiles = (16, block_n, D, warps, stages)
            use(default_config if block_n is None else lambda *a, _c=tiles, **k: _c, programs, pdl)
            name = "default tiles" if block_n is None else (block_n, warps, stages)
            label = f"{name} programs/SM {programs or 'default'}" + (f" pdl {pdl}" if args.pdl else "")
            try:
                err = (tk.decode_attention(*x, **kw).float() - want.float()).abs().max().item()
                ms = triton.testing.do_bench_cudagraph(lambda x=x, kw=kw: tk.decode_attention(*x, **kw))
            except Exception as e:  # a configuration that does not compile (shared memory, registers)
                say(f"{case} {label}: {type(e).__name__}: {str(e)[:120]}")
                continue
            results.append((ms, label))
            say(f"{case} {label}: {ms * 1e3:.1f} us {kv_gb / ms * 1e3 / copy:.0%} of copy err {err:.3g}")
        ms, label = min(results)
        say(f"BEST {case}: {label} {ms * 1e3:.1f} us {kv_gb / ms * 1e3 / copy:.0%} of copy")
    use(default_config, None)
    say.save()


if __name__ == "__main__":
    main()
