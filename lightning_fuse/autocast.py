"""``fp8_autocast``: the context under which fused modules run their FP8 path.

When scales move outside Lightning (``update_scales=True``, the default): once, when the context
exits, for every model that ran FP8 inside it, in one batched update per model (``scaling.py``):

- the forward tensors (inputs, weights) from the amaxes recorded inside this context;
- the gradients from the amaxes recorded by the backward passes since the previous update.

So step ``t``'s backward quantizes with scales built from gradient amaxes up to step ``t - 1``,
the same delay as TransformerEngine (which updates at the end of each backward), while nothing
runs from inside a backward pass: no Python side effect for ``torch.compile`` to trace there.
A backward run inside the context is counted in that same exit's update.

The Lightning callback passes ``update_scales=False`` and updates once per optimizer step instead,
after gradient accumulation; code outside Lightning that accumulates gradients can do the same with
``fp8_state_of(model).update(recipe)``.
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
        update_scales: update the delayed scales of every model that ran inside, at exit (module
            docstring); ``False`` leaves it to the caller (``FP8ScalingState.update``).

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
        if ctx.update_scales:  # a step ends here: its weights may change before the next, so their FP8 copies are made again
            for state in ctx.states.values():
                state.steps += 1
        if ctx.enabled and ctx.update_scales and isinstance(ctx.recipe, DelayedScaling):
            for state in ctx.states.values():
                state.update(ctx.recipe)
