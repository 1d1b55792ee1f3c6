"""lightning-fuse: FP8 Linear -> bias -> activation chains with a one-kernel fused backward."""

from .autocast import fp8_autocast
from .callback import FusedBackwardCallback
from .config import FuseConfig, make_fuse_config
from .fuse import FuseReport, fp8_state_of, fuse_, unfuse_
from .modules import FP8Linear, FusedLinearBiasActivation
from .recipe import CurrentScaling, DelayedScaling
from .scaling import FP8ScalingState

__all__ = [
    "CurrentScaling",
    "DelayedScaling",
    "FP8Linear",
    "FP8ScalingState",
    "FuseConfig",
    "FuseReport",
    "FusedBackwardCallback",
    "FusedLinearBiasActivation",
    "fp8_autocast",
    "fp8_state_of",
    "fuse_",
    "make_fuse_config",
    "unfuse_",
]
