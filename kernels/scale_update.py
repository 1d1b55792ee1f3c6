"""The delayed-scaling update of a whole model's FP8 tensors in one launch per group.

A group holds ``S`` tensors' amax histories as ``history[L, S]`` (row 0 the newest), their scales
and their non-finite counters. ``update_scales`` does what ``FP8ScalingState`` documents, for every
column at once: count and zero a non-finite newest amax, reduce the history (``max`` or the newest
row), turn it into ``scale = fp8_max / amax / 2**margin`` (keeping the old scale where the amax is
zero or was non-finite), and roll the history by one row with row 0 cleared.

Written as ~17 PyTorch operations per group this cost 0.3-0.6 ms of CPU time per optimizer step on
the H200 host, more than the FP8 GEMMs it serves saved at d=1600 (benchmarks/bench_overhead.py).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._launch import check_margin, use_triton
from .fp8 import scale_quotient

__all__ = ["MAX_KERNEL_HISTORY", "aligned_scales", "update_scales", "update_scales_reference"]

MAX_KERNEL_HISTORY = 8192  # longer histories take the PyTorch path (one program holds a column block)


@triton.jit
def _update_scales_kernel(
    history_ptr, scale_ptr, new_scale_ptr, new_scale_inv_ptr, nonfinite_ptr,
    L, S, scale_stride, new_scale_stride, fp8_max, margin_factor,
    USE_MAX: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_S: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    col_mask = cols < S
    rows = tl.arange(0, BLOCK_L)
    mask = (rows < L)[:, None] & col_mask[None, :]
    history = tl.load(history_ptr + rows[:, None] * S + cols[None, :], mask=mask, other=0.0)
    newest = tl.load(history_ptr + cols, mask=col_mask, other=0.0)
    finite = tl.abs(newest) < float("inf")  # false for NaN and +-inf
    counts = tl.load(nonfinite_ptr + cols, mask=col_mask, other=0)
    tl.store(nonfinite_ptr + cols, counts + (~finite).to(tl.int64), mask=col_mask)
    history = tl.where((rows == 0)[:, None] & ~finite[None, :], 0.0, history)
    if USE_MAX:
        amax = tl.max(history, axis=0)
    else:
        amax = tl.where(finite, newest, 0.0)
    old = tl.load(scale_ptr + cols * scale_stride, mask=col_mask, other=1.0)
    usable = finite & (amax > 0)
    scale = tl.where(usable, scale_quotient(fp8_max, amax, usable, margin_factor), old)
    tl.store(new_scale_ptr + cols * new_scale_stride, scale, mask=col_mask)
    tl.store(new_scale_inv_ptr + cols * new_scale_stride, tl.math.div_rn(1.0, scale), mask=col_mask)
    # Every thread has loaded its rows before any row is overwritten by its predecessor.
    tl.debug_barrier()
    tl.store(history_ptr + (rows + 1)[:, None] * S + cols[None, :], history, mask=((rows + 1) < L)[:, None] & col_mask[None, :])
    tl.store(history_ptr + cols, tl.zeros((BLOCK_S,), dtype=tl.float32), mask=col_mask)


def _aligned_empty(slots: int, device: torch.device) -> torch.Tensor:
    """A 1-D fp32 view with elements 16 bytes apart.

    cuBLASLt answers CUBLAS_STATUS_NOT_SUPPORTED for an FP8 GEMM whose scale pointer is not 16-byte
    aligned (seen on an H200, torch 2.11): each slot's scale must be usable on its own.
    """
    return torch.empty(slots, 4, dtype=torch.float32, device=device)[:, 0]


def aligned_scales(values: torch.Tensor) -> torch.Tensor:
    """1-D fp32 ``values`` copied into a view whose elements sit 16 bytes apart (``_aligned_empty``)."""
    out = _aligned_empty(values.shape[0], values.device)
    out.copy_(values)
    return out


def update_scales(history: torch.Tensor, scale: torch.Tensor, nonfinite: torch.Tensor, *, fp8_max: float,
                  margin: int, use_max: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One group's update (module docstring). ``history`` and ``nonfinite`` change in place.

    Returns ``(history, scale, scale_inv)``: new scale tensors (16-byte spaced, so each element can
    be a GEMM's scale), never the old ones written in place, because a backward pass may still
    hold the scale its forward quantized with.
    """
    _check(history, scale, nonfinite, fp8_max, margin)
    length, slots = history.shape
    if not use_triton(history) or length > MAX_KERNEL_HISTORY or not history.is_contiguous():
        return update_scales_reference(history, scale, nonfinite, fp8_max=fp8_max, margin=margin, use_max=use_max)
    new_scale = _aligned_empty(slots, history.device)
    new_scale_inv = _aligned_empty(slots, history.device)
    block_l = 1 << (length - 1).bit_length()  # next power of two (plain ints: triton's helper is slow to call)
    block_s = max(1, min(1 << (slots - 1).bit_length(), 4096 // block_l))
    _update_scales_kernel[(-(-slots // block_s),)](
        history, scale, new_scale, new_scale_inv, nonfinite, length, slots, scale.stride(0), new_scale.stride(0),
        fp8_max, 2.0 ** margin, USE_MAX=use_max, BLOCK_L=block_l, BLOCK_S=block_s, num_warps=4)
    return history, new_scale, new_scale_inv


def update_scales_reference(history: torch.Tensor, scale: torch.Tensor, nonfinite: torch.Tensor, *,
                            fp8_max: float, margin: int, use_max: bool):
    """``update_scales`` in PyTorch operations (CPU without Triton, very long histories, tests)."""
    _check(history, scale, nonfinite, fp8_max, margin)
    newest = history[0]
    finite = torch.isfinite(newest)
    nonfinite += (~finite).to(torch.int64)
    newest.masked_fill_(~finite, 0.0)
    amax = history.amax(dim=0) if use_max else newest
    usable = finite & (amax > 0)
    new = torch.where(usable, fp8_max / amax.clamp_min(torch.finfo(torch.float32).tiny) / (2.0 ** margin), scale)
    new = new.clamp(max=torch.finfo(torch.float32).max)
    new_scale, new_scale_inv = aligned_scales(new), aligned_scales(new.reciprocal())
    history.copy_(torch.roll(history, 1, dims=0))  # in place, as the kernel rolls it
    history[0].zero_()
    return history, new_scale, new_scale_inv


def _check(history: torch.Tensor, scale: torch.Tensor, nonfinite: torch.Tensor, fp8_max: object,
           margin: object) -> None:
    if not isinstance(history, torch.Tensor) or history.dim() != 2 or history.dtype != torch.float32 \
            or history.shape[0] < 1:
        raise ValueError(f"`history` must be a float32 (length >= 1, slots) tensor; got "
                         f"{_describe(history)}")
    slots = history.shape[1]
    if not isinstance(scale, torch.Tensor) or scale.shape != (slots,) or scale.dtype != torch.float32:
        raise ValueError(f"`scale` must be a float32 ({slots},) tensor, one per history column; got {_describe(scale)}")
    if not isinstance(nonfinite, torch.Tensor) or nonfinite.shape != (slots,) or nonfinite.dtype != torch.int64 \
            or not nonfinite.is_contiguous():
        raise ValueError(f"`nonfinite` must be a contiguous int64 ({slots},) tensor; got {_describe(nonfinite)}")
    for name, t in (("scale", scale), ("nonfinite", nonfinite)):
        if t.device != history.device:
            raise ValueError(f"`{name}` is on {t.device} but `history` is on {history.device}")
    if isinstance(fp8_max, bool) or not isinstance(fp8_max, (int, float)) or not 0 < fp8_max < math.inf:
        raise ValueError(f"`fp8_max` must be a positive finite number (the FP8 format's largest value); got {fp8_max!r}")
    check_margin(margin)


def _describe(t: object) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} tensor of shape {tuple(t.shape)}{'' if t.is_contiguous() else ' (not contiguous)'} on {t.device}"
