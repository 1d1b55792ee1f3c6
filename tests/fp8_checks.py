"""Assertions shared by the numerics tests: FP8 closeness, SQNR."""

from __future__ import annotations

import torch

from lightning_fuse.kernels import FP8_FORMATS


def fp8_step(values: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """The spacing of the FP8 grid at ``|values|`` (float32)."""
    fmt = FP8_FORMATS[fp8_dtype]
    v = values.abs().to(torch.float32)
    min_normal_exp = 1 - fmt.exponent_bias
    exponent = torch.floor(torch.log2(v.clamp_min(2.0 ** min_normal_exp))).clamp_min(min_normal_exp)
    return torch.exp2(exponent - fmt.mantissa_bits)


def assert_fp8_close(actual: torch.Tensor, expected: torch.Tensor, *, min_exact: float = 0.99) -> None:
    """At least ``min_exact`` of the elements bit-exact (one element may differ in a tiny tensor),
    every element within one FP8 step."""
    actual, expected = actual.cpu(), expected.cpu()
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if actual.numel() == 0:
        return
    a, e = actual.view(torch.uint8), expected.view(torch.uint8)
    mismatched = int((a != e).sum())
    allowed = max(1, int((1.0 - min_exact) * a.numel())) if min_exact < 1.0 else 0
    af, ef = actual.to(torch.float32), expected.to(torch.float32)
    step = fp8_step(torch.maximum(af.abs(), ef.abs()), actual.dtype)
    off = (af - ef).abs() > step
    both_nan = torch.isnan(af) & torch.isnan(ef)
    assert mismatched <= allowed, f"{mismatched} of {a.numel()} FP8 codes differ (at most {allowed} may)"
    assert not (off & ~both_nan).any(), f"{int((off & ~both_nan).sum())} FP8 values differ by more than one step"


def sqnr_db(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """``20 log10(|ref| / |actual - ref|)`` in float64."""
    r = reference.to(torch.float64)
    noise = (actual.to(torch.float64) - r).norm()
    return float("inf") if noise == 0 else float(20 * torch.log10(r.norm() / noise))
