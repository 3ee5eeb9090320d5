"""The norms' weight-gradient partial sums (rows.sum_partials_kernel) timed alone on this machine's GPU over its
constexprs, at the partial buffers a Llama training step's rms_norm backward writes (programs x width fp32, as the
norms' backward plan sizes them for 8192 rows), and the whole rms_norm backward plan beside them. do_bench device
time in us; the shipped configuration is marked *.

    python benchmarks/sweep_sum_partials.py
"""

from __future__ import annotations

import torch
import triton.testing

from tile_kernels.core import norms
from tile_kernels.core.rows import sum_partials_kernel
from tile_kernels.torch._runtime import Executor, target

ROWS = 8192
WIDTHS = (2048, 4096)
CONFIGS = [(block_n, tile, warps) for block_n in (8, 16, 32, 64) for tile in (2048, 4096, 8192) for warps in (4, 8)]


def sweep(n: int, device, tgt) -> None:
    plan = norms.backward(1, ROWS, n, is_rms=True, x_dtype="bfloat16", weight_dtype="bfloat16", has_bias=False,
                          has_dh=True, target=tgt)  # fmt: skip
    norm_launch, shipped = plan.launches
    programs = norm_launch.grid[0]
    inputs = [torch.randn(ROWS, n, device=device, dtype=torch.bfloat16) for _ in range(2)]
    inputs += [torch.rand(n, device=device, dtype=torch.bfloat16) + 0.5, torch.rand(ROWS, device=device) + 0.5]
    inputs += [torch.randn(ROWS, n, device=device, dtype=torch.bfloat16)]
    run = Executor(plan)
    whole = triton.testing.do_bench(lambda: run(*inputs, device=device)) * 1e3
    shipped_config = (shipped.constexprs["BLOCK_N"], shipped.constexprs["BLOCK_G"], shipped.num_warps)
    print(f"width {n}: {programs} partial rows ({programs * n * 4 / 2**20:.1f} MiB); whole backward plan "
          f"{whole:.1f} us; shipped sum (BLOCK_N, BLOCK_G, warps) {shipped_config}", flush=True)  # fmt: skip
    partial = torch.randn(programs, n, device=device)
    out = torch.empty(n, device=device, dtype=torch.bfloat16)
    want = partial.sum(0)
    rows = []
    for block_n, tile, warps in CONFIGS:
        block_g = max(1, tile // block_n)

        def call(block_n=block_n, block_g=block_g, warps=warps):
            sum_partials_kernel[(triton.cdiv(n, block_n), 1)](partial, programs, n // 16, out, BLOCK_G=block_g,
                                                               BLOCK_N=block_n, UNIT=16, num_warps=warps)  # fmt: skip

        call()
        torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2)
        us = triton.testing.do_bench(call) * 1e3
        mark = "*" if (block_n, block_g, warps) == shipped_config else " "
        rows.append((us, f"  {mark} BLOCK_N {block_n:3d} BLOCK_G {block_g:4d} warps {warps}: {us:6.1f} us"))
    for _, line in sorted(rows)[:8]:
        print(line)
    print("\n".join(line for _, line in rows if line.startswith("  *")), flush=True)


def main() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    tgt = target(device)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    for n in WIDTHS:
        sweep(n, device, tgt)


if __name__ == "__main__":
    main()
