"""Finding ``Linear -> activation`` chains in any model, in execution order.

For every module that has a linear-like child (directly, or inside a ``ModuleList``/``ModuleDict``/
``nn.Sequential`` child), the order of calls is read from:

- the ``nn.Sequential`` itself, when the module is a plain ``nn.Sequential`` that its parent calls
  as a whole;
- otherwise its ``forward``, traced with ``torch.fx`` with those children as leaves (the module's
  registration order says nothing about the order its forward calls them in). A Sequential child
  whose items the forward calls one by one (iterating or indexing it) is read from this graph, not
  from its item order; one called both ways has its chains refused. Where the forward cannot be
  traced, a Sequential child keeps its item order only if the forward's source uses it just by
  calling it whole.

The trace takes every argument as a tensor; a forward may branch on ``arg is None`` or on an
argument's default. So each argument after the first is also traced at its default (``None`` where
it has none), and a chain that call does not keep (the linear called, its output going elsewhere)
is refused.

A chain is a linear whose output has exactly one user, an activation: an activation module child
(``nn.GELU``, ``nn.ReLU``, ``nn.SiLU``, transformers' activation classes), a functional call
(``F.gelu(x, approximate=...)``, ``F.relu``, ``torch.relu``, ``F.silu``) or ``x.relu()``. Near
misses (a Dropout in between, the linear's output used twice, an activation module or a linear
called at two places, extra arguments, a forward that depends on ``self.training``, a linear or
activation module that another module's forward also calls directly, past its parent) are returned
with the reason they cannot be fused; a forward that cannot be traced is returned as skipped.
Nothing here changes the model (attributes a trace sets on it are taken off again).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from .activation_skip import FUNCTIONAL_ACTIVATIONS, GELU_APPROXIMATIONS
from .modules import is_linear_like

__all__ = ["Chain", "ChainSearch", "SkippedModule", "activation_of_module", "find_chains"]

# transformers' activation classes, matched by name (transformers is not a dependency). GELUActivation
# is exact GELU whether it calls F.gelu or its erf formula (use_gelu_python); the tanh formulas
# (NewGELU, FastGELU, AccurateGELU, GELUTanh's python variant) are GELU's tanh approximation.
_HF_ACTIVATIONS = {
    "GELUActivation": "gelu",
    "NewGELUActivation": "gelu_tanh",
    "FastGELUActivation": "gelu_tanh",
    "AccurateGELUActivation": "gelu_tanh",
    "GELUTanh": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh",
    "QuickGELUActivation": "quick_gelu",
    "ReLUSquaredActivation": "squared_relu",
    "SiLUActivation": "silu",
}

# Functional activations: the name, and the keyword arguments each accepts (positional extras map
# onto them in this order) with a check of their value.
_FUNCTIONAL: dict[Callable[..., Any], tuple[str, tuple[str, ...]]] = {
    F.gelu: ("gelu", ("approximate",)),
    F.relu: ("relu", ("inplace",)),
    torch.relu: ("relu", ()),
    F.silu: ("silu", ("inplace",)),
}
_FUNCTIONAL_LABELS = {function: label for label, function in FUNCTIONAL_ACTIVATIONS.items() if function in _FUNCTIONAL}
_DROPOUT_FUNCTIONS = (F.dropout, torch.dropout, F.alpha_dropout)
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


@dataclass(frozen=True)
class Chain:
    """One ``linear -> activation`` pair, fusable when ``reason`` is empty."""

    parent: str  # fqn of the module whose forward (or Sequential order) links the two ("" for the root)
    linear: str  # fqn of the linear-like module
    activation: str  # activation name ("gelu", "gelu_tanh", ...); "" when it cannot be told
    act_module: Optional[str]  # fqn of the activation module; None for a functional call
    act_function: Optional[str]  # the functional call's label (activation_skip.FUNCTIONAL_ACTIVATIONS); None otherwise
    consumer: Optional[str]  # fqn of the linear that alone consumes the activation's output, if any
    reason: str = ""  # "" when the chain can be fused, else why it is left alone
    no_consumer: str = ""  # why no linear alone consumes the activation's output (a fusable chain without one)


@dataclass(frozen=True)
class SkippedModule:
    """A module with linear children whose call order could not be read."""

    name: str  # fqn of the module
    reason: str  # why (the tracing error, in short)


@dataclass
class ChainSearch:
    """Everything ``find_chains`` found, in the model's ``named_modules()`` order."""

    chains: list[Chain] = field(default_factory=list)  # fusable chains and near misses
    skipped: list[SkippedModule] = field(default_factory=list)  # modules whose forward could not be traced


