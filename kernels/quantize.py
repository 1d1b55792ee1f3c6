"""FP8 quantization of a forward tensor (inputs, weights): cast, transposed copy and amax in one pass.

It is the fused backward kernel with the activation and bias-gradient terms compiled out:
2 + 1 + 1 bytes per element of a bf16 ``[M, N]`` with the transposed copy.
"""

from __future__ import annotations

from typing import Optional

import torch

from .dact_dbias_quantize import current_scaling_pass, run_pass
from .fp8 import fp8_format

__all__ = ["quantize", "quantize_current_scaling"]


def quantize(x: torch.Tensor, *, scale: torch.Tensor, fp8_dtype: torch.dtype,
             amax: Optional[torch.Tensor] = None, transpose: bool = False):
    """``saturate(x * scale)`` in ``fp8_dtype`` (nearest-even), optionally with its ``(N, M)`` transpose.

    Args:
        x: ``[*, N]`` fp32, bf16 or fp16 tensor, any strides.
        scale: fp32 tensor with one element.
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        amax: fp32 tensor with one element, max-reduced in place with ``max(|x|)``.
        transpose: also write the transposed copy (``M`` = product of the leading dimensions).

    Returns:
        ``(x_fp8, x_fp8_t)``, ``x_fp8_t`` being ``None`` without ``transpose``.
    """
    if fp8_dtype is None:
        raise ValueError("`fp8_dtype` is required: quantize casts to torch.float8_e4m3fn or torch.float8_e5m2")
    fp8_format(fp8_dtype, optional=False)  # its message, not run_pass's, which offers None
    out, out_t, _ = run_pass(x, None, None, scale, fp8_dtype, amax, transpose, compute_dbias=False, argument="x")
    return out, out_t


def quantize_current_scaling(x: torch.Tensor, *, fp8_dtype: torch.dtype, transpose: bool = False, margin: int = 0):
    """``quantize`` with the scale taken from ``x``'s own amax (an amax pass, then the cast pass).

    Returns ``(x_fp8, x_fp8_t, amax, scale)``.
    """
    out, out_t, _, amax, scale = current_scaling_pass(x, None, None, fp8_dtype, transpose, margin, False,
                                                      torch.float32, argument="x")
    return out, out_t, amax, scale
