"""Triton kernels for the fused FP8 backward, with their launchers and pure-torch references.

Installed as ``lightning_fuse.kernels``.
"""

from ._launch import device_has_fp8, use_triton
from .bias_act import bias_act, bias_act_reference
from .activations import ACTIVATIONS, activation_derivative_reference, activation_reference
from .dact_dbias_quantize import (
    dact_dbias_quantize,
    dact_dbias_quantize_current_scaling,
    dact_dbias_quantize_reference,
    dbias_quantize,
)
from .fp8 import FP8_FORMATS, quantize_reference
from .quantize import quantize, quantize_current_scaling
from .scale_update import aligned_scales, update_scales, update_scales_reference

__all__ = [
    "ACTIVATIONS",
    "FP8_FORMATS",
    "activation_derivative_reference",
    "aligned_scales",
    "activation_reference",
    "bias_act",
    "bias_act_reference",
    "dact_dbias_quantize",
    "dact_dbias_quantize_current_scaling",
    "dact_dbias_quantize_reference",
    "dbias_quantize",
    "device_has_fp8",
    "quantize",
    "quantize_current_scaling",
    "quantize_reference",
    "update_scales",
    "update_scales_reference",
    "use_triton",
]