def activation_of_module(module: nn.Module) -> Optional[str]:
    """The activation name computed by ``module``, or ``None`` if it is not a known activation."""
    cls = type(module)
    if isinstance(module, nn.GELU) and cls.forward is nn.GELU.forward:
        return GELU_APPROXIMATIONS.get(module.approximate)
    if isinstance(module, nn.ReLU) and cls.forward is nn.ReLU.forward:
        return "relu"
    if isinstance(module, nn.SiLU) and cls.forward is nn.SiLU.forward:
        return "silu"
    if cls.__module__.startswith("transformers.") and cls.__name__ in _HF_ACTIVATIONS:
        return _HF_ACTIVATIONS[cls.__name__]
    return None


def _join(parent: str, name: str) -> str:
    return f"{parent}.{name}" if parent else name


def _has_hooks(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def _leaf_children(module: nn.Module) -> dict[str, nn.Module]:
    """Path -> module of the direct children, looking through ``ModuleList``/``ModuleDict`` children."""
    leaves: dict[str, nn.Module] = {}

    def walk(owner: nn.Module, prefix: str) -> None:
        for name, child in owner.named_children():
            path = prefix + name
            leaves.setdefault(path, child)
            if isinstance(child, (*_CONTAINERS, nn.Sequential)):
                walk(child, path + ".")

    walk(module, "")
    return leaves


class _ChildLeafTracer(fx.Tracer):
    """Records calls of the given modules as ``call_module`` nodes and traces through everything else.

    ``direct`` collects the other modules the traced forward itself calls (a grandchild called past its
    parent, ``self.block.fc(x)``); calls made inside such a module's own forward are not its business.
    """

    def __init__(self, leaves: set[int]) -> None:
        super().__init__()
        self._leaves = leaves
        self._depth = 0
        self.direct: set[int] = set()

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return id(m) in self._leaves

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if id(m) in self._leaves:
            return super().call_module(m, forward, args, kwargs)
        if not self._depth:
            self.direct.add(id(m))
        self._depth += 1
        try:
            return super().call_module(m, forward, args, kwargs)
        finally:
            self._depth -= 1


@dataclass(frozen=True)
class _ActivationUse:
    name: str  # activation name, "" when it cannot be told
    problem: str  # "" or why this call cannot be fused
    module: Optional[str]  # path of the activation module (relative to the parent), None when functional


def _functional_use(node: fx.Node) -> Optional[_ActivationUse]:
    """The activation of a functional call whose first argument is the linear's output."""
    name, keywords = _FUNCTIONAL[node.target]
    label = _FUNCTIONAL_LABELS[node.target]
    extra_positional = node.args[1:]
    if len(extra_positional) > len(keywords):
        return _ActivationUse(name, f"{label} is called with {len(node.args)} positional arguments", None)
    arguments = dict(zip(keywords, extra_positional))
    arguments.update(node.kwargs)
    unexpected = sorted(set(arguments) - set(keywords))
    if unexpected:
        return _ActivationUse(name, f"{label} is called with extra arguments {unexpected}", None)
    for key, value in arguments.items():
        if isinstance(value, fx.Node):
            return _ActivationUse(name, f"{label}'s `{key}` is a tensor or computed value ({value.name}), "
                                        "not a constant known when the forward is traced", None)
        if key == "inplace" and not isinstance(value, bool):
            return _ActivationUse(name, f"{label} has inplace={value!r}", None)
    if node.target is F.gelu:
        approximate = arguments.get("approximate", "none")
        if approximate not in GELU_APPROXIMATIONS:
            return _ActivationUse("", f"F.gelu has approximate={approximate!r} (expected 'none' or 'tanh')", None)
        name = GELU_APPROXIMATIONS[approximate]
    return _ActivationUse(name, "", None)


def _activation_use(node: fx.Node, source: fx.Node, leaves: dict[str, nn.Module]) -> Optional[_ActivationUse]:
    """How ``node`` applies an activation to ``source`` (its first argument), or ``None`` if it does not."""
    if not node.args or node.args[0] is not source:
        return None
    if node.op == "call_module":
        module = leaves.get(str(node.target))
        name = activation_of_module(module) if module is not None else None
        if name is None:
            return None
        target = str(node.target)
        if len(node.args) > 1 or node.kwargs:
            return _ActivationUse(name, f"the activation `{target}` is called with extra arguments", target)
        if _has_hooks(module):
            return _ActivationUse(name, f"the activation `{target}` has hooks, which fusing would drop", target)
        return _ActivationUse(name, "", target)
    if node.op == "call_function" and node.target in _FUNCTIONAL:
        return _functional_use(node)
    if node.op == "call_method" and node.target == "relu":
        if len(node.args) > 1 or node.kwargs:
            return _ActivationUse("relu", "Tensor.relu is called with extra arguments", None)
        return _ActivationUse("relu", "", None)
    return None


def _is_dropout(node: fx.Node, leaves: dict[str, nn.Module]) -> bool:
    if node.op == "call_module":
        return isinstance(leaves.get(str(node.target)), nn.modules.dropout._DropoutNd)
    return node.op == "call_function" and node.target in _DROPOUT_FUNCTIONS


def _is_passthrough(node: fx.Node, leaves: dict[str, nn.Module]) -> bool:
    """A Dropout or ``nn.Identity``: what may sit between an MLP's activation and its output linear."""
    if node.op == "call_module" and isinstance(leaves.get(str(node.target)), nn.Identity):
        return True
    return _is_dropout(node, leaves)


def _consumer(node: fx.Node, leaves: dict[str, nn.Module], calls: Counter, where: str) -> tuple[Optional[str], str]:
    """``(path, "")`` of the linear that alone consumes ``node`` (through Dropouts/Identities), or
    ``(None, why not)``; ``where`` names the forward traced ("`mlp`'s forward")."""
    current = node
    while True:
        users = list(current.users)
        if len(users) > 1:
            names = ", ".join(_node_label(user) for user in users)
            return None, f"the activation's output has {len(users)} users ({names})"
        if not users:
            return None, f"the activation's output is unused in {where}"
        user = users[0]
        if user.op == "output":
            return None, f"{where} returns the activation's output: what takes it is outside that forward"
        if not user.args or user.args[0] is not current:
            return None, f"the activation's output goes to {_node_label(user)}, not as its input"
        if _is_passthrough(user, leaves):
            current = user
            continue
        if user.op == "call_module" and is_linear_like(leaves.get(str(user.target), nn.Identity())):
            if calls[user.target] == 1:
                return str(user.target), ""
            return None, f"the linear `{user.target}` it goes to is called {calls[user.target]} times in {where}"
        return None, f"the activation's output goes to {_node_label(user)}, not to a linear"


def _node_label(node: fx.Node) -> str:
    if node.op in ("call_module", "call_method"):
        return str(node.target)
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target))
    return node.name


