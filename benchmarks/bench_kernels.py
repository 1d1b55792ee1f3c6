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
import itertools
import os

import torch

from common import (
    FP8_MAX,
    copy_bandwidth_gbps,
    graph_ms,
    environment,
    median_ms,
    print_table,
    unfused_dact_dbias_quantize,
    unfused_dbias_quantize,
    unfused_quantize,
    write_results,
)
from lightning_fuse.kernels import (activation_derivative_reference, bias_act_reference, dact_dbias_quantize,
                                    dbias_quantize, quantize)
from lightning_fuse.kernels._launch import LaunchConfig, _pick_config, fp8_encoder
from lightning_fuse.kernels.activations import activation_id
from lightning_fuse.kernels.bias_act import _bias_act_kernel
from lightning_fuse.kernels.dact_dbias_quantize import _launch

SIZES = [(8192, 3072), (16384, 6400), (32768, 8192), (16384, 16384)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
GRAD = torch.float8_e5m2
FWD = torch.float8_e4m3fn


def _check(name, ours, theirs):
    """FP8 outputs: >= 99.9% bit-exact with the eager cast, transposed copy exactly the row-wise one."""
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


def _dact_reference(grad, pre, scale, fp8_dtype):
    """float64 reference of the fused kernel (PyTorch's fp32 gelu_backward loses accuracy for large
    negative inputs, where 1 + tanh cancels)."""
    dx = grad.double() * activation_derivative_reference(pre.double(), "gelu_tanh")
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


# (encoder, block_m, block_n, warps, loop stages, byte transposes); the first is the previous
# default, the second the shipped one (SHIPPED_VARIANT).
SWEEP_VARIANTS = [
    ("ptx", 64, 64, 8, 0, False), ("ptx", 64, 64, 8, 3, False), ("ptx", 64, 64, 8, 2, False),
    ("ptx", 64, 64, 8, 4, False), ("ptx", 64, 64, 4, 3, False), ("ptx", 128, 64, 8, 3, False),
    ("ptx", 64, 128, 8, 3, False), ("ptx", 32, 128, 4, 3, False), ("ptx", 64, 64, 4, 0, False),
    ("ptx4", 64, 64, 8, 3, False), ("ptx", 64, 64, 8, 3, True),
]
SHIPPED_VARIANT = SWEEP_VARIANTS[1]  # what pick_config chooses for the bias-gradient passes


# kernel -> (activation id, FP8 code, bias gradient, FP8 dtype) of the pass the sweep times
SWEEP_KERNELS = {"dact_dbias_quantize": (2, 2, True, GRAD), "dbias_quantize": (0, 2, True, GRAD),
                 "quantize": (0, 1, False, FWD)}


def sweep(m=16384, n=6400, dtype=torch.bfloat16, per_sm_values=("occ", "occ2", 2, 4, 8), on_row=None,
          variants=SWEEP_VARIANTS, kernel="dact_dbias_quantize"):
    """Times launch configurations of one of the backward/cast passes (``SWEEP_KERNELS``; by default
    the fused kernel): ``SWEEP_VARIANTS`` x programs per multiprocessor, ``occ`` = exactly one wave
    at the compiled kernel's occupancy. Checks every output of each, and returns the rows;
    ``on_row`` sees each row as it is made."""
    activation, fp8_code, with_dbias, fp8_dtype = SWEEP_KERNELS[kernel]
    grad = torch.randn(m, n, device="cuda", dtype=dtype)
    pre = torch.randn(m, n, device="cuda", dtype=dtype) * 2 if activation else None
    scale = torch.tensor(2048.0 if fp8_code == 2 else 32.0, device="cuda")
    amax = torch.zeros(1, device="cuda")
    if activation:
        ref = _dact_reference(grad, pre, scale, GRAD)
    elif with_dbias:
        ref = unfused_dbias_quantize(grad.float(), scale, GRAD, amax.clone())
    else:
        ref = unfused_quantize(grad.float(), scale, FWD, amax.clone())
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.empty(m, n, dtype=torch.uint8, device="cuda")
    out_t = torch.empty(n, m, dtype=torch.uint8, device="cuda")
    dbias = torch.empty(n, dtype=torch.float32, device="cuda")
    rows, seen = [], set()
    for (encoder, bm, bn, warps, stages, tbytes), per_sm in itertools.product(variants, per_sm_values):
        os.environ["LIGHTNING_FUSE_FP8_ENCODER"] = encoder
        strips = -(-n // bn)
        row = dict(kernel=kernel, M=m, N=n, encoder=encoder, block_m=bm, block_n=bn, warps=warps, stages=stages,
                   transpose_bytes=tbytes, per_sm=per_sm)
        try:
            compiled = _launch(grad, pre, activation, scale, fp8_code, amax, True, with_dbias, True,
                               LaunchConfig(bm, bn, warps, 1, tbytes, stages), out, out_t, dbias, False)
            resident = _resident_per_sm(compiled, warps)
            if per_sm in ("occ", "occ2"):  # whole waves: never a partly filled last one
                groups = max(1, min(-(-m // bm), (sms * resident * (2 if per_sm == "occ2" else 1)) // strips))
            else:
                groups = max(1, min(-(-m // bm), -(-(sms * per_sm) // strips)))
            cfg = LaunchConfig(bm, bn, warps, groups, tbytes, stages)
            key = (encoder, bm, bn, warps, stages, tbytes, cfg.row_groups(m))
            if key in seen:
                continue
            seen.add(key)

            def run():
                _launch(grad, pre, activation, scale, fp8_code, amax, True, with_dbias, True, cfg, out, out_t, dbias,
                        False)
            out.fill_(255)
            out_t.fill_(255)
            run()
            ok, _ = _check(f"sweep {kernel} {cfg}", (out.view(fp8_dtype), out_t.view(fp8_dtype),
                                                      dbias if with_dbias else None), ref)
            ms = graph_ms(run, rep_ms=60)
            row.update(regs=compiled.n_regs, spills=compiled.n_spills, shared=compiled.metadata.shared,
                       resident=resident, groups=cfg.row_groups(m)[1], ms=ms,
                       GBps=m * n * ((2 if activation else 1) * grad.element_size() + 2) / ms / 1e6, ok=str(ok))
        except Exception as exc:  # a configuration the compiler rejects (e.g. out of resources)
            row.update(ms=float("nan"), ok=repr(exc)[:80])
        rows.append(row)
        if on_row is not None:
            on_row(rows)
    os.environ.pop("LIGHTNING_FUSE_FP8_ENCODER", None)
    return rows


BIAS_ACT_VARIANTS = list(itertools.product((0, 3, 4), (4, 8), ((64, 64), (32, 64), (64, 128), (32, 128))))


def sweep_bias_act(m=16384, n=8192, dtype=torch.bfloat16, on_row=None):
    """Times launch configurations of the forward activation pass as the modules run it after an FP8
    GEMM with the bias in its epilogue (gelu_tanh; output, e4m3 row-wise and transposed copies, amax;
    6 bytes per element): ``BIAS_ACT_VARIANTS`` (loop stages, warps, tiles) x programs per
    multiprocessor (``f4``: 4, rounded down to whole waves; ``c8``: 8, rounded up). Every output of
    each is checked."""
    h = torch.randn(m, n, device="cuda", dtype=dtype)
    scale = torch.tensor(64.0, device="cuda")
    amax = torch.zeros(1, device="cuda")
    y = torch.empty_like(h)
    q = torch.empty(m, n, dtype=torch.uint8, device="cuda")
    q_t = torch.empty(n, m, dtype=torch.uint8, device="cuda")
    ref_y, ref_q, _ = bias_act_reference(h, None, "gelu_tanh", scale=scale, fp8_dtype=FWD)
    rows = []
    for (stages, warps, (bm, bn)), per_sm in itertools.product(BIAS_ACT_VARIANTS, ("f4", "c8")):
        strips = -(-n // bn)
        # the library's grid rule (kernels/_launch.py), with this variant's tiles and programs per SM
        cfg = _pick_config(m, n, h.device, bm, bn, warps, int(per_sm[1:]), stages, per_sm[0] == "f")
        rows_per_group, groups = cfg.row_groups(m)
        row = dict(M=m, N=n, block_m=bm, block_n=bn, warps=warps, stages=stages, per_sm=per_sm, groups=groups)

        def run():
            _bias_act_kernel[(strips, groups)](
                h, h, y, q, q_t, scale, amax, h, h.stride(0), h.stride(1), y.stride(0), q.stride(0),
                q_t.stride(0), 0, m, n, rows_per_group, ACTIVATION=activation_id("gelu_tanh"), HAS_BIAS=False,
                STORE_PRE=False, STORE_Y=True, FP8_FORMAT=1, TRANSPOSE=True, COMPUTE_AMAX=True,
                ENCODER=fp8_encoder(h), LOOP_STAGES=stages or None, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps)
        try:
            q.fill_(0)
            q_t.fill_(0)
            y.fill_(0)
            run()
            exact = (q == ref_q.view(torch.uint8)).float().mean().item()
            ok = exact >= 0.99 and torch.equal(q_t, q.t()) and (y == ref_y).float().mean().item() >= 0.999
            ms = graph_ms(run, rep_ms=100)
            row.update(ms=ms, GBps=m * n * (2 * h.element_size() + 2) / ms / 1e6, exact=exact, ok=str(ok))
        except Exception as exc:  # a configuration the compiler rejects
            row.update(ms=float("nan"), ok=repr(exc)[:80])
        rows.append(row)
        if on_row is not None:
            on_row(rows)
    return rows


def bench(sizes, dtypes, copy_gbps, out_dir):
    rows = []
    for (m, n), (dname, dtype) in itertools.product(sizes, dtypes.items()):
        grad = torch.randn(m, n, device="cuda", dtype=dtype)
        pre = torch.randn(m, n, device="cuda", dtype=dtype) * 2
        scale = torch.tensor(2048.0, device="cuda")
        amax = torch.zeros(1, device="cuda")
        eb = grad.element_size()
        cases = {
            "dact_dbias_quantize": (
                lambda: dact_dbias_quantize(grad, pre, "gelu_tanh", scale=scale, fp8_dtype=GRAD, amax=amax,
                                            transpose=True),
                lambda: unfused_dact_dbias_quantize(grad, pre, "tanh", scale, GRAD, amax),
                lambda: _dact_reference(grad, pre, scale, GRAD),
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
    fig, axes = plt.subplots(1, len(kernels), figsize=(6 * len(kernels), 4), sharey=True)
    for ax, kernel in zip(axes, kernels):
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
    parser.add_argument("--sweep", action="store_true", help="also time launch configurations of the fused kernel")
    parser.add_argument("--sweep-sizes", default="16384x6400", help="sizes the sweep runs at")
    parser.add_argument("--sweep-only", action="store_true", help="stop after the sweep")
    parser.add_argument("--sweep-kernel", default="dact_dbias_quantize", choices=list(SWEEP_KERNELS),
                        help="the pass the sweep times")
    parser.add_argument("--sweep-grid-only", action="store_true",
                        help="sweep only the number of programs, with the shipped tiles and pipelining")
    parser.add_argument("--sweep-bias-act", action="store_true",
                        help="time launch configurations of the forward activation pass at --sweep-sizes, then stop")
    parser.add_argument("--sizes", default=",".join(f"{m}x{n}" for m, n in SIZES))
    args = parser.parse_args()
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    torch.manual_seed(0)
    copy_gbps = copy_bandwidth_gbps()
    print(f"{environment()}  copy bandwidth {copy_gbps:.0f} GB/s")
    extra = {"copy_GBps": copy_gbps}
    if args.sweep_bias_act:
        columns = ["M", "N", "block_m", "block_n", "warps", "stages", "per_sm", "groups", "ms", "frac_copy", "ok"]
        done = []

        def on_bias_act_row(rows):
            rows[-1]["frac_copy"] = rows[-1].get("GBps", float("nan")) / copy_gbps
            write_results(args.out, "sweep_bias_act", done + rows, extra)
            print_table(rows[-1:], columns)

        for m, n in [tuple(int(v) for v in s.split("x")) for s in args.sweep_sizes.split(",")]:
            done += sweep_bias_act(m, n, on_row=on_bias_act_row)
        print("fastest:")
        print_table(sorted(done, key=lambda r: r["ms"] if r["ms"] == r["ms"] else 1e9)[:8], columns)
        return
    if args.sweep:
        columns = ["kernel", "M", "N", "encoder", "block_m", "block_n", "warps", "stages", "transpose_bytes",
                   "per_sm", "regs", "resident", "groups", "ms", "frac_copy", "ok"]
        sweep_rows = []

        def on_row(rows):  # written and printed row by row: a run cut off by its time limit keeps them
            rows[-1]["frac_copy"] = rows[-1].get("GBps", float("nan")) / copy_gbps
            write_results(args.out, "sweep", sweep_rows + rows, extra)
            print_table(rows[-1:], columns)

        for m, n in [tuple(int(v) for v in s.split("x")) for s in args.sweep_sizes.split(",")]:
            if args.sweep_grid_only:  # the shipped tiles, only the grid size varies: whole waves or not
                sweep_rows += sweep(m, n, per_sm_values=("occ", "occ2", 3, 4, 8), on_row=on_row,
                                    variants=[SHIPPED_VARIANT], kernel=args.sweep_kernel)
            else:
                sweep_rows += sweep(m, n, on_row=on_row, kernel=args.sweep_kernel)
        print("fastest:")
        print_table(sorted(sweep_rows, key=lambda r: r["ms"] if r["ms"] == r["ms"] else 1e9)[:8], columns)
        if args.sweep_only:
            return
    rows = bench(sizes, DTYPES, copy_gbps, args.out)
    out = write_results(args.out, "kernels", rows, extra)
    plot(rows, out / "kernels.png")
    print(f"copy bandwidth {copy_gbps:.0f} GB/s")
    print_table(rows, ["kernel", "M", "N", "dtype", "ours_ms", "eager_ms", "compile_ms", "vs_eager", "vs_compile",
                       "frac_copy", "ours_wall_ms", "ok"])


if __name__ == "__main__":
    main()
