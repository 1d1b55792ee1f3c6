"""Host (CPU) time against device time (GPU): is a call or a training step bound by launching?

For each kernel call and for one fused-MLP training step it reports:

- host ms: CPU time to issue one call, measured over a burst of calls issued back to back with no
  synchronization (the GPU queue absorbs them, so this is the launch cost alone);
- device ms: the same call replayed from a CUDA graph (no launch cost);
- wall ms: CUDA-event median of the call as a user runs it.

A call with host ms above device ms is launch-bound: the GPU waits on Python. The script also writes
the top entries of a cProfile of the MLP step (``profile.txt``), the place to look when it is.

    python benchmarks/bench_overhead.py --out results/overhead

``--wrappers-only`` runs without a GPU: the Triton kernels are replaced by no-ops (under the Triton
interpreter's launch path) and it times what remains, the library's own Python per call and per
FP8 MLP step (tiny shapes, ``emulate=True``), against a plain ``torch.add_`` and a plain bf16 step.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
from pathlib import Path

import torch
from torch import nn

from common import environment, graph_ms, host_ms, median_ms, print_table, write_results
from lightning_fuse import DelayedScaling, FuseConfig, fp8_autocast, fuse_
from lightning_fuse.kernels import bias_act, dact_dbias_quantize, dbias_quantize, quantize


def kernel_rows(m: int, n: int) -> list[dict]:
    dev = "cuda"
    g = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    pre = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    bias = torch.randn(n, device=dev, dtype=torch.bfloat16)
    scale = torch.ones((), device=dev)
    amax = torch.zeros(1, device=dev)
    e5, e4 = torch.float8_e5m2, torch.float8_e4m3fn
    calls = {
        "torch add_ (reference point)": lambda: g.add_(0.0),
        "dact_dbias_quantize": lambda: dact_dbias_quantize(g, pre, "gelu_tanh", scale=scale, fp8_dtype=e5, amax=amax,
                                                           transpose=True),
        "dbias_quantize": lambda: dbias_quantize(g, scale=scale, fp8_dtype=e5, amax=amax, transpose=True),
        "quantize": lambda: quantize(g, scale=scale, fp8_dtype=e4, amax=amax, transpose=True),
        "bias_act": lambda: bias_act(pre, bias, "gelu_tanh"),
    }
    rows = []
    for name, fn in calls.items():
        rows.append({"what": f"{name} {m}x{n}", "host_ms": host_ms(fn), "device_ms": graph_ms(fn),
                     "wall_ms": median_ms(fn)})
    return rows


def launch_rows() -> list[dict]:
    """Host cost of launching one Triton kernel with the fused kernel's argument count: through
    ``JITFunction`` (binding, specialization, cache lookup) against calling the compiled kernel's
    launcher directly, and a bare ``torch._scaled_mm``."""
    import triton
    import triton.language as tl

    @triton.jit
    def touch(p0, p1, p2, p3, p4, p5, p6, s0, s1, s2, s3, s4, s5, m, n, r,
              A: tl.constexpr, B: tl.constexpr, C: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(p0 + offs, tl.load(p1 + offs) + m)

    t = [torch.zeros(1024, device="cuda") for _ in range(7)]
    ints = (4096, 1, 4096, 1, 4096, 4096, 8192, 4096, 64)
    jit = lambda: touch[(1,)](*t, *ints, A=1, B=2, C=True, BLOCK=128)
    compiled = jit()
    stream = torch.cuda.current_stream().cuda_stream
    args = (*t, *ints, 1, 2, True, 128)
    direct = lambda: compiled.run(1, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None,
                                  *args)
    a = torch.randn(4096, 4096, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(4096, 4096, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    mm = lambda: torch._scaled_mm(a[:64], b[:, :64], scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    return [{"what": name, "host_ms": host_ms(fn, 2000, warmup=5), "device_ms": float("nan"), "wall_ms": float("nan")}
            for name, fn in (("triton launch through JITFunction (22 args)", jit),
                             ("triton launch, compiled kernel called directly", direct),
                             ("torch._scaled_mm 64x4096x64", mm), ("torch.empty", lambda: torch.empty(64, device="cuda")))]


def mlp_rows(d: int, tokens: int, out_dir: Path) -> list[dict]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d)).cuda().bfloat16()
    base = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d)).cuda().bfloat16()
    fuse_(model, FuseConfig(convert="mlp"))
    x = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16)
    recipe = DelayedScaling()

    def ours():
        with fp8_autocast(recipe):
            y = model(x)
        y.backward(dy)

    def bf16():
        base(x).backward(dy)

    rows = []
    for name, fn in (("MLP step bf16 eager", bf16), ("MLP step ours", ours)):
        for _ in range(3):
            fn()
        rows.append({"what": f"{name} d={d}", "host_ms": host_ms(fn, 30), "device_ms": _profiled_device_ms(fn),
                     "wall_ms": median_ms(fn)})
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(20):
        ours()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
    (out_dir / f"profile_d{d}.txt").write_text(text.getvalue())
    return rows


def _profiled_device_ms(fn, steps: int = 5) -> float:
    """Sum of GPU kernel time per step, from the PyTorch profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    total_us = sum(e.self_device_time_total for e in prof.key_averages())
    return total_us / steps / 1e3


