"""Row tiles in one contiguous range per row group, or dealt to the groups in turn (GPU).

The backward passes walk each column strip in row groups; ``LaunchConfig.cyclic_rows`` deals the
row tiles to the groups in turn (group g takes tiles g, g + G, ...) instead of one contiguous range
each, and ``LaunchRule.cyclic_max_groups`` says where the shipped rules do. Here both orders run
through the public functions at the grid the library picks (the order forced either way), bf16
inputs, on the same data: the outputs of the two orders checked equal (FP8 bytes, every transposed
element, amax; the bias gradient within 1e-6), then each order timed ``--rounds`` times in turn
(CUDA-graph replays, median), so a drift of the card falls on both alike. The table gives the
median round of each, the speedup of dealing in turn, and both as fractions of the copy bandwidth
measured at the start. Grids in the queued form (no row groups) are skipped.

    python benchmarks/row_order.py --out results/row_order
"""

from __future__ import annotations

import argparse

import torch

from common import (copy_bandwidth_gbps, environment, graph_ms, parse_sizes, print_table, row_groups_changed,
                    write_results)
from lightning_fuse.kernels import _launch, dact_dbias_quantize, dbias_quantize

SIZES = "8192x3072,16384x3072,8192x1024,4096x4096,8192x6400,16384x6400,32768x8192"
PASSES = {"dbias_quantize": 4, "dact_dbias_quantize": 6}  # bytes per element with bf16 inputs


def compare(name, m, n, rounds, copy_gbps):
    torch.manual_seed(0)
    grad = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    pre = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 2
    scale = torch.tensor(2048.0, device="cuda")
    amax = torch.zeros(1, device="cuda")
    kwargs = dict(scale=scale, fp8_dtype=torch.float8_e5m2, amax=amax, transpose=True)
    if name == "dbias_quantize":
        def run():
            return dbias_quantize(grad, **kwargs)
    else:
        def run():
            return dact_dbias_quantize(grad, pre, "gelu_tanh", **kwargs)
    configs, outputs = {}, {}
    for cyclic in (False, True):
        with row_groups_changed(cyclic_rows=cyclic):
            configs[cyclic] = _launch.launch_config(name, m, n, grad.device, grad.dtype)
            amax.zero_()
            outputs[cyclic] = [t.clone() for t in run()] + [amax.clone()]
    if configs[False].chunk_tiles:
        return None
    (q, q_t, dbias, a), (q2, q2_t, dbias2, a2) = outputs[False], outputs[True]
    bytes_of = lambda t: t.view(torch.uint8)  # noqa: E731
    same = (torch.equal(bytes_of(q), bytes_of(q2)) and torch.equal(bytes_of(q_t), bytes_of(q2_t))
            and torch.equal(bytes_of(q2_t), bytes_of(q2).t()) and torch.equal(a, a2))
    rel = ((dbias.double() - dbias2.double()).norm() / dbias.double().norm()).item()
    times = {False: [], True: []}
    for _ in range(rounds):
        for cyclic in (False, True):
            with row_groups_changed(cyclic_rows=cyclic):
                times[cyclic].append(graph_ms(run, rep_ms=100))
    median = {c: sorted(t)[len(t) // 2] for c, t in times.items()}
    rows, groups = configs[False].row_groups(m)
    nbytes = m * n * PASSES[name]
    return dict(kernel=name, M=m, N=n, groups=groups, rows_per_group=rows, loop_stages=configs[False].loop_stages,
                contiguous_us=median[False] * 1e3, in_turn_us=median[True] * 1e3,
                speedup=median[False] / median[True],
                frac_contiguous=nbytes / median[False] / 1e6 / copy_gbps,
                frac_in_turn=nbytes / median[True] / 1e6 / copy_gbps,
                spread=max(max(t) / min(t) for t in times.values()),
                ok=str(same and rel < 1e-6), dbias_rel=rel)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/row_order")
    parser.add_argument("--sizes", default=SIZES)
    parser.add_argument("--passes", default=",".join(PASSES), help=f"comma-separated: {', '.join(PASSES)}")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("row_order.py times GPU launches: no CUDA device here")
    copy_gbps = copy_bandwidth_gbps()
    print(f"{environment()}  copy bandwidth {copy_gbps:.0f} GB/s")
    rows = []
    for m, n in parse_sizes(args.sizes):
        for name in args.passes.split(","):
            row = compare(name, m, n, args.rounds, copy_gbps)
            if row is not None:
                rows.append(row)
                print_table(rows[-1:], list(row))
                write_results(args.out, "row_order", rows, {"copy_GBps": copy_gbps})
    print_table(rows, ["kernel", "M", "N", "groups", "contiguous_us", "in_turn_us", "speedup", "frac_contiguous",
                       "frac_in_turn", "spread", "ok"])


if __name__ == "__main__":
    main()
