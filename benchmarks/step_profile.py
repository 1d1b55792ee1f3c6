"""Where a training step's GPU time goes: a Lightning callback that profiles a few optimizer steps
after warm-up and sums device time per kernel category (GEMMs, attention, lightning-fuse's
kernels, normalization, elementwise, optimizer, ...), plus the time the GPU sat idle.

Used by ``bench_e2e.py --profile-steps N``; the categories come from kernel names.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from typing import Callable

import torch
from lightning.pytorch.callbacks import Callback

# First match wins; lower-case kernel names.
CATEGORIES = [
    ("lightning-fuse kernels", r"_dact_dbias_quantize|_bias_act|_sum_partials|_update_scales"),
    ("attention", r"flash|fmha|attention|sdpa"),
    ("GEMM", r"gemm|cutlass|xmma|nvjet|sm90_|sm100_|cublas|matmul|aten::(add)?mm$|bmm|scaled_mm"),
    ("normalization", r"layer_?norm|rms_?norm"),
    ("optimizer", r"adam|multi_tensor|foreach|fused_sgd|optimizer"),
    ("softmax / cross-entropy", r"softmax|log_softmax|nll_loss|cross_entropy"),
    ("reduction", r"reduce|sum_|_sum|amax|max_"),
    ("copy / cast", r"copy|cast|convert|memcpy|memset|fill"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise|triton_"),
]


def categorize(kernel_name: str) -> str:
    """The category of a CUDA kernel by its (demangled) name; ``other`` when nothing matches."""
    name = kernel_name.lower()
    for category, pattern in CATEGORIES:
        if re.search(pattern, name):
            return category
    return "other"


class StepProfile(Callback):
    """Profiles optimizer steps ``[start, start + steps)`` of the first fit (CUDA activity only).

    After fit, ``per_step_ms`` maps each category to device milliseconds per step, with ``busy``
    (their sum), ``wall`` (synchronized host time per step) and ``idle`` (wall minus busy: time
    the GPU waited on the host or on synchronization).
    """

    def __init__(self, start: int = 5, steps: int = 3) -> None:
        if start < 1 or steps < 1:
            raise ValueError(f"StepProfile needs start >= 1 and steps >= 1; got start={start}, steps={steps}")
        self.start, self.steps = start, steps
        self.per_step_ms: dict[str, float] = {}
        self.kernels: list[tuple[str, float]] = []  # (name, ms per step), largest first
        self._profiler = None
        self._sync: Callable[[], None] = lambda: None
        self._self_time = "self_device_time_total"
        self._started = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.start and self._profiler is None and not self.per_step_ms:
            cuda = torch.cuda.is_available()
            self._sync = torch.cuda.synchronize if cuda else (lambda: None)
            self._self_time = "self_device_time_total" if cuda else "self_cpu_time_total"
            self._sync()
            # Without a GPU (a smoke test of this callback) the CPU operators stand in for kernels.
            activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
            self._profiler = torch.profiler.profile(activities=[activity])
            self._profiler.__enter__()
            self._started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._profiler is not None and trainer.global_step >= self.start + self.steps:
            self._sync()
            wall = (time.perf_counter() - self._started) * 1e3 / self.steps
            self._profiler.__exit__(None, None, None)
            totals: dict[str, float] = defaultdict(float)
            kernels = []
            for event in self._profiler.key_averages():
                ms = getattr(event, self._self_time) / 1e3 / self.steps
                if ms > 0:
                    totals[categorize(event.key)] += ms
                    kernels.append((event.key, ms))
            busy = sum(totals.values())
            self.per_step_ms = {**dict(sorted(totals.items(), key=lambda kv: -kv[1])), "busy": busy, "wall": wall,
                                "idle": max(0.0, wall - busy)}
            self.kernels = sorted(kernels, key=lambda kv: -kv[1])
            self._profiler = None
