"""Forms of the fused pass, each against PyTorch eager and ``torch.compile`` timed in the same run (GPU).

The 4x-``torch.compile`` target is a ratio at one size (16384x6400): a form of the pass counts only
beside the baseline measured with it. Each ``--form`` is run through the public
``dact_dbias_quantize`` (tanh GELU, e5m2, transposed copy) on the same data:

- ``shipped``: the launch the library's rules pick;
- ``stagesK``: that launch with a ``K``-deep pipelined row loop where it takes the loop without
  prefetch (the two-deep form's; 1 turns the pipelining off);
- ``in_turn``: that launch with its row tiles dealt to the row groups in turn (``cyclic_rows``);
- ``regsR``: that launch compiled under a cap of ``R`` registers per thread (``max_registers``), so
  that more programs fit on a multiprocessor;
- ``groupsG``: that launch with ``G`` row groups per column strip (evened out as the rules do);
- ``NAME=PATH``: a copy of ``kernels/dact_dbias_quantize.py`` (as ``kernel_revisions.py`` loads them)
  whose row-groups kernel stands in for the shipped one;
- forms joined by ``+`` combine: ``early=/tmp/early.py+in_turn``.

Every form's outputs are checked first (FP8 codes >= 99% exact against the float64 values' cast and
none more than one FP8 step off, every transposed element equal to the row-wise copy, the bias
gradient within 1e-3 of float64's); then the baselines and the forms are timed in turn (CUDA-graph
replays), ``--rounds`` times over, and the table gives each one's median round.

    cd benchmarks && python fused_forms.py --form shipped --form stages1 --form in_turn --out results/fused_forms

On a machine without CUDA (``TRITON_INTERPRET=1``) it runs the checks alone, at a small size.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import statistics

import torch

from bench_kernels import GRAD, _check, _dact_reference, _poison_like
from common import (copy_bandwidth_gbps, environment, graph_ms, parse_sizes, print_table, row_groups_changed,
                    unfused_dact_dbias_quantize, write_results)
from kernel_revisions import load_source
from lightning_fuse.kernels import _launch, dact_dbias_quantize

# the module, not the function the package exports under the same name
fused_module = importlib.import_module("lightning_fuse.kernels.dact_dbias_quantize")
SHIPPED_KERNEL = fused_module._dact_dbias_quantize_kernel
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True)
class Form:
    name: str
    kernel: object = SHIPPED_KERNEL
    loop_stages: int | None = None
    in_turn: bool = False
    max_registers: int | None = None
    groups: int | None = None


def parse_form(spec: str, sources: dict) -> Form:
    """``spec`` as a ``Form``; ``sources`` caches the kernel copies loaded so far by path."""
    form = Form(spec)
    for part in spec.split("+"):
        if part == "shipped":
            continue
        if part == "in_turn":
            form = dataclasses.replace(form, in_turn=True)
        elif part.startswith("stages") and part[6:].isdigit() and int(part[6:]) >= 1:
            form = dataclasses.replace(form, loop_stages=int(part[6:]))
        elif part.startswith("regs") and part[4:].isdigit() and int(part[4:]) >= 24:
            form = dataclasses.replace(form, max_registers=int(part[4:]))
        elif part.startswith("groups") and part[6:].isdigit() and int(part[6:]) >= 1:
            form = dataclasses.replace(form, groups=int(part[6:]))
        elif "=" in part:
            name, path = part.split("=", 1)
            if path not in sources:
                sources[path] = load_source(name, path)._dact_dbias_quantize_kernel
            form = dataclasses.replace(form, name=spec.replace(f"={path}", ""), kernel=sources[path])
        else:
            raise ValueError(f"--form {spec!r}: expected shipped, stagesK (K >= 1), in_turn, regsR (R >= 24), groupsG "
                             f"(G >= 1) or NAME=PATH (a copy of kernels/dact_dbias_quantize.py), joined by '+'; "
                             f"got {part!r}")
    return form


@contextlib.contextmanager
def using(form: Form):
    """Every fused launch inside runs ``form``: its kernel, and the rules' pick changed as it says."""
    fused_module._dact_dbias_quantize_kernel = form.kernel
    try:
        with row_groups_changed(cyclic_rows=True if form.in_turn else None, loop_stages=form.loop_stages,
                                max_registers=form.max_registers, groups=form.groups):
            yield
    finally:
        fused_module._dact_dbias_quantize_kernel = SHIPPED_KERNEL


