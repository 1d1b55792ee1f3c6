"""The bias gradient's pass with bf16 and with fp16 inputs of the same values, in buffers placed anew
between trials (GPU).

The H200 kernel table of 2026-12-06 had ``dbias_quantize`` 7-8% slower with bf16 inputs than with
fp16 at the three larger sizes, where the table before had them within 0.2% and the two builds'
row loops compile alike (``kernel_isa.py --only dbias --inputs bf16,fp16``). This separates the
input dtype from where the buffers sit: each trial allocates new inputs and outputs after a pad of a
different size (earlier trials' buffers kept, so none is reused), then times both dtypes twice, in
turn, through the pass's launcher into those outputs (``launch``) and through the public function,
which allocates its outputs on every call (``public``). If the gap follows the trial, it is the
placement; if it follows the dtype in every trial, it is the dtype.

    cd benchmarks && python input_dtypes.py --out results/input_dtypes
"""

from __future__ import annotations

import argparse

import torch

from common import copy_bandwidth_gbps, environment, graph_ms, parse_sizes, print_table, write_results
from lightning_fuse.kernels import dbias_quantize
from lightning_fuse.kernels._launch import launch_config
from lightning_fuse.kernels.dact_dbias_quantize import _launch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
GRAD = torch.float8_e5m2


def trial(m, n, values, pad_mb, keep, copy_gbps, index):
    keep.append(torch.empty(pad_mb * 2**20 + 2**21, dtype=torch.uint8, device="cuda"))  # moves what follows
    scale = torch.tensor(2048.0, device="cuda")
    amax = torch.zeros(1, device="cuda")
    out = torch.empty(m, n, dtype=torch.uint8, device="cuda")
    out_t = torch.empty(n, m, dtype=torch.uint8, device="cuda")
    inputs = {name: values.to(dtype) for name, dtype in DTYPES.items()}
    dbias = {name: torch.empty(n, dtype=dtype, device="cuda") for name, dtype in DTYPES.items()}
    keep += [out, out_t, *inputs.values()]
    times = {}
    for _ in range(2):
        for name, grad in inputs.items():
            cfg = launch_config("dbias_quantize", m, n, grad.device, grad.dtype)
            times.setdefault(("launch", name), []).append(graph_ms(
                lambda: _launch(grad, None, 0, scale, 2, amax, True, True, True, cfg, out, out_t, dbias[name], False),
                rep_ms=60))
            times.setdefault(("public", name), []).append(graph_ms(
                lambda: dbias_quantize(grad, scale=scale, fp8_dtype=GRAD, amax=amax, transpose=True), rep_ms=60))
    rows = []
    for (how, name), ts in times.items():
        best = min(ts)
        rows.append(dict(M=m, N=n, trial=index, pad_MB=pad_mb, call=how, dtype=name, us=best * 1e3,
                         frac_copy=m * n * 4 / best / 1e6 / copy_gbps))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="16384x6400,32768x8192")
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--out", default="results/input_dtypes")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("input_dtypes.py times GPU launches: no CUDA device here")
    copy_gbps = copy_bandwidth_gbps()
    print(f"{environment()}  copy bandwidth {copy_gbps:.0f} GB/s")
    rows, keep = [], []
    for m, n in parse_sizes(args.sizes):
        values = torch.randn(m, n, device="cuda")
        for index in range(args.trials):
            rows += trial(m, n, values, index * 97, keep, copy_gbps, index)
            print_table(rows[-4:], list(rows[-1]))
            write_results(args.out, "input_dtypes", rows, {"copy_GBps": copy_gbps})
    print_table(rows, list(rows[-1]))


if __name__ == "__main__":
    main()
