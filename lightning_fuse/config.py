"""``FuseConfig``: what ``fuse_`` looks for and what it swaps (an OmegaConf structured config).

``convert`` picks which linear layers are swapped:

- ``"chains"``: only the linear of each ``Linear -> activation`` chain (``FusedLinearBiasActivation``);
- ``"mlp"`` (default): also the linear that alone consumes a fused chain's activation output
  (GPT-2's ``c_proj``), as an ``FP8Linear``, so a whole MLP block runs FP8;
- ``"all"``: every other eligible linear too (attention projections included), as ``FP8Linear``.

Build one from code (``FuseConfig(convert="all")``), from keyword arguments or a mapping
(``FuseConfig.create(**kwargs)``, ``make_fuse_config(dict_or_dictconfig)``); each rejects a
misspelt key with the list of valid ones (the constructor with a ``TypeError``, the other two with a
``ValueError``).

``resolve_module_filter`` turns the callback's ``module_filter_fn`` as a config file can give it (an
import path, or a Hydra-style ``_target_`` node) into the callable ``fuse_`` takes.
"""

from __future__ import annotations

import difflib
import functools
import importlib
from dataclasses import dataclass, fields
from collections.abc import Sequence
from typing import Any, Callable, Iterable, Mapping, Optional, Tuple, Union

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lightning_fuse.kernels import ACTIVATIONS

__all__ = ["CONVERT_MODES", "FuseConfig", "make_fuse_config", "resolve_module_filter"]

CONVERT_MODES: Tuple[str, ...] = ("chains", "mlp", "all")


def _check_names(field_name: str, value: object, accepted: Optional[Tuple[str, ...]]) -> Tuple[str, ...]:
    """``value`` as a tuple of strings (each in ``accepted`` when given), or a ``TypeError``/``ValueError``."""
    # Any sequence: Hydra's instantiate hands ListConfigs over unless told to convert them.
    if isinstance(value, str) or not isinstance(value, Sequence):
        example = f"[{accepted[0]!r}]" if accepted else "['lm_head']"
        raise TypeError(f"`{field_name}` must be a list of strings, e.g. {example}; got {value!r}")
    names = tuple(value)
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"`{field_name}` must hold strings; got {name!r} ({type(name).__name__})")
        if accepted is not None and name not in accepted:
            raise ValueError(f"`{field_name}` holds an unknown activation {name!r}; accepted: {', '.join(accepted)}")
    return names


@dataclass(frozen=True)
class FuseConfig:
    """What ``fuse_`` finds and swaps (see the module docstring for ``convert``).

    Raises:
        ValueError: an unknown ``convert`` mode or activation name.
        TypeError: a field of the wrong type.

    Example::

        report = fuse_(model, FuseConfig(convert="all", exclude=("lm_head",)))
    """

    convert: str = "mlp"  # which linears are swapped: "chains", "mlp" or "all" (module docstring)
    activations: Tuple[str, ...] = ACTIVATIONS  # activations whose chains are fused; other chains are reported
    exclude: Tuple[str, ...] = ()  # fnmatch patterns of linear fqns never swapped ("*" spans dots), e.g. "*.attn.*"
    emulate: bool = False  # run the FP8 path on CPU too (how CI tests the FP8 logic; slow)

    def __post_init__(self) -> None:
        if self.convert not in CONVERT_MODES:
            raise ValueError(f"`convert` must be one of {', '.join(CONVERT_MODES)}; got {self.convert!r}")
        # OmegaConf hands sequences over as lists; tuples keep the frozen config hashable.
        object.__setattr__(self, "activations", _check_names("activations", self.activations, ACTIVATIONS))
        object.__setattr__(self, "exclude", _check_names("exclude", self.exclude, None))
        if not isinstance(self.emulate, bool):
            raise TypeError(f"`emulate` must be a bool; got {self.emulate!r} ({type(self.emulate).__name__})")

    @classmethod
    def create(cls, **kwargs: Any) -> "FuseConfig":
        """A config from keyword arguments; a misspelt key is a ``ValueError`` listing the valid keys."""
        return make_fuse_config(kwargs)