def compare(forms, m, n, dname, rounds, copy_gbps, device):
    torch.manual_seed(0)
    dtype = DTYPES[dname]
    grad = torch.randn(m, n, device=device, dtype=dtype)
    pre = torch.randn(m, n, device=device, dtype=dtype) * 2
    scale = torch.tensor(2048.0, device=device)
    amax = torch.zeros(1, device=device)

    def ours():
        return dact_dbias_quantize(grad, pre, "gelu_tanh", scale=scale, fp8_dtype=GRAD, amax=amax, transpose=True)

    reference = _dact_reference(grad, pre, scale, GRAD)
    checks, configs = {}, {}
    for form in forms:
        with using(form):
            configs[form.name] = _launch.launch_config("dact_dbias_quantize", m, n, grad.device, dtype)
            if device.type == "cuda":
                _poison_like((m, n), (n, m))
            checks[form.name] = _check(f"{form.name} {m}x{n} {dname}", ours(), reference)[0]
    times = {form.name: [] for form in forms}
    baselines = {"eager": [], "compile": []}
    if device.type == "cuda":
        def eager():
            return unfused_dact_dbias_quantize(grad, pre, "tanh", scale, GRAD, amax)

        compiled = torch.compile(eager, dynamic=False)
        compiled()
        for _ in range(rounds):
            baselines["eager"].append(graph_ms(eager, rep_ms=100))
            baselines["compile"].append(graph_ms(compiled, rep_ms=100))
            for form in forms:
                with using(form):
                    times[form.name].append(graph_ms(ours, rep_ms=100))
        torch._dynamo.reset()
    median = {name: statistics.median(ts) if ts else float("nan") for name, ts in {**times, **baselines}.items()}
    first = median[forms[0].name]
    rows = []
    for form in forms:
        cfg, t = configs[form.name], median[form.name]
        rows.append(dict(form=form.name, M=m, N=n, dtype=dname, groups=cfg.row_groups(m)[1],
                         loop_stages=cfg.loop_stages, prefetch=cfg.prefetch, in_turn=cfg.cyclic_rows,
                         max_registers=cfg.max_registers, ms=t,
                         vs_first=first / t, vs_eager=median["eager"] / t, vs_compile=median["compile"] / t,
                         frac_copy=m * n * (2 * grad.element_size() + 2) / t / 1e6 / copy_gbps,
                         eager_ms=median["eager"], compile_ms=median["compile"],
                         spread=max(times[form.name]) / min(times[form.name]) if times[form.name] else float("nan"),
                         ok=str(checks[form.name])))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--form", action="append", help="shipped, stagesK, in_turn, regsR, groupsG, NAME=PATH or a '+' of them "
                        "(repeatable; the first is the one the others are compared with; default: shipped)")
    parser.add_argument("--sizes", help="MxN,... (default: 16384x6400; 132x96 on CPU)")
    parser.add_argument("--dtypes", default="bf16,fp16", help=f"comma-separated: {', '.join(DTYPES)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="results/fused_forms")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sources = {}
    forms = [parse_form(spec, sources) for spec in (args.form or ["shipped"])]
    if len({form.name for form in forms}) < len(forms):
        raise SystemExit(f"--form: each form once; got {[form.name for form in forms]}")
    sizes = parse_sizes(args.sizes or ("16384x6400" if device.type == "cuda" else "132x96"))
    dtypes = args.dtypes.split(",")
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        raise SystemExit(f"--dtypes: expected some of {', '.join(DTYPES)}; got {unknown}")
    copy_gbps = copy_bandwidth_gbps() if device.type == "cuda" else float("nan")
    print(f"{environment()}  copy bandwidth {copy_gbps:.0f} GB/s")
    rows = []
    for (m, n), dname in ((size, d) for size in sizes for d in dtypes):
        rows += compare(forms, m, n, dname, args.rounds, copy_gbps, device)
        write_results(args.out, "fused_forms", rows, {"copy_GBps": copy_gbps})
    print_table(rows, ["form", "M", "N", "dtype", "groups", "loop_stages", "in_turn", "max_registers", "ms", "vs_first",
                       "vs_compile", "frac_copy", "compile_ms", "spread", "ok"])
    if not all(row["ok"] == "True" for row in rows):
        raise SystemExit("a form failed its checks (above)")


if __name__ == "__main__":
    main()
