"""Per-model FP8 scaling state: every amax history and scale, stacked for one batched update.

Each FP8 module registered here owns three tensors: its input (forward slot ``2 i``), its weight
(forward slot ``2 i + 1``) and its output gradient (backward slot ``i``). The kernels max-reduce
amaxes straight into row 0 of the histories; ``update`` then turns all of them into scales with a
handful of whole-model tensor operations (and one all-reduce of the stacked amaxes under
``torch.distributed``), never a launch per module.

Semantics of an update (delayed scaling):

- the newest amaxes (row 0) are max-reduced across ranks when ``recipe.reduce_amax`` is set;
- a non-finite newest amax is counted in ``nonfinite`` and replaced by 0 in the history, and that
  tensor keeps its previous scale; so does a tensor whose amax is 0 (it did not run, or was all
  zeros);
- otherwise ``scale = fp8_max / amax / 2**margin`` with ``amax`` the history's max (``"max"``) or
  row 0 (``"most_recent"``);
- the history rolls by one row and row 0 starts again from zero.

The forward scales are replaced, not written in place: a backward pass still holding the scale its
forward used sees the value it quantized with. The gradient (backward) scales are written in place
instead: an eager backward looks them up when it runs, and a backward compiled with its forward
(``torch.compile``) reads the very tensors its forward was given, so an update between a forward and
its backward (``loss.backward()`` after the ``fp8_autocast`` block) reaches both alike. The state is
made and replaced outside inference mode even when a forward under ``torch.inference_mode``
(Lightning's validate, test and predict) triggers it, so a later training step can save it for
backward; under ``torch.compile`` it is made when the graph is traced, never inside the graph. On
GPUs each group's update is one Triton launch (``kernels/scale_update.py``); the per-module views
``slot`` hands out are made once per update.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any, Callable, Iterable, Optional, TypeVar

import torch
import torch.distributed as dist

from lightning_fuse.kernels import aligned_scales, update_scales

from .collective_buffers import CollectiveBuffers
from .recipe import DelayedScaling, make_recipe

__all__ = ["FP8ScalingState"]

_GROUPS = ("forward", "backward")

_F = TypeVar("_F", bound=Callable[..., Any])


def _outside_inference_mode(fn: _F) -> _F:
    """``fn`` run outside ``torch.inference_mode`` when called inside it: tensors made there are
    inference tensors, which a later training step could not save for backward."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling() and torch.is_inference_mode_enabled():
            with torch.inference_mode(False):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)
    return wrapper  # type: ignore[return-value]


class _Group:
    """History, scales and non-finite counters of one kind of tensor (forward or backward)."""

    def __init__(self, history_len: int, slots: int, device: torch.device) -> None:
        self.history = torch.zeros(history_len, slots, dtype=torch.float32, device=device)
        self.scale = aligned_scales(torch.ones(slots, dtype=torch.float32, device=device))
        self.scale_inv = aligned_scales(torch.ones(slots, dtype=torch.float32, device=device))
        self.nonfinite = torch.zeros(slots, dtype=torch.int64, device=device)
        self._views: Optional[tuple] = None

    @_outside_inference_mode
    def views(self) -> tuple:
        """Per-slot ``(scales, scale_invs, amaxes)``: made in three calls, not three per slot per step."""
        if self._views is None or self._views[0] is not self.scale or self._views[1] is not self.history:
            self._views = (self.scale, self.history, self.scale.unbind(0), self.scale_inv.unbind(0),
                           self.history[0].split(1))
        return self._views[2:]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"history": self.history, "scale": self.scale, "scale_inv": self.scale_inv, "nonfinite": self.nonfinite}


# Every state by ``id``: what ``_ensure_when_traced`` is given (constants only, as dynamo passes them on).
_STATES: "weakref.WeakValueDictionary[int, FP8ScalingState]" = weakref.WeakValueDictionary()


@torch.compiler.assume_constant_result
def _ensure_when_traced(key: int, history_len: int, device: torch.device) -> bool:
    """``ensure`` of the state ``id`` ``key``, run by dynamo while it traces, on the real state, and
    left out of the graph.

    Tensors a traced forward made would be intermediates of its graph, handed back as outputs; the
    backward then max-reduces gradient amaxes into the backward history in place, and AOTAutograd
    cannot partition a forward output that the backward writes ("Node select_scatter_... was invalid,
    but is output"). Made here, the state's tensors are inputs of every graph, whose mutations
    (forward and backward) functionalization writes back. Later calls run no code of this: the
    graph's guards on the state (its ``groups`` and their tensors' shapes and devices) send a state
    that needs allocating, moving or resizing to a new trace, which runs this again.
    """
    with torch.inference_mode(False):  # tensors a later training step can save for backward
        _STATES[key]._ensure(history_len, device)
    return True


