"""``fuse_`` and ``unfuse_``: swap a model's ``Linear -> activation`` chains (and, per ``FuseConfig.convert``,
other linears) for the fused modules, in place, and back.

What a swap does:

- a chain's linear becomes ``FusedLinearBiasActivation`` holding the same ``Parameter`` objects;
- its activation stops being applied where it was: an activation module child becomes
  ``nn.Identity()`` (the original is kept on it for ``unfuse_``); for a functional call in the
  parent's ``forward``, the parent instance gets a ``forward`` that runs the class's own forward
  with that call skipped on the fused linear's output (``activation_skip.py``; ``unfuse_``
  deletes it);
- with ``convert="mlp"`` the linear that alone consumes a fused activation's output, and with
  ``convert="all"`` every other eligible linear, becomes ``FP8Linear``.

Never swapped, and reported with the reason: linears whose weight or bias is shared with another
module (tied weights), modules registered at two places, chains whose linear or activation module
another module's forward also calls directly (``self.block.fc(x)``), ``nn.MultiheadAttention``'s ``out_proj``
(which the attention never calls), linears with hooks, ``nn.Linear``
subclasses with their own ``forward``, parametrized or lazy weights, names matched by
``FuseConfig.exclude`` and modules ``module_filter_fn`` rejects. ``state_dict`` keys and values do
not change, so checkpoints load both ways with ``strict=True``. The model's FP8 scaling state
(every swapped module registered in ``named_modules()`` order) is returned by ``fp8_state_of``.
"""

from __future__ import annotations

import fnmatch
import logging
import warnings
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Union

from omegaconf import DictConfig
from torch import nn
from torch.nn.utils import parametrize

from .activation_skip import ActivationsFusedAway
from .chain_finder import Chain, ChainSearch, SkippedModule, find_chains
from .config import FuseConfig, make_fuse_config, resolve_module_filter
from .modules import (FP8Linear, FusedLinearBiasActivation, FP8LinearBase, fp8_shape_reason, is_linear_like,
                      linear_dims)
from .scaling import FP8ScalingState

__all__ = ["ChainReport", "FuseReport", "LinearReport", "fp8_state_of", "fuse_", "unfuse_"]

log = logging.getLogger(__name__)

ModuleFilter = Callable[[nn.Module, str], bool]

_RECORD_ATTR = "_lightning_fuse"  # on the fused model: config, report and FP8 state of the fuse_ call
_ORIGINAL_ATTR = "_lightning_fuse_original"  # on an nn.Identity that replaced an activation: (original, fused linear)
_PARTNER_ATTR = "_lightning_fuse_partner"  # on a fused chain's linear: (its placeholder or the parent whose call it skips,)


# -- the report -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChainReport:
    """One chain found (or near miss), and what ``fuse_`` did with it."""

    name: str  # fqn of the chain's linear
    activation: str  # activation name ("gelu", "gelu_tanh", ...), "" when it could not be told
    in_features: int  # the linear's input features
    out_features: int  # the linear's output features
    fused: bool  # swapped for FusedLinearBiasActivation
    reason: str  # "" when fused, else why not
    fp8: bool  # whether FP8 GEMMs can run these dimensions (else the module runs in high precision)
    fp8_reason: str  # why FP8 cannot apply by shape, or ""
    consumer: str = ""  # fqn of the linear that alone takes the activation's output ("mlp" converts it), or ""
    no_consumer: str = ""  # why there is none, for a fused chain (e.g. a gated MLP multiplies the output first)


@dataclass(frozen=True)
class LinearReport:
    """A linear outside any fused chain that ``FuseConfig.convert`` selects, and what ``fuse_`` did."""

    name: str  # fqn of the linear
    role: str  # "mlp": it alone consumes a fused chain's activation; "other": selected by convert="all"
    in_features: int  # input features
    out_features: int  # output features
    fused: bool  # swapped for FP8Linear
    reason: str  # "" when swapped, else why not
    fp8: bool  # whether FP8 GEMMs can run these dimensions
    fp8_reason: str  # why FP8 cannot apply by shape, or ""