def wrapper_rows() -> list[dict]:
    """CPU microseconds of the library's Python around each launch (kernels replaced by no-ops)."""
    import os
    import sys

    os.environ["TRITON_INTERPRET"] = "1"  # CPU tensors take the kernels' launch path (launches are no-ops here)

    class _NoLaunch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    modules = {name: sys.modules[f"lightning_fuse.kernels.{name}"] for name in
               ("dact_dbias_quantize", "bias_act", "scale_update")}
    modules["dact_dbias_quantize"]._dact_dbias_quantize_kernel = _NoLaunch()
    modules["dact_dbias_quantize"]._sum_partials_kernel = _NoLaunch()
    modules["bias_act"]._bias_act_kernel = _NoLaunch()
    modules["scale_update"]._update_scales_kernel = _NoLaunch()

    g = torch.randn(64, 96, dtype=torch.bfloat16)
    pre = torch.randn_like(g)
    scale, amax = torch.ones(()), torch.zeros(1)
    rows = [
        ("torch add_ (reference point)", lambda: amax.add_(0.0)),
        ("dact_dbias_quantize", lambda: dact_dbias_quantize(g, pre, "gelu_tanh", scale=scale, fp8_dtype=torch.float8_e5m2,
                                                            amax=amax, transpose=True)),
        ("quantize", lambda: quantize(g, scale=scale, fp8_dtype=torch.float8_e4m3fn, amax=amax, transpose=True)),
        ("bias_act", lambda: bias_act(pre, g[0], "gelu_tanh")),
    ]
    d = 32
    plain = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d)).bfloat16()
    model = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d)).bfloat16()
    fuse_(model, FuseConfig(convert="mlp", emulate=True))
    x = torch.randn(16, d, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(16, d, dtype=torch.bfloat16)
    recipe = DelayedScaling()

    def ours():
        with fp8_autocast(recipe):
            y = model(x)
        y.backward(dy)

    class FunctionalMLP(nn.Module):  # litgpt's form: the activation a call in the forward
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(torch.nn.functional.gelu(self.fc(x), approximate="tanh"))

    functional = FunctionalMLP().bfloat16()
    fuse_(functional, FuseConfig(convert="mlp", emulate=True))

    def ours_functional():
        with fp8_autocast(recipe):
            y = functional(x)
        y.backward(dy)

    rows += [("MLP step bf16 (16 x 32, CPU GEMMs)", lambda: plain(x).backward(dy)),
             ("MLP step ours (16 x 32, CPU FP8 GEMMs)", ours),
             ("MLP step ours, F.gelu in the forward (activation call skipped at run time)", ours_functional)]
    return [{"what": name, "cpu_us": 1e3 * host_ms(fn, 300 if "step" in name else 2000, warmup=5)} for name, fn in rows]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/overhead")
    parser.add_argument("--dims", default="1600")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--wrappers-only", action="store_true", help="no GPU: time the library's Python alone")
    args = parser.parse_args()
    out = Path(args.out)
    if args.wrappers_only:
        rows = wrapper_rows()
        write_results(out, "wrappers", rows)
        print_table(rows, ["what", "cpu_us"])
        return
    out.mkdir(parents=True, exist_ok=True)
    print(environment())
    rows = launch_rows() + kernel_rows(8192, 3072)
    for d in [int(v) for v in args.dims.split(",")]:
        rows += mlp_rows(d, args.tokens, out)
    write_results(out, "overhead", rows)
    print_table(rows, ["what", "host_ms", "device_ms", "wall_ms"])


if __name__ == "__main__":
    main()
