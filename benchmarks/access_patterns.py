"""Where the 4-byte passes lose to a copy: the same traffic with no arithmetic, pattern by pattern.

``quantize`` and ``dbias_quantize`` read 2 bytes and write 2 per element, like a copy, but in
whole waves of long-lived programs they reached 0.80-0.85 of the copy bandwidth where a Triton
copy of the same size reaches 0.88-0.95 (``copy_ceiling.py``). Here one kernel moves bytes the way
the passes do (column strips of ``block_m x block_n`` tiles walked down row groups, four
interleaved row sets per tile) and computes nothing: each FP8 "code" is the high byte of the bf16
input. It writes the rows back as bf16 (a strip-shaped copy), or as one byte per element, with or
without the transposed copy packed into words as the passes write it. Each pattern runs persistent
(one whole wave at the kernel's residency, as in the passes' grid) and with one tile per program.
Every pattern's output is checked (the shipped passes timed beside them are checked by
``bench_kernels.py``). Timed from CUDA graphs in one run, as fractions of the 2 GB copy; with
``--ncu`` the script instead launches each variant once at one size for Nsight Compute (DRAM bytes
read and written per variant).

    python benchmarks/access_patterns.py --out results/access_patterns
"""

from __future__ import annotations

import argparse
import importlib

import torch
import triton
import triton.language as tl

from bench_kernels import SIZES, _resident_per_sm
from common import copy_bandwidth_gbps, environment, graph_ms, parse_sizes, print_table, write_results
from copy_ceiling import triton_copy
from lightning_fuse.kernels._launch import LaunchConfig, launch_config

ddq = importlib.import_module("lightning_fuse.kernels.dact_dbias_quantize")


