"""Shared pieces of the GPU benchmarks: timing, copy bandwidth, the unfused PyTorch baselines, output."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import importlib
import json
import os
import platform
import time
from datetime import date
from pathlib import Path
from typing import Callable

import torch
import triton
import triton.testing

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def environment() -> dict:
    """Date, GPU, library versions: stamped on every result file."""
    return {
        "date": date.today().isoformat(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }


def median_ms(fn: Callable[[], object], warmup_ms: int = 50, rep_ms: int = 300) -> float:
    """Median time of ``fn`` in ms: CUDA events through ``triton.testing.do_bench``, after warm-up."""
    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def graph_ms(fn: Callable[[], object], rep_ms: int = 200) -> float:
    """Median device time of ``fn`` in ms, replayed from a CUDA graph: launch overhead excluded."""
    return float(triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))


@contextlib.contextmanager
def separate_sum_launch():
    """Inside it, the passes sum the bias gradient in their second launch (no arrival counters), as
    under ``torch.compile``: what summing it inside the pass saves."""
    module = importlib.import_module("lightning_fuse.kernels.dact_dbias_quantize")
    in_pass = module._arrival_counters
    module._arrival_counters = lambda device, strips: None
    try:
        yield
    finally:
        module._arrival_counters = in_pass


@contextlib.contextmanager
def row_groups_changed(cyclic_rows: bool | None = None, loop_stages: int | None = None,
                       max_registers: int | None = None, groups: int | None = None):
    """Inside it, every row-groups launch the rules pick (of two groups or more; the queued form is left
    as it is) deals its row tiles in turn or not (``cyclic_rows``; ``None`` keeps the rule's order),
    every one whose loop has no prefetch is pipelined ``loop_stages`` deep (``None`` keeps the rule's),
    and, where given, compiles under a cap of ``max_registers`` per thread and runs ``groups`` row groups
    per column strip (``None`` keeps the rule's grid; the group count is evened out as the rules do)."""
    launch = importlib.import_module("lightning_fuse.kernels._launch")
    pick = launch._pick_config

    def changed(m, n, device, rule, dtype=torch.bfloat16):
        cfg = pick(m, n, device, rule, dtype)
        if cfg.chunk_tiles:
            return cfg
        if cyclic_rows is not None and cfg.groups > 1:
            cfg = dataclasses.replace(cfg, cyclic_rows=cyclic_rows)
        if loop_stages is not None and not cfg.prefetch:
            cfg = dataclasses.replace(cfg, loop_stages=loop_stages)
        if max_registers is not None:
            cfg = dataclasses.replace(cfg, max_registers=max_registers)
        if groups is not None:  # evened out: no empty group
            cfg = dataclasses.replace(cfg, groups=dataclasses.replace(cfg, groups=groups).row_groups(m)[1])
        return cfg

    launch._pick_config = changed
    launch._CONFIGS.clear()
    try:
        yield
    finally:
        launch._pick_config = pick
        launch._CONFIGS.clear()


def host_ms(fn, calls: int = 200, warmup: int = 1) -> float:
    """CPU ms per call over a burst of ``calls`` issued without synchronizing (the GPU, if any, is
    idle at the start and drained at the end)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    sync()
    return elapsed / calls * 1e3


def copy_bandwidth_gbps(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), measured now.

    Timed with plain CUDA events, not a CUDA graph: captured in a graph, ``copy_`` becomes a memcpy
    node and ran at 2.77 TB/s on the H200 against 4.27 TB/s for the same copy launched directly.
    """
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6


def unfused_dact_dbias_quantize(grad: torch.Tensor, pre_act: torch.Tensor, approximate: str, scale: torch.Tensor,
                                fp8_dtype: torch.dtype, amax: torch.Tensor, transpose: bool = True):
    """The PyTorch sequence the fused kernel replaces: gelu_backward, sum, amax, scaled saturating cast, transpose."""
    dx = torch.ops.aten.gelu_backward(grad, pre_act, approximate=approximate)
    return unfused_dbias_quantize(dx, scale, fp8_dtype, amax, transpose)


def unfused_dbias_quantize(grad: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, amax: torch.Tensor,
                           transpose: bool = True):
    """sum, amax, scaled saturating cast, transpose."""
    dbias = grad.sum(0, dtype=torch.float32)
    q, q_t = unfused_quantize(grad, scale, fp8_dtype, amax, transpose)
    return q, q_t, dbias


def unfused_quantize(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, amax: torch.Tensor,
                     transpose: bool = True):
    """amax, scaled saturating cast, transpose."""
    torch.maximum(amax, x.abs().max().float().reshape(1), out=amax)
    fmax = FP8_MAX[fp8_dtype]
    q = (x.float() * scale).clamp(-fmax, fmax).to(fp8_dtype)
    return q, (q.t().contiguous() if transpose else None)


def unfused_current_scaling(grad: torch.Tensor, pre_act: torch.Tensor | None, approximate: str | None,
                            fp8_dtype: torch.dtype, transpose: bool = True):
    """The PyTorch sequence the current-scaling passes replace: gelu_backward (without ``pre_act``: the
    gradient itself), amax, the scale from it (1 where the amax is zero or not finite), sum, scaled
    saturating cast, transpose."""
    dx = grad if pre_act is None else torch.ops.aten.gelu_backward(grad, pre_act, approximate=approximate)
    amax = dx.abs().amax().float()
    fmax = FP8_MAX[fp8_dtype]
    scale = torch.where(torch.isfinite(amax) & (amax > 0), fmax / amax, torch.ones_like(amax))
    dbias = dx.sum(0, dtype=torch.float32)
    q = (dx.float() * scale).clamp(-fmax, fmax).to(fp8_dtype)
    return q, (q.t().contiguous() if transpose else None), dbias, amax, scale


def parse_sizes(text: str) -> list[tuple[int, int]]:
    """``"8192x3072,16384x6400"`` -> ``[(8192, 3072), (16384, 6400)]`` (the scripts' ``--sizes``)."""
    return [tuple(int(v) for v in size.split("x")) for size in text.split(",")]


def write_results(out_dir: str | os.PathLike, stem: str, rows: list[dict], extra: dict | None = None) -> Path:
    """Writes ``stem.csv`` and ``stem.json`` (rows + environment) under ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    with open(out / f"{stem}.json", "w") as f:
        json.dump({"environment": environment(), **(extra or {}), "rows": rows}, f, indent=2)
    return out


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c, ""))) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c, "")).rjust(w) for c, w in zip(columns, widths)))


def _fmt(v: object) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)