@dataclass(frozen=True)
class FuseReport:
    """What ``fuse_`` found and swapped; ``str(report)`` is a plain-text table."""

    chains: tuple[ChainReport, ...] = ()  # every chain found, fused or not, in named_modules() order
    linears: tuple[LinearReport, ...] = ()  # other linears selected by FuseConfig.convert
    skipped: tuple[SkippedModule, ...] = ()  # modules with linear children whose forward could not be traced
    config: FuseConfig = field(default_factory=FuseConfig)  # the config fuse_ ran with

    @property
    def num_fused(self) -> int:
        """Chains swapped for ``FusedLinearBiasActivation``."""
        return sum(chain.fused for chain in self.chains)

    @property
    def num_fp8_linears(self) -> int:
        """Other linears swapped for ``FP8Linear``."""
        return sum(linear.fused for linear in self.linears)

    def to_dict(self) -> dict[str, Any]:
        """Plain Python containers (for logging or JSON)."""
        return {
            "chains": [asdict(chain) for chain in self.chains],
            "linears": [asdict(linear) for linear in self.linears],
            "skipped": [asdict(skipped) for skipped in self.skipped],
            "config": asdict(self.config),
        }

    def table(self) -> str:
        """One row per chain and per selected linear: name, kind, shape, activation, decision, reason."""
        header = ("name", "kind", "in", "out", "activation", "swapped to", "fp8 shape", "reason")
        rows = []
        for chain in self.chains:
            rows.append((chain.name, "chain", str(chain.in_features), str(chain.out_features),
                         chain.activation or "?", "FusedLinearBiasActivation" if chain.fused else "-",
                         "ok" if chain.fp8 else "no", chain.reason or chain.fp8_reason))
        for linear in self.linears:
            rows.append((linear.name, linear.role, str(linear.in_features), str(linear.out_features), "-",
                         "FP8Linear" if linear.fused else "-", "ok" if linear.fp8 else "no",
                         linear.reason or linear.fp8_reason))
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]

        def line(row: tuple[str, ...]) -> str:
            cells = [cell.ljust(width) for cell, width in zip(row, widths)] + [row[-1]]
            return "  ".join(cells).rstrip()

        lines = [line(header), line(tuple("-" * width for width in widths) + ("------",))]
        lines += [line(row) for row in rows]
        lines.append(f"{self.num_fused} of {len(self.chains)} chains fused, {self.num_fp8_linears} other linears "
                     f"converted to FP8Linear (convert={self.config.convert!r})")
        alone = [chain for chain in self.chains if chain.fused and chain.no_consumer]
        if alone and self.config.convert == "mlp":
            lines.append("fused chains whose output no linear takes alone (convert='mlp' converts only such a "
                         "linear; convert='all' converts the others too):")
            lines += [f"  {chain.name}: {chain.no_consumer}" for chain in alone]
        if self.skipped:
            lines.append("not traced (their linears stay as they are unless convert='all'):")
            lines += [f"  {skipped.name}: {skipped.reason}" for skipped in self.skipped]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


@dataclass
class _FuseRecord:
    """Kept on the fused model (as ``_lightning_fuse``): survives ``deepcopy`` and ``pickle`` with it."""

    config: FuseConfig
    report: FuseReport
    state: FP8ScalingState


# -- eligibility ------------------------------------------------------------------------------------


class _Sharing:
    """Where each module and parameter of the model is registered (tied weights, shared modules)."""

    def __init__(self, model: nn.Module) -> None:
        self.module_paths: dict[int, list[str]] = defaultdict(list)
        for name, module in model.named_modules(remove_duplicate=False):
            self.module_paths[id(module)].append(name)
        self.param_paths: dict[int, list[str]] = defaultdict(list)
        for name, param in model.named_parameters(remove_duplicate=False):
            self.param_paths[id(param)].append(name)

    def reason(self, module: nn.Module, fqn: str) -> str:
        paths = self.module_paths[id(module)]
        if len(paths) > 1:
            return (f"the module is registered at {len(paths)} places ({', '.join(paths)}); "
                    "shared modules are not swapped")
        for attr in ("weight", "bias"):
            param = getattr(module, attr, None)
            if param is None:
                continue
            own = f"{fqn}.{attr}" if fqn else attr  # the model itself a linear: its fqn is ""
            others = [path for path in self.param_paths[id(param)] if path != own]
            if others:
                return f"its {attr} is shared with {others[0]} (tied weights are never converted)"
        return ""