def unknown_names(owner: str, noun: str, given: Iterable[Any], valid: Sequence[str]) -> str:
    """The message naming what of ``given`` is not in ``valid`` (each with its closest valid name) and
    listing the valid ones, e.g. "unknown FuseConfig key(s) 'conver' (did you mean 'convert'?); valid
    keys: ..."; "" if all are valid."""
    hints = []
    for name in given:
        if name not in valid:
            close = difflib.get_close_matches(str(name), valid, n=1)
            hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return f"unknown {owner} {noun}(s) {', '.join(hints)}; valid {noun}s: {', '.join(valid)}" if hints else ""


def checked_fields(noun: str) -> Callable[[type], type]:
    """A dataclass decorator: its constructor names a misspelt keyword's closest field and lists them
    all in a ``TypeError`` (the generated one says only "unexpected keyword argument")."""
    def decorate(cls: type) -> type:
        init = cls.__init__
        valid = tuple(f.name for f in fields(cls))

        @functools.wraps(init)
        def checked(self: Any, *args: Any, **kwargs: Any) -> None:
            message = unknown_names(cls.__name__, noun, kwargs, valid)
            if message:
                raise TypeError(message)
            init(self, *args, **kwargs)

        cls.__init__ = checked  # type: ignore[method-assign]
        return cls
    return decorate


checked_fields("key")(FuseConfig)


def _unknown_keys(keys: Iterable[Any]) -> str:
    """The message naming the keys of ``keys`` that are not ``FuseConfig`` fields; "" if none."""
    return unknown_names("FuseConfig", "key", keys, tuple(f.name for f in fields(FuseConfig)))


def make_fuse_config(config: Union[FuseConfig, Mapping[str, Any], DictConfig, None]) -> FuseConfig:
    """A ``FuseConfig`` from a config, a mapping of its fields, an OmegaConf ``DictConfig``, or ``None``
    (the defaults). A Hydra ``_target_`` key naming ``FuseConfig`` is accepted and dropped.

    Raises:
        ValueError: an unknown key (the message lists the valid ones), or a bad value.
        TypeError: ``config`` is none of the accepted types, or a field has the wrong type.
    """
    if config is None:
        return FuseConfig()
    if isinstance(config, FuseConfig):
        return config
    if isinstance(config, DictConfig):
        raw = OmegaConf.to_container(config, resolve=True)
    elif isinstance(config, Mapping):
        raw = dict(config)
    else:
        raise TypeError(f"`config` must be a FuseConfig, a mapping of its fields, a DictConfig or None; "
                        f"got {type(config).__name__}")
    target = raw.pop("_target_", None)
    if target is not None and not str(target).endswith("FuseConfig"):
        raise ValueError(f"`_target_` must name lightning_fuse.FuseConfig; got {target!r}")
    message = _unknown_keys(raw)
    if message:
        raise ValueError(message)
    # Checked before OmegaConf sees them, so the message names the accepted values.
    if "convert" in raw and raw["convert"] not in CONVERT_MODES:
        raise ValueError(f"`convert` must be one of {', '.join(CONVERT_MODES)}; got {raw['convert']!r}")
    if "activations" in raw:
        _check_names("activations", raw["activations"], ACTIVATIONS)
    if "exclude" in raw:
        _check_names("exclude", raw["exclude"], None)
    if "emulate" in raw:  # OmegaConf would read "yes", "on", "1" or 2 as True
        emulate = raw["emulate"]
        if isinstance(emulate, str) and emulate.lower() not in ("true", "false"):
            raise ValueError(f"`emulate` must be a bool (or 'true'/'false' from a config file); got {emulate!r}")
        if not isinstance(emulate, (bool, str)):
            raise TypeError(f"`emulate` must be a bool; got {emulate!r} ({type(emulate).__name__})")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(FuseConfig), raw)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        raise ValueError(f"bad FuseConfig value for `{key}`: {str(err).splitlines()[0]}") from None
    try:
        return OmegaConf.to_object(merged)
    except TypeError as err:
        raise ValueError(str(err)) from None


