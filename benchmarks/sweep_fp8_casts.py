"""Tile of the per-token FP8 casts (fp8_quantize with block_rows 1, swiglu_fp8_quantize): fp8_quantize.ROW_TILE =
(rows, columns, warps) of a program, timed on this machine's GPU (triton.testing.do_bench_cudagraph: device time)
at 2^26 elements, bf16, over row widths, beside torch.compile of the same math. Each line: us and % of the copy
bandwidth measured in the same run (algorithmic bytes: inputs read once, codes and scales written once); the
default tile is marked *.

    python benchmarks/sweep_fp8_casts.py [--tile 16,256,4 ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import functools

import numpy as np
import torch
import triton.testing
from sweep_log import SweepLog

import tile_kernels.torch as tk
from tile_kernels.core import fp8_quantize
from tile_kernels.torch import _runtime

WIDTHS = (1024, 4096, 16384)
TILES = ((1, 1024, 4), (1, 2048, 4), (1, 2048, 8), (1, 4096, 8), (1, 4096, 16), (2, 1024, 4), (2, 2048, 8),
         (4, 512, 4), (4, 1024, 4), (4, 1024, 8), (8, 512, 4), (8, 1024, 4), (8, 1024, 8), (16, 256, 4))  # fmt: skip


def _compiled_quantize(x):
    blocks = x.float().unflatten(-1, (-1, 128))
    scale = torch.where((amax := blocks.abs().amax(-1, keepdim=True)) > 0, amax / 448.0, 1.0)
    return (blocks / scale).to(torch.float8_e4m3fn).flatten(-2), scale.squeeze(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the lines to this file")
    parser.add_argument("--tile", action="append", help="only this tile, as rows,columns,warps (repeatable)")
    args = parser.parse_args()
    tiles = [tuple(map(int, t.split(","))) for t in args.tile] if args.tile else TILES
    emit = SweepLog(args.out)

    src = torch.empty(2**28, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_gbs = 2 * src.numel() / triton.testing.do_bench_cudagraph(lambda: dst.copy_(src)) / 1e6
    emit(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
         f"copy {copy_gbs:.0f} GB/s")  # fmt: skip
    quantize = torch.compile(_compiled_quantize)
    swiglu_quantize = torch.compile(lambda g, u: _compiled_quantize(torch.nn.functional.silu(g) * u))
    default = fp8_quantize.ROW_TILE
    for k in WIDTHS:
        x = torch.randn(2**26 // k, k, device="cuda", dtype=torch.bfloat16)
        up = torch.randn_like(x)
        # the bench's data (fp8_quantize.sample: blocks scaled by powers of 2, one in 8 all zero)
        sample = fp8_quantize.sample(np.random.default_rng(0), x.shape, "float32")["x"]
        x_sample = torch.from_numpy(sample).to("cuda", torch.bfloat16)
        cases = {  # name: (call, compiled peer, bytes)
            "fp8_quantize": (functools.partial(tk.fp8_quantize, x), functools.partial(quantize, x),
                             x.numel() * (2 + 1 + 4 / 128)),
            "fp8_quantize, sample data": (functools.partial(tk.fp8_quantize, x_sample),
                                          functools.partial(quantize, x_sample), x.numel() * (2 + 1 + 4 / 128)),
            "swiglu_fp8_quantize": (functools.partial(tk.swiglu_fp8_quantize, x, up),
                                    functools.partial(swiglu_quantize, x, up), x.numel() * (4 + 1 + 4 / 128)),
        }  # fmt: skip
        for name, (call, peer, nbytes) in cases.items():
            ms = triton.testing.do_bench_cudagraph(peer)
            emit(f"{name} {x.shape[0]}x{k} torch.compile: {ms * 1e3:.1f} us {100 * nbytes / ms / 1e6 / copy_gbs:.0f}%")
            best = None
            for tile in tiles:
                fp8_quantize.ROW_TILE = tile
                _runtime._cached_executor.cache_clear()
                ms = triton.testing.do_bench_cudagraph(call)
                best = min(best or (ms, tile), (ms, tile))
                mark = "*" if tile == default else " "
                emit(
                    f"{name} {x.shape[0]}x{k} {mark}{tile}: {ms * 1e3:.1f} us {100 * nbytes / ms / 1e6 / copy_gbs:.0f}%"
                )
            emit(f"BEST {name} {x.shape[0]}x{k}: {best[1]} {best[0] * 1e3:.1f} us")
            fp8_quantize.ROW_TILE = default
            _runtime._cached_executor.cache_clear()
    emit.save()


if __name__ == "__main__":
    main()
