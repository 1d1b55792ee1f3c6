"""Tiny models for the chain-finder and swap tests: the MLP shapes real code uses, and near misses.

Every dimension is small (d <= 64) so the Triton interpreter stays fast.
"""

from __future__ import annotations

import copy
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

# -- MLPs that must be fused ------------------------------------------------------------------------


class Conv1D(nn.Module):
    """HF's Conv1D (an ``(in, out)`` weight), as transformers defines it, so tests need not import it."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * nx ** -0.5)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*x.shape[:-1], self.nf)


class NanoGPTMLP(nn.Module):
    """nanoGPT's ``MLP``: ``c_fc -> GELU (exact) -> c_proj -> dropout``."""

    def __init__(self, d: int = 16, bias: bool = True, dropout: float = 0.0) -> None:
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * d, d, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.c_fc(x)  # (B, T, 4d)
        x = self.gelu(x)
        x = self.c_proj(x)  # (B, T, d)
        return self.dropout(x)


class ShuffledMLP(nn.Module):
    """The nanoGPT MLP with its children registered in another order than its forward calls them."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.c_proj = nn.Linear(4 * d, d)
        self.dropout = nn.Dropout(0.0)
        self.gelu = nn.GELU()
        self.c_fc = nn.Linear(d, 4 * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class LitGPTMLP(nn.Module):
    """litgpt's ``GptNeoxMLP``: the activation is a functional call inside ``forward``."""

    def __init__(self, d: int = 16, approximate: str = "tanh") -> None:
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc(x)
        x = F.gelu(x, approximate=self.approximate)
        return self.proj(x)


class FunctionalZoo(nn.Module):
    """Every functional activation form the finder knows, one per linear, in a stack."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d, self.e = (nn.Linear(d, d) for _ in range(5))

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # `input` shadows a builtin, as in HF code
        h = F.relu(self.a(input))
        h = torch.relu(self.b(h))
        h = F.silu(self.c(h))
        h = self.d(h).relu()
        return F.gelu(self.e(h))


class ModuleListMLP(nn.Module):
    """Linears held in a ``ModuleList``; the activation is functional."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d, 2 * d), nn.Linear(2 * d, d)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](F.silu(self.layers[0](x)))


class Block(nn.Module):
    """A transformer-ish block: an attention-like projection (not a chain) and a nanoGPT MLP."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.attn_proj = nn.Linear(d, d)
        self.mlp = NanoGPTMLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn_proj(x)
        return x + self.mlp(x)


class TiedHeadLM(nn.Module):
    """An embedding, an MLP and an output head whose weight is the embedding's (tied weights)."""

    def __init__(self, vocab: int = 32, d: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.mlp = NanoGPTMLP(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.mlp(self.wte(idx)))


def sequential_mlp(d: int = 16, activation: Optional[nn.Module] = None) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d, 4 * d), activation or nn.GELU(), nn.Linear(4 * d, d))


# -- near misses: found, reported, left alone -----------------------------------------------------


class DropoutBetween(nn.Module):
    """``fc -> dropout -> act``: the activation does not consume the linear's output directly."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.drop = nn.Dropout(0.1)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.drop(self.fc(x)))


class OutputReused(nn.Module):
    """``act(h) + h``: the pre-activation value is needed after the activation."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.act(h) + h


class SharedActivation(nn.Module):
    """One activation module instance applied after two linears."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc1(x)) + self.act(self.fc2(x))


class LinearCalledTwice(nn.Module):
    """One linear module called twice, each time followed by an activation."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.act1 = nn.GELU()
        self.act2 = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act2(self.fc(self.act1(self.fc(x))))


class ActivationExtraArgs(nn.Module):
    """An activation module called with an extra tensor argument (only traced, never run)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x), x)


class GeluFromTensorArg(nn.Module):
    """``F.gelu`` whose ``approximate`` comes from a forward argument: unknown at trace time."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, approximate: str) -> torch.Tensor:
        return F.gelu(self.fc(x), approximate=approximate)


class TrainingDependent(nn.Module):
    """A forward whose graph depends on ``self.training`` (functional dropout)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(F.gelu(self.fc(x)), 0.1, training=self.training)


class OptionalArgMLP(nn.Module):
    """A functional activation in a forward with an optional argument."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, scale: Optional[float] = None) -> torch.Tensor:
        h = F.relu(self.fc(x))
        return h * scale if scale is not None else h