def _chains_in_graph(graph: fx.Graph, leaves: dict[str, nn.Module], parent: str) -> list[Chain]:
    calls = Counter(node.target for node in graph.nodes if node.op == "call_module")
    chains: list[Chain] = []
    reported: set[str] = set()
    for node in graph.nodes:
        if node.op != "call_module" or not is_linear_like(leaves.get(str(node.target), nn.Identity())):
            continue
        target = str(node.target)
        if target in reported:
            continue
        users = list(node.users)
        uses = [(user, use) for user in users if (use := _activation_use(user, node, leaves)) is not None]
        reason = ""
        if not uses and len(users) == 1 and _is_dropout(users[0], leaves):
            dropout = users[0]
            uses = [(user, use) for user in dropout.users
                    if (use := _activation_use(user, dropout, leaves)) is not None]
            if not uses:
                continue
            reason = (f"a Dropout (`{_node_label(dropout)}`) sits between the linear and the activation: "
                      "only a direct linear -> activation chain is fused")
        if not uses:
            continue
        act_node, use = uses[0]
        if not reason:
            if calls[target] > 1:
                where = f"`{parent}`'s forward" if parent else "the model's forward"
                reason = f"`{target}` is called {calls[target]} times in {where}; only a linear called once is fused"
            elif len(users) > 1:
                names = ", ".join(_node_label(user) for user in users)
                reason = (f"its output has {len(users)} users ({names}): the value before the activation "
                          "is needed elsewhere, so it cannot be fused away")
            elif use.problem:
                reason = use.problem
            elif use.module is not None and calls[use.module] > 1:
                reason = (f"the activation module `{use.module}` is called at {calls[use.module]} places; "
                          "replacing it would change the other calls")
        reported.add(target)
        consumer, no_consumer = (None, "") if reason else _consumer(
            act_node, leaves, calls, f"`{parent}`'s forward" if parent else "the model's forward")
        chains.append(Chain(
            parent=parent,
            linear=_join(parent, target),
            activation=use.name,
            act_module=_join(parent, use.module) if use.module is not None else None,
            act_function=None if use.module is not None else (
                "Tensor.relu" if act_node.op == "call_method" else _FUNCTIONAL_LABELS[act_node.target]),
            consumer=_optional_join(parent, consumer),
            reason=reason,
            no_consumer=no_consumer,
        ))
    return chains


