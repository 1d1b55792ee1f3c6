"""``find_chains``: which ``linear -> activation`` pairs are found, in execution order, and the near
misses it reports (with why) instead of fusing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers_models import (
    ActivationExtraArgs,
    Block,
    CallsInnerActivation,
    CallsInnerLinear,
    CallsNestedModuleWhole,
    DropoutBetween,
    FunctionalZoo,
    GeluFromTensorArg,
    LinearCalledTwice,
    LitGPTMLP,
    ModuleListMLP,
    NanoGPTMLP,
    OutputReused,
    SharedActivation,
    ShuffledMLP,
    TrainingDependent,
    Untraceable,
    sequential_mlp,
)
from lightning_fuse.chain_finder import activation_of_module, find_chains


def _by_linear(model: nn.Module) -> dict:
    return {chain.linear: chain for chain in find_chains(model).chains}


@pytest.mark.parametrize("make", [NanoGPTMLP, ShuffledMLP])
def test_module_activation_chain(make):
    # c_fc -> gelu is a chain whatever order the children are registered in; c_proj alone consumes
    # the activation's output (the trailing Dropout follows c_proj, it is not in between).
    chains = _by_linear(make())
    assert list(chains) == ["c_fc"]
    chain = chains["c_fc"]
    assert (chain.activation, chain.act_module, chain.act_function, chain.consumer, chain.reason) == \
        ("gelu", "gelu", None, "c_proj", "")


def test_sequential_chain_and_consumer():
    # Sequential order is execution order: 0 -> 1 is a chain, 2 consumes it.
    chains = _by_linear(nn.Sequential(sequential_mlp(), nn.Linear(16, 16)))
    chain = chains["0.0"]
    assert (chain.activation, chain.act_module, chain.consumer, chain.reason) == ("gelu", "0.1", "0.2", "")
    assert list(chains) == ["0.0"]  # the last Linear is followed by nothing


@pytest.mark.parametrize("approximate, expected", [("none", "gelu"), ("tanh", "gelu_tanh")])
def test_functional_gelu(approximate, expected):
    # litgpt reads `approximate` from its config: a constant by the time the forward is traced.
    chain = _by_linear(LitGPTMLP(approximate=approximate))["fc"]
    assert (chain.activation, chain.act_module, chain.consumer, chain.reason) == (expected, None, "proj", "")
    assert chain.act_function == "F.gelu"


def test_every_functional_form():
    chains = _by_linear(FunctionalZoo())
    assert {name: chain.activation for name, chain in chains.items()} == \
        {"a": "relu", "b": "relu", "c": "silu", "d": "relu", "e": "gelu"}
    assert all(not chain.reason for chain in chains.values())
    # a..d feed the next linear through the activation; e's activation is the output.
    assert chains["a"].consumer == "b" and chains["e"].consumer is None


def test_linear_inside_module_list():
    chain = _by_linear(ModuleListMLP())["layers.0"]
    assert (chain.parent, chain.activation, chain.consumer, chain.reason) == ("", "silu", "layers.1", "")


def test_nested_fqns():
    chains = _by_linear(nn.Sequential(Block(), Block()))
    assert list(chains) == ["0.mlp.c_fc", "1.mlp.c_fc"]
    assert chains["1.mlp.c_fc"].consumer == "1.mlp.c_proj" and chains["1.mlp.c_fc"].parent == "1.mlp"


class _ReturnsActivation(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)

    def forward(self, x):
        return torch.relu(self.fc(x))


class _LlamaMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class _LinearTwiceAfter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        h = torch.relu(self.fc(x))
        return self.proj(h) + self.proj(x.new_zeros(x.shape[0], 16))


@pytest.mark.parametrize("make, linear, why", [
    # a gated MLP multiplies the activation's output first (Llama's act(gate) * up)
    (_LlamaMLP, "gate", "the activation's output goes to mul, not to a linear"),
    # BERT's intermediate layer returns it: the output linear is in a sibling module
    (lambda: nn.Sequential(_ReturnsActivation(), nn.Linear(16, 8)), "0.fc",
     "`0`'s forward returns the activation's output: what takes it is outside that forward"),
    (FunctionalZoo, "e", "the model's forward returns the activation's output"),
    (lambda: nn.Sequential(nn.Linear(8, 16), nn.GELU()), "0",
     "the activation ends the model's Sequential: what takes its output is outside it"),
    (lambda: nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16)), "0",
     "the activation's output goes to `2` (LayerNorm)"),
    (lambda: nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.GELU())), "0.0", "ends the Sequential `0`"),
    (_LinearTwiceAfter, "fc", "the linear `proj` it goes to is called 2 times in the model's forward"),
])
def test_a_fusable_chain_without_a_consumer_says_why(make, linear, why):
    # convert="mlp" converts the linear that alone takes a chain's activation output; where there is
    # none, the report says why (tests/test_fuse.py checks the report's table).
    chain = _by_linear(make())[linear]
    assert chain.reason == "" and chain.consumer is None
    assert why in chain.no_consumer, chain.no_consumer


@pytest.mark.parametrize("make, linear, why", [
    # the activation consumes the Dropout's output, not the linear's
    (DropoutBetween, "fc", "Dropout (`drop`) sits between"),
    (lambda: nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1), nn.ReLU()), "0", "Dropout (`1`) sits between"),
    # the value before the activation is needed by the `add`
    (OutputReused, "fc", "its output has 2 users"),
    # turning `act` into Identity would also remove it after fc2 (and vice versa)
    (SharedActivation, "fc1", "`act` is called at 2 places"),
    (SharedActivation, "fc2", "`act` is called at 2 places"),
    (lambda: nn.Sequential(nn.Linear(8, 8), *[nn.ReLU()] * 2), "0", "appears 2 times"),
    # fusing the activation into `fc` would apply it after both calls
    (LinearCalledTwice, "fc", "called 2 times"),
    (ActivationExtraArgs, "fc", "called with extra arguments"),
    (GeluFromTensorArg, "fc", "not a constant"),
    # dropout's `training` flag is baked into the traced graph: train and eval graphs differ
    (TrainingDependent, "fc", "train and eval mode"),
])
def test_near_misses_are_reported(make, linear, why):
    chain = _by_linear(make())[linear]
    assert why in chain.reason
    assert chain.consumer is None


def test_activation_with_hooks_is_not_fused():
    model = NanoGPTMLP()
    model.gelu.register_forward_hook(lambda module, args, out: out)
    assert "hooks" in _by_linear(model)["c_fc"].reason


def test_untraceable_forward_is_skipped_not_raised():
    search = find_chains(nn.Sequential(Untraceable(), NanoGPTMLP()))
    assert [chain.linear for chain in search.chains] == ["1.c_fc"]
    assert len(search.skipped) == 1 and search.skipped[0].name == "0"
    assert "cannot be traced by torch.fx" in search.skipped[0].reason


def test_modules_without_linear_children_are_not_reported():
    class NoLinears(nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # untraceable, but it has no linear to fuse, so nobody needs to know
                return x
            return -x

    search = find_chains(nn.Sequential(NoLinears(), nn.Tanh()))
    assert search.chains == [] and search.skipped == []


def test_finder_does_not_change_the_model():
    model = TrainingDependent().eval()
    before = {name: type(m) for name, m in model.named_modules()}
    find_chains(model)
    assert {name: type(m) for name, m in model.named_modules()} == before
    assert model.training is False and "forward" not in model.__dict__


@pytest.mark.parametrize("name, expected", [
    ("gelu", "gelu"), ("gelu_python", "gelu"), ("gelu_new", "gelu_tanh"), ("gelu_fast", "gelu_tanh"),
    ("gelu_pytorch_tanh", "gelu_tanh"), ("gelu_python_tanh", "gelu_tanh"), ("gelu_accurate", "gelu_tanh"),
    ("quick_gelu", "quick_gelu"), ("relu2", "squared_relu"), ("silu", "silu"), ("swish", "silu"), ("relu", "relu"),
    ("gelu_10", None), ("mish", None), ("tanh", None),  # clipped GELU and others have no kernel
])
def test_transformers_activation_classes(name, expected):
    activations = pytest.importorskip("transformers.activations")
    module = activations.ACT2FN[name]
    assert activation_of_module(module) == expected
    if expected is not None:
        # The name is right only if the class computes that function.
        from lightning_fuse.modules import activation_forward

        h = torch.randn(64, dtype=torch.float64) * 3
        torch.testing.assert_close(module(h), activation_forward(h, expected), rtol=1e-6, atol=1e-6)


def test_torch_activation_modules():
    assert activation_of_module(nn.GELU()) == "gelu"
    assert activation_of_module(nn.GELU(approximate="tanh")) == "gelu_tanh"
    assert activation_of_module(nn.ReLU(inplace=True)) == "relu"
    assert activation_of_module(nn.SiLU()) == "silu"

    class ScaledGELU(nn.GELU):
        def forward(self, x):
            return 2 * super().forward(x)

    # a subclass with its own forward computes something else
    assert activation_of_module(ScaledGELU()) is None


def test_class_named_like_transformers_is_not_trusted():
    class GELUActivation(nn.Module):  # same name, but not transformers' class
        def forward(self, x):
            return x

    assert activation_of_module(GELUActivation()) is None


# -- a chain's linear or activation called directly by another module's forward -----------------------


@pytest.mark.parametrize("make, why", [
    (CallsInnerLinear, "`inner.fc` is also called directly by the model's forward"),
    (CallsInnerActivation, "the activation module `inner.act` is also called directly by the model's forward"),
])
def test_a_chain_whose_linear_or_activation_another_forward_calls_directly_is_refused(make, why):
    # Fused, `inner.fc` would apply the activation at the other call too, and `inner.act` would be an
    # Identity there: the other forward does not call them as `inner`'s forward does.
    (chain,) = find_chains(make()).chains
    assert chain.linear == "inner.fc" and why in chain.reason and chain.consumer is None


def test_a_grandchild_called_whole_keeps_its_chain():
    (chain,) = find_chains(CallsNestedModuleWhole()).chains
    assert (chain.linear, chain.reason) == ("wrap.inner.fc", "")