class Untraceable(nn.Module):
    """Data-dependent control flow: torch.fx cannot trace it."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if h.sum() > 0:
            return self.act(h)
        return h


class SequentialLooped(nn.Module):
    """A Sequential its parent iterates with a residual around every item: its item order is not the
    data flow (``fc``'s output also feeds the add), so nothing may be fused from that order."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x) + x
        return x


class SequentialIndexed(nn.Module):
    """A Sequential its parent indexes: the first linear's output is used twice."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.net[0](x)
        return self.net[2](self.net[1](h)) + h.mean(-1, keepdim=True)


class SequentialItemwise(nn.Module):
    """A Sequential its parent calls item by item in order: a real chain, found in the parent's graph."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.net:
            x = layer(x)
        return x


class SequentialTwoWays(nn.Module):
    """A Sequential called whole and item by item: its linear runs at two places."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) + self.net[0](x)


class GatedMLP(nn.Module):
    """A functional activation in a forward of two required arguments, one of them allowed to be None."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor, gate: Optional[torch.Tensor]) -> torch.Tensor:
        h = F.gelu(self.fc(x), approximate="tanh")
        if gate is not None:
            h = h * gate
        return self.proj(h)


# -- comparisons -------------------------------------------------------------------------------------


def fused_and_reference(make: Callable[[], nn.Module], seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """Two identical models (the first to be fused)."""
    torch.manual_seed(seed)
    model = make()
    return model, copy.deepcopy(model)


def assert_same_outputs_and_grads(fused: nn.Module, reference: nn.Module, x: torch.Tensor,
                                  rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Output, input gradient and every parameter gradient of ``fused`` equal ``reference``'s."""
    x1 = x.detach().clone().requires_grad_(x.is_floating_point())
    x2 = x.detach().clone().requires_grad_(x.is_floating_point())
    seed = int(torch.randint(0, 2**31, ()))
    torch.manual_seed(seed)  # the same dropout masks in both
    y1 = fused(x1)
    torch.manual_seed(seed)
    y2 = reference(x2)
    torch.testing.assert_close(y1, y2, rtol=rtol, atol=atol)
    weight = torch.randn_like(y1)  # a non-uniform upstream gradient
    (y1 * weight).sum().backward()
    (y2 * weight).sum().backward()
    if x.is_floating_point():
        torch.testing.assert_close(x1.grad, x2.grad, rtol=rtol, atol=atol)
    params1, params2 = dict(fused.named_parameters()), dict(reference.named_parameters())
    assert params1.keys() == params2.keys()
    for name, param in params1.items():
        assert param.grad is not None, name
        torch.testing.assert_close(param.grad, params2[name].grad, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


# -- forwards a single trace does not show whole -----------------------------------------------------


class OptionalBranchMLP(nn.Module):
    """Without its optional argument the forward also reads the pre-activation (a traced Proxy is never None)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor, skip: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = self.fc(x)
        y = self.act(h)
        if skip is None:
            return y + h
        return y + skip


class LoopedUntraceable(SequentialLooped):
    """``SequentialLooped`` (a residual around every item of its Sequential) in a forward torch.fx cannot trace."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = super().forward(x)
        if x.abs().max() > 1e6:  # data-dependent
            x = x / x.abs().max()
        return x


class CallsSequentialWhole(nn.Module):
    """Calls its Sequential whole, in a forward torch.fx cannot trace."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.mlp(x)
        if y.abs().max() > 1e6:  # data-dependent
            y = y / y.abs().max()
        return y


class FrozenFeatureMLP(nn.Module):
    """A functional chain run under ``torch.no_grad()`` (a frozen feature extractor)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.head = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            features = F.relu(self.fc(x))
        return self.head(features)


class MLPWithAuxLoss(nn.Module):
    """Stores a value computed from the activation on ``self`` (as MoE routers store their auxiliary loss)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc(x), approximate="tanh")
        self.aux_loss = h.pow(2).mean()
        return self.proj(h)


class ScaledResidualMLP(nn.Module):
    """Reads a Python attribute that a schedule changes during training."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)
        self.alpha = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.alpha * self.proj(F.silu(self.fc(x)))


class StochasticDepthMLP(nn.Module):
    """Skips the block at random in training (a draw in Python, which a trace would fix once)."""

    def __init__(self, d: int = 16, p: float = 0.5) -> None:
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.rand(()).item() < self.p:
            return x
        return x + self.proj(F.gelu(self.fc(x)))


class AliasedActivation(nn.Module):
    """One GELU registered at two paths, called through the second."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.act = nn.GELU()
        self.fc = nn.Linear(d, 4 * d)
        self.block = nn.ModuleList([self.act])
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.block[0](self.fc(x)))


class ConstantScaleMLP(nn.Module):
    """Builds a tensor constant in its forward (which tracing stores on the module)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x))) * torch.tensor(0.5)


class ModuleListWithActivation(nn.Module):
    """A chain whose linear is in a ModuleList and whose activation module is not."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d, 2 * d), nn.Linear(2 * d, d)])
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](self.act(self.layers[0](x)))


# -- a chain's linear or activation called directly by another module's forward -----------------------


class InnerChain(nn.Module):
    """``fc -> act``: a chain in this forward."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class CallsInnerLinear(nn.Module):
    """Calls ``inner`` whole, and ``inner.fc`` directly (its raw output, no activation)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.inner = InnerChain(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) + self.inner.fc(x)


class CallsInnerActivation(nn.Module):
    """Calls ``inner`` whole, and ``inner.act`` directly on another tensor."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.inner = InnerChain(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) + self.inner.act(x)


class CallsNestedModuleWhole(nn.Module):
    """Calls a grandchild module whole (``wrap.inner``): its chain is what that module computes."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.wrap = nn.Module()
        self.wrap.inner = InnerChain(d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.wrap.inner(x))



def keep_all_but_c_proj(module: nn.Module, fqn: str) -> bool:
    """A module filter named by its import path in tests."""
    return fqn != "c_proj"