def _unswappable_reason(module: nn.Module) -> str:
    """Why this linear-like module cannot be replaced by a fused one, or ``""``."""
    cls = type(module)
    if isinstance(module, nn.Linear) and cls.forward is not nn.Linear.forward:
        return f"its class {cls.__name__} overrides nn.Linear.forward, which the swapped module would not run"
    if parametrize.is_parametrized(module):
        return "its weight is parametrized (torch.nn.utils.parametrize); the swapped module would bypass that"
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter) or isinstance(weight, nn.parameter.UninitializedParameter):
        return "its weight is not an initialized nn.Parameter"
    if not weight.dtype.is_floating_point:
        return f"its weight has dtype {weight.dtype}; only floating-point weights are swapped"
    bias = getattr(module, "bias", None)
    if bias is not None and not isinstance(bias, nn.Parameter):
        return "its bias is a plain tensor, not an nn.Parameter"
    if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks:
        return "it has hooks, which the swapped module would not run"
    return ""


class _Eligibility:
    """Why a linear is not swapped (config, filter, sharing, its type), or ``""``."""

    def __init__(self, model: nn.Module, config: FuseConfig, module_filter_fn: Optional[ModuleFilter]) -> None:
        self.config = config
        self.module_filter_fn = module_filter_fn
        self.sharing = _Sharing(model)
        # nn.MultiheadAttention reads its out_proj's weight and bias itself and never calls the module
        self.attention_out = {id(m.out_proj) for m in model.modules() if isinstance(m, nn.MultiheadAttention)}

    def reason(self, module: nn.Module, fqn: str) -> str:
        for pattern in self.config.exclude:
            if fnmatch.fnmatchcase(fqn, pattern):
                return f"excluded by FuseConfig.exclude pattern {pattern!r}"
        if not fqn:
            return "it is the model itself: fuse_ changes a model in place, so it swaps submodules only (wrap it)"
        if id(module) in self.attention_out:
            return ("it is an nn.MultiheadAttention's out_proj: the attention reads its weight directly and "
                    "never calls it, so a swapped module would not run")
        reason = _unswappable_reason(module) or self.sharing.reason(module, fqn)
        if reason:
            return reason
        if self.module_filter_fn is not None and not self.module_filter_fn(module, fqn):
            return "module_filter_fn returned False"
        return ""


# -- fuse_ / unfuse_ -------------------------------------------------------------------------------


def _set_submodule(model: nn.Module, fqn: str, new: nn.Module) -> None:
    owner_path, _, name = fqn.rpartition(".")
    setattr(model.get_submodule(owner_path) if owner_path else model, name, new)


def _fused_part(model: nn.Module) -> str:
    """The fqn of the first already-swapped piece of ``model``, or ``""``."""
    for name, module in model.named_modules():
        if isinstance(module, FP8LinearBase) or _ORIGINAL_ATTR in module.__dict__ \
                or isinstance(module.__dict__.get("forward"), ActivationsFusedAway):
            return name or type(model).__name__
    return ""


def _existing_report(model: nn.Module, record: _FuseRecord, config: FuseConfig) -> FuseReport:
    if record.config != config:
        raise ValueError(f"the model is already fused with {record.config}; call unfuse_(model) before fusing it "
                         f"with {config}")
    for name in record.state.names:
        try:
            module = model.get_submodule(name)
        except AttributeError:
            module = None
        if not isinstance(module, FP8LinearBase):
            raise ValueError(f"the model was fused, then partly unfused (`{name}` is no longer a fused module); "
                             "call unfuse_(model) on the whole model and fuse it again")
    return record.report


def _shape(module: nn.Module) -> tuple[int, int, bool, str]:
    in_features, out_features, _ = linear_dims(module)
    reason = fp8_shape_reason(in_features, out_features)
    return in_features, out_features, not reason, reason


