"""FP8 recipes: how scales are chosen. Frozen configs; the per-model state lives in ``scaling.py``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

from .config import checked_fields

__all__ = ["CurrentScaling", "DelayedScaling", "Recipe", "make_recipe"]

_FORMATS = ("hybrid", "e4m3")
_AMAX_ALGOS = ("max", "most_recent")


def _check_format(fp8_format: object) -> None:
    if fp8_format not in _FORMATS:
        raise ValueError(f"`fp8_format` must be one of {', '.join(_FORMATS)}; got {fp8_format!r}")


def _check_margin(margin: object) -> None:
    if not isinstance(margin, int) or isinstance(margin, bool) or margin < 0:
        raise ValueError(f"`margin` must be a non-negative int (scale = fp8_max / amax / 2**margin); got {margin!r}")


class _HybridFormats:
    """The FP8 dtypes of a recipe's ``fp8_format``."""

    fp8_format: str

    @property
    def forward_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn

    @property
    def backward_dtype(self) -> torch.dtype:
        return torch.float8_e5m2 if self.fp8_format == "hybrid" else torch.float8_e4m3fn


@checked_fields("field")
@dataclass(frozen=True)
class DelayedScaling(_HybridFormats):
    """Scales from a history of past amaxes (TransformerEngine's delayed scaling).

    ``scale = fp8_max / amax / 2**margin`` where ``amax`` is the max (or the most recent entry) of
    the last ``amax_history_len`` amaxes recorded for that tensor.
    """

    fp8_format: str = "hybrid"  # "hybrid": e4m3 forward tensors, e5m2 gradients; "e4m3": e4m3 everywhere
    amax_history_len: int = 1024  # steps of amax kept per tensor
    amax_compute_algo: str = "max"  # "max" over the history, or "most_recent"
    margin: int = 0  # extra headroom: the scale is divided by 2**margin
    reduce_amax: bool = True  # all-reduce (max) amaxes over the process group before each update

    def __post_init__(self) -> None:
        _check_format(self.fp8_format)
        if not isinstance(self.amax_history_len, int) or isinstance(self.amax_history_len, bool) \
                or self.amax_history_len < 1:
            raise ValueError(f"`amax_history_len` must be a positive int; got {self.amax_history_len!r}")
        if self.amax_compute_algo not in _AMAX_ALGOS:
            raise ValueError(f"`amax_compute_algo` must be one of {', '.join(_AMAX_ALGOS)}; "
                             f"got {self.amax_compute_algo!r}")
        _check_margin(self.margin)
        if not isinstance(self.reduce_amax, bool):
            raise TypeError(f"`reduce_amax` must be a bool; got {self.reduce_amax!r} ({type(self.reduce_amax).__name__})")


@checked_fields("field")
@dataclass(frozen=True)
class CurrentScaling(_HybridFormats):
    """Scales from each tensor's own amax, computed just before it is cast (one extra read pass)."""

    fp8_format: str = "hybrid"  # "hybrid": e4m3 forward tensors, e5m2 gradients; "e4m3": e4m3 everywhere
    margin: int = 0  # extra headroom: the scale is divided by 2**margin

    def __post_init__(self) -> None:
        _check_format(self.fp8_format)
        _check_margin(self.margin)


Recipe = Union[DelayedScaling, CurrentScaling]

_RECIPES = {"delayed": DelayedScaling, "current": CurrentScaling}


def make_recipe(recipe: object) -> Recipe:
    """A recipe from a recipe object, a name (``"delayed"``/``"current"``) or a mapping of its fields.

    A mapping may carry ``_target_`` (Hydra) or ``name``; the remaining keys are the recipe's fields.
    """
    if isinstance(recipe, (DelayedScaling, CurrentScaling)):
        return recipe
    if isinstance(recipe, str):
        if recipe not in _RECIPES:
            raise ValueError(f"`recipe` must be one of {', '.join(_RECIPES)} or a recipe object; got {recipe!r}")
        return _RECIPES[recipe]()
    if hasattr(recipe, "items"):
        fields = dict(recipe.items())
        target = str(fields.pop("_target_", fields.pop("name", "delayed")))
        tail = target.rsplit(".", 1)[-1].lower()
        kinds = {"delayed": "delayed", "delayedscaling": "delayed", "current": "current", "currentscaling": "current"}
        if tail not in kinds:  # anything else is a typo or a recipe this library does not have
            raise ValueError(f"a recipe mapping's `_target_`/`name` must name DelayedScaling or CurrentScaling "
                             f"('delayed', 'current'); got {target!r}")
        kind = kinds[tail]
        cls = _RECIPES[kind]
        valid = set(cls.__dataclass_fields__)
        unknown = sorted(set(fields) - valid)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} field(s) {unknown}; valid fields: {sorted(valid)}")
        return cls(**fields)
    raise TypeError(f"`recipe` must be a DelayedScaling, CurrentScaling, 'delayed', 'current' or a mapping; "
                    f"got {type(recipe).__name__}")
