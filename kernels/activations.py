"""Activation functions and their derivatives: Triton device functions and float64-capable references.

tanh-GELU is written through sigmoid: libdevice tanh does not run under the Triton interpreter,
and sigmoid avoids the cancellation of ``1 + tanh(u)`` for large negative inputs.

Names follow PyTorch: ``gelu`` (exact, erf), ``gelu_tanh`` (tanh approximation, GPT-2's
``gelu_new``), ``relu``, ``silu``, ``quick_gelu`` (``x * sigmoid(1.702 x)``), ``squared_relu``.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

__all__ = [
    "ACTIVATIONS",
    "activation_id",
    "act_forward",
    "act_derivative",
    "activation_reference",
    "activation_derivative_reference",
    "add_rounded",
]

# The kernels' ACTIVATION constexpr; 0 means "no activation" (plain bias gradient / quantize).
_IDS = {"gelu": 1, "gelu_tanh": 2, "relu": 3, "silu": 4, "quick_gelu": 5, "squared_relu": 6}
ACTIVATIONS: tuple[str, ...] = tuple(_IDS)

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def activation_id(name: object, argument: str = "activation") -> int:
    """The kernels' id for ``name``, or a ``ValueError`` listing the accepted names."""
    if not isinstance(name, str) or name not in _IDS:
        raise ValueError(f"`{argument}` must be one of {', '.join(ACTIVATIONS)}; got {name!r}")
    return _IDS[name]


# Compiled kernels take the hardware reciprocal through inline PTX; the Triton interpreter cannot
# run PTX and divides instead.
_PTX = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")


@triton.jit
def _rcp(d):
    """``1 / d`` as ``rcp.approx.ftz.f32`` (1 ulp; results below 2^-126 flush to 0): one instruction,
    where the approximate division ``tl.fdiv`` adds a range check, a select and three multiplies."""
    if _PTX:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [d], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.fdiv(1.0, d)


@triton.jit
def add_rounded(a, b):
    """``a + b`` as ``add.rn.f32``, into which ``ptxas`` never fuses the multiply that made ``a`` or ``b``.

    A plain add may take in a product as one fused multiply-add, and whether it does depends on the
    code around it: the fused pass's bias-gradient partials differed in the last bits between its
    build that sums them itself and the one a second launch sums (468 of 1,200 partials on an H100,
    the dx they came from identical). Adding with an explicit rounding gives the bias gradient the
    very products the FP8 copy is made of, in every build."""
    if _PTX:
        # (libdevice's add_rn is add.rn.ftz, which would flush subnormal gradients to zero)
        return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return a + b


@triton.jit
def _gaussian_and_tail(x):
    """``(e, h)`` with ``e = exp(-x^2 / 2)`` and ``e h = 0.5 erfc(|x| / sqrt 2)``, the normal
    distribution's tail beyond ``|x|``: ``Phi(x) = e h`` for ``x < 0`` and ``1 - e h`` otherwise.

    ``h`` is ``0.5 erfcx(|x| / sqrt 2)`` as a degree-8 polynomial in ``t = 1 / (1 + 0.2275 |x|)``
    (``tools/fit_gelu_erf.py``: 3.2e-8 largest relative error for ``|x| <= 13.3``; past that ``e``
    is 0). One reciprocal and eight multiply-adds on top of the exponential the derivative's
    ``x phi(x)`` needs anyway, where libdevice's ``erf`` took about 25 instructions per element."""
    t = _rcp(1.0 + 0.2275 * tl.abs(x))
    h = -0.08640581643174418 * t + 0.33777916452683104
    h = h * t - 0.3623132796459131
    h = h * t + 0.3842278919547299
    h = h * t - 0.08278050219622743
    h = h * t + 0.137061759801604
    h = h * t + 0.08057194807434662
    h = h * t + 0.09191574415610831
    h = h * t - 5.691211351321824e-05
    e = tl.math.exp2(-0.7213475204444817 * x * x)  # -log2(e) / 2
    return e, h


@triton.jit
def _sigmoid(t):
    """``sigmoid(z)`` from ``t = -z log2(e)``: ``1 / (1 + 2^t)``, 0 where ``2^t`` overflows. Callers fold
    ``-log2(e)`` into their constants, which saves the multiply ``exp`` would add.

    The reciprocal is ``rcp.approx.ftz.f32`` (1 ulp; ``1 + 2^t >= 1``, so flushing subnormals only
    turns results below 2^-126 into 0): one instruction, where the approximate division
    ``tl.fdiv`` adds a range check, a select and three multiplies around it (4 of the fused
    gelu_tanh backward's 30.8 instructions per element; BENCHMARKS.md)."""
    return _rcp(1.0 + tl.math.exp2(t))