def fuse_(model: nn.Module, config: Union[FuseConfig, dict, DictConfig, None] = None, *,
          module_filter_fn: Optional[ModuleFilter] = None) -> FuseReport:
    """Swaps the ``Linear -> activation`` chains of ``model`` (and other linears, per ``config.convert``)
    for the fused modules, in place. See the module docstring for what is swapped and what is not.

    Fusing a model again with an equal config returns the first report and changes nothing.

    Args:
        model: any ``nn.Module``.
        config: a ``FuseConfig``, a mapping of its fields or a ``DictConfig``; ``None`` for the defaults.
        module_filter_fn: ``(module, fqn) -> bool``; a linear is swapped only where it returns ``True``. Also
            the import path of one (``"mypkg.filters.keep"``), as a config file gives it.

    Returns:
        A ``FuseReport``: every chain found (fused or why not), the other linears selected by
        ``convert``, and the modules whose forward could not be traced.

    Raises:
        ValueError: a bad config, or a model already fused with another config (or partly).
        TypeError: ``model`` is not an ``nn.Module``, or ``module_filter_fn`` is not callable.
        ValueError: ``module_filter_fn`` is an import path that does not import.

    Example::

        report = fuse_(model, FuseConfig(convert="mlp"), module_filter_fn=lambda m, fqn: "lm_head" not in fqn)
        report.table()  # every chain found, fused or why not
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"`model` must be an nn.Module; got {type(model).__name__}")
    config = make_fuse_config(config)
    module_filter_fn = resolve_module_filter(module_filter_fn)  # a callable, or an import path as configs give
    record = model.__dict__.get(_RECORD_ATTR)
    if isinstance(record, _FuseRecord):
        return _existing_report(model, record, config)
    fused_part = _fused_part(model)
    if fused_part:
        raise ValueError(f"`{fused_part}` is already fused (by fuse_ on a part of this model?); call unfuse_ on "
                         "that part first, or fuse the whole model once")

    plan = _plan(model, config, module_filter_fn)
    swapped = _swap(model, plan, config)
    report = plan.report
    if report.num_fused == 0:
        what = (f"; {report.num_fp8_linears} other linears were converted to FP8Linear" if swapped
                else "; the model is unchanged")
        warnings.warn(f"lightning_fuse: no fusable Linear -> activation chain in {type(model).__name__}{what}. "
                      "str(report) lists what was found and why it was left alone.", stacklevel=2)
    if swapped:
        state = FP8ScalingState()
        for name, module in model.named_modules():
            if id(module) in swapped:
                module.bind_fp8_state(state, name)
        model.__dict__[_RECORD_ATTR] = _FuseRecord(config, report, state)
    log.info("lightning_fuse: %s\n%s", type(model).__name__, report.table())
    return report


@dataclass
class _Plan:
    """What ``fuse_`` will swap, decided before anything changes."""

    report: FuseReport  # the decisions, as returned to the user
    chains: list[Chain]  # the chains to fuse
    forwards: dict[str, dict[str, str]]  # parent fqn -> {linear path under it: functional activation label}


def _decide_chains(model: nn.Module, chains: list[Chain], config: FuseConfig,
                   eligibility: _Eligibility) -> tuple[dict[str, str], set[str]]:
    """``(linear fqn -> "" or why its chain is not fused, linears refused for themselves)``."""
    decisions: dict[str, str] = {}
    refused: set[str] = set()  # refused for the linear itself (filter, exclude, tied): never swapped at all
    for chain in chains:
        reason = chain.reason
        if not reason and chain.activation not in config.activations:
            reason = (f"activation {chain.activation!r} is not in FuseConfig.activations "
                      f"({', '.join(config.activations)})")
        if not reason and chain.act_module is not None:
            paths = eligibility.sharing.module_paths[id(model.get_submodule(chain.act_module))]
            if len(paths) > 1:  # the one its forward calls may not be the one at this path
                reason = (f"the activation module is registered at {len(paths)} places ({', '.join(paths)}); "
                          "replacing it at one would leave the call at the other")
        if not reason:
            reason = eligibility.reason(model.get_submodule(chain.linear), chain.linear)
            if reason:
                refused.add(chain.linear)
        decisions[chain.linear] = reason
    return decisions, refused


def _skipped_calls(chains: list[Chain], decisions: dict[str, str]) -> dict[str, dict[str, str]]:
    """Parent fqn -> {fused linear's path under it: label of the activation call its forward skips}."""
    forwards: dict[str, dict[str, str]] = defaultdict(dict)
    for chain in chains:
        if chain.act_function is not None and not decisions[chain.linear]:
            local = chain.linear[len(chain.parent) + 1:] if chain.parent else chain.linear
            forwards[chain.parent][local] = chain.act_function
    return dict(forwards)


def _select_linears(model: nn.Module, search: ChainSearch, fused: list[Chain], refused: set[str],
                    convert: str) -> dict[str, str]:
    """fqn -> role of the linears ``convert`` turns into ``FP8Linear``, in ``named_modules()`` order."""
    consumers = {chain.consumer for chain in fused if chain.consumer is not None}
    if convert == "mlp":
        chain_linears = {chain.linear for chain in search.chains}
        wanted = {name for name in consumers if name not in chain_linears}
    elif convert == "all":
        skip = {chain.linear for chain in fused} | refused
        wanted = {name for name, module in model.named_modules() if is_linear_like(module) and name not in skip}
    else:
        wanted = set()
    order = [name for name, _ in model.named_modules()]
    ordered = [name for name in order if name in wanted] + sorted(wanted - set(order))
    return {name: "mlp" if name in consumers else "other" for name in ordered}


def _plan(model: nn.Module, config: FuseConfig, module_filter_fn: Optional[ModuleFilter]) -> _Plan:
    search = find_chains(model)
    eligibility = _Eligibility(model, config, module_filter_fn)
    decisions, refused = _decide_chains(model, search.chains, config, eligibility)
    forwards = _skipped_calls(search.chains, decisions)
    fused = [chain for chain in search.chains if not decisions[chain.linear]]

    chain_reports = []
    for chain in search.chains:
        in_features, out_features, fp8, fp8_reason = _shape(model.get_submodule(chain.linear))
        reason = decisions[chain.linear]
        chain_reports.append(ChainReport(chain.linear, chain.activation, in_features, out_features, not reason,
                                         reason, fp8, fp8_reason, chain.consumer or "",
                                         chain.no_consumer if not reason else ""))
    linear_reports = []
    for name, role in _select_linears(model, search, fused, refused, config.convert).items():
        module = model.get_submodule(name)
        in_features, out_features, fp8, fp8_reason = _shape(module)
        # An FP8Linear that FP8 cannot run computes what the linear does: nothing to swap it for.
        reason = eligibility.reason(module, name) or (f"{fp8_reason}, so it could never run FP8" if fp8_reason else "")
        linear_reports.append(LinearReport(name, role, in_features, out_features, not reason, reason, fp8,
                                           fp8_reason))
    report = FuseReport(tuple(chain_reports), tuple(linear_reports), tuple(search.skipped), config)
    return _Plan(report, fused, forwards)


def _swap(model: nn.Module, plan: _Plan, config: FuseConfig) -> set[int]:
    """Carries out ``plan``; returns the ids of the new FP8-capable modules."""
    swapped: set[int] = set()
    for chain in plan.chains:
        fused = FusedLinearBiasActivation(model.get_submodule(chain.linear), chain.activation, emulate=config.emulate)
        _set_submodule(model, chain.linear, fused)
        swapped.add(id(fused))
        if chain.act_module is not None:
            placeholder = nn.Identity()
            placeholder.train(fused.training)
            # Tuples hide these from nn.Module registration: the original (no parameters anyway) for unfuse_,
            # and the chain's two halves for each other, so a partial unfuse_ cannot split them.
            setattr(placeholder, _ORIGINAL_ATTR, (model.get_submodule(chain.act_module), fused))
            _set_submodule(model, chain.act_module, placeholder)
            setattr(fused, _PARTNER_ATTR, (placeholder,))
        else:
            setattr(fused, _PARTNER_ATTR, (model.get_submodule(chain.parent) if chain.parent else model,))
    for parent, calls in plan.forwards.items():
        owner = model.get_submodule(parent) if parent else model
        owner.forward = ActivationsFusedAway(owner, calls)
    for linear in plan.report.linears:
        if linear.fused:
            converted = FP8Linear(model.get_submodule(linear.name), emulate=config.emulate)
            _set_submodule(model, linear.name, converted)
            swapped.add(id(converted))
    for chain in plan.chains:
        consumer = model.get_submodule(chain.consumer) if chain.consumer is not None else None
        if isinstance(consumer, FP8Linear):
            # The chain's activation pass writes the consumer's FP8 input too (modules.py).
            model.get_submodule(chain.linear).link_consumer(consumer)
    return swapped


def unfuse_(model: nn.Module) -> nn.Module:
    """Undoes ``fuse_`` in place: original module types holding the same (current) ``Parameter``
    objects, activation modules put back, class forwards restored. Also works on a part of a fused
    model. Returns ``model``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"`model` must be an nn.Module; got {type(model).__name__}")
    _check_whole_chains(model)
    for owner in list(model.modules()):
        for name, child in list(owner.named_children()):
            if isinstance(child, FP8LinearBase):
                original = child.to_original()
                original.train(child.training)  # the original missed every train()/eval() since the swap
                setattr(owner, name, original)
            elif isinstance(child, nn.Identity) and _ORIGINAL_ATTR in child.__dict__:
                original = child.__dict__[_ORIGINAL_ATTR][0]
                original.train(child.training)
                setattr(owner, name, original)
        if isinstance(owner.__dict__.get("forward"), ActivationsFusedAway):
            del owner.__dict__["forward"]
        owner.__dict__.pop(_RECORD_ATTR, None)  # also the record of a fused model held inside this one
    return model


def _check_whole_chains(model: nn.Module) -> None:
    """Raises if ``model`` holds one half of a fused chain (the linear, or where its activation was)
    but not the other: putting one half back would drop the activation or apply it twice."""
    inside = {id(m) for m in model.modules()}
    for name, module in model.named_modules():
        if isinstance(module, FusedLinearBiasActivation) and _PARTNER_ATTR in module.__dict__:
            partner = module.__dict__[_PARTNER_ATTR][0]
            if id(partner) not in inside:
                where = ("the nn.Identity that replaced its activation module" if isinstance(partner, nn.Identity)
                         else f"the {type(partner).__name__} whose forward calls its activation")
                raise ValueError(f"unfuse_: `{name or type(model).__name__}` is a fused chain whose other half "
                                 f"({where}) is outside the module given; call unfuse_ on a module that holds both, "
                                 "or on the whole model")
        elif isinstance(module, nn.Identity) and _ORIGINAL_ATTR in module.__dict__:
            fused = module.__dict__[_ORIGINAL_ATTR][1]
            if id(fused) not in inside:
                raise ValueError(f"unfuse_: `{name or type(model).__name__}` stands for an activation fused into a "
                                 "linear outside the module given; call unfuse_ on a module that holds both, or on "
                                 "the whole model")


def fp8_state_of(model: nn.Module) -> Optional[FP8ScalingState]:
    """The FP8 scaling state ``fuse_`` created for ``model`` (or for the one fused submodule inside
    it, e.g. under a wrapper), or ``None`` when nothing in it was fused.

    Raises:
        ValueError: several parts of ``model`` were fused separately (each has its own state).
    """
    record = model.__dict__.get(_RECORD_ATTR)
    if isinstance(record, _FuseRecord):
        return record.state
    found = [(name, m.__dict__[_RECORD_ATTR]) for name, m in model.named_modules()
             if isinstance(m.__dict__.get(_RECORD_ATTR), _FuseRecord)]
    if len(found) > 1:
        raise ValueError(f"{len(found)} parts of the model were fused separately ({', '.join(n for n, _ in found)}), "
                         "each with its own FP8 state; ask for one with fp8_state_of(model.get_submodule(name))")
    return found[0][1].state if found else None