def _optional_join(parent: str, path: Optional[str]) -> Optional[str]:
    return _join(parent, path) if path is not None else None


def _chains_in_sequential(seq: nn.Sequential, parent: str) -> list[Chain]:
    items = list(seq._modules.items())
    uses = Counter(id(module) for _, module in items)
    chains: list[Chain] = []
    for i, (key, module) in enumerate(items):
        if not is_linear_like(module) or i + 1 >= len(items):
            continue
        next_key, next_module = items[i + 1]
        act_key, act_index, reason = next_key, i + 1, ""
        if isinstance(next_module, nn.modules.dropout._DropoutNd) and i + 2 < len(items):
            act_key, act_index = items[i + 2][0], i + 2
            reason = (f"a Dropout (`{next_key}`) sits between the linear and the activation: "
                      "only a direct linear -> activation chain is fused")
        act_module = items[act_index][1]
        name = activation_of_module(act_module)
        if name is None:
            continue
        if not reason:
            if uses[id(module)] > 1:
                reason = (f"`{key}` appears {uses[id(module)]} times in the Sequential; "
                          "only a linear called once is fused")
            elif uses[id(act_module)] > 1:
                reason = (f"the activation module `{act_key}` appears {uses[id(act_module)]} times in the "
                          "Sequential; replacing it would change the other calls")
            elif _has_hooks(act_module):
                reason = f"the activation `{act_key}` has hooks, which fusing would drop"
        consumer, no_consumer = None, ""
        if not reason:
            j = act_index + 1
            while j < len(items) and isinstance(items[j][1], (nn.Identity, nn.modules.dropout._DropoutNd)):
                j += 1
            where = f"the Sequential `{parent}`" if parent else "the model's Sequential"
            if j >= len(items):
                no_consumer = f"the activation ends {where}: what takes its output is outside it"
            elif not is_linear_like(items[j][1]):
                no_consumer = f"the activation's output goes to `{items[j][0]}` ({type(items[j][1]).__name__})"
            elif uses[id(items[j][1])] > 1:
                no_consumer = f"the linear `{items[j][0]}` appears {uses[id(items[j][1])]} times in the Sequential"
            else:
                consumer = _join(parent, items[j][0])
        chains.append(Chain(parent, _join(parent, key), name, _join(parent, act_key), None, consumer, reason,
                            no_consumer))
    return chains


def _trace(module: nn.Module, leaves: dict[str, nn.Module], training: bool,
           concrete_args: Optional[dict[str, Any]] = None, direct: Optional[set[int]] = None) -> fx.Graph:
    """``module``'s forward traced in the given mode, leaving the model as it was: tracing stores tensor
    constants on the module (``_tensor_constant0``), and a forward that sets attributes leaves proxies.
    ``direct`` receives the ids of the modules other than ``leaves`` that the forward itself calls."""
    saved = [(m, dict(m.__dict__)) for m in module.modules()]
    was_training = module.training
    module.training = training
    tracer = _ChildLeafTracer({id(child) for child in leaves.values()})
    try:
        graph = tracer.trace(module, concrete_args)
        if direct is not None:
            direct.update(tracer.direct)
        return graph
    finally:
        for m, attributes in saved:
            m.__dict__.clear()
            m.__dict__.update(attributes)
        module.training = was_training