@triton.jit
def act_forward(x, ACTIVATION: tl.constexpr):
    """``act(x)`` for fp32 ``x``."""
    if ACTIVATION == 1:
        e, h = _gaussian_and_tail(x)
        tail = e * h
        return x * tl.where(x < 0.0, tail, 1.0 - tail)
    elif ACTIVATION == 2:
        # 0.5 (1 + tanh(u)) == sigmoid(2 u), without the cancellation for large negative x;
        # -2 u log2(e) = x (-2.302208198144325 - 0.1029432395800235 * x^2).
        return x * _sigmoid(x * (-2.302208198144325 - 0.1029432395800235 * x * x))
    elif ACTIVATION == 3:
        # NaN stays NaN, as in PyTorch (tl.maximum's default drops it on the GPU: max(NaN, 0) = 0)
        return tl.maximum(x, 0.0, propagate_nan=tl.PropagateNan.ALL)
    elif ACTIVATION == 4:
        return x * _sigmoid(-1.4426950408889634 * x)
    elif ACTIVATION == 5:
        return x * _sigmoid(-2.4554669595930156 * x)
    elif ACTIVATION == 6:
        r = tl.maximum(x, 0.0, propagate_nan=tl.PropagateNan.ALL)
        return r * r
    else:
        return x


@triton.jit
def act_derivative(x, ACTIVATION: tl.constexpr):
    """``act'(x)`` for fp32 ``x``."""
    if ACTIVATION == 1:
        # Phi(x) + x phi(x) = [x >= 0] + e (x / sqrt(2 pi) -/+ h): the one exponential serves both terms.
        e, h = _gaussian_and_tail(x)
        return tl.where(x < 0.0, 0.0, 1.0) + e * (0.3989422804014327 * x + tl.where(x < 0.0, h, -h))
    elif ACTIVATION == 2:
        # With s = sigmoid(2 u): 0.5 (1 + tanh u) = s and 0.5 (1 - tanh(u)^2) = 2 s (1 - s), so
        # act' = s + x s (1 - s) (2 du/dx), 2 du/dx = 1.5957691216057308 + 0.21406444881780076 * x^2.
        x2 = x * x
        s = _sigmoid(x * (-2.302208198144325 - 0.1029432395800235 * x2))
        return s + x * s * (1.0 - s) * (1.5957691216057308 + 0.21406444881780076 * x2)
    elif ACTIVATION == 3:
        return tl.where(x <= 0.0, 0.0, 1.0)  # 1 at NaN, as PyTorch's threshold_backward passes the gradient
    elif ACTIVATION == 4:
        s = _sigmoid(-1.4426950408889634 * x)
        return s * (1.0 + x * (1.0 - s))
    elif ACTIVATION == 5:
        s = _sigmoid(-2.4554669595930156 * x)
        return s + 1.702 * x * s * (1.0 - s)
    elif ACTIVATION == 6:
        return 2.0 * tl.maximum(x, 0.0, propagate_nan=tl.PropagateNan.ALL)  # NaN: autograd of relu(x)**2 gives NaN
    else:
        return x * 0.0 + 1.0


def activation_reference(x: torch.Tensor, name: str) -> torch.Tensor:
    """``act(x)`` in ``x``'s dtype, written out from the formulas (float64 gives the reference)."""
    activation_id(name)
    if name == "gelu":
        return 0.5 * x * (1.0 + torch.erf(x * _INV_SQRT_2))
    if name == "gelu_tanh":
        return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x**3)))
    if name == "relu":
        return torch.clamp_min(x, 0.0)
    if name == "silu":
        return x * torch.sigmoid(x)
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    return torch.clamp_min(x, 0.0) ** 2


def activation_derivative_reference(x: torch.Tensor, name: str) -> torch.Tensor:
    """``act'(x)`` in ``x``'s dtype (ReLU's derivative is 0 at 0 and 1 at NaN, as PyTorch's gradient is)."""
    activation_id(name)
    if name == "gelu":
        return 0.5 * (1.0 + torch.erf(x * _INV_SQRT_2)) + x * _INV_SQRT_2PI * torch.exp(-0.5 * x * x)
    if name == "gelu_tanh":
        t = torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x**3))
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * x * x)
    if name == "relu":
        return (~(x <= 0)).to(x.dtype)
    if name == "silu":
        s = torch.sigmoid(x)
        return s * (1.0 + x * (1.0 - s))
    if name == "quick_gelu":
        s = torch.sigmoid(1.702 * x)
        return s + 1.702 * x * s * (1.0 - s)
    return 2.0 * torch.clamp_min(x, 0.0)
