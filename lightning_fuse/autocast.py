"""``fp8_autocast``: the context under which fused modules run their FP8 path.

When scales move outside Lightning (``update_scales=True``, the default), as in TransformerEngine:
the forward tensors' scales (inputs, weights) update once when the outermost use of the context
exits, the gradients' scales once when the backward pass that used them ends. Each is one batched
update per model (see ``scaling.py``). The Lightning callback passes ``update_scales=False`` and
updates once per optimizer step instead, after gradient accumulation.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Optional

from .recipe import DelayedScaling, Recipe, make_recipe
from .scaling import FP8ScalingState

__all__ = ["FP8Context", "active_context", "fp8_autocast"]


@dataclass
class FP8Context:
    recipe: Recipe
    enabled: bool
    update_scales: bool
    states: dict[int, FP8ScalingState] = field(default_factory=dict)  # the models that ran FP8 inside


_STACK: list[FP8Context] = []


def active_context() -> Optional[FP8Context]:
    """The innermost ``fp8_autocast`` context, or ``None``."""
    return _STACK[-1] if _STACK else None


@contextlib.contextmanager
def fp8_autocast(recipe: object = None, enabled: bool = True, *, update_scales: bool = True) -> Iterator[FP8Context]:
    """Runs fused modules' FP8 path inside the block.

    Args:
        recipe: ``DelayedScaling`` (the default when ``None``), ``CurrentScaling``, their names, or a
            mapping of a recipe's fields.
        enabled: ``False`` runs every fused module in high precision (its backward stays fused).
        update_scales: update delayed scales at context exit (forward tensors) and at the end of
            backward (gradients); ``False`` leaves it to the caller (``FP8ScalingState.update``).

    Example::

        with fp8_autocast(DelayedScaling(amax_history_len=16)):
            loss = model(x).sum()
        loss.backward()
    """
    ctx = FP8Context(make_recipe(recipe) if recipe is not None else DelayedScaling(), bool(enabled),
                     bool(update_scales))
    _STACK.append(ctx)
    try:
        yield ctx
    finally:
        _STACK.pop()
        if ctx.enabled and ctx.update_scales and isinstance(ctx.recipe, DelayedScaling):
            for state in ctx.states.values():
                state.update(ctx.recipe, ("forward",))
