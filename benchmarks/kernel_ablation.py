"""Where a kernel's time goes, without hardware counters: each pass timed whole and with one stage
left out (the transposed copy, every store, the activation), against reference ceilings measured in
the same run (device copy, read-only and write-only traffic).

Each row gives the bytes the variant moves, its device time (CUDA-graph median) and that rate as a
fraction of the copy bandwidth. A stage whose removal saves more time than its bytes account for is
where the pass loses bandwidth.

    python benchmarks/kernel_ablation.py --sizes 16384x6400 --out results/ablation
    # hardware counters of the shipped passes, on a machine where Nsight Compute reads them:
    ncu --clock-control none --set full -k regex:"_dact|_bias_act" python benchmarks/kernel_ablation.py --profile
"""

from __future__ import annotations

import argparse

import torch

from common import (copy_bandwidth_gbps, environment, graph_ms, median_ms, parse_sizes, print_table,
                    separate_sum_launch, write_results)
from lightning_fuse.kernels import bias_act
from lightning_fuse.kernels._launch import launch_config
from lightning_fuse.kernels.activations import activation_id
from lightning_fuse.kernels.dact_dbias_quantize import _launch

GELU_TANH = activation_id("gelu_tanh")


# pass -> (activation, FP8 code, bias gradient), each launched as the library launches it
PASSES = {"dact_dbias_quantize": (GELU_TANH, 2, True), "dbias_quantize": (0, 2, True), "quantize": (0, 1, False)}


def _buffers(m, n, dtype):
    """Random inputs (gradient, pre-activation), a scale, an amax, and the outputs of every pass."""
    grad = torch.randn(m, n, device="cuda", dtype=dtype)
    pre = torch.randn(m, n, device="cuda", dtype=dtype) * 2
    scale = torch.tensor(64.0, device="cuda")
    amax = torch.zeros(1, device="cuda")
    out = torch.empty(m, n, dtype=torch.uint8, device="cuda")
    out_t = torch.empty(n, m, dtype=torch.uint8, device="cuda")
    dbias = torch.empty(n, dtype=torch.float32, device="cuda")
    return grad, pre, scale, amax, out, out_t, dbias


def _second_sum_launch(fn):
    """``fn`` with the bias gradient summed by the pass's second launch (``separate_sum_launch``)."""
    def run():
        with separate_sum_launch():
            return fn()
    return run


def ablation(m, n, dtype, copy_gbps):
    eb = torch.tensor([], dtype=dtype).element_size()
    grad, pre, scale, amax, out, out_t, dbias = _buffers(m, n, dtype)
    rows = []

    def add(name, variant, nbytes, fn, graph=True):
        fn()
        # A copy captured in a CUDA graph becomes a memcpy node, much slower than the kernel an
        # eager copy launches (common.copy_bandwidth_gbps): the copy is timed with plain events.
        ms = graph_ms(fn, rep_ms=100) if graph else median_ms(fn)
        gbps = nbytes / ms / 1e6
        rows.append(dict(kernel=name, variant=variant, M=m, N=n, bytes_per_element=nbytes / (m * n), ms=ms,
                         GBps=gbps, frac_copy=gbps / copy_gbps))
        print_table(rows[-1:], list(rows[-1]))

    # Ceilings: what the memory system gives plain traffic of the same size.
    src = grad.view(-1)
    dst = torch.empty_like(src)
    add("reference", "copy (bf16 -> bf16, eager)", 2 * eb * m * n, lambda: dst.copy_(src), graph=False)
    add("reference", "read only (sum)", eb * m * n, lambda: torch.sum(src))
    add("reference", "write only (fill uint8)", m * n, lambda: out.fill_(1))
    for name, (act, code, with_dbias) in PASSES.items():
        cfg = launch_config(name, m, n, grad.device)
        read = (2 if act else 1) * eb
        p = pre if act else None

        def variant(activation=act, transpose=True, store=True, dbias_on=with_dbias, amax_on=True, p=p):
            return lambda: _launch(grad, p, activation, scale, code, amax if amax_on else None, transpose, dbias_on,
                                   store, cfg, out, out_t, dbias, False)

        add(name, "shipped", (read + 2) * m * n, variant())
        add(name, "no transposed copy", (read + 1) * m * n, variant(transpose=False))
        add(name, "no stores (reads, amax, dbias)", read * m * n, variant(transpose=False, store=False))
        add(name, "no amax", (read + 2) * m * n, variant(amax_on=False))
        if act:
            # pre_act still read, the derivative not computed: the arithmetic's share
            add(name, "no activation (pre_act not read)", (eb + 2) * m * n, variant(activation=0, p=None))
        if with_dbias:
            add(name, "no bias gradient", (read + 2) * m * n, variant(dbias_on=False))
            add(name, "bias gradient summed by a second launch", (read + 2) * m * n, _second_sum_launch(variant()))
    h = pre
    add("bias_act", "shipped (gelu_tanh, y + e4m3 + e4m3^T)", (2 * eb + 2) * m * n,
        lambda: bias_act(h, None, "gelu_tanh", scale=scale, fp8_dtype=torch.float8_e4m3fn, amax=amax,
                         transpose=True))
    add("bias_act", "no FP8 copies (y only)", 2 * eb * m * n, lambda: bias_act(h, None, "gelu_tanh"))
    return rows


def profile(m, n, dtype, repeat):
    """Runs each shipped pass ``repeat`` times (for a profiler wrapped around this process)."""
    grad, pre, scale, amax, out, out_t, dbias = _buffers(m, n, dtype)
    for name, (act, code, with_dbias) in PASSES.items():
        cfg = launch_config(name, m, n, grad.device)
        for _ in range(repeat):
            _launch(grad, pre if act else None, act, scale, code, amax, True, with_dbias, True, cfg, out, out_t,
                    dbias, False)
        torch.cuda.synchronize()
        print(name, cfg, flush=True)
    for _ in range(repeat):
        bias_act(pre, None, "gelu_tanh", scale=scale, fp8_dtype=torch.float8_e4m3fn, amax=amax, transpose=True)
    dst = torch.empty_like(grad)
    for _ in range(repeat):
        dst.copy_(grad)
    torch.cuda.synchronize()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="16384x6400")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--out", default="results/ablation")
    parser.add_argument("--profile", action="store_true", help="run each shipped pass --repeat times, time nothing")
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    sizes = parse_sizes(args.sizes)
    torch.manual_seed(0)
    if args.profile:
        for m, n in sizes:
            profile(m, n, dtype, args.repeat)
        return
    copy_gbps = copy_bandwidth_gbps()
    print(f"{environment()}  copy bandwidth {copy_gbps:.0f} GB/s")
    rows = []
    for m, n in sizes:
        rows += ablation(m, n, dtype, copy_gbps)
        write_results(args.out, "ablation", rows, {"copy_GBps": copy_gbps})
    print_table(rows, ["kernel", "variant", "M", "N", "bytes_per_element", "ms", "frac_copy"])


if __name__ == "__main__":
    main()
