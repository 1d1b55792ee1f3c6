"""What plain traffic of the same size reaches: the ceiling the 4-byte passes are measured against.

The kernel table gives every pass as a fraction of one copy bandwidth, measured on a 2 GB copy. A
smaller pass pays the same start and end (the first loads' round trip with every multiprocessor
asking at once, the last stores' drain) over fewer bytes. Here, at the kernel table's sizes, in one
run: a Triton copy of an ``M x N`` bf16 tensor (2 bytes read and 2 written per element, the traffic
of ``quantize`` and ``dbias_quantize``; one 8 KB tile per program, CUDA-graph median like the
passes), ``torch``'s own copy (CUDA events: captured in a graph it becomes a slower memcpy node),
and the two passes at their shipped launches, each as a fraction of the 2 GB copy.

    python benchmarks/copy_ceiling.py --out results/copy_ceiling
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from bench_kernels import SIZES
from common import copy_bandwidth_gbps, environment, graph_ms, median_ms, print_table, write_results
from lightning_fuse.kernels import dbias_quantize, quantize


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def triton_copy(src: torch.Tensor, dst: torch.Tensor, block: int = 4096) -> None:
    _copy_kernel[(triton.cdiv(src.numel(), block),)](src, dst, src.numel(), BLOCK=block, num_warps=4)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/copy_ceiling")
    args = parser.parse_args()
    copy_gbps = copy_bandwidth_gbps()
    print(f"{environment()}  copy bandwidth {copy_gbps:.0f} GB/s")
    rows = []
    for m, n in SIZES:
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        dst = torch.empty_like(x)
        triton_copy(x, dst)
        assert torch.equal(dst, x), "the Triton copy wrote wrong values"
        scale, amax = torch.tensor(8.0, device="cuda"), torch.zeros(1, device="cuda")
        nbytes = 4 * m * n
        timings = {
            "Triton copy (graph)": graph_ms(lambda: triton_copy(x, dst)),
            "torch copy_ (events)": median_ms(lambda: dst.copy_(x)),
            "quantize (graph)": graph_ms(lambda: quantize(x, scale=scale, fp8_dtype=torch.float8_e4m3fn, amax=amax,
                                                          transpose=True)),
            "dbias_quantize (graph)": graph_ms(lambda: dbias_quantize(x, scale=scale, fp8_dtype=torch.float8_e5m2,
                                                                      amax=amax, transpose=True)),
        }
        for name, ms in timings.items():
            rows.append(dict(M=m, N=n, traffic=name, ms=ms, frac_copy=nbytes / ms / 1e6 / copy_gbps))
        write_results(args.out, "copy_ceiling", rows, {"copy_GBps": copy_gbps})
    print_table(rows, ["M", "N", "traffic", "ms", "frac_copy"])


if __name__ == "__main__":
    main()
