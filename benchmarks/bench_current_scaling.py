"""Current scaling (GPU): the two-pass backward passes against PyTorch eager and torch.compile.

Under current scaling a gradient's FP8 scale comes from that gradient's own amax, so the fused
backward runs in two passes (``dact_dbias_quantize_current_scaling``): pass 1 reads the inputs and
reduces the amax and the bias gradient, writing nothing per element; pass 2 reads them again and
writes the FP8 copies, row-wise and transposed. Bytes per element with bf16 inputs: 4 + 6 = 10 for
the pass with an activation (tanh GELU here), 2 + 4 = 6 without one (pass 2 is then the cast).

For each size and input dtype the outputs are checked first against float64 (the amax, the scale,
the FP8 codes as ``bench_kernels.py`` checks them, every element of the transposed copy, the bias
gradient), then timed from CUDA-graph replays (median): the whole call; each pass alone at the
shipped launch (``between_ms``: the whole call less the two passes); pass 1 at other numbers of
programs per multiprocessor (``--pass1-slots``, the shipped rule with that residency); the one-pass
delayed-scaling call with the same scale given; and the eager and compiled current-scaling sequence
(``common.unfused_current_scaling``).

    cd benchmarks && python bench_current_scaling.py --out results/current_scaling
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools

import torch

from bench_kernels import DTYPES, GRAD, SIZES, _check, _resident_per_sm
from common import (FP8_MAX, copy_bandwidth_gbps, environment, graph_ms, parse_sizes, print_table,
                    unfused_current_scaling, write_results)
from lightning_fuse.kernels import (dact_dbias_quantize, dact_dbias_quantize_current_scaling,
                                    dact_dbias_quantize_reference, dbias_quantize)
from lightning_fuse.kernels._launch import LAUNCH_RULES, LaunchRule, _pick_config, launch_config
from lightning_fuse.kernels.activations import activation_id
from lightning_fuse.kernels.dact_dbias_quantize import _launch, _pass_name

ACTIVATION = "gelu_tanh"  # gelu_backward(approximate="tanh") in the eager sequence


def _with_slots(rule: LaunchRule, programs_per_sm: int) -> LaunchRule:
    """``rule`` and its alternatives with ``programs_per_sm`` programs per multiprocessor."""
    alternative = rule.alternative and _with_slots(rule.alternative, programs_per_sm)
    return dataclasses.replace(rule, programs_per_sm=programs_per_sm, alternative=alternative)


def bench(sizes, dtypes, copy_gbps, out_dir, slots, with_activation=(True, False)):
    rows, pass1_rows = [], []
    device = torch.device("cuda")
    for (m, n), (dname, dtype), act in itertools.product(sizes, dtypes.items(), with_activation):
        grad = torch.randn(m, n, device=device, dtype=dtype)
        pre = torch.randn(m, n, device=device, dtype=dtype) * 2 if act else None
        name = "dact_dbias_quantize" if act else "dbias_quantize"
        activation = ACTIVATION if act else None
        eb = grad.element_size()
        pass1_bytes, pass2_bytes = m * n * eb * (2 if act else 1), m * n * (eb * (2 if act else 1) + 2)

        def ours():
            return dact_dbias_quantize_current_scaling(grad, pre, activation, fp8_dtype=GRAD, transpose=True)

        q, q_t, dbias, amax, scale = ours()
        # float64 dx, its amax, and the FP8 codes with the pass's own scale, the transposed copy, the bias gradient
        ref_amax = torch.zeros(1, device=device)
        ref = dact_dbias_quantize_reference(grad, pre, activation, scale=scale, fp8_dtype=GRAD, amax=ref_amax,
                                            transpose=True, compute_dtype=torch.float64)
        amax_ref, fmax = ref_amax.item(), FP8_MAX[GRAD]
        amax_ok = abs(amax.item() - amax_ref) <= 1e-5 * amax_ref
        scale_ok = abs(scale.item() - fmax / amax_ref) <= 1e-5 * fmax / amax_ref
        codes_ok, exact = _check(f"{name} current scaling {m}x{n} {dname}", (q, q_t, dbias), ref)
        ok = amax_ok and scale_ok and codes_ok
        if not (amax_ok and scale_ok):
            print(f"CHECK FAILED {name} {m}x{n} {dname}: amax {amax.item()} vs {amax_ref}, scale {scale.item()}")

        # The passes alone, into preallocated outputs, as the call launches them.
        act_id = activation_id(ACTIVATION) if act else 0
        first = launch_config(_pass_name(act_id, True), m, n, device, dtype)
        second = launch_config(_pass_name(act_id, False), m, n, device, dtype)
        out = torch.empty(m, n, dtype=GRAD, device=device)
        out_t = torch.empty(n, m, dtype=GRAD, device=device)
        part_dbias = torch.zeros(n, dtype=torch.float32, device=device)
        part_amax = torch.zeros(1, dtype=torch.float32, device=device)

        def pass1(cfg=first):
            return _launch(grad, pre, act_id, None, 0, part_amax, False, True, False, cfg, out, out_t, part_dbias,
                           False)

        pass_scale = torch.empty((), dtype=torch.float32, device=device)

        def pass2():  # derives the scale from pass 1's amax (part_amax) and stores it into pass_scale
            return _launch(grad, pre, act_id, pass_scale, 2, part_amax, True, False, True, second, out, out_t,
                           part_dbias, False, margin=0)

        compiled1 = pass1()
        pass2()
        pass_ok = (torch.equal(out.view(torch.uint8), q.view(torch.uint8)) and torch.equal(part_amax, amax)
                   and torch.equal(pass_scale, scale))
        ok = ok and pass_ok

        def delayed():
            if act:
                return dact_dbias_quantize(grad, pre, ACTIVATION, scale=scale, fp8_dtype=GRAD, transpose=True)
            return dbias_quantize(grad, scale=scale, fp8_dtype=GRAD, transpose=True)

        def eager():
            return unfused_current_scaling(grad, pre, "tanh" if act else None, GRAD)

        compiled = torch.compile(eager, dynamic=False)
        compiled()
        t_ours, t1, t2 = graph_ms(ours), graph_ms(pass1), graph_ms(pass2)
        t_delayed, t_eager, t_comp = graph_ms(delayed), graph_ms(eager), graph_ms(compiled)
        nbytes = pass1_bytes + pass2_bytes
        resident = _resident_per_sm(compiled1, first.num_warps)
        programs = first.groups if first.chunk_tiles else first.row_groups(m)[1] * -(-n // first.block_n)
        rows.append(dict(kernel=name, M=m, N=n, dtype=dname, ours_ms=t_ours, pass1_ms=t1, pass2_ms=t2,
                         between_ms=t_ours - t1 - t2, delayed_ms=t_delayed, eager_ms=t_eager, compile_ms=t_comp,
                         vs_eager=t_eager / t_ours, vs_compile=t_comp / t_ours, vs_delayed=t_ours / t_delayed,
                         frac_copy=nbytes / t_ours / 1e6 / copy_gbps,
                         pass1_frac_copy=pass1_bytes / t1 / 1e6 / copy_gbps,
                         pass2_frac_copy=pass2_bytes / t2 / 1e6 / copy_gbps,
                         pass1_regs=compiled1.n_regs, pass1_resident=resident,
                         pass1_programs_per_sm=programs / torch.cuda.get_device_properties(0).multi_processor_count,
                         pass1_queued=bool(first.chunk_tiles), exact=exact, ok=str(ok)))
        print_table(rows[-1:], list(rows[-1]))
        write_results(out_dir, "current_scaling", rows, {"copy_GBps": copy_gbps})
        torch._dynamo.reset()

        # Pass 1 at other residencies: the shipped rule with k programs per multiprocessor.
        rule = LAUNCH_RULES[_pass_name(act_id, True)]
        for k in slots:
            cfg = _pick_config(m, n, device, _with_slots(rule, k), dtype)
            part_amax.zero_()
            pass1(cfg)
            k_ok = torch.equal(part_amax, amax)
            t = graph_ms(lambda: pass1(cfg))
            pass1_rows.append(dict(kernel=name, M=m, N=n, dtype=dname, programs_per_sm=k,
                                   queued=bool(cfg.chunk_tiles), ms=t, vs_shipped=t1 / t,
                                   frac_copy=pass1_bytes / t / 1e6 / copy_gbps, ok=str(k_ok)))
            print_table(pass1_rows[-1:], list(pass1_rows[-1]))
        if pass1_rows:
            write_results(out_dir, "current_scaling_pass1", pass1_rows, {"copy_GBps": copy_gbps})
    return rows, pass1_rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/current_scaling")
    parser.add_argument("--sizes", default=",".join(f"{m}x{n}" for m, n in SIZES))
    parser.add_argument("--dtypes", default="bf16", help=f"input dtypes, comma-separated: {', '.join(DTYPES)}")
    parser.add_argument("--pass1-slots", default="",
                        help="also time pass 1 with these programs per multiprocessor, comma-separated (e.g. 4,6,8)")
    parser.add_argument("--passes", default="dact_dbias_quantize,dbias_quantize",
                        help="dact_dbias_quantize (tanh GELU), dbias_quantize, or both")
    args = parser.parse_args()
    dtypes = {}
    for d in args.dtypes.split(","):
        if d not in DTYPES:
            parser.error(f"--dtypes: unknown dtype {d!r}; accepted: {', '.join(DTYPES)}")
        dtypes[d] = DTYPES[d]
    passes = args.passes.split(",")
    unknown = sorted(set(passes) - {"dact_dbias_quantize", "dbias_quantize"})
    if unknown:
        parser.error(f"--passes: unknown pass(es) {unknown}; passes: dact_dbias_quantize, dbias_quantize")
    with_activation = tuple(p == "dact_dbias_quantize" for p in passes)
    slots = [int(k) for k in args.pass1_slots.split(",") if k]
    torch.manual_seed(0)
    copy_gbps = copy_bandwidth_gbps()
    print(f"{environment()}  copy bandwidth {copy_gbps:.0f} GB/s")
    rows, pass1_rows = bench(parse_sizes(args.sizes), dtypes, copy_gbps, args.out, slots, with_activation)
    print(f"copy bandwidth {copy_gbps:.0f} GB/s")
    print_table(rows, ["kernel", "M", "N", "dtype", "ours_ms", "pass1_ms", "pass2_ms", "between_ms", "delayed_ms",
                       "eager_ms", "compile_ms", "vs_eager", "vs_compile", "vs_delayed", "frac_copy", "pass1_frac_copy",
                       "pass2_frac_copy", "pass1_regs", "pass1_resident", "ok"])
    if pass1_rows:
        print_table(pass1_rows, list(pass1_rows[0]))


if __name__ == "__main__":
    main()
