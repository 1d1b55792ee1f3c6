"""Same-run A/B of revisions of the kernel source of the backward passes and the cast (GPU).

Each ``--source NAME=PATH`` is a copy of ``kernels/dact_dbias_quantize.py`` from some revision
(``git show REV:kernels/dact_dbias_quantize.py > PATH``). Every copy is loaded beside the installed
package as a module of its own (its relative imports resolve to the installed ``_launch``,
``activations`` and ``fp8``; its ``triton_op`` registrations are skipped), so all of them run in
one process, on the same data, on the same card. Each pass is launched through the copy's own
``_launch`` with the launch the installed library picks (grid ``shipped``), with ``K`` row tiles
per program (``tK``), whole waves of ``K`` programs per multiprocessor (``pK``) or the queued
form (``qKcC``: ``K`` programs per multiprocessor taking chunks of ``C`` row tiles), and optionally
other tiles (``--tiles``).

Every launch is checked first: the transposed copy equal to the row-wise one in every byte, the
row-wise codes equal to the first source's (and the first source's to the float64 values' own cast
in at least 99% of elements), the amax and the bias gradient (where the pass has one) within 1e-5
of float64's. Then the sources are timed in turn (CUDA-graph replays, median), ``--rounds``
times over, so a drift of the card over the run falls on every source alike; the table gives each
source's fastest round, its ratio to the first source's, and its bytes' rate as a fraction of the
copy bandwidth measured at the start of the run.

``--public`` adds the installed package's own function (``dact_dbias_quantize``, ``dbias_quantize``,
``quantize``: outputs allocated on every call, the shipped launch) as one more source, ``public``, in
the shipped grid: whether the public call and a launch into preallocated outputs time alike.
``--scale`` sets the FP8 scale of every pass.

    git show main:kernels/dact_dbias_quantize.py > /tmp/main.py
    python benchmarks/kernel_revisions.py --source main=/tmp/main.py --source new=kernels/dact_dbias_quantize.py

On a machine without CUDA (``TRITON_INTERPRET=1``) it runs the checks alone, at small sizes.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import statistics
import sys
from pathlib import Path

import torch
import torch.library

from bench_kernels import SIZES
from common import copy_bandwidth_gbps, environment, graph_ms, parse_sizes, print_table, write_results
from lightning_fuse.kernels import (ACTIVATIONS, activation_derivative_reference, dact_dbias_quantize, dbias_quantize,
                                    quantize, quantize_reference)
from lightning_fuse.kernels.activations import activation_id
from lightning_fuse.kernels._launch import LaunchConfig, LaunchRule, _pick_config, _queued_config, launch_config

# pass -> (activation id: 2 is gelu_tanh, 0 none; --activation sets the fused pass's; bytes per element with
# bf16 inputs; bias gradient; FP8 code: 2 e5m2, the gradients' format, 1 e4m3, the cast's; scale)
PASSES = {"dact_dbias_quantize": (2, 6, True, 2, 2048.0), "dbias_quantize": (0, 4, True, 2, 2048.0),
          "quantize": (0, 4, False, 1, 32.0)}
FP8_DTYPES = {1: torch.float8_e4m3fn, 2: torch.float8_e5m2}
PUBLIC = object()  # the source ``--public`` adds: the installed package's own function, outputs allocated per call


def load_source(name: str, path: str | Path):
    """``path`` imported as ``lightning_fuse.kernels._revision_<name>``, its ``triton_op`` calls made
    no-ops (the installed module has registered those names already)."""
    real = torch.library.triton_op

    def no_op(op_name, fn=None, **kwargs):
        return fn if fn is not None else (lambda f: f)

    spec = importlib.util.spec_from_file_location(f"lightning_fuse.kernels._revision_{name}", path)
    if spec is None:
        raise ValueError(f"--source {name}={path}: not a Python file that can be imported")
    module = importlib.util.module_from_spec(spec)
    torch.library.triton_op = no_op
    try:
        spec.loader.exec_module(module)
    finally:
        torch.library.triton_op = real
    if not hasattr(module, "_launch"):
        raise ValueError(f"--source {name}={path}: has no _launch; expected a copy of kernels/dact_dbias_quantize.py")
    return module


def grid_config(pass_name: str, m: int, n: int, device: torch.device, grid: str,
                tiles: tuple | None, dtype: torch.dtype = torch.bfloat16) -> LaunchConfig:
    """The launch for ``grid``: ``shipped`` (the installed library's rule, its tiles), ``tK`` (``K`` row
    tiles per program) or ``pK`` (the shipped rules' fewest whole waves filled to 85% at ``K`` programs per
    multiprocessor, none over 8192 rows), with the shipped tiles or ``tiles`` = (block_m, block_n,
    warps, loop stages, prefetch[, register cap per thread])."""
    shipped = launch_config(pass_name, m, n, device, dtype)
    if tiles is None:
        tiles = (shipped.block_m, shipped.block_n, shipped.num_warps, shipped.loop_stages, int(shipped.prefetch))
    block_m, block_n, warps, stages, prefetch = tiles[:5]
    registers = tiles[5] if len(tiles) > 5 else 0
    if grid == "shipped":
        return shipped
    kind, count = grid[:1], grid[1:]
    if kind == "q":
        programs, _, chunk = count.partition("c")
        if not (programs.isdigit() and chunk.isdigit() and int(programs) >= 1 and int(chunk) >= 1):
            raise ValueError(f"grid {grid!r}: expected qKcC (the queued form: K programs per multiprocessor, "
                             f"chunks of C row tiles), K, C >= 1")
        rule = LaunchRule(block_m, block_n, warps, 0, int(programs), True, chunk_tiles=int(chunk))
        config = _queued_config(m, n, device, rule)[0]
    elif kind in ("t", "p") and count.isdigit() and int(count) >= 1:
        if kind == "t":
            rule = LaunchRule(block_m, block_n, warps, stages, 1, True, prefetch=bool(prefetch),
                              tiles_per_program=int(count), min_waves=0)
        else:
            rule = LaunchRule(block_m, block_n, warps, stages, int(count), True, prefetch=bool(prefetch),
                              max_rows_per_program=8192)
        config = _pick_config(m, n, device, rule)
    else:
        raise ValueError(f"grid {grid!r}: expected 'shipped', tK (K row tiles per program), pK (whole waves of K "
                         f"programs per multiprocessor) or qKcC (the queued form), K >= 1")
    return dataclasses.replace(config, max_registers=registers)


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _inputs(m, n, device, dtype=torch.bfloat16):
    gen = torch.Generator(device="cpu").manual_seed(m * 7 + n)
    grad = torch.randn(m, n, generator=gen).to(device, dtype)
    pre = (torch.randn(m, n, generator=gen) * 2).to(device, dtype)
    return grad, pre


def compare(sources: dict, sizes, passes, grids, tile_sets, rounds: int, device: torch.device,
            scale: float | None = None, dtype: torch.dtype = torch.bfloat16):
    rows = []
    for (m, n), pass_name in itertools.product(sizes, passes):
        grad, pre = _inputs(m, n, device, dtype)
        scale_t = torch.tensor(scale or PASSES[pass_name][4], device=device)
        amax = torch.zeros(1, device=device)
        reference = _reference(pass_name, grad, pre, scale_t)
        configs = {}  # one launch per distinct configuration, named by the first grid that gives it
        for grid, tiles in itertools.product(grids, tile_sets):
            configs.setdefault(grid_config(pass_name, m, n, device, grid, tiles, dtype), grid)
        for cfg, grid in configs.items():
            rows += _compare_one(sources, pass_name, m, n, grad, pre, scale_t, amax, reference, cfg, grid, rounds,
                                 device)
    return rows


def _reference(pass_name, grad, pre, scale):
    """The float64 values' codes (their own cast), amax and bias gradient: what every launch of the
    pass at this size is checked against."""
    activation, _, _, fp8_code, _ = PASSES[pass_name]
    dx = grad.double() * (activation_derivative_reference(pre.double(), ACTIVATIONS[activation - 1]) if activation
                          else 1)
    return quantize_reference(dx, scale, FP8_DTYPES[fp8_code]).view(torch.uint8), dx.abs().max().item(), dx.sum(0)


def _compare_one(sources, pass_name, m, n, grad, pre, scale, amax, reference, cfg, grid, rounds, device):
    """Checks and times one launch configuration of one pass under every source."""
    rows = []
    activation, nbytes, with_dbias, fp8_code, _ = PASSES[pass_name]
    fp8_dtype = FP8_DTYPES[fp8_code]

    def launcher(module):
        # 0xFF: an e5m2/e4m3 NaN, so a byte the launch never writes fails the checks
        out = torch.full((m, n), 255, dtype=torch.uint8, device=device)
        out_t = torch.full((n, m), 255, dtype=torch.uint8, device=device)
        dbias = torch.full((n,), float("nan"), dtype=torch.float32, device=device)

        def call():
            module._launch(grad, pre if activation else None, activation, scale, fp8_code, amax, True, with_dbias,
                           True, cfg, out, out_t, dbias, False)
            return out, out_t, dbias
        return call

    def public_call():  # the installed package's own function: it allocates its outputs on every call
        if pass_name == "quantize":
            out, out_t = quantize(grad, scale=scale, fp8_dtype=fp8_dtype, amax=amax, transpose=True)
            dbias = None
        elif activation:
            out, out_t, dbias = dact_dbias_quantize(grad, pre, ACTIVATIONS[activation - 1], scale=scale,
                                                    fp8_dtype=fp8_dtype, amax=amax, transpose=True)
        else:
            out, out_t, dbias = dbias_quantize(grad, scale=scale, fp8_dtype=fp8_dtype, amax=amax, transpose=True)
        return out.view(torch.uint8), out_t.view(torch.uint8), dbias

    calls = {name: (public_call if module is PUBLIC else launcher(module)) for name, module in sources.items()
             if module is not PUBLIC or grid == "shipped"}
    # the first source's codes match the float64 values' own cast but for rounding-boundary ties
    ref_codes, ref_amax, ref_dbias = reference
    first_codes = None
    checks = {}
    for name, call in calls.items():
        amax.zero_()
        if sources[name] is PUBLIC:  # its outputs come from freed blocks: fill those with 0xFF first
            for shape in ((m, n), (n, m)):
                torch.full(shape, 255, dtype=torch.uint8, device=device)  # freed at once, its bytes left behind
        out, out_t, dbias = call()
        if first_codes is None:
            first_codes = out.clone()
            exact = (out == ref_codes).double().mean().item()
        rel = ((dbias.double() - ref_dbias).norm() / ref_dbias.norm()).item() if with_dbias else 0.0
        checks[name] = (torch.equal(out_t, out.t()) and torch.equal(out, first_codes) and rel < 1e-5
                        and exact >= 0.99 and abs(amax.item() - ref_amax) <= 1e-5 * ref_amax)
        if not checks[name]:
            print(f"CHECK FAILED {name} {pass_name} {m}x{n} {grid}: dbias rel {rel:.2e}, first source's codes "
                  f"{exact:.4f} exact, amax {amax.item()} against {ref_amax}", file=sys.stderr)
    times = {name: [] for name in calls}
    if device.type == "cuda":
        for _ in range(rounds):
            for name, call in calls.items():
                times[name].append(graph_ms(call, rep_ms=100))
    base = min(times[next(iter(calls))], default=float("nan"))
    for name in calls:
        best = min(times[name], default=float("nan"))
        rows.append(dict(source=name, kernel=pass_name, M=m, N=n, grid=grid, block=f"{cfg.block_m}x{cfg.block_n}",
                         warps=cfg.num_warps, stages=cfg.loop_stages, prefetch=cfg.prefetch,
                         groups=cfg.row_groups(m)[1], ms=best,
                         median_ms=statistics.median(times[name]) if times[name] else float("nan"),
                         vs_first=base / best if best == best else float("nan"),
                         GBps=m * n * nbytes / best / 1e6 if best == best else float("nan"),
                         ok=str(checks[name])))
        print_table(rows[-1:], list(rows[-1]))
    return rows


def _tiles(spec: str) -> tuple:
    values = spec.split(",")
    if len(values) not in (5, 6) or not all(v.isdigit() for v in values):
        raise ValueError(f"--tiles {spec!r}: expected 5 or 6 integers block_m,block_n,warps,loop_stages,prefetch"
                         f"[,register cap]")
    return tuple(int(v) for v in values)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", action="append", required=True, metavar="NAME=PATH",
                        help="a copy of kernels/dact_dbias_quantize.py; the first is the baseline")
    parser.add_argument("--passes", default="dbias_quantize,dact_dbias_quantize")
    parser.add_argument("--sizes", help="MxN,... (default: the kernel table's sizes; 64x96,130x40 on CPU)")
    parser.add_argument("--grids", default="shipped", help="shipped, tK (K row tiles per program), pK (whole "
                        "waves of K programs per multiprocessor) or qKcC (the queued form: K programs per "
                        "multiprocessor taking chunks of C row tiles), comma-separated")
    parser.add_argument("--tiles", action="append", help="block_m,block_n,warps,loop_stages,prefetch[,register cap] for "
                        "the tK, pK and qKcC grids (repeatable; default: the shipped launch's)")
    parser.add_argument("--public", action="store_true", help="also time the installed package's own function "
                        "(outputs allocated per call, its shipped launch) as a source named 'public', in the shipped grid")
    parser.add_argument("--scale", type=float, help="the FP8 scale (default: 2048 for the gradients' passes, 32 for "
                        "the cast)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="the inputs' dtype")
    parser.add_argument("--activation", choices=ACTIVATIONS, default="gelu_tanh",
                        help="the fused pass's activation")
    parser.add_argument("--out", default="results/kernel_revisions")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sources = {}
    for spec in args.source:
        name, sep, path = spec.partition("=")
        if not sep or not name.isidentifier():
            raise ValueError(f"--source {spec!r}: expected NAME=PATH with NAME a Python identifier")
        sources[name] = load_source(name, path)
    if args.public:
        if "public" in sources:
            raise ValueError("--source public=...: the name 'public' is taken by --public; choose another")
        sources["public"] = PUBLIC
    passes = args.passes.split(",")
    PASSES["dact_dbias_quantize"] = (activation_id(args.activation), *PASSES["dact_dbias_quantize"][1:])
    for p in passes:
        if p not in PASSES:
            raise ValueError(f"--passes: {p!r} is not one of {', '.join(PASSES)}")
    default_sizes = ",".join(f"{m}x{n}" for m, n in SIZES) if device.type == "cuda" else "64x96,130x40"
    tile_sets = [_tiles(spec) for spec in args.tiles] if args.tiles else [None]
    copy_gbps = copy_bandwidth_gbps() if device.type == "cuda" else float("nan")
    rows = compare(sources, parse_sizes(args.sizes or default_sizes), passes, args.grids.split(","), tile_sets,
                   args.rounds, device, args.scale, DTYPES[args.dtype])
    for row in rows:
        row["frac_copy"] = row["GBps"] / copy_gbps
    write_results(args.out, "revisions", rows, {"sources": dict(s.partition("=")[::2] for s in args.source),
                                                "copy_GBps": copy_gbps})
    print(environment(), f"copy bandwidth {copy_gbps:.0f} GB/s")
    print_table(rows, ["source", "kernel", "M", "N", "grid", "block", "warps", "stages", "prefetch", "groups", "ms",
                       "median_ms", "vs_first", "frac_copy", "ok"])
    if not all(r["ok"] == "True" for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
