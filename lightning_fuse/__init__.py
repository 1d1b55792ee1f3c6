"""lightning-fuse: FP8 Linear -> bias -> activation chains with a one-kernel fused backward."""

from .autocast import fp8_autocast
from .modules import FP8Linear, FusedLinearBiasActivation
from .recipe import CurrentScaling, DelayedScaling
from .scaling import FP8ScalingState

__all__ = [
    "CurrentScaling",
    "DelayedScaling",
    "FP8Linear",
    "FP8ScalingState",
    "FusedLinearBiasActivation",
    "fp8_autocast",
]