_FILTER_FORMS = ("a callable (module, fqn) -> bool, the import path of one ('mypkg.filters.keep' or "
                 "'mypkg.filters:keep'), a {_target_: ..., _partial_: true, ...} node, or None")


def _import_object(path: Any, argument: str) -> Any:
    """The object an import path names: ``pkg.mod.name`` or ``pkg.mod:name``, the name possibly an
    attribute of an attribute (``pkg.mod.Filters.keep``), as Hydra's ``_target_`` resolves it."""
    if isinstance(path, str) and ":" in path:
        module_name, _, rest = path.partition(":")
        splits = [(module_name, rest.split("."))] if module_name and rest else []
    else:
        parts = path.split(".") if isinstance(path, str) else []
        # the longest prefix that is a module, the rest attributes of it
        splits = [(".".join(parts[:i]), parts[i:]) for i in range(len(parts) - 1, 0, -1)]
    if not splits or not all(part for name, attrs in splits for part in [*name.split("."), *attrs]):
        raise ValueError(f"`{argument}` must be an import path with a module and a name, such as "
                         f"'mypkg.filters.keep'; got {path!r}")
    for module_name, attrs in splits:
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name is None or not (module_name + ".").startswith(err.name + "."):
                raise  # the module exists but fails importing something of its own: say that, not "not found"
            continue
        for depth, attr in enumerate(attrs):
            try:
                obj = getattr(obj, attr)
            except AttributeError:
                owner = ".".join([module_name, *attrs[:depth]])
                raise ValueError(f"`{argument}` {path!r}: {owner!r} has no attribute {attr!r}") from None
        return obj
    raise ValueError(f"`{argument}` {path!r}: no module named {splits[-1][0]!r}")


def resolve_module_filter(value: Any) -> Optional[Callable[[Any, str], bool]]:
    """The module filter ``value`` gives: a callable as it is; an import path, imported; a mapping with
    ``_target_`` as Hydra instantiates one (``_partial_: true`` binds the other keys as keyword
    arguments of the filter itself; without it the target is called with them and must return the filter).

    Raises:
        ValueError: a path that does not import, or a mapping without ``_target_`` or with other ``_`` keys.
        TypeError: a value of none of those forms, or one that does not give a callable.
    """
    if value is None or callable(value):
        return value
    if isinstance(value, str):
        resolved = _import_object(value, "module_filter_fn")
    elif isinstance(value, (Mapping, DictConfig)):
        node = OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig) else dict(value)
        if "_target_" not in node:
            raise ValueError(f"`module_filter_fn` as a mapping must have a `_target_` naming a function; got {node!r}")
        target = _import_object(node.pop("_target_"), "module_filter_fn._target_")
        partial = node.pop("_partial_", False)
        special = sorted(k for k in node if str(k).startswith("_"))
        if special:
            raise ValueError(f"`module_filter_fn` takes only `_target_` and `_partial_` of Hydra's special keys; "
                             f"got {special}")
        if not isinstance(partial, bool):
            raise TypeError(f"`module_filter_fn._partial_` must be a bool; got {partial!r}")
        if not callable(target):
            raise TypeError(f"`module_filter_fn._target_` must name a callable; got {target!r}")
        resolved = functools.partial(target, **node) if partial else target(**node)
    else:
        raise TypeError(f"`module_filter_fn` must be {_FILTER_FORMS}; got {value!r} ({type(value).__name__})")
    if not callable(resolved):
        raise TypeError(f"`module_filter_fn` {value!r} gives {resolved!r}, which is not callable: expected "
                        f"{_FILTER_FORMS}")
    return resolved