@triton.jit
def _pattern_kernel(src_ptr, out_ptr, out_t_ptr, M, N, rows_per_group, ROW_BYTES: tl.constexpr,
                    TRANSPOSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    quarter = tl.arange(0, BLOCK_M // 4)
    for m0 in range(pid_m * rows_per_group, pid_m * rows_per_group + rows_per_group, BLOCK_M):
        r0 = m0 + 4 * quarter
        k0, k1, k2, k3 = ddq._row_masks(r0, M, mask_n)
        t0, t1, t2, t3 = ddq._load_rows(src_ptr, r0, offs_n, k0, k1, k2, k3, N, 1)
        rows = out_ptr + offs_n[None, :]
        if ROW_BYTES == 2:
            tl.store(rows + r0[:, None] * N, t0, mask=k0)
            tl.store(rows + (r0 + 1)[:, None] * N, t1, mask=k1)
            tl.store(rows + (r0 + 2)[:, None] * N, t2, mask=k2)
            tl.store(rows + (r0 + 3)[:, None] * N, t3, mask=k3)
        c0 = (t0.to(tl.int16, bitcast=True).to(tl.int32) >> 8) & 0xFF
        c1 = (t1.to(tl.int16, bitcast=True).to(tl.int32) >> 8) & 0xFF
        c2 = (t2.to(tl.int16, bitcast=True).to(tl.int32) >> 8) & 0xFF
        c3 = (t3.to(tl.int16, bitcast=True).to(tl.int32) >> 8) & 0xFF
        if ROW_BYTES == 1:
            codes = out_ptr.to(tl.pointer_type(tl.uint8)) + offs_n[None, :]
            tl.store(codes + r0[:, None] * N, c0.to(tl.uint8), mask=k0)
            tl.store(codes + (r0 + 1)[:, None] * N, c1.to(tl.uint8), mask=k1)
            tl.store(codes + (r0 + 2)[:, None] * N, c2.to(tl.uint8), mask=k2)
            tl.store(codes + (r0 + 3)[:, None] * N, c3.to(tl.uint8), mask=k3)
        if TRANSPOSE:
            ddq.store_packed_transpose(out_t_ptr, m0, quarter, offs_n, mask_n, M, M, c0, c1, c2, c3)


# name -> (row bytes, transposed copy)
PATTERNS = {"strip copy (2 B rows)": (2, False), "1 B rows": (1, False), "1 B rows + T": (1, True),
            "T only": (0, True)}
# (block_m, block_n, warps)
TILES = [(64, 64, 8), (64, 64, 4), (128, 128, 8)]


def _grid(m, n, bm, bn, per_sm, sms):
    """(rows_per_group, groups): the passes' whole-wave row groups at ``per_sm`` programs per
    multiprocessor, or one tile per program (``per_sm=0``)."""
    strips, row_tiles = -(-n // bn), -(-m // bm)
    groups = row_tiles if per_sm == 0 else max(1, min(row_tiles, per_sm * sms // strips))
    cfg = LaunchConfig(bm, bn, 1, groups)
    return cfg.row_groups(m)


def _variants(m, n, x, sms):
    """(name, bytes per element, launch, check) for every pattern, tile and grid at ``m x n``, and the
    shipped passes."""
    out16 = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    out8 = torch.empty(m, n, dtype=torch.uint8, device="cuda")
    out_t = torch.empty(n, m, dtype=torch.uint8, device="cuda")
    codes = (x.view(torch.int16).to(torch.int32) >> 8 & 0xFF).to(torch.uint8)
    variants = [("Triton copy, flat", 4, lambda: triton_copy(x, out16), lambda: torch.equal(out16, x))]
    for (name, (row_bytes, transpose)), (bm, bn, warps) in ((p, t) for p in PATTERNS.items() for t in TILES):
        out = out16 if row_bytes == 2 else out8

        def launch(rows_per_group, groups, bm=bm, bn=bn, warps=warps, out=out, row_bytes=row_bytes,
                   transpose=transpose):
            return _pattern_kernel[(-(-n // bn), groups)](x, out, out_t, m, n, rows_per_group, ROW_BYTES=row_bytes,
                                                          TRANSPOSE=transpose, BLOCK_M=bm, BLOCK_N=bn,
                                                          num_warps=warps)

        def check(row_bytes=row_bytes, transpose=transpose):
            ok = True
            if row_bytes == 2:
                ok &= torch.equal(out16, x)
            if row_bytes == 1:
                ok &= torch.equal(out8, codes)
            if transpose:
                ok &= torch.equal(out_t, codes.t())
            return bool(ok)

        resident = _resident_per_sm(launch(*_grid(m, n, bm, bn, 1, sms)), warps)
        for per_sm in (resident, 0):
            rows_per_group, groups = _grid(m, n, bm, bn, per_sm, sms)
            grid = f"{per_sm}/SM whole waves" if per_sm else "one tile per program"
            variants.append((f"{name}, {bm}x{bn} {warps}w, {grid}", 2 + row_bytes + transpose,
                             lambda a=rows_per_group, b=groups, f=launch: f(a, b), check))
    scale, amax = torch.tensor(8.0, device="cuda"), torch.zeros(1, device="cuda")
    fp8 = torch.empty(m, n, dtype=torch.float8_e4m3fn, device="cuda")
    fp8_t = torch.empty(n, m, dtype=torch.float8_e4m3fn, device="cuda")
    for pass_name, grad_pass in (("quantize", False), ("dbias_quantize", True)):
        cfg = launch_config(pass_name, m, n, x.device)
        dbias = torch.empty(n, dtype=torch.float32, device="cuda")
        for transpose in (True, False):
            variants.append((f"{pass_name} shipped{'' if transpose else ', no T'}", 3 + transpose,
                             lambda c=cfg, t=transpose, g=grad_pass, d=dbias: ddq._launch(
                                 x, None, 0, scale, 1, amax, t, g, True, c, fp8, fp8_t, d if g else None, False),
                             lambda: True))
    return variants


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/access_patterns")
    parser.add_argument("--sizes", default=",".join(f"{m}x{n}" for m, n in SIZES))
    parser.add_argument("--ncu", action="store_true", help="launch each variant once (for Nsight Compute)")
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sizes = parse_sizes(args.sizes)
    copy_gbps = None if args.ncu else copy_bandwidth_gbps()
    print(environment(), "" if args.ncu else f" copy bandwidth {copy_gbps:.0f} GB/s")
    rows = []
    for m, n in sizes:
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        for name, nbytes, launch, check in _variants(m, n, x, sms):
            launch()
            torch.cuda.synchronize()
            assert check(), f"{name} at {m}x{n} wrote wrong bytes"
            if args.ncu:
                print(f"launched {name}")
                continue
            ms = graph_ms(launch)
            rows.append(dict(M=m, N=n, variant=name, ms=ms, frac_copy=nbytes * m * n / ms / 1e6 / copy_gbps))
            print(f"{m}x{n} {name}: {ms:.4f} ms {rows[-1]['frac_copy']:.3f}", flush=True)
        if not args.ncu:
            write_results(args.out, "access_patterns", rows, {"copy_GBps": copy_gbps})
    if rows:
        print_table(rows, ["M", "N", "variant", "ms", "frac_copy"])


if __name__ == "__main__":
    main()