class FP8ScalingState:
    """Amax histories and scales of one model's FP8 tensors (see the module docstring)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.groups: dict[str, _Group] = {}
        # Bumped at every update of the forward scales: cached FP8 weights are keyed on it.
        self.generation = 0
        # Bumped once per optimizer step (the exit of an fp8_autocast that updates scales, ``update``, or
        # the callback before each optimizer step): cached FP8 weights are keyed on it too, since a
        # weight can change without its version counter moving (fused optimizers, writes through .data).
        self.steps = 0
        self._pending: Optional[dict[str, Any]] = None  # loaded state waiting for a device
        self.current_nonfinite: Optional[torch.Tensor] = None  # non-finite amaxes seen under CurrentScaling
        self._collective = CollectiveBuffers()  # update's all-reduce tensors, by groups
        _STATES[id(self)] = self

    def __setstate__(self, state: dict[str, Any]) -> None:  # unpickled or copied: known by id too
        self.__dict__.update(state)
        _STATES[id(self)] = self

    # -- registration and storage -------------------------------------------------------------

    def register(self, name: str) -> int:
        """Adds a module (by its fully qualified name) and returns its index."""
        if self.groups:
            raise RuntimeError(f"cannot register {name!r}: modules must be registered before the first FP8 step, "
                               f"and this state was already allocated for {self.names}")
        self.names.append(name)
        return len(self.names) - 1

    @property
    def history_len(self) -> int:
        return self.groups["forward"].history.shape[0] if self.groups else 0

    @_outside_inference_mode
    def ensure(self, history_len: int, device: torch.device) -> None:
        """Allocates (or moves, or resizes the history of) the state for ``device``.

        Under ``torch.compile`` this runs when the graph is traced, not in it (``_ensure_when_traced``).
        """
        if torch.compiler.is_compiling():
            _ensure_when_traced(id(self), history_len, device)
            return
        self._ensure(history_len, device)

    def _ensure(self, history_len: int, device: torch.device) -> None:
        n = len(self.names)
        if not self.groups:
            self.groups = {"forward": _Group(history_len, 2 * n, device), "backward": _Group(history_len, n, device)}
            if self._pending is not None:
                self._apply_loaded(self._pending)
                self._pending = None
            return
        fwd = self.groups["forward"]
        if fwd.history.device != device:
            for group in self.groups.values():
                for key, value in group.tensors().items():
                    setattr(group, key, aligned_scales(value.to(device)) if key.startswith("scale") else value.to(device))
        if self.history_len != history_len:
            for group in self.groups.values():
                old = group.history
                new = torch.zeros(history_len, old.shape[1], dtype=old.dtype, device=old.device)
                keep = min(history_len, old.shape[0])
                new[:keep] = old[:keep]
                group.history = new

    def slot(self, group: str, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(scale, scale_inv, amax)`` of one tensor: 0-d views and a one-element view of history row 0."""
        g = self.groups[group]
        if torch.compiler.is_compiling():  # no cache mutation (a side effect) in a traced graph
            return g.scale[index], g.scale_inv[index], g.history[0, index:index + 1]
        scales, scale_invs, amaxes = g.views()
        return scales[index], scale_invs[index], amaxes[index]

    # -- updates ------------------------------------------------------------------------------

    @_outside_inference_mode
    @torch.no_grad()
    def update(self, recipe: Any, groups: Iterable[str] = _GROUPS) -> None:
        """Turns the newest amaxes of ``groups`` into scales and rolls the histories (module docstring).

        ``recipe``: a ``DelayedScaling``, or what ``make_recipe`` makes one from (``"delayed"``, a mapping).
        """
        if not isinstance(recipe, DelayedScaling):
            recipe = make_recipe(recipe)
            if not isinstance(recipe, DelayedScaling):
                raise TypeError(f"`recipe` must be a DelayedScaling (only delayed scaling keeps histories to update); "
                                f"got {type(recipe).__name__}")
        groups = [g for g in groups if g in self.groups]
        if not groups:
            return
        if recipe.reduce_amax and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # Gathered in a kept tensor, not a temporary (collective_buffers.py says why).
            rows = [self.groups[g].history[0] for g in groups]
            newest = torch.cat(rows, out=self._collective.get(tuple(groups), sum(r.numel() for r in rows),
                                                                rows[0].dtype, rows[0].device))
            # A NaN does not survive a MAX all-reduce on every backend (gloo keeps it or not by rank
            # order): send it as +inf, which does, so every rank counts it and keeps the scale.
            newest.masked_fill_(newest.isnan(), float("inf"))
            dist.all_reduce(newest, op=dist.ReduceOp.MAX)
            for g, part in zip(groups, newest.split([self.groups[g].history.shape[1] for g in groups])):
                self.groups[g].history[0].copy_(part)
        for g in groups:
            fp8_max = 448.0 if (g == "forward" or recipe.fp8_format == "e4m3") else 57344.0
            self._update_group(self.groups[g], recipe, fp8_max, in_place=g == "backward")
        if "forward" in groups:
            self.generation += 1
        self.steps += 1

    @staticmethod
    def _update_group(group: _Group, recipe: DelayedScaling, fp8_max: float, in_place: bool = False) -> None:
        """``in_place``: the new scales are copied into the group's own scale tensors (module docstring)."""
        history, scale, scale_inv = update_scales(
            group.history, group.scale, group.nonfinite, fp8_max=fp8_max, margin=recipe.margin,
            use_max=recipe.amax_compute_algo == "max")
        group.history = history
        if in_place:
            group.scale.copy_(scale)
            group.scale_inv.copy_(scale_inv)
        else:
            group.scale, group.scale_inv = scale, scale_inv

    # -- health ------------------------------------------------------------------------------

    @_outside_inference_mode
    def count_nonfinite(self, amax: torch.Tensor) -> None:
        """Counts a non-finite current-scaling amax (no sync: the count stays on the device)."""
        if self.current_nonfinite is None or self.current_nonfinite.device != amax.device:
            self.current_nonfinite = torch.zeros((), dtype=torch.int64, device=amax.device)
        self.current_nonfinite += (~torch.isfinite(amax)).sum()

    def stats(self) -> dict[str, float]:
        """``nonfinite_amax`` (events so far), and ``scale_min`` and ``scale_max`` over every tensor where
        there are scales (delayed scaling, once allocated: current scaling keeps none between steps)."""
        if not self.groups:
            count = float(self.current_nonfinite.item()) if self.current_nonfinite is not None else 0.0
            return {"nonfinite_amax": count}
        scales = torch.cat([g.scale for g in self.groups.values()])
        nonfinite = sum(g.nonfinite.sum() for g in self.groups.values())
        values = torch.stack([nonfinite.to(torch.float64), scales.min().double(), scales.max().double()]).tolist()
        return {"nonfinite_amax": values[0], "scale_min": values[1], "scale_max": values[2]}

    # -- checkpointing -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        if not self.groups:
            return dict(self._pending) if self._pending is not None else {"names": list(self.names)}
        out: dict[str, Any] = {"names": list(self.names), "generation": self.generation}
        for name, group in self.groups.items():
            for key, value in group.tensors().items():
                out[f"{name}.{key}"] = value.detach().cpu().clone()
        return out

    @_outside_inference_mode
    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = list(state.get("names", []))
        if saved != self.names:
            if any(name not in saved for name in self.names) or len(set(saved)) != len(saved):
                raise ValueError(
                    f"FP8 state was saved for modules {state.get('names')} but this model has {self.names}; "
                    "fuse the same model with the same FuseConfig before loading"
                )
            # Saved for more modules than this model runs in FP8 (a linear FP8 cannot run is no longer
            # converted, say): each module takes its own columns, the others are dropped.
            dropped = [name for name in saved if name not in self.names]
            warnings.warn(f"FP8 state: the scales saved for {dropped} are dropped: this model does not run "
                          "them in FP8", stacklevel=2)
            state = _columns_of(state, [saved.index(name) for name in self.names])
        if "forward.history" not in state:
            # Saved before the first FP8 step: back to that, so the next step allocates fresh histories and scales.
            self.groups = {}
            self._pending = None
            self.generation += 1
            return
        if self.groups:
            self._apply_loaded(state)
        else:
            self._pending = dict(state)

    def _apply_loaded(self, state: dict[str, Any]) -> None:
        self.generation = int(state.get("generation", 0)) + 1
        for name, group in self.groups.items():
            device = group.history.device
            for key in group.tensors():
                value = state[f"{name}.{key}"].to(device)
                setattr(group, key, aligned_scales(value) if key.startswith("scale") else value.clone())


def _columns_of(state: dict[str, Any], modules: list[int]) -> dict[str, Any]:
    """``state`` (a ``state_dict``) cut down to the columns of ``modules`` (indices into its names), in
    that order: a module's two forward slots (``2 i``, ``2 i + 1``) and its backward slot ``i``."""
    names = list(state["names"])
    picked = {"forward": torch.tensor([slot for i in modules for slot in (2 * i, 2 * i + 1)], dtype=torch.long),
              "backward": torch.tensor(modules, dtype=torch.long)}
    out: dict[str, Any] = {"names": [names[i] for i in modules]}
    for key, value in state.items():
        group = key.split(".", 1)[0]
        if key == "names":
            continue
        if group in picked and isinstance(value, torch.Tensor):
            index = picked[group].to(value.device)
            out[key] = value.index_select(value.dim() - 1, index)  # history: (length, slots); the rest: (slots,)
        else:
            out[key] = value
    return out