def _variants(module: nn.Module) -> list[tuple[str, dict[str, Any]]]:
    """Calls other than "every argument a tensor" that the forward may take another path for: each
    argument after the first at its default, or ``None`` where it has none. ``(label, concrete_args)``."""
    try:
        parameters = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return []
    variants = []
    for p in parameters[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        value = None if p.default is p.empty else p.default
        variants.append((f"{p.name}={value!r}", {p.name: value}))
    return variants


def _refused_by_variants(module: nn.Module, leaves: dict[str, nn.Module], parent: str,
                         chains: list[Chain]) -> list[Chain]:
    """``chains`` with those refused that another call pattern (``_variants``) does not keep: there the
    linear is called but its output does not go to that activation alone."""
    for label, concrete in _variants(module):
        try:
            graph = _trace(module, leaves, module.training, concrete)
        except Exception:  # the forward does not take that value at all: no other path to check
            continue
        called = {str(node.target) for node in graph.nodes if node.op == "call_module"}
        there = {chain.linear: chain for chain in _chains_in_graph(graph, leaves, parent)}
        checked = []
        for chain in chains:
            other = there.get(chain.linear)
            local = chain.linear[len(parent) + 1:] if parent else chain.linear
            if chain.reason or local not in called or (
                    other is not None and not other.reason and other.activation == chain.activation
                    and other.act_module == chain.act_module and other.act_function == chain.act_function):
                checked.append(chain)
                continue
            why = other.reason if other is not None and other.reason else "its output goes elsewhere"
            checked.append(_refused(chain, f"called with {label}, its parent's forward takes another path, where "
                                           f"{why}; a fused activation would be wrong for such calls"))
        chains = checked
    return chains


def _calls_only_whole(module: nn.Module, attribute: str) -> bool:
    """Whether the source of ``module``'s forward uses ``self.<attribute>`` only to call it (at least once)."""
    try:
        source = textwrap.dedent(inspect.getsource(type(module).forward))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return False
    function = tree.body[0]
    if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)) or not function.args.args:
        return False
    this = function.args.args[0].arg
    called: set[int] = set()
    uses = []
    for node in ast.walk(function):
        if isinstance(node, ast.Call):
            called.add(id(node.func))
        if (isinstance(node, ast.Attribute) and node.attr == attribute and isinstance(node.value, ast.Name)
                and node.value.id == this):
            uses.append(node)
    return bool(uses) and all(id(use) in called for use in uses)


def _short(err: Exception) -> str:
    text = str(err).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(err).__name__}: {first[:200]}" if first else type(err).__name__


_TWO_WAYS = ("its Sequential is called both as a whole and item by item, so the linear's output goes to "
             "more places than the Sequential's order shows")


def _refused(chain: Chain, why: str) -> Chain:
    """``chain`` left alone for ``why`` (unchanged if it already has a reason)."""
    return chain if chain.reason else replace(chain, consumer=None, reason=why, no_consumer="")


