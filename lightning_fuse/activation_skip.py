"""Functional activations fused away: the parent's own ``forward`` runs, minus the activation call.

A chain whose activation is a call in its parent's ``forward`` (``F.gelu(self.fc(x))``, as litgpt's
MLP writes it) has no module to replace. The parent instance gets a ``forward`` that runs its
class's ``forward`` unchanged under a ``TorchFunctionMode``: when a fused linear of that parent
returns its output (the activation already applied), the mode notes that tensor, and the call of
the chain's activation function on that very tensor returns it as it is. Any other call, including
the same function on any other tensor, runs as written. Everything else in the forward (grad and
autocast contexts, attribute writes, random branches, Python state read at call time) behaves as
it did, since it is the same code.

The chain finder has checked that the linear's output has one user, that activation; if at run
time a fused linear's output is not passed to it, the result would differ from the original
model's, and the call raises instead.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["FUNCTIONAL_ACTIVATIONS", "GELU_APPROXIMATIONS", "ActivationsFusedAway", "note_output", "parent_running",
           "suspended"]

# The functional activations the chain finder accepts, by the label it records for a chain; the value
# is the function a TorchFunctionMode sees for that call (F.relu and F.silu dispatch as themselves).
FUNCTIONAL_ACTIVATIONS: dict[str, Callable[..., Any]] = {
    "F.gelu": F.gelu,
    "F.relu": F.relu,
    "torch.relu": torch.relu,
    "F.silu": F.silu,
    "Tensor.relu": torch.Tensor.relu,
}

_MODES: list["_SkipFusedActivations"] = []  # the innermost parent's forward running now is last


class _SkipFusedActivations(TorchFunctionMode):
    """One call of a parent's forward: skips each fused linear's activation call, once, on its output."""

    def __init__(self, linears: dict[int, Callable[..., Any]]) -> None:
        super().__init__()
        self.linears = linears  # id(fused linear) -> the activation function the forward calls on its output
        self.pending: list[tuple[torch.Tensor, Callable[..., Any], nn.Module]] = []

    def note(self, module: nn.Module, out: torch.Tensor) -> None:
        func = self.linears.get(id(module))
        if func is not None:
            self.pending.append((out, func, module))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.pending and args:
            for i, (out, expected, module) in enumerate(self.pending):
                if func is expected and args[0] is out:
                    _check_same_activation(module, func, args, kwargs or {})
                    del self.pending[i]
                    return out  # the fused linear applied it already
        return func(*args, **(kwargs or {}))


GELU_APPROXIMATIONS = {"none": "gelu", "tanh": "gelu_tanh"}  # F.gelu's approximate -> activation name


def _check_same_activation(module: nn.Module, func: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    """Raises where this call computes another activation than the one fused into ``module``: ``F.gelu``'s
    ``approximate`` may come from an attribute read when the forward was traced and changed since."""
    if func is not F.gelu:
        return
    approximate = kwargs.get("approximate", args[1] if len(args) > 1 else "none")
    name = GELU_APPROXIMATIONS.get(approximate) if isinstance(approximate, str) else None
    if name != module.activation:
        raise RuntimeError(
            f"lightning_fuse: `{_path_of(module)}` was fused with {module.activation}, but F.gelu is called on its "
            f"output with approximate={approximate!r} ({name or 'not a known GELU'}): the forward computes another "
            "activation than when it was traced. Fuse the model again (unfuse_ then fuse_) after changing it")


def _path_of(module: nn.Module) -> str:
    fqn = getattr(module, "_fqn", None)  # the fused modules' name in their model
    return fqn() if callable(fqn) else type(module).__name__


def parent_running() -> bool:
    """Whether a parent forward with a skipped activation call is running (cheap: checked per call)."""
    return len(_MODES) != 0  # (torch 2.11's dynamo cannot trace bool() of a list)


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Inside a fused module's own forward, the running parent's mode steps aside: none of that
    module's operations can be the activation call, and each one would pass through Python."""
    if (_MODES and not torch.compiler.is_compiling()
            and torch.overrides._get_current_function_mode() is _MODES[-1]):
        with torch.overrides._pop_mode_temporarily():
            yield
    else:
        yield


def note_output(module: nn.Module, out: torch.Tensor) -> None:
    """Called by a fused linear with its output: the running parent forward skips its activation call."""
    _MODES[-1].note(module, out)


class ActivationsFusedAway:
    """A parent's instance ``forward``: its class's ``forward`` with the fused chains' activation calls
    skipped. ``chains`` maps each fused linear's path under the parent to its activation's label
    (``FUNCTIONAL_ACTIVATIONS``). Picklable, and copied with the parent by ``copy.deepcopy``."""

    def __init__(self, owner: nn.Module, chains: dict[str, str]) -> None:
        for label in chains.values():
            if label not in FUNCTIONAL_ACTIVATIONS:
                raise ValueError(f"unknown functional activation {label!r}; expected one of "
                                 f"{', '.join(FUNCTIONAL_ACTIVATIONS)}")
        self.owner = owner
        self.chains = dict(chains)

    @property
    def __signature__(self) -> inspect.Signature:
        signature = inspect.signature(type(self.owner).forward)
        return signature.replace(parameters=list(signature.parameters.values())[1:])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        owner = self.owner
        mode = _SkipFusedActivations({id(owner.get_submodule(path)): FUNCTIONAL_ACTIVATIONS[label]
                                      for path, label in self.chains.items()})
        _MODES.append(mode)
        try:
            with mode:
                out = type(owner).forward(owner, *args, **kwargs)
        finally:
            _MODES.pop()
        if mode.pending:
            paths = {id(owner.get_submodule(path)): path for path in self.chains}
            missed = ", ".join(f"`{paths[id(module)]}`" for _, _, module in mode.pending)
            raise RuntimeError(
                f"lightning_fuse: in this call of {type(owner).__name__}.forward the output of {missed} did not go "
                "to the activation that was fused into it (the forward took a path its trace did not show), so "
                "the result would differ from the original model's. Leave that linear out of fuse_ "
                "(FuseConfig.exclude) or unfuse_ the model")
        return out

    def __repr__(self) -> str:
        return f"<{type(self.owner).__name__}.forward without its fused activation calls (lightning_fuse)>"
