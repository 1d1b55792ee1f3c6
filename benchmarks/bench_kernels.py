"""Kernel benchmark (GPU): the fused kernels against PyTorch eager and torch.compile of the same math.

For every size and input dtype, each kernel's outputs are first checked against a float64 (fused
kernel) or float32 reference (every element of every transposed output compared with the row-wise
copy), then timed: device time from CUDA-graph replays (``do_bench_cudagraph``, median), and wall
time per call from plain CUDA-event timing (``do_bench``, median), which adds launch overhead.
Bandwidth counts the bytes each kernel must move (inputs read once, outputs written once) over the
device time, as a fraction of the device-to-device copy bandwidth measured in the same run.

    python benchmarks/bench_kernels.py --out results/kernels [--sweep]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import itertools

import torch

from common import (
    FP8_MAX,
    copy_bandwidth_gbps,
    graph_ms,
    environment,
    median_ms,
    parse_sizes,
    print_table,
    separate_sum_launch,
    unfused_dact_dbias_quantize,
    unfused_dbias_quantize,
    unfused_quantize,
    write_results,
)
from lightning_fuse.kernels import (activation_derivative_reference, bias_act_reference, dact_dbias_quantize,
                                    dbias_quantize, quantize)
from lightning_fuse.kernels._launch import LAUNCH_RULES, LaunchConfig, LaunchRule, _pick_config, launch_config
from lightning_fuse.kernels.activations import activation_id
from lightning_fuse.kernels.dact_dbias_quantize import _launch

# the module, not the function the package exports under the same name
bias_act_module = importlib.import_module("lightning_fuse.kernels.bias_act")

SIZES = [(8192, 3072), (16384, 6400), (32768, 8192), (16384, 16384)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
GRAD = torch.float8_e5m2
FWD = torch.float8_e4m3fn


def _check(name, ours, theirs):
    """FP8 outputs: >= 99% bit-exact with the reference's cast and none more than one FP8 step off, the
    transposed copy exactly the row-wise one, the bias gradient within 1e-3 of the reference's."""
    q, q_t = ours[0], ours[1]
    a, b = q.view(torch.uint8), theirs[0].view(torch.uint8)
    exact = (a == b).float().mean().item()
    a_f, b_f = q.float(), theirs[0].float()
    mantissa, min_exp = (2, -14) if q.dtype == torch.float8_e5m2 else (3, -6)
    exponent = torch.floor(torch.log2(torch.maximum(a_f.abs(), b_f.abs()).clamp_min(2.0 ** min_exp)))
    step_off = ((a_f - b_f).abs() > torch.exp2(exponent - mantissa)).sum().item()
    transposed_ok = torch.equal(q_t.view(torch.uint8), a.t())
    ok = exact >= 0.99 and transposed_ok and step_off == 0
    if len(ours) > 2 and ours[2] is not None:
        rel = ((ours[2] - theirs[2]).norm() / theirs[2].norm()).item()
        ok = ok and rel < 1e-3
    if not ok:
        print(f"CHECK FAILED {name}: exact={exact:.5f} transposed_ok={transposed_ok} far={step_off}")
    return ok, exact


def _dact_reference(grad, pre, scale, fp8_dtype, activation="gelu_tanh"):
    """float64 reference of the fused kernel (PyTorch's fp32 gelu_backward loses accuracy for large
    negative inputs, where 1 + tanh cancels)."""
    dx = grad.double() * activation_derivative_reference(pre.double(), activation)
    fmax = FP8_MAX[fp8_dtype]
    q = (dx * scale.double()).clamp(-fmax, fmax).float().to(fp8_dtype)
    return q, q.t().contiguous(), dx.sum(0).float()


def _poison_like(*shapes_dtypes):
    """Fills freed allocator blocks with 0xFF so an element the kernel never writes shows as NaN."""
    blocks = [torch.full(s, 255, dtype=torch.uint8, device="cuda") for s in shapes_dtypes]
    del blocks


