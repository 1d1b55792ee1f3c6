"""Measuring what the swap buys: each distinct swapped-module shape, original computation vs fused,
forward + backward, on the real device and dtypes (CUDA events after warm-up; wall clock on CPU),
the two timed in turn.

The measurement runs on fresh modules of the same shapes (never the model's own parameters), so
it changes nothing in the model and its optimizer. The fused copy re-quantizes its weight every
repetition, as training does once per optimizer step. Its backward computes the gradients training
computes: none for a frozen weight or bias (LoRA fine-tuning, say) or for an input that wants none
(the first layer's, reading the data), and no backward at all where nothing wants a gradient.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, ContextManager, Optional, Sequence

import torch
from torch import nn

from .autocast import fp8_autocast
from .modules import FP8Linear, FusedLinearBiasActivation, FP8LinearBase
from .recipe import Recipe
from .scaling import FP8ScalingState

__all__ = ["ShapeKey", "measure", "shape_key"]


@dataclass(frozen=True)
class ShapeKey:
    """What the speed of a swapped module depends on."""

    in_features: int
    out_features: int
    activation: Optional[str]  # None for FP8Linear
    bias: bool
    weight_is_in_out: bool
    tokens: int  # rows of the flattened input
    input_dtype: torch.dtype
    param_dtype: torch.dtype
    # which gradients the backward computes (training skips the GEMM of each one not wanted)
    weight_requires_grad: bool = True
    bias_requires_grad: bool = True
    input_requires_grad: bool = True

    def label(self) -> str:
        act = self.activation or "linear"
        frozen = "" if self.weight_requires_grad else ", frozen weight"
        return f"{self.in_features}x{self.out_features} {act} ({self.tokens} tokens{frozen})"


def shape_key(module: FP8LinearBase, tokens: int, input_dtype: torch.dtype, *, input_requires_grad: bool = True,
              grad_enabled: bool = True) -> ShapeKey:
    """The key of ``module`` run on ``tokens`` rows of ``input_dtype``; ``grad_enabled=False`` for a module
    that runs without autograd (under ``torch.no_grad``), whose measurement then has no backward."""
    bias = module.bias
    return ShapeKey(module.in_features, module.out_features, module.activation, bias is not None,
                    module.weight_is_in_out, int(tokens), input_dtype, module.weight.dtype,
                    weight_requires_grad=grad_enabled and module.weight.requires_grad,
                    bias_requires_grad=grad_enabled and bias is not None and bias.requires_grad,
                    input_requires_grad=grad_enabled and input_requires_grad)


class Conv1D(nn.Module):
    """A stand-in for transformers' ``Conv1D`` (weight stored ``(in, out)``; matched by its class name),
    so that a GPT-2 chain is timed in its own weight layout."""

    def __init__(self, nx: int, nf: int, bias: bool, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf, device=device, dtype=dtype) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf, device=device, dtype=dtype)) if bias else None


def _copy_of(key: ShapeKey, device: torch.device, emulate: bool) -> FP8LinearBase:
    if key.weight_is_in_out:
        linear: nn.Module = Conv1D(key.in_features, key.out_features, key.bias, device, key.param_dtype)
    else:
        linear = nn.Linear(key.in_features, key.out_features, bias=key.bias, device=device, dtype=key.param_dtype)
    module = FusedLinearBiasActivation(linear, key.activation, emulate=emulate) if key.activation else \
        FP8Linear(linear, emulate=emulate)
    module.weight.requires_grad_(key.weight_requires_grad)
    if module.bias is not None:
        module.bias.requires_grad_(key.bias_requires_grad)
    module.bind_fp8_state(FP8ScalingState(), f"benchmark[{key.label()}]")
    return module


def _interleaved_ms(device: torch.device, fns: Sequence[Callable[[], None]], warmup: int, reps: int,
                    bursts: int = 3) -> list[float]:
    """ms per call of each of ``fns`` after ``warmup`` calls of each: the fastest of its samples, the
    samples of all of them taken in turn, so that anything else slowing the machine for a while
    (another process, a clock ramping up) slows them alike, and the fastest sample is the one it
    spared (interference only adds time).

    On GPUs a sample is a burst of ``reps`` calls issued back to back between two CUDA events, as a
    training loop issues them, so a call costs the larger of its CPU launch time and its GPU time
    (timing single calls with a synchronization after each would add the launch latency of every
    call, which a training loop hides behind the GPU work queued before it); ``bursts`` of them
    each. On CPU, where calls are synchronous, a sample is one call, ``reps`` of them each.
    """
    for fn in fns:
        for _ in range(warmup):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(bursts):
            for fn, samples in zip(fns, times):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(reps):
                    fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / reps)
    else:
        for _ in range(reps):
            for fn, samples in zip(fns, times):
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e3)
    return [min(samples) for samples in times]


def measure(key: ShapeKey, device: torch.device, recipe: Optional[Recipe], *, emulate: bool = False,
            precision_context: Callable[[], ContextManager] = contextlib.nullcontext,
            warmup: int = 3, reps: int = 10) -> tuple[float, float]:
    """``(original_ms, fused_ms)`` of forward + backward for one shape.

    ``precision_context`` is entered around both forwards (the Trainer's autocast, for example);
    the fused copy runs under ``fp8_autocast(recipe)`` when a recipe is given.
    """
    module = _copy_of(key, device, emulate)
    x = torch.randn(key.tokens, key.in_features, device=device, dtype=key.input_dtype,
                    requires_grad=key.input_requires_grad)
    dy = None

    def step(fused: bool) -> Callable[[], None]:
        def run() -> None:
            nonlocal dy
            module.fused = fused
            module.weight.grad = None
            if module.bias is not None:
                module.bias.grad = None
            x.grad = None
            # A shape FP8 cannot run takes the high-precision path anyway: no second fallback warning for it.
            fp8 = (fp8_autocast(recipe, update_scales=False) if (fused and recipe is not None and not module.fp8_reason)
                   else contextlib.nullcontext())
            with precision_context(), fp8:
                y = module(x)
            if not y.requires_grad:  # nothing here wants a gradient: training runs no backward either
                return
            if dy is None or dy.dtype != y.dtype:
                dy = torch.randn_like(y)
            y.backward(dy)
            module.fp8_state.generation += 1  # a new step: the FP8 weight copy is made again
        return run

    original, fused = _interleaved_ms(device, (step(False), step(True)), warmup, reps)
    return original, fused