def find_chains(model: nn.Module) -> ChainSearch:
    """Every ``linear -> activation`` chain of ``model`` and every near miss (see the module docstring).

    Never raises for a model it cannot read: such modules are listed in ``skipped``.
    """
    search = ChainSearch()
    # Sequentials whose items a traced parent calls one by one: their item order is not the data flow,
    # the parent's graph is. -> "" or, where the parent also calls the whole Sequential, why its
    # chains cannot be fused.
    itemwise: dict[str, str] = {}
    # id of a module -> fqn of a module whose forward calls it past its parent (``self.block.fc(x)``)
    direct: dict[int, str] = {}
    read: set[str] = set()  # the modules whose forward was looked at (traced, or found untraceable)
    for parent, module in model.named_modules():
        if isinstance(module, _CONTAINERS) or getattr(type(module), "forward", None) is nn.Module.forward:
            continue  # no forward of its own: whoever calls its children is traced instead
        leaves = _leaf_children(module)
        if not any(is_linear_like(child) for child in leaves.values()):
            continue
        read.add(parent)
        calls_here: set[int] = set()
        if type(module) is nn.Sequential or (isinstance(module, nn.Sequential)
                                             and type(module).forward is nn.Sequential.forward):
            chains = _chains_in_sequential(module, parent)
            if parent in itemwise:
                if not itemwise[parent]:
                    continue  # its parent calls its items itself: the parent's graph says in what order
                chains = [_refused(chain, itemwise[parent]) for chain in chains]
            search.chains.extend(chains)
            continue
        if "forward" in module.__dict__:
            why = ("its forward is replaced on the instance, so the class's forward (what torch.fx traces) "
                   "is not what runs")
        else:
            try:
                graph = _trace(module, leaves, module.training, direct=calls_here)
                why = ""
            except Exception as err:  # any user forward may fail to trace; it is reported, never raised
                why = f"its forward cannot be traced by torch.fx ({_short(err)})"
        if why:
            search.skipped.append(SkippedModule(parent or type(module).__name__, why))
            # Its Sequential children: called whole only if its source says so; else their order is unknown.
            for path, child in leaves.items():
                if isinstance(child, nn.Sequential) and ("." in path or not _calls_only_whole(module, path)):
                    itemwise[_join(parent, path)] = (
                        f"its parent `{parent or type(module).__name__}` was not read ({why.partition(' (')[0]}) "
                        "and does not only call it whole, so the order its items run in is unknown")
            continue
        for called_id in calls_here:
            direct.setdefault(called_id, parent)
        called = Counter(str(node.target) for node in graph.nodes if node.op == "call_module")
        for path, child in leaves.items():
            if isinstance(child, nn.Sequential) and any(t.startswith(path + ".") for t in called):
                itemwise[_join(parent, path)] = _TWO_WAYS if called[path] else ""
        chains = [_refused(chain, _TWO_WAYS) if itemwise.get(chain.linear.rpartition(".")[0]) else chain
                  for chain in _chains_in_graph(graph, leaves, parent)]
        if not chains:
            continue
        try:
            other = _trace(module, leaves, not module.training)
            same = other.python_code("self").src == graph.python_code("self").src
        except Exception:  # traceable in one mode only: the forward depends on self.training
            same = False
        if not same:
            why = ("its forward traces differently in train and eval mode (it reads self.training), "
                   "so the chain found in one mode may not exist in the other")
            chains = [_refused(chain, why) for chain in chains]
        if any(not chain.reason for chain in chains):
            chains = _refused_by_variants(module, leaves, parent, chains)
        search.chains.extend(chains)
    search.chains = _refused_for_direct_calls(model, search.chains, direct, read)
    return search


def _refused_for_direct_calls(model: nn.Module, chains: list[Chain], direct: dict[int, str],
                              read: set[str]) -> list[Chain]:
    """``chains`` with those refused whose linear or activation module another forward calls directly
    (``self.block.fc(x)`` in an ancestor of ``block``): fused, that call would get the activation too,
    or lose it. Ancestors not traced yet (no linear child of their own) are traced here."""
    if not any(not chain.reason for chain in chains):
        return chains
    ancestors: set[str] = set()
    for chain in chains:
        if not chain.reason:
            parts = chain.linear.split(".")
            ancestors.update(".".join(parts[:i]) for i in range(len(parts) - 1))
    for name, module in model.named_modules():
        if name not in ancestors or name in read or isinstance(module, _CONTAINERS) \
                or type(module).forward in (nn.Module.forward, nn.Sequential.forward) or "forward" in module.__dict__:
            continue
        calls_here: set[int] = set()
        try:
            _trace(module, _leaf_children(module), module.training, direct=calls_here)
        except Exception:  # not readable: nothing known about its calls
            continue
        for called_id in calls_here:
            direct.setdefault(called_id, name)

    def caller(name: str) -> str:
        return f"`{name}`'s forward" if name else "the model's forward"

    checked = []
    for chain in chains:
        linear = id(model.get_submodule(chain.linear))
        act = id(model.get_submodule(chain.act_module)) if chain.act_module is not None else None
        if not chain.reason and linear in direct:
            chain = _refused(chain, f"`{chain.linear}` is also called directly by {caller(direct[linear])}, not only "
                                    "where the activation follows it: fused, that call would get the activation too")
        elif not chain.reason and act is not None and act in direct:
            chain = _refused(chain, f"the activation module `{chain.act_module}` is also called directly by "
                                    f"{caller(direct[act])}; replacing it would change that call")
        checked.append(chain)
    return checked