def _resident_per_sm(compiled, warps: int) -> int:
    """Programs of ``compiled`` one multiprocessor holds at once (registers, shared memory, warps)."""
    props = torch.cuda.get_device_properties(0)
    regs_per_warp = -(-compiled.n_regs * 32 // 256) * 256  # allocated per warp in units of 256
    by_regs = props.regs_per_multiprocessor // max(1, regs_per_warp * warps)
    shared = compiled.metadata.shared
    by_shared = props.shared_memory_per_multiprocessor // shared if shared else 32
    return max(1, min(32, props.max_threads_per_multi_processor // (32 * warps), by_regs, by_shared))


# (block_m, block_n, warps, loop stages[, max registers]) per pass. Candidates chosen on the CPU with kernel_isa.py:
# tiles whose row sets (block_m / 4 rows) give 16-byte loads, and the next smaller ones.
# A fifth entry caps the registers per thread (``maxnreg``, 0: no cap): with 128 the fused kernel's
# pipelined loop compiles without spills to 4 programs per multiprocessor instead of 3 (kernel_isa.py).
# A sixth, True, loads each tile's inputs one iteration ahead in registers (LaunchConfig.prefetch).
SWEEP_VARIANTS = {
    "dact_dbias_quantize": [(64, 64, 4, 0, 0, True), (64, 64, 4, 3), (64, 64, 4, 3, 128), (64, 64, 4, 2),
                            (64, 64, 4, 4), (32, 64, 4, 0), (32, 64, 4, 0, 0, True)],
    "dbias_quantize": [(128, 64, 8, 0, 0, True), (64, 64, 4, 0, 0, True), (128, 128, 8, 0, 0, True), (64, 64, 4, 0),
                       (64, 64, 8, 0), (32, 64, 4, 0), (64, 64, 4, 3), (64, 64, 4, 2)],
    "quantize": [(64, 64, 8, 0), (64, 64, 8, 0, 0, True), (64, 64, 4, 0), (128, 64, 4, 0), (64, 64, 8, 2)],
    "bias_act": [(32, 64, 8, 0), (32, 64, 8, 0, 0, True), (64, 64, 8, 0), (32, 64, 4, 0), (64, 64, 4, 0),
                 (32, 128, 4, 0)],
}
# pass -> (activation id, FP8 code, bias gradient, FP8 dtype)
SWEEP_KERNELS = {"dact_dbias_quantize": (2, 2, True, GRAD), "dbias_quantize": (0, 2, True, GRAD),
                 "quantize": (0, 1, False, FWD), "bias_act": (2, 1, False, FWD)}


def _shipped_variant(kernel, m, n):
    """(block_m, block_n, warps, loop stages, max registers, prefetch) of the launch the library picks: its
    tiles, swept in the row groups' grids (the fused pass's queued form has its own grids in
    kernel_revisions.py, ``qKcC``)."""
    cfg = launch_config(kernel, m, n, torch.device("cuda"))
    return cfg.block_m, cfg.block_n, cfg.num_warps, cfg.loop_stages, cfg.max_registers, cfg.prefetch


def _sweep_config(per_sm, m, n, bm, bn, warps, stages, max_registers, cyclic, resident, prefetch=False):
    """The library's grid rule (kernels/_launch.py) for one variant: ``occ``/``occ2`` make exactly
    one/two full waves at the compiled kernel's residency (never a partly filled last wave), ``fill``
    the fewest whole waves filled to 85% (the shipped rules' waves, without their row bound
    ``max_rows_per_program`` or their row tiles per program); a number asks for that many programs per
    multiprocessor, rounded up; ``tK`` gives every program ``K`` row tiles (``t1``: one tile per
    program), as many programs as that takes."""
    if isinstance(per_sm, str) and per_sm.startswith("t"):
        rule = LaunchRule(bm, bn, warps, stages, resident, True, tiles_per_program=int(per_sm[1:]), min_waves=0)
    elif per_sm in ("occ", "occ2"):
        rule = LaunchRule(bm, bn, warps, stages, resident * (2 if per_sm == "occ2" else 1), True, min_wave_fill=0)
    elif per_sm == "fill":
        rule = LaunchRule(bm, bn, warps, stages, resident, True)
    else:
        rule = LaunchRule(bm, bn, warps, stages, per_sm, False)
    return dataclasses.replace(_pick_config(m, n, torch.device("cuda"), rule), max_registers=max_registers,
                               cyclic_rows=cyclic, prefetch=prefetch)


def sweep(m=16384, n=6400, dtype=torch.bfloat16, per_sm_values=("occ", "occ2", "fill", 8), on_row=None, variants=None,
          kernel="dact_dbias_quantize", row_orders=(False,), activation_name="gelu_tanh"):
    """Times launch configurations of one pass (``SWEEP_KERNELS``): ``variants`` (by default
    ``SWEEP_VARIANTS[kernel]``) x programs per multiprocessor (``_sweep_config``) x ``row_orders``
    (``LaunchConfig.cyclic_rows``). Checks every output of each, and returns the rows; ``on_row`` sees
    each row as it is made. The passes with an activation (the fused pass, the forward activation)
    take ``activation_name``."""
    activation, fp8_code, with_dbias, fp8_dtype = SWEEP_KERNELS[kernel]
    if activation:
        activation = activation_id(activation_name)
    grad = torch.randn(m, n, device="cuda", dtype=dtype) * (2 if kernel == "bias_act" else 1)
    pre = torch.randn(m, n, device="cuda", dtype=dtype) * 2 if kernel == "dact_dbias_quantize" else None
    scale = torch.tensor(2048.0 if fp8_code == 2 else 32.0, device="cuda")
    amax = torch.zeros(1, device="cuda")
    if kernel == "bias_act":
        ref = bias_act_reference(grad, None, activation_name, scale=scale, fp8_dtype=FWD, transpose=True)
        ref = (ref[1], ref[2], None)
        y = torch.empty_like(grad)
    elif activation:
        ref = _dact_reference(grad, pre, scale, GRAD, activation_name)
    elif with_dbias:
        ref = unfused_dbias_quantize(grad.float(), scale, GRAD, amax.clone())
    else:
        ref = unfused_quantize(grad.float(), scale, FWD, amax.clone())
    out = torch.empty(m, n, dtype=torch.uint8, device="cuda")
    out_t = torch.empty(n, m, dtype=torch.uint8, device="cuda")
    dbias = torch.empty(n, dtype=torch.float32, device="cuda")

    def launch(cfg):
        if kernel == "bias_act":
            return bias_act_module._launch(grad, None, activation, scale, fp8_code, amax, True, None, y, out, out_t,
                                           cfg, False)
        return _launch(grad, pre, activation, scale, fp8_code, amax, True, with_dbias, True, cfg, out, out_t, dbias,
                       False)

    rows, seen = [], set()
    for (bm, bn, warps, stages, *cap), per_sm, cyclic in itertools.product(variants or SWEEP_VARIANTS[kernel],
                                                                           per_sm_values, row_orders):
        max_registers = cap[0] if cap else 0
        prefetch = bool(cap[1]) if len(cap) > 1 else False
        row = dict(kernel=kernel if activation_name == "gelu_tanh" or not activation else f"{kernel} {activation_name}",
                   M=m, N=n, block_m=bm, block_n=bn, warps=warps, stages=stages,
                   max_registers=max_registers, prefetch=prefetch, per_sm=per_sm, cyclic=cyclic)
        try:
            compiled = launch(LaunchConfig(bm, bn, warps, 1, stages, max_registers, cyclic_rows=cyclic,
                                           prefetch=prefetch))
            resident = _resident_per_sm(compiled, warps)
            cfg = _sweep_config(per_sm, m, n, bm, bn, warps, stages, max_registers, cyclic, resident, prefetch)
            key = (bm, bn, warps, stages, max_registers, prefetch, cyclic, cfg.row_groups(m))
            if key in seen:
                continue
            seen.add(key)
            out.fill_(255)
            out_t.fill_(255)
            launch(cfg)
            ok, _ = _check(f"sweep {kernel} {cfg}", (out.view(fp8_dtype), out_t.view(fp8_dtype),
                                                      dbias if with_dbias else None), ref)
            ms = graph_ms(lambda: launch(cfg), rep_ms=60)
            nbytes = (2 if kernel in ("dact_dbias_quantize", "bias_act") else 1) * grad.element_size() + 2
            row.update(regs=compiled.n_regs, spills=compiled.n_spills, shared=compiled.metadata.shared,
                       resident=resident, groups=cfg.row_groups(m)[1], ms=ms, GBps=m * n * nbytes / ms / 1e6,
                       ok=str(ok))
        except Exception as exc:  # a configuration the compiler rejects (e.g. out of resources)
            row.update(ms=float("nan"), ok=repr(exc)[:80])
        rows.append(row)
        if on_row is not None:
            on_row(rows)
    return rows


# the fused pass's GELUs: ours by name, and gelu_backward's `approximate` for the eager sequence
GELUS = {"gelu_tanh": "tanh", "gelu": "none"}


def bench(sizes, dtypes, copy_gbps, out_dir, activation="gelu_tanh", passes=None):
    rows = []
    fused = "dact_dbias_quantize" if activation == "gelu_tanh" else f"dact_dbias_quantize {activation}"
    for (m, n), (dname, dtype) in itertools.product(sizes, dtypes.items()):
        grad = torch.randn(m, n, device="cuda", dtype=dtype)
        pre = torch.randn(m, n, device="cuda", dtype=dtype) * 2
        scale = torch.tensor(2048.0, device="cuda")
        amax = torch.zeros(1, device="cuda")
        eb = grad.element_size()
        cases = {
            fused: (
                lambda: dact_dbias_quantize(grad, pre, activation, scale=scale, fp8_dtype=GRAD, amax=amax,
                                            transpose=True),
                lambda: unfused_dact_dbias_quantize(grad, pre, GELUS[activation], scale, GRAD, amax),
                lambda: _dact_reference(grad, pre, scale, GRAD, activation),
                m * n * (2 * eb + 2)),
            "dbias_quantize": (
                lambda: dbias_quantize(grad, scale=scale, fp8_dtype=GRAD, amax=amax, transpose=True),
                lambda: unfused_dbias_quantize(grad, scale, GRAD, amax),
                lambda: unfused_dbias_quantize(grad.float(), scale, GRAD, amax.clone()),
                m * n * (eb + 2)),
            "quantize": (
                lambda: quantize(pre, scale=scale / 64, fp8_dtype=FWD, amax=amax, transpose=True),
                lambda: unfused_quantize(pre, scale / 64, FWD, amax),
                lambda: unfused_quantize(pre.float(), scale / 64, FWD, amax.clone()),
                m * n * (eb + 2)),
        }
        for name, (ours, eager, reference, nbytes) in cases.items():
            if passes is not None and name.split()[0] not in passes:
                continue
            _poison_like((m, n), (n, m))
            ok, exact = _check(f"{name} {m}x{n} {dname}", ours(), reference())
            compiled = torch.compile(eager, dynamic=False)
            compiled()
            t_ours, t_eager, t_comp = graph_ms(ours), graph_ms(eager), graph_ms(compiled)
            gbps = nbytes / t_ours / 1e6
            rows.append(dict(kernel=name, M=m, N=n, dtype=dname, ours_ms=t_ours, eager_ms=t_eager,
                             compile_ms=t_comp, vs_eager=t_eager / t_ours, vs_compile=t_comp / t_ours,
                             GBps=gbps, frac_copy=gbps / copy_gbps, ours_wall_ms=median_ms(ours),
                             eager_wall_ms=median_ms(eager), compile_wall_ms=median_ms(compiled),
                             exact=exact, ok=str(ok)))
            print_table(rows[-1:], list(rows[-1]))
            write_results(out_dir, "kernels", rows, {"copy_GBps": copy_gbps})  # kept if a later size is cut off
            torch._dynamo.reset()
    return rows


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kernels = sorted({r["kernel"] for r in rows})
    fig, axes = plt.subplots(1, len(kernels), figsize=(6 * len(kernels), 4), sharey=True, squeeze=False)
    for ax, kernel in zip(axes[0], kernels):
        sub = [r for r in rows if r["kernel"] == kernel]
        labels = [f"{r['M']}x{r['N']}\n{r['dtype']}" for r in sub]
        x = range(len(sub))
        for offset, key, label in ((-0.25, "frac_copy", "ours"),):
            ax.bar([i + offset for i in x], [r[key] for r in sub], width=0.25, label=label)
        ax.bar([i for i in x], [r["frac_copy"] * r["ours_ms"] / r["compile_ms"] for r in sub], width=0.25,
               label="torch.compile")
        ax.bar([i + 0.25 for i in x], [r["frac_copy"] * r["ours_ms"] / r["eager_ms"] for r in sub], width=0.25,
               label="eager")
        ax.axhline(0.85, color="k", ls="--", lw=0.8)
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.set_title(kernel)
        ax.set_ylabel("fraction of copy bandwidth (ours' bytes)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/kernels")
    parser.add_argument("--sweep", action="store_true",
                        help="also time launch configurations of the passes --sweep-kernel names")
    parser.add_argument("--sweep-sizes", default="16384x6400", help="sizes the sweep runs at")
    parser.add_argument("--sweep-only", action="store_true", help="stop after the sweep")
    parser.add_argument("--sweep-kernel", default="dact_dbias_quantize",
                        help=f"the passes the sweep times, comma-separated: {', '.join(SWEEP_KERNELS)}")
    parser.add_argument("--sweep-grid-only", action="store_true",
                        help="sweep only the number of programs, with the shipped tiles and pipelining")
    parser.add_argument("--sweep-grids", help="grids the sweep times, comma-separated (occ, occ2, fill, programs "
                        "per multiprocessor, or tK: K row tiles per program); default occ,occ2,fill,8, with "
                        "--sweep-grid-only occ,occ2,fill,2,4,8")
    parser.add_argument("--sweep-variants", help="the variants to sweep instead of SWEEP_VARIANTS, as "
                        "kernel:bm,bn,warps,stages[,max registers[,prefetch]] separated by ';' "
                        "(e.g. 'quantize:64,64,8,0;quantize:64,64,8,0,0,1')")
    parser.add_argument("--sweep-separate-sum", action="store_true",
                        help="sweep the backward passes also with the bias gradient summed by its second launch "
                        "(no arrival in the pass), as under torch.compile")
    parser.add_argument("--sweep-cyclic", action="store_true",
                        help="time every configuration with contiguous and with cyclic row tiles")
    parser.add_argument("--sizes", default=",".join(f"{m}x{n}" for m, n in SIZES))
    parser.add_argument("--activation", choices=sorted(GELUS), default="gelu_tanh",
                        help="the fused pass's GELU in the timed table (the eager sequence's gelu_backward takes "
                             "the same one), and in --sweep's fused pass and forward activation")
    parser.add_argument("--passes", help="time only these passes, comma-separated (default: every pass)")
    parser.add_argument("--cyclic-devices", help="the bias gradient's pass deals its row tiles in turn over several "
                        "waves too on GPUs whose name holds one of these, comma-separated (its rule's "
                        "LaunchRule.cyclic_devices, in place of the shipped one's)")
    args = parser.parse_args()
    if args.cyclic_devices is not None:
        devices = tuple(d for d in args.cyclic_devices.split(",") if d)
        LAUNCH_RULES["dbias_quantize"] = dataclasses.replace(LAUNCH_RULES["dbias_quantize"], cyclic_devices=devices)
    passes = None
    if args.passes:
        passes = args.passes.split(",")
        unknown = sorted(set(passes) - {"dact_dbias_quantize", "dbias_quantize", "quantize"})
        if unknown:
            parser.error(f"--passes: unknown pass(es) {unknown}; passes: dact_dbias_quantize, dbias_quantize, quantize")
    sizes = parse_sizes(args.sizes)
    torch.manual_seed(0)
    copy_gbps = copy_bandwidth_gbps()
    print(f"{environment()}  copy bandwidth {copy_gbps:.0f} GB/s")
    extra = {"copy_GBps": copy_gbps, "dbias_quantize_cyclic_devices": args.cyclic_devices}
    if args.sweep:
        columns = ["kernel", "M", "N", "block_m", "block_n", "warps", "stages", "max_registers", "per_sm", "cyclic",
                   "regs", "resident", "groups",
                   "ms", "frac_copy", "ok"]
        sweep_rows = []
        grids = args.sweep_grids or ("occ,occ2,fill,2,4,8" if args.sweep_grid_only else "occ,occ2,fill,8")
        grids = [int(g) if g.isdigit() else g for g in grids.split(",")]

        def on_row(rows):  # written and printed row by row: a run cut off by its time limit keeps them
            rows[-1]["frac_copy"] = rows[-1].get("GBps", float("nan")) / copy_gbps
            write_results(args.out, "sweep", sweep_rows + rows, extra)
            print_table(rows[-1:], columns)

        for kernel in args.sweep_kernel.split(","):
            for m, n in parse_sizes(args.sweep_sizes):
                variants = [_shipped_variant(kernel, m, n)] if args.sweep_grid_only else None
                if args.sweep_variants:
                    variants = [tuple(int(v) for v in spec.split(":")[1].split(","))
                                for spec in args.sweep_variants.split(";") if spec.split(":")[0] == kernel]
                sweep_rows += sweep(m, n, on_row=on_row, kernel=kernel, variants=variants, per_sm_values=grids,
                                    row_orders=(False, True) if args.sweep_cyclic else (False,),
                                    activation_name=args.activation)
                if args.sweep_separate_sum and SWEEP_KERNELS[kernel][2]:
                    with separate_sum_launch():
                        rows = sweep(m, n, on_row=None, kernel=kernel, variants=variants, per_sm_values=grids,
                                     activation_name=args.activation)
                    for r in rows:
                        r["kernel"] += " (sum launched)"
                        r["frac_copy"] = r.get("GBps", float("nan")) / copy_gbps
                    sweep_rows += rows
                    write_results(args.out, "sweep", sweep_rows, extra)
        print("fastest per pass and size:")
        best = {}
        for r in sweep_rows:
            k = (r["kernel"], r["M"], r["N"])
            if r["ms"] == r["ms"] and (k not in best or r["ms"] < best[k]["ms"]):
                best[k] = r
        print_table(list(best.values()), columns)
        if args.sweep_only:
            return
    rows = bench(sizes, DTYPES, copy_gbps, args.out, activation=args.activation, passes=passes)
    out = write_results(args.out, "kernels", rows, extra)
    plot(rows, out / "kernels.png")
    print(f"copy bandwidth {copy_gbps:.0f} GB/s")
    print_table(rows, ["kernel", "M", "N", "dtype", "ours_ms", "eager_ms", "compile_ms", "vs_eager", "vs_compile",
                       "frac_copy", "ours_wall_ms", "ok"])


if __name__ == "__main__":
    main()
